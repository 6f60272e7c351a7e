// A persistent thread pool: n−1 workers created once, the calling thread acts as thread 0.
// `run` executes one job on every thread; inside a job, `barrier` separates phases (the graph
// executor runs a whole graph as one job with a barrier after each node, so a graph costs one wake-up).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pi {

class ThreadPool {
 public:
  using JobFn = void (*)(void* ctx, int ith, int nth);

  /// @param n threads in total (≥ 1), the caller included.
  explicit ThreadPool(int n);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  /// Runs fn(ctx, ith, n) on all n threads (the caller is ith 0) and returns when all have finished.
  /// Not reentrant: one job at a time (callers serialise).
  void run(JobFn fn, void* ctx);

  /// Wakes sleeping workers so that they wait spinning for the next run (call before the work that
  /// precedes run, e.g. validating a graph, so that a futex wake-up overlaps it). Cheap when none sleeps.
  void prepare();

  /// Waits until every thread of the current job reached it. Only valid inside a job, called by all.
  void barrier();

 private:
  void worker(int ith);

  int n_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_cv_;
  std::condition_variable done_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  uint64_t poke_ = 0;  // guarded by mu_: prepare() calls
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<int> barrier_phase_{0};
};

/// Start of part `ith` of `n` items split into `nth` contiguous parts (deterministic).
inline int64_t split_begin(int64_t n, int ith, int nth) { return n * ith / nth; }

}  // namespace pi
