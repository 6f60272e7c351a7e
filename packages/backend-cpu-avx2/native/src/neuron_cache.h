// A neuron cache: the rows of a sparse FFN weight (one row per neuron) kept in a file and read on
// demand into a bounded set of slots, never through the page cache.
//
// - Storage: the rows of one tensor, `n_rows` rows of `row_bytes` each, starting at `file_offset` in
//   the file (PowerInfer/GGUF layout: rows of one matrix contiguous), or spread with a `row_stride`
//   (bundled layout: gate, up and down rows of a neuron together; see apps/cli/src/commands/convert.ts).
// - Slots: a pinned hot region (rows chosen by the caller, read at bind time, never evicted) and a cold
//   region managed by CLOCK (an LRU approximation with a reference bit).
// - Rows are neurons (a sparse FFN weight) or, for routed experts, whole experts (CacheSpec::expert_rows:
//   row e of a stacked {n_embd, n_ff_exp, n_expert} tensor is expert e's matrix, contiguous in the file).
// - Reads: the file is opened with O_DIRECT; each read covers whole 4 KiB blocks into a reader's
//   aligned bounce buffer (at most kMaxBounce = 1 MiB) and the row is copied into its slot. A row larger
//   than kRowPiece (an expert) is queued as 1 MiB pieces that several readers fetch at once. Where O_DIRECT is refused (tmpfs, some
//   overlay file systems) the file is read with pread and the range is dropped from the page cache
//   with posix_fadvise(POSIX_FADV_DONTNEED) after each read; `direct()` says which is in use.
// - Reads: io_uring where the kernel allows it (kRingThreads threads, a ring each, keep up to kRingDepth
//   reads in flight; rings set up with raw system calls: no liburing), else a pool of `io_threads` pread
//   threads; both fed from one queue (POWERINFER_IO=pread chooses the pool). A request is queued as soon as a layer's
//   active list is known, so computation of cached rows overlaps the reads.
//
// Thread model: request()/prefetch() run on one thread at a time (thread 0 of the sparse op, under the
// executor's lock); reader threads only fill slots and flip their state; wait() is called by any
// compute thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct iovec;

namespace pi {

class NeuronCache;

/// Counters shared by all caches of a backend (monotonic; the caller takes differences).
struct CacheCounters {
  std::atomic<int64_t> hits{0};          ///< rows requested that were in a slot (or already being read)
  std::atomic<int64_t> misses{0};        ///< rows requested that had to be read
  std::atomic<int64_t> reads{0};         ///< pread calls issued (a run of adjacent rows is one read)
  std::atomic<int64_t> bytes_read{0};    ///< bytes transferred by those reads (whole 4 KiB blocks)
  std::atomic<int64_t> stall_ns{0};      ///< compute-thread time spent waiting for a row (summed over threads)
  std::atomic<int64_t> io_busy_ns{0};    ///< wall time with at least one read in flight
  std::atomic<int64_t> io_errors{0};     ///< failed reads (the row is zero-filled; compute reports IO)
  std::atomic<int> last_errno{0};
  std::mutex err_mu;        ///< guards last_path
  std::string last_path;    ///< the file of the last failed read (for the error the compute call reports)
};

class Ring;

/// How a backend's reads are issued.
enum class IoEngine { PREAD, IO_URING };

/// The readers of a backend: kRingThreads io_uring threads, or a pool of pread threads.
class ReaderPool {
 public:
  /// `engine` IO_URING falls back to the pread pool of `threads` threads when the kernel refuses a ring
  /// (depth() says which runs).
  ReaderPool(int threads, CacheCounters* counters, IoEngine engine = IoEngine::PREAD);
  ~ReaderPool();
  ReaderPool(const ReaderPool&) = delete;
  ReaderPool& operator=(const ReaderPool&) = delete;

  struct Job {
    NeuronCache* cache;
    int64_t first_row;  ///< first of `count` adjacent rows
    int count;
    int32_t slots[16];  ///< slot of each row
    /// A piece of one large row (count 1): bytes [part_off, part_off + part_len) of it; 0: whole rows.
    /// A row read in pieces is READY when its last piece lands (SlotPool::left_).
    uint64_t part_off = 0;
    uint64_t part_len = 0;
  };
  void submit(const Job* jobs, size_t n);
  int size() const { return static_cast<int>(threads_.size()); }
  /// Reads the rings keep in flight (0: the pread pool).
  int depth() const;

