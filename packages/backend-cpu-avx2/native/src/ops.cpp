#include "ops.h"

#include "attn_ggml.h"
#include "attn_tiled.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

namespace pi {
namespace {

constexpr size_t kAlign = 64;

inline size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/// Carves a node's scratch region; with base == nullptr it only measures.
struct Bump {
  uint8_t* base;
  size_t off = 0;
  explicit Bump(uint8_t* b) : base(b) {}
  void* take(size_t bytes) {
    off = align_up(off);
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  }
};

/// Barrier between the phases of a node (a no-op when the graph runs on the calling thread alone).
inline void sync(const NodeExec& n) {
  if (n.pool) n.pool->barrier();
}

inline int64_t lo(int64_t n, int ith, int nth) { return split_begin(n, ith, nth); }
inline int64_t hi(int64_t n, int ith, int nth) { return split_begin(n, ith + 1, nth); }

/// Whether a weight row's axpy is dequantize-then-y = fma(a, w, y) per element (so a row used by several
/// columns can be dequantized once): every dtype but F32 (nothing to convert) and Q4_0/Q8_0 (their axpy
/// rounds a·d per block first).
inline bool axpy_dequantizes(int dt) { return dt != DT_F32 && dt != DT_Q4_0 && dt != DT_Q8_0; }

/// Asks for a weight row that will be read next (sparse ops jump between rows, which defeats the
/// hardware prefetcher at every row start).
inline void prefetch_row(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/// Bytes of an upcoming scattered row that the sparse expert ops prefetch: its head only — the kernels
/// prefetch ahead within the rows they read, and asking for whole rows several rows ahead fills the
/// core's miss queue (prefetch instructions then stall).
constexpr size_t kSparseRowHead = 512;
inline void prefetch_head(const uint8_t* p, size_t bytes) {
  prefetch_row(p, bytes < kSparseRowHead ? bytes : kSparseRowHead);
}

/// The rows of the group after [e, e + R) of a list ending at `end`, for a kernel that fetches them while it
/// computes (KernelTable::dot_rows8_next, axpy_rows_next): nx[r] = row(e + R + r), the last one repeated when
/// the group is short; null when there is no next group.
template <int R, typename Row>
const uint8_t* const* next_group(int64_t e, int64_t end, Row row, const uint8_t** nx) {
  const int64_t n = end - (e + R) < R ? end - (e + R) : R;
  if (n <= 0) return nullptr;
  for (int r = 0; r < R; r++) nx[r] = row(e + R + (r < n ? r : n - 1));
  return nx;
}

/// Takes the next chunk [begin, end) of n items from the node's work queue; false when none is left.
inline bool next_chunk(const NodeExec& nd, int64_t n, int64_t chunk, int64_t* begin, int64_t* end) {
  const int64_t b = nd.chunk->fetch_add(chunk, std::memory_order_relaxed);
  if (b >= n) return false;
  *begin = b;
  *end = b + chunk < n ? b + chunk : n;
  return true;
}

/// Chunk size: about 8 chunks per thread, at least `min`.
inline int64_t chunk_size(int64_t n, int nth, int64_t min) {
  const int64_t c = (n + 8 * nth - 1) / (8 * nth);
  return c < min ? min : c;
}

// ---- dense matrix ops -----------------------------------------------------------------------

struct MatLayout {
  void* xq = nullptr;     // converted activations: T rows of x_row_bytes, or ⌈T/2⌉ column pairs (pairs below)
  float* xtmp = nullptr;  // pairs: one converted row per thread (K floats each)
};

/// Whether a mul_mat takes its activations interleaved by column pairs (KernelTable::gemm_tile_pairs): a
/// float weight with the pair kernel, ≥ 2 columns, all in the prompt GEMM arithmetic (source 2), k % 8 == 0
/// and a row count % 4 == 0 (where gemm_tile applies).
bool mat_pairs(const NodeExec& n) {
  const TensorView& W = n.src[0];
  const int64_t T = n.src[1].rows();
  if (W.packed || T < 2 || W.dtype < 0 || W.dtype >= DT_TABLE || !n.k->gemm_tile_pairs[W.dtype] || !n.k->gemm_tile[W.dtype]) return false;
  if (W.ne[0] % 8 != 0 || W.rows() % 4 != 0 || !n.has[2]) return false;
  const int32_t* gemm = n.src[2].i32();
  return std::all_of(gemm, gemm + T, [](int32_t f) { return f != 0; });
}

MatLayout mat_layout(const NodeExec& n, int nth, Bump& b) {
  MatLayout l;
  const int fmt = x_format(n.src[0].dtype);
  const int64_t K = n.src[1].ne[0], T = n.src[1].rows();
  const int dt = n.src[0].dtype;
  if ((dt == DT_F32 || dt == DT_F16 || dt == DT_BF16) && T >= 2) {
    // room for the pair layout whether or not this run takes it (the flags are data, and the executor
    // sizes scratch before it binds the kernel table): T + 1 rows and a row per thread
    l.xq = b.take(static_cast<size_t>(K) * 4 * static_cast<size_t>(T + 1));
    l.xtmp = static_cast<float*>(b.take(static_cast<size_t>(K) * 4 * static_cast<size_t>(nth)));
  } else if (fmt != XF_F32) {
    l.xq = b.take(x_row_bytes(fmt, n.src[1].ne[0]) * static_cast<size_t>(T));
  }
  return l;
}

/// Converts x's columns into the weight type's activation format (all threads), then a barrier.
const uint8_t* convert_x(const NodeExec& n, void* xq, int ith, int nth) {
  const TensorView& x = n.src[1];
  const int fmt = x_format(n.src[0].dtype);
  if (fmt == XF_F32) return x.data;
  const int64_t K = x.ne[0], T = x.rows();
  const size_t xrb = x_row_bytes(fmt, K);
  uint8_t* out = static_cast<uint8_t*>(xq);
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) n.k->convert[fmt](x.f32() + t * K, out + t * xrb, K);
  return out;
}

/// convert_x into the pair layout of KernelTable::gemm_tile_pairs: pair p = columns 2p and 2p + 1 (the last
/// column twice when T is odd), 2K floats each.
const float* convert_x_pairs(const NodeExec& n, const MatLayout& l, int ith, int nth) {
  const TensorView& x = n.src[1];
  const int fmt = x_format(n.src[0].dtype);
  const int64_t K = x.ne[0], T = x.rows(), P = (T + 1) / 2;
  float* out = static_cast<float*>(l.xq);
  float* tmp = l.xtmp + static_cast<size_t>(ith) * static_cast<size_t>(K);
  for (int64_t p = lo(P, ith, nth); p < hi(P, ith, nth); p++) {
    float* dst = out + p * 2 * K;
    for (int c = 0; c < 2; c++) {
      const int64_t t = 2 * p + c < T ? 2 * p + c : T - 1;
      const float* row = x.f32() + t * K;
      if (fmt != XF_F32) {
        n.k->convert[fmt](row, reinterpret_cast<uint8_t*>(tmp), K);
        row = tmp;
      }
      for (int64_t i = 0; i < K; i += 8) std::memcpy(dst + 2 * i + 8 * c, row + i, 8 * sizeof(float));
    }
  }
  return out;
}

void op_mul_mat(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const MatLayout l = mat_layout(n, nth, b);
  const TensorView& W = n.src[0];
  const int64_t K = W.ne[0], N = W.rows(), T = n.src[1].rows();
  const bool pairs = mat_pairs(n);
  const float* xpairs = pairs ? convert_x_pairs(n, l, ith, nth) : nullptr;
  const uint8_t* xq = pairs ? nullptr : convert_x(n, l.xq, ith, nth);
  sync(n);
  const size_t wrb = row_bytes(W.dtype, K);
  const size_t xrb = x_row_bytes(x_format(W.dtype), K);
  float* y = n.dst.f32();
  if (W.packed) {
    // Q4_0/Q4_K repacked (TensorStore::packed). One token: 4 groups of 8 rows per kernel call, read as four
    // concurrent streams. A batch: one group × up to 4 tokens per call; a group's weights (8 rows) stay in
    // cache while every token of a 48-token block is dotted with them. Results equal the unpacked kernels'
    // bit for bit, and the GEMM flags do not change Q4_0/Q4_K arithmetic.
    const PackedTileFn tile = n.k->packed_tile[W.dtype];
    const int64_t G = N / 8;
    const size_t gbytes = packed_group_bytes(W.dtype, K);
    int64_t g0, g1;
    float out[64];
    if (T == 1) {
      while (next_chunk(n, G, (chunk_size(G, nth, 4) + 3) / 4 * 4, &g0, &g1)) {
        for (int64_t g = g0; g < g1; g += 4) {
          const int ng = g1 - g < 4 ? static_cast<int>(g1 - g) : 4;
          tile(K, ng, 1, W.packed + static_cast<size_t>(g) * gbytes, &xq, y + g * 8);
        }
      }
      return;
    }
    // batches: two groups (16 rows) × up to 4 tokens per call (the AVX-512 kernels hold the two groups in
    // one register's halves); chunks of whole group pairs
    while (next_chunk(n, G, (chunk_size(G, nth, 2) + 1) / 2 * 2, &g0, &g1)) {
      for (int64_t tb = 0; tb < T; tb += 48) {
        const int64_t te = tb + 48 < T ? tb + 48 : T;
        for (int64_t g = g0; g < g1; g += 2) {
          const int ng = g1 - g < 2 ? 1 : 2;
          const uint8_t* grp = W.packed + static_cast<size_t>(g) * gbytes;
          for (int64_t t = tb; t < te; t += 4) {
            const int nc = te - t < 4 ? static_cast<int>(te - t) : 4;
            const uint8_t* x[4];
            for (int c = 0; c < nc; c++) x[c] = xq + (t + c) * xrb;
            tile(K, ng, nc, grp, x, out);
            for (int j = 0; j < ng; j++) {
              for (int c = 0; c < nc; c++) {
                for (int r = 0; r < 8; r++) y[(g + j) * 8 + r + (t + c) * N] = out[8 * (j * nc + c) + r];
              }
            }
          }
        }
      }
    }
    return;
  }
  const DotTileFn dot_tile = n.k->dot_tile[W.dtype];
  // Columns flagged for llama.cpp's prompt GEMM arithmetic (source 2, see graph.ts) take it where ggml's
  // llamafile path would: a kernel for the weight type, k % 8 == 0 and a row count % 4 == 0.
  const DotTileFn gemm_tile = K % 8 == 0 && N % 4 == 0 ? n.k->gemm_tile[W.dtype] : nullptr;
  const int32_t* gemm = n.has[2] && gemm_tile ? n.src[2].i32() : nullptr;
  if (gemm && std::none_of(gemm, gemm + T, [](int32_t f) { return f != 0; })) gemm = nullptr;
  const auto tile_of = [&](int64_t t) { return gemm && gemm[t] ? gemm_tile : dot_tile; };
  // with GEMM columns a multiple of 4 rows, so their tiles (4 rows) are cut only at the matrix's end
  const int64_t chunk = gemm ? (chunk_size(N, nth, 16) + 3) / 4 * 4 : chunk_size(N, nth, 16);
  int64_t r0, r1;
  if (T == 1 && tile_of(0) == dot_tile) {
    // Rows of a page or more: four at a time, read as four concurrent streams. One long row after
    // another leaves the memory system mostly idle (one DRAM stream per core, the prefetcher stopping
    // at each page); four in flight nearly double F16 matrix × vector throughput on a Zen 3 core.
    // Shorter rows (Q4_0 at n_embd 4096: 2.3 KB) are one sequential stream already, and the rows
    // interleaved run slower there. Tiles compute each output exactly as dot does.
    // Q8_0 rows (4352 bytes at n_embd 4096) also run faster one after another: 64 → 88 t/s dense decode
    // on the 2-layer 7B slice, 2 threads, 2-vCPU AMD EPYC with AVX-512 (F16's 8 KB rows lose there,
    // 62 → 56). Q8_0 without the next row's software prefetch, which leaves the sequential stream to the
    // hardware prefetcher: 1 thread 46.5–49.9 → 50.7–54.5 t/s, 2 threads 86.2–92.6 → 90.8–103.5 (same
    // machine, three alternating rounds of 5).
    if (wrb < 4096 || W.dtype == DT_Q8_0) {
      const bool pf = W.dtype != DT_Q8_0;
      while (next_chunk(n, N, chunk, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
          const uint8_t* w = W.data + r * wrb;
          if (pf && r + 1 < N) prefetch_row(w + wrb, wrb);
          y[r] = n.k->dot[W.dtype](K, w, xq);
        }
      }
      return;
    }
    while (next_chunk(n, N, chunk, &r0, &r1)) {
      for (int64_t r = r0; r < r1; r += 4) {
        const int nr = r + 4 <= r1 ? 4 : static_cast<int>(r1 - r);
        const uint8_t* w[4];
        for (int i = 0; i < nr; i++) w[i] = W.data + (r + i) * wrb;
        dot_tile(K, nr, 1, w, &xq, y + r);
      }
    }
    return;
  }
  if (!gemm) {
    // Rows in tiles of 16, tokens in tiles of 32: a tile's weight rows stay in cache while every
    // token of the tile is dotted with them, so each weight row is read from memory once per tile;
    // inside, 2 rows × 2 tokens at a time share their loads (same per-output arithmetic as dot). Q4_0
    // and Q4_K take 1 row × 4 tokens: their kernels unpack a row's block (Q4_K: decode its scales) once
    // for the 4 tokens.
    const bool wide = W.dtype == DT_Q4_0 || W.dtype == DT_Q4_K;
    const int mr = wide ? 1 : 2, mc = wide ? 4 : 2;
    while (next_chunk(n, N, chunk, &r0, &r1)) {
      for (int64_t rb = r0; rb < r1; rb += 16) {
        const int64_t re = rb + 16 < r1 ? rb + 16 : r1;
        for (int64_t tb = 0; tb < T; tb += 32) {
          const int64_t te = tb + 32 < T ? tb + 32 : T;
          for (int64_t r = rb; r < re; r += mr) {
            const int nr = r + mr <= re ? mr : static_cast<int>(re - r);
            const uint8_t* w[2] = {W.data + r * wrb, W.data + (r + 1) * wrb};
            for (int64_t t = tb; t < te; t += mc) {
              const int nc = t + mc <= te ? mc : static_cast<int>(te - t);
              const uint8_t* x[4];
              for (int c = 0; c < nc; c++) x[c] = xq + (t + c) * xrb;
              float out[8];
              dot_tile(K, nr, nc, w, x, out);
              for (int i = 0; i < nr; i++) {
                for (int c = 0; c < nc; c++) y[r + i + (t + c) * N] = out[i * nc + c];
              }
            }
          }
        }
      }
    }
    return;
  }
  // With GEMM columns: rows in blocks of 16, tokens in blocks of 48; a block's weight rows stay in
  // cache while every token of the block is dotted with them. Inside, a run of columns taking the same
  // arithmetic is cut into register tiles: GEMM columns 4 rows × gemm_cols columns (3 on AVX2, 12 with
  // AVX-512's 32 registers), the others 2 × 2; a tile's columns go over all the block's rows before the
  // next tile, so their activations are reused from cache. Per-output arithmetic does not depend on the
  // tile (see DotTileFn and KernelTable::gemm_tile).
  while (next_chunk(n, N, chunk, &r0, &r1)) {
    for (int64_t rb = r0; rb < r1; rb += 16) {
      const int64_t re = rb + 16 < r1 ? rb + 16 : r1;
      for (int64_t tb = 0; tb < T; tb += 48) {
        const int64_t te = tb + 48 < T ? tb + 48 : T;
        for (int64_t t = tb; t < te;) {
          const DotTileFn tile = tile_of(t);
          const bool g = tile != dot_tile;
          const int mc = g ? (n.k->gemm_cols < 12 ? n.k->gemm_cols : 12) : 2, mr = g ? 4 : 2;
          int nc = 1;
          while (nc < mc && t + nc < te && tile_of(t + nc) == tile) nc++;
          const uint8_t* x[12];
          if (pairs) {
            // t is even here: every column takes the GEMM arithmetic, blocks of 48 and runs of 12
            for (int p = 0; p < (nc + 1) / 2; p++) x[p] = reinterpret_cast<const uint8_t*>(xpairs + (t / 2 + p) * 2 * K);
          } else {
            for (int c = 0; c < nc; c++) x[c] = xq + (t + c) * xrb;
          }
          const DotTileFn run = pairs ? n.k->gemm_tile_pairs[W.dtype] : tile;
          for (int64_t r = rb; r < re; r += mr) {
            const int nr = r + mr <= re ? mr : static_cast<int>(re - r);
            const uint8_t* w[4];
            for (int i = 0; i < nr; i++) w[i] = W.data + (r + i) * wrb;
            float out[48];
            run(K, nr, nc, w, x, out);
            for (int i = 0; i < nr; i++) {
              for (int c = 0; c < nc; c++) y[r + i + (t + c) * N] = out[i * nc + c];
            }
          }
          t += nc;
        }
      }
    }
  }
}

void op_get_rows(const NodeExec& n, int ith, int nth) {
  const TensorView& W = n.src[0];
  const int32_t* ids = n.src[1].i32();
  const int64_t K = W.ne[0], T = n.src[1].nel;
  const size_t wrb = row_bytes(W.dtype, K);
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) {
    n.k->dequant[W.dtype](W.data + static_cast<int64_t>(ids[t]) * wrb, n.dst.f32() + t * K, K);
  }
}

// ---- sparse ops -----------------------------------------------------------------------------

struct SparseLayout {
  void* xq = nullptr;          // mul_mat_sparse: converted activations
  int64_t* count = nullptr;    // number of list entries
  int32_t* list = nullptr;     // pairs (neuron, weight row) with at least one active token
  uint8_t* mark = nullptr;     // n_out flags (duplicates in rows are taken once)
  float* acc = nullptr;        // axpy_sparse: nth accumulators of E·T floats (nth > 1)
  float* tmp = nullptr;        // axpy_sparse: nth rows of E floats (dequantized weight row)
  // mul_mat_sparse with a batch (batch_kind != BK_NONE)
  int32_t* part = nullptr;     // 2·ncand: the list's busy entries first (see partition_busy)
  int64_t* n_busy = nullptr;   // number of busy entries
  uint8_t* pack = nullptr;     // BK_PACKED: nth × 2 repacked groups of 8 gathered rows
  // axpy_sparse with a batch (axpy_batch)
  int64_t cap = 0;             // entries a thread's share holds at most
  uint8_t* slices = nullptr;   // nth × cap slices of the share's rows (SliceSpec)
  int32_t* bidx = nullptr;     // nth × min(T, AXPY_TC) × cap: per token, the share's entries active at it
  float* ba = nullptr;         // … and their coefficients a[i, t]
  // file-backed weight (neuron cache) only
  int32_t* slot = nullptr;     // cache slot of each list entry
  int32_t* order = nullptr;    // mul_mat_sparse: entries of the round, rows already loaded first
  int64_t* round = nullptr;    // end of the current round (entries [r0, round[0]) hold slots)
};

/// How mul_mat_sparse computes the busy rows of a batch (rows active for many of its tokens; see
/// partition_busy): whole tiles of rows × tokens, each output in the arithmetic of the type's dot (so the
/// result of an output never depends on the path), the products of inactive pairs dropped.
enum BatchKind {
  BK_NONE = 0,  ///< every row by its active tokens (dot_active_tokens)
  BK_DOT,       ///< F32/F16: dot_tile, 4 rows × 3 tokens
  BK_GEMM,      ///< Q8_0: gemm_tile, 4 rows × up to 6 tokens (its arithmetic is the Q8_0 dot's)
  BK_PACKED,    ///< Q4_0/Q4_K: 16 gathered rows repacked into two groups, packed_tile × 4 tokens
};

int batch_kind(const KernelTable* k, int dtype, int64_t K) {
  if ((dtype == DT_F32 || dtype == DT_F16) && k->dot_tile[dtype]) return BK_DOT;
  if (dtype == DT_Q8_0 && k->gemm_tile[dtype] && k->gemm_is_dot[dtype] && K % 8 == 0) return BK_GEMM;
  if ((dtype == DT_Q4_0 || dtype == DT_Q4_K) && k->packed_tile[dtype]) return BK_PACKED;
  return BK_NONE;
}

/// Tokens per pass of axpy_batch: its per-token lists hold this many tokens, and the weights are read and
/// converted once per pass (at 64 tokens the F16 7B slice's conversions cost more than the products saved;
/// one pass for llama-bench's ubatch of 512).
constexpr int64_t AXPY_TC = 512;

/// How axpy_batch holds a part of a weight row (see AxpyGatherFn): the slice kind, the elements per slice
/// (width: 64, or the block size when larger) and the bytes per slice; kind −1 where the dtype or the row
/// length does not allow it (rows of a length not a multiple of the width take the row-by-row path).
struct SliceSpec {
  int kind = -1;
  int64_t width = 0;
  int64_t stride = 0;
};

SliceSpec slice_spec(int dtype, int64_t E) {
  const int64_t blk = dtype_layout(dtype).block;
  if (blk <= 0) return {};
  const int64_t width = blk > 64 ? blk : 64;
  if (width % 64 != 0 || E % width != 0) return {};
  switch (dtype) {
    case DT_Q4_0:
    case DT_Q8_0: return {SK_I8, 64, 72};
    case DT_F16: return {SK_F16, 64, 128};
    case DT_F32: return {SK_F32, 64, 256};
    default: return axpy_dequantizes(dtype) ? SliceSpec{SK_F32, width, 4 * width} : SliceSpec{};
  }
}

SparseLayout sparse_layout(const NodeExec& n, int nth, Bump& b) {
  SparseLayout l;
  const TensorView& W = n.src[0];
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const int64_t ncand = n.has[3] ? n.src[3].nel : n_out;
  const int64_t T = n.src[1].rows();
  if (n.op == OP_MUL_MAT_SPARSE) {
    const int fmt = x_format(W.dtype);
    if (fmt != XF_F32) l.xq = b.take(x_row_bytes(fmt, W.ne[0]) * static_cast<size_t>(T));
    // (sized by the dtype alone: the scratch is measured without a kernel table)
    const int d = W.dtype;
    if (T > 1 && (d == DT_F32 || d == DT_F16 || d == DT_Q8_0 || d == DT_Q4_0 || d == DT_Q4_K)) {
      l.part = static_cast<int32_t*>(b.take(sizeof(int32_t) * 2 * static_cast<size_t>(ncand)));
      l.n_busy = static_cast<int64_t*>(b.take(sizeof(int64_t)));
      if (d == DT_Q4_0 || d == DT_Q4_K) l.pack = static_cast<uint8_t*>(b.take(2 * packed_group_bytes(d, W.ne[0]) * static_cast<size_t>(nth)));
    }
  }
  l.count = static_cast<int64_t*>(b.take(sizeof(int64_t)));
  l.list = static_cast<int32_t*>(b.take(sizeof(int32_t) * 2 * static_cast<size_t>(ncand)));
  l.mark = static_cast<uint8_t*>(b.take(static_cast<size_t>(n_out)));
  if (n.op == OP_AXPY_SPARSE) {
    const size_t E = static_cast<size_t>(W.ne[0]);
    if (nth > 1) l.acc = static_cast<float*>(b.take(sizeof(float) * E * static_cast<size_t>(T) * nth));
    if (T > 1 && axpy_dequantizes(W.dtype)) l.tmp = static_cast<float*>(b.take(sizeof(float) * E * nth));
    const SliceSpec sp = slice_spec(W.dtype, W.ne[0]);
    if (T > 1 && sp.kind >= 0 && !W.cache) {
      l.cap = (ncand + nth - 1) / nth;
      const size_t per = static_cast<size_t>(nth) * static_cast<size_t>(l.cap);
      l.slices = static_cast<uint8_t*>(b.take(per * static_cast<size_t>(sp.stride)));
      const size_t tc = static_cast<size_t>(T < AXPY_TC ? T : AXPY_TC);
      l.bidx = static_cast<int32_t*>(b.take(sizeof(int32_t) * per * tc));
      l.ba = static_cast<float*>(b.take(sizeof(float) * per * tc));
    }
  }
  if (W.cache) {
    l.slot = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(ncand)));
    l.order = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(ncand)));
    l.round = static_cast<int64_t*>(b.take(sizeof(int64_t) * 2));
  }
  return l;
}

