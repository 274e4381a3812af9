// PyTorch on gpumem: the C functions torch.cuda.memory.CUDAPluggableAllocator loads from this
// library, and the C accessors gpumem.torch reads its stats through (ctypes: not on the hot path).
//
// One Engine over one CudaBackend per device, made on the device's first allocation. No Python
// here: PyTorch calls these from any thread, with or without the GIL.
//
// Note [What PyTorch gives a pluggable allocator]: PyTorch (torch/csrc/cuda/CUDAPluggableAllocator.cpp)
// calls alloc(size, device, stream) with the current stream of the current device, and
// free(ptr, size, device, stream) with the size, device and stream *of the allocation*, from the
// tensor's deleter. From Python only these two functions can be installed
// (torch._C._cuda_customAllocator(alloc, free)): the C++ hooks set_record_stream_fn,
// set_reset_fn (torch.cuda.empty_cache), stats and snapshots are not reachable, so
// - Tensor.record_stream(s) does nothing under any pluggable allocator. gpumem frees are
//   stream-ordered on the allocation stream: the engine records an event on that stream when the
//   memory goes back, and no other stream reuses the memory before that event has completed. A
//   tensor also used on *another* stream must be kept alive until that stream is done with it, or
//   announced with gpumem.torch.record_stream(tensor, stream) (gpumem_torch_record_stream below,
//   whose signature is also the one set_record_stream_fn takes, for C++ programs that build the
//   pluggable allocator themselves);
// - torch.cuda.empty_cache() does nothing: gpumem.torch.empty_cache() gives cached memory back;
// - torch.cuda.memory_stats() and friends raise: gpumem.torch.memory_stats() reads ours.
//
// Note [Out of memory reaches PyTorch as its OutOfMemoryError]: PyTorch does not check the
// pointer alloc returns (a null pointer would become a tensor that faults in the first kernel),
// and it turns a C++ exception from alloc into a Python exception: c10::OutOfMemoryError into
// torch.OutOfMemoryError, any other std::exception into RuntimeError (pytorch issue 133280). So on
// out of memory the hook PyTorch calls (gpumem_torch_alloc_hook; Note [Two alloc functions: one for
// C, one for PyTorch]) throws c10::OutOfMemoryError, built without PyTorch's headers from the
// symbols of the c10 library PyTorch has loaded (its constructor, vtable and type_info, found with
// dlopen RTLD_NOLOAD; the object is made by c10's own constructor, so its layout is c10's). Where
// those symbols cannot be found (another PyTorch build, or no PyTorch at all), it throws
// gpumem::TorchOutOfMemory, a std::runtime_error whose message starts like PyTorch's ("CUDA out of
// memory."), which PyTorch raises as RuntimeError. Other errors throw std::runtime_error.
#include <dlfcn.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cxxabi.h>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_backend.h"
#include "engine.h"
#include "recorder.h"

#define GPUMEM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
// A 0-or-1 variable `name`, where set, into `field`; anything else is refused.
void env_bool(const char* name, bool& field) {
    if (const char* v = std::getenv(name)) {
        std::string s(v);
        if (s != "0" && s != "1") throw std::runtime_error(std::string(name) + " must be 0 or 1, not '" + s + "'");
        field = s == "1";
    }
}

// The engine's policy for PyTorch: the defaults, where GPUMEM_BUSY_SLACK (a number >= 0, or inf) sets
// AllocatorPolicy.busy_slack, GPUMEM_CHUNK_MAX_FRACTION chunk_max_fraction, GPUMEM_PAGE_SLACK page_slack,
// GPUMEM_PAGE_SLACK_MIN_NBYTES page_slack_min_nbytes, GPUMEM_STREAM_ORDERED_STEAL stream_ordered_steal,
// GPUMEM_WAIT_OWN_STREAM wait_own_stream, GPUMEM_PLAN_WARMUP plan_warmup, GPUMEM_WARMUP_GIVE_BACK
// warmup_give_back, GPUMEM_STEAL_AFTER_WARMUP steal_after_warmup, GPUMEM_STEAL_BEFORE_WARMUP steal_before_warmup and
// GPUMEM_WAIT_ON_GPU wait_on_gpu
// (issue 18 measures several live). `base` (gpumem_torch_configure's policy, the default policy otherwise) with
// those variables applied.
gpumem::EngineConfig torch_engine_config(const gpumem::EngineConfig& base) {
    gpumem::EngineConfig cfg = base;
    if (const char* v = std::getenv("GPUMEM_BUSY_SLACK")) {
        char* end = nullptr;
        double value = std::strtod(v, &end);
        if (end == v || *end != '\0' || !(value >= 0.0))
            throw std::runtime_error(std::string("GPUMEM_BUSY_SLACK must be a number >= 0 or inf, not '") + v + "'");
        cfg.busy_slack = value;
    }
    // AllocatorPolicy.chunk_max_fraction: GPUMEM_CHUNK_MAX_FRACTION, a number in (0, 1] (issue 18 measures several live)
    if (const char* v = std::getenv("GPUMEM_CHUNK_MAX_FRACTION")) {
        char* end = nullptr;
        double value = std::strtod(v, &end);
        if (end == v || *end != '\0' || !(value > 0.0 && value <= 1.0))
            throw std::runtime_error(std::string("GPUMEM_CHUNK_MAX_FRACTION must be a number in (0, 1], not '") + v + "'");
        cfg.chunk_max_fraction = value;
    }
    // AllocatorPolicy.page_slack: GPUMEM_PAGE_SLACK, a number in [0, 1]; page_slack_min_nbytes:
    // GPUMEM_PAGE_SLACK_MIN_NBYTES, a whole number of bytes >= 0 (with GPUMEM_CHUNK_MAX_FRACTION and
    // GPUMEM_STREAM_ORDERED_STEAL, the memory-first policy step plans want, set with no code change)
    if (const char* v = std::getenv("GPUMEM_PAGE_SLACK")) {
        char* end = nullptr;
        double value = std::strtod(v, &end);
        if (end == v || *end != '\0' || !(value >= 0.0 && value <= 1.0))
            throw std::runtime_error(std::string("GPUMEM_PAGE_SLACK must be a number in [0, 1], not '") + v + "'");
        cfg.page_slack = value;
    }
    if (const char* v = std::getenv("GPUMEM_PAGE_SLACK_MIN_NBYTES")) {
        std::string s(v);
        bool digits = !s.empty() && s.size() <= 19 && s.find_first_not_of("0123456789") == std::string::npos;
        if (!digits)
            throw std::runtime_error("GPUMEM_PAGE_SLACK_MIN_NBYTES must be a whole number of bytes >= 0, not '" + s + "'");
        cfg.page_slack_min_nbytes = std::stoull(s);
    }
    // AllocatorPolicy.stream_ordered_steal: GPUMEM_STREAM_ORDERED_STEAL=0 or 1 (issue 18 measures both live)
    env_bool("GPUMEM_STREAM_ORDERED_STEAL", cfg.stream_ordered_steal);
    // AllocatorPolicy.wait_own_stream: GPUMEM_WAIT_OWN_STREAM=0 or 1 (Note [Wait for the program's own stream] in
    // backing.py; 0 is the rule before 2026-11-30)
    env_bool("GPUMEM_WAIT_OWN_STREAM", cfg.wait_own_stream);
    // AllocatorPolicy.plan_warmup: GPUMEM_PLAN_WARMUP=0 or 1 (Note [A memory-first warm-up] in plan.py)
    env_bool("GPUMEM_PLAN_WARMUP", cfg.plan_warmup);
    // AllocatorPolicy.warmup_give_back: GPUMEM_WARMUP_GIVE_BACK=0 or 1 (0 keeps the warm-up's one-page chunks)
    env_bool("GPUMEM_WARMUP_GIVE_BACK", cfg.warmup_give_back);
    // AllocatorPolicy.steal_after_warmup: GPUMEM_STEAL_AFTER_WARMUP=0 or 1 (0: the policy's own knobs after a warm-up
    // has ended, the rule before 2026-12-03; Note [The ordered steal after a warm-up] in backing.py)
    env_bool("GPUMEM_STEAL_AFTER_WARMUP", cfg.steal_after_warmup);
    // AllocatorPolicy.steal_before_warmup: GPUMEM_STEAL_BEFORE_WARMUP=1 (the default: the stream-ordered steal until a
    // warm-up has ended, a rule that ends where steals outrun its budget; Note [The ordered steal before a warm-up] in
    // backing.py) or 0 (the policy's own knobs until then, the rule before 2026-12-04)
    env_bool("GPUMEM_STEAL_BEFORE_WARMUP", cfg.steal_before_warmup);
    // AllocatorPolicy.wait_on_gpu: GPUMEM_WAIT_ON_GPU=0 or 1 (Note [Wait on the GPU, not the host] in backing.py)
    env_bool("GPUMEM_WAIT_ON_GPU", cfg.wait_on_gpu);
    return cfg;
}
}  // namespace

