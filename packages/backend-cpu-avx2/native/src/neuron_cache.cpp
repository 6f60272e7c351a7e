#include "neuron_cache.h"

#include <fcntl.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "tensor_store.h"

namespace pi {
namespace {

constexpr uint64_t kBlock = 4096;  // O_DIRECT alignment used for offsets, lengths and buffers

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// pread until `len` bytes or end of file; returns bytes read or −errno.
int64_t pread_full(int fd, uint8_t* buf, size_t len, uint64_t off) {
  size_t got = 0;
  while (got < len) {
    const ssize_t r = pread(fd, buf + got, len - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<int64_t>(got);
}

}  // namespace

size_t bounce_bytes_for(size_t row_bytes, uint64_t stride) {
  const size_t full = static_cast<size_t>((15 * stride + row_bytes + 2 * kBlock) / kBlock * kBlock);
  // a 1 MiB piece of a row starts anywhere in a 4 KiB block: two more blocks keep it one read
  const size_t cap = kMaxBounce + 2 * kBlock;
  return full < cap ? full : cap;
}

// ---- reader pool ----------------------------------------------------------------------------

// ---- io_uring (raw system calls; see io_uring(7)) -------------------------------------------------

/// A submission and completion ring, used by one thread.
class Ring {
 public:
  /// A ring of `entries` submissions; null when the kernel refuses one (ENOSYS, EPERM: seccomp,
  /// kernel.io_uring_disabled) or lacks a feature used here (IORING_OP_READ, single mmap: 5.6+).
  static std::unique_ptr<Ring> create(unsigned entries) {
    std::unique_ptr<Ring> r(new Ring());
    io_uring_params p;
    std::memset(&p, 0, sizeof p);
    r->fd_ = static_cast<int>(syscall(__NR_io_uring_setup, entries, &p));
    if (r->fd_ < 0) return nullptr;
    if (!(p.features & IORING_FEAT_SINGLE_MMAP) || !(p.features & IORING_FEAT_NODROP)) return nullptr;
    r->ring_bytes_ = std::max<size_t>(p.sq_off.array + p.sq_entries * sizeof(unsigned),
                                      p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
    r->ring_ = mmap(nullptr, r->ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd_, IORING_OFF_SQ_RING);
    if (r->ring_ == MAP_FAILED) {
      r->ring_ = nullptr;
      return nullptr;
    }
    r->sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    void* q = mmap(nullptr, r->sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd_, IORING_OFF_SQES);
    if (q == MAP_FAILED) return nullptr;
    r->sqes_ = static_cast<io_uring_sqe*>(q);
    uint8_t* b = static_cast<uint8_t*>(r->ring_);
    r->sq_head_ = reinterpret_cast<unsigned*>(b + p.sq_off.head);
    r->sq_tail_ = reinterpret_cast<unsigned*>(b + p.sq_off.tail);
    r->sq_mask_ = *reinterpret_cast<unsigned*>(b + p.sq_off.ring_mask);
    r->sq_entries_ = p.sq_entries;
    r->sq_array_ = reinterpret_cast<unsigned*>(b + p.sq_off.array);
    r->cq_head_ = reinterpret_cast<unsigned*>(b + p.cq_off.head);
    r->cq_tail_ = reinterpret_cast<unsigned*>(b + p.cq_off.tail);
    r->cq_mask_ = *reinterpret_cast<unsigned*>(b + p.cq_off.ring_mask);
    r->cqes_ = reinterpret_cast<io_uring_cqe*>(b + p.cq_off.cqes);
    // kernels before 5.6 have no IORING_OP_READ (its completion says EINVAL): probe with a zero-length
    // read of /dev/null
    const int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (nul < 0) return nullptr;
    io_uring_sqe* e = r->next();
    e->opcode = IORING_OP_READ;
    e->fd = nul;
    e->addr = 0;
    e->len = 0;
    e->off = 0;
    e->user_data = 1;
    int res = -1;
    if (r->enter(1) >= 0) r->reap([&](const io_uring_cqe& c) { res = c.res; });
    close(nul);
    if (res != 0) return nullptr;
    return r;
  }
  ~Ring() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (ring_) munmap(ring_, ring_bytes_);
    if (fd_ >= 0) close(fd_);
  }
  /// The next submission entry (zeroed), or null when the ring is full.
  io_uring_sqe* next() {
    const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    if (local_tail_ - head >= sq_entries_) return nullptr;
    const unsigned i = local_tail_ & sq_mask_;
    io_uring_sqe* e = &sqes_[i];
    std::memset(e, 0, sizeof *e);
    sq_array_[i] = i;
    local_tail_++;
    pending_++;
    return e;
  }
  /// Submits the entries taken since the last call and waits for `min_complete` completions; −errno on
  /// failure (EINTR is retried).
  int enter(unsigned min_complete) {
    __atomic_store_n(sq_tail_, local_tail_, __ATOMIC_RELEASE);
    for (;;) {
      const long r = syscall(__NR_io_uring_enter, fd_, pending_, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0,
                             nullptr, 0);
      if (r >= 0) {
        pending_ -= static_cast<unsigned>(r) < pending_ ? static_cast<unsigned>(r) : pending_;
        return static_cast<int>(r);
      }
      if (errno == EINTR) continue;
      return -errno;
    }
  }
  /// Calls f on every completion that has arrived; returns how many.
  template <typename F>
  unsigned reap(F&& f) {
    unsigned head = *cq_head_, n = 0;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    for (; head != tail; head++, n++) f(cqes_[head & cq_mask_]);
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return n;
  }

 private:
  Ring() = default;
  int fd_ = -1;
  void* ring_ = nullptr;
  size_t ring_bytes_ = 0, sqes_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, sq_entries_ = 0, cq_mask_ = 0, local_tail_ = 0, pending_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

// ---- reader pool ----------------------------------------------------------------------------

ReaderPool::ReaderPool(int threads, CacheCounters* counters, IoEngine engine) : counters_(counters) {
  if (threads < 1) threads = 1;
  if (engine == IoEngine::IO_URING) {
    // kRingThreads rings (each kRingDepth / kRingThreads reads plus the poll of the wake-up eventfd), a
    // thread each: the copies (and transposes) of landed reads run on several threads, as the pool's do;
    // else the pread pool
    std::vector<std::unique_ptr<Ring>> rings;
    for (int i = 0; i < kRingThreads; i++) {
      std::unique_ptr<Ring> r = Ring::create(kRingDepth / kRingThreads + 1);
      if (!r) break;
      rings.push_back(std::move(r));
    }
    const int efd = rings.size() == static_cast<size_t>(kRingThreads) ? eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | EFD_SEMAPHORE) : -1;
    if (efd >= 0) {
      rings_ = std::move(rings);
      wake_fd_ = efd;
      for (int i = 0; i < kRingThreads; i++) threads_.emplace_back([this, i] { ring_loop(rings_[static_cast<size_t>(i)].get()); });
      return;
    }
  }
  for (int i = 0; i < threads; i++) threads_.emplace_back([this] { loop(); });
}

ReaderPool::~ReaderPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (wake_fd_ >= 0) {
    // (a semaphore eventfd: every ring thread's poll finds it readable from now on)
    const uint64_t many = uint64_t{1} << 40;
    (void)!write(wake_fd_, &many, sizeof many);
  }
  for (auto& t : threads_) t.join();
  if (wake_fd_ >= 0) close(wake_fd_);
}

int ReaderPool::depth() const { return rings_.empty() ? 0 : kRingDepth; }

void ReaderPool::submit(const Job* jobs, size_t n) {
  if (n == 0) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < n; i++) queue_.push_back(jobs[i]);
  }
  if (wake_fd_ >= 0) {
    // one wake-up per ring thread (a semaphore eventfd: each poll that fires takes one)
    const uint64_t k = kRingThreads;
    (void)!write(wake_fd_, &k, sizeof k);
  } else if (n == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
}

void ReaderPool::finish(const Job& job, bool ok) {
  if (!ok) {
    counters_->io_errors.fetch_add(1);
    for (int i = 0; i < job.count; i++) {
      uint8_t* d = const_cast<uint8_t*>(job.cache->slot_data(job.slots[i]));
      if (job.part_len) {
        std::memset(d + job.part_off, 0, static_cast<size_t>(job.part_len));  // (transposed: garbage, reported)
      } else {
        std::memset(d, 0, job.cache->row_bytes_);
      }
    }
  }
  int done = 0;
  for (int i = 0; i < job.count; i++) {
    const size_t si = static_cast<size_t>(job.slots[i]);
    // a piece: the row is ready when its last piece has landed
    if (job.part_len && job.cache->slots_->left_[si].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    job.cache->slots_->state_[si].store(NeuronCache::READY, std::memory_order_release);
    done++;
  }
  if (done) job.cache->in_flight_.fetch_sub(done, std::memory_order_acq_rel);
}

void ReaderPool::loop() {
  uint8_t* bounce = nullptr;
  size_t bounce_bytes = 0;
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stop_ and drained
      job = queue_.front();
      queue_.pop_front();
      if (in_flight_++ == 0) busy_since_ns_ = now_ns();
    }
    const size_t need = bounce_bytes_for(job.cache->row_bytes_, std::max(job.cache->row_stride_, job.cache->bucket_stride_));
    if (need > bounce_bytes) {
      std::free(bounce);
      bounce = nullptr;
      void* p = nullptr;
      if (posix_memalign(&p, kBlock, need) == 0) bounce = static_cast<uint8_t*>(p);
      bounce_bytes = bounce ? need : 0;
    }
    if (!bounce) counters_->last_errno.store(ENOMEM);
    finish(job, bounce && job.cache->load(job, bounce, bounce_bytes));
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--in_flight_ == 0) counters_->io_busy_ns.fetch_add(now_ns() - busy_since_ns_);
    }
  }
  std::free(bounce);
}

