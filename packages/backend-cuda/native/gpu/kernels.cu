// The GPU kernels of powerinfer-ts, one source for CUDA (nvcc), ROCm (hipcc) and the CPU emulator
// (see port.h). Op contracts: packages/core/src/backend/graph.ts.
//
// Rules that keep this file portable:
// - no warp size is assumed: warp-level reductions loop from PI_WARP / 2, block reductions keep one
//   shared slot per warp (at most kThreads / 32 of them) and every block is a whole number of warps;
// - every thread of a block reaches every barrier and every shuffle (early exits are block-uniform);
// - wide loads only where the address is checked or known to be aligned: float weight rows and F32
//   activations in 16-byte vectors when aligned (scalar otherwise), quantized blocks (18 or 34 bytes,
//   2-byte aligned) as 16-bit words combined into 32-bit ones, so any row length and dtype still work;
// - F16/BF16 conversions are the hardware's on the GPU (dtype.h), Q8_0/Q4_0 dot products are integer
//   (pi_dp4a) against activations quantized once per op to 8-bit blocks;
// - results never depend on the number of blocks: reductions run in a fixed order (the sparse
//   down projection sums per-chunk partials in chunk order), so a GPU run is deterministic.
#include "port.h"
// port.h first: it defines PI_HD for dtype.h
#include "dtype.h"
#include "kernels.h"
#include "runtime.h"

#include <cmath>
#include <cstdlib>
#if defined(PI_GPU_CUDA) && defined(__CUDACC__)
#include <mma.h>
#endif

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

/// 32 bits from a 2-byte aligned address (quantized blocks): two 16-bit loads.
PI_DEV inline int load_i32_a2(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<int>(static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16));
}

PI_DEV inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// Four floats loaded at once (one 16-byte vector load) from a 16-byte aligned address.
struct alignas(16) F4 {
  float v[4];
};

/// Two int32 (eight int8) loaded at once from an 8-byte aligned address.
struct alignas(8) I2 {
  int32_t a, b;
};

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
        for (int j = 0; j < 4; j++) {
          if (DT == DT_F16) {
            pi_half2_to_float2(v[0].w[j], &ch.w[2 * j], &ch.w[2 * j + 1]);
          } else {
            ch.w[2 * j] = pi_bf16_to_float(static_cast<uint16_t>(v[0].w[j] & 0xffffu));
            ch.w[2 * j + 1] = pi_bf16_to_float(static_cast<uint16_t>(v[0].w[j] >> 16));
          }
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
    const uint32_t q0 = static_cast<uint32_t>(load_i32_a2(b + 2 + 8 * q));
    const uint32_t q1 = static_cast<uint32_t>(load_i32_a2(b + 6 + 8 * q));
    for (int j = 0; j < 4; j++) {
      ch.w[j] = d * static_cast<float>(static_cast<int8_t>(q0 >> (8 * j)));
      ch.w[4 + j] = d * static_cast<float>(static_cast<int8_t>(q1 >> (8 * j)));
    }
    return;
  }
  const uint8_t* b = row + blk * 18;  // DT_Q4_0: bytes 4q..4q+3 → elements 4q.. and 16+4q..
  const float d = load_half(b);
  ch.o0 = blk * 32 + 4 * q;
  ch.o1 = ch.o0 + 16;
  const uint32_t v = static_cast<uint32_t>(load_i32_a2(b + 2 + 4 * q));
  for (int j = 0; j < 4; j++) {
    const uint32_t byte = (v >> (8 * j)) & 0xffu;
    ch.w[j] = d * static_cast<float>(static_cast<int>(byte & 15u) - 8);
    ch.w[4 + j] = d * static_cast<float>(static_cast<int>(byte >> 4) - 8);
  }
}

PI_DEV inline float chunk_dot(const Chunk& ch, const float* x) {
  const float* x0 = x + ch.o0;
  const float* x1 = x + ch.o1;
  if (ch.n0 == 4 && ch.n1 == 4 && aligned16(x0) && aligned16(x1)) {  // two vector loads, same order
    const F4 a = *reinterpret_cast<const F4*>(x0);
    const F4 b = *reinterpret_cast<const F4*>(x1);
    float s = 0.0f;
    for (int j = 0; j < 4; j++) s += ch.w[j] * a.v[j];
    for (int j = 0; j < 4; j++) s += ch.w[4 + j] * b.v[j];
    return s;
  }
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

/// Activations quantized to 8-bit blocks (k_quantize_q8): q int8 [k, T] (column t at t·k), d F32
/// [k/32, T] (the scale of each block of 32, rounded to F16 like a Q8_0 block's). q == null: F32 x.
struct QAct {
  const int8_t* q;
  const float* d;
};

/// Q8_0 rounding of activations, once per op: one thread per block of 32 values (x [k, T] F32 with k a
/// multiple of 32, so that blocks never straddle columns); d = amax/127, q = round(x/d).
PI_KERNEL void k_quantize_q8(const float* x, int64_t nblocks, int8_t* q, float* d) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const float* xb = x + b * 32;
  float v[32];
  if (aligned16(xb)) {
    for (int i = 0; i < 8; i++) {
      const F4 f = reinterpret_cast<const F4*>(xb)[i];
      for (int j = 0; j < 4; j++) v[4 * i + j] = f.v[j];
    }
  } else {
    for (int i = 0; i < 32; i++) v[i] = xb[i];
  }
  float amax = 0.0f;
  for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
  const float db = amax / 127.0f;
  U128 out[2];
  for (int i = 0; i < 8; i++) {
    uint32_t w = 0;
    for (int j = 0; j < 4; j++) {
      const int qi = db != 0.0f ? static_cast<int>(roundf(v[4 * i + j] / db)) : 0;
      w |= (static_cast<uint32_t>(qi) & 0xffu) << (8 * j);
    }
    out[i / 4].w[i % 4] = w;
  }
  reinterpret_cast<U128*>(q + b * 32)[0] = out[0];
  reinterpret_cast<U128*>(q + b * 32)[1] = out[1];
  d[b] = pi_half_to_float(pi_float_to_half(db));
}

