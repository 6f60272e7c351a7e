// The GPU kernels of powerinfer-ts, one source for CUDA (nvcc), ROCm (hipcc) and the CPU emulator
// (see port.h). Op contracts: packages/core/src/backend/graph.ts.
//
// Rules that keep this file portable:
// - no warp size is assumed: warp-level reductions loop from PI_WARP / 2, block reductions keep one
//   shared slot per warp (at most kThreads / 32 of them) and every block is a whole number of warps;
// - every thread of a block reaches every barrier and every shuffle (early exits are block-uniform);
// - weights are read with 2-byte loads at most (quantized blocks are 18 or 34 bytes long), so any
//   row length and any dtype work without alignment assumptions;
// - results never depend on the number of blocks: reductions run in a fixed order (the sparse
//   down projection sums per-chunk partials in chunk order), so a GPU run is deterministic.
#include "port.h"
// port.h first: it defines PI_HD for dtype.h
#include "dtype.h"
#include "kernels.h"
#include "runtime.h"

#include <cmath>

namespace pigpu {
namespace {

constexpr int kThreads = 128;      // row kernels: threads per block (a multiple of 64)
constexpr int kEltThreads = 256;   // elementwise kernels
constexpr int kTok = 8;            // tokens (columns) per block in matrix kernels
constexpr int kMaxWarps = 1024 / 32;
constexpr int kAttnTile = 64;      // cache positions per attention tile
constexpr int kAxpyCols = 2 * kThreads;  // output elements per axpy block (two per thread)

inline unsigned blocks_for(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

PI_DEV inline float load_half(const uint8_t* p) {
  return pi_half_to_float(*reinterpret_cast<const uint16_t*>(p));
}

// ---- weights: one element, or a chunk of 8 ----

/// Element e of a weight row.
template <int DT>
PI_DEV inline float weight_at(const uint8_t* row, int64_t e) {
  if (DT == DT_F32) return reinterpret_cast<const float*>(row)[e];
  if (DT == DT_F16) return pi_half_to_float(reinterpret_cast<const uint16_t*>(row)[e]);
  if (DT == DT_BF16) return pi_bf16_to_float(reinterpret_cast<const uint16_t*>(row)[e]);
  if (DT == DT_Q8_0) {
    const uint8_t* b = row + (e / 32) * 34;
    return load_half(b) * static_cast<float>(static_cast<int8_t>(b[2 + e % 32]));
  }
  // DT_Q4_0: byte j holds element j (low nibble) and element j + 16 (high nibble)
  const uint8_t* b = row + (e / 32) * 18;
  const int r = static_cast<int>(e % 32);
  const int byte = b[2 + (r & 15)];
  const int q = r < 16 ? (byte & 15) : (byte >> 4);
  return load_half(b) * static_cast<float>(q - 8);
}

/// Eight weights of a row and where their activations are: w[0..3] pair with x[o0 .. o0+3],
/// w[4..7] with x[o1 .. o1+3]; n0/n1 of each run lie inside the row (float rows end anywhere).
struct Chunk {
  float w[8];
  int64_t o0, o1;
  int n0, n1;
};

/// 16 bytes loaded at once (one vector load on the GPU) from a 16-byte aligned address.
struct alignas(16) U128 {
  uint32_t w[4];
};

template <int DT>
PI_DEV inline void load_chunk(const uint8_t* row, int64_t c, int64_t k, Chunk& ch) {
  if (DT == DT_F32 || DT == DT_F16 || DT == DT_BF16) {
    ch.o0 = 8 * c;
    ch.o1 = 8 * c + 4;
    const int64_t left = k - ch.o0;
    ch.n0 = left >= 4 ? 4 : static_cast<int>(left);
    ch.n1 = left >= 8 ? 4 : (left > 4 ? static_cast<int>(left - 4) : 0);
    const int es = DT == DT_F32 ? 4 : 2;
    const uint8_t* p = row + ch.o0 * es;
    if (left >= 8 && reinterpret_cast<uintptr_t>(p) % 16 == 0) {  // whole chunk, aligned: vector loads
      U128 v[2];
      v[0] = reinterpret_cast<const U128*>(p)[0];
      if (DT == DT_F32) {
        v[1] = reinterpret_cast<const U128*>(p)[1];
        for (int j = 0; j < 8; j++) ch.w[j] = pi_bits_to_float(v[j / 4].w[j % 4]);
      } else {
        for (int j = 0; j < 8; j++) {
          const uint16_t h = static_cast<uint16_t>(v[0].w[j / 2] >> (16 * (j % 2)));
          ch.w[j] = DT == DT_F16 ? pi_half_to_float(h) : pi_bf16_to_float(h);
        }
      }
      return;
    }
    for (int j = 0; j < 8; j++) {
      const int64_t e = ch.o0 + j;
      ch.w[j] = e < k ? weight_at<DT>(row, e) : 0.0f;
    }
    return;
  }
  const int64_t blk = c / 4;
  const int q = static_cast<int>(c % 4);
  ch.n0 = ch.n1 = 4;
  if (DT == DT_Q8_0) {
    const uint8_t* b = row + blk * 34;
    const float d = load_half(b);
    ch.o0 = blk * 32 + 8 * q;
    ch.o1 = ch.o0 + 4;
    for (int j = 0; j < 8; j++) ch.w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + 8 * q + j]));
    return;
  }
  const uint8_t* b = row + blk * 18;  // DT_Q4_0: bytes 4q..4q+3 → elements 4q.. and 16+4q..
  const float d = load_half(b);
  ch.o0 = blk * 32 + 4 * q;
  ch.o1 = ch.o0 + 16;
  for (int j = 0; j < 4; j++) {
    const int byte = b[2 + 4 * q + j];
    ch.w[j] = d * static_cast<float>((byte & 15) - 8);
    ch.w[4 + j] = d * static_cast<float>((byte >> 4) - 8);
  }
}

