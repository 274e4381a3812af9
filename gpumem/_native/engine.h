// The native allocator engine: an exact C++ port of gpumem's pure-Python caching allocator in
// virtual-memory mode (gpumem/allocator/python_engine.py over VirtualBacking of backing.py, with the
// StreamFences of fences.py and the blocks and free lists of block.py), and in segment mode (over
// SegmentBacking: Note [Segment mode] in engine.cpp).
//
// Note [An exact port]: the engine makes the same decisions as the Python reference: the same
// pointers, the same device calls with the same arguments in the same order, the same stats and
// the same errors, also when a device call fails (Note [Failure atomicity] in backing.py). The
// differential test (tests/allocator/test_native_differential.py) holds it to that. Each function
// below names the Python original it mirrors; a change to the reference is ported function by
// function. The data structures differ (they are what makes the engine fast: no heap allocation
// on the hot path, best fit in an ordered set keyed (size, addr), page tables as arrays), the
// order in which they are walked does not (insertion-ordered where Python's dicts are).
//
// Threads: every public method takes the engine's mutex (PyTorch calls it from any thread). A
// caller that holds another lock the device may need (the GIL) installs lock-wait hooks so that it
// drops that lock while it waits for the engine's (Note [Waiting for the engine's lock]).
#pragma once

#include <cstddef>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <list>
#include <memory>
#include <atomic>
#include <mutex>
#include <thread>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"

