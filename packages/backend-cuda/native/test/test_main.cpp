// Native tests of the GPU backends (no Node needed), run by ctest.
//
// Linked against the emulator (powerinfer_gpu_tests --emu-warp 32|64) they run every kernel on the CPU
// under the SIMT emulator; linked against the CUDA or ROCm runtime (powerinfer_cuda_tests,
// powerinfer_rocm_tests) the same checks run on the GPU, and the binary exits 77 (ctest: skipped) with
// the probe's reason when there is no usable device. This is the test to run on a GPU machine that
// has no package registry: cmake + ctest only.
//
// Covers: F16/BF16 conversions; every op against a double-precision reference for every weight
// dtype the kernels claim, batch 1 and batched, sparse ops with logits, row lists and compact weights
// (outputs of inactive neurons exactly 0, rows-read counters exact); determinism; graph validation
// (malformed graphs throw BAD_GRAPH / UNSUPPORTED_OP before any kernel runs); memory budget and device
// out-of-memory as OUT_OF_MEMORY; on the emulator, that a kernel with divergent barriers is reported.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dtype.h"
#include "executor.h"
#include "graph.h"
#include "kernels.h"
#include "runtime.h"
#if defined(PI_GPU_EMU)
#include "emu.h"
#endif

using namespace pigpu;

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    g_checks++;                                                   \
    if (!(cond)) {                                                \
      g_failures++;                                               \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
    }                                                             \
  } while (0)

std::mt19937 rng(20261129);
float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

const int kWeightTypes[] = {DT_F32, DT_F16, DT_BF16, DT_Q8_0, DT_Q4_0};

// ---- host reference of the weight formats ----

float ref_weight(int dt, const uint8_t* row, int64_t e) {
  uint16_t h;
  switch (dt) {
    case DT_F32: {
      float f;
      std::memcpy(&f, row + 4 * e, 4);
      return f;
    }
    case DT_F16: std::memcpy(&h, row + 2 * e, 2); return pi_half_to_float(h);
    case DT_BF16: std::memcpy(&h, row + 2 * e, 2); return pi_bf16_to_float(h);
    case DT_Q8_0: {
      const uint8_t* b = row + (e / 32) * 34;
      std::memcpy(&h, b, 2);
      return pi_half_to_float(h) * static_cast<float>(static_cast<int8_t>(b[2 + e % 32]));
    }
    default: {
      const uint8_t* b = row + (e / 32) * 18;
      std::memcpy(&h, b, 2);
      const int r = static_cast<int>(e % 32);
      const int q = r < 16 ? (b[2 + r] & 15) : (b[2 + r - 16] >> 4);
      return pi_half_to_float(h) * static_cast<float>(q - 8);
    }
  }
}

/// Random weights: rows × k elements of dt, |w| ≲ 1.
std::vector<uint8_t> random_weights(int dt, int64_t k, int64_t rows) {
  std::vector<uint8_t> b(row_bytes(dt, k) * static_cast<uint64_t>(rows));
  for (auto& v : b) v = static_cast<uint8_t>(irand(0, 255));
  const Layout l = dtype_layout(dt);
  const int64_t nb = k / l.block * rows;
  for (int64_t i = 0; i < (l.block == 1 ? k * rows : nb); i++) {
    uint8_t* p = b.data() + i * l.bytes;
    const float v = uni(-1, 1);
    uint16_t h;
    switch (dt) {
      case DT_F32: std::memcpy(p, &v, 4); break;
      case DT_F16: h = pi_float_to_half(v); std::memcpy(p, &h, 2); break;
      case DT_BF16: h = pi_float_to_bf16(v); std::memcpy(p, &h, 2); break;
      default: h = pi_float_to_half(uni(0.01f, 0.1f)); std::memcpy(p, &h, 2); break;  // block scale
    }
  }
  return b;
}

std::vector<float> randf(size_t n, float lo = -1, float hi = 1) {
  std::vector<float> v(n);
  for (auto& x : v) x = uni(lo, hi);
  return v;
}

// ---- a tiny graph builder over the wire format ----

struct G {
  std::vector<int32_t> tensors, nodes;
  std::vector<double> params;
  std::vector<WireGraph::In> inputs;
  std::vector<WireGraph::Out> outputs;
  std::vector<std::vector<float>> outs;

  int tensor(int kind, int dtype, std::vector<int64_t> ne, int ref) {
    while (ne.size() < 4) ne.push_back(1);
    const int id = static_cast<int>(tensors.size() / kTensorWords);
    tensors.insert(tensors.end(), {kind, dtype, static_cast<int32_t>(ne[0]), static_cast<int32_t>(ne[1]),
                                   static_cast<int32_t>(ne[2]), static_cast<int32_t>(ne[3]), ref, -1});
    return id;
  }
  int input(const std::vector<float>& v, std::vector<int64_t> ne) {
    inputs.push_back({v.data(), v.size() * 4});
    return tensor(KIND_INPUT, DT_F32, ne, static_cast<int>(inputs.size()) - 1);
  }
  int input_i32(const std::vector<int32_t>& v, std::vector<int64_t> ne) {
    inputs.push_back({v.data(), v.size() * 4});
    return tensor(KIND_INPUT, DT_I32, ne, static_cast<int>(inputs.size()) - 1);
  }
  int handle(int id, int dtype, std::vector<int64_t> ne) { return tensor(KIND_HANDLE, dtype, ne, id); }
  int node(int op, std::vector<int64_t> ne, std::vector<int> src, std::vector<double> p) {
    const int dst = tensor(KIND_INTERMEDIATE, DT_F32, ne, -1);
    raw_node(op, dst, src, p);
    return dst;
  }
  void raw_node(int op, int dst, std::vector<int> src, std::vector<double> p) {
    while (src.size() < 5) src.push_back(-1);
    nodes.push_back(op);
    nodes.push_back(dst);
    for (int s : src) nodes.push_back(s);
    nodes.push_back(static_cast<int32_t>(params.size()));
    nodes.push_back(static_cast<int32_t>(p.size()));
    nodes.push_back(0);
    params.insert(params.end(), p.begin(), p.end());
  }
  /// Marks t as an output; returns the index into outs.
  int output(int t) {
    int64_t n = 1;
    for (int d = 0; d < 4; d++) n *= tensors[static_cast<size_t>(t) * kTensorWords + 2 + d];
    outs.emplace_back(static_cast<size_t>(n), std::nanf(""));
    tensors[static_cast<size_t>(t) * kTensorWords + 7] = static_cast<int32_t>(outs.size()) - 1;
    return static_cast<int>(outs.size()) - 1;
  }
  WireGraph wire() {
    WireGraph w;
    w.tensors = tensors.data();
    w.tensor_words = tensors.size();
    w.nodes = nodes.data();
    w.node_words = nodes.size();
    w.params = params.data();
    w.n_params = params.size();
    w.inputs = inputs;
    for (auto& o : outs) outputs.push_back({o.data(), o.size() * 4});
    w.outputs = outputs;
    return w;
  }
};

/// Compares got with want under tol (per element); returns the number of mismatches (first few printed).
int compare(const char* what, const std::vector<float>& got, const std::vector<double>& want,
            const std::vector<double>& tol) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); i++) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol[i])) {
      if (bad < 3) std::fprintf(stderr, "  %s[%zu] = %.9g, want %.9g (tol %.3g)\n", what, i, got[i], want[i], tol[i]);
      bad++;
    }
  }
  return bad;
}

