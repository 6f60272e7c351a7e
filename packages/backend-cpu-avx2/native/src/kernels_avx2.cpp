// AVX2 + FMA + F16C kernels. This translation unit alone is compiled with -mavx2 -mfma -mf16c; it is
// only entered after cpu_features() confirmed the CPU (and OS) support them. kernels_avx2_vnni.cpp
// compiles it again with AVX512-VNNI + AVX512VL (PI_KERNELS_VNNI): the byte dot products become vpdpbusd
// on the same 256-bit registers, with the same integers and the same float operations, so both tables
// give bit-identical results. It uses no templates or
// inline functions from the standard library (an out-of-line copy compiled here could be picked by the
// linker for a scalar caller); every helper has internal linkage.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "attn_ggml.h"
#include "attn_tiled.h"
#include "kernels.h"

namespace pi {
namespace {

inline float hsum_ps(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

/// Σ over byte pairs of signed x · signed y, as 8 int32 lanes (x may be −128; y must not be). Each lane
/// is the exact sum of 4 consecutive byte products: maddubs cannot saturate here (|x| ≤ 128, |y| ≤ 127),
/// so the VNNI form (one vpdpbusd) gives the same integers.
inline __m256i dot_i8_i32(__m256i x, __m256i y) {
  const __m256i ax = _mm256_sign_epi8(x, x);
  const __m256i sy = _mm256_sign_epi8(y, x);
#if defined(PI_KERNELS_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
#endif
}

/// Σ over byte pairs of unsigned x · signed y (x ≤ 63), as 8 int32 lanes (exact, as dot_i8_i32).
inline __m256i dot_u8_i32(__m256i ux, __m256i y) {
#if defined(PI_KERNELS_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, y);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ux, y), _mm256_set1_epi16(1));
#endif
}

/// 16 packed nibble bytes → 32 bytes: low nibbles in bytes 0..15, high nibbles in 16..31.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/// Bit j of x → byte j = 0xFF when set, 0 otherwise (j = 0..31).
inline __m256i bits_to_bytes(uint32_t x) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                          0x0303030303030303LL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/// F16 → F32 with the F16C instruction (exact, like the scalar f16_to_f32).
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// ---- F32 / F16 / BF16 -----------------------------------------------------------------------

inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_bf16(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/// Float weight rows: KIND 0 = F32, 1 = F16, 2 = BF16 (x holds F32 values, rounded to the weight
/// type by the activation conversion, so only the weights are converted).
template <int KIND>
inline __m256 wload(const uint8_t* w, int64_t i) {
  if (KIND == 0) return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + i);
  if (KIND == 1) return load_f16(reinterpret_cast<const uint16_t*>(w) + i);
  return load_bf16(reinterpret_cast<const uint16_t*>(w) + i);
}

template <int KIND>
inline float welem(const uint8_t* w, int64_t i) {
  if (KIND == 0) return reinterpret_cast<const float*>(w)[i];
  if (KIND == 1) return h2f(reinterpret_cast<const uint16_t*>(w)[i]);
  return bf16_to_f32(reinterpret_cast<const uint16_t*>(w)[i]);
}

/// ggml's reduction of four 8-lane accumulators (GGML_F32x8_REDUCE): a0 += a2, a1 += a3, a0 += a1, then
/// the two 128-bit halves added and two horizontal adds: ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)).
inline float ggml_hsum8(__m256 a) {
  const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t1 = _mm_hadd_ps(t0, t0);
  return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}
inline float ggml_reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  a0 = _mm256_add_ps(a0, a2);
  a1 = _mm256_add_ps(a1, a3);
  return ggml_hsum8(_mm256_add_ps(a0, a1));
}

/// The elements past the last 32-element step, after the vector part's reduction `red` (llama.cpp's tails:
/// F32 each product rounded then added in float; F16/BF16 products added in double).
template <int KIND>
inline float float_dot_tail(float red, const uint8_t* w, const float* x, int64_t i, int64_t k) {
  if (KIND == 0) {
    float s = red;
    for (int64_t j = i; j < k; j++) s += welem<KIND>(w, j) * x[j];
    return s;
  }
  double s = red;
  for (int64_t j = i; j < k; j++) s += static_cast<double>(welem<KIND>(w, j) * x[j]);
  return static_cast<float>(s);
}

/// NR × NC dot products of float rows. Every tile shape performs exactly the same operations per output,
/// so a 2×2 tile (matrix × matrix) and a 1×1 tile (matrix × vector, sparse rows) give bit-identical results.
/// F32 and F16 weights follow llama.cpp's matrix × vector (`ggml_vec_dot_f32` / `ggml_vec_dot_f16` on
/// AVX2: four accumulators over 32-element steps, {@link ggml_reduce4}, then the tail — F32: each product
/// rounded, then added to the float sum (no FMA: checked bit for bit against llama.cpp's ffn_down with
/// n_ff = 172); F16: products added in double); its decode steps
/// then give the same floats as llama.cpp's. BF16 as `ggml_vec_dot_bf16`: the same four accumulators
/// (its products are exact, so its mul + add equals the FMA), summed (c1 + c3) + (c2 + c4), hsum_ps, then
/// the tail's products added in double (checked against llama.cpp's BF16 ffn_out, n_ff = 172).
/// Prefetch distance of float rows in matrix × vector tiles (bytes ahead of the step being read): 1 KiB
/// measured best on the 2-vCPU Xeon (F16 7B slice decode 19.6 → 23.8 t/s dense, 42.4 → 48.8 sparse; 512
/// and 2048 were no better).
constexpr int kFloatPrefetch = 1024;
#if defined(PI_KERNELS_VNNI)
/// F32/F16 rows on AVX-512: the same four 8-lane accumulators held as two 16-lane ones (lanes 0–7 of the
/// first = accumulator 0, lanes 8–15 = accumulator 1; the second holds 2 and 3), each FMA the same per lane,
/// and ggml_reduce4's first two adds done as one 16-lane add: bit-identical to the 256-bit tile with half
/// the instructions (one 16-element conversion and FMA per 32 bytes of F16 weights instead of two).
template <int KIND>
inline __m512 wload16(const uint8_t* w, int64_t i) {
  if (KIND == 0) return _mm512_loadu_ps(reinterpret_cast<const float*>(w) + i);
  // the zero-masked form: GCC 12's unmasked intrinsic warns (-Wmaybe-uninitialized, in its header)
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(w) + i)));
}

template <int KIND, int NR, int NC>
void dot_tile_float512(int64_t k, const uint8_t* const* w, const float* const* x, float* out) {
  __m512 a[NR][NC][2];
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) a[r][c][0] = a[r][c][1] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  constexpr int esize = KIND == 0 ? 4 : 2;
  for (; i + 32 <= k; i += 32) {
    if (NC == 1 && NR > 1) {
      for (int r = 0; r < NR; r++) __builtin_prefetch(w[r] + i * esize + kFloatPrefetch, 0, 3);
    }
    for (int j = 0; j < 2; j++) {
      __m512 wj[NR];
      for (int r = 0; r < NR; r++) wj[r] = wload16<KIND>(w[r], i + 16 * j);
      for (int c = 0; c < NC; c++) {
        const __m512 xj = _mm512_loadu_ps(x[c] + i + 16 * j);
        for (int r = 0; r < NR; r++) a[r][c][j] = _mm512_fmadd_ps(wj[r], xj, a[r][c][j]);
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) {
      // (a0 + a2 | a1 + a3), then a0 + a1 and ggml_reduce4's 128-bit steps
      const __m512 s = _mm512_add_ps(a[r][c][0], a[r][c][1]);
      // the halves through memory: GCC 12's 512→256-bit extract intrinsics warn (-Wuninitialized, in its header)
      alignas(64) float h[16];
      _mm512_store_ps(h, s);
      const float red = ggml_hsum8(_mm256_add_ps(_mm256_load_ps(h), _mm256_load_ps(h + 8)));
      out[r * NC + c] = float_dot_tail<KIND>(red, w[r], x[c], i, k);
    }
  }
}
#endif

template <int KIND, int NR, int NC>
void dot_tile_float(int64_t k, const uint8_t* const* w, const uint8_t* const* xv, float* out) {
  const float* x[NC];
  for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const float*>(xv[c]);
#if defined(PI_KERNELS_VNNI)
  if constexpr (KIND != 2) {
    dot_tile_float512<KIND, NR, NC>(k, w, x, out);
    return;
  }
#endif
  __m256 a[NR][NC][4];
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) {
      for (int j = 0; j < 4; j++) a[r][c][j] = _mm256_setzero_ps();
    }
  }
  int64_t i = 0;
  constexpr int esize = KIND == 0 ? 4 : 2;
  for (; i + 32 <= k; i += 32) {
    if (NC == 1 && NR > 1) {
      // matrix × vector: each row a stream, asked for kFloatPrefetch bytes ahead (the hardware prefetcher
      // ramps up slowly on several short streams)
      for (int r = 0; r < NR; r++) __builtin_prefetch(w[r] + i * esize + kFloatPrefetch, 0, 3);
    }
    for (int j = 0; j < 4; j++) {
      __m256 wj[NR];
      for (int r = 0; r < NR; r++) wj[r] = wload<KIND>(w[r], i + 8 * j);
      for (int c = 0; c < NC; c++) {
        const __m256 xj = _mm256_loadu_ps(x[c] + i + 8 * j);
        for (int r = 0; r < NR; r++) a[r][c][j] = _mm256_fmadd_ps(wj[r], xj, a[r][c][j]);
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) {
      // BF16: ggml_vec_dot_bf16 sums its four accumulators as (c1 + c3) + (c2 + c4), then hsum_ps
      const float red =
          KIND == 2 ? hsum_ps(_mm256_add_ps(_mm256_add_ps(a[r][c][0], a[r][c][2]), _mm256_add_ps(a[r][c][1], a[r][c][3])))
                    : ggml_reduce4(a[r][c][0], a[r][c][1], a[r][c][2], a[r][c][3]);
      out[r * NC + c] = float_dot_tail<KIND>(red, w[r], x[c], i, k);
    }
  }
}

template <int KIND>
void dot_tile_f(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
#if defined(PI_KERNELS_VNNI)
  // 512-bit F32/F16 tiles: 4 rows × 3 columns in 24 of the 32 registers (a batch of sparse rows)
  if constexpr (KIND != 2) {
    if (nr == 4 && nc == 3) return dot_tile_float<KIND, 4, 3>(k, w, x, out);
  }
#endif
  if (nr > 2 && nc > 1) {
    // rows one or two at a time (the shapes below), each written at its place in out
    for (int r = 0; r < nr; r += 2) {
      const int m = nr - r < 2 ? nr - r : 2;
      float o[2 * 16];
      for (int c = 0; c < nc; c += 16) {
        const int mc = nc - c < 16 ? nc - c : 16;
        dot_tile_f<KIND>(k, m, mc, w + r, x + c, o);
        for (int i = 0; i < m; i++) {
          for (int j = 0; j < mc; j++) out[(r + i) * nc + c + j] = o[i * mc + j];
        }
      }
    }
    return;
  }
  if (nr == 2 && nc > 2) {
    for (int i = 0; i < 2; i++) dot_tile_f<KIND>(k, 1, nc, w + i, x, out + i * nc);
    return;
  }
  if (nr > 4) {  // one column
    for (int r = 0; r < nr; r += 4) dot_tile_f<KIND>(k, nr - r < 4 ? nr - r : 4, 1, w + r, x, out + r);
    return;
  }
  if (nc == 1 && nr == 4) {
    dot_tile_float<KIND, 4, 1>(k, w, x, out);
  } else if (nc == 1 && nr == 3) {
    dot_tile_float<KIND, 3, 1>(k, w, x, out);
  } else if (nr == 2 && nc == 2) {
    dot_tile_float<KIND, 2, 2>(k, w, x, out);
  } else if (nr == 2) {
    dot_tile_float<KIND, 2, 1>(k, w, x, out);
  } else if (nc == 2) {
    dot_tile_float<KIND, 1, 2>(k, w, x, out);
  } else if (nr == 1 && nc > 2) {
    for (int c = 0; c < nc; c += 2) dot_tile_f<KIND>(k, 1, nc - c < 2 ? nc - c : 2, w, x + c, out + c);
  } else {
    dot_tile_float<KIND, 1, 1>(k, w, x, out);
  }
}

/// NR × NC outputs in llama.cpp's prompt GEMM arithmetic (llamafile tinyBLAS<8, __m256>: `gemm_bloc`):
/// each output one accumulator, acc = fma(w[i..i+8), x[i..i+8), acc) for i = 0, 8, …, then hsum_ps (the
/// same reduction as tinyBLAS's hsum). k must be a multiple of 8. Up to 4 × 3 outputs (tinyBLAS's AVX2
/// tile): 12 independent FMA chains cover the FMA latency; the NC activation vectors of a step are
/// loaded once, each weight vector once (converted once) and used for its NC outputs; 12 accumulators
/// + 3 activations + 1 weight = the 16 ymm registers.
template <int KIND, int NR, int NC>
void gemm_tile_float(int64_t k, const uint8_t* const* w, const uint8_t* const* xv, float* out) {
  const float* x[NC];
  for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const float*>(xv[c]);
  __m256 a[NR][NC];
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) a[r][c] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i + 8 <= k; i += 8) {
    __m256 xc[NC];
    for (int c = 0; c < NC; c++) xc[c] = _mm256_loadu_ps(x[c] + i);
    for (int r = 0; r < NR; r++) {
      const __m256 wv = wload<KIND>(w[r], i);
      for (int c = 0; c < NC; c++) a[r][c] = _mm256_fmadd_ps(wv, xc[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) out[r * NC + c] = hsum_ps(a[r][c]);
  }
}

#if defined(PI_KERNELS_VNNI)
/// 8 elements of a float weight row, converted, in both 256-bit halves of a 512-bit register.
template <int KIND>
inline __m512 wload8x2(const uint8_t* w, int64_t i) {
  if (KIND == 1) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(w) + i));
    return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_broadcastsi128_si256(h));
  }
  const __m256d v = _mm256_castps_pd(wload<KIND>(w, i));
  return _mm512_castpd_ps(_mm512_maskz_insertf64x4(0xFF, _mm512_castpd256_pd512(v), v, 1));
}

