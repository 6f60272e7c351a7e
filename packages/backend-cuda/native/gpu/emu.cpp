// SIMT emulator (see emu.h): blocks run one after another, the threads of a block as ucontext fibers.
#include "emu.h"

#include <sys/mman.h>

// Fiber switches: a few instructions of assembly on x86-64 (swapcontext costs a signal-mask system
// call per switch); ucontext elsewhere.
#if defined(__x86_64__) && !defined(PI_EMU_UCONTEXT)
#define PI_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#if defined(PI_EMU_ASM_SWITCH)
// pi_emu_switch(save, load): pushes the callee-saved registers, stores the stack pointer in *save,
// loads `load` as the stack pointer, pops the registers saved there and returns into that context.
extern "C" void pi_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl pi_emu_switch
  .type pi_emu_switch, @function
pi_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pi_emu_switch, .-pi_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace piemu {
namespace {

/// A saved execution context.
struct Context {
#if defined(PI_EMU_ASM_SWITCH)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

void switch_to(Context& save, Context& load) {
#if defined(PI_EMU_ASM_SWITCH)
  pi_emu_switch(&save.sp, load.sp);
#else
  swapcontext(&save.uc, &load.uc);
#endif
}

constexpr size_t kStackBytes = 256 * 1024;
constexpr unsigned kMaxThreads = 1024;

enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };

struct Fiber {
  Context ctx;
  ThreadState st;
  State state = READY;
  uint64_t slot = 0;    // value offered to a warp exchange
  int mask = 0;         // xor mask of that exchange
  uint64_t result = 0;  // value received
  char* stack = nullptr;
};

struct Scheduler {
  Context main;
  std::vector<Fiber> fibers;
  int cur = -1;
  int warp = 0;
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;
  Stats stats;

  ~Scheduler() {
    for (Fiber& f : fibers)
      if (f.stack) munmap(f.stack, kStackBytes);
  }
};

int default_warp() {
  const char* e = std::getenv("POWERINFER_GPU_EMU_WARP");
  if (e && std::string(e) == "64") return 64;
  return 32;
}

thread_local Scheduler* t_sched = nullptr;
thread_local int t_warp = 0;

Scheduler& sched() {
  if (!t_sched) t_sched = new Scheduler();  // one per OS thread, lives as long as the thread
  return *t_sched;
}

Fiber& me() {
  if (!t_sched || t_sched->cur < 0) throw EmuError("emulator: a device function was called outside a kernel");
  return t_sched->fibers[static_cast<size_t>(t_sched->cur)];
}

void yield_to_scheduler(Fiber& f) {
  t_sched->stats.switches++;
  switch_to(f.ctx, t_sched->main);
}

void fiber_entry() {
  Scheduler& s = *t_sched;
  Fiber& f = s.fibers[static_cast<size_t>(s.cur)];
  try {
    (*s.body)();
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
  }
  f.state = DONE;
  switch_to(f.ctx, s.main);  // never resumed
}

/// Prepares f.ctx so that switching to it calls fiber_entry on f's stack.
void start_context(Fiber& f) {
#if defined(PI_EMU_ASM_SWITCH)
  // 16-byte aligned top; below it a null "return address" (fiber_entry never returns), the address
  // pi_emu_switch returns to, and six zeroed callee-saved registers.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&fiber_entry);
  for (int i = 0; i < 6; i++) *--sp = nullptr;
  f.ctx.sp = sp;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = kStackBytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_entry, 0);
#endif
}

std::string where(const Fiber& f) {
  return "block (" + std::to_string(f.st.block.x) + "," + std::to_string(f.st.block.y) + "," +
         std::to_string(f.st.block.z) + ") thread (" + std::to_string(f.st.thread.x) + "," +
         std::to_string(f.st.thread.y) + "," + std::to_string(f.st.thread.z) + ")";
}

void run_block(Scheduler& s, size_t n) {
  const size_t w = static_cast<size_t>(s.warp);
  for (;;) {
    for (size_t i = 0; i < n; i++) {
      if (s.fibers[i].state != READY) continue;
      s.cur = static_cast<int>(i);
      s.stats.switches++;
      switch_to(s.main, s.fibers[i].ctx);
      s.cur = -1;
      if (s.error) std::rethrow_exception(s.error);
    }
    size_t done = 0, at_block = 0;
    for (size_t i = 0; i < n; i++) {
      done += s.fibers[i].state == DONE;
      at_block += s.fibers[i].state == WAIT_BLOCK;
    }
    if (done == n) return;
    if (at_block == n) {
      for (size_t i = 0; i < n; i++) s.fibers[i].state = READY;
      continue;
    }
    bool released = false;
    for (size_t base = 0; base < n; base += w) {
      bool all = true;
      for (size_t l = 0; l < w && all; l++) all = s.fibers[base + l].state == WAIT_WARP;
      if (!all) continue;
      const int mask = s.fibers[base].mask;
      for (size_t l = 0; l < w; l++) {
        Fiber& f = s.fibers[base + l];
        if (f.mask != mask) throw EmuError("emulator: lanes of one warp shuffle with different masks at " + where(f));
        f.result = s.fibers[base + (l ^ static_cast<size_t>(mask))].slot;
      }
      for (size_t l = 0; l < w; l++) s.fibers[base + l].state = READY;
      released = true;
    }
    if (released) continue;
    // Nothing can move: some threads wait at a barrier that others will never reach.
    for (size_t i = 0; i < n; i++) {
      const Fiber& f = s.fibers[i];
      if (f.state == WAIT_BLOCK || f.state == WAIT_WARP) {
        throw EmuError(std::string("emulator: barrier divergence: ") + where(f) + " waits at " +
                       (f.state == WAIT_BLOCK ? "__syncthreads" : "a warp shuffle") + " (" + std::to_string(done) +
                       " of " + std::to_string(n) + " threads exited, " + std::to_string(at_block) +
                       " wait at __syncthreads), which the others never reach");
      }
    }
    throw EmuError("emulator: scheduler stalled");
  }
}

}  // namespace

