// The AVX2 kernel table compiled a second time with AVX512F/VL/BW/VNNI (vpdpbusd on 256-bit registers, the
// same integer sums as maddubs + madd, the same float operations: bit-identical results; and 32 vector
// registers for wider GEMM tiles). Only this translation unit gets those flags; it is entered after
// cpu_features() found all four on the CPU (and OS). See kernels_avx2.cpp.
#define PI_KERNELS_VNNI 1
#include "kernels_avx2.cpp"
