// Device runtime (runtime.h) over the CUDA runtime, the HIP runtime, or host memory (emulator).
// Every runtime call goes through PI_CHECK: a failure becomes a GpuError naming the call, with code
// OUT_OF_MEMORY when the device refused an allocation.
#include "port.h"
// port.h first
#include "runtime.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#ifndef PI_GPU_ARCHS
#define PI_GPU_ARCHS "unknown"
#endif

namespace pigpu {

const char* build_archs() { return PI_GPU_ARCHS; }

#if defined(PI_GPU_CUDA) || defined(PI_GPU_HIP)

#if defined(PI_GPU_CUDA)
#define PI_RT(name) cuda##name
using pi_error_t = cudaError_t;
using pi_props_t = cudaDeviceProp;
const char* platform() { return "cuda"; }
static bool is_oom(pi_error_t e) { return e == cudaErrorMemoryAllocation; }
#else
#define PI_RT(name) hip##name
using pi_error_t = hipError_t;
using pi_props_t = hipDeviceProp_t;
const char* platform() { return "rocm"; }
static bool is_oom(pi_error_t e) { return e == hipErrorOutOfMemory; }
#endif

namespace {

[[noreturn]] void fail(pi_error_t e, const char* call) {
  (void)PI_RT(GetLastError)();  // clear a non-sticky error so that the device stays usable
  throw GpuError(is_oom(e) ? "OUT_OF_MEMORY" : "UNAVAILABLE",
                 std::string(platform()) + ": " + call + ": " + PI_RT(GetErrorString)(e));
}

}  // namespace

#define PI_CHECK(call)                      \
  do {                                      \
    const pi_error_t pi_err_ = (call);      \
    if (pi_err_ != PI_RT(Success)) fail(pi_err_, #call); \
  } while (0)

namespace {

std::string arch_of(const pi_props_t& p) {
#if defined(PI_GPU_CUDA)
  return "sm_" + std::to_string(p.major) + std::to_string(p.minor);
#else
  std::string a = p.gcnArchName;  // e.g. "gfx90a:sramecc+:xnack-"
  const size_t colon = a.find(':');
  return colon == std::string::npos ? a : a.substr(0, colon);
#endif
}

/// Whether this build carries code the device can run, and why not.
bool arch_supported(const pi_props_t& p, std::string* why) {
  const std::string archs = build_archs();
#if defined(PI_GPU_CUDA)
  // SASS for sm_XY runs on sm_XZ with Z ≥ Y; PTX (compute_XY) is compiled by the driver for newer GPUs.
  const int cc = p.major * 10 + p.minor;
  int lowest = 1000;
  size_t pos = 0;
  while ((pos = archs.find("sm_", pos)) != std::string::npos) {
    const int v = std::atoi(archs.c_str() + pos + 3);
    if (v > 0 && v < lowest) lowest = v;
    pos += 3;
  }
  if (cc >= lowest) return true;
  *why = std::string(p.name) + " has compute capability " + std::to_string(p.major) + "." + std::to_string(p.minor) +
         "; this build has code for " + archs;
  return false;
#else
  const std::string a = arch_of(p);
  size_t pos = 0;
  while ((pos = archs.find(a, pos)) != std::string::npos) {
    const size_t end = pos + a.size();
    if ((pos == 0 || archs[pos - 1] == ' ') && (end == archs.size() || archs[end] == ' ')) return true;
    pos = end;
  }
  *why = std::string(p.name) + " is " + a + "; this build has code for " + archs +
         " (build with a ROCm that supports it and POWERINFER_ROCM_ARCHS)";
  return false;
#endif
}

DeviceProps props_of(int i, const pi_props_t& p) {
  DeviceProps d;
  d.index = i;
  d.name = p.name;
  d.arch = arch_of(p);
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.warp_size = p.warpSize;
  d.multiprocessors = p.multiProcessorCount;
  d.total_bytes = p.totalGlobalMem;
  d.free_bytes = p.totalGlobalMem;
  d.supported = arch_supported(p, &d.why);
  return d;
}

}  // namespace

ProbeReport probe() {
  ProbeReport r;
  try {
#if defined(PI_GPU_CUDA)
    void* drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!drv) {
      r.reason = "no NVIDIA driver";
      return r;
    }
    dlclose(drv);
#else
    if (access("/dev/kfd", F_OK) != 0) {
      r.reason = "no AMD GPU driver (/dev/kfd missing: amdgpu kernel driver not loaded)";
      return r;
    }
#endif
    (void)PI_RT(DriverGetVersion)(&r.driver_version);
    (void)PI_RT(RuntimeGetVersion)(&r.runtime_version);
    int n = 0;
    const pi_error_t e = PI_RT(GetDeviceCount)(&n);
#if defined(PI_GPU_CUDA)
    if (e == cudaErrorInsufficientDriver) {
      r.reason = "NVIDIA driver too old: it supports CUDA " + std::to_string(r.driver_version / 1000) + "." +
                 std::to_string(r.driver_version % 1000 / 10) + ", this build needs CUDA " +
                 std::to_string(r.runtime_version / 1000) + "." + std::to_string(r.runtime_version % 1000 / 10);
      return r;
    }
    if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
      r.reason = "no CUDA device";
      return r;
    }
#else
    if (e == hipErrorNoDevice || (e == hipSuccess && n == 0)) {
      r.reason = "no ROCm device";
      return r;
    }
#endif
    if (e != PI_RT(Success)) {
      (void)PI_RT(GetLastError)();
      r.reason = std::string(platform()) + " runtime: " + PI_RT(GetErrorString)(e);
      return r;
    }
    // Properties only: GetDeviceProperties creates no context (SetDevice + MemGetInfo would, on every
    // device, and leave the last one current). Free memory is read when a backend loads.
    for (int i = 0; i < n; i++) {
      pi_props_t p;
      if (PI_RT(GetDeviceProperties)(&p, i) != PI_RT(Success)) {
        (void)PI_RT(GetLastError)();
        continue;
      }
      DeviceProps d = props_of(i, p);
      d.free_known = false;
      r.devices.push_back(d);
    }
    bool any = false;
    for (const DeviceProps& d : r.devices) any = any || d.supported;
    if (!any) {
      r.reason = r.devices.empty() ? "no usable device" : r.devices[0].why;
      return r;
    }
    r.ok = true;
  } catch (const std::exception& ex) {
    r.ok = false;
    r.reason = ex.what();
  }
  return r;
}

