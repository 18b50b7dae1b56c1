// The block scheduler of cudasim (see sim.h): the threads of a block are fibers on one OS thread,
// run in turn until each reaches a barrier, a warp exchange or its end; a barrier releases its
// waiters once every live thread of the block (or warp) has arrived. Blocks are spread over OS
// threads with OpenMP. Context switches are a few instructions on x86-64 (no system call), so a
// kernel of a million threads costs milliseconds of scheduling.
#include <sys/mman.h>

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cudasim/sim.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDASIM_ASAN 1
#else
#define CUDASIM_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cudasim {

namespace {

// Virtual size of a fiber's stack; the pages are committed only when touched.
constexpr std::size_t kStackBytes = std::size_t{256} << 10;
constexpr std::size_t kGuardBytes = 4096;

enum class FiberState : uint8_t { Ready, WaitBlock, WaitWarp, Done };

struct Fiber {
    ThreadState st{};
    FiberState state = FiberState::Ready;
    char* stack = nullptr;  // lowest usable address (above the guard page)
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
    void* fake_stack = nullptr;  // AddressSanitizer's bookkeeping across switches
};

struct Warp {
    int alive = 0, arrived = 0;
    unsigned gen = 0;
    alignas(16) unsigned char table[2][32 * kMaxExchangeBytes];
};

// One per OS thread: the fibers, stacks and barrier counts of the block it is running.
struct Worker {
    std::vector<char*> stacks;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    unsigned char* smem = nullptr;
    std::size_t smem_bytes = 0;
    Fiber* current = nullptr;
    const std::function<void()>* body = nullptr;
    const char* kernel = "";
    uint3 block_idx{};
    int alive = 0, block_arrived = 0;
#if defined(__x86_64__)
    void* sched_sp = nullptr;
#else
    ucontext_t sched_ctx;
#endif
    const void* sched_stack_bottom = nullptr;  // for AddressSanitizer
    std::size_t sched_stack_size = 0;
    void* sched_fake_stack = nullptr;