/// Dots of one Q8_0/Q4_0 weight row with quantized activations: each thread takes chunks of 8
/// weights (a quarter block), integer products with dp4a, one float multiply-add per chunk and column.
template <int DT>
PI_DEV inline void row_dots_q8(const uint8_t* row, int64_t k, const QAct& qa, int64_t t0, unsigned mask,
                               float* acc) {
  const int64_t nchunks = k / 8;
  const int64_t nblk = k / 32;
  for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
    const int64_t blk = c / 4;
    const int q = static_cast<int>(c % 4);
    if (DT == DT_Q8_0) {
      const uint8_t* b = row + blk * 34;
      const float dw = load_half(b);
      const int w0 = load_i32_a2(b + 2 + 8 * q);
      const int w1 = load_i32_a2(b + 6 + 8 * q);
      for (int j = 0; j < kTok; j++) {
        if (!(mask & (1u << j))) continue;
        const I2 xq = *reinterpret_cast<const I2*>(qa.q + (t0 + j) * k + blk * 32 + 8 * q);
        const int si = pi_dp4a(w1, xq.b, pi_dp4a(w0, xq.a, 0));
        acc[j] += dw * qa.d[(t0 + j) * nblk + blk] * static_cast<float>(si);
      }
    } else {  // DT_Q4_0: bytes 4q..4q+3 hold elements 4q.. (low nibbles) and 16+4q.. (high nibbles)
      const uint8_t* b = row + blk * 18;
      const float dw = load_half(b);
      const int v = load_i32_a2(b + 2 + 4 * q);
      const int lo = v & 0x0f0f0f0f;
      const int hi = (v >> 4) & 0x0f0f0f0f;
      for (int j = 0; j < kTok; j++) {
        if (!(mask & (1u << j))) continue;
        const int8_t* xc = qa.q + (t0 + j) * k + blk * 32 + 4 * q;
        const int u0 = *reinterpret_cast<const int*>(xc);
        const int u1 = *reinterpret_cast<const int*>(xc + 16);
        const int si = pi_dp4a(hi, u1, pi_dp4a(lo, u0, 0));
        const int sx = pi_dp4a(0x01010101, u1, pi_dp4a(0x01010101, u0, 0));  // (q − 8)·x = q·x − 8·x
        acc[j] += dw * qa.d[(t0 + j) * nblk + blk] * static_cast<float>(si - 8 * sx);
      }
    }
  }
}

/// Dots of one weight row with the columns t0.. (bit j of `mask`: column t0 + j), summed over the block.
template <int DT>
PI_DEV inline void row_dots(const uint8_t* row, int64_t k, const float* x, const QAct& qa, int64_t t0,
                            unsigned mask, float* acc, float* sh) {
  for (int j = 0; j < kTok; j++) acc[j] = 0.0f;
  if ((DT == DT_Q8_0 || DT == DT_Q4_0) && qa.q) {
    row_dots_q8<DT>(row, k, qa, t0, mask, acc);
  } else {
    const int64_t nchunks = (k + 7) / 8;
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      Chunk ch;
      load_chunk<DT>(row, c, k, ch);
      for (int j = 0; j < kTok; j++) {
        if (mask & (1u << j)) acc[j] += chunk_dot(ch, x + (t0 + j) * k);
      }
    }
  }
  int n = 0;  // highest column + 1 (block-uniform)
  for (int j = 0; j < kTok; j++)
    if (mask & (1u << j)) n = j + 1;
  block_sum_n(acc, n, sh);
}

template <int DT>
PI_KERNEL void k_mul_mat(const uint8_t* w, uint64_t row_bytes, int64_t k, int64_t n_rows, const float* x, QAct qa,
                         int64_t t, float* y) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t r = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  const unsigned mask = (1u << nt) - 1u;
  float acc[kTok];
  row_dots<DT>(w + static_cast<uint64_t>(r) * row_bytes, k, x, qa, t0, mask, acc, sh);
  if (threadIdx.x == 0) {
    for (int j = 0; j < nt; j++) y[(t0 + j) * n_rows + r] = acc[j];
  }
}

#if defined(PI_GPU_CUDA)
// ---- prompt processing on tensor cores (CUDA, F16 weights) ----
// Tiles of our own rather than cuBLAS: the addon links the CUDA runtime statically so that only the
// driver is needed at run time, and cuBLAS (static: hundreds of MiB; shared: a toolkit on every user's
// machine) would break both that and the device kit's 64 MiB. WMMA fragments compile to mma.sync on
// sm_80/86/89/90. A block computes 64 weight rows × 64 columns: 4 warps of 16 rows, 4 accumulators of
// 16 × 16 each (F32); the columns' activations are staged in shared memory as F16, 32 at a time along k
// (F16 rounding of the activations, which core's conformance kit admits for F16 weights); each weight
// tile is read once per 64 columns instead of once per 8. Used when the shapes fit (k % 32 == 0,
// rows % 64 == 0, T ≥ 16, 32-byte aligned rows); the emulator and ROCm take k_mul_mat.
constexpr int kTcRows = 64, kTcCols = 64, kTcK = 32, kTcLd = kTcK + 8;

PI_KERNEL void k_mul_mat_tc(const uint16_t* w, int64_t k, int64_t n_rows, const float* x, int64_t t, float* y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  using namespace nvcuda;
  __shared__ __align__(32) __half xs[kTcCols * kTcLd];  // [column][k], padded rows
  __shared__ __align__(32) float cs[kTcRows / 16][16 * 16];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTcRows + warp * 16;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTcCols;
  const __half* wh = reinterpret_cast<const __half*>(w);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTcCols / 16];
  for (int j = 0; j < kTcCols / 16; j++) wmma::fill_fragment(acc[j], 0.0f);
  for (int64_t k0 = 0; k0 < k; k0 += kTcK) {
    __syncthreads();  // the previous slice of xs has been read
    for (int e = static_cast<int>(threadIdx.x); e < kTcCols * kTcK; e += static_cast<int>(blockDim.x)) {
      const int c = e / kTcK, kk = e % kTcK;
      const float v = c0 + c < t ? x[(c0 + c) * k + k0 + kk] : 0.0f;
      xs[c * kTcLd + kk] = __float2half_rn(v);
    }
    __syncthreads();
    for (int kk = 0; kk < kTcK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
      wmma::load_matrix_sync(a, wh + r0 * k + k0 + kk, static_cast<unsigned>(k));
      for (int j = 0; j < kTcCols / 16; j++) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(b, xs + j * 16 * kTcLd + kk, kTcLd);
        wmma::mma_sync(acc[j], a, b, acc[j]);
      }
    }
  }
  for (int j = 0; j < kTcCols / 16; j++) {  // element (row rr, column cc) at cs[cc·16 + rr]: rows contiguous in y
    wmma::store_matrix_sync(cs[warp], acc[j], 16, wmma::mem_col_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int64_t col = c0 + j * 16 + e / 16;
      if (col < t) y[col * n_rows + r0 + e % 16] = cs[warp][e];
    }
    __syncwarp();
  }
