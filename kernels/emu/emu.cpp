// The runtime of the CPU emulator of CUDA (see emu.h): fibers, the per-block scheduler,
// __syncthreads and the warp collectives.
//
// A launch runs on the calling OS thread. Each block runs to completion before the next
// starts; within a block every CUDA thread is a fiber on its own stack, and the scheduler
// runs the ready fibers in order, each until it waits (a barrier, a warp collective) or
// returns. A barrier releases its threads when its last participant arrives: it is then
// that the values of a collective are exchanged, all at once. Fibers and their stacks are
// kept per OS thread and reused by later blocks and launches.
#if defined(__APPLE__)
// ucontext (the fallback below) is behind the X/Open API there.
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif

#include "emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__ELF__) && !defined(TK_EMU_UCONTEXT)
#define TK_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace tk_emu {

__thread const Builtins* tls_builtins = nullptr;

namespace {

constexpr unsigned kWarp = 32;
constexpr unsigned kMaxThreads = 1024;
// Stack of one CUDA thread, above a guard page.
constexpr size_t kStackBytes = 256 * 1024;
// The most dynamic shared memory a block may ask for (an H100's opt-in maximum).
constexpr unsigned kMaxDynamicShared = 227 * 1024;

// ---------------------------------------------------------------------------------------
// Contexts.

#if TK_EMU_ASM_SWITCH

// x86-64 System V: the callee-saved registers, the SSE and x87 control words, the stack
// pointer. No signal mask (swapcontext's system call), so a switch costs a few
// nanoseconds.
struct Context {
    void* sp = nullptr;
};

extern "C" void tk_emu_switch_context(void** save_sp, void* next_sp);
asm(R"(
    .pushsection .text
    .globl tk_emu_switch_context
    .hidden tk_emu_switch_context
    .type tk_emu_switch_context, @function
    .p2align 4
tk_emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tk_emu_switch_context, .-tk_emu_switch_context
    .popsection
)");

inline void switch_context(Context& from, Context& to) { tk_emu_switch_context(&from.sp, to.sp); }

// A context that starts `entry` (which never returns) on the stack [base, base + size).
void init_context(Context& ctx, char* base, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 9;
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    std::memset(sp, 0, 9 * sizeof(uint64_t));
    std::memcpy(reinterpret_cast<char*>(sp), &mxcsr, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
    // sp[1..6]: r15, r14, r13, r12, rbx, rbp; sp[7]: where `ret` goes; sp[8]: the return
    // address of `entry`'s frame (none). At entry, rsp = top - 8, as after a call.
    sp[7] = reinterpret_cast<uint64_t>(entry);
    ctx.sp = sp;
}

#else

struct Context {
    ucontext_t uc;
};

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

void init_context(Context& ctx, char* base, size_t size, void (*entry)()) {
    getcontext(&ctx.uc);
    ctx.uc.uc_stack.ss_sp = base;
    ctx.uc.uc_stack.ss_size = size;
    ctx.uc.uc_link = nullptr;
    makecontext(&ctx.uc, entry, 0);
}

#endif

// ---------------------------------------------------------------------------------------
// Threads, blocks, launches.

enum class State : uint8_t { Ready, Running, WaitBlock, WaitWarp, Exited };

struct Fiber {
    Context ctx;
    char* mapping = nullptr;  // guard page + stack
    // At the top of its loop, ready to run a new CUDA thread; false while a thread runs
    // on it (and after a failed launch left it in the middle of one).
    bool fresh = false;
    Builtins builtins{};
    unsigned linear = 0;
    State state = State::Ready;
    // What it waits at.
    int op = 0;
    unsigned mask = 0;
    uint64_t value = 0;
    int b = 0, c = 0;
    const char* file = "";
    int line = 0;
    uint64_t result = 0;

    ~Fiber() {
        if (mapping != nullptr) munmap(mapping, kStackBytes + page_size());
    }
    static size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }
};

struct Launch {
    const char* kernel;
    void (*body)(void*);
    void* ctx;
    dim3 grid, block;
    unsigned n;  // threads per block
    unsigned shared_bytes;
    uint3 block_idx;
    // Ready fibers, a ring of n (a fiber is queued at most once).
    std::vector<unsigned> queue;
    unsigned head = 0, count = 0;
    unsigned live = 0;          // threads of the block that have not exited
    unsigned waiting_block = 0;  // threads at __syncthreads
    bool failed = false;
    std::string error;
};

struct Runtime {
    std::vector<std::unique_ptr<Fiber>> fibers;
    Context scheduler;
    Launch* launch = nullptr;
    Fiber* current = nullptr;
    unsigned char* dynamic_shared = nullptr;

