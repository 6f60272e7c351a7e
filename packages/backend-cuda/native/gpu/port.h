// Portability layer of the GPU kernels: one kernel source (kernels.cu, runtime.cu) compiled three ways.
//
//   PI_GPU_CUDA  nvcc (CUDA runtime)                       — @powerinfer/backend-cuda
//   PI_GPU_HIP   hipcc, HIP_PLATFORM=amd (HIP runtime)     — @powerinfer/backend-rocm
//   PI_GPU_EMU   any C++17 compiler: kernels run on the CPU under the SIMT emulator of emu.h
//                (blocks one after another, each thread a fiber), for tests without a GPU
//
// Kernels never assume a warp of 32: PI_WARP is 32 on NVIDIA, the target's wavefront size on AMD
// (64 on gfx9, 32 on gfx10+/wave32), and whatever the emulator was configured with. Warp-level code
// goes through pi_shfl_xor / pi_warp_sum below; block sizes are multiples of 64 so that every block is
// a whole number of warps on every target.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(PI_GPU_EMU)
#include "emu.h"
#define PI_HD
#define PI_DEV
#define PI_KERNEL
#define PI_SHARED static thread_local
#define PI_WARP (::piemu::warp_size())
#define PI_LAUNCH(kernel, grid, block, stream, ...) \
  ::piemu::launch((grid), (block), (stream), [&]() { kernel(__VA_ARGS__); })
#define __syncthreads() ::piemu::syncthreads()
#define threadIdx (::piemu::current().thread)
#define blockIdx (::piemu::current().block)
#define blockDim (::piemu::current().block_dim)
#define gridDim (::piemu::current().grid_dim)
using pi_dim3 = ::piemu::Dim3;
using pi_stream_t = void*;

#elif defined(PI_GPU_HIP)
#include <hip/hip_runtime.h>
#define PI_HD __host__ __device__
#define PI_DEV __device__
#define PI_KERNEL __global__
#define PI_SHARED __shared__
// The wavefront size follows from the target, as the hardware defines it: 64 on GCN and CDNA (GFX8,
// GFX9: gfx8xx, gfx90x, gfx94x/95x), 32 on RDNA (gfx10+, compiled in wave32 mode, hipcc's default
// there). __AMDGCN_WAVEFRONT_SIZE is deprecated and gone from current ROCm, and warpSize is no longer a
// constant expression there; the family macros below are defined by clang for every AMDGPU target
// (checked with ROCm 5.2's clang: __GFX9__ for gfx906, __GFX10__ for gfx1030). The executor checks at
// run time that the device's warpSize equals PI_WARP (check_warp_size in kernels.h), so a gfx10+ build
// forced to wave64 (-mwavefrontsize64) fails at load instead of computing wrong sums.
#if defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX8__) || defined(__GFX9__) || defined(__gfx801__) || defined(__gfx802__) || defined(__gfx803__) || \
    defined(__gfx810__) || defined(__gfx900__) || defined(__gfx902__) || defined(__gfx904__) ||                    \
    defined(__gfx906__) || defined(__gfx908__) || defined(__gfx909__) || defined(__gfx90a__) ||                    \
    defined(__gfx90c__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)
#define PI_WARP 64
#else
#define PI_WARP 32
#endif
#else
#define PI_WARP 64  // host pass: never used to generate device code
#endif
#define PI_LAUNCH(kernel, grid, block, stream, ...) \
  hipLaunchKernelGGL(kernel, (grid), (block), 0, (stream), __VA_ARGS__)
using pi_dim3 = dim3;
using pi_stream_t = hipStream_t;

#elif defined(PI_GPU_CUDA)
#include <cuda_runtime.h>
#define PI_HD __host__ __device__
#define PI_DEV __device__
#define PI_KERNEL __global__
#define PI_SHARED __shared__
#define PI_WARP 32
#define PI_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
using pi_dim3 = dim3;
using pi_stream_t = cudaStream_t;

#else
#error "define one of PI_GPU_CUDA, PI_GPU_HIP, PI_GPU_EMU"
#endif

/// Exchanges `v` with lane (lane ^ mask) of the same warp; every lane of the warp must call it.
PI_DEV inline float pi_shfl_xor(float v, int mask) {
#if defined(PI_GPU_EMU)
  return ::piemu::shfl_xor(v, mask);
#elif defined(PI_GPU_HIP)
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

/// Sum over the lanes of a warp (every lane gets it).
PI_DEV inline float pi_warp_sum(float v) {
  for (int m = PI_WARP / 2; m > 0; m >>= 1) v += pi_shfl_xor(v, m);
  return v;
}

/// Maximum over the lanes of a warp (every lane gets it).
PI_DEV inline float pi_warp_max(float v) {
  for (int m = PI_WARP / 2; m > 0; m >>= 1) {
    const float o = pi_shfl_xor(v, m);
    v = o > v ? o : v;
  }
  return v;
}

/// 64-bit atomic add to a counter in device memory.
PI_DEV inline void pi_atomic_add_u64(unsigned long long* p, unsigned long long v) {
#if defined(PI_GPU_EMU)
  ::piemu::atomic_add(p, v);
#else
  atomicAdd(p, v);
#endif
}

/// Dot product of the four signed bytes of a and b, plus c (dp4a on NVIDIA sm_61+, v_dot4_i32_i8 on
/// the AMD targets that have it, plain integer arithmetic elsewhere: exact everywhere).
PI_DEV inline int pi_dp4a(int a, int b, int c) {
#if defined(PI_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  return __dp4a(a, b, c);
#elif defined(PI_GPU_HIP) && defined(__HIP_DEVICE_COMPILE__) && \
    (defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx1030__))
  return __builtin_amdgcn_sdot4(a, b, c, false);
#else
  for (int i = 0; i < 4; i++) {
    c += static_cast<int>(static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i))) *
         static_cast<int>(static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i)));
  }
  return c;
#endif
}

/// The warp size of the hardware the kernel runs on (what PI_WARP must equal).
PI_DEV inline int pi_hw_warp_size() {
#if defined(PI_GPU_EMU)
  return ::piemu::warp_size();
#else  // CUDA; HIP: a device variable (a constant before ROCm 7, a builtin read after)
  return warpSize;
#endif
}