    ~Worker() {
        for (char* s : stacks) munmap(s - kGuardBytes, kStackBytes + kGuardBytes);
        std::free(smem);
    }
};

thread_local Worker tl_worker;

#if defined(__x86_64__)
extern "C" void cudasim_switch(void** save_sp, void* new_sp);
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp,
// loads new_sp and restores the registers saved there (System V x86-64 ABI).
asm(R"(
    .pushsection .text
    .globl cudasim_switch
    .type cudasim_switch, @function
    .p2align 4
cudasim_switch:
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
    .size cudasim_switch, .-cudasim_switch
    .popsection
)");
#endif

void start_switch(void** fake_save, const void* bottom, std::size_t size) {
#if CUDASIM_ASAN
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
    (void)fake_save, (void)bottom, (void)size;
#endif
}

void finish_switch(void* fake_save, const void** bottom_old, std::size_t* size_old) {
#if CUDASIM_ASAN
    __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
    (void)fake_save, (void)bottom_old, (void)size_old;
#endif
}

// From the running fiber back to the scheduler; returns when the scheduler resumes it.
void yield(Worker& w, Fiber& f) {
    start_switch(&f.fake_stack, w.sched_stack_bottom, w.sched_stack_size);
#if defined(__x86_64__)
    cudasim_switch(&f.sp, w.sched_sp);
#else
    swapcontext(&f.ctx, &w.sched_ctx);
#endif
    finish_switch(f.fake_stack, nullptr, nullptr);
}

void release_block(Worker& w) {
    w.block_arrived = 0;
    for (Fiber& f : w.fibers)
        if (f.state == FiberState::WaitBlock) f.state = FiberState::Ready;
}

void release_warp(Worker& w, unsigned warp) {
    Warp& wp = w.warps[warp];
    wp.arrived = 0;
    wp.gen++;
    const std::size_t first = (std::size_t)warp * 32;
    const std::size_t last = std::min(first + 32, w.fibers.size());
    for (std::size_t i = first; i < last; i++)
        if (w.fibers[i].state == FiberState::WaitWarp) w.fibers[i].state = FiberState::Ready;
}

[[noreturn]] void fiber_main() {
    Worker& w = tl_worker;
    finish_switch(nullptr, &w.sched_stack_bottom, &w.sched_stack_size);
    (*w.body)();
    Fiber& f = *w.current;
    f.state = FiberState::Done;
    w.alive--;
    Warp& wp = w.warps[f.st.warp];
    wp.alive--;
    // Threads that have left no longer hold back a barrier the others wait at.
    if (wp.alive > 0 && wp.arrived > 0 && wp.arrived == wp.alive) release_warp(w, f.st.warp);
    if (w.alive > 0 && w.block_arrived > 0 && w.block_arrived == w.alive) release_block(w);
    start_switch(nullptr, w.sched_stack_bottom, w.sched_stack_size);  // this stack is done
#if defined(__x86_64__)
    cudasim_switch(&f.sp, w.sched_sp);
#else
    setcontext(&w.sched_ctx);
#endif
    __builtin_unreachable();
}

char* new_stack() {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        std::fprintf(stderr, "cudasim: cannot map a fiber stack\n");
        std::abort();
    }
    mprotect(p, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting
    return static_cast<char*>(p) + kGuardBytes;
}

void prepare_fiber(Fiber& f) {
#if CUDASIM_ASAN
    __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
#if defined(__x86_64__)
    // The first switch pops six registers and returns into fiber_main with the stack as after a
    // call: 8 bytes below a 16-byte boundary.
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                               // fiber_main's return address (none)
    *--sp = reinterpret_cast<void*>(&fiber_main);  // where cudasim_switch returns to
    for (int i = 0; i < 6; i++) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

[[noreturn]] void deadlock(const Worker& w) {
    int at_block = 0, at_warp = 0, done = 0;
    for (const Fiber& f : w.fibers) {
        at_block += f.state == FiberState::WaitBlock;
        at_warp += f.state == FiberState::WaitWarp;
        done += f.state == FiberState::Done;
    }
    std::fprintf(stderr,
                 "cudasim: deadlock in kernel %s, block (%u,%u,%u): %d threads wait at "
                 "__syncthreads, %d at a warp collective, %d have finished; a barrier is not "
                 "reached by every thread of its block or warp\n",
                 w.kernel, w.block_idx.x, w.block_idx.y, w.block_idx.z, at_block, at_warp, done);
    std::abort();
}

void run_block(Worker& w, uint3 bid, dim3 grid, dim3 block, std::size_t smem) {
    const unsigned n = block.x * block.y * block.z;
    while (w.stacks.size() < n) w.stacks.push_back(new_stack());
    if (w.smem_bytes < smem) {
        std::free(w.smem);
        w.smem = static_cast<unsigned char*>(std::aligned_alloc(128, (smem + 127) / 128 * 128));
        w.smem_bytes = smem;
    }
    if (smem > 0) std::memset(w.smem, 0xA5, smem);  // shared memory starts undefined
    w.fibers.assign(n, Fiber{});
    w.warps.resize((n + 31) / 32);
    for (unsigned k = 0; k < w.warps.size(); k++) {
        w.warps[k].alive = (int)std::min(32u, n - 32 * k);
        w.warps[k].arrived = 0;
        w.warps[k].gen = 0;
    }
    for (unsigned i = 0; i < n; i++) {
        Fiber& f = w.fibers[i];
        f.st.thread_idx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        f.st.block_idx = bid;
        f.st.block_dim = block;
        f.st.grid_dim = grid;
        f.st.linear = i;
        f.st.lane = i % 32;
        f.st.warp = i / 32;
        f.stack = w.stacks[i];
        prepare_fiber(f);
    }
    w.block_idx = bid;
    w.alive = (int)n;
    w.block_arrived = 0;
    for (;;) {
        bool ran = false;
        for (Fiber& f : w.fibers) {
            if (f.state != FiberState::Ready) continue;
            ran = true;
            w.current = &f;
            start_switch(&w.sched_fake_stack, f.stack, kStackBytes);
#if defined(__x86_64__)
            cudasim_switch(&w.sched_sp, f.sp);
#else
            swapcontext(&w.sched_ctx, &f.ctx);
#endif
            finish_switch(w.sched_fake_stack, nullptr, nullptr);
        }
        if (w.alive == 0) break;
        if (!ran) deadlock(w);
    }
    w.current = nullptr;
}

int sim_threads() {
    static const int n = [] {
        const char* v = std::getenv("MEMTRAIN_SIM_THREADS");
        int t = v ? std::atoi(v) : 0;
        return t > 0 ? t : omp_get_max_threads();
    }();
    return n;
}

}  // namespace

const ThreadState& self() {
    return tl_worker.current->st;
}

void syncthreads() {
    Worker& w = tl_worker;
    Fiber& f = *w.current;
    if (++w.block_arrived == w.alive) {
        release_block(w);
        return;
    }
    f.state = FiberState::WaitBlock;
    yield(w, f);
}

const unsigned char* warp_exchange(const void* mine, std::size_t bytes) {
    Worker& w = tl_worker;
    Fiber& f = *w.current;
    Warp& wp = w.warps[f.st.warp];
    unsigned char* table = wp.table[wp.gen & 1];
    if (bytes > kMaxExchangeBytes) {
        std::fprintf(stderr, "cudasim: warp exchange of %zu bytes (at most %zu)\n", bytes,
                     kMaxExchangeBytes);
        std::abort();
    }
    if (bytes > 0) std::memcpy(table + f.st.lane * kMaxExchangeBytes, mine, bytes);
    if (++wp.arrived == wp.alive) {
        release_warp(w, f.st.warp);
    } else {
        f.state = FiberState::WaitWarp;
        yield(w, f);
    }
    return table;
}

void* dynamic_smem() {
    return tl_worker.smem;
}

cudaError_t launch(const char* name, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                   std::function<void()> body) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
        set_last_error(cudaErrorInvalidConfiguration);
        return cudaErrorInvalidConfiguration;
    }
    if (smem > 227 * 1024) {
        set_last_error(cudaErrorInvalidValue);
        return cudaErrorInvalidValue;
    }
    return enqueue(stream, [name, grid, block, smem, body = std::move(body)] {
        const int64_t nblocks = (int64_t)grid.x * grid.y * grid.z;
        const int nthreads = nblocks > 1 ? sim_threads() : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t b = 0; b < nblocks; b++) {
            Worker& w = tl_worker;
            w.body = &body;
            w.kernel = name;
            const uint3 bid{(unsigned)(b % grid.x), (unsigned)((b / grid.x) % grid.y),
                            (unsigned)(b / ((int64_t)grid.x * grid.y))};
            run_block(w, bid, grid, block, smem);
        }
    });
}

}  // namespace cudasim
