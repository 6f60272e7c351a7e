#include "executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "ops.h"

namespace pi {
namespace {

/// A validated tensor (the wire header's GTensor) with where its bytes are for this run.
struct TInfo : GTensor {
  TensorPtr handle;
  size_t arena_off = 0;
  uint8_t* data = nullptr;
};

[[noreturn]] void bad(const std::string& msg) { throw BackendErr("BAD_GRAPH", msg); }

/// A first-fit allocator of arena offsets with coalescing, for intermediates' lifetimes.
class OffsetAllocator {
 public:
  size_t alloc(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    for (size_t i = 0; i < free_.size(); i++) {
      if (free_[i].size >= bytes) {
        const size_t off = free_[i].off;
        free_[i].off += bytes;
        free_[i].size -= bytes;
        if (free_[i].size == 0) free_.erase(free_.begin() + static_cast<long>(i));
        return off;
      }
    }
    // Extend: merge with a free block that ends at the top.
    if (!free_.empty() && free_.back().off + free_.back().size == top_) {
      const size_t off = free_.back().off;
      free_.pop_back();
      top_ = off + bytes;
      return off;
    }
    const size_t off = top_;
    top_ += bytes;
    return off;
  }
  void release(size_t off, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    size_t i = 0;
    while (i < free_.size() && free_[i].off < off) i++;
    free_.insert(free_.begin() + static_cast<long>(i), Range{off, bytes});
    if (i + 1 < free_.size() && free_[i].off + free_[i].size == free_[i + 1].off) {
      free_[i].size += free_[i + 1].size;
      free_.erase(free_.begin() + static_cast<long>(i + 1));
    }
    if (i > 0 && free_[i - 1].off + free_[i - 1].size == free_[i].off) {
      free_[i - 1].size += free_[i].size;
      free_.erase(free_.begin() + static_cast<long>(i));
    }
  }
  size_t top() const { return top_; }

 private:
  struct Range {
    size_t off, size;
  };
  std::vector<Range> free_;
  size_t top_ = 0;
};

// ---- opt-in per-op timing (POWERINFER_CPU_PROFILE=1): thread 0's wall time per node, from its start to
// the barrier after it, summed by (op, dtype of its first source) and printed to stderr at exit. For
// finding where a decode step's time goes; off by default (one getenv at start-up, one branch per node).

constexpr int kProfDtypes = 16;
struct OpProfile {
  double ns[OP_COUNT][kProfDtypes] = {};
  long calls[OP_COUNT][kProfDtypes] = {};
  double bytes[OP_COUNT][kProfDtypes] = {};  // sparse ops: rows read × row bytes
  double compute_ns = 0;                      // Executor::compute, entry to return (all its graphs)
  double prep_ns = 0;                         // entry to the start of the run (validation, planning, repacking)
  double run_ns = 0;                          // the run: the pool's job, start to join
  long computes = 0;
  std::vector<float> prep_us;                 // per graph (the first 1<<20), for the median
};
OpProfile* g_profile = nullptr;
std::mutex g_profile_mu;  // backends may compute at once

void print_profile() {
  if (!g_profile) return;
  std::lock_guard<std::mutex> lk(g_profile_mu);
  double total = 0;
  for (int o = 0; o < OP_COUNT; o++) {
    for (int d = 0; d < kProfDtypes; d++) total += g_profile->ns[o][d];
  }
  std::fprintf(stderr, "powerinfer cpu profile (thread 0 wall time per node, %.1f ms in all):\n", total / 1e6);
  if (g_profile->computes > 0) {
    const double per = 1e3 * static_cast<double>(g_profile->computes);
    std::fprintf(stderr, "  %ld graphs computed in %.1f ms: %.1f ms (%.2f us per graph) outside the nodes (validation, planning, repacking weights at first use, copying outputs)\n",
                 g_profile->computes, g_profile->compute_ns / 1e6, (g_profile->compute_ns - total) / 1e6,
                 (g_profile->compute_ns - total) / per);
    std::fprintf(stderr, "    per graph: %.2f us before the run (validation, planning, repacking), %.2f us in the run outside the nodes (pool start and join), %.2f us after it (row counters, outputs)\n",
                 g_profile->prep_ns / per, (g_profile->run_ns - total) / per,
                 (g_profile->compute_ns - g_profile->prep_ns - g_profile->run_ns) / per);
    std::vector<float> v = g_profile->prep_us;
    if (!v.empty()) {
      std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
      std::fprintf(stderr, "    median graph: %.2f us before the run\n", static_cast<double>(v[v.size() / 2]));
    }
  }
  for (int o = 0; o < OP_COUNT; o++) {
    for (int d = 0; d < kProfDtypes; d++) {
      const double ns = g_profile->ns[o][d];
      if (g_profile->calls[o][d] == 0) continue;
      std::fprintf(stderr, "  %-18s %-5s %9.2f ms %5.1f %% %8ld calls %8.2f us/call", op_name(o), dtype_name(d),
                   ns / 1e6, 100.0 * ns / total, g_profile->calls[o][d],
                   ns / 1e3 / static_cast<double>(g_profile->calls[o][d]));
      if (g_profile->bytes[o][d] > 0) std::fprintf(stderr, " %6.1f GB/s (rows read)", g_profile->bytes[o][d] / ns);
      std::fprintf(stderr, "\n");
    }
  }
}

bool profile_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("POWERINFER_CPU_PROFILE");
    if (!e || !*e || std::strcmp(e, "0") == 0) return false;
    g_profile = new OpProfile();
    std::atexit(print_profile);
    return true;
  }();
  return on;
}

