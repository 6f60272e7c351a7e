// The wire format between @powerinfer/core and a native backend: what `Graph.encode()` produces
// (packages/core/src/backend/graph.ts) and what `NativeBackend` (packages/core/src/native/adapter.ts)
// hands to an addon. Every native backend includes this header; an out-of-tree one finds it in the
// installed package at node_modules/@powerinfer/core/native/include. A test checks that these constants
// equal the TypeScript ones (packages/core/test/wire.test.ts).
//
// tensors: int32 words, kTensorWords per tensor: kind, dtype code, ne0..ne3, ref (handle id or input
//          index, −1 for intermediates), output index (−1: none). Intermediates are f32 (top_k's: i32).
// nodes:   int32 words, kNodeWords per node: op code, dst, src0..src4 (−1: none), param offset,
//          param count, reserved.
// params:  float64.
// Errors cross the boundary as a JavaScript Error whose `code` is one of the kErr* strings below
// (core's BackendErrorCode).
//
// Everything here is a type, a constant or a `static inline` function: the header may be included by
// translation units compiled with different instruction-set flags, and by CUDA/HIP sources.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define POWERINFER_WIRE_HD __host__ __device__
#else
#define POWERINFER_WIRE_HD
#endif

namespace powerinfer {
namespace wire {

/// Op codes (core's OP_CODES). See graph.ts for each op's contract.
enum Op : int {
  OP_GET_ROWS = 1,
  OP_MUL_MAT = 2,
  OP_RMS_NORM = 3,
  OP_NORM = 4,
  OP_ROPE = 5,
  OP_SOFTMAX = 6,
  OP_ATTENTION = 7,
  OP_ADD = 8,
  OP_MUL = 9,
  OP_SCALE = 10,
  OP_SILU = 11,
  OP_RELU = 12,
  OP_GELU = 13,
  OP_CPY = 14,
  OP_SLICE = 15,
  OP_MUL_MAT_SPARSE = 16,
  OP_AXPY_SPARSE = 17,
  OP_SIGMOID = 18,
  OP_TOP_K = 19,
  OP_MUL_MAT_ID = 20,
  OP_MOE_SUM = 21,
  OP_MUL_MAT_ID_SPARSE = 22,
  OP_AXPY_ID_SPARSE = 23,
  OP_RESHAPE = 24,
  OP_ATTENTION_SWA = 25,
  OP_MOE_SCATTER = 26,
  OP_COUNT = 27,
};

/// Tensor dtype codes, ggml's numbering (core's DTYPE_CODES).
enum DType : int {
  DT_F32 = 0,
  DT_F16 = 1,
  DT_Q4_0 = 2,
  DT_Q4_1 = 3,
  DT_Q5_0 = 6,
  DT_Q5_1 = 7,
  DT_Q8_0 = 8,
  DT_Q4_K = 12,
  DT_Q5_K = 13,
  DT_Q6_K = 14,
  DT_I32 = 26,
  DT_BF16 = 30,
};

/// Tensor kinds in the encoding (core's TENSOR_KIND).
enum TensorKind : int { KIND_INTERMEDIATE = 0, KIND_INPUT = 1, KIND_HANDLE = 2 };

constexpr int kTensorWords = 8;  // core's TENSOR_STRIDE
constexpr int kNodeWords = 10;   // core's NODE_STRIDE
constexpr int kMaxSrc = 5;       // core's MAX_SRC
constexpr int kRopeNormal = 0;   // core's ROPE_NORMAL
constexpr int kRopeNeox = 2;     // core's ROPE_NEOX

/// Error codes (core's BackendErrorCode).
constexpr const char* kErrUnavailable = "UNAVAILABLE";
constexpr const char* kErrOutOfMemory = "OUT_OF_MEMORY";
constexpr const char* kErrUnsupportedOp = "UNSUPPORTED_OP";
constexpr const char* kErrBadTensor = "BAD_TENSOR";
constexpr const char* kErrBadGraph = "BAD_GRAPH";
constexpr const char* kErrIo = "IO";
constexpr const char* kErrDisposed = "DISPOSED";

/// Elements per block and bytes per block (ggml's block layouts; core's DTYPE_LAYOUT); {0, 0} for an
/// unknown code.
struct Layout {
  int block;
  int bytes;
};

static inline POWERINFER_WIRE_HD Layout dtype_layout(int dt) {
  switch (dt) {
    case DT_F32: return {1, 4};
    case DT_F16: return {1, 2};
    case DT_BF16: return {1, 2};
    case DT_I32: return {1, 4};
    case DT_Q4_0: return {32, 18};
    case DT_Q4_1: return {32, 20};
    case DT_Q5_0: return {32, 22};
    case DT_Q5_1: return {32, 24};
    case DT_Q8_0: return {32, 34};
    case DT_Q4_K: return {256, 144};
    case DT_Q5_K: return {256, 176};
    case DT_Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

/// Whether `dt` is a dtype a weight may have (every wire dtype but i32).
static inline bool is_weight_dtype(int dt) { return dt != DT_I32 && dtype_layout(dt).block != 0; }

static inline const char* dtype_name(int dt) {
  switch (dt) {
    case DT_F32: return "f32";
    case DT_F16: return "f16";
    case DT_BF16: return "bf16";
    case DT_I32: return "i32";
    case DT_Q4_0: return "q4_0";
    case DT_Q4_1: return "q4_1";
    case DT_Q5_0: return "q5_0";
    case DT_Q5_1: return "q5_1";
    case DT_Q8_0: return "q8_0";
    case DT_Q4_K: return "q4_K";
    case DT_Q5_K: return "q5_K";
    case DT_Q6_K: return "q6_K";
    default: return "unknown";
  }
}

/// Bytes of a row of `n` elements (n a multiple of the block size).
static inline POWERINFER_WIRE_HD uint64_t row_bytes(int dt, int64_t n) {
  const Layout l = dtype_layout(dt);
  return static_cast<uint64_t>(n / l.block) * static_cast<uint64_t>(l.bytes);
}

/// The usual answer to `supportsOp(op, dtypes)` (dtypes[0]: the weight, cache, destination or source dtype):
/// weight ops for the dtypes `weight_ok` accepts, attention with f32/f16 caches, cpy into f32/f16/bf16, every
/// other known op on f32. A backend with other limits answers its own way.
static inline bool standard_supports_op(int op, const int* dtypes, int n_dtypes, bool (*weight_ok)(int)) {
  const int d = n_dtypes > 0 ? dtypes[0] : DT_F32;
  switch (op) {
    case OP_GET_ROWS:
    case OP_MUL_MAT:
    case OP_MUL_MAT_SPARSE:
    case OP_AXPY_SPARSE:
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE:
    case OP_AXPY_ID_SPARSE: return weight_ok(d);
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: return d == DT_F32 || d == DT_F16;
    case OP_CPY: return d == DT_F32 || d == DT_F16 || d == DT_BF16;
    default: return op > 0 && op < OP_COUNT && d == DT_F32;
  }
}

/// An error the backend reports to JavaScript with one of the kErr* codes.
struct BackendErr : std::runtime_error {
  std::string code;
  BackendErr(std::string c, const std::string& msg) : std::runtime_error(msg), code(std::move(c)) {}
};

/// Borrowed views of an encoded graph (the caller keeps the arrays alive).
struct WireGraph {
  const int32_t* tensors = nullptr;
  size_t tensor_words = 0;
  const int32_t* nodes = nullptr;
  size_t node_words = 0;
  const double* params = nullptr;
  size_t n_params = 0;
  struct In {
    const void* data;
    size_t bytes;
  };
  struct Out {
    float* data;
    size_t bytes;
  };
  std::vector<In> inputs;
  std::vector<Out> outputs;
};

/// What the validator needs to know of a backend tensor.
struct HandleInfo {
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  bool read_only = false;
  /// Host copy of an i32 tensor's values (row and expert ids are checked on the host), else null.
  const int32_t* i32 = nullptr;
};
/// Looks up handle `id`; false when there is none.
using HandleFinder = std::function<bool(int id, HandleInfo* out)>;

/// A validated tensor.
struct GTensor {
  int kind = 0;
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  int64_t nel = 1;
  int ref = -1;
  int out = -1;
  int producer = -1;             // node that computes it (intermediates)
  int last_use = -1;             // last node that reads or writes it (outputs: the node count)
  const int32_t* i32 = nullptr;  // host values of an i32 input or handle
  int64_t id_bound = 0;          // i32 intermediates (top_k outputs): every value is < id_bound
};

/// A validated node.
struct GNode {
  int op = 0;
  int dst = -1;
  int src[kMaxSrc] = {-1, -1, -1, -1, -1};
  const double* p = nullptr;
  int np = 0;
};

struct CheckedGraph {
  std::vector<GTensor> tensors;
  std::vector<GNode> nodes;
};

/// What a backend tells the validator about itself.
struct CheckOptions {
  /// Whether the backend has kernels for weights of this dtype (false: UNSUPPORTED_OP). Default: all.
  std::function<bool(int dtype)> weight_supported;
  /// Most columns (tokens, or slots × tokens) a node may have (false: UNSUPPORTED_OP). Default: no limit.
  int64_t max_columns = INT64_MAX;
  /// Largest attention head_dim (false: UNSUPPORTED_OP). Default: no limit.
  int64_t max_head_dim = INT64_MAX;
};

/// The op's name as in core ("mul_mat"), or "unknown op".
const char* op_name(int op);

/// Validates an encoded graph: array lengths, indices, kinds, dtypes, shapes, parameter ranges, the
/// order of producers and readers, outputs, and the values of i32 row and expert ids — so that a bad
/// graph is a BackendErr before any kernel runs (packages/core/native/src/wire_check.cpp).
/// @throws BackendErr BAD_GRAPH (malformed), UNSUPPORTED_OP (valid, but not on this backend).
CheckedGraph check_graph(const WireGraph& g, const HandleFinder& find, const CheckOptions& options = {});

}  // namespace wire
}  // namespace powerinfer