/// x[i..i+8) of two activation rows: a in the low 256-bit half, b in the high one.
inline __m512 xload8x2(const float* a, const float* b, int64_t i) {
  const __m256d lo = _mm256_castps_pd(_mm256_loadu_ps(a + i)), hi = _mm256_castps_pd(_mm256_loadu_ps(b + i));
  // the zero-masked form: GCC 12's unmasked intrinsic warns (-Wmaybe-uninitialized, in its header)
  return _mm512_castpd_ps(_mm512_maskz_insertf64x4(0xFF, _mm512_castpd256_pd512(lo), hi, 1));
}

/// gemm_tile_float on 512-bit registers: each register holds two outputs of one weight row (columns 2p
/// and 2p + 1, one per 256-bit half), each half the same 8-lane FMA chain as the 256-bit tile and the
/// same hsum_ps at the end, so every output is bit-identical to it, with half the FMA instructions. Up
/// to 4 rows × 12 columns: 24 accumulators + 6 activation pairs + a weight = 31 of the 32 registers. An odd
/// column count computes its last column twice (the copy is dropped).
///
/// PAIRS: the activations interleaved by column pairs (KernelTable::gemm_tile_pairs), x[p] the pair's 16-float
/// steps: the pair's register is one load. Same FMAs on the same lane values, so the same outputs bit for bit.
template <int KIND, int NR, int NC, bool PAIRS = false>
void gemm_tile_float512(int64_t k, const uint8_t* const* w, const float* const* x, float* out) {
  constexpr int NP = (NC + 1) / 2;
  __m512 a[NR][NP];
  for (int r = 0; r < NR; r++) {
    for (int p = 0; p < NP; p++) a[r][p] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i + 8 <= k; i += 8) {
    __m512 xc[NP];
    for (int p = 0; p < NP; p++) {
      xc[p] = PAIRS ? _mm512_loadu_ps(x[p] + 2 * i) : xload8x2(x[2 * p], x[2 * p + 1 < NC ? 2 * p + 1 : 2 * p], i);
    }
    for (int r = 0; r < NR; r++) {
      const __m512 wv = wload8x2<KIND>(w[r], i);
      for (int p = 0; p < NP; p++) a[r][p] = _mm512_fmadd_ps(wv, xc[p], a[r][p]);
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int p = 0; p < NP; p++) {
      // the halves through memory (see dot_tile_float512)
      alignas(64) float h[16];
      _mm512_store_ps(h, a[r][p]);
      out[r * NC + 2 * p] = hsum_ps(_mm256_load_ps(h));
      if (2 * p + 1 < NC) out[r * NC + 2 * p + 1] = hsum_ps(_mm256_load_ps(h + 8));
    }
  }
}

/// Columns of the widest GEMM register tile. With AVX512VL the compiler has 32 vector registers (ymm16–31
/// through EVEX encodings): Q8_0 takes 4 × 6 tiles, 24 accumulators + 6 activations + a weight, so each
/// weight vector serves 6 FMAs instead of 3; float weights take 4 × 12 on 512-bit registers
/// (gemm_tile_float512). The per-output arithmetic is the same 8-lane chain in every tile.
constexpr int kGemmColsQ8 = 6;
constexpr int kGemmColsFloat = 12;
#else
constexpr int kGemmColsQ8 = 3;  ///< AVX2: 16 registers, 4 × 3 tiles (tinyBLAS's AVX2 tile)
constexpr int kGemmColsFloat = 3;
#endif
constexpr int kGemmCols = kGemmColsFloat > kGemmColsQ8 ? kGemmColsFloat : kGemmColsQ8;

template <template <int, int> class F, int COLS, size_t I>
constexpr DotTileFn gemm_shape_fn() {
  return F<static_cast<int>(I) / COLS + 1, static_cast<int>(I) % COLS + 1>::run;
}
template <template <int, int> class F, int COLS, size_t... I>
constexpr std::array<DotTileFn, sizeof...(I)> gemm_shape_table(std::index_sequence<I...>) {
  return {gemm_shape_fn<F, COLS, I>()...};
}

/// A tile kernel for every shape 1–4 rows × 1–COLS columns, index (nr − 1) · COLS + (nc − 1).
template <template <int, int> class F, int COLS>
struct GemmShapes {
  static constexpr std::array<DotTileFn, 4 * COLS> fns = gemm_shape_table<F, COLS>(std::make_index_sequence<4 * COLS>());
  /// nr ≤ 4 rows × nc ≤ COLS columns; larger shapes in 4 × COLS pieces.
  static void tile(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
    if (nr <= 0 || nc <= 0) return;
    if (nr <= 4 && nc <= COLS) return fns[static_cast<size_t>((nr - 1) * COLS + (nc - 1))](k, nr, nc, w, x, out);
    for (int r = 0; r < nr; r += 4) {
      const int mr = nr - r < 4 ? nr - r : 4;
      for (int c = 0; c < nc; c += COLS) {
        const int mc = nc - c < COLS ? nc - c : COLS;
        float o[4 * COLS];
        fns[static_cast<size_t>((mr - 1) * COLS + (mc - 1))](k, mr, mc, w + r, x + c, o);
        for (int i = 0; i < mr; i++) {
          for (int j = 0; j < mc; j++) out[(r + i) * nc + c + j] = o[i * mc + j];
        }
      }
    }
  }
};

template <int KIND>
struct GemmFloat {
  template <int NR, int NC>
  struct S {
    static void run(int64_t k, int, int, const uint8_t* const* w, const uint8_t* const* xv, float* out) {
#if defined(PI_KERNELS_VNNI)
      const float* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const float*>(xv[c]);
      gemm_tile_float512<KIND, NR, NC>(k, w, x, out);
#else
      gemm_tile_float<KIND, NR, NC>(k, w, xv, out);
#endif
    }
  };
};

template <int KIND>
void gemm_tile_f(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  GemmShapes<GemmFloat<KIND>::template S, kGemmColsFloat>::tile(k, nr, nc, w, x, out);
}

#if defined(PI_KERNELS_VNNI)
template <int KIND>
struct GemmFloatPairs {
  template <int NR, int NC>
  struct S {
    static void run(int64_t k, int, int, const uint8_t* const* w, const uint8_t* const* xv, float* out) {
      const float* x[(NC + 1) / 2];
      for (int p = 0; p < (NC + 1) / 2; p++) x[p] = reinterpret_cast<const float*>(xv[p]);
      gemm_tile_float512<KIND, NR, NC, true>(k, w, x, out);
    }
  };
};

/// KernelTable::gemm_tile_pairs: nr ≤ 4 rows × nc ≤ 12 columns in one register tile.
template <int KIND>
void gemm_tile_pairs_f(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  static_assert(kGemmColsFloat == 12, "the pair tiles take up to 12 columns");
  if (nr <= 0 || nc <= 0 || nr > 4 || nc > 12) return;
  GemmShapes<GemmFloatPairs<KIND>::template S, 12>::fns[static_cast<size_t>((nr - 1) * 12 + (nc - 1))](k, nr, nc, w, x, out);
}
#endif

template <int KIND>
float dot_f(int64_t k, const void* w, const void* x) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  const uint8_t* xp = static_cast<const uint8_t*>(x);
  float out;
  dot_tile_float<KIND, 1, 1>(k, &wp, &xp, &out);
  return out;
}

float dot_f32v(int64_t n, const float* a, const float* b) { return dot_f<0>(n, a, b); }

/// Quantized types: no shared work between outputs yet, so a tile is a loop over the dot.
template <int DT>
void dot_tile_loop(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out);

// ---- legacy quants (x in Q8_0 / Q8_1) -------------------------------------------------------

/// NR (1–4) rows of Q8_0 against one activation row, interleaved block by block: several rows are read
/// as concurrent streams (more memory-level parallelism than one row after another) and share the
/// activation loads. Each row's arithmetic is the same whatever NR: llama.cpp's AVX2
/// `ggml_vec_dot_q8_0_q8_0` (one accumulator, acc = fma(d_w·d_x, Σ bytes, acc) block after block, then
/// hsum: checked against llama.cpp's result_output).
template <int NR>
void dot_rows_q8_0(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out) {
  const XBlockQ8* b = reinterpret_cast<const XBlockQ8*>(x);
  const int64_t nb = k / QK;
  __m256 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; i++) {
    // several rows: each a stream, asked for kFloatPrefetch bytes ahead, one line per two 34-byte blocks
    if (NR > 1 && i % 2 == 0) {
      for (int r = 0; r < NR; r++) __builtin_prefetch(w[r] + i * sizeof(BlockQ8_0) + kFloatPrefetch, 0, 3);
    }
    const __m256i x0 = loadu256(b[i].qs);
#if defined(PI_KERNELS_VNNI)
    // as gemm_tile_q8_0_t: vpdpbusd(−128·Σx, w + 128, x), the correction shared by the rows
    const __m256i neg =
        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(static_cast<char>(0x80)), x0));
#endif
    for (int r = 0; r < NR; r++) {
      const BlockQ8_0* a = reinterpret_cast<const BlockQ8_0*>(w[r]);
#if defined(PI_KERNELS_VNNI)
      const __m256i p0 = _mm256_dpbusd_epi32(neg, _mm256_xor_si256(loadu256(a[i].qs), _mm256_set1_epi8(static_cast<char>(0x80))), x0);
#else
      const __m256i p0 = dot_i8_i32(loadu256(a[i].qs), x0);
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(a[i].d) * b[i].d), _mm256_cvtepi32_ps(p0), acc[r]);
    }
  }
  for (int r = 0; r < NR; r++) out[r] = hsum_ps(acc[r]);
}

/// N (1–4) Q4_0 dot products of (weight row, activation row) pairs, in the Q4_0 arithmetic
/// (KernelTable::packed_tile): per block, each pair's exact integer Σ(q − 8)·x (Σq·x − 8·Σx), then
/// acc = fma(float(that), d_w·d_x, acc). The pairs' integer sums are gathered into one vector (horizontal
/// adds) so that the scale arithmetic runs on 4 lanes at once. Pairs: 4 rows × one token (matrix × vector),
/// or with ONE_ROW one row × N tokens (a sparse row in a batch: its nibbles are unpacked once per block).
template <int N, bool ONE_ROW = false>
void dot_pairs_q4_0(int64_t k, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  const int64_t nb = k / QK;
  const BlockQ4_0* a[4];
  const XBlockQ8* b[4];
  for (int j = 0; j < 4; j++) {
    a[j] = reinterpret_cast<const BlockQ4_0*>(w[j < N && !ONE_ROW ? j : 0]);
    b[j] = reinterpret_cast<const XBlockQ8*>(x[j < N ? j : 0]);
  }
  if (N == 1) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
      const int s = hsum_epi32(dot_u8_i32(unpack_nibbles(a[0][i].qs), loadu256(b[0][i].qs))) - 8 * b[0][i].sum;
      acc = __builtin_fmaf(static_cast<float>(s), h2f(a[0][i].d) * b[0][i].d, acc);
    }
    out[0] = acc;
    return;
  }
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; i++) {
    __m256i u[4];
    u[0] = unpack_nibbles(a[0][i].qs);
    for (int j = 1; j < N; j++) u[j] = ONE_ROW ? u[0] : unpack_nibbles(a[j][i].qs);
    __m256i p[4];
    for (int j = 0; j < 4; j++) p[j] = j < N ? dot_u8_i32(u[j], loadu256(b[j][i].qs)) : _mm256_setzero_si256();
    // lane j of the result: Σ of pair j's 8 lanes
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s = _mm_sub_epi32(s, _mm_setr_epi32(8 * b[0][i].sum, 8 * b[1][i].sum, 8 * b[2][i].sum, 8 * b[3][i].sum));
    const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(a[0][i].d), static_cast<short>(a[1][i].d),
                                                  static_cast<short>(a[2][i].d), static_cast<short>(a[3][i].d), 0, 0, 0, 0));
    const __m128 dx = _mm_setr_ps(b[0][i].d, b[1][i].d, b[2][i].d, b[3][i].d);
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, dx), acc);
  }
  float o[4];
  _mm_storeu_ps(o, acc);
  for (int j = 0; j < N; j++) out[j] = o[j];
}

/// Fetches the next N rows of a sparse op (rows at any addresses, each `rb` bytes) into cache while a kernel
/// computes the current ones, spread over the kernel's nb block iterations at the rate it reads its own rows:
/// after iteration i, (i + 1)/nb of the next rows' cache lines are asked for, line by line across the rows
/// (every row's head first). A scattered row (Q4_0: 2.3 KB at n_embd 4096) is too short for the hardware
/// prefetcher to ramp up on, and asking for whole rows at once overfills the core's miss queue. Measured
/// here (Zen 4 VM, one thread, 10 % of 88,064 Q4_0 rows of 4096 from DRAM, medians of 5): 10.2 → 13.6 GB/s.
template <int N>
struct NextRows {
  const uint8_t* const* rows;
  int64_t nb;
  size_t rb;
  int64_t total, done = 0;
  NextRows(const uint8_t* const* r, int64_t n_blocks, size_t row_bytes)
      : rows(r), nb(n_blocks), rb(row_bytes), total(static_cast<int64_t>(N) * static_cast<int64_t>((row_bytes + 63) / 64 + 1)) {}
  inline void step(int64_t i) {
    const int64_t target = ((i + 1) * total + nb - 1) / nb;
    for (; done < target; done++) {
      size_t off = 64 * static_cast<size_t>(done / N);
      if (off >= rb) off = rb - 1;  // a row's last line (rows need not start on a line)
      _mm_prefetch(reinterpret_cast<const char*>(rows[done % N] + off), _MM_HINT_T0);
    }
  }
};

