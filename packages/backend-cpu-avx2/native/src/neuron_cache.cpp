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
    for (int i = 0; i < job.count; i++) job.cache->state_[job.slots[i]].store(NeuronCache::READY, std::memory_order_release);
    job.cache->in_flight_.fetch_sub(job.count, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--in_flight_ == 0) counters_->io_busy_ns.fetch_add(now_ns() - busy_since_ns_);
    }
  }
  std::free(bounce);
}

// ---- cache ----------------------------------------------------------------------------------

NeuronCache::NeuronCache(const CacheSpec& s, std::shared_ptr<ReaderPool> pool, CacheCounters* counters)
    : file_offset_(s.file_offset),
      row_stride_(s.row_stride ? s.row_stride : s.row_bytes),
      bucket_rows_(s.bucket_rows > 0 ? s.bucket_rows : 1),
      bucket_stride_(s.bucket_stride ? s.bucket_stride : (s.row_stride ? s.row_stride : s.row_bytes) * (s.bucket_rows > 0 ? s.bucket_rows : 1)),
      row_bytes_(s.row_bytes),
      slot_bytes_((s.row_bytes + 63) / 64 * 64),
      n_rows_(s.n_rows),
      pool_(std::move(pool)),
      counters_(counters) {
  if (n_rows_ < 1 || row_bytes_ == 0) throw BackendErr("BAD_TENSOR", "neuron cache: empty tensor");
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
  const size_t total = static_cast<size_t>(n_slots_ > 0 ? n_slots_ : 1) * slot_bytes_;
  void* p = nullptr;
  if (posix_memalign(&p, 64, total) != 0) {
    close(fd_);
    throw BackendErr("OUT_OF_MEMORY", "neuron cache: cannot allocate " + std::to_string(total) + " bytes of slots");
  }
  slots_ = static_cast<uint8_t*>(p);
  slot_of_.assign(static_cast<size_t>(n_rows_), -1);
  row_of_.assign(static_cast<size_t>(n_slots_), -1);
  stamp_of_.assign(static_cast<size_t>(n_slots_), 0);
  ref_.assign(static_cast<size_t>(n_slots_), 0);
  fresh_.assign(static_cast<size_t>(n_slots_), 0);
  state_.reset(new std::atomic<uint8_t>[static_cast<size_t>(n_slots_ > 0 ? n_slots_ : 1)]);
  for (int64_t i = 0; i < n_slots_; i++) state_[i].store(EMPTY);
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
      const int32_t slot = static_cast<int32_t>(i);
      job.slots[job.count++] = slot;
      slot_of_[static_cast<size_t>(hot[i])] = slot;
      row_of_[static_cast<size_t>(slot)] = hot[i];
      i++;
    }
    if (!load(job, static_cast<uint8_t*>(b), bb)) {
      const int e = counters_->last_errno.load();
      std::free(b);
      release();
      throw BackendErr("IO", "neuron cache: reading hot rows of " + s.path + " failed: " + std::strerror(e));
    }
    for (int k = 0; k < job.count; k++) state_[job.slots[k]].store(READY);
  }
  std::free(b);
}

NeuronCache::~NeuronCache() { release(); }

void NeuronCache::release() {
  // reads in flight write into our slots: wait for them
  while (in_flight_.load(std::memory_order_acquire) > 0) sched_yield();
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  std::free(slots_);
  slots_ = nullptr;
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
    std::memcpy(slots_ + static_cast<size_t>(job.slots[i]) * slot_bytes_, bounce + off, row_bytes_);
  }
  return true;
}

int32_t NeuronCache::victim() {
  const int64_t cold = n_slots_ - n_hot_;
  if (cold <= 0) return -1;
  for (int64_t step = 0; step < 2 * cold + 1; step++) {
    const int32_t s = static_cast<int32_t>(n_hot_ + hand_);
    hand_ = hand_ + 1 == cold ? 0 : hand_ + 1;
    if (stamp_of_[static_cast<size_t>(s)] == stamp_) continue;                 // used by this request
    if (state_[s].load(std::memory_order_acquire) == PENDING) continue;       // being read
    if (ref_[static_cast<size_t>(s)]) {
      ref_[static_cast<size_t>(s)] = 0;
      continue;
    }
    return s;
  }
  return -1;
}

int64_t NeuronCache::request(const int32_t* rows, int64_t n, int stride, int32_t* slot_out, bool own) {
  // pass 1: rows present (or being read) are protected first, so pass 2 never evicts one of them
  int64_t hits = 0;
  for (int64_t e = 0; e < n; e++) {
    const int32_t s = slot_of_[static_cast<size_t>(rows[e * stride])];
    if (s >= 0) {
      stamp_of_[static_cast<size_t>(s)] = stamp_;
      ref_[static_cast<size_t>(s)] = 1;
    }
  }
  // pass 2: misses get a slot each; adjacent rows become one read
  jobs_.clear();
  int64_t e = 0;
  int64_t misses = 0;
  for (; e < n; e++) {
    const int32_t r = rows[e * stride];
    int32_t s = slot_of_[static_cast<size_t>(r)];
    if (s >= 0) {
      stamp_of_[static_cast<size_t>(s)] = stamp_;
      if (own && fresh_[static_cast<size_t>(s)]) {
        fresh_[static_cast<size_t>(s)] = 0;
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
      s = victim();
    }
    if (s < 0) break;
    const int32_t old = row_of_[static_cast<size_t>(s)];
    if (old >= 0) slot_of_[static_cast<size_t>(old)] = -1;
    row_of_[static_cast<size_t>(s)] = r;
    slot_of_[static_cast<size_t>(r)] = s;
    stamp_of_[static_cast<size_t>(s)] = stamp_;
    ref_[static_cast<size_t>(s)] = 1;
    state_[s].store(PENDING, std::memory_order_release);
    in_flight_.fetch_add(1, std::memory_order_acq_rel);
    fresh_[static_cast<size_t>(s)] = own ? 0 : 1;
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
  if (state_[slot].load(std::memory_order_acquire) != READY) {
    const int64_t t0 = now_ns();
    int spins = 0;
    while (state_[slot].load(std::memory_order_acquire) != READY) {
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