 private:
  void loop();
  void ring_loop(Ring* ring);
  /// Marks the job's rows READY (a piece: when it is the row's last) and updates the counters.
  void finish(const Job& job, bool ok);
  std::vector<std::unique_ptr<Ring>> rings_;  // one per ring thread (set by the constructor only)
  int wake_fd_ = -1;  // eventfd the ring threads poll: submit() writes it
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  int in_flight_ = 0;
  int64_t busy_since_ns_ = 0;
  CacheCounters* counters_;
};

/// Slots of one row size shared by several caches (all FFN tensors of a model with that row size): the
/// LRU region is one CLOCK over all of them, so a layer can use what others are not using and a token's
/// working set of one layer fits even when the budget is a small share of the FFN. Pinned (hot) slots
/// belong to one cache and are never evicted. Grows only while tensors are bound (no compute running).
class SlotPool {
 public:
  explicit SlotPool(size_t slot_bytes) : slot_bytes_(slot_bytes) {}
  ~SlotPool();
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;
  /// Adds n slots (pinned or LRU); returns the first id. @throws BackendErr OUT_OF_MEMORY.
  int32_t add(int64_t n, bool pinned);
  size_t slot_bytes() const { return slot_bytes_; }
  int64_t size() const { return static_cast<int64_t>(ptr_.size()); }

 private:
  friend class NeuronCache;
  friend class ReaderPool;
  size_t slot_bytes_;
  std::vector<void*> chunks_;
  std::vector<uint8_t*> ptr_;
  std::vector<NeuronCache*> owner_;  // cache whose row the slot holds (null: empty)
  std::vector<int32_t> row_;
  std::vector<uint32_t> stamp_;      // generation of the last request that used the slot
  std::vector<uint8_t> ref_;         // CLOCK reference bits
  std::vector<uint8_t> fresh_;       // read by a prefetch, not yet asked for by its own op
  std::vector<uint8_t> pinned_;
  std::deque<std::atomic<uint8_t>> state_;
  std::deque<std::atomic<int32_t>> left_;  // pieces of the slot's row still being read
  uint32_t gen_ = 1;
  int64_t hand_ = 0;
};

/// How a cache is bound (see addon mapTensorCached).
struct CacheSpec {
  std::string path;
  uint64_t file_offset = 0;   ///< byte offset of row 0
  uint64_t row_stride = 0;    ///< bytes between rows in the file (= row_bytes for a plain tensor)
  int64_t bucket_rows = 1;    ///< rows per bucket (bundled layout: buckets start 4 KiB aligned)
  uint64_t bucket_stride = 0; ///< bytes between bucket starts (default: row_stride × bucket_rows)
  size_t row_bytes = 0;       ///< bytes of one row (bundled layout: the whole neuron record)
  int64_t n_rows = 0;
  std::vector<int32_t> hot;   ///< rows pinned in memory (read at bind time)
  int64_t cold_slots = 0;     ///< LRU slots
  /// One row per expert (a stacked expert tensor {n_embd, n_ff_exp, n_expert}: row e is expert e's whole
  /// matrix): read by the routed-expert ops (mul_mat_id, mul_mat_id_sparse, axpy_id_sparse). False: one
  /// row per neuron, read by mul_mat_sparse/axpy_sparse.
  bool expert_rows = false;
  /// Transpose on read (expert rows of F16/F32 only): the file holds each expert as `transpose_rows`
  /// rows of row_bytes / (transpose_rows · elem_bytes) elements (llama.cpp's {n_ff_exp, n_embd} down
  /// projection) and the slot receives the transpose (neuron-major {n_embd, n_ff_exp}). 0: as stored.
  int64_t transpose_rows = 0;
  int elem_bytes = 0;  ///< 2 (F16) or 4 (F32) with transpose_rows
};

class NeuronCache {
 public:
  /// Opens the file and reads the hot rows. @throws BackendErr IO / BAD_TENSOR / OUT_OF_MEMORY.
  NeuronCache(const CacheSpec& spec, std::shared_ptr<ReaderPool> pool, std::shared_ptr<SlotPool> slots,
              CacheCounters* counters);
  ~NeuronCache();
  NeuronCache(const NeuronCache&) = delete;
  NeuronCache& operator=(const NeuronCache&) = delete;

  /// Slot state: READY rows can be read; PENDING rows are being read.
  enum : uint8_t { EMPTY = 0, PENDING = 1, READY = 2 };

  /// Starts a new request generation: rows requested from now on are protected from eviction until the
  /// next begin(). Called once per op (by the op's own cache) before request().
  void begin() { slots_->gen_++; }
  /**
   * Assigns slots to rows[0..n) (stride `stride` int32 words between entries), queuing reads for the
   * rows not present; writes each entry's slot to slot_out (may be null). Stops at the first row for
   * which no slot can be freed (every cold slot is protected or still being read).
   * `own`: the op's own rows (counted as hits and misses); false: a prefetch for a sibling's op (rows
   * read now count as misses when that op asks for them).
   * @return entries assigned (n when all fit).
   */
  int64_t request(const int32_t* rows, int64_t n, int stride, int32_t* slot_out, bool own);
  /// Whether `slot` was READY at request time (a hit), for ordering work.
  bool ready(int32_t slot) const { return slots_->state_[slot].load(std::memory_order_acquire) == READY; }
  /// The bytes of a slot, waiting (spin, then yield, then sleep) until its read has landed.
  const uint8_t* wait(int32_t slot);
  const uint8_t* slot_data(int32_t slot) const { return slots_->ptr_[static_cast<size_t>(slot)]; }

