// The ops of the interface, executed by all threads of the pool on a validated node.
// Each op splits its work deterministically by thread index, so results for a fixed thread count
// are identical run to run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "executor.h"

namespace pi {

struct NodeExec {
  int op = 0;
  TensorView dst;
  TensorView src[MAX_SRC];
  bool has[MAX_SRC] = {false, false, false, false, false};
  const double* p = nullptr;
  int np = 0;
  uint8_t* scratch = nullptr;   // shared scratch of this node (64-byte aligned)
  size_t scratch_bytes = 0;
  int64_t* rows_read = nullptr; // one counter per thread
  /// Work-queue counter of this node (0 before the node runs): ops whose outputs are independent of
  /// which thread computes them hand out chunks dynamically, so a thread the OS delays does not hold
  /// the others up (results stay bit-identical: every output element is computed the same way).
  std::atomic<int64_t>* chunk = nullptr;
  const KernelTable* k = nullptr;
  ThreadPool* pool = nullptr;   // null: the graph runs on the calling thread alone
  /// top_k whose ids route file-backed expert stacks (expert caches): once its output is complete, the
  /// chosen experts of these caches are queued for reading (prefetch_experts), before the expert ops run.
  NeuronCache* prefetch[4] = {nullptr, nullptr, nullptr, nullptr};
  int n_prefetch = 0;
};

/// Thread 0, after node `n` (a top_k with NodeExec::prefetch) is complete: queues the reads of the experts
/// its ids name in each cache (a prefetch: counted as misses when their op asks for them).
void prefetch_experts(const NodeExec& n);

/// Scratch bytes the node needs when run with nth threads.
size_t node_scratch_bytes(const NodeExec& n, int nth);

/// Runs thread ith's share of the node (called by every thread; may use pool->barrier()).
void exec_node(const NodeExec& n, int ith, int nth);

/// exp(x) in the arithmetic of llama.cpp's AVX2+FMA `ggml_v_expf` (see ops.cpp); within 2 ulp of expf.
float expf_ggml_avx2(float x);
/// SiLU of element `i` of a row of `row` elements as llama.cpp's AVX2 build computes it (blocks of 8 with
/// `expf_ggml_avx2`, the row's last row mod 8 elements with expf).
float silu_ggml(float x, int64_t i, int64_t row);

}  // namespace pi