void profile_add(const NodeExec& n, std::chrono::steady_clock::time_point t0, int nth) {
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  const int d = n.has[0] && n.src[0].dtype >= 0 && n.src[0].dtype < kProfDtypes ? n.src[0].dtype : 0;
  std::lock_guard<std::mutex> lk(g_profile_mu);
  if (n.op > 0 && n.op < OP_COUNT) {
    g_profile->ns[n.op][d] += ns;
    g_profile->calls[n.op][d]++;
    if (n.rows_read && n.has[0]) {
      int64_t r = 0;
      for (int t = 0; t < nth; t++) r += n.rows_read[t];
      g_profile->bytes[n.op][d] += static_cast<double>(r) * static_cast<double>(row_bytes(n.src[0].dtype, n.src[0].ne[0]));
    }
  }
}

struct RunCtx {
  std::vector<NodeExec>* nodes;
  ThreadPool* pool;  // null when the whole graph runs on the calling thread
  /// Workers that have entered this run. Until all have, thread 0 runs the nodes alone: a worker the OS
  /// wakes or schedules late (a futex wake-up, another thread on its core) does not hold the graph up.
  std::atomic<int> arrived{0};
  /// The node from which all threads run together (−1: not decided yet; nodes.size(): thread 0 ran all).
  std::atomic<int> join_at{-1};
  /// Per node: whether thread 0 may run it alone while workers are missing (nodes small enough that
  /// running them on one thread costs less than a late worker usually does; a large prompt product
  /// waits for the workers instead).
  const char* solo_ok = nullptr;
  int test_delay_us = 0;  ///< Executor::set_test_worker_delay
};

/// Runs node i, prefetches and profile included, on thread ith of nth; `alone`: thread 0 runs it by itself
/// while the workers are missing (ith 0 of 1, no barriers).
inline void run_node(const RunCtx* rc, size_t i, int ith, int nth, bool prof, bool alone = false) {
  const std::vector<NodeExec>& nodes = *rc->nodes;
  const NodeExec& n = nodes[i];
  std::chrono::steady_clock::time_point t0;
  if (prof) t0 = std::chrono::steady_clock::now();
  // the previous node's output is complete here (one thread, or after its barrier)
  if (ith == 0 && i > 0 && nodes[i - 1].n_prefetch) prefetch_experts(nodes[i - 1]);
  if (alone) {
    NodeExec solo = n;
    solo.pool = nullptr;  // its barriers would wait for the absent workers
    exec_node(solo, 0, 1);
  } else if (!rc->pool) {
    exec_node(n, 0, 1);
  } else if (!n.pool) {
    if (ith == 0) exec_node(n, 0, 1);
    if (i + 1 < nodes.size() && nodes[i + 1].pool) rc->pool->barrier();
  } else {
    exec_node(n, ith, nth);
    rc->pool->barrier();
  }
  if (prof) profile_add(n, t0, nth);
}

