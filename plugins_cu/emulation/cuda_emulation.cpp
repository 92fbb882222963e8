// CPU emulation of the CUDA execution model (see cuda_emulation.h), plus the handful of CUDA
// runtime calls the kernel library makes (memory, device queries, errors) on host memory.
#include "cuda_emulation.h"

#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <vector>

// Fiber switches: a minimal x86-64 stack switch (callee-saved registers only, no signal-mask
// system call), else ucontext, which AddressSanitizer understands.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define TL_EMU_FAST_SWITCH 1
extern "C" void tl_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .globl tl_emu_switch
    .hidden tl_emu_switch
    .type tl_emu_switch,@function
tl_emu_switch:
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
    .size tl_emu_switch, .-tl_emu_switch
)");
#else
#define TL_EMU_FAST_SWITCH 0
#endif

namespace tl_emu {

dim3 g_block_idx, g_grid_dim, g_block_dim;

namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kSlot = 64;

struct Copy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  char* stack = nullptr;
  uint3 tid;
  int linear = 0;
  bool done = false;
  std::vector<Copy> uncommitted;
  std::deque<std::vector<Copy>> groups;
};

struct WarpSync {
  int size = 32;
  int arrived = 0;
  unsigned gen = 0;
  alignas(16) unsigned char slots[2][32 * kSlot];
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<WarpSync> warps;
  int nthreads = 0;
  int arrived = 0;
  unsigned gen = 0;
  uint64_t serial = 0;
  uint64_t progress = 0;  // bumped whenever a fiber arrives somewhere or finishes
  bool failed = false;
};

#if !TL_EMU_FAST_SWITCH
ucontext_t g_scheduler;
#endif
void* g_scheduler_sp = nullptr;
Fiber* g_current = nullptr;
Block g_block;
const std::function<void()>* g_body = nullptr;
std::map<void*, uint64_t> g_poisoned;
std::mutex g_launch_mutex;
int g_last_error = 0;

void to_scheduler() {
#if TL_EMU_FAST_SWITCH
  tl_emu_switch(&g_current->sp, g_scheduler_sp);
#else
  swapcontext(&g_current->ctx, &g_scheduler);
#endif
}

void to_fiber(Fiber& f) {
  g_current = &f;
#if TL_EMU_FAST_SWITCH
  tl_emu_switch(&g_scheduler_sp, f.sp);
#else
  swapcontext(&g_scheduler, &f.ctx);
#endif
}

void yield() { to_scheduler(); }

// Land committed copy groups, oldest first, until at most `keep` remain pending.
void flush_copies(Fiber& f, size_t keep) {
  while (f.groups.size() > keep) {
    for (const Copy& c : f.groups.front()) {
      if (c.valid) memcpy(c.dst, c.src, 16);
      else memset(c.dst, 0, 16);
    }
    f.groups.pop_front();
  }
}

void trampoline() {
  (*g_body)();
  g_current->groups.push_back(std::move(g_current->uncommitted));  // never-committed copies
  g_current->uncommitted.clear();
  flush_copies(*g_current, 0);
  g_current->done = true;
  ++g_block.progress;
  to_scheduler();  // never resumed
}

// Wait until `gen` moves on; `arrived`/`expected` implement an arrive-and-wait barrier.
void barrier(int& arrived, unsigned& gen, int expected) {
  const unsigned my_gen = gen;
  ++g_block.progress;
  if (++arrived == expected) {
    arrived = 0;
    ++gen;
    return;
  }
  while (gen == my_gen && !g_block.failed) yield();
}

// Order in which a sweep resumes the threads: TL_EMU_SCHEDULE=forward (default), reverse, or
// shuffle (a new random order per sweep). Results must not depend on it; a kernel whose output
// changes with it has a race between two barriers.
enum class Schedule { kForward, kReverse, kShuffle };
Schedule schedule_from_env() {
  const char* s = getenv("TL_EMU_SCHEDULE");
  if (s && !strcmp(s, "reverse")) return Schedule::kReverse;
  if (s && !strcmp(s, "shuffle")) return Schedule::kShuffle;
  return Schedule::kForward;
}

int run_block(int nthreads, dim3 block) {
  Block& b = g_block;
  static const Schedule schedule = schedule_from_env();
  static std::mt19937 rng(12345);
  std::vector<int> order(nthreads);
  for (int t = 0; t < nthreads; ++t) order[t] = schedule == Schedule::kReverse ? nthreads - 1 - t : t;
  b.nthreads = nthreads;
  b.arrived = 0;
  ++b.gen;
  ++b.serial;
  b.failed = false;
  const int nwarps = (nthreads + 31) / 32;
  b.warps.assign(nwarps, WarpSync());
  for (int w = 0; w < nwarps; ++w) b.warps[w].size = std::min(32, nthreads - 32 * w);
  if (static_cast<int>(b.fibers.size()) < nthreads) b.fibers.resize(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = b.fibers[t];
    if (!f.stack) f.stack = static_cast<char*>(malloc(kStackBytes));
    f.linear = t;
    f.tid = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    f.done = false;
    f.uncommitted.clear();
    f.groups.clear();
#if TL_EMU_FAST_SWITCH
    // Initial frame for tl_emu_switch: six zeroed registers, then trampoline as the return
    // address, then a fake caller return address (16-byte alignment as after a call).
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top) - 8;
    for (int i = 0; i < 6; ++i) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void*>(&trampoline);
    frame[7] = nullptr;
    f.sp = frame;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
#endif
  }
  int alive = nthreads;
  while (alive > 0) {
    const uint64_t before = b.progress;
    alive = 0;
    if (schedule == Schedule::kShuffle) std::shuffle(order.begin(), order.end(), rng);
    for (int t : order) {
      Fiber& f = b.fibers[t];
      if (f.done) continue;
      to_fiber(f);
      if (!f.done) ++alive;
    }
    if (alive > 0 && b.progress == before) {
      // No fiber moved during a whole sweep: some threads wait at a barrier others never reach.
      fprintf(stderr, "tl_emu: deadlock in block (%u,%u,%u): divergent barrier or collective\n",
              g_block_idx.x, g_block_idx.y, g_block_idx.z);
      b.failed = true;
      for (int t = 0; t < nthreads; ++t) {  // let waiting fibers run to their end
        Fiber& f = b.fibers[t];
        if (f.done) continue;
        to_fiber(f);
      }
      return cudaErrorLaunchFailure;
    }
  }
  g_current = nullptr;
  return 0;
}

}  // namespace