/// The activations a Q8_0/Q4_0 dot product sees on the GPU (kernels.cu, k_quantize_q8): each block of
/// 32 values of a column rounded to q·d16, d = amax/127 (float), q = round(x/d), d16 = F16(d). Other
/// dtypes: x itself. The reference then multiplies these exactly, so only float32 summation error remains.
std::vector<float> gpu_activations(int dt, const std::vector<float>& x) {
  if (dt != DT_Q8_0 && dt != DT_Q4_0) return x;
  std::vector<float> r(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (size_t j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(x[b + j]));
    const float d = amax / 127.0f;
    const float d16 = pi_half_to_float(pi_float_to_half(d));
    for (size_t j = 0; j < 32; j++) r[b + j] = d != 0.0f ? std::round(x[b + j] / d) * d16 : 0.0f;
  }
  return r;
}

double dot_tol(double abs_sum, int64_t k) { return 1e-6 + abs_sum * (static_cast<double>(k) + 16) * 1.2e-7; }

// ---- op tests ----

void test_conversions() {
  CHECK(pi_float_to_half(1.0f) == 0x3c00, "f16(1)");
  CHECK(pi_float_to_half(65504.0f) == 0x7bff, "f16 max");
  CHECK(pi_float_to_half(65520.0f) == 0x7c00, "f16 overflow");
  CHECK(pi_float_to_half(5.960464477539063e-08f) == 0x0001, "f16 smallest subnormal");
  CHECK(pi_float_to_half(2.9802322387695312e-08f) == 0x0000, "f16 tie to even at 2^-25");
  CHECK(pi_half_to_float(0x0001) == 5.960464477539063e-08f, "f16 subnormal decode");
  CHECK(pi_half_to_float(0x3555) == 0.333251953125f, "f16 decode");
  CHECK(pi_float_to_bf16(1.00390625f) == 0x3f80, "bf16 tie to even");
  CHECK(std::isnan(pi_bf16_to_float(pi_float_to_bf16(std::nanf("")))), "bf16 NaN");
  for (int i = 0; i < 65536; i++) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = pi_half_to_float(h);
    if (std::isnan(f)) continue;
    if (pi_float_to_half(f) != h) {
      CHECK(false, "f16 round trip of 0x%04x", i);
      break;
    }
  }
}

void test_mul_mat(Executor& ex, int dt, int64_t k, int64_t n, int64_t t) {
  const auto w = random_weights(dt, k, n);
  const int hw = ex.create(dt, std::vector<int64_t>{k, n, 1, 1}.data(), w.data(), w.size());
  const auto x = randf(static_cast<size_t>(k * t));
  const auto xr = gpu_activations(dt, x);
  G g;
  const int y = g.node(OP_MUL_MAT, {n, t}, {g.handle(hw, dt, {k, n}), g.input(x, {k, t})}, {});
  const int o = g.output(y);
  ex.compute(g.wire());
  std::vector<double> want(static_cast<size_t>(n * t)), tol(want.size());
  const uint64_t rb = row_bytes(dt, k);
  for (int64_t c = 0; c < t; c++) {
    for (int64_t r = 0; r < n; r++) {
      double s = 0, a = 0;
      for (int64_t e = 0; e < k; e++) {
        const double p = static_cast<double>(ref_weight(dt, w.data() + r * rb, e)) * xr[static_cast<size_t>(c * k + e)];
        s += p;
        a += std::fabs(p);
      }
      want[static_cast<size_t>(c * n + r)] = s;
      // F16 weights with T ≥ 16 may run on tensor cores (CUDA), which round the activations to F16:
      // |Δx| ≤ |x|·2^-11, the rounding core's conformance kit admits for F16 weights
      tol[static_cast<size_t>(c * n + r)] = dot_tol(a, k) + (dt == DT_F16 && t >= 16 ? a / 2048 : 0.0);
    }
  }
  CHECK(compare("mul_mat", g.outs[static_cast<size_t>(o)], want, tol) == 0, "mul_mat %s k=%lld n=%lld t=%lld",
        dtype_name(dt), (long long)k, (long long)n, (long long)t);
  ex.free(hw);
}

void test_get_rows(Executor& ex, int dt) {
  const int64_t k = 96, r = 7, t = 5;
  const auto w = random_weights(dt, k, r);
  const int hw = ex.create(dt, std::vector<int64_t>{k, r, 1, 1}.data(), w.data(), w.size());
  std::vector<int32_t> ids = {3, 0, 6, 3, 1};
  G g;
  const int y = g.node(OP_GET_ROWS, {k, t}, {g.handle(hw, dt, {k, r}), g.input_i32(ids, {t})}, {});
  const int o = g.output(y);
  ex.compute(g.wire());
  std::vector<double> want(static_cast<size_t>(k * t)), tol(want.size(), 0.0);
  for (int64_t c = 0; c < t; c++)
    for (int64_t e = 0; e < k; e++)
      want[static_cast<size_t>(c * k + e)] = ref_weight(dt, w.data() + ids[static_cast<size_t>(c)] * row_bytes(dt, k), e);
  CHECK(compare("get_rows", g.outs[static_cast<size_t>(o)], want, tol) == 0, "get_rows %s", dtype_name(dt));
  ex.free(hw);
}

/// mul_mat_sparse and axpy_sparse with logits, a rows list and optionally compact weights.
void test_sparse(Executor& ex, int dt, bool axpy, bool with_logits, int rows_mode, int64_t t, int64_t k_len = 0) {
  // row length (x length, or E for axpy): by default one that is not a multiple of 8 for float rows (the
  // scalar tails); k_len a multiple of 32 takes the aligned vector paths
  const int64_t k = k_len ? k_len : dt == DT_Q8_0 || dt == DT_Q4_0 ? 160 : 67;
  const int64_t n_out = 300;
  std::vector<int32_t> rows;
  if (rows_mode > 0)
    for (int32_t i = 0; i < n_out; i++)
      if (irand(0, 2) == 0) rows.push_back(i);
  const bool compact = rows_mode == 2;
  const int64_t m = compact ? static_cast<int64_t>(rows.size()) : n_out;
  const auto w = random_weights(dt, k, m);
  const int hw = ex.create(dt, std::vector<int64_t>{k, m, 1, 1}.data(), w.data(), w.size());
  const float thr = 0.25f;
  const auto logits = randf(static_cast<size_t>(n_out * t));
  const auto x = randf(static_cast<size_t>((axpy ? n_out : k) * t));
  const auto xr = axpy ? x : gpu_activations(dt, x);  // axpy keeps its F32 activations
  G g;
  const int wt = g.handle(hw, dt, {k, m});
  const int xt = g.input(x, {axpy ? n_out : k, t});
  const int lt = with_logits ? g.input(logits, {n_out, t}) : -1;
  const int rt = rows_mode > 0 ? g.input_i32(rows, {static_cast<int64_t>(rows.size())}) : -1;
  const int y = g.node(axpy ? OP_AXPY_SPARSE : OP_MUL_MAT_SPARSE, {axpy ? k : n_out, t}, {wt, xt, lt, rt},
                       {thr, static_cast<double>(n_out)});
  const int o = g.output(y);
  const std::vector<double> rr = ex.compute(g.wire());
  std::vector<int64_t> wrow(static_cast<size_t>(n_out), -1);
  if (rows_mode == 0)
    for (int64_t i = 0; i < n_out; i++) wrow[static_cast<size_t>(i)] = i;
  for (size_t j = 0; j < rows.size(); j++) wrow[static_cast<size_t>(rows[j])] = compact ? static_cast<int64_t>(j) : rows[j];
  const uint64_t rb = row_bytes(dt, k);
  const int64_t out_len = axpy ? k : n_out;
  std::vector<double> want(static_cast<size_t>(out_len * t), 0.0), tol(want.size(), 0.0), abs(want.size(), 0.0);
  int64_t active = 0;
  for (int64_t c = 0; c < t; c++) {
    for (int64_t i = 0; i < n_out; i++) {
      if (wrow[static_cast<size_t>(i)] < 0) continue;
      if (with_logits && !(logits[static_cast<size_t>(c * n_out + i)] >= thr)) continue;
      active++;
      const uint8_t* row = w.data() + static_cast<uint64_t>(wrow[static_cast<size_t>(i)]) * rb;
      if (axpy) {
        const double a = x[static_cast<size_t>(c * n_out + i)];
        for (int64_t e = 0; e < k; e++) {
          const double p = a * ref_weight(dt, row, e);
          want[static_cast<size_t>(c * k + e)] += p;
          abs[static_cast<size_t>(c * k + e)] += std::fabs(p);
        }
      } else {
        double s = 0, a = 0;
        for (int64_t e = 0; e < k; e++) {
          const double p = static_cast<double>(ref_weight(dt, row, e)) * xr[static_cast<size_t>(c * k + e)];
          s += p;
          a += std::fabs(p);
        }
        want[static_cast<size_t>(c * n_out + i)] = s;
        abs[static_cast<size_t>(c * n_out + i)] = a;
      }
    }
  }
  for (size_t i = 0; i < want.size(); i++) tol[i] = abs[i] == 0 ? 0.0 : dot_tol(abs[i], axpy ? n_out : k);
  const char* name = axpy ? "axpy_sparse" : "mul_mat_sparse";
  CHECK(compare(name, g.outs[static_cast<size_t>(o)], want, tol) == 0, "%s %s logits=%d rows=%d t=%lld", name,
        dtype_name(dt), with_logits, rows_mode, (long long)t);
  CHECK(rr.size() == 1 && rr[0] == static_cast<double>(active), "%s %s rowsRead %g, expected %lld", name,
        dtype_name(dt), rr.empty() ? -1.0 : rr[0], (long long)active);
  ex.free(hw);
}

