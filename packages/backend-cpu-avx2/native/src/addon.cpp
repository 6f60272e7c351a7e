// N-API surface of the CPU backend (node-addon-api, Node-API version 8, C++ exceptions).
//
// Module exports:
//   cpuInfo() → { avx2, fma, f16c, avx512f, kernel, reason }  (what select_kernels(false) picks)
//   Backend class: new Backend({ threads, memoryBudget, forceScalar, repack, hugePageCopyBytes, deferHugePageCopies })
//     createTensor(dtypeCode, ne[], data?) → id
//     mapTensor(dtypeCode, ne[], path, fileOffset, byteLength) → id
//     readTensor(id) → Uint8Array, writeTensor(id, view, offset), freeTensor(id)
//     allocatedBytes(), hugePageCopyBytes(), threads, kernel, kernelReason
//     copyPendingAsync() → Promise of the bytes copied (the copies deferHugePageCopies reserved), pendingCopyBytes()
//     supportsOp(opCode, dtypeCodes[]) → boolean
//     compute(tensors, nodes, params, inputs[], outputs[]) → { rowsRead: Float64Array, elapsedMs }
//     computeAsync(...same) → Promise of the same
//     dispose()
//   benchReadBandwidth(bytes, threads, iterations) → bytes per second (sum of a large F32 array)
// Errors are JS Errors with a `code` property (the interface's BackendErrorCode).
#include <napi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "executor.h"
#include "kernels.h"
#include "tensor_store.h"
#include "neuron_cache.h"

namespace {

using pi::BackendErr;

Napi::Error make_error(Napi::Env env, const std::string& code, const std::string& msg) {
  Napi::Error e = Napi::Error::New(env, msg);
  e.Set("code", Napi::String::New(env, code));
  return e;
}

[[noreturn]] void throw_error(Napi::Env env, const std::string& code, const std::string& msg) {
  throw make_error(env, code, msg);
}

/// A JS number that is a non-negative integer (a file offset, a byte count). @throws BAD_TENSOR naming `what`.
uint64_t whole_number(Napi::Env env, const Napi::Value& v, const char* what) {
  const double d = v.IsNumber() ? v.As<Napi::Number>().DoubleValue() : -1;
  if (!(d >= 0) || d != static_cast<double>(static_cast<uint64_t>(d))) {
    throw_error(env, "BAD_TENSOR", std::string(what) + " must be a non-negative integer");
  }
  return static_cast<uint64_t>(d);
}

/// The state shared between the JS object and in-flight async computations.
struct State {
  pi::TensorStore store;
  pi::Executor exec;
  bool disposed = false;
  State(size_t budget, int threads, bool force_scalar) : store(budget), exec(store, threads, force_scalar) {}
};

int get_int(const Napi::Value& v, const char* what) {
  if (!v.IsNumber()) throw_error(v.Env(), "BAD_TENSOR", std::string(what) + " must be a number");
  const double d = v.As<Napi::Number>().DoubleValue();
  if (d != static_cast<double>(static_cast<int64_t>(d)) || d < -2147483648.0 || d > 2147483647.0) {
    throw_error(v.Env(), "BAD_TENSOR", std::string(what) + " must be a 32-bit integer");
  }
  return static_cast<int>(d);
}

void get_shape(const Napi::Value& v, int64_t ne[4]) {
  Napi::Env env = v.Env();
  if (!v.IsArray()) throw_error(env, "BAD_TENSOR", "shape must be an array");
  Napi::Array a = v.As<Napi::Array>();
  if (a.Length() < 1 || a.Length() > 4) throw_error(env, "BAD_TENSOR", "tensor rank must be 1..4");
  for (int i = 0; i < 4; i++) ne[i] = 1;
  for (uint32_t i = 0; i < a.Length(); i++) {
    Napi::Value e = a.Get(i);
    if (!e.IsNumber()) throw_error(env, "BAD_TENSOR", "shape entries must be numbers");
    const double d = e.As<Napi::Number>().DoubleValue();
    if (!(d >= 1) || d != static_cast<double>(static_cast<int64_t>(d)) || d > 1099511627776.0) {
      throw_error(env, "BAD_TENSOR", "bad dimension " + std::to_string(d));
    }
    ne[i] = static_cast<int64_t>(d);
  }
}

struct ViewBytes {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

ViewBytes view_bytes(const Napi::Value& v) {
  if (v.IsTypedArray()) {
    Napi::TypedArray ta = v.As<Napi::TypedArray>();
    Napi::ArrayBuffer ab = ta.ArrayBuffer();
    return {static_cast<const uint8_t*>(ab.Data()) + ta.ByteOffset(), ta.ByteLength()};
  }
  if (v.IsDataView()) {
    Napi::DataView dv = v.As<Napi::DataView>();
    Napi::ArrayBuffer ab = dv.ArrayBuffer();
    return {static_cast<const uint8_t*>(ab.Data()) + dv.ByteOffset(), dv.ByteLength()};
  }
  if (v.IsBuffer()) {
    Napi::Buffer<uint8_t> b = v.As<Napi::Buffer<uint8_t>>();
    return {b.Data(), b.Length()};
  }
  throw_error(v.Env(), "BAD_TENSOR", "expected an ArrayBufferView");
}

/// Collects an encoded graph's arrays (and, for async work, references that keep them alive).
struct GraphArgs {
  pi::EncodedGraph g;
  std::vector<Napi::Reference<Napi::Value>> refs;
  /// false for a synchronous compute: the caller's arguments outlive the call, so no reference is made
  bool hold = true;