PI_DEV inline float chunk_dot(const Chunk& ch, const float* x) {
  float s = 0.0f;
  for (int j = 0; j < 4; j++)
    if (j < ch.n0) s += ch.w[j] * x[ch.o0 + j];
  for (int j = 0; j < 4; j++)
    if (j < ch.n1) s += ch.w[4 + j] * x[ch.o1 + j];
  return s;
}

// ---- block reductions (every thread of the block calls them and gets the result) ----

/// Sums v[0..n) over the block; `sh` is shared memory of kTok · kMaxWarps floats.
PI_DEV inline void block_sum_n(float* v, int n, float* sh) {
  const int lane = static_cast<int>(threadIdx.x) % PI_WARP;
  const int warp = static_cast<int>(threadIdx.x) / PI_WARP;
  const int nw = static_cast<int>(blockDim.x) / PI_WARP;
  for (int j = 0; j < kTok; j++) {
    if (j < n) v[j] = pi_warp_sum(v[j]);
  }
  __syncthreads();  // sh may still be read by an earlier reduction
  if (lane == 0) {
    for (int j = 0; j < kTok; j++)
      if (j < n) sh[j * kMaxWarps + warp] = v[j];
  }
  __syncthreads();
  for (int j = 0; j < kTok; j++) {
    if (j >= n) continue;
    float s = 0.0f;
    for (int w = 0; w < nw; w++) s += sh[j * kMaxWarps + w];
    v[j] = s;
  }
}

PI_DEV inline float block_sum(float v, float* sh) {
  float a[kTok];
  a[0] = v;
  block_sum_n(a, 1, sh);
  return a[0];
}

PI_DEV inline float block_max(float v, float* sh) {
  const int lane = static_cast<int>(threadIdx.x) % PI_WARP;
  const int warp = static_cast<int>(threadIdx.x) / PI_WARP;
  const int nw = static_cast<int>(blockDim.x) / PI_WARP;
  v = pi_warp_max(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float m = sh[0];
  for (int w = 1; w < nw; w++) m = sh[w] > m ? sh[w] : m;
  return m;
}

// ---- get_rows ----

template <int DT>
PI_KERNEL void k_get_rows(const uint8_t* w, uint64_t row_bytes, int64_t k, const int32_t* ids, float* y) {
  const int64_t t = blockIdx.y;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < k) y[t * k + e] = weight_at<DT>(w + static_cast<uint64_t>(ids[t]) * row_bytes, e);
}

// ---- mul_mat and mul_mat_sparse: one block per weight row, kTok tokens per block ----

/// Dots of one weight row with the columns t0.. (bit j of `mask`: column t0 + j), summed over the block.
template <int DT>
PI_DEV inline void row_dots(const uint8_t* row, int64_t k, const float* x, int64_t t0, unsigned mask, float* acc,
                            float* sh) {
  for (int j = 0; j < kTok; j++) acc[j] = 0.0f;
  const int64_t nchunks = (k + 7) / 8;
  for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
    Chunk ch;
    load_chunk<DT>(row, c, k, ch);
    for (int j = 0; j < kTok; j++) {
      if (mask & (1u << j)) acc[j] += chunk_dot(ch, x + (t0 + j) * k);
    }
  }
  int n = 0;  // highest column + 1 (block-uniform)
  for (int j = 0; j < kTok; j++)
    if (mask & (1u << j)) n = j + 1;
  block_sum_n(acc, n, sh);
}