/// Thread 0: the list of candidate neurons with at least one active token column.
void build_active_list(const NodeExec& n, const SparseLayout& l) {
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const int64_t M = n.src[0].rows();
  const int64_t T = n.src[1].rows();
  const bool has_rows = n.has[3];
  const int64_t ncand = has_rows ? n.src[3].nel : n_out;
  const bool compact = has_rows && M == ncand;
  const int32_t* rows = has_rows ? n.src[3].i32() : nullptr;
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  std::memset(l.mark, 0, static_cast<size_t>(n_out));
  int64_t len = 0;
  for (int64_t j = 0; j < ncand; j++) {
    const int64_t i = rows ? rows[j] : j;
    if (l.mark[i]) continue;
    l.mark[i] = 1;
    bool any = logits == nullptr;
    for (int64_t t = 0; !any && t < T; t++) any = logits[i + t * n_out] >= thr;
    if (!any) continue;
    l.list[2 * len] = static_cast<int32_t>(i);
    l.list[2 * len + 1] = static_cast<int32_t>(compact ? j : i);
    len++;
  }
  *l.count = len;
}

/// Thread 0, a batch: reorders the active list so that its busy entries come first (each part in list
/// order), *n_busy of them. Busy: active for at least half of the tokens, estimated on up to 64 tokens spread
/// over the batch (half measured faster than a quarter, and both faster than no tiles, on the 2-layer 7B F16
/// and Q4_0 slices, pp128/pp512 at 2 threads). Only the speed depends on the estimate: both paths give every
/// output the same value.
void partition_busy(const NodeExec& n, const SparseLayout& l) {
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const int64_t T = n.src[1].rows();
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  const int64_t len = *l.count;
  const int64_t S = T < 64 ? T : 64;
  int64_t nb = 0, ns = 0;
  for (int64_t e = 0; e < len; e++) {
    const int64_t i = l.list[2 * e];
    int64_t c = S;
    if (logits) {
      c = 0;
      for (int64_t j = 0; j < S; j++) c += logits[i + (j * T / S) * n_out] >= thr;
    }
    if (2 * c >= S) {
      l.part[2 * nb] = l.list[2 * e];
      l.part[2 * nb + 1] = l.list[2 * e + 1];
      nb++;
    } else {
      // quiet entries stay in list order in `list` itself, compacted behind (ns ≤ e)
      l.list[2 * ns] = l.list[2 * e];
      l.list[2 * ns + 1] = l.list[2 * e + 1];
      ns++;
    }
  }
  // list = busy entries, then the quiet ones
  std::memmove(l.list + 2 * nb, l.list, sizeof(int32_t) * 2 * static_cast<size_t>(ns));
  std::memcpy(l.list, l.part, sizeof(int32_t) * 2 * static_cast<size_t>(nb));
  *l.n_busy = nb;
}

