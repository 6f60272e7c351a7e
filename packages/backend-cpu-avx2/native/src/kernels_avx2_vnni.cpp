// The AVX2 kernel table compiled a second time with AVX512-VNNI and AVX512VL (vpdpbusd on 256-bit
// registers, the same integer sums as maddubs + madd, the same float operations: bit-identical results).
// Only this translation unit gets those flags; it is entered after cpu_features() found avx512vnni and
// avx512vl on the CPU (and OS). See kernels_avx2.cpp.
#define PI_KERNELS_VNNI 1
#include "kernels_avx2.cpp"