/// One io_uring reader thread (of kRingThreads, each with its own ring): takes jobs from the shared queue
/// while fewer than kRingDepth / kRingThreads reads (and kRingBytes / kRingThreads of buffers) are in flight —
/// one read of whole 4 KiB blocks per job: IORING_OP_READV straight into the rows' slots where
/// NeuronCache::into_slots allows, else IORING_OP_READ into a buffer of its own whose bytes are copied (or
/// transposed) into the slots as NeuronCache::load does. It sleeps in io_uring_enter; a poll of the eventfd
/// that submit() writes wakes it for new jobs.
void ReaderPool::ring_loop(Ring* ring) {
  constexpr int kDepth = kRingDepth / kRingThreads;
  constexpr size_t kBytes = kRingBytes / kRingThreads;
  struct Flight {
    Job job;
    uint8_t* buf = nullptr;
    size_t cap = 0;
    uint64_t a0 = 0, a1 = 0, first = 0, last_end = 0;
    iovec iov[16];
    int n_iov = 0;  // > 0: read straight into the rows' slots (NeuronCache::into_slots), buf unused
  };
  constexpr uint64_t kWake = ~uint64_t{0};
  std::vector<Flight> fl(kDepth);
  std::vector<int> free_list;
  for (int i = kDepth - 1; i >= 0; i--) free_list.push_back(i);
  size_t bytes_in_flight = 0, allocated = 0;
  int n_flight = 0;
  bool poll_armed = false;
  auto arm_poll = [&] {
    io_uring_sqe* e = ring->next();
    if (!e) return;
    e->opcode = IORING_OP_POLL_ADD;
    e->fd = wake_fd_;
    e->poll32_events = POLLIN;
    e->user_data = kWake;
    poll_armed = true;
  };
  auto submit_read = [&](int i) -> bool {
    Flight& f = fl[static_cast<size_t>(i)];
    io_uring_sqe* e = ring->next();
    if (!e) return false;
    e->fd = f.job.cache->fd_;
    if (f.n_iov > 0) {
      e->opcode = IORING_OP_READV;
      e->addr = reinterpret_cast<uint64_t>(f.iov);
      e->len = static_cast<uint32_t>(f.n_iov);
    } else {
      e->opcode = IORING_OP_READ;
      e->addr = reinterpret_cast<uint64_t>(f.buf);
      e->len = static_cast<uint32_t>(f.a1 - f.a0);
    }
    e->off = f.a0;
    e->user_data = static_cast<uint64_t>(i);
    return true;
  };
  auto done = [&](int i, bool ok) {
    Flight& f = fl[static_cast<size_t>(i)];
    finish(f.job, ok);
    bytes_in_flight -= f.n_iov > 0 ? 0 : static_cast<size_t>(f.a1 - f.a0);
    n_flight--;
    free_list.push_back(i);
    std::lock_guard<std::mutex> lk(mu_);
    if (--in_flight_ == 0) counters_->io_busy_ns.fetch_add(now_ns() - busy_since_ns_);
  };
  arm_poll();
  for (;;) {
    bool stop = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (!queue_.empty() && !free_list.empty()) {
        const Job& job = queue_.front();
        uint64_t a0, a1, first, last_end;
        job.cache->job_range(job, &a0, &a1, &first, &last_end);
        const int i = free_list.back();
        Flight& f = fl[static_cast<size_t>(i)];
        f.n_iov = job.cache->into_slots(job, f.iov);
        const size_t need = f.n_iov > 0 ? 0 : static_cast<size_t>(a1 - a0);  // (bytes of read buffers)
        if (n_flight > 0 && bytes_in_flight + need > kBytes) break;
        if (f.cap < need) {
          if (allocated + need > 2 * kBytes) {
            // keep the buffers within twice the bytes in flight: free the idle ones first (a freed buffer of a
            // megabyte goes back to the system, and a new one page-faults: not on every read)
            for (int k : free_list) {
              Flight& g = fl[static_cast<size_t>(k)];
              allocated -= g.cap;
              std::free(g.buf);
              g.buf = nullptr;
              g.cap = 0;
            }
          }
          allocated -= f.cap;
          std::free(f.buf);
          f.buf = nullptr;
          f.cap = 0;
          void* p = nullptr;
          const size_t cap = (need + 65535) / 65536 * 65536;
          if (posix_memalign(&p, kBlock, cap) != 0) {
            if (n_flight > 0) break;  // no memory now: retry after completions
            // nothing in flight to wait for: the job fails (its op reports IO, ENOMEM)
            counters_->last_errno.store(ENOMEM);
            const Job failed = job;
            queue_.pop_front();
            finish(failed, false);
            continue;
          }
          f.buf = static_cast<uint8_t*>(p);
          f.cap = cap;
          allocated += cap;
        }
        f.job = job;
        f.a0 = a0, f.a1 = a1, f.first = first, f.last_end = last_end;
        if (!submit_read(i)) break;  // (the ring has room for kDepth reads and the poll)
        free_list.pop_back();
        queue_.pop_front();
        bytes_in_flight += need;
        n_flight++;
        if (in_flight_++ == 0) busy_since_ns_ = now_ns();
      }
      stop = stop_ && queue_.empty() && n_flight == 0;
    }
    if (stop) break;
    const int r = ring->enter(1);
    if (r < 0 && r != -EAGAIN && r != -EBUSY) {
      // io_uring_enter failed (not seen outside fault injection): the reads in flight and the rest of the
      // queue are read again synchronously (pread, as the pool does; a failure there names the file). Reads
      // the kernel may still complete land in their buffers, which are not freed, or in their slots with the
      // same bytes.
      uint8_t* bounce = nullptr;
      void* p = nullptr;
      const size_t bb = kMaxBounce + 2 * kBlock;
      if (posix_memalign(&p, kBlock, bb) == 0) bounce = static_cast<uint8_t*>(p);
      if (!bounce) counters_->last_errno.store(ENOMEM);
      for (size_t i = 0; i < fl.size(); i++) {
        if (std::find(free_list.begin(), free_list.end(), static_cast<int>(i)) != free_list.end()) continue;
        Flight& f = fl[i];
        const bool ok = bounce && f.job.cache->load(f.job, bounce, bb);
        f.buf = nullptr;  // (left to the kernel)
        done(static_cast<int>(i), ok);
      }
      for (;;) {
        Job job;
        {
          std::unique_lock<std::mutex> lk(mu_);
          if (queue_.empty()) {
            if (stop_) break;
            lk.unlock();
            usleep(100);
            continue;
          }
          job = queue_.front();
          queue_.pop_front();
        }
        finish(job, bounce && job.cache->load(job, bounce, bb));
      }
      std::free(bounce);
      break;
    }
    ring->reap([&](const io_uring_cqe& c) {
      if (c.user_data == kWake) {
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof v);
        poll_armed = false;
        return;
      }
      const int i = static_cast<int>(c.user_data);
      Flight& f = fl[static_cast<size_t>(i)];
      if (c.res == -EINTR || c.res == -EAGAIN) {
        if (!submit_read(i)) done(i, false);
        return;
      }
      counters_->reads.fetch_add(1, std::memory_order_relaxed);
      if (c.res < 0) {
        f.job.cache->read_failed(-c.res);
        done(i, false);
        return;
      }
      uint64_t got = static_cast<uint64_t>(c.res);
      if (f.n_iov > 0) {
        // straight into the slots: whole rows of whole blocks (a short read, rare: the job again by pread)
        if (got == f.a1 - f.a0) {
          counters_->bytes_read.fetch_add(static_cast<int64_t>(got), std::memory_order_relaxed);
          done(i, true);
          return;
        }
        void* p = nullptr;
        const size_t bb = static_cast<size_t>(f.a1 - f.a0);
        const bool ok = posix_memalign(&p, kBlock, bb) == 0 && f.job.cache->load(f.job, static_cast<uint8_t*>(p), bb);
        std::free(p);
        done(i, ok);
        return;
      }
      const uint64_t need = std::min(f.a1, f.last_end) - f.a0;  // the file may end inside the last block
      if (got < need && got > 0) {
        // a short read (rare): the rest synchronously
        const int64_t more = pread_full(f.job.cache->fd_, f.buf + got, static_cast<size_t>(f.a1 - f.a0 - got), f.a0 + got);
        if (more > 0) got += static_cast<uint64_t>(more);
      }
      if (got < need) {
        f.job.cache->read_failed(EIO);
        done(i, false);
        return;
      }
      counters_->bytes_read.fetch_add(static_cast<int64_t>(got), std::memory_order_relaxed);
      f.job.cache->place(f.job, f.buf, f.a0, got, f.first, f.last_end);
      done(i, true);
    });
    if (!poll_armed) arm_poll();
  }
  for (Flight& f : fl) std::free(f.buf);
}