/// One weight row (output i) against the batch's tokens for which it is active (all tokens without
/// logits; else logit ≥ thr), four tokens per tile call: y[i + t·n_out] = dot(row, x_t). Returns the
/// number of products.
inline int64_t dot_active_tokens(DotTileFn tile, int64_t K, const uint8_t* w, const uint8_t* xq,
                                 size_t xrb, int64_t T, const float* logits, float thr, int64_t i, int64_t n_out, float* y) {
  int64_t done = 0;
  int64_t ts[4];
  const uint8_t* xs[4];
  int m = 0;
  for (int64_t t = 0; t <= T; t++) {
    if (t < T) {
      if (logits && !(logits[i + t * n_out] >= thr)) continue;
      ts[m] = t;
      xs[m++] = xq + t * xrb;
      if (m < 4) continue;
    }
    if (m == 0) continue;
    float out[4];
    tile(K, 1, m, &w, xs, out);
    for (int j = 0; j < m; j++) y[i + ts[j] * n_out] = out[j];
    done += m;
    m = 0;
  }
  return done;
}

/// A batch's busy entries [e0, e1) of the active list (up to 4 rows, BK_PACKED up to 16) against every token
/// block where one of them is active: whole tiles, only the active pairs' outputs stored (their number is
/// returned). Each output is computed in the arithmetic of the type's dot, as dot_active_tokens does.
int64_t busy_rows(const NodeExec& n, const SparseLayout& l, int bk, int64_t e0, int64_t e1, const uint8_t* xq,
                  size_t xrb, float* y, int ith) {
  const TensorView& W = n.src[0];
  const int64_t K = W.ne[0], T = n.src[1].rows();
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  const size_t wrb = row_bytes(W.dtype, K);
  const int nr = static_cast<int>(e1 - e0);
  int64_t iout[16];
  const uint8_t* w[16];
  for (int r = 0; r < nr; r++) {
    iout[r] = l.list[2 * (e0 + r)];
    w[r] = W.data + static_cast<int64_t>(l.list[2 * (e0 + r) + 1]) * wrb;
  }
  const auto active = [&](int r, int64_t t) { return !logits || logits[iout[r] + t * n_out] >= thr; };
  const auto any_active = [&](int64_t t0, int nc) {
    for (int c = 0; c < nc; c++) {
      for (int r = 0; r < nr; r++) {
        if (active(r, t0 + c)) return true;
      }
    }
    return false;
  };
  int64_t done = 0;
  const uint8_t* x[8];
  float out[128];
  if (bk == BK_PACKED) {
    // the rows repacked into one or two groups of 8 (a short group repeats its last row; those outputs are dropped)
    const size_t gbytes = packed_group_bytes(W.dtype, K);
    uint8_t* pk = l.pack + static_cast<size_t>(ith) * 2 * gbytes;
    const int ng = nr > 8 ? 2 : 1;
    for (int g = 0; g < ng; g++) {
      const uint8_t* rows[8];
      for (int r = 0; r < 8; r++) rows[r] = w[8 * g + r < nr ? 8 * g + r : nr - 1];
      pack_rows_x8(W.dtype, K, rows, pk + static_cast<size_t>(g) * gbytes);
    }
    const PackedTileFn ptile = n.k->packed_tile[W.dtype];
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
      const int nc = T - t0 < 4 ? static_cast<int>(T - t0) : 4;
      if (!any_active(t0, nc)) continue;
      for (int c = 0; c < nc; c++) x[c] = xq + (t0 + c) * xrb;
      ptile(K, ng, nc, pk, x, out);
      for (int g = 0; g < ng; g++) {
        for (int c = 0; c < nc; c++) {
          for (int r = 0; r < 8 && 8 * g + r < nr; r++) {
            if (!active(8 * g + r, t0 + c)) continue;
            y[iout[8 * g + r] + (t0 + c) * n_out] = out[8 * (g * nc + c) + r];
            done++;
          }
        }
      }
    }
    return done;
  }
  const DotTileFn tile = bk == BK_DOT ? n.k->dot_tile[W.dtype] : n.k->gemm_tile[W.dtype];
  const int ncb = bk == BK_DOT ? 3 : (n.k->gemm_cols < 6 ? n.k->gemm_cols : 6);
  for (int64_t t0 = 0; t0 < T; t0 += ncb) {
    const int nc = T - t0 < ncb ? static_cast<int>(T - t0) : ncb;
    if (!any_active(t0, nc)) continue;
    for (int c = 0; c < nc; c++) x[c] = xq + (t0 + c) * xrb;
    tile(K, nr, nc, w, x, out);
    for (int r = 0; r < nr; r++) {
      for (int c = 0; c < nc; c++) {
        if (!active(r, t0 + c)) continue;
        y[iout[r] + (t0 + c) * n_out] = out[r * nc + c];
        done++;
      }
    }
  }
  return done;
}

void op_mul_mat_sparse(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const SparseLayout l = sparse_layout(n, nth, b);
  const TensorView& W = n.src[0];
  const int64_t K = W.ne[0], T = n.src[1].rows();
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  float* y = n.dst.f32();
  const int bk = T > 1 ? batch_kind(n.k, W.dtype, K) : BK_NONE;
  if (ith == 0) {
    build_active_list(n, l);
    if (bk != BK_NONE) partition_busy(n, l);
  }
  const uint8_t* xq = convert_x(n, l.xq, ith, nth);
  const int64_t ny = n.dst.nel;
  std::memset(y + lo(ny, ith, nth), 0, sizeof(float) * static_cast<size_t>(hi(ny, ith, nth) - lo(ny, ith, nth)));
  sync(n);
  const int64_t len = *l.count;
  const int64_t nbusy = bk != BK_NONE ? *l.n_busy : 0;
  const size_t wrb = row_bytes(W.dtype, K);
  const size_t xrb = x_row_bytes(x_format(W.dtype), K);
  int64_t read = 0;
  // work items: groups of busy entries (tiles), then chunks of the quiet ones
  const int64_t gr = bk == BK_PACKED ? 16 : 4;
  const int64_t ngroups = (nbusy + gr - 1) / gr;
  // (a whole number of tile_rows groups per chunk, so that every group but a chunk's last is full)
  const int64_t tr = n.k->tile_rows[W.dtype];
  const int64_t chunk = (chunk_size(len - nbusy, nth, 8) + tr - 1) / tr * tr;
  const int64_t items = ngroups + (len - nbusy + chunk - 1) / chunk;
  int64_t j0, j1, e0, e1;
  const DotTileFn tile = n.k->dot_tile[W.dtype];
  while (next_chunk(n, items, 1, &j0, &j1)) {
    if (j0 < ngroups) {
      const int64_t b0 = j0 * gr;
      read += busy_rows(n, l, bk, b0, b0 + gr < nbusy ? b0 + gr : nbusy, xq, xrb, y, ith);
      continue;
    }
    e0 = nbusy + (j0 - ngroups) * chunk;
    e1 = e0 + chunk < len ? e0 + chunk : len;
    if (T == 1) {
      // One token: tile_rows active rows at a time (4; 8 for Q4_0) as concurrent streams (as the dense matrix × vector),
      // the next group prefetched: a sparse row (Q4_0: 2.3 KB at n_embd 4096) is too short for the
      // hardware prefetcher to ramp up on.
      // With dot_rows8_next (Q4_0) the kernel fetches the next group while it computes this one.
      const int R = n.k->tile_rows[W.dtype];
      const auto next_fn = R == 8 ? n.k->dot_rows8_next[W.dtype] : nullptr;
      for (int64_t p = e0; p < e0 + R && p < e1; p++) prefetch_head(W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb, wrb);
      for (int64_t e = e0; e < e1; e += R) {
        const int nr = e + R <= e1 ? R : static_cast<int>(e1 - e);
        const uint8_t* w[8];
        float out[8];
        for (int r = 0; r < nr; r++) w[r] = W.data + static_cast<int64_t>(l.list[2 * (e + r) + 1]) * wrb;
        if (next_fn && nr == 8) {
          const uint8_t* nx[8];
          next_fn(K, w, xq, out, next_group<8>(e, e1, [&](int64_t p) { return W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb; }, nx));
        } else {
          for (int64_t p = e + R; p < e + 2 * R && p < e1; p++) prefetch_head(W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb, wrb);
          tile(K, nr, 1, w, &xq, out);
        }
        for (int r = 0; r < nr; r++) y[l.list[2 * (e + r)]] = out[r];
      }
      read += e1 - e0;
      continue;
    }
    // two rows ahead: a small row (Q4_0: 2.3 KB at n_embd 4096) takes less time than a DRAM round trip
    if (e0 + 1 < e1) prefetch_row(W.data + static_cast<int64_t>(l.list[2 * e0 + 3]) * wrb, wrb);
    for (int64_t e = e0; e < e1; e++) {
      const int64_t i = l.list[2 * e];
      const uint8_t* w = W.data + static_cast<int64_t>(l.list[2 * e + 1]) * wrb;
      if (e + 2 < e1) prefetch_row(W.data + static_cast<int64_t>(l.list[2 * e + 5]) * wrb, wrb);
      read += dot_active_tokens(tile, K, w, xq, xrb, T, logits, thr, i, n_out, y);
    }
  }
  n.rows_read[ith] += read;
}