/// A large axpy (many chunks summed in order) gives the same bits twice.
void test_axpy_deterministic(Executor& ex) {
  const int64_t e = 200, n_out = 3000, t = 2;
  const auto w = random_weights(DT_F16, e, n_out);
  const int hw = ex.create(DT_F16, std::vector<int64_t>{e, n_out, 1, 1}.data(), w.data(), w.size());
  const auto a = randf(static_cast<size_t>(n_out * t));
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    G g;
    const int y = g.node(OP_AXPY_SPARSE, {e, t}, {g.handle(hw, DT_F16, {e, n_out}), g.input(a, {n_out, t})},
                         {0.0, static_cast<double>(n_out)});
    const int o = g.output(y);
    ex.compute(g.wire());
    if (run == 0)
      first = g.outs[static_cast<size_t>(o)];
    else
      CHECK(std::memcmp(first.data(), g.outs[static_cast<size_t>(o)].data(), first.size() * 4) == 0,
            "axpy_sparse is not deterministic");
  }
  ex.free(hw);
}

void test_norms_softmax(Executor& ex) {
  for (int op : {OP_RMS_NORM, OP_NORM, OP_SOFTMAX}) {
    for (int64_t n : {1, 7, 515, 4096}) {
      const int64_t t = 3;
      const auto x = randf(static_cast<size_t>(n * t), -2, 3);
      G g;
      const double p = op == OP_SOFTMAX ? 0.7 : 1e-5;
      const int y = g.node(op, {n, t}, {g.input(x, {n, t})}, {p});
      const int o = g.output(y);
      ex.compute(g.wire());
      std::vector<double> want(static_cast<size_t>(n * t)), tol(want.size());
      for (int64_t c = 0; c < t; c++) {
        const float* xc = x.data() + c * n;
        double mean = 0, sq = 0, mx = -1e300, se = 0;
        for (int64_t i = 0; i < n; i++) {
          mean += xc[i] / static_cast<double>(n);
          sq += static_cast<double>(xc[i]) * xc[i] / static_cast<double>(n);
          mx = std::max(mx, p * xc[i]);
        }
        double var = 0;
        for (int64_t i = 0; i < n; i++) var += (xc[i] - mean) * (xc[i] - mean) / static_cast<double>(n);
        for (int64_t i = 0; i < n; i++) se += std::exp(p * xc[i] - mx);
        for (int64_t i = 0; i < n; i++) {
          double v;
          if (op == OP_RMS_NORM)
            v = xc[i] / std::sqrt(sq + p);
          else if (op == OP_NORM)
            v = (xc[i] - mean) / std::sqrt(var + p);
          else
            v = std::exp(p * xc[i] - mx) / se;
          want[static_cast<size_t>(c * n + i)] = v;
          tol[static_cast<size_t>(c * n + i)] = 1e-7 + std::fabs(v) * (static_cast<double>(n) + 32) * 1.2e-7 +
                                                 (op == OP_NORM ? 1e-6 * std::fabs(mean) : 0.0);
        }
      }
      CHECK(compare(op_name(op), g.outs[static_cast<size_t>(o)], want, tol) == 0, "%s n=%lld", op_name(op), (long long)n);
    }
  }
}

