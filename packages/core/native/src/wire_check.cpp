// The one validator of an encoded graph, shared by every native backend (declared in
// include/powerinfer/wire.h). Backend-specific limits (a GPU's grid size, its weight kernels) come in
// through CheckOptions and are reported as UNSUPPORTED_OP; everything else malformed is BAD_GRAPH.
#include <cmath>
#include <utility>

#include "powerinfer/wire.h"

namespace powerinfer {
namespace wire {
namespace {

struct OpInfo {
  const char* name;
  int required;  // sources that must be present
  int optional;  // sources that may follow them
  int params;
};

OpInfo op_info(int op) {
  switch (op) {
    case OP_GET_ROWS: return {"get_rows", 2, 0, 0};
    case OP_MUL_MAT: return {"mul_mat", 2, 1, 0};
    case OP_RMS_NORM: return {"rms_norm", 1, 0, 1};
    case OP_NORM: return {"norm", 1, 0, 1};
    case OP_ROPE: return {"rope", 2, 0, 5};
    case OP_SOFTMAX: return {"softmax", 1, 0, 1};
    case OP_ATTENTION: return {"attention", 3, 0, 5};
    case OP_ADD: return {"add", 2, 0, 0};
    case OP_MUL: return {"mul", 2, 0, 0};
    case OP_SCALE: return {"scale", 1, 0, 1};
    case OP_SILU: return {"silu", 1, 0, 0};
    case OP_RELU: return {"relu", 1, 0, 0};
    case OP_GELU: return {"gelu", 1, 0, 0};
    case OP_CPY: return {"cpy", 1, 0, 1};
    case OP_SLICE: return {"slice", 1, 0, 2};
    case OP_MUL_MAT_SPARSE: return {"mul_mat_sparse", 2, 2, 2};
    case OP_AXPY_SPARSE: return {"axpy_sparse", 2, 2, 2};
    case OP_SIGMOID: return {"sigmoid", 1, 0, 0};
    case OP_TOP_K: return {"top_k", 1, 0, 1};
    case OP_MUL_MAT_ID: return {"mul_mat_id", 3, 0, 0};
    case OP_MOE_SUM: return {"moe_sum", 3, 0, 2};
    case OP_MUL_MAT_ID_SPARSE: return {"mul_mat_id_sparse", 3, 1, 1};
    case OP_AXPY_ID_SPARSE: return {"axpy_id_sparse", 3, 1, 1};
    case OP_RESHAPE: return {"reshape", 1, 0, 0};
    case OP_ATTENTION_SWA: return {"attention_swa", 3, 0, 6};
    case OP_MOE_SCATTER: return {"moe_scatter", 2, 0, 3};
    default: return {nullptr, 0, 0, 0};
  }
}

std::string dims(const int64_t ne[4]) {
  std::string s = "[";
  for (int d = 0; d < 4; d++) s += std::to_string(ne[d]) + (d < 3 ? ", " : "]");
  return s;
}

bool same(const int64_t a[4], const int64_t b[4]) {
  return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/// Checks of one node, with its position in messages.
class NodeCheck {
 public:
  NodeCheck(int index, const OpInfo& info, CheckedGraph& cg, const GNode& n, const CheckOptions& o)
      : index_(index), op_(info.name), cg_(cg), n_(n), o_(o) {}

  [[noreturn]] void bad(const std::string& msg) const { throw BackendErr("BAD_GRAPH", where() + ": " + msg); }
  [[noreturn]] void unsupported(const std::string& msg) const {
    throw BackendErr("UNSUPPORTED_OP", where() + ": " + msg);
  }

  bool has(int s) const { return n_.src[s] >= 0; }
  const GTensor& src(int s) const { return cg_.tensors[static_cast<size_t>(n_.src[s])]; }
  const GTensor& dst() const { return cg_.tensors[static_cast<size_t>(n_.dst)]; }

  void f32(int s) const {
    if (has(s) && src(s).dtype != DT_F32) bad("source " + std::to_string(s) + " must be f32");
  }
  void i32(int s) const {
    if (has(s) && src(s).dtype != DT_I32) bad("source " + std::to_string(s) + " must be i32");
  }
  void flat(int s) const {
    if (has(s) && (src(s).ne[2] != 1 || src(s).ne[3] != 1)) bad("source " + std::to_string(s) + " must be 2-D");
  }
  void columns(int64_t t) const {
    if (t > o_.max_columns) unsupported(std::to_string(t) + " columns; at most " + std::to_string(o_.max_columns));
  }
  void dst_is(int64_t a, int64_t b) const {
    const int64_t e[4] = {a, b, 1, 1};
    if (!same(dst().ne, e)) bad("destination shape " + dims(dst().ne) + ", expected " + dims(e));
  }
  void dst_like(int s) const {
    if (!same(dst().ne, src(s).ne)) bad("destination shape " + dims(dst().ne) + " != source shape " + dims(src(s).ne));
  }
  void weight(int s) const {
    const int dt = src(s).dtype;
    const Layout l = dtype_layout(dt);
    if (l.block == 0 || dt == DT_I32) bad("weight dtype code " + std::to_string(dt) + " is not a weight type");
    if (src(s).ne[0] % l.block != 0) {
      bad("row length " + std::to_string(src(s).ne[0]) + " is not a multiple of the " + dtype_name(dt) + " block");
    }
    if (o_.weight_supported && !o_.weight_supported(dt)) {
      unsupported(std::string("no kernel for ") + dtype_name(dt) + " weights on this backend");
    }
  }
  [[noreturn]] void len(const char* what, int64_t got, int64_t want) const {
    bad(std::string(what) + " length " + std::to_string(got) + " != " + std::to_string(want));
  }
  int64_t int_param(int k, const char* what, int64_t lo, int64_t hi) const {
    const double v = n_.p[k];
    if (v != std::floor(v) || v < static_cast<double>(lo) || v > static_cast<double>(hi)) {
      bad(std::string(what) + " = " + std::to_string(v) + " is not an integer in " + std::to_string(lo) + ".." +
          std::to_string(hi));
    }
    return static_cast<int64_t>(v);
  }

 private:
  // "node N (op)", made only for an error message: a graph is checked before every compute, and building
  // it for every node took 15-20 us of a decode step's ~50 us check on a 4-layer MoE graph (112 nodes)
  std::string where() const { return "node " + std::to_string(index_) + " (" + op_ + ")"; }
  int index_;
  const char* op_;
  CheckedGraph& cg_;
  const GNode& n_;
  const CheckOptions& o_;
};

void check_sparse(const NodeCheck& c, const GNode& n, bool axpy) {
  c.weight(0);
  c.f32(1);
  c.f32(2);
  c.i32(3);
  c.flat(0);
  c.flat(1);
  const int64_t m = c.src(0).ne[1];
  const int64_t t = c.src(1).ne[1];
  c.columns(t);
  const int64_t n_out = c.int_param(1, "n_out", 1, int64_t{1} << 31);
  if (axpy) {
    if (c.src(1).ne[0] != n_out) c.len("activations", c.src(1).ne[0], n_out);
    c.dst_is(c.src(0).ne[0], t);
  } else {
    if (c.src(0).ne[0] != c.src(1).ne[0]) c.len("x", c.src(1).ne[0], c.src(0).ne[0]);
    c.dst_is(n_out, t);
  }
  if (c.has(2) && (c.src(2).ne[0] != n_out || c.src(2).nel != n_out * t)) {
    c.bad("logits shape " + dims(c.src(2).ne) + ", expected [" + std::to_string(n_out) + ", " + std::to_string(t) +
          "]");
  }
  if (!c.has(3)) {
    if (m < n_out) c.bad("W has " + std::to_string(m) + " rows, fewer than n_out " + std::to_string(n_out));
    return;
  }
  const GTensor& rows = c.src(3);
  if (!rows.i32) c.bad("the rows list must be an input or a backend tensor");
  const bool compact = m == rows.nel;
  for (int64_t j = 0; j < rows.nel; j++) {
    const int64_t r = rows.i32[j];
    if (r < 0 || r >= n_out || (!compact && r >= m)) {
      c.bad("rows[" + std::to_string(j) + "] = " + std::to_string(r) + " is out of range (n_out " +
            std::to_string(n_out) + ", W rows " + std::to_string(m) + ")");
    }
  }
  (void)n;
}

/// Checks expert ids (source `s`, i32 [U, T]) against `n_expert`: host values of inputs and backend
/// tensors are checked one by one; a top_k output is in range when top_k chose among ≤ n_expert values.
/// @return {U, T}
std::pair<int64_t, int64_t> check_expert_ids(const NodeCheck& c, int s, int64_t n_expert) {
  c.i32(s);
  c.flat(s);
  const GTensor& ids = c.src(s);
  if (ids.i32) {
    for (int64_t j = 0; j < ids.nel; j++) {
      if (ids.i32[j] < 0 || ids.i32[j] >= n_expert) {
        c.bad("expert id " + std::to_string(ids.i32[j]) + " at " + std::to_string(j) + " out of range 0.." +
              std::to_string(n_expert - 1));
      }
    }
  } else if (ids.kind != KIND_INTERMEDIATE || ids.id_bound < 1) {
    c.bad("expert ids must be an input, a backend tensor or the output of top_k");
  } else if (ids.id_bound > n_expert) {
    c.bad("ids come from top_k over " + std::to_string(ids.id_bound) + " values, but there are " +
          std::to_string(n_expert) + " experts");
  }
  return {ids.ne[0], ids.ne[1]};
}

/// mul_mat_id (sparse: mul_mat_id_sparse): W [K, M, E], x [K, T] or [K, U, T], ids [U, T], logits? → [M, U, T].
void check_mul_mat_id(const NodeCheck& c, bool sparse) {
  c.weight(0);
  c.f32(1);
  if (c.src(0).ne[3] != 1) c.bad("W must be 3-D [K, M, n_expert]");
  const int64_t k = c.src(0).ne[0], m = c.src(0).ne[1];
  const auto [u, t] = check_expert_ids(c, 2, c.src(0).ne[2]);
  c.columns(u * t);
  if (c.src(1).ne[0] != k) c.len("x", c.src(1).ne[0], k);
  const int64_t cols = c.src(1).nel / k;
  if (cols != t && cols != u * t) {
    c.bad("x has " + std::to_string(cols) + " columns; expected " + std::to_string(t) + " or " + std::to_string(u * t));
  }
  const int64_t e[4] = {m, u, t, 1};
  if (!same(c.dst().ne, e)) c.bad("destination shape " + dims(c.dst().ne) + ", expected " + dims(e));
  if (sparse && c.has(3)) {
    c.f32(3);
    if (c.src(3).ne[0] != m || c.src(3).nel != m * u * t) c.bad("logits shape " + dims(c.src(3).ne) + ", expected " + dims(e));
  }
}

/// axpy_id_sparse: Wt [D, M, E], a [M, U, T], ids [U, T], logits? [M, U, T] → [D, U, T].
void check_axpy_id(const NodeCheck& c) {
  c.weight(0);
  c.f32(1);
  if (c.src(0).ne[3] != 1) c.bad("Wt must be 3-D [D, M, n_expert]");
  const int64_t d = c.src(0).ne[0], m = c.src(0).ne[1];
  const auto [u, t] = check_expert_ids(c, 2, c.src(0).ne[2]);
  c.columns(u * t);
  const int64_t a[4] = {m, u, t, 1};
  if (!same(c.src(1).ne, a)) c.bad("a shape " + dims(c.src(1).ne) + ", expected " + dims(a));
  if (c.has(3)) {
    c.f32(3);
    if (c.src(3).ne[0] != m || c.src(3).nel != m * u * t) c.bad("logits shape " + dims(c.src(3).ne) + ", expected " + dims(a));
  }
  const int64_t e[4] = {d, u, t, 1};
  if (!same(c.dst().ne, e)) c.bad("destination shape " + dims(c.dst().ne) + ", expected " + dims(e));
}

}  // namespace

const char* op_name(int op) {
  const OpInfo i = op_info(op);
  return i.name ? i.name : "unknown op";
}

CheckedGraph check_graph(const WireGraph& g, const HandleFinder& find, const CheckOptions& options) {
  auto bad = [](const std::string& m) -> void { throw BackendErr("BAD_GRAPH", m); };
  if (g.tensor_words % kTensorWords != 0) bad("tensors array length is not a multiple of 8");
  if (g.node_words % kNodeWords != 0) bad("nodes array length is not a multiple of 10");
  const size_t nt = g.tensor_words / kTensorWords;
  const size_t nn = g.node_words / kNodeWords;
  if (nt > (size_t{1} << 24) || nn > (size_t{1} << 24)) bad("graph too large");
  CheckedGraph cg;
  cg.tensors.resize(nt);
  std::vector<bool> output_taken(g.outputs.size(), false);

  for (size_t i = 0; i < nt; i++) {
    const int32_t* w = g.tensors + i * kTensorWords;
    GTensor& t = cg.tensors[i];
    // the tensor's name in a message (made only then)
    const auto name = [i] { return "tensor " + std::to_string(i); };
    t.kind = w[0];
    t.dtype = w[1];
    for (int d = 0; d < 4; d++) {
      t.ne[d] = w[2 + d];
      if (t.ne[d] < 1) bad(name() + ": dimension " + std::to_string(t.ne[d]) + " < 1");
      t.nel *= t.ne[d];
      if (t.nel > (int64_t{1} << 40)) bad(name() + ": too many elements");
    }
    t.ref = w[6];
    t.out = w[7];
    switch (t.kind) {
      case KIND_INTERMEDIATE:
        if (t.dtype != DT_F32 && t.dtype != DT_I32) bad(name() + ": intermediates are f32 (top_k's i32)");
        break;
      case KIND_INPUT: {
        if (t.dtype != DT_F32 && t.dtype != DT_I32) bad(name() + ": inputs are f32 or i32");
        if (t.ref < 0 || static_cast<size_t>(t.ref) >= g.inputs.size()) {
          bad(name() + ": input index " + std::to_string(t.ref) + " out of range (" + std::to_string(g.inputs.size()) +
              " inputs)");
        }
        const WireGraph::In& in = g.inputs[static_cast<size_t>(t.ref)];
        if (in.bytes != static_cast<size_t>(t.nel) * 4) {
          bad(name() + ": input " + std::to_string(t.ref) + " has " + std::to_string(in.bytes) + " bytes, " +
              dims(t.ne) + " needs " + std::to_string(t.nel * 4));
        }
        if (reinterpret_cast<uintptr_t>(in.data) % 4 != 0) bad(name() + ": input data is not 4-byte aligned");
        if (t.dtype == DT_I32) t.i32 = static_cast<const int32_t*>(in.data);
        break;
      }
      case KIND_HANDLE: {
        HandleInfo h;
        if (!find(t.ref, &h)) bad(name() + ": backend tensor " + std::to_string(t.ref) + " does not exist (freed?)");
        if (h.dtype != t.dtype) {
          bad(name() + ": dtype " + dtype_name(t.dtype) + " differs from the backend tensor's " + dtype_name(h.dtype));
        }
        if (!same(h.ne, t.ne)) bad(name() + ": shape " + dims(t.ne) + " differs from the backend tensor's " + dims(h.ne));
        t.i32 = h.i32;
        break;
      }
      default: bad(name() + ": unknown kind " + std::to_string(t.kind));
    }
    if (t.out != -1) {
      if (t.out < 0 || static_cast<size_t>(t.out) >= g.outputs.size()) bad(name() + ": output index " + std::to_string(t.out) + " out of range");
      if (t.dtype != DT_F32) bad(name() + ": only f32 tensors can be outputs");
      if (g.outputs[static_cast<size_t>(t.out)].bytes != static_cast<size_t>(t.nel) * 4) {
        bad(name() + ": output array has " + std::to_string(g.outputs[static_cast<size_t>(t.out)].bytes) +
            " bytes, the tensor " + std::to_string(t.nel * 4));
      }
      if (output_taken[static_cast<size_t>(t.out)]) bad(name() + ": output " + std::to_string(t.out) + " used twice");
      output_taken[static_cast<size_t>(t.out)] = true;
    }
  }

  cg.nodes.resize(nn);
  for (size_t ni = 0; ni < nn; ni++) {
    const int32_t* w = g.nodes + ni * kNodeWords;
    GNode& n = cg.nodes[ni];
    const int node = static_cast<int>(ni);
    n.op = w[0];
    const OpInfo info = op_info(n.op);
    if (!info.name) bad("node " + std::to_string(ni) + ": unknown op code " + std::to_string(n.op));
    NodeCheck c(node, info, cg, n, options);
    const int32_t poff = w[7], pcnt = w[8];
    if (pcnt != info.params) c.bad("expects " + std::to_string(info.params) + " params, got " + std::to_string(pcnt));
    if (poff < 0 || static_cast<size_t>(poff) + static_cast<size_t>(pcnt) > g.n_params) c.bad("params out of range");
    n.p = g.params + poff;
    n.np = pcnt;
    for (int k = 0; k < pcnt; k++)
      if (!std::isfinite(n.p[k])) c.bad("param " + std::to_string(k) + " is not finite");
    for (int s = 0; s < kMaxSrc; s++) {
      const int id = w[2 + s];
      if (id == -1) {
        if (s < info.required) c.bad("source " + std::to_string(s) + " missing");
        continue;
      }
      if (s >= info.required + info.optional) c.bad("unexpected source " + std::to_string(s));
      if (id < 0 || static_cast<size_t>(id) >= nt) c.bad("source tensor " + std::to_string(id) + " out of range");
      GTensor& st = cg.tensors[static_cast<size_t>(id)];
      if (st.kind == KIND_INTERMEDIATE && (st.producer < 0 || st.producer >= node)) {
        c.bad("source tensor " + std::to_string(id) + " is read before a node computes it");
      }
      st.last_use = node;
      n.src[s] = id;
    }
    n.dst = w[1];
    if (n.dst < 0 || static_cast<size_t>(n.dst) >= nt) c.bad("destination tensor " + std::to_string(n.dst) + " out of range");
    GTensor& dt = cg.tensors[static_cast<size_t>(n.dst)];
    if (n.op == OP_CPY) {
      if (dt.kind != KIND_HANDLE) c.bad("the destination must be a backend tensor");
      HandleInfo h;
      find(dt.ref, &h);
      if (h.read_only) c.bad("the destination is read-only");
      if (dt.dtype != DT_F32 && dt.dtype != DT_F16 && dt.dtype != DT_BF16) {
        c.unsupported(std::string("destination dtype ") + dtype_name(dt.dtype) + " (f32, f16, bf16 only)");
      }
    } else {
      if (dt.kind != KIND_INTERMEDIATE) c.bad("the destination must be an intermediate tensor");
      if (dt.producer != -1) c.bad("destination tensor " + std::to_string(n.dst) + " is computed twice");
      if (dt.dtype != (n.op == OP_TOP_K ? DT_I32 : DT_F32)) {
        c.bad(std::string("the destination must be ") + (n.op == OP_TOP_K ? "i32" : "f32"));
      }
      dt.producer = node;
    }
    if (dt.last_use < node) dt.last_use = node;

    switch (n.op) {
      case OP_GET_ROWS: {
        c.weight(0);
        c.i32(1);
        c.columns(c.src(1).nel);
        c.dst_is(c.src(0).ne[0], c.src(1).nel);
        const GTensor& ids = c.src(1);
        const int64_t rows = c.src(0).ne[1] * c.src(0).ne[2] * c.src(0).ne[3];
        if (!ids.i32) {
          // top_k's ids: bounded by the values it ranked
          if (ids.kind != KIND_INTERMEDIATE || ids.id_bound < 1) {
            c.bad("row ids must be an input, a backend tensor or the output of top_k");
          }
          if (ids.id_bound > rows) {
            c.bad("ids come from top_k over " + std::to_string(ids.id_bound) + " values, but there are " +
                  std::to_string(rows) + " rows");
          }
        }
        for (int64_t j = 0; ids.i32 && j < ids.nel; j++) {
          if (ids.i32[j] < 0 || ids.i32[j] >= rows) {
            c.bad("row id " + std::to_string(ids.i32[j]) + " out of range 0.." + std::to_string(rows - 1));
          }
        }
        break;
      }
      case OP_MUL_MAT:
        c.weight(0);
        c.f32(1);
        c.flat(0);
        c.flat(1);
        c.columns(c.src(1).ne[1]);
        if (c.src(0).ne[0] != c.src(1).ne[0]) c.len("x", c.src(1).ne[0], c.src(0).ne[0]);
        c.dst_is(c.src(0).ne[1], c.src(1).ne[1]);
        if (c.has(2)) {
          // per-column GEMM flags (0/1): an input, one per column of x
          c.i32(2);
          const GTensor& f = c.src(2);
          if (!f.i32) c.bad("the gemm flags must be an input or a backend tensor");
          if (f.nel != c.src(1).ne[1]) c.len("gemm flags", f.nel, c.src(1).ne[1]);
          for (int64_t j = 0; j < f.nel; j++) {
            if (f.i32[j] != 0 && f.i32[j] != 1) {
              c.bad("gemm flag " + std::to_string(j) + " is " + std::to_string(f.i32[j]) + ", not 0 or 1");
            }
          }
        }
        break;
      case OP_RMS_NORM:
      case OP_NORM:
      case OP_SOFTMAX:
        c.f32(0);
        c.dst_like(0);
        if (c.src(0).ne[1] * c.src(0).ne[2] * c.src(0).ne[3] > (int64_t{1} << 31) - 1) c.unsupported("too many columns");
        break;
      case OP_SCALE:
      case OP_SIGMOID:
      case OP_SILU:
      case OP_RELU:
      case OP_GELU:
        c.f32(0);
        c.dst_like(0);
        break;
      case OP_ROPE: {
        c.f32(0);
        c.i32(1);
        c.flat(0);
        c.dst_like(0);
        c.columns(c.src(0).ne[1]);
        const int64_t hd = c.int_param(4, "head_dim", 1, c.src(0).ne[0]);
        const int64_t nd = c.int_param(0, "n_dims", 2, hd);
        const int64_t mode = c.int_param(1, "mode", 0, 2);
        if (c.src(0).ne[0] % hd != 0) c.bad("row length is not a multiple of head_dim");
        if (nd % 2 != 0) c.bad("n_dims must be even");
        if (mode == 1) c.bad("mode must be 0 (normal) or 2 (NeoX)");
        if (c.src(1).nel != c.src(0).ne[1]) c.bad("positions must have one entry per column");
        if (!(n.p[2] > 0)) c.bad("freq_base must be positive");
        break;
      }
      case OP_ATTENTION:
      case OP_ATTENTION_SWA: {
        if (n.op == OP_ATTENTION_SWA) c.int_param(5, "window", 1, int64_t{1} << 31);
        c.f32(0);
        c.flat(0);
        c.flat(1);
        c.flat(2);
        c.dst_like(0);
        c.columns(c.src(0).ne[1]);
        const int kd = c.src(1).dtype;
        if ((kd != DT_F32 && kd != DT_F16) || c.src(2).dtype != kd) c.unsupported("caches must both be f32 or both f16");
        if (!same(c.src(1).ne, c.src(2).ne)) c.bad("k and v caches differ in shape");
        const int64_t hd = c.int_param(3, "head_dim", 1, c.src(0).ne[0]);
        const int64_t nh = c.int_param(4, "n_head", 1, c.src(0).ne[0]);
        const int64_t nkv = c.int_param(1, "n_head_kv", 1, nh);
        const int64_t np = c.int_param(0, "n_past", 0, c.src(1).ne[1]);
        if (hd * nh != c.src(0).ne[0]) c.bad("q row " + std::to_string(c.src(0).ne[0]) + " != head_dim·n_head");
        if (hd * nkv != c.src(1).ne[0]) c.bad("cache row " + std::to_string(c.src(1).ne[0]) + " != head_dim·n_head_kv");
        if (nh % nkv != 0) c.bad("n_head must be a multiple of n_head_kv");
        if (np + c.src(0).ne[1] > c.src(1).ne[1]) {
          c.bad(std::to_string(np + c.src(0).ne[1]) + " positions exceed the cache size " + std::to_string(c.src(1).ne[1]));
        }
        if (hd > options.max_head_dim) {
          c.unsupported("head_dim " + std::to_string(hd) + " > " + std::to_string(options.max_head_dim));
        }
        if (nh > options.max_columns) c.unsupported("more than " + std::to_string(options.max_columns) + " heads");
        break;
      }
      case OP_ADD:
      case OP_MUL:
        c.f32(0);
        c.f32(1);
        c.dst_like(0);
        if (c.src(1).nel != c.src(0).nel && c.src(1).nel != c.src(0).ne[0]) {
          c.bad("shapes " + dims(c.src(0).ne) + " and " + dims(c.src(1).ne) + " do not broadcast");
        }
        break;
      case OP_CPY: {
        c.f32(0);
        c.flat(0);
        if (dt.ne[2] != 1 || dt.ne[3] != 1) c.bad("the destination must be 2-D");
        if (c.src(0).ne[0] != dt.ne[0]) c.len("source row", c.src(0).ne[0], dt.ne[0]);
        const int64_t off = c.int_param(0, "row_offset", 0, dt.ne[1]);
        if (off + c.src(0).ne[1] > dt.ne[1]) {
          c.bad("rows " + std::to_string(off) + ".." + std::to_string(off + c.src(0).ne[1]) + " exceed " +
                std::to_string(dt.ne[1]));
        }
        break;
      }
      case OP_SLICE: {
        c.f32(0);
        c.flat(0);
        const int64_t off = c.int_param(0, "offset", 0, c.src(0).ne[0]);
        const int64_t len = c.int_param(1, "length", 1, c.src(0).ne[0]);
        if (off + len > c.src(0).ne[0]) c.bad(std::to_string(off) + "+" + std::to_string(len) + " exceeds the row");
        c.dst_is(len, c.src(0).ne[1]);
        break;
      }
      case OP_MUL_MAT_SPARSE: check_sparse(c, n, false); break;
      case OP_AXPY_SPARSE: check_sparse(c, n, true); break;
      case OP_RESHAPE:
        c.f32(0);
        if (dt.nel != c.src(0).nel) c.bad("reshape to " + dims(dt.ne) + " changes the element count of " + dims(c.src(0).ne));
        break;
      case OP_TOP_K: {
        c.f32(0);
        c.flat(0);
        const int64_t k = c.int_param(0, "k", 1, c.src(0).ne[0]);
        c.dst_is(k, c.src(0).ne[1]);
        dt.id_bound = c.src(0).ne[0];
        break;
      }
      case OP_MUL_MAT_ID: check_mul_mat_id(c, false); break;
      case OP_MUL_MAT_ID_SPARSE: check_mul_mat_id(c, true); break;
      case OP_AXPY_ID_SPARSE: check_axpy_id(c); break;
      case OP_MOE_SCATTER: {
        // src [R, U, T] (R = m or 1), ids [U, T]; m, n_expert, fill → [m·n_expert, T]
        c.f32(0);
        const int64_t m = c.int_param(0, "m", 1, int64_t{1} << 31);
        const int64_t ne = c.int_param(1, "n_expert", 1, int64_t{1} << 20);
        const auto [u, t] = check_expert_ids(c, 1, ne);
        const int64_t r = c.src(0).ne[0];
        if ((r != m && r != 1) || c.src(0).ne[1] != u || c.src(0).ne[2] != t || c.src(0).ne[3] != 1) {
          c.bad("src shape " + dims(c.src(0).ne) + ", expected [" + std::to_string(m) + " or 1, " + std::to_string(u) +
                ", " + std::to_string(t) + ", 1]");
        }
        if (std::fabs(n.p[2]) > 3.4028234663852886e38) c.bad("fill is outside the f32 range");
        c.dst_is(m * ne, t);
        break;
      }
      case OP_MOE_SUM: {
        c.f32(0);
        c.f32(1);
        c.flat(1);
        const auto [u, t] = check_expert_ids(c, 2, c.src(1).ne[0]);
        const int64_t d = c.src(0).ne[0];
        const int64_t ye[4] = {d, u, t, 1};
        if (!same(c.src(0).ne, ye)) c.bad("y shape " + dims(c.src(0).ne) + ", expected " + dims(ye));
        if (c.src(1).ne[1] != t) c.bad("probs must be [n_expert, " + std::to_string(t) + "]");
        c.int_param(0, "norm", 0, 1);
        c.dst_is(d, t);
        break;
      }
      default: break;
    }
  }
  for (size_t i = 0; i < nt; i++) {
    GTensor& t = cg.tensors[i];
    if (t.kind == KIND_INTERMEDIATE && t.out >= 0 && t.producer < 0) {
      bad("tensor " + std::to_string(i) + ": output that no node computes");
    }
  }
  return cg;
}

}  // namespace wire
}  // namespace powerinfer