/// axpy_sparse with a batch, one active neuron i: its row `w` times a[i, t] added into column t of `acc`
/// for every column whose logit passes. Dequantizing once for several columns is only taken where it
/// rounds exactly like the row's own axpy (axpy_dequantizes: the same fma(a, w, y) per element, whether
/// the row is converted block by block or whole); Q4_0/Q8_0 round a·d per block first, so their columns
/// take the row's axpy, and a column's result never depends on the rest of the batch.
/// @return the columns the row was added to (rows read).
int64_t axpy_row_columns(const NodeExec& n, const uint8_t* w, int64_t i, int64_t T, int64_t E, int64_t n_out,
                         const float* a, const float* logits, float thr, float* tmp, float* acc) {
  const int dtype = n.src[0].dtype;
  int64_t nact = 0;
  for (int64_t t = 0; t < T; t++) nact += (!logits || logits[i + t * n_out] >= thr) ? 1 : 0;
  const bool deq = tmp && nact >= 2 && axpy_dequantizes(dtype);
  if (deq) n.k->dequant[dtype](w, tmp, E);
  const AxpyFn axpy = n.k->axpy[dtype];
  for (int64_t t = 0; t < T; t++) {
    if (logits && !(logits[i + t * n_out] >= thr)) continue;
    if (deq) {
      n.k->axpy_f32(E, a[i + t * n_out], tmp, acc + t * E);
    } else {
      axpy(E, a[i + t * n_out], w, acc + t * E);
    }
  }
  return nact;
}

/// The operands of an axpy_sparse node: Wt [E, M], activations a [n_out, T], optional logits and threshold.
struct AxpyArgs {
  const TensorView& W;
  int64_t E, T, n_out;
  float thr;
  const float* logits;
  const float* a;
  size_t wrb;  // bytes per weight row
  explicit AxpyArgs(const NodeExec& n)
      : W(n.src[0]),
        E(W.ne[0]),
        T(n.src[1].rows()),
        n_out(static_cast<int64_t>(n.p[1])),
        thr(static_cast<float>(n.p[0])),
        logits(n.has[2] ? n.src[2].f32() : nullptr),
        a(n.src[1].f32()),
        wrb(row_bytes(W.dtype, E)) {}
};

/// Whether the table has what axpy_batch needs for this slice kind (fill_slice's converter and axpy_gather).
bool batch_usable(const KernelTable* k, int dtype, const SliceSpec& sp) {
  if (sp.kind < 0 || !k->axpy_gather[sp.kind]) return false;
  if (sp.kind == SK_I8) return k->slice_i8[dtype] != nullptr;
  return sp.kind == SK_F16 || dtype == DT_F32 || k->dequant[dtype] != nullptr;
}

/// Fills one slice (SliceSpec) from the part of a weight row at w (block-aligned, sp.width elements).
void fill_slice(const NodeExec& n, const SliceSpec& sp, const uint8_t* w, uint8_t* s) {
  const int dtype = n.src[0].dtype;
  if (sp.kind == SK_I8) {
    n.k->slice_i8[dtype](w, s);
  } else if (sp.kind == SK_F16 || dtype == DT_F32) {
    std::memcpy(s, w, static_cast<size_t>(sp.stride));
  } else {
    n.k->dequant[dtype](w, reinterpret_cast<float*>(s), sp.width);
  }
}

/// axpy_sparse with a batch, thread ith's share [e0, e1) of the active list, into acc (E × T, every element
/// written): per pass of up to AXPY_TC tokens, each token's list of the share's entries active at it; then
/// per part of the row length (SliceSpec), the share's rows converted once into slices and, token by token,
/// the 64-output register tiles of axpy_gather over that token's entries. Each output element gets
/// fma(s, v, acc) over the share's active rows in list order from +0, as axpy_row_columns gives it; the
/// weights are converted once per pass instead of once per (row, token), and the outputs leave the registers
/// once instead of being loaded and stored for every row. @return the (row, token) pairs computed.
int64_t axpy_batch(const NodeExec& n, const AxpyArgs& x, const SparseLayout& l, const SliceSpec& sp, int64_t e0,
                   int64_t e1, float* acc, int ith) {
  const TensorView& W = x.W;
  const int64_t E = x.E, T = x.T, n_out = x.n_out;
  const float thr = x.thr;
  const float* logits = x.logits;
  const float* a = x.a;
  const size_t wrb = x.wrb;
  const size_t cap = static_cast<size_t>(l.cap);
  uint8_t* sl = l.slices + static_cast<size_t>(ith) * cap * static_cast<size_t>(sp.stride);
  const size_t tcap = static_cast<size_t>(T < AXPY_TC ? T : AXPY_TC);
  int32_t* idx = l.bidx + static_cast<size_t>(ith) * tcap * cap;
  float* av = l.ba + static_cast<size_t>(ith) * tcap * cap;
  const AxpyGatherFn gather = n.k->axpy_gather[sp.kind];
  const int64_t esz = sp.kind == SK_I8 ? 1 : sp.kind == SK_F16 ? 2 : 4;
  int64_t cnt[AXPY_TC];
  int64_t read = 0;
  for (int64_t t0 = 0; t0 < T; t0 += AXPY_TC) {
    const int64_t tc = T - t0 < AXPY_TC ? T - t0 : AXPY_TC;
    for (int64_t c = 0; c < tc; c++) {
      const int64_t t = t0 + c;
      int32_t* ic = idx + static_cast<size_t>(c) * cap;
      float* ac = av + static_cast<size_t>(c) * cap;
      int64_t m = 0;
      for (int64_t e = e0; e < e1; e++) {
        const int64_t i = l.list[2 * e];
        if (logits && !(logits[i + t * n_out] >= thr)) continue;
        ic[m] = static_cast<int32_t>(e - e0);
        ac[m] = a[i + t * n_out];
        m++;
      }
      cnt[c] = m;
      read += m;
    }
    for (int64_t ec = 0; ec < E; ec += sp.width) {
      const size_t off = row_bytes(W.dtype, ec);
      for (int64_t e = e0; e < e1; e++) {
        fill_slice(n, sp, W.data + static_cast<int64_t>(l.list[2 * e + 1]) * wrb + off,
                   sl + static_cast<size_t>(e - e0) * static_cast<size_t>(sp.stride));
      }
      for (int64_t c = 0; c < tc; c++) {
        for (int64_t sub = 0; sub < sp.width; sub += 64) {
          gather(cnt[c], idx + static_cast<size_t>(c) * cap, av + static_cast<size_t>(c) * cap, sl + sub * esz, sp.stride,
                 acc + (t0 + c) * E + ec + sub);
        }
      }
    }
  }
  return read;
}

void op_axpy_sparse(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const SparseLayout l = sparse_layout(n, nth, b);
  const AxpyArgs x(n);
  const TensorView& W = x.W;
  const int64_t E = x.E, T = x.T;
  const float* a = x.a;
  const size_t wrb = x.wrb;
  float* y = n.dst.f32();
  if (ith == 0) build_active_list(n, l);
  sync(n);
  const int64_t len = *l.count;
  // Each thread sums its contiguous share of the active rows into its own accumulator; the shares
  // are then added in thread order, so the result depends only on the thread count.
  float* acc = nth == 1 ? y : l.acc + static_cast<size_t>(ith) * static_cast<size_t>(E * T);
  float* tmp = l.tmp ? l.tmp + static_cast<size_t>(ith) * static_cast<size_t>(E) : nullptr;
  int64_t read = 0;
  const int64_t e0 = lo(len, ith, nth), e1 = hi(len, ith, nth);
  const SliceSpec sp = l.slices ? slice_spec(W.dtype, E) : SliceSpec{};
  if (batch_usable(n.k, W.dtype, sp)) {
    read = axpy_batch(n, x, l, sp, e0, e1, acc, ith);
  } else if (T == 1) {
    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(E));
    // Four rows per pass over y: y is loaded and stored once per four rows.
    // With axpy_rows_next (Q4_0) the kernel fetches the next four rows while it adds these.
    const AxpyRowsFn rows = n.k->axpy_rows[W.dtype];
    const auto next_fn = n.k->axpy_rows_next[W.dtype];
    for (int64_t p = e0; p < e0 + 4 && p < e1; p++) prefetch_head(W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb, wrb);
    for (int64_t e = e0; e < e1; e += 4) {
      const int nr = static_cast<int>(e1 - e < 4 ? e1 - e : 4);
      float av[4];
      const uint8_t* wr[4];
      for (int r = 0; r < nr; r++) {
        av[r] = a[l.list[2 * (e + r)]];
        wr[r] = W.data + static_cast<int64_t>(l.list[2 * (e + r) + 1]) * wrb;
      }
      if (next_fn && nr == 4) {
        const uint8_t* nx[4];
        next_fn(E, av, wr, acc, next_group<4>(e, e1, [&](int64_t p) { return W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb; }, nx));
      } else {
        for (int64_t p = e + 4; p < e + 8 && p < e1; p++) prefetch_head(W.data + static_cast<int64_t>(l.list[2 * p + 1]) * wrb, wrb);
        rows(E, nr, av, wr, acc);
      }
    }
    read = e1 - e0;
  } else {
    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(E * T));
    for (int64_t e = e0; e < e1; e++) {
      const int64_t i = l.list[2 * e];
      const uint8_t* w = W.data + static_cast<int64_t>(l.list[2 * e + 1]) * wrb;
      if (e + 1 < e1) prefetch_row(W.data + static_cast<int64_t>(l.list[2 * e + 3]) * wrb, wrb);
      read += axpy_row_columns(n, w, i, T, E, x.n_out, a, x.logits, x.thr, tmp, acc);
    }
  }
  n.rows_read[ith] += read;
  if (nth == 1) return;
  sync(n);
  const int64_t ny = E * T;
  for (int64_t e = lo(ny, ith, nth); e < hi(ny, ith, nth); e++) {
    float s = l.acc[e];
    for (int th = 1; th < nth; th++) s += l.acc[static_cast<size_t>(th) * static_cast<size_t>(ny) + e];
    y[e] = s;
  }
}

// ---- sparse ops over a file-backed weight (neuron cache) --------------------------------------
//
// Thread 0 asks the cache for slots of the active rows (queuing reads for the missing ones) and, for
// mul_mat_sparse, queues the same rows of the other weights of this FFN (gate/up/down) at once, so
// their reads overlap this op and the next. Rows already loaded are computed first; a row still being
// read is waited for. When the cache cannot hold every active row at once (a long prompt), the list is
// done in rounds, each as many rows as fit. Each output element is computed exactly as on the mapped
// path, so results equal the unlimited run's (axpy_sparse: the same per-thread order of rows; rounds
// only change where a thread's groups of four rows start).

/// Thread 0: assigns slots to entries [r0, len); returns the end of the round.
int64_t cache_round(const NodeExec& n, const SparseLayout& l, int64_t r0, int64_t len, bool prefetch_siblings) {
  NeuronCache* c = n.src[0].cache;
  c->begin();
  const bool counts = n.src[0].cache_counts;
  int64_t got = c->request(l.list + 2 * r0 + 1, len - r0, 2, l.slot + r0, counts);
  if (got == 0 && len > r0) {
    // every free slot is held by rows further down the list: take one row alone (always fits: a cache
    // that does not pin every row has at least one cold slot)
    c->begin();
    got = c->request(l.list + 2 * r0 + 1, 1, 2, l.slot + r0, counts);
  }
  if (prefetch_siblings && r0 == 0) {
    // no begin() here: caches of one FFN may share a slot pool, and a new generation would expose this
    // op's own rows to eviction by the prefetch
    for (NeuronCache* sib : c->siblings) sib->request(l.list + 1, len, 2, nullptr, false);
  }
  return r0 + got;
}