const ThreadState& current() { return me().st; }

int warp_size() {
  if (t_sched && t_sched->cur >= 0) return t_sched->warp;
  if (!t_warp) t_warp = default_warp();
  return t_warp;
}

void set_warp_size(int w) {
  if (w != 32 && w != 64) throw EmuError("emulator: warp size must be 32 or 64");
  t_warp = w;
}

void syncthreads() {
  Fiber& f = me();
  f.state = WAIT_BLOCK;
  yield_to_scheduler(f);
}

uint64_t exchange_xor(uint64_t bits, int mask) {
  Fiber& f = me();
  if (mask <= 0 || mask >= t_sched->warp) throw EmuError("emulator: shuffle mask outside the warp at " + where(f));
  f.slot = bits;
  f.mask = mask;
  f.state = WAIT_WARP;
  yield_to_scheduler(f);
  return f.result;
}

void launch(Dim3 grid, Dim3 block, const void*, const std::function<void()>& body) {
  Scheduler& s = sched();
  if (s.cur >= 0) throw EmuError("emulator: kernel launched from inside a kernel");
  const unsigned long long n = static_cast<unsigned long long>(block.x) * block.y * block.z;
  const int w = warp_size();
  if (n == 0 || n > kMaxThreads) throw EmuError("emulator: block of " + std::to_string(n) + " threads");
  if (n % static_cast<unsigned>(w) != 0) {
    throw EmuError("emulator: block of " + std::to_string(n) + " threads is not a whole number of " +
                   std::to_string(w) + "-lane warps");
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw EmuError("emulator: bad grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
                   std::to_string(grid.z) + ")");
  }
  s.warp = w;
  s.body = &body;
  s.error = nullptr;
  s.stats.launches++;
  if (s.fibers.size() < n) s.fibers.resize(n);
  for (size_t i = 0; i < n; i++) {
    if (!s.fibers[i].stack) {
      void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw EmuError("emulator: cannot map a fiber stack");
      s.fibers[i].stack = static_cast<char*>(p);
    }
  }
  for (unsigned bz = 0; bz < grid.z; bz++) {
    for (unsigned by = 0; by < grid.y; by++) {
      for (unsigned bx = 0; bx < grid.x; bx++) {
        s.stats.blocks++;
        size_t i = 0;
        for (unsigned tz = 0; tz < block.z; tz++) {
          for (unsigned ty = 0; ty < block.y; ty++) {
            for (unsigned tx = 0; tx < block.x; tx++, i++) {
              Fiber& f = s.fibers[i];
              f.st.thread = Dim3(tx, ty, tz);
              f.st.block = Dim3(bx, by, bz);
              f.st.block_dim = block;
              f.st.grid_dim = grid;
              f.state = READY;
              start_context(f);
            }
          }
        }
        try {
          run_block(s, n);
        } catch (...) {
          s.cur = -1;
          throw;
        }
      }
    }
  }
}

Stats stats() { return t_sched ? t_sched->stats : Stats{}; }

}  // namespace piemu