  void parse(const Napi::CallbackInfo& info, bool hold_refs) {
    hold = hold_refs;
    Napi::Env env = info.Env();
    if (info.Length() < 5) throw_error(env, "BAD_GRAPH", "compute(tensors, nodes, params, inputs, outputs)");
    if (!info[0].IsTypedArray() || info[0].As<Napi::TypedArray>().TypedArrayType() != napi_int32_array) {
      throw_error(env, "BAD_GRAPH", "tensors must be an Int32Array");
    }
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_int32_array) {
      throw_error(env, "BAD_GRAPH", "nodes must be an Int32Array");
    }
    if (!info[2].IsTypedArray() || info[2].As<Napi::TypedArray>().TypedArrayType() != napi_float64_array) {
      throw_error(env, "BAD_GRAPH", "params must be a Float64Array");
    }
    if (!info[3].IsArray() || !info[4].IsArray()) throw_error(env, "BAD_GRAPH", "inputs and outputs must be arrays");
    Napi::Int32Array t = info[0].As<Napi::Int32Array>();
    Napi::Int32Array n = info[1].As<Napi::Int32Array>();
    Napi::Float64Array p = info[2].As<Napi::Float64Array>();
    g.tensors = t.Data();
    g.tensor_words = t.ElementLength();
    g.nodes = n.Data();
    g.node_words = n.ElementLength();
    g.params = p.Data();
    g.n_params = p.ElementLength();
    keep(info[0]);
    keep(info[1]);
    keep(info[2]);
    Napi::Array ins = info[3].As<Napi::Array>();
    for (uint32_t i = 0; i < ins.Length(); i++) {
      Napi::Value v = ins.Get(i);
      if (!v.IsTypedArray() && !v.IsDataView()) throw_error(env, "BAD_GRAPH", "input " + std::to_string(i) + " is not an ArrayBufferView");
      const ViewBytes vb = view_bytes(v);
      g.inputs.push_back({vb.data, vb.bytes});
      keep(v);
    }
    Napi::Array outs = info[4].As<Napi::Array>();
    for (uint32_t i = 0; i < outs.Length(); i++) {
      Napi::Value v = outs.Get(i);
      if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
        throw_error(env, "BAD_GRAPH", "output " + std::to_string(i) + " is not a Float32Array");
      }
      Napi::Float32Array f = v.As<Napi::Float32Array>();
      g.outputs.push_back({f.Data(), f.ByteLength()});
      keep(v);
    }
  }

  void keep(const Napi::Value& v) {
    if (hold) refs.push_back(Napi::Persistent(v));
  }
};