namespace {
std::atomic<uint64_t> g_flags_set{0};  // bit d: device d's scheduling flags were asked for
}  // namespace

void set_device(int device) {
  PI_CHECK(PI_RT(SetDevice)(device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (!bit || (g_flags_set.fetch_or(bit) & bit)) return;
  const char* spin = std::getenv("POWERINFER_GPU_SPIN");
  if (spin && std::strcmp(spin, "1") == 0) return;
#if defined(PI_GPU_CUDA)
  const pi_error_t e = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
  // An already active context keeps its flags (another library made it first): not an error.
  if (e == cudaErrorSetOnActiveProcess) {
    (void)cudaGetLastError();
    return;
  }
#else
  const pi_error_t e = hipSetDeviceFlags(hipDeviceScheduleBlockingSync);
  if (e == hipErrorSetOnActiveProcess) {
    (void)hipGetLastError();
    return;
  }
#endif
  if (e != PI_RT(Success)) fail(e, "SetDeviceFlags(ScheduleBlockingSync)");
}

void* host_alloc_pinned(uint64_t bytes) {
  void* p = nullptr;
#if defined(PI_GPU_CUDA)
  PI_CHECK(cudaHostAlloc(&p, bytes == 0 ? 256 : bytes, cudaHostAllocDefault));
#else
  PI_CHECK(hipHostMalloc(&p, bytes == 0 ? 256 : bytes, hipHostMallocDefault));
#endif
  return p;
}

void host_free_pinned(void* p) noexcept {
#if defined(PI_GPU_CUDA)
  if (p) (void)cudaFreeHost(p);
#else
  if (p) (void)hipHostFree(p);
#endif
}

DeviceProps device_props(int device) {
  pi_props_t p;
  PI_CHECK(PI_RT(GetDeviceProperties)(&p, device));
  DeviceProps d = props_of(device, p);
  size_t fr = 0, tot = 0;
  PI_CHECK(PI_RT(MemGetInfo)(&fr, &tot));
  d.free_bytes = fr;
  d.total_bytes = tot;
  return d;
}

void mem_info(uint64_t* free_bytes, uint64_t* total_bytes) {
  size_t fr = 0, tot = 0;
  PI_CHECK(PI_RT(MemGetInfo)(&fr, &tot));
  *free_bytes = fr;
  *total_bytes = tot;
}

void* dev_alloc(uint64_t bytes) {
  void* p = nullptr;
  PI_CHECK(PI_RT(Malloc)(&p, bytes == 0 ? 256 : bytes));
  return p;
}

void dev_free(void* p) noexcept {
  if (p) (void)PI_RT(Free)(p);
}

void* stream_create() {
  pi_stream_t s;
  PI_CHECK(PI_RT(StreamCreateWithFlags)(&s, PI_RT(StreamNonBlocking)));
  return static_cast<void*>(s);
}

void stream_destroy(void* s) noexcept {
  if (s) (void)PI_RT(StreamDestroy)(static_cast<pi_stream_t>(s));
}

void stream_sync(void* s) { PI_CHECK(PI_RT(StreamSynchronize)(static_cast<pi_stream_t>(s))); }

void copy_h2d(void* dst, const void* src, uint64_t bytes, void* s) {
  if (bytes) PI_CHECK(PI_RT(MemcpyAsync)(dst, src, bytes, PI_RT(MemcpyHostToDevice), static_cast<pi_stream_t>(s)));
}

void copy_d2h(void* dst, const void* src, uint64_t bytes, void* s) {
  if (bytes) PI_CHECK(PI_RT(MemcpyAsync)(dst, src, bytes, PI_RT(MemcpyDeviceToHost), static_cast<pi_stream_t>(s)));
}

void copy_d2d(void* dst, const void* src, uint64_t bytes, void* s) {
  if (bytes) PI_CHECK(PI_RT(MemcpyAsync)(dst, src, bytes, PI_RT(MemcpyDeviceToDevice), static_cast<pi_stream_t>(s)));
}

void zero_async(void* dst, uint64_t bytes, void* s) {
  if (bytes) PI_CHECK(PI_RT(MemsetAsync)(dst, 0, bytes, static_cast<pi_stream_t>(s)));
}

void* event_create() {
#if defined(PI_GPU_CUDA)
  cudaEvent_t e;
#else
  hipEvent_t e;
#endif
  PI_CHECK(PI_RT(EventCreate)(&e));
  return static_cast<void*>(e);
}

void event_destroy(void* e) noexcept {
#if defined(PI_GPU_CUDA)
  if (e) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
#else
  if (e) (void)hipEventDestroy(static_cast<hipEvent_t>(e));
#endif
}

void event_record(void* e, void* s) {
#if defined(PI_GPU_CUDA)
  PI_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<pi_stream_t>(s)));
#else
  PI_CHECK(hipEventRecord(static_cast<hipEvent_t>(e), static_cast<pi_stream_t>(s)));
#endif
}

