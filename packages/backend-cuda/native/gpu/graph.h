// The wire form of core's Graph.encode() as the GPU backends read it, and its validation.
//
// tensors: Int32 words, 8 per tensor: kind (0 intermediate, 1 input, 2 handle), dtype code, ne0..ne3,
//          (intermediates are f32, except top_k's output, i32)
//          ref (handle id or input index), output index (−1: none).
// nodes:   Int32 words, 10 per node: op code, dst, src0..src4 (−1: none), param offset, param count, reserved.
// params:  Float64.
// check_graph() validates all of it (indices, shapes, dtypes, parameter ranges, row ids of i32
// tensors) before anything reaches the device: a bad graph is a BackendErr, never a device fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace pigpu {

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
};

constexpr int kTensorWords = 8;
constexpr int kNodeWords = 10;
constexpr int kMaxSrc = 5;
/// Most columns (tokens) a node may have: grid dimension y of the kernels.
constexpr int64_t kMaxColumns = 65535;

enum TensorKind : int { KIND_INTERMEDIATE = 0, KIND_INPUT = 1, KIND_HANDLE = 2 };

/// An error the backend reports to JS with a BackendErrorCode (BAD_GRAPH, UNSUPPORTED_OP, BAD_TENSOR, …).
struct BackendErr : std::runtime_error {
  std::string code;
  BackendErr(std::string c, const std::string& msg) : std::runtime_error(msg), code(std::move(c)) {}
};

const char* op_name(int op);

/// Whether the GPU kernels implement `op` for these dtypes (weight/source dtype first, as in supportsOp).
bool supports_op(int op, const int* dtypes, int n_dtypes);

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
  /// Host copy of an i32 tensor's values (row ids are checked on the host), else null.
  const int32_t* i32 = nullptr;
};
using HandleFinder = std::function<bool(int id, HandleInfo* out)>;

struct GTensor {
  int kind = 0;
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  int64_t nel = 1;
  int ref = -1;
  int out = -1;
  int producer = -1;  // node that computes it (intermediates)
  int last_use = -1;  // last node that reads or writes it
  const int32_t* i32 = nullptr;  // host values of an i32 input or handle
  int64_t id_bound = 0;          // i32 intermediates (top_k outputs): every value is < id_bound
};

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

/// Validates an encoded graph. @throws BackendErr BAD_GRAPH (malformed), UNSUPPORTED_OP (valid, but not on this backend).
CheckedGraph check_graph(const WireGraph& g, const HandleFinder& find);

}  // namespace pigpu
