#include "thread_pool.h"

#include <sched.h>

namespace pi {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waiting for work: spin briefly, then yield the core (so a caller thread building the next graph, or
// another process, can run), then sleep on the condition variable. Long enough to cover the gap
// between two graph calls of a decode step, short enough not to burn a shared core while idle.
constexpr int kSpinWake = 1 << 11;
constexpr int kYieldWake = 256;
constexpr int kSpinBarrier = 1 << 10;

/// Waits until done() holds, spinning then yielding; returns false if it still does not hold.
template <typename F>
bool spin_then_yield(F done) {
  for (int s = 0; s < kSpinWake; s++) {
    if (done()) return true;
    cpu_relax();
  }
  for (int s = 0; s < kYieldWake; s++) {
    if (done()) return true;
    sched_yield();
  }
  return done();
}

}  // namespace

ThreadPool::ThreadPool(int n) : n_(n < 1 ? 1 : n) {
  threads_.reserve(static_cast<size_t>(n_ - 1));
  for (int i = 1; i < n_; i++) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    if (!spin_then_yield([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    fn_(ctx_, ith, n_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(JobFn fn, void* ctx) {
  if (n_ == 1) {
    fn(ctx, 0, 1);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  pending_.store(n_ - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_cv_.notify_all();
  fn(ctx, 0, n_);
  if (!spin_then_yield([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
}

void ThreadPool::barrier() {
  if (n_ == 1) return;
  const int phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  int spins = 0;
  while (barrier_phase_.load(std::memory_order_acquire) == phase) {
    if (++spins < kSpinBarrier) {
      cpu_relax();
    } else {
      sched_yield();  // more threads than free cores: let the late one run
    }
  }
}

}  // namespace pi