    ~Runtime() { std::free(dynamic_shared); }
};

thread_local Runtime runtime;

void fiber_main();

const char* op_name(Op op) {
    switch (op) {
        case Op::ShflIdx: return "__shfl_sync";
        case Op::ShflUp: return "__shfl_up_sync";
        case Op::ShflDown: return "__shfl_down_sync";
        case Op::ShflXor: return "__shfl_xor_sync";
        case Op::SyncWarp: return "__syncwarp";
        case Op::Ballot: return "__ballot_sync";
        case Op::Any: return "__any_sync";
        case Op::All: return "__all_sync";
    }
    return "?";
}

const char* block_op_name(BlockOp op) {
    switch (op) {
        case BlockOp::Sync: return "__syncthreads";
        case BlockOp::Count: return "__syncthreads_count";
        case BlockOp::And: return "__syncthreads_and";
        case BlockOp::Or: return "__syncthreads_or";
    }
    return "?";
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

std::string dims(uint3 v) { return format("(%u, %u, %u)", v.x, v.y, v.z); }

void write_error(const std::string& message, char* err, size_t err_len) {
    if (err == nullptr || err_len == 0) return;
    size_t n = message.size() < err_len - 1 ? message.size() : err_len - 1;
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
}

// Where the running thread is, for messages.
std::string here(const Launch& l, const Fiber& f) {
    return format("kernel %s, block %s, thread %s", l.kernel, dims(l.block_idx).c_str(),
                  dims(f.builtins.thread_idx).c_str());
}

void push(Launch& l, unsigned i) {
    l.queue[(l.head + l.count) % l.n] = i;
    ++l.count;
}

bool pop(Launch& l, unsigned& i) {
    if (l.count == 0) return false;
    i = l.queue[l.head];
    l.head = (l.head + 1) % l.n;
    --l.count;
    return true;
}

// Gives the OS thread back to the scheduler; returns when this fiber is run again.
void yield(Runtime& r, Fiber& f) { switch_context(f.ctx, r.scheduler); }

// Fails the launch from the running fiber, which is never resumed.
[[noreturn]] void abort_launch(Runtime& r, Fiber& f, const std::string& message) {
    r.launch->failed = true;
    r.launch->error = message;
    switch_context(f.ctx, r.scheduler);
    std::abort();  // unreachable: a failed launch resumes no fiber
}

Runtime& running_runtime(const char* what) {
    Runtime& r = runtime;
    if (r.launch == nullptr || r.current == nullptr) {
        std::fprintf(stderr, "trainkit cuda emulator: %s called outside a kernel launch\n",
                     what);
        std::abort();
    }
    return r;
}

// The lane a participant reads, by PTX shfl.sync's rules; `ok` false when it reads its own.
unsigned source_lane(Op op, unsigned lane, int b, int c) {
    const int l = (int)lane, bval = b & 31, cval = c & 31, seg = (c >> 8) & 31;
    const int max_lane = (l & seg) | (cval & ~seg);
    const int min_lane = l & seg;
    int j = l;
    bool in_range = false;
    switch (op) {
        case Op::ShflUp: j = l - bval; in_range = j >= max_lane; break;
        case Op::ShflDown: j = l + bval; in_range = j <= max_lane; break;
        case Op::ShflXor: j = l ^ bval; in_range = j <= max_lane; break;
        case Op::ShflIdx: j = min_lane | (bval & ~seg); in_range = j <= max_lane; break;
        default: break;
    }
    return in_range ? (unsigned)j : lane;
}

// Completes the collective of the lanes of `mask` in the warp starting at `base`, when
// every lane of it that has not exited waits in one with the same mask and op. Returns
// whether it did; `running` (the caller's fiber, which goes on by itself) is not queued.
bool try_complete_warp(Runtime& r, unsigned base, unsigned mask, Op op, Fiber* running) {
    Launch& l = *r.launch;
    unsigned participants = 0;
    // From the highest lane: lanes mostly arrive in order, so a collective that is not
    // complete is usually seen to be so at once.
    for (int lane = (int)kWarp - 1; lane >= 0; --lane) {
        if (!((mask >> lane) & 1u) || base + lane >= l.n) continue;
        const Fiber& g = *r.fibers[base + lane];
        if (g.state == State::Exited) continue;
        if (g.state != State::WaitWarp || g.mask != mask || g.op != (int)op) return false;
        participants |= 1u << lane;
    }
    if (participants == 0) return false;
    uint64_t reduced = 0;
    if (op == Op::Ballot || op == Op::Any || op == Op::All) {
        unsigned ballot = 0;
        for (unsigned lane = 0; lane < kWarp; ++lane) {
            if ((participants >> lane) & 1u) {
                if (r.fibers[base + lane]->value != 0) ballot |= 1u << lane;
            }
        }
        reduced = op == Op::Ballot ? ballot
                  : op == Op::Any  ? (ballot != 0)
                                   : (ballot == participants);
    }
    for (unsigned lane = 0; lane < kWarp; ++lane) {
        if (!((participants >> lane) & 1u)) continue;
        Fiber& g = *r.fibers[base + lane];
        if (op == Op::SyncWarp) {
            g.result = 0;
        } else if (op == Op::Ballot || op == Op::Any || op == Op::All) {
            g.result = reduced;
        } else {
            const unsigned j = source_lane(op, lane, g.b, g.c);
            if (!((participants >> j) & 1u)) {
                const char* why = !((mask >> j) & 1u) ? "is not in the mask"
                                  : base + j >= l.n   ? "is past the end of the block"
                                                      : "has exited";
                abort_launch(r, *r.current,
                             format("kernel %s, block %s, thread %s: %s (mask 0x%08x) at "
                                    "%s:%d reads lane %u, which %s (the device would return "
                                    "an undefined value)",
                                    l.kernel, dims(l.block_idx).c_str(),
                                    dims(g.builtins.thread_idx).c_str(), op_name(op), mask,
                                    g.file, g.line, j, why));
            }
            g.result = r.fibers[base + j]->value;
        }
    }
    for (unsigned lane = 0; lane < kWarp; ++lane) {
        if (!((participants >> lane) & 1u)) continue;
        Fiber& g = *r.fibers[base + lane];
        if (&g == running) {
            g.state = State::Running;
        } else {
            g.state = State::Ready;
            push(l, base + lane);
        }
    }
    return true;
}

// Releases __syncthreads when every thread that has not exited waits at it.
void release_block(Runtime& r, Fiber* running) {
    Launch& l = *r.launch;
    const Fiber* first = nullptr;
    int count = 0;
    for (unsigned i = 0; i < l.n; ++i) {
        const Fiber& g = *r.fibers[i];
        if (g.state != State::WaitBlock) continue;
        if (first == nullptr) {
            first = &g;
        } else if (g.op != first->op || g.line != first->line ||
                   std::strcmp(g.file, first->file) != 0) {
            abort_launch(r, *r.current,
                         format("kernel %s, block %s: divergent %s: thread %s waits at %s "
                                "(%s:%d) while thread %s waits at %s (%s:%d); every thread "
                                "of a block that has not exited must reach the same one",
                                l.kernel, dims(l.block_idx).c_str(),
                                block_op_name((BlockOp)first->op),
                                dims(first->builtins.thread_idx).c_str(),
                                block_op_name((BlockOp)first->op), first->file, first->line,
                                dims(g.builtins.thread_idx).c_str(),
                                block_op_name((BlockOp)g.op), g.file, g.line));
        }
        count += g.value != 0;
    }
    if (first == nullptr) return;
    int result = 0;
    switch ((BlockOp)first->op) {
        case BlockOp::Sync: result = 0; break;
        case BlockOp::Count: result = count; break;
        case BlockOp::And: result = count == (int)l.waiting_block; break;
        case BlockOp::Or: result = count != 0; break;
    }
    for (unsigned i = 0; i < l.n; ++i) {
        Fiber& g = *r.fibers[i];
        if (g.state != State::WaitBlock) continue;
        g.result = (uint64_t)result;
        if (&g == running) {
            g.state = State::Running;
        } else {
            g.state = State::Ready;
            push(l, i);
        }
    }
    l.waiting_block = 0;
}

// The running thread returned from the kernel.
void thread_exit(Runtime& r, Fiber& f) {
    Launch& l = *r.launch;
    f.state = State::Exited;
    --l.live;
    // Exited threads count as arrived at __syncthreads.
    if (l.waiting_block > 0 && l.waiting_block == l.live) release_block(r, nullptr);
    // A collective of its warp that waited only for it (it is no longer expected).
    const unsigned base = f.linear & ~(kWarp - 1), lane = f.linear & (kWarp - 1);
    for (unsigned other = 0; other < kWarp && base + other < l.n; ++other) {
        const Fiber& g = *r.fibers[base + other];
        if (g.state == State::WaitWarp && ((g.mask >> lane) & 1u)) {
            try_complete_warp(r, base, g.mask, (Op)g.op, nullptr);
        }
    }
}

void fiber_main() {
    for (;;) {
        Runtime& r = runtime;
        Fiber& f = *r.current;
        f.fresh = false;
        r.launch->body(r.launch->ctx);
        thread_exit(r, *r.current);
        f.fresh = true;
        switch_context(f.ctx, r.scheduler);
    }
}

// Makes sure `n` fibers exist; false when memory runs out.
bool ensure_fibers(Runtime& r, unsigned n, std::string& error) {
    const size_t page = Fiber::page_size();
    while (r.fibers.size() < n) {
        std::unique_ptr<Fiber> f(new Fiber());
        void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            error = format("cannot map a %zu KiB stack for CUDA thread %zu",
                           kStackBytes / 1024, r.fibers.size());
            return false;
        }
        f->mapping = static_cast<char*>(m);
        mprotect(f->mapping, page, PROT_NONE);  // overflow faults instead of corrupting
        init_context(f->ctx, f->mapping + page, kStackBytes, fiber_main);
        f->fresh = true;
        r.fibers.push_back(std::move(f));
    }
    return true;
}

std::string thread_list(const std::vector<unsigned>& ids) {
    std::string out;
    size_t shown = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
        if (shown == 8) {
            out += ", ...";
            break;
        }
        if (!out.empty()) out += ", ";
        out += j == i ? format("%u", ids[i]) : format("%u-%u", ids[i], ids[j]);
        ++shown;
        i = j;
    }
    return out;
}