Napi::Object compute_result(Napi::Env env, const std::vector<double>& rows, double ms) {
  Napi::Float64Array r = Napi::Float64Array::New(env, rows.size());
  if (!rows.empty()) std::memcpy(r.Data(), rows.data(), rows.size() * sizeof(double));
  Napi::Object o = Napi::Object::New(env);
  o.Set("rowsRead", r);
  o.Set("elapsedMs", Napi::Number::New(env, ms));
  return o;
}

class ComputeWorker : public Napi::AsyncWorker {
 public:
  ComputeWorker(Napi::Env env, std::shared_ptr<State> st, std::unique_ptr<GraphArgs> args)
      : Napi::AsyncWorker(env, "powerinfer.cpu.compute"), deferred_(Napi::Promise::Deferred::New(env)),
        st_(std::move(st)), args_(std::move(args)) {}

  Napi::Promise promise() { return deferred_.Promise(); }

  void Execute() override {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      st_->exec.compute(args_->g, rows_);
      ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    } catch (const BackendErr& e) {
      code_ = e.code;
      SetError(e.what());
    } catch (const std::exception& e) {
      code_ = "BAD_GRAPH";
      SetError(e.what());
    }
  }

  void OnOK() override {
    Napi::HandleScope scope(Env());
    args_.reset();
    deferred_.Resolve(compute_result(Env(), rows_, ms_));
  }

  void OnError(const Napi::Error& e) override {
    Napi::HandleScope scope(Env());
    args_.reset();
    deferred_.Reject(make_error(Env(), code_, e.Message()).Value());
  }

 private:
  Napi::Promise::Deferred deferred_;
  std::shared_ptr<State> st_;
  std::unique_ptr<GraphArgs> args_;
  std::vector<double> rows_;
  double ms_ = 0;
  std::string code_ = "BAD_GRAPH";
};

/// Makes the huge-page copies that mapTensor reserved with deferHugePageCopies (TensorStore::copy_pending)
/// on a worker thread, so that the event loop runs meanwhile.
class CopyWorker : public Napi::AsyncWorker {
 public:
  CopyWorker(Napi::Env env, std::shared_ptr<State> st)
      : Napi::AsyncWorker(env, "powerinfer.cpu.copy"), deferred_(Napi::Promise::Deferred::New(env)), st_(std::move(st)) {}

  Napi::Promise promise() { return deferred_.Promise(); }

  void Execute() override { bytes_ = st_->store.copy_pending(); }

  void OnOK() override {
    Napi::HandleScope scope(Env());
    deferred_.Resolve(Napi::Number::New(Env(), static_cast<double>(bytes_)));
  }

 private:
  Napi::Promise::Deferred deferred_;
  std::shared_ptr<State> st_;
  size_t bytes_ = 0;
};