// ---- slot pool ------------------------------------------------------------------------------

SlotPool::~SlotPool() {
  for (void* c : chunks_) std::free(c);
}

int32_t SlotPool::add(int64_t n, bool pinned) {
  const int32_t first = static_cast<int32_t>(ptr_.size());
  if (n <= 0) return first;
  if (static_cast<int64_t>(ptr_.size()) + n > (int64_t{1} << 31) - 1) throw BackendErr("OUT_OF_MEMORY", "neuron cache: too many slots");
  void* p = nullptr;
  // slots of whole 4 KiB blocks start on a block: the io_uring reader reads such rows straight into them
  const size_t align = slot_bytes_ % kBlock == 0 ? kBlock : 64;
  if (posix_memalign(&p, align, static_cast<size_t>(n) * slot_bytes_) != 0) {
    throw BackendErr("OUT_OF_MEMORY", "neuron cache: cannot allocate " + std::to_string(static_cast<size_t>(n) * slot_bytes_) +
                                          " bytes of slots");
  }
  // touch the pages now (load time): the slots are the budget's memory, and a first touch while decoding
  // would page-fault inside the readers' copies
  std::memset(p, 0, static_cast<size_t>(n) * slot_bytes_);
  chunks_.push_back(p);
  for (int64_t i = 0; i < n; i++) {
    ptr_.push_back(static_cast<uint8_t*>(p) + static_cast<size_t>(i) * slot_bytes_);
    owner_.push_back(nullptr);
    row_.push_back(-1);
    stamp_.push_back(0);
    ref_.push_back(0);
    fresh_.push_back(0);
    pinned_.push_back(pinned ? 1 : 0);
    state_.emplace_back(NeuronCache::EMPTY);
    left_.emplace_back(0);
  }
  return first;
}