/// 8 Q4_0 rows at any addresses (a sparse decode's active rows) · one activation row: each block's nibbles
/// are transposed on the fly into the repacked arrangement (BlockQ4_0x8: 32-bit lane r holds 4 bytes of row r),
/// then packed_tile's arithmetic: per row the exact integer Σ(q − 8)·x of the block in its own lane, acc =
/// fma(float(that), d_w·d_x, acc) block after block, so every output is bit-identical to dot_pairs_q4_0's and
/// the unpacked dot's. It needs no horizontal sums: ~3.5× dot_pairs_q4_0<4>'s throughput on rows in cache
/// (1536-element rows, 2 threads: 15 → 50 GB/s here).
template <bool NEXT>
void dot_rows8_q4_0_impl(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out, const uint8_t* const* next) {
  const int64_t nb = k / QK;
  const BlockQ4_0* a[8];
  for (int r = 0; r < 8; r++) a[r] = reinterpret_cast<const BlockQ4_0*>(w[r]);
  const XBlockQ8* b = reinterpret_cast<const XBlockQ8*>(x);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  NextRows<8> pf(next, nb, static_cast<size_t>(nb) * sizeof(BlockQ4_0));
  for (int64_t i = 0; i < nb; i++) {
    if constexpr (NEXT) pf.step(i);
    // rows r and r + 4 in the two 128-bit halves, then a 4 × 4 transpose of 32-bit lanes within each half:
    // v[ch] lane r = bytes 4·ch … 4·ch + 3 of row r's nibbles
    __m256i y[4];
    for (int r = 0; r < 4; r++) {
      y[r] = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a[r + 4][i].qs)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(a[r][i].qs)));
    }
    const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                          _mm256_unpackhi_epi64(t1, t3)};
    __m256i p = _mm256_setzero_si256();
    for (int ch = 0; ch < 4; ch++) {
      const __m256i xl = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[i].qs) + 4 * ch)));
      const __m256i xh = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[i].qs) + 16 + 4 * ch)));
      const __m256i lo = _mm256_and_si256(v[ch], m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v[ch], 4), m4);
#if defined(PI_KERNELS_VNNI)
      p = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(p, lo, xl), hi, xh);
#else
      p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
    }
#if !defined(PI_KERNELS_VNNI)
    p = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
    const __m256i s = _mm256_sub_epi32(p, _mm256_set1_epi32(8 * b[i].sum));
    const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(
        static_cast<short>(a[0][i].d), static_cast<short>(a[1][i].d), static_cast<short>(a[2][i].d),
        static_cast<short>(a[3][i].d), static_cast<short>(a[4][i].d), static_cast<short>(a[5][i].d),
        static_cast<short>(a[6][i].d), static_cast<short>(a[7][i].d)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(b[i].d)), acc);
  }
  _mm256_storeu_ps(out, acc);
}

void dot_rows8_q4_0(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out) {
  dot_rows8_q4_0_impl<false>(k, w, x, out, nullptr);
}

/// KernelTable::dot_rows8_next for Q4_0: dot_rows8_q4_0 while the next 8 rows are fetched.
void dot_rows8_next_q4_0(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out, const uint8_t* const* next) {
  if (next) {
    dot_rows8_q4_0_impl<true>(k, w, x, out, next);
  } else {
    dot_rows8_q4_0_impl<false>(k, w, x, out, nullptr);
  }
}

/// Q4_0 tiles, any nr × nc: one row against 2–4 columns shares its unpacked nibbles; otherwise the nr·nc
/// (row, column) pairs in groups of 4; 5–8 rows against one column: dot_rows8_q4_0.
void dot_tile_q4_0(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  if (nc == 1 && nr > 4) {
    const uint8_t* w8[8];
    for (int r = 0; r < 8; r++) w8[r] = w[r < nr ? r : 0];
    float o[8];
    dot_rows8_q4_0(k, w8, x[0], o);
    for (int r = 0; r < nr; r++) out[r] = o[r];
    return;
  }
  if (nr == 1 && nc == 2) return dot_pairs_q4_0<2, true>(k, w, x, out);
  if (nr == 1 && nc == 3) return dot_pairs_q4_0<3, true>(k, w, x, out);
  if (nr == 1 && nc == 4) return dot_pairs_q4_0<4, true>(k, w, x, out);
  static constexpr void (*fns[4])(int64_t, const uint8_t* const*, const uint8_t* const*, float*) = {
      dot_pairs_q4_0<1>, dot_pairs_q4_0<2>, dot_pairs_q4_0<3>, dot_pairs_q4_0<4>};
  const int n = nr * nc;
  for (int p = 0; p < n; p += 4) {
    const int m = n - p < 4 ? n - p : 4;
    const uint8_t* ws[4];
    const uint8_t* xs[4];
    for (int j = 0; j < m; j++) {
      ws[j] = w[(p + j) / nc];
      xs[j] = x[(p + j) % nc];
    }
    fns[m - 1](k, ws, xs, out + p);  // out[r·nc + c] is pair r·nc + c
  }
}

/// Matrix × vector prefetch distance in the repacked Q4_0 streams (bytes ahead of the block being read):
/// 1 KiB measured best here (2-vCPU Xeon: 10.9 / 19.7 GB/s at 1 / 2 threads, 9.5 / 17.0 without it).
constexpr int kQ4x8Prefetch = 1024;

/// Vector operations of the repacked kernels for W groups per register: W = 1, one group of 8 rows per 256-bit
/// register (lane r = row r); W = 2 (AVX-512 only), groups 2h and 2h + 1 in the two 256-bit halves of a 512-bit
/// register, each half doing what the W = 1 register does (so every output is bit-identical). Loads take the
/// W groups' pointers (the second ignored when W = 1).
template <int W>
struct Lanes;
template <>
struct Lanes<1> {
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I set1(int v) { return _mm256_set1_epi32(v); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static I nibbles() { return _mm256_set1_epi8(0x0F); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I srl4(I v) { return _mm256_srli_epi16(v, 4); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
  static I q32(const uint8_t* p, const uint8_t*) { return loadu256(p); }                   ///< 32 bytes
  static I u8to32(const uint8_t* p, const uint8_t*) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I u8to16(__m128i a, __m128i) { return _mm256_cvtepu8_epi16(a); }                 ///< 16 bytes → int16
  static F h8(const uint16_t* p, const uint16_t*) { return load_f16(p); }                  ///< 8 F16 values
  static void store(F v, float* o, float*) { _mm256_storeu_ps(o, v); }
#if defined(PI_KERNELS_VNNI)
  static I dpbusd(I acc, I u, I x) { return _mm256_dpbusd_epi32(acc, u, x); }
#endif
};
#if defined(PI_KERNELS_VNNI)
template <>
struct Lanes<2> {
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I set1(int v) { return _mm512_set1_epi32(v); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static I nibbles() { return _mm512_set1_epi8(0x0F); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I srl4(I v) { return _mm512_srli_epi16(v, 4); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  // the zero-masked forms: GCC 12's unmasked intrinsics warn (-Wmaybe-uninitialized, in its headers)
  static F cvt(I v) { return _mm512_maskz_cvtepi32_ps(0xFFFF, v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
  static I q32(const uint8_t* p, const uint8_t* q) {
    return _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(loadu256(p)), loadu256(q), 1);
  }
  static I u8to32(const uint8_t* p, const uint8_t* q) {
    return _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  static I u8to16(__m128i a, __m128i b) { return _mm512_cvtepu8_epi16(_mm256_set_m128i(b, a)); }
  static F h8(const uint16_t* p, const uint16_t* q) {
    return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)),
                                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(F v, float* o, float* o2) {
    alignas(64) float t[16];
    _mm512_store_ps(t, v);
    for (int r = 0; r < 8; r++) {
      o[r] = t[r];
      o2[r] = t[8 + r];
    }
  }
  static I dpbusd(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
};
#endif

/// Groups per register for a repacked tile of NG groups × NC columns: two on AVX-512 for batches (NC > 1,
/// NG even), else one (matrix × vector keeps four 256-bit streams with their prefetch).
template <int NG, int NC>
constexpr int lanes_w() {
#if defined(PI_KERNELS_VNNI)
  return NG % 2 == 0 && NC > 1 ? 2 : 1;
#else
  return 1;
#endif
}

/// NG groups of 8 repacked Q4_0 rows (BlockQ4_0x8, consecutive groups) × NC activation rows: per block, per
/// 4-byte chunk c, one 32-byte load holds a group's 8 rows' nibbles of elements 4c..4c+3 (low) and
/// 16+4c..16+4c+3 (high); multiplied by the activation's 4 matching bytes broadcast to every row's lane
/// (maddubs: 16-bit pair sums, ≤ 2·15·127 each, 8 of them summed stay below 2^15; or vpdpbusd), then one madd
/// gives lane r = row r's Σ q·x. Several groups at once are several concurrent memory streams (one stream per
/// core leaves DRAM bandwidth unused in matrix × vector). Same per-output arithmetic as dot_pairs_q4_0. With
/// AVX-512, batches hold two groups per register (Lanes<2>).
template <int NG, int NC>
void q4_0x8_tile_t(int64_t k, const uint8_t* groups, const uint8_t* const* x, float* out) {
  constexpr int W = lanes_w<NG, NC>(), NH = NG / W;
  using L = Lanes<W>;
  using I = typename L::I;
  using F = typename L::F;
  const int64_t nb = k / QK;
  const BlockQ4_0x8* a[NG];
  for (int g = 0; g < NG; g++) a[g] = reinterpret_cast<const BlockQ4_0x8*>(groups) + g * nb;
  const XBlockQ8* b[NC];
  for (int c = 0; c < NC; c++) b[c] = reinterpret_cast<const XBlockQ8*>(x[c]);
  const I m4 = L::nibbles();
  F acc[NH][NC];
  for (int h = 0; h < NH; h++) {
    for (int c = 0; c < NC; c++) acc[h][c] = L::fzero();
  }
  for (int64_t i = 0; i < nb; i++) {
    if (NC == 1) {
      for (int g = 0; g < NG; g++) __builtin_prefetch(reinterpret_cast<const uint8_t*>(a[g] + i) + kQ4x8Prefetch, 0, 3);
    }
    I p[NH][NC];
    for (int h = 0; h < NH; h++) {
      for (int c = 0; c < NC; c++) p[h][c] = L::zero();
    }
    for (int ch = 0; ch < 4; ch++) {
      I xl[NC], xh[NC];
      for (int c = 0; c < NC; c++) {
        xl[c] = L::set1(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[c][i].qs) + 4 * ch)));
        xh[c] = L::set1(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[c][i].qs) + 16 + 4 * ch)));
      }
      for (int h = 0; h < NH; h++) {
        const I v = L::q32(a[W * h][i].qs + 32 * ch, a[W * h + W - 1][i].qs + 32 * ch);
        const I lo = L::and_(v, m4);
        const I hi = L::and_(L::srl4(v), m4);
        for (int c = 0; c < NC; c++) {
#if defined(PI_KERNELS_VNNI)
          p[h][c] = L::dpbusd(L::dpbusd(p[h][c], lo, xl[c]), hi, xh[c]);  // int32 lanes directly
#else
          p[h][c] = _mm256_add_epi16(p[h][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[c]), _mm256_maddubs_epi16(hi, xh[c])));
#endif
        }
      }
    }
    for (int h = 0; h < NH; h++) {
      const F dw = L::h8(a[W * h][i].d, a[W * h + W - 1][i].d);
      for (int c = 0; c < NC; c++) {
#if defined(PI_KERNELS_VNNI)
        const I s = L::sub(p[h][c], L::set1(8 * b[c][i].sum));
#else
        const I s = L::sub(L::madd16(p[h][c], _mm256_set1_epi16(1)), L::set1(8 * b[c][i].sum));
#endif
        acc[h][c] = L::fmadd(L::cvt(s), L::mul(dw, L::fset1(b[c][i].d)), acc[h][c]);
      }
    }
  }
  for (int h = 0; h < NH; h++) {
    for (int c = 0; c < NC; c++) L::store(acc[h][c], out + 8 * (W * h * NC + c), out + 8 * ((W * h + W - 1) * NC + c));
  }
}

float dot_q4_0(int64_t k, const void* w, const void* x) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  const uint8_t* xp = static_cast<const uint8_t*>(x);
  float out;
  dot_pairs_q4_0<1>(k, &wp, &xp, &out);
  return out;
}

float dot_q8_0(int64_t k, const void* w, const void* x) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  float out;
  dot_rows_q8_0<1>(k, &wp, static_cast<const uint8_t*>(x), &out);
  return out;
}

/// Q8_0 weights in llama.cpp's prompt GEMM arithmetic (llamafile tinyBLAS_Q0_AVX): per output one
/// accumulator, acc = fma(d_w · d_x, float(Σ of the block's byte products, 8 int32 lanes), acc) block by
/// block, then hsum_ps. NR × NC outputs (up to 4 × 3) per call: a block's weight bytes are loaded (and
/// their absolute values taken) once for the NC columns, its scale converted once; the activation
/// blocks come from L1 for each row.
template <int NR, int NC>
void gemm_tile_q8_0_t(int64_t k, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  const int64_t nb = k / QK;
  const BlockQ8_0* a[NR];
  for (int r = 0; r < NR; r++) a[r] = reinterpret_cast<const BlockQ8_0*>(w[r]);
  const XBlockQ8* b[NC];
  for (int c = 0; c < NC; c++) b[c] = reinterpret_cast<const XBlockQ8*>(x[c]);
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < nb; i++) {
#if defined(PI_KERNELS_VNNI)
    // Σ w·x per lane of 4 bytes as vpdpbusd(−128·Σx, w + 128, x): the weight biased to unsigned once per row,
    // the correction once per column (the same exact integers as the sign trick below)
    __m256i neg[NC];
    __m256 dx[NC];
    for (int c = 0; c < NC; c++) {
      neg[c] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(static_cast<char>(0x80)), loadu256(b[c][i].qs)));
      dx[c] = _mm256_set1_ps(b[c][i].d);
    }
    for (int r = 0; r < NR; r++) {
      const __m256i wu = _mm256_xor_si256(loadu256(a[r][i].qs), _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256 dw = _mm256_set1_ps(h2f(a[r][i].d));
      for (int c = 0; c < NC; c++) {
        const __m256i p = _mm256_dpbusd_epi32(neg[c], wu, loadu256(b[c][i].qs));
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[c]), _mm256_cvtepi32_ps(p), acc[r][c]);
      }
    }