namespace gpumem {
namespace {

constexpr int kMaxDevices = 64;

struct TorchOutOfMemory : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// One device's engine, and what the PyTorch side counts beyond the engine's own stats.
// Note [The trace's GPU clock]: a trace's clock says when the CPU made each call, not when the GPU ran the
// work queued before it, and a replay must guess that (Note [The GPU runs behind the CPU] in
// gpumem/sim/gpu_work.py): a long gap may be the GPU draining or the CPU busy elsewhere. With the clock on
// (gpumem_torch_trace_gpu_clock(1)), each traced alloc and free also records a CUDA event with timing on the
// op's stream, before the op's own work: it completes once the work queued there before the op has run, and
// its time, read back against a reference event recorded (and waited for) at the device's first stamp, is
// when the GPU got there, on the trace's clock. Events are read oldest first as they complete (a few per
// stamp, so that only those of the GPU's lag are held); the rest when the trace is read, which waits for
// them. Each event read becomes the reference of the next: cuEventElapsedTime gives float milliseconds, whose
// resolution against one reference would fall to a microsecond after 11 s and 250 us after an hour (attacker
// 31). Past kMaxPendingStamps outstanding (a GPU far behind) or on a driver error the clock stops for that
// device (later events get none: the replay then refuses the clock). A stamp carries the clock's generation
// (high 32 bits), which a new trace advances, so that an op stamped just before tracing restarted cannot take a
// stamp of the new trace (recorder.h trace_read_gpu). The clock stamps only while the trace is on (turned off
// with it). Each stamp costs the program a few microseconds of CPU (an event made, recorded, queried).
//
// Note [A stamp lies between its event's record and its completion seen]: chained references carry two errors.
// The first reference's time was read once event_synchronize returned: late by the wake-up, and by what a timing
// event takes to be seen done (on the H200 2.5 us more than a fence, an event without timing as the engine's,
// recorded just before it: event_latency.py beside reports/hil/gpu-clock-bounds-h200-2026-11-30.md). Every stamp
// carried that offset, so an idle GPU showed 4-6 us of lag, and a replay read it as queued work: a fence the engine
// records at an allocation (lazily, for the pages freed since its last pass), which live found done, was pending
// in the replay, and the replay grew where live stole. Now the queue is drained, a fence and the reference are
// recorded back to back, and the reference's time is when the fence is seen done (anchor_reference). That is good
// to a few microseconds, not better: the timing event is made between the two records, and the idle floor of the
// H200 traces so made starts between 1 and 4 us. Second, the GPU's timer and the host's steady clock tick a few parts
// per million apart, which over a long run adds up (one 11 s trace drifted from 6 to 61 us). But an event completes
// after it was recorded and no later than the query that saw it complete, so each stamp read is held between the
// host times of the two: bounds, so the hold only ever moves a stamp toward the truth. They bound the drift, they
// do not remove it: a stamp can run late by at most the time from its event's completion to the query that saw it,
// early by at most the time from its record to its completion (a few microseconds where the GPU keeps up; in the
// H200 traces the idle floor fell by up to 4.5 us over 11 s, to about -2 us, held there by the lower bound). Both are needed: the
// upper alone turned the elapsed times' rounding into a downward ratchet (stamps 13 us before their own record by
// the end of 11 s runs). A timing event made before the fence, the best of several anchors, and re-anchoring at
// idle moments would remove the rest.
struct GpuClock {
    static constexpr std::size_t kMaxPendingStamps = 1u << 20;
    static constexpr std::size_t kMaxStamps = (std::size_t{1} << 32) - 1;   // an index fits the low 32 bits
    std::mutex mutex;                 // guards every member below
    EventHandle ref = 0;              // the reference event: the last one read (0: not yet recorded)
    std::int64_t ref_ns = 0;          // its time, steady-clock ns
    std::uint32_t generation = 0;     // advanced by each new trace
    std::vector<std::int64_t> stamp_ns;                          // by stamp: steady-clock ns, -1 not yet known
    struct Pending {
        std::size_t stamp;            // its index in stamp_ns
        EventHandle event;
        std::int64_t recorded_ns;     // steady-clock ns just before the event was recorded
    };
    std::deque<Pending> pending;      // stamps whose event is not yet read, oldest first
    bool stopped = false;             // too many pending, or a driver error: no more stamps
};

struct DeviceEngine {
    std::unique_ptr<CudaBackend> backend;
    std::unique_ptr<Engine> engine;
    GpuClock clock;
    std::atomic<std::uint64_t> torch_ooms{0};       // alloc calls that ended in out of memory
    std::atomic<std::uint64_t> torch_errors{0};     // alloc calls that failed otherwise
    std::atomic<std::uint64_t> free_errors{0};      // free calls that failed (reported on stderr)
    std::atomic<std::uint64_t> zero_allocs{0};      // size-0 requests (no memory: null pointer)
    // Note [Time in the engine's slow path]
    std::atomic<std::uint64_t> slow_ns{0};          // wall ns inside the engine's allocate and free past the fast path
    std::atomic<std::uint64_t> slow_calls{0};       // how many such calls
};

// Note [Time in the engine's slow path]: a policy's cost in step time is host time spent in the engine where
// its fast path (a cached block of the size class, a free into the stream's list) does not serve the call:
// searches, splits, growth, steals, fences and their driver calls. Step times on a shared host move by more
// than that (issue 18's alternated rounds: 289-389 ms for one setting of generate()), so the hooks measure it
// directly: two steady-clock reads around each slow call, none on the fast path (tens of nanoseconds against
// the microseconds a slow call takes). The driver calls' share is in the backend's own times (Note [Time in
// driver calls] in cuda_backend.h); the rest is the engine's own work.

// Note [Tracing PyTorch's calls]: gpumem_torch_trace(1) makes the hooks record every allocation and
// free they serve, read per device as (kind 0 alloc / 1 free, address, bytes, stream, nanoseconds since
// tracing began): the allocation trace of a live run, which gpumem.torch turns into a gpumem trace to
// replay in the simulator. A free is recorded before the engine frees the block, so that its address
// cannot be handed out again (and recorded) ahead of it. The trace is a window of the one recorder
// (Note [One recorder for the history and the trace] in recorder.h).

std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Note [Engines live until the process ends]: the per-device engines are made once and never
// destroyed. PyTorch frees tensors during interpreter shutdown, after any static destructor of
// ours could have run; an engine destroyed first would turn those frees into use-after-free. The
// driver takes the memory back when the process exits.
struct TorchState {
    std::mutex make_mutex;
    std::atomic<DeviceEngine*> devices[kMaxDevices] = {};
    std::string make_error[kMaxDevices];   // why a device's engine could not be made (under make_mutex)
    EngineConfig config;                   // the policy of engines made from now on (under make_mutex)
    bool warmup_at_start = false;          // engines made from now on begin the plan warm-up (under make_mutex)
};

// Adds the wall time of its scope to d's slow-path counters when the scope ends, by a return or an exception
// (an allocation that ends in out of memory, after the engine's retries, is among the slowest: attacker review).
struct SlowPathTimer {
    DeviceEngine* d;
    std::int64_t began_ns;
    explicit SlowPathTimer(DeviceEngine* engine) : d(engine), began_ns(now_ns()) {}
    SlowPathTimer(const SlowPathTimer&) = delete;
    SlowPathTimer& operator=(const SlowPathTimer&) = delete;
    ~SlowPathTimer() {
        d->slow_ns.fetch_add(static_cast<std::uint64_t>(now_ns() - began_ns), std::memory_order_relaxed);
        d->slow_calls.fetch_add(1, std::memory_order_relaxed);
    }
};

TorchState& state() {
    static TorchState* s = new TorchState();   // never destroyed (Note [Engines live until the process ends])
    return *s;
}

thread_local std::string t_last_error;

DeviceEngine* existing(int device) {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return state().devices[device].load(std::memory_order_acquire);
}

// existing(device), or null with gpumem_torch_last_error() saying there is no engine there (the C functions' -1).
DeviceEngine* existing_or_error(int device) {
    DeviceEngine* d = existing(device);
    if (d == nullptr) t_last_error = "gpumem has no engine on CUDA device " + std::to_string(device);
    return d;
}

void record_event(std::int32_t action, int device, std::uint64_t addr, std::uint64_t nbytes, std::uint64_t stream,
                  std::int64_t gpu_stamp = -1, std::int64_t reserved = -1, std::int64_t t_ns = -1);

std::atomic<bool> g_gpu_clock_on{false};   // gpumem_torch_trace_gpu_clock: traced ops are stamped

// Reads the completed event at the front of `c.pending`, which becomes the reference (under c.mutex). `done_ns`:
// a steady-clock time at which the event was seen complete (Note [A stamp lies between its event's record and
// its completion seen]).
void read_front(GpuClock& c, CudaBackend& b, std::int64_t done_ns) {
    const auto [stamp, ev, recorded_ns] = c.pending.front();
    const std::int64_t chained = c.ref_ns + std::llround(b.timing_elapsed_ms(c.ref, ev) * 1e6);
    const std::int64_t ns = std::max(recorded_ns, std::min(chained, done_ns));
    c.stamp_ns[stamp] = ns;
    c.pending.pop_front();
    const EventHandle old = c.ref;
    c.ref = ev;
    c.ref_ns = ns;
    b.timing_event_destroy(old);
}

// The clock's first reference on `stream` (under c.mutex; Note [A stamp lies between its event's record and its
// completion seen]): the work queued so far drained, then a fence and the reference recorded back to back, the
// reference's time taken when the fence is seen done. Throws on a driver error (the clock then stops).
void anchor_reference(GpuClock& c, CudaBackend& b, std::uint64_t stream) {
    constexpr std::int64_t kSpinNs = 1'000'000;   // past this (work queued meanwhile by another thread): wait
    b.stream_synchronize(stream);   // the work queued so far
    const EventHandle fence = b.event_record(stream);
    EventHandle ref = 0;
    try {
        ref = b.timing_event_record(stream);
        const std::int64_t give_up_ns = now_ns() + kSpinNs;
        bool seen = b.event_query(fence);
        while (!seen && now_ns() < give_up_ns) seen = b.event_query(fence);
        if (!seen) b.event_synchronize(fence);
        c.ref_ns = now_ns();
        b.event_synchronize(ref);   // an elapsed time needs both events complete
    } catch (...) {
        try {
            if (ref != 0) b.timing_event_destroy(ref);
        } catch (...) {   // a lost device: the event goes with it
        }
        b.event_destroy(fence);
        throw;
    }
    c.ref = ref;   // before the fence goes: a failure there leaves the reference to gpu_clock_reset
    b.event_destroy(fence);
}

// Stamps an op on `stream` of device `d` (Note [The trace's GPU clock]): its stamp, or -1 (the clock is off or
// stopped). Never throws.
std::int64_t gpu_stamp(DeviceEngine* d, std::uint64_t stream) noexcept {
    if (!g_gpu_clock_on.load(std::memory_order_relaxed)) return -1;
    GpuClock& c = d->clock;
    CudaBackend& b = *d->backend;
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.stopped) return -1;
    try {
        // an event recorded on a stream being captured into a CUDA graph goes into the graph, and querying or
        // waiting for it would break the capture: such ops get no stamp (their GPU time unknown; attacker 32)
        if (b.stream_capturing(stream)) return -1;
        if (c.ref == 0) anchor_reference(c, b, stream);
        for (int k = 0; k < 4 && !c.pending.empty() && b.event_query(c.pending.front().event); ++k)
            read_front(c, b, now_ns());
        if (c.pending.size() >= GpuClock::kMaxPendingStamps || c.stamp_ns.size() >= GpuClock::kMaxStamps) {
            c.stopped = true;
            return -1;
        }
        c.stamp_ns.push_back(-1);   // room first: nothing to undo if it throws
        c.pending.push_back({c.stamp_ns.size() - 1, 0, 0});
        try {
            c.pending.back().event = b.timing_event_record(stream, &c.pending.back().recorded_ns);
        } catch (...) {
            c.pending.pop_back();
            c.stamp_ns.pop_back();
            throw;
        }
        return static_cast<std::int64_t>(static_cast<std::uint64_t>(c.generation) << 32 | (c.stamp_ns.size() - 1));
    } catch (const std::exception& e) {
        c.stopped = true;
        std::fprintf(stderr, "gpumem: the trace's GPU clock stopped on a CUDA device: %s\n", e.what());
        return -1;
    }
}

// Forgets device `d`'s clock: waits for and destroys its events (a new trace begins). Never throws.
void gpu_clock_reset(DeviceEngine* d) noexcept {
    GpuClock& c = d->clock;
    std::lock_guard<std::mutex> lock(c.mutex);
    try {
        for (const GpuClock::Pending& p : c.pending) {
            d->backend->event_synchronize(p.event);
            d->backend->timing_event_destroy(p.event);
        }
        if (c.ref != 0) d->backend->timing_event_destroy(c.ref);
    } catch (const std::exception&) {   // a lost device: the events go with it
    }
    c.pending.clear();
    c.stamp_ns.clear();
    c.ref = 0;
    c.stopped = false;
    ++c.generation;
}

// PlanEventKind (gpumem/trace/model.py): what a step-plan event of the trace says (Recorder::kPlanEvent)
constexpr std::uint64_t kPlanMark = 0, kPlanWarmupStart = 1, kPlanWarmupStop = 2;

DeviceEngine* get_or_make(int device) {
    if (device < 0 || device >= kMaxDevices)
        throw std::runtime_error("gpumem: CUDA device index " + std::to_string(device) + " out of range");
    TorchState& s = state();
    DeviceEngine* d = s.devices[device].load(std::memory_order_acquire);
    if (d != nullptr) return d;
    std::lock_guard<std::mutex> lock(s.make_mutex);
    d = s.devices[device].load(std::memory_order_relaxed);
    if (d != nullptr) return d;
    auto made = std::make_unique<DeviceEngine>();
    try {
        made->backend = std::make_unique<CudaBackend>(device);
        if (!made->backend->info().vmm_supported)
            throw std::runtime_error("CUDA device " + std::to_string(device) +
                                     " does not support virtual memory management (cuMemCreate/cuMemMap), "
                                     "which gpumem's native engine needs");
        made->engine = std::make_unique<Engine>(*made->backend, torch_engine_config(s.config));
        // Note [A memory-first warm-up] in plan.py; the trace says so, for a replay to begin it there too
        if (s.warmup_at_start && made->engine->start_plan_warmup())
            record_event(Recorder::kPlanEvent, device, 0, kPlanWarmupStart, 0);
    } catch (const std::exception& e) {
        s.make_error[device] = e.what();
        throw std::runtime_error(std::string("gpumem could not start on CUDA device ") + std::to_string(device) +
                                 ": " + e.what());
    }
    d = made.release();
    s.devices[device].store(d, std::memory_order_release);
    return d;
}

std::string format_mib(std::uint64_t nbytes) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(nbytes) / (1024.0 * 1024.0));
    return buf;
}