const uint3& thread_idx() { return g_current->tid; }
int lane_id() { return g_current->linear & 31; }

int launch(dim3 grid, dim3 block, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  if (nthreads <= 0 || nthreads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    g_last_error = cudaErrorInvalidConfiguration;
    return g_last_error;
  }
  g_grid_dim = grid;
  g_block_dim = block;
  g_body = &body;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        g_block_idx = dim3(x, y, z);
        const int err = run_block(nthreads, block);
        if (err) {
          g_last_error = err;
          return err;
        }
      }
  return 0;
}

void syncthreads() {
  barrier(g_block.arrived, g_block.gen, g_block.nthreads);
}

const unsigned char* warp_exchange(const void* in, size_t bytes) {
  WarpSync& w = g_block.warps[g_current->linear >> 5];
  unsigned char* slots = w.slots[w.gen & 1];
  memcpy(slots + kSlot * lane_id(), in, bytes);
  barrier(w.arrived, w.gen, w.size);
  return slots;
}

void poison_shared_once(void* p, size_t bytes) {
  uint64_t& seen = g_poisoned[p];
  if (seen != g_block.serial) {
    memset(p, 0xFF, bytes);
    seen = g_block.serial;
  }
}

void cp_async(void* dst, const void* src, bool valid) {
  g_current->uncommitted.push_back(Copy{dst, src, valid});
}
void cp_commit() {
  g_current->groups.push_back(std::move(g_current->uncommitted));
  g_current->uncommitted.clear();
}
void cp_wait(int pending_allowed) { flush_copies(*g_current, static_cast<size_t>(pending_allowed)); }

namespace {
float to_float(uint16_t bits, bool is_bf16) {
  if (is_bf16) return __uint_as_float(static_cast<unsigned>(bits) << 16);
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
float element(uint32_t pair, int which, bool is_bf16) {
  return to_float(static_cast<uint16_t>(which ? pair >> 16 : pair & 0xffff), is_bf16);
}
}  // namespace

void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool is_bf16) {
  struct Rec {
    uint32_t a[4], b[2];
    float c[4];
  } mine;
  memcpy(mine.a, a, sizeof(mine.a));
  mine.b[0] = b0;
  mine.b[1] = b1;
  memcpy(mine.c, c, sizeof(mine.c));
  const unsigned char* all = warp_exchange(&mine, sizeof(Rec));
  auto rec = [&](int lane) {
    Rec r;
    memcpy(&r, all + kSlot * lane, sizeof(Rec));
    return r;
  };
  // PTX ISA layouts, g = lane / 4, t = lane % 4:
  //   A(row, k): lane (row % 8) * 4 + (k % 8) / 2, reg (row >= 8) + 2 * (k >= 8), half k % 2
  //   B(k, n):   lane n * 4 + (k % 8) / 2,         reg (k >= 8),                 half k % 2
  //   C(row, n): lane (row % 8) * 4 + n / 2,       reg 2 * (row >= 8) + n % 2
  auto A = [&](int row, int k) {
    return element(rec((row % 8) * 4 + (k % 8) / 2).a[(row >= 8) + 2 * (k >= 8)], k % 2, is_bf16);
  };
  auto B = [&](int k, int n) {
    return element(rec(n * 4 + (k % 8) / 2).b[k >= 8], k % 2, is_bf16);
  };
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >= 2), n = 2 * t + (i % 2);
    double acc = mine.c[i];
    for (int k = 0; k < 16; ++k) acc += static_cast<double>(A(row, k)) * B(k, n);
    out[i] = static_cast<float>(acc);
  }
  memcpy(c, out, sizeof(out));
}

void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) {
  const unsigned char* all = warp_exchange(&row_ptr, sizeof(row_ptr));
  auto row = [&](int lane) {
    const uint16_t* p;
    memcpy(&p, all + kSlot * lane, sizeof(p));
    return p;
  };
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
  for (int m = 0; m < 4; ++m) {  // matrix m: rows from lanes 8m..8m+7; lane gets (2t, g), (2t+1, g)
    const uint16_t lo = row(8 * m + 2 * t)[g], hi = row(8 * m + 2 * t + 1)[g];
    r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

}  // namespace tl_emu

// ---- CUDA runtime calls used by api.cu, on host memory ----
extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? 132 : 0;  // an H200's count
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  const int e = tl_emu::g_last_error;
  tl_emu::g_last_error = 0;
  return static_cast<cudaError_t>(e);
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error (CPU emulation)";
    case cudaErrorLaunchFailure: return "unspecified launch failure (CPU emulation: deadlock)";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (CPU emulation)";
    case cudaErrorMemoryAllocation: return "out of memory (CPU emulation)";
    default: return "CUDA error (CPU emulation)";
  }
}
cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* ptr) {
  free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void*, int, size_t) {
  *blocks = 4;  // what the default decode kernel gets on an H200 for GQA groups of 3-4
  return cudaSuccess;
}

}  // extern "C"