#else
  (void)w, (void)k, (void)n_rows, (void)x, (void)t, (void)y;
#endif
}
#endif

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

/// mul_mat_sparse over the compacted active list of column group z = blockIdx.y (k_axpy_compact: in
/// candidate order, with the column masks): block b takes entries b, b + gridDim.x, ... — a grid sized
/// for the device, not one block per candidate, so inactive rows cost nothing at all. Each row's dots
/// are those of k_mul_mat (row_dots), so the values do not depend on the grid.
template <int DT>
PI_KERNEL void k_mul_mat_sparse(const uint8_t* w, uint64_t row_bytes, int64_t k, const float* x, QAct qa, int64_t t,
                                const int32_t* rows, int compact, int64_t n_cand, int64_t n_out, const int32_t* list,
                                const uint8_t* masks, const int32_t* count, float* y) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t z = blockIdx.y;
  const int64_t t0 = z * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  const int64_t n = count[z];
  for (int64_t e = blockIdx.x; e < n; e += gridDim.x) {
    const int64_t j = list[z * n_cand + e];  // candidate
    const unsigned mask = masks[z * n_cand + e];
    const int64_t i = rows ? rows[j] : j;
    const int64_t wrow = rows && compact ? j : i;
    float acc[kTok];
    row_dots<DT>(w + static_cast<uint64_t>(wrow) * row_bytes, k, x, qa, t0, mask, acc, sh);
    if (threadIdx.x == 0) {
      for (int c = 0; c < nt; c++)
        if (mask & (1u << c)) y[(t0 + c) * n_out + i] = acc[c];
    }
  }
}

// ---- axpy_sparse: y[:, t] = Σ_active a[i, t] · Wt-row(i) ----
// PowerInfer's manner: (1) k_axpy_compact builds, per group of kTok columns, the list of active
// candidates in candidate order with a block prefix sum (compaction: inactive rows cost nothing after
// it); (2) k_axpy_list splits that list into `chunks` equal ranges (grid y), stages each tile of row ids,
// column masks and activations in shared memory, and streams kAxpyInFlight rows at a time with 16-byte
// loads, each thread owning 8 consecutive output elements; (3) with several chunks, k_sum_chunks adds
// the chunks' partials in chunk order. Every output element is summed in list order within a chunk and
// chunk order across chunks: deterministic, independent of the device.

constexpr int kScan = 256;        // threads of the compaction block
constexpr int kStage = 64;        // list entries staged in shared memory per tile
constexpr int kAxpyInFlight = 4;  // weight rows loaded before their multiply-adds
constexpr int kAxpyVec = 8;       // output elements per thread
constexpr int kAxpyOut = kAxpyVec * kThreads;  // output elements per block
constexpr int64_t kSparseBlocks = 2048;        // mul_mat_sparse: blocks that walk the active list

/// Compaction of the candidates of column group z = blockIdx.x: list[z·n_cand + j] = j-th active
/// candidate (ascending), masks[...] its active columns (bit j: column 8z + j), count[z] their number;
/// rows_read += active (neuron, column) pairs.
PI_KERNEL void k_axpy_compact(const float* logits, const int32_t* rows, int64_t n_cand, float threshold,
                              int64_t n_out, int64_t t, int32_t* list, uint8_t* masks, int32_t* count,
                              unsigned long long* rows_read) {
  PI_SHARED int scan[2][kScan];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t z = blockIdx.x;
  const int64_t t0 = z * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  int32_t* lz = list + z * n_cand;
  uint8_t* mz = masks + z * n_cand;
  int base = 0;  // active entries before this tile
  unsigned long long pairs = 0;
  for (int64_t c0 = 0; c0 < n_cand; c0 += kScan) {
    const int64_t c = c0 + tid;
    unsigned mask = 0;
    if (c < n_cand) mask = active_mask(logits, threshold, n_out, rows ? rows[c] : c, t0, nt);
    pairs += static_cast<unsigned long long>(popcount8(mask));
    // inclusive prefix sum of the flags (Hillis–Steele, double-buffered)
    int cur = 0;
    scan[0][tid] = mask ? 1 : 0;
    __syncthreads();
    for (int off = 1; off < kScan; off <<= 1) {
      const int v = scan[cur][tid] + (tid >= off ? scan[cur][tid - off] : 0);
      scan[cur ^ 1][tid] = v;
      cur ^= 1;
      __syncthreads();
    }
    const int incl = scan[cur][tid];
    if (mask) {
      lz[base + incl - 1] = static_cast<int32_t>(c);
      mz[base + incl - 1] = static_cast<uint8_t>(mask);
    }
    base += scan[cur][kScan - 1];
    __syncthreads();  // scan is rewritten by the next tile
  }
  if (tid == 0) count[z] = base;
  if (pairs) pi_atomic_add_u64(rows_read, pairs);
}