template <int DT>
PI_KERNEL void k_mul_mat(const uint8_t* w, uint64_t row_bytes, int64_t k, int64_t n_rows, const float* x, int64_t t,
                         float* y) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t r = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  const unsigned mask = (1u << nt) - 1u;
  float acc[kTok];
  row_dots<DT>(w + static_cast<uint64_t>(r) * row_bytes, k, x, t0, mask, acc, sh);
  if (threadIdx.x == 0) {
    for (int j = 0; j < nt; j++) y[(t0 + j) * n_rows + r] = acc[j];
  }
}

/// Whether neuron i is active for each of the columns t0.. (bit j: column t0 + j). Block-uniform.
PI_DEV inline unsigned active_mask(const float* logits, float threshold, int64_t n_out, int64_t i, int64_t t0,
                                   int64_t nt) {
  unsigned m = 0;
  for (int j = 0; j < nt; j++) {
    if (!logits || logits[(t0 + j) * n_out + i] >= threshold) m |= 1u << j;
  }
  return m;
}

PI_DEV inline int popcount8(unsigned m) {
  int c = 0;
  for (int j = 0; j < kTok; j++) c += (m >> j) & 1u;
  return c;
}

template <int DT>
PI_KERNEL void k_mul_mat_sparse(const uint8_t* w, uint64_t row_bytes, int64_t k, const float* x, int64_t t,
                                const float* logits, const int32_t* rows, int compact, float threshold, int64_t n_out,
                                unsigned long long* rows_read, float* y) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t j = blockIdx.x;  // candidate
  const int64_t i = rows ? rows[j] : j;
  const int64_t wrow = rows && compact ? j : i;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  const unsigned mask = active_mask(logits, threshold, n_out, i, t0, nt);
  if (mask == 0) return;  // the whole block: the row is never read
  float acc[kTok];
  row_dots<DT>(w + static_cast<uint64_t>(wrow) * row_bytes, k, x, t0, mask, acc, sh);
  if (threadIdx.x == 0) {
    for (int c = 0; c < nt; c++)
      if (mask & (1u << c)) y[(t0 + c) * n_out + i] = acc[c];
    pi_atomic_add_u64(rows_read, static_cast<unsigned long long>(popcount8(mask)));
  }
}

// ---- axpy_sparse: y[:, t] = Σ_active a[i, t] · Wt-row(i) ----
// grid: x = slices of kAxpyCols output elements, y = chunks of candidates, z = groups of kTok columns.
// Each block writes its partial sums for its (slice, chunk, columns) to part (chunk-major); when there
// is a single chunk it writes y directly. k_sum_chunks adds the chunks in order.

template <int DT>
PI_KERNEL void k_axpy_sparse(const uint8_t* w, uint64_t row_bytes, int64_t e_len, const float* a, int64_t t,
                             const float* logits, const int32_t* rows, int64_t n_cand, int compact, float threshold,
                             int64_t n_out, int64_t chunk, unsigned long long* rows_read, float* out) {
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * kAxpyCols + threadIdx.x;
  const int64_t e1 = e0 + kThreads;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t c1 = c0 + chunk < n_cand ? c0 + chunk : n_cand;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  float acc0[kTok], acc1[kTok];
  for (int j = 0; j < kTok; j++) acc0[j] = acc1[j] = 0.0f;
  unsigned long long counted = 0;
  for (int64_t c = c0; c < c1; c++) {
    const int64_t i = rows ? rows[c] : c;
    const unsigned mask = active_mask(logits, threshold, n_out, i, t0, nt);
    if (mask == 0) continue;
    counted += static_cast<unsigned long long>(popcount8(mask));
    const uint8_t* row = w + static_cast<uint64_t>(rows && compact ? c : i) * row_bytes;
    const float w0 = e0 < e_len ? weight_at<DT>(row, e0) : 0.0f;
    const float w1 = e1 < e_len ? weight_at<DT>(row, e1) : 0.0f;
    for (int j = 0; j < kTok; j++) {
      if (!(mask & (1u << j))) continue;
      const float ai = a[(t0 + j) * n_out + i];
      acc0[j] += ai * w0;
      acc1[j] += ai * w1;
    }
  }
  // out is [chunks][t][e_len] (or y itself, [t][e_len], with one chunk)
  float* o = out + static_cast<int64_t>(blockIdx.y) * t * e_len;
  for (int j = 0; j < nt; j++) {
    if (e0 < e_len) o[(t0 + j) * e_len + e0] = acc0[j];
    if (e1 < e_len) o[(t0 + j) * e_len + e1] = acc1[j];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && counted) pi_atomic_add_u64(rows_read, counted);
}

