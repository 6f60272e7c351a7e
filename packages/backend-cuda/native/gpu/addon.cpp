// N-API surface of the GPU backends (node-addon-api, Node-API 8, C++ exceptions). One source for the
// CUDA, ROCm and emulator addons; they differ only in the runtime they link (runtime.cu).
//
// exports:
//   platform: "cuda" | "rocm" | "emu";  archs: the device code targets of this build
//   probe() → { ok, reason, driverVersion, runtimeVersion, devices: [{ index, name, arch, computeCapability,
//               warpSize, multiprocessors, freeMemory, totalMemory, supported, why }] }   (never throws)
//   Backend: new Backend({ device, memoryBudget, emuWarpSize, emuMemory })
//     createTensor(dtype, ne[], data?) → id        mapTensor(dtype, ne[], path, fileOffset, byteLength) → id (uploads)
//     readTensor(id) → Uint8Array   writeTensor(id, view, offset)   freeTensor(id)
//     allocatedBytes()  arenaBytes()  deviceInfo()  supportsOp(op, dtypes[])
//     compute(tensors, nodes, params, inputs[], outputs[]) → { rowsRead: Float64Array, elapsedMs }
//     computeAsync(same) → Promise of the same (runs on a libuv worker thread)
//     dispose()
// Errors are JS Errors with a `code` (a BackendErrorCode of core).
#include <napi.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "executor.h"
#include "graph.h"
#include "runtime.h"

namespace {

using pigpu::BackendErr;

Napi::Error coded_error(Napi::Env env, const std::string& code, const std::string& msg) {
  Napi::Error e = Napi::Error::New(env, msg);
  e.Set("code", Napi::String::New(env, code));
  return e;
}

[[noreturn]] void throw_coded(Napi::Env env, const std::string& code, const std::string& msg) {
  throw coded_error(env, code, msg);
}

/// Runs `f`, turning native exceptions into coded JS errors.
template <class F>
auto guarded(Napi::Env env, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Napi::Error&) {
    throw;
  } catch (const BackendErr& e) {
    throw_coded(env, e.code, e.what());
  } catch (const pigpu::GpuError& e) {
    throw_coded(env, e.code, e.what());
  } catch (const std::bad_alloc&) {
    throw_coded(env, "OUT_OF_MEMORY", "host memory exhausted");
  } catch (const std::exception& e) {
    throw_coded(env, "UNAVAILABLE", e.what());
  }
}

int64_t to_int(const Napi::Value& v, const char* what, int64_t lo, int64_t hi) {
  if (!v.IsNumber()) throw_coded(v.Env(), "BAD_TENSOR", std::string(what) + " must be a number");
  const double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi)) || d != static_cast<double>(static_cast<int64_t>(d))) {
    throw_coded(v.Env(), "BAD_TENSOR", std::string(what) + " must be an integer in " + std::to_string(lo) + ".." +
                                           std::to_string(hi));
  }
  return static_cast<int64_t>(d);
}

void to_shape(const Napi::Value& v, int64_t ne[4]) {
  if (!v.IsArray()) throw_coded(v.Env(), "BAD_TENSOR", "shape must be an array");
  Napi::Array a = v.As<Napi::Array>();
  if (a.Length() < 1 || a.Length() > 4) throw_coded(v.Env(), "BAD_TENSOR", "tensor rank must be 1..4");
  for (int d = 0; d < 4; d++) ne[d] = 1;
  for (uint32_t d = 0; d < a.Length(); d++) ne[d] = to_int(a.Get(d), "dimension", 1, int64_t{1} << 40);
}

struct Bytes {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

Bytes view_of(const Napi::Value& v) {
  if (v.IsTypedArray()) {
    Napi::TypedArray t = v.As<Napi::TypedArray>();
    return {static_cast<const uint8_t*>(t.ArrayBuffer().Data()) + t.ByteOffset(), t.ByteLength()};
  }
  if (v.IsDataView()) {
    Napi::DataView dv = v.As<Napi::DataView>();
    return {static_cast<const uint8_t*>(dv.ArrayBuffer().Data()) + dv.ByteOffset(), dv.ByteLength()};
  }
  throw_coded(v.Env(), "BAD_TENSOR", "expected an ArrayBufferView");
}

Napi::Object device_object(Napi::Env env, const pigpu::DeviceProps& d) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("index", d.index);
  o.Set("name", d.name);
  o.Set("arch", d.arch);
  o.Set("computeCapability", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor));
  o.Set("warpSize", d.warp_size);
  o.Set("multiprocessors", d.multiprocessors);
  o.Set("freeMemory", static_cast<double>(d.free_bytes));
  o.Set("freeMemoryKnown", d.free_known);
  o.Set("totalMemory", static_cast<double>(d.total_bytes));
  o.Set("supported", d.supported);
  o.Set("why", d.why);
  return o;
}

