// Tensors owned by a backend instance: allocated (64-byte aligned, counted against the memory
// budget) or mapped zero-copy from a file (one read-only private mapping per file, shared).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "powerinfer/wire.h"

namespace pi {

/// 8 rows of a Q4_0 or Q4_K matrix (row r at rows[r], any rows) → one repacked group (BlockQ4_0x8 /
/// BlockQ4_Kx8 blocks, packed_group_bytes(dtype, k) bytes at dst), as TensorStore::packed makes them.
void pack_rows_x8(int dtype, int64_t k, const uint8_t* const* rows, uint8_t* dst);

class NeuronCache;
class ReaderPool;
class SlotPool;
struct CacheCounters;
struct CacheSpec;

/// Errors carry one of the interface's BackendErrorCode values (the wire header's BackendErr).
using ::powerinfer::wire::BackendErr;

/// A read-only mapping of a whole file.
struct FileMapping {
  std::string path;
  void* base = nullptr;
  size_t size = 0;
  ~FileMapping();
};

/// Memory for `bytes` of weights, KV cache or intermediates: from 2 MiB up, a 2 MiB-aligned anonymous
/// mapping of its own, advised for transparent huge pages (one TLB entry per 2 MiB instead of per 4 KiB:
/// the sparse ops read rows scattered over the whole matrix) and not inherited by child processes
/// (MADV_DONTFORK); smaller, 64-byte aligned from malloc. Null when the allocation fails. Free with
/// free_weights(p, bytes) and the same `bytes`.
uint8_t* alloc_weights(size_t bytes);
void free_weights(uint8_t* p, size_t bytes);

struct Tensor {
  int id = 0;
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  size_t bytes = 0;
  uint8_t* data = nullptr;
  bool mapped = false;
  std::shared_ptr<FileMapping> mapping;  // keeps a mapped tensor's file mapped
  /// A mapped tensor whose bytes were copied into huge-page memory at map time (TensorStore::set_copy_limit):
  /// `data` is the copy (owned), `map_data` the bytes in the file mapping. Still read-only (`mapped`).
  bool copied = false;
  uint8_t* map_data = nullptr;
  /// A copy reserved by map() with deferral on (TensorStore::set_defer_copies), not made yet: its bytes count
  /// in TensorStore::copied(); copy_pending() makes it, a release or a repack first cancels it.
  bool copy_pending = false;
  /// File-backed rows (data == nullptr): only the sparse ops read such a tensor, through the cache.
  std::shared_ptr<NeuronCache> cache;
  size_t cache_part = 0;      ///< byte offset of this tensor's row within a cache row (bundled layout)
  bool cache_counts = true;   ///< whether this tensor's requests count hits/misses (one per cache)
  /// Q4_0/Q4_K rows repacked for the dense matrix product (BlockQ4_0x8/BlockQ4_Kx8 groups, see common.h),
  /// made at first use by TensorStore::packed; null before that, when repacking is off, or when refused.
  uint8_t* packed = nullptr;
  size_t packed_bytes = 0;  ///< size of `packed` (Q4_0: bytes; Q4_K: bytes · 1184/1152)
  bool pack_refused = false;  ///< the memory budget had no room for the packed copy
  ~Tensor();
};

using TensorPtr = std::shared_ptr<Tensor>;

class TensorStore {
 public:
  /// @param budget bytes allocatable by create() (SIZE_MAX: unlimited).
  explicit TensorStore(size_t budget) : budget_(budget) {}

