#include "thread_pool.h"

#include <sched.h>

#include <chrono>

namespace pi {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waiting: spin on `pause` briefly, then yield the core (so the caller thread building the next graph, or
// another process, can run) until a deadline, then sleep on the condition variable. A worker waits for
// work up to kWaitWorkUs: that covers the gap between two decode steps (the JavaScript side builds the
// next graph, the executor validates it), which a sleeping worker would otherwise pay as a futex wake-up
// (~250 us per token on a 2-vCPU VM; llama.cpp's pool spins even longer by default). Yielding keeps a
// shared core usable by others meanwhile.
constexpr int kSpinRounds = 1 << 11;
constexpr int64_t kWaitWorkUs = 3000;
constexpr int64_t kWaitDoneUs = 200;
constexpr int kSpinBarrier = 1 << 10;

/// Waits until done() holds, spinning then yielding until `us` microseconds have passed; returns false
/// if it still does not hold then.
template <typename F>
bool spin_then_yield(F done, int64_t us) {
  for (int s = 0; s < kSpinRounds; s++) {
    if (done()) return true;
    cpu_relax();
  }
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int s = 0;; s++) {
    if (done()) return true;
    sched_yield();
    if ((s & 15) == 15 && std::chrono::steady_clock::now() >= t_end) return done();
  }
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
    if (!spin_then_yield([&] { return generation_.load(std::memory_order_acquire) != seen; }, kWaitWorkUs)) {
      std::unique_lock<std::mutex> lk(mu_);
      const uint64_t poked = poke_;
      wake_cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen || poke_ != poked; });
      if (generation_.load(std::memory_order_acquire) == seen) continue;  // poked: wait spinning again
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
  if (!spin_then_yield([&] { return pending_.load(std::memory_order_acquire) == 0; }, kWaitDoneUs)) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
}

void ThreadPool::prepare() {
  if (n_ == 1) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    poke_++;
  }
  wake_cv_.notify_all();
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
