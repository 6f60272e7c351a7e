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

/// Keys [j0, j1) of one query row: s = scale · dot(k_j, q), online softmax (running max M, sum S), V rows
/// accumulated into `acc` (hd uint16 for F16 V, hd floats for F32 V). The row's state between calls is
/// (S, M, acc): a row's keys taken in several calls get exactly the operations of one call.
template <class P, int KI, int VI>
inline void attn_keys_ggml(int64_t hd, const float* q, const uint8_t* k, size_t kstride, const uint8_t* v,
                           size_t vstride, int64_t j0, int64_t j1, float scale, void* acc, float& S, float& M) {
  uint16_t* a16 = static_cast<uint16_t*>(acc);
  float* a32 = static_cast<float*>(acc);
  for (int64_t j = j0; j < j1; j++) {
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
}

/// out = acc / S (acc converted from F16 first for F16 V); out may not alias acc.
template <int VI>
inline void attn_finish_ggml(int64_t hd, float S, const void* acc, float* out) {
  if (VI) {
    const uint16_t* a16 = static_cast<const uint16_t*>(acc);
    for (int64_t d = 0; d < hd; d++) out[d] = f16_to_f32(a16[d]);
  } else {
    std::memcpy(out, acc, sizeof(float) * static_cast<size_t>(hd));
  }
  const float inv = S == 0.0f ? 0.0f : 1.0f / S;
  for (int64_t d = 0; d < hd; d++) out[d] = out[d] * inv;
}

template <class P, int KI, int VI>
void attn_row_ggml(int64_t hd, const float* q, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride,
                   int64_t n, float scale, float* out, void* acc) {
  std::memset(acc, 0, (VI ? sizeof(uint16_t) : sizeof(float)) * static_cast<size_t>(hd));
  float S = 0.0f, M = -INFINITY;
  attn_keys_ggml<P, KI, VI>(hd, q, k, kstride, v, vstride, 0, n, scale, acc, S, M);
  attn_finish_ggml<VI>(hd, S, acc, out);
}

/// Up to kAttnTileRows query rows over the same K/V rows (one KV head; row r sees keys [0, n[r])): the keys
/// in blocks of kAttnKeyBlock, each block taken by every row in turn while it is in cache. Every row gets the
/// operations of attn_row_ggml in the same order (bit-identical); `acc` holds nr · hd floats.
constexpr int kAttnTileRows = 8;
constexpr int64_t kAttnKeyBlock = 32;

template <class P, int KI, int VI>
void attn_rows_ggml(int64_t hd, int nr, const float* const* q, const uint8_t* k, size_t kstride, const uint8_t* v,
                    size_t vstride, const int64_t* n, float scale, float* const* out, void* acc) {
  float S[kAttnTileRows], M[kAttnTileRows];
  int64_t nmax = 0;
  const size_t abytes = (VI ? sizeof(uint16_t) : sizeof(float)) * static_cast<size_t>(hd);
  auto acc_of = [&](int r) { return static_cast<uint8_t*>(acc) + static_cast<size_t>(r) * sizeof(float) * static_cast<size_t>(hd); };
  for (int r = 0; r < nr; r++) {
    std::memset(acc_of(r), 0, abytes);
    S[r] = 0.0f;
    M[r] = -INFINITY;
    if (n[r] > nmax) nmax = n[r];
  }
  for (int64_t j0 = 0; j0 < nmax; j0 += kAttnKeyBlock) {
    for (int r = 0; r < nr; r++) {
      const int64_t j1 = j0 + kAttnKeyBlock < n[r] ? j0 + kAttnKeyBlock : n[r];
      if (j0 < j1) attn_keys_ggml<P, KI, VI>(hd, q[r], k, kstride, v, vstride, j0, j1, scale, acc_of(r), S[r], M[r]);
    }
  }
  for (int r = 0; r < nr; r++) attn_finish_ggml<VI>(hd, S[r], acc_of(r), out[r]);
}

}  // namespace pi