/// Fused groups (add → rms_norm → mul by a weight, silu → mul) give the bits of the separate kernels
/// (POWERINFER_GPU_FUSE=0) and the double-precision values; the sum the add writes is still an output.
void test_fusion(Executor& ex) {
  const int64_t n = 300, t = 3;
  const auto a = randf(static_cast<size_t>(n * t)), b = randf(static_cast<size_t>(n * t)), w = randf(static_cast<size_t>(n));
  const auto gv = randf(static_cast<size_t>(n * t), -4, 4), uv = randf(static_cast<size_t>(n * t));
  auto run = [&](bool fused, std::vector<std::vector<float>>* outs) {
    if (fused) unsetenv("POWERINFER_GPU_FUSE");
    else setenv("POWERINFER_GPU_FUSE", "0", 1);
    G g;
    const int ta = g.input(a, {n, t}), tb = g.input(b, {n, t}), tw = g.input(w, {n});
    const int tg = g.input(gv, {n, t}), tu = g.input(uv, {n, t});
    const int h = g.node(OP_ADD, {n, t}, {ta, tb}, {});
    const int nr = g.node(OP_RMS_NORM, {n, t}, {h}, {1e-5});
    const int y = g.node(OP_MUL, {n, t}, {nr, tw}, {});
    const int sg = g.node(OP_SILU, {n, t}, {tg}, {});
    const int z = g.node(OP_MUL, {n, t}, {tu, sg}, {});
    const int oh = g.output(h), oy = g.output(y), oz = g.output(z);
    ex.compute(g.wire());
    *outs = {g.outs[static_cast<size_t>(oh)], g.outs[static_cast<size_t>(oy)], g.outs[static_cast<size_t>(oz)]};
  };
  std::vector<std::vector<float>> sep, fus;
  run(false, &sep);
  run(true, &fus);
  // RoPE → KV write (F16 cache, rows 2..4): the same cache bytes either way
  std::vector<std::vector<uint8_t>> cache(2);
  const int64_t hd = 64, nh = 2, rows = 6;
  const auto kx = randf(static_cast<size_t>(hd * nh * t));
  const std::vector<int32_t> pos = {2, 3, 4};
  for (int fused = 0; fused < 2; fused++) {
    if (fused) unsetenv("POWERINFER_GPU_FUSE");
    else setenv("POWERINFER_GPU_FUSE", "0", 1);
    const int64_t ne[4] = {hd * nh, rows, 1, 1};
    const int hc = ex.create(DT_F16, ne, nullptr, 0);
    G g;
    const int kr = g.node(OP_ROPE, {hd * nh, t}, {g.input(kx, {hd * nh, t}), g.input_i32(pos, {t})},
                          {static_cast<double>(hd), 0.0, 10000.0, 1.0, static_cast<double>(hd)});
    g.raw_node(OP_CPY, g.handle(hc, DT_F16, {hd * nh, rows}), {kr}, {2.0});
    ex.compute(g.wire());
    cache[static_cast<size_t>(fused)] = ex.read(hc);
    ex.free(hc);
  }
  unsetenv("POWERINFER_GPU_FUSE");
  CHECK(cache[0] == cache[1], "fused rope + KV write differs from rope then cpy");
  bool written = false;  // the rows were written (not left zero)
  for (size_t i = 2 * hd * nh * 2; i < cache[1].size() - static_cast<size_t>(hd * nh * 2); i++) written = written || cache[1][i] != 0;
  CHECK(written, "fused rope + KV write wrote the cache rows");
  for (size_t i = 0; i < 3; i++)
    CHECK(std::memcmp(sep[i].data(), fus[i].data(), sep[i].size() * 4) == 0, "fused output %zu differs from the separate ops", i);
  std::vector<double> wy(static_cast<size_t>(n * t)), ty(wy.size()), wz(wy.size()), tz(wy.size());
  for (int64_t c = 0; c < t; c++) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) {
      const double v = static_cast<double>(a[static_cast<size_t>(c * n + i)]) + b[static_cast<size_t>(c * n + i)];
      ss += v * v;
    }
    const double r = 1 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; i++) {
      const size_t k = static_cast<size_t>(c * n + i);
      const double v = static_cast<double>(a[k]) + b[k];
      wy[k] = v * r * w[static_cast<size_t>(i)];
      ty[k] = 1e-6 + std::fabs(wy[k]) * (n + 16) * 1.2e-7;
      const double gd = gv[k];
      wz[k] = gd / (1 + std::exp(-gd)) * uv[k];
      tz[k] = 1e-6 + std::fabs(wz[k]) * 1e-6;
    }
  }
  CHECK(compare("add+rms_norm×w", fus[1], wy, ty) == 0, "fused add + rms_norm × weight");
  CHECK(compare("silu×up", fus[2], wz, tz) == 0, "fused silu × up");
}

void test_rope(Executor& ex) {
  struct C {
    int hd, nh, nd, mode;
    double base, scale;
  };
  for (const C& c : {C{8, 1, 8, 0, 10000, 1}, C{64, 3, 64, 2, 10000, 1}, C{64, 2, 32, 0, 500000, 0.25}, C{80, 1, 20, 2, 1e4, 1}}) {
    const int64_t n = c.hd * c.nh, t = 3;
    const auto x = randf(static_cast<size_t>(n * t));
    std::vector<int32_t> pos = {0, 17, 3999};
    G g;
    const int y = g.node(OP_ROPE, {n, t}, {g.input(x, {n, t}), g.input_i32(pos, {t})},
                         {static_cast<double>(c.nd), static_cast<double>(c.mode), c.base, c.scale, static_cast<double>(c.hd)});
    const int o = g.output(y);
    ex.compute(g.wire());
    std::vector<double> want(static_cast<size_t>(n * t)), tol(want.size(), 0.0);
    for (int64_t col = 0; col < t; col++) {
      for (int h = 0; h < c.nh; h++) {
        const int64_t b = col * n + h * c.hd;
        for (int r = 0; r < c.hd; r++) want[static_cast<size_t>(b + r)] = x[static_cast<size_t>(b + r)];
        for (int i = 0; i < c.nd / 2; i++) {
          const int i0 = c.mode == 2 ? i : 2 * i, i1 = c.mode == 2 ? i + c.nd / 2 : 2 * i + 1;
          const double th = pos[static_cast<size_t>(col)] * c.scale * std::pow(c.base, -2.0 * i / c.nd);
          const double x0 = x[static_cast<size_t>(b + i0)], x1 = x[static_cast<size_t>(b + i1)];
          want[static_cast<size_t>(b + i0)] = x0 * std::cos(th) - x1 * std::sin(th);
          want[static_cast<size_t>(b + i1)] = x0 * std::sin(th) + x1 * std::cos(th);
          tol[static_cast<size_t>(b + i0)] = tol[static_cast<size_t>(b + i1)] = 1e-6 * (std::fabs(x0) + std::fabs(x1));
        }
      }
    }
    CHECK(compare("rope", g.outs[static_cast<size_t>(o)], want, tol) == 0, "rope hd=%d nd=%d mode=%d", c.hd, c.nd, c.mode);
  }
}

void test_attention(Executor& ex, int kv_dt) {
  struct C {
    int d, h, hkv, ctx, n_past, t;
  };
  for (const C& c : {C{8, 1, 1, 6, 0, 1}, C{64, 4, 2, 150, 70, 3}, C{128, 2, 2, 9, 8, 1}, C{256, 2, 1, 70, 0, 5},
                    C{128, 4, 2, 600, 560, 1}}) {  // decode over a long cache: 18 flash-decoding splits
    const int64_t kv_row = static_cast<int64_t>(c.d) * c.hkv;
    auto kf = randf(static_cast<size_t>(kv_row * c.ctx)), vf = randf(static_cast<size_t>(kv_row * c.ctx));
    std::vector<uint8_t> kb(kf.size() * (kv_dt == DT_F16 ? 2 : 4)), vb(kb.size());
    for (size_t i = 0; i < kf.size(); i++) {
      if (kv_dt == DT_F16) {
        const uint16_t a = pi_float_to_half(kf[i]), b = pi_float_to_half(vf[i]);
        kf[i] = pi_half_to_float(a);
        vf[i] = pi_half_to_float(b);
        std::memcpy(kb.data() + 2 * i, &a, 2);
        std::memcpy(vb.data() + 2 * i, &b, 2);
      } else {
        std::memcpy(kb.data() + 4 * i, &kf[i], 4);
        std::memcpy(vb.data() + 4 * i, &vf[i], 4);
      }
    }
    const int64_t ne[4] = {kv_row, c.ctx, 1, 1};
    const int hk = ex.create(kv_dt, ne, kb.data(), kb.size()), hv = ex.create(kv_dt, ne, vb.data(), vb.size());
    const int64_t qn = static_cast<int64_t>(c.d) * c.h;
    const auto q = randf(static_cast<size_t>(qn * c.t), -2, 2);
    const double scale = 1 / std::sqrt(static_cast<double>(c.d));
    G g;
    const int y = g.node(OP_ATTENTION, {qn, c.t},
                         {g.input(q, {qn, c.t}), g.handle(hk, kv_dt, {kv_row, c.ctx}), g.handle(hv, kv_dt, {kv_row, c.ctx})},
                         {static_cast<double>(c.n_past), static_cast<double>(c.hkv), scale, static_cast<double>(c.d),
                          static_cast<double>(c.h)});
    const int o = g.output(y);
    ex.compute(g.wire());
    std::vector<double> want(static_cast<size_t>(qn * c.t)), tol(want.size());
    for (int t = 0; t < c.t; t++) {
      for (int h = 0; h < c.h; h++) {
        const int gq = h / (c.h / c.hkv);
        const int n_kv = c.n_past + t + 1;
        std::vector<double> s(static_cast<size_t>(n_kv));
        double mx = -1e300;
        for (int p = 0; p < n_kv; p++) {
          double d = 0;
          for (int j = 0; j < c.d; j++) d += static_cast<double>(q[static_cast<size_t>(t * qn + h * c.d + j)]) * kf[static_cast<size_t>(p * kv_row + gq * c.d + j)];
          s[static_cast<size_t>(p)] = d * scale;
          mx = std::max(mx, s[static_cast<size_t>(p)]);
        }
        double sum = 0;
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (int j = 0; j < c.d; j++) {
          double acc = 0, a = 0;
          for (int p = 0; p < n_kv; p++) {
            acc += s[static_cast<size_t>(p)] / sum * vf[static_cast<size_t>(p * kv_row + gq * c.d + j)];
            a += s[static_cast<size_t>(p)] / sum * std::fabs(vf[static_cast<size_t>(p * kv_row + gq * c.d + j)]);
          }
          want[static_cast<size_t>(t * qn + h * c.d + j)] = acc;
          tol[static_cast<size_t>(t * qn + h * c.d + j)] = 1e-6 + a * 2e-5;
        }
      }
    }
    CHECK(compare("attention", g.outs[static_cast<size_t>(o)], want, tol) == 0, "attention %s d=%d h=%d/%d n_past=%d t=%d",
          dtype_name(kv_dt), c.d, c.h, c.hkv, c.n_past, c.t);
    ex.free(hk);
    ex.free(hv);
  }
}