#else
    for (int r = 0; r < NR; r++) {
      const __m256i wq = loadu256(a[r][i].qs);
      const __m256i aw = _mm256_sign_epi8(wq, wq);
      const float dw = h2f(a[r][i].d);
      for (int c = 0; c < NC; c++) {
        // dot_i8_i32(wq, xq) with |wq| shared by the columns
        const __m256i sx = _mm256_sign_epi8(loadu256(b[c][i].qs), wq);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * b[c][i].d), _mm256_cvtepi32_ps(p), acc[r][c]);
      }
    }
#endif
  }
  for (int r = 0; r < NR; r++) {
    for (int c = 0; c < NC; c++) out[r * NC + c] = hsum_ps(acc[r][c]);
  }
}

#if defined(PI_KERNELS_VNNI)
/// gemm_tile_q8_0_t on 512-bit registers, as gemm_tile_float512: columns 2p and 2p + 1 in the two 256-bit
/// halves (their activation blocks side by side, the weight block in both halves), each half the same
/// vpdpbusd integers and the same float multiply and FMA per lane as the 256-bit tile, so every output is
/// bit-identical to it with half the instructions. Up to 4 rows × 6 columns (12 accumulators + 3 × 3
/// per-block column vectors); an odd column count computes its last column twice (the copy is dropped).
template <int NR, int NC>
void gemm_tile_q8_0_512(int64_t k, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  constexpr int NP = (NC + 1) / 2;
  const int64_t nb = k / QK;
  const BlockQ8_0* a[NR];
  for (int r = 0; r < NR; r++) a[r] = reinterpret_cast<const BlockQ8_0*>(w[r]);
  const XBlockQ8* b[2 * NP];
  for (int c = 0; c < 2 * NP; c++) b[c] = reinterpret_cast<const XBlockQ8*>(x[c < NC ? c : NC - 1]);
  __m512 acc[NR][NP];
  for (int r = 0; r < NR; r++) {
    for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();
  }
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < nb; i++) {
    __m512i xq[NP], neg[NP];
    __m512 dx[NP];
    for (int p = 0; p < NP; p++) {
      // the zero-masked insert: GCC 12's unmasked intrinsic warns (-Wmaybe-uninitialized, in its header)
      xq[p] = _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(loadu256(b[2 * p][i].qs)), loadu256(b[2 * p + 1][i].qs), 1);
      neg[p] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, xq[p]));
      dx[p] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(b[2 * p][i].d), _mm512_set1_ps(b[2 * p + 1][i].d));
    }
    for (int r = 0; r < NR; r++) {
      // zero-masked forms below: GCC 12's unmasked broadcast and conversion intrinsics warn (see above)
      const __m512i wu = _mm512_xor_si512(_mm512_maskz_broadcast_i64x4(0xFF, loadu256(a[r][i].qs)), bias);
      const __m512 dw = _mm512_set1_ps(h2f(a[r][i].d));
      for (int p = 0; p < NP; p++) {
        const __m512i q = _mm512_dpbusd_epi32(neg[p], wu, xq[p]);
        acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[p]), _mm512_maskz_cvtepi32_ps(0xFFFF, q), acc[r][p]);
      }
    }
  }
  for (int r = 0; r < NR; r++) {
    for (int p = 0; p < NP; p++) {
      alignas(64) float h[16];
      _mm512_store_ps(h, acc[r][p]);
      out[r * NC + 2 * p] = hsum_ps(_mm256_load_ps(h));
      if (2 * p + 1 < NC) out[r * NC + 2 * p + 1] = hsum_ps(_mm256_load_ps(h + 8));
    }
  }
}
#endif

struct GemmQ8 {
  template <int NR, int NC>
  struct S {
    static void run(int64_t k, int, int, const uint8_t* const* w, const uint8_t* const* x, float* out) {
#if defined(PI_KERNELS_VNNI)
      gemm_tile_q8_0_512<NR, NC>(k, w, x, out);
#else
      gemm_tile_q8_0_t<NR, NC>(k, w, x, out);
#endif
    }
  };
};

void gemm_tile_q8_0(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  GemmShapes<GemmQ8::S, kGemmColsQ8>::tile(k, nr, nc, w, x, out);
}

/// Q4_0 / Q8_0 tiles: 2–4 rows take the interleaved rows (for each column); one row loops over the dot.
template <void (*R1)(int64_t, const uint8_t* const*, const uint8_t*, float*),
          void (*R2)(int64_t, const uint8_t* const*, const uint8_t*, float*),
          void (*R3)(int64_t, const uint8_t* const*, const uint8_t*, float*),
          void (*R4)(int64_t, const uint8_t* const*, const uint8_t*, float*)>
void dot_tile_rows(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  for (int r = 0; r < nr; r += 4) {
    const int m = nr - r < 4 ? nr - r : 4;
    for (int c = 0; c < nc; c++) {
      float o[4];
      (m == 4 ? R4 : m == 3 ? R3 : m == 2 ? R2 : R1)(k, w + r, x[c], o);
      for (int i = 0; i < m; i++) out[(r + i) * nc + c] = o[i];
    }
  }
}

float dot_q4_1(int64_t k, const void* w, const void* x) {
  const BlockQ4_1* a = static_cast<const BlockQ4_1*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  __m256 acc = _mm256_setzero_ps();
  float summ = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    const __m256i p = dot_u8_i32(unpack_nibbles(a[i].qs), loadu256(b[i].qs));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(a[i].d) * b[i].d), _mm256_cvtepi32_ps(p), acc);
    summ += h2f(a[i].m) * b[i].s;
  }
  return hsum_ps(acc) + summ;
}

float dot_q5_0(int64_t k, const void* w, const void* x) {
  const BlockQ5_0* a = static_cast<const BlockQ5_0*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  __m256 acc = _mm256_setzero_ps();
  const __m256i h16 = _mm256_set1_epi8(0x10);
  for (int64_t i = 0; i < k / QK; i++) {
    const __m256i hb = _mm256_and_si256(bits_to_bytes(load_u32(a[i].qh)), h16);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(unpack_nibbles(a[i].qs), hb), h16);
    const __m256i p = dot_i8_i32(q, loadu256(b[i].qs));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(a[i].d) * b[i].d), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum_ps(acc);
}

float dot_q5_1(int64_t k, const void* w, const void* x) {
  const BlockQ5_1* a = static_cast<const BlockQ5_1*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  __m256 acc = _mm256_setzero_ps();
  float summ = 0.0f;
  const __m256i h16 = _mm256_set1_epi8(0x10);
  for (int64_t i = 0; i < k / QK; i++) {
    const __m256i hb = _mm256_and_si256(bits_to_bytes(load_u32(a[i].qh)), h16);
    const __m256i q = _mm256_or_si256(unpack_nibbles(a[i].qs), hb);
    const __m256i p = dot_u8_i32(q, loadu256(b[i].qs));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(a[i].d) * b[i].d), _mm256_cvtepi32_ps(p), acc);
    summ += h2f(a[i].m) * b[i].s;
  }
  return hsum_ps(acc) + summ;
}

// ---- K-quants (x in Q8_K). Integer sums are exact, and each super-block's float combination is
// the same expression as the scalar kernel's, so both paths give identical results. -------------

/// One Q4_K super-block's contribution to a dot product's running sum: s + d_x·(d·Σ sc·q·x − dmin·Σ m·bsum),
/// the integer parts exact (one expression shared by every Q4_K kernel so that all round alike).
inline float q4_K_step(float s, float dx, uint16_t d, uint16_t dmin, int sumi, int summ) {
  return s + dx * (h2f(d) * static_cast<float>(sumi) - h2f(dmin) * static_cast<float>(summ));
}

/// A Q4_K super-block's 12 scale bytes → 16 bytes: the 8 sub-blocks' 6-bit scales (bytes 0..7) and mins
/// (bytes 8..15), as k4_scale_min decodes them, with 32-bit word operations.
inline void k4_decode_scales(const uint8_t* q, uint32_t out[4]) {
  uint32_t u[3];
  __builtin_memcpy(u, q, 12);
  out[0] = u[0] & 0x3F3F3F3Fu;                                       // sc 0..3: q[j] & 63
  out[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);  // sc 4..7
  out[2] = u[1] & 0x3F3F3F3Fu;                                       // m 0..3: q[j + 4] & 63
  out[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);  // m 4..7
}

/// NR (2–4) Q4_K rows against one activation row: per super-block each row's exact integer sums (scales
/// decoded with word operations, the mins against the activation's 8 sub-block sums in one madd), the NR
/// rows' sums gathered into one vector (horizontal adds), then dot_q4_K's float step on NR lanes at once
/// (the same operations per lane as q4_K_step).
template <int NR>
void dot_rows_q4_K(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out) {
  const BlockQ8_K* b = reinterpret_cast<const BlockQ8_K*>(x);
  const BlockQ4_K* a[4];
  for (int r = 0; r < 4; r++) a[r] = reinterpret_cast<const BlockQ4_K*>(w[r < NR ? r : 0]);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < k / QK_K; i++) {
    // the activation's sums of its 8 sub-blocks of 32 (pairs of 16-element bsums), as int16
    const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].bsums)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].bsums + 8)));
    __m256i sumi[4];
    __m128i summ[4];
    for (int r = 0; r < 4; r++) {
      if (r >= NR) {
        sumi[r] = _mm256_setzero_si256();
        summ[r] = _mm_setzero_si128();
        continue;
      }
      uint32_t sm[4];
      k4_decode_scales(a[r][i].scales, sm);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(sm);
      summ[r] = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))), bs);
      __m256i acc_i = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        const __m256i q = loadu256(a[r][i].qs + 32 * j);
        const __m256i lo = _mm256_and_si256(q, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadu256(b[i].qs + 64 * j)), _mm256_set1_epi16(sc[2 * j]));
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadu256(b[i].qs + 64 * j + 32)), _mm256_set1_epi16(sc[2 * j + 1]));
        acc_i = _mm256_add_epi32(acc_i, _mm256_add_epi32(p0, p1));
      }
      sumi[r] = acc_i;
    }
    // lane r: row r's Σ sc·q·x and Σ m·x
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(sumi[0], sumi[1]), _mm256_hadd_epi32(sumi[2], sumi[3]));
    const __m128i si = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128i sn = _mm_hadd_epi32(_mm_hadd_epi32(summ[0], summ[1]), _mm_hadd_epi32(summ[2], summ[3]));
    const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(a[0][i].d), static_cast<short>(a[1][i].d),
                                                 static_cast<short>(a[2][i].d), static_cast<short>(a[3][i].d), 0, 0, 0, 0));
    const __m128 dmin = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(a[0][i].dmin), static_cast<short>(a[1][i].dmin),
                                                    static_cast<short>(a[2][i].dmin), static_cast<short>(a[3][i].dmin), 0, 0, 0, 0));
    const __m128 v = _mm_sub_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(si)), _mm_mul_ps(dmin, _mm_cvtepi32_ps(sn)));
    acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(b[i].d), v));
  }
  float o[4];
  _mm_storeu_ps(o, acc);
  for (int r = 0; r < NR; r++) out[r] = o[r];
}

/// One Q4_K row against NC (1–4) activation rows: each super-block's 6-bit scales and mins are decoded and its
/// nibbles unpacked once for the NC columns; each output sums as dot_q4_K.
template <int NC>
void dot_row_cols_q4_K(int64_t k, const uint8_t* w, const uint8_t* const* x, float* out) {
  const BlockQ4_K* a = reinterpret_cast<const BlockQ4_K*>(w);
  const BlockQ8_K* b[NC];
  for (int c = 0; c < NC; c++) b[c] = reinterpret_cast<const BlockQ8_K*>(x[c]);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  float s[NC];
  for (int c = 0; c < NC; c++) s[c] = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    uint32_t sm[4];
    k4_decode_scales(a[i].scales, sm);
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(sm);
    const uint8_t* mn = sc + 8;
    __m256i acc[NC];
    int summ[NC];
    for (int c = 0; c < NC; c++) {
      acc[c] = _mm256_setzero_si256();
      summ[c] = 0;
    }
    for (int j = 0; j < 4; j++) {
      const __m256i q = loadu256(a[i].qs + 32 * j);
      const __m256i lo = _mm256_and_si256(q, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      const __m256i s1 = _mm256_set1_epi16(sc[2 * j]), s2 = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int c = 0; c < NC; c++) {
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadu256(b[c][i].qs + 64 * j)), s1);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadu256(b[c][i].qs + 64 * j + 32)), s2);
        acc[c] = _mm256_add_epi32(acc[c], _mm256_add_epi32(p0, p1));
        summ[c] += mn[2 * j] * (b[c][i].bsums[4 * j] + b[c][i].bsums[4 * j + 1]) +
                   mn[2 * j + 1] * (b[c][i].bsums[4 * j + 2] + b[c][i].bsums[4 * j + 3]);
      }
    }
    for (int c = 0; c < NC; c++) s[c] = q4_K_step(s[c], b[c][i].d, a[i].d, a[i].dmin, hsum_epi32(acc[c]), summ[c]);
  }
  for (int c = 0; c < NC; c++) out[c] = s[c];
}