// What every thread of a stuck block waits at.
std::string deadlock_report(Runtime& r) {
    Launch& l = *r.launch;
    struct Group {
        State state;
        int op;
        unsigned mask;
        const char* file;
        int line;
        std::vector<unsigned> ids;
    };
    std::vector<Group> groups;
    unsigned exited = 0;
    for (unsigned i = 0; i < l.n; ++i) {
        const Fiber& g = *r.fibers[i];
        if (g.state == State::Exited) {
            ++exited;
            continue;
        }
        bool found = false;
        for (Group& gr : groups) {
            if (gr.state == g.state && gr.op == g.op && gr.mask == g.mask && gr.line == g.line &&
                std::strcmp(gr.file, g.file) == 0) {
                gr.ids.push_back(i);
                found = true;
                break;
            }
        }
        if (!found) groups.push_back(Group{g.state, g.op, g.mask, g.file, g.line, {i}});
    }
    std::string out = format("kernel %s, block %s: deadlock, no thread of the block can go on:",
                             l.kernel, dims(l.block_idx).c_str());
    for (const Group& gr : groups) {
        const size_t n = gr.ids.size();
        if (gr.state == State::WaitBlock) {
            out += format(" %zu thread%s wait%s at %s (%s:%d): %s;", n, n == 1 ? "" : "s",
                          n == 1 ? "s" : "", block_op_name((BlockOp)gr.op), gr.file, gr.line,
                          thread_list(gr.ids).c_str());
        } else {
            out += format(" %zu thread%s wait%s in %s (mask 0x%08x) at %s:%d: %s;", n,
                          n == 1 ? "" : "s", n == 1 ? "s" : "", op_name((Op)gr.op), gr.mask,
                          gr.file, gr.line, thread_list(gr.ids).c_str());
        }
    }
    out += format(" %u thread%s exited (threads by linear index x + y * blockDim.x + "
                  "z * blockDim.x * blockDim.y)",
                  exited, exited == 1 ? " has" : "s have");
    return out;
}