// ---- c10::OutOfMemoryError without PyTorch's headers (Note [Out of memory reaches PyTorch ...]) ----

struct C10SourceLocation {   // c10::SourceLocation
    const char* function;
    const char* file;
    std::uint32_t line;
};

using C10ErrorCtor = void (*)(void* self, C10SourceLocation loc, std::string msg);

struct C10Oom {
    C10ErrorCtor ctor = nullptr;
    void* vtable = nullptr;          // _ZTVN3c1016OutOfMemoryErrorE
    std::type_info* type = nullptr;  // _ZTIN3c1016OutOfMemoryErrorE
    bool usable() const { return ctor != nullptr && vtable != nullptr && type != nullptr; }
};

C10Oom find_c10_oom() {
    C10Oom found;
    const char* libs[] = {"libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_cpu.so", "libtorch_python.so"};
    for (const char* name : libs) {
        void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
        if (h == nullptr) continue;
        if (found.ctor == nullptr) {
            void* c = dlsym(h, "_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
            if (c == nullptr)
                c = dlsym(h, "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
            found.ctor = reinterpret_cast<C10ErrorCtor>(c);
        }
        if (found.vtable == nullptr) found.vtable = dlsym(h, "_ZTVN3c1016OutOfMemoryErrorE");
        if (found.type == nullptr) found.type = static_cast<std::type_info*>(dlsym(h, "_ZTIN3c1016OutOfMemoryErrorE"));
        // the handles stay open: PyTorch's libraries are loaded for the life of the process anyway
    }
    return found;
}

void destroy_c10_error(void* obj) {
    // the complete-object destructor is the first slot of the vtable (Itanium C++ ABI)
    void** vptr = *static_cast<void***>(obj);
    reinterpret_cast<void (*)(void*)>(vptr[0])(obj);
}

[[noreturn]] void throw_out_of_memory(const std::string& msg) {
    static const C10Oom c10 = find_c10_oom();
    if (c10.usable()) {
        // c10::Error's size differs between PyTorch versions; 1 KiB is several times any of them.
        constexpr std::size_t kRoom = 1024;
        void* obj = __cxxabiv1::__cxa_allocate_exception(kRoom);
        std::memset(obj, 0, kRoom);
        c10.ctor(obj, C10SourceLocation{"gpumem_torch_malloc", __FILE__, static_cast<std::uint32_t>(__LINE__)}, msg);
        // OutOfMemoryError adds nothing to Error but its type: give the object that type's vtable
        *static_cast<void**>(obj) = static_cast<char*>(c10.vtable) + 2 * sizeof(void*);
        __cxxabiv1::__cxa_throw(obj, c10.type, &destroy_c10_error);
    }
    throw TorchOutOfMemory(msg);
}

std::string oom_message(const EngineError& e, std::uint64_t nbytes, int device) {
    const OomInfo& o = e.oom;
    return "CUDA out of memory. Tried to allocate " + format_mib(nbytes) + " on GPU " + std::to_string(device) +
           " through gpumem. GPU " + std::to_string(device) + " has a total capacity of " +
           format_mib(o.total_nbytes) + " of which " + format_mib(o.free_nbytes) + " is free. gpumem holds " +
           format_mib(o.reserved_nbytes) + " (" + format_mib(o.allocated_nbytes) + " allocated by PyTorch" +
           // Note [A step plan in the out-of-memory error] (gpumem/allocator/engine.py)
           (o.plan_mapped_nbytes ? "; " + format_mib(o.plan_mapped_nbytes) + " of it in step plans' arenas, " +
                                       format_mib(o.plan_dropped_nbytes) + " of that in dropped plans' arenas, " +
                                       format_mib(o.plan_live_nbytes) + " of the arenas live"
                                 : std::string()) +
           "). " + e.what();
}

// Note [Allocation history for gpumem record]: PyTorch refuses _record_memory_history and snapshots
// under a pluggable allocator, so `gpumem record --allocator gpumem` (gpumem/recording.py) asks this
// library for the history instead: while on, each successful alloc, each free and each out-of-memory
// is recorded (Note [One recorder for the history and the trace] in recorder.h); Python copies the
// events out at the end and writes them as a PyTorch snapshot. The OOM observer is called from the
// allocating thread, after the engine has given up and before the error is thrown, with no engine
// lock held (as PyTorch calls its own OOM observers).
using OomObserver = void (*)(int device, std::uint64_t requested_nbytes, std::uint64_t free_nbytes,
                             std::uint64_t total_nbytes);

struct Recording {
    Recorder recorder;
    std::atomic<OomObserver> oom_observer{nullptr};
};

Recording& recording() {
    static Recording* r = new Recording();   // never destroyed (Note [Engines live until the process ends])
    return *r;
}

// Records one event of the hooks (one relaxed load when neither the history nor the trace is on).
// `t_ns`: when the op began (steady clock), -1 for now.
void record_event(std::int32_t action, int device, std::uint64_t addr, std::uint64_t nbytes, std::uint64_t stream,
                  std::int64_t gpu_stamp, std::int64_t reserved, std::int64_t t_ns) {
    Recorder& r = recording().recorder;
    if (r.on()) r.record(action, device, addr, nbytes, stream, t_ns < 0 ? now_ns() : t_ns, gpu_stamp, reserved);
}

// Note [An op's time is when it began]: an allocation is recorded once the engine has made it (its address is
// known only then), but with the time it began and a GPU clock stamped before the engine ran: a replay's CPU
// reaches the op at its time, with the GPU as far behind as it was then, and runs the simulated engine there,
// whose device calls cost their simulated time (a free was recorded so already: before the engine frees).
// Stamped after the engine, a slow allocation (a steal or a growth: hundreds of microseconds of driver calls) was
// replayed that much later than live, after the GPU's queued work that the live engine had found still running:
// replayed, a 7B batch-16 server stole a busy chunk's pages in the prefill where live grew (the first difference
// gpumem replay --compare-live found, 194 MiB, reports/hil/live-reserve-h200-2026-11-30.md). The time alone moved
// to the start made it worse: the stamp, still taken after, then counted the engine's own time as GPU work.
//
// Note [The live engine's reserve]: a replay of a live trace says how much memory the engine would hold, and
// where it differs from the live run's peak it cannot say where the two parted (the trace has the requests, not
// the engine's answers). So each traced allocation also records the engine's reserved bytes once it is made
// (Engine::reserved_nbytes, one more lock of the engine's while a recording is on): a replay compares its own
// after each allocation (gpumem.replay_compare.compare_live) and finds the first op where it grew or stole
// otherwise.
// Frees are recorded before the engine frees the block (Note [Tracing PyTorch's calls]), so they carry none; a
// free does not change the reserve (chunks are stolen or released at allocations and empty_cache()).
std::int64_t reserve_after(DeviceEngine* d) noexcept {
    if (!recording().recorder.on()) return -1;
    try {
        return static_cast<std::int64_t>(d->engine->reserved_nbytes());
    } catch (...) {
        return -1;
    }
}

// Note [Two alloc functions: one for C, one for PyTorch]: a C++ exception must not leave a function
// that C code calls (ctypes, a C program): nothing there can catch it, and the process aborts (it
// did, for gpumem_torch_malloc called without a driver). PyTorch, on the other hand, only learns
// of a failure through an exception (Note [Out of memory reaches PyTorch as its OutOfMemoryError]:
// it does not check the pointer). So the allocation is written once, without exceptions
// (allocate_on), and exported twice: gpumem_torch_malloc, the C function, returns null and records
// why (gpumem_torch_last_error()); gpumem_torch_alloc_hook, what gpumem.torch installs in PyTorch,
// throws. Both count their failures (torch_ooms, torch_errors).
struct AllocFailure {
    std::string what;   // empty: no failure (a null pointer is then a zero-size request's)
    bool oom = false;
};

void* allocate_on(ssize_t size, int device, void* stream, AllocFailure* failure) noexcept {
    try {
        if (size <= 0) {
            // Zero-size tensors get no memory (PyTorch never dereferences their pointer; the free of a
            // null pointer does nothing). A negative size cannot come from PyTorch (size_t).
            if (size < 0) {
                failure->what = "gpumem_torch_malloc: negative size " + std::to_string(size);
                return nullptr;
            }
            if (DeviceEngine* d = existing(device)) d->zero_allocs.fetch_add(1, std::memory_order_relaxed);
            return nullptr;
        }
        DeviceEngine* d = get_or_make(device);   // throws when there is no driver, no VMM...
        const std::uint64_t nbytes = static_cast<std::uint64_t>(size);
        const std::uint64_t s = reinterpret_cast<std::uintptr_t>(stream);
        try {
            // Note [An op's time is when it began]; Note [The trace's GPU clock]
            const bool traced = recording().recorder.on();
            const std::int64_t stamp = traced ? gpu_stamp(d, s) : -1;
            const std::int64_t began_ns = traced ? now_ns() : -1;
            std::uint64_t p = d->engine->try_allocate_fast(nbytes, s);
            if (p == 0) {
                SlowPathTimer timed(d);   // Note [Time in the engine's slow path]
                p = d->engine->allocate(nbytes, s);
            }
            // Note [One recorder for the history and the trace]; Note [The live engine's reserve]
            record_event(Recorder::kAlloc, device, p, nbytes, s, stamp, reserve_after(d), began_ns);
            return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
        } catch (const EngineError& e) {
            if (e.kind == EngineErrorKind::kOutOfMemory) {
                d->torch_ooms.fetch_add(1, std::memory_order_relaxed);
                record_event(Recorder::kOutOfMemory, device, 0, nbytes, s);
                if (OomObserver obs = recording().oom_observer.load(std::memory_order_acquire))
                    obs(device, nbytes, e.oom.free_nbytes, e.oom.total_nbytes);   // no engine lock held
                failure->oom = true;
                failure->what = oom_message(e, nbytes, device);
                return nullptr;
            }
            d->torch_errors.fetch_add(1, std::memory_order_relaxed);
            failure->what = "gpumem could not allocate " + std::to_string(nbytes) + " bytes on CUDA device " +
                            std::to_string(device) + ": " + e.what();
        } catch (const BackendError& e) {
            d->torch_errors.fetch_add(1, std::memory_order_relaxed);
            failure->what = "gpumem: CUDA device " + std::to_string(device) + ": " + e.what();
        } catch (const std::exception& e) {
            d->torch_errors.fetch_add(1, std::memory_order_relaxed);
            failure->what = "gpumem: CUDA device " + std::to_string(device) + ": " + e.what();
        }
    } catch (const std::exception& e) {
        failure->what = e.what();
    } catch (...) {
        failure->what = "gpumem_torch_malloc: unknown C++ exception";
    }
    if (failure->what.empty()) failure->what = "gpumem_torch_malloc: failed";
    return nullptr;
}

}  // namespace

// The engine PyTorch's hooks use on `device` (made on first use), for gpumem._engine.CudaAllocator:
// Python programs and PyTorch on one device share one engine, as they share the device's memory.
Engine& cuda_engine(int device) { return *get_or_make(device)->engine; }

}  // namespace gpumem