/// Every thread runs every node from the join point on (see RunCtx::join_at); a small node
/// (NodeExec::pool == null) runs on thread 0 alone, and a run of consecutive small nodes needs no barrier
/// between its nodes (one thread, program order), only one before the next node that all threads share.
/// Before the join, thread 0 runs nodes alone (ith 0 of 1, no barriers) while they are RunCtx::solo_ok:
/// those compute every output the same way whatever the number of threads (axpy_sparse, whose sum depends
/// on it, is never solo_ok), so the results do not depend on when the workers arrive.
void run_graph(void* ctx, int ith, int nth) {
  RunCtx* rc = static_cast<RunCtx*>(ctx);
  const std::vector<NodeExec>& nodes = *rc->nodes;
  const bool prof = ith == 0 && g_profile;
  size_t start = 0;
  if (rc->pool && nth > 1) {
    if (ith != 0) {
      if (rc->test_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(rc->test_delay_us));
      rc->arrived.fetch_add(1, std::memory_order_acq_rel);
      int j;
      while ((j = rc->join_at.load(std::memory_order_acquire)) < 0) __builtin_ia32_pause();
      start = static_cast<size_t>(j);
    } else {
      for (; start < nodes.size() && rc->test_delay_us >= 0 && rc->solo_ok[start] && rc->arrived.load(std::memory_order_acquire) < nth - 1; start++) {
        run_node(rc, start, 0, nth, prof, true);
      }
      // release: the outputs of the nodes run alone are visible to the workers that acquire join_at
      rc->join_at.store(static_cast<int>(start), std::memory_order_release);
    }
  }
  for (size_t i = start; i < nodes.size(); i++) run_node(rc, i, ith, nth, prof);
}

/// Rough bytes a node touches (weights read plus activations); used to keep tiny graphs on one thread.
double node_work(const NodeExec& n) {
  switch (n.op) {
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE:
    case OP_AXPY_ID_SPARSE: {
      // the selected experts' matrices (at most one per slot and token, at most all experts)
      const double used = static_cast<double>(n.src[2].nel) < static_cast<double>(n.src[0].ne[2])
                              ? static_cast<double>(n.src[2].nel)
                              : static_cast<double>(n.src[0].ne[2]);
      return static_cast<double>(row_bytes(n.src[0].dtype, n.src[0].ne[0])) * static_cast<double>(n.src[0].ne[1]) * used +
             4.0 * static_cast<double>(n.src[1].nel + n.dst.nel);
    }
    case OP_MUL_MAT:
    case OP_MUL_MAT_SPARSE:
    case OP_AXPY_SPARSE:
      return static_cast<double>(row_bytes(n.src[0].dtype, n.src[0].ne[0])) * static_cast<double>(n.src[0].rows()) +
             4.0 * static_cast<double>(n.src[1].nel + n.dst.nel);
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: {
      const double ctx = static_cast<double>(n.p[0]) + static_cast<double>(n.src[0].rows());
      return 2.0 * 4.0 * ctx * static_cast<double>(n.src[1].ne[0]) * (n.p[4] / n.p[1]) * static_cast<double>(n.src[0].rows());
    }
    default: return 8.0 * static_cast<double>(n.dst.nel);
  }
}

/// Nodes touching less than this (~0.3 ms on one core) may run on thread 0 alone while a worker is late.
constexpr double kSoloWorkBytes = 8.0 * 1024 * 1024;

/// Graphs that touch less than this run on the calling thread alone: waking the pool and a barrier
/// per node would cost more than the threads save. POWERINFER_CPU_SERIAL_BYTES overrides it (tests
/// set 0 so that every graph exercises the threaded paths).
double serial_work_default() {
  const char* e = std::getenv("POWERINFER_CPU_SERIAL_BYTES");
  if (e && *e) {
    char* end = nullptr;
    const double v = std::strtod(e, &end);
    if (end != e && v >= 0) return v;
  }
  return 256.0 * 1024;
}

}  // namespace