float dot_q4_K(int64_t k, const void* w, const void* x) {
  const uint8_t* xp = static_cast<const uint8_t*>(x);
  float out;
  dot_row_cols_q4_K<1>(k, static_cast<const uint8_t*>(w), &xp, &out);
  return out;
}

/// Q4_K tiles, any nr × nc: 2–4 rows × one column in dot_rows_q4_K; otherwise each row against its columns four
/// at a time (shared scale decoding and unpacking).
void dot_tile_q4_K(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  if (nc == 1 && nr == 4) return dot_rows_q4_K<4>(k, w, x[0], out);
  if (nc == 1 && nr == 3) return dot_rows_q4_K<3>(k, w, x[0], out);
  if (nc == 1 && nr == 2) return dot_rows_q4_K<2>(k, w, x[0], out);
  for (int r = 0; r < nr; r++) {
    for (int c = 0; c < nc; c += 4) {
      float o[4];
      const int m = nc - c < 4 ? nc - c : 4;
      switch (m) {
        case 1: dot_row_cols_q4_K<1>(k, w[r], x + c, o); break;
        case 2: dot_row_cols_q4_K<2>(k, w[r], x + c, o); break;
        case 3: dot_row_cols_q4_K<3>(k, w[r], x + c, o); break;
        default: dot_row_cols_q4_K<4>(k, w[r], x + c, o);
      }
      for (int j = 0; j < m; j++) out[r * nc + c + j] = o[j];
    }
  }
}

/// NG groups of 8 repacked Q4_K rows (BlockQ4_Kx8, consecutive groups) × NC activation rows (Q8_K). Per
/// super-block and sub-block pair p, per 4-byte chunk c, one 32-byte load holds a group's 8 rows' nibbles of
/// elements 64p + 4c..+3 (low) and 64p + 32 + 4c..+3 (high), multiplied by the activation's 4 matching bytes
/// broadcast to every row's lane (maddubs into 16-bit pair sums: 8 chunks stay ≤ 8·2·15·128 < 2^15; or
/// vpdpbusd). Lane r then holds row r's sub-block sum; madd with the row's 6-bit scale (both 16-bit halves,
/// or mullo after vpdpbusd) adds sc·Σ q·x to the int32 super-block sum; the mins take 4 madds (pairs of
/// sub-blocks' mins against the activation's pairs of 32-element sums). The float step per row lane is
/// dot_q4_K's: s + d_x·(d·Σ sc·q·x − dmin·Σ m·x), unfused.
/// Matrix × vector prefetch distance in the repacked Q4_K streams: 2 KiB (1.7 super-blocks of a group)
/// measured best on a 2-vCPU AMD EPYC with AVX-512 (2-layer 7B Q4_K slice decode, 2 threads: 180–194 t/s at
/// 1 KiB, 210–215 at 2 KiB, 218 at 2.5 KiB, 199 at 4 KiB, 171 without; 1 thread 111 → 125). Q4_0 gained
/// nothing from 2 KiB there (188/189 vs 190/192 t/s) and keeps kQ4x8Prefetch.
constexpr int kQ4Kx8Prefetch = 2048;

template <int NG, int NC>
void q4_Kx8_tile_t(int64_t k, const uint8_t* groups, const uint8_t* const* x, float* out) {
  constexpr int W = lanes_w<NG, NC>(), NH = NG / W;
  using L = Lanes<W>;
  using I = typename L::I;
  using F = typename L::F;
  const int64_t nb = k / QK_K;
  const BlockQ4_Kx8* a[NG];
  for (int g = 0; g < NG; g++) a[g] = reinterpret_cast<const BlockQ4_Kx8*>(groups) + g * nb;
  const BlockQ8_K* b[NC];
  for (int c = 0; c < NC; c++) b[c] = reinterpret_cast<const BlockQ8_K*>(x[c]);
  const I m4 = L::nibbles();
  F acc[NH][NC];
  for (int h = 0; h < NH; h++) {
    for (int c = 0; c < NC; c++) acc[h][c] = L::fzero();
  }
  for (int64_t i = 0; i < nb; i++) {
    // the register's first and last group (the same group when W = 1)
    const BlockQ4_Kx8* g0[NH];
    const BlockQ4_Kx8* g1[NH];
    for (int h = 0; h < NH; h++) {
      g0[h] = &a[W * h][i];
      g1[h] = &a[W * h + W - 1][i];
    }
    I sumi[NH][NC], summ[NH][NC];
    for (int h = 0; h < NH; h++) {
      for (int c = 0; c < NC; c++) sumi[h][c] = summ[h][c] = L::zero();
    }
    for (int p = 0; p < 4; p++) {
      I pl[NH][NC], ph[NH][NC];
      for (int h = 0; h < NH; h++) {
        for (int c = 0; c < NC; c++) pl[h][c] = ph[h][c] = L::zero();
      }
      for (int ch = 0; ch < 8; ch++) {
        if (NC == 1 && ch % 2 == 0) {
          for (int g = 0; g < NG; g++) __builtin_prefetch(a[g][i].qs + 256 * p + 32 * ch + kQ4Kx8Prefetch, 0, 3);
        }
        I xl[NC], xh[NC];
        for (int c = 0; c < NC; c++) {
          xl[c] = L::set1(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[c][i].qs) + 64 * p + 4 * ch)));
          xh[c] = L::set1(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(b[c][i].qs) + 64 * p + 32 + 4 * ch)));
        }
        for (int h = 0; h < NH; h++) {
          const I v = L::q32(g0[h]->qs + 256 * p + 32 * ch, g1[h]->qs + 256 * p + 32 * ch);
          const I lo = L::and_(v, m4);
          const I hi = L::and_(L::srl4(v), m4);
          for (int c = 0; c < NC; c++) {
#if defined(PI_KERNELS_VNNI)
            pl[h][c] = L::dpbusd(pl[h][c], lo, xl[c]);
            ph[h][c] = L::dpbusd(ph[h][c], hi, xh[c]);
#else
            pl[h][c] = _mm256_add_epi16(pl[h][c], _mm256_maddubs_epi16(lo, xl[c]));
            ph[h][c] = _mm256_add_epi16(ph[h][c], _mm256_maddubs_epi16(hi, xh[c]));
#endif
          }
        }
      }
      for (int h = 0; h < NH; h++) {
        const I sl = L::u8to32(g0[h]->sc + 16 * p, g1[h]->sc + 16 * p);
        const I sh = L::u8to32(g0[h]->sc + 16 * p + 8, g1[h]->sc + 16 * p + 8);
        for (int c = 0; c < NC; c++) {
#if defined(PI_KERNELS_VNNI)
          const I t = L::add(L::mullo(pl[h][c], sl), L::mullo(ph[h][c], sh));
#else
          // the row's scale in both 16-bit halves of its lane: madd gives sc·(pair sum + pair sum)
          const I t = L::add(L::madd16(pl[h][c], _mm256_or_si256(sl, _mm256_slli_epi32(sl, 16))),
                             L::madd16(ph[h][c], _mm256_or_si256(sh, _mm256_slli_epi32(sh, 16))));
#endif
          sumi[h][c] = L::add(sumi[h][c], t);
        }
      }
    }
    // mins: lanes (2r, 2r + 1) = row r's mins of sub-blocks 2t and 2t + 1 against the activation's sums of
    // those sub-blocks (|Σ| ≤ 32·128, an int16) in both halves of a broadcast int32
    for (int t = 0; t < 4; t++) {
      I bs[NC];
      for (int c = 0; c < NC; c++) {
        const int s0 = b[c][i].bsums[4 * t] + b[c][i].bsums[4 * t + 1];
        const int s1 = b[c][i].bsums[4 * t + 2] + b[c][i].bsums[4 * t + 3];
        bs[c] = L::set1(static_cast<int>((static_cast<uint32_t>(s0) & 0xFFFFu) | (static_cast<uint32_t>(s1) << 16)));
      }
      for (int h = 0; h < NH; h++) {
        __m128i mg[2];
        for (int j = 0; j < 2; j++) {
          const uint8_t* mn = (j == 0 ? g0[h] : g1[h])->mn + 16 * t;
          mg[j] = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 8)));
        }
        const I m = L::u8to16(mg[0], mg[1]);
        for (int c = 0; c < NC; c++) summ[h][c] = L::add(summ[h][c], L::madd16(m, bs[c]));
      }
    }
    for (int h = 0; h < NH; h++) {
      const F d = L::h8(g0[h]->d, g1[h]->d);
      const F dmin = L::h8(g0[h]->dmin, g1[h]->dmin);
      for (int c = 0; c < NC; c++) {
        const F v = L::fsub(L::mul(d, L::cvt(sumi[h][c])), L::mul(dmin, L::cvt(summ[h][c])));
        acc[h][c] = L::fadd(acc[h][c], L::mul(L::fset1(b[c][i].d), v));
      }
    }
  }
  for (int h = 0; h < NH; h++) {
    for (int c = 0; c < NC; c++) L::store(acc[h][c], out + 8 * (W * h * NC + c), out + 8 * ((W * h + W - 1) * NC + c));
  }
}

/// The kernels of the repacked layouts, as types (KernelTable::packed_tile takes them through packed_tile).
struct Q4_0x8Kernel {
  static constexpr int kDtype = DT_Q4_0;
  template <int NG, int NC>
  static void run(int64_t k, const uint8_t* groups, const uint8_t* const* x, float* out) {
    q4_0x8_tile_t<NG, NC>(k, groups, x, out);
  }
};
struct Q4_Kx8Kernel {
  static constexpr int kDtype = DT_Q4_K;
  template <int NG, int NC>
  static void run(int64_t k, const uint8_t* groups, const uint8_t* const* x, float* out) {
    q4_Kx8_tile_t<NG, NC>(k, groups, x, out);
  }
};

/// KernelTable::packed_tile for one repacked layout: the shapes its kernel is built for (4 groups × 1 column,
/// 2 × 1, 2 × 2), any other ng × nc as one group × up to 4 columns at a time.
template <class K>
void packed_tile(int64_t k, int ng, int nc, const uint8_t* groups, const uint8_t* const* x, float* out) {
  if (ng == 4 && nc == 1) return K::template run<4, 1>(k, groups, x, out);
  if (ng == 2 && nc == 1) return K::template run<2, 1>(k, groups, x, out);
  if (ng == 2 && nc == 2) return K::template run<2, 2>(k, groups, x, out);
  if (ng == 2 && nc == 3) return K::template run<2, 3>(k, groups, x, out);
  if (ng == 2 && nc == 4) return K::template run<2, 4>(k, groups, x, out);
  const size_t gbytes = packed_group_bytes(K::kDtype, k);
  for (int g = 0; g < ng; g++) {
    for (int c = 0; c < nc; c += 4) {
      const uint8_t* grp = groups + g * gbytes;
      float* o = out + 8 * (g * nc + c);
      switch (nc - c < 4 ? nc - c : 4) {
        case 1: K::template run<1, 1>(k, grp, x + c, o); break;
        case 2: K::template run<1, 2>(k, grp, x + c, o); break;
        case 3: K::template run<1, 3>(k, grp, x + c, o); break;
        default: K::template run<1, 4>(k, grp, x + c, o);
      }
    }
  }
}

float dot_q5_K(int64_t k, const void* w, const void* x) {
  const BlockQ5_K* a = static_cast<const BlockQ5_K*>(w);
  const BlockQ8_K* b = static_cast<const BlockQ8_K*>(x);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i h16 = _mm256_set1_epi8(0x10);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    __m256i acc = _mm256_setzero_si256();
    int summ = 0;
    const __m256i qh = loadu256(a[i].qh);
    for (int j = 0; j < 4; j++) {
      uint8_t sc1, m1, sc2, m2;
      k4_scale_min(2 * j, a[i].scales, &sc1, &m1);
      k4_scale_min(2 * j + 1, a[i].scales, &sc2, &m2);
      const __m256i b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * j)));
      const __m256i b2 = _mm256_set1_epi8(static_cast<char>(2 << (2 * j)));
      const __m256i hb1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), h16);
      const __m256i hb2 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b2), b2), h16);
      const __m256i q = loadu256(a[i].qs + 32 * j);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), hb1);
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), hb2);
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadu256(b[i].qs + 64 * j)), _mm256_set1_epi16(sc1));
      const __m256i p1 =
          _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadu256(b[i].qs + 64 * j + 32)), _mm256_set1_epi16(sc2));
      acc = _mm256_add_epi32(acc, _mm256_add_epi32(p0, p1));
      summ += m1 * (b[i].bsums[4 * j] + b[i].bsums[4 * j + 1]) + m2 * (b[i].bsums[4 * j + 2] + b[i].bsums[4 * j + 3]);
    }
    const int sumi = hsum_epi32(acc);
    s += b[i].d * (h2f(a[i].d) * static_cast<float>(sumi) - h2f(a[i].dmin) * static_cast<float>(summ));
  }
  return s;
}

float dot_q6_K(int64_t k, const void* w, const void* x) {
  const BlockQ6_K* a = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* b = static_cast<const BlockQ8_K*>(x);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m2 = _mm256_set1_epi8(0x03);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
      const __m256i qla = loadu256(a[i].ql + 64 * h);
      const __m256i qlb = loadu256(a[i].ql + 64 * h + 32);
      const __m256i qh = loadu256(a[i].qh + 32 * h);
      for (int quarter = 0; quarter < 4; quarter++) {
        const __m256i src = (quarter & 1) ? qlb : qla;
        const __m256i nib = quarter < 2 ? _mm256_and_si256(src, m4) : _mm256_and_si256(_mm256_srli_epi16(src, 4), m4);
        const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * quarter), m2), 4);
        const __m256i q = _mm256_or_si256(nib, hb);
        const int g = 8 * h + 2 * quarter;
        const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(a[i].scales[g + 1]), _mm_set1_epi16(a[i].scales[g]));
        const __m256i p = _mm256_maddubs_epi16(q, loadu256(b[i].qs + 128 * h + 32 * quarter));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scv));
      }
    }
    int off = 0;
    for (int g = 0; g < QK_K / 16; g++) off += a[i].scales[g] * b[i].bsums[g];
    const int sumi = hsum_epi32(acc) - 32 * off;
    s += b[i].d * h2f(a[i].d) * static_cast<float>(sumi);
  }
  return s;
}