PI_KERNEL void k_sum_chunks(const float* part, int64_t chunks, int64_t n, float* y) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; c++) s += part[c * n + idx];
  y[idx] = s;
}

// ---- norms and softmax: one block per column ----

PI_KERNEL void k_rms_norm(const float* x, float* y, int64_t n, float eps) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const float* xc = x + static_cast<int64_t>(blockIdx.x) * n;
  float* yc = y + static_cast<int64_t>(blockIdx.x) * n;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += xc[i] * xc[i];
  s = block_sum(s, sh);
  const float r = 1.0f / sqrtf(s / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yc[i] = xc[i] * r;
}

PI_KERNEL void k_norm(const float* x, float* y, int64_t n, float eps) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const float* xc = x + static_cast<int64_t>(blockIdx.x) * n;
  float* yc = y + static_cast<int64_t>(blockIdx.x) * n;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += xc[i];
  const float mean = block_sum(s, sh) / static_cast<float>(n);
  float v = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += (xc[i] - mean) * (xc[i] - mean);
  const float r = 1.0f / sqrtf(block_sum(v, sh) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yc[i] = (xc[i] - mean) * r;
}

PI_KERNEL void k_softmax(const float* x, float* y, int64_t n, float scale) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const float* xc = x + static_cast<int64_t>(blockIdx.x) * n;
  float* yc = y + static_cast<int64_t>(blockIdx.x) * n;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, scale * xc[i]);
  m = block_max(m, sh);
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = expf(scale * xc[i] - m);
    yc[i] = e;
    s += e;
  }
  const float inv = 1.0f / block_sum(s, sh);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yc[i] *= inv;
}

// ---- rope: one thread per element; θ in double precision ----

PI_KERNEL void k_rope(const float* x, const int32_t* pos, float* y, int64_t n, int head_dim, int n_dims, int mode,
                      double freq_base, double freq_scale) {
  const int64_t t = blockIdx.y;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const float* xc = x + t * n;
  const int r = static_cast<int>(idx % head_dim);
  const int64_t base = idx - r;
  if (r >= n_dims) {
    y[t * n + idx] = xc[idx];
    return;
  }
  int i, i0, i1;
  if (mode == 2) {  // NeoX: (i, i + n_dims/2)
    const int half = n_dims / 2;
    i = r % half;
    i0 = i;
    i1 = i + half;
  } else {  // normal: (2i, 2i + 1)
    i = r / 2;
    i0 = 2 * i;
    i1 = 2 * i + 1;
  }
  const double theta = static_cast<double>(pos[t]) * freq_scale * pow(freq_base, -2.0 * i / n_dims);
  const float c = static_cast<float>(cos(theta));
  const float s = static_cast<float>(sin(theta));
  const float x0 = xc[base + i0];
  const float x1 = xc[base + i1];
  y[t * n + idx] = r == i0 ? x0 * c - x1 * s : x0 * s + x1 * c;
}

// ---- attention with the KV cache: one block per (head, token), online softmax over tiles ----

