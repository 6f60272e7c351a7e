// Element types the GPU backends hold (ggml's numbering, as on the wire) and their block layouts,
// with F16/BF16 conversions usable on the host and, through PI_HD, in kernels.
#pragma once

#include <cstdint>
#include <cstring>

#include "powerinfer/wire.h"

// Device passes convert in hardware (cvt.f32.f16 / cvt.rn.f16.f32 / cvt.rn.bf16.f32 on NVIDIA,
// v_cvt_f32_f16 / v_cvt_f16_f32 on AMD); the host and the emulator use the exact software routines
// below, which give the same values (round to nearest even; NaN payloads may differ).
#if defined(PI_GPU_CUDA) && defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#if defined(PI_GPU_CUDA) && defined(__CUDA_ARCH__)
#define PI_HW_CUDA 1
#endif
#if defined(PI_GPU_HIP) && defined(__HIP_DEVICE_COMPILE__)
#define PI_HW_HIP 1
#endif

#ifndef PI_HD
#define PI_HD
#endif

namespace pigpu {

// Dtype codes, block layouts, names and row sizes: the wire header's (shared by every native backend).
using namespace ::powerinfer::wire;

/// Weight dtypes the kernels compute with (the others stay on the CPU through supportsOp).
inline bool is_gpu_weight_dtype(int dt) {
  return dt == DT_F32 || dt == DT_F16 || dt == DT_BF16 || dt == DT_Q8_0 || dt == DT_Q4_0;
}

PI_HD inline float pi_bits_to_float(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

PI_HD inline uint32_t pi_float_to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

/// binary16 → float (exact, subnormals included).
PI_HD inline float pi_half_to_float(uint16_t h) {
#if defined(PI_HW_CUDA)
  return __half2float(__ushort_as_half(h));
#elif defined(PI_HW_HIP)
  _Float16 f;
  memcpy(&f, &h, 2);
  return static_cast<float>(f);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 31) return pi_bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return pi_bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return pi_bits_to_float(sign);
  uint32_t e = 113;  // normalise the subnormal: value = mant · 2^-24
  while (!(mant & 0x400u)) {
    mant <<= 1;
    e--;
  }
  return pi_bits_to_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
#endif
}

/// Two binary16 values packed in a 32-bit word (element 0 in the low half) → floats; one instruction
/// pair on the GPU (__half22float2).
PI_HD inline void pi_half2_to_float2(uint32_t v, float* lo, float* hi) {
#if defined(PI_HW_CUDA)
  __half2 h;
  memcpy(&h, &v, 4);
  const float2 f = __half22float2(h);
  *lo = f.x;
  *hi = f.y;
#else
  *lo = pi_half_to_float(static_cast<uint16_t>(v & 0xffffu));
  *hi = pi_half_to_float(static_cast<uint16_t>(v >> 16));
#endif
}

/// float → binary16, round to nearest even; overflow → ±Inf, NaN → quiet NaN.
PI_HD inline uint16_t pi_float_to_half(float f) {
#if defined(PI_HW_CUDA)
  return __half_as_ushort(__float2half_rn(f));
#elif defined(PI_HW_HIP)
  const _Float16 hf = static_cast<_Float16>(f);
  uint16_t h;
  memcpy(&h, &hf, 2);
  return h;
#else
  const uint32_t x = pi_float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 rounds to Inf
  if (a < 0x38800000u) {                                                  // below 2^-14: subnormal half
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);             // below 2^-25: rounds to 0
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
  return static_cast<uint16_t>(sign | (r >> 13));
#endif
}

PI_HD inline float pi_bf16_to_float(uint16_t b) {
#if defined(PI_HW_CUDA)
  return __bfloat162float(__ushort_as_bfloat16(b));
#else
  return pi_bits_to_float(static_cast<uint32_t>(b) << 16);
#endif
}

/// float → bfloat16, round to nearest even; NaN stays a quiet NaN.
PI_HD inline uint16_t pi_float_to_bf16(float f) {
#if defined(PI_HW_CUDA)
  if (f != f) return static_cast<uint16_t>((pi_float_to_bits(f) >> 16) | 0x40u);  // keep the payload rule
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t x = pi_float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#endif
}

}  // namespace pigpu
