#include "graph.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "ops.h"

namespace pi {
namespace {

const char* const kOpNames[OP_COUNT] = {"?",       "get_rows", "mul_mat", "rms_norm", "norm",  "rope",
                                        "softmax", "attention", "add",    "mul",      "scale", "silu",
                                        "relu",    "gelu",      "cpy",    "slice",    "mul_mat_sparse",
                                        "axpy_sparse", "sigmoid",  "top_k",     "mul_mat_id", "moe_sum",
                                        "mul_mat_id_sparse", "axpy_id_sparse", "reshape", "attention_swa"};

struct TInfo {
  int kind = 0;
  int dtype = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  int64_t nel = 0;
  int ref = -1;
  int out = -1;
  int produced_by = -1;  // node index (intermediates)
  int last_use = -1;     // node index of the last reader
  TensorPtr handle;
  size_t arena_off = 0;
  uint8_t* data = nullptr;
};

[[noreturn]] void bad(const std::string& msg) { throw BackendErr("BAD_GRAPH", msg); }

std::string shape_str(const int64_t ne[4]) {
  return "[" + std::to_string(ne[0]) + ", " + std::to_string(ne[1]) + ", " + std::to_string(ne[2]) + ", " +
         std::to_string(ne[3]) + "]";
}

bool same_shape(const int64_t a[4], const int64_t b[4]) {
  return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/// Number of sources (required, optional) and params per op.
struct OpSig {
  int required;
  int optional;
  int params;
};

OpSig op_sig(int op) {
  switch (op) {
    case OP_GET_ROWS: return {2, 0, 0};
    case OP_MUL_MAT: return {2, 0, 0};
    case OP_RMS_NORM: return {1, 0, 1};
    case OP_NORM: return {1, 0, 1};
    case OP_ROPE: return {2, 0, 5};
    case OP_SOFTMAX: return {1, 0, 1};
    case OP_ATTENTION: return {3, 0, 5};
    case OP_ADD: return {2, 0, 0};
    case OP_MUL: return {2, 0, 0};
    case OP_SCALE: return {1, 0, 1};
    case OP_SILU: return {1, 0, 0};
    case OP_RELU: return {1, 0, 0};
    case OP_GELU: return {1, 0, 0};
    case OP_CPY: return {1, 0, 1};
    case OP_SLICE: return {1, 0, 2};
    case OP_MUL_MAT_SPARSE: return {2, 2, 2};
    case OP_AXPY_SPARSE: return {2, 2, 2};
    case OP_SIGMOID: return {1, 0, 0};
    case OP_TOP_K: return {1, 0, 1};
    case OP_MUL_MAT_ID: return {3, 0, 0};
    case OP_MOE_SUM: return {3, 0, 2};
    case OP_MUL_MAT_ID_SPARSE: return {3, 1, 1};
    case OP_AXPY_ID_SPARSE: return {3, 1, 1};
    case OP_RESHAPE: return {1, 0, 0};
    case OP_ATTENTION_SWA: return {3, 0, 6};
    default: return {-1, 0, 0};
  }
}

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

struct RunCtx {
  std::vector<NodeExec>* nodes;
  ThreadPool* pool;  // null when the whole graph runs on the calling thread
};

/// Every thread runs every node; a small node (NodeExec::pool == null) runs on thread 0 alone, and a
/// run of consecutive small nodes needs no barrier between its nodes (one thread, program order),
/// only one before the next node that all threads share.
void run_graph(void* ctx, int ith, int nth) {
  RunCtx* rc = static_cast<RunCtx*>(ctx);
  const std::vector<NodeExec>& nodes = *rc->nodes;
  for (size_t i = 0; i < nodes.size(); i++) {
    const NodeExec& n = nodes[i];
    if (!rc->pool) {
      exec_node(n, 0, 1);
      continue;
    }
    if (!n.pool) {
      if (ith == 0) exec_node(n, 0, 1);
      if (i + 1 < nodes.size() && nodes[i + 1].pool) rc->pool->barrier();
      continue;
    }
    exec_node(n, ith, nth);
    rc->pool->barrier();
  }
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

int64_t checked_int_param(double v, const char* what, int node, int64_t min, int64_t max) {
  if (!std::isfinite(v) || v != std::floor(v) || v < static_cast<double>(min) || v > static_cast<double>(max)) {
    bad("node " + std::to_string(node) + ": " + what + " " + std::to_string(v) + " is not an integer in " +
        std::to_string(min) + ".." + std::to_string(max));
  }
  return static_cast<int64_t>(v);
}

}  // namespace

const char* op_name(int op) { return op > 0 && op < OP_COUNT ? kOpNames[op] : "?"; }

bool supports_op(int op, const int* dtypes, int n_dtypes) {
  const int d0 = n_dtypes > 0 ? dtypes[0] : DT_F32;
  switch (op) {
    case OP_GET_ROWS:
    case OP_MUL_MAT:
    case OP_MUL_MAT_SPARSE:
    case OP_AXPY_SPARSE:
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE:
    case OP_AXPY_ID_SPARSE: return is_weight_dtype(d0);
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: return d0 == DT_F32 || d0 == DT_F16;
    case OP_CPY: return d0 == DT_F32 || d0 == DT_F16 || d0 == DT_BF16;
    case OP_RMS_NORM:
    case OP_NORM:
    case OP_ROPE:
    case OP_SOFTMAX:
    case OP_ADD:
    case OP_MUL:
    case OP_SCALE:
    case OP_SILU:
    case OP_RELU:
    case OP_GELU:
    case OP_SIGMOID:
    case OP_TOP_K:
    case OP_MOE_SUM:
    case OP_RESHAPE:
    case OP_SLICE: return d0 == DT_F32;
    default: return false;
  }
}

void Executor::ArenaFree::operator()(uint8_t* p) const { std::free(p); }

Executor::Executor(TensorStore& store, int threads, bool force_scalar)
    : store_(store), pool_(threads), kernels_(&select_kernels(force_scalar, &reason_)),
      serial_work_bytes_(serial_work_default()) {}

void Executor::compute(const EncodedGraph& g, std::vector<double>& rows_read) {
  // ---- parse and validate tensors ----
  if (g.tensor_words % TENSOR_STRIDE != 0) bad("tensors array length is not a multiple of 8");
  if (g.node_words % NODE_STRIDE != 0) bad("nodes array length is not a multiple of 10");
  const size_t nt = g.tensor_words / TENSOR_STRIDE;
  const size_t nn = g.node_words / NODE_STRIDE;
  if (nt > (1u << 24) || nn > (1u << 24)) bad("graph too large");
  std::vector<TInfo> ts(nt);
  std::vector<int> output_used(g.outputs.size(), -1);
  for (size_t i = 0; i < nt; i++) {
    const int32_t* w = g.tensors + i * TENSOR_STRIDE;
    TInfo& t = ts[i];
    const std::string name = "tensor " + std::to_string(i);
    t.kind = w[0];
    t.dtype = w[1];
    t.nel = 1;
    for (int d = 0; d < 4; d++) {
      t.ne[d] = w[2 + d];
      if (t.ne[d] < 1) bad(name + ": bad dimension " + std::to_string(t.ne[d]));
      t.nel *= t.ne[d];
      if (t.nel > (int64_t{1} << 40)) bad(name + ": too many elements");
    }
    t.ref = w[6];
    t.out = w[7];
    if (t.kind < 0 || t.kind > 2) bad(name + ": unknown kind " + std::to_string(t.kind));
    if (t.kind == 0) {
      // i32 intermediates hold expert ids (top_k); each op checks the dtypes of its sources
      if (t.dtype != DT_F32 && t.dtype != DT_I32) bad(name + ": intermediate tensors must be f32 or i32");
    } else if (t.kind == 1) {
      if (t.dtype != DT_F32 && t.dtype != DT_I32) bad(name + ": inputs must be f32 or i32");
      if (t.ref < 0 || static_cast<size_t>(t.ref) >= g.inputs.size()) {
        bad(name + ": input index " + std::to_string(t.ref) + " out of range (" + std::to_string(g.inputs.size()) +
            " inputs)");
      }
      const HostBuffer& hb = g.inputs[static_cast<size_t>(t.ref)];
      if (hb.bytes != static_cast<size_t>(t.nel) * 4) {
        bad(name + ": input " + std::to_string(t.ref) + " has " + std::to_string(hb.bytes) + " bytes, shape " +
            shape_str(t.ne) + " needs " + std::to_string(t.nel * 4));
      }
      if (reinterpret_cast<uintptr_t>(hb.data) % 4 != 0) bad(name + ": input data is not 4-byte aligned");
      t.data = const_cast<uint8_t*>(static_cast<const uint8_t*>(hb.data));
    } else {
      t.handle = store_.find(t.ref);
      if (!t.handle) bad(name + ": handle " + std::to_string(t.ref) + " does not exist (freed or never created)");
      if (t.handle->dtype != t.dtype) {
        bad(name + ": dtype code " + std::to_string(t.dtype) + " differs from handle's " + dtype_name(t.handle->dtype));
      }
      if (!same_shape(t.handle->ne, t.ne)) {
        bad(name + ": shape " + shape_str(t.ne) + " differs from handle's " + shape_str(t.handle->ne));
      }
      t.data = t.handle->data;
    }
    if (t.out != -1) {
      if (t.out < 0 || static_cast<size_t>(t.out) >= g.outputs.size()) {
        bad(name + ": output index " + std::to_string(t.out) + " out of range");
      }
      if (t.dtype != DT_F32) bad(name + ": only f32 tensors can be outputs");
      if (g.outputs[static_cast<size_t>(t.out)].bytes != static_cast<size_t>(t.nel) * 4) {
        bad(name + ": output array has " + std::to_string(g.outputs[static_cast<size_t>(t.out)].bytes) +
            " bytes, tensor needs " + std::to_string(t.nel * 4));
      }
      if (output_used[static_cast<size_t>(t.out)] != -1) bad(name + ": output index used twice");
      output_used[static_cast<size_t>(t.out)] = static_cast<int>(i);
    }
  }

  // ---- parse and validate nodes ----
  std::vector<NodeExec> ex(nn);
  std::vector<int> dst_of(nn);
  std::vector<int> src_of(nn * MAX_SRC, -1);
  for (size_t ni = 0; ni < nn; ni++) {
    const int32_t* w = g.nodes + ni * NODE_STRIDE;
    const int node = static_cast<int>(ni);
    const int op = w[0];
    const OpSig sig = op_sig(op);
    const std::string where = "node " + std::to_string(ni) + " (" + op_name(op) + ")";
    if (sig.required < 0) bad("node " + std::to_string(ni) + ": unknown op code " + std::to_string(op));
    const int32_t poff = w[7], pcnt = w[8];
    if (pcnt != sig.params) {
      bad(where + ": expects " + std::to_string(sig.params) + " params, got " + std::to_string(pcnt));
    }
    if (poff < 0 || static_cast<size_t>(poff) + static_cast<size_t>(pcnt) > g.n_params) {
      bad(where + ": params out of range");
    }
    NodeExec& n = ex[ni];
    n.op = op;
    n.p = g.params + poff;
    n.np = pcnt;
    for (int k = 0; k < pcnt; k++) {
      if (!std::isfinite(n.p[k])) bad(where + ": param " + std::to_string(k) + " is not finite");
    }
    // sources
    for (int s = 0; s < MAX_SRC; s++) {
      const int id = w[2 + s];
      if (id == -1) {
        if (s < sig.required) bad(where + ": missing source " + std::to_string(s));
        continue;
      }
      if (s >= sig.required + sig.optional) bad(where + ": unexpected source " + std::to_string(s));
      if (id < 0 || static_cast<size_t>(id) >= nt) bad(where + ": source tensor " + std::to_string(id) + " out of range");
      TInfo& st = ts[static_cast<size_t>(id)];
      if (st.kind == 0 && (st.produced_by < 0 || st.produced_by >= node)) {
        bad(where + ": source tensor " + std::to_string(id) + " is used before a node computes it");
      }
      st.last_use = node;
      n.has[s] = true;
      src_of[ni * MAX_SRC + s] = id;
      n.src[s].dtype = st.dtype;
      for (int d = 0; d < 4; d++) n.src[s].ne[d] = st.ne[d];
      n.src[s].nel = st.nel;
      n.src[s].cache = st.handle ? st.handle->cache.get() : nullptr;  // scratch sizes depend on it
      if (n.src[s].cache) {
        n.src[s].cache_part = st.handle->cache_part;
        n.src[s].cache_counts = st.handle->cache_counts;
      }
    }
    // destination
    const int dst = w[1];
    if (dst < 0 || static_cast<size_t>(dst) >= nt) bad(where + ": destination tensor " + std::to_string(dst) + " out of range");
    TInfo& dt = ts[static_cast<size_t>(dst)];
    if (op == OP_CPY) {
      if (dt.kind != 2) bad(where + ": destination must be a backend tensor (handle)");
      if (dt.dtype != DT_F32 && dt.dtype != DT_F16 && dt.dtype != DT_BF16) {
        bad(where + ": destination dtype " + dtype_name(dt.dtype) + " not supported (f32, f16, bf16)");
      }
      if (dt.handle->mapped) bad(where + ": destination is a read-only mapped tensor");
      dt.last_use = node;
    } else {
      if (dt.kind != 0) bad(where + ": destination must be an intermediate tensor");
      if (dt.produced_by != -1) bad(where + ": destination tensor " + std::to_string(dst) + " is computed twice");
      dt.produced_by = node;
      if (dt.last_use < node) dt.last_use = node;
    }
    if (op != OP_CPY && dt.dtype != (op == OP_TOP_K ? DT_I32 : DT_F32)) {
      bad(where + ": destination must be " + (op == OP_TOP_K ? "i32" : "f32"));
    }
    dst_of[ni] = dst;
    n.dst.dtype = dt.dtype;
    for (int d = 0; d < 4; d++) n.dst.ne[d] = dt.ne[d];
    n.dst.nel = dt.nel;

    // per-op dtype and shape checks
    const TensorView* S = n.src;
    auto need_f32 = [&](int s) {
      if (n.has[s] && S[s].dtype != DT_F32) bad(where + ": source " + std::to_string(s) + " must be f32");
    };
    auto need_i32 = [&](int s) {
      if (n.has[s] && S[s].dtype != DT_I32) bad(where + ": source " + std::to_string(s) + " must be i32");
    };
    auto need_dst = [&](int64_t a, int64_t b) {
      const int64_t e[4] = {a, b, 1, 1};
      if (!same_shape(n.dst.ne, e)) bad(where + ": destination shape " + shape_str(n.dst.ne) + ", expected " + shape_str(e));
    };
    auto need_dst_like = [&](int s) {
      if (!same_shape(n.dst.ne, S[s].ne)) {
        bad(where + ": destination shape " + shape_str(n.dst.ne) + " differs from source shape " + shape_str(S[s].ne));
      }
    };
    auto need_2d = [&](int s) {
      if (S[s].ne[2] != 1 || S[s].ne[3] != 1) bad(where + ": source " + std::to_string(s) + " must be 2-D");
    };
    auto need_weight = [&](int s) {
      if (!is_weight_dtype(S[s].dtype)) {
        bad(where + ": weight dtype code " + std::to_string(S[s].dtype) + " (" + dtype_name(S[s].dtype) + ") not supported");
      }
      if (S[s].ne[0] % dtype_layout(S[s].dtype).block != 0) {
        bad(where + ": row length " + std::to_string(S[s].ne[0]) + " is not a multiple of the " +
            dtype_name(S[s].dtype) + " block size");
      }
    };
    switch (op) {
      case OP_GET_ROWS:
        need_weight(0);
        need_i32(1);
        need_dst(S[0].ne[0], S[1].nel);
        break;
      case OP_MUL_MAT:
        need_weight(0);
        need_f32(1);
        need_2d(0);
        need_2d(1);
        if (S[0].ne[0] != S[1].ne[0]) bad(where + ": W row length " + std::to_string(S[0].ne[0]) + " != x length " + std::to_string(S[1].ne[0]));
        need_dst(S[0].ne[1], S[1].ne[1]);
        break;
      case OP_RMS_NORM:
      case OP_NORM:
      case OP_SOFTMAX:
      case OP_SCALE:
      case OP_SILU:
      case OP_RELU:
      case OP_GELU:
      case OP_SIGMOID:
        need_f32(0);
        need_dst_like(0);
        break;
      case OP_RESHAPE:
        need_f32(0);
        if (n.dst.nel != S[0].nel) bad(where + ": destination has " + std::to_string(n.dst.nel) + " elements, source " + std::to_string(S[0].nel));
        break;
      case OP_TOP_K: {
        need_f32(0);
        need_2d(0);
        const int64_t k = checked_int_param(n.p[0], "k", node, 1, S[0].ne[0]);
        need_dst(k, S[0].ne[1]);
        break;
      }
      case OP_MUL_MAT_ID:
      case OP_MUL_MAT_ID_SPARSE:
      case OP_AXPY_ID_SPARSE: {
        need_weight(0);
        need_f32(1);
        need_i32(2);
        need_f32(3);
        if (S[0].ne[3] != 1) bad(where + ": stacked experts must be 3-D [K, M, n_expert]");
        need_2d(2);
        const int64_t U = S[2].ne[0], T = S[2].ne[1], M = S[0].ne[1];
        const int64_t xcols = S[1].rows();
        if (op == OP_AXPY_ID_SPARSE) {
          const int64_t e[4] = {M, U, T, 1};
          if (!same_shape(S[1].ne, e)) bad(where + ": activations shape " + shape_str(S[1].ne) + ", expected " + shape_str(e));
        } else {
          if (S[0].ne[0] != S[1].ne[0]) bad(where + ": W row length " + std::to_string(S[0].ne[0]) + " != x length " + std::to_string(S[1].ne[0]));
          if (xcols != T && xcols != U * T) {
            bad(where + ": x has " + std::to_string(xcols) + " columns, expected " + std::to_string(T) + " or " + std::to_string(U * T));
          }
        }
        const int64_t e[4] = {op == OP_AXPY_ID_SPARSE ? S[0].ne[0] : M, U, T, 1};
        if (!same_shape(n.dst.ne, e)) bad(where + ": destination shape " + shape_str(n.dst.ne) + ", expected " + shape_str(e));
        if (n.has[3] && (S[3].ne[0] != M || S[3].nel != M * U * T)) {
          bad(where + ": logits shape " + shape_str(S[3].ne) + ", expected [" + std::to_string(M) + ", " + std::to_string(U) + ", " + std::to_string(T) + "]");
        }
        break;
      }
      case OP_MOE_SUM: {
        need_f32(0);
        need_f32(1);
        need_i32(2);
        need_2d(1);
        need_2d(2);
        const int64_t U = S[2].ne[0], T = S[2].ne[1];
        const int64_t e[4] = {S[0].ne[0], U, T, 1};
        if (!same_shape(S[0].ne, e)) bad(where + ": y shape " + shape_str(S[0].ne) + ", expected " + shape_str(e));
        if (S[1].ne[1] != T) bad(where + ": probs must have " + std::to_string(T) + " columns");
        need_dst(S[0].ne[0], T);
        if (n.p[0] != 0 && n.p[0] != 1) bad(where + ": norm must be 0 or 1");
        break;
      }
      case OP_ROPE: {
        need_f32(0);
        need_i32(1);
        need_2d(0);
        need_dst_like(0);
        const int64_t hd = checked_int_param(n.p[4], "head_dim", node, 1, S[0].ne[0]);
        const int64_t nd = checked_int_param(n.p[0], "n_dims", node, 2, hd);
        const int64_t mode = checked_int_param(n.p[1], "mode", node, 0, 2);
        if (S[0].ne[0] % hd != 0) bad(where + ": row length " + std::to_string(S[0].ne[0]) + " not a multiple of head_dim");
        if (nd % 2 != 0) bad(where + ": n_dims must be even");
        if (mode != 0 && mode != 2) bad(where + ": mode must be 0 (normal) or 2 (NeoX)");
        if (S[1].nel != S[0].ne[1]) bad(where + ": positions must have one entry per token");
        if (!(n.p[2] > 0)) bad(where + ": freq_base must be positive");
        break;
      }
      case OP_ATTENTION:
      case OP_ATTENTION_SWA: {
        if (op == OP_ATTENTION_SWA) checked_int_param(n.p[5], "window", node, 1, int64_t{1} << 40);
        need_f32(0);
        need_2d(0);
        need_2d(1);
        need_2d(2);
        need_dst_like(0);
        if (S[1].dtype != DT_F32 && S[1].dtype != DT_F16) bad(where + ": k cache must be f32 or f16");
        if (S[2].dtype != DT_F32 && S[2].dtype != DT_F16) bad(where + ": v cache must be f32 or f16");
        if (!same_shape(S[1].ne, S[2].ne)) bad(where + ": k and v caches differ in shape");
        const int64_t hd = checked_int_param(n.p[3], "head_dim", node, 1, S[0].ne[0]);
        const int64_t nh = checked_int_param(n.p[4], "n_head", node, 1, S[0].ne[0]);
        const int64_t nkv = checked_int_param(n.p[1], "n_head_kv", node, 1, nh);
        const int64_t np = checked_int_param(n.p[0], "n_past", node, 0, S[1].ne[1]);
        if (hd * nh != S[0].ne[0]) bad(where + ": q row " + std::to_string(S[0].ne[0]) + " != head_dim·n_head");
        if (hd * nkv != S[1].ne[0]) bad(where + ": cache row " + std::to_string(S[1].ne[0]) + " != head_dim·n_head_kv");
        if (nh % nkv != 0) bad(where + ": n_head must be a multiple of n_head_kv");
        if (np + S[0].ne[1] > S[1].ne[1]) {
          bad(where + ": " + std::to_string(np + S[0].ne[1]) + " positions exceed the cache size " + std::to_string(S[1].ne[1]));
        }
        break;
      }
      case OP_ADD:
      case OP_MUL:
        need_f32(0);
        need_f32(1);
        need_dst_like(0);
        if (S[1].nel != S[0].nel && S[1].nel != S[0].ne[0]) {
          bad(where + ": shapes " + shape_str(S[0].ne) + " and " + shape_str(S[1].ne) + " do not broadcast");
        }
        break;
      case OP_CPY: {
        need_f32(0);
        need_2d(0);
        if (dt.ne[2] != 1 || dt.ne[3] != 1) bad(where + ": destination must be 2-D");
        if (S[0].ne[0] != dt.ne[0]) bad(where + ": row length " + std::to_string(S[0].ne[0]) + " != destination row length " + std::to_string(dt.ne[0]));
        const int64_t off = checked_int_param(n.p[0], "row_offset", node, 0, dt.ne[1]);
        if (off + S[0].ne[1] > dt.ne[1]) bad(where + ": rows " + std::to_string(off) + ".." + std::to_string(off + S[0].ne[1]) + " exceed " + std::to_string(dt.ne[1]));
        break;
      }
      case OP_SLICE: {
        need_f32(0);
        need_2d(0);
        const int64_t off = checked_int_param(n.p[0], "offset", node, 0, S[0].ne[0]);
        const int64_t len = checked_int_param(n.p[1], "length", node, 1, S[0].ne[0]);
        if (off + len > S[0].ne[0]) bad(where + ": " + std::to_string(off) + "+" + std::to_string(len) + " exceeds " + std::to_string(S[0].ne[0]));
        need_dst(len, S[0].ne[1]);
        break;
      }
      case OP_MUL_MAT_SPARSE:
      case OP_AXPY_SPARSE: {
        need_weight(0);
        need_f32(1);
        need_f32(2);
        need_i32(3);
        need_2d(0);
        need_2d(1);
        const int64_t M = S[0].ne[1], T = S[1].ne[1];
        const int64_t n_out = checked_int_param(n.p[1], "n_out", node, 1, int64_t{1} << 31);
        if (op == OP_MUL_MAT_SPARSE) {
          if (S[0].ne[0] != S[1].ne[0]) bad(where + ": W row length " + std::to_string(S[0].ne[0]) + " != x length " + std::to_string(S[1].ne[0]));
          need_dst(n_out, T);
        } else {
          if (S[1].ne[0] != n_out) bad(where + ": activations length " + std::to_string(S[1].ne[0]) + " != n_out " + std::to_string(n_out));
          need_dst(S[0].ne[0], T);
        }
        if (n.has[2] && (S[2].ne[0] != n_out || S[2].nel != n_out * T)) {
          bad(where + ": logits shape " + shape_str(S[2].ne) + ", expected [" + std::to_string(n_out) + ", " + std::to_string(T) + "]");
        }
        if (!n.has[3] && M < n_out) bad(where + ": W has " + std::to_string(M) + " rows, fewer than n_out " + std::to_string(n_out));
        break;
      }
      default: break;
    }
  }

  // ---- values of i32 sources (indices must be in range before any kernel runs) ----
  for (size_t ni = 0; ni < nn; ni++) {
    const NodeExec& n = ex[ni];
    const std::string where = "node " + std::to_string(ni) + " (" + op_name(n.op) + ")";
    auto values = [&](int s) {
      const TInfo& st = ts[static_cast<size_t>(src_of[ni * MAX_SRC + s])];
      // an i32 intermediate (a top_k output) has no values before the run: only expert ids may be one
      if (st.kind == 0) bad(where + ": source " + std::to_string(s) + " must be an input or a backend tensor");
      return reinterpret_cast<const int32_t*>(st.data);
    };
    if (n.op == OP_GET_ROWS) {
      const int32_t* ids = values(1);
      const int64_t R = n.src[0].rows();
      for (int64_t t = 0; t < n.src[1].nel; t++) {
        if (ids[t] < 0 || ids[t] >= R) bad(where + ": row id " + std::to_string(ids[t]) + " out of range 0.." + std::to_string(R - 1));
      }
    } else if (n.op == OP_MUL_MAT_ID || n.op == OP_MUL_MAT_ID_SPARSE || n.op == OP_AXPY_ID_SPARSE || n.op == OP_MOE_SUM) {
      // expert ids: an input's values are checked here; a top_k output is in range when its row count is
      const int64_t E = n.op == OP_MOE_SUM ? n.src[1].ne[0] : n.src[0].ne[2];
      const TInfo& it = ts[static_cast<size_t>(src_of[ni * MAX_SRC + 2])];
      if (it.kind == 0) {
        const NodeExec& prod = ex[static_cast<size_t>(it.produced_by)];
        if (prod.op != OP_TOP_K) bad(where + ": expert ids must be an input or the output of top_k");
        if (prod.src[0].ne[0] > E) {
          bad(where + ": ids come from top_k over " + std::to_string(prod.src[0].ne[0]) + " values, but there are " + std::to_string(E) + " experts");
        }
      } else {
        const int32_t* ids = values(2);
        for (int64_t j = 0; j < n.src[2].nel; j++) {
          if (ids[j] < 0 || ids[j] >= E) {
            bad(where + ": expert id " + std::to_string(ids[j]) + " at " + std::to_string(j) + " out of range 0.." + std::to_string(E - 1));
          }
        }
      }
    } else if ((n.op == OP_MUL_MAT_SPARSE || n.op == OP_AXPY_SPARSE) && n.has[3]) {
      const int32_t* rows = values(3);
      const int64_t n_out = static_cast<int64_t>(n.p[1]);
      const int64_t M = n.src[0].ne[1];
      const bool compact = M == n.src[3].nel;
      for (int64_t j = 0; j < n.src[3].nel; j++) {
        if (rows[j] < 0 || rows[j] >= n_out || (!compact && rows[j] >= M)) {
          bad(where + ": rows[" + std::to_string(j) + "] = " + std::to_string(rows[j]) + " out of range (n_out " +
              std::to_string(n_out) + ", W rows " + std::to_string(M) + ")");
        }
      }
    }
  }

  // file-backed weights (neuron caches) are read only by the sparse ops, as their weight
  for (size_t ni = 0; ni < nn; ni++) {
    for (int s = 0; s < MAX_SRC; s++) {
      const int ti = src_of[ni * MAX_SRC + s];
      if (ti < 0) continue;
      const TInfo& st = ts[static_cast<size_t>(ti)];
      if (!st.handle || !st.handle->cache) continue;
      const int op = ex[ni].op;
      if (s != 0 || (op != OP_MUL_MAT_SPARSE && op != OP_AXPY_SPARSE)) {
        bad("node " + std::to_string(ni) + " (" + op_name(op) + "): tensor " + std::to_string(st.handle->id) +
            " is file-backed (neuron cache) and only mul_mat_sparse/axpy_sparse can read it");
      }
    }
  }

  std::lock_guard<std::mutex> lk(mu_);
  CacheCounters& cc = store_.counters();
  const int64_t io_errors0 = cc.io_errors.load();
  double work = 0;
  std::vector<char> small(nn, 0);
  for (size_t ni = 0; ni < nn; ni++) {
    const double w = node_work(ex[ni]);
    work += w;
    small[ni] = w < serial_work_bytes_ / 8 ? 1 : 0;  // default: nodes under 32 KiB run on one thread
  }
  const bool serial = pool_.size() == 1 || work < serial_work_bytes_;
  const int nth = serial ? 1 : pool_.size();

  // ---- plan the arena: intermediates by lifetime, then the largest node scratch, then counters ----
  std::vector<std::vector<int>> frees(nn);
  for (size_t i = 0; i < nt; i++) {
    TInfo& t = ts[i];
    if (t.kind != 0) continue;
    if (t.out >= 0) t.last_use = static_cast<int>(nn);  // outputs live to the end
    if (t.produced_by < 0 && t.out >= 0) bad("tensor " + std::to_string(i) + ": output is never computed");
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
    uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(64, grow));
    if (!p) throw BackendErr("OUT_OF_MEMORY", "cannot allocate a compute arena of " + std::to_string(grow) + " bytes");
    arena_holder_.reset(p);
    arena_ = p;
    arena_size_ = grow;
  }
  int64_t* counters = reinterpret_cast<int64_t*>(arena_ + counters_off);
  std::memset(counters, 0, counters_bytes);
  std::vector<std::atomic<int64_t>*> chunk_ctr(nn);
  for (size_t ni = 0; ni < nn; ni++) chunk_ctr[ni] = new (arena_ + chunks_off + 64 * ni) std::atomic<int64_t>(0);

  // ---- bind views ----
  for (size_t i = 0; i < nt; i++) {
    if (ts[i].kind == 0) ts[i].data = arena_ + ts[i].arena_off;
  }
  for (size_t ni = 0; ni < nn; ni++) {
    NodeExec& n = ex[ni];
    n.dst.data = ts[static_cast<size_t>(dst_of[ni])].data;
    for (int s = 0; s < MAX_SRC; s++) {
      if (n.has[s]) {
        const TInfo& st = ts[static_cast<size_t>(src_of[ni * MAX_SRC + s])];
        n.src[s].data = st.data;
      }
    }
    n.scratch = arena_ + scratch_off;
    n.scratch_bytes = scratch;
    n.rows_read = counters + ni * static_cast<size_t>(nth);
    n.chunk = chunk_ctr[ni];
    n.k = kernels_;
    n.pool = serial || small[ni] ? nullptr : &pool_;
  }

  // ---- run: one pool job for the whole graph, a barrier after each node ----
  if (nn > 0) {
    RunCtx rc{&ex, serial ? nullptr : &pool_};
    if (serial) {
      run_graph(&rc, 0, 1);
    } else {
      pool_.run(run_graph, &rc);
    }
  }

  if (cc.io_errors.load() != io_errors0) {
    throw BackendErr("IO", std::string("reading weight rows from the model file failed: ") +
                               std::strerror(cc.last_errno.load()));
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
}

}  // namespace pi