template <int KVDT>
PI_DEV inline float kv_at(const void* p, int64_t i) {
  if (KVDT == DT_F16) return pi_half_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

template <int KVDT>
PI_KERNEL void k_attention(const float* q, const void* kc, const void* vc, float* y, int head_dim, int n_head,
                           int n_head_kv, int64_t n_past, float scale, int64_t window) {
  PI_SHARED float qs[kMaxHeadDim];
  PI_SHARED float s[kAttnTile];
  const int h = static_cast<int>(blockIdx.x);
  const int64_t t = blockIdx.y;
  const int g = h / (n_head / n_head_kv);
  const int64_t q_row = static_cast<int64_t>(head_dim) * n_head;
  const int64_t kv_row = static_cast<int64_t>(head_dim) * n_head_kv;
  const int64_t n_kv = n_past + t + 1;  // causal: positions 0 .. n_past + t
  // sliding window: positions n_kv − window .. n_past + t only
  const int64_t p_first = window > 0 && n_kv > window ? n_kv - window : 0;
  const int tid = static_cast<int>(threadIdx.x);
  const int nth = static_cast<int>(blockDim.x);
  const int lane = tid % PI_WARP;
  const int warp = tid / PI_WARP;
  const int nw = nth / PI_WARP;
  for (int j = tid; j < head_dim; j += nth) qs[j] = q[t * q_row + static_cast<int64_t>(h) * head_dim + j];
  float acc[kMaxHeadDim / kThreads];
  for (int k = 0; k < kMaxHeadDim / kThreads; k++) acc[k] = 0.0f;
  float m = -INFINITY;  // running maximum of the scores
  float l = 0.0f;       // running sum of exp(score − m)
  __syncthreads();
  for (int64_t p0 = p_first; p0 < n_kv; p0 += kAttnTile) {
    const int np = static_cast<int>(n_kv - p0 < kAttnTile ? n_kv - p0 : kAttnTile);
    for (int pp = warp; pp < np; pp += nw) {  // one warp per position, lanes over the head dimension
      const int64_t off = (p0 + pp) * kv_row + static_cast<int64_t>(g) * head_dim;
      float d = 0.0f;
      for (int j = lane; j < head_dim; j += PI_WARP) d += qs[j] * kv_at<KVDT>(kc, off + j);
      d = pi_warp_sum(d);
      if (lane == 0) s[pp] = d * scale;
    }
    __syncthreads();
    float mt = m;
    for (int i = 0; i < np; i++) mt = s[i] > mt ? s[i] : mt;
    const float corr = expf(m - mt);  // 0 on the first tile (m = −∞)
    __syncthreads();                  // every thread has read the scores
    for (int i = tid; i < np; i += nth) s[i] = expf(s[i] - mt);
    __syncthreads();
    float lt = 0.0f;
    for (int i = 0; i < np; i++) lt += s[i];
    l = l * corr + lt;
    for (int k = 0; k < kMaxHeadDim / kThreads; k++) {
      const int j = tid + k * nth;
      if (j >= head_dim) break;
      float a = acc[k] * corr;
      const int64_t off = p0 * kv_row + static_cast<int64_t>(g) * head_dim + j;
      for (int i = 0; i < np; i++) a += s[i] * kv_at<KVDT>(vc, off + i * kv_row);
      acc[k] = a;
    }
    m = mt;
    __syncthreads();  // before the next tile overwrites s
  }
  const float inv = 1.0f / l;
  for (int k = 0; k < kMaxHeadDim / kThreads; k++) {
    const int j = tid + k * nth;
    if (j < head_dim) y[t * q_row + static_cast<int64_t>(h) * head_dim + j] = acc[k] * inv;
  }
}

// ---- routed experts ----

/// top_k: one thread per column, k passes; pass j takes the largest value after pick j−1 in the order
/// (value descending, index ascending). A column of NaNs yields index 0 (always a valid expert).
PI_KERNEL void k_top_k(const float* x, int64_t n, int k, int64_t t, int32_t* ids) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= t) return;
  const float* xc = x + c * n;
  float pv = 0.0f;
  int64_t pi = -1;  // previous pick (none yet)
  for (int j = 0; j < k; j++) {
    int64_t best = -1;
    float bv = 0.0f;
    for (int64_t i = 0; i < n; i++) {
      const float v = xc[i];
      if (pi >= 0 && !(v < pv || (v == pv && i > pi))) continue;  // not after the previous pick
      if (best < 0 || v > bv) {  // ascending i: an equal value never displaces a lower index
        if (v == v) {
          best = i;
          bv = v;
        }
      }
    }
    if (best < 0) best = 0;
    ids[c * k + j] = static_cast<int32_t>(best);
    pv = bv;
    pi = best;
  }
}

/// mul_mat_id / mul_mat_id_sparse: one block per (row r, column c = t·U + u).
template <int DT>
PI_KERNEL void k_mul_mat_id(const uint8_t* w, uint64_t row_bytes, uint64_t expert_bytes, int64_t k, int64_t m,
                            const float* x, int per_slot, int64_t n_used, const int32_t* ids, const float* logits,
                            float threshold, unsigned long long* rows_read, float* y) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t r = blockIdx.x;
  const int64_t c = blockIdx.y;
  if (logits && !(logits[c * m + r] >= threshold)) return;  // the whole block: the row is never read
  const float* xc = x + (per_slot ? c : c / n_used) * k;
  const uint8_t* row = w + static_cast<uint64_t>(ids[c]) * expert_bytes + static_cast<uint64_t>(r) * row_bytes;
  float acc[kTok];
  row_dots<DT>(row, k, xc, 0, 1u, acc, sh);
  if (threadIdx.x == 0) {
    y[c * m + r] = acc[0];
    if (rows_read) pi_atomic_add_u64(rows_read, 1ull);
  }
}