// ---- cache ----------------------------------------------------------------------------------

NeuronCache::NeuronCache(const CacheSpec& s, std::shared_ptr<ReaderPool> pool, std::shared_ptr<SlotPool> slots,
                         CacheCounters* counters)
    : path_(s.path),
      expert_rows_(s.expert_rows),
      tr_rows_(s.transpose_rows),
      tr_elem_(s.elem_bytes),
      file_offset_(s.file_offset),
      row_stride_(s.row_stride ? s.row_stride : s.row_bytes),
      bucket_rows_(s.bucket_rows > 0 ? s.bucket_rows : 1),
      bucket_stride_(s.bucket_stride ? s.bucket_stride : (s.row_stride ? s.row_stride : s.row_bytes) * (s.bucket_rows > 0 ? s.bucket_rows : 1)),
      row_bytes_(s.row_bytes),
      n_rows_(s.n_rows),
      pool_(std::move(pool)),
      slots_(std::move(slots)),
      counters_(counters) {
  if (n_rows_ < 1 || row_bytes_ == 0) throw BackendErr("BAD_TENSOR", "neuron cache: empty tensor");
  if (slots_->slot_bytes() < row_bytes_) throw BackendErr("BAD_TENSOR", "neuron cache: slot pool of smaller rows");
  if (row_stride_ < row_bytes_) throw BackendErr("BAD_TENSOR", "neuron cache: row stride below the row size");
  if (bucket_stride_ < row_stride_ * static_cast<uint64_t>(bucket_rows_ - 1) + row_bytes_) {
    throw BackendErr("BAD_TENSOR", "neuron cache: bucket stride below the bucket's rows");
  }
  if (s.cold_slots < 0) throw BackendErr("BAD_TENSOR", "neuron cache: negative cold slot count");
  if (tr_rows_ != 0 && (!expert_rows_ || (tr_elem_ != 2 && tr_elem_ != 4) || tr_rows_ < 0 ||
                        row_bytes_ % (static_cast<uint64_t>(tr_rows_) * static_cast<uint64_t>(tr_elem_)) != 0 ||
                        file_offset_ % static_cast<uint64_t>(tr_elem_) != 0 || row_stride_ != row_bytes_)) {
    throw BackendErr("BAD_TENSOR", "neuron cache: transpose on read needs F16/F32 expert rows of whole source rows");
  }
  // a job's rows are read together: keep a job within one bounce buffer where rows allow (an expert's
  // matrix is larger: it is one job, read in kMaxBounce pieces)
  max_job_rows_ = static_cast<int>(std::min<uint64_t>(16, std::max<uint64_t>(1, kMaxBounce / std::max(row_stride_, uint64_t{1}))));
  fd_ = open(s.path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  direct_ = fd_ >= 0;
  if (fd_ < 0) {
    fd_ = open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw BackendErr("IO", "neuron cache: cannot open " + s.path + ": " + std::strerror(errno));
    // no O_DIRECT here: reads go through the page cache and are dropped after each read
    if (posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM) != 0) { /* advisory only */ }
  }
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    const int e = errno;
    close(fd_);
    throw BackendErr("IO", "neuron cache: cannot stat " + s.path + ": " + std::strerror(e));
  }
  const uint64_t end = row_off(n_rows_ - 1) + row_bytes_;
  if (end > static_cast<uint64_t>(st.st_size)) {
    close(fd_);
    throw BackendErr("BAD_TENSOR", "neuron cache: rows end at byte " + std::to_string(end) + ", beyond the file size " +
                                       std::to_string(st.st_size) + " of " + s.path);
  }
  std::vector<uint8_t> seen(static_cast<size_t>(n_rows_), 0);
  std::vector<int32_t> hot;
  for (int32_t r : s.hot) {
    if (r < 0 || r >= n_rows_) {
      close(fd_);
      throw BackendErr("BAD_TENSOR", "neuron cache: hot row " + std::to_string(r) + " out of range 0.." +
                                         std::to_string(n_rows_ - 1));
    }
    if (!seen[static_cast<size_t>(r)]) hot.push_back(r);
    seen[static_cast<size_t>(r)] = 1;
  }
  n_hot_ = static_cast<int64_t>(hot.size());
  int64_t cold = s.cold_slots;
  if (cold < 1) cold = 1;  // a row that is not pinned needs somewhere to land
  if (cold > n_rows_ - n_hot_) cold = n_rows_ - n_hot_;
  n_slots_ = n_hot_ + cold;
  slot_of_.assign(static_cast<size_t>(n_rows_), -1);
  int32_t hot0 = 0;
  try {
    hot0 = slots_->add(n_hot_, true);
    slots_->add(cold, false);
  } catch (...) {
    close(fd_);
    throw;
  }
  // hot rows: read now, on this thread, in runs of adjacent rows
  std::sort(hot.begin(), hot.end());
  const size_t bb = bounce_bytes_for(row_bytes_, std::max(row_stride_, bucket_stride_));
  void* b = nullptr;
  if (posix_memalign(&b, kBlock, bb) != 0) {
    release();
    throw BackendErr("OUT_OF_MEMORY", "neuron cache: cannot allocate a read buffer");
  }
  for (size_t i = 0; i < hot.size();) {
    ReaderPool::Job job{this, hot[i], 0, {}};
    while (i < hot.size() && job.count < max_job_rows_ && hot[i] == job.first_row + job.count) {
      const int32_t slot = hot0 + static_cast<int32_t>(i);
      job.slots[job.count++] = slot;
      slot_of_[static_cast<size_t>(hot[i])] = slot;
      slots_->owner_[static_cast<size_t>(slot)] = this;
      slots_->row_[static_cast<size_t>(slot)] = hot[i];
      i++;
    }
    if (!load(job, static_cast<uint8_t*>(b), bb)) {
      const int e = counters_->last_errno.load();
      std::free(b);
      release();
      throw BackendErr("IO", "neuron cache: reading hot rows of " + s.path + " failed: " + std::strerror(e));
    }
    for (int k = 0; k < job.count; k++) slots_->state_[static_cast<size_t>(job.slots[k])].store(READY);
  }
  std::free(b);
}