Napi::Value Probe(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const pigpu::ProbeReport r = pigpu::probe();
  Napi::Object o = Napi::Object::New(env);
  o.Set("ok", r.ok);
  o.Set("reason", r.reason);
  o.Set("driverVersion", r.driver_version);
  o.Set("runtimeVersion", r.runtime_version);
  Napi::Array devs = Napi::Array::New(env, r.devices.size());
  for (size_t i = 0; i < r.devices.size(); i++) devs.Set(static_cast<uint32_t>(i), device_object(env, r.devices[i]));
  o.Set("devices", devs);
  return o;
}

/// An encoded graph's arrays, and references that keep them alive while a worker thread computes.
struct GraphArgs {
  pigpu::WireGraph g;
  std::vector<Napi::Reference<Napi::Value>> refs;

  void keep(const Napi::Value& v) { refs.push_back(Napi::Persistent(v)); }

  void parse(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    auto typed = [&](int i, napi_typedarray_type type, const char* what) {
      if (!info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != type) {
        throw_coded(env, "BAD_GRAPH", std::string(what));
      }
      keep(info[i]);
      return info[i].As<Napi::TypedArray>();
    };
    if (info.Length() < 5) throw_coded(env, "BAD_GRAPH", "compute(tensors, nodes, params, inputs, outputs)");
    Napi::TypedArray t = typed(0, napi_int32_array, "tensors must be an Int32Array");
    Napi::TypedArray n = typed(1, napi_int32_array, "nodes must be an Int32Array");
    Napi::TypedArray p = typed(2, napi_float64_array, "params must be a Float64Array");
    g.tensors = reinterpret_cast<const int32_t*>(view_of(t).data);
    g.tensor_words = t.ElementLength();
    g.nodes = reinterpret_cast<const int32_t*>(view_of(n).data);
    g.node_words = n.ElementLength();
    g.params = reinterpret_cast<const double*>(view_of(p).data);
    g.n_params = p.ElementLength();
    if (!info[3].IsArray() || !info[4].IsArray()) throw_coded(env, "BAD_GRAPH", "inputs and outputs must be arrays");
    Napi::Array ins = info[3].As<Napi::Array>();
    for (uint32_t i = 0; i < ins.Length(); i++) {
      Napi::Value v = ins.Get(i);
      if (!v.IsTypedArray() && !v.IsDataView()) throw_coded(env, "BAD_GRAPH", "input " + std::to_string(i) + " is not an ArrayBufferView");
      const Bytes b = view_of(v);
      g.inputs.push_back({b.data, b.size});
      keep(v);
    }
    Napi::Array outs = info[4].As<Napi::Array>();
    for (uint32_t i = 0; i < outs.Length(); i++) {
      Napi::Value v = outs.Get(i);
      if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
        throw_coded(env, "BAD_GRAPH", "output " + std::to_string(i) + " is not a Float32Array");
      }
      const Bytes b = view_of(v);
      g.outputs.push_back({reinterpret_cast<float*>(const_cast<uint8_t*>(b.data)), b.size});
      keep(v);
    }
  }
};

Napi::Object result_object(Napi::Env env, const std::vector<double>& rows, double ms) {
  Napi::Object o = Napi::Object::New(env);
  Napi::Float64Array r = Napi::Float64Array::New(env, rows.size());
  for (size_t i = 0; i < rows.size(); i++) r[i] = rows[i];
  o.Set("rowsRead", r);
  o.Set("elapsedMs", ms);
  return o;
}

