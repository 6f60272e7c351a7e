// The device runtime as the host code sees it: probing, memory, streams, copies. Implemented in
// runtime.cu over the CUDA runtime, the HIP runtime, or host memory for the emulator. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pigpu {

/// A failed device call. `code` is a backend error code: "OUT_OF_MEMORY" for an allocation that the
/// device refused, "UNAVAILABLE" for every other device fault.
struct GpuError : std::runtime_error {
  std::string code;
  GpuError(std::string c, const std::string& msg) : std::runtime_error(msg), code(std::move(c)) {}
};

struct DeviceProps {
  int index = 0;
  std::string name;
  /// "sm_90" (CUDA), "gfx90a" (ROCm), "emulated" (emulator).
  std::string arch;
  int cc_major = 0, cc_minor = 0;
  int warp_size = 32;
  int multiprocessors = 0;
  uint64_t free_bytes = 0, total_bytes = 0;
  /// False in probe(): free memory needs a context, which probe() never creates; free_bytes is then
  /// total_bytes. device_props() (a loaded backend) reads it.
  bool free_known = true;
  /// False when this build has no code for the device (then `why` says so).
  bool supported = true;
  std::string why;
};

struct ProbeReport {
  bool ok = false;
  /// Without the "unavailable: " prefix, e.g. "no NVIDIA driver"; empty when ok.
  std::string reason;
  std::vector<DeviceProps> devices;
  int driver_version = 0, runtime_version = 0;
};

/// "cuda", "rocm" or "emu".
const char* platform();
/// The device code targets of this build, e.g. "sm_80 sm_86 sm_89 sm_90 compute_90".
const char* build_archs();

/// Finds the driver, runtime and devices from their properties alone: it creates no context on any
/// device and leaves the calling thread's current device as it was. Never throws.
ProbeReport probe();

/// Makes `device` current for the calling thread. The first time per device (before its context
/// exists) it asks for blocking synchronisation (cudaDeviceScheduleBlockingSync /
/// hipDeviceScheduleBlockingSync): a host thread waiting for the GPU sleeps instead of spinning a core,
/// which the CPU half of hybrid execution needs. POWERINFER_GPU_SPIN=1 keeps the runtime's default.
void set_device(int device);
DeviceProps device_props(int device);
void mem_info(uint64_t* free_bytes, uint64_t* total_bytes);

/// Device memory, 256-byte aligned. @throws GpuError OUT_OF_MEMORY / UNAVAILABLE.
void* dev_alloc(uint64_t bytes);
void dev_free(void* p) noexcept;

void* stream_create();
void stream_destroy(void* s) noexcept;
void stream_sync(void* s);

/// Page-locked host memory (cudaHostAlloc / hipHostMalloc; plain memory on the emulator): copies from
/// and to it run as DMA without a staging copy in the driver. @throws GpuError.
void* host_alloc_pinned(uint64_t bytes);
void host_free_pinned(void* p) noexcept;

void copy_h2d(void* dst, const void* src, uint64_t bytes, void* stream);
void copy_d2h(void* dst, const void* src, uint64_t bytes, void* stream);
void copy_d2d(void* dst, const void* src, uint64_t bytes, void* stream);
void zero_async(void* dst, uint64_t bytes, void* stream);

/// Timing events on a stream (cudaEvent / hipEvent; host clock on the emulator, whose launches are
/// synchronous). event_elapsed_ms waits for `end` and gives the milliseconds between the two records.
void* event_create();
void event_destroy(void* e) noexcept;
void event_record(void* e, void* stream);
float event_elapsed_ms(void* start, void* end);

/// Checks the last kernel launch. @throws GpuError naming `what`.
void check_launch(const char* what);

/// Emulator only: warp size (32/64) and device memory size of the calling thread's launches.
void emu_configure(int warp_size, uint64_t memory_bytes);

}  // namespace pigpu