using namespace gpumem;

// Names of the values gpumem_torch_stats writes, in order, comma-separated: the engine's stats
// (kStatFields in engine.h), then the shim's own counters, then the backend's time in driver calls
// (Note [Time in driver calls] in cuda_backend.h), then the hooks' time in the engine's slow path (Note [Time in
// the engine's slow path]).
GPUMEM_EXPORT const char* gpumem_torch_stat_names() {
    try {
        static const std::string names = [] {
            std::string out;
            for (const StatField& f : kStatFields) (out += f.name) += ',';
            return out + "torch_ooms,torch_errors,free_errors,zero_allocs,"
                         "driver_memory_ns,driver_event_ns,driver_wait_ns,engine_slow_ns,engine_slow_calls";
        }();
        return names.c_str();
    } catch (...) {   // no memory for the string: never an exception through the C boundary
        return "";
    }
}

// Allocates `size` bytes on CUDA device `device` for work on `stream` (a cudaStream_t); the C
// function: never throws (Note [Two alloc functions: one for C, one for PyTorch]). Returns the
// pointer; null for size 0 (no memory), and null on failure, with the reason in
// gpumem_torch_last_error() (out of memory, no driver, no virtual memory management, a negative
// size). Free with gpumem_torch_free.
GPUMEM_EXPORT void* gpumem_torch_malloc(ssize_t size, int device, void* stream) {
    AllocFailure failure;
    void* p = allocate_on(size, device, stream, &failure);
    if (p == nullptr && !failure.what.empty()) t_last_error = failure.what;
    return p;
}