// Runs one block; false with l.error set when it fails.
bool run_block(Runtime& r, Launch& l) {
    const dim3 bd = l.block;
    for (unsigned i = 0; i < l.n; ++i) {
        Fiber& f = *r.fibers[i];
        if (!f.fresh) {
            // Left in the middle of a thread by a failed launch: start it afresh.
            init_context(f.ctx, f.mapping + Fiber::page_size(), kStackBytes, fiber_main);
            f.fresh = true;
        }
        f.linear = i;
        f.builtins.thread_idx = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.builtins.block_idx = l.block_idx;
        f.builtins.block_dim = l.block;
        f.builtins.grid_dim = l.grid;
        f.state = State::Ready;
        f.file = "";
        f.line = 0;
    }
    l.head = 0;
    l.count = 0;
    for (unsigned i = 0; i < l.n; ++i) push(l, i);
    l.live = l.n;
    l.waiting_block = 0;
    if (l.shared_bytes > 0) std::memset(r.dynamic_shared, 0xff, l.shared_bytes);
    unsigned i;
    while (pop(l, i)) {
        Fiber& f = *r.fibers[i];
        f.state = State::Running;
        r.current = &f;
        tls_builtins = &f.builtins;
        switch_context(r.scheduler, f.ctx);
        if (l.failed) return false;
    }
    if (l.live > 0) {
        l.error = deadlock_report(r);
        return false;
    }
    return true;
}

