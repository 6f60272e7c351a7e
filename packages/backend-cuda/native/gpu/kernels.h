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

enum UnaryOp { UNARY_SCALE, UNARY_SILU, UNARY_RELU, UNARY_GELU };
enum BinaryOp { BINARY_ADD, BINARY_MUL };

void launch_get_rows(const Weights& w, const int32_t* ids, int64_t t, float* y, void* stream);
void launch_mul_mat(const Weights& w, const float* x, int64_t t, float* y, void* stream);
void launch_mul_mat_sparse(const Weights& w, const float* x, int64_t t, const Selection& s, float* y, void* stream);

/// Scratch bytes launch_axpy_sparse needs for this shape (0 when it sums in place).
uint64_t axpy_sparse_scratch_bytes(const Weights& wt, int64_t t, const Selection& s);
void launch_axpy_sparse(const Weights& wt, const float* a, int64_t t, const Selection& s, float* y, void* scratch,
                        void* stream);

void launch_rms_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream);
void launch_norm(const float* x, float* y, int64_t n, int64_t t, float eps, void* stream);
void launch_softmax(const float* x, float* y, int64_t n, int64_t t, float scale, void* stream);
void launch_rope(const float* x, const int32_t* pos, float* y, int64_t n, int64_t t, int head_dim, int n_dims,
                 int mode, double freq_base, double freq_scale, void* stream);

struct AttentionArgs {
  const float* q;  // [head_dim·n_head, T]
  const void* k;   // [head_dim·n_head_kv, ctx] of kv_dtype
  const void* v;
  int kv_dtype;    // DT_F32 or DT_F16
  int head_dim, n_head, n_head_kv;
  int64_t t, n_past;
  float scale;
  float* y;        // [head_dim·n_head, T]
};
/// Largest head_dim the attention kernel handles.
constexpr int kMaxHeadDim = 512;
void launch_attention(const AttentionArgs& a, void* stream);

void launch_binary(BinaryOp op, const float* a, const float* b, float* y, int64_t n, int64_t nb, void* stream);
void launch_unary(UnaryOp op, const float* x, float* y, int64_t n, float param, void* stream);
/// Rows row_offset.. of dst (row length n, dtype F32/F16/BF16) ← src [n, T], converted.
void launch_cpy(const float* src, void* dst, int dst_dtype, int64_t n, int64_t t, int64_t row_offset, void* stream);
void launch_slice(const float* x, float* y, int64_t n, int64_t t, int64_t offset, int64_t length, void* stream);

}  // namespace pigpu