// PyTorch's alloc hook (CUDAPluggableAllocator: void*(size_t, int, cudaStream_t)), what
// gpumem.torch installs: gpumem_torch_malloc, with failures thrown as C++ exceptions, which PyTorch
// turns into Python ones (c10::OutOfMemoryError: torch.OutOfMemoryError; others RuntimeError).
// Only for C++ callers that catch them (Note [Two alloc functions: one for C, one for PyTorch]).
GPUMEM_EXPORT void* gpumem_torch_alloc_hook(ssize_t size, int device, void* stream) {
    AllocFailure failure;
    void* p = allocate_on(size, device, stream, &failure);
    if (p == nullptr && !failure.what.empty()) {
        if (failure.oom) throw_out_of_memory(failure.what);
        throw std::runtime_error(failure.what);
    }
    return p;
}

// PyTorch's free hook (void(void*, size_t, int, cudaStream_t)). Called from tensor deleters, which
// must not throw: a failure is counted (free_errors) and reported on stderr.
GPUMEM_EXPORT void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream) {
    // the engine knows the block's stream (Note [What PyTorch gives a pluggable allocator]); size and
    // stream only go to the recorder (Note [One recorder for the history and the trace]), which keeps the
    // ones PyTorch passes
    if (ptr == nullptr) return;
    DeviceEngine* d = existing(device);
    if (d == nullptr) {
        std::fprintf(stderr, "gpumem: free of %p on CUDA device %d, where gpumem allocated nothing\n", ptr, device);
        return;
    }
    const std::uint64_t p = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uint64_t s = reinterpret_cast<std::uintptr_t>(stream);
    record_event(Recorder::kFree, device, p, static_cast<std::uint64_t>(size), s,
                 recording().recorder.on() ? gpu_stamp(d, s) : -1);
    try {
        if (!d->engine->try_free_fast(p)) {
            SlowPathTimer timed(d);   // Note [Time in the engine's slow path]
            d->engine->free(p);
        }
    } catch (const std::exception& e) {
        if (d->free_errors.fetch_add(1, std::memory_order_relaxed) < 8)
            std::fprintf(stderr, "gpumem: free of %p on CUDA device %d failed: %s\n", ptr, device, e.what());
    }
}