/// axpy_id_sparse: grid x = slices of kAxpyCols output elements, y = columns c; the neurons are summed
/// in order within the block (deterministic).
template <int DT>
PI_KERNEL void k_axpy_id_sparse(const uint8_t* w, uint64_t row_bytes, uint64_t expert_bytes, int64_t d, int64_t m,
                                const float* a, const int32_t* ids, const float* logits, float threshold,
                                unsigned long long* rows_read, float* y) {
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * kAxpyCols + threadIdx.x;
  const int64_t e1 = e0 + kThreads;
  const int64_t c = blockIdx.y;
  const uint8_t* ex = w + static_cast<uint64_t>(ids[c]) * expert_bytes;
  float acc0 = 0.0f, acc1 = 0.0f;
  unsigned long long counted = 0;
  for (int64_t i = 0; i < m; i++) {
    if (logits && !(logits[c * m + i] >= threshold)) continue;
    counted++;
    const float ai = a[c * m + i];
    const uint8_t* row = ex + static_cast<uint64_t>(i) * row_bytes;
    if (e0 < d) acc0 += ai * weight_at<DT>(row, e0);
    if (e1 < d) acc1 += ai * weight_at<DT>(row, e1);
  }
  if (e0 < d) y[c * d + e0] = acc0;
  if (e1 < d) y[c * d + e1] = acc1;
  if (blockIdx.x == 0 && threadIdx.x == 0 && counted) pi_atomic_add_u64(rows_read, counted);
}

/// moe_sum: one thread per output element.
PI_KERNEL void k_moe_sum(const float* y, const float* probs, const int32_t* ids, int64_t d, int64_t n_expert,
                         int64_t n_used, int norm, float scale, int64_t total, float* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int64_t t = idx / d;
  const int64_t i = idx % d;
  const float* p = probs + t * n_expert;
  const int32_t* id = ids + t * n_used;
  float div = 1.0f;
  if (norm) {
    float s = 0.0f;
    for (int64_t u = 0; u < n_used; u++) s += p[id[u]];
    div = s > 6.103515625e-05f ? s : 6.103515625e-05f;  // 2^-14, the smallest normal F16
  }
  float acc = 0.0f;
  for (int64_t u = 0; u < n_used; u++) acc += (p[id[u]] / div) * scale * y[(t * n_used + u) * d + i];
  out[idx] = acc;
}

// ---- elementwise ----

PI_KERNEL void k_binary(int op, const float* a, const float* b, float* y, int64_t n, int64_t nb) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float bv = b[nb == n ? i : i % nb];
  y[i] = op == BINARY_ADD ? a[i] + bv : a[i] * bv;
}

PI_KERNEL void k_unary(int op, const float* x, float* y, int64_t n, float param) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  float r;
  switch (op) {
    case UNARY_SCALE: r = v * param; break;
    case UNARY_SILU: r = v / (1.0f + expf(-v)); break;
    case UNARY_RELU: r = v > 0.0f ? v : 0.0f; break;
    case UNARY_SIGMOID: r = 1.0f / (1.0f + expf(-v)); break;
    default: {  // gelu, tanh approximation
      const float c = 0.7978845608028654f;  // sqrt(2/π)
      r = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
    }
  }
  y[i] = r;
}

PI_KERNEL void k_cpy(const float* src, void* dst, int dst_dtype, int64_t n, int64_t total, int64_t row_offset) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t o = row_offset * n + i;
  if (dst_dtype == DT_F32)
    static_cast<float*>(dst)[o] = src[i];
  else if (dst_dtype == DT_F16)
    static_cast<uint16_t*>(dst)[o] = pi_float_to_half(src[i]);
  else
    static_cast<uint16_t*>(dst)[o] = pi_float_to_bf16(src[i]);
}

PI_KERNEL void k_slice(const float* x, float* y, int64_t n, int64_t offset, int64_t length, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t t = i / length;
  y[i] = x[t * n + offset + i % length];
}

pi_stream_t as_stream(void* s) { return static_cast<pi_stream_t>(s); }

unsigned token_groups(int64_t t) { return blocks_for(t, kTok); }

}  // namespace

// ---- launchers ----

#define PI_WEIGHT_SWITCH(dtype, CALL)                              \
  switch (dtype) {                                                 \
    case DT_F32: CALL(DT_F32); break;                              \
    case DT_F16: CALL(DT_F16); break;                              \
    case DT_BF16: CALL(DT_BF16); break;                            \
    case DT_Q8_0: CALL(DT_Q8_0); break;                            \
    case DT_Q4_0: CALL(DT_Q4_0); break;                            \
    default: throw GpuError("UNAVAILABLE", "kernels: unsupported weight dtype"); \
  }