void test_elementwise(Executor& ex) {
  const int64_t n = 300, t = 2;
  const auto a = randf(static_cast<size_t>(n * t), -6, 6), b = randf(static_cast<size_t>(n * t), -3, 3);
  const auto bc = randf(static_cast<size_t>(n), -3, 3);
  G g;
  const int ai = g.input(a, {n, t}), bi = g.input(b, {n, t}), ci = g.input(bc, {n});
  const int o_add = g.output(g.node(OP_ADD, {n, t}, {ai, bi}, {}));
  const int o_mul = g.output(g.node(OP_MUL, {n, t}, {ai, ci}, {}));
  const int o_scale = g.output(g.node(OP_SCALE, {n, t}, {ai}, {-2.5}));
  const int o_silu = g.output(g.node(OP_SILU, {n, t}, {ai}, {}));
  const int o_relu = g.output(g.node(OP_RELU, {n, t}, {ai}, {}));
  const int o_gelu = g.output(g.node(OP_GELU, {n, t}, {ai}, {}));
  const int o_slice = g.output(g.node(OP_SLICE, {100, t}, {ai}, {37, 100}));
  ex.compute(g.wire());
  const size_t N = static_cast<size_t>(n * t);
  std::vector<double> w(N), tl(N);
  auto run = [&](const char* name, int o, const std::function<double(size_t)>& f, double rel) {
    for (size_t i = 0; i < N; i++) {
      w[i] = f(i);
      tl[i] = 1e-7 + rel * std::fabs(w[i]);
    }
    CHECK(compare(name, g.outs[static_cast<size_t>(o)], w, tl) == 0, "%s", name);
  };
  run("add", o_add, [&](size_t i) { return static_cast<double>(a[i]) + b[i]; }, 1.2e-7);
  run("mul", o_mul, [&](size_t i) { return static_cast<double>(a[i]) * bc[i % n]; }, 1.2e-7);
  run("scale", o_scale, [&](size_t i) { return a[i] * -2.5; }, 1.2e-7);
  run("silu", o_silu, [&](size_t i) { return a[i] / (1 + std::exp(-static_cast<double>(a[i]))); }, 1e-6);
  run("relu", o_relu, [&](size_t i) { return a[i] > 0 ? a[i] : 0.0; }, 0);
  run("gelu", o_gelu, [&](size_t i) {
    const double v = a[i];
    return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  }, 1e-6);
  std::vector<double> ws(100 * t), ts(ws.size(), 0.0);
  for (int64_t c = 0; c < t; c++)
    for (int64_t i = 0; i < 100; i++) ws[static_cast<size_t>(c * 100 + i)] = a[static_cast<size_t>(c * n + 37 + i)];
  CHECK(compare("slice", g.outs[static_cast<size_t>(o_slice)], ws, ts) == 0, "slice");
}

void test_cpy(Executor& ex) {
  for (int dt : {DT_F32, DT_F16, DT_BF16}) {
    const int64_t n = 67, rows = 9, t = 3, off = 4;
    const int64_t ne[4] = {n, rows, 1, 1};
    const int h = ex.create(dt, ne, nullptr, 0);
    const auto src = randf(static_cast<size_t>(n * t), -70, 70);
    G g;
    const int dst = g.handle(h, dt, {n, rows});
    g.raw_node(OP_CPY, dst, {g.input(src, {n, t})}, {static_cast<double>(off)});
    ex.compute(g.wire());
    const std::vector<uint8_t> got = ex.read(h);
    const size_t es = dt == DT_F32 ? 4 : 2;
    bool ok = true;
    for (int64_t r = 0; r < rows && ok; r++) {
      for (int64_t i = 0; i < n; i++) {
        const uint8_t* p = got.data() + (r * n + i) * static_cast<int64_t>(es);
        uint32_t bits = 0;
        std::memcpy(&bits, p, es);
        if (r < off || r >= off + t) {
          ok = ok && bits == 0;
          continue;
        }
        const float s = src[static_cast<size_t>((r - off) * n + i)];
        const uint32_t want = dt == DT_F32 ? pi_float_to_bits(s) : dt == DT_F16 ? pi_float_to_half(s) : pi_float_to_bf16(s);
        ok = ok && bits == want;
      }
    }
    CHECK(ok, "cpy into %s", dtype_name(dt));
    ex.free(h);
  }
}