NeuronCache::~NeuronCache() { release(); }

void NeuronCache::release() {
  // reads in flight write into our slots: wait for them
  while (in_flight_.load(std::memory_order_acquire) > 0) sched_yield();
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  // our slots go back to the pool: pinned ones stay out of circulation (their memory is the pool's)
  if (slots_) {
    for (size_t i = 0; i < slots_->owner_.size(); i++) {
      if (slots_->owner_[i] == this) {
        slots_->owner_[i] = nullptr;
        slots_->row_[i] = -1;
        slots_->state_[i].store(EMPTY);
      }
    }
  }
}

void NeuronCache::job_range(const ReaderPool::Job& job, uint64_t* a0, uint64_t* a1, uint64_t* first,
                            uint64_t* last_end) const {
  *first = row_off(job.first_row) + job.part_off;
  *last_end = job.part_len ? *first + job.part_len : row_off(job.first_row + job.count - 1) + row_bytes_;
  *a0 = *first / kBlock * kBlock;
  *a1 = (*last_end + kBlock - 1) / kBlock * kBlock;
}

int NeuronCache::into_slots(const ReaderPool::Job& job, iovec* iov) const {
  // O_DIRECT reads of whole rows, each of whole 4 KiB blocks, one after another in the file, into slots
  // that start on a block (SlotPool::add): no copy
  if (!direct_ || tr_rows_ || job.part_len || row_bytes_ % kBlock != 0 || job.count > 16) return 0;
  const uint64_t r0 = row_off(job.first_row);
  if (r0 % kBlock != 0) return 0;
  for (int i = 0; i < job.count; i++) {
    uint8_t* d = slots_->ptr_[static_cast<size_t>(job.slots[i])];
    if (row_off(job.first_row + i) != r0 + static_cast<uint64_t>(i) * row_bytes_ ||
        reinterpret_cast<uintptr_t>(d) % kBlock != 0) {
      return 0;
    }
    iov[i].iov_base = d;
    iov[i].iov_len = row_bytes_;
  }
  return job.count;
}