void launch_get_rows(const Weights& w, const int32_t* ids, int64_t t, float* y, void* stream) {
  const pi_dim3 grid(blocks_for(w.k, kThreads), static_cast<unsigned>(t));
  const uint8_t* wd = static_cast<const uint8_t*>(w.data);
#define PI_CALL(DT) PI_LAUNCH(k_get_rows<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, w.row_bytes, w.k, ids, y)
  PI_WEIGHT_SWITCH(w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("get_rows");
}

void launch_mul_mat(const Weights& w, const float* x, int64_t t, float* y, void* stream) {
  const pi_dim3 grid(static_cast<unsigned>(w.rows), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(w.data);
#define PI_CALL(DT) PI_LAUNCH(k_mul_mat<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, w.row_bytes, w.k, w.rows, x, t, y)
  PI_WEIGHT_SWITCH(w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("mul_mat");
}

void launch_mul_mat_sparse(const Weights& w, const float* x, int64_t t, const Selection& s, float* y, void* stream) {
  zero_async(y, static_cast<uint64_t>(s.n_out * t) * 4, stream);
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  const pi_dim3 grid(static_cast<unsigned>(n_cand), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(w.data);
  const int compact = s.compact ? 1 : 0;
#define PI_CALL(DT)                                                                                            \
  PI_LAUNCH(k_mul_mat_sparse<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, w.row_bytes, w.k, x, t, s.logits, \
            s.rows, compact, s.threshold, s.n_out, s.rows_read, y)
  PI_WEIGHT_SWITCH(w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("mul_mat_sparse");
}

namespace {
/// Candidates per axpy chunk: enough chunks to fill the device, partials capped at 64 MiB.
int64_t axpy_chunk(const Weights& wt, int64_t t, const Selection& s) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  int64_t chunks = (n_cand + 255) / 256;
  if (chunks > 64) chunks = 64;
  const int64_t per = wt.k * t * 4;
  while (chunks > 1 && chunks * per > (int64_t{64} << 20)) chunks /= 2;
  if (chunks < 1) chunks = 1;
  return (n_cand + chunks - 1) / chunks;
}
}  // namespace

uint64_t axpy_sparse_scratch_bytes(const Weights& wt, int64_t t, const Selection& s) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  const int64_t chunk = axpy_chunk(wt, t, s);
  const int64_t chunks = (n_cand + chunk - 1) / chunk;
  return chunks > 1 ? static_cast<uint64_t>(chunks * t * wt.k) * 4 : 0;
}

void launch_axpy_sparse(const Weights& wt, const float* a, int64_t t, const Selection& s, float* y, void* scratch,
                        void* stream) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  const int64_t chunk = axpy_chunk(wt, t, s);
  const int64_t chunks = (n_cand + chunk - 1) / chunk;
  float* out = chunks > 1 ? static_cast<float*>(scratch) : y;
  const pi_dim3 grid(blocks_for(wt.k, kAxpyCols), static_cast<unsigned>(chunks), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(wt.data);
  const int compact = s.compact ? 1 : 0;
#define PI_CALL(DT)                                                                                                  \
  PI_LAUNCH(k_axpy_sparse<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, wt.row_bytes, wt.k, a, t, s.logits, \
            s.rows, n_cand, compact, s.threshold, s.n_out, chunk, s.rows_read, out)
  PI_WEIGHT_SWITCH(wt.dtype, PI_CALL)
#undef PI_CALL
  check_launch("axpy_sparse");
  if (chunks > 1) {
    const int64_t n = t * wt.k;
    PI_LAUNCH(k_sum_chunks, pi_dim3(blocks_for(n, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), out,
              chunks, n, y);
    check_launch("axpy_sparse (sum of chunks)");
  }
}

void launch_rms_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream) {
  PI_LAUNCH(k_rms_norm, pi_dim3(static_cast<unsigned>(t)), pi_dim3(kThreads), as_stream(stream), x, y, n, eps);
  check_launch("rms_norm");
}

void launch_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream) {
  PI_LAUNCH(k_norm, pi_dim3(static_cast<unsigned>(t)), pi_dim3(kThreads), as_stream(stream), x, y, n, eps);
  check_launch("norm");
}

void launch_softmax(const float* x, float* y, int64_t n, int64_t t, float scale, void* stream) {
  PI_LAUNCH(k_softmax, pi_dim3(static_cast<unsigned>(t)), pi_dim3(kThreads), as_stream(stream), x, y, n, scale);
  check_launch("softmax");
}

void launch_rope(const float* x, const int32_t* pos, float* y, int64_t n, int64_t t, int head_dim, int n_dims,
                 int mode, double freq_base, double freq_scale, void* stream) {
  const pi_dim3 grid(blocks_for(n, kEltThreads), static_cast<unsigned>(t));
  PI_LAUNCH(k_rope, grid, pi_dim3(kEltThreads), as_stream(stream), x, pos, y, n, head_dim, n_dims, mode, freq_base,
            freq_scale);
  check_launch("rope");
}

void launch_attention(const AttentionArgs& a, void* stream) {
  const pi_dim3 grid(static_cast<unsigned>(a.n_head), static_cast<unsigned>(a.t));
  if (a.kv_dtype == DT_F16) {
    PI_LAUNCH(k_attention<DT_F16>, grid, pi_dim3(kThreads), as_stream(stream), a.q, a.k, a.v, a.y, a.head_dim,
              a.n_head, a.n_head_kv, a.n_past, a.scale, a.window);
  } else {
    PI_LAUNCH(k_attention<DT_F32>, grid, pi_dim3(kThreads), as_stream(stream), a.q, a.k, a.v, a.y, a.head_dim,
              a.n_head, a.n_head_kv, a.n_past, a.scale, a.window);
  }
  check_launch("attention");
}

void launch_top_k(const float* x, int64_t n, int64_t t, int k, int32_t* ids, void* stream) {
  PI_LAUNCH(k_top_k, pi_dim3(blocks_for(t, kThreads)), pi_dim3(kThreads), as_stream(stream), x, n, k, t, ids);
  check_launch("top_k");
}

void launch_mul_mat_id(const Experts& e, const float* x, bool x_per_slot, const int32_t* ids, int64_t n_used,
                       int64_t t, const float* logits, float threshold, unsigned long long* rows_read, float* y,
                       void* stream) {
  const int64_t cols = n_used * t;
  if (logits) zero_async(y, static_cast<uint64_t>(e.w.rows * cols) * 4, stream);
  const pi_dim3 grid(static_cast<unsigned>(e.w.rows), static_cast<unsigned>(cols));
  const uint8_t* wd = static_cast<const uint8_t*>(e.w.data);
  const int per_slot = x_per_slot ? 1 : 0;
#define PI_CALL(DT)                                                                                             \
  PI_LAUNCH(k_mul_mat_id<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, e.w.row_bytes, e.expert_bytes, e.w.k, \
            e.w.rows, x, per_slot, n_used, ids, logits, threshold, rows_read, y)
  PI_WEIGHT_SWITCH(e.w.dtype, PI_CALL)
#undef PI_CALL
  check_launch(logits ? "mul_mat_id_sparse" : "mul_mat_id");
}

void launch_axpy_id_sparse(const Experts& e, const float* a, const int32_t* ids, int64_t cols, const float* logits,
                           float threshold, unsigned long long* rows_read, float* y, void* stream) {
  const pi_dim3 grid(blocks_for(e.w.k, kAxpyCols), static_cast<unsigned>(cols));
  const uint8_t* wd = static_cast<const uint8_t*>(e.w.data);
#define PI_CALL(DT)                                                                                           \
  PI_LAUNCH(k_axpy_id_sparse<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, e.w.row_bytes, e.expert_bytes, \
            e.w.k, e.w.rows, a, ids, logits, threshold, rows_read, y)
  PI_WEIGHT_SWITCH(e.w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("axpy_id_sparse");
}

void launch_moe_sum(const float* y, const float* probs, const int32_t* ids, int64_t d, int64_t n_expert,
                    int64_t n_used, int64_t t, bool norm, float scale, float* out, void* stream) {
  const int64_t total = d * t;
  PI_LAUNCH(k_moe_sum, pi_dim3(blocks_for(total, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), y, probs,
            ids, d, n_expert, n_used, norm ? 1 : 0, scale, total, out);
  check_launch("moe_sum");
}

void launch_binary(BinaryOp op, const float* a, const float* b, float* y, int64_t n, int64_t nb, void* stream) {
  PI_LAUNCH(k_binary, pi_dim3(blocks_for(n, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream),
            static_cast<int>(op), a, b, y, n, nb);
  check_launch(op == BINARY_ADD ? "add" : "mul");
}

void launch_unary(UnaryOp op, const float* x, float* y, int64_t n, float param, void* stream) {
  PI_LAUNCH(k_unary, pi_dim3(blocks_for(n, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream),
            static_cast<int>(op), x, y, n, param);
  check_launch("unary op");
}

void launch_cpy(const float* src, void* dst, int dst_dtype, int64_t n, int64_t t, int64_t row_offset, void* stream) {
  const int64_t total = n * t;
  PI_LAUNCH(k_cpy, pi_dim3(blocks_for(total, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), src, dst,
            dst_dtype, n, total, row_offset);
  check_launch("cpy");
}

void launch_slice(const float* x, float* y, int64_t n, int64_t t, int64_t offset, int64_t length, void* stream) {
  const int64_t total = length * t;
  PI_LAUNCH(k_slice, pi_dim3(blocks_for(total, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), x, y, n,
            offset, length, total);
  check_launch("slice");
}

}  // namespace pigpu