/// Malformed graphs are refused before any kernel runs.
void test_validation(Executor& ex) {
  const int64_t ne[4] = {64, 4, 1, 1};
  const int hq = ex.create(DT_Q4_K, std::vector<int64_t>{256, 2, 1, 1}.data(), nullptr, 0);
  const int hf = ex.create(DT_F32, ne, nullptr, 0);
  const auto x = randf(64 * 2);
  auto expect = [&](const char* what, const char* code, const std::function<void(G&)>& build) {
    G g;
    build(g);
    std::string got = "no error";
    try {
      ex.compute(g.wire());
    } catch (const BackendErr& e) {
      got = e.code + ": " + e.what();
      if (e.code == code) return;
    }
    CHECK(false, "%s: expected %s, got %s", what, code, got.c_str());
  };
  expect("unknown op", "BAD_GRAPH", [&](G& g) { g.node(99, {4, 2}, {g.input(x, {64, 2})}, {}); });
  expect("shape mismatch", "BAD_GRAPH", [&](G& g) { g.node(OP_MUL_MAT, {5, 2}, {g.handle(hf, DT_F32, {64, 4}), g.input(x, {64, 2})}, {}); });
  expect("freed handle", "BAD_GRAPH", [&](G& g) { g.node(OP_MUL_MAT, {4, 2}, {g.handle(12345, DT_F32, {64, 4}), g.input(x, {64, 2})}, {}); });
  expect("q4_K weights", "UNSUPPORTED_OP", [&](G& g) {
    g.node(OP_MUL_MAT, {2, 1}, {g.handle(hq, DT_Q4_K, {256, 2}), g.input(randf(256), {256, 1})}, {});
  });
  expect("read before computed", "BAD_GRAPH", [&](G& g) {
    const int later = g.tensor(KIND_INTERMEDIATE, DT_F32, {64, 2}, -1);
    g.node(OP_RELU, {64, 2}, {later}, {});
  });
  static std::vector<int32_t> bad_rows = {0, 400};
  expect("row id out of range", "BAD_GRAPH", [&](G& g) {
    g.node(OP_MUL_MAT_SPARSE, {4, 2}, {g.handle(hf, DT_F32, {64, 4}), g.input(x, {64, 2}), -1, g.input_i32(bad_rows, {2})}, {0.0, 4.0});
  });
  static std::vector<int32_t> ids = {4};
  expect("get_rows id", "BAD_GRAPH", [&](G& g) { g.node(OP_GET_ROWS, {64, 1}, {g.handle(hf, DT_F32, {64, 4}), g.input_i32(ids, {1})}, {}); });
  expect("attention past the cache", "BAD_GRAPH", [&](G& g) {
    g.node(OP_ATTENTION, {64, 2}, {g.input(x, {64, 2}), g.handle(hf, DT_F32, {64, 4}), g.handle(hf, DT_F32, {64, 4})},
           {3, 1, 0.125, 64, 1});
  });
  expect("NaN param", "BAD_GRAPH", [&](G& g) { g.node(OP_SCALE, {64, 2}, {g.input(x, {64, 2})}, {std::nan("")}); });
  // routed experts: W [64, 2, 2] (two experts of two rows)
  const int he = ex.create(DT_F32, std::vector<int64_t>{64, 2, 2, 1}.data(), nullptr, 0);
  static std::vector<int32_t> bad_expert = {0, 2};
  expect("expert id out of range", "BAD_GRAPH", [&](G& g) {
    g.node(OP_MUL_MAT_ID, {2, 1, 2}, {g.handle(he, DT_F32, {64, 2, 2}), g.input(x, {64, 2}), g.input_i32(bad_expert, {1, 2})}, {});
  });
  static const std::vector<float> logits3(3 * 2);
  expect("top_k over more values than experts", "BAD_GRAPH", [&](G& g) {
    const int ids = g.tensor(KIND_INTERMEDIATE, DT_I32, {1, 2}, -1);
    g.raw_node(OP_TOP_K, ids, {g.input(logits3, {3, 2})}, {1});
    g.node(OP_MUL_MAT_ID, {2, 1, 2}, {g.handle(he, DT_F32, {64, 2, 2}), g.input(x, {64, 2}), ids}, {});
  });
  expect("top_k into an f32 tensor", "BAD_GRAPH", [&](G& g) { g.node(OP_TOP_K, {1, 2}, {g.input(logits3, {3, 2})}, {1}); });
  static std::vector<int32_t> ok_expert = {1, 0};
  static const std::vector<float> y8 = randf(8), p2 = randf(2);
  expect("moe_sum id beyond probs", "BAD_GRAPH", [&](G& g) {
    g.node(OP_MOE_SUM, {4, 2}, {g.input(y8, {4, 1, 2}), g.input(p2, {1, 2}), g.input_i32(ok_expert, {1, 2})}, {0, 1});
  });
  ex.free(he);
  ex.free(hq);
  ex.free(hf);
}

void test_memory(int device) {
  Executor small(device, 1 << 20);
  const int64_t ne[4] = {1024, 128, 1, 1};  // 512 KiB of f32
  const int a = small.create(DT_F32, ne, nullptr, 0);
  std::string code;
  try {
    small.create(DT_F32, ne, nullptr, 0);
    small.create(DT_F32, ne, nullptr, 0);
  } catch (const BackendErr& e) {
    code = e.code;
  }
  CHECK(code == "OUT_OF_MEMORY", "allocation beyond the budget: %s", code.c_str());
  CHECK(small.allocated() == 2 * 512 * 1024, "allocated after a refused allocation: %llu",
        (unsigned long long)small.allocated());
  small.free(a);
  // the device itself refusing an allocation (far beyond any GPU's memory)
  Executor big(device, UINT64_MAX);
  code.clear();
  try {
    const int64_t huge[4] = {int64_t{1} << 20, int64_t{1} << 19, 1, 1};  // 2 TiB of f32
    big.create(DT_F32, huge, nullptr, 0);
  } catch (const BackendErr& e) {
    code = e.code;
  }
  CHECK(code == "OUT_OF_MEMORY", "device out of memory: %s", code.c_str());
  CHECK(big.allocated() == 0, "nothing allocated after a device refusal");
}

}  // namespace

#if defined(PI_GPU_EMU)
/// A kernel whose threads disagree about a barrier: the emulator must report it.
static void divergent_kernel() {
  if (piemu::current().thread.x % 2 == 0) piemu::syncthreads();
}

static void test_emulator_faults() {
  std::string msg;
  try {
    piemu::launch(piemu::Dim3(1), piemu::Dim3(64), nullptr, [] { divergent_kernel(); });
  } catch (const piemu::EmuError& e) {
    msg = e.what();
  }
  CHECK(msg.find("barrier divergence") != std::string::npos, "divergent barrier not reported: '%s'", msg.c_str());
  msg.clear();
  try {
    piemu::launch(piemu::Dim3(1), piemu::Dim3(48), nullptr, [] {});
  } catch (const piemu::EmuError& e) {
    msg = e.what();
  }
  CHECK(!msg.empty(), "a block that is not a whole number of warps is refused");
}
#endif