namespace gpumem {

// gpumem.allocator.policy.GrowthRule: how physical chunks are sized (Note [Chunks of several pages]
// in backing.py).
enum class GrowthRule : int {
    kPages = 0,    // every chunk is one page; empty pages are stolen one by one (_map_pages)
    kChunks = 1,   // chunks of several pages, created within page_slack, moved whole (_map_runs)
};

// gpumem.allocator.policy.SegmentRule: how large a new malloc'd segment is (segment mode only;
// AllocatorPolicy.segment_nbytes).
enum class SegmentRule : int {
    kGranular = 0,   // the request rounded up to the granularity
    kPytorch = 1,    // small pool: small_segment_nbytes; large: 20 MiB under 10 MiB, else rounded to 2 MiB
    kExact = 2,      // exactly the (rounded) request
};

// Policy knobs mirrored from gpumem.allocator.policy.AllocatorPolicy (the segment-mode ones at the end).
struct EngineConfig {
    std::uint64_t round_nbytes = 512;
    std::uint64_t small_max_nbytes = 1u << 20;
    bool separate_small_pool = true;
    std::uint64_t min_split_small_nbytes = 512;
    std::uint64_t min_split_large_nbytes = 512;
    double va_reserve_factor = 2.0;
    bool steal_empty_pages = true;
    double page_slack = 0.005;
    std::uint64_t page_slack_min_nbytes = std::uint64_t{4} << 20;   // growth=CHUNKS: the slack is at least this (whole pages)
    GrowthRule growth = GrowthRule::kChunks;
    double chunk_max_fraction = 1.0 / 256;              // growth=CHUNKS: cap relative to the memory held
    std::uint64_t chunk_max_nbytes = std::uint64_t{1} << 30;   // growth=CHUNKS: absolute cap
    double grow_ahead_fraction = 0.0;                   // growth=CHUNKS: grow ahead at the top of a range
    double busy_slack = 0.05;                           // growth=CHUNKS: create past busy idle chunks within this slack
    bool stream_ordered_steal = false;                  // growth=CHUNKS: steal a chunk busy on the same stream at once
    bool wait_own_stream = false;                       // growth=CHUNKS: wait for a chunk busy on the same stream only
    bool wait_on_gpu = false;                           // growth=CHUNKS: past busy_slack, the stream waits, not the host
    std::uint64_t limit_nbytes = 0;   // 0: no limit (Python: limit_nbytes None)
    double gc_threshold = 0.0;        // 0: none (Python: gc_threshold None)
    // Segment mode (Note [Segment mode] in engine.cpp): malloc'd segments (SegmentBacking) instead of
    // a virtual range per pool; the knobs below are read in that mode only.
    bool segments = false;
    SegmentRule segment_rule = SegmentRule::kGranular;
    std::uint64_t small_segment_nbytes = std::uint64_t{2} << 20;
    bool segments_top_down = false;
    // growth=CHUNKS with step plans: grow memory-first until a plan is installed (Note [A memory-first warm-up]
    // in plan.py; Engine::warmup_)
    bool plan_warmup = true;
    bool warmup_give_back = true;   // a warm-up that ends with no plan gives the idle cache back
    // a warm-up that ends (with a plan or none) leaves the stream-ordered steal on (Note [The ordered steal after a
    // warm-up] in backing.py)
    bool steal_after_warmup = true;
    // before a warm-up has begun (or after one stopped by hand), the stream-ordered steal is on, within a budget
    // (Note [The ordered steal before a warm-up] in backing.py)
    bool steal_before_warmup = true;
    // growth=PAGES, no steal: the page size of the small / large pool's range (Note [Pages of a pool's own
    // size] in engine.cpp); 0: the device granularity (Python: small_page_nbytes / large_page_nbytes None)
    std::uint64_t small_page_nbytes = 0;
    std::uint64_t large_page_nbytes = 0;
};

// The fields of gpumem.allocator.stats.AllocatorStats, as snapshot_stats() fills them in.
struct EngineStats {
    std::uint64_t allocated_nbytes = 0;
    std::uint64_t requested_nbytes = 0;
    std::uint64_t reserved_nbytes = 0;
    std::uint64_t active_nbytes = 0;
    std::uint64_t inactive_split_nbytes = 0;
    std::uint64_t largest_free_nbytes = 0;
    std::uint64_t peak_allocated_nbytes = 0;
    std::uint64_t peak_requested_nbytes = 0;
    std::uint64_t peak_reserved_nbytes = 0;
    std::uint64_t num_allocs = 0;
    std::uint64_t num_frees = 0;
    std::uint64_t num_live_blocks = 0;
    std::uint64_t num_free_blocks = 0;
    std::uint64_t num_segments = 0;
    std::uint64_t num_splits = 0;
    std::uint64_t cache_hits = 0;
    std::uint64_t cache_misses = 0;
    std::uint64_t num_alloc_retries = 0;
    std::uint64_t num_ooms = 0;
    std::uint64_t num_gc_releases = 0;
    std::uint64_t device_calls = 0;
    std::uint64_t event_calls = 0;
    std::uint64_t plan_free_nbytes = 0;   // a step plan's arenas' mapped bytes no live allocation holds
    // backing details (VirtualBacking's describe() and counters)
    std::uint64_t n_chunks = 0;
    std::uint64_t n_steals = 0;
    std::uint64_t n_waits = 0;
    std::uint64_t n_ranges = 0;
    std::uint64_t va_nbytes = 0;
    std::uint64_t granularity_nbytes = 0;
    std::uint64_t leaked_nbytes = 0;
};

// One row per EngineStats member, in order: what the Python binding (module.cpp) and the C API
// (torch_api.cpp) walk to name and read the stats (Note [The policy and the stats from one table
// each] in module.cpp). `counter`: a field of AllocatorStats, else one of the backing's own.
struct StatField {
    const char* name;
    std::uint64_t EngineStats::*member;
    bool counter;
};
#define GPUMEM_STAT(name, counter) StatField{#name, &EngineStats::name, counter}
inline constexpr StatField kStatFields[] = {
    GPUMEM_STAT(allocated_nbytes, true), GPUMEM_STAT(requested_nbytes, true), GPUMEM_STAT(reserved_nbytes, true),
    GPUMEM_STAT(active_nbytes, true), GPUMEM_STAT(inactive_split_nbytes, true),
    GPUMEM_STAT(largest_free_nbytes, true), GPUMEM_STAT(peak_allocated_nbytes, true),
    GPUMEM_STAT(peak_requested_nbytes, true), GPUMEM_STAT(peak_reserved_nbytes, true), GPUMEM_STAT(num_allocs, true),
    GPUMEM_STAT(num_frees, true), GPUMEM_STAT(num_live_blocks, true), GPUMEM_STAT(num_free_blocks, true),
    GPUMEM_STAT(num_segments, true), GPUMEM_STAT(num_splits, true), GPUMEM_STAT(cache_hits, true),
    GPUMEM_STAT(cache_misses, true), GPUMEM_STAT(num_alloc_retries, true), GPUMEM_STAT(num_ooms, true),
    GPUMEM_STAT(num_gc_releases, true), GPUMEM_STAT(device_calls, true), GPUMEM_STAT(event_calls, true),
    GPUMEM_STAT(plan_free_nbytes, true),
    GPUMEM_STAT(n_chunks, false), GPUMEM_STAT(n_steals, false), GPUMEM_STAT(n_waits, false),
    GPUMEM_STAT(n_ranges, false), GPUMEM_STAT(va_nbytes, false), GPUMEM_STAT(granularity_nbytes, false),
    GPUMEM_STAT(leaked_nbytes, false),
};
#undef GPUMEM_STAT
static_assert(sizeof(EngineStats) == sizeof(kStatFields) / sizeof(kStatFields[0]) * sizeof(std::uint64_t),
              "every EngineStats member (all std::uint64_t) has its row in kStatFields");

enum class EngineErrorKind : int {
    kInvalidArgument = 1,   // gpumem.errors.InvalidArgumentError
    kInvalidPointer = 2,    // InvalidPointerError
    kDoubleFree = 3,        // DoubleFreeError
    kOutOfMemory = 4,       // OutOfMemoryError (with OomInfo)
    kDeviceLost = 5,        // DeviceLostError ("the device was lost: ...", after a loss)
    kInternal = 6,          // InternalError
    kClosed = 7,            // InvalidArgumentError (the allocator is closed)
};

// What the Python allocator's _oom_error() needs to build its OutOfMemoryError.
enum class OomCause : int {
    kDevice = 1,        // the device said out of memory (BackendError kOutOfMemory): generic or injected hint
    kTooLarge = 2,      // larger than the device: refused at once
    kLimit = 3,         // LimitExceeded
    kAddressSpace = 4,  // AddressSpaceExhausted
};

struct OomInfo {
    OomCause cause = OomCause::kDevice;
    std::uint64_t requested_nbytes = 0;
    std::uint64_t free_nbytes = 0;        // device mem_info() at the time of the error
    std::uint64_t total_nbytes = 0;
    std::uint64_t allocated_nbytes = 0;
    std::uint64_t cached_nbytes = 0;      // reserved - allocated (may be "negative": signed)
    std::int64_t cached_signed = 0;
    std::uint64_t reserved_nbytes = 0;
    std::uint64_t limit_nbytes = 0;       // 0: none
    std::uint64_t va_nbytes = 0;
    // step plans' arenas (in reserved): mapped, of it the dropped plans' arenas', and their live bytes
    // (engine.py oom_error's plan_*; Note [A step plan in the out-of-memory error] there)
    std::uint64_t plan_mapped_nbytes = 0;
    std::uint64_t plan_dropped_nbytes = 0;
    std::uint64_t plan_live_nbytes = 0;
    void* cause_py_exc = nullptr;         // the device's exception (Python backend), borrowed
    bool segment_mode = false;            // raised in segment mode (_oom_error's segment_mode_vmm is not None)
};

class EngineError : public std::runtime_error {
  public:
    EngineErrorKind kind;
    OomInfo oom;   // kOutOfMemory only
    EngineError(EngineErrorKind k, const std::string& what) : std::runtime_error(what), kind(k) {}
    EngineError(const OomInfo& info, const std::string& what)
        : std::runtime_error(what), kind(EngineErrorKind::kOutOfMemory), oom(info) {}
};

// Note [Waiting for the engine's lock]: with the Python backend the engine's mutex is taken with
// the GIL held, and a device call made under the mutex may drop the GIL (the simulator's own
// lock). A second Python thread that then blocked on the mutex while holding the GIL would
// deadlock with the first. So the engine first tries the lock; when it is taken, it calls
// `release()` (the binding: PyEval_SaveThread), waits, and calls `reacquire(token)`.
struct LockHooks {
    void* (*release)() = nullptr;
    void (*reacquire)(void*) = nullptr;
};

namespace detail {
struct VSeg;
struct Block;
struct FreeList;

using FenceMap = std::vector<std::pair<std::uint64_t, std::uint64_t>>;   // (stream, number), insertion order

struct BlockLess {
    using is_transparent = void;
    bool operator()(const Block* a, const Block* b) const;
    bool operator()(const Block* a, const std::pair<std::uint64_t, std::uint64_t>& k) const;
    bool operator()(const std::pair<std::uint64_t, std::uint64_t>& k, const Block* b) const;
};
using BlockSet = std::set<Block*, BlockLess>;

struct Block {
    std::uint64_t addr = 0, size = 0, requested = 0, stream = 0;
    VSeg* seg = nullptr;
    Block* prev = nullptr;
    Block* next = nullptr;
    bool allocated = false;
    FreeList* in_list = nullptr;                       // the free list holding it, if any
    std::unique_ptr<std::vector<std::uint64_t>> pending_streams;   // record_stream (sorted set)
    std::unique_ptr<FenceMap> fences;                  // freed with pending streams
    BlockSet::node_type node;                          // reused set node: no allocation per add
    BlockSet::iterator where;                          // its place in in_list's set (valid while in_list)
    std::uint64_t place = 0;   // the second half of its free-list key: addr, or its top-down place (fl_add)
};

// A free list's blocks in (size, place) order (Note [A few free blocks in an array] in engine.cpp): a sorted
// array of their keys while they are few, the ordered set of Block::node / Block::where past that. Iterated
// (begin/end, rbegin) as the set would be.
class FreeBlocks {
  public:
    struct Entry {   // a block's key kept beside it: the array's search reads no block
        std::uint64_t size, place;
        Block* b;
    };
    class iterator {
      public:
        using iterator_category = std::bidirectional_iterator_tag;
        using value_type = Block*;
        using difference_type = std::ptrdiff_t;
        using pointer = Block* const*;
        using reference = Block* const&;
        iterator() = default;
        iterator(const Entry* e, BlockSet::const_iterator it) : e_(e), it_(it) {}
        reference operator*() const { return e_ ? e_->b : *it_; }
        iterator& operator++() {
            if (e_) ++e_; else ++it_;
            return *this;
        }
        iterator& operator--() {
            if (e_) --e_; else --it_;
            return *this;
        }
        iterator operator++(int) { iterator t = *this; ++*this; return t; }
        iterator operator--(int) { iterator t = *this; --*this; return t; }
        bool operator==(const iterator& o) const { return e_ == o.e_ && it_ == o.it_; }
        bool operator!=(const iterator& o) const { return !(*this == o); }
      private:
        const Entry* e_ = nullptr;   // the array's entry (array mode), else null
        BlockSet::const_iterator it_{};
    };
    using reverse_iterator = std::reverse_iterator<iterator>;
    void add(Block* b);            // b's size and place set, b in no list
    bool remove(Block* b);         // false (nothing changed) when b is not here
    Block* best_fit(std::uint64_t size) const;   // the first block of size >= size, or null
    bool empty() const { return set_mode_ ? set_.empty() : arr_.empty(); }
    std::size_t size() const { return set_mode_ ? set_.size() : arr_.size(); }
    iterator begin() const { return set_mode_ ? iterator(nullptr, set_.begin()) : iterator(arr_.data(), {}); }
    iterator end() const {
        return set_mode_ ? iterator(nullptr, set_.end()) : iterator(arr_.data() + arr_.size(), {});
    }
    reverse_iterator rbegin() const { return reverse_iterator(end()); }
    reverse_iterator rend() const { return reverse_iterator(begin()); }
  private:
    void to_set();
    void to_array();
    bool set_mode_ = false;
    std::vector<Entry> arr_;
    BlockSet set_;
};

struct FreeList {
    bool small = false;
    std::uint64_t stream = 0;
    FreeBlocks blocks;
    std::uint64_t nbytes = 0;
};

// A few stream -> number pairs: the `batch` (the fence recorded on each stream in this pass) and `busy` (the
// oldest fence found pending on each) dicts of one steal or give-back in backing.py. A steal made two hash maps
// and up to three allocations for one or two streams; these hold kInline pairs in place, more in a vector.
class StreamNumbers {
  public:
    const std::uint64_t* find(std::uint64_t stream) const {   // nullptr: absent
        for (std::size_t i = 0; i < n_inline_; ++i)
            if (inline_[i].first == stream) return &inline_[i].second;
        for (const auto& e : more_)
            if (e.first == stream) return &e.second;
        return nullptr;
    }
    void set(std::uint64_t stream, std::uint64_t number) {   // d[stream] = number
        for (std::size_t i = 0; i < n_inline_; ++i)
            if (inline_[i].first == stream) { inline_[i].second = number; return; }
        for (auto& e : more_)
            if (e.first == stream) { e.second = number; return; }
        if (n_inline_ < kInline) inline_[n_inline_++] = {stream, number};
        else more_.emplace_back(stream, number);
    }
  private:
    static constexpr std::size_t kInline = 4;
    std::pair<std::uint64_t, std::uint64_t> inline_[kInline];
    std::size_t n_inline_ = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> more_;
};

// A hash map uint64 (nonzero) -> pointer, open addressing: no allocation per insert.
class PtrMap {
  public:
    PtrMap();
    void* get(std::uint64_t key) const;
    void put(std::uint64_t key, void* value);
    bool erase(std::uint64_t key);
    std::size_t size() const { return n_; }
    template <class F> void for_each(F f) const {
        for (const Slot& e : slots_) if (e.key) f(e.key, e.value);
    }
    void clear();
  private:
    struct Slot {   // key and value side by side: one cache line per probe
        std::uint64_t key;
        void* value;
    };
    void grow();
    std::vector<Slot> slots_;
    std::size_t n_ = 0, mask_ = 0;
};
}  // namespace detail

// Errors: a device error the Python allocator lets through is rethrown as the backend's BackendError
// (out of memory, device lost, other; with the Python backend, py_exc is the device's exception,
// valid until the backend's clear_errors()); everything the allocator itself raises is an
// EngineError (kOutOfMemory carries OomInfo, the numbers of PythonEngine._oom_error).
// Backend contract beyond backend.h: mem_create never returns ChunkHandle 0 (the engine's page
// tables use 0 for "no chunk"); EventHandle may be any value.
class Engine {
  public:
    // Does not own `backend`, which must outlive the engine. Reserves nothing yet; calls
    // backend.info() once (total memory, granularity).
    Engine(Backend& backend, const EngineConfig& config);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // PythonEngine.allocate: a device pointer for `nbytes` (> 0) on `stream`.
    std::uint64_t allocate(std::uint64_t nbytes, std::uint64_t stream);
    // The hot path alone (Note [The hot path makes no device call]): the pointer, or 0 when the
    // request needs the full allocate() (which then decides exactly as Python's slow path). With
    // `size_out`, the block's size is written there too (what block_size(ptr) would say, under the
    // same lock: CuPy's hook needs both, Note [CuPy's allocator in C]).
    std::uint64_t try_allocate_fast(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out = nullptr);
    // What allocate() raises before it looks at the cache, when it cannot serve (kDeviceLost once the
    // device was lost, kClosed once close() ran); returns when neither.
    void check_open();
    // PythonEngine.free.
    void free(std::uint64_t ptr);
    // The free hot path alone: true when done, false when free() must run (changes nothing then).
    bool try_free_fast(std::uint64_t ptr);
    void record_stream(std::uint64_t ptr, std::uint64_t stream);
    std::uint64_t empty_cache();
    void synchronize();
    // Gives everything back (Note [Closing waits for the streams] in caching.py); idempotent.
    void close();

