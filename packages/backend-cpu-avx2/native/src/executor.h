// Execution of an encoded graph (the wire form of core's Graph.encode(), see powerinfer/wire.h): the
// shared validator (check_graph) runs first, then this file plans the arena, binds views and runs the
// nodes on the thread pool.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.h"
#include "powerinfer/wire.h"
#include "tensor_store.h"
#include "thread_pool.h"
#include "neuron_cache.h"

namespace pi {

using namespace ::powerinfer::wire;

constexpr int TENSOR_STRIDE = kTensorWords;
constexpr int NODE_STRIDE = kNodeWords;
constexpr int MAX_SRC = kMaxSrc;


/// Whether the executor implements `op` with the given dtypes (weight/source dtype first).
bool supports_op(int op, const int* dtypes, int n_dtypes);

/// Borrowed views of an encoded graph (the caller keeps the arrays alive during compute()).
using EncodedGraph = WireGraph;
using HostBuffer = WireGraph::In;
using HostOutput = WireGraph::Out;

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
  /// A dense mul_mat's Q4_0/Q4_K weight in the repacked layout (TensorStore::packed), or null.
  const uint8_t* packed = nullptr;

  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  float* f32() const { return reinterpret_cast<float*>(data); }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(data); }
};

/// Executes graphs for one backend instance: holds the thread pool, the kernel table and the arena
/// for intermediates (grown on demand, reused across calls). compute() calls are serialised.
class Executor {
 public:
  Executor(TensorStore& store, int threads, bool force_scalar);
  ~Executor();

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

  /// Whether dense Q4_0 matrix products repack their weight at first use (default true; false keeps
  /// every weight zero-copy, `--no-repack`).
  void set_repack(bool on) { repack_ = on; }
  bool repack() const { return repack_; }

  /// Tests: the workers start each graph this many microseconds late (thread 0 then runs the first nodes
  /// alone), to check that results do not depend on when they arrive. 0 (default) = no delay; negative =
  /// thread 0 never runs nodes alone (it waits for the workers, the reference for the check).
  void set_test_worker_delay(int us) { test_worker_delay_us_ = us; }

  /// Bytes currently reserved by the intermediate arena.
  size_t arena_bytes() const { return arena_size_; }

 private:
  TensorStore& store_;
  ThreadPool pool_;
  const char* reason_ = "";  // declared before kernels_: select_kernels() sets it
  const KernelTable* kernels_;
  double serial_work_bytes_;
  bool repack_ = true;
  int test_worker_delay_us_ = 0;
  std::atomic<bool> last_parallel_{false};  // the last graph ran on the pool (compute() then wakes it first)
  std::mutex mu_;
  uint8_t* arena_ = nullptr;
  size_t arena_size_ = 0;
  struct ArenaFree {
    ArenaFree() noexcept : bytes(0) {}
    explicit ArenaFree(size_t b) noexcept : bytes(b) {}
    size_t bytes;  // the allocation's size (free_weights needs it)
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, ArenaFree> arena_holder_;
  struct RunScratch;
  std::unique_ptr<RunScratch> work_;
};

}  // namespace pi
