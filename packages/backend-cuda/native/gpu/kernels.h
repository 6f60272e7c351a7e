// Host-side entry points of the GPU kernels (kernels.cu). Plain C++: callers need no GPU headers.
// Every pointer is device memory; activations and outputs are contiguous F32, column t of an [n, T]
// tensor starts at t·n. `stream` is the platform's stream handle (cudaStream_t / hipStream_t / unused).
// Each function launches its kernels asynchronously and checks the launch (pigpu::GpuError).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pigpu {

/// A weight matrix: `rows` rows of `k` elements of `dtype`, `row_bytes` apart.
struct Weights {
  const void* data;
  int dtype;
  int64_t k;
  int64_t rows;
  uint64_t row_bytes;
};

/// The neuron selection of a sparse op (see graph.ts): rows list (nullable), gate logits (nullable).
struct Selection {
  const float* logits;   // [n_out, T] or null
  const int32_t* rows;   // [n_rows] or null
  int64_t n_rows;
  bool compact;          // W row j holds neuron rows[j]
  float threshold;
  int64_t n_out;
  unsigned long long* rows_read;  // one device counter: += active (neuron, token) pairs
};

enum UnaryOp { UNARY_SCALE, UNARY_SILU, UNARY_RELU, UNARY_GELU, UNARY_SIGMOID };
enum BinaryOp { BINARY_ADD, BINARY_MUL };

/// Checks that the kernels were compiled for the device's warp size: a kernel reports PI_WARP (the
/// compile-time wave size of the target) and the hardware's warpSize. Synchronous.
/// @throws GpuError UNAVAILABLE naming both when they differ (e.g. a gfx10+ device in wave64 mode).
void check_warp_size(void* stream);

void launch_get_rows(const Weights& w, const int32_t* ids, int64_t t, float* y, void* stream);

/// Scratch bytes launch_mul_mat / launch_mul_mat_sparse need: Q8_0 and Q4_0 weights quantize the
/// activations x [k, T] once per op to 8-bit blocks (int8 [k, T] + one F32 scale per 32 values, the
/// scale rounded to F16 as in Q8_0) and take integer dot products (dp4a); 0 for float weights.
uint64_t mul_mat_scratch_bytes(const Weights& w, int64_t t);
void launch_mul_mat(const Weights& w, const float* x, int64_t t, float* y, void* scratch, void* stream);
/// Scratch bytes of launch_mul_mat_sparse: the compacted active list (as axpy_sparse's, one chunk)
/// and the quantized activations of mul_mat_scratch_bytes.
uint64_t mul_mat_sparse_scratch_bytes(const Weights& w, int64_t t, const Selection& s);
/// Compacts the active rows (prefix sum, candidate order; rows_read counted there), then a grid sized
/// for the device walks the list: rows never active cost no block.
void launch_mul_mat_sparse(const Weights& w, const float* x, int64_t t, const Selection& s, float* y, void* scratch,
                           void* stream);

/// Scratch bytes launch_axpy_sparse needs for this shape: the compacted active list (candidate ids and
/// column masks per group of 8 columns) and, with several chunks, their partial sums.
uint64_t axpy_sparse_scratch_bytes(const Weights& wt, int64_t t, const Selection& s);
void launch_axpy_sparse(const Weights& wt, const float* a, int64_t t, const Selection& s, float* y, void* scratch,
                        void* stream);

/// Fused SiLU × up: y = silu(g) · u (u_first: u · silu(g)), n elements; the same two roundings as
/// launch_unary(SILU) then launch_binary(MUL), in one launch.
void launch_silu_mul(const float* g, const float* u, bool silu_first, float* y, int64_t n, void* stream);
/// Fused add + RMS norm × weight over T columns of n: s = a + b (b null: s = a; written to h when h is
/// non-null), y = (s · rsqrt(mean(s²) + eps)) · w[idx % nw] (w null: no multiply). Bit-identical to the
/// separate ops (same operations, same order); one launch instead of up to three.
void launch_add_rms_norm_mul(const float* a, const float* b, float* h, const float* w, int64_t nw, float* y, int64_t n,
                             int64_t t, float eps, void* stream);
void launch_rms_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream);
void launch_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream);
void launch_softmax(const float* x, float* y, int64_t n, int64_t t, float scale, void* stream);
void launch_rope(const float* x, const int32_t* pos, float* y, int64_t n, int64_t t, int head_dim, int n_dims,
                 int mode, double freq_base, double freq_scale, void* stream);