    EngineStats stats();                       // snapshot_stats(), under the lock
    // PyTorch's C++ allocator interface (gpumem/_shim/torch_shim.cpp): the limit on reserved memory from
    // now on (0: none; memory already held beyond it is kept, as torch.cuda.set_per_process_memory_fraction
    // keeps it), beyond the Python reference; and peaks reset to the current values, reserved with a step
    // plan's arena (torch.cuda.reset_peak_memory_stats; PythonEngine.reset_peak_stats).
    void set_limit_nbytes(std::uint64_t nbytes);
    std::uint64_t limit_nbytes();
    void reset_peak_stats();
    std::uint64_t reserved_nbytes();
    std::uint64_t allocated_nbytes();
    // PythonEngine.releasable_nbytes: what empty_cache's release of the engine's cache would give back now, its
    // fences waited for, changing nothing; with `with_carried`, were the READY step's carried blocks freed too
    // (Note [The room counts whole chunks] in plan.py). 0 once closed; kDeviceLost once the device was lost.
    std::uint64_t releasable_nbytes(bool with_carried = false);
    std::uint64_t block_size(std::uint64_t ptr);   // throws kInvalidPointer for a non-live pointer
    std::vector<std::pair<std::uint64_t, std::uint64_t>> live_blocks();   // (ptr, size)
    // check_consistency(): the engine's own invariants, plus the device's mappings (va, nbytes,
    // chunk) and reservations (va, nbytes) that `list_device` fills in (it returns whether the
    // device lists its reservations; empty function: the engine's own invariants only). It runs
    // under the engine's lock, after a mem_info() that notices a lost device (remembered, as in
    // every operation), so that what it lists matches the engine's state while other threads
    // allocate. The problems found (empty: consistent).
    using DeviceMaps = std::vector<std::tuple<std::uint64_t, std::uint64_t, ChunkHandle>>;
    using Reservations = std::vector<std::pair<std::uint64_t, std::uint64_t>>;
    using ListDevice = std::function<bool(DeviceMaps& maps, Reservations& reservations)>;
    std::vector<std::string> consistency_problems(const ListDevice& list_device);
    bool closed();
    bool lost();
    std::string describe();
    std::uint64_t total_nbytes() const { return total_nbytes_; }
    void set_lock_hooks(const LockHooks& hooks) { hooks_ = hooks; }
    // Whether the calling thread holds the engine's lock: it is inside one of the engine's
    // operations (a device call ran Python that came back). Note [Re-entry from the lock's thread].
    bool held_by_this_thread() const { return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id(); }