void op_mul_mat_sparse_cached(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const SparseLayout l = sparse_layout(n, nth, b);
  const TensorView& W = n.src[0];
  NeuronCache* c = W.cache;
  const size_t part = W.cache_part;
  const int64_t K = W.ne[0], T = n.src[1].rows();
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  float* y = n.dst.f32();
  if (ith == 0) build_active_list(n, l);
  const uint8_t* xq = convert_x(n, l.xq, ith, nth);
  const int64_t ny = n.dst.nel;
  std::memset(y + lo(ny, ith, nth), 0, sizeof(float) * static_cast<size_t>(hi(ny, ith, nth) - lo(ny, ith, nth)));
  sync(n);
  const int64_t len = *l.count;
  const size_t xrb = x_row_bytes(x_format(W.dtype), K);
  const DotTileFn tile = n.k->dot_tile[W.dtype];
  int64_t read = 0;
  int64_t r0 = 0;
  while (r0 < len) {
    if (ith == 0) {
      const int64_t r1 = cache_round(n, l, r0, len, true);
      // rows already loaded first, then the rest in the order their reads were queued (mark[] holds
      // one snapshot of each row's state, so both passes agree)
      for (int64_t e = r0; e < r1; e++) l.mark[l.list[2 * e]] = c->ready(l.slot[e]) ? 2 : 3;
      int64_t k = 0;
      for (int64_t e = r0; e < r1; e++) {
        if (l.mark[l.list[2 * e]] == 2) l.order[k++] = static_cast<int32_t>(e);
      }
      for (int64_t e = r0; e < r1; e++) {
        if (l.mark[l.list[2 * e]] == 3) l.order[k++] = static_cast<int32_t>(e);
      }
      l.round[0] = r1;
      n.chunk->store(0, std::memory_order_relaxed);
    }
    sync(n);
    const int64_t r1 = l.round[0];
    const int64_t cnt = r1 - r0;
    const int64_t chunk = chunk_size(cnt, nth, 4);
    int64_t e0, e1;
    while (next_chunk(n, cnt, chunk, &e0, &e1)) {
      if (T == 1) {
        for (int64_t q = e0; q < e1; q += 4) {
          const int nr = q + 4 <= e1 ? 4 : static_cast<int>(e1 - q);
          const uint8_t* w[4];
          float out[4];
          for (int r = 0; r < nr; r++) w[r] = c->wait(l.slot[l.order[q + r]]) + part;
          tile(K, nr, 1, w, &xq, out);
          for (int r = 0; r < nr; r++) y[l.list[2 * l.order[q + r]]] = out[r];
        }
        read += e1 - e0;
        continue;
      }
      for (int64_t q = e0; q < e1; q++) {
        const int64_t e = l.order[q];
        const int64_t i = l.list[2 * e];
        const uint8_t* w = c->wait(l.slot[e]) + part;
        read += dot_active_tokens(tile, K, w, xq, xrb, T, logits, thr, i, n_out, y);
      }
    }
    sync(n);
    r0 = r1;
  }
  n.rows_read[ith] += read;
}

void op_axpy_sparse_cached(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const SparseLayout l = sparse_layout(n, nth, b);
  const TensorView& W = n.src[0];
  NeuronCache* c = W.cache;
  const size_t part = W.cache_part;
  const int64_t E = W.ne[0], T = n.src[1].rows();
  const int64_t n_out = static_cast<int64_t>(n.p[1]);
  const float thr = static_cast<float>(n.p[0]);
  const float* logits = n.has[2] ? n.src[2].f32() : nullptr;
  const float* a = n.src[1].f32();
  float* y = n.dst.f32();
  if (ith == 0) build_active_list(n, l);
  sync(n);
  const int64_t len = *l.count;
  const AxpyRowsFn rows = n.k->axpy_rows[W.dtype];
  float* acc = nth == 1 ? y : l.acc + static_cast<size_t>(ith) * static_cast<size_t>(E * T);
  std::memset(acc, 0, sizeof(float) * static_cast<size_t>(E * T));
  float* tmp = l.tmp ? l.tmp + static_cast<size_t>(ith) * static_cast<size_t>(E) : nullptr;
  int64_t read = 0;
  const int64_t s0 = lo(len, ith, nth), s1 = hi(len, ith, nth);
  int64_t r0 = 0;
  while (r0 < len) {
    if (ith == 0) l.round[0] = cache_round(n, l, r0, len, false);
    sync(n);
    const int64_t r1 = l.round[0];
    const int64_t e0 = s0 > r0 ? s0 : r0, e1 = s1 < r1 ? s1 : r1;
    if (T == 1) {
      for (int64_t e = e0; e < e1; e += 4) {
        const int nr = static_cast<int>(e1 - e < 4 ? e1 - e : 4);
        float av[4];
        const uint8_t* wr[4];
        for (int r = 0; r < nr; r++) {
          av[r] = a[l.list[2 * (e + r)]];
          wr[r] = c->wait(l.slot[e + r]) + part;
        }
        rows(E, nr, av, wr, acc);
      }
      if (e1 > e0) read += e1 - e0;
    } else {
      for (int64_t e = e0; e < e1; e++) {
        const int64_t i = l.list[2 * e];
        const uint8_t* w = c->wait(l.slot[e]) + part;
        read += axpy_row_columns(n, w, i, T, E, n_out, a, logits, thr, tmp, acc);
      }
    }
    sync(n);
    r0 = r1;
  }
  n.rows_read[ith] += read;
  if (nth == 1) return;
  const int64_t ny = E * T;
  for (int64_t e = lo(ny, ith, nth); e < hi(ny, ith, nth); e++) {
    float s = l.acc[e];
    for (int th = 1; th < nth; th++) s += l.acc[static_cast<size_t>(th) * static_cast<size_t>(ny) + e];
    y[e] = s;
  }
}

// ---- routed experts (mixture of experts) ----------------------------------------------------
//
// ids [U, T] name, per token t, the U experts its slots use. mul_mat_id and mul_mat_id_sparse group the
// (slot, token) pairs by expert, so that a chunk of an expert's rows is read once for every token routed
// to it; each output element is one DotFn call (the arithmetic of mul_mat), so results do not depend on
// the grouping or the thread count. axpy_id_sparse splits its output into (column, block-aligned piece)
// items, each summed by one thread in neuron order.

struct ExpertLayout {
  void* xq = nullptr;        // converted activations (mul_mat_id*)
  int32_t* start = nullptr;  // E + 1 offsets into pairs, by expert
  int32_t* pairs = nullptr;  // U·T pair indices (t·U + u), grouped by expert
  int32_t* used = nullptr;   // experts with at least one pair, in id order
  int64_t* n_used = nullptr;
  // file-backed stack (expert cache, one row per expert) only
  int32_t* slot = nullptr;   // cache slot of used[j]
  int32_t* slot_of = nullptr;  // axpy_id_sparse: slot of expert e in the current round (−1: not in it)
  int64_t* round = nullptr;  // end of the current round (used[j0, round[0]) hold slots)
};

ExpertLayout expert_layout(const NodeExec& n, Bump& b) {
  ExpertLayout l;
  const TensorView& W = n.src[0];
  const int64_t E = W.ne[2], P = n.src[2].nel;
  if (n.op != OP_AXPY_ID_SPARSE) {
    const int fmt = x_format(W.dtype);
    if (fmt != XF_F32) l.xq = b.take(x_row_bytes(fmt, W.ne[0]) * static_cast<size_t>(n.src[1].rows()));
  }
  l.start = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(E + 1)));
  l.pairs = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(P)));
  l.used = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(E)));
  l.n_used = static_cast<int64_t*>(b.take(sizeof(int64_t)));
  if (W.cache) {
    l.slot = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(E)));
    l.slot_of = static_cast<int32_t*>(b.take(sizeof(int32_t) * static_cast<size_t>(E)));
    l.round = static_cast<int64_t*>(b.take(sizeof(int64_t)));
  }
  return l;
}

// A file-backed expert stack (expert cache: one row per expert, see neuron_cache.h) is computed in
// rounds of used experts: thread 0 asks the cache for slots of as many of them as fit (queuing reads for
// the missing ones, and on the first round the same experts of the layer's other stacks, so gate, up and
// down are read together), puts the experts already loaded first, and every thread waits only for the
// expert it computes. Each output element is computed exactly as on the mapped path.

/// Thread 0: slots for used[j0..); returns the end of the round.
int64_t expert_cache_round(const NodeExec& n, const ExpertLayout& l, int64_t j0, int64_t nu) {
  NeuronCache* c = n.src[0].cache;
  const bool counts = n.src[0].cache_counts;
  c->begin();
  int64_t got = c->request(l.used + j0, nu - j0, 1, l.slot + j0, counts);
  if (got == 0 && nu > j0) {
    c->begin();
    got = c->request(l.used + j0, 1, 1, l.slot + j0, counts);
  }
  if (j0 == 0) {
    for (NeuronCache* sib : c->siblings) sib->request(l.used, nu, 1, nullptr, false);
  }
  const int64_t j1 = j0 + got;
  // experts already in memory first (a stable partition: the order of the rest is the queue's)
  int32_t tmp_e[64], tmp_s[64];
  int64_t k = j0;
  for (int64_t a = j0; a < j1; a += 64) {
    const int64_t b = a + 64 < j1 ? a + 64 : j1;
    int nt = 0;
    for (int64_t j = a; j < b; j++) {
      if (c->ready(l.slot[j])) {
        l.used[k] = l.used[j], l.slot[k] = l.slot[j], k++;
      } else {
        tmp_e[nt] = l.used[j], tmp_s[nt] = l.slot[j], nt++;
      }
    }
    // pending ones of this block go after the ready ones found so far; later blocks' ready ones follow
    for (int i = 0; i < nt; i++) l.used[k + i] = tmp_e[i], l.slot[k + i] = tmp_s[i];
    k += nt;
  }
  return j1;
}

/// Thread 0: pairs grouped by expert (counting sort, pairs in order within an expert).
void group_by_expert(const NodeExec& n, const ExpertLayout& l) {
  const int64_t E = n.src[0].ne[2], P = n.src[2].nel;
  const int32_t* ids = n.src[2].i32();
  std::memset(l.start, 0, sizeof(int32_t) * static_cast<size_t>(E + 1));
  for (int64_t p = 0; p < P; p++) l.start[ids[p] + 1]++;
  int64_t nu = 0;
  for (int64_t e = 0; e < E; e++) {
    if (l.start[e + 1] > 0) l.used[nu++] = static_cast<int32_t>(e);
    l.start[e + 1] += l.start[e];
  }
  // fill using `used` slots as cursors would clobber it; walk the pairs once per used expert instead
  for (int64_t j = 0; j < nu; j++) {
    const int32_t e = l.used[j];
    int32_t c = l.start[e];
    for (int64_t p = 0; p < P; p++) {
      if (ids[p] == e) l.pairs[c++] = static_cast<int32_t>(p);
    }
  }
  *l.n_used = nu;
}