/// Fused RoPE + KV write: rows row_offset.. of `cache` (dtype F32/F16/BF16, row length n) ← rope(x)
/// converted; the values of launch_rope then launch_cpy, in one launch.
void launch_rope_cpy(const float* x, const int32_t* pos, void* cache, int cache_dtype, int64_t row_offset, int64_t n,
                     int64_t t, int head_dim, int n_dims, int mode, double freq_base, double freq_scale, void* stream);

struct AttentionArgs {
  const float* q;  // [head_dim·n_head, T]
  const void* k;   // [head_dim·n_head_kv, ctx] of kv_dtype
  const void* v;
  int kv_dtype;    // DT_F32 or DT_F16
  int head_dim, n_head, n_head_kv;
  int64_t t, n_past;
  float scale;
  int64_t window;  // > 0: query t sees the cache positions p with (n_past + t) − p < window; 0: all
  float* y;        // [head_dim·n_head, T]
};
/// Largest head_dim the attention kernel handles.
constexpr int kMaxHeadDim = 512;
/// Scratch bytes launch_attention needs (flash-decoding partials; 0 when one block per head suffices).
uint64_t attention_scratch_bytes(const AttentionArgs& a);
void launch_attention(const AttentionArgs& a, void* scratch, void* stream);

// ---- routed experts (mixture of experts) ----

/// Stacked expert matrices: `w.rows` rows of `w.k` elements per expert, `expert_bytes` apart.
struct Experts {
  Weights w;
  int64_t n_expert;
  uint64_t expert_bytes;
};

/// ids[:, c] ← indices of the k largest of x[:, c] (x [n, T] F32), largest first, lower index first on
/// equal values. ids is I32 [k, T].
void launch_top_k(const float* x, int64_t n, int64_t t, int k, int32_t* ids, void* stream);

/// y[:, c] = W_{ids[c]} · x_c for the U·T columns c = t·U + u of ids [U, T]; x has T columns (x_c =
/// column t) or U·T (x_c = column c). With `logits` (F32 [M, U·T]) only the elements with logits ≥
/// threshold are computed, the others are 0, and `rows_read` (non-null) counts them. y is F32 [M, U·T].
void launch_mul_mat_id(const Experts& e, const float* x, bool x_per_slot, const int32_t* ids, int64_t n_used,
                       int64_t t, const float* logits, float threshold, unsigned long long* rows_read, float* y,
                       void* stream);

/// y[:, c] = Σ over active i of a[i, c] · row i of Wt_{ids[c]} (Wt [D, M, E] neuron-major), for the U·T
/// columns of ids; active: logits[i, c] ≥ threshold (all without logits). rows_read counts (i, c) pairs.
void launch_axpy_id_sparse(const Experts& e, const float* a, const int32_t* ids, int64_t cols, const float* logits,
                           float threshold, unsigned long long* rows_read, float* y, void* stream);

/// out[:, t] = Σ_u w[u,t] · y[:, u, t] (slot order), w[u,t] = probs[ids[u,t], t], divided by
/// max(Σ_u w, 2^-14) when `norm`, times `scale`. y [D, U, T], probs [n_expert, T], out [D, T], all F32.
void launch_moe_sum(const float* y, const float* probs, const int32_t* ids, int64_t d, int64_t n_expert,
                    int64_t n_used, int64_t t, bool norm, float scale, float* out, void* stream);

/// out[e·m + i, t] = src[i (0 when r = 1), u, t] where ids[u,t] = e (the last such slot), else `fill`.
/// src [r, U, T] (r = m or 1), ids [U, T], out [m·n_expert, T], all F32 but ids.
void launch_moe_scatter(const float* src, int64_t r, const int32_t* ids, int64_t n_used, int64_t t, int64_t m,
                        int64_t n_expert, float fill, float* out, void* stream);

void launch_binary(BinaryOp op, const float* a, const float* b, float* y, int64_t n, int64_t nb, void* stream);
void launch_unary(UnaryOp op, const float* x, float* y, int64_t n, float param, void* stream);
/// Rows row_offset.. of dst (row length n, dtype F32/F16/BF16) ← src [n, T], converted.
void launch_cpy(const float* src, void* dst, int dst_dtype, int64_t n, int64_t t, int64_t row_offset, void* stream);
void launch_slice(const float* x, float* y, int64_t n, int64_t t, int64_t offset, int64_t length, void* stream);

}  // namespace pigpu