// Tensor.record_stream for gpumem: `ptr` (an allocation of any device's engine) is also used on
// `stream`; its memory is not reused before the work queued on `stream` until its free is done.
// The signature set_record_stream_fn takes. Returns 0, or -1 with gpumem_torch_last_error().
GPUMEM_EXPORT int gpumem_torch_record_stream(void* ptr, void* stream) {
    const std::uint64_t p = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uint64_t s = reinterpret_cast<std::uintptr_t>(stream);
    std::string why = "no gpumem engine has started";
    for (int i = 0; i < kMaxDevices; ++i) {
        DeviceEngine* d = existing(i);
        if (d == nullptr) continue;
        try {
            d->engine->record_stream(p, s);
            record_event(Recorder::kStreamUse, i, p, 0, s);   // a StreamUse of the trace (recorder.h)
            return 0;
        } catch (const EngineError& e) {
            if (e.kind != EngineErrorKind::kInvalidPointer) {
                t_last_error = e.what();
                return -1;
            }
            why = e.what();
        } catch (const std::exception& e) {
            t_last_error = e.what();
            return -1;
        }
    }
    t_last_error = "gpumem_torch_record_stream: " + why;
    return -1;
}

// torch.cuda.Stream.wait_stream, for gpumem's trace: on `device`, `stream` waits for the work queued on
// `waited` so far (a StreamWait of the trace: recorder.h). Nothing else: the wait itself is PyTorch's
// (cudaStreamWaitEvent), which passes no allocator call, so the caller reports it (gpumem.torch
// .trace_wait_stream). Returns 0, or -1 with gpumem_torch_last_error() for a device out of range.
GPUMEM_EXPORT int gpumem_torch_trace_wait_stream(int device, void* stream, void* waited) {
    if (device < 0 || device >= kMaxDevices) {
        t_last_error = "gpumem_torch_trace_wait_stream: device " + std::to_string(device) + " out of range";
        return -1;
    }
    record_event(Recorder::kStreamWait, device, reinterpret_cast<std::uintptr_t>(waited), 0,
                 reinterpret_cast<std::uintptr_t>(stream));
    return 0;
}