void op_mul_mat_id(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const ExpertLayout l = expert_layout(n, b);
  const TensorView& W = n.src[0];
  const int64_t K = W.ne[0], M = W.ne[1];
  const int64_t U = n.src[2].ne[0], T = n.src[2].ne[1];
  const bool per_slot = n.src[1].rows() != T || U == 1;
  const bool sparse = n.op == OP_MUL_MAT_ID_SPARSE;
  const float thr = sparse ? static_cast<float>(n.p[0]) : 0.0f;
  const float* logits = sparse && n.has[3] ? n.src[3].f32() : nullptr;
  float* y = n.dst.f32();
  if (ith == 0) group_by_expert(n, l);
  const uint8_t* xq = convert_x(n, l.xq, ith, nth);
  if (sparse) {
    const int64_t ny = n.dst.nel;
    std::memset(y + lo(ny, ith, nth), 0, sizeof(float) * static_cast<size_t>(hi(ny, ith, nth) - lo(ny, ith, nth)));
  }
  sync(n);
  const size_t wrb = row_bytes(W.dtype, K);
  const size_t xrb = x_row_bytes(x_format(W.dtype), K);
  const DotFn dot = n.k->dot[W.dtype];
  const DotTileFn tile = n.k->dot_tile[W.dtype];
  const int64_t nu = *l.n_used;
  if (W.packed && !sparse && M % 8 == 0) {
    // Q4_0/Q4_K repacked (TensorStore::packed; expert e's rows are groups e·M/8 …): items (used expert,
    // 4 groups of 8 rows). One (slot, token) on the expert: the 4 groups as concurrent streams; more: each
    // group × up to 4 of its columns per call. Results equal the unpacked dot's bit for bit.
    const PackedTileFn ptile = n.k->packed_tile[W.dtype];
    const size_t gbytes = packed_group_bytes(W.dtype, K);
    const int64_t G = M / 8, per = (G + 3) / 4, items = nu * per;
    int64_t i0, i1;
    float out[64];
    while (next_chunk(n, items, chunk_size(items, nth, 1), &i0, &i1)) {
      for (int64_t it = i0; it < i1; it++) {
        const int32_t e = l.used[it / per];
        const int64_t g0 = (it % per) * 4, ng = G - g0 < 4 ? G - g0 : 4;
        const uint8_t* grp = W.packed + (static_cast<size_t>(e) * static_cast<size_t>(G) + static_cast<size_t>(g0)) * gbytes;
        const int32_t q0 = l.start[e], q1 = l.start[e + 1];
        if (q1 - q0 == 1) {
          const int64_t p = l.pairs[q0];
          const uint8_t* xp = xq + (per_slot ? p : p / U) * xrb;
          ptile(K, static_cast<int>(ng), 1, grp, &xp, y + p * M + g0 * 8);
          continue;
        }
        // two groups (16 rows) × up to 4 columns per call, as the dense batch driver
        for (int64_t g = 0; g < ng; g += 2) {
          const int gn = ng - g < 2 ? 1 : 2;
          for (int32_t q = q0; q < q1; q += 4) {
            const int nc = q1 - q < 4 ? q1 - q : 4;
            const uint8_t* x[4];
            for (int c = 0; c < nc; c++) {
              const int64_t p = l.pairs[q + c];
              x[c] = xq + (per_slot ? p : p / U) * xrb;
            }
            ptile(K, gn, nc, grp + static_cast<size_t>(g) * gbytes, x, out);
            for (int j = 0; j < gn; j++) {
              for (int c = 0; c < nc; c++) {
                float* yo = y + static_cast<int64_t>(l.pairs[q + c]) * M + (g0 + g + j) * 8;
                for (int r = 0; r < 8; r++) yo[r] = out[8 * (j * nc + c) + r];
              }
            }
          }
        }
      }
    }
    return;
  }
  // items: (used expert, chunk of rows); one round over every used expert unless the stack is
  // file-backed (expert_cache_round)
  NeuronCache* c = W.cache;
  const int64_t rows_chunk = logits ? 64 : 16;
  const int64_t per_expert = (M + rows_chunk - 1) / rows_chunk;
  int64_t read = 0;
  for (int64_t j0 = 0; j0 < nu;) {
    if (c) {
      if (ith == 0) {
        l.round[0] = expert_cache_round(n, l, j0, nu);
        n.chunk->store(0, std::memory_order_relaxed);
      }
      sync(n);
    }
    const int64_t j1 = c ? l.round[0] : nu;
    const int64_t items = (j1 - j0) * per_expert;
    int64_t i0, i1;
    const int64_t chunk = chunk_size(items, nth, 1);
    while (next_chunk(n, items, chunk, &i0, &i1)) {
      for (int64_t it = i0; it < i1; it++) {
        const int64_t j = j0 + it / per_expert;
        const int32_t e = l.used[j];
        const int64_t r0 = (it % per_expert) * rows_chunk;
        const int64_t r1 = r0 + rows_chunk < M ? r0 + rows_chunk : M;
        const uint8_t* we = c ? c->wait(l.slot[j]) + W.cache_part : W.data + static_cast<size_t>(e) * static_cast<size_t>(M) * wrb;
        if (logits && l.start[e + 1] - l.start[e] == 1) {
          // one (slot, token) on this expert (decode), sparse: the chunk's active rows tile_rows at a time as
          // concurrent streams, the next group prefetched (as mul_mat_sparse's decode); only active rows are read
          const int64_t p = l.pairs[l.start[e]];
          const uint8_t* xp = xq + (per_slot ? p : p / U) * xrb;
          const float* lg = logits + p * M;
          int32_t act[64];
          int na = 0;
          for (int64_t r = r0; r < r1; r++) {
            if (lg[r] >= thr) act[na++] = static_cast<int32_t>(r);
          }
          const int R = n.k->tile_rows[W.dtype];
          const auto next_fn = R == 8 ? n.k->dot_rows8_next[W.dtype] : nullptr;
          for (int j = 0; j < R && j < na; j++) prefetch_head(we + static_cast<size_t>(act[j]) * wrb, wrb);
          for (int i = 0; i < na; i += R) {
            const int nr = na - i < R ? na - i : R;
            const uint8_t* w[8];
            float out[8];
            for (int r = 0; r < nr; r++) w[r] = we + static_cast<size_t>(act[i + r]) * wrb;
            if (next_fn && nr == 8) {
              const uint8_t* nx[8];
              next_fn(K, w, xp, out, next_group<8>(i, na, [&](int64_t p) { return we + static_cast<size_t>(act[p]) * wrb; }, nx));
            } else {
              for (int j = i + R; j < i + 2 * R && j < na; j++) prefetch_head(we + static_cast<size_t>(act[j]) * wrb, wrb);
              tile(K, nr, 1, w, &xp, out);
            }
            for (int r = 0; r < nr; r++) y[p * M + act[i + r]] = out[r];
          }
          read += na;
          continue;
        }
        if (!logits && l.start[e + 1] - l.start[e] == 1) {
          // one (slot, token) on this expert (decode): four rows at a time as concurrent streams, as the
          // dense matrix × vector does; a tile computes each output exactly as dot does
          const int64_t p = l.pairs[l.start[e]];
          const uint8_t* xp = xq + (per_slot ? p : p / U) * xrb;
          for (int64_t r = r0; r < r1; r += 4) {
            const int nr = r + 4 <= r1 ? 4 : static_cast<int>(r1 - r);
            const uint8_t* w[4];
            for (int i = 0; i < nr; i++) w[i] = we + (r + i) * wrb;
            tile(K, nr, 1, w, &xp, y + p * M + r);
          }
          read += r1 - r0;
          continue;
        }
        for (int64_t r = r0; r < r1; r++) {
          const uint8_t* w = we + r * wrb;
          if (r + 1 < r1) prefetch_row(w + wrb, wrb);
          for (int32_t q = l.start[e]; q < l.start[e + 1]; q++) {
            const int64_t p = l.pairs[q];  // t·U + u
            const int64_t o = p * M + r;
            if (logits && !(logits[o] >= thr)) continue;
            const int64_t col = per_slot ? p : p / U;
            y[o] = dot(K, w, xq + col * xrb);
            read++;
          }
        }
      }
    }
    if (c) sync(n);
    j0 = j1;
  }
  if (sparse) n.rows_read[ith] += read;
}

void op_axpy_id_sparse(const NodeExec& n, int ith, int nth) {
  const TensorView& W = n.src[0];
  const int64_t D = W.ne[0], M = W.ne[1];
  const int64_t P = n.src[2].nel;  // columns (slot, token)
  const int32_t* ids = n.src[2].i32();
  const float thr = static_cast<float>(n.p[0]);
  const float* logits = n.has[3] ? n.src[3].f32() : nullptr;
  const float* a = n.src[1].f32();
  float* y = n.dst.f32();
  const size_t wrb = row_bytes(W.dtype, D);
  const int64_t blk = dtype_layout(W.dtype).block;
  // pieces of a column: whole blocks, about 512 values; a single piece from two columns per thread on (a
  // decode step's 4–6 chosen experts at 2 threads: whole rows read once per column, 3–11 % faster on the
  // SmallThinker-4B F16 slice than 512-value pieces, alternating A/B)
  int64_t piece = P >= 2 * nth ? D : (512 + blk - 1) / blk * blk;
  if (piece > D) piece = D;
  const int64_t npieces = (D + piece - 1) / piece;
  const size_t piece_bytes = row_bytes(W.dtype, piece);
  const AxpyFn axpy = n.k->axpy[W.dtype];
  const AxpyRowsFn axpy_rows = n.k->axpy_rows[W.dtype];
  const int64_t items = P * npieces;
  int64_t read = 0;
  // a file-backed stack (expert cache) is summed in rounds of used experts (expert_cache_round); a
  // column whose expert is not in the round waits for its round
  NeuronCache* c = W.cache;
  ExpertLayout l;
  int64_t nu = 1;
  if (c) {
    Bump b(n.scratch);
    l = expert_layout(n, b);
    if (ith == 0) group_by_expert(n, l);
    sync(n);
    nu = *l.n_used;
  }
  for (int64_t j0 = 0; j0 < nu;) {
    if (c) {
      if (ith == 0) {
        const int64_t j1 = expert_cache_round(n, l, j0, nu);
        for (int64_t e = 0; e < W.ne[2]; e++) l.slot_of[e] = -1;
        for (int64_t j = j0; j < j1; j++) l.slot_of[l.used[j]] = l.slot[j];
        l.round[0] = j1;
        n.chunk->store(0, std::memory_order_relaxed);
      }
      sync(n);
    }
    const int64_t j1 = c ? l.round[0] : nu;
    int64_t i0, i1;
    const int64_t chunk = chunk_size(items, nth, 1);
    while (next_chunk(n, items, chunk, &i0, &i1)) {
      for (int64_t it = i0; it < i1; it++) {
        const int64_t p = it / npieces, pc = it % npieces;
        if (c && l.slot_of[ids[p]] < 0) continue;
        const int64_t off = pc * piece;
        const int64_t len = off + piece <= D ? piece : D - off;
        const uint8_t* we = (c ? c->wait(l.slot_of[ids[p]]) + W.cache_part
                               : W.data + static_cast<size_t>(ids[p]) * static_cast<size_t>(M) * wrb) +
                            static_cast<size_t>(pc) * piece_bytes;
        float* yc = y + p * D + off;
        std::memset(yc, 0, sizeof(float) * static_cast<size_t>(len));
        const float* ac = a + p * M;
        const float* lc = logits ? logits + p * M : nullptr;
        // four active rows per pass over the piece (same per-element operations as four axpy calls); the
        // piece of the active row four ahead is prefetched (rows are scattered: no hardware prefetch)
        float av[4];
        const uint8_t* wr[4];
        int nr = 0;
        int64_t ahead = 0, nahead = 0;  // next row to look at for prefetching; active rows prefetched ahead
        for (int64_t i = 0; i < M; i++) {
          if (lc && !(lc[i] >= thr)) continue;
          if (pc == 0) read++;
          if (ahead <= i) ahead = i + 1, nahead = 0;
          else nahead--;
          while (nahead < 4 && ahead < M) {
            if (!lc || lc[ahead] >= thr) {
              prefetch_head(we + ahead * wrb, piece_bytes);
              nahead++;
            }
            ahead++;
          }
          av[nr] = ac[i];
          wr[nr] = we + i * wrb;
          if (++nr == 4) {
            axpy_rows(len, 4, av, wr, yc);
            nr = 0;
          }
        }
        if (nr == 1) {
          axpy(len, av[0], wr[0], yc);
        } else if (nr > 1) {
          axpy_rows(len, nr, av, wr, yc);
        }
      }
    }
    if (c) sync(n);
    j0 = j1;
  }
  n.rows_read[ith] += read;
}

void op_moe_sum(const NodeExec& n, int ith, int nth) {
  const int64_t D = n.src[0].ne[0], U = n.src[2].ne[0], T = n.src[2].ne[1];
  const int64_t NE = n.src[1].ne[0];
  const bool norm = n.p[0] != 0;
  const float scale = static_cast<float>(n.p[1]);
  const float* yin = n.src[0].f32();
  const float* probs = n.src[1].f32();
  const int32_t* ids = n.src[2].i32();
  float* out = n.dst.f32();
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) {
    // the weights in llama.cpp's arithmetic: the sum in double rounded once (ggml_vec_sum_f32), clamped
    // at the smallest normal F16, each weight divided in float, then scaled
    float w[64];
    float wsum_f = 0.0f;
    if (norm) {
      double s = 0.0;
      for (int64_t u = 0; u < U; u++) s += static_cast<double>(probs[t * NE + ids[t * U + u]]);
      wsum_f = static_cast<float>(s);
      if (!(wsum_f >= 6.103515625e-5f)) wsum_f = 6.103515625e-5f;
    }
    float* o = out + t * D;
    for (int64_t u0 = 0; u0 < U; u0 += 64) {
      const int64_t ub = u0 + 64 < U ? u0 + 64 : U;
      for (int64_t u = u0; u < ub; u++) {
        float wu = probs[t * NE + ids[t * U + u]];
        if (norm) wu = wu / wsum_f;
        if (scale != 1.0f) wu = wu * scale;
        w[u - u0] = wu;
      }
      for (int64_t u = u0; u < ub; u++) {
        const float* yu = yin + (t * U + u) * D;
        const float wu = w[u - u0];
        if (u == 0) {
          for (int64_t i = 0; i < D; i++) o[i] = yu[i] * wu;
        } else {
          for (int64_t i = 0; i < D; i++) o[i] = o[i] + yu[i] * wu;
        }
      }
    }
  }
}