void NeuronCache::read_failed(int e) {
  counters_->last_errno.store(e);
  std::lock_guard<std::mutex> lk(counters_->err_mu);
  counters_->last_path = path_;
}

void NeuronCache::place(const ReaderPool::Job& job, const uint8_t* data, uint64_t pos, uint64_t got, uint64_t first,
                        uint64_t last_end) {
  if (!direct_) {
    // keep the page cache from holding the file (the reason this cache exists)
    (void)posix_fadvise(fd_, static_cast<off_t>(pos), static_cast<off_t>(got), POSIX_FADV_DONTNEED);
  }
  const uint64_t p1 = pos + got;
  for (int i = 0; i < job.count; i++) {
    const uint64_t r0 = row_off(job.first_row + i), r1 = r0 + row_bytes_;
    const uint64_t c0 = std::max({r0, pos, first}), c1 = std::min({r1, p1, last_end});
    if (c0 >= c1) continue;
    uint8_t* slot = slots_->ptr_[static_cast<size_t>(job.slots[i])];
    if (tr_rows_) {
      // pieces start 4 KiB aligned and rows at multiples of the element size: no element straddles
      scatter_transposed(slot, data + (c0 - pos), c0 - r0, c1 - r0);
    } else {
      std::memcpy(slot + (c0 - r0), data + (c0 - pos), static_cast<size_t>(c1 - c0));
    }
  }
}