// Starts gpumem's engine on `device` now rather than at its first allocation (loads the driver,
// checks virtual memory support; reserves no memory). Returns 0, or -1 with gpumem_torch_last_error().
GPUMEM_EXPORT int gpumem_torch_start(int device) {
    try {
        get_or_make(device);
        return 0;
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
}

// Whether gpumem has an engine on `device` (1), none yet (0), or failed to make one (-1: see
// gpumem_torch_last_error()).
GPUMEM_EXPORT int gpumem_torch_engine_state(int device) {
    if (device < 0 || device >= kMaxDevices) {
        t_last_error = "device index out of range";
        return -1;
    }
    if (existing(device) != nullptr) return 1;
    TorchState& s = state();
    std::lock_guard<std::mutex> lock(s.make_mutex);
    if (!s.make_error[device].empty()) {
        t_last_error = s.make_error[device];
        return -1;
    }
    return 0;
}

// Writes up to `n` stats of `device`'s engine (in the order of gpumem_torch_stat_names) into `out`.
// Returns how many were written; 0 when gpumem has no engine on that device yet; -1 on error.
GPUMEM_EXPORT int gpumem_torch_stats(int device, std::uint64_t* out, int n) {
    DeviceEngine* d = existing(device);
    if (d == nullptr) return 0;
    if (out == nullptr || n < 0) {
        t_last_error = "gpumem_torch_stats: bad output buffer";
        return -1;
    }
    EngineStats st;
    try {
        st = d->engine->stats();
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
    const CudaBackend::CallTimes times = d->backend->call_times();
    const std::uint64_t own[] = {d->torch_ooms.load(), d->torch_errors.load(), d->free_errors.load(),
                                 d->zero_allocs.load(), times.memory_ns, times.event_ns, times.wait_ns,
                                 d->slow_ns.load(), d->slow_calls.load()};
    std::uint64_t values[sizeof kStatFields / sizeof kStatFields[0] + sizeof own / sizeof own[0]];
    int count = 0;
    for (const StatField& f : kStatFields) values[count++] = st.*f.member;
    for (std::uint64_t v : own) values[count++] = v;
    const int written = n < count ? n : count;
    for (int i = 0; i < written; ++i) out[i] = values[i];
    return written;
}

// Gives `device`'s cached memory back to the driver; the bytes released go to *released_nbytes.
// Returns 0 (also when gpumem has no engine there: nothing to release), or -1 on error.
GPUMEM_EXPORT int gpumem_torch_empty_cache(int device, std::uint64_t* released_nbytes) {
    std::uint64_t released = 0;
    if (DeviceEngine* d = existing(device)) {
        try {
            released = d->engine->empty_cache();
        } catch (const std::exception& e) {
            t_last_error = e.what();
            return -1;
        }
    }
    if (released_nbytes != nullptr) *released_nbytes = released;
    return 0;
}

// What gpumem_torch_empty_cache would give back on `device` now (Engine::releasable_nbytes: whole idle chunks and
// cached ones; not a step plan's arena; with `with_carried`, were the READY step's carried blocks freed too), to
// *nbytes; changes nothing. Returns 0 (0 bytes where gpumem has no engine there), or -1 on error.
GPUMEM_EXPORT int gpumem_torch_releasable(int device, int with_carried, std::uint64_t* nbytes) {
    std::uint64_t releasable = 0;
    if (DeviceEngine* d = existing(device)) {
        try {
            releasable = d->engine->releasable_nbytes(with_carried != 0);
        } catch (const std::exception& e) {
            t_last_error = e.what();
            return -1;
        }
    }
    if (nbytes != nullptr) *nbytes = releasable;
    return 0;
}

// The message of this thread's last failed gpumem_torch_* call.
GPUMEM_EXPORT const char* gpumem_torch_last_error() { return t_last_error.c_str(); }

// Turns the allocation history on (max_entries > 0: cleared, then recorded up to that many events)
// or off (max_entries == 0: kept for gpumem_torch_history). Note [Allocation history for gpumem record].
GPUMEM_EXPORT int gpumem_torch_record_history(std::uint64_t max_entries) {
    Recorder& r = recording().recorder;
    if (max_entries == 0) {
        r.history_stop();
        return 0;
    }
    try {
        r.history_start(max_entries, now_ns());
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
    return 0;
}

// Copies up to `n` recorded events into `out` (out == nullptr: none); *dropped gets the events past
// max_entries. Returns how many events the history holds.
GPUMEM_EXPORT std::int64_t gpumem_torch_history(HistoryEvent* out, std::int64_t n, std::uint64_t* dropped) {
    return recording().recorder.history_read(out, n, dropped);
}

// The function gpumem_torch_malloc calls on out of memory before it throws (nullptr: none).
GPUMEM_EXPORT void gpumem_torch_set_oom_observer(OomObserver observer) {
    recording().oom_observer.store(observer, std::memory_order_release);
}

// sizeof(HistoryEvent), so that Python can check its mirror of the layout.
GPUMEM_EXPORT int gpumem_torch_history_event_size() { return static_cast<int>(sizeof(HistoryEvent)); }
// Turns tracing on (1: the trace emptied, its clock restarted) or off (0; the trace is
// kept). Note [Tracing PyTorch's calls].
GPUMEM_EXPORT void gpumem_torch_trace(int on) {
    Recorder& r = recording().recorder;
    if (on) {
        for (int i = 0; i < kMaxDevices; ++i)
            if (DeviceEngine* d = existing(i)) gpu_clock_reset(d);
        r.trace_start(now_ns());
    } else {
        g_gpu_clock_on.store(false, std::memory_order_relaxed);   // the clock goes with the trace (attacker 31)
        r.trace_stop();
    }
}

// Turns the trace's GPU clock on (1) or off (0) for the ops traced from now on (Note [The trace's GPU clock]).
GPUMEM_EXPORT void gpumem_torch_trace_gpu_clock(int on) { g_gpu_clock_on.store(on != 0, std::memory_order_relaxed); }

// Copies up to `n` of `device`'s GPU clock times into `out`, one per event gpumem_torch_trace_read copies, in its
// order: nanoseconds on the trace's clock at which the GPU had run the work queued on the event's stream before
// it, -1 where unknown (no stamp: the clock was off or stopped). Waits for the events not yet complete. Returns
// how many the trace holds there (as gpumem_torch_trace_read), -1 when gpumem has no engine there.
GPUMEM_EXPORT std::int64_t gpumem_torch_trace_gpu_read(int device, std::int64_t* out, std::int64_t n) {
    DeviceEngine* d = existing_or_error(device);
    if (d == nullptr) return -1;
    std::vector<std::int64_t> stamp_ns;
    std::uint32_t generation = 0;
    {
        GpuClock& c = d->clock;
        std::lock_guard<std::mutex> lock(c.mutex);
        try {
            while (!c.pending.empty()) {
                d->backend->event_synchronize(c.pending.front().event);
                read_front(c, *d->backend, now_ns());
            }
        } catch (const std::exception& e) {   // the times read so far stay; the rest are unknown (-1)
            c.stopped = true;
            std::fprintf(stderr, "gpumem: reading the trace's GPU clock failed on CUDA device %d: %s\n", device,
                         e.what());
        }
        try {
            stamp_ns = c.stamp_ns;
        } catch (const std::bad_alloc&) {   // never an exception through the C boundary
            t_last_error = "gpumem: no memory to read the trace's GPU clock";
            return -1;
        }
        generation = c.generation;
    }
    try {
        return recording().recorder.trace_read_gpu(device, stamp_ns, generation, out, n);
    } catch (const std::exception& e) {
        t_last_error = std::string("gpumem: reading the trace's GPU clock failed: ") + e.what();
        return -1;
    }
}

// Copies up to `n` of `device`'s engine reserves into `out`, one per event gpumem_torch_trace_read copies, in its
// order: the engine's reserved bytes once the event's allocation was made, -1 for events without one (Note [The
// live engine's reserve]). Returns how many the trace holds there, -1 when gpumem has no engine there.
GPUMEM_EXPORT std::int64_t gpumem_torch_trace_reserved_read(int device, std::int64_t* out, std::int64_t n) {
    if (existing_or_error(device) == nullptr) return -1;
    try {
        return recording().recorder.trace_read_reserved(device, out, n);
    } catch (const std::exception& e) {
        t_last_error = std::string("gpumem: reading the trace's reserves failed: ") + e.what();
        return -1;
    }
}

// Copies up to `n` events of `device`'s trace into `out` (5 words each: kind, address, bytes,
// stream, nanoseconds); returns how many the trace holds there (call with n = 0 to size `out`), -1 when
// gpumem has no engine there.
GPUMEM_EXPORT std::int64_t gpumem_torch_trace_read(int device, std::uint64_t* out, std::int64_t n) {
    if (existing_or_error(device) == nullptr) return -1;
    return recording().recorder.trace_read(device, out, n);
}

// The policy of the engines made from now on (devices whose engine exists keep theirs): growth 0
// pages / 1 chunks, and the EngineConfig fields of the same names (any page_slack_min_nbytes is valid). Returns 0, or -1 with
// gpumem_torch_last_error() (a value out of range: nothing changed).
GPUMEM_EXPORT int gpumem_torch_configure(int growth, double page_slack, double chunk_max_fraction,
                                         double grow_ahead_fraction, int steal_empty_pages, double busy_slack,
                                         int stream_ordered_steal, std::uint64_t page_slack_min_nbytes,
                                         int plan_warmup, int wait_own_stream, int warmup_give_back,
                                         int steal_after_warmup, int steal_before_warmup, int wait_on_gpu) {
    // the ranges of AllocatorPolicy (Note [Every knob has a range] in policy.py)
    if ((growth != 0 && growth != 1) || !(page_slack >= 0.0 && page_slack <= 1.0) ||
        !(chunk_max_fraction >= 0.0 && chunk_max_fraction <= 1.0) ||
        !(grow_ahead_fraction >= 0.0 && grow_ahead_fraction <= 1.0) || !(busy_slack >= 0.0) ||
        (stream_ordered_steal != 0 && stream_ordered_steal != 1) || (plan_warmup != 0 && plan_warmup != 1) ||
        (wait_own_stream != 0 && wait_own_stream != 1) || (warmup_give_back != 0 && warmup_give_back != 1) ||
        (steal_empty_pages != 0 && steal_empty_pages != 1) || (steal_after_warmup != 0 && steal_after_warmup != 1) ||
        (steal_before_warmup != 0 && steal_before_warmup != 1) || (wait_on_gpu != 0 && wait_on_gpu != 1)) {
        t_last_error = "gpumem_torch_configure: growth must be 0 or 1, page_slack, grow_ahead_fraction and "
                       "chunk_max_fraction in [0, 1], busy_slack >= 0, steal_empty_pages, stream_ordered_steal, "
                       "plan_warmup, wait_own_stream, warmup_give_back, steal_after_warmup, steal_before_warmup and "
                       "wait_on_gpu 0 or 1";
        return -1;
    }
    TorchState& s = state();
    std::lock_guard<std::mutex> lock(s.make_mutex);
    s.config.growth = growth == 0 ? GrowthRule::kPages : GrowthRule::kChunks;
    s.config.page_slack = page_slack;
    s.config.chunk_max_fraction = chunk_max_fraction;
    s.config.grow_ahead_fraction = grow_ahead_fraction;
    s.config.steal_empty_pages = steal_empty_pages != 0;
    s.config.busy_slack = busy_slack;
    s.config.stream_ordered_steal = stream_ordered_steal != 0;
    s.config.page_slack_min_nbytes = page_slack_min_nbytes;
    s.config.plan_warmup = plan_warmup != 0;
    s.config.wait_own_stream = wait_own_stream != 0;
    s.config.warmup_give_back = warmup_give_back != 0;
    s.config.steal_after_warmup = steal_after_warmup != 0;
    s.config.steal_before_warmup = steal_before_warmup != 0;
    s.config.wait_on_gpu = wait_on_gpu != 0;
    return 0;
}

// Automatic step marks turned on (on = 1) or off (0): engines made from now on begin the memory-first warm-up
// at once, and so does every engine that exists (where its policy has one, none ran, no plan is installed:
// Note [A memory-first warm-up] in plan.py), since the first automatic mark comes after the first step. Off:
// every engine's warm-up stops as if it had not begun (its idle cache goes back; a mark by hand begins it again).
// Returns 0 (an engine whose device was lost is left as it is), -1 with gpumem_torch_last_error() when `on` is
// not 0 or 1 (nothing changes).
GPUMEM_EXPORT int gpumem_torch_plan_warmup(int on) {
    if (on != 0 && on != 1) {
        t_last_error = "gpumem_torch_plan_warmup: on must be 0 or 1";
        return -1;
    }
    TorchState& s = state();
    std::lock_guard<std::mutex> lock(s.make_mutex);
    s.warmup_at_start = on != 0;
    for (auto& slot : s.devices) {
        DeviceEngine* d = slot.load(std::memory_order_acquire);
        if (d == nullptr) continue;
        try {
            const int device = static_cast<int>(&slot - &s.devices[0]);
            if (on ? d->engine->start_plan_warmup() : d->engine->stop_plan_warmup())
                record_event(Recorder::kPlanEvent, device, 0, on ? kPlanWarmupStart : kPlanWarmupStop, 0);
        } catch (const std::exception&) {
            // a lost device's engine refuses every operation: it has nothing to warm up; the others go on
        }
    }
    return 0;
}

// ---- step plans (Note [Step plans] in gpumem/allocator/plan.py), for gpumem.torch.step() -------------------
// A step boundary on `device` (its engine made if need be): returns the MarkResult (0 nothing, 1 a recorded
// step waits for its plan, 2 the plan was dropped), or -1 with gpumem_torch_last_error().
GPUMEM_EXPORT int gpumem_torch_step_mark(int device) {
    try {
        const int result = get_or_make(device)->engine->mark_step();
        record_event(Recorder::kPlanEvent, device, 0, kPlanMark, 0);   // a replay marks there too
        return result;
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
}

// The recorded step waiting for its plan: up to `n` allocations into `out`, 4 words each (requested bytes,
// stream, free rank in its step, free rank in the next; -1 as 2**64 - 1), its generation into `*generation`
// (for gpumem_torch_step_install). Returns how many the step holds (call with n = 0 to size `out`), 0 when
// no step waits (another thread's mark took it: Note [Step plans and threads] in plan.py), or -1 with
// gpumem_torch_last_error().
GPUMEM_EXPORT std::int64_t gpumem_torch_step_template(int device, std::uint64_t* out, std::int64_t n,
                                                      std::uint64_t* generation) {
    DeviceEngine* d = existing_or_error(device);
    if (d == nullptr) return -1;
    try {
        std::vector<Engine::StepRecord> rec;
        std::uint64_t gen = 0;
        if (!d->engine->ready_step(&rec, &gen)) return 0;
        if (generation != nullptr) *generation = gen;
        const std::int64_t count = static_cast<std::int64_t>(rec.size());
        for (std::int64_t i = 0; out != nullptr && i < count && i < n; ++i) {
            const Engine::StepRecord& r = rec[static_cast<std::size_t>(i)];
            out[4 * i] = r.nbytes;
            out[4 * i + 1] = r.stream;
            out[4 * i + 2] = static_cast<std::uint64_t>(r.free_own);
            out[4 * i + 3] = static_cast<std::uint64_t>(r.free_next);
        }
        return count;
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
}

// Installs the plan of the waiting step of `generation` (gpumem_torch_step_template's; -1: whichever waits):
// `n` offsets (-1: the engine's). Returns 0, 1 when that step no longer waits (nothing installed), -2 when
// the device refused the arena's memory or address range (out of memory: nothing installed, the step runs
// without a plan), or -1 with gpumem_torch_last_error() (nothing changed for a bad plan).
GPUMEM_EXPORT int gpumem_torch_step_install(int device, const std::int64_t* offsets, std::int64_t n,
                                            std::int64_t generation) {
    DeviceEngine* d = existing(device);
    if (d == nullptr || offsets == nullptr || n < 0) {
        t_last_error = d == nullptr ? "gpumem has no engine on CUDA device " + std::to_string(device)
                                    : std::string("gpumem_torch_step_install: bad offsets");
        return -1;
    }
    try {
        return d->engine->install_plan(std::vector<std::int64_t>(offsets, offsets + n), generation) ? 0 : 1;
    } catch (const EngineError& e) {
        t_last_error = e.what();
        return e.kind == EngineErrorKind::kOutOfMemory ? -2 : -1;
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
}

// The plan layer's counters (PlanInfo.FIELDS' order), up to `n` into `out`; returns how many were written,
// 0 when gpumem has no engine on `device`, -1 on error.
GPUMEM_EXPORT int gpumem_torch_step_info(int device, std::uint64_t* out, int n) {
    DeviceEngine* d = existing(device);
    if (d == nullptr) return 0;
    if (out == nullptr || n < 0) {
        t_last_error = "gpumem_torch_step_info: bad output buffer";
        return -1;
    }
    try {
        std::vector<std::uint64_t> v = d->engine->step_plan_info();
        const int written = n < static_cast<int>(v.size()) ? n : static_cast<int>(v.size());
        for (int i = 0; i < written; ++i) out[i] = v[static_cast<std::size_t>(i)];
        return written;
    } catch (const std::exception& e) {
        t_last_error = e.what();
        return -1;
    }
}