void op_top_k(const NodeExec& n, int ith, int nth) {
  const int64_t N = n.src[0].ne[0], T = n.src[0].rows();
  const int64_t k = static_cast<int64_t>(n.p[0]);
  int32_t* out = reinterpret_cast<int32_t*>(n.dst.data);
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) {
    const float* x = n.src[0].f32() + t * N;
    int32_t* o = out + t * k;
    // selection by insertion into the sorted top list: larger first, equal values keep the lower index first
    int64_t len = 0;
    for (int64_t i = 0; i < N; i++) {
      const float v = x[i];
      if (len == k && !(v > x[o[k - 1]])) continue;
      int64_t j = len < k ? len++ : k - 1;
      while (j > 0 && v > x[o[j - 1]]) {
        o[j] = o[j - 1];
        j--;
      }
      o[j] = static_cast<int32_t>(i);
    }
  }
}

// ---- normalisation, rope, softmax, attention ------------------------------------------------

void op_rms_norm(const NodeExec& n, int ith, int nth) {
  const int64_t ne0 = n.src[0].ne[0], R = n.src[0].rows();
  const float eps = static_cast<float>(n.p[0]);
  for (int64_t r = lo(R, ith, nth); r < hi(R, ith, nth); r++) {
    const float* x = n.src[0].f32() + r * ne0;
    float* y = n.dst.f32() + r * ne0;
    // as ggml's rms_norm: each square rounded to float, summed in double
    double sum = 0.0;
    for (int64_t i = 0; i < ne0; i++) sum += static_cast<double>(x[i] * x[i]);
    const float mean = static_cast<float>(sum / static_cast<double>(ne0));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < ne0; i++) y[i] = x[i] * scale;
  }
}

void op_norm(const NodeExec& n, int ith, int nth) {
  const int64_t ne0 = n.src[0].ne[0], R = n.src[0].rows();
  const float eps = static_cast<float>(n.p[0]);
  for (int64_t r = lo(R, ith, nth); r < hi(R, ith, nth); r++) {
    const float* x = n.src[0].f32() + r * ne0;
    float* y = n.dst.f32() + r * ne0;
    double sum = 0.0;
    for (int64_t i = 0; i < ne0; i++) sum += x[i];
    const float mean = static_cast<float>(sum / static_cast<double>(ne0));
    double sum2 = 0.0;
    for (int64_t i = 0; i < ne0; i++) {
      const float v = x[i] - mean;
      y[i] = v;
      sum2 += static_cast<double>(v) * v;
    }
    const float variance = static_cast<float>(sum2 / static_cast<double>(ne0));
    const float scale = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < ne0; i++) y[i] *= scale;
  }
}

void op_rope(const NodeExec& n, int ith, int nth) {
  const int n_dims = static_cast<int>(n.p[0]);
  const int mode = static_cast<int>(n.p[1]);
  const float freq_base = static_cast<float>(n.p[2]);
  const float freq_scale = static_cast<float>(n.p[3]);
  const int64_t hd = static_cast<int64_t>(n.p[4]);
  const int64_t D = n.src[0].ne[0], T = n.src[0].rows(), H = D / hd;
  const int32_t* pos = n.src[1].i32();
  // θ_i = pos · freq_scale · base^(−2i/n_dims), the powers built by repeated F32 multiplication as
  // llama.cpp does, so the rotations match its results.
  const float theta_scale = std::pow(freq_base, -2.0f / static_cast<float>(n_dims));
  for (int64_t u = lo(T * H, ith, nth); u < hi(T * H, ith, nth); u++) {
    const int64_t t = u / H, h = u % H;
    const float* x = n.src[0].f32() + t * D + h * hd;
    float* y = n.dst.f32() + t * D + h * hd;
    float theta = static_cast<float>(pos[t]);
    for (int i0 = 0; i0 < n_dims; i0 += 2) {
      const float ang = freq_scale * theta;
      const float c = std::cos(ang), s = std::sin(ang);
      theta *= theta_scale;
      const int a = mode == 2 ? i0 / 2 : i0;
      const int bi = mode == 2 ? i0 / 2 + n_dims / 2 : i0 + 1;
      const float x0 = x[a], x1 = x[bi];
      // as GCC contracts ggml's rotate_pairs (gnu++17, -O3, FMA): the cos product of y[a] and the sin
      // product of y[bi] are fused, the other product is rounded first
      if (kGgmlContract) {
        y[a] = std::fma(x0, c, -(x1 * s));
        y[bi] = std::fma(x0, s, x1 * c);
      } else {
        y[a] = x0 * c - x1 * s;
        y[bi] = x0 * s + x1 * c;
      }
    }
    for (int64_t i = n_dims; i < hd; i++) y[i] = x[i];
  }
}

void softmax_row(const float* x, float* y, int64_t n, float scale) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; i++) mx = std::fmax(mx, scale * x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const float e = std::exp(scale * x[i] - mx);
    y[i] = e;
    sum += e;
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; i++) y[i] *= inv;
}

void op_softmax(const NodeExec& n, int ith, int nth) {
  const int64_t ne0 = n.src[0].ne[0], R = n.src[0].rows();
  const float scale = static_cast<float>(n.p[0]);
  for (int64_t r = lo(R, ith, nth); r < hi(R, ith, nth); r++) {
    softmax_row(n.src[0].f32() + r * ne0, n.dst.f32() + r * ne0, ne0, scale);
  }
}

struct AttnLayout {
  float* q16 = nullptr;   // nth × kAttnTileRows × head_dim: q rounded to F16 (F16 keys)
  void* acc = nullptr;    // nth × kAttnTileRows × head_dim floats: the V accumulators
  float* tile = nullptr;  // nth × attn_tile_floats(head_dim): the tiled path's buffers (tiled batches only)
};

/// Whether a batch takes llama.cpp's tiled arithmetic (attn_tiled.h): as ggml-cpu decides it, a batch of at
/// least 64 query rows whose K and V have one type (F32 or F16) and whose head size is whole SIMD vectors
/// (with a sliding window too: llama.cpp masks the keys before the window). ggml's vectors are 8 floats in
/// its AVX2 build and 16 in its AVX-512 one; a head size of 16·k takes the tiled path in both, so that is
/// the rule here (a head of 8, 24, … stays on the row path, as in an AVX-512 llama.cpp).
bool attn_tiled(const NodeExec& n) {
  const int64_t hd = static_cast<int64_t>(n.p[3]);
  return n.src[0].rows() >= kFaTileQ && n.src[1].dtype == n.src[2].dtype &&
         (n.src[1].dtype == DT_F16 || n.src[1].dtype == DT_F32) && hd % 16 == 0;
}

AttnLayout attn_layout(const NodeExec& n, int nth, Bump& b) {
  AttnLayout l;
  const size_t hd = static_cast<size_t>(n.p[3]) * kAttnTileRows;
  l.q16 = static_cast<float*>(b.take(sizeof(float) * hd * nth));
  l.acc = b.take(sizeof(float) * hd * nth);
  if (attn_tiled(n)) l.tile = static_cast<float*>(b.take(sizeof(float) * attn_tile_floats(static_cast<int64_t>(n.p[3])) * nth));
  return l;
}

// One query row at a time in llama.cpp's CPU flash-attention arithmetic (see attn_ggml.h): with F16
// keys q is rounded to F16, the softmax is online and the V accumulator has the cache's type.
void op_attention(const NodeExec& n, int ith, int nth) {
  Bump b(n.scratch);
  const AttnLayout l = attn_layout(n, nth, b);
  const int64_t n_past = static_cast<int64_t>(n.p[0]);
  const int64_t Hkv = static_cast<int64_t>(n.p[1]);
  const float scale = static_cast<float>(n.p[2]);
  const int64_t hd = static_cast<int64_t>(n.p[3]);
  const int64_t H = static_cast<int64_t>(n.p[4]);
  const TensorView& Q = n.src[0];
  const TensorView& Kc = n.src[1];
  const TensorView& Vc = n.src[2];
  const int64_t T = Q.rows();
  const int64_t group = H / Hkv;
  const int ki = Kc.dtype == DT_F16 ? 1 : 0, vi = Vc.dtype == DT_F16 ? 1 : 0;
  const size_t kes = ki ? 2 : 4, ves = vi ? 2 : 4;
  const int64_t kvrow = hd * Hkv;
  float* q16 = l.q16 + static_cast<size_t>(ith) * static_cast<size_t>(hd) * kAttnTileRows;
  void* acc = static_cast<float*>(l.acc) + static_cast<size_t>(ith) * static_cast<size_t>(hd) * kAttnTileRows;
  // attention_swa: keys at positions p with (n_past + t) − p < window only
  const int64_t window = n.op == OP_ATTENTION_SWA ? static_cast<int64_t>(n.p[5]) : 0;
  int64_t u0, u1;
  if (attn_tiled(n)) {
    // a prompt-sized batch: units of (up to kFaTileQ consecutive tokens, one head) in llama.cpp's tiled
    // arithmetic (attn_tiled.h); a row's values do not depend on where its tile starts
    float* scratch = l.tile + static_cast<size_t>(ith) * attn_tile_floats(hd);
    const int64_t tiles = (T + kFaTileQ - 1) / kFaTileQ;
    const int64_t units = tiles * H;
    const int64_t chunk = chunk_size(units, nth, 1);
    while (next_chunk(n, units, chunk, &u0, &u1)) for (int64_t u = u0; u < u1; u++) {
      // the last tiles (most keys) first, so the short ones even out the threads' ends
      const int64_t t0 = (tiles - 1 - u / H) * kFaTileQ, h = u % H, kvh = h / group;
      const int nr = static_cast<int>(T - t0 < kFaTileQ ? T - t0 : kFaTileQ);
      const float* qs[kFaTileQ];
      float* outs[kFaTileQ];
      int64_t nk[kFaTileQ], first[kFaTileQ];
      for (int r = 0; r < nr; r++) {
        const int64_t t = t0 + r;
        qs[r] = Q.f32() + t * hd * H + h * hd;
        outs[r] = n.dst.f32() + t * hd * H + h * hd;
        nk[r] = n_past + t + 1;
        first[r] = window > 0 && nk[r] > window ? nk[r] - window : 0;
      }
      n.k->attn_tile[ki](hd, nr, qs, Kc.data + static_cast<size_t>(kvh * hd) * kes, static_cast<size_t>(kvrow) * kes,
                         Vc.data + static_cast<size_t>(kvh * hd) * ves, static_cast<size_t>(kvrow) * ves,
                         window > 0 ? first : nullptr, nk, scale, outs, scratch);
    }
    return;
  }
  if (window == 0 && T > 1) {
    // a batch: units of (up to kAttnTileRows consecutive tokens, one head), the tile's rows taking each block
    // of keys in turn (attn_rows: each row's arithmetic unchanged, the K/V block read once per tile)
    const int64_t tiles = (T + kAttnTileRows - 1) / kAttnTileRows;
    const int64_t units = tiles * H;
    const int64_t chunk = chunk_size(units, nth, 1);
    while (next_chunk(n, units, chunk, &u0, &u1)) for (int64_t u = u0; u < u1; u++) {
      const int64_t t0 = (u / H) * kAttnTileRows, h = u % H, kvh = h / group;
      const int nr = static_cast<int>(T - t0 < kAttnTileRows ? T - t0 : kAttnTileRows);
      const float* qs[kAttnTileRows];
      float* outs[kAttnTileRows];
      int64_t nk[kAttnTileRows];
      for (int r = 0; r < nr; r++) {
        const int64_t t = t0 + r;
        const float* q = Q.f32() + t * hd * H + h * hd;
        if (ki) {
          float* qr = q16 + static_cast<size_t>(r) * static_cast<size_t>(hd);
          n.k->convert[XF_F16](q, qr, hd);
          qs[r] = qr;
        } else {
          qs[r] = q;
        }
        outs[r] = n.dst.f32() + t * hd * H + h * hd;
        nk[r] = n_past + t + 1;
      }
      n.k->attn_rows[ki][vi](hd, nr, qs, Kc.data + static_cast<size_t>(kvh * hd) * kes, static_cast<size_t>(kvrow) * kes,
                             Vc.data + static_cast<size_t>(kvh * hd) * ves, static_cast<size_t>(kvrow) * ves, nk, scale,
                             outs, acc);
    }
    return;
  }
  const int64_t units = T * H;
  const int64_t chunk = chunk_size(units, nth, 1);
  while (next_chunk(n, units, chunk, &u0, &u1)) for (int64_t u = u0; u < u1; u++) {
    const int64_t t = u / H, h = u % H, kvh = h / group;
    const int64_t end = n_past + t + 1;
    const int64_t first = window > 0 && end > window ? end - window : 0;
    const int64_t ctx = end - first;
    const float* q = Q.f32() + t * hd * H + h * hd;
    if (ki) n.k->convert[XF_F16](q, q16, hd);
    float* out = n.dst.f32() + t * hd * H + h * hd;
    n.k->attn_row[ki][vi](hd, ki ? q16 : q, Kc.data + static_cast<size_t>(first * kvrow + kvh * hd) * kes,
                          static_cast<size_t>(kvrow) * kes, Vc.data + static_cast<size_t>(first * kvrow + kvh * hd) * ves,
                          static_cast<size_t>(kvrow) * ves, ctx, scale, out, acc);
  }
}

