// Causal attention for a tile of up to kFaTileQ query rows in the arithmetic of llama.cpp's tiled CPU flash
// attention (ggml-cpu ops.cpp `ggml_compute_forward_flash_attn_ext_tiled`, simd-gemm.h), the path llama.cpp
// takes for a batch of at least 64 query rows with F32 or F16 K/V of one type (a prompt): the keys in tiles
// of kFaTileKV, per tile
//   KQ = Q · Kᵀ (F32; every score one chain of FMAs over the head dimension in order, K converted from F16),
//   s = KQ · scale, keys a row may not see = −inf,
//   M' = max(M, max_j s_j); where M' > M: O *= e^(M − M'), S *= e^(M − M') (expf),
//   p_j = e^(s_j − M') (`ggml_v_expf`, 8 lanes), S += Σ p_j (each 8-lane block reduced in the AVX2 build's
//   order to a float, the blocks summed in double),
//   O += P · V (F32; every output one chain of FMAs over the tile's keys in order),
// and out = O · (1/S). Unlike the one-row path (attn_ggml.h), q keeps F32 with F16 keys and the V
// accumulator is F32. A row's result depends only on the key tiling (tiles start at key 0), not on which
// rows share its tile, so any grouping of rows gives the same values.
//
// The matrix products come from a policy type P defined in each kernel translation unit (scalar, AVX2):
//   static void gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
//                    int64_t M, int64_t K, int64_t N);   // C[M×N] += A[M×K]·B[K×N], per output FMAs in k order
//   static double soft_max(int64_t n, float* y, float max); // y = ggml_v_expf(y − max), returns the sum
//   static float scale_max(int64_t n, float* y, int64_t from, int64_t to, float scale);  // y = y·scale in [from, to), −inf elsewhere; max
//   template <int KV> static void pack(int64_t hd, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride,
//                                      int64_t kv, float* Kt, int64_t ldkt, float* V32);  // kv keys as F32: Kt[d·ldkt + j], V32[j·hd + d]
// (n, N: multiples of 8).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace pi {

/// llama.cpp's GGML_FA_TILE_Q / GGML_FA_TILE_KV (ggml-cpu common.h).
constexpr int kFaTileQ = 64;
constexpr int kFaTileKV = 64;

/// Scratch floats attn_tile needs for head size hd: Q tile, scores, Kᵀ tile, V tile, accumulators.
constexpr size_t attn_tile_floats(int64_t hd) {
  return static_cast<size_t>(kFaTileQ * kFaTileKV) + 4 * static_cast<size_t>(kFaTileQ) * static_cast<size_t>(hd);
}

/// exp(x) in llama.cpp's AVX2 `ggml_v_expf` arithmetic (ops.cpp).
float expf_ggml_avx2(float x);

/// nr ≤ kFaTileQ query rows (q[r]: hd F32 values) of one head over the K/V rows `kstride`/`vstride` bytes
/// apart (KV = 1: F16, 0: F32, the same type for both), row r seeing keys [first[r], n[r]) (first null: from
/// key 0; a sliding window masks the keys before first[r], as llama.cpp's mask does); out[r]: hd floats.
/// hd must be a multiple of 8; `scratch` holds attn_tile_floats(hd) floats.
template <class P, int KV>
void attn_tile_ggml(int64_t hd, int nr, const float* const* q, const uint8_t* k, size_t kstride, const uint8_t* v,
                    size_t vstride, const int64_t* first, const int64_t* n, float scale, float* const* out,
                    float* scratch) {
  constexpr int64_t TQ = kFaTileQ, TK = kFaTileKV;
  float* Qt = scratch;           // nr × hd
  float* KQ = Qt + TQ * hd;      // nr × TK
  float* Kt = KQ + TQ * TK;      // hd × TK (transposed: a key per column)
  float* V32 = Kt + hd * TK;     // TK × hd
  float* O = V32 + TK * hd;      // nr × hd
  float S[kFaTileQ], M[kFaTileQ];
  int64_t nmax = 0;
  for (int r = 0; r < nr; r++) {
    std::memcpy(Qt + r * hd, q[r], sizeof(float) * static_cast<size_t>(hd));
    S[r] = 0.0f;
    M[r] = -INFINITY;
    if (n[r] > nmax) nmax = n[r];
  }
  std::memset(O, 0, sizeof(float) * static_cast<size_t>(nr * hd));
  // tiles no row sees are skipped (every row's P would be zero there)
  int64_t jmin = nmax;
  for (int r = 0; r < nr; r++) jmin = first == nullptr ? 0 : (first[r] < jmin ? first[r] : jmin);
  for (int64_t j0 = jmin / TK * TK; j0 < nmax; j0 += TK) {
    const int64_t kv = nmax - j0 < TK ? nmax - j0 : TK;
    P::template pack<KV>(hd, k + static_cast<size_t>(j0) * kstride, kstride, v + static_cast<size_t>(j0) * vstride,
                         vstride, kv, Kt, TK, V32);
    if (kv < TK) {
      for (int64_t d = 0; d < hd; d++) std::memset(Kt + d * TK + kv, 0, sizeof(float) * static_cast<size_t>(TK - kv));
      std::memset(V32 + kv * hd, 0, sizeof(float) * static_cast<size_t>((TK - kv) * hd));
    }
    std::memset(KQ, 0, sizeof(float) * static_cast<size_t>(nr * TK));
    P::gemm(KQ, TK, Qt, hd, Kt, TK, nr, hd, TK);
    for (int r = 0; r < nr; r++) {
      float* row = KQ + r * TK;
      // the tile's keys this row sees: [from, to)
      const int64_t from = first == nullptr || first[r] <= j0 ? 0 : (first[r] - j0 < TK ? first[r] - j0 : TK);
      const int64_t to = n[r] - j0 < 0 ? 0 : (n[r] - j0 < TK ? n[r] - j0 : TK);
      if (to <= from) {
        // every key of the tile masked for this row: it adds nothing (P row of zeros)
        std::memset(row, 0, sizeof(float) * TK);
        continue;
      }
      const float tmax = P::scale_max(TK, row, from, to, scale);
      if (tmax == -INFINITY) {
        std::memset(row, 0, sizeof(float) * TK);
        continue;
      }
      const float Mnew = std::fmax(M[r], tmax);
      if (Mnew > M[r]) {
        const float ms = std::exp(M[r] - Mnew);
        float* o = O + r * hd;
        for (int64_t d = 0; d < hd; d++) o[d] *= ms;
        S[r] *= ms;
      }
      M[r] = Mnew;
      S[r] = static_cast<float>(static_cast<double>(S[r]) + P::soft_max(TK, row, Mnew));
    }
    P::gemm(O, hd, KQ, TK, V32, hd, nr, TK, hd);
  }
  for (int r = 0; r < nr; r++) {
    const float inv = S[r] == 0.0f ? 0.0f : 1.0f / S[r];
    const float* o = O + r * hd;
    for (int64_t d = 0; d < hd; d++) out[r][d] = o[d] * inv;
  }
}

}  // namespace pi