unsigned char* dynamic_shared_buffer(Runtime& r) {
    if (r.dynamic_shared == nullptr) {
        r.dynamic_shared = static_cast<unsigned char*>(std::aligned_alloc(256, kMaxDynamicShared));
    }
    return r.dynamic_shared;
}

}  // namespace

uint64_t warp_collective(Op op, unsigned mask, uint64_t value, int b, int c, int width,
                         const char* file, int line) {
    Runtime& r = running_runtime(op_name(op));
    Launch& l = *r.launch;
    Fiber& f = *r.current;
    const unsigned lane = f.linear & (kWarp - 1);
    if (!((mask >> lane) & 1u)) {
        abort_launch(r, f,
                     format("%s: %s at %s:%d with mask 0x%08x, which does not name the "
                            "calling lane %u",
                            here(l, f).c_str(), op_name(op), file, line, mask, lane));
    }
    if (width < 1 || width > (int)kWarp || (width & (width - 1)) != 0) {
        abort_launch(r, f,
                     format("%s: %s at %s:%d with width %d; width must be a power of 2 "
                            "from 1 to 32",
                            here(l, f).c_str(), op_name(op), file, line, width));
    }
    f.state = State::WaitWarp;
    f.op = (int)op;
    f.mask = mask;
    f.value = value;
    f.b = b;
    f.c = c;
    f.file = file;
    f.line = line;
    if (!try_complete_warp(r, f.linear & ~(kWarp - 1), mask, op, &f)) yield(r, f);
    return f.result;
}