bool NeuronCache::load(const ReaderPool::Job& job, uint8_t* bounce, size_t bounce_bytes) {
  // the job's file bytes [first, last_end) — whole rows, or one piece of a row — as whole 4 KiB blocks,
  // read in pieces of at most bounce_bytes (a multiple of 4 KiB); each piece's overlap with each row is
  // copied (or transposed) into the row's slot
  uint64_t a0, a1, first, last_end;
  job_range(job, &a0, &a1, &first, &last_end);
  const uint64_t piece = bounce_bytes / kBlock * kBlock;
  if (piece == 0) {
    counters_->last_errno.store(EOVERFLOW);
    return false;
  }
  for (uint64_t pos = a0; pos < a1; pos += piece) {
    const uint64_t len = std::min(piece, a1 - pos);
    const int64_t got = pread_full(fd_, bounce, static_cast<size_t>(len), pos);
    counters_->reads.fetch_add(1, std::memory_order_relaxed);
    const uint64_t need = std::min(len, last_end - pos);  // the file may end inside the last block
    if (got < 0 || static_cast<uint64_t>(got) < need) {
      read_failed(got < 0 ? static_cast<int>(-got) : EIO);
      return false;
    }
    counters_->bytes_read.fetch_add(got, std::memory_order_relaxed);
    place(job, bounce, pos, static_cast<uint64_t>(got), first, last_end);
  }
  return true;
}

namespace {

/// dst[c·rows + r] = src[(r − r_base)·cols + c] for rows [ra, rb) and columns [c0, c1), in 16 × 16 tiles
/// (each tile's writes are 16 runs of 16 contiguous elements).
template <typename T>
void transpose_block(T* dst, const T* src, uint64_t rows, uint64_t cols, uint64_t r_base, uint64_t ra, uint64_t rb,
                     uint64_t c0, uint64_t c1) {
  for (uint64_t r = ra; r < rb; r += 16) {
    const uint64_t re = std::min(rb, r + 16);
    for (uint64_t c = c0; c < c1; c += 16) {
      const uint64_t ce = std::min(c1, c + 16);
      for (uint64_t cc = c; cc < ce; cc++) {
        T* d = dst + cc * rows;
        const T* sp = src + (r - r_base) * cols + cc;
        for (uint64_t rr = r; rr < re; rr++) d[rr] = sp[(rr - r) * cols];
      }
    }
  }
}

template <typename T>
void scatter_t(uint8_t* dst8, const uint8_t* src8, uint64_t rows, uint64_t cols, uint64_t k0, uint64_t k1) {
  T* dst = reinterpret_cast<T*>(dst8);
  // src holds source elements [k0, k1): element k is (row k / cols, column k % cols)
  const T* src = reinterpret_cast<const T*>(src8);
  uint64_t k = k0;
  // a partial first row
  if (k % cols != 0) {
    const uint64_t r = k / cols, c0 = k % cols, c1 = std::min(cols, c0 + (k1 - k));
    for (uint64_t c = c0; c < c1; c++) dst[c * rows + r] = src[k - k0 + (c - c0)];
    k += c1 - c0;
  }
  // whole rows, tiled
  const uint64_t ra = k / cols, rb = k1 / cols;
  if (rb > ra) {
    transpose_block(dst, src + (k - k0), rows, cols, ra, ra, rb, 0, cols);
    k = rb * cols;
  }
  // a partial last row
  if (k < k1) {
    const uint64_t r = k / cols;
    for (uint64_t c = 0; c < k1 - k; c++) dst[c * rows + r] = src[k - k0 + c];
  }
}

}  // namespace

void NeuronCache::scatter_transposed(uint8_t* dst, const uint8_t* src, uint64_t b0, uint64_t b1) const {
  // source: tr_rows_ rows of `cols` elements; destination: `cols` rows of tr_rows_ elements
  const uint64_t es = static_cast<uint64_t>(tr_elem_);
  const uint64_t cols = row_bytes_ / es / static_cast<uint64_t>(tr_rows_);
  const uint64_t rows = static_cast<uint64_t>(tr_rows_);
  if (es == 2) {
    scatter_t<uint16_t>(dst, src, rows, cols, b0 / es, b1 / es);
  } else {
    scatter_t<uint32_t>(dst, src, rows, cols, b0 / es, b1 / es);
  }
}

int32_t NeuronCache::victim() {
  SlotPool& P = *slots_;
  const int64_t n = P.size();
  for (int64_t step = 0; step < 2 * n + 1; step++) {
    const size_t s = static_cast<size_t>(P.hand_);
    P.hand_ = P.hand_ + 1 == n ? 0 : P.hand_ + 1;
    if (P.pinned_[s]) continue;
    if (P.stamp_[s] == P.gen_) continue;                                   // used by this request
    if (P.state_[s].load(std::memory_order_acquire) == PENDING) continue;  // being read
    if (P.ref_[s]) {
      P.ref_[s] = 0;
      continue;
    }
    return static_cast<int32_t>(s);
  }
  return -1;
}