    // -- step plans: gpumem/allocator/plan.py's StepPlan (Note [Step plans] there) ---------------------------
    // Off until mark_step(): while off, the hot paths pay one test (plan_active()); while on, the fast paths
    // serve what the plan serves with no device call (a slot whose pages are mapped, a free of the current
    // arena's) and step aside for the rest (allocate()/free() run the plan layer).
    // A step boundary: returns MarkResult (0 nothing, 1 a recorded step waits for its plan, 2 the plan was
    // dropped). The READY step (requested bytes, streams, free rank in its step, in the next; -1: none),
    // and the plan's install (an offset per allocation, -1: the engine's). The layer's counters, in the
    // order of PlanInfo.FIELDS. Note [Step plans and threads] (plan.py): ready_step gives the READY step and
    // its generation (false: none waits); install_plan with a generation (>= 0) installs nothing and returns
    // false when that READY step went away; without one (-1), no READY step raises.
    int mark_step();
    bool start_plan_warmup();   // PythonEngine.start_plan_warmup (Note [A memory-first warm-up] in plan.py)
    bool stop_plan_warmup();    // PythonEngine.stop_plan_warmup
    struct StepRecord {
        std::uint64_t nbytes;
        std::uint64_t stream;
        std::int64_t free_own;
        std::int64_t free_next;
    };
    std::vector<StepRecord> step_template();
    bool ready_step(std::vector<StepRecord>* out, std::uint64_t* generation);
    bool install_plan(const std::vector<std::int64_t>& offsets, std::int64_t generation = -1);
    std::vector<std::uint64_t> step_plan_info();
    // Records a recorded step may hold before it is abandoned (plan.py StepPlan.set_record_limit, Note [When
    // marks stop]); the caller checked it is in [1, 2**40].
    void set_step_record_limit(std::uint64_t records);
    // Planned steps from an install within which a step that leaves the plan drops it (plan.py
    // StepPlan.early_leave_steps, Note [A plan that leaves early]; 0: never).
    void set_early_leave_steps(std::uint64_t steps);
    // Note [One lock for a run of fast paths] (engine.cpp): the lock taken once for a run of try_allocate_fast
    // and try_free_fast calls (the binding's run_ops, Note [A step's ops in one call] in op_table.h), which nest
    // in it; the holder calls nothing else and runs no Python until release_for_fast_run().
    void hold_for_fast_run();
    void release_for_fast_run();
    // try_allocate_fast and try_free_fast for the thread that holds the lock through hold_for_fast_run(), which
    // they do not take again (Note [Fast paths under a held run] in engine.cpp); kInternal when it is not held.
    std::uint64_t try_allocate_fast_held(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out = nullptr);
    bool try_free_fast_held(std::uint64_t ptr);
    // Note [The small pool's state as bytes] (engine.cpp): everything the small pool's next ops depend on, packed
    // as little-endian 64-bit words, for the estimate's fast replay to compare exactly (gpumem/estimate/fastreplay.py).
    std::string small_pool_state();

