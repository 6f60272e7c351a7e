// One query row of attention in the arithmetic of llama.cpp's CPU flash attention (ggml-cpu ops.cpp,
// `flash_attn_ext`, one row at a time): online softmax with a running maximum, expf, and the V
// accumulator kept in the cache's type (F16: rounded to nearest even after every key, as ggml's VKQ16).
// Models whose activations are quantized to Q8_0 blocks (Q8_0/Q4_0 weights) amplify last-bit
// differences of the attention output into different int8 roundings, so matching llama.cpp's logits on
// those files needs its exact order of operations here, not just an accurate softmax.
//
// The primitives come from a policy type P defined in each kernel translation unit (scalar, AVX2), so
// every instantiation is local to its unit (no inline function compiled with AVX2 flags leaks into
// the scalar table). P provides:
//   template <int KI> static float dot(int64_t n, const uint8_t* k, const float* q);   // ggml_vec_dot_f32/_f16
//   static void scale_f32(int64_t n, float* y, float a);        // y *= a
//   static void scale_f16(int64_t n, uint16_t* y, float a);     // y = f16(f32(y) · a)
//   static void mad_f32(int64_t n, float* y, const float* x, float a);        // y += x · a
//   static void mad_f16(int64_t n, uint16_t* y, const uint16_t* x, float a);  // y = f16(f32(y) + f32(x) · a)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

#ifndef PI_GGML_CONTRACT
#define PI_GGML_CONTRACT 1
#endif

namespace pi {

/// Whether ggml's scalar tails (`y[i] = y[i] + x[i]*v`, `S = S*ms + vs`) are contracted into one FMA,
/// as GCC and clang do for ggml's builds (-ffp-contract=fast/on); measured against llama.cpp's logits.
constexpr bool kGgmlContract = PI_GGML_CONTRACT;

template <class P, int KI, int VI>
void attn_row_ggml(int64_t hd, const float* q, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride,
                   int64_t n, float scale, float* out, void* acc) {
  uint16_t* a16 = static_cast<uint16_t*>(acc);
  float* a32 = VI ? out : static_cast<float*>(acc);
  if (VI) {
    std::memset(a16, 0, sizeof(uint16_t) * static_cast<size_t>(hd));
  } else {
    std::memset(a32, 0, sizeof(float) * static_cast<size_t>(hd));
  }
  float S = 0.0f, M = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    const float s = P::template dot<KI>(hd, k + static_cast<size_t>(j) * kstride, q) * scale;
    const float Mold = M;
    float ms = 1.0f, vs = 1.0f;
    if (s > M) {
      M = s;
      ms = std::exp(Mold - M);
      if (VI) {
        P::scale_f16(hd, a16, ms);
      } else {
        P::scale_f32(hd, a32, ms);
      }
    } else {
      // expf(x) rounds to +0 for x < −104 (e^−104 ≈ 6.8e−46 is below half the smallest subnormal); taking 0
      // there skips libm's underflow path (errno), which far-away keys of a long context otherwise hit
      vs = s - M < -104.0f ? 0.0f : std::exp(s - M);
    }
    const uint8_t* vr = v + static_cast<size_t>(j) * vstride;
    if (VI) {
      P::mad_f16(hd, a16, reinterpret_cast<const uint16_t*>(vr), vs);
    } else {
      P::mad_f32(hd, a32, reinterpret_cast<const float*>(vr), vs);
    }
    S = kGgmlContract ? std::fma(S, ms, vs) : S * ms + vs;
  }
  if (VI) {
    for (int64_t d = 0; d < hd; d++) a32[d] = f16_to_f32(a16[d]);
  }
  const float inv = S == 0.0f ? 0.0f : 1.0f / S;
  for (int64_t d = 0; d < hd; d++) out[d] = a32[d] * inv;
}

}  // namespace pi