// ---- axpy -----------------------------------------------------------------------------------

void axpy_f32v(int64_t n, float a, const float* x, float* y) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; i++) y[i] += a * x[i];
}

void axpy_f32(int64_t k, float a, const void* w, float* y) { axpy_f32v(k, a, static_cast<const float*>(w), y); }

void axpy_f16(int64_t k, float a, const void* w, float* y) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_f16(h + i), _mm256_loadu_ps(y + i)));
    _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, load_f16(h + i + 8), _mm256_loadu_ps(y + i + 8)));
  }
  for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_f16(h + i), _mm256_loadu_ps(y + i)));
  for (; i < k; i++) y[i] += a * h2f(h[i]);
}

void axpy_bf16(int64_t k, float a, const void* w, float* y) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_bf16(h + i), _mm256_loadu_ps(y + i)));
  for (; i < k; i++) y[i] += a * bf16_to_f32(h[i]);
}

using AxpyRowsN = void (*)(int64_t k, const float* a, const uint8_t* const* w, float* y);

/// An AxpyRowsFn from a kernel's 1-, 2-, 3- and 4-row forms (nr is 1–4: the ops take rows 4 at a time).
template <AxpyRowsN R1, AxpyRowsN R2, AxpyRowsN R3, AxpyRowsN R4>
void axpy_rows_of(int64_t k, int nr, const float* a, const uint8_t* const* w, float* y) {
  switch (nr) {
    case 1: return R1(k, a, w, y);
    case 2: return R2(k, a, w, y);
    case 3: return R3(k, a, w, y);
    default: return R4(k, a, w, y);
  }
}

/// y[0..k) += a_r · w_r for NR Q4_0 rows (1–4), y loaded and stored once per block: per element
/// y = fma(a_r · d_r, float(q − 8), y) row after row (a_r · d_r rounded to F32 first), the scalar kernel's
/// operations. The nibbles are zero-extended to 32-bit lanes and converted without an integer → float
/// conversion: with AVX-512 a 16-entry table lookup (vpermps reads an index's low 4 bits only, so the high
/// nibble needs one shift and no mask), 16 elements per instruction; with AVX2 mask or shift, −8, convert.
/// Both give exactly float(q − 8). Measured here (Zen 4 VM, one thread, 4096-element rows from L3): 8.3 GB/s
/// for the previous signed-byte form, 20 GB/s with the table, 9.8 GB/s with the AVX2 form.
template <int NR, bool NEXT>
void axpy_rows_q4_0_impl(int64_t k, const float* a, const uint8_t* const* w, float* y, const uint8_t* const* next) {
  const BlockQ4_0* b[NR];
  for (int r = 0; r < NR; r++) b[r] = reinterpret_cast<const BlockQ4_0*>(w[r]);
  NextRows<4> pf(next, k / QK, static_cast<size_t>(k / QK) * sizeof(BlockQ4_0));
#if defined(PI_KERNELS_VNNI)
  const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  // the zero-masked forms with every lane selected: the unmasked intrinsics of GCC 12 read an
  // uninitialised pass-through operand (-Wmaybe-uninitialized); the instructions are the same
  const __mmask16 all = 0xFFFF;
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    if constexpr (NEXT) pf.step(i);
    __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);
    for (int r = 0; r < NR; r++) {
      const __m512 s = _mm512_set1_ps(a[r] * h2f(b[r][i].d));
      const __m512i q = _mm512_maskz_cvtepu8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r][i].qs)));
      y0 = _mm512_fmadd_ps(s, _mm512_maskz_permutexvar_ps(all, q, tab), y0);                              // elements 0..15
      y1 = _mm512_fmadd_ps(s, _mm512_maskz_permutexvar_ps(all, _mm512_maskz_srli_epi32(all, q, 4), tab), y1);  // 16..31
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
  }
#else
  const __m256i m4 = _mm256_set1_epi32(0x0F), e8 = _mm256_set1_epi32(8);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    if constexpr (NEXT) pf.step(i);
    __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8), y2 = _mm256_loadu_ps(y + 16), y3 = _mm256_loadu_ps(y + 24);
    for (int r = 0; r < NR; r++) {
      const __m256 s = _mm256_set1_ps(a[r] * h2f(b[r][i].d));
      const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[r][i].qs)));
      const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[r][i].qs + 8)));
      y0 = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q0, m4), e8)), y0);
      y1 = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q1, m4), e8)), y1);
      y2 = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q0, 4), e8)), y2);
      y3 = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q1, 4), e8)), y3);
    }
    _mm256_storeu_ps(y, y0);
    _mm256_storeu_ps(y + 8, y1);
    _mm256_storeu_ps(y + 16, y2);
    _mm256_storeu_ps(y + 24, y3);
  }
#endif
}

template <int NR>
void axpy_rows_q4_0_n(int64_t k, const float* a, const uint8_t* const* w, float* y) {
  axpy_rows_q4_0_impl<NR, false>(k, a, w, y, nullptr);
}

void axpy_q4_0(int64_t k, float a, const void* w, float* y) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  axpy_rows_q4_0_n<1>(k, &a, &wp, y);
}


/// Other quantized rows: dequantize a block at a time (scalar table), accumulate with FMA.
/// Q4_K → F32 (the scalar dequant_q4_K's operations: d·sc · q − dmin·m per element, unfused).
void dequant_q4_K(const void* w, float* y, int64_t k) {
  const BlockQ4_K* b = static_cast<const BlockQ4_K*>(w);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < k / QK_K; i++) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    for (int j = 0; j < 4; j++) {
      uint8_t sc, m;
      k4_scale_min(2 * j, b[i].scales, &sc, &m);
      const __m256 d1 = _mm256_set1_ps(d * sc), m1 = _mm256_set1_ps(dmin * m);
      k4_scale_min(2 * j + 1, b[i].scales, &sc, &m);
      const __m256 d2 = _mm256_set1_ps(d * sc), m2 = _mm256_set1_ps(dmin * m);
      const __m256i q = loadu256(b[i].qs + 32 * j);
      const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      for (int h = 0; h < 2; h++) {
        const __m256i v = h == 0 ? lo : hi;
        const __m256 dd = h == 0 ? d1 : d2, mm = h == 0 ? m1 : m2;
        const __m128i v0 = _mm256_castsi256_si128(v), v1 = _mm256_extracti128_si256(v, 1);
        const __m128i parts[4] = {v0, _mm_srli_si128(v0, 8), v1, _mm_srli_si128(v1, 8)};
        for (int p = 0; p < 4; p++) {
          const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
          _mm256_storeu_ps(y + 8 * p, _mm256_sub_ps(_mm256_mul_ps(dd, f), mm));
        }
        y += 32;
      }
    }
  }
}

/// y[0..k) += Σ_r a[r] · dequant_q4_K(w[r]) for NR ≤ 4 rows without storing the dequantized rows: per
/// element acc = fma(a[r], d·sc·q − dmin·m, acc) row after row (d·sc and dmin·m rounded to F32, then the
/// product and the difference rounded unfused), the operations of axpy_rows_blocks over dequant_q4_K
/// (bit-identical). On the AVX-512 table each (row, sub-block) gets a 16-entry table of d·sc·q − dmin·m for
/// q = 0..15, computed with those same two roundings, and the nibbles index it (vpermps), 16 elements per
/// instruction. One thread, 4096-element rows in L2/L3: 6.1 GB/s for the previous form, 10.0 GB/s with the
/// table, 6.4 GB/s for the AVX2 form (the previous one kept 64 vectors of scales on the stack).
template <int NR>
void axpy_rows_q4_K_n(int64_t k, const float* a, const uint8_t* const* w, float* y) {
  for (int64_t i = 0; i < k / QK_K; i++, y += QK_K) {
    float dsc[NR][8], dmn[NR][8];
    for (int r = 0; r < NR; r++) {
      const BlockQ4_K& blk = reinterpret_cast<const BlockQ4_K*>(w[r])[i];
      uint32_t sm[4];
      k4_decode_scales(blk.scales, sm);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(sm);
      const float d = h2f(blk.d), dmin = h2f(blk.dmin);
      for (int j = 0; j < 8; j++) {
        dsc[r][j] = d * sc[j];
        dmn[r][j] = dmin * sc[8 + j];
      }
    }
#if defined(PI_KERNELS_VNNI)
    const __mmask16 all = 0xFFFF;  // zero-masked forms: see axpy_rows_q4_0_n
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < 4; j++) {
      // bytes 32j..32j+31: low nibbles are sub-block 2j (elements 64j..), high nibbles sub-block 2j + 1
      float* yp = y + 64 * j;
      __m512 y0 = _mm512_loadu_ps(yp), y1 = _mm512_loadu_ps(yp + 16), y2 = _mm512_loadu_ps(yp + 32), y3 = _mm512_loadu_ps(yp + 48);
      for (int r = 0; r < NR; r++) {
        const uint8_t* qs = reinterpret_cast<const BlockQ4_K*>(w[r])[i].qs + 32 * j;
        const __m512 av = _mm512_set1_ps(a[r]);
        const __m512 tl = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc[r][2 * j]), iota), _mm512_set1_ps(dmn[r][2 * j]));
        const __m512 th = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc[r][2 * j + 1]), iota), _mm512_set1_ps(dmn[r][2 * j + 1]));
        const __m512i q0 = _mm512_maskz_cvtepu8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        const __m512i q1 = _mm512_maskz_cvtepu8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
        y0 = _mm512_fmadd_ps(av, _mm512_maskz_permutexvar_ps(all, q0, tl), y0);  // vpermps reads bits 0..3
        y1 = _mm512_fmadd_ps(av, _mm512_maskz_permutexvar_ps(all, q1, tl), y1);
        y2 = _mm512_fmadd_ps(av, _mm512_maskz_permutexvar_ps(all, _mm512_maskz_srli_epi32(all, q0, 4), th), y2);
        y3 = _mm512_fmadd_ps(av, _mm512_maskz_permutexvar_ps(all, _mm512_maskz_srli_epi32(all, q1, 4), th), y3);
      }
      _mm512_storeu_ps(yp, y0);
      _mm512_storeu_ps(yp + 16, y1);
      _mm512_storeu_ps(yp + 32, y2);
      _mm512_storeu_ps(yp + 48, y3);
    }
#else
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    for (int j = 0; j < 4; j++) {
      for (int h = 0; h < 2; h++) {
        float* yp = y + 64 * j + 32 * h;
        __m256 v[4];
        for (int p = 0; p < 4; p++) v[p] = _mm256_loadu_ps(yp + 8 * p);
        for (int r = 0; r < NR; r++) {
          const uint8_t* qs = reinterpret_cast<const BlockQ4_K*>(w[r])[i].qs + 32 * j;
          const __m256 av = _mm256_set1_ps(a[r]);
          const __m256 ds = _mm256_set1_ps(dsc[r][2 * j + h]), dm = _mm256_set1_ps(dmn[r][2 * j + h]);
          for (int p = 0; p < 4; p++) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * p)));
            q = h == 0 ? _mm256_and_si256(q, m4) : _mm256_srli_epi32(q, 4);
            v[p] = _mm256_fmadd_ps(av, _mm256_sub_ps(_mm256_mul_ps(ds, _mm256_cvtepi32_ps(q)), dm), v[p]);
          }
        }
        for (int p = 0; p < 4; p++) _mm256_storeu_ps(yp + 8 * p, v[p]);
      }
    }
#endif
  }
}

void axpy_q4_K(int64_t k, float a, const void* w, float* y) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  axpy_rows_q4_K_n<1>(k, &a, &wp, y);
}

/// The dequantizer of a block type for the axpy kernels below (the AVX2 one where there is one).
template <int DT>
DequantFn block_dequant() {
  return DT == DT_Q4_K ? dequant_q4_K : kernels_scalar().dequant[DT];
}

template <int DT, int BLOCK, int BYTES>
void axpy_blocks(int64_t k, float a, const void* w, float* y) {
  alignas(32) float tmp[BLOCK];
  const uint8_t* p = static_cast<const uint8_t*>(w);
  const DequantFn deq = block_dequant<DT>();
  for (int64_t i = 0; i < k / BLOCK; i++, p += BYTES, y += BLOCK) {
    deq(p, tmp, BLOCK);
    axpy_f32v(BLOCK, a, tmp, y);
  }
}

// ---- multi-row axpy: y loaded and stored once for up to 4 rows ---------------------------------