  private:
    struct Guard;
    // -- plan.py: StepPlan -----------------------------------------------------------------------------
    enum PlanState : int { kPlanOff = 0, kPlanRecording = 1, kPlanRecordingNext = 2, kPlanReady = 3, kPlanPlanned = 4 };
    static constexpr std::size_t kFixedSlot = static_cast<std::size_t>(-1);   // plan.py slot -1: a kept block fixed
    struct PlanLive {
        std::size_t slot;   // kFixedSlot: kept, no slot meets it any more (Note [Moving slots off kept blocks])
        std::uint64_t size, requested;
    };
    struct PlanRun {
        std::uint64_t va, nbytes;
        ChunkHandle h;
        bool unmapped = false;   // a failed release's retry only releases it (plan.py _Arena.runs)
    };
    struct PlanArena {   // plan.py's _Arena
        std::uint64_t base = 0, nbytes = 0;
        std::uint64_t extent_nbytes = 0;   // the plan's extent in the reservation, pages rounded (PlanInfo.arena_nbytes)
        std::vector<ChunkHandle> pages;   // 0: unmapped
        std::vector<PlanRun> runs;
        std::uint64_t mapped_nbytes = 0;
        std::set<std::uint64_t> streams;
        std::unordered_map<std::uint64_t, PlanLive> live;
        bool dropped = false;
        bool holds(std::uint64_t p) const { return p >= base && p < base + nbytes; }
    };
    bool plan_active() const { return plan_state_ != kPlanOff || !arenas_.empty(); }
    // plan.py StepPlan.holds_memory: plan_shrink() has something to drop or give back
    bool plan_holds_memory() const { return plan_state_ == kPlanPlanned || !arenas_.empty(); }
    void plan_reset_recording();
    void plan_clear_slots();
    void plan_slide();
    std::uint64_t plan_allocate(std::uint64_t nbytes, std::uint64_t stream);
    std::uint64_t plan_serve(std::uint64_t nbytes, std::uint64_t stream);
    bool plan_slot_live(std::size_t k) const;
    std::int64_t plan_slot_taken(std::uint64_t off, std::uint64_t size) const;   // the live slot meeting [off, off + size), -1: none
    std::uint64_t plan_hand_out(PlanArena* arena, std::size_t k, std::uint64_t nbytes);   // slot k served
    std::uint64_t plan_serve_fast(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out);
    bool plan_free_fast(std::uint64_t ptr);
    void plan_occupy(std::size_t k, bool live);
    void plan_move_off_kept();   // plan.py _move_off_kept
    void count_alloc(std::uint64_t size, std::uint64_t nbytes);
    bool plan_map(PlanArena* arena, std::uint64_t off, std::uint64_t size);
    void plan_book_run(PlanArena* arena, std::uint64_t va, std::uint64_t nb, ChunkHandle h);
    bool plan_free(std::uint64_t ptr);
    void plan_record_free(std::uint64_t ptr);
    void plan_record_cross_stream(std::uint64_t ptr);
    // the arena and live entry of a live arena pointer (nullptr: in no arena); throws kInvalidPointer inside one
    // The arena holding `ptr` with its live entry in `out`, or null when no arena holds it; an arena that
    // holds it with no live allocation there raises (worded for a free when `freeing`).
    PlanArena* plan_arena_entry(std::uint64_t ptr, PlanLive* out, bool freeing = false);
    bool plan_record_stream(std::uint64_t ptr, std::uint64_t stream);
    void plan_drop();
    void plan_shrink();   // plan.py StepPlan.shrink
    void plan_give_back_dropped();
    void plan_give_back_idle_runs(PlanArena* arena);   // plan.py _give_back_idle_runs
    std::uint64_t plan_give_back_idle();   // plan.py give_back_idle (empty_cache)
    int plan_mark();   // plan.py StepPlan._mark
    bool plan_step_hit() const { return !missed_ && !left_; }   // plan.py _step_hit (Note [A step that ends early])
    bool plan_drops(std::uint32_t bits) const;   // plan.py _drops
    bool plan_end_step();   // plan.py _end_step
    bool plan_restarts(std::uint64_t nbytes, std::uint64_t stream) const;   // plan.py _restarts
    void plan_release(PlanArena* arena);
    void plan_give_back_run(PlanArena* arena, std::size_t i);
    void plan_close();
    std::uint64_t plan_live_nbytes() const;
    const std::pair<std::uint64_t, std::uint64_t>* plan_released_arena(std::uint64_t ptr) const;
    std::uint64_t allocate_engine(std::uint64_t nbytes, std::uint64_t stream);   // PythonEngine._allocate_engine
    void free_engine(std::uint64_t ptr);                                          // PythonEngine._free_engine
    std::uint64_t empty_cache_locked();                                           // PythonEngine._empty_cache_locked

    // reentrant: the thread that holds the lock may take it again (reads); otherwise it throws
    // kInternal (Note [Re-entry from the lock's thread]).
    void lock(bool reentrant = false);
    void unlock();

    // -- python_engine.py: PythonEngine ----------------------------------------------------------
    void check_usable_op();
    std::uint64_t allocate_slow(std::uint64_t nbytes, std::uint64_t size, bool small, std::uint64_t stream);
    std::uint64_t round_up_nbytes(std::uint64_t nbytes) const;   // policy.round(nbytes), saturated
    bool never_fits(std::uint64_t size) const;   // PythonEngine._never_fits: over the device or the limit
    std::uint64_t hand_out(detail::Block* b, std::uint64_t nbytes, std::uint64_t stream);
    void free_booked(std::uint64_t ptr, detail::Block* b);
    void begin_multi_stream();
    detail::Block* grow(bool small, std::uint64_t stream, std::uint64_t size, detail::FreeList* fl,
                        std::uint64_t nbytes);
    detail::Block* grow_once(bool small, std::uint64_t stream, std::uint64_t size, detail::FreeList* fl);
    std::uint64_t release_cached_all(bool wait);               // PythonEngine._release_cached
    bool anything_to_wait_for();
    bool reown_idle(std::uint64_t stream, detail::FreeList* fl);
    detail::Block* retry_after_release(bool small, std::uint64_t stream, std::uint64_t size,
                                       detail::FreeList* fl, std::uint64_t nbytes);
    std::uint64_t kept_nbytes(const detail::Block* b, std::uint64_t size, bool small) const;
    detail::Block* split(detail::Block* b, std::uint64_t size, bool small, detail::FreeList* fl);
    void insert_free(detail::Block* b);
    detail::FreeList* free_list_of(const detail::Block* b);
    detail::FreeList* free_list_get(bool small, std::uint64_t stream);
    detail::FreeList* free_list_make(bool small, std::uint64_t stream);
    std::uint64_t process_pending(bool wait);
    EngineError oom_error(std::uint64_t nbytes, OomCause cause, void* cause_exc);
    OomInfo device_oom_info(OomCause cause, std::uint64_t requested);
    std::string inside_live(std::uint64_t ptr) const;
    std::vector<std::uint64_t> streams_in_use();
    void note_lost(const std::string& what);

    // -- block.py ------------------------------------------------------------------------------
    detail::Block* new_block(std::uint64_t addr, std::uint64_t size, std::uint64_t stream, detail::VSeg* seg);
    void recycle_block(detail::Block* b);
    detail::Block* split_block(detail::Block* b, std::uint64_t size);
    detail::Block* merge_blocks(detail::Block* left, detail::Block* right);
    void append_block(detail::VSeg* seg, detail::Block* b);
    detail::Block* drop_last_block(detail::VSeg* seg);
    void fl_add(detail::FreeList* fl, detail::Block* b);
    void fl_remove(detail::FreeList* fl, detail::Block* b);
    static detail::Block* fl_best_fit(detail::FreeList* fl, std::uint64_t size);

    // -- fences.py: StreamFences -----------------------------------------------------------------
    std::uint64_t fences_record(std::uint64_t stream);
    struct StreamQueue;
    using FenceQueueIndex = std::unordered_map<std::uint64_t, std::list<StreamQueue>::iterator>;
    FenceQueueIndex::iterator fences_new_queue(std::uint64_t stream);
    void fences_drop_queue(FenceQueueIndex::iterator it);
    bool fences_done(std::uint64_t stream, std::uint64_t number);
    void fences_wait(std::uint64_t stream, std::uint64_t number);
    void destroy_retired_event(EventHandle event);
    bool fences_all_done(const detail::FenceMap* f);
    void fences_wait_all(const detail::FenceMap* f);
    void fences_order_after(std::uint64_t waiting, std::uint64_t stream, std::uint64_t number);
    bool fences_event_of(std::uint64_t stream, std::uint64_t number, EventHandle* out);
    void fences_forget_idle();
    void fences_close();
    std::uint64_t fences_done_of(std::uint64_t stream) const;
    static void merge_fences(std::unique_ptr<detail::FenceMap>& into, std::uint64_t stream, std::uint64_t number);