  /// A zero-filled tensor. @throws BackendErr BAD_TENSOR (shape/dtype), OUT_OF_MEMORY (budget/allocation).
  TensorPtr create(int dtype, const int64_t ne[4]);
  /// A tensor whose bytes stay in `path` at `offset` (or, within the copy limit, are copied from there
  /// into huge-page memory: see set_copy_limit). @throws BackendErr BAD_TENSOR, IO.
  TensorPtr map(int dtype, const int64_t ne[4], const std::string& path, uint64_t offset, uint64_t byte_length);
  /// A tensor whose rows stay in the file and are read on demand into a neuron cache (see
  /// neuron_cache.h); `group` > 0 links caches of one FFN so that one list prefetches all.
  /// @throws BackendErr BAD_TENSOR, IO, OUT_OF_MEMORY.
  TensorPtr map_cached(int dtype, const int64_t ne[4], const CacheSpec& spec, int group, int pool = 0);
  /// Another tensor over the cache of tensor `with` (bundled layout): its rows are bytes
  /// [part_offset, part_offset + row size) of that cache's rows. @throws BackendErr BAD_TENSOR.
  TensorPtr share_cached(int dtype, const int64_t ne[4], int with, size_t part_offset);
  /// The tensor's rows in the repacked layout of its dtype (Q4_0: BlockQ4_0x8, Q4_K: BlockQ4_Kx8; 8 rows'
  /// blocks interleaved, see common.h), made on the first call (single-threaded, about the time of one read
  /// of the tensor) and kept until the tensor is freed or written. The copy (packed_bytes: Q4_0 the
  /// tensor's size, Q4_K 2.8 % more) counts against the memory budget like create(); when it does not fit,
  /// null (the unpacked kernels run, with bit-identical results). A mapped tensor's pages are released
  /// from this process after packing (madvise DONTNEED: the file's pages refault if another op reads
  /// them), so the copy replaces them in memory instead of doubling it.
  /// Requires dtype Q4_0 or Q4_K, ne[0] a multiple of the block (32 / 256), rows % 8 == 0 and
  /// data != null (else null).
  const uint8_t* packed(const TensorPtr& t);
  /// Mapped tensors of at least 2 MiB are copied into memory advised for transparent huge pages
  /// (MADV_HUGEPAGE, 2 MiB-aligned) while the copies total at most `bytes` (default 0: every weight stays
  /// mapped). A file's page cache may hold 4 KiB pages (a freshly written or randomly read file): the
  /// sparse operators' scattered rows then miss the TLB on nearly every row. The copy's mapped pages are
  /// released from this process (the page cache keeps them, reclaimable); the copy does not count against
  /// the memory budget (it is the weights).
  void set_copy_limit(size_t bytes);
  /// Deferral of the copies above: map() then only reserves a tensor's copy (within the limit, in map order,
  /// so the same tensors are copied as without deferral) and copy_pending() makes them later, on any thread:
  /// a server's load returns to its event loop while the copies are made. Until a tensor's copy is made
  /// its data is the file mapping (the same bytes).
  void set_defer_copies(bool on);
  /// Makes the reserved copies one tensor at a time: the copy is made outside the lock, then swapped in under
  /// it (data → the copy, the mapping's pages released from this process). A tensor released or repacked
  /// meanwhile is skipped and its reservation returned; so is one whose allocation fails. One call at a
  /// time (later calls wait). A compute running meanwhile reads either the mapping or the copy, per tensor
  /// (the same bytes); callers that want the copies' speed wait for this before computing.
  /// @return bytes copied.
  size_t copy_pending();
  /// Bytes of reserved copies not made yet.
  size_t pending_copy_bytes() const;
  /// Bytes of mapped tensors held as huge-page copies (reserved ones not yet made included).
  size_t copied() const;
  /// Drops a packed copy (after the tensor's bytes changed).
  void drop_packed(Tensor& t);
  /// Counters of all caches (monotonic).
  CacheCounters& counters();
  /// Bytes held by neuron cache slots (hot + cold).
  size_t cache_bytes() const;
  /// Number of reader threads (0 before the first cached tensor).
  int io_threads() const;
  /// Reads the io_uring reader keeps in flight (0: pread threads, or no cache yet).
  int io_depth() const;
  /// Whether every cache reads with O_DIRECT (false when one fell back to pread + fadvise).
  bool all_direct() const;
  /// @throws BackendErr BAD_TENSOR when the id is unknown or freed.
  TensorPtr get(int id) const;
  /// Null when the id is unknown.
  TensorPtr find(int id) const;
  void release(int id);
  void clear();
  size_t allocated() const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<int, TensorPtr> tensors_;
  std::unordered_map<std::string, std::weak_ptr<FileMapping>> files_;
  std::unordered_map<int, std::vector<std::weak_ptr<NeuronCache>>> groups_;
  std::unordered_map<std::string, std::weak_ptr<SlotPool>> pools_;  // "pool id:slot bytes"
  std::shared_ptr<CacheCounters> counters_;
  std::shared_ptr<ReaderPool> readers_;
  size_t budget_;
  size_t allocated_ = 0;
  size_t copy_limit_ = 0;
  size_t copied_ = 0;
  bool defer_copies_ = false;
  std::vector<std::weak_ptr<Tensor>> pending_;  // reserved copies, in map order
  std::mutex copy_mu_;                          // one copy_pending() at a time
  int next_id_ = 1;
};

/// Bytes of a contiguous tensor; throws BackendErr BAD_TENSOR on a bad dtype or shape.
size_t tensor_bytes(int dtype, const int64_t ne[4]);

}  // namespace pi