bool supports_op(int op, const int* dtypes, int n_dtypes) {
  return standard_supports_op(op, dtypes, n_dtypes, is_weight_dtype);
}

void Executor::ArenaFree::operator()(uint8_t* p) const { free_weights(p, bytes); }

/// compute()'s per-graph tables, kept between calls (guarded by Executor::mu_).
struct Executor::RunScratch {
  std::vector<TInfo> ts;
  std::vector<NodeExec> ex;
  std::vector<int> dst_of, src_of;
  std::vector<char> small, solo_ok;
  std::vector<std::vector<int>> frees;
  std::vector<std::atomic<int64_t>*> chunk_ctr;
};

Executor::~Executor() = default;

Executor::Executor(TensorStore& store, int threads, bool force_scalar)
    : store_(store), pool_(threads), kernels_(&select_kernels(force_scalar, &reason_)),
      serial_work_bytes_(serial_work_default()), work_(std::make_unique<RunScratch>()) {
  profile_enabled();
}

void Executor::compute(const EncodedGraph& g, std::vector<double>& rows_read) {
  const auto t_start = std::chrono::steady_clock::now();
  // the workers' wake-up (if they sleep) overlaps the validation below, when the last graph used them
  if (last_parallel_.load(std::memory_order_relaxed)) pool_.prepare();
  std::lock_guard<std::mutex> lk(mu_);
  RunScratch& rs = *work_;  // vectors kept between calls (no allocation, no page faults per graph)
  struct ReleaseHandles {  // the tensors this graph holds are released when it ends, thrown or not
    std::vector<TInfo>& ts;
    ~ReleaseHandles() { ts.clear(); }
  } release_handles{rs.ts};
  // ---- validate (the shared validator of powerinfer/wire.h), then resolve tensors and nodes ----
  const CheckedGraph cg = check_graph(g, [&](int id, HandleInfo* h) {
    TensorPtr t = store_.find(id);
    if (!t) return false;
    h->dtype = t->dtype;
    for (int d = 0; d < 4; d++) h->ne[d] = t->ne[d];
    h->read_only = t->mapped;
    h->i32 = t->dtype == DT_I32 ? reinterpret_cast<const int32_t*>(t->data) : nullptr;
    return true;
  });
  const size_t nt = cg.tensors.size();
  const size_t nn = cg.nodes.size();
  std::vector<TInfo>& ts = rs.ts;
  ts.assign(nt, TInfo());
  for (size_t i = 0; i < nt; i++) {
    TInfo& t = ts[i];
    static_cast<GTensor&>(t) = cg.tensors[i];
    if (t.kind == KIND_INPUT) {
      t.data = const_cast<uint8_t*>(static_cast<const uint8_t*>(g.inputs[static_cast<size_t>(t.ref)].data));
    } else if (t.kind == KIND_HANDLE) {
      t.handle = store_.find(t.ref);
      if (!t.handle) bad("tensor " + std::to_string(i) + ": handle " + std::to_string(t.ref) + " does not exist");
      t.data = t.handle->data;
    }
  }
  std::vector<NodeExec>& ex = rs.ex;
  ex.assign(nn, NodeExec());
  std::vector<int>& dst_of = rs.dst_of;
  dst_of.assign(nn, 0);
  std::vector<int>& src_of = rs.src_of;
  src_of.assign(nn * MAX_SRC, -1);
  for (size_t ni = 0; ni < nn; ni++) {
    const GNode& c = cg.nodes[ni];
    NodeExec& n = ex[ni];
    n.op = c.op;
    n.p = c.p;
    n.np = c.np;
    for (int s = 0; s < MAX_SRC; s++) {
      if (c.src[s] < 0) continue;
      const TInfo& st = ts[static_cast<size_t>(c.src[s])];
      n.has[s] = true;
      src_of[ni * MAX_SRC + s] = c.src[s];
      n.src[s].dtype = st.dtype;
      for (int d = 0; d < 4; d++) n.src[s].ne[d] = st.ne[d];
      n.src[s].nel = st.nel;
      n.src[s].cache = st.handle ? st.handle->cache.get() : nullptr;  // scratch sizes depend on it
      if (n.src[s].cache) {
        n.src[s].cache_part = st.handle->cache_part;
        n.src[s].cache_counts = st.handle->cache_counts;
      }
      // a dense Q4_0/Q4_K product (mul_mat, mul_mat_id) reads its weight in the repacked layout (made at first use)
      if (s == 0 && (c.op == OP_MUL_MAT || c.op == OP_MUL_MAT_ID) && repack_ && st.handle && !st.handle->cache && st.dtype >= 0 && st.dtype < DT_TABLE &&
          kernels_->packed_tile[st.dtype]) {
        n.src[s].packed = store_.packed(st.handle);
      }
      // file-backed weights (neuron caches) are read only as the weight of the sparse ops (one row per
      // neuron) or of the routed-expert ops (one row per expert)
      if (n.src[s].cache) {
        const bool experts = n.src[s].cache->expert_rows();
        const bool ok = s == 0 && (experts ? (c.op == OP_MUL_MAT_ID || c.op == OP_MUL_MAT_ID_SPARSE || c.op == OP_AXPY_ID_SPARSE)
                                           : (c.op == OP_MUL_MAT_SPARSE || c.op == OP_AXPY_SPARSE));
        if (!ok) {
          bad("node " + std::to_string(ni) + " (" + op_name(c.op) + "): tensor " + std::to_string(st.handle->id) +
              (experts ? " is file-backed one expert per row (expert cache) and only mul_mat_id/mul_mat_id_sparse/axpy_id_sparse can read it"
                       : " is file-backed (neuron cache) and only mul_mat_sparse/axpy_sparse can read it"));
        }
      }
    }
    const TInfo& dt = ts[static_cast<size_t>(c.dst)];
    dst_of[ni] = c.dst;
    n.dst.dtype = dt.dtype;
    for (int d = 0; d < 4; d++) n.dst.ne[d] = dt.ne[d];
    n.dst.nel = dt.nel;
  }
  // a top_k whose ids route file-backed expert stacks queues their chosen experts as soon as it is done
  // (before the predictors run, and before attention when the router runs first: SmallThinker)
  for (size_t ni = 0; ni < nn; ni++) {
    const NodeExec& n = ex[ni];
    if ((n.op != OP_MUL_MAT_ID && n.op != OP_MUL_MAT_ID_SPARSE && n.op != OP_AXPY_ID_SPARSE) || !n.src[0].cache) continue;
    const int prod = ts[static_cast<size_t>(src_of[ni * MAX_SRC + 2])].producer;
    if (prod < 0 || ex[static_cast<size_t>(prod)].op != OP_TOP_K) continue;
    NodeExec& k = ex[static_cast<size_t>(prod)];
    bool have = false;
    for (int i = 0; i < k.n_prefetch; i++) have = have || k.prefetch[i] == n.src[0].cache;
    if (!have && k.n_prefetch < 4) k.prefetch[k.n_prefetch++] = n.src[0].cache;
  }
  // A top_k whose ids route nothing, over the same router weight (gating(W·r)) as one that routes expert
  // caches, is a look-ahead guess of that layer's experts (the graph computes a later layer's router on an
  // earlier input): it queues the same caches.
  auto router_of = [&](size_t ni) -> int {  // the router weight's handle id, or −1
    int t = src_of[ni * MAX_SRC + 0];
    for (int hop = 0; hop < 2 && t >= 0; hop++) {
      const int p = ts[static_cast<size_t>(t)].producer;
      if (p < 0) return -1;
      const int op = ex[static_cast<size_t>(p)].op;
      if (op == OP_MUL_MAT) {
        const TInfo& w = ts[static_cast<size_t>(src_of[static_cast<size_t>(p) * MAX_SRC + 0])];
        return w.handle ? w.handle->id : -1;
      }
      if (op != OP_SOFTMAX && op != OP_SIGMOID) return -1;
      t = src_of[static_cast<size_t>(p) * MAX_SRC + 0];
    }
    return -1;
  };
  // (only when some top_k routes a cache: the usual graph pays one scan of its nodes)
  std::vector<std::pair<int, size_t>> routed;  // (router handle, top_k node) of the top_k that route caches
  for (size_t ni = 0; ni < nn; ni++) {
    if (ex[ni].op == OP_TOP_K && ex[ni].n_prefetch) routed.emplace_back(router_of(ni), ni);
  }
  for (size_t ai = 0; ai < nn && !routed.empty(); ai++) {
    if (ex[ai].op != OP_TOP_K || ex[ai].n_prefetch) continue;
    const int r = router_of(ai);
    for (const auto& [h, bi] : routed) {
      if (r < 0 || h != r) continue;
      for (int i = 0; i < ex[bi].n_prefetch; i++) ex[ai].prefetch[i] = ex[bi].prefetch[i];
      ex[ai].n_prefetch = ex[bi].n_prefetch;
      break;
    }
  }

  CacheCounters& cc = store_.counters();
  const int64_t io_errors0 = cc.io_errors.load();
  double work = 0;
  std::vector<char>& small = rs.small;
  small.assign(nn, 0);
  std::vector<char>& solo_ok = rs.solo_ok;
  solo_ok.assign(nn, 0);
  for (size_t ni = 0; ni < nn; ni++) {
    const double w = node_work(ex[ni]);
    work += w;
    small[ni] = w < serial_work_bytes_ / 8 ? 1 : 0;  // default: nodes under 32 KiB run on one thread
    // axpy_sparse sums each thread's share of the rows apart, so its result depends on the thread count
    solo_ok[ni] = w < kSoloWorkBytes && ex[ni].op != OP_AXPY_SPARSE ? 1 : 0;
  }
  const bool serial = pool_.size() == 1 || work < serial_work_bytes_;
  const int nth = serial ? 1 : pool_.size();
  last_parallel_.store(!serial, std::memory_order_relaxed);

  // ---- plan the arena: intermediates by lifetime, then the largest node scratch, then counters ----
  std::vector<std::vector<int>>& frees = rs.frees;
  if (frees.size() < nn) frees.resize(nn);
  for (size_t ni = 0; ni < nn; ni++) frees[ni].clear();
  for (size_t i = 0; i < nt; i++) {
    TInfo& t = ts[i];
    if (t.kind != 0) continue;
    if (t.out >= 0) t.last_use = static_cast<int>(nn);  // outputs live to the end
    if (t.producer < 0 && t.out >= 0) bad("tensor " + std::to_string(i) + ": output is never computed");
    if (t.last_use >= 0 && t.last_use < static_cast<int>(nn)) frees[static_cast<size_t>(t.last_use)].push_back(static_cast<int>(i));
  }
  OffsetAllocator alloc;
  for (size_t ni = 0; ni < nn; ni++) {
    if (ex[ni].op != OP_CPY) {
      TInfo& d = ts[static_cast<size_t>(dst_of[ni])];
      d.arena_off = alloc.alloc(static_cast<size_t>(d.nel) * 4);
    }
    for (int id : frees[ni]) alloc.release(ts[static_cast<size_t>(id)].arena_off, static_cast<size_t>(ts[static_cast<size_t>(id)].nel) * 4);
  }
  size_t scratch = 0;
  for (size_t ni = 0; ni < nn; ni++) {
    const size_t s = node_scratch_bytes(ex[ni], small[ni] ? 1 : nth);
    if (s > scratch) scratch = s;
  }
  const size_t scratch_off = (alloc.top() + 63) / 64 * 64;
  const size_t counters_off = scratch_off + (scratch + 63) / 64 * 64;
  const size_t counters_bytes = sizeof(int64_t) * static_cast<size_t>(nth) * (nn == 0 ? 1 : nn);
  const size_t chunks_off = (counters_off + counters_bytes + 63) / 64 * 64;
  const size_t chunks_bytes = 64 * (nn == 0 ? 1 : nn);  // one cache line per node's atomic counter
  const size_t need = chunks_off + chunks_bytes;
  if (need > arena_size_) {
    size_t grow = arena_size_ * 3 / 2;
    if (grow < need) grow = need;
    grow = (grow + 4095) / 4096 * 4096;
    // huge pages from 2 MiB up, not inherited by child processes (see alloc_weights)
    uint8_t* p = alloc_weights(grow);
    if (!p) throw BackendErr("OUT_OF_MEMORY", "cannot allocate a compute arena of " + std::to_string(grow) + " bytes");
    arena_holder_.reset();
    arena_holder_ = std::unique_ptr<uint8_t, ArenaFree>(p, ArenaFree{grow});
    arena_ = p;
    arena_size_ = grow;
  }
  int64_t* counters = reinterpret_cast<int64_t*>(arena_ + counters_off);
  std::memset(counters, 0, counters_bytes);
  std::vector<std::atomic<int64_t>*>& chunk_ctr = rs.chunk_ctr;
  chunk_ctr.assign(nn, nullptr);
  for (size_t ni = 0; ni < nn; ni++) chunk_ctr[ni] = new (arena_ + chunks_off + 64 * ni) std::atomic<int64_t>(0);

  // ---- bind views ----
  for (size_t i = 0; i < nt; i++) {
    if (ts[i].kind == 0) ts[i].data = arena_ + ts[i].arena_off;
    // a handle's bytes move when packing replaces its huge-page copy (TensorStore::packed, above)
    if (ts[i].kind == KIND_HANDLE) ts[i].data = ts[i].handle->data;
  }
  for (size_t ni = 0; ni < nn; ni++) {
    NodeExec& n = ex[ni];
    n.dst.data = ts[static_cast<size_t>(dst_of[ni])].data;
    for (int s = 0; s < MAX_SRC; s++) {
      if (n.has[s]) n.src[s].data = ts[static_cast<size_t>(src_of[ni * MAX_SRC + s])].data;
    }
    n.scratch = arena_ + scratch_off;
    n.scratch_bytes = scratch;
    n.rows_read = counters + ni * static_cast<size_t>(nth);
    n.chunk = chunk_ctr[ni];
    n.k = kernels_;
    n.pool = serial || small[ni] ? nullptr : &pool_;
  }

  // ---- run: one pool job for the whole graph, a barrier after each node ----
  const auto t_run = std::chrono::steady_clock::now();
  if (nn > 0) {
    RunCtx rc;
    rc.nodes = &ex;
    rc.pool = serial ? nullptr : &pool_;
    rc.solo_ok = solo_ok.data();
    rc.test_delay_us = test_worker_delay_us_;
    if (serial) {
      run_graph(&rc, 0, 1);
    } else {
      pool_.run(run_graph, &rc);
    }
  }

  const auto t_ran = std::chrono::steady_clock::now();
  if (cc.io_errors.load() != io_errors0) {
    std::string path;
    {
      std::lock_guard<std::mutex> elk(cc.err_mu);
      path = cc.last_path;
    }
    throw BackendErr("IO", "reading weight rows from the model file " + (path.empty() ? std::string("(unknown)") : path) +
                               " failed: " + std::strerror(cc.last_errno.load()));
  }
  rows_read.assign(nn, 0.0);
  for (size_t ni = 0; ni < nn; ni++) {
    int64_t s = 0;
    for (int th = 0; th < nth; th++) s += counters[ni * static_cast<size_t>(nth) + static_cast<size_t>(th)];
    rows_read[ni] = static_cast<double>(s);
  }
  for (size_t i = 0; i < nt; i++) {
    const TInfo& t = ts[i];
    if (t.out >= 0) std::memcpy(g.outputs[static_cast<size_t>(t.out)].data, t.data, static_cast<size_t>(t.nel) * 4);
  }
  if (g_profile) {
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t_start).count();
    std::lock_guard<std::mutex> plk(g_profile_mu);
    g_profile->compute_ns += ns;
    g_profile->prep_ns += std::chrono::duration<double, std::nano>(t_run - t_start).count();
    if (g_profile->prep_us.size() < (1u << 20))
      g_profile->prep_us.push_back(static_cast<float>(std::chrono::duration<double, std::micro>(t_run - t_start).count()));
    g_profile->run_ns += std::chrono::duration<double, std::nano>(t_ran - t_run).count();
    g_profile->computes++;
  }
}

}  // namespace pi