    // -- backing.py: VirtualBacking (same names) ------------------------------------------------------
    void check_limit(std::uint64_t extra_nbytes, std::uint64_t requested);
    detail::VSeg* segment(bool small);                          // _segment
    detail::VSeg* range_of(bool small);
    std::uint64_t extend(detail::VSeg* seg, std::uint64_t stream, std::uint64_t extra_nbytes, std::uint64_t requested);
    bool lower_top(detail::VSeg* seg, std::uint64_t addr, std::uint64_t stream, bool wait);
    void wait_top(detail::VSeg* seg, std::uint64_t stream);
    [[noreturn]] void va_exhausted(std::uint64_t nbytes);
    void commit(detail::Block* b);
    bool commit_quietly(detail::Block* b, std::uint64_t nbytes);
    void decommit(detail::Block* b);
    void fence_page(detail::VSeg* seg, std::int64_t page, detail::StreamNumbers& batch);
    bool page_ready(detail::VSeg* seg, std::int64_t page, bool wait,
                    detail::StreamNumbers& batch,
                    detail::StreamNumbers* busy = nullptr);
    std::uint64_t stealable(detail::VSeg* seg, std::int64_t first, std::int64_t last);
    void map_pages(detail::VSeg* seg, const std::vector<std::int64_t>& need, std::int64_t first, std::int64_t last,
                   std::uint64_t requested);
    std::uint64_t release_unmapped(std::int64_t count);        // count < 0: all
    ChunkHandle unmap_page(detail::VSeg* seg, std::int64_t p);
    void forget_page(detail::VSeg* seg, std::int64_t p);
    void steal(detail::VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t count, std::uint64_t requested);
    bool create_instead(std::uint64_t requested);
    std::uint64_t backing_release_cached(bool wait);            // VirtualBacking.release_cached
    void backing_close(bool keep_all);
    std::uint64_t mapped_empty_nbytes() const;
    std::uint64_t backing_largest_free_nbytes() const;
    // chunks of several pages (Note [Chunks of several pages] in backing.py; same names)
    std::uint64_t chunk_nbytes(ChunkHandle h) const;           // PhysicalHandle.nbytes
    std::int64_t chunk_pages(ChunkHandle h) const { return static_cast<std::int64_t>(chunk_nbytes(h) / g_); }
    std::uint64_t unmapped_nbytes() const;                     // sum(h.nbytes for h in unmapped)
    void note_chunk(ChunkHandle h, std::uint64_t nbytes);     // a chunk mem_create'd: counted as held
    std::int64_t chunk_start(detail::VSeg* seg, std::int64_t p) const;
    std::int64_t mapped_chunk_pages(const detail::VSeg* seg, std::int64_t p) const;   // chunk_pages(seg->chunks[p])
    std::int64_t chunk_cap_pages() const;
    std::int64_t chunk_cap_pages_of(std::int64_t held_pages, const EngineConfig& k) const;   // AllocatorPolicy.chunk_cap_pages
    void map_runs(detail::VSeg* seg, const std::vector<std::int64_t>& need, std::int64_t first, std::int64_t last,
                  std::uint64_t requested, std::uint64_t stream, std::int64_t whole_lo, std::int64_t whole_hi);
    bool take_cached(std::int64_t max_pages, ChunkHandle* out);
    void map_chunk(detail::VSeg* seg, std::int64_t pos, ChunkHandle h);
    std::int64_t growth_pages(detail::VSeg* seg, std::int64_t pos, std::int64_t rem, bool at_top, std::int64_t budget);
    ChunkHandle chunk_for(detail::VSeg* seg, std::int64_t pos, std::int64_t rem, bool at_top, std::int64_t first,
                          std::int64_t last, std::int64_t budget, std::uint64_t requested, std::uint64_t stream,
                          std::int64_t unshared);
    ChunkHandle create_chunk(std::int64_t n_pages, std::uint64_t requested);
    struct IdleChunk {   // (pages, address, first page, range), as _idle_chunks' tuples
        std::int64_t n;
        std::uint64_t addr;
        std::int64_t s;
        detail::VSeg* seg;
    };
    void idle_chunks(detail::VSeg* seg, std::int64_t first, std::int64_t last, std::vector<IdleChunk>& found);
    bool chunk_ready(detail::VSeg* seg, std::int64_t s, bool wait, detail::StreamNumbers& batch,
                     detail::StreamNumbers* busy = nullptr);
    bool steal_chunk(detail::VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t max_pages,
                     std::uint64_t requested, std::uint64_t stream, std::int64_t unshared, ChunkHandle* out);
    // stream-ordered steal (Note [Stream-ordered steal] in backing.py; same names)
    detail::FenceMap chunk_fences(detail::VSeg* seg, std::int64_t s, detail::StreamNumbers& batch);
    ChunkHandle defer_unmap(detail::VSeg* seg, std::int64_t s, detail::FenceMap pending);
    struct StolenOrdered {   // VirtualBacking._stolen_ordered's entries: a deferred entry and its noaccess pages
        detail::VSeg* seg;
        std::int64_t s;
        ChunkHandle h;
        std::vector<std::int64_t> noaccess;
    };
    void undefer(const StolenOrdered& st);
    void drain_deferred(bool wait, detail::VSeg* seg, const std::vector<std::int64_t>* pages,
                        const std::vector<ChunkHandle>* handles);
    bool has_deferred(ChunkHandle h) const;
    bool release_idle_chunk(detail::VSeg* seg, std::int64_t first, std::int64_t last, bool wait);
    ChunkHandle unmap_chunk(detail::VSeg* seg, std::int64_t s);

    Backend& backend_;
    EngineConfig cfg_;
    LockHooks hooks_;
    std::mutex mutex_;
    std::atomic<std::thread::id> owner_{};   // the thread that holds mutex_, or none
    int depth_ = 0;                          // how many times owner_ took it (under mutex_)
    bool fast_run_held_ = false;             // hold_for_fast_run() holds it (Note [One lock for a run of fast paths])
    std::uint64_t total_nbytes_ = 0, g_ = 0, va_nbytes_ = 0;
    std::int64_t small_max_ = -1;

