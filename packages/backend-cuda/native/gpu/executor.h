// One GPU backend instance on one device: its tensors (device memory, counted against a budget),
// a stream, and a compute arena for graph inputs, intermediates, counters and kernel scratch, grown
// on demand and reused across calls. Every method is serialised by one mutex, so a compute running on
// a worker thread and calls from the JS thread never interleave.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "graph.h"
#include "runtime.h"

namespace pigpu {

struct DeviceTensor {
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  uint64_t bytes = 0;
  void* dev = nullptr;
  std::vector<int32_t> host_i32;  // shadow of an i32 tensor (row ids are validated on the host)
  ~DeviceTensor() { dev_free(dev); }
};

class Executor {
 public:
  /// @param budget bytes createTensor may allocate; UINT64_MAX: unlimited.
  Executor(int device, uint64_t budget);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// A tensor filled from `data` (`bytes` long) or zeroed when data is null.
  /// @throws BackendErr BAD_TENSOR / OUT_OF_MEMORY (budget or device).
  int create(int dtype, const int64_t ne[4], const void* data, uint64_t data_bytes);
  /// A tensor filled from a file range (read in pieces through a host buffer).
  int create_from_file(int dtype, const int64_t ne[4], const std::string& path, uint64_t offset, uint64_t bytes);
  std::vector<uint8_t> read(int id);
  void write(int id, const void* data, uint64_t bytes, uint64_t offset);
  void free(int id);
  uint64_t allocated() const;
  uint64_t arena_bytes() const;

  /// Validates and runs a graph; returns rowsRead per node.
  std::vector<double> compute(const WireGraph& g);

  DeviceProps props();
  int device() const { return device_; }

 private:
  std::shared_ptr<DeviceTensor> find(int id) const;
  void ensure_arena(uint64_t bytes);
  /// Page-locked host memory of at least `bytes` for a graph's inputs and outputs (grows, never shrinks).
  uint8_t* ensure_staging(uint64_t bytes);

  int device_;
  uint64_t budget_;
  uint64_t allocated_ = 0;
  void* stream_ = nullptr;
  void* arena_ = nullptr;
  uint64_t arena_size_ = 0;
  void* staging_ = nullptr;  // pinned: inputs are gathered here and sent in one copy, outputs come back here
  uint64_t staging_size_ = 0;
  int next_id_ = 1;
  std::map<int, std::shared_ptr<DeviceTensor>> tensors_;
  mutable std::recursive_mutex mu_;
};

/// Turns a device error into the backend error the addon reports.
BackendErr as_backend_error(const GpuError& e);

}  // namespace pigpu
