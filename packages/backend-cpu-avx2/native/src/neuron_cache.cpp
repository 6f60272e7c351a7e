#include "neuron_cache.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
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
  return static_cast<size_t>((15 * stride + row_bytes + 2 * kBlock) / kBlock * kBlock);
}

// ---- reader pool ----------------------------------------------------------------------------

ReaderPool::ReaderPool(int threads, CacheCounters* counters) : counters_(counters) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; i++) threads_.emplace_back([this] { loop(); });
}

ReaderPool::~ReaderPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReaderPool::submit(const Job* jobs, size_t n) {
  if (n == 0) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < n; i++) queue_.push_back(jobs[i]);
  }
  if (n == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
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
    if (!bounce || !job.cache->load(job, bounce, bounce_bytes)) {
      if (!bounce) counters_->last_errno.store(ENOMEM);
      counters_->io_errors.fetch_add(1);
      for (int i = 0; i < job.count; i++) {
        std::memset(const_cast<uint8_t*>(job.cache->slot_data(job.slots[i])), 0, job.cache->row_bytes_);
      }
    }
    for (int i = 0; i < job.count; i++) {
      job.cache->slots_->state_[static_cast<size_t>(job.slots[i])].store(NeuronCache::READY, std::memory_order_release);
    }
    job.cache->in_flight_.fetch_sub(job.count, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--in_flight_ == 0) counters_->io_busy_ns.fetch_add(now_ns() - busy_since_ns_);
    }
  }
  std::free(bounce);
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
  if (posix_memalign(&p, 64, static_cast<size_t>(n) * slot_bytes_) != 0) {
    throw BackendErr("OUT_OF_MEMORY", "neuron cache: cannot allocate " + std::to_string(static_cast<size_t>(n) * slot_bytes_) +
                                          " bytes of slots");
  }
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
  }
  return first;
}

// ---- cache ----------------------------------------------------------------------------------

NeuronCache::NeuronCache(const CacheSpec& s, std::shared_ptr<ReaderPool> pool, std::shared_ptr<SlotPool> slots,
                         CacheCounters* counters)
    : file_offset_(s.file_offset),
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
    while (i < hot.size() && job.count < 16 && hot[i] == job.first_row + job.count) {
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

bool NeuronCache::load(const ReaderPool::Job& job, uint8_t* bounce, size_t bounce_bytes) {
  const uint64_t first = row_off(job.first_row);
  const uint64_t last_end = row_off(job.first_row + job.count - 1) + row_bytes_;
  const uint64_t a0 = first / kBlock * kBlock;
  const uint64_t a1 = (last_end + kBlock - 1) / kBlock * kBlock;
  if (a1 - a0 > bounce_bytes) {
    counters_->last_errno.store(EOVERFLOW);
    return false;
  }
  const int64_t got = pread_full(fd_, bounce, static_cast<size_t>(a1 - a0), a0);
  counters_->reads.fetch_add(1, std::memory_order_relaxed);
  if (got < 0 || static_cast<uint64_t>(got) < last_end - a0) {
    counters_->last_errno.store(got < 0 ? static_cast<int>(-got) : EIO);
    return false;
  }
  counters_->bytes_read.fetch_add(got, std::memory_order_relaxed);
  if (!direct_) {
    // keep the file out of the page cache (advisory: a failure leaves the pages to normal reclaim)
    (void)posix_fadvise(fd_, static_cast<off_t>(a0), static_cast<off_t>(a1 - a0), POSIX_FADV_DONTNEED);
  }
  for (int i = 0; i < job.count; i++) {
    const uint64_t off = row_off(job.first_row + i) - a0;
    std::memcpy(slots_->ptr_[static_cast<size_t>(job.slots[i])], bounce + off, row_bytes_);
  }
  return true;
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
    if (last && last->count < 16 && last->first_row + last->count == r) {
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
  for (int64_t r = 0; r < n_rows_; r++) {
    const int64_t got = pread_full(fd, dst + static_cast<size_t>(r) * part_bytes, part_bytes, row_off(r) + part_off);
    if (got != static_cast<int64_t>(part_bytes)) {
      close(fd);
      throw BackendErr("IO", std::string("neuron cache: reading the model file failed: ") +
                                 (got < 0 ? std::strerror(static_cast<int>(-got)) : "short read"));
    }
  }
  close(fd);
}

}  // namespace pi