  /// Copies bytes [part_off, part_off + part_bytes) of every row, as a slot holds it (transposed when
  /// the cache transposes on read) (bind-time tools: readTensor). @throws BackendErr IO.
  void read_all(uint8_t* dst, size_t part_off, size_t part_bytes) const;
  /// File offset of row r.
  uint64_t row_off(int64_t r) const {
    return file_offset_ + static_cast<uint64_t>(r / bucket_rows_) * bucket_stride_ +
           static_cast<uint64_t>(r % bucket_rows_) * row_stride_;
  }

  size_t row_bytes() const { return row_bytes_; }
  int64_t n_rows() const { return n_rows_; }
  int64_t hot_rows() const { return n_hot_; }
  /// Bytes of slot memory this cache added to its pool (pinned + its share of the LRU region).
  size_t resident_bytes() const { return static_cast<size_t>(n_slots_) * slots_->slot_bytes(); }
  bool direct() const { return direct_; }
  /// Whether a row is an expert (CacheSpec::expert_rows).
  bool expert_rows() const { return expert_rows_; }

  /// Other caches of the same FFN (gate/up/down): their rows are prefetched with this one's list.
  std::vector<NeuronCache*> siblings;

 private:
  friend class ReaderPool;
  /// Reads a run of rows into their slots (reader thread). Returns false on an I/O error.
  bool load(const ReaderPool::Job& job, uint8_t* bounce, size_t bounce_bytes);
  /// The job's file range as whole 4 KiB blocks [*a0, *a1), and its bytes [*first, *last_end).
  void job_range(const ReaderPool::Job& job, uint64_t* a0, uint64_t* a1, uint64_t* first, uint64_t* last_end) const;
  /// Copies (or transposes) the overlap of file bytes [pos, pos + got) held at `data` with each row of the
  /// job into the row's slot.
  void place(const ReaderPool::Job& job, const uint8_t* data, uint64_t pos, uint64_t got, uint64_t first,
             uint64_t last_end);
  /// Where the job's rows can be read straight into their slots (O_DIRECT, whole 4 KiB blocks, rows
  /// adjacent in the file, slots on a block), fills iov (up to 16) and returns the row count; else 0.
  int into_slots(const ReaderPool::Job& job, struct iovec* iov) const;
  /// Records a failed read of this cache's file (errno e).
  void read_failed(int e);
  /// Transpose on read: scatters source bytes [b0, b1) of a row (element aligned) from `src` into `dst`.
  void scatter_transposed(uint8_t* dst, const uint8_t* src, uint64_t b0, uint64_t b1) const;
  int32_t victim();
  /// Waits for reads in flight, closes the file and frees the slots (destructor, failed constructor).
  void release();

  std::string path_;  ///< the model file (named in I/O errors)
  int fd_ = -1;
  bool direct_ = false;
  bool expert_rows_ = false;
  int64_t tr_rows_ = 0;  ///< transpose on read: source rows per expert (0: none)
  int tr_elem_ = 0;
  int max_job_rows_ = 16;  ///< adjacent rows per read job (fewer for rows near the bounce size)
  uint64_t file_offset_, row_stride_;
  int64_t bucket_rows_;
  uint64_t bucket_stride_;
  size_t row_bytes_;
  int64_t n_rows_, n_hot_ = 0, n_slots_ = 0;
  std::vector<int32_t> slot_of_;      // row → pool slot (−1 absent)
  std::atomic<int64_t> in_flight_{0};
  std::shared_ptr<ReaderPool> pool_;
  std::shared_ptr<SlotPool> slots_;
  CacheCounters* counters_;
  std::vector<ReaderPool::Job> jobs_;  // reused by request()
};

/// Bytes of a reader's bounce buffer for jobs of up to 16 rows of `row_bytes` with `stride`, at most
/// kMaxBounce: a longer job (an expert's matrix is megabytes) is read in pieces of that size.
size_t bounce_bytes_for(size_t row_bytes, uint64_t stride);
/// Largest bounce buffer (and so the largest single read), less two 4 KiB blocks: 1 MiB.
constexpr size_t kMaxBounce = size_t{1} << 20;
/// A row larger than this (an expert) is queued as pieces of this many bytes, read by several reader
/// threads at once.
constexpr uint64_t kRowPiece = uint64_t{1} << 20;
/// Reads the io_uring readers keep in flight, and the bytes their buffers may hold at most, in all; and
/// how many rings (and threads) share them.
constexpr int kRingDepth = 64;
constexpr int kRingThreads = 4;
constexpr size_t kRingBytes = size_t{24} << 20;

}  // namespace pi
