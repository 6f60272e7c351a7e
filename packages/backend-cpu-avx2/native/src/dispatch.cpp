// Run-time choice of the kernel table (cpuid via the compiler's builtins, which also check that the
// OS saves the AVX state).
#include <cstdlib>
#include <cstring>

#include "kernels.h"

namespace pi {

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11)
  f.f16c = __builtin_cpu_supports("f16c");
#else
  f.f16c = f.avx2;  // every AVX2 CPU shipped has F16C
#endif
  f.avx512f = __builtin_cpu_supports("avx512f");
  // the VNNI table is compiled with AVX512F/VL/BW/VNNI: all four must be there
  f.avx512vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512bw") && f.avx512f;
#endif
  return f;
}

const KernelTable& select_kernels(bool force_scalar, const char** reason) {
  const char* why = "";
#if defined(PI_HAVE_AVX2_KERNELS)
  const CpuFeatures f = cpu_features();
  if (force_scalar) {
    why = "scalar (forced by forceScalar)";
  } else if (!f.avx2) {
    why = "scalar (CPU lacks AVX2)";
  } else if (!f.fma) {
    why = "scalar (CPU lacks FMA)";
  } else if (!f.f16c) {
    why = "scalar (CPU lacks F16C)";
  } else {
#if defined(PI_HAVE_VNNI_KERNELS)
    const char* off = std::getenv("POWERINFER_CPU_NO_VNNI");
    if (f.avx512vnni && !(off && *off && std::strcmp(off, "0") != 0)) {
      if (reason) *reason = "avx2+fma+f16c+avx512vnni";
      return kernels_avx2_vnni();
    }
#endif
    if (reason) *reason = "avx2+fma+f16c";
    return kernels_avx2();
  }
#else
  why = force_scalar ? "scalar (forced by forceScalar)" : "scalar (built without AVX2 kernels for this target)";
#endif
  if (reason) *reason = why;
  return kernels_scalar();
}

}  // namespace pi