inline __m256 load_f32v(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline __m256 load_f16v(const uint8_t* p) { return load_f16(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load_bf16v(const uint8_t* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

/// Float rows (ES bytes per element), NR of them: 32 elements per step in four independent 8-lane chains
/// (the coefficients broadcast once), then 8 at a time, then the scalar tail as the single-row kernels; per
/// element y = fma(a_r, w_r, y) row after row, as NR successive single-row calls. One 8-lane chain per step
/// was latency-bound: F16, one thread, 4096-element rows: 31 → 55–60 GB/s from L2, 25 → 35–40 from L3.
template <int NR, int ES, __m256 (*LOAD)(const uint8_t*), float (*ELEM)(const uint8_t*)>
void axpy_rows_float_n(int64_t k, const float* a, const uint8_t* const* w, float* y) {
  __m256 s[NR];
  for (int r = 0; r < NR; r++) s[r] = _mm256_set1_ps(a[r]);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(y + i + 8 * j);
    for (int r = 0; r < NR; r++) {
      for (int j = 0; j < 4; j++) v[j] = _mm256_fmadd_ps(s[r], LOAD(w[r] + (i + 8 * j) * ES), v[j]);
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + i + 8 * j, v[j]);
  }
  for (; i + 8 <= k; i += 8) {
    __m256 acc = _mm256_loadu_ps(y + i);
    for (int r = 0; r < NR; r++) acc = _mm256_fmadd_ps(s[r], LOAD(w[r] + i * ES), acc);
    _mm256_storeu_ps(y + i, acc);
  }
  for (; i < k; i++) {
    for (int r = 0; r < NR; r++) y[i] += a[r] * ELEM(w[r] + i * ES);
  }
}

inline float elem_f32(const uint8_t* p) {
  float f;
  __builtin_memcpy(&f, p, 4);
  return f;
}
inline float elem_f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return h2f(h);
}
inline float elem_bf16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return bf16_to_f32(h);
}

/// KernelTable::axpy_rows_next for Q4_0: axpy_rows_q4_0_n<4> while the next 4 rows are fetched.
void axpy_rows_next_q4_0(int64_t k, const float* a, const uint8_t* const* w, float* y, const uint8_t* const* next) {
  if (next) {
    axpy_rows_q4_0_impl<4, true>(k, a, w, y, next);
  } else {
    axpy_rows_q4_0_n<4>(k, a, w, y);
  }
}

/// Q8_0 rows (1–4): per element y = fma(a_r · d_r, float(q), y) row after row, as axpy_q8_0 (a_r · d_r
/// rounded to F32 first); bytes sign-extended straight from memory, 16 lanes per instruction on the AVX-512
/// table. All rows of a 4096 × 11008 matrix from memory (axpy_sparse, every neuron active): one thread 9–10 →
/// 12–14 GB/s, two 16–19 → 26 GB/s against the previous form (which kept the rows' bytes on the stack).
template <int NR>
void axpy_rows_q8_0_n(int64_t k, const float* a, const uint8_t* const* w, float* y) {
  const BlockQ8_0* b[NR];
  for (int r = 0; r < NR; r++) b[r] = reinterpret_cast<const BlockQ8_0*>(w[r]);
#if defined(PI_KERNELS_VNNI)
  const __mmask16 all = 0xFFFF;  // zero-masked forms: see axpy_rows_q4_0_n
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);
    for (int r = 0; r < NR; r++) {
      const __m512 s = _mm512_set1_ps(a[r] * h2f(b[r][i].d));
      const __m512i q0 = _mm512_maskz_cvtepi8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r][i].qs)));
      const __m512i q1 = _mm512_maskz_cvtepi8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r][i].qs + 16)));
      y0 = _mm512_fmadd_ps(s, _mm512_maskz_cvtepi32_ps(all, q0), y0);
      y1 = _mm512_fmadd_ps(s, _mm512_maskz_cvtepi32_ps(all, q1), y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
  }
#else
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(y + 8 * j);
    for (int r = 0; r < NR; r++) {
      const __m256 s = _mm256_set1_ps(a[r] * h2f(b[r][i].d));
      for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[r][i].qs + 8 * j)));
        v[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(q), v[j]);
      }
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + 8 * j, v[j]);
  }
#endif
}

void axpy_q8_0(int64_t k, float a, const void* w, float* y) {
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  axpy_rows_q8_0_n<1>(k, &a, &wp, y);
}

/// 8 values of a slice as F32 (SliceKind: int8, F16 or F32 elements; exact conversions).
template <int SK>
inline __m256 slice_load8(const uint8_t* v, int i) {
  if constexpr (SK == SK_I8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * i))));
  } else if constexpr (SK == SK_F16) {
    return load_f16(reinterpret_cast<const uint16_t*>(v) + 8 * i);
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(v) + 8 * i);
  }
}

/// KernelTable::slice_i8: two blocks' scales (F32) and their integers (q − 8 for Q4_0) as int8.
template <int DT>
void slice_i8(const uint8_t* w, uint8_t* slice) {
  float d[2];
  for (int b = 0; b < 2; b++) {
    __m256i q;
    if constexpr (DT == DT_Q4_0) {
      const BlockQ4_0& blk = reinterpret_cast<const BlockQ4_0*>(w)[b];
      d[b] = h2f(blk.d);
      q = _mm256_sub_epi8(unpack_nibbles(blk.qs), _mm256_set1_epi8(8));
    } else {
      const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(w)[b];
      d[b] = h2f(blk.d);
      q = loadu256(blk.qs);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(slice + 8 + 32 * b), q);
  }
  std::memcpy(slice, d, sizeof d);
}

/// AxpyGatherFn: eight independent 8-lane FMA chains (64 outputs) held in registers over all entries.
template <int SK>
void axpy_gather(int64_t n, const int32_t* idx, const float* a, const uint8_t* slices, int64_t stride, float* y) {
  __m256 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
  // the slices are scattered over a thread's share (hundreds of KiB): fetch a few entries ahead
  constexpr int64_t kAhead = 6;
  constexpr int64_t kLines = SK == SK_I8 ? 2 : SK == SK_F16 ? 2 : 4;
  for (int64_t j = 0; j < n; j++) {
    const uint8_t* p = slices + static_cast<int64_t>(idx[j]) * stride;
    if (j + kAhead < n) {
      const char* q = reinterpret_cast<const char*>(slices + static_cast<int64_t>(idx[j + kAhead]) * stride);
      for (int64_t l = 0; l < kLines; l++) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
    }
    __m256 s0, s1;
    if constexpr (SK == SK_I8) {
      float d[2];
      std::memcpy(d, p, sizeof d);
      s0 = _mm256_set1_ps(a[j] * d[0]);
      s1 = _mm256_set1_ps(a[j] * d[1]);
      p += 8;
    } else {
      s0 = s1 = _mm256_set1_ps(a[j]);
    }
    for (int i = 0; i < 4; i++) acc[i] = _mm256_fmadd_ps(s0, slice_load8<SK>(p, i), acc[i]);
    for (int i = 4; i < 8; i++) acc[i] = _mm256_fmadd_ps(s1, slice_load8<SK>(p, i), acc[i]);
  }
  for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + 8 * i, acc[i]);
}

/// Other quantized rows: each block dequantized (scalar table) for every row, then accumulated.
template <int DT, int BLOCK, int BYTES>
void axpy_rows_blocks(int64_t k, int nr, const float* a, const uint8_t* const* w, float* y) {
  alignas(32) float tmp[4][BLOCK];
  const DequantFn deq = block_dequant<DT>();
  for (int64_t i = 0; i < k / BLOCK; i++, y += BLOCK) {
    for (int r = 0; r < nr; r++) deq(w[r] + i * BYTES, tmp[r], BLOCK);
    for (int j = 0; j < BLOCK; j += 8) {
      __m256 acc = _mm256_loadu_ps(y + j);
      for (int r = 0; r < nr; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(a[r]), _mm256_load_ps(tmp[r] + j), acc);
      _mm256_storeu_ps(y + j, acc);
    }
  }
}

void dequant_f16(const void* w, float* y, int64_t k) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) _mm256_storeu_ps(y + i, load_f16(h + i));
  for (; i < k; i++) y[i] = h2f(h[i]);
}

void store_f16(const float* x, void* dst, int64_t k) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < k; i++) h[i] = f32_to_f16(x[i]);
}

void convert_f16(const float* x, void* dst, int64_t k) {
  float* y = static_cast<float*>(dst);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
  }
  for (; i < k; i++) y[i] = h2f(f32_to_f16(x[i]));
}

// ---- activation quantization (bit-identical with the scalar converters: same F32 operations,
// round-to-nearest-even via vroundps) -------------------------------------------------------------

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/// 32 floats · id rounded to nearest even → 32 int8 (|values| ≤ 127 by construction); returns Σ.
inline int quantize32(const float* x, __m256 id, int8_t* q) {
  const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), id), r));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id), r));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id), r));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id), r));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  // pack 32 → 16 → 8 bits (packs works per 128-bit lane: fix the order with a permute)
  const __m256i p16a = _mm256_packs_epi32(i0, i1);
  const __m256i p16b = _mm256_packs_epi32(i2, i3);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  return hsum_epi32(s);
}

template <bool Q1>
void convert_q8(const float* x, void* dst, int64_t k) {
  XBlockQ8* b = static_cast<XBlockQ8*>(dst);
  for (int64_t i = 0; i < k / QK; i++, x += QK) {
    const __m256 m = _mm256_max_ps(_mm256_max_ps(abs_ps(_mm256_loadu_ps(x)), abs_ps(_mm256_loadu_ps(x + 8))),
                                   _mm256_max_ps(abs_ps(_mm256_loadu_ps(x + 16)), abs_ps(_mm256_loadu_ps(x + 24))));
    const float amax = hmax_ps(m);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int sum = quantize32(x, _mm256_set1_ps(id), b[i].qs);
    b[i].d = h2f(f32_to_f16(d));
    if (Q1) {
      b[i].s = h2f(f32_to_f16(d * static_cast<float>(sum)));
    } else {
      b[i].sum = sum;
    }
  }
}

// ---- attention: one call per (token, head) instead of one per key ------------------------------

/// ggml's AVX2 vector primitives (vec.h/vec.cpp with GGML_F32_STEP = GGML_F16_STEP = 32, 8 lanes):
/// the same operations, lane for lane, as GgmlScalar in kernels_scalar.cpp.
struct GgmlAvx2 {
  template <int KI>
  static __m256 kload(const uint8_t* k, int64_t i) {
    return KI ? load_f16(reinterpret_cast<const uint16_t*>(k) + i) : _mm256_loadu_ps(reinterpret_cast<const float*>(k) + i);
  }
  template <int KI>
  static float dot(int64_t n, const uint8_t* k, const float* q) {
    const int64_t np = n & ~int64_t{31};
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < np; i += 32) {
      s0 = _mm256_fmadd_ps(kload<KI>(k, i), _mm256_loadu_ps(q + i), s0);
      s1 = _mm256_fmadd_ps(kload<KI>(k, i + 8), _mm256_loadu_ps(q + i + 8), s1);
      s2 = _mm256_fmadd_ps(kload<KI>(k, i + 16), _mm256_loadu_ps(q + i + 16), s2);
      s3 = _mm256_fmadd_ps(kload<KI>(k, i + 24), _mm256_loadu_ps(q + i + 24), s3);
    }
    const __m256 r = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    const float red = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    if (KI) {
      const uint16_t* kh = reinterpret_cast<const uint16_t*>(k);
      double sum = red;
      for (int64_t i = np; i < n; i++) sum += static_cast<double>(h2f(kh[i]) * q[i]);
      return static_cast<float>(sum);
    }
    const float* kf = reinterpret_cast<const float*>(k);
    float sum = red;
    for (int64_t i = np; i < n; i++) sum = kGgmlContract ? std::fma(kf[i], q[i], sum) : sum + kf[i] * q[i];
    return sum;
  }
  static void scale_f32(int64_t n, float* y, float a) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), va));
    for (; i < n; i++) y[i] *= a;
  }
  static void scale_f16(int64_t n, uint16_t* y, float a) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_mul_ps(load_f16(y + i), va), 0));
    }
    for (; i < n; i++) y[i] = f32_to_f16(h2f(y[i]) * a);
  }
  // ggml's vector loops take 32 elements at a time and leave the rest to a scalar tail; the tail's
  // contracted y = fma(x, a, y) per element is what the 8-lane FMA does, so with kGgmlContract the vector
  // loop runs on to the last multiple of 8 (head_dim 8–24 models then take no scalar path at all)
  static constexpr int64_t kMadMask = kGgmlContract ? ~int64_t{7} : ~int64_t{31};
  static void mad_f32(int64_t n, float* y, const float* x, float a) {
    const int64_t np = n & kMadMask;
    const __m256 va = _mm256_set1_ps(a);
    for (int64_t i = 0; i < np; i += 8) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), va, _mm256_loadu_ps(y + i)));
    }
    for (int64_t i = np; i < n; i++) y[i] = kGgmlContract ? std::fma(x[i], a, y[i]) : y[i] + x[i] * a;
  }
  static void mad_f16(int64_t n, uint16_t* y, const uint16_t* x, float a) {
    const int64_t np = n & kMadMask;
    const __m256 va = _mm256_set1_ps(a);
    for (int64_t i = 0; i < np; i += 8) {
      const __m256 r = _mm256_fmadd_ps(load_f16(x + i), va, load_f16(y + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(r, 0));
    }
    for (int64_t i = np; i < n; i++) {
      const float xv = h2f(x[i]), yv = h2f(y[i]);
      y[i] = f32_to_f16(kGgmlContract ? std::fma(xv, a, yv) : yv + xv * a);
    }
  }
};

/// llama.cpp's AVX2 `ggml_v_expf` (ggml-cpu vec.h): the same operations lane by lane as expf_ggml_avx2.
inline __m256 v_expf_ggml(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b =
      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
  const __m256 absn = _mm256_andnot_ps(_mm256_set1_ps(-0.f), n);
  const __m256 c = _mm256_cmp_ps(absn, _mm256_set1_ps(126), _CMP_GT_OQ);
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  if (!_mm256_movemask_ps(c)) return _mm256_fmadd_ps(j, k, k);
  const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                     _mm256_set1_epi32(static_cast<int>(0x82000000u)));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 d = _mm256_cmp_ps(absn, _mm256_set1_ps(192), _CMP_GT_OQ);
  return _mm256_or_ps(_mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
                      _mm256_andnot_ps(d, _mm256_or_ps(_mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                       _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)))));
}