/// Computes on a worker thread; settles a promise with the result or a coded error.
class ComputeWorker : public Napi::AsyncWorker {
 public:
  ComputeWorker(Napi::Env env, std::shared_ptr<pigpu::Executor> ex, int emu_warp, std::unique_ptr<GraphArgs> args)
      : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), ex_(std::move(ex)), emu_warp_(emu_warp),
        args_(std::move(args)) {}

  Napi::Promise promise() { return deferred_.Promise(); }

  void Execute() override {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      pigpu::emu_configure(emu_warp_, 0);
      rows_ = ex_->compute(args_->g);
    } catch (const BackendErr& e) {
      code_ = e.code;
      msg_ = e.what();
    } catch (const pigpu::GpuError& e) {
      code_ = e.code;
      msg_ = e.what();
    } catch (const std::bad_alloc&) {
      code_ = "OUT_OF_MEMORY";
      msg_ = "host memory exhausted";
    } catch (const std::exception& e) {
      code_ = "UNAVAILABLE";
      msg_ = e.what();
    }
    ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  void OnOK() override {
    Napi::Env env = Env();
    if (!code_.empty()) {
      deferred_.Reject(coded_error(env, code_, msg_).Value());
      return;
    }
    deferred_.Resolve(result_object(env, rows_, ms_));
  }

  void OnError(const Napi::Error& e) override { deferred_.Reject(e.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  std::shared_ptr<pigpu::Executor> ex_;
  int emu_warp_;
  std::unique_ptr<GraphArgs> args_;
  std::vector<double> rows_;
  double ms_ = 0;
  std::string code_, msg_;
};

class Backend : public Napi::ObjectWrap<Backend> {
 public:
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, "Backend",
                       {InstanceMethod("createTensor", &Backend::CreateTensor),
                        InstanceMethod("mapTensor", &Backend::LoadTensor),
                        InstanceMethod("readTensor", &Backend::ReadTensor),
                        InstanceMethod("writeTensor", &Backend::WriteTensor),
                        InstanceMethod("freeTensor", &Backend::FreeTensor),
                        InstanceMethod("allocatedBytes", &Backend::AllocatedBytes),
                        InstanceMethod("arenaBytes", &Backend::ArenaBytes),
                        InstanceMethod("deviceInfo", &Backend::DeviceInfo),
                        InstanceMethod("supportsOp", &Backend::SupportsOp),
                        InstanceMethod("compute", &Backend::Compute),
                        InstanceMethod("computeAsync", &Backend::ComputeAsync),
                        InstanceMethod("dispose", &Backend::Dispose)});
  }

  explicit Backend(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Backend>(info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1 || !info[0].IsObject()) throw_coded(env, "UNAVAILABLE", "new Backend({ device, memoryBudget })");
    Napi::Object o = info[0].As<Napi::Object>();
    const int device = static_cast<int>(to_int(o.Get("device"), "device", 0, 1023));
    const double budget = o.Get("memoryBudget").IsNumber() ? o.Get("memoryBudget").As<Napi::Number>().DoubleValue() : -1;
    emu_warp_ = o.Get("emuWarpSize").IsNumber() ? o.Get("emuWarpSize").As<Napi::Number>().Int32Value() : 0;
    const double emu_mem = o.Get("emuMemory").IsNumber() ? o.Get("emuMemory").As<Napi::Number>().DoubleValue() : 0;
    guarded(env, [&] {
      pigpu::emu_configure(emu_warp_, emu_mem > 0 ? static_cast<uint64_t>(emu_mem) : 0);
      ex_ = std::make_shared<pigpu::Executor>(device, budget < 0 || budget >= 1.8e19 ? UINT64_MAX
                                                                                      : static_cast<uint64_t>(budget));
      return 0;
    });
  }

 private:
  pigpu::Executor& ex(Napi::Env env) {
    if (!ex_) throw_coded(env, "DISPOSED", "the backend was disposed");
    return *ex_;
  }

  Napi::Value CreateTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int dtype = static_cast<int>(to_int(info[0], "dtype", 0, 255));
    int64_t ne[4];
    to_shape(info[1], ne);
    Bytes b;
    if (info.Length() > 2 && !info[2].IsUndefined()) b = view_of(info[2]);
    return guarded(env, [&] {
      return Napi::Number::New(env, ex(env).create(dtype, ne, b.data, b.size));
    });
  }

  Napi::Value LoadTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int dtype = static_cast<int>(to_int(info[0], "dtype", 0, 255));
    int64_t ne[4];
    to_shape(info[1], ne);
    if (!info[2].IsString()) throw_coded(env, "IO", "path must be a string");
    const std::string path = info[2].As<Napi::String>().Utf8Value();
    const int64_t off = to_int(info[3], "fileOffset", 0, int64_t{1} << 52);
    const int64_t len = to_int(info[4], "byteLength", 0, int64_t{1} << 52);
    return guarded(env, [&] {
      return Napi::Number::New(env, ex(env).create_from_file(dtype, ne, path, static_cast<uint64_t>(off),
                                                             static_cast<uint64_t>(len)));
    });
  }

  Napi::Value ReadTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int id = static_cast<int>(to_int(info[0], "tensor id", 0, INT32_MAX));
    return guarded(env, [&] {
      const std::vector<uint8_t> bytes = ex(env).read(id);
      Napi::Uint8Array out = Napi::Uint8Array::New(env, bytes.size());
      if (!bytes.empty()) std::memcpy(out.Data(), bytes.data(), bytes.size());
      return out;
    });
  }

  Napi::Value WriteTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int id = static_cast<int>(to_int(info[0], "tensor id", 0, INT32_MAX));
    const Bytes b = view_of(info[1]);
    const int64_t off = info.Length() > 2 && !info[2].IsUndefined() ? to_int(info[2], "offset", 0, int64_t{1} << 52) : 0;
    guarded(env, [&] {
      ex(env).write(id, b.data, b.size, static_cast<uint64_t>(off));
      return 0;
    });
    return env.Undefined();
  }

  Napi::Value FreeTensor(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int id = static_cast<int>(to_int(info[0], "tensor id", 0, INT32_MAX));
    guarded(env, [&] {
      ex(env).free(id);
      return 0;
    });
    return env.Undefined();
  }

  Napi::Value AllocatedBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(ex(info.Env()).allocated()));
  }

  Napi::Value ArenaBytes(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(ex(info.Env()).arena_bytes()));
  }

  Napi::Value DeviceInfo(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guarded(env, [&] {
      pigpu::emu_configure(emu_warp_, 0);
      return device_object(env, ex(env).props());
    });
  }

  Napi::Value SupportsOp(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const int op = static_cast<int>(to_int(info[0], "op", 0, 1000));
    std::vector<int> dts;
    if (info.Length() > 1 && info[1].IsArray()) {
      Napi::Array a = info[1].As<Napi::Array>();
      for (uint32_t i = 0; i < a.Length(); i++) dts.push_back(static_cast<int>(to_int(a.Get(i), "dtype", 0, 255)));
    }
    return Napi::Boolean::New(env, pigpu::supports_op(op, dts.data(), static_cast<int>(dts.size())));
  }

  Napi::Value Compute(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    GraphArgs a;
    a.parse(info);
    return guarded(env, [&] {
      const auto t0 = std::chrono::steady_clock::now();
      pigpu::emu_configure(emu_warp_, 0);
      const std::vector<double> rows = ex(env).compute(a.g);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      return result_object(env, rows, ms);
    });
  }

  Napi::Value ComputeAsync(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    ex(env);
    auto a = std::make_unique<GraphArgs>();
    a->parse(info);
    auto* w = new ComputeWorker(env, ex_, emu_warp_, std::move(a));
    Napi::Promise p = w->promise();
    w->Queue();
    return p;
  }

  Napi::Value Dispose(const Napi::CallbackInfo& info) {
    ex_.reset();  // an in-flight computeAsync keeps its own reference until it settles
    return info.Env().Undefined();
  }

  std::shared_ptr<pigpu::Executor> ex_;
  int emu_warp_ = 0;
};

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  exports.Set("platform", Napi::String::New(env, pigpu::platform()));
  exports.Set("archs", Napi::String::New(env, pigpu::build_archs()));
  exports.Set("probe", Napi::Function::New(env, Probe));
  exports.Set("Backend", Backend::Init(env));
  return exports;
}

}  // namespace

NODE_API_MODULE(NODE_GYP_MODULE_NAME, Init)