// ---- elementwise ----------------------------------------------------------------------------

void op_binary(const NodeExec& n, int ith, int nth) {
  const float* a = n.src[0].f32();
  const float* b = n.src[1].f32();
  float* y = n.dst.f32();
  const int64_t N = n.dst.nel;
  const int64_t nb = n.src[1].nel;
  const bool mul = n.op == OP_MUL;
  const int64_t e0 = lo(N, ith, nth), e1 = hi(N, ith, nth);
  if (nb == N) {
    if (mul) {
      for (int64_t e = e0; e < e1; e++) y[e] = a[e] * b[e];
    } else {
      for (int64_t e = e0; e < e1; e++) y[e] = a[e] + b[e];
    }
    return;
  }
  for (int64_t e = e0; e < e1; e++) {
    const float bv = b[e % nb];
    y[e] = mul ? a[e] * bv : a[e] + bv;
  }
}

}  // namespace

/// exp(x) as llama.cpp's AVX2+FMA build computes it for whole blocks of 8 (ggml-cpu vec.h, `ggml_v_expf`),
/// one lane at a time: n = round(x·log2 e) by the 1.5·2²³ shifter, b = x − n·ln 2 in two parts (Cody–Waite),
/// exp(b) ≈ 1 + b·p(b) with a degree-5 minimax polynomial in FMAs, times 2ⁿ built in the exponent bits
/// (with a two-factor scale where |n| > 126, and overflow/underflow where |n| > 192). Same constants and
/// operation order, so the same float for every input; it differs from expf in the last bit for some.
float expf_ggml_avx2(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float nn = z - r;
  const float b = std::fma(-nn, 0x1.7f7d1cp-20f, std::fma(-nn, 0x1.62e4p-1f, x));
  const uint32_t e = f32_bits(z) << 23;
  const float k = bits_f32(e + f32_bits(1.0f));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, 0x1.ffffecp-1f * b);
  if (!(std::fabs(nn) > 126.0f)) return std::fma(j, k, k);
  const uint32_t g = nn <= 0.0f ? 0x82000000u : 0u;
  const float s1 = bits_f32(g + 0x7f000000u);
  const float s2 = bits_f32(e - g);
  if (std::fabs(nn) > 192.0f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
}

/// SiLU x/(1 + e^−x) of element i of a row of `row` elements in llama.cpp's AVX2 arithmetic
/// (`ggml_vec_swiglu_f32`/`ggml_vec_silu_f32`): the row's whole blocks of 8 use `ggml_v_expf`, its last
/// row mod 8 elements expf. The FFN's activations feed an 8-bit quantization (Q8_0/Q4_0 dot products)
/// where a last-bit difference can change an int8, so the engine follows llama.cpp here.
float silu_ggml(float x, int64_t i, int64_t row) {
  if (kGgmlContract && i < (row & ~int64_t{7})) return x / (1.0f + expf_ggml_avx2(0.0f - x));
  return x / (1.0f + std::exp(-x));
}

namespace {

void op_unary(const NodeExec& n, int ith, int nth) {
  const float* x = n.src[0].f32();
  float* y = n.dst.f32();
  const int64_t N = n.dst.nel;
  const int64_t e0 = lo(N, ith, nth), e1 = hi(N, ith, nth);
  switch (n.op) {
    case OP_SCALE: {
      const float s = static_cast<float>(n.p[0]);
      for (int64_t e = e0; e < e1; e++) y[e] = x[e] * s;
      break;
    }
    case OP_SILU: {
      const int64_t row = n.src[0].ne[0];
      for (int64_t e = e0; e < e1; e++) y[e] = silu_ggml(x[e], e % row, row);
      break;
    }
    case OP_RELU:
      for (int64_t e = e0; e < e1; e++) y[e] = x[e] > 0.0f ? x[e] : 0.0f;
      break;
    case OP_SIGMOID:
      for (int64_t e = e0; e < e1; e++) y[e] = 1.0f / (1.0f + std::exp(-x[e]));
      break;
    case OP_GELU: {
      // ggml's CPU GELU (GGML_GELU_FP16): the tanh approximation (Hendrycks & Gimpel 2016) of the
      // input rounded to F16, itself rounded to F16 (ggml looks it up in a 65536-entry F16 table);
      // 0 below −10, identity above 10. Same results as llama.cpp, table-free.
      const float c = 0.79788456080286535587989211986876f;  // sqrt(2/π)
      for (int64_t e = e0; e < e1; e++) {
        const float v = x[e];
        if (v <= -10.0f) {
          y[e] = 0.0f;
        } else if (v >= 10.0f) {
          y[e] = v;
        } else {
          const float h = f16_to_f32(f32_to_f16(v));
          y[e] = f16_to_f32(f32_to_f16(0.5f * h * (1.0f + std::tanh(c * h * (1.0f + 0.044715f * h * h)))));
        }
      }
      break;
    }
    default: break;
  }
}

void op_cpy(const NodeExec& n, int ith, int nth) {
  const TensorView& s = n.src[0];
  const int64_t ne0 = s.ne[0], T = s.rows();
  const int64_t off = static_cast<int64_t>(n.p[0]);
  const size_t drb = row_bytes(n.dst.dtype, ne0);
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) {
    const float* x = s.f32() + t * ne0;
    uint8_t* d = n.dst.data + static_cast<size_t>(off + t) * drb;
    switch (n.dst.dtype) {
      case DT_F16: n.k->store_f16(x, d, ne0); break;
      case DT_BF16: n.k->store_bf16(x, d, ne0); break;
      default: std::memcpy(d, x, drb); break;
    }
  }
}

/// moe_scatter: src [R, U, T] (R = m or 1), ids [U, T] → [m·n_expert, T]; one (token, expert) block of m
/// outputs per work item: the slot that chose the expert (the last, if an id repeats) or the fill.
void op_moe_scatter(const NodeExec& n, int ith, int nth) {
  const int64_t m = static_cast<int64_t>(n.p[0]), NE = static_cast<int64_t>(n.p[1]);
  const float fill = static_cast<float>(n.p[2]);
  const int64_t R = n.src[0].ne[0], U = n.src[1].ne[0], T = n.src[1].ne[1];
  const float* src = n.src[0].f32();
  const int32_t* ids = n.src[1].i32();
  float* out = n.dst.f32();
  const int64_t blocks = T * NE;
  for (int64_t b = lo(blocks, ith, nth); b < hi(blocks, ith, nth); b++) {
    const int64_t t = b / NE, e = b % NE;
    int64_t slot = -1;
    for (int64_t u = 0; u < U; u++)
      if (ids[t * U + u] == e) slot = u;
    float* o = out + t * NE * m + e * m;
    if (slot < 0) {
      std::fill(o, o + m, fill);
    } else if (R == 1) {
      std::fill(o, o + m, src[t * U + slot]);
    } else {
      std::memcpy(o, src + (t * U + slot) * m, sizeof(float) * static_cast<size_t>(m));
    }
  }
}

void op_reshape(const NodeExec& n, int ith, int nth) {
  const int64_t N = n.dst.nel;
  const int64_t e0 = lo(N, ith, nth), e1 = hi(N, ith, nth);
  std::memcpy(n.dst.f32() + e0, n.src[0].f32() + e0, sizeof(float) * static_cast<size_t>(e1 - e0));
}

void op_slice(const NodeExec& n, int ith, int nth) {
  const int64_t N = n.src[0].ne[0], T = n.src[0].rows();
  const int64_t off = static_cast<int64_t>(n.p[0]), len = static_cast<int64_t>(n.p[1]);
  for (int64_t t = lo(T, ith, nth); t < hi(T, ith, nth); t++) {
    std::memcpy(n.dst.f32() + t * len, n.src[0].f32() + t * N + off, sizeof(float) * static_cast<size_t>(len));
  }
}

}  // namespace

void prefetch_experts(const NodeExec& n) {
  const int32_t* ids = n.dst.i32();
  const int64_t P = n.dst.nel;
  int32_t list[1024];
  uint8_t seen[1024] = {};
  int64_t nu = 0;
  for (int64_t p = 0; p < P; p++) {
    const int32_t e = ids[p];
    if (e < 0 || e >= 1024) return;  // more experts than this list holds: the ops request them themselves
    if (!seen[e]) seen[e] = 1, list[nu++] = e;
  }
  std::sort(list, list + nu);  // adjacent experts become one read
  for (int i = 0; i < n.n_prefetch; i++) n.prefetch[i]->request(list, nu, 1, nullptr, false);
}

size_t node_scratch_bytes(const NodeExec& n, int nth) {
  Bump b(nullptr);
  switch (n.op) {
    case OP_MUL_MAT: mat_layout(n, nth, b); break;
    case OP_MUL_MAT_SPARSE:
    case OP_AXPY_SPARSE: sparse_layout(n, nth, b); break;
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: attn_layout(n, nth, b); break;
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE: expert_layout(n, b); break;
    case OP_AXPY_ID_SPARSE:
      if (n.src[0].cache) expert_layout(n, b);
      break;
    default: break;
  }
  return align_up(b.off);
}

void exec_node(const NodeExec& n, int ith, int nth) {
  switch (n.op) {
    case OP_GET_ROWS: op_get_rows(n, ith, nth); break;
    case OP_MUL_MAT: op_mul_mat(n, ith, nth); break;
    case OP_RMS_NORM: op_rms_norm(n, ith, nth); break;
    case OP_NORM: op_norm(n, ith, nth); break;
    case OP_ROPE: op_rope(n, ith, nth); break;
    case OP_SOFTMAX: op_softmax(n, ith, nth); break;
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: op_attention(n, ith, nth); break;
    case OP_ADD:
    case OP_MUL: op_binary(n, ith, nth); break;
    case OP_SCALE:
    case OP_SILU:
    case OP_RELU:
    case OP_GELU:
    case OP_SIGMOID: op_unary(n, ith, nth); break;
    case OP_TOP_K: op_top_k(n, ith, nth); break;
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE: op_mul_mat_id(n, ith, nth); break;
    case OP_AXPY_ID_SPARSE: op_axpy_id_sparse(n, ith, nth); break;
    case OP_MOE_SUM: op_moe_sum(n, ith, nth); break;
    case OP_MOE_SCATTER: op_moe_scatter(n, ith, nth); break;
    case OP_CPY: op_cpy(n, ith, nth); break;
    case OP_SLICE: op_slice(n, ith, nth); break;
    case OP_RESHAPE: op_reshape(n, ith, nth); break;
    case OP_MUL_MAT_SPARSE:
      if (n.src[0].cache) {
        op_mul_mat_sparse_cached(n, ith, nth);
      } else {
        op_mul_mat_sparse(n, ith, nth);
      }
      break;
    case OP_AXPY_SPARSE:
      if (n.src[0].cache) {
        op_axpy_sparse_cached(n, ith, nth);
      } else {
        op_axpy_sparse(n, ith, nth);
      }
      break;
    default: break;
  }
}

}  // namespace pi