    // PythonEngine state
    std::unordered_map<std::uint64_t, detail::FreeList*> fl_index_[2];   // [small][stream]
    std::list<std::unique_ptr<detail::FreeList>> fl_order_;              // insertion order (dict order)
    detail::FreeList* fl_last_[2] = {nullptr, nullptr};                  // [small]: free_list_get's last find
    detail::PtrMap live_;
    std::vector<std::uint64_t> live_order_;                               // unused slots: 0
    detail::PtrMap freed_;
    std::vector<std::uint64_t> freed_ring_;
    std::size_t freed_head_ = 0, freed_count_ = 0;
    std::vector<detail::Block*> pending_;
    EngineStats st_;
    bool closed_ = false, committed_ = false, lost_ = false;
    std::string lost_what_;
    std::uint64_t leaked_nbytes_ = 0;
    std::vector<detail::Block*> block_pool_;
    std::vector<std::unique_ptr<detail::Block[]>> block_slabs_;

    // StreamFences state
    struct StreamQueue {
        std::uint64_t stream;
        std::vector<std::pair<std::uint64_t, EventHandle>> q;   // (number, event), oldest first
        std::size_t head = 0;
        std::size_t size() const { return q.size() - head; }
    };
    std::list<StreamQueue> fq_order_;
    FenceQueueIndex fq_index_;
    std::list<StreamQueue> fq_spare_;                          // nodes of dropped queues, for fences_new_queue
    std::vector<FenceQueueIndex::node_type> fq_index_spare_;   // fq_index_'s, likewise
    std::unordered_map<std::uint64_t, std::uint64_t> fdone_;
    std::uint64_t fnext_ = 1;
    std::uint64_t n_records_ = 0, n_queries_ = 0, f_n_waits_ = 0, n_destroys_ = 0, n_stream_waits_ = 0;

    // VirtualBacking state
    std::vector<std::unique_ptr<detail::VSeg>> vsegs_;   // creation order (dict order); at most 2
    std::vector<std::unique_ptr<detail::VSeg>> closed_vsegs_;   // given back by close(): kept for the blocks naming them
    detail::VSeg* vseg_by_key_[2] = {nullptr, nullptr};
    std::vector<ChunkHandle> unmapped_;
    struct Deferred {   // VirtualBacking.deferred's entries
        detail::VSeg* seg;
        std::int64_t s;
        ChunkHandle h;
        detail::FenceMap fences;
    };
    std::vector<Deferred> deferred_;
    std::uint64_t reserved_nbytes_ = 0, n_segments_ = 0, device_calls_ = 0;
    std::uint64_t n_chunks_ = 0, n_steals_ = 0, n_waits_ = 0;
    double busy_pages_ = 0.0;   // VirtualBacking._busy_pages
    // commit's `need` and map_runs' `mapped`, kept between calls for their capacity (neither runs inside itself)
    std::vector<std::int64_t> commit_need_, map_runs_mapped_;
    std::int64_t live_pages_ = 0, peak_live_pages_ = 0;
    bool chunked_ = true;                                        // VirtualBacking.chunked
    std::unordered_map<ChunkHandle, std::uint64_t> chunk_nbytes_;   // every chunk held -> its size
    std::vector<ChunkHandle>* created_ = nullptr;               // VirtualBacking._created
    std::vector<StolenOrdered>* stolen_ordered_ = nullptr;      // VirtualBacking._stolen_ordered
    bool have_first_stream_ = false, multi_stream_ = false;
    std::uint64_t first_stream_ = 0;

    // StepPlan state
    int plan_state_ = kPlanOff;
    std::vector<StepRecord> rec_cur_, rec_prev_;
    std::unordered_map<std::uint64_t, std::size_t> rec_cur_map_, rec_prev_map_;
    bool rec_cur_cross_ = false, rec_prev_cross_ = false;   // a recorded step used record_stream on another stream
    std::uint64_t since_mark_ = 0;
    std::vector<std::unique_ptr<PlanArena>> arenas_;   // the current plan's last; dropped ones until their last free
    std::vector<std::pair<std::uint64_t, std::uint64_t>> released_arenas_;   // (base, nbytes) of the last ones given back
    std::vector<std::int64_t> slot_off_;
    std::vector<std::uint64_t> slot_size_, slot_stream_;
    // The live slots as a Fenwick tree over the planned slots sorted by (offset, slot): occ_start_[i] and
    // occ_slot_[i] at position i, slot_pos_[k] the position of slot k; plan.py's _Ranges (plan_slot_taken).
    std::vector<std::uint64_t> occ_start_;
    std::vector<std::size_t> occ_slot_, slot_pos_, occ_tree_;
    std::vector<char> slot_poisoned_;
    std::vector<std::uint64_t> slot_served_in_;   // plan.py served_in: the planned step each slot was last served in
    std::vector<std::int64_t> slot_e1_, slot_e2_;   // plan.py e1, e2: each slot's lifetime in ranks
    std::uint64_t blocked_nbytes_ = 0;   // plan.py blocked_nbytes: served by the engine because of kept blocks
    std::int64_t moved_at_ = -1;   // plan.py moved_at: the planned step of the last move off kept blocks
    std::uint64_t plan_moves_ = 0;   // plan.py counts["moves"]
    std::size_t cursor_ = 0;
    bool left_ = false, missed_ = false;
    bool plan_broken_ = false;   // plan.py broken: a mapping of the arena could not be undone; drop at the next mark
    std::uint32_t miss_bits_ = 0;   // plan.py miss_bits: the last kMissWindow planned steps, 1 for a miss
    std::uint64_t plan_generation_ = 0;   // plan.py StepPlan.generation
    std::uint64_t planned_steps_ = 0;
    std::uint64_t plan_mapped_nbytes_ = 0;
    std::uint64_t plan_served_ = 0, plan_fallback_ = 0, plan_steps_hit_ = 0, plan_steps_missed_ = 0,
                  plans_installed_ = 0, plans_dropped_ = 0, plan_arena_calls_ = 0;
    std::uint64_t plan_recordings_abandoned_ = 0;   // plan.py counts["recordings_abandoned"]
    std::uint64_t plan_implicit_steps_ = 0;   // plan.py counts["implicit_steps"] (Note [An implicit step restart])
    std::uint64_t record_limit_ = std::uint64_t{1} << 14;   // plan.py record_limit (RECORD_LIMIT)
    std::uint64_t early_drops_ = 0;   // plan.py early_drops (Note [A plan that leaves early])
    std::uint64_t early_leave_steps_ = 16;   // plan.py early_leave_steps (EARLY_LEAVE_STEPS)
    // Note [A memory-first warm-up] in plan.py: VirtualBacking.warmup and StepPlan's warmup_* (same names)
    bool warmup_ = false, warmup_done_ = false;
    EngineConfig memory_first_;   // AllocatorPolicy.memory_first(): the growth knobs while warm
    // VirtualBacking.after_warmup: a warm-up ended and cfg_.steal_after_warmup (Note [The ordered steal after a
    // warm-up] in backing.py); steal_knobs_ (VirtualBacking._steal_knobs): cfg_ with the stream-ordered steal, the
    // knobs of the after- and the before-rule
    bool after_warmup_ = false;
    EngineConfig steal_knobs_;
    // VirtualBacking.before_steals / before_ended: steals of every kind made while cfg_.steal_before_warmup alone
    // gives the stream-ordered steal; the rule ends for the run where they pass kBeforeStealBurst plus one per
    // kBeforeStealAllocs allocations (Note [The ordered steal before a warm-up] in backing.py)
    std::uint64_t before_steals_ = 0;
    bool before_ended_ = false;
    static constexpr std::uint64_t kBeforeStealAllocs = 256;   // backing.py BEFORE_STEAL_ALLOCS
    static constexpr std::uint64_t kBeforeStealBurst = 512;    // backing.py BEFORE_STEAL_BURST
    bool before_rule_alone() const { return !(warmup_ || after_warmup_ || cfg_.stream_ordered_steal); }
    bool ordered_steal_allowed() const {   // VirtualBacking._ordered_steal_allowed
        return knobs().stream_ordered_steal && !(before_rule_alone() && before_ended_);
    }
    void count_steal() {   // VirtualBacking._count_steal
        ++n_steals_;
        if (before_ended_ || !(before_rule_alone() && knobs().stream_ordered_steal)) return;
        if (++before_steals_ > kBeforeStealBurst + st_.num_allocs / kBeforeStealAllocs) before_ended_ = true;
    }
    const EngineConfig& knobs() const {   // VirtualBacking.knobs
        if (warmup_) return memory_first_;
        // the steal after a warm-up ended, or before one ended where the policy says so (warmup_done_ is
        // VirtualBacking.warmup_ended; Note [The ordered steal before a warm-up] in backing.py)
        return after_warmup_ || (!warmup_done_ && cfg_.steal_before_warmup) ? steal_knobs_ : cfg_;
    }
    std::uint64_t warmup_marks_ = 0, warmup_since_ = 0;
    bool plan_start_warmup();   // StepPlan.start_warmup (caller holds mu_)
    void plan_end_warmup(bool planned);   // StepPlan.end_warmup
    void plan_check_warmup();   // StepPlan.check_warmup