int64_t NeuronCache::request(const int32_t* rows, int64_t n, int stride, int32_t* slot_out, bool own) {
  SlotPool& P = *slots_;
  // pass 1: rows present (or being read) are protected first, so pass 2 never evicts one of them
  for (int64_t e = 0; e < n; e++) {
    const int32_t s = slot_of_[static_cast<size_t>(rows[e * stride])];
    if (s >= 0) {
      P.stamp_[static_cast<size_t>(s)] = P.gen_;
      P.ref_[static_cast<size_t>(s)] = 1;
    }
  }
  // pass 2: misses get a slot each; adjacent rows become one read
  jobs_.clear();
  int64_t e = 0;
  int64_t hits = 0, misses = 0;
  for (; e < n; e++) {
    const int32_t r = rows[e * stride];
    int32_t s = slot_of_[static_cast<size_t>(r)];
    if (s >= 0) {
      const size_t si = static_cast<size_t>(s);
      P.stamp_[si] = P.gen_;
      if (own && P.fresh_[si]) {
        P.fresh_[si] = 0;
        misses++;  // read for this token by the prefetch
      } else if (own) {
        hits++;
      }
      if (slot_out) slot_out[e] = s;
      continue;
    }
    s = victim();
    if (s < 0 && e == 0) {
      // only slots still being read are free: wait for them once
      while (in_flight_.load(std::memory_order_acquire) > 0) sched_yield();
      for (NeuronCache* c : siblings) {
        while (c->in_flight_.load(std::memory_order_acquire) > 0) sched_yield();
      }
      s = victim();
    }
    if (s < 0) break;
    const size_t si = static_cast<size_t>(s);
    if (NeuronCache* old = P.owner_[si]) old->slot_of_[static_cast<size_t>(P.row_[si])] = -1;
    P.owner_[si] = this;
    P.row_[si] = r;
    slot_of_[static_cast<size_t>(r)] = s;
    P.stamp_[si] = P.gen_;
    P.ref_[si] = 1;
    P.state_[si].store(PENDING, std::memory_order_release);
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
    P.fresh_[si] = own ? 0 : 1;
    if (own) misses++;
    if (slot_out) slot_out[e] = s;
    ReaderPool::Job* last = jobs_.empty() ? nullptr : &jobs_.back();
    if (row_bytes_ > kRowPiece) {
      // a large row (an expert): pieces that several readers fetch at once
      const uint64_t np = (row_bytes_ + kRowPiece - 1) / kRowPiece;
      P.left_[si].store(static_cast<int32_t>(np), std::memory_order_relaxed);
      for (uint64_t k = 0; k < np; k++) {
        ReaderPool::Job j{this, r, 1, {s}};
        j.part_off = k * kRowPiece;
        j.part_len = std::min<uint64_t>(kRowPiece, row_bytes_ - j.part_off);
        jobs_.push_back(j);
      }
    } else if (last && last->part_len == 0 && last->count < max_job_rows_ && last->first_row + last->count == r) {
      last->slots[last->count++] = s;
    } else {
      jobs_.push_back(ReaderPool::Job{this, r, 1, {s}});
    }
  }
  counters_->hits.fetch_add(hits, std::memory_order_relaxed);
  counters_->misses.fetch_add(misses, std::memory_order_relaxed);
  pool_->submit(jobs_.data(), jobs_.size());
  return e;
}

const uint8_t* NeuronCache::wait(int32_t slot) {
  const std::atomic<uint8_t>& st = slots_->state_[static_cast<size_t>(slot)];
  if (st.load(std::memory_order_acquire) != READY) {
    const int64_t t0 = now_ns();
    int spins = 0;
    while (st.load(std::memory_order_acquire) != READY) {
      if (++spins < 64) {
        __builtin_ia32_pause();
      } else if (spins < 1024) {
        sched_yield();
      } else {
        usleep(20);
      }
    }
    counters_->stall_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  }
  return slot_data(slot);
}

void NeuronCache::read_all(uint8_t* dst, size_t part_off, size_t part_bytes) const {
  // a plain descriptor: O_DIRECT would need aligned destination buffers
  const int fd = open(("/proc/self/fd/" + std::to_string(fd_)).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw BackendErr("IO", std::string("neuron cache: cannot reopen the model file: ") + std::strerror(errno));
  std::vector<uint8_t> tmp(tr_rows_ ? part_bytes : 0);
  for (int64_t r = 0; r < n_rows_; r++) {
    uint8_t* d = dst + static_cast<size_t>(r) * part_bytes;
    const int64_t got = pread_full(fd, tr_rows_ ? tmp.data() : d, part_bytes, row_off(r) + part_off);
    if (got == static_cast<int64_t>(part_bytes) && tr_rows_) scatter_transposed(d, tmp.data(), 0, part_bytes);
    if (got != static_cast<int64_t>(part_bytes)) {
      close(fd);
      throw BackendErr("IO", std::string("neuron cache: reading the model file failed: ") +
                                 (got < 0 ? std::strerror(static_cast<int>(-got)) : "short read"));
    }
  }
  close(fd);
}

}  // namespace pi