float event_elapsed_ms(void* start, void* end) {
  float ms = 0.0f;
#if defined(PI_GPU_CUDA)
  PI_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
  PI_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
#else
  PI_CHECK(hipEventSynchronize(static_cast<hipEvent_t>(end)));
  PI_CHECK(hipEventElapsedTime(&ms, static_cast<hipEvent_t>(start), static_cast<hipEvent_t>(end)));
#endif
  return ms;
}

void check_launch(const char* what) {
  const pi_error_t e = PI_RT(GetLastError)();
  if (e != PI_RT(Success)) fail(e, what);
}

void emu_configure(int, uint64_t) {}

#else  // PI_GPU_EMU: "device" memory is host memory, launches run synchronously on the CPU

namespace {
std::atomic<uint64_t> g_used{0};
std::atomic<uint64_t> g_total{uint64_t{8} << 30};
}  // namespace

const char* platform() { return "emu"; }

ProbeReport probe() {
  ProbeReport r;
  r.ok = true;
  r.devices.push_back(device_props(0));
  return r;
}

void set_device(int device) {
  if (device != 0) throw GpuError("UNAVAILABLE", "emu: no device " + std::to_string(device));
}

DeviceProps device_props(int device) {
  DeviceProps d;
  d.index = device;
  d.warp_size = piemu::warp_size();
  d.name = "SIMT emulator (warp " + std::to_string(d.warp_size) + ")";
  d.arch = "emulated";
  d.multiprocessors = 1;
  mem_info(&d.free_bytes, &d.total_bytes);
  return d;
}

