// A small SIMT emulator that runs the GPU kernels on the CPU (PI_GPU_EMU builds, for tests).
//
// A launch runs its blocks one after another on the calling thread; inside a block every GPU thread
// is a fiber with its own stack. __syncthreads() is a block barrier, warp shuffles are warp barriers
// with a slot per lane: a fiber runs until it reaches a barrier, and a barrier opens when every
// thread it concerns has reached it. A thread that exits while others wait at a barrier, or warps
// that wait at different barriers forever, are reported as errors (on a GPU they hang or corrupt):
// the emulator makes kernels prove that they synchronise correctly for any warp size (32 or 64).
//
// `__shared__` variables are `static thread_local` (one block runs at a time per OS thread).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>

namespace piemu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr Dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/// What a kernel sees as threadIdx/blockIdx/blockDim/gridDim.
struct ThreadState {
  Dim3 thread, block, block_dim, grid_dim;
};

/// A kernel fault found by the emulator (barrier divergence, bad launch configuration).
struct EmuError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The calling fiber's state (only valid inside a kernel).
const ThreadState& current();

/// Lanes per warp of the emulated device (32 or 64; default 32, or $POWERINFER_GPU_EMU_WARP).
int warp_size();
/// Sets the warp size of launches made by this OS thread from now on.
void set_warp_size(int w);

/// Block barrier.
void syncthreads();

/// The value `bits` of lane (lane ^ mask) of the calling warp; every lane of the warp must call it.
uint64_t exchange_xor(uint64_t bits, int mask);

inline float shfl_xor(float v, int mask) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  const uint32_t r = static_cast<uint32_t>(exchange_xor(b, mask));
  float o;
  std::memcpy(&o, &r, 4);
  return o;
}

inline void atomic_add(unsigned long long* p, unsigned long long v) { *p += v; }

/// Runs `body` as a kernel over grid × block; returns when every block has finished (the stream is
/// ignored: launches are synchronous). @throws EmuError on a bad configuration or a synchronisation fault.
void launch(Dim3 grid, Dim3 block, const void* stream, const std::function<void()>& body);

/// Kernel launches and fiber switches made by this OS thread (for tests and benchmarks).
struct Stats {
  uint64_t launches = 0, blocks = 0, switches = 0;
};
Stats stats();

}  // namespace piemu