int block_barrier(BlockOp op, int predicate, const char* file, int line) {
    Runtime& r = running_runtime(block_op_name(op));
    Launch& l = *r.launch;
    Fiber& f = *r.current;
    f.state = State::WaitBlock;
    f.op = (int)op;
    f.value = predicate != 0;
    f.file = file;
    f.line = line;
    ++l.waiting_block;
    if (l.waiting_block == l.live) {
        release_block(r, &f);
    } else {
        yield(r, f);
    }
    return (int)f.result;
}

void fail(const char* what, const char* file, int line) {
    Runtime& r = running_runtime(what);
    abort_launch(r, *r.current,
                 format("%s: %s at %s:%d", here(*r.launch, *r.current).c_str(), what, file, line));
}

void* dynamic_shared_memory() { return dynamic_shared_buffer(runtime); }

int launch_error(const char* kernel, const char* message, char* err, size_t err_len) {
    write_error(format("kernel %s: %s", kernel, message), err, err_len);
    return 1;
}

int run_launch(const char* kernel, dim3 grid, dim3 block, unsigned shared_bytes,
               void (*body)(void*), void* ctx, char* err, size_t err_len) {
    Runtime& r = runtime;
    if (r.launch != nullptr) {
        return launch_error(kernel, "launched from inside a kernel (no dynamic parallelism)",
                            err, err_len);
    }
    const unsigned long long n =
        (unsigned long long)block.x * (unsigned long long)block.y * block.z;
    if (block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0) {
        return launch_error(kernel,
                            format("grid %s and block %s: every dimension must be at least 1",
                                   dims(grid).c_str(), dims(block).c_str())
                                .c_str(),
                            err, err_len);
    }
    if (n > kMaxThreads || block.x > 1024 || block.y > 1024 || block.z > 64) {
        return launch_error(kernel,
                            format("block %s: at most 1024 threads (x, y <= 1024, z <= 64)",
                                   dims(block).c_str())
                                .c_str(),
                            err, err_len);
    }
    if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u) {
        return launch_error(kernel,
                            format("grid %s: x <= 2^31 - 1, y and z <= 65535",
                                   dims(grid).c_str())
                                .c_str(),
                            err, err_len);
    }
    if (shared_bytes > kMaxDynamicShared) {
        return launch_error(kernel,
                            format("%u bytes of dynamic shared memory; at most %u",
                                   shared_bytes, kMaxDynamicShared)
                                .c_str(),
                            err, err_len);
    }
    std::string error;
    if (!ensure_fibers(r, (unsigned)n, error)) return launch_error(kernel, error.c_str(), err, err_len);
    if (shared_bytes > 0 && dynamic_shared_buffer(r) == nullptr) {
        return launch_error(kernel, "cannot allocate the dynamic shared memory", err, err_len);
    }

    Launch l;
    l.kernel = kernel;
    l.body = body;
    l.ctx = ctx;
    l.grid = grid;
    l.block = block;
    l.n = (unsigned)n;
    l.shared_bytes = shared_bytes;
    l.queue.assign(l.n, 0);
    r.launch = &l;
    bool ok = true;
    for (unsigned z = 0; ok && z < grid.z; ++z) {
        for (unsigned y = 0; ok && y < grid.y; ++y) {
            for (unsigned x = 0; ok && x < grid.x; ++x) {
                l.block_idx = uint3{x, y, z};
                ok = run_block(r, l);
            }
        }
    }
    r.launch = nullptr;
    r.current = nullptr;
    tls_builtins = nullptr;
    if (!ok) {
        write_error(l.error, err, err_len);
        return 1;
    }
    return 0;
}

}  // namespace tk_emu