/// attn_tiled.h's primitives: register-tiled F32 GEMM (RM rows × RN vectors of 8 columns, each output one FMA
/// chain in k order, as simd-gemm.h) and ggml_vec_soft_max_f32's AVX2 loop.
struct TiledAvx2 {
#if defined(PI_KERNELS_VNNI)
  static constexpr int RM = 6, RN = 4;  // 24 accumulators of the 32 registers
#else
  static constexpr int RM = 6, RN = 2;  // 12 accumulators of the 16 registers
#endif
  template <int R, int N>
  static void ukernel(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K) {
    __m256 acc[R][N];
    for (int i = 0; i < R; i++) {
      for (int c = 0; c < N; c++) acc[i][c] = _mm256_loadu_ps(C + i * ldc + 8 * c);
    }
    for (int64_t kk = 0; kk < K; kk++) {
      __m256 b[N];
      for (int c = 0; c < N; c++) b[c] = _mm256_loadu_ps(B + kk * ldb + 8 * c);
      for (int i = 0; i < R; i++) {
        const __m256 a = _mm256_broadcast_ss(A + i * lda + kk);
        for (int c = 0; c < N; c++) acc[i][c] = _mm256_fmadd_ps(b[c], a, acc[i][c]);
      }
    }
    for (int i = 0; i < R; i++) {
      for (int c = 0; c < N; c++) _mm256_storeu_ps(C + i * ldc + 8 * c, acc[i][c]);
    }
  }
  template <int R>
  static void rows(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, int64_t N) {
    int64_t j = 0;
    for (; j + 8 * RN <= N; j += 8 * RN) ukernel<R, RN>(C + j, ldc, A, lda, B + j, ldb, K);
    for (; j < N; j += 8) ukernel<R, 1>(C + j, ldc, A, lda, B + j, ldb, K);
  }
  static void gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t K,
                   int64_t N) {
    int64_t i = 0;
    for (; i + RM <= M; i += RM) rows<RM>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K, N);
    const int64_t rest = M - i;
    if (rest >= 4) {
      rows<4>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K, N);
      i += 4;
    }
    if (M - i >= 2) {
      rows<2>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K, N);
      i += 2;
    }
    if (M - i >= 1) rows<1>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K, N);
  }
  template <int KV>
  static __m256 load8(const uint8_t* row, int64_t d) {
    return KV ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d)))
              : _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  }
  template <int KV>
  static void pack(int64_t hd, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride, int64_t kv, float* Kt,
                   int64_t ldkt, float* V32) {
    for (int64_t j = 0; j < kv; j++) {
      const uint8_t* vr = v + static_cast<size_t>(j) * vstride;
      for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(V32 + j * hd + d, load8<KV>(vr, d));
    }
    int64_t j = 0;
    for (; j + 8 <= kv; j += 8) {
      // 8 keys × 8 dims at a time, transposed in registers (hd is a multiple of 8)
      for (int64_t d = 0; d < hd; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = load8<KV>(k + static_cast<size_t>(j + i) * kstride, d);
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* o = Kt + d * ldkt + j;
        _mm256_storeu_ps(o + 0 * ldkt, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(o + 1 * ldkt, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(o + 2 * ldkt, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(o + 3 * ldkt, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(o + 4 * ldkt, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(o + 5 * ldkt, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(o + 6 * ldkt, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(o + 7 * ldkt, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
    }
    for (; j < kv; j++) {
      const uint8_t* kr = k + static_cast<size_t>(j) * kstride;
      for (int64_t d = 0; d < hd; d++) Kt[d * ldkt + j] = KV ? h2f(load_u16(kr + 2 * d)) : reinterpret_cast<const float*>(kr)[d];
    }
  }
  static float scale_max(int64_t n, float* y, int64_t from, int64_t to, float scale) {
    // max is exact, so the lanes' order does not matter
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mx = ninf;
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(j)));
      const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(from)), idx),
                                             _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(to)), idx));
      const __m256 keep = _mm256_castsi256_ps(in);
      const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(y + j), vs), keep);
      _mm256_storeu_ps(y + j, x);
      mx = _mm256_max_ps(mx, x);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static double soft_max(int64_t n, float* y, float max) {
    double sum = 0.0;
    const __m256 vm = _mm256_set1_ps(max);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 val = v_expf_ggml(_mm256_sub_ps(_mm256_loadu_ps(y + i), vm));
      _mm256_storeu_ps(y + i, val);
      sum += static_cast<double>(hsum_ps(val));
    }
    return sum;
  }
};

double sum_f32(const float* x, int64_t n) {
  // Four concurrent streams (the quarters of the array), as matrix × vector reads four rows at once:
  // one stream per core leaves DRAM bandwidth unused, and the probe should measure what is attainable.
  const int64_t q = n / 4 / 8 * 8;
  const float* p[4] = {x, x + q, x + 2 * q, x + 3 * q};
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  for (int64_t i = 0; i < q; i += 8) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p[0] + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p[1] + i));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p[2] + i));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p[3] + i));
  }
  double t = hsum_ps(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (int64_t i = 4 * q; i < n; i++) t += x[i];
  return t;
}

DotFn dot_of(int dt) {
  switch (dt) {
    case DT_Q4_0: return dot_q4_0;
    case DT_Q4_1: return dot_q4_1;
    case DT_Q5_0: return dot_q5_0;
    case DT_Q5_1: return dot_q5_1;
    case DT_Q8_0: return dot_q8_0;
    case DT_Q4_K: return dot_q4_K;
    case DT_Q5_K: return dot_q5_K;
    default: return dot_q6_K;
  }
}

template <int DT>
void dot_tile_loop(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  const DotFn dot = dot_of(DT);
  for (int r = 0; r < nr; r++) {
    for (int c = 0; c < nc; c++) out[r * nc + c] = dot(k, w[r], x[c]);
  }
}

KernelTable make_table() {
  KernelTable t = kernels_scalar();  // dequant and conversions not specialised here
#if defined(PI_KERNELS_VNNI)
  t.name = "avx2+avx512vnni";
#else
  t.name = "avx2";
#endif
  t.dot[DT_F32] = dot_f<0>;
  t.dot[DT_F16] = dot_f<1>;
  t.dot[DT_BF16] = dot_f<2>;
  t.dot_tile[DT_F32] = dot_tile_f<0>;
  t.dot_tile[DT_F16] = dot_tile_f<1>;
  t.dot_tile[DT_BF16] = dot_tile_f<2>;
  t.gemm_tile[DT_F32] = gemm_tile_f<0>;
  t.gemm_tile[DT_F16] = gemm_tile_f<1>;
  t.gemm_tile[DT_BF16] = gemm_tile_f<2>;
#if defined(PI_KERNELS_VNNI)
  t.gemm_tile_pairs[DT_F32] = gemm_tile_pairs_f<0>;
  t.gemm_tile_pairs[DT_F16] = gemm_tile_pairs_f<1>;
  t.gemm_tile_pairs[DT_BF16] = gemm_tile_pairs_f<2>;
#endif
  t.dot_tile[DT_Q4_0] = dot_tile_q4_0;
  t.tile_rows[DT_Q4_0] = 8;
  t.dot_rows8_next[DT_Q4_0] = dot_rows8_next_q4_0;
  t.axpy_rows_next[DT_Q4_0] = axpy_rows_next_q4_0;
  t.packed_tile[DT_Q4_0] = packed_tile<Q4_0x8Kernel>;
  t.packed_tile[DT_Q4_K] = packed_tile<Q4_Kx8Kernel>;
  t.dot_tile[DT_Q4_1] = dot_tile_loop<DT_Q4_1>;
  t.dot_tile[DT_Q5_0] = dot_tile_loop<DT_Q5_0>;
  t.dot_tile[DT_Q5_1] = dot_tile_loop<DT_Q5_1>;
  t.dot_tile[DT_Q8_0] = dot_tile_rows<dot_rows_q8_0<1>, dot_rows_q8_0<2>, dot_rows_q8_0<3>, dot_rows_q8_0<4>>;
  t.gemm_tile[DT_Q8_0] = gemm_tile_q8_0;
  t.gemm_is_dot[DT_Q8_0] = true;  // dot_rows_q8_0 and gemm_tile_q8_0_t: the same lanes, scale FMA and hsum
  t.gemm_cols = kGemmCols;
  t.dot_tile[DT_Q4_K] = dot_tile_q4_K;
  t.dot_tile[DT_Q5_K] = dot_tile_loop<DT_Q5_K>;
  t.dot_tile[DT_Q6_K] = dot_tile_loop<DT_Q6_K>;
  t.dot[DT_Q4_0] = dot_q4_0;
  t.dot[DT_Q4_1] = dot_q4_1;
  t.dot[DT_Q5_0] = dot_q5_0;
  t.dot[DT_Q5_1] = dot_q5_1;
  t.dot[DT_Q8_0] = dot_q8_0;
  t.dot[DT_Q4_K] = dot_q4_K;
  t.dot[DT_Q5_K] = dot_q5_K;
  t.dot[DT_Q6_K] = dot_q6_K;
  t.dequant[DT_F16] = dequant_f16;
  t.dequant[DT_Q4_K] = dequant_q4_K;
  t.axpy[DT_F32] = axpy_f32;
  t.axpy[DT_F16] = axpy_f16;
  t.axpy[DT_BF16] = axpy_bf16;
  t.axpy[DT_Q4_0] = axpy_q4_0;
  t.axpy[DT_Q8_0] = axpy_q8_0;
  t.axpy[DT_Q4_1] = axpy_blocks<DT_Q4_1, QK, 20>;
  t.axpy[DT_Q5_0] = axpy_blocks<DT_Q5_0, QK, 22>;
  t.axpy[DT_Q5_1] = axpy_blocks<DT_Q5_1, QK, 24>;
  t.axpy[DT_Q4_K] = axpy_q4_K;
  t.axpy[DT_Q5_K] = axpy_blocks<DT_Q5_K, QK_K, 176>;
  t.axpy[DT_Q6_K] = axpy_blocks<DT_Q6_K, QK_K, 210>;
  t.axpy_rows[DT_F32] = axpy_rows_of<axpy_rows_float_n<1, 4, load_f32v, elem_f32>, axpy_rows_float_n<2, 4, load_f32v, elem_f32>,
                                      axpy_rows_float_n<3, 4, load_f32v, elem_f32>, axpy_rows_float_n<4, 4, load_f32v, elem_f32>>;
  t.axpy_rows[DT_F16] = axpy_rows_of<axpy_rows_float_n<1, 2, load_f16v, elem_f16>, axpy_rows_float_n<2, 2, load_f16v, elem_f16>,
                                      axpy_rows_float_n<3, 2, load_f16v, elem_f16>, axpy_rows_float_n<4, 2, load_f16v, elem_f16>>;
  t.axpy_rows[DT_BF16] = axpy_rows_of<axpy_rows_float_n<1, 2, load_bf16v, elem_bf16>, axpy_rows_float_n<2, 2, load_bf16v, elem_bf16>,
                                       axpy_rows_float_n<3, 2, load_bf16v, elem_bf16>, axpy_rows_float_n<4, 2, load_bf16v, elem_bf16>>;
  t.axpy_rows[DT_Q4_0] = axpy_rows_of<axpy_rows_q4_0_n<1>, axpy_rows_q4_0_n<2>, axpy_rows_q4_0_n<3>, axpy_rows_q4_0_n<4>>;
  t.axpy_rows[DT_Q8_0] = axpy_rows_of<axpy_rows_q8_0_n<1>, axpy_rows_q8_0_n<2>, axpy_rows_q8_0_n<3>, axpy_rows_q8_0_n<4>>;
  t.axpy_rows[DT_Q4_1] = axpy_rows_blocks<DT_Q4_1, QK, 20>;
  t.axpy_rows[DT_Q5_0] = axpy_rows_blocks<DT_Q5_0, QK, 22>;
  t.axpy_rows[DT_Q5_1] = axpy_rows_blocks<DT_Q5_1, QK, 24>;
  t.axpy_rows[DT_Q4_K] = axpy_rows_of<axpy_rows_q4_K_n<1>, axpy_rows_q4_K_n<2>, axpy_rows_q4_K_n<3>, axpy_rows_q4_K_n<4>>;
  t.axpy_rows[DT_Q5_K] = axpy_rows_blocks<DT_Q5_K, QK_K, 176>;
  t.axpy_rows[DT_Q6_K] = axpy_rows_blocks<DT_Q6_K, QK_K, 210>;
  t.slice_i8[DT_Q4_0] = slice_i8<DT_Q4_0>;
  t.slice_i8[DT_Q8_0] = slice_i8<DT_Q8_0>;
  t.axpy_gather[SK_I8] = axpy_gather<SK_I8>;
  t.axpy_gather[SK_F16] = axpy_gather<SK_F16>;
  t.axpy_gather[SK_F32] = axpy_gather<SK_F32>;
  t.convert[XF_F16] = convert_f16;
  t.convert[XF_Q8_0] = convert_q8<false>;
  t.convert[XF_Q8_1] = convert_q8<true>;
  t.store_f16 = store_f16;
  t.dot_f32 = dot_f32v;
  t.axpy_f32 = axpy_f32v;
  t.attn_row[0][0] = attn_row_ggml<GgmlAvx2, 0, 0>;
  t.attn_row[0][1] = attn_row_ggml<GgmlAvx2, 0, 1>;
  t.attn_row[1][0] = attn_row_ggml<GgmlAvx2, 1, 0>;
  t.attn_row[1][1] = attn_row_ggml<GgmlAvx2, 1, 1>;
  t.attn_rows[0][0] = attn_rows_ggml<GgmlAvx2, 0, 0>;
  t.attn_rows[0][1] = attn_rows_ggml<GgmlAvx2, 0, 1>;
  t.attn_rows[1][0] = attn_rows_ggml<GgmlAvx2, 1, 0>;
  t.attn_rows[1][1] = attn_rows_ggml<GgmlAvx2, 1, 1>;
  t.attn_tile[0] = attn_tile_ggml<TiledAvx2, 0>;
  t.attn_tile[1] = attn_tile_ggml<TiledAvx2, 1>;
  t.sum_f32 = sum_f32;
  return t;
}

}  // namespace

#if defined(PI_KERNELS_VNNI)
const KernelTable& kernels_avx2_vnni() {
#else
const KernelTable& kernels_avx2() {
#endif
  static const KernelTable table = make_table();
  return table;
}

}  // namespace pi