class Backend : public Napi::ObjectWrap<Backend> {
 public:
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, "Backend",
                       {
                           InstanceMethod<&Backend::CreateTensor>("createTensor"),
                           InstanceMethod<&Backend::MapTensor>("mapTensor"),
                           InstanceMethod<&Backend::MapTensorCached>("mapTensorCached"),
                           InstanceMethod<&Backend::CacheStats>("cacheStats"),
                           InstanceMethod<&Backend::ReadTensor>("readTensor"),
                           InstanceMethod<&Backend::WriteTensor>("writeTensor"),
                           InstanceMethod<&Backend::FreeTensor>("freeTensor"),
                           InstanceMethod<&Backend::AllocatedBytes>("allocatedBytes"),
                           InstanceMethod<&Backend::HugePageCopyBytes>("hugePageCopyBytes"),
                           InstanceMethod<&Backend::CopyPendingAsync>("copyPendingAsync"),
                           InstanceMethod<&Backend::PendingCopyBytes>("pendingCopyBytes"),
                           InstanceMethod<&Backend::SupportsOp>("supportsOp"),
                           InstanceMethod<&Backend::Compute>("compute"),
                           InstanceMethod<&Backend::ComputeAsync>("computeAsync"),
                           InstanceMethod<&Backend::Dispose>("dispose"),
                           InstanceAccessor<&Backend::Threads>("threads"),
                           InstanceAccessor<&Backend::Kernel>("kernel"),
                           InstanceAccessor<&Backend::KernelReason>("kernelReason"),
                       });
  }

  explicit Backend(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Backend>(info) {
    Napi::Env env = info.Env();
    int threads = 1;
    double budget = -1;  // unlimited
    bool force_scalar = false;
    bool repack = true;
    double copy_limit = 0;  // bytes of mapped weights copied into huge-page memory
    bool defer_copies = false;  // copies reserved at mapTensor, made by copyPendingAsync
    if (info.Length() > 0 && info[0].IsObject()) {
      Napi::Object o = info[0].As<Napi::Object>();
      if (o.Has("threads") && !o.Get("threads").IsUndefined()) threads = get_int(o.Get("threads"), "threads");
      if (o.Has("memoryBudget") && o.Get("memoryBudget").IsNumber()) budget = o.Get("memoryBudget").As<Napi::Number>().DoubleValue();
      if (o.Has("forceScalar")) force_scalar = o.Get("forceScalar").ToBoolean().Value();
      if (o.Has("repack") && !o.Get("repack").IsUndefined()) repack = o.Get("repack").ToBoolean().Value();
      if (o.Has("hugePageCopyBytes") && o.Get("hugePageCopyBytes").IsNumber()) {
        copy_limit = o.Get("hugePageCopyBytes").As<Napi::Number>().DoubleValue();
      }
      if (o.Has("deferHugePageCopies")) defer_copies = o.Get("deferHugePageCopies").ToBoolean().Value();
    }
    if (!(copy_limit >= 0)) throw_error(env, "UNAVAILABLE", "hugePageCopyBytes must be a number >= 0");
    if (threads < 1 || threads > 512) throw_error(env, "UNAVAILABLE", "threads must be in 1..512");
    if (std::isnan(budget)) throw_error(env, "UNAVAILABLE", "memoryBudget must be a number");
    const size_t limit = budget < 0 || budget >= 1.8e19 ? SIZE_MAX : static_cast<size_t>(budget);
    st_ = std::make_shared<State>(limit, threads, force_scalar);
    st_->exec.set_repack(repack);
    st_->store.set_copy_limit(copy_limit >= 1.8e19 ? SIZE_MAX : static_cast<size_t>(copy_limit));
    st_->store.set_defer_copies(defer_copies);
  }

 private:
  State& live(Napi::Env env) {
    if (!st_ || st_->disposed) throw_error(env, "DISPOSED", "the backend was disposed");
    return *st_;
  }

  template <typename F>
  auto guarded(Napi::Env env, F f) -> decltype(f()) {
    try {
      return f();
    } catch (const BackendErr& e) {
      throw_error(env, e.code, e.what());
    }
  }

  Napi::Value CreateTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    const int dt = get_int(info[0], "dtype");
    int64_t ne[4];
    get_shape(info[1], ne);
    ViewBytes src;
    const bool has_data = info.Length() > 2 && !info[2].IsUndefined() && !info[2].IsNull();
    if (has_data) src = view_bytes(info[2]);
    const size_t bytes = guarded(env, [&] { return pi::tensor_bytes(dt, ne); });
    if (has_data && src.bytes != bytes) {
      throw_error(env, "BAD_TENSOR", "data has " + std::to_string(src.bytes) + " bytes, a " + pi::dtype_name(dt) +
                                         " tensor of this shape needs " + std::to_string(bytes));
    }
    pi::TensorPtr t = guarded(env, [&] { return s.store.create(dt, ne); });
    if (has_data && bytes) std::memcpy(t->data, src.data, bytes);
    return Napi::Number::New(env, t->id);
  }

  Napi::Value MapTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    const int dt = get_int(info[0], "dtype");
    int64_t ne[4];
    get_shape(info[1], ne);
    if (!info[2].IsString()) throw_error(env, "BAD_TENSOR", "path must be a string");
    const std::string path = info[2].As<Napi::String>().Utf8Value();
    const uint64_t off = whole_number(env, info[3], "fileOffset");
    const uint64_t len = whole_number(env, info[4], "byteLength");
    pi::TensorPtr t = guarded(env, [&] { return s.store.map(dt, ne, path, off, len); });
    return Napi::Number::New(env, t->id);
  }

  // mapTensorCached(dtype, ne[], path, fileOffset, byteLength, { rowStride, hot: Int32Array, coldRows, group, pool, expertRows }) → id
  Napi::Value MapTensorCached(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    const int dt = get_int(info[0], "dtype");
    int64_t ne[4];
    get_shape(info[1], ne);
    if (!info[2].IsString()) throw_error(env, "BAD_TENSOR", "path must be a string");
    auto whole = [&](const Napi::Value& v, const char* what) { return whole_number(env, v, what); };
    pi::CacheSpec spec;
    spec.path = info[2].As<Napi::String>().Utf8Value();
    spec.file_offset = whole(info[3], "fileOffset");
    const uint64_t len = whole(info[4], "byteLength");
    if (!info[5].IsObject()) throw_error(env, "BAD_TENSOR", "cache options must be an object");
    Napi::Object o = info[5].As<Napi::Object>();
    const size_t bytes = guarded(env, [&] { return pi::tensor_bytes(dt, ne); });
    const bool bundled = o.Has("recordBytes") && !o.Get("recordBytes").IsUndefined();
    if (!bundled && !(o.Has("shareWith") && !o.Get("shareWith").IsUndefined()) && len != bytes) {
      throw_error(env, "BAD_TENSOR", "byteLength " + std::to_string(len) + " != " + std::to_string(bytes));
    }
    if (o.Has("shareWith") && !o.Get("shareWith").IsUndefined()) {
      // another part of a bundled neuron record: the rows live in that tensor's cache
      const int with = get_int(o.Get("shareWith"), "shareWith");
      const uint64_t part = o.Has("partOffset") ? whole(o.Get("partOffset"), "partOffset") : 0;
      pi::TensorPtr t = guarded(env, [&] { return s.store.share_cached(dt, ne, with, static_cast<size_t>(part)); });
      return Napi::Number::New(env, t->id);
    }
    // expertRows: a stacked expert tensor {n_embd, n_ff_exp, n_expert} cached one expert per row
    spec.expert_rows = o.Has("expertRows") && o.Get("expertRows").ToBoolean().Value();
    if (spec.expert_rows && bundled) throw_error(env, "BAD_TENSOR", "expertRows cannot be combined with a bundled layout");
    if (o.Has("transposeRows") && !o.Get("transposeRows").IsUndefined()) {
      // neuron-major expert rows from llama.cpp's {n_ff_exp, n_embd} down stack: transposed on read
      spec.transpose_rows = static_cast<int64_t>(whole(o.Get("transposeRows"), "transposeRows"));
      spec.elem_bytes = dt == pi::DT_F16 ? 2 : dt == pi::DT_F32 ? 4 : 0;
      if (!spec.expert_rows || spec.elem_bytes == 0 || spec.transpose_rows < 1) {
        throw_error(env, "BAD_TENSOR", "transposeRows needs expertRows and an f16 or f32 tensor");
      }
    }
    spec.n_rows = spec.expert_rows ? ne[2] : ne[1];
    spec.row_bytes = bytes / static_cast<size_t>(spec.n_rows);
    if (o.Has("recordBytes") && !o.Get("recordBytes").IsUndefined()) spec.row_bytes = whole(o.Get("recordBytes"), "recordBytes");
    if (o.Has("bucketRows") && !o.Get("bucketRows").IsUndefined()) spec.bucket_rows = static_cast<int64_t>(whole(o.Get("bucketRows"), "bucketRows"));
    if (o.Has("bucketStride") && !o.Get("bucketStride").IsUndefined()) spec.bucket_stride = whole(o.Get("bucketStride"), "bucketStride");
    spec.row_stride = o.Has("rowStride") && !o.Get("rowStride").IsUndefined() ? whole(o.Get("rowStride"), "rowStride") : spec.row_bytes;
    spec.cold_slots = static_cast<int64_t>(whole(o.Get("coldRows"), "coldRows"));
    if (o.Has("hot") && o.Get("hot").IsTypedArray()) {
      Napi::TypedArray ta = o.Get("hot").As<Napi::TypedArray>();
      if (ta.TypedArrayType() != napi_int32_array) throw_error(env, "BAD_TENSOR", "hot must be an Int32Array");
      Napi::Int32Array h = ta.As<Napi::Int32Array>();
      spec.hot.assign(h.Data(), h.Data() + h.ElementLength());
    }
    const int group = o.Has("group") && o.Get("group").IsNumber() ? get_int(o.Get("group"), "group") : 0;
    const int pool = o.Has("pool") && o.Get("pool").IsNumber() ? get_int(o.Get("pool"), "pool") : 0;
    pi::TensorPtr t = guarded(env, [&] { return s.store.map_cached(dt, ne, spec, group, pool); });
    return Napi::Number::New(env, t->id);
  }

  // cacheStats() → monotonic counters of every neuron cache of this backend
  Napi::Value CacheStats(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    pi::CacheCounters& c = s.store.counters();
    Napi::Object o = Napi::Object::New(env);
    auto num = [&](const char* k, double v) { o.Set(k, Napi::Number::New(env, v)); };
    num("hits", static_cast<double>(c.hits.load()));
    num("misses", static_cast<double>(c.misses.load()));
    num("reads", static_cast<double>(c.reads.load()));
    num("bytesRead", static_cast<double>(c.bytes_read.load()));
    num("stallMs", static_cast<double>(c.stall_ns.load()) / 1e6);
    num("ioBusyMs", static_cast<double>(c.io_busy_ns.load()) / 1e6);
    num("ioErrors", static_cast<double>(c.io_errors.load()));
    num("cacheBytes", static_cast<double>(s.store.cache_bytes()));
    num("ioThreads", s.store.io_threads());
    num("ioDepth", s.store.io_depth());
    o.Set("direct", Napi::Boolean::New(env, s.store.all_direct()));
    return o;
  }

  Napi::Value ReadTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    pi::TensorPtr t = guarded(env, [&] { return s.store.get(get_int(info[0], "id")); });
    Napi::Uint8Array out = Napi::Uint8Array::New(env, t->bytes);
    if (t->cache) {
      guarded(env, [&] {
        t->cache->read_all(out.Data(), t->cache_part, t->bytes / static_cast<size_t>(t->cache->n_rows()));
        return 0;
      });
    } else if (t->bytes) {
      std::memcpy(out.Data(), t->data, t->bytes);
    }
    return out;
  }

  Napi::Value WriteTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    pi::TensorPtr t = guarded(env, [&] { return s.store.get(get_int(info[0], "id")); });
    const ViewBytes src = view_bytes(info[1]);
    double off = 0;
    if (info.Length() > 2 && info[2].IsNumber()) off = info[2].As<Napi::Number>().DoubleValue();
    if (t->mapped) throw_error(env, "BAD_TENSOR", "tensor " + std::to_string(t->id) + " is mapped from a file (read-only)");
    if (!(off >= 0) || off != static_cast<double>(static_cast<uint64_t>(off)) || off > static_cast<double>(t->bytes) ||
        src.bytes > t->bytes - static_cast<size_t>(off)) {
      throw_error(env, "BAD_TENSOR", "write of " + std::to_string(src.bytes) + " bytes at offset " + std::to_string(off) +
                                         " exceeds the tensor's " + std::to_string(t->bytes) + " bytes");
    }
    if (src.bytes) std::memmove(t->data + static_cast<size_t>(off), src.data, src.bytes);
    if (src.bytes) s.store.drop_packed(*t);  // the repacked copy no longer matches
    return env.Undefined();
  }

  Napi::Value FreeTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    guarded(env, [&] {
      s.store.release(get_int(info[0], "id"));
      return 0;
    });
    return env.Undefined();
  }

  Napi::Value AllocatedBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(live(info.Env()).store.allocated()));
  }
  // hugePageCopyBytes() → bytes of mapped weights held as huge-page copies
  Napi::Value HugePageCopyBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(live(info.Env()).store.copied()));
  }


  // copyPendingAsync() → Promise of the bytes copied
  Napi::Value CopyPendingAsync(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    live(env);
    auto* w = new CopyWorker(env, st_);
    Napi::Promise p = w->promise();
    w->Queue();
    return p;
  }
  // pendingCopyBytes() → bytes of reserved copies not made yet
  Napi::Value PendingCopyBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(live(info.Env()).store.pending_copy_bytes()));
  }

  Napi::Value SupportsOp(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int op = get_int(info[0], "op");
    std::vector<int> dts;
    if (info.Length() > 1 && info[1].IsArray()) {
      Napi::Array a = info[1].As<Napi::Array>();
      for (uint32_t i = 0; i < a.Length(); i++) dts.push_back(get_int(a.Get(i), "dtype"));
    }
    return Napi::Boolean::New(env, pi::supports_op(op, dts.data(), static_cast<int>(dts.size())));
  }

  Napi::Value Compute(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    State& s = live(env);
    GraphArgs args;
    args.parse(info, false);
    std::vector<double> rows;
    const auto t0 = std::chrono::steady_clock::now();
    guarded(env, [&] {
      s.exec.compute(args.g, rows);
      return 0;
    });
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return compute_result(env, rows, ms);
  }

  Napi::Value ComputeAsync(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    live(env);
    auto args = std::make_unique<GraphArgs>();
    args->parse(info, true);
    auto* w = new ComputeWorker(env, st_, std::move(args));
    Napi::Promise p = w->promise();
    w->Queue();
    return p;
  }

  Napi::Value Dispose(const Napi::CallbackInfo& info) {
    if (st_ && !st_->disposed) {
      st_->disposed = true;
      st_->store.clear();  // tensors used by in-flight work stay alive through their references
    }
    return info.Env().Undefined();
  }

  Napi::Value Threads(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), st_->exec.threads()); }
  Napi::Value Kernel(const Napi::CallbackInfo& info) { return Napi::String::New(info.Env(), st_->exec.kernel_name()); }
  Napi::Value KernelReason(const Napi::CallbackInfo& info) {
    return Napi::String::New(info.Env(), st_->exec.kernel_reason());
  }

  std::shared_ptr<State> st_;
};