    // -- segment mode: backing.py SegmentBacking (Note [Segment mode] in engine.cpp; same names) -----------
    std::uint64_t segment_nbytes(bool small, std::uint64_t nbytes) const;   // AllocatorPolicy.segment_nbytes
    detail::VSeg* new_segment(bool small, std::uint64_t stream, std::uint64_t nbytes);
    detail::Block* grow_segment(bool small, std::uint64_t stream, std::uint64_t size);   // _grow_once, segments
    std::uint64_t segments_release_cached(bool wait);   // SegmentBacking.release_cached
    void drop_blocks(detail::VSeg* seg);                // PythonEngine._drop_blocks
    void segments_close(const std::vector<std::uint64_t>& failed);   // SegmentBacking.close with close()'s keep
    void segment_streams(const detail::VSeg* seg, std::set<std::uint64_t>& out) const;   // _segment_streams
    bool in_some_segment(std::uint64_t ptr) const;     // any segment of segments_list() holds ptr
    void segments_consistency_problems(const Reservations* allocations, std::vector<std::string>& problems);
    std::vector<std::unique_ptr<detail::VSeg>> msegs_;          // SegmentBacking.segments, creation order
    std::vector<std::unique_ptr<detail::VSeg>> closed_msegs_;   // given back by close(): kept for the blocks naming them
    std::uint64_t order_low_ = std::uint64_t{1} << 62;          // SegmentBacking._order_low (_TOP_DOWN_START)
    bool top_down_ = false;                                     // segments_top_down in segment mode
    // Pages of a pool's own size (Note [Pages of a pool's own size] in engine.cpp)
    bool custom_pages_ = false;                // VirtualBacking.custom_pages
    std::uint64_t page_nbytes_[2] = {0, 0};    // VirtualBacking.page_nbytes: [large, small] (the range's key)
    std::int64_t seg_chunk_pages(const detail::VSeg* seg, ChunkHandle h) const;   // h.nbytes // seg.page_nbytes
    // Note [An index of idle chunks] in backing.py: VirtualBacking._idle_keys (same names)
    using IdleKey = std::pair<std::int64_t, std::uint64_t>;   // (pages, address)
    std::set<IdleKey> idle_index_;
    std::vector<std::set<IdleKey>::node_type> idle_nodes_;   // nodes of entries idle_at dropped, for idle_index_add
    struct IdleWalk {   // _idle_walk's generator: the chunks found so far, and where it is in the index
        detail::VSeg* seg = nullptr;
        std::int64_t first = 0, last = -1;
        bool descending = true, done = false;
        std::set<IdleKey>::iterator pos;
        std::vector<IdleChunk> got;   // borrowed from `spare` (no allocation per steal), given back at the end
        std::vector<std::vector<IdleChunk>>& spare;
        explicit IdleWalk(std::vector<std::vector<IdleChunk>>& from) : spare(from) {
            if (spare.empty()) return;
            got = std::move(spare.back());
            spare.pop_back();
        }
        ~IdleWalk() {
            got.clear();
            try {
                spare.push_back(std::move(got));
            } catch (...) {   // out of memory: the buffer is freed instead
            }
        }
        IdleWalk(const IdleWalk&) = delete;
        IdleWalk& operator=(const IdleWalk&) = delete;
    };
    std::vector<std::vector<IdleChunk>> idle_walk_spare_;   // IdleWalk::got's buffers between walks
    void idle_refresh();
    void idle_index_add(detail::VSeg* seg, std::int64_t s, const IdleKey& key, std::set<IdleKey>::iterator& last);
    std::set<IdleKey>::iterator idle_index_drop(std::set<IdleKey>::iterator at);
    bool idle_entry(const IdleKey& key, IdleChunk& out) const;
    void idle_walk(IdleWalk& w, detail::VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t max_pages);
    const IdleChunk* idle_at(IdleWalk& w, std::size_t i);
    // VirtualBacking._chunk_of_stream: one of `fits` whose pending work is all on `stream` (with `busy`, of the largest
    // the one whose last fence there is oldest; without, the first, its fences in `pending`), -1 where none; with
    // `unshared` >= 0, only chunks of at most that many pages (Note [No other stream on a deferred chunk] in backing.py)
    std::ptrdiff_t chunk_of_stream(IdleWalk& fits, std::uint64_t stream, detail::StreamNumbers& batch,
                                   detail::StreamNumbers* busy, detail::FenceMap& pending, std::int64_t unshared = -1);
    bool fence_done_in_pass(std::uint64_t stream, std::uint64_t number, detail::StreamNumbers* busy);   // _fence_done
    void idle_index_problems(std::vector<std::string>& problems);
    // the fast paths' bodies, under the lock (Note [Fast paths under a held run] in engine.cpp)
    std::uint64_t fast_allocate_locked(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out);
    bool fast_free_locked(std::uint64_t ptr);
};

}  // namespace gpumem
