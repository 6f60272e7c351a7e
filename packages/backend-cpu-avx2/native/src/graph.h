// Validation, planning and execution of an encoded graph (the wire form of core's Graph.encode()).
//
// tensors: Int32 words, stride 8: kind (0 intermediate, 1 input, 2 handle), dtype code (ggml),
//          ne0..ne3, ref (handle id or input index, −1 for intermediates), output index (−1 = none).
// nodes:   Int32 words, stride 10: op code, dst, src0..src4 (−1 = none), param offset, param count, reserved.
// params:  Float64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.h"
#include "tensor_store.h"
#include "thread_pool.h"
#include "neuron_cache.h"

namespace pi {

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
  // routed experts (mixture of experts)
  OP_SIGMOID = 18,
  OP_TOP_K = 19,
  OP_MUL_MAT_ID = 20,
  OP_MOE_SUM = 21,
  OP_MUL_MAT_ID_SPARSE = 22,
  OP_AXPY_ID_SPARSE = 23,
  OP_RESHAPE = 24,
  OP_ATTENTION_SWA = 25,
  OP_COUNT = 26,
};

constexpr int TENSOR_STRIDE = 8;
constexpr int NODE_STRIDE = 10;
constexpr int MAX_SRC = 5;

const char* op_name(int op);

/// Whether the executor implements `op` with the given dtypes (weight/source dtype first).
bool supports_op(int op, const int* dtypes, int n_dtypes);

struct HostBuffer {
  const void* data = nullptr;
  size_t bytes = 0;
};

struct HostOutput {
  float* data = nullptr;
  size_t bytes = 0;
};

/// Borrowed views of an encoded graph (the caller keeps the arrays alive during compute()).
struct EncodedGraph {
  const int32_t* tensors = nullptr;
  size_t tensor_words = 0;
  const int32_t* nodes = nullptr;
  size_t node_words = 0;
  const double* params = nullptr;
  size_t n_params = 0;
  std::vector<HostBuffer> inputs;
  std::vector<HostOutput> outputs;
};

/// One resolved tensor of a graph being executed.
struct TensorView {
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  int64_t nel = 0;
  uint8_t* data = nullptr;
  /// File-backed weight (data null): rows come from this cache (sparse ops' src[0] only).
  NeuronCache* cache = nullptr;
  size_t cache_part = 0;     ///< byte offset of the tensor's row within the cache's row
  bool cache_counts = true;  ///< this op's requests count hits and misses

  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  float* f32() const { return reinterpret_cast<float*>(data); }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(data); }
};

/// Executes graphs for one backend instance: holds the thread pool, the kernel table and the arena
/// for intermediates (grown on demand, reused across calls). compute() calls are serialised.
class Executor {
 public:
  Executor(TensorStore& store, int threads, bool force_scalar);

  int threads() const { return pool_.size(); }
  const char* kernel_name() const { return kernels_->name; }
  const char* kernel_reason() const { return reason_; }
  const KernelTable& kernels() const { return *kernels_; }

  /// Validates and runs a graph; rows_read receives one count per node.
  /// @throws BackendErr BAD_GRAPH (malformed graph), BAD_TENSOR (freed handle), OUT_OF_MEMORY (arena).
  void compute(const EncodedGraph& g, std::vector<double>& rows_read);

  /// Graphs estimated to touch fewer bytes run on the calling thread alone (default 256 KiB, or
  /// POWERINFER_CPU_SERIAL_BYTES); 0 = always use the whole pool.
  void set_serial_work_bytes(double b) { serial_work_bytes_ = b; }

  /// Bytes currently reserved by the intermediate arena.
  size_t arena_bytes() const { return arena_size_; }

 private:
  TensorStore& store_;
  ThreadPool pool_;
  const char* reason_ = "";  // declared before kernels_: select_kernels() sets it
  const KernelTable* kernels_;
  double serial_work_bytes_;
  std::mutex mu_;
  uint8_t* arena_ = nullptr;
  size_t arena_size_ = 0;
  struct ArenaFree {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, ArenaFree> arena_holder_;
};

}  // namespace pi