Napi::Value CpuInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const pi::CpuFeatures f = pi::cpu_features();
  const char* reason = "";
  const pi::KernelTable& k = pi::select_kernels(false, &reason);
  Napi::Object o = Napi::Object::New(env);
  o.Set("avx2", f.avx2);
  o.Set("fma", f.fma);
  o.Set("f16c", f.f16c);
  o.Set("avx512f", f.avx512f);
  o.Set("kernel", k.name);
  o.Set("reason", reason);
  return o;
}

/// Reads a large F32 array with `threads` threads `iters` times; returns the best bytes/second.
Napi::Value BenchReadBandwidth(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const double bytes_d = info[0].As<Napi::Number>().DoubleValue();
  const int threads = get_int(info[1], "threads");
  const int iters = get_int(info[2], "iterations");
  const size_t n = static_cast<size_t>(bytes_d / 4);
  float* x = static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
  if (!x) throw_error(env, "OUT_OF_MEMORY", "bench buffer");
  for (size_t i = 0; i < n; i++) x[i] = static_cast<float>(i & 1023);
  pi::ThreadPool pool(threads);
  const char* reason = "";
  const pi::KernelTable& k = pi::select_kernels(false, &reason);
  struct Ctx {
    const float* x;
    size_t n;
    const pi::KernelTable* k;
    double sums[512];
  } ctx{x, n, &k, {}};
  double best = 0;
  for (int it = 0; it < iters; it++) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run(
        [](void* c, int ith, int nth) {
          Ctx* cx = static_cast<Ctx*>(c);
          const size_t b = cx->n * static_cast<size_t>(ith) / static_cast<size_t>(nth);
          const size_t e = cx->n * static_cast<size_t>(ith + 1) / static_cast<size_t>(nth);
          cx->sums[ith] = cx->k->sum_f32(cx->x + b, static_cast<int64_t>(e - b));
        },
        &ctx);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n) * 4 / s);
  }
  std::free(x);
  return Napi::Number::New(env, best);
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  exports.Set("Backend", Backend::Init(env));
  exports.Set("cpuInfo", Napi::Function::New<CpuInfo>(env, "cpuInfo"));
  exports.Set("benchReadBandwidth", Napi::Function::New<BenchReadBandwidth>(env, "benchReadBandwidth"));
  exports.Set("opCount", Napi::Number::New(env, pi::OP_COUNT));
  return exports;
}

}  // namespace

NODE_API_MODULE(powerinfer_cpu, Init)