/// Weights e0 .. e0+7 of a row (zeros past e_len): 16-byte loads for float rows when aligned, 16-bit
/// word loads for quantized blocks (e0 is a multiple of 8, so the 8 lie in one block).
template <int DT>
PI_DEV inline void load8(const uint8_t* row, int64_t e0, int64_t e_len, float* w) {
  if (DT == DT_F32 || DT == DT_F16 || DT == DT_BF16) {
    const int es = DT == DT_F32 ? 4 : 2;
    const uint8_t* p = row + e0 * es;
    if (e0 + 8 <= e_len && aligned16(p)) {
      if (DT == DT_F32) {
        const F4 a = reinterpret_cast<const F4*>(p)[0];
        const F4 b = reinterpret_cast<const F4*>(p)[1];
        for (int j = 0; j < 4; j++) {
          w[j] = a.v[j];
          w[4 + j] = b.v[j];
        }
      } else {
        const U128 v = *reinterpret_cast<const U128*>(p);
        for (int j = 0; j < 4; j++) {
          if (DT == DT_F16) {
            pi_half2_to_float2(v.w[j], &w[2 * j], &w[2 * j + 1]);
          } else {
            w[2 * j] = pi_bf16_to_float(static_cast<uint16_t>(v.w[j] & 0xffffu));
            w[2 * j + 1] = pi_bf16_to_float(static_cast<uint16_t>(v.w[j] >> 16));
          }
        }
      }
      return;
    }
    for (int j = 0; j < 8; j++) w[j] = e0 + j < e_len ? weight_at<DT>(row, e0 + j) : 0.0f;
    return;
  }
  if (e0 >= e_len) {  // quantized rows are whole blocks: a chunk is all in or all out
    for (int j = 0; j < 8; j++) w[j] = 0.0f;
    return;
  }
  const int64_t blk = e0 / 32;
  const int r = static_cast<int>(e0 % 32);
  if (DT == DT_Q8_0) {
    const uint8_t* b = row + blk * 34;
    const float d = load_half(b);
    const uint32_t q0 = static_cast<uint32_t>(load_i32_a2(b + 2 + r));
    const uint32_t q1 = static_cast<uint32_t>(load_i32_a2(b + 6 + r));
    for (int j = 0; j < 4; j++) {
      w[j] = d * static_cast<float>(static_cast<int8_t>(q0 >> (8 * j)));
      w[4 + j] = d * static_cast<float>(static_cast<int8_t>(q1 >> (8 * j)));
    }
    return;
  }
  const uint8_t* b = row + blk * 18;  // DT_Q4_0: element r is byte r%16, low nibble for r < 16
  const float d = load_half(b);
  const uint32_t v0 = static_cast<uint32_t>(load_i32_a2(b + 2 + r % 16));
  const uint32_t v1 = static_cast<uint32_t>(load_i32_a2(b + 6 + r % 16));
  const int shift = r < 16 ? 0 : 4;
  for (int j = 0; j < 4; j++) {
    w[j] = d * static_cast<float>(static_cast<int>((v0 >> (8 * j + shift)) & 15u) - 8);
    w[4 + j] = d * static_cast<float>(static_cast<int>((v1 >> (8 * j + shift)) & 15u) - 8);
  }
}

/// grid: x = slices of kAxpyOut output elements, y = chunks of the active list, z = groups of kTok
/// columns. Chunk y of a list of n entries is [y·n/chunks, (y+1)·n/chunks).
template <int DT>
PI_KERNEL void k_axpy_list(const uint8_t* w, uint64_t row_bytes, int64_t e_len, const float* a, int64_t t,
                           const int32_t* rows, int compact, int64_t n_cand, int64_t n_out, const int32_t* list,
                           const uint8_t* masks, const int32_t* count, int64_t chunks, float* out) {
  PI_SHARED int64_t s_row[kStage];
  PI_SHARED unsigned s_mask[kStage];
  PI_SHARED float s_a[kStage * kTok];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * kAxpyOut + static_cast<int64_t>(tid) * kAxpyVec;
  const int64_t z = blockIdx.z;
  const int64_t t0 = z * kTok;
  const int64_t nt = t - t0 < kTok ? t - t0 : kTok;
  const int64_t n = count[z];
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * n / chunks;
  const int64_t j1 = (static_cast<int64_t>(blockIdx.y) + 1) * n / chunks;
  const int32_t* lz = list + z * n_cand;
  const uint8_t* mz = masks + z * n_cand;
  float acc[kTok][kAxpyVec];
  for (int c = 0; c < kTok; c++)
    for (int v = 0; v < kAxpyVec; v++) acc[c][v] = 0.0f;
  for (int64_t s0 = j0; s0 < j1; s0 += kStage) {
    const int ns = static_cast<int>(j1 - s0 < kStage ? j1 - s0 : kStage);
    __syncthreads();  // the previous tile has been read
    for (int e = tid; e < ns; e += static_cast<int>(blockDim.x)) {
      const int64_t c = lz[s0 + e];
      const int64_t i = rows ? rows[c] : c;
      const unsigned m = mz[s0 + e];
      s_row[e] = rows && compact ? c : i;
      s_mask[e] = m;
      for (int j = 0; j < kTok; j++) s_a[e * kTok + j] = (m >> j) & 1u ? a[(t0 + j) * n_out + i] : 0.0f;
    }
    __syncthreads();
    for (int e = 0; e < ns; e += kAxpyInFlight) {
      float wv[kAxpyInFlight][kAxpyVec];
      for (int f = 0; f < kAxpyInFlight; f++) {  // loads of several rows first, then their FMAs
        if (e + f < ns) load8<DT>(w + static_cast<uint64_t>(s_row[e + f]) * row_bytes, e0, e_len, wv[f]);
      }
      for (int f = 0; f < kAxpyInFlight; f++) {
        if (e + f >= ns) break;
        const unsigned m = s_mask[e + f];
        for (int c = 0; c < kTok; c++) {
          if (!((m >> c) & 1u)) continue;
          const float ai = s_a[(e + f) * kTok + c];
          for (int v = 0; v < kAxpyVec; v++) acc[c][v] += ai * wv[f][v];
        }
      }
    }
  }
  // out is [chunks][t][e_len] (or y itself, [t][e_len], with one chunk)
  float* o = out + static_cast<int64_t>(blockIdx.y) * t * e_len;
  for (int c = 0; c < nt; c++) {
    float* oc = o + (t0 + c) * e_len + e0;
    if (e0 + kAxpyVec <= e_len && aligned16(oc)) {
      F4 lo, hi;
      for (int v = 0; v < 4; v++) {
        lo.v[v] = acc[c][v];
        hi.v[v] = acc[c][4 + v];
      }
      reinterpret_cast<F4*>(oc)[0] = lo;
      reinterpret_cast<F4*>(oc)[1] = hi;
    } else {
      for (int v = 0; v < kAxpyVec; v++)
        if (e0 + v < e_len) oc[v] = acc[c][v];
    }
  }
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

/// k_binary(ADD) + k_rms_norm + k_binary(MUL) in one block per column (see launch_add_rms_norm_mul).
PI_KERNEL void k_add_rms_norm_mul(const float* a, const float* b, float* h, const float* w, int64_t nw, float* y,
                                  int64_t n, float eps) {
  PI_SHARED float sh[kTok * kMaxWarps];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = b ? a[base + i] + b[base + i] : a[base + i];
    if (h) h[base + i] = v;
    s += v * v;
  }
  s = block_sum(s, sh);
  const float r = 1.0f / sqrtf(s / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = b ? a[base + i] + b[base + i] : a[base + i];
    const float o = v * r;
    y[base + i] = w ? o * w[(base + i) % nw] : o;
  }
}