// ---- --bench: kernel times with timing events at 7B shapes (the device kit's step 7) ----
//
// Not a test: times the kernels the way a decode step and a prompt run them, straight through the
// launchers (no graph executor, no host copies), with events around `reps` back-to-back calls. Lines
// "bench\t<kernel>\t<µs>\t<GB/s>\t<% of the bandwidth>" for each kernel and "row\t<name>\t<detail>" for
// the kit's table. Shapes: LLaMA-2-7B (d 4096, FFN 11008, 32 heads of 128, vocab 32000) or, with
// --small (the emulator), d 256, FFN 704, 2 heads. Bandwidth reference: --bw GB/s (default 4800, the
// H200's HBM3e peak). Weights are random (valid values); timings do not depend on them.
namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(uint64_t bytes) : p(dev_alloc(bytes)) {}
  DevBuf(const void* host, uint64_t bytes, void* stream) : p(dev_alloc(bytes)) {
    copy_h2d(p, host, bytes, stream);
    stream_sync(stream);
  }
  ~DevBuf() { dev_free(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Bench {
  void* stream;
  int reps;
  double bw;  // bytes per second
  void* e0 = event_create();
  void* e1 = event_create();
  Bench(void* s, int r, double b) : stream(s), reps(r), bw(b) {}
  ~Bench() {
    event_destroy(e0);
    event_destroy(e1);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;
  /// Mean µs of f over `reps` calls after two warm-up calls.
  double time_us(const std::function<void()>& f) {
    f();
    f();
    stream_sync(stream);
    event_record(e0, stream);
    for (int i = 0; i < reps; i++) f();
    event_record(e1, stream);
    return static_cast<double>(event_elapsed_ms(e0, e1)) * 1000.0 / reps;
  }
  void line(const std::string& name, double us, double bytes) {
    std::printf("bench\t%s\t%.2f us\t%.1f GB/s\t%.0f %%\n", name.c_str(), us, bytes / us / 1e3,
                100.0 * bytes / (us * 1e-6) / bw);
    std::fflush(stdout);
  }
};

int run_bench(bool small, double bw_gbs, int reps) {
  const ProbeReport pr = probe();
  if (!pr.ok) {
    std::printf("SKIP: %s backend unavailable: %s\n", platform(), pr.reason.c_str());
    return 77;
  }
  int device = 0;
  for (const DeviceProps& dp : pr.devices)
    if (dp.supported) {
      device = dp.index;
      break;
    }
  set_device(device);
  const DeviceProps props = device_props(device);
  std::printf("bench on %s: %s (%s), %d reps, bandwidth reference %.0f GB/s\n", platform(), props.name.c_str(),
              props.arch.c_str(), reps, bw_gbs);
  const int64_t d = small ? 256 : 4096, ffn = small ? 704 : 11008, vocab = small ? 1000 : 32000;
  const int n_head = small ? 2 : 32, hd = 128, layers = 32;
  const int64_t ctx = small ? 512 : 4096, pp = small ? 64 : 512;
  void* st = stream_create();
  Bench b(st, reps, bw_gbs * 1e9);
  const float thr = 0.8f;  // logits uniform in [-1, 1]: 10 % active
  const auto xh = randf(static_cast<size_t>(ffn * pp));
  const auto lh = randf(static_cast<size_t>(ffn * pp));
  DevBuf x(xh.data(), xh.size() * 4, st), logits(lh.data(), lh.size() * 4, st);
  DevBuf y(static_cast<uint64_t>(std::max(ffn, vocab) * pp) * 4), y2(static_cast<uint64_t>(ffn * pp) * 4);
  DevBuf counter(8);
  DevBuf scratch(uint64_t{256} << 20);
  auto weights = [&](int dt, int64_t k, int64_t rows) {
    const auto h = random_weights(dt, k, rows);
    return std::make_unique<DevBuf>(h.data(), h.size(), st);
  };
  auto W = [](const DevBuf& buf, int dt, int64_t k, int64_t rows) {
    return Weights{buf.p, dt, k, rows, row_bytes(dt, k)};
  };
  auto sel = [&](int64_t n_out, bool with_logits) {
    Selection s{};
    s.logits = with_logits ? logits.as<float>() : nullptr;
    s.threshold = thr;
    s.n_out = n_out;
    s.rows_read = counter.as<unsigned long long>();
    return s;
  };
  const std::string D = std::to_string(d), F = std::to_string(ffn);
  // ---- matrix × vector and the sparse ops, per weight dtype ----
  for (int dt : {DT_F16, DT_Q8_0, DT_Q4_0}) {
    const std::string n = dtype_name(dt);
    const auto wdd = weights(dt, d, d), wfd = weights(dt, d, ffn);
    const Weights Wdd = W(*wdd, dt, d, d), Wfd = W(*wfd, dt, d, ffn);
    const double bdd = static_cast<double>(Wdd.row_bytes * d), bfd = static_cast<double>(Wfd.row_bytes * ffn);
    b.line("mul_mat " + n + " " + D + "x" + D + " t=1",
           b.time_us([&] { launch_mul_mat(Wdd, x.as<float>(), 1, y.as<float>(), scratch.p, st); }), bdd);
    b.line("mul_mat " + n + " " + F + "x" + D + " t=1",
           b.time_us([&] { launch_mul_mat(Wfd, x.as<float>(), 1, y.as<float>(), scratch.p, st); }), bfd);
    const Selection s10 = sel(ffn, true), sall = sel(ffn, false);
    b.line("mul_mat_sparse " + n + " " + F + "x" + D + " 10% active", b.time_us([&] {
             launch_mul_mat_sparse(Wfd, x.as<float>(), 1, s10, y.as<float>(), scratch.p, st);
           }),
           0.1 * bfd);
    b.line("axpy_sparse " + n + " " + F + " rows of " + D + " 10% active", b.time_us([&] {
             launch_axpy_sparse(Wfd, x.as<float>(), 1, s10, y.as<float>(), scratch.p, st);
           }),
           0.1 * bfd);
    b.line("axpy_sparse " + n + " " + F + " rows of " + D + " dense (down projection)", b.time_us([&] {
             launch_axpy_sparse(Wfd, x.as<float>(), 1, sall, y.as<float>(), scratch.p, st);
           }),
           bfd);
    if (dt != DT_Q8_0) {
      b.line("mul_mat " + n + " " + D + "x" + D + " t=" + std::to_string(pp) + " (prompt)",
             b.time_us([&] { launch_mul_mat(Wdd, x.as<float>(), pp, y.as<float>(), scratch.p, st); }), bdd);
    }
  }
  // ---- attention over an F16 cache ----
  const int64_t kv_row = static_cast<int64_t>(hd) * n_head;
  std::vector<uint16_t> kvh(static_cast<size_t>(kv_row * ctx));
  for (auto& v : kvh) v = pi_float_to_half(uni(-1, 1));
  DevBuf kc(kvh.data(), kvh.size() * 2, st), vc(kvh.data(), kvh.size() * 2, st);
  auto attn = [&](int64_t t, int64_t n_past) {
    AttentionArgs a{};
    a.q = x.as<float>();
    a.k = kc.p;
    a.v = vc.p;
    a.kv_dtype = DT_F16;
    a.head_dim = hd;
    a.n_head = n_head;
    a.n_head_kv = n_head;
    a.t = t;
    a.n_past = n_past;
    a.scale = 0.08838834764831845f;
    a.y = y.as<float>();
    return a;
  };
  for (int64_t np : {int64_t{128}, ctx}) {
    const AttentionArgs a = attn(1, np - 1);
    b.line("attention f16 cache, " + std::to_string(np) + " positions, t=1",
           b.time_us([&] { launch_attention(a, scratch.p, st); }), static_cast<double>(np * kv_row * 2 * 2));
  }
  {
    const AttentionArgs a = attn(pp, 0);
    b.line("attention f16 cache, prompt t=" + std::to_string(pp),
           b.time_us([&] { launch_attention(a, scratch.p, st); }), static_cast<double>(pp * kv_row * 2 * 2));
  }
  // ---- one decode step of a 7B-shaped model, every kernel on the device (F16 weights) ----
  const auto wq = weights(DT_F16, d, d), wk = weights(DT_F16, d, d), wv = weights(DT_F16, d, d),
             wo = weights(DT_F16, d, d), wg = weights(DT_F16, d, ffn), wu = weights(DT_F16, d, ffn),
             wdn = weights(DT_F16, ffn, d), wdt = weights(DT_F16, d, ffn), wout = weights(DT_F16, d, vocab);
  DevBuf h(static_cast<uint64_t>(d) * 4 * 8), pos(256);
  std::vector<float> norm_w(static_cast<size_t>(d), 1.0f);
  DevBuf nw(norm_w.data(), norm_w.size() * 4, st);
  const float* xf = x.as<float>();
  float* hq = h.as<float>();
  float* hk = hq + d;
  float* hv = hq + 2 * d;
  float* ha = hq + 3 * d;
  float* hn = hq + 4 * d;
  float* g = y.as<float>();
  float* u = y2.as<float>();
  auto layer = [&](int64_t n_past, bool sparse) {
    launch_rms_norm(xf, hn, d, 1, 1e-5f, st);
    launch_binary(BINARY_MUL, hn, nw.as<float>(), hn, d, d, st);
    launch_mul_mat(W(*wq, DT_F16, d, d), hn, 1, hq, scratch.p, st);
    launch_mul_mat(W(*wk, DT_F16, d, d), hn, 1, hk, scratch.p, st);
    launch_mul_mat(W(*wv, DT_F16, d, d), hn, 1, hv, scratch.p, st);
    launch_rope(hq, pos.as<int32_t>(), hq, d, 1, hd, hd, 0, 10000.0, 1.0, st);
    launch_rope(hk, pos.as<int32_t>(), hk, d, 1, hd, hd, 0, 10000.0, 1.0, st);
    launch_cpy(hk, kc.p, DT_F16, d, 1, n_past, st);
    launch_cpy(hv, vc.p, DT_F16, d, 1, n_past, st);
    AttentionArgs a = attn(1, n_past);
    a.q = hq;
    a.y = ha;
    launch_attention(a, scratch.p, st);
    launch_mul_mat(W(*wo, DT_F16, d, d), ha, 1, hn, scratch.p, st);
    launch_binary(BINARY_ADD, hn, xf, hn, d, d, st);
    launch_rms_norm(hn, ha, d, 1, 1e-5f, st);
    launch_binary(BINARY_MUL, ha, nw.as<float>(), ha, d, d, st);
    if (sparse) {  // PowerInfer: gate and up on the active rows, down as axpy over them (predictor excluded)
      const Selection s10 = sel(ffn, true);
      launch_mul_mat_sparse(W(*wg, DT_F16, d, ffn), ha, 1, s10, g, scratch.p, st);
      launch_mul_mat_sparse(W(*wu, DT_F16, d, ffn), ha, 1, s10, u, scratch.p, st);
      launch_unary(UNARY_SILU, g, g, ffn, 0.0f, st);
      launch_binary(BINARY_MUL, g, u, g, ffn, ffn, st);
      launch_axpy_sparse(W(*wdt, DT_F16, d, ffn), g, 1, s10, hq, scratch.p, st);
    } else {
      launch_mul_mat(W(*wg, DT_F16, d, ffn), ha, 1, g, scratch.p, st);
      launch_mul_mat(W(*wu, DT_F16, d, ffn), ha, 1, u, scratch.p, st);
      launch_unary(UNARY_SILU, g, g, ffn, 0.0f, st);
      launch_binary(BINARY_MUL, g, u, g, ffn, ffn, st);
      launch_mul_mat(W(*wdn, DT_F16, ffn, d), g, 1, hq, scratch.p, st);
    }
    launch_binary(BINARY_ADD, hq, hn, hq, d, d, st);
  };
  for (bool sparse : {false, true}) {
    for (int64_t n_past : {int64_t{128}, ctx - 1}) {
      const int32_t ph = static_cast<int32_t>(n_past);
      copy_h2d(pos.p, &ph, 4, st);
      stream_sync(st);
      const double us = b.time_us([&] {
        for (int l = 0; l < layers; l++) layer(n_past, sparse);
        launch_rms_norm(hq, hn, d, 1, 1e-5f, st);
        launch_mul_mat(W(*wout, DT_F16, d, vocab), hn, 1, y.as<float>(), scratch.p, st);
      });
      const std::string what =
          std::string(sparse ? "sparse FFN 10 %" : "dense") + ", " + std::to_string(n_past) + " cached positions";
      std::printf("bench\tdecode step (%d layers, F16, %s)\t%.2f us\n", layers, what.c_str(), us);
      std::printf("row\tdecode %s\t%.1f tokens/s (%.3f ms per token, %d layers, F16 weights, kernels only)\n",
                  what.c_str(), 1e6 / us, us / 1000.0, layers);
      std::fflush(stdout);
    }
  }
  {  // prompt: one layer's matmuls and attention at t = pp (norms and elementwise ops are minor)
    const double us = b.time_us([&] {
      for (const DevBuf* w4 : {wq.get(), wk.get(), wv.get(), wo.get()})
        launch_mul_mat(W(*w4, DT_F16, d, d), x.as<float>(), pp, y.as<float>(), scratch.p, st);
      launch_mul_mat(W(*wg, DT_F16, d, ffn), x.as<float>(), pp, y.as<float>(), scratch.p, st);
      launch_mul_mat(W(*wu, DT_F16, d, ffn), x.as<float>(), pp, y.as<float>(), scratch.p, st);
      launch_mul_mat(W(*wdn, DT_F16, ffn, d), x.as<float>(), pp, y.as<float>(), scratch.p, st);
      const AttentionArgs a = attn(pp, 0);
      launch_attention(a, scratch.p, st);
    });
    std::printf("row\tpp%lld\t%.0f tokens/s (%.1f ms for %d layers' matmuls and attention, F16 weights)\n",
                static_cast<long long>(pp), static_cast<double>(pp) / (us * layers * 1e-6), us * layers / 1000.0,
                layers);
  }
  stream_destroy(st);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i++) {
    if (std::string(argv[i]) == "--emu-warp") emu_configure(std::atoi(argv[i + 1]), 0);
  }
  bool bench = false, small = false;
  double bw = 4800;
  int reps = 20;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--bench") bench = true;
    if (a == "--small") small = true;
    if (a == "--bw" && i + 1 < argc) bw = std::atof(argv[i + 1]);
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[i + 1]));
  }
  if (bench) {
    try {
      return run_bench(small, bw, reps);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench: %s\n", e.what());
      return 1;
    }
  }
  const ProbeReport pr = probe();
  if (!pr.ok) {
    std::printf("SKIP: %s backend unavailable: %s\n", platform(), pr.reason.c_str());
    return 77;
  }
  int device = 0;
  for (const DeviceProps& d : pr.devices) {
    if (d.supported) {
      device = d.index;
      break;
    }
  }
  set_device(device);
  const DeviceProps props = device_props(device);
  std::printf("%s: %s (%s, warp %d), code for %s\n", platform(), props.name.c_str(), props.arch.c_str(),
              props.warp_size, build_archs());

  test_conversions();
  {
    Executor ex(device, UINT64_MAX);
    for (int dt : kWeightTypes) {
      test_get_rows(ex, dt);
      const int64_t k = dtype_layout(dt).block == 1 ? 67 : 96;
      test_mul_mat(ex, dt, k, 19, 1);
      test_mul_mat(ex, dt, k, 5, 11);  // two token groups
      for (bool axpy : {false, true}) {
        test_sparse(ex, dt, axpy, false, 0, 3);
        test_sparse(ex, dt, axpy, true, 0, 1);
        test_sparse(ex, dt, axpy, true, 1, 2);
        test_sparse(ex, dt, axpy, true, 2, 9);
        test_sparse(ex, dt, axpy, false, 2, 1);
        test_sparse(ex, dt, axpy, true, 1, 3, 1056);  // aligned rows, two axpy output slices
      }
      test_mul_mat(ex, dt, 256, 7, 2);  // aligned rows: 16-byte weight and activation loads
      test_mul_mat(ex, dt, 256, 128, 70);  // F16 on CUDA: tensor-core tiles (2 × 2 blocks, a partial one)
    }
    test_mul_mat(ex, DT_Q4_0, 4096, 3, 1);
    test_axpy_deterministic(ex);
    test_norms_softmax(ex);
    test_rope(ex);
    test_fusion(ex);
    test_attention(ex, DT_F32);
    test_attention(ex, DT_F16);
    test_elementwise(ex);
    test_cpy(ex);
    test_validation(ex);
  }
  test_memory(device);
#if defined(PI_GPU_EMU)
  test_emulator_faults();
#endif
  std::printf("%d checks, %d failed\n", g_checks, g_failures);
  std::printf("%d passed, %d failed\n", g_checks - g_failures, g_failures);
  return g_failures == 0 ? 0 : 1;
}