void mem_info(uint64_t* free_bytes, uint64_t* total_bytes) {
  const uint64_t used = g_used.load(), total = g_total.load();
  *total_bytes = total;
  *free_bytes = used < total ? total - used : 0;
}

void* dev_alloc(uint64_t bytes) {
  const uint64_t size = (bytes + 255) / 256 * 256 + 256;  // header keeps the size
  const uint64_t used = g_used.fetch_add(size) + size;
  if (used > g_total.load()) {
    g_used.fetch_sub(size);
    throw GpuError("OUT_OF_MEMORY", "emu: dev_alloc(" + std::to_string(bytes) + "): out of memory");
  }
  void* p = std::aligned_alloc(256, size);
  if (!p) {
    g_used.fetch_sub(size);
    throw GpuError("OUT_OF_MEMORY", "emu: dev_alloc(" + std::to_string(bytes) + "): out of memory");
  }
  std::memcpy(p, &size, sizeof size);
  return static_cast<uint8_t*>(p) + 256;
}

void dev_free(void* p) noexcept {
  if (!p) return;
  uint8_t* base = static_cast<uint8_t*>(p) - 256;
  uint64_t size;
  std::memcpy(&size, base, sizeof size);
  g_used.fetch_sub(size);
  std::free(base);
}

void* host_alloc_pinned(uint64_t bytes) {
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!p) throw GpuError("OUT_OF_MEMORY", "emu: host_alloc_pinned(" + std::to_string(bytes) + "): out of memory");
  return p;
}
void host_free_pinned(void* p) noexcept { std::free(p); }

void* stream_create() { return nullptr; }
void stream_destroy(void*) noexcept {}
void stream_sync(void*) {}
void copy_h2d(void* dst, const void* src, uint64_t bytes, void*) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void copy_d2h(void* dst, const void* src, uint64_t bytes, void*) {
  if (bytes) std::memcpy(dst, src, bytes);
}
void copy_d2d(void* dst, const void* src, uint64_t bytes, void*) {
  if (bytes) std::memmove(dst, src, bytes);
}
void zero_async(void* dst, uint64_t bytes, void*) {
  if (bytes) std::memset(dst, 0, bytes);
}
void check_launch(const char*) {}

void* event_create() { return new std::chrono::steady_clock::time_point(); }
void event_destroy(void* e) noexcept { delete static_cast<std::chrono::steady_clock::time_point*>(e); }
void event_record(void* e, void*) { *static_cast<std::chrono::steady_clock::time_point*>(e) = std::chrono::steady_clock::now(); }
float event_elapsed_ms(void* start, void* end) {
  const auto a = *static_cast<std::chrono::steady_clock::time_point*>(start);
  const auto b = *static_cast<std::chrono::steady_clock::time_point*>(end);
  return std::chrono::duration<float, std::milli>(b - a).count();
}

void emu_configure(int warp_size, uint64_t memory_bytes) {
  if (warp_size) piemu::set_warp_size(warp_size);
  if (memory_bytes) g_total.store(memory_bytes);
}

#endif

}  // namespace pigpu