PI_KERNEL void k_silu_mul(const float* g, const float* u, int silu_first, float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = g[i];
  const float sv = v / (1.0f + expf(-v));
  y[i] = silu_first ? sv * u[i] : u[i] * sv;
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

/// Writes element idx of column t of the rope's result: to y, or (y null: RoPE + KV write fused) converted
/// to the cache's dtype at row row_offset + t of `cache` — the stores of k_rope then k_cpy.
PI_DEV inline void rope_store(float* y, void* cache, int cache_dtype, int64_t row_offset, int64_t n, int64_t t,
                              int64_t idx, float v) {
  if (y) {
    y[t * n + idx] = v;
    return;
  }
  const int64_t o = (row_offset + t) * n + idx;
  if (cache_dtype == DT_F32)
    static_cast<float*>(cache)[o] = v;
  else if (cache_dtype == DT_F16)
    static_cast<uint16_t*>(cache)[o] = pi_float_to_half(v);
  else
    static_cast<uint16_t*>(cache)[o] = pi_float_to_bf16(v);
}

PI_KERNEL void k_rope(const float* x, const int32_t* pos, float* y, void* cache, int cache_dtype, int64_t row_offset,
                      int64_t n, int head_dim, int n_dims, int mode, double freq_base, double freq_scale) {
  const int64_t t = blockIdx.y;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const float* xc = x + t * n;
  const int r = static_cast<int>(idx % head_dim);
  const int64_t base = idx - r;
  if (r >= n_dims) {
    rope_store(y, cache, cache_dtype, row_offset, n, t, idx, xc[idx]);
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
  rope_store(y, cache, cache_dtype, row_offset, n, t, idx, r == i0 ? x0 * c - x1 * s : x0 * s + x1 * c);
}

// ---- attention with the KV cache: flash-decoding ----
// Grid (head, token, split): split z of a query covers the cache positions [p_first + z·span,
// p_first + (z+1)·span) of its window, in tiles of kAttnTile with an online softmax. With one split the
// block writes the normalised output; otherwise it writes its partial (running maximum m, sum l, the
// unnormalised accumulator) and k_attention_combine merges the splits in split order (fixed: the
// result does not depend on how the blocks were scheduled). K rows are read two elements per lane
// (4-byte loads of F16 pairs converted with __half22float2, 8-byte loads of F32 pairs), V rows two
// dimensions per thread.

template <int KVDT>
PI_DEV inline float kv_at(const void* p, int64_t i) {
  if (KVDT == DT_F16) return pi_half_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

/// Elements i and i+1 of a cache (i even, both inside the row; `vec`: the address is aligned).
template <int KVDT>
PI_DEV inline void kv_pair(const void* p, int64_t i, bool vec, float* a, float* b) {
  if (vec) {
    if (KVDT == DT_F16) {
      pi_half2_to_float2(*reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p) + i), a, b);
    } else {
      const float* f = static_cast<const float*>(p) + i;
      struct alignas(8) F2 {
        float x, y;
      };
      const F2 v = *reinterpret_cast<const F2*>(f);
      *a = v.x;
      *b = v.y;
    }
    return;
  }
  *a = kv_at<KVDT>(p, i);
  *b = kv_at<KVDT>(p, i + 1);
}

constexpr int kAttnPairs = kMaxHeadDim / (2 * kThreads);  // dimension pairs per thread

template <int KVDT>
PI_KERNEL void k_attention(const float* q, const void* kc, const void* vc, float* y, int head_dim, int n_head,
                           int n_head_kv, int64_t n_past, float scale, int64_t window, int n_split, int64_t span,
                           float* part) {
  PI_SHARED float qs[kMaxHeadDim];
  PI_SHARED float s[kAttnTile];
  const int h = static_cast<int>(blockIdx.x);
  const int64_t t = blockIdx.y;
  const int z = static_cast<int>(blockIdx.z);
  const int g = h / (n_head / n_head_kv);
  const int64_t q_row = static_cast<int64_t>(head_dim) * n_head;
  const int64_t kv_row = static_cast<int64_t>(head_dim) * n_head_kv;
  const int64_t n_kv = n_past + t + 1;  // causal: positions 0 .. n_past + t
  // sliding window: positions n_kv − window .. n_past + t only
  const int64_t p_first = window > 0 && n_kv > window ? n_kv - window : 0;
  const int64_t p_begin = p_first + z * span;
  const int64_t p_end = p_begin + span < n_kv ? p_begin + span : n_kv;
  const int tid = static_cast<int>(threadIdx.x);
  const int nth = static_cast<int>(blockDim.x);
  const int lane = tid % PI_WARP;
  const int warp = tid / PI_WARP;
  const int nw = nth / PI_WARP;
  const int pairs = (head_dim + 1) / 2;
  const int64_t g_off = static_cast<int64_t>(g) * head_dim;
  // pair loads need an even head_dim (then every pair lies in one row and is aligned)
  const bool vec = head_dim % 2 == 0 && reinterpret_cast<uintptr_t>(kc) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(vc) % 16 == 0;
  for (int j = tid; j < head_dim; j += nth) qs[j] = q[t * q_row + static_cast<int64_t>(h) * head_dim + j];
  float acc[kAttnPairs][2];
  for (int k = 0; k < kAttnPairs; k++) acc[k][0] = acc[k][1] = 0.0f;
  float m = -INFINITY;  // running maximum of the scores
  float l = 0.0f;       // running sum of exp(score − m)
  __syncthreads();
  for (int64_t p0 = p_begin; p0 < p_end; p0 += kAttnTile) {
    const int np = static_cast<int>(p_end - p0 < kAttnTile ? p_end - p0 : kAttnTile);
    for (int pp = warp; pp < np; pp += nw) {  // one warp per position, lanes over pairs of dimensions
      const int64_t off = (p0 + pp) * kv_row + g_off;
      float d = 0.0f;
      for (int j2 = lane; j2 < pairs; j2 += PI_WARP) {
        const int j = 2 * j2;
        if (j + 1 < head_dim) {
          float k0, k1;
          kv_pair<KVDT>(kc, off + j, vec, &k0, &k1);
          d += qs[j] * k0;
          d += qs[j + 1] * k1;
        } else {
          d += qs[j] * kv_at<KVDT>(kc, off + j);
        }
      }
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
    for (int k = 0; k < kAttnPairs; k++) {
      const int j = 2 * (tid + k * nth);
      if (j >= head_dim) break;
      float a0 = acc[k][0] * corr;
      float a1 = acc[k][1] * corr;
      const int64_t off = p0 * kv_row + g_off + j;
      if (j + 1 < head_dim) {
        for (int i = 0; i < np; i++) {
          float v0, v1;
          kv_pair<KVDT>(vc, off + i * kv_row, vec, &v0, &v1);
          a0 += s[i] * v0;
          a1 += s[i] * v1;
        }
      } else {
        for (int i = 0; i < np; i++) a0 += s[i] * kv_at<KVDT>(vc, off + i * kv_row);
      }
      acc[k][0] = a0;
      acc[k][1] = a1;
    }
    m = mt;
    __syncthreads();  // before the next tile overwrites s
  }
  if (n_split == 1) {
    const float inv = 1.0f / l;
    for (int k = 0; k < kAttnPairs; k++) {
      const int j = 2 * (tid + k * nth);
      if (j >= head_dim) break;
      float* yo = y + t * q_row + static_cast<int64_t>(h) * head_dim + j;
      yo[0] = acc[k][0] * inv;
      if (j + 1 < head_dim) yo[1] = acc[k][1] * inv;
    }
    return;
  }
  // partial of (t, h, z): [m, l, acc[head_dim]] at ((t·n_head + h)·n_split + z)·(head_dim + 2)
  float* pz = part + ((t * n_head + h) * n_split + z) * (head_dim + 2);
  if (tid == 0) {
    pz[0] = m;
    pz[1] = l;
  }
  for (int k = 0; k < kAttnPairs; k++) {
    const int j = 2 * (tid + k * nth);
    if (j >= head_dim) break;
    pz[2 + j] = acc[k][0];
    if (j + 1 < head_dim) pz[3 + j] = acc[k][1];
  }
}

/// Merges the splits of (head, token) = (blockIdx.x, blockIdx.y) in split order: M = max m_z,
/// L = Σ l_z·e^(m_z − M), y = Σ acc_z·e^(m_z − M) / L. An empty split (m = −∞, l = 0) adds nothing.
PI_KERNEL void k_attention_combine(const float* part, int head_dim, int n_head, int n_split, float* y) {
  const int h = static_cast<int>(blockIdx.x);
  const int64_t t = blockIdx.y;
  const float* p = part + (t * n_head + h) * n_split * (head_dim + 2);
  float mx = -INFINITY;
  for (int z = 0; z < n_split; z++) mx = p[z * (head_dim + 2)] > mx ? p[z * (head_dim + 2)] : mx;
  float l = 0.0f;
  for (int z = 0; z < n_split; z++) {
    const float* pz = p + z * (head_dim + 2);
    if (pz[1] > 0.0f) l += pz[1] * expf(pz[0] - mx);
  }
  const float inv = 1.0f / l;
  float* yo = y + t * static_cast<int64_t>(head_dim) * n_head + static_cast<int64_t>(h) * head_dim;
  for (int j = static_cast<int>(threadIdx.x); j < head_dim; j += static_cast<int>(blockDim.x)) {
    float a = 0.0f;
    for (int z = 0; z < n_split; z++) {
      const float* pz = p + z * (head_dim + 2);
      if (pz[1] > 0.0f) a += pz[2 + j] * expf(pz[0] - mx);
    }
    yo[j] = a * inv;
  }
}

PI_KERNEL void k_warp_info(int* out) {
  if (threadIdx.x == 0) {
    out[0] = PI_WARP;
    out[1] = pi_hw_warp_size();
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
  row_dots<DT>(row, k, xc, QAct{nullptr, nullptr}, 0, 1u, acc, sh);
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

/// moe_scatter: one thread per output element (e·m + i, t).
PI_KERNEL void k_moe_scatter(const float* src, int64_t r, const int32_t* ids, int64_t n_used, int64_t m,
                             int64_t n_expert, float fill, int64_t total, float* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int64_t per = m * n_expert;
  const int64_t t = idx / per;
  const int64_t e = (idx % per) / m;
  const int64_t i = idx % m;
  int64_t slot = -1;
  for (int64_t u = 0; u < n_used; u++)
    if (ids[t * n_used + u] == e) slot = u;
  out[idx] = slot < 0 ? fill : src[(t * n_used + slot) * r + (r == 1 ? 0 : i)];
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

namespace {
#if defined(PI_GPU_CUDA)
/// Whether the current device has tensor cores for F16 mma (compute capability ≥ 7.0; this build's
/// lowest target is sm_80). POWERINFER_TENSOR_CORES=0 turns the path off.
bool tensor_cores() {
  const char* env = std::getenv("POWERINFER_TENSOR_CORES");
  if (env && env[0] == '0') return false;
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) !=
                                                 cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 7;
}
#endif
bool quantized_weights(int dt) { return dt == DT_Q8_0 || dt == DT_Q4_0; }
uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }

/// Quantizes x [k, T] into scratch (layout: q int8 [k·T], then d F32 [k/32·T], 256-byte aligned).
QAct quantize_activations(const Weights& w, const float* x, int64_t t, void* scratch, void* stream) {
  if (!quantized_weights(w.dtype)) return QAct{nullptr, nullptr};
  int8_t* q = static_cast<int8_t*>(scratch);
  float* d = reinterpret_cast<float*>(static_cast<uint8_t*>(scratch) + align256(static_cast<uint64_t>(w.k * t)));
  const int64_t nblocks = w.k / 32 * t;
  PI_LAUNCH(k_quantize_q8, pi_dim3(blocks_for(nblocks, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), x,
            nblocks, q, d);
  check_launch("quantize activations (q8)");
  return QAct{q, d};
}
}  // namespace

uint64_t mul_mat_scratch_bytes(const Weights& w, int64_t t) {
  if (!quantized_weights(w.dtype)) return 0;
  return align256(static_cast<uint64_t>(w.k * t)) + align256(static_cast<uint64_t>(w.k / 32 * t) * 4);
}

void launch_mul_mat(const Weights& w, const float* x, int64_t t, float* y, void* scratch, void* stream) {
#if defined(PI_GPU_CUDA)
  if (w.dtype == DT_F16 && t >= 16 && w.k % kTcK == 0 && w.rows % kTcRows == 0 &&
      reinterpret_cast<uintptr_t>(w.data) % 32 == 0 && tensor_cores()) {
    const pi_dim3 grid(static_cast<unsigned>(w.rows / kTcRows), blocks_for(t, kTcCols));
    PI_LAUNCH(k_mul_mat_tc, grid, pi_dim3(128), as_stream(stream), static_cast<const uint16_t*>(w.data), w.k, w.rows,
              x, t, y);
    check_launch("mul_mat (tensor cores)");
    return;
  }
#endif
  const QAct qa = quantize_activations(w, x, t, scratch, stream);
  const pi_dim3 grid(static_cast<unsigned>(w.rows), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(w.data);
#define PI_CALL(DT) \
  PI_LAUNCH(k_mul_mat<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, w.row_bytes, w.k, w.rows, x, qa, t, y)
  PI_WEIGHT_SWITCH(w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("mul_mat");
}

namespace {
/// Chunks of the active list: enough blocks to fill the device (the list is at most n_cand long),
/// partials capped at 64 MiB. A function of the shape only, so the summation order is fixed.
int64_t axpy_chunks(const Weights& wt, int64_t t, const Selection& s) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  int64_t chunks = (n_cand + 255) / 256;
  if (chunks > 64) chunks = 64;
  const int64_t per = wt.k * t * 4;
  while (chunks > 1 && chunks * per > (int64_t{64} << 20)) chunks /= 2;
  return chunks < 1 ? 1 : chunks;
}

struct AxpyScratch {
  int32_t* list;
  uint8_t* masks;
  int32_t* count;
  float* part;
};

/// Scratch layout: list (I32 [n_cand, groups]), masks (U8 [n_cand, groups]), count (I32 [groups]),
/// partials (F32 [e_len, t, chunks], only with several chunks); each 256-byte aligned.
uint64_t axpy_layout(const Weights& wt, int64_t t, const Selection& s, uint8_t* base, AxpyScratch* out,
                     bool partials = true) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  const uint64_t groups = token_groups(t);
  const int64_t chunks = axpy_chunks(wt, t, s);
  uint64_t off = 0;
  const uint64_t o_list = off;
  off += align256(groups * static_cast<uint64_t>(n_cand) * 4);
  const uint64_t o_masks = off;
  off += align256(groups * static_cast<uint64_t>(n_cand));
  const uint64_t o_count = off;
  off += align256(groups * 4);
  const uint64_t o_part = off;
  if (partials && chunks > 1) off += static_cast<uint64_t>(chunks * t * wt.k) * 4;
  if (out) {
    out->list = reinterpret_cast<int32_t*>(base + o_list);
    out->masks = base + o_masks;
    out->count = reinterpret_cast<int32_t*>(base + o_count);
    out->part = reinterpret_cast<float*>(base + o_part);
  }
  return off;
}
}  // namespace

uint64_t axpy_sparse_scratch_bytes(const Weights& wt, int64_t t, const Selection& s) {
  return axpy_layout(wt, t, s, nullptr, nullptr);
}

uint64_t mul_mat_sparse_scratch_bytes(const Weights& w, int64_t t, const Selection& s) {
  return align256(axpy_layout(w, t, s, nullptr, nullptr, false)) + mul_mat_scratch_bytes(w, t);
}

void launch_mul_mat_sparse(const Weights& w, const float* x, int64_t t, const Selection& s, float* y, void* scratch,
                           void* stream) {
  zero_async(y, static_cast<uint64_t>(s.n_out * t) * 4, stream);
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  AxpyScratch sc;  // the compaction's list, masks and counts (no partials: one chunk)
  const uint64_t list_bytes = align256(axpy_layout(w, t, s, static_cast<uint8_t*>(scratch), &sc, false));
  PI_LAUNCH(k_axpy_compact, pi_dim3(token_groups(t)), pi_dim3(kScan), as_stream(stream), s.logits, s.rows, n_cand,
            s.threshold, s.n_out, t, sc.list, sc.masks, sc.count, s.rows_read);
  check_launch("mul_mat_sparse (compaction)");
  const QAct qa = quantize_activations(w, x, t, static_cast<uint8_t*>(scratch) + list_bytes, stream);
  const int64_t blocks = n_cand < kSparseBlocks ? n_cand : kSparseBlocks;
  const pi_dim3 grid(static_cast<unsigned>(blocks > 0 ? blocks : 1), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(w.data);
  const int compact = s.compact ? 1 : 0;
#define PI_CALL(DT)                                                                                            \
  PI_LAUNCH(k_mul_mat_sparse<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, w.row_bytes, w.k, x, qa, t, s.rows, \
            compact, n_cand, s.n_out, sc.list, sc.masks, sc.count, y)
  PI_WEIGHT_SWITCH(w.dtype, PI_CALL)
#undef PI_CALL
  check_launch("mul_mat_sparse");
}

void launch_axpy_sparse(const Weights& wt, const float* a, int64_t t, const Selection& s, float* y, void* scratch,
                        void* stream) {
  const int64_t n_cand = s.rows ? s.n_rows : s.n_out;
  const int64_t chunks = axpy_chunks(wt, t, s);
  AxpyScratch sc;
  axpy_layout(wt, t, s, static_cast<uint8_t*>(scratch), &sc);
  PI_LAUNCH(k_axpy_compact, pi_dim3(token_groups(t)), pi_dim3(kScan), as_stream(stream), s.logits, s.rows, n_cand,
            s.threshold, s.n_out, t, sc.list, sc.masks, sc.count, s.rows_read);
  check_launch("axpy_sparse (compaction)");
  float* out = chunks > 1 ? sc.part : y;
  const pi_dim3 grid(blocks_for(wt.k, kAxpyOut), static_cast<unsigned>(chunks), token_groups(t));
  const uint8_t* wd = static_cast<const uint8_t*>(wt.data);
  const int compact = s.compact ? 1 : 0;
#define PI_CALL(DT)                                                                                               \
  PI_LAUNCH(k_axpy_list<DT>, grid, pi_dim3(kThreads), as_stream(stream), wd, wt.row_bytes, wt.k, a, t, s.rows,    \
            compact, n_cand, s.n_out, sc.list, sc.masks, sc.count, chunks, out)
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

void launch_add_rms_norm_mul(const float* a, const float* b, float* h, const float* w, int64_t nw, float* y, int64_t n,
                             int64_t t, float eps, void* stream) {
  PI_LAUNCH(k_add_rms_norm_mul, pi_dim3(static_cast<unsigned>(t)), pi_dim3(kThreads), as_stream(stream), a, b, h, w,
            nw, y, n, eps);
  check_launch("add + rms_norm × weight (fused)");
}

void launch_silu_mul(const float* g, const float* u, bool silu_first, float* y, int64_t n, void* stream) {
  PI_LAUNCH(k_silu_mul, pi_dim3(blocks_for(n, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), g, u,
            silu_first ? 1 : 0, y, n);
  check_launch("silu × up (fused)");
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
  PI_LAUNCH(k_rope, grid, pi_dim3(kEltThreads), as_stream(stream), x, pos, y, static_cast<void*>(nullptr), 0,
            int64_t{0}, n, head_dim, n_dims, mode, freq_base, freq_scale);
  check_launch("rope");
}

void launch_rope_cpy(const float* x, const int32_t* pos, void* cache, int cache_dtype, int64_t row_offset, int64_t n,
                     int64_t t, int head_dim, int n_dims, int mode, double freq_base, double freq_scale,
                     void* stream) {
  const pi_dim3 grid(blocks_for(n, kEltThreads), static_cast<unsigned>(t));
  PI_LAUNCH(k_rope, grid, pi_dim3(kEltThreads), as_stream(stream), x, pos, static_cast<float*>(nullptr), cache,
            cache_dtype, row_offset, n, head_dim, n_dims, mode, freq_base, freq_scale);
  check_launch("rope + KV write (fused)");
}

namespace {
/// Splits of the cache per query (flash-decoding): enough blocks to fill a large GPU (about 256 in
/// all) and at least kAttnSplitMin positions per split; 1 for prompts (n_head·T blocks suffice).
constexpr int64_t kAttnSplitMin = 32;
constexpr int64_t kAttnBlocks = 256;
void attention_split(const AttentionArgs& a, int* n_split, int64_t* span) {
  int64_t range = a.n_past + a.t;  // most positions a query of this call sees
  if (a.window > 0 && range > a.window) range = a.window;
  const int64_t heads = static_cast<int64_t>(a.n_head) * a.t;
  int64_t n = (kAttnBlocks + heads - 1) / heads;
  const int64_t most = (range + kAttnSplitMin - 1) / kAttnSplitMin;
  if (n > most) n = most;
  if (n < 1) n = 1;
  *span = (range + n - 1) / n;
  *n_split = static_cast<int>((range + *span - 1) / *span);
}
}  // namespace

uint64_t attention_scratch_bytes(const AttentionArgs& a) {
  int n_split;
  int64_t span;
  attention_split(a, &n_split, &span);
  if (n_split == 1) return 0;
  return static_cast<uint64_t>(a.t * a.n_head) * static_cast<uint64_t>(n_split) *
         static_cast<uint64_t>(a.head_dim + 2) * 4;
}

void launch_attention(const AttentionArgs& a, void* scratch, void* stream) {
  int n_split;
  int64_t span;
  attention_split(a, &n_split, &span);
  float* part = static_cast<float*>(scratch);
  const pi_dim3 grid(static_cast<unsigned>(a.n_head), static_cast<unsigned>(a.t), static_cast<unsigned>(n_split));
  if (a.kv_dtype == DT_F16) {
    PI_LAUNCH(k_attention<DT_F16>, grid, pi_dim3(kThreads), as_stream(stream), a.q, a.k, a.v, a.y, a.head_dim,
              a.n_head, a.n_head_kv, a.n_past, a.scale, a.window, n_split, span, part);
  } else {
    PI_LAUNCH(k_attention<DT_F32>, grid, pi_dim3(kThreads), as_stream(stream), a.q, a.k, a.v, a.y, a.head_dim,
              a.n_head, a.n_head_kv, a.n_past, a.scale, a.window, n_split, span, part);
  }
  check_launch("attention");
  if (n_split > 1) {
    PI_LAUNCH(k_attention_combine, pi_dim3(static_cast<unsigned>(a.n_head), static_cast<unsigned>(a.t)),
              pi_dim3(kThreads), as_stream(stream), part, a.head_dim, a.n_head, n_split, a.y);
    check_launch("attention (combine splits)");
  }
}

void check_warp_size(void* stream) {
  int* d = static_cast<int*>(dev_alloc(8));
  int h[2] = {0, 0};
  try {
    PI_LAUNCH(k_warp_info, pi_dim3(1), pi_dim3(64), as_stream(stream), d);
    check_launch("warp size check");
    copy_d2h(h, d, 8, stream);
    stream_sync(stream);
  } catch (...) {
    dev_free(d);
    throw;
  }
  dev_free(d);
  if (h[0] != h[1]) {
    throw GpuError("UNAVAILABLE", std::string(platform()) + ": the kernels were compiled for a warp of " +
                                      std::to_string(h[0]) + " lanes, the device runs " + std::to_string(h[1]) +
                                      " (rebuild for this target without -mwavefrontsize64 / -mno-wavefrontsize64)");
  }
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

void launch_moe_scatter(const float* src, int64_t r, const int32_t* ids, int64_t n_used, int64_t t, int64_t m,
                        int64_t n_expert, float fill, float* out, void* stream) {
  const int64_t total = m * n_expert * t;
  PI_LAUNCH(k_moe_scatter, pi_dim3(blocks_for(total, kEltThreads)), pi_dim3(kEltThreads), as_stream(stream), src, r,
            ids, n_used, m, n_expert, fill, total, out);
  check_launch("moe_scatter");
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
