// The native allocator engine: see engine.h and Note [An exact port] there. Every function names
// its Python original (gpumem/allocator/{caching,backing,fences,block}.py); keep them in step.
#include "engine.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <unordered_set>

namespace gpumem {
namespace detail {

// -- page tables ---------------------------------------------------------------------------------
// Python's VirtualSegment.dirty / .users: page -> one stream (an int) or several (a frozenset).
// One stream per page is kept in an array (the common case, no allocation), more in a map.
struct StreamTable {
    std::vector<std::uint64_t> one;
    std::vector<std::uint8_t> state;   // 0: absent, 1: one stream, 2: several (in `many`)
    std::unordered_map<std::int64_t, std::vector<std::uint64_t>> many;   // sorted
    explicit StreamTable(std::size_t n) : one(n, 0), state(n, 0) {}
    bool has(std::int64_t p) const { return state[p] != 0; }
    // table.get(p) == stream (an int equal to it; a frozenset never is)
    bool equals(std::int64_t p, std::uint64_t s) const { return state[p] == 1 && one[p] == s; }
    // VirtualBacking._note_user
    void note(std::int64_t p, std::uint64_t s) {
        std::uint8_t st = state[p];
        if (st == 0) {
            state[p] = 1;
            one[p] = s;
        } else if (st == 1) {
            if (one[p] == s) return;
            std::vector<std::uint64_t> v{std::min(one[p], s), std::max(one[p], s)};
            many[p] = std::move(v);
            state[p] = 2;
        } else {
            auto& v = many[p];
            auto it = std::lower_bound(v.begin(), v.end(), s);
            if (it == v.end() || *it != s) v.insert(it, s);
        }
    }
    // the streams of page p, sorted (Python: sorted(streams) where it matters)
    void get(std::int64_t p, std::vector<std::uint64_t>& out) const {
        out.clear();
        if (state[p] == 1) out.push_back(one[p]);
        else if (state[p] == 2) out = many.at(p);
    }
    void pop(std::int64_t p) {
        if (state[p] == 2) many.erase(p);
        state[p] = 0;
    }
    template <class F> void each_stream(F f) const {
        for (std::size_t p = 0; p < state.size(); ++p)
            if (state[p] == 1) f(one[p]);
        for (auto& kv : many)
            for (auto s : kv.second) f(s);
    }
};

// Python's VirtualSegment (backing.py).
struct VSeg {
    std::uint64_t base, nbytes;
    bool small;
    std::uint64_t top = 0;   // bytes from base tiled by blocks
    Block* last = nullptr;
    std::int64_t n_pages;
    std::vector<std::int64_t> refs;
    std::vector<ChunkHandle> chunks;   // 0: no chunk mapped
    // Beside `chunks`, for each mapped page: the first page and the size of its chunk (what _chunk_start's walk
    // and h.nbytes would give, read in O(1) on the steal path: Note [The chunk of a page at hand]). Written
    // only by set_chunk and clear_chunk, with `chunks`; meaningless where chunks[p] is 0.
    std::vector<std::int64_t> chunk_first;
    std::vector<std::uint64_t> chunk_nbytes;
    // `empty`: insertion-ordered set of pages (a dict in Python): a linked list over pages
    std::vector<std::int64_t> eprev, enext;
    std::vector<std::uint8_t> in_empty;
    std::int64_t ehead = -1, etail = -1;
    std::size_t n_empty = 0;
    StreamTable dirty, users;
    using PageFences = std::unordered_map<std::int64_t, FenceMap>;
    PageFences page_fences;
    // page_fences' nodes taken out by fences_erase, their maps cleared: fences_node hands them out again (a steal
    // fences each page it takes and drops the entry once the work is done: two allocations a page, without)
    std::vector<PageFences::node_type> spare_fences;
    PageFences node_maker;   // where fences_node makes a node when none is spare (always empty between calls)
    std::vector<std::uint8_t> noaccess;
    std::size_t n_noaccess = 0;
    std::unique_ptr<FenceMap> top_fences;
    std::vector<std::uint8_t> deferred;   // seg.deferred: old mappings of chunks stolen stream-ordered
    std::size_t n_deferred = 0;
    std::vector<std::uint8_t> seen;       // idle_chunks' marks, all clear between calls (Note [Unmarking what was marked])

    VSeg(std::uint64_t b, std::uint64_t n, bool s, std::uint64_t g)
        : base(b), nbytes(n), small(s), n_pages(static_cast<std::int64_t>(n / g)), refs(n / g, 0),
          chunks(n / g, 0), chunk_first(n / g, 0), chunk_nbytes(n / g, 0), eprev(n / g, -1), enext(n / g, -1),
          in_empty(n / g, 0), dirty(n / g), users(n / g), noaccess(n / g, 0), deferred(n / g, 0), seen(n / g, 0),
          in_fresh(n / g, 0), indexed(n / g, 0) { set_page(g); }
    // A malloc'd segment (segment mode: backing.py's Segment): no pages, the fields at the end.
    struct Malloced {};
    VSeg(std::uint64_t b, std::uint64_t n, bool s, std::uint64_t stream, Malloced)
        : base(b), nbytes(n), small(s), top(n), n_pages(0), dirty(0), users(0), malloced(true), mstream(stream),
          order(b) {}

    // chunks[p] = h, h being the chunk of `nbytes` mapped from page `first` on
    void set_chunk(std::int64_t p, ChunkHandle h, std::int64_t first, std::uint64_t nbytes) {
        chunks[p] = h;
        chunk_first[p] = first;
        chunk_nbytes[p] = nbytes;
    }
    void clear_chunk(std::int64_t p) {   // chunks[p] = None
        chunks[p] = 0;
        chunk_first[p] = 0;
        chunk_nbytes[p] = 0;
    }
    bool is_empty(std::int64_t p) const { return in_empty[p] != 0; }
    // a node for page_fences[p], in no map, its fences empty
    PageFences::node_type fences_node(std::int64_t p) {
        if (spare_fences.empty()) {
            node_maker.emplace(p, FenceMap{});
            return node_maker.extract(p);
        }
        PageFences::node_type node = std::move(spare_fences.back());
        spare_fences.pop_back();
        node.key() = p;
        return node;
    }
    void fences_spare(PageFences::node_type node) {
        node.mapped().clear();   // keeps its capacity
        spare_fences.push_back(std::move(node));
    }
    void fences_erase(PageFences::iterator it) { fences_spare(page_fences.extract(it)); }   // page_fences.erase(it)
    void fences_erase(std::int64_t p) {   // page_fences.pop(p, None)
        auto it = page_fences.find(p);
        if (it != page_fences.end()) fences_erase(it);
    }
    void empty_add(std::int64_t p) {   // seg.empty[p] = None (keeps its place if there)
        add_fresh(p);
        if (in_empty[p]) return;
        in_empty[p] = 1;
        eprev[p] = etail;
        enext[p] = -1;
        if (etail >= 0) enext[etail] = p; else ehead = p;
        etail = p;
        ++n_empty;
    }
    void empty_pop(std::int64_t p) {   // seg.empty.pop(p, None)
        if (!in_empty[p]) return;
        in_empty[p] = 0;
        if (eprev[p] >= 0) enext[eprev[p]] = enext[p]; else ehead = enext[p];
        if (enext[p] >= 0) eprev[enext[p]] = eprev[p]; else etail = eprev[p];
        --n_empty;
    }
    void empty_list(std::vector<std::int64_t>& out) const {   // list(seg.empty)
        out.clear();
        for (std::int64_t p = ehead; p >= 0; p = enext[p]) out.push_back(p);
    }
    void noaccess_add(std::int64_t p) { if (!noaccess[p]) { noaccess[p] = 1; ++n_noaccess; } }
    void noaccess_discard(std::int64_t p) { if (noaccess[p]) { noaccess[p] = 0; --n_noaccess; } }

    // segment mode (Segment's live, dirty, fence, order, stream)
    bool malloced = false;
    std::uint64_t mstream = 0;     // Segment.stream
    std::uint64_t live = 0;        // Segment.live: allocated blocks, and freed ones waiting for other streams
    bool mdirty = false;           // Segment.dirty: fell empty, its last users' work has no fence yet
    std::uint64_t fence = 0;       // Segment.fence: recorded on mstream since (0: none)
    std::uint64_t order = 0;       // Segment.order: where it sorts among equal sizes (TopDownFreeList)

    // The range's pages (VirtualSegment.page_nbytes; Note [Pages of a pool's own size] in engine.cpp)
    std::uint64_t page_nbytes = 0;
    int page_shift = -1;             // log2(page_nbytes) where it is a power of two, else -1
    std::uint64_t page_magic = 0;    // else floor(offset / page_nbytes) = offset * page_magic >> page_magic_shift
    int page_magic_shift = 0;        //   for every offset in the range (0: divide)
    void set_page(std::uint64_t g);
    std::uint64_t page_va(std::int64_t p) const { return base + static_cast<std::uint64_t>(p) * page_nbytes; }
    // the page of an offset in the range: a shift, a multiplication, or (not on the hot path's devices) a division
    std::int64_t page_of(std::uint64_t offset) const {
        if (page_shift >= 0) return static_cast<std::int64_t>(offset >> page_shift);
#ifdef __SIZEOF_INT128__
        if (page_magic)
            return static_cast<std::int64_t>(
                static_cast<std::uint64_t>((static_cast<unsigned __int128>(offset) * page_magic) >> page_magic_shift));
#endif
        return static_cast<std::int64_t>(offset / page_nbytes);
    }
    std::uint64_t top_max = 0;   // the highest top the range had (Note [The small pool's state as bytes])
    // seg.fresh: pages put in `empty` since the engine last looked for idle chunks (Note [An index of idle
    // chunks] in backing.py), each once
    std::vector<std::int64_t> fresh;
    std::vector<std::uint8_t> in_fresh;
    // indexed[s] = n (> 0): the idle index holds (n pages, the address of page s); 0: unknown. Set by
    // Engine::idle_index_add, cleared by Engine::idle_index_drop when it drops that entry.
    std::vector<std::int64_t> indexed;
    void add_fresh(std::int64_t p) {
        if (!in_fresh[p]) {
            in_fresh[p] = 1;
            fresh.push_back(p);
        }
    }
};

// Note [Pages of a pool's own size]: PyTorch's expandable segments map 2 MiB pages under the small pool and
// 20 MiB pages under the large one (Note [Expandable segments] in policy.py), so each range has its page size
// (VirtualSegment.page_nbytes): the engine reads it where the Python reference reads `seg.page_nbytes` (a
// block's pages, the addresses and sizes of maps, unmaps and access calls, the consistency check, the empty
// bytes), and the granularity where it reads `self.granularity` (steals, chunks of several pages: a policy
// with pages of its own has growth=PAGES and no steal, AllocatorPolicy refuses the rest, and so does the
// engine). A chunk cached unmapped fits only a page of its size: _map_pages moves the cached chunks of the
// range's size last, stably, and counts those alone. 20 MiB is no power of two: where a range's page is not,
// its page_of multiplies by a magic number instead of dividing (a 64-bit division costs tens of cycles, four
// per allocate + free on the hot path): q = floor(x * m / 2**(N + l)) with l = ceil(log2 d), m = ceil(2**(N
// + l) / d), exact for every x < 2**N (Granlund and Montgomery 1994, theorem 4.2; N: the range's bits, at
// most 62, so that m <= 2**63 and x * m < 2**125).
void VSeg::set_page(std::uint64_t g) {
    page_nbytes = g;
    page_shift = -1;
    page_magic = 0;
    if ((g & (g - 1)) == 0) {
        page_shift = 0;
        while ((std::uint64_t{1} << page_shift) < g) ++page_shift;
        return;
    }
#ifdef __SIZEOF_INT128__
    int n = 0;   // offsets are < nbytes <= 2**n
    while (n < 64 && (std::uint64_t{1} << n) < nbytes) ++n;
    int l = 0;   // 2**(l - 1) < g < 2**l
    while (l < 64 && (std::uint64_t{1} << l) < g) ++l;
    if (n > 62 || l >= 64) return;
    const unsigned __int128 one = 1;
    const unsigned __int128 m = ((one << (n + l)) + g - 1) / g;
    page_magic = static_cast<std::uint64_t>(m);
    page_magic_shift = n + l;
#endif
}

// keyed (size, place): place is the address, or with segments_top_down in segment mode the block's
// TopDownFreeList key (fl_add)
bool BlockLess::operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->place < b->place;
}
bool BlockLess::operator()(const Block* a, const std::pair<std::uint64_t, std::uint64_t>& k) const {
    return a->size != k.first ? a->size < k.first : a->place < k.second;
}
bool BlockLess::operator()(const std::pair<std::uint64_t, std::uint64_t>& k, const Block* b) const {
    return k.first != b->size ? k.first < b->size : k.second < b->place;
}

// -- PtrMap: open addressing, linear probing, backward-shift deletion -----------------------------
PtrMap::PtrMap() : slots_(64, Slot{0, nullptr}), mask_(63) {}

static inline std::size_t hash64(std::uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
}

void* PtrMap::get(std::uint64_t key) const {
    for (std::size_t i = hash64(key) & mask_;; i = (i + 1) & mask_) {
        const Slot& e = slots_[i];
        if (e.key == key) return e.value;
        if (e.key == 0) return nullptr;
    }
}

void PtrMap::put(std::uint64_t key, void* value) {
    if ((n_ + 1) * 2 > slots_.size()) grow();
    for (std::size_t i = hash64(key) & mask_;; i = (i + 1) & mask_) {
        Slot& e = slots_[i];
        if (e.key == key) { e.value = value; return; }
        if (e.key == 0) { e.key = key; e.value = value; ++n_; return; }
    }
}

bool PtrMap::erase(std::uint64_t key) {
    std::size_t i = hash64(key) & mask_;
    for (;; i = (i + 1) & mask_) {
        if (slots_[i].key == key) break;
        if (slots_[i].key == 0) return false;
    }
    std::size_t j = i;
    for (;;) {
        j = (j + 1) & mask_;
        if (slots_[j].key == 0) break;
        std::size_t h = hash64(slots_[j].key) & mask_;
        // move slot j to the hole at i if its home is not in (i, j] (cyclically)
        bool stay = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!stay) {
            slots_[i] = slots_[j];
            i = j;
        }
    }
    slots_[i] = Slot{0, nullptr};
    --n_;
    return true;
}

void PtrMap::grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.size() * 2, Slot{0, nullptr});
    mask_ = slots_.size() - 1;
    n_ = 0;
    for (const Slot& e : old)
        if (e.key) put(e.key, e.value);
}

void PtrMap::clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{0, nullptr});
    n_ = 0;
}

// Note [A few free blocks in an array]: a free list often holds few blocks (the 7B's decode under the `gpumem`
// policy, 4,000 new tokens: 5 or 6 free blocks in all, 2 to 7 in the list each time one is added), and every
// allocation and free changes it two or three times (the best fit out, the split's rest in; the neighbours out,
// the merged block in). In a red-black tree of Block* each of those walks nodes and blocks and rebalances: some
// 15 % of the samples of that replay (perf). So while a list holds at most kArrayMax blocks, FreeBlocks keeps
// their keys (size, place) sorted in an array, each block beside its key: a search reads the array only, an
// insert or removal moves a few entries. Past kArrayMax it moves them into the set of Block* (each block's node,
// as fl_add kept it) and keeps the set until the list is down to kArrayMin (no back and forth at the edge). Same
// order either way, so the same best fit and the same walks: what the engine decides does not depend on the
// form (tests/allocator/test_native_hot_path_forms.py). The engine alone on that decode's 9.1 M ops: 35 to 37 ns
// an op before, 30 to 32 after (reports/estimate-speed.md, round 8).
namespace {
constexpr std::size_t kArrayMax = 32;
constexpr std::size_t kArrayMin = 8;
inline bool entry_less(std::uint64_t size, std::uint64_t place, const FreeBlocks::Entry& e) {
    return size != e.size ? size < e.size : place < e.place;
}
}  // namespace

void FreeBlocks::add(Block* b) {
    if (!set_mode_ && arr_.size() >= kArrayMax) to_set();
    if (set_mode_) {
        if (b->node.empty()) {
            b->where = set_.insert(b).first;
        } else {
            b->node.value() = b;
            b->where = set_.insert(std::move(b->node)).position;
        }
        return;
    }
    if (arr_.capacity() < kArrayMax) arr_.reserve(kArrayMax);   // once: no allocation on the hot path after
    const std::uint64_t size = b->size, place = b->place;
    std::size_t i = arr_.size();
    arr_.emplace_back();
    Entry* a = arr_.data();
    for (; i > 0 && entry_less(size, place, a[i - 1]); --i) a[i] = a[i - 1];   // one insertion sort step
    a[i] = Entry{size, place, b};
}

bool FreeBlocks::remove(Block* b) {
    if (set_mode_) {
        if (*b->where != b) return false;
        b->node = set_.extract(b->where);
        if (set_.size() <= kArrayMin) to_array();
        return true;
    }
    Entry* a = arr_.data();
    const std::size_t n = arr_.size();
    for (std::size_t i = 0; i < n; ++i)
        if (a[i].b == b) {
            for (; i + 1 < n; ++i) a[i] = a[i + 1];
            arr_.pop_back();
            return true;
        }
    return false;
}

Block* FreeBlocks::best_fit(std::uint64_t size) const {
    if (set_mode_) {
        auto it = set_.lower_bound(std::make_pair(size, std::uint64_t(0)));
        return it == set_.end() ? nullptr : *it;
    }
    for (const Entry& e : arr_)
        if (e.size >= size) return e.b;
    return nullptr;
}

void FreeBlocks::to_set() {
    std::size_t moved = 0;
    try {   // a node that cannot be allocated leaves the list as it was (in the array)
        for (; moved < arr_.size(); ++moved) {
            Block* b = arr_[moved].b;
            if (b->node.empty()) {
                b->where = set_.insert(set_.end(), b);
            } else {
                b->node.value() = b;
                b->where = set_.insert(set_.end(), std::move(b->node));
            }
        }
    } catch (...) {
        for (std::size_t i = 0; i < moved; ++i) arr_[i].b->node = set_.extract(arr_[i].b->where);
        throw;
    }
    set_mode_ = true;
    arr_.clear();
}

void FreeBlocks::to_array() {
    set_mode_ = false;
    arr_.reserve(kArrayMax);
    while (!set_.empty()) {
        Block* b = *set_.begin();
        arr_.push_back(Entry{b->size, b->place, b});
        b->node = set_.extract(set_.begin());
    }
}

}  // namespace detail

using detail::Block;
using detail::FenceMap;
using detail::FreeList;
using detail::VSeg;
using detail::StreamTable;
using detail::StreamNumbers;

namespace {
constexpr std::size_t kFreedMemory = 65536;   // python_engine.py _FREED_MEMORY
constexpr std::size_t kReleasedArenas = 8;   // plan.py RELEASED_ARENAS

std::string hex(std::uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%" PRIx64, v);
    return buf;
}

// What the Python allocator's `except OutOfMemoryError` would see in the exception being handled.
struct Caught {
    bool oom = false;
    OomCause cause = OomCause::kDevice;
    void* exc = nullptr;
};
Caught classify_current() {
    try {
        throw;
    } catch (const BackendError& e) {
        return {e.kind == ErrorKind::kOutOfMemory, OomCause::kDevice, e.py_exc};
    } catch (const EngineError& e) {
        return {e.kind == EngineErrorKind::kOutOfMemory, e.oom.cause, e.oom.cause_py_exc};
    } catch (...) {
        return {};
    }
}
// Note [Only Exception is caught]: where the Python allocator catches a device's failure and goes
// on (`except Exception`: a lost event, a page kept mapped, a stream that could not be waited for),
// a KeyboardInterrupt or SystemExit raised by the device call is not caught: it propagates. The
// Python backend marks those BackendError::fatal; the engine's catch-all sites call this first.
void rethrow_if_fatal() {
    try {
        throw;
    } catch (const BackendError& e) {
        if (e.fatal) throw;
    } catch (...) {
    }
}
}  // namespace

// -- the lock ----------------------------------------------------------------------------------------
// Note [Re-entry from the lock's thread]: with the Python backend a device call runs Python
// (a finalizer, the cyclic GC, a signal handler) that may call the allocator again on the thread
// that holds the lock. The Python allocator's lock is an RLock, so that does not deadlock; but an
// operation that changes the engine's state in the middle of another would break its invariants
// (the Python allocator gets corrupted that way too). So the lock records its owner: reads (stats,
// block_size, describe...) re-enter; an operation that changes state throws kInternal rather than
// deadlock. The binding defers a re-entrant free() to the end of the outer operation (module.cpp).
void Engine::lock(bool reentrant) {
    if (held_by_this_thread()) {
        if (!reentrant && !fast_run_held_)   // Note [One lock for a run of fast paths]
            throw EngineError(EngineErrorKind::kInternal,
                              "the allocator was re-entered from a device call of one of its own operations "
                              "(only free() and reads may re-enter)");
        ++depth_;
        return;
    }
    if (!mutex_.try_lock()) {
        void* token = hooks_.release ? hooks_.release() : nullptr;   // Note [Waiting for the engine's lock]
        mutex_.lock();
        if (hooks_.reacquire) hooks_.reacquire(token);
    }
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    depth_ = 1;
}
void Engine::unlock() {
    if (--depth_ > 0) return;
    owner_.store(std::thread::id(), std::memory_order_relaxed);
    mutex_.unlock();
}

struct Engine::Guard {
    Engine& e;
    explicit Guard(Engine& en, bool reentrant = false) : e(en) { e.lock(reentrant); }
    ~Guard() { e.unlock(); }
};

// Note [One lock for a run of fast paths]: the binding's run_ops (module.cpp; Note [A step's ops in one call]
// in op_table.h) sends a decode step's ops, a thousand or more, most of them cache hits and frees that need no
// device call. Taken and given back per op, the lock (a mutex try_lock and unlock) was a fifth of the engine's
// time there. hold_for_fast_run() takes it once (waiting as every operation waits: Note [Waiting for the
// engine's lock]); while it is held, the fast paths' own Guard nests in it instead of throwing kInternal
// (Note [Re-entry from the lock's thread]). That check is kept for what it guards: the holder runs no Python
// and makes no device call while it holds the lock (only try_allocate_fast and try_free_fast, which make
// none), so nothing can re-enter through it; it gives the lock back before any slow path (run with the
// lock taken for that op alone, inside device.deferred_events()), error or Python call. Other threads wait
// for the run of fast ops as they wait for one slow operation; what they see between runs is what the
// per-op loop could have let them see (the GIL held all along, no device call in between).
void Engine::hold_for_fast_run() {
    lock(false);
    fast_run_held_ = true;
}
void Engine::release_for_fast_run() {
    fast_run_held_ = false;
    unlock();
}

Engine::Engine(Backend& backend, const EngineConfig& config)
    : backend_(backend), cfg_(config), memory_first_(config), steal_knobs_(config) {
    steal_knobs_.stream_ordered_steal = true;   // Note [The ordered steal after a warm-up] in backing.py
    memory_first_.page_slack = 0.0;   // AllocatorPolicy.memory_first (Note [A memory-first warm-up] in plan.py)
    memory_first_.page_slack_min_nbytes = 0;
    memory_first_.stream_ordered_steal = true;
    memory_first_.chunk_max_fraction = 1.0 / 4096;   // policy.py WARMUP_CHUNKS
    DeviceInfo info = backend_.info();
    total_nbytes_ = info.total_nbytes;
    g_ = info.granularity_nbytes;
    if (!g_ || (cfg_.round_nbytes & (cfg_.round_nbytes - 1)) || !cfg_.round_nbytes)
        throw EngineError(EngineErrorKind::kInvalidArgument, "bad granularity or round_nbytes");
    // VirtualBacking.__init__: -(-int(total * factor) // g) * g, refused from 2**64 on (as in Python):
    // the product is checked as a double before it is converted (a conversion out of range is undefined)
    const double va_exact = static_cast<double>(total_nbytes_) * cfg_.va_reserve_factor;
    const std::uint64_t va = va_exact < 18446744073709551616.0 ? static_cast<std::uint64_t>(va_exact) : UINT64_MAX;
    // pool_va_nbytes: a whole number of pages of either pool (Note [Pages of a pool's own size]); segment
    // mode reserves no range (va_nbytes 0 there) and has no pages
    page_nbytes_[1] = cfg_.small_page_nbytes ? cfg_.small_page_nbytes : g_;
    page_nbytes_[0] = cfg_.large_page_nbytes ? cfg_.large_page_nbytes : g_;
    custom_pages_ = !cfg_.segments && (cfg_.small_page_nbytes || cfg_.large_page_nbytes);
    if (!cfg_.segments && (page_nbytes_[0] % g_ || page_nbytes_[1] % g_))
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "a page size is not a multiple of the device's granularity");
    if (custom_pages_ && (cfg_.growth != GrowthRule::kPages || cfg_.steal_empty_pages))
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "small_page_nbytes / large_page_nbytes need growth='pages' and steal_empty_pages=False");
    std::uint64_t unit = page_nbytes_[0];   // lcm of the two page sizes, refused past 64 bits
    {
        std::uint64_t a = page_nbytes_[0], b = page_nbytes_[1];
        while (b) { std::uint64_t t = a % b; a = b; b = t; }
        const std::uint64_t k = page_nbytes_[1] / a;
        unit = k && unit > UINT64_MAX / k ? 0 : unit * k;
    }
    if ((!unit || va > UINT64_MAX - unit + 1) && !cfg_.segments)
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "va_reserve_factor times the device's total memory is 2**64 B or more of address space "
                          "per pool, more than 64-bit addresses hold; lower va_reserve_factor");
    va_nbytes_ = cfg_.segments ? 0 : (va + unit - 1) / unit * unit;
    top_down_ = cfg_.segments && cfg_.segments_top_down;
    if (cfg_.segments && (static_cast<int>(cfg_.segment_rule) < 0 || static_cast<int>(cfg_.segment_rule) > 2 ||
                          !cfg_.small_segment_nbytes))
        throw EngineError(EngineErrorKind::kInvalidArgument, "bad segment rule or small_segment_nbytes");
    small_max_ = cfg_.separate_small_pool ? static_cast<std::int64_t>(cfg_.small_max_nbytes) : -1;
    // AllocatorPolicy.__post_init__'s checks of the growth knobs
    if (!(cfg_.page_slack >= 0.0 && cfg_.page_slack <= 1.0) ||
        !(cfg_.chunk_max_fraction >= 0.0 && cfg_.chunk_max_fraction <= 1.0) ||
        !(cfg_.grow_ahead_fraction >= 0.0 && cfg_.grow_ahead_fraction <= 1.0) || !cfg_.chunk_max_nbytes ||
        (cfg_.growth != GrowthRule::kPages && cfg_.growth != GrowthRule::kChunks))
        throw EngineError(EngineErrorKind::kInvalidArgument, "bad growth policy");
    chunked_ = cfg_.growth == GrowthRule::kChunks;
    freed_ring_.assign(kFreedMemory + 1, 0);
}

Engine::~Engine() = default;

// -- block.py ----------------------------------------------------------------------------------------
Block* Engine::new_block(std::uint64_t addr, std::uint64_t size, std::uint64_t stream, VSeg* seg) {
    if (block_pool_.empty()) {
        constexpr std::size_t kSlab = 256;
        block_slabs_.emplace_back(new Block[kSlab]);
        Block* slab = block_slabs_.back().get();
        for (std::size_t i = kSlab; i-- > 0;) block_pool_.push_back(&slab[i]);
    }
    Block* b = block_pool_.back();
    block_pool_.pop_back();
    b->addr = addr;
    b->size = size;
    b->requested = 0;
    b->stream = stream;
    b->seg = seg;
    b->prev = b->next = nullptr;
    b->allocated = false;
    b->in_list = nullptr;
    return b;
}

void Engine::recycle_block(Block* b) {
    b->pending_streams.reset();
    b->fences.reset();
    b->prev = b->next = nullptr;
    b->in_list = nullptr;
    b->seg = nullptr;
    block_pool_.push_back(b);
}

// block.split_block
Block* Engine::split_block(Block* b, std::uint64_t size) {
    if (!(0 < size && size < b->size)) throw EngineError(EngineErrorKind::kInternal, "cannot split block at " + hex(b->addr));
    Block* rest = new_block(b->addr + size, b->size - size, b->stream, b->seg);
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    else if (b->seg && b->seg->last == b) b->seg->last = rest;
    b->next = rest;
    b->size = size;
    return rest;
}

// block.merge_blocks (the right block goes back to the pool)
Block* Engine::merge_blocks(Block* left, Block* right) {
    if (left->next != right || right->prev != left || left->addr + left->size != right->addr)
        throw EngineError(EngineErrorKind::kInternal, "merge of non-adjacent blocks at " + hex(left->addr));
    if (left->allocated || right->allocated || left->stream != right->stream || left->seg != right->seg)
        throw EngineError(EngineErrorKind::kInternal, "merge of blocks that are not two free blocks of one stream");
    left->size += right->size;
    left->next = right->next;
    if (right->next) right->next->prev = left;
    else if (left->seg && left->seg->last == right) left->seg->last = left;
    recycle_block(right);
    return left;
}

// block.append_block
void Engine::append_block(VSeg* seg, Block* b) {
    Block* last = seg->last;
    if (last && last->addr + last->size != b->addr)
        throw EngineError(EngineErrorKind::kInternal, "append of a block that is not contiguous at " + hex(b->addr));
    b->prev = last;
    b->next = nullptr;
    if (last) last->next = b;
    seg->last = b;
}

// block.drop_last_block
Block* Engine::drop_last_block(VSeg* seg) {
    Block* last = seg->last;
    if (!last || last->next) throw EngineError(EngineErrorKind::kInternal, "drop of the last block of a segment with none");
    seg->last = last->prev;
    if (last->prev) last->prev->next = nullptr;
    last->prev = nullptr;
    return last;
}

// FreeList.add / remove / best_fit
void Engine::fl_add(FreeList* fl, Block* b) {
    // FreeList keys by address; TopDownFreeList by the segment's order plus the offset in it
    b->place = top_down_ ? b->seg->order + (b->addr - b->seg->base) : b->addr;
    fl->blocks.add(b);   // Note [A few free blocks in an array]
    b->in_list = fl;
    fl->nbytes += b->size;
}

void Engine::fl_remove(FreeList* fl, Block* b) {
    // the place fl_add kept (no second descent of the set); a block is in at most one list, and its
    // size and address do not change while it is in one
    if (b->in_list != fl || !fl->blocks.remove(b))
        throw EngineError(EngineErrorKind::kInternal, "block " + hex(b->addr) + " is not in its free list");
    b->in_list = nullptr;
    fl->nbytes -= b->size;
}

Block* Engine::fl_best_fit(FreeList* fl, std::uint64_t size) {
    return fl->blocks.best_fit(size);
}

// -- free lists (PythonEngine._free_lists, an insertion-ordered dict) ------------------------------
FreeList* Engine::free_list_get(bool small, std::uint64_t stream) {
    FreeList*& last = fl_last_[small ? 1 : 0];   // the list found last (most calls are on one stream)
    if (last && last->stream == stream) return last;
    auto& idx = fl_index_[small ? 1 : 0];
    auto it = idx.find(stream);
    if (it == idx.end()) return nullptr;
    return last = it->second;
}

FreeList* Engine::free_list_make(bool small, std::uint64_t stream) {
    FreeList* fl = free_list_get(small, stream);
    if (fl) return fl;
    fl_order_.emplace_back(new FreeList());
    fl = fl_order_.back().get();
    fl->small = small;
    fl->stream = stream;
    fl_index_[small ? 1 : 0][stream] = fl;
    return fl;
}

// PythonEngine._free_list_of
FreeList* Engine::free_list_of(const Block* b) {
    bool small = b->seg && b->seg->small && cfg_.separate_small_pool;
    return free_list_make(small, b->stream);
}

// -- fences.py: StreamFences ---------------------------------------------------------------------------
std::uint64_t Engine::fences_done_of(std::uint64_t stream) const {
    auto it = fdone_.find(stream);
    return it == fdone_.end() ? 0 : it->second;
}

// StreamFences.record
std::uint64_t Engine::fences_record(std::uint64_t stream) {
    EventHandle ev = backend_.event_record(stream);
    ++n_records_;
    std::uint64_t number = fnext_++;
    auto it = fq_index_.find(stream);
    if (it == fq_index_.end()) it = fences_new_queue(stream);
    StreamQueue& q = *it->second;
    q.q.emplace_back(number, ev);
    // StreamFences._retire_front: retire the completed events at the front except the newest
    while (q.size() > 1) {
        ++n_queries_;
        if (!backend_.event_query(q.q[q.head].second)) break;
        // _retire (the queue keeps at least one event: never deleted here)
        auto front = q.q[q.head++];
        fdone_[stream] = front.first;
        destroy_retired_event(front.second);
    }
    if (q.head > 32 && q.head * 2 > q.q.size()) {
        q.q.erase(q.q.begin(), q.q.begin() + static_cast<std::ptrdiff_t>(q.head));
        q.head = 0;
    }
    return number;
}

// A stream's queue of fences at the end of fq_order_ (StreamFences: self._queues[stream] = deque()), in the nodes
// of one fences_drop_queue kept where there are: a stream whose fences all completed loses its queue (as in
// Python), and a steal's next record on it made it again, three allocations a steal.
Engine::FenceQueueIndex::iterator Engine::fences_new_queue(std::uint64_t stream) {
    if (fq_spare_.empty()) {
        fq_order_.push_back(StreamQueue{stream, {}, 0});
    } else {
        fq_order_.splice(fq_order_.end(), fq_spare_, fq_spare_.begin());
        StreamQueue& q = fq_order_.back();
        q.stream = stream;
        q.q.clear();   // keeps its capacity
        q.head = 0;
    }
    if (fq_index_spare_.empty()) return fq_index_.emplace(stream, std::prev(fq_order_.end())).first;
    FenceQueueIndex::node_type node = std::move(fq_index_spare_.back());
    fq_index_spare_.pop_back();
    node.key() = stream;
    node.mapped() = std::prev(fq_order_.end());
    return fq_index_.insert(std::move(node)).position;
}

// del self._queues[stream]: the queue's nodes kept for fences_new_queue
void Engine::fences_drop_queue(FenceQueueIndex::iterator it) {
    fq_spare_.splice(fq_spare_.end(), fq_order_, it->second);
    fq_index_spare_.push_back(fq_index_.extract(it));
}

// A retired fence's event is destroyed; a failure is not fatal (a lost event handle holds no memory).
void Engine::destroy_retired_event(EventHandle event) {
    try {
        backend_.event_destroy(event);
        ++n_destroys_;
    } catch (...) {
        rethrow_if_fatal();   // Note [Only Exception is caught]
    }
}

// StreamFences.done
bool Engine::fences_done(std::uint64_t stream, std::uint64_t number) {
    if (number <= fences_done_of(stream)) return true;
    auto it = fq_index_.find(stream);
    bool has_q = it != fq_index_.end();
    while (has_q) {
        StreamQueue& q = *it->second;
        auto front = q.q[q.head];
        if (front.first > number) break;
        ++n_queries_;
        if (!backend_.event_query(front.second)) return false;
        // _retire
        ++q.head;
        fdone_[stream] = front.first;
        if (!q.size()) {
            fences_drop_queue(it);
            has_q = false;
        }
        destroy_retired_event(front.second);
    }
    if (number <= fences_done_of(stream) || !has_q) return true;
    StreamQueue& q = *it->second;
    return q.q[q.head].first > number;
}

// StreamFences._event_of: the newest event of `stream` recorded at or before fence `number` and not known complete
// (false: the fence is done)
bool Engine::fences_event_of(std::uint64_t stream, std::uint64_t number, EventHandle* out) {
    if (number <= fences_done_of(stream)) return false;
    auto it = fq_index_.find(stream);
    if (it == fq_index_.end()) return false;
    const StreamQueue& q = *it->second;
    bool have = false;
    for (std::size_t i = q.head; i < q.q.size(); ++i) {
        if (q.q[i].first > number) break;
        *out = q.q[i].second;
        have = true;
    }
    return have;
}

// StreamFences.wait
void Engine::fences_wait(std::uint64_t stream, std::uint64_t number) {
    EventHandle target = 0;
    if (!fences_event_of(stream, number, &target)) return;
    backend_.event_synchronize(target);
    ++f_n_waits_;
    auto it = fq_index_.find(stream);
    StreamQueue* q = &*it->second;
    while (q && q->q[q->head].first <= number) {
        auto front = q->q[q->head++];
        fdone_[stream] = front.first;
        if (!q->size()) {
            fences_drop_queue(it);
            q = nullptr;
        }
        destroy_retired_event(front.second);
    }
}

// StreamFences.order_after (Note [Wait on the GPU, not the host] in backing.py)
void Engine::fences_order_after(std::uint64_t waiting, std::uint64_t stream, std::uint64_t number) {
    EventHandle target = 0;
    if (!fences_event_of(stream, number, &target)) return;
    backend_.stream_wait_event(waiting, target);
    ++n_stream_waits_;
}

bool Engine::fences_all_done(const FenceMap* f) {
    if (!f || f->empty()) return true;
    for (auto& sn : *f)
        if (!fences_done(sn.first, sn.second)) return false;
    return true;
}

void Engine::fences_wait_all(const FenceMap* f) {
    if (!f) return;
    for (auto& sn : *f) fences_wait(sn.first, sn.second);
}

// StreamFences.forget_idle
void Engine::fences_forget_idle() {
    std::vector<std::uint64_t> streams;
    for (auto& q : fq_order_) streams.push_back(q.stream);
    try {
        for (auto s : streams) {
            auto it = fq_index_.find(s);
            if (it == fq_index_.end()) continue;
            StreamQueue& q = *it->second;
            ++n_queries_;
            if (backend_.event_query(q.q.back().second)) {
                std::vector<EventHandle> evs;
                while (q.size()) {
                    auto front = q.q[q.head++];
                    fdone_[s] = front.first;
                    if (!q.size()) {
                        fences_drop_queue(it);
                        destroy_retired_event(front.second);
                        break;
                    }
                    destroy_retired_event(front.second);
                }
            }
        }
    } catch (const BackendError& e) {
        // a lost device, and a KeyboardInterrupt or SystemExit, go through (Note [Only Exception is caught])
        if (e.kind == ErrorKind::kDeviceLost || e.fatal) throw;
        // the events stay queued, nothing is lost
    }
    for (auto it = fdone_.begin(); it != fdone_.end();) {
        if (!fq_index_.count(it->first)) it = fdone_.erase(it);
        else ++it;
    }
}

// StreamFences.close
void Engine::fences_close() {
    for (auto& q : fq_order_)
        for (std::size_t i = q.head; i < q.q.size(); ++i) {
            try {
                backend_.event_destroy(q.q[i].second);
            } catch (...) {
                rethrow_if_fatal();   // Note [Only Exception is caught]
            }
        }
    fq_order_.clear();
    fq_index_.clear();
}

// fences.merge_fences
void Engine::merge_fences(std::unique_ptr<FenceMap>& into, std::uint64_t stream, std::uint64_t number) {
    if (!into) {
        into.reset(new FenceMap{{stream, number}});
        return;
    }
    for (auto& sn : *into)
        if (sn.first == stream) {
            if (sn.second < number) sn.second = number;
            return;
        }
    into->emplace_back(stream, number);
}

namespace {
void merge_into(FenceMap& into, std::uint64_t stream, std::uint64_t number) {
    for (auto& sn : into)
        if (sn.first == stream) {
            if (sn.second < number) sn.second = number;
            return;
        }
    into.emplace_back(stream, number);
}
}  // namespace

// -- backing.py: VirtualBacking ----------------------------------------------------------------------------
// What every out-of-memory error says of the device: the cause, the request and the device's free and total.
OomInfo Engine::device_oom_info(OomCause cause, std::uint64_t requested) {
    std::uint64_t f, t;
    backend_.mem_info(&f, &t);
    OomInfo info;
    info.cause = cause;
    info.requested_nbytes = requested;
    info.free_nbytes = f;
    info.total_nbytes = t;
    return info;
}

// Backing._check_limit
void Engine::check_limit(std::uint64_t extra_nbytes, std::uint64_t requested) {
    if (cfg_.limit_nbytes && reserved_nbytes_ + plan_mapped_nbytes_ + extra_nbytes > cfg_.limit_nbytes) {
        OomInfo info = device_oom_info(OomCause::kLimit, requested);
        info.limit_nbytes = cfg_.limit_nbytes;
        throw EngineError(info, "the allocator's limit is reached");
    }
}

// VirtualBacking._segment
VSeg* Engine::segment(bool small) {
    bool key = small && cfg_.separate_small_pool;
    VSeg* seg = vseg_by_key_[key];
    if (!seg) {
        std::uint64_t base = backend_.address_reserve(va_nbytes_, 0);
        ++device_calls_;
        vsegs_.emplace_back(new VSeg(base, va_nbytes_, key, page_nbytes_[key]));
        seg = vsegs_.back().get();
        vseg_by_key_[key] = seg;
        ++n_segments_;
    }
    return seg;
}

// VirtualBacking.range_of (reserve=True)
VSeg* Engine::range_of(bool small) {
    VSeg* seg = vseg_by_key_[small && cfg_.separate_small_pool];
    return seg ? seg : segment(small);
}

// VirtualBacking.begin_multi_stream: blocks of a second stream from now on; the chunks taken without a host wait
// while one stream had blocks are waited for now (Note [One stream needs no whole pages] in backing.py)
void Engine::begin_multi_stream() {
    if (multi_stream_) return;
    if (!deferred_.empty()) drain_deferred(true, nullptr, nullptr, nullptr);   // first: one that throws runs again
    multi_stream_ = true;
}

// VirtualBacking.extend
std::uint64_t Engine::extend(VSeg* seg, std::uint64_t stream, std::uint64_t extra_nbytes, std::uint64_t requested) {
    if (seg->top + extra_nbytes > seg->nbytes || extra_nbytes > seg->nbytes) va_exhausted(requested);
    if (seg->top_fences && !seg->top_fences->empty()) wait_top(seg, stream);
    if (!have_first_stream_) {
        have_first_stream_ = true;
        first_stream_ = stream;
    } else if (stream != first_stream_) {
        begin_multi_stream();
    }
    std::uint64_t addr = seg->base + seg->top;
    seg->top += extra_nbytes;
    if (seg->top > seg->top_max) seg->top_max = seg->top;   // Note [The small pool's state as bytes]
    return addr;
}

// VirtualBacking.lower_top
bool Engine::lower_top(VSeg* seg, std::uint64_t addr, std::uint64_t stream, bool wait) {
    std::uint64_t number = fences_record(stream);
    if (!wait && !fences_done(stream, number)) return false;
    merge_fences(seg->top_fences, stream, number);
    seg->top = addr - seg->base;
    return true;
}

// VirtualBacking._wait_top
void Engine::wait_top(VSeg* seg, std::uint64_t stream) {
    FenceMap& pending = *seg->top_fences;
    FenceMap snapshot = pending;
    for (auto& sn : snapshot) {
        std::uint64_t s = sn.first, n = sn.second;
        if (s != stream && !fences_done(s, n)) {
            fences_wait(s, n);
            ++n_waits_;
        }
        if (fences_done(s, n)) {
            for (auto it = pending.begin(); it != pending.end(); ++it)
                if (it->first == s) {
                    pending.erase(it);
                    break;
                }
        }
    }
    if (pending.empty()) seg->top_fences.reset();
}

// VirtualBacking._va_exhausted (raised)
void Engine::va_exhausted(std::uint64_t nbytes) {
    throw EngineError(device_oom_info(OomCause::kAddressSpace, nbytes), "the allocator's virtual range is exhausted");
}

// VirtualBacking.commit
void Engine::commit(Block* b) {
    VSeg* seg = b->seg;
    if (seg->malloced) {   // SegmentBacking.commit
        ++seg->live;
        return;
    }
    std::int64_t first = seg->page_of(b->addr - seg->base);
    std::int64_t last = seg->page_of(b->addr + b->size - 1 - seg->base);
    auto& refs = seg->refs;
    if (first == last && refs[first]) {
        ++refs[first];   // the common case: a page already holding live data
        return;
    }
    if (seg->n_noaccess) {
        for (std::int64_t p = first; p <= last; ++p) {
            if (!seg->noaccess[p]) continue;
            backend_.mem_set_access(seg->page_va(p), seg->page_nbytes);
            ++device_calls_;
            seg->noaccess_discard(p);
        }
    }
    std::vector<std::int64_t>& need = commit_need_;
    need.clear();
    for (std::int64_t p = first; p <= last; ++p)
        if (refs[p] == 0 && seg->chunks[p] == 0) need.push_back(p);
    if (!need.empty()) {
        if (chunked_) {   // the pages the block covers whole (Note [No other stream on a deferred chunk] in backing.py)
            const std::uint64_t g = seg->page_nbytes;
            // one stream: every page (Note [One stream needs no whole pages] in backing.py)
            const std::int64_t whole_lo = first + (multi_stream_ && (b->addr - seg->base) % g != 0 ? 1 : 0);
            const std::int64_t whole_hi = last - (multi_stream_ && (b->addr + b->size - seg->base) % g != 0 ? 1 : 0);
            map_runs(seg, need, first, last, b->size, b->stream, whole_lo, whole_hi);
        }
        else map_pages(seg, need, first, last, b->size);
    }
    for (std::int64_t p = first; p <= last; ++p) {
        if (refs[p] == 0) {
            seg->empty_pop(p);
            ++live_pages_;
        }
        ++refs[p];
    }
    if (live_pages_ > peak_live_pages_) peak_live_pages_ = live_pages_;
}

// VirtualBacking.commit_quietly (Note [A quiet commit] in backing.py)
//
// Note [Pages of a block in one pass]: a block of several pages (most of the memory of a training
// step: activations of MiBs to GiBs, 2 MiB pages) costs the hot path a loop over its pages on each
// allocation and each free: the live count of every page, the insertion-ordered list of empty pages,
// the stream each empty page is dirty with. On gpt2_bf16 those loops were two fifths of the engine's
// instructions (reports/cupy-hook-cpu-profile.md). Same bookkeeping, cheaper: a free on one stream
// skips the users table and notes a page dirty only when it is not dirty with that stream already
// (in a steady state it is: the same step freed it last time); an allocation unlinks the pages it
// takes from the empty list a run at a time (pages emptied by one free follow each other there, so
// a run is spliced out with two links, not two per page), the live counts counted in registers.
bool Engine::commit_quietly(Block* b, std::uint64_t nbytes) {
    VSeg* seg = b->seg;
    if (seg->malloced) {   // SegmentBacking.commit_quietly
        ++seg->live;
        return true;
    }
    const std::int64_t first = seg->page_of(b->addr - seg->base);
    const std::int64_t last = seg->page_of(b->addr + nbytes - 1 - seg->base);
    std::int64_t* r = seg->refs.data();   // counted here, stored once: the stores to the pages do not reload them
    if (last == first && r[first]) {
        ++r[first];
        return true;
    }
    const ChunkHandle* chunks = seg->chunks.data();
    for (std::int64_t p = first; p <= last; ++p)
        if (chunks[p] == 0) return false;
    if (seg->n_noaccess)
        for (std::int64_t p = first; p <= last; ++p)
            if (seg->noaccess[p]) return false;
    std::uint8_t* in_empty = seg->in_empty.data();
    std::int64_t* eprev = seg->eprev.data();
    std::int64_t* enext = seg->enext.data();
    std::int64_t newly_live = 0, unlinked = 0;
    std::int64_t run_head = -1, run_tail = -1;   // pages leaving the empty list, linked there head to tail
    auto splice_out = [&]() {
        const std::int64_t before = eprev[run_head], after = enext[run_tail];
        if (before >= 0) enext[before] = after; else seg->ehead = after;
        if (after >= 0) eprev[after] = before; else seg->etail = before;
    };
    for (std::int64_t p = first; p <= last; ++p) {
        if (r[p] == 0) {
            ++newly_live;
            if (in_empty[p]) {   // seg->empty_pop(p), a run at a time
                in_empty[p] = 0;
                ++unlinked;
                if (run_tail >= 0 && enext[run_tail] == p) {
                    run_tail = p;
                } else {
                    if (run_tail >= 0) splice_out();
                    run_head = run_tail = p;
                }
            }
        }
        ++r[p];
    }
    if (run_tail >= 0) splice_out();
    seg->n_empty -= static_cast<std::size_t>(unlinked);
    live_pages_ += newly_live;
    if (live_pages_ > peak_live_pages_) peak_live_pages_ = live_pages_;
    return true;
}

// VirtualBacking.decommit
void Engine::decommit(Block* b) {
    VSeg* seg = b->seg;
    if (seg->malloced) {   // SegmentBacking.decommit
        if (!--seg->live) seg->mdirty = true;
        return;
    }
    std::int64_t first = seg->page_of(b->addr - seg->base);
    std::int64_t last = seg->page_of(b->addr + b->size - 1 - seg->base);
    std::int64_t* r = seg->refs.data();
    std::uint64_t stream = b->stream;
    bool multi = multi_stream_;
    if (first == last && r[first] > 1) {
        --r[first];   // the common case: the page keeps live data
        if (multi && !seg->users.equals(first, stream)) seg->users.note(first, stream);
        return;
    }
    if (!multi) {   // one stream (Note [Pages of a block in one pass]): no users to fold into dirty
        StreamTable& dirty = seg->dirty;
        const std::uint8_t* dirty_state = dirty.state.data();
        const std::uint64_t* dirty_one = dirty.one.data();
        std::uint8_t* in_empty = seg->in_empty.data();
        std::int64_t* eprev = seg->eprev.data();
        std::int64_t* enext = seg->enext.data();
        std::int64_t emptied = 0, appended = 0, tail = seg->etail;
        for (std::int64_t p = first; p <= last; ++p) {
            if (--r[p] != 0) continue;
            ++emptied;
            seg->add_fresh(p);
            if (!in_empty[p]) {   // seg->empty_add(p); the tail's next link is written once, after the loop
                in_empty[p] = 1;
                eprev[p] = tail;
                if (tail >= 0) enext[tail] = p; else seg->ehead = p;
                tail = p;
                ++appended;
            }
            if (!(dirty_state[p] == 1 && dirty_one[p] == stream)) dirty.note(p, stream);   // mostly dirty with it already
        }
        if (appended) {
            enext[tail] = -1;
            seg->etail = tail;
            seg->n_empty += static_cast<std::size_t>(appended);
        }
        live_pages_ -= emptied;
        return;
    }
    for (std::int64_t p = first; p <= last; ++p) {
        --r[p];
        if (r[p] == 0) {
            seg->empty_add(p);
            --live_pages_;
            seg->dirty.note(p, stream);
            if (seg->users.has(p)) {
                std::vector<std::uint64_t> us;
                seg->users.get(p, us);
                seg->users.pop(p);
                for (auto u : us) seg->dirty.note(p, u);
            }
        } else if (!seg->users.equals(p, stream)) {
            seg->users.note(p, stream);
        }
    }
}

// VirtualBacking._fence_page
void Engine::fence_page(VSeg* seg, std::int64_t page, StreamNumbers& batch) {
    if (!seg->dirty.has(page)) return;
    std::uint64_t one_stream = 0;
    std::vector<std::uint64_t> several;   // dirty with several streams (sorted); one is read in place
    const std::uint64_t* streams = &one_stream;
    std::size_t n_streams = 1;
    if (seg->dirty.state[page] == 1) {
        one_stream = seg->dirty.one[page];
    } else {
        seg->dirty.get(page, several);
        streams = several.data();
        n_streams = several.size();
    }
    auto existing = seg->page_fences.find(page);
    VSeg::PageFences::node_type local;   // the page's new entry, when it has none: in the map once all are merged
    if (existing == seg->page_fences.end()) local = seg->fences_node(page);
    FenceMap& pf = local ? local.mapped() : existing->second;   // mutated in place, as in Python
    try {
        for (std::size_t i = 0; i < n_streams; ++i) {
            const std::uint64_t s = streams[i];
            const std::uint64_t* known = batch.find(s);
            std::uint64_t number;
            if (!known) {
                number = fences_record(s);
                batch.set(s, number);
            } else {
                number = *known;
            }
            merge_into(pf, s, number);
        }
    } catch (...) {
        if (local) seg->fences_spare(std::move(local));
        throw;
    }
    if (local) seg->page_fences.insert(std::move(local));
    seg->dirty.pop(page);
}

// VirtualBacking._page_ready
bool Engine::page_ready(VSeg* seg, std::int64_t page, bool wait, StreamNumbers& batch,
                        StreamNumbers* busy) {
    if (seg->dirty.has(page)) fence_page(seg, page, batch);
    auto it = seg->page_fences.find(page);
    if (it == seg->page_fences.end() || it->second.empty()) return true;
    bool known = false;   // a fence at or after one found pending in this pass
    if (busy)
        for (auto& f : it->second) {
            const std::uint64_t* b = busy->find(f.first);
            if (b && f.second >= *b) { known = true; break; }
        }
    if (!known) {
        if (fences_all_done(&it->second)) {
            seg->fences_erase(it);
            return true;
        }
        if (busy && it->second.size() == 1) {
            auto& f = it->second.front();
            const std::uint64_t* b = busy->find(f.first);
            if (!b || f.second < *b) busy->set(f.first, f.second);
        }
    }
    if (!wait) return false;
    it = seg->page_fences.find(page);
    FenceMap copy = it->second;
    fences_wait_all(&copy);
    ++n_waits_;
    seg->fences_erase(page);
    return true;
}

// VirtualBacking._stealable
std::uint64_t Engine::stealable(VSeg* seg, std::int64_t first, std::int64_t last) {
    std::uint64_t own = 0;
    if (seg->n_empty)
        for (std::int64_t p = first; p <= last; ++p) own += seg->is_empty(p) ? 1 : 0;
    std::uint64_t total = 0;
    for (auto& s : vsegs_) total += s->n_empty;
    return total - own;
}

// VirtualBacking._map_pages
void Engine::map_pages(VSeg* seg, const std::vector<std::int64_t>& need, std::int64_t first, std::int64_t last,
                       std::uint64_t requested) {
    const std::uint64_t g = seg->page_nbytes;
    std::int64_t n_need = static_cast<std::int64_t>(need.size());
    std::int64_t shortfall = n_need - static_cast<std::int64_t>(unmapped_.size());
    if (custom_pages_) {
        // pages of two sizes: only a cached chunk of this range's page size fits; those go last (popped first)
        std::stable_partition(unmapped_.begin(), unmapped_.end(), [&](ChunkHandle h) { return chunk_nbytes(h) != g; });
        shortfall = n_need;
        for (ChunkHandle h : unmapped_) shortfall -= chunk_nbytes(h) == g ? 1 : 0;
    }
    if (shortfall > 0 && cfg_.steal_empty_pages) {
        // Create freely up to the slack above the most pages live data ever touched; past it, steal.
        std::int64_t touched = std::max(peak_live_pages_, live_pages_ + n_need);
        std::int64_t allowance = static_cast<std::int64_t>(static_cast<double>(touched) * (1.0 + cfg_.page_slack))
                                 - static_cast<std::int64_t>(reserved_nbytes_ / g);
        std::int64_t creatable = std::max<std::int64_t>(0, std::min(shortfall, allowance));
        shortfall = std::max(creatable, shortfall - static_cast<std::int64_t>(stealable(seg, first, last)));
    }
    if (shortfall > 0) {
        check_limit(static_cast<std::uint64_t>(shortfall) * g, requested);
        std::int64_t created = 0;
        try {
            for (std::int64_t i = 0; i < shortfall; ++i) {
                ChunkHandle h = backend_.mem_create(g);
                ++device_calls_;
                unmapped_.push_back(h);
                note_chunk(h, g);
                ++created;
            }
        } catch (...) {
            try {
                release_unmapped(created);   // give back what this call created, as far as it can
            } catch (...) {   // the first error is the one raised
                rethrow_if_fatal();   // Note [Only Exception is caught]
            }
            throw;
        }
    }
    std::int64_t n_steal = n_need - static_cast<std::int64_t>(unmapped_.size());
    if (n_steal > 0) steal(seg, first, last, n_steal, requested);
    std::vector<std::int64_t> mapped;
    mapped.reserve(need.size());
    try {
        for (auto p : need) {
            ChunkHandle h = unmapped_.back();
            std::uint64_t va = seg->base + static_cast<std::uint64_t>(p) * g;
            backend_.mem_map(va, g, h, 0);
            ++device_calls_;
            unmapped_.pop_back();
            seg->set_chunk(p, h, p, chunk_nbytes(h));
            seg->noaccess_add(p);
            mapped.push_back(p);
        }
        // one access call per contiguous run of newly mapped pages
        std::int64_t run_start = mapped[0], prev = mapped[0];
        for (std::size_t i = 1; i <= mapped.size(); ++i) {
            bool more = i < mapped.size();
            std::int64_t p = more ? mapped[i] : -1;
            if (more && p == prev + 1) {
                prev = p;
                continue;
            }
            backend_.mem_set_access(seg->base + static_cast<std::uint64_t>(run_start) * g,
                                    static_cast<std::uint64_t>(prev - run_start + 1) * g);
            ++device_calls_;
            for (std::int64_t q = run_start; q <= prev; ++q) seg->noaccess_discard(q);
            if (more) run_start = prev = p;
        }
    } catch (...) {
        // undo: unmap what this call mapped, keep the chunks cached; a page that cannot be unmapped
        // stays mapped and empty (and marked noaccess if its access was never set)
        for (std::size_t i = 0; i < mapped.size(); ++i) {
            const std::int64_t p = mapped[i];
            ChunkHandle h = seg->chunks[p];
            try {
                backend_.mem_unmap(seg->base + static_cast<std::uint64_t>(p) * g, g);
            } catch (...) {
                try {
                    rethrow_if_fatal();   // Note [Only Exception is caught]
                } catch (...) {           // Ctrl-C in the undo: the pages not undone stay mapped, empty and stealable
                    for (std::size_t j = i; j < mapped.size(); ++j) seg->empty_add(mapped[j]);
                    throw;
                }
                seg->empty_add(p);
                continue;
            }
            ++device_calls_;
            seg->clear_chunk(p);
            seg->noaccess_discard(p);
            unmapped_.push_back(h);
        }
        throw;
    }
}

// VirtualBacking._release_unmapped
std::uint64_t Engine::release_unmapped(std::int64_t count) {
    std::uint64_t released = 0;
    std::int64_t n = static_cast<std::int64_t>(unmapped_.size());
    if (count >= 0) n = std::min(n, count);
    if (!deferred_.empty() && n > 0) {   // a chunk goes back once mapped nowhere
        std::vector<ChunkHandle> going(unmapped_.end() - n, unmapped_.end());
        drain_deferred(true, nullptr, nullptr, &going);
    }
    for (std::int64_t i = 0; i < n; ++i) {
        ChunkHandle h = unmapped_.back();
        std::uint64_t nbytes = chunk_nbytes(h);
        backend_.mem_release(h);
        ++device_calls_;
        unmapped_.pop_back();
        chunk_nbytes_.erase(h);
        --n_chunks_;
        reserved_nbytes_ -= nbytes;
        released += nbytes;
    }
    return released;
}

// VirtualBacking._forget_chunk_pages, for one page: no longer empty, mapped, fenced or dirty
void Engine::forget_page(VSeg* seg, std::int64_t p) {
    seg->empty_pop(p);
    seg->clear_chunk(p);
    seg->noaccess_discard(p);
    seg->fences_erase(p);
    seg->dirty.pop(p);
}

// VirtualBacking._unmap_page
ChunkHandle Engine::unmap_page(VSeg* seg, std::int64_t p) {
    ChunkHandle h = seg->chunks[p];
    if (!h || !seg->is_empty(p))
        throw EngineError(EngineErrorKind::kInternal, "page is not a mapped empty page in range " + hex(seg->base));
    std::uint64_t va = seg->page_va(p);
    backend_.mem_unmap(va, seg->page_nbytes);
    ++device_calls_;
    forget_page(seg, p);
    return h;
}

// VirtualBacking._steal
void Engine::steal(VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t count, std::uint64_t requested) {
    struct Cand {
        std::uint64_t addr;
        std::int64_t p;
        VSeg* other;
    };
    std::vector<Cand> candidates;
    std::vector<std::int64_t> pages;
    for (auto& up : vsegs_) {
        VSeg* other = up.get();
        other->empty_list(pages);
        std::size_t k = std::min(pages.size(), static_cast<std::size_t>(count + (last - first + 1)));
        std::partial_sort(pages.begin(), pages.begin() + static_cast<std::ptrdiff_t>(k), pages.end(),
                          std::greater<std::int64_t>());
        for (std::size_t i = 0; i < k; ++i) {
            std::int64_t p = pages[i];
            if (other == seg && first <= p && p <= last) continue;
            candidates.push_back({other->base + static_cast<std::uint64_t>(p) * g_, p, other});
        }
    }
    std::sort(candidates.begin(), candidates.end(), [](const Cand& a, const Cand& b) { return a.addr > b.addr; });
    if (static_cast<std::int64_t>(candidates.size()) < count)
        throw EngineError(EngineErrorKind::kInternal, "fewer stealable pages than counted");
    std::vector<Cand> busy;
    StreamNumbers batch;
    std::int64_t stolen = 0;
    for (auto& c : candidates) {
        if (stolen == count) break;
        if (!page_ready(c.other, c.p, false, batch)) {
            busy.push_back(c);
            continue;
        }
        unmapped_.push_back(unmap_page(c.other, c.p));
        count_steal();
        ++stolen;
    }
    if (stolen < count && !busy.empty()) {
        // before creating or waiting, any other empty page whose work is done (beyond the highest few)
        for (auto& up : vsegs_) {
            VSeg* other = up.get();
            if (stolen == count) break;
            other->empty_list(pages);
            for (auto p : pages) {
                if (stolen == count) break;
                bool seen = false;
                for (auto& c : candidates)
                    if (c.other == other && c.p == p) {
                        seen = true;
                        break;
                    }
                if (seen || (other == seg && first <= p && p <= last)) continue;
                if (page_ready(other, p, false, batch)) {
                    unmapped_.push_back(unmap_page(other, p));
                    count_steal();
                    ++stolen;
                }
            }
        }
    }
    for (auto& c : busy) {
        if (stolen == count) break;
        if (create_instead(requested)) {
            ++stolen;
            continue;
        }
        page_ready(c.other, c.p, true, batch);
        unmapped_.push_back(unmap_page(c.other, c.p));
        count_steal();
        ++stolen;
    }
}

// VirtualBacking._create_instead
bool Engine::create_instead(std::uint64_t requested) {
    ChunkHandle h;
    try {
        check_limit(g_, requested);
        h = backend_.mem_create(g_);
    } catch (...) {
        if (classify_current().oom) return false;   // memory is needed now: wait for the busy page
        throw;
    }
    ++device_calls_;
    unmapped_.push_back(h);
    note_chunk(h, g_);
    return true;
}

// -- chunks of several pages (Note [Chunks of several pages] in backing.py) ----------------------------------
// PhysicalHandle.nbytes: the engine keeps each held chunk's size (ChunkHandle is an opaque id).
std::uint64_t Engine::chunk_nbytes(ChunkHandle h) const {
    auto it = chunk_nbytes_.find(h);
    if (it == chunk_nbytes_.end()) throw EngineError(EngineErrorKind::kInternal, "a chunk of unknown size");
    return it->second;
}

// sum(h.nbytes for h in self.unmapped)
std::uint64_t Engine::unmapped_nbytes() const {
    std::uint64_t n = 0;
    for (ChunkHandle h : unmapped_) n += chunk_nbytes(h);
    return n;
}

// the bookkeeping after a successful mem_create: n_chunks += 1; reserved_nbytes += nbytes
void Engine::note_chunk(ChunkHandle h, std::uint64_t nbytes) {
    chunk_nbytes_[h] = nbytes;
    ++n_chunks_;
    reserved_nbytes_ += nbytes;
}

// Note [The chunk of a page at hand]: a steal reads, for each page it looks at, the first page of its chunk
// (_chunk_start walks back page by page) and the chunk's size (h.nbytes: a hash lookup here, ChunkHandle being
// an opaque id): a walk back per fresh page in idle_refresh, a lookup per chunk read in idle_entry, chunk_ready,
// unmap_chunk. On a 7B model's generate() replay (prompt 2048, 6,000 new tokens: 950k steals), with the device's
// methods doing nothing, idle_refresh and the lookups were an eighth of the CPU time. So each range keeps,
// beside `chunks`, the first page (chunk_first) and the size (chunk_nbytes) of the chunk mapped at each page,
// written where `chunks` is (VSeg::set_chunk, clear_chunk: every mapping and unmapping goes through them) and
// read where Python walks or asks the handle. The values are the same (a chunk is mapped whole, contiguous, in
// one place), so are the decisions; check_consistency compares them.
//
// VirtualBacking._chunk_start: read from the range's chunk_first where a chunk is mapped (Note [The chunk of a
// page at hand]); the walk where none is (a run of unmapped pages, as Python walks it)
std::int64_t Engine::chunk_start(VSeg* seg, std::int64_t p) const {
    const auto& chunks = seg->chunks;
    ChunkHandle h = chunks[p];
    if (h) return seg->chunk_first[p];
    while (p && chunks[p - 1] == h) --p;
    return p;
}

// chunk_pages(seg->chunks[p]) for a mapped page p, from the range's chunk_nbytes (Note [The chunk of a page at
// hand]); an unmapped page raises as chunk_pages(None) would
std::int64_t Engine::mapped_chunk_pages(const VSeg* seg, std::int64_t p) const {
    if (!seg->chunks[p]) return chunk_pages(0);
    return static_cast<std::int64_t>(seg->chunk_nbytes[p] / g_);
}

// VirtualBacking._chunk_cap_pages
std::int64_t Engine::chunk_cap_pages() const {
    return chunk_cap_pages_of(static_cast<std::int64_t>(reserved_nbytes_ / g_), knobs());
}

// AllocatorPolicy.chunk_cap_pages
std::int64_t Engine::chunk_cap_pages_of(std::int64_t held, const EngineConfig& k) const {
    std::int64_t by_fraction = static_cast<std::int64_t>(static_cast<double>(held) * k.chunk_max_fraction);
    return std::max<std::int64_t>(1, std::min(by_fraction, static_cast<std::int64_t>(k.chunk_max_nbytes / g_)));
}

// VirtualBacking._map_runs
void Engine::map_runs(VSeg* seg, const std::vector<std::int64_t>& need, std::int64_t first, std::int64_t last,
                      std::uint64_t requested, std::uint64_t stream, std::int64_t whole_lo, std::int64_t whole_hi) {
    const std::uint64_t g = g_;
    if (!deferred_.empty()) {
        drain_deferred(false, nullptr, nullptr, nullptr);
        bool hit = false;
        if (seg->n_deferred)
            for (auto p : need) if (seg->deferred[p]) { hit = true; break; }
        if (hit) drain_deferred(true, seg, &need, nullptr);   // the old mapping must go before a new one there
    }
    std::int64_t touched = std::max(peak_live_pages_, live_pages_ + static_cast<std::int64_t>(need.size()));
    // pages held may reach this before a steal
    // at least page_slack_min_nbytes more than touched, within the limit (Note [A slack of at least one page])
    const EngineConfig& k = knobs();   // Note [A memory-first warm-up] in plan.py
    std::int64_t floor = touched + static_cast<std::int64_t>(k.page_slack_min_nbytes / g);
    if (cfg_.limit_nbytes)
        floor = std::min(floor, (static_cast<std::int64_t>(cfg_.limit_nbytes) - static_cast<std::int64_t>(plan_mapped_nbytes_)) /
                                    static_cast<std::int64_t>(g));
    std::int64_t budget = std::max(static_cast<std::int64_t>(static_cast<double>(touched) * (1.0 + k.page_slack)), floor);
    busy_pages_ = static_cast<double>(touched) * (1.0 + k.page_slack + k.busy_slack);
    std::int64_t top_page = static_cast<std::int64_t>((seg->top - 1) / g);
    std::vector<std::int64_t>& mapped = map_runs_mapped_;   // first pages of the chunks this call mapped
    mapped.clear();
    std::vector<ChunkHandle> created;
    created_ = &created;
    std::vector<StolenOrdered> stolen;
    stolen_ordered_ = &stolen;
    try {
        std::size_t i = 0;
        while (i < need.size()) {
            std::size_t j = i;
            while (j + 1 < need.size() && need[j + 1] == need[j] + 1) ++j;
            std::int64_t pos = need[i], end = need[j] + 1;
            i = j + 1;
            while (pos < end) {
                std::int64_t rem = end - pos;
                ChunkHandle h;
                if (!take_cached(rem, &h))
                    h = chunk_for(seg, pos, rem, end - 1 == top_page, first, last, budget, requested, stream,
                                  pos >= whole_lo ? whole_hi - pos + 1 : 0);
                map_chunk(seg, pos, h);
                mapped.push_back(pos);
                pos += mapped_chunk_pages(seg, pos);
            }
        }
        // one access call per contiguous run of newly mapped pages
        std::size_t k = 0;
        while (k < mapped.size()) {
            std::int64_t start = mapped[k];
            std::int64_t stop = start + mapped_chunk_pages(seg, start);
            while (k + 1 < mapped.size() && mapped[k + 1] == stop) {
                ++k;
                stop += mapped_chunk_pages(seg, stop);
            }
            ++k;
            backend_.mem_set_access(seg->base + static_cast<std::uint64_t>(start) * g,
                                    static_cast<std::uint64_t>(stop - start) * g);
            ++device_calls_;
            for (std::int64_t q = start; q < stop; ++q) seg->noaccess_discard(q);
        }
    } catch (...) {
        created_ = nullptr;
        stolen_ordered_ = nullptr;
        // however the rollback ends: a chunk stolen stream-ordered and cached again goes back where it is
        // still mapped (the finally of VirtualBacking._map_runs' rollback)
        struct Undefer {
            Engine* engine;
            std::vector<StolenOrdered>* stolen;
            ~Undefer() { for (const StolenOrdered& st : *stolen) engine->undefer(st); }
        } undefer_guard{this, &stolen};
        // undo: unmap what this call mapped, keep the chunks cached; a chunk that cannot be unmapped
        // stays mapped with its pages empty (and noaccess if access was never set)
        for (std::int64_t start : mapped) {
            ChunkHandle h = seg->chunks[start];
            if (!h) throw EngineError(EngineErrorKind::kInternal, "page " + std::to_string(start) + " was mapped with no chunk");
            std::uint64_t nbytes = chunk_nbytes(h);
            std::int64_t n = static_cast<std::int64_t>(nbytes / g);
            try {
                backend_.mem_unmap(seg->base + static_cast<std::uint64_t>(start) * g, nbytes);
            } catch (...) {   // the first error is the one raised
                rethrow_if_fatal();   // Note [Only Exception is caught]
                for (std::int64_t q = start; q < start + n; ++q)
                    if (!seg->refs[q]) seg->empty_add(q);
                for (const StolenOrdered& st : stolen) {   // stolen stream-ordered: its old work fences it here too
                    if (st.h != h) continue;
                    for (const Deferred& e : deferred_) {
                        if (e.seg != st.seg || e.s != st.s || e.h != st.h) continue;
                        for (std::int64_t q = start; q < start + n; ++q)
                            for (auto& f : e.fences) merge_into(seg->page_fences[q], f.first, f.second);
                    }
                }
                continue;
            }
            ++device_calls_;
            for (std::int64_t q = start; q < start + n; ++q) {
                seg->clear_chunk(q);
                seg->noaccess_discard(q);
                seg->empty_pop(q);
            }
            unmapped_.push_back(h);
        }
        // and give back the chunks this call created: a failed allocation holds no more memory
        for (ChunkHandle h : created) {
            auto it = std::find(unmapped_.begin(), unmapped_.end(), h);
            if (it == unmapped_.end()) continue;   // could not be unmapped: kept, counted
            std::uint64_t nbytes = chunk_nbytes(h);
            try {
                backend_.mem_release(h);
            } catch (...) {   // kept cached and counted; the first error is raised
                rethrow_if_fatal();   // Note [Only Exception is caught]
                continue;
            }
            ++device_calls_;
            unmapped_.erase(std::find(unmapped_.begin(), unmapped_.end(), h));
            chunk_nbytes_.erase(h);
            --n_chunks_;
            reserved_nbytes_ -= nbytes;
        }
        throw;
    }
    created_ = nullptr;
    stolen_ordered_ = nullptr;
}

// VirtualBacking._take_cached: the largest cached chunk of at most max_pages, out of the cache
bool Engine::take_cached(std::int64_t max_pages, ChunkHandle* out) {
    std::ptrdiff_t best = -1;
    std::int64_t best_n = 0;
    for (std::size_t idx = 0; idx < unmapped_.size(); ++idx) {
        std::int64_t n = chunk_pages(unmapped_[idx]);
        if (n <= max_pages && (best < 0 || n > best_n)) {
            best = static_cast<std::ptrdiff_t>(idx);
            best_n = n;
        }
    }
    if (best < 0) return false;
    *out = unmapped_[static_cast<std::size_t>(best)];
    unmapped_.erase(unmapped_.begin() + best);
    return true;
}

// VirtualBacking._map_chunk: map h (held by the caller, in no list) whole at page pos; on failure it is cached
void Engine::map_chunk(VSeg* seg, std::int64_t pos, ChunkHandle h) {
    std::uint64_t nbytes = chunk_nbytes(h);
    std::uint64_t va = seg->base + static_cast<std::uint64_t>(pos) * g_;
    try {
        backend_.mem_map(va, nbytes, h, 0);
    } catch (...) {
        unmapped_.push_back(h);
        throw;
    }
    ++device_calls_;
    for (std::int64_t q = pos; q < pos + static_cast<std::int64_t>(nbytes / g_); ++q) {
        seg->set_chunk(q, h, pos, nbytes);
        seg->noaccess_add(q);
        if (!seg->refs[q]) seg->empty_add(q);   // pages of the chunk past the block (grown ahead): mapped, empty
    }
}

// VirtualBacking._growth_pages
std::int64_t Engine::growth_pages(VSeg* seg, std::int64_t pos, std::int64_t rem, bool at_top, std::int64_t budget) {
    std::int64_t held = static_cast<std::int64_t>(reserved_nbytes_ / g_);
    std::int64_t room = budget - held;
    if (room <= 0) return 0;
    std::int64_t cap = chunk_cap_pages();
    std::int64_t n = std::min({rem, cap, room});
    if (at_top && n == rem) {
        std::int64_t by_fraction = static_cast<std::int64_t>(static_cast<double>(held) * cfg_.grow_ahead_fraction);
        std::int64_t ahead = std::min({std::max(rem, by_fraction), cap, room, seg->n_pages - pos});
        while (n < ahead && !seg->chunks[pos + n]) ++n;
    }
    return n;
}

// VirtualBacking._chunk_for
ChunkHandle Engine::chunk_for(VSeg* seg, std::int64_t pos, std::int64_t rem, bool at_top, std::int64_t first,
                              std::int64_t last, std::int64_t budget, std::uint64_t requested, std::uint64_t stream,
                              std::int64_t unshared) {
    std::int64_t n = cfg_.steal_empty_pages ? growth_pages(seg, pos, rem, at_top, budget)
                                            : std::min(rem, chunk_cap_pages());
    if (n) return create_chunk(n, requested);
    ChunkHandle h;
    if (steal_chunk(seg, first, last, rem, requested, stream, unshared, &h)) return h;
    // idle chunks that remain are all larger than the run: give back one whose work is done and
    // create what fits (memory shrinks); wait for one only when memory would run short
    release_idle_chunk(seg, first, last, false);
    n = std::min(rem, chunk_cap_pages());
    try {
        return create_chunk(n, requested);
    } catch (...) {
        if (!classify_current().oom) throw;
        if (!release_idle_chunk(seg, first, last, true)) throw;
    }
    return create_chunk(n, requested);
}

// VirtualBacking._create_chunk
ChunkHandle Engine::create_chunk(std::int64_t n_pages, std::uint64_t requested) {
    std::uint64_t nbytes = static_cast<std::uint64_t>(n_pages) * g_;
    check_limit(nbytes, requested);
    ChunkHandle h = backend_.mem_create(nbytes);
    ++device_calls_;
    note_chunk(h, nbytes);
    if (created_) created_->push_back(h);
    return h;
}

// VirtualBacking._idle_chunks (in no particular order: every caller sorts by (pages, address))
//
// Note [Unmarking what was marked]: the pages of every chunk looked at are marked in the range's `seen`
// (each chunk is looked at once), and only those are unmarked after: clearing a mark per page of the range
// on each call (its whole virtual range, twice the device's memory: 137k pages on an H200) was three
// quarters of the engine's instructions on gpt2_bf16 at page slack 0.005, where it steals in every step
// (reports/cupy-hook-cpu-profile.md).
void Engine::idle_chunks(VSeg* seg, std::int64_t first, std::int64_t last, std::vector<IdleChunk>& found) {
    found.clear();
    struct Unmark {   // leaves every `seen` all clear, also when chunk_pages throws
        std::uint8_t* seen = nullptr;
        std::vector<std::pair<std::int64_t, std::int64_t>> marked;   // (first page, pages)
        ~Unmark() { clear(); }
        void clear() {
            for (const auto& m : marked) std::fill(seen + m.first, seen + m.first + m.second, std::uint8_t{0});
            marked.clear();
        }
    } unmark;
    for (auto& up : vsegs_) {
        VSeg* other = up.get();
        unmark.clear();
        std::uint8_t* seen = unmark.seen = other->seen.data();
        for (std::int64_t p = other->ehead; p >= 0; p = other->enext[p]) {
            if (seen[p]) continue;
            std::int64_t s = chunk_start(other, p);
            std::int64_t n = mapped_chunk_pages(other, s);
            unmark.marked.emplace_back(s, n);
            std::fill(seen + s, seen + s + n, std::uint8_t{1});
            if (other == seg && s <= last && s + n > first) continue;
            bool idle = true;
            for (std::int64_t q = s; q < s + n && idle; ++q) idle = other->is_empty(q);
            if (idle) found.push_back({n, other->base + static_cast<std::uint64_t>(s) * g_, s, other});
        }
    }
}

// VirtualBacking._chunk_ready (stops at the first page whose work is not done; with wait_own_stream the chunk's
// other pages are fenced first: Note [Wait for the oldest fence] in backing.py)
bool Engine::chunk_ready(VSeg* seg, std::int64_t s, bool wait, StreamNumbers& batch,
                         StreamNumbers* busy) {
    std::int64_t n = mapped_chunk_pages(seg, s);
    for (std::int64_t q = s; q < s + n; ++q)
        if (!page_ready(seg, q, wait, batch, busy)) {
            if (knobs().wait_own_stream)
                for (std::int64_t r = q + 1; r < s + n; ++r)
                    if (seg->dirty.has(r)) fence_page(seg, r, batch);
            return false;
        }
    return true;
}

// VirtualBacking._chunk_of_stream
std::ptrdiff_t Engine::chunk_of_stream(IdleWalk& fits, std::uint64_t stream, StreamNumbers& batch,
                                       StreamNumbers* busy, FenceMap& pending, std::int64_t unshared) {
    std::ptrdiff_t oldest = -1;
    std::int64_t oldest_n = 0, oldest_own = 0;
    FenceMap here;
    for (std::size_t i = 0; idle_at(fits, i); ++i) {
        IdleChunk c = fits.got[i];
        if (unshared >= 0 && c.n > unshared) continue;   // Note [No other stream on a deferred chunk] in backing.py
        here = chunk_fences(c.seg, c.s, batch);
        bool ours = true;
        std::int64_t own = -1;   // the chunk's last fence on stream (-1: none)
        for (auto& f : here) {
            if (f.first == stream) own = static_cast<std::int64_t>(f.second);
            else if (!fence_done_in_pass(f.first, f.second, busy)) { ours = false; break; }
        }
        if (!ours) continue;
        if (!busy) {   // the stream-ordered steal: the first in the steal's order
            pending = std::move(here);
            return static_cast<std::ptrdiff_t>(i);
        }
        // Note [Wait for the oldest fence] in backing.py: the largest, then the oldest fence; `pending` is not filled
        // here (the wait's caller does not read it)
        if (oldest < 0 || c.n > oldest_n || (c.n == oldest_n && own < oldest_own)) {
            oldest = static_cast<std::ptrdiff_t>(i);
            oldest_n = c.n;
            oldest_own = own;
        }
    }
    return oldest;
}

// VirtualBacking._fence_done
bool Engine::fence_done_in_pass(std::uint64_t stream, std::uint64_t number, StreamNumbers* busy) {
    if (!busy) return fences_done(stream, number);   // every fence queried (the stream-ordered steal)
    const std::uint64_t* b = busy->find(stream);
    if (b && number >= *b) return false;   // at or after a fence found pending in this pass
    if (fences_done(stream, number)) return true;
    if (!b || number < *b) busy->set(stream, number);
    return false;
}

// VirtualBacking._steal_chunk (false: None)
bool Engine::steal_chunk(VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t max_pages,
                         std::uint64_t requested, std::uint64_t stream, std::int64_t unshared, ChunkHandle* out) {
    IdleWalk fits(idle_walk_spare_);
    idle_walk(fits, seg, first, last, max_pages);   // Note [An index of idle chunks] in backing.py
    if (!idle_at(fits, 0)) return false;
    StreamNumbers batch, busy;
    for (std::size_t i = 0; idle_at(fits, i); ++i) {
        IdleChunk c = fits.got[i];
        if (chunk_ready(c.seg, c.s, false, batch, &busy)) {
            count_steal();
            *out = unmap_chunk(c.seg, c.s);
            return true;
        }
    }
    FenceMap pending;
    if (unshared > 0 && ordered_steal_allowed()) {   // Notes [Stream-ordered steal], [No other stream on a deferred chunk]
        std::ptrdiff_t i = chunk_of_stream(fits, stream, batch, nullptr, pending, unshared);
        if (i >= 0) {
            IdleChunk c = fits.got[static_cast<std::size_t>(i)];
            count_steal();
            *out = defer_unmap(c.seg, c.s, std::move(pending));
            return true;
        }
    }
    if (knobs().wait_own_stream) {   // Note [Wait for the program's own stream] in backing.py
        std::ptrdiff_t i = chunk_of_stream(fits, stream, batch, &busy, pending);
        if (i >= 0) {
            IdleChunk c = fits.got[static_cast<std::size_t>(i)];
            chunk_ready(c.seg, c.s, true, batch);
            count_steal();
            *out = unmap_chunk(c.seg, c.s);
            return true;
        }
    }
    const IdleChunk c = fits.got[0];
    if (static_cast<double>(reserved_nbytes_ / g_) + static_cast<double>(c.n) <= busy_pages_) {
        try {
            *out = create_chunk(c.n, requested);
            return true;
        } catch (...) {
            if (!classify_current().oom) throw;   // memory is needed now: wait for the busy chunk
        }
    }
    if (knobs().wait_on_gpu && c.n <= unshared) {   // Notes [Wait on the GPU, not the host], [No other stream on a
                                                     // deferred chunk] in backing.py
        pending = chunk_fences(c.seg, c.s, batch);
        for (const auto& sn : pending)
            if (sn.first != stream) fences_order_after(stream, sn.first, sn.second);
        count_steal();
        *out = defer_unmap(c.seg, c.s, std::move(pending));
        return true;
    }
    chunk_ready(c.seg, c.s, true, batch);
    count_steal();
    *out = unmap_chunk(c.seg, c.s);
    return true;
}

// VirtualBacking._release_idle_chunk
bool Engine::release_idle_chunk(VSeg* seg, std::int64_t first, std::int64_t last, bool wait) {
    IdleWalk idle(idle_walk_spare_);
    idle_walk(idle, seg, first, last, -1);   // Note [An index of idle chunks] in backing.py
    StreamNumbers batch, busy;
    bool found = false;
    IdleChunk pick{};
    for (std::size_t i = 0; idle_at(idle, i); ++i)
        if (chunk_ready(idle.got[i].seg, idle.got[i].s, false, batch, &busy)) {
            pick = idle.got[i];
            found = true;
            break;
        }
    if (!found) {
        if (!wait || !idle_at(idle, 0)) return false;
        pick = idle.got[0];
        chunk_ready(pick.seg, pick.s, true, batch);
    }
    unmapped_.push_back(unmap_chunk(pick.seg, pick.s));
    release_unmapped(1);
    return true;
}

// VirtualBacking._idle_refresh (Note [An index of idle chunks] in backing.py)
void Engine::idle_refresh() {
    std::uint64_t n_fresh = 0;   // Note [The engine's own time] in gpumem/sim/latency.py; before anything changes
    for (auto& up : vsegs_) n_fresh += up->fresh.size();
    if (n_fresh) backend_.engine_work(n_fresh);
    for (auto& up : vsegs_) {
        VSeg* other = up.get();
        IdleKey last_key{-1, 0};
        auto last_at = idle_index_.end();   // the entry of last_key
        for (std::int64_t p : other->fresh) {
            other->in_fresh[p] = 0;
            if (!other->is_empty(p) || !other->chunks[p]) continue;   // taken again (or unmapped) since
            std::int64_t s = chunk_start(other, p);
            IdleKey key{mapped_chunk_pages(other, s), other->base + static_cast<std::uint64_t>(s) * g_};
            if (key == last_key) continue;   // the page before was of the same chunk: in the index already
            last_key = key;
            idle_index_add(other, s, key, last_at);
        }
        other->fresh.clear();
    }
}

// idle_index_.insert(key) (key: the chunk of seg at page s), cheaply: a chunk indexed before, as most are, is
// found in the range's `indexed`; a key that goes just after `last` (the entry the caller added or found last:
// chunks fall idle in address order, over half the time on the 7B's decode) needs no search; the node is one
// idle_index_drop gave back, where there is one. `last` is left on key's entry.
void Engine::idle_index_add(VSeg* seg, std::int64_t s, const IdleKey& key, std::set<IdleKey>::iterator& last) {
    if (seg->indexed[s] == key.first) return;
    seg->indexed[s] = key.first;
    const auto end = idle_index_.end();
    std::set<IdleKey>::iterator at;   // the first entry above key
    if (last != end && *last < key && (std::next(last) == end || key < *std::next(last))) {
        at = std::next(last);
    } else {
        at = idle_index_.lower_bound(key);
        if (at != end && *at == key) {
            last = at;
            return;
        }
    }
    if (idle_nodes_.empty()) {
        last = idle_index_.emplace_hint(at, key);
        return;
    }
    std::set<IdleKey>::node_type node = std::move(idle_nodes_.back());
    idle_nodes_.pop_back();
    node.value() = key;
    last = idle_index_.insert(at, std::move(node));
}

// idle_index_.erase(at), its node kept for idle_index_add, and its range's `indexed` mark cleared where it
// named this entry; the entry after it
std::set<Engine::IdleKey>::iterator Engine::idle_index_drop(std::set<IdleKey>::iterator at) {
    const IdleKey key = *at;
    for (auto& up : vsegs_) {
        VSeg* other = up.get();
        if (key.second < other->base || key.second - other->base >= other->nbytes) continue;
        std::int64_t s = static_cast<std::int64_t>((key.second - other->base) / g_);
        if (other->indexed[s] == key.first) other->indexed[s] = 0;
        break;
    }
    auto next = std::next(at);
    idle_nodes_.push_back(idle_index_.extract(at));
    return next;
}

// VirtualBacking._idle_entry (false: None)
bool Engine::idle_entry(const std::pair<std::int64_t, std::uint64_t>& key, IdleChunk& out) const {
    for (auto& up : vsegs_) {
        VSeg* other = up.get();
        if (key.second < other->base || key.second - other->base >= other->nbytes) continue;
        std::int64_t s = static_cast<std::int64_t>((key.second - other->base) / g_);
        ChunkHandle h = other->chunks[s];
        if (!h || (s && other->chunks[s - 1] == h) || mapped_chunk_pages(other, s) != key.first) return false;
        for (std::int64_t q = s; q < s + key.first; ++q)
            if (!other->is_empty(q)) return false;
        out = {key.first, key.second, s, other};
        return true;
    }
    return false;
}

// VirtualBacking._idle_walk: max_pages < 0 walks every idle chunk, smallest first
void Engine::idle_walk(IdleWalk& w, VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t max_pages) {
    idle_refresh();
    w.seg = seg;
    w.first = first;
    w.last = last;
    w.descending = max_pages >= 0;
    w.done = false;
    w.got.clear();
    w.pos = w.descending ? idle_index_.upper_bound({max_pages, ~std::uint64_t{0}}) : idle_index_.begin();
}

// The i-th chunk of the walk, looked up in the index as far as needed (nullptr: fewer); entries no longer idle
// leave the index on the way. The caller changes no page's emptiness while it walks.
const Engine::IdleChunk* Engine::idle_at(IdleWalk& w, std::size_t i) {
    while (w.got.size() <= i && !w.done) {
        if (w.descending) {
            if (w.pos == idle_index_.begin()) {
                w.done = true;
                break;
            }
            --w.pos;
        } else if (w.pos == idle_index_.end()) {
            w.done = true;
            break;
        }
        IdleChunk c;
        if (!idle_entry(*w.pos, c)) {
            w.pos = idle_index_drop(w.pos);   // descending: the next step goes below it
            continue;
        }
        if (!(c.seg == w.seg && c.s <= w.last && c.s + c.n > w.first)) {
            if (!w.descending) ++w.pos;
            w.got.push_back(c);
        } else if (w.descending) {   // every chunk of this size that meets [first, last] is passed over
            std::int64_t lo = std::max<std::int64_t>(0, w.first - c.n + 1);
            w.pos = idle_index_.lower_bound({c.n, c.seg->base + static_cast<std::uint64_t>(lo) * g_});
        } else {
            w.pos = idle_index_.upper_bound({c.n, c.seg->base + static_cast<std::uint64_t>(w.last) * g_});
        }
    }
    return i < w.got.size() ? &w.got[i] : nullptr;
}

// VirtualBacking._idle_index_problems
void Engine::idle_index_problems(std::vector<std::string>& problems) {
    for (auto& up : vsegs_)   // what idle_index_add takes as indexed is (Note [The chunk of a page at hand])
        for (std::int64_t s = 0; s < up->n_pages; ++s)
            if (up->indexed[s] && !idle_index_.count({up->indexed[s], up->page_va(s)}))
                problems.push_back("page " + std::to_string(s) + " of " + hex(up->base) +
                                   " is marked indexed, its entry is not in the index");
    std::vector<IdleChunk> all;
    idle_chunks(nullptr, 0, -1, all);
    for (const IdleChunk& c : all) {
        if (idle_index_.count({c.n, c.addr})) continue;
        bool fresh = false;
        for (std::int64_t q = c.s; q < c.s + c.n && !fresh; ++q)
            fresh = c.seg->in_fresh[q] != 0;
        if (!fresh)
            problems.push_back("the idle chunk at page " + std::to_string(c.s) + " of " + hex(c.seg->base) + " (" +
                               std::to_string(static_cast<std::uint64_t>(c.n) * g_) + " B) is not indexed");
    }
}

// VirtualBacking._unmap_chunk
ChunkHandle Engine::unmap_chunk(VSeg* seg, std::int64_t s) {
    ChunkHandle h = seg->chunks[s];
    if (!h || (s && seg->chunks[s - 1] == h))
        throw EngineError(EngineErrorKind::kInternal, "page " + std::to_string(s) + " of range " + hex(seg->base) +
                                                          " is not the first page of a chunk");
    std::uint64_t nbytes = seg->chunk_nbytes[s];   // chunk_nbytes(h) (Note [The chunk of a page at hand])
    std::int64_t n = static_cast<std::int64_t>(nbytes / g_);
    for (std::int64_t q = s; q < s + n; ++q)
        if (!seg->is_empty(q))
            throw EngineError(EngineErrorKind::kInternal, "chunk at page " + std::to_string(s) + " of range " +
                                                              hex(seg->base) + " is not idle");
    std::uint64_t va = seg->base + static_cast<std::uint64_t>(s) * g_;
    backend_.mem_unmap(va, nbytes);
    ++device_calls_;
    for (std::int64_t q = s; q < s + n; ++q) {
        forget_page(seg, q);
    }
    return h;
}

// VirtualBacking._chunk_fences
FenceMap Engine::chunk_fences(VSeg* seg, std::int64_t s, StreamNumbers& batch) {
    FenceMap merged;
    std::int64_t n = mapped_chunk_pages(seg, s);
    for (std::int64_t q = s; q < s + n; ++q) {
        if (seg->dirty.has(q)) fence_page(seg, q, batch);
        auto it = seg->page_fences.find(q);
        if (it == seg->page_fences.end()) continue;
        for (auto& f : it->second) merge_into(merged, f.first, f.second);
    }
    return merged;
}

// VirtualBacking._defer_unmap
ChunkHandle Engine::defer_unmap(VSeg* seg, std::int64_t s, FenceMap pending) {
    ChunkHandle h = seg->chunks[s];
    if (!h || (s && seg->chunks[s - 1] == h))
        throw EngineError(EngineErrorKind::kInternal, "page " + std::to_string(s) + " of range " + hex(seg->base) +
                                                          " is not the first page of a chunk");
    std::int64_t n = mapped_chunk_pages(seg, s);
    for (std::int64_t q = s; q < s + n; ++q)
        if (!seg->is_empty(q))
            throw EngineError(EngineErrorKind::kInternal, "chunk at page " + std::to_string(s) + " of range " +
                                                              hex(seg->base) + " is not idle");
    std::vector<std::int64_t> noaccess;
    if (seg->n_noaccess)
        for (std::int64_t q = s; q < s + n; ++q) if (seg->noaccess[q]) noaccess.push_back(q);
    for (std::int64_t q = s; q < s + n; ++q) {
        forget_page(seg, q);
        if (!seg->deferred[q]) { seg->deferred[q] = 1; ++seg->n_deferred; }
    }
    deferred_.push_back(Deferred{seg, s, h, std::move(pending)});
    if (stolen_ordered_) stolen_ordered_->push_back(StolenOrdered{seg, s, h, std::move(noaccess)});
    return h;
}

// VirtualBacking._undefer: a failed map_runs puts a chunk it stole stream-ordered back where it is still mapped
void Engine::undefer(const StolenOrdered& st) {
    auto cached = std::find(unmapped_.begin(), unmapped_.end(), st.h);
    if (cached == unmapped_.end()) return;   // its new mapping could not be undone: it stays deferred
    auto d = std::find_if(deferred_.begin(), deferred_.end(),
                          [&](const Deferred& e) { return e.seg == st.seg && e.s == st.s && e.h == st.h; });
    if (d == deferred_.end()) return;
    unmapped_.erase(cached);
    FenceMap pending = std::move(d->fences);
    deferred_.erase(d);
    VSeg* seg = st.seg;
    for (std::int64_t q = st.s; q < st.s + chunk_pages(st.h); ++q) {
        if (seg->deferred[q]) { seg->deferred[q] = 0; --seg->n_deferred; }
        seg->set_chunk(q, st.h, st.s, chunk_nbytes(st.h));
        seg->empty_add(q);
        if (!pending.empty()) seg->page_fences[q] = pending;
    }
    for (std::int64_t q : st.noaccess) seg->noaccess_add(q);
}

// VirtualBacking._drain_deferred (pages: with seg; both null and handles null: every entry)
void Engine::drain_deferred(bool wait, VSeg* seg, const std::vector<std::int64_t>* pages,
                            const std::vector<ChunkHandle>* handles) {
    std::vector<std::uint64_t> busy;
    std::vector<Deferred> keep;
    std::size_t i = 0;
    auto finish = [&]() {
        for (std::size_t k = i; k < deferred_.size(); ++k) keep.push_back(std::move(deferred_[k]));
        deferred_ = std::move(keep);
    };
    try {
        while (i < deferred_.size()) {
            Deferred& e = deferred_[i];
            std::uint64_t nbytes = chunk_nbytes(e.h);
            std::int64_t n = static_cast<std::int64_t>(nbytes / g_);
            if (wait) {
                bool chosen = true;
                if (seg && pages) {
                    chosen = false;
                    if (e.seg == seg)
                        for (auto p : *pages) if (e.s <= p && p < e.s + n) { chosen = true; break; }
                } else if (handles) {
                    chosen = std::find(handles->begin(), handles->end(), e.h) != handles->end();
                }
                if (!chosen) {
                    keep.push_back(std::move(e));
                    ++i;
                    continue;
                }
                if (!fences_all_done(&e.fences)) {
                    fences_wait_all(&e.fences);
                    ++n_waits_;
                }
            } else {
                bool skip = false;
                for (auto& f : e.fences)
                    if (std::find(busy.begin(), busy.end(), f.first) != busy.end()) { skip = true; break; }
                if (skip || !fences_all_done(&e.fences)) {
                    for (auto& f : e.fences)
                        if (std::find(busy.begin(), busy.end(), f.first) == busy.end()) busy.push_back(f.first);
                    keep.push_back(std::move(e));
                    ++i;
                    continue;
                }
            }
            backend_.mem_unmap(e.seg->base + static_cast<std::uint64_t>(e.s) * g_, nbytes);
            ++device_calls_;
            for (std::int64_t q = e.s; q < e.s + n; ++q)
                if (e.seg->deferred[q]) { e.seg->deferred[q] = 0; --e.seg->n_deferred; }
            ++i;
        }
    } catch (...) {
        finish();
        throw;
    }
    finish();
}

bool Engine::has_deferred(ChunkHandle h) const {
    for (auto& e : deferred_) if (e.h == h) return true;
    return false;
}

// VirtualBacking.release_cached
std::uint64_t Engine::backing_release_cached(bool wait) {
    std::uint64_t released = 0;
    StreamNumbers batch;
    std::vector<std::int64_t> pages;
    if (!deferred_.empty()) drain_deferred(wait, nullptr, nullptr, nullptr);
    for (auto& up : vsegs_) {
        VSeg* seg = up.get();
        seg->empty_list(pages);
        if (chunked_) {   // whole idle chunks
            for (auto p : pages) {
                if (!seg->is_empty(p)) continue;   // unmapped with its chunk
                std::int64_t s = chunk_start(seg, p), n = mapped_chunk_pages(seg, s);
                bool idle = true;
                for (std::int64_t q = s; q < s + n && idle; ++q) idle = seg->is_empty(q);
                if (!idle || !chunk_ready(seg, s, wait, batch)) continue;   // live data on it, or its work not done
                if (!deferred_.empty() && has_deferred(seg->chunks[s])) continue;   // still mapped where stolen from
                unmapped_.push_back(unmap_chunk(seg, s));
            }
            continue;
        }
        for (auto p : pages) {
            if (!page_ready(seg, p, wait, batch)) continue;
            unmapped_.push_back(unmap_page(seg, p));
        }
    }
    released += release_unmapped(-1);
    return released;
}

// VirtualBacking.close
void Engine::backing_close(bool keep_all) {
    std::vector<VSeg*> order;
    for (auto& up : vsegs_) order.push_back(up.get());
    for (VSeg* seg : order) {
        if (keep_all) continue;
        bool whole = true;
        for (std::size_t k = 0; k < deferred_.size();) {
            Deferred& e = deferred_[k];
            if (e.seg != seg) { ++k; continue; }
            std::uint64_t nbytes = chunk_nbytes(e.h);
            try {   // the allocator waited for the streams that used it
                backend_.mem_unmap(seg->page_va(e.s), nbytes);
            } catch (...) {   // kept, still counted
                rethrow_if_fatal();   // Note [Only Exception is caught]
                whole = false;
                ++k;
                continue;
            }
            for (std::int64_t q = e.s; q < e.s + static_cast<std::int64_t>(nbytes / seg->page_nbytes); ++q)
                if (seg->deferred[q]) { seg->deferred[q] = 0; --seg->n_deferred; }
            deferred_.erase(deferred_.begin() + static_cast<std::ptrdiff_t>(k));
        }
        for (std::int64_t p = 0; p < seg->n_pages; ++p) {
            ChunkHandle h = seg->chunks[p];
            if (!h || (p && seg->chunks[p - 1] == h)) continue;   // unmapped, or not the first page of its chunk
            std::uint64_t va = seg->page_va(p);
            std::uint64_t nbytes = chunk_nbytes(h);
            try {   // the allocator waited for the streams that used it
                backend_.mem_unmap(va, nbytes);
            } catch (...) {   // kept, still counted
                rethrow_if_fatal();   // Note [Only Exception is caught]
                whole = false;
                continue;
            }
            for (std::int64_t q = p; q < p + static_cast<std::int64_t>(nbytes / seg->page_nbytes); ++q) {
                seg->clear_chunk(q);
                seg->empty_pop(q);
                seg->noaccess_discard(q);
            }
            unmapped_.push_back(h);
        }
        if (!whole) continue;
        try {
            backend_.address_free(seg->base, seg->nbytes);
        } catch (...) {
            rethrow_if_fatal();   // Note [Only Exception is caught]
            continue;
        }
        vseg_by_key_[seg->small ? 1 : 0] = nullptr;
        for (auto it = vsegs_.begin(); it != vsegs_.end(); ++it)
            if (it->get() == seg) {
                closed_vsegs_.push_back(std::move(*it));
                vsegs_.erase(it);
                break;
            }
        --n_segments_;
    }
    std::vector<ChunkHandle> snapshot = unmapped_;
    for (ChunkHandle h : snapshot) {
        // its old mapping could not be unmapped: still mapped there, kept and counted
        if (!deferred_.empty() && has_deferred(h)) continue;
        try {
            backend_.mem_release(h);
        } catch (...) {
            rethrow_if_fatal();   // Note [Only Exception is caught]
            continue;
        }
        unmapped_.erase(std::find(unmapped_.begin(), unmapped_.end(), h));
        --n_chunks_;
        reserved_nbytes_ -= chunk_nbytes(h);
        chunk_nbytes_.erase(h);
    }
}

// h.nbytes // seg.page_nbytes: the pages of `seg` a chunk covers (chunk_pages, in the granularity, is
// for the chunked paths, which run with the granularity's pages only: Note [Pages of a pool's own size])
std::int64_t Engine::seg_chunk_pages(const VSeg* seg, ChunkHandle h) const {
    return static_cast<std::int64_t>(chunk_nbytes(h) / seg->page_nbytes);
}

std::uint64_t Engine::mapped_empty_nbytes() const {
    std::uint64_t n = 0;
    for (auto& s : vsegs_) n += s->n_empty * s->page_nbytes;
    return n;
}

// VirtualBacking.largest_free_nbytes
std::uint64_t Engine::backing_largest_free_nbytes() const {
    std::uint64_t largest = 0;
    for (auto& fl : fl_order_)
        if (!fl->blocks.empty()) largest = std::max(largest, (*fl->blocks.rbegin())->size);
    std::uint64_t cached = unmapped_nbytes() + mapped_empty_nbytes();
    return std::max(largest, cached);
}

// -- backing.py: SegmentBacking (segment mode) -----------------------------------------------------------
// Note [Segment mode]: the Python engine runs malloc'd segments (SegmentBacking: the bestfit, pytorch and
// cupy policies, and any policy on a device without virtual memory) as well as a virtual range per pool;
// the native engine ports both. A segment is a VSeg marked `malloced`, with no page tables: Segment's
// fields (live, dirty, fence, order, stream) are at the end of the struct; blocks tile it from `base` to
// `base + nbytes`, so the block code (split, merge, free lists) is the virtual path's. What differs, each in
// a function of this section or a branch at the top of the shared one, as in Python's isinstance tests:
// commit/decommit count live blocks per segment (no device call: a segment is all memory), growing
// mallocs a segment (_grow_once), the cache is given back by freeing segments that hold no live block
// once their fence has completed (release_cached; no range top to lower and no idle stream's blocks to
// re-own), the out-of-memory error says whether the device has virtual memory (segment_mode_vmm),
// stats count the free lists' bytes as inactive, close keeps only the segments of streams it could not
// wait for, and with segments_top_down the free lists order equal sizes by segment age
// (TopDownFreeList: Block::place, set in fl_add). The device calls are Device.malloc and Device.free
// (Backend::segment_malloc / segment_free): the Python backend has them, CudaBackend does not, and the
// engines over CUDA (torch_api.cpp) always run virtual memory. tests/allocator/test_native_differential.py
// runs the segment policies through the same random programs as the virtual-memory ones.
namespace {
// Block.__repr__: "<Block 0x...+size allocated|free stream=s>" (consistency problems quote it)
std::string block_repr(const Block* b) {
    return "<Block " + hex(b->addr) + "+" + std::to_string(b->size) + (b->allocated ? " allocated" : " free") +
           " stream=" + std::to_string(b->stream) + ">";
}
}  // namespace

// AllocatorPolicy.segment_nbytes (nbytes: the rounded request, at most the device's total)
std::uint64_t Engine::segment_nbytes(bool small, std::uint64_t nbytes) const {
    constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
    if (cfg_.segment_rule == SegmentRule::kExact) return nbytes;
    if (small && cfg_.separate_small_pool && nbytes <= cfg_.small_segment_nbytes) return cfg_.small_segment_nbytes;
    if (cfg_.segment_rule == SegmentRule::kPytorch) return nbytes < 10 * kMiB ? 20 * kMiB : (nbytes + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
    return (nbytes + g_ - 1) / g_ * g_;
}

// SegmentBacking.new_segment
VSeg* Engine::new_segment(bool small, std::uint64_t stream, std::uint64_t nbytes) {
    const std::uint64_t seg_nbytes = segment_nbytes(small, nbytes);
    check_limit(seg_nbytes, nbytes);
    const std::uint64_t step = (seg_nbytes + g_ - 1) / g_ * g_;   // align_up(seg_nbytes, granularity)
    // the device is asked first, as Python's SegmentBacking does: a segment larger than any device fails there,
    // out of memory, in both engines (attacker review, 2026-12-05: the key check came first and raised an internal
    // error for a policy of 2**63 - 1 B small segments)
    const std::uint64_t ptr = backend_.segment_malloc(seg_nbytes);
    ++device_calls_;
    if (cfg_.segments_top_down && step > order_low_) {   // Python's int goes below 0; the engine's key would wrap
        backend_.segment_free(ptr);
        ++device_calls_;
        throw EngineError(EngineErrorKind::kInternal, "segments_top_down: 2**62 B of segments made, the order keys ran out");
    }
    std::unique_ptr<VSeg> seg(new VSeg(ptr, seg_nbytes, small, stream, VSeg::Malloced{}));
    if (cfg_.segments_top_down) {   // Note [Segments top-down] in policy.py
        order_low_ -= step;
        seg->order = order_low_;
    }
    msegs_.push_back(std::move(seg));
    reserved_nbytes_ += seg_nbytes;
    ++n_segments_;
    return msegs_.back().get();
}

// PythonEngine._grow_once, segment mode: a new malloc'd segment tiled by one block
Block* Engine::grow_segment(bool small, std::uint64_t stream, std::uint64_t size) {
    VSeg* seg = new_segment(small, stream, size);
    Block* b = new_block(seg->base, seg->nbytes, stream, seg);
    append_block(seg, b);
    return b;
}

// SegmentBacking.release_cached (with PythonEngine._drop_blocks)
std::uint64_t Engine::segments_release_cached(bool wait) {
    std::uint64_t released = 0;
    std::vector<VSeg*> order;   // list(self.segments.items())
    order.reserve(msegs_.size());
    for (auto& up : msegs_) order.push_back(up.get());
    for (VSeg* seg : order) {
        if (seg->live) continue;   // holds live data, or blocks freed but waiting for other streams' events
        if (seg->mdirty) {
            seg->fence = fences_record(seg->mstream);   // covers the work of every block it held
            seg->mdirty = false;
        }
        if (seg->fence && !fences_done(seg->mstream, seg->fence)) {
            if (!wait) continue;
            fences_wait(seg->mstream, seg->fence);
        }
        const std::uint64_t base = seg->base, nbytes = seg->nbytes;
        backend_.segment_free(base);
        ++device_calls_;
        drop_blocks(seg);
        for (auto it = msegs_.begin(); it != msegs_.end(); ++it)
            if (it->get() == seg) {
                msegs_.erase(it);   // no block names it any more
                break;
            }
        reserved_nbytes_ -= nbytes;
        --n_segments_;
        released += nbytes;
    }
    return released;
}

// PythonEngine._drop_blocks: forget the blocks of a segment given back (all free, merged into one)
void Engine::drop_blocks(VSeg* seg) {
    Block* b = seg->last;
    while (b) {
        if (b->allocated || b->fences)
            throw EngineError(EngineErrorKind::kInternal,
                              "segment " + hex(seg->base) + " was given back with " + block_repr(b) + " in use");
        Block* prev = b->prev;
        fl_remove(free_list_of(b), b);
        if (prev) prev->next = nullptr;
        seg->last = prev;
        recycle_block(b);
        b = prev;
    }
    seg->last = nullptr;
}

// PythonEngine._segment_streams: the streams of the blocks tiling `seg` (and of their other-stream uses)
void Engine::segment_streams(const VSeg* seg, std::set<std::uint64_t>& out) const {
    out.insert(seg->mstream);
    for (const Block* b = seg->last; b; b = b->prev) {
        out.insert(b->stream);
        if (b->pending_streams) out.insert(b->pending_streams->begin(), b->pending_streams->end());
        if (b->fences)
            for (auto& sn : *b->fences) out.insert(sn.first);
    }
}

// SegmentBacking.close with PythonEngine.close's keep(): a segment a failed stream may still use is kept
void Engine::segments_close(const std::vector<std::uint64_t>& failed) {
    std::vector<VSeg*> order;
    for (auto& up : msegs_) order.push_back(up.get());
    for (VSeg* seg : order) {
        if (!failed.empty()) {
            std::set<std::uint64_t> streams;
            segment_streams(seg, streams);
            bool keep = false;
            for (auto s : failed) keep = keep || streams.count(s) != 0;
            if (keep) continue;
        }
        try {   // the allocator waited for the streams that used it
            backend_.segment_free(seg->base);
        } catch (...) {   // closing gives back what it can, keeps the rest
            rethrow_if_fatal();   // Note [Only Exception is caught]
            continue;
        }
        for (auto it = msegs_.begin(); it != msegs_.end(); ++it)
            if (it->get() == seg) {
                closed_msegs_.push_back(std::move(*it));
                msegs_.erase(it);
                break;
            }
        reserved_nbytes_ -= seg->nbytes;
        --n_segments_;
    }
}

bool Engine::in_some_segment(std::uint64_t ptr) const {
    for (auto& up : msegs_)
        if (up->base <= ptr && ptr - up->base < up->nbytes) return true;
    return false;
}

// PythonEngine.consistency_problems in segment mode: SegmentBacking.consistency_problems (against the
// device's allocations, when listed), _chain_problems per segment, then the engine's own checks
void Engine::segments_consistency_problems(const Reservations* allocations, std::vector<std::string>& problems) {
    std::uint64_t total = 0;
    for (auto& up : msegs_) {
        const VSeg* seg = up.get();
        total += seg->nbytes;
        if (!allocations) continue;
        const std::pair<std::uint64_t, std::uint64_t>* found = nullptr;
        for (auto& a : *allocations)
            if (a.first == seg->base) found = &a;   // dict(): the last listed wins
        if (!found || found->second != seg->nbytes)
            problems.push_back("segment " + hex(seg->base) + "+" + std::to_string(seg->nbytes) +
                               " is not a live device allocation of that size (device: " +
                               (found ? std::to_string(found->second) : std::string("None")) + ")");
    }
    if (total != reserved_nbytes_)
        problems.push_back("segments hold " + std::to_string(total) + " B but reserved_nbytes is " +
                           std::to_string(reserved_nbytes_));
    for (auto& up : msegs_) {   // _chain_problems
        const VSeg* seg = up.get();
        const Block* head = seg->last;
        while (head && head->prev) head = head->prev;
        std::uint64_t cursor = seg->base, live = 0;
        const Block* prev = nullptr;
        for (const Block* b = head; b; b = b->next) {
            if (b->prev != prev || b->addr != cursor || b->size == 0 || b->seg != seg) {
                problems.push_back("block chain broken at " + block_repr(b) + " (expected " + hex(cursor) + ")");
                break;
            }
            if (b->allocated) ++live;
            else if (b->fences || b->pending_streams) ++live;   // freed, waiting for other streams
            else if (!b->in_list || b->in_list != free_list_get(seg->small && cfg_.separate_small_pool, b->stream))
                problems.push_back("free block " + block_repr(b) + " is in no free list");
            cursor = b->addr + b->size;
            prev = b;
        }
        if (prev != seg->last) problems.push_back("segment " + hex(seg->base) + ": last block is not the end of the chain");
        if (cursor != seg->base + seg->nbytes)
            problems.push_back("blocks of segment " + hex(seg->base) + " end at " + hex(cursor) + ", expected " +
                               hex(seg->base + seg->nbytes));
        if (live != seg->live)
            problems.push_back("segment " + hex(seg->base) + " counts " + std::to_string(seg->live) +
                               " live blocks, its chain has " + std::to_string(live));
    }
    for (auto& fl : fl_order_)
        for (const Block* b : fl->blocks)
            if (b->allocated || b->stream != fl->stream || b->fences)
                problems.push_back(block_repr(b) + " is in the free list of stream " + std::to_string(fl->stream) +
                                   " but is not free there");
    std::uint64_t live_nbytes = plan_live_nbytes();
    live_.for_each([&](std::uint64_t addr, void* v) {
        const Block* b = static_cast<const Block*>(v);
        live_nbytes += b->size;
        if (!b->allocated || b->addr != addr)
            problems.push_back("live block " + block_repr(b) + " is not marked allocated at " + hex(addr));
    });
    if (live_nbytes != st_.allocated_nbytes)
        problems.push_back("live blocks hold " + std::to_string(live_nbytes) + " B, allocated_nbytes is " +
                           std::to_string(st_.allocated_nbytes));
    for (const Block* b : pending_)
        if (b->allocated || !b->fences || b->fences->empty())
            problems.push_back("pending block " + block_repr(b) + " has no fences or is allocated");
    if (st_.allocated_nbytes > reserved_nbytes_ + plan_mapped_nbytes_)
        problems.push_back("reserved " + std::to_string(reserved_nbytes_ + plan_mapped_nbytes_) + " B < allocated " +
                           std::to_string(st_.allocated_nbytes) + " B");
}

// -- python_engine.py: PythonEngine -------------------------------------------------------------------------
void Engine::note_lost(const std::string& what) {
    lost_ = true;
    lost_what_ = what;
}

void Engine::check_usable_op() {
    if (lost_) throw EngineError(EngineErrorKind::kDeviceLost, "the device was lost: " + lost_what_);
}

// Runs an operation body; a device loss is remembered (PythonEngine._operation).
#define GPUMEM_OPERATION(...)                                         \
    try {                                                             \
        __VA_ARGS__                                                   \
    } catch (const BackendError& e) {                                 \
        if (e.kind == ErrorKind::kDeviceLost) note_lost(e.what());    \
        throw;                                                        \
    }

std::uint64_t Engine::try_allocate_fast(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out) {
    Guard guard(*this);
    return fast_allocate_locked(nbytes, stream, size_out);
}

// Note [Fast paths under a held run]: run_ops (module.cpp) holds the engine's lock through a run of fast paths
// (Note [One lock for a run of fast paths]); try_allocate_fast and try_free_fast took it again per op all the
// same, nested: a look at the owning thread (an atomic load and pthread_self) and the depth counted up and down,
// some 3 ns of the 28 an op cost the engine on the 7B's decode (engine-only bench, reports/estimate-speed.md round
// 8). The _held variants are the same fast paths without that nesting; they check only that a run is held (a
// plain flag: the binding calls them between hold_for_fast_run() and release_for_fast_run() on its own thread).
std::uint64_t Engine::try_allocate_fast_held(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out) {
    if (!fast_run_held_) throw EngineError(EngineErrorKind::kInternal, "try_allocate_fast_held outside a held run");
    return fast_allocate_locked(nbytes, stream, size_out);
}

bool Engine::try_free_fast_held(std::uint64_t ptr) {
    if (!fast_run_held_) throw EngineError(EngineErrorKind::kInternal, "try_free_fast_held outside a held run");
    return fast_free_locked(ptr);
}

// try_allocate_fast under the lock
std::uint64_t Engine::fast_allocate_locked(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out) {
    if (nbytes == 0) return 0;
    const std::uint64_t r = cfg_.round_nbytes;
    if (nbytes > UINT64_MAX - r) return 0;
    std::uint64_t size = (nbytes + r - 1) & ~(r - 1);   // r is a power of two (the constructor checks)
    bool small = static_cast<std::int64_t>(size) <= small_max_ && size <= (UINT64_MAX >> 1);
    if (lost_ || closed_) return 0;
    if (plan_active()) return plan_serve_fast(nbytes, stream, size_out);   // else allocate() runs the plan layer
    FreeList* fl = free_list_get(small, stream);
    if (!fl) return 0;
    Block* b = fl_best_fit(fl, size);
    if (!b || !commit_quietly(b, kept_nbytes(b, size, small))) return 0;
    fl_remove(fl, b);
    ++st_.cache_hits;
    b = split(b, size, small, fl);
    if (size_out) *size_out = b->size;
    return hand_out(b, nbytes, stream);
}

// PythonEngine.allocate
std::uint64_t Engine::allocate(std::uint64_t nbytes, std::uint64_t stream) {
    if (nbytes == 0) throw EngineError(EngineErrorKind::kInvalidArgument, "nbytes must be positive, got 0");
    Guard guard(*this);
    if (plan_active()) {
        check_usable_op();
        return plan_allocate(nbytes, stream);
    }
    return allocate_engine(nbytes, stream);
}

// PythonEngine._allocate_engine: the engine's allocation, under the lock
// policy.round(nbytes), saturated at UINT64_MAX
std::uint64_t Engine::round_up_nbytes(std::uint64_t nbytes) const {
    const std::uint64_t r = cfg_.round_nbytes;
    return nbytes > UINT64_MAX - r ? UINT64_MAX : (nbytes + r - 1) & ~(r - 1);
}

std::uint64_t Engine::allocate_engine(std::uint64_t nbytes, std::uint64_t stream) {
    std::uint64_t size = round_up_nbytes(nbytes);
    bool small = size <= (UINT64_MAX >> 1) && static_cast<std::int64_t>(size) <= small_max_;
    // Note [The hot path makes no device call]
    if (!lost_ && !closed_) {
        FreeList* fl = free_list_get(small, stream);
        if (fl) {
            Block* b = fl_best_fit(fl, size);
            if (b && commit_quietly(b, kept_nbytes(b, size, small))) {
                fl_remove(fl, b);
                ++st_.cache_hits;
                return hand_out(split(b, size, small, fl), nbytes, stream);
            }
        }
    }
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kClosed, "allocator is closed");
    GPUMEM_OPERATION(return allocate_slow(nbytes, size, small, stream);)
}

void Engine::check_open() {
    Guard guard(*this, true);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kClosed, "allocator is closed");
}

// PythonEngine._never_fits: larger than the device or the limit, refused at once (and no leave: plan.py, Note [A
// plan that leaves early])
bool Engine::never_fits(std::uint64_t size) const {
    return size > total_nbytes_ || (cfg_.limit_nbytes && size > cfg_.limit_nbytes);
}

// PythonEngine._allocate_slow
std::uint64_t Engine::allocate_slow(std::uint64_t nbytes, std::uint64_t size, bool small, std::uint64_t stream) {
    std::uint64_t total = total_nbytes_;
    if (never_fits(size)) {
        // can never fit: refuse at once, without waiting for work or flushing the cache
        ++st_.num_ooms;
        std::uint64_t f, t;
        backend_.mem_info(&f, &t);
        throw oom_error(nbytes, size > total ? OomCause::kTooLarge : OomCause::kLimit, nullptr);
    }
    plan_check_warmup();   // Note [A memory-first warm-up] in plan.py
    FreeList* fl = free_list_make(small, stream);
    Block* b = fl_best_fit(fl, size);
    if (!b && !pending_.empty()) {
        process_pending(false);   // blocks whose other-stream uses are done, see Note [Streams]
        b = fl_best_fit(fl, size);
    }
    committed_ = false;
    if (b) {
        fl_remove(fl, b);
        ++st_.cache_hits;
    } else {
        b = grow(small, stream, size, fl, nbytes);
    }
    if (!committed_) {
        b = split(b, size, small, fl);
        bool retry = false;
        try {
            commit(b);
        } catch (...) {
            insert_free(b);   // _unsplit_after_failure: the block goes back, see the Note
            if (!classify_current().oom) throw;
            ++st_.num_alloc_retries;
            retry = true;
        }
        if (retry) b = retry_after_release(small, stream, size, fl, nbytes);
    }
    return hand_out(b, nbytes, stream);
}

// PythonEngine._hand_out
std::uint64_t Engine::hand_out(Block* b, std::uint64_t nbytes, std::uint64_t stream) {
    (void)stream;
    b->allocated = true;
    b->requested = nbytes;
    std::uint64_t addr = b->addr;
    live_.put(addr, b);
    count_alloc(b->size, nbytes);
    return addr;
}

// One allocation handed out, `size` bytes (rounded) for `nbytes` requested: the counters and their peaks
// (reserved counts the plan's mapped arena pages too). Caller holds mu_.
void Engine::count_alloc(std::uint64_t size, std::uint64_t nbytes) {
    EngineStats& st = st_;
    st.allocated_nbytes += size;
    st.requested_nbytes += nbytes;
    ++st.num_allocs;
    if (st.allocated_nbytes > st.peak_allocated_nbytes) st.peak_allocated_nbytes = st.allocated_nbytes;
    if (st.requested_nbytes > st.peak_requested_nbytes) st.peak_requested_nbytes = st.requested_nbytes;
    if (reserved_nbytes_ + plan_mapped_nbytes_ > st.peak_reserved_nbytes)
        st.peak_reserved_nbytes = reserved_nbytes_ + plan_mapped_nbytes_;
}

bool Engine::try_free_fast(std::uint64_t ptr) {
    Guard guard(*this);
    return fast_free_locked(ptr);
}

// try_free_fast under the lock
bool Engine::fast_free_locked(std::uint64_t ptr) {
    if (lost_) return false;
    if (plan_active()) return plan_free_fast(ptr);   // else free() runs the plan layer
    Block* b = static_cast<Block*>(live_.get(ptr));
    if (!b || b->pending_streams) return false;
    decommit(b);   // no device call: fences come when memory goes back
    free_booked(ptr, b);
    return true;
}

// PythonEngine.free
void Engine::free(std::uint64_t ptr) {
    Guard guard(*this);
    if (plan_active()) {
        check_usable_op();
        bool done = false;
        GPUMEM_OPERATION({ done = plan_free(ptr); })
        if (done) return;
        free_engine(ptr);
        plan_record_free(ptr);
        return;
    }
    free_engine(ptr);
}

// PythonEngine._free_engine, under the lock
void Engine::free_engine(std::uint64_t ptr) {
    if (!lost_) {
        Block* b = static_cast<Block*>(live_.get(ptr));
        if (b && !b->pending_streams) {
            decommit(b);
            free_booked(ptr, b);
            return;
        }
    }
    check_usable_op();
    GPUMEM_OPERATION({
        if (closed_) throw EngineError(EngineErrorKind::kClosed, "free of " + hex(ptr) + ": the allocator is closed");
        Block* b = static_cast<Block*>(live_.get(ptr));
        if (!b) {
            if (ptr == 0) throw EngineError(EngineErrorKind::kInvalidArgument, "ptr must be a positive address, got 0");
            if (freed_.get(ptr))
                throw EngineError(EngineErrorKind::kDoubleFree, "double free of " + hex(ptr) + " in the caching allocator");
            const std::pair<std::uint64_t, std::uint64_t>* released = plan_released_arena(ptr);
            bool in_range = false;
            for (auto& seg : vsegs_) in_range = in_range || (seg->base <= ptr && ptr - seg->base < seg->nbytes);
            in_range = in_range || in_some_segment(ptr);   // segment mode: the malloc'd segments
            if (released && !in_range)
                throw EngineError(EngineErrorKind::kInvalidPointer,
                                  "free of " + hex(ptr) + ", which lies in a step plan's arena (at " +
                                      hex(released->first) + ", " + std::to_string(released->second) +
                                      " B) given back when nothing in it was live: a double free? (Note [Frees into a "
                                      "given-back arena])");
            throw EngineError(EngineErrorKind::kInvalidPointer,
                              "free of " + hex(ptr) + ", which this allocator did not allocate" + inside_live(ptr));
        }
        if (b->pending_streams) {
            std::unique_ptr<FenceMap> f(new FenceMap());
            for (auto s : *b->pending_streams) f->emplace_back(s, fences_record(s));   // may raise: still live
            b->fences = std::move(f);
        } else {
            decommit(b);
        }
        free_booked(ptr, b);
    })
}

// PythonEngine._free_booked
void Engine::free_booked(std::uint64_t ptr, Block* b) {
    live_.erase(ptr);
    if (!freed_.get(ptr)) {
        freed_.put(ptr, reinterpret_cast<void*>(1));
        const std::size_t cap = freed_ring_.size();   // head + count <= 2 * cap - 1: no division
        std::size_t at = freed_head_ + freed_count_;
        freed_ring_[at >= cap ? at - cap : at] = ptr;
        ++freed_count_;
        if (freed_count_ > kFreedMemory) {
            freed_.erase(freed_ring_[freed_head_]);
            freed_head_ = freed_head_ + 1 == cap ? 0 : freed_head_ + 1;
            --freed_count_;
        }
    }
    st_.allocated_nbytes -= b->size;
    st_.requested_nbytes -= b->requested;
    ++st_.num_frees;
    b->allocated = false;
    if (b->fences) {
        // its pages stay committed until the other streams' events complete, see Note [Streams]
        pending_.push_back(b);
        return;
    }
    insert_free(b);
}

// PythonEngine._grow
Block* Engine::grow(bool small, std::uint64_t stream, std::uint64_t size, FreeList* fl, std::uint64_t nbytes) {
    ++st_.cache_misses;
    if (cfg_.gc_threshold > 0) {
        double cap = static_cast<double>(cfg_.limit_nbytes ? cfg_.limit_nbytes : total_nbytes_);
        if (static_cast<double>(reserved_nbytes_) > cfg_.gc_threshold * cap) {
            ++st_.num_gc_releases;
            release_cached_all(false);
        }
    }
    try {
        return grow_once(small, stream, size, fl);
    } catch (...) {
        if (!classify_current().oom) throw;
    }
    ++st_.num_alloc_retries;
    committed_ = true;   // the retry split and committed it: allocate() must not commit it again
    return retry_after_release(small, stream, size, fl, nbytes);
}

// PythonEngine._grow_once (virtual memory)
Block* Engine::grow_once(bool small, std::uint64_t stream, std::uint64_t size, FreeList* fl) {
    if (cfg_.segments) return grow_segment(small, stream, size);
    VSeg* vseg = range_of(small);
    Block* tail = vseg->last;
    if (tail && tail->stream == stream && !tail->allocated && !tail->fences && tail->in_list == fl) {
        extend(vseg, stream, size - tail->size, size);
        fl_remove(fl, tail);
        tail->size = size;
        return tail;
    }
    std::uint64_t addr = extend(vseg, stream, size, size);
    Block* b = new_block(addr, size, stream, vseg);
    append_block(vseg, b);
    return b;
}

// PythonEngine._release_cached
std::uint64_t Engine::release_cached_all(bool wait) {
    if (cfg_.segments) return segments_release_cached(wait);   // no range tops to lower
    std::uint64_t released = backing_release_cached(wait);
    for (auto& up : vsegs_) {
        VSeg* seg = up.get();
        for (;;) {
            Block* last = seg->last;
            if (!last || last->allocated || last->fences) break;
            if (!lower_top(seg, last->addr, last->stream, wait)) break;
            fl_remove(free_list_of(last), last);
            recycle_block(drop_last_block(seg));
        }
    }
    return released;
}

// PythonEngine._anything_to_wait_for
bool Engine::anything_to_wait_for() {
    if (!pending_.empty()) return true;
    if (cfg_.segments) {   // any(not seg.live for seg in backing.segments_list())
        for (auto& up : msegs_)
            if (!up->live) return true;
        return false;
    }
    if (!unmapped_.empty()) return true;
    for (auto& up : vsegs_) {
        Block* last = up->last;
        if (up->n_empty || (last && !last->allocated && !last->fences)) return true;
    }
    return false;
}

// PythonEngine._reown_idle
bool Engine::reown_idle(std::uint64_t stream, FreeList* fl) {
    bool pool = fl->small;
    bool moved = false;
    std::vector<FreeList*> lists;
    for (auto& up : fl_order_) lists.push_back(up.get());
    for (FreeList* other : lists) {
        if (other->small != pool || other->stream == stream || other->blocks.empty()) continue;
        std::uint64_t s = other->stream;
        std::uint64_t number = fences_record(s);
        if (!fences_done(s, number)) continue;   // that stream still has work queued
        begin_multi_stream();   // pages track their streams: before any block moves (it may throw)
        std::vector<Block*> blocks(other->blocks.begin(), other->blocks.end());
        for (Block* b : blocks) {
            fl_remove(other, b);
            b->stream = stream;
            insert_free(b);
        }
        moved = true;
    }
    if (moved) {
        release_cached_all(false);   // a merged free top can now be trimmed
    }
    return moved;
}

// PythonEngine._retry_after_release
Block* Engine::retry_after_release(bool small, std::uint64_t stream, std::uint64_t size, FreeList* fl,
                                   std::uint64_t nbytes) {
    // the engine's own cache first, then a step plan's arena (plan.py StepPlan.shrink: Note [Step plans under
    // memory pressure])
    for (int shrink = 0; shrink < 2; ++shrink) {
        if (shrink) plan_shrink();
        for (int w = 0; w < 2; ++w) {
            bool wait = w == 1;
            process_pending(wait);
            release_cached_all(wait);
            bool more = !wait && anything_to_wait_for();   // before this attempt adds its own free block
            Block* b = nullptr;
            Caught caught;
            try {
                b = fl_best_fit(fl, size);
                if (!b && !cfg_.segments && reown_idle(stream, fl)) b = fl_best_fit(fl, size);   // virtual memory only
                if (b) fl_remove(fl, b);
                else b = grow_once(small, stream, size, fl);
                b = split(b, size, small, fl);
                commit(b);
                return b;
            } catch (...) {
                if (b) insert_free(b);
                caught = classify_current();
                if (!caught.oom) throw;
            }
            if (!more && (shrink || !plan_holds_memory())) {
                ++st_.num_ooms;
                throw oom_error(nbytes, caught.cause, caught.exc);
            }
            if (!more) break;   // the plan's arena next
        }
    }
    throw EngineError(EngineErrorKind::kInternal, "unreachable");
}

// PythonEngine._kept_nbytes
std::uint64_t Engine::kept_nbytes(const Block* b, std::uint64_t size, bool small) const {
    std::uint64_t remaining = b->size - size;
    std::uint64_t min_rest = small ? cfg_.min_split_small_nbytes : cfg_.min_split_large_nbytes;
    return (remaining >= min_rest && remaining > 0) ? size : b->size;
}

// PythonEngine._split
Block* Engine::split(Block* b, std::uint64_t size, bool small, FreeList* fl) {
    std::uint64_t remaining = b->size - size;
    std::uint64_t min_rest = small ? cfg_.min_split_small_nbytes : cfg_.min_split_large_nbytes;
    if (remaining >= min_rest && remaining > 0) {
        fl_add(fl, split_block(b, size));
        ++st_.num_splits;
    }
    return b;
}

// PythonEngine._insert_free
void Engine::insert_free(Block* b) {
    FreeList* fl = free_list_of(b);
    Block* prev = b->prev;
    if (prev && !prev->allocated && !prev->fences && prev->in_list == fl) {
        fl_remove(fl, prev);
        b = merge_blocks(prev, b);
    }
    Block* nxt = b->next;
    if (nxt && !nxt->allocated && !nxt->fences && nxt->in_list == fl) {
        fl_remove(fl, nxt);
        merge_blocks(b, nxt);
    }
    fl_add(fl, b);
}

// PythonEngine._process_pending
std::uint64_t Engine::process_pending(bool wait) {
    std::uint64_t done = 0;
    std::vector<Block*> pending;
    pending.swap(pending_);
    std::vector<Block*> remaining;
    std::size_t i = 0;
    std::unordered_map<std::uint64_t, std::uint64_t> blocked;
    try {
        for (i = 0; i < pending.size(); ++i) {
            Block* block = pending[i];
            bool ready = true;
            for (auto& sn : *block->fences) {
                auto bit = blocked.find(sn.first);
                if (bit != blocked.end() && sn.second >= bit->second) {
                    ready = false;
                    break;
                }
                if (!fences_done(sn.first, sn.second)) {
                    blocked[sn.first] = bit == blocked.end() ? sn.second : std::min(bit->second, sn.second);
                    ready = false;
                    break;
                }
            }
            if (!ready) {
                if (!wait) {
                    remaining.push_back(block);
                    continue;
                }
                fences_wait_all(block->fences.get());
            }
            decommit(block);
            block->fences.reset();
            block->pending_streams.reset();
            insert_free(block);
            ++done;
        }
    } catch (...) {
        remaining.insert(remaining.end(), pending.begin() + static_cast<std::ptrdiff_t>(i), pending.end());
        remaining.insert(remaining.end(), pending_.begin(), pending_.end());
        pending_.swap(remaining);
        throw;
    }
    remaining.insert(remaining.end(), pending_.begin(), pending_.end());
    pending_.swap(remaining);
    return done;
}

// PythonEngine._oom_error (the numbers; the binding writes the message and the hint)
EngineError Engine::oom_error(std::uint64_t nbytes, OomCause cause, void* cause_exc) {
    OomInfo info = device_oom_info(cause, nbytes);
    const std::uint64_t reserved = reserved_nbytes_ + plan_mapped_nbytes_;   // a step plan's arena counts
    info.allocated_nbytes = st_.allocated_nbytes;
    info.cached_signed = static_cast<std::int64_t>(reserved) - static_cast<std::int64_t>(st_.allocated_nbytes);
    info.cached_nbytes = reserved - st_.allocated_nbytes;
    info.reserved_nbytes = reserved;
    info.limit_nbytes = cfg_.limit_nbytes;
    info.va_nbytes = va_nbytes_;
    info.segment_mode = cfg_.segments;   // the binding adds segment_mode_vmm (the device's vmm_supported, now)
    info.plan_mapped_nbytes = plan_mapped_nbytes_;
    for (auto& a : arenas_)
        if (a->dropped) info.plan_dropped_nbytes += a->mapped_nbytes;
    info.plan_live_nbytes = plan_live_nbytes();
    info.cause_py_exc = cause_exc;
    return EngineError(info, "out of memory: tried to allocate " + std::to_string(nbytes) + " bytes; the device has " +
                                 std::to_string(info.free_nbytes) + " bytes free of " + std::to_string(info.total_nbytes));
}

// PythonEngine._inside_live
std::string Engine::inside_live(std::uint64_t ptr) const {
    std::string out;
    live_.for_each([&](std::uint64_t addr, void* v) {
        const Block* b = static_cast<const Block*>(v);
        if (out.empty() && b->addr < ptr && ptr < b->addr + b->size)
            out = "; it is inside the live block at " + hex(b->addr) + " (+" + hex(ptr - b->addr) + "): free that pointer";
        (void)addr;
    });
    return out;
}

// PythonEngine.record_stream
void Engine::record_stream(std::uint64_t ptr, std::uint64_t stream) {
    Guard guard(*this);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kClosed, "record_stream of " + hex(ptr) + ": the allocator is closed");
    if (!arenas_.empty() && plan_record_stream(ptr, stream)) return;
    Block* b = static_cast<Block*>(live_.get(ptr));
    if (!b)
        throw EngineError(EngineErrorKind::kInvalidPointer,
                          "record_stream: " + hex(ptr) + " is not a live allocation" + inside_live(ptr));
    if (stream != b->stream) {
        if (!b->pending_streams) b->pending_streams.reset(new std::vector<std::uint64_t>());
        auto& v = *b->pending_streams;
        auto it = std::lower_bound(v.begin(), v.end(), stream);
        if (it == v.end() || *it != stream) v.insert(it, stream);
        plan_record_cross_stream(ptr);   // a recorded step that crosses streams is not planned
    }
}

// PythonEngine.synchronize
void Engine::synchronize() {
    Guard guard(*this);
    check_usable_op();
    GPUMEM_OPERATION({
        backend_.synchronize();
        process_pending(true);
    })
}

// PythonEngine.empty_cache
std::uint64_t Engine::empty_cache() {
    Guard guard(*this);
    check_usable_op();
    std::uint64_t released = empty_cache_locked();
    // the step plans' arena runs no live allocation touches (plan.py give_back_idle, Note [When marks stop])
    if (!closed_) GPUMEM_OPERATION({ released += plan_give_back_idle(); })
    return released;
}

std::uint64_t Engine::empty_cache_locked() {
    GPUMEM_OPERATION({
        if (closed_) return 0;
        std::uint64_t f, t;
        backend_.mem_info(&f, &t);   // a lost device is noticed here, even with nothing cached
        process_pending(true);
        std::uint64_t released = release_cached_all(true);
        for (auto it = fl_order_.begin(); it != fl_order_.end();) {
            if ((*it)->blocks.empty()) {   // idle streams cost nothing once their cache is gone
                fl_index_[(*it)->small ? 1 : 0].erase((*it)->stream);
                fl_last_[0] = fl_last_[1] = nullptr;
                it = fl_order_.erase(it);
            } else {
                ++it;
            }
        }
        fences_forget_idle();   // nor their events and fence entries
        return released;
    })
}

// PythonEngine._streams_in_use (sorted)
std::vector<std::uint64_t> Engine::streams_in_use() {
    std::set<std::uint64_t> streams{0};
    for (auto& fl : fl_order_) streams.insert(fl->stream);
    auto add_block = [&](const Block* b) {
        streams.insert(b->stream);
        if (b->pending_streams) streams.insert(b->pending_streams->begin(), b->pending_streams->end());
        if (b->fences)
            for (auto& sn : *b->fences) streams.insert(sn.first);
    };
    live_.for_each([&](std::uint64_t, void* v) { add_block(static_cast<const Block*>(v)); });
    for (Block* b : pending_) add_block(b);
    for (auto& up : vsegs_) {
        for (const Block* b = up->last; b; b = b->prev) add_block(b);
        up->dirty.each_stream([&](std::uint64_t s) { streams.insert(s); });
        up->users.each_stream([&](std::uint64_t s) { streams.insert(s); });
        for (auto& kv : up->page_fences)
            for (auto& sn : kv.second) streams.insert(sn.first);
        if (up->top_fences)
            for (auto& sn : *up->top_fences) streams.insert(sn.first);
    }
    for (auto& up : msegs_) segment_streams(up.get(), streams);
    for (auto& q : fq_order_) streams.insert(q.stream);
    return std::vector<std::uint64_t>(streams.begin(), streams.end());
}

// PythonEngine.close
void Engine::close() {
    Guard guard(*this);
    if (closed_) return;
    closed_ = true;
    std::vector<std::uint64_t> failed;
    if (reserved_nbytes_ || n_segments_) {
        for (auto s : streams_in_use()) {
            try {
                backend_.stream_synchronize(s);
            } catch (...) {   // that stream's memory is kept, below
                rethrow_if_fatal();   // Note [Only Exception is caught]
                failed.push_back(s);
            }
        }
        if (!failed.empty()) {
            try {
                backend_.synchronize();
                failed.clear();
            } catch (...) {
                rethrow_if_fatal();   // Note [Only Exception is caught]
            }
        }
    }
    try {
        plan_close();
    } catch (...) {   // the arena's pages stay counted as leaked
        rethrow_if_fatal();   // Note [Only Exception is caught]
    }
    // a range is shared by all streams: any of them may still use it
    if (cfg_.segments) segments_close(failed);
    else backing_close(!failed.empty());
    fences_close();
    live_.clear();
    pending_.clear();
    fl_index_[0].clear();
    fl_index_[1].clear();
    fl_last_[0] = fl_last_[1] = nullptr;
    fl_order_.clear();
    st_.allocated_nbytes = st_.requested_nbytes = 0;   // live blocks are invalid from here (PythonEngine.close)
    leaked_nbytes_ = reserved_nbytes_ + plan_mapped_nbytes_;
}

// -- introspection --------------------------------------------------------------------------------------
EngineStats Engine::stats() {
    Guard guard(*this, true);
    EngineStats st = st_;
    st.reserved_nbytes = reserved_nbytes_ + plan_mapped_nbytes_;
    st.num_segments = n_segments_;
    std::uint64_t pend = 0;
    for (Block* b : pending_) pend += b->size;
    st.active_nbytes = st.allocated_nbytes + pend;
    std::int64_t total_free = static_cast<std::int64_t>(st.reserved_nbytes) - static_cast<std::int64_t>(st.allocated_nbytes);
    std::int64_t inactive = total_free - static_cast<std::int64_t>(mapped_empty_nbytes())
                            - static_cast<std::int64_t>(unmapped_nbytes());
    st.inactive_split_nbytes = inactive > 0 ? static_cast<std::uint64_t>(inactive) : 0;
    st.num_live_blocks = live_.size();
    for (auto& a : arenas_) st.num_live_blocks += a->live.size();   // plan.py live_count: every arena's, dropped ones' too
    std::uint64_t nfree = 0;
    for (auto& fl : fl_order_) nfree += fl->blocks.size();
    st.num_free_blocks = nfree;
    std::uint64_t largest = backing_largest_free_nbytes();
    std::uint64_t cap = total_free > 0 ? static_cast<std::uint64_t>(total_free) : 0;
    st.largest_free_nbytes = std::min(largest, cap);
    if (cfg_.segments) {   // segment mode: the free lists' bytes; Backing.largest_free_nbytes (the largest free block)
        std::uint64_t in_lists = 0, largest_block = 0;
        for (auto& fl : fl_order_) {
            in_lists += fl->nbytes;
            if (!fl->blocks.empty()) largest_block = std::max(largest_block, (*fl->blocks.rbegin())->size);
        }
        st.inactive_split_nbytes = in_lists;
        st.largest_free_nbytes = std::min(largest_block, cap);
    }
    st.device_calls = device_calls_ + plan_arena_calls_;
    st.event_calls = n_records_ + n_queries_ + f_n_waits_ + n_destroys_ + n_stream_waits_;
    const std::uint64_t plan_live = plan_live_nbytes();
    st.plan_free_nbytes = plan_mapped_nbytes_ > plan_live ? plan_mapped_nbytes_ - plan_live : 0;
    st.n_chunks = n_chunks_;
    st.n_steals = n_steals_;
    st.n_waits = n_waits_;
    st.n_ranges = vsegs_.size();
    st.va_nbytes = va_nbytes_;
    st.granularity_nbytes = g_;
    st.leaked_nbytes = leaked_nbytes_;
    return st;
}

void Engine::set_limit_nbytes(std::uint64_t nbytes) {
    Guard guard(*this);
    cfg_.limit_nbytes = nbytes;
}

std::uint64_t Engine::limit_nbytes() {
    Guard guard(*this, true);
    return cfg_.limit_nbytes;
}

void Engine::reset_peak_stats() {
    Guard guard(*this);
    st_.peak_allocated_nbytes = st_.allocated_nbytes;
    st_.peak_requested_nbytes = st_.requested_nbytes;
    st_.peak_reserved_nbytes = reserved_nbytes_ + plan_mapped_nbytes_;   // a step plan's arena counts
}

std::uint64_t Engine::reserved_nbytes() {
    Guard guard(*this, true);
    return reserved_nbytes_ + plan_mapped_nbytes_;
}

std::uint64_t Engine::allocated_nbytes() {
    Guard guard(*this, true);
    return st_.allocated_nbytes;
}

// PythonEngine.releasable_nbytes: SegmentBacking.releasable_nbytes and VirtualBacking.releasable_nbytes (Note
// [The room counts whole chunks] in plan.py): free segments; cached chunks and mapped chunks no live block
// touches, counted once each, less those still mapped where stolen from. With `with_carried`, a page touched only
// by the READY step's carried blocks (PythonEngine._carried_blocks) counts as empty.
std::uint64_t Engine::releasable_nbytes(bool with_carried) {
    Guard guard(*this);
    check_usable_op();
    if (closed_) return 0;
    // blocks freed while other streams used them go back with the cache too (it waits for those uses)
    std::vector<Block*> carried(pending_.begin(), pending_.end());
    if (with_carried && plan_state_ == kPlanReady)
        for (const auto& kv : rec_cur_map_) {   // the step just ended; its slots' lifetimes are the template's
            if (kv.second >= rec_prev_.size()) continue;   // not at READY, where the two steps have one length
            const StepRecord& r = rec_prev_[kv.second];
            if (r.free_own >= 0 || r.free_next != 0) continue;   // freed before the next step allocates: room
            if (Block* b = static_cast<Block*>(live_.get(kv.first))) carried.push_back(b);
        }
    std::uint64_t nbytes = 0;
    if (cfg_.segments) {
        std::unordered_map<const VSeg*, std::uint64_t> gone;
        for (Block* b : carried) ++gone[b->seg];
        for (auto& up : msegs_) {
            auto it = gone.find(up.get());
            if (up->live == (it == gone.end() ? 0 : it->second)) nbytes += up->nbytes;
        }
        return nbytes;
    }
    std::unordered_map<const VSeg*, std::unordered_map<std::int64_t, std::int64_t>> gone;
    for (Block* b : carried) {
        const VSeg* seg = b->seg;
        auto& pages = gone[seg];
        const auto first = static_cast<std::int64_t>((b->addr - seg->base) / seg->page_nbytes);
        const auto last = static_cast<std::int64_t>((b->addr + b->size - 1 - seg->base) / seg->page_nbytes);
        for (std::int64_t q = first; q <= last; ++q) ++pages[q];
    }
    for (ChunkHandle h : unmapped_) nbytes += chunk_nbytes(h);
    std::vector<std::int64_t> pages;
    std::unordered_set<ChunkHandle> seen;
    static const std::unordered_map<std::int64_t, std::int64_t> kNone;
    for (auto& up : vsegs_) {
        VSeg* seg = up.get();
        auto git = gone.find(seg);
        const auto& freed = git == gone.end() ? kNone : git->second;
        seg->empty_list(pages);
        for (const auto& kv : freed) pages.push_back(kv.first);
        for (auto p : pages) {
            const ChunkHandle h = seg->chunks[p];
            if (!h || !seen.insert(h).second) continue;   // no chunk, or counted
            const std::int64_t first = chunk_start(seg, p);
            const auto n = static_cast<std::int64_t>(seg->chunk_nbytes[p] / seg->page_nbytes);
            bool idle = true;
            for (std::int64_t q = first; q < first + n && idle; ++q) {
                if (seg->is_empty(q)) continue;
                auto f = freed.find(q);
                idle = f != freed.end() && seg->refs[q] == f->second;
            }
            if (idle && (deferred_.empty() || !has_deferred(h))) nbytes += seg->chunk_nbytes[p];
        }
    }
    return nbytes;
}

std::uint64_t Engine::block_size(std::uint64_t ptr) {
    Guard guard(*this, true);
    if (!arenas_.empty()) {
        PlanLive e{};
        if (plan_arena_entry(ptr, &e)) return e.size;
    }
    Block* b = static_cast<Block*>(live_.get(ptr));
    if (!b) throw EngineError(EngineErrorKind::kInvalidPointer, hex(ptr) + " is not a live allocation");
    return b->size;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> Engine::live_blocks() {
    Guard guard(*this, true);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    live_.for_each([&](std::uint64_t addr, void* v) { out.emplace_back(addr, static_cast<Block*>(v)->size); });
    for (auto& a : arenas_)   // the step plan's arenas' live allocations too (plan.py: review attacker 12, F4)
        for (auto& kv : a->live) out.emplace_back(kv.first, kv.second.size);
    std::sort(out.begin(), out.end());
    return out;
}

bool Engine::closed() {
    Guard guard(*this, true);
    return closed_;
}

bool Engine::lost() {
    Guard guard(*this, true);
    return lost_;
}

std::string Engine::describe() {
    Guard guard(*this, true);
    if (cfg_.segments) {   // SegmentBacking.describe
        static const char* const rules[] = {"granular", "pytorch", "exact"};
        return "segments (" + std::to_string(n_segments_) + " live, rule=" +
               rules[static_cast<int>(cfg_.segment_rule)] + ")";
    }
    return "virtual memory (" + std::to_string(vsegs_.size()) + " range(s) of " + std::to_string(va_nbytes_ >> 30) +
           " GiB shared by all streams, " + std::to_string(n_chunks_) + " chunks (growth=" +
           (chunked_ ? "chunks" : "pages") + ") over " + std::to_string(reserved_nbytes_ >> 20) + " MiB, " +
           std::to_string(n_steals_) + " steals)";
}

// PythonEngine.check_consistency + VirtualBacking.consistency_problems + _chain_problems
std::vector<std::string> Engine::consistency_problems(const ListDevice& list_device) {
    Guard guard(*this, true);
    check_usable_op();
    std::vector<std::string> problems;
    if (closed_) return problems;
    DeviceMaps maps;
    Reservations res;
    bool have_res = false;
    GPUMEM_OPERATION({
        std::uint64_t f, t;
        backend_.mem_info(&f, &t);   // a lost device raises (BackendError kDeviceLost), remembered
        // read under the lock: no other thread's operation changes the mappings meanwhile
        if (list_device) have_res = list_device(maps, res);
    })
    const DeviceMaps* device_maps = list_device ? &maps : nullptr;
    const Reservations* reservations = have_res ? &res : nullptr;
    if (cfg_.segments) {   // the second listing is the device's allocations (NativeEngine.consistency_problems)
        segments_consistency_problems(reservations, problems);
        return problems;
    }
    std::uint64_t mapped = 0, mapped_nbytes = 0;
    std::int64_t live_pages = 0;
    for (auto& up : vsegs_) {
        VSeg* seg = up.get();
        if (reservations) {
            bool found = false;
            for (auto& r : *reservations)
                if (r.first == seg->base && r.second == seg->nbytes) found = true;
            if (!found) problems.push_back("range " + hex(seg->base) + " is not a device reservation of that size");
        }
        std::size_t deferred_pages = 0;
        for (auto& e : deferred_) {
            if (e.seg != seg) continue;
            std::int64_t n = seg_chunk_pages(seg, e.h);
            deferred_pages += static_cast<std::size_t>(n);
            for (std::int64_t q = e.s; q < e.s + n; ++q)
                if (!seg->deferred[q] || seg->chunks[q]) {
                    problems.push_back("the pages of the old mapping at " + hex(seg->page_va(e.s)) +
                                       " are not marked deferred and unmapped");
                    break;
                }
        }
        if (deferred_pages != seg->n_deferred)
            problems.push_back(std::to_string(seg->n_deferred) + " pages of " + hex(seg->base) +
                               " are marked deferred, not those of its old mappings");
        if (device_maps) {
            std::unordered_map<std::uint64_t, ChunkHandle> ours;
            std::unordered_map<std::uint64_t, ChunkHandle> old;   // old mappings of stream-ordered steals
            for (auto& e : deferred_)
                if (e.seg == seg) old[seg->page_va(e.s)] = e.h;
            for (std::int64_t p = 0; p < seg->n_pages; ++p)
                if (seg->chunks[p] && !(p && seg->chunks[p - 1] == seg->chunks[p]))
                    ours[seg->page_va(p)] = seg->chunks[p];
            for (auto& m : *device_maps) {
                std::uint64_t va = std::get<0>(m);
                if (va < seg->base || va >= seg->base + seg->nbytes) continue;
                auto od = old.find(va);
                if (od != old.end()) {
                    if (std::get<1>(m) != chunk_nbytes(od->second) || od->second != std::get<2>(m))
                        problems.push_back("the chunk stolen stream-ordered from " + hex(va) + " is not mapped there any more");
                    old.erase(od);
                    continue;
                }
                auto it = ours.find(va);
                if (it == ours.end() || std::get<1>(m) != chunk_nbytes(it->second) || it->second != std::get<2>(m)) {
                    problems.push_back("device maps " + hex(va) + " differently from the allocator");
                } else {
                    ++mapped;
                    mapped_nbytes += std::get<1>(m);
                }
                if (it != ours.end()) ours.erase(it);
            }
            for (auto& kv : ours) problems.push_back("the allocator has page " + hex(kv.first) + " mapped, the device does not");
            for (auto& kv : old)
                problems.push_back("the chunk stolen stream-ordered from " + hex(kv.first) + " is not mapped there any more");
        } else {
            for (std::int64_t p = 0; p < seg->n_pages; ++p)
                if (seg->chunks[p] && !(p && seg->chunks[p - 1] == seg->chunks[p])) {
                    ++mapped;
                    mapped_nbytes += chunk_nbytes(seg->chunks[p]);
                }
        }
        // every chunk lies on exactly its pages, contiguous (Note [Chunks of several pages])
        for (std::int64_t p = 0; p < seg->n_pages; ++p) {
            ChunkHandle h = seg->chunks[p];
            if (!h || (p && seg->chunks[p - 1] == h)) continue;
            std::int64_t n = seg_chunk_pages(seg, h);
            bool exact = p + n <= seg->n_pages && (p + n == seg->n_pages || seg->chunks[p + n] != h);
            for (std::int64_t q = p; q < p + n && exact; ++q) exact = seg->chunks[q] == h;
            if (!exact)
                problems.push_back("chunk at page " + std::to_string(p) + " of " + hex(seg->base) +
                                   " is not on exactly its " + std::to_string(n) + " pages");
            bool at_hand = true;   // Note [The chunk of a page at hand]
            for (std::int64_t q = p; q < seg->n_pages && seg->chunks[q] == h && at_hand; ++q)
                at_hand = seg->chunk_first[q] == p && seg->chunk_nbytes[q] == chunk_nbytes(h);
            if (!at_hand)
                problems.push_back("chunk at page " + std::to_string(p) + " of " + hex(seg->base) +
                                   " has pages that name another first page or size");
        }
        for (std::int64_t p = 0; p < seg->n_pages; ++p) {
            std::int64_t r = seg->refs[p];
            if (r < 0) problems.push_back("page " + std::to_string(p) + " of " + hex(seg->base) + " has negative live blocks");
            else if (r) {
                ++live_pages;
                if (!seg->chunks[p]) problems.push_back("page " + std::to_string(p) + " of " + hex(seg->base) + " holds live data but is not mapped");
            } else if (seg->chunks[p] && !seg->is_empty(p)) {
                problems.push_back("page " + std::to_string(p) + " of " + hex(seg->base) + " is mapped, empty and not stealable");
            }
        }
        // _chain_problems
        const Block* head = seg->last;
        while (head && head->prev) head = head->prev;
        std::uint64_t cursor = seg->base;
        const Block* prev = nullptr;
        for (const Block* b = head; b; b = b->next) {
            if (b->prev != prev || b->addr != cursor || b->size == 0 || b->seg != seg) {
                problems.push_back("block chain broken at " + hex(b->addr) + " (expected " + hex(cursor) + ")");
                break;
            }
            if (!b->allocated && !b->fences && !b->pending_streams) {
                if (b->in_list != free_list_get(seg->small && cfg_.separate_small_pool, b->stream))
                    problems.push_back("free block " + hex(b->addr) + " is in no free list");
            }
            cursor = b->addr + b->size;
            prev = b;
        }
        if (cursor != seg->base + seg->top)
            problems.push_back("blocks of segment " + hex(seg->base) + " end at " + hex(cursor) + ", expected " +
                               hex(seg->base + seg->top));
    }
    if (live_pages != live_pages_)
        problems.push_back(std::to_string(live_pages) + " pages hold live data, live_pages is " + std::to_string(live_pages_));
    if (chunked_) idle_index_problems(problems);
    if (mapped + unmapped_.size() != n_chunks_ || mapped_nbytes + unmapped_nbytes() != reserved_nbytes_)
        problems.push_back(std::to_string(mapped) + " mapped + " + std::to_string(unmapped_.size()) +
                           " unmapped chunks, n_chunks " + std::to_string(n_chunks_) + ", reserved " +
                           std::to_string(reserved_nbytes_) + " B");
    for (auto& fl : fl_order_)
        for (const Block* b : fl->blocks)
            if (b->allocated || b->stream != fl->stream || b->fences)
                problems.push_back("block " + hex(b->addr) + " is in the free list of stream " + std::to_string(fl->stream) +
                                   " but is not free there");
    std::uint64_t live_nbytes = plan_live_nbytes();
    live_.for_each([&](std::uint64_t addr, void* v) {
        const Block* b = static_cast<const Block*>(v);
        live_nbytes += b->size;
        if (!b->allocated || b->addr != addr) problems.push_back("live block " + hex(addr) + " is not marked allocated");
    });
    if (live_nbytes != st_.allocated_nbytes)
        problems.push_back("live blocks hold " + std::to_string(live_nbytes) + " B, allocated_nbytes is " +
                           std::to_string(st_.allocated_nbytes));
    for (const Block* b : pending_)
        if (b->allocated || !b->fences || b->fences->empty())
            problems.push_back("pending block " + hex(b->addr) + " has no fences or is allocated");
    if (st_.allocated_nbytes > reserved_nbytes_ + plan_mapped_nbytes_)
        problems.push_back("reserved " + std::to_string(reserved_nbytes_ + plan_mapped_nbytes_) + " B < allocated " +
                           std::to_string(st_.allocated_nbytes) + " B");
    return problems;
}


// -- plan.py: StepPlan (Note [Step plans] in gpumem/allocator/plan.py) ------------------------------------
// The plan layer in front of the engine; every function mirrors the Python method of the same name and
// runs under the engine's lock.
namespace {
constexpr int kMissLimit = 3;         // plan.py MISS_LIMIT
constexpr int kMissWindow = 8;        // plan.py MISS_WINDOW
constexpr int kMissWindowLimit = 4;   // plan.py MISS_WINDOW_LIMIT
constexpr std::uint64_t kArenaVaFactor = 2;   // plan.py ARENA_VA_FACTOR
constexpr std::uint64_t kOverrunFactor = 4;   // plan.py OVERRUN_FACTOR
constexpr std::uint64_t kEarlyDrops = 3;   // plan.py EARLY_DROPS
constexpr std::uint64_t kWarmupMarks = 8;   // plan.py WARMUP_MARKS
constexpr std::uint64_t kWarmupAllocs = std::uint64_t{1} << 14;   // plan.py WARMUP_ALLOCS

// plan.py _Ranges over a std::map: disjoint ranges [start, end) with a slot each (install's sweep)
struct Ranges {
    std::map<std::uint64_t, std::pair<std::uint64_t, std::size_t>> at;   // start -> (end, slot)
    // the slot of the range meeting [lo, hi), or -1: only the one starting last below hi can
    std::int64_t meeting(std::uint64_t lo, std::uint64_t hi) const {
        auto it = at.lower_bound(hi);
        if (it == at.begin()) return -1;
        --it;
        return it->second.first > lo ? static_cast<std::int64_t>(it->second.second) : -1;
    }
};

// plan.py _check_slots: a sweep over the step's ranks; two slots alive together that overlap raise
void check_slots(const std::vector<std::pair<std::int64_t, std::size_t>>& planned,
                 const std::vector<std::uint64_t>& sizes, const std::vector<std::int64_t>& e1,
                 const std::vector<std::int64_t>& e2) {
    struct Event {
        std::int64_t t;
        int starts;
        std::size_t k;
        bool operator<(const Event& o) const {
            return t != o.t ? t < o.t : starts != o.starts ? starts < o.starts : k < o.k;
        }
    };
    std::vector<Event> events;
    events.reserve(planned.size() * 2);
    std::vector<std::uint64_t> offs(sizes.size(), 0);
    for (auto& ok : planned) {
        const std::size_t k = ok.second;
        offs[k] = static_cast<std::uint64_t>(ok.first);
        events.push_back(Event{static_cast<std::int64_t>(k), 1, k});
        events.push_back(Event{e1[k], 0, k});
        if (e2[k]) {
            events.push_back(Event{0, 1, k});
            events.push_back(Event{e2[k], 0, k});
        }
    }
    std::sort(events.begin(), events.end());
    Ranges alive;
    for (const Event& ev : events) {
        const std::uint64_t o = offs[ev.k];
        if (!ev.starts) {
            alive.at.erase(o);
            continue;
        }
        const std::int64_t j = alive.meeting(o, o + sizes[ev.k]);
        if (j >= 0) {
            const std::size_t a = std::min(static_cast<std::size_t>(j), ev.k), b = std::max(static_cast<std::size_t>(j), ev.k);
            throw EngineError(EngineErrorKind::kInvalidArgument, "install_plan: slots " + std::to_string(a) + " and " +
                                                                     std::to_string(b) +
                                                                     " are alive together and overlap in the arena");
        }
        alive.at.emplace(o, std::make_pair(o + sizes[ev.k], ev.k));
    }
}

// plan.py _refused_slots: whether each slot's range meets a slot of another stream; `planned` sorted
std::vector<char> refused_slots(const std::vector<std::pair<std::int64_t, std::size_t>>& planned,
                                const std::vector<std::uint64_t>& sizes, const std::vector<std::uint64_t>& streams) {
    std::vector<char> refused(sizes.size(), 0);
    const std::size_t m = planned.size();
    std::vector<std::uint64_t> starts(m), st(m);
    for (std::size_t i = 0; i < m; ++i) {
        starts[i] = static_cast<std::uint64_t>(planned[i].first);
        st[i] = streams[planned[i].second];
    }
    bool have_best = false;
    std::uint64_t best_stream = 0;
    std::int64_t best_end = -1, other_end = -1;   // the largest end so far, its stream; the largest of others
    for (std::size_t i = 0; i < m; ++i) {
        const std::size_t k = planned[i].second;
        const std::int64_t o = planned[i].first, end = o + static_cast<std::int64_t>(sizes[k]);
        if ((have_best && best_stream != st[i] ? best_end : other_end) > o) refused[k] = 1;
        if (have_best && st[i] == best_stream) {
            best_end = std::max(best_end, end);
        } else if (end > best_end) {
            other_end = best_end;
            best_end = end;
            best_stream = st[i];
            have_best = true;
        } else {
            other_end = std::max(other_end, end);
        }
    }
    std::vector<std::size_t> next_other(m, m);   // the first position after i whose stream is not st[i]
    for (std::size_t i = m; i-- > 1;) next_other[i - 1] = st[i] != st[i - 1] ? i : next_other[i];
    for (std::size_t i = 0; i < m; ++i) {
        const std::size_t k = planned[i].second;
        const std::size_t hi = static_cast<std::size_t>(
            std::lower_bound(starts.begin(), starts.end(), starts[i] + sizes[k]) - starts.begin());
        if (next_other[i] < hi) refused[k] = 1;
    }
    return refused;
}
}  // namespace

void Engine::plan_reset_recording() {
    // swapped with empty ones, not cleared: an abandoned recording's memory goes back (Note [When marks stop])
    std::vector<StepRecord>().swap(rec_cur_);
    std::vector<StepRecord>().swap(rec_prev_);
    std::unordered_map<std::uint64_t, std::size_t>().swap(rec_cur_map_);
    std::unordered_map<std::uint64_t, std::size_t>().swap(rec_prev_map_);
    rec_cur_cross_ = rec_prev_cross_ = false;
    since_mark_ = 0;
}

void Engine::plan_clear_slots() {
    slot_off_.clear();
    slot_size_.clear();
    slot_stream_.clear();
    occ_start_.clear();
    occ_slot_.clear();
    slot_pos_.clear();
    occ_tree_.clear();
    slot_poisoned_.clear();
    slot_served_in_.clear();
    slot_e1_.clear();
    slot_e2_.clear();
    blocked_nbytes_ = 0;
    moved_at_ = -1;
    cursor_ = 0;
    left_ = missed_ = plan_broken_ = false;
    miss_bits_ = 0;
    planned_steps_ = 0;
}

void Engine::plan_slide() {
    rec_prev_.swap(rec_cur_);
    rec_prev_map_.swap(rec_cur_map_);
    rec_cur_.clear();
    rec_cur_map_.clear();
    rec_prev_cross_ = rec_cur_cross_;
    rec_cur_cross_ = false;
}

int Engine::mark_step() {
    Guard guard(*this);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kInvalidArgument, "mark_step: the allocator is closed");
    GPUMEM_OPERATION({
        const int result = plan_mark();
        // plan.py StepPlan.mark: give back every dropped arena with nothing live (a drop's, or a failed one's)
        // and the runs of the others that nothing live touches
        plan_give_back_dropped();
        return result;
    })
}

// StepPlan.start_warmup .. check_warmup (Note [A memory-first warm-up] in plan.py)
bool Engine::plan_start_warmup() {
    plan_check_warmup();
    if (!warmup_ && !warmup_done_ && plan_state_ != kPlanPlanned && cfg_.plan_warmup && cfg_.steal_empty_pages &&
        chunked_ && !cfg_.segments) {
        warmup_ = true;
        warmup_marks_ = 0;
        warmup_since_ = st_.num_allocs;
    }
    return warmup_;
}

void Engine::plan_end_warmup(bool planned) {
    if (warmup_) {
        warmup_ = false;
        warmup_done_ = true;
        if (cfg_.steal_after_warmup) after_warmup_ = true;   // StepPlan.end_warmup
        if (!planned && cfg_.warmup_give_back) empty_cache_locked();   // Note [A memory-first warm-up] in plan.py
    }
}

void Engine::plan_check_warmup() {
    if (warmup_ && st_.num_allocs - warmup_since_ >= kWarmupAllocs) plan_end_warmup(false);
}

bool Engine::start_plan_warmup() {
    Guard guard(*this);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kInvalidArgument, "start_plan_warmup: the allocator is closed");
    return plan_start_warmup();
}

bool Engine::stop_plan_warmup() {   // StepPlan.stop_warmup
    Guard guard(*this);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kInvalidArgument, "stop_plan_warmup: the allocator is closed");
    plan_check_warmup();   // one past kWarmupAllocs has ended: none begins again (StepPlan.stop_warmup)
    if (!warmup_) return false;
    warmup_ = false;
    empty_cache_locked();
    return true;
}

int Engine::plan_mark() {
    if (plan_start_warmup()) {   // the first mark begins it; each counts
        ++warmup_marks_;
        warmup_since_ = st_.num_allocs;
        if (warmup_marks_ >= kWarmupMarks) plan_end_warmup(false);
    }
    {
        int s = plan_state_;
        if (s == kPlanOff || s == kPlanReady) {
            plan_reset_recording();
            plan_state_ = kPlanRecording;
            return 0;
        }
        if (s == kPlanRecording) {
            plan_slide();
            plan_state_ = kPlanRecordingNext;
            return 0;
        }
        if (s == kPlanRecordingNext) {
            bool same = !rec_prev_.empty() && !rec_prev_cross_ && !rec_cur_cross_ && rec_prev_.size() == rec_cur_.size();
            for (std::size_t i = 0; same && i < rec_prev_.size(); ++i)
                same = rec_prev_[i].nbytes == rec_cur_[i].nbytes && rec_prev_[i].stream == rec_cur_[i].stream;
            if (same) {
                plan_state_ = kPlanReady;
                ++plan_generation_;
                since_mark_ = 0;
                return 1;
            }
            plan_slide();
            return 0;
        }
        if (plan_end_step()) {
            plan_drop();
            plan_reset_recording();
            plan_state_ = kPlanRecording;
            return 2;
        }
        return 0;
    }
}

// plan.py _drops: whether a step end leaving these miss bits drops the plan
bool Engine::plan_drops(std::uint32_t bits) const {
    const std::uint32_t last = (1u << kMissLimit) - 1;
    return plan_broken_ || (bits & last) == last || __builtin_popcount(bits) >= kMissWindowLimit;
}

// plan.py _end_step: end the planned step (a mark, or an implicit restart: Note [An implicit step restart] in
// plan.py), counted hit or missed; true when that drops the plan (the caller drops it).
bool Engine::plan_end_step() {
    const bool hit = plan_step_hit();
    if (hit) ++plan_steps_hit_;
    else ++plan_steps_missed_;
    miss_bits_ = ((miss_bits_ << 1) | (hit ? 0u : 1u)) & ((1u << kMissWindow) - 1);
    if (planned_steps_ == 0) empty_cache_locked();   // the leftovers of the last step before the plan
    ++planned_steps_;
    if (planned_steps_ >= early_leave_steps_) early_drops_ = 0;   // it lived (plan.py, Note [A plan that leaves early])
    if (plan_drops(miss_bits_)) return true;
    cursor_ = 0;
    left_ = missed_ = false;
    const std::uint64_t blocked = blocked_nbytes_;
    blocked_nbytes_ = 0;
    if (blocked >= g_ && (moved_at_ < 0 || planned_steps_ - static_cast<std::uint64_t>(moved_at_) >= kMissWindow))
        plan_move_off_kept();
    return false;
}

// plan.py _restarts (Note [An implicit step restart]): the allocation after the step's last slot starts a new
// planned step when the step kept to the template, it is slot 0's (its rounded size exactly, its stream, slot 0
// free), and ending the step here would not drop the plan.
bool Engine::plan_restarts(std::uint64_t nbytes, std::uint64_t stream) const {
    if (left_ || plan_broken_) return false;
    const std::uint64_t r = cfg_.round_nbytes;   // slot 0's own size, not any that fits (plan.py)
    if ((nbytes + r - 1) / r * r != slot_size_[0] || stream != slot_stream_[0]) return false;
    const std::int64_t off = slot_off_[0];
    if (off >= 0 && plan_slot_taken(static_cast<std::uint64_t>(off), slot_size_[0]) >= 0) return false;
    const std::uint32_t bits = ((miss_bits_ << 1) | (plan_step_hit() ? 0u : 1u)) & ((1u << kMissWindow) - 1);
    return !plan_drops(bits);
}

// plan.py _move_off_kept (Note [Moving slots off kept blocks]): the slots that meet a kept block move elsewhere
// in the arena, the kept blocks fixed where they are; the runs nothing uses then go back, and the engine's idle
// cache.
void Engine::plan_move_off_kept() {
    PlanArena* arena = arenas_.back().get();
    const std::uint64_t base = arena->base, ps = planned_steps_;
    const std::size_t n = slot_off_.size();
    struct Kept {
        std::uint64_t off, size;
        std::size_t k;
        bool operator<(const Kept& o) const { return off != o.off ? off < o.off : size != o.size ? size < o.size : k < o.k; }
    };
    std::vector<Kept> kept;
    for (auto& kv : arena->live)
        if (kv.second.slot != kFixedSlot && ps - slot_served_in_[kv.second.slot] >= 2)
            kept.push_back(Kept{kv.first - base, kv.second.size, kv.second.slot});
    if (kept.empty()) return;
    std::sort(kept.begin(), kept.end());
    std::vector<char> is_kept(n, 0), moving(n, 0);
    for (const Kept& kb : kept) is_kept[kb.k] = 1;
    std::vector<std::size_t> move;
    for (std::size_t k = 0; k < n; ++k) {
        if (slot_off_[k] < 0) continue;
        const std::uint64_t o = static_cast<std::uint64_t>(slot_off_[k]);
        for (const Kept& kb : kept)
            if (kb.off < o + slot_size_[k] && o < kb.off + kb.size) {
                move.push_back(k);
                moving[k] = 1;
                break;
            }
    }
    auto prefix = [&](std::size_t i) {
        std::size_t c = 0;
        for (; i > 0; i -= i & (~i + 1)) c += occ_tree_[i];
        return c;
    };
    auto taken = [&](std::size_t k) { return prefix(slot_pos_[k] + 1) != prefix(slot_pos_[k]); };
    for (std::size_t k : move)   // a slot taken by anything but its kept block (live in this step, or poisoned) stays
        if (taken(k) && !is_kept[k]) return;
    // always in the way: kept blocks (this move's and earlier ones'), ranges poisoned and freed
    typedef std::pair<std::uint64_t, std::uint64_t> Range;
    std::vector<Range> always;
    for (const Kept& kb : kept) always.emplace_back(kb.off, kb.off + kb.size);
    for (auto& kv : arena->live)
        if (kv.second.slot == kFixedSlot) always.emplace_back(kv.first - base, kv.first - base + kv.second.size);
    for (std::size_t i = 0; i < occ_slot_.size(); ++i) {
        const std::size_t k = occ_slot_[i];
        if (taken(k) && !plan_slot_live(k))
            always.emplace_back(static_cast<std::uint64_t>(slot_off_[k]), static_cast<std::uint64_t>(slot_off_[k]) + slot_size_[k]);
    }
    auto meets = [&](std::size_t i, std::size_t j) {   // other streams, or alive together
        if (slot_stream_[i] != slot_stream_[j]) return true;
        const std::int64_t si[2][2] = {{static_cast<std::int64_t>(i), slot_e1_[i]}, {0, slot_e2_[i]}};
        const std::int64_t sj[2][2] = {{static_cast<std::int64_t>(j), slot_e1_[j]}, {0, slot_e2_[j]}};
        const int ni = slot_e2_[i] ? 2 : 1, nj = slot_e2_[j] ? 2 : 1;
        for (int a = 0; a < ni; ++a)
            for (int b = 0; b < nj; ++b)
                if (si[a][0] < sj[b][1] && sj[b][0] < si[a][1]) return true;
        return false;
    };
    std::vector<std::size_t> order(move);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        if (slot_size_[a] != slot_size_[b]) return slot_size_[a] > slot_size_[b];
        const std::int64_t la = (slot_e1_[a] - static_cast<std::int64_t>(a)) + slot_e2_[a];
        const std::int64_t lb = (slot_e1_[b] - static_cast<std::int64_t>(b)) + slot_e2_[b];
        if (la != lb) return la > lb;
        return a < b;
    });
    std::vector<std::uint64_t> placed_off(n, 0);
    std::vector<std::size_t> placed;
    for (std::size_t i : order) {
        std::vector<Range> ranges(always);
        for (std::size_t j = 0; j < n; ++j)
            if (slot_off_[j] >= 0 && !moving[j] && meets(i, j))
                ranges.emplace_back(static_cast<std::uint64_t>(slot_off_[j]), static_cast<std::uint64_t>(slot_off_[j]) + slot_size_[j]);
        for (std::size_t j : placed)
            if (meets(i, j)) ranges.emplace_back(placed_off[j], placed_off[j] + slot_size_[j]);
        std::sort(ranges.begin(), ranges.end());
        std::uint64_t reach = 0;
        for (const Range& r : ranges) {
            if (r.first >= reach + slot_size_[i]) break;
            reach = std::max(reach, r.second);
        }
        placed_off[i] = reach;
        placed.push_back(i);
    }
    std::uint64_t top = 0;
    for (std::size_t j = 0; j < n; ++j)
        if (slot_off_[j] >= 0 && !moving[j]) top = std::max(top, static_cast<std::uint64_t>(slot_off_[j]) + slot_size_[j]);
    for (std::size_t i : placed) top = std::max(top, placed_off[i] + slot_size_[i]);
    for (const Range& r : always) top = std::max(top, r.second);
    const std::uint64_t extent = (top + g_ - 1) / g_ * g_;
    if (extent > arena->nbytes) return;   // no room left in the reservation: the engine keeps serving those slots
    // the new offsets may lie on bytes other streams' work (or this stream's, still queued) touched: wait
    // for the arena's streams first (Note [Moving slots off kept blocks]; review attacker 12, F1)
    for (std::uint64_t s : arena->streams) backend_.stream_synchronize(s);   // sorted (std::set)
    for (const Kept& kb : kept) {
        plan_occupy(kb.k, false);
        arena->live[base + kb.off].slot = kFixedSlot;
    }
    std::vector<char> was_taken(n, 0);
    for (std::size_t i = 0; i < occ_slot_.size(); ++i) was_taken[occ_slot_[i]] = taken(occ_slot_[i]) ? 1 : 0;
    for (std::size_t i : placed) {
        slot_off_[i] = static_cast<std::int64_t>(placed_off[i]);
        slot_poisoned_[i] = 0;
    }
    std::vector<std::pair<std::int64_t, std::size_t>> sorted_slots;
    for (std::size_t k = 0; k < n; ++k)
        if (slot_off_[k] >= 0) sorted_slots.emplace_back(slot_off_[k], k);
    std::sort(sorted_slots.begin(), sorted_slots.end());
    occ_start_.clear();
    occ_slot_.clear();
    for (auto& ok : sorted_slots) {
        slot_pos_[ok.second] = occ_slot_.size();
        occ_start_.push_back(static_cast<std::uint64_t>(ok.first));
        occ_slot_.push_back(ok.second);
    }
    occ_tree_.assign(occ_slot_.size() + 1, 0);
    for (std::size_t k = 0; k < n; ++k)
        if (slot_off_[k] >= 0 && was_taken[k]) plan_occupy(k, true);
    arena->extent_nbytes = extent;
    moved_at_ = static_cast<std::int64_t>(ps);
    ++plan_moves_;
    // the runs no slot and no live block touches go back (after the arena's streams), then the engine's idle cache
    std::vector<Range> used;
    for (std::size_t k = 0; k < n; ++k)
        if (slot_off_[k] >= 0)
            used.emplace_back(static_cast<std::uint64_t>(slot_off_[k]), static_cast<std::uint64_t>(slot_off_[k]) + slot_size_[k]);
    for (auto& kv : arena->live) used.emplace_back(kv.first - base, kv.first - base + kv.second.size);
    std::sort(used.begin(), used.end());
    std::vector<std::uint64_t> starts(used.size()), reach_at(used.size());
    for (std::size_t i = 0; i < used.size(); ++i) {
        starts[i] = used[i].first;
        reach_at[i] = i ? std::max(reach_at[i - 1], used[i].second) : used[i].second;
    }
    std::vector<std::size_t> idle;
    for (std::size_t i = 0; i < arena->runs.size(); ++i) {
        const std::uint64_t lo = arena->runs[i].va - base, hi = lo + arena->runs[i].nbytes;
        const std::size_t j = static_cast<std::size_t>(std::lower_bound(starts.begin(), starts.end(), hi) - starts.begin());
        if (j == 0 || reach_at[j - 1] <= lo) idle.push_back(i);
    }
    for (std::size_t j = idle.size(); j-- > 0;) plan_give_back_run(arena, idle[j]);   // its streams waited for above
    empty_cache_locked();
}

std::vector<Engine::StepRecord> Engine::step_template() {
    Guard guard(*this, true);
    if (plan_state_ != kPlanReady)
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "step_template: no recorded step waits for a plan (mark_step returns READY when two "
                          "recorded steps match)");
    return rec_prev_;
}

bool Engine::ready_step(std::vector<StepRecord>* out, std::uint64_t* generation) {
    Guard guard(*this, true);
    if (plan_state_ != kPlanReady) return false;
    if (out) *out = rec_prev_;
    if (generation) *generation = plan_generation_;
    return true;
}

bool Engine::install_plan(const std::vector<std::int64_t>& offsets, std::int64_t generation) {
    Guard guard(*this);
    check_usable_op();
    if (closed_) throw EngineError(EngineErrorKind::kInvalidArgument, "install_plan: the allocator is closed");
    if (generation >= 0 && (plan_state_ != kPlanReady || static_cast<std::uint64_t>(generation) != plan_generation_))
        return false;   // Note [Step plans and threads]: another thread's mark took the READY step
    if (plan_state_ != kPlanReady)
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "install_plan: no recorded step waits for a plan (mark_step returns READY when two "
                          "recorded steps match)");
    const std::vector<StepRecord>& rec = rec_prev_;
    const std::size_t n = rec.size();
    if (offsets.size() != n)
        throw EngineError(EngineErrorKind::kInvalidArgument,
                          "install_plan: the recorded step has " + std::to_string(n) + " allocations, got " +
                              std::to_string(offsets.size()) + " offsets");
    const std::uint64_t r = cfg_.round_nbytes;
    std::vector<std::uint64_t> sizes(n);
    std::vector<std::int64_t> e1(n, 0), e2(n, 0);
    std::vector<std::pair<std::int64_t, std::size_t>> planned;
    for (std::size_t k = 0; k < n; ++k) {
        sizes[k] = (rec[k].nbytes + r - 1) / r * r;
        std::int64_t o = offsets[k];
        if (o == -1) continue;
        if (o < 0 || static_cast<std::uint64_t>(o) % r || o > (std::int64_t{1} << 62))
            throw EngineError(EngineErrorKind::kInvalidArgument,
                              "install_plan: offset " + std::to_string(o) + " of slot " + std::to_string(k) +
                                  " is not -1 or a multiple of " + std::to_string(r) + " B");
        if (static_cast<std::uint64_t>(o) + sizes[k] > total_nbytes_)   // never mapped: refused before reserving
            throw EngineError(EngineErrorKind::kInvalidArgument,
                              "install_plan: offset " + std::to_string(o) + " of slot " + std::to_string(k) + " (" +
                                  std::to_string(sizes[k]) + " B) ends past the device's " +
                                  std::to_string(total_nbytes_) + " B: no arena that large can be mapped");
        if (rec[k].free_own >= 0) {
            e1[k] = rec[k].free_own;
        } else if (rec[k].free_next >= 0 && rec[k].free_next <= static_cast<std::int64_t>(k)) {
            e1[k] = static_cast<std::int64_t>(n);
            e2[k] = rec[k].free_next;
        } else {
            throw EngineError(EngineErrorKind::kInvalidArgument,
                              "install_plan: slot " + std::to_string(k) +
                                  " is not freed within its step or early in the next: it cannot be planned (give "
                                  "it offset -1)");
        }
        planned.emplace_back(o, k);
    }
    std::sort(planned.begin(), planned.end());
    if (planned.empty()) throw EngineError(EngineErrorKind::kInvalidArgument, "install_plan: the plan places no allocation");
    check_slots(planned, sizes, e1, e2);
    std::vector<std::uint64_t> streams(n);
    for (std::size_t k = 0; k < n; ++k) streams[k] = rec[k].stream;
    std::vector<char> refused = refused_slots(planned, sizes, streams);
    std::uint64_t height = 0;
    for (auto& pk : planned)
        if (!refused[pk.second]) height = std::max(height, static_cast<std::uint64_t>(pk.first) + sizes[pk.second]);
    if (height == 0)
        throw EngineError(EngineErrorKind::kInvalidArgument, "install_plan: every slot of the plan meets another stream's");
    const std::uint64_t arena_nbytes = (height + g_ - 1) / g_ * g_;
    std::unique_ptr<PlanArena> arena(new PlanArena());
    GPUMEM_OPERATION({ arena->base = backend_.address_reserve(arena_nbytes * kArenaVaFactor, 0); })
    ++plan_arena_calls_;
    arena->nbytes = arena_nbytes * kArenaVaFactor;
    arena->extent_nbytes = arena_nbytes;
    arena->pages.assign(arena->nbytes / g_, 0);
    for (auto& pk : planned)
        if (!refused[pk.second]) arena->streams.insert(rec[pk.second].stream);
    arenas_.push_back(std::move(arena));
    slot_off_.assign(n, -1);
    for (std::size_t k = 0; k < n; ++k)
        if (offsets[k] >= 0 && !refused[k]) slot_off_[k] = offsets[k];
    slot_size_ = sizes;
    slot_stream_ = streams;
    slot_e1_ = e1;
    slot_e2_ = e2;
    blocked_nbytes_ = 0;
    moved_at_ = -1;
    occ_start_.clear();
    occ_slot_.clear();
    slot_pos_.assign(n, 0);
    for (auto& pk : planned)
        if (!refused[pk.second]) {
            slot_pos_[pk.second] = occ_slot_.size();
            occ_start_.push_back(static_cast<std::uint64_t>(pk.first));
            occ_slot_.push_back(pk.second);
        }
    occ_tree_.assign(occ_slot_.size() + 1, 0);
    slot_poisoned_.assign(n, 0);
    slot_served_in_.assign(n, 0);
    cursor_ = 0;
    miss_bits_ = 0;
    planned_steps_ = 0;
    missed_ = plan_broken_ = false;
    left_ = since_mark_ > 0;   // allocations came between the mark and the install: not this step
    plan_state_ = kPlanPlanned;
    ++plans_installed_;
    plan_end_warmup(true);
    rec_prev_.clear();
    rec_prev_map_.clear();
    rec_cur_.clear();
    rec_cur_map_.clear();
    rec_cur_cross_ = rec_prev_cross_ = false;
    return true;
}

std::uint64_t Engine::plan_allocate(std::uint64_t nbytes, std::uint64_t stream) {
    if (plan_state_ == kPlanPlanned && !lost_ && !closed_) {
        const bool was_left = left_;
        std::uint64_t p = 0;
        GPUMEM_OPERATION({ p = plan_serve(nbytes, stream); })
        if (p) return p;
        ++plan_fallback_;
        if (cursor_ > kOverrunFactor * slot_off_.size()) {   // marks stopped? (plan.py, Note [When marks stop])
            plan_drop();
            plan_reset_recording();
            plan_state_ = kPlanOff;
            GPUMEM_OPERATION({ plan_give_back_dropped(); })
        } else if (left_ && !was_left && planned_steps_ < early_leave_steps_ && early_drops_ < kEarlyDrops &&
                   !never_fits(round_up_nbytes(nbytes))) {
            ++early_drops_;   // plan.py, Note [A plan that leaves early]
            plan_drop();
            plan_reset_recording();
            plan_state_ = kPlanRecording;
            try {
                GPUMEM_OPERATION({ plan_give_back_dropped(); })
            } catch (const BackendError& e) {
                // a lost device, and a KeyboardInterrupt or SystemExit, go through (Note [Only Exception is caught]);
                // else the runs stay held and the next mark gives them back
                if (e.kind == ErrorKind::kDeviceLost || e.fatal) throw;
            }
        }
    }
    std::uint64_t p = allocate_engine(nbytes, stream);
    ++since_mark_;
    if (plan_state_ == kPlanRecording || plan_state_ == kPlanRecordingNext) {
        if (rec_cur_.size() >= record_limit_) {   // marks stopped? (plan.py, Note [When marks stop])
            plan_reset_recording();
            plan_state_ = kPlanOff;
            ++plan_recordings_abandoned_;
        } else {
            rec_cur_map_[p] = rec_cur_.size();
            rec_cur_.push_back(StepRecord{nbytes, stream, -1, -1});
        }
    }
    return p;
}

std::uint64_t Engine::plan_serve(std::uint64_t nbytes, std::uint64_t stream) {
    std::size_t k = cursor_;
    if (k == slot_off_.size() && plan_restarts(nbytes, stream)) {
        ++plan_implicit_steps_;
        plan_end_step();   // no drop: plan_restarts checked it
        k = 0;
    }
    cursor_ = k + 1;
    if (plan_broken_) {
        missed_ = true;
        return 0;
    }
    if (left_ || k >= slot_off_.size()) {
        left_ = true;
        return 0;
    }
    if (nbytes > slot_size_[k] || stream != slot_stream_[k]) {
        left_ = true;
        return 0;
    }
    const std::int64_t off = slot_off_[k];
    if (off < 0) return 0;
    const std::uint64_t size = slot_size_[k];
    const std::int64_t j = plan_slot_taken(static_cast<std::uint64_t>(off), size);
    if (j >= 0) {   // a live slot: this one, still taken, or another
        // one kept past every planned lifetime is served by the engine, not a miss (plan.py, Note [Allocations
        // kept past their step])
        const std::size_t js = static_cast<std::size_t>(j);
        if (planned_steps_ - slot_served_in_[js] < 2 || (slot_poisoned_[js] && !plan_slot_live(js))) missed_ = true;
        else blocked_nbytes_ += size;   // the slot may move (plan.py, Note [Moving slots off kept blocks])
        return 0;
    }
    PlanArena* arena = arenas_.back().get();
    bool mapped = false;
    try {
        mapped = plan_map(arena, static_cast<std::uint64_t>(off), size);
    } catch (...) {
        missed_ = true;   // the allocation fails: the step is not served by the plan
        throw;
    }
    if (!mapped) {
        missed_ = true;
        return 0;
    }
    return plan_hand_out(arena, k, nbytes);
}

std::uint64_t Engine::plan_hand_out(PlanArena* arena, std::size_t k, std::uint64_t nbytes) {
    const std::uint64_t size = slot_size_[k], ptr = arena->base + static_cast<std::uint64_t>(slot_off_[k]);
    plan_occupy(k, true);
    slot_served_in_[k] = planned_steps_;
    arena->live[ptr] = PlanLive{k, size, nbytes};
    count_alloc(size, nbytes);
    ++plan_served_;
    return ptr;
}

// plan_allocate when the plan serves the request with no device call (its slot's pages mapped), for the hot
// path (try_allocate_fast); 0, nothing changed, otherwise: allocate() then decides as plan.py does.
std::uint64_t Engine::plan_serve_fast(std::uint64_t nbytes, std::uint64_t stream, std::uint64_t* size_out) {
    const std::size_t k = cursor_;
    if (plan_state_ != kPlanPlanned || left_ || plan_broken_ || k >= slot_off_.size() || slot_off_[k] < 0 || nbytes > slot_size_[k] ||
        stream != slot_stream_[k])
        return 0;
    const std::uint64_t off = static_cast<std::uint64_t>(slot_off_[k]), size = slot_size_[k];
    PlanArena* arena = arenas_.back().get();
    for (std::uint64_t p = off / g_; p <= (off + size - 1) / g_; ++p)
        if (!arena->pages[p]) return 0;
    if (plan_slot_taken(off, size) >= 0) return 0;
    cursor_ = k + 1;
    if (size_out) *size_out = size;
    return plan_hand_out(arena, k, nbytes);
}

// plan_free of a live allocation of the current plan's arena (no give-back follows), for the hot path
// (try_free_fast); false, nothing changed, otherwise.
bool Engine::plan_free_fast(std::uint64_t ptr) {
    if (arenas_.empty()) return false;
    PlanArena* arena = arenas_.back().get();
    if (arena->dropped || !arena->holds(ptr)) return false;
    auto it = arena->live.find(ptr);
    if (it == arena->live.end()) return false;
    const PlanLive e = it->second;
    arena->live.erase(it);
    if (e.slot != kFixedSlot && !slot_poisoned_[e.slot]) plan_occupy(e.slot, false);   // a slot used on another stream stays taken
    st_.allocated_nbytes -= e.size;
    st_.requested_nbytes -= e.requested;
    ++st_.num_frees;
    return true;
}

// plan.py _slot_live: slot k's allocation in the current arena is live (a poisoned slot stays taken after its free)
bool Engine::plan_slot_live(std::size_t k) const {
    const PlanArena* arena = arenas_.back().get();
    auto it = arena->live.find(arena->base + static_cast<std::uint64_t>(slot_off_[k]));
    return it != arena->live.end() && it->second.slot == k;
}

// plan.py _Ranges.meeting over the Fenwick tree of live positions: the live slot starting last below
// off + size is the only one that can meet [off, off + size) (live slots are disjoint); -1 for none.
std::int64_t Engine::plan_slot_taken(std::uint64_t off, std::uint64_t size) const {
    const std::size_t m = occ_slot_.size();
    const std::size_t hi =
        static_cast<std::size_t>(std::lower_bound(occ_start_.begin(), occ_start_.end(), off + size) - occ_start_.begin());
    std::size_t c = 0;   // live positions below hi
    for (std::size_t i = hi; i > 0; i -= i & (~i + 1)) c += occ_tree_[i];
    if (c == 0) return -1;
    std::size_t pos = 0;   // the c-th live position (0-based: pos after the loop)
    std::size_t step = 1;
    while (step * 2 <= m) step *= 2;
    for (; step; step >>= 1)
        if (pos + step <= m && occ_tree_[pos + step] < c) {
            pos += step;
            c -= occ_tree_[pos];
        }
    return occ_start_[pos] + slot_size_[occ_slot_[pos]] > off ? static_cast<std::int64_t>(occ_slot_[pos]) : -1;
}

void Engine::plan_occupy(std::size_t k, bool live) {
    const std::size_t m = occ_slot_.size();
    for (std::size_t i = slot_pos_[k] + 1; i <= m; i += i & (~i + 1)) {
        if (live) ++occ_tree_[i];
        else --occ_tree_[i];
    }
}

bool Engine::plan_map(PlanArena* arena, std::uint64_t off, std::uint64_t size) {
    const std::uint64_t first = off / g_, last = (off + size - 1) / g_;
    std::vector<std::uint64_t> todo;
    for (std::uint64_t p = first; p <= last; ++p)
        if (!arena->pages[p]) todo.push_back(p);
    if (todo.empty()) return true;
    empty_cache_locked();   // first: under a limit, the idle cache is what makes room (plan.py _map)
    if (cfg_.limit_nbytes && reserved_nbytes_ + plan_mapped_nbytes_ + todo.size() * g_ > cfg_.limit_nbytes) return false;
    // runs of at most the engine's chunk cap (plan.py, Note [Arena runs of at most a chunk])
    const std::uint64_t cap =
        static_cast<std::uint64_t>(chunk_cap_pages_of(static_cast<std::int64_t>((reserved_nbytes_ + plan_mapped_nbytes_) / g_), cfg_));
    std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;
    for (std::uint64_t p : todo) {
        if (!runs.empty() && runs.back().second == p && p - runs.back().first < cap) runs.back().second = p + 1;
        else runs.emplace_back(p, p + 1);
    }
    for (auto& ab : runs) {
        const std::uint64_t va = arena->base + ab.first * g_, nb = (ab.second - ab.first) * g_;
        ChunkHandle h = 0;
        try {
            h = backend_.mem_create(nb);
        } catch (...) {
            if (!classify_current().oom) throw;
            return false;
        }
        try {
            backend_.mem_map(va, nb, h, 0);
        } catch (...) {
            try {
                backend_.mem_release(h);
            } catch (...) {
                rethrow_if_fatal();
            }
            throw;
        }
        try {
            backend_.mem_set_access(va, nb);
        } catch (...) {
            bool unmapped = true;
            try {
                backend_.mem_unmap(va, nb);
            } catch (...) {
                // plan.py: the mapping stays, kept as a run for the give-back to retry; the plan is dropped at
                // the next mark (Note [A mapping the arena could not undo]); a fatal error goes on, once booked
                plan_book_run(arena, va, nb, h);
                plan_broken_ = true;
                rethrow_if_fatal();
                unmapped = false;
            }
            if (!unmapped) throw;
            try {
                backend_.mem_release(h);
            } catch (...) {
                rethrow_if_fatal();
            }
            throw;
        }
        plan_arena_calls_ += 3;
        plan_book_run(arena, va, nb, h);
        for (std::uint64_t p = ab.first; p < ab.second; ++p) arena->pages[p] = h;
    }
    return true;
}

// plan.py _book_run
void Engine::plan_book_run(PlanArena* arena, std::uint64_t va, std::uint64_t nb, ChunkHandle h) {
    arena->runs.push_back(PlanRun{va, nb, h, false});
    arena->mapped_nbytes += nb;
    plan_mapped_nbytes_ += nb;
    if (reserved_nbytes_ + plan_mapped_nbytes_ > st_.peak_reserved_nbytes)
        st_.peak_reserved_nbytes = reserved_nbytes_ + plan_mapped_nbytes_;
}

bool Engine::plan_free(std::uint64_t ptr) {
    PlanLive e{};
    PlanArena* arena = plan_arena_entry(ptr, &e, true);
    if (arena == nullptr) return false;
    arena->live.erase(ptr);
    if (!arena->dropped && e.slot != kFixedSlot && !slot_poisoned_[e.slot])
        plan_occupy(e.slot, false);   // a slot used on another stream stays taken
    st_.allocated_nbytes -= e.size;
    st_.requested_nbytes -= e.requested;
    ++st_.num_frees;
    if (arena->dropped && arena->live.empty()) plan_release(arena);
    return true;
}

void Engine::plan_record_free(std::uint64_t ptr) {
    auto it = rec_cur_map_.find(ptr);
    if (it != rec_cur_map_.end()) {
        rec_cur_[it->second].free_own = static_cast<std::int64_t>(rec_cur_.size());
        rec_cur_map_.erase(it);
        return;
    }
    it = rec_prev_map_.find(ptr);
    if (it != rec_prev_map_.end()) {
        rec_prev_[it->second].free_next = static_cast<std::int64_t>(rec_cur_.size());
        rec_prev_map_.erase(it);
    }
}

// StepPlan.record_cross_stream (Note [Step plans and record_stream] in plan.py)
void Engine::plan_record_cross_stream(std::uint64_t ptr) {
    if (rec_cur_map_.count(ptr)) rec_cur_cross_ = true;
    else if (rec_prev_map_.count(ptr)) rec_prev_cross_ = true;
}

Engine::PlanArena* Engine::plan_arena_entry(std::uint64_t ptr, PlanLive* out, bool freeing) {
    for (std::size_t i = arenas_.size(); i-- > 0;) {
        PlanArena* arena = arenas_[i].get();
        if (!arena->holds(ptr)) continue;
        auto it = arena->live.find(ptr);
        if (it == arena->live.end())
            throw EngineError(EngineErrorKind::kInvalidPointer,
                              freeing ? "free of " + hex(ptr) + ": no live allocation starts there in the step plan's arena"
                                      : hex(ptr) + " is not a live allocation (inside the step plan's arena)");
        if (out) *out = it->second;
        return arena;
    }
    return nullptr;
}

bool Engine::plan_record_stream(std::uint64_t ptr, std::uint64_t stream) {
    PlanLive e{};
    PlanArena* arena = plan_arena_entry(ptr, &e);
    if (!arena) return false;
    if (arena->dropped || e.slot == kFixedSlot) {   // a dropped arena's, or a kept block no slot meets any more
        arena->streams.insert(stream);
    } else if (stream != slot_stream_[e.slot]) {
        arena->streams.insert(stream);
        slot_poisoned_[e.slot] = 1;
    }
    return true;
}

void Engine::plan_drop() {
    PlanArena* arena = arenas_.back().get();
    arena->dropped = true;
    ++plans_dropped_;
    plan_clear_slots();
}

// plan.py StepPlan.shrink
void Engine::plan_shrink() {
    if (plan_state_ == kPlanPlanned) {
        plan_drop();
        plan_reset_recording();
        plan_state_ = kPlanRecording;
    }
    plan_give_back_dropped();
}

// plan.py _give_back_dropped
void Engine::plan_give_back_dropped() {
    std::vector<PlanArena*> dropped;
    for (auto& a : arenas_)
        if (a->dropped) dropped.push_back(a.get());
    for (PlanArena* arena : dropped) {
        if (arena->live.empty()) {
            plan_release(arena);
            continue;
        }
        plan_give_back_idle_runs(arena);
    }
}

// plan.py _give_back_idle_runs: the runs of `arena` that no live allocation touches, after the arena's streams
void Engine::plan_give_back_idle_runs(PlanArena* arena) {
    std::vector<std::size_t> idle;
    for (std::size_t i = 0; i < arena->runs.size(); ++i) {
        const PlanRun& r = arena->runs[i];
        bool used = false;
        for (auto& kv : arena->live)
            if (kv.first < r.va + r.nbytes && r.va < kv.first + kv.second.size) {
                used = true;
                break;
            }
        if (!used) idle.push_back(i);
    }
    if (idle.empty()) return;
    for (std::uint64_t s : arena->streams) backend_.stream_synchronize(s);   // sorted (std::set)
    for (std::size_t j = idle.size(); j-- > 0;) plan_give_back_run(arena, idle[j]);
}

// plan.py give_back_idle (empty_cache): every dropped arena with nothing live, and the runs of every arena,
// the current plan's too, that no live allocation touches; the bytes given back
std::uint64_t Engine::plan_give_back_idle() {
    const std::uint64_t before = plan_mapped_nbytes_;
    plan_give_back_dropped();
    if (plan_state_ == kPlanPlanned) plan_give_back_idle_runs(arenas_.back().get());
    return before - plan_mapped_nbytes_;
}

void Engine::set_step_record_limit(std::uint64_t records) {
    Guard guard(*this);
    record_limit_ = records;
}

void Engine::set_early_leave_steps(std::uint64_t steps) {
    Guard guard(*this);
    early_leave_steps_ = steps;
}

// Unmap (unless a failed try already did) and release run `i` of `arena`, then forget it: a failure leaves
// the run with what was done marked, so the next try goes on from there. Caller holds mu_.
void Engine::plan_give_back_run(PlanArena* arena, std::size_t i) {
    PlanRun& run = arena->runs[i];
    if (!run.unmapped) {
        backend_.mem_unmap(run.va, run.nbytes);
        run.unmapped = true;
        ++plan_arena_calls_;
        // unmapped now: a slot that touches these pages maps them again, even if the release below fails
        // (its pages read as mapped served unmapped memory: review attacker 12, F2); the bytes stay held
        // (mapped_nbytes) until the release
        for (std::uint64_t p = (run.va - arena->base) / g_; p < (run.va - arena->base + run.nbytes) / g_; ++p)
            arena->pages[p] = 0;
    }
    backend_.mem_release(run.h);
    ++plan_arena_calls_;
    const std::uint64_t nb = run.nbytes;
    arena->runs.erase(arena->runs.begin() + static_cast<std::ptrdiff_t>(i));
    arena->mapped_nbytes -= nb;
    plan_mapped_nbytes_ -= nb;
}

void Engine::plan_release(PlanArena* arena) {
    for (std::uint64_t s : arena->streams) backend_.stream_synchronize(s);   // sorted (std::set)
    while (!arena->runs.empty()) plan_give_back_run(arena, arena->runs.size() - 1);
    backend_.address_free(arena->base, arena->nbytes);
    ++plan_arena_calls_;
    released_arenas_.emplace_back(arena->base, arena->nbytes);
    if (released_arenas_.size() > kReleasedArenas) released_arenas_.erase(released_arenas_.begin());
    for (auto it = arenas_.begin(); it != arenas_.end(); ++it)
        if (it->get() == arena) {
            arenas_.erase(it);
            break;
        }
}

// StepPlan.released_arena (Note [Frees into a given-back arena] in plan.py): error path only
const std::pair<std::uint64_t, std::uint64_t>* Engine::plan_released_arena(std::uint64_t ptr) const {
    for (auto it = released_arenas_.rbegin(); it != released_arenas_.rend(); ++it)
        if (it->first <= ptr && ptr - it->first < it->second) return &*it;
    return nullptr;
}

void Engine::plan_close() {
    while (!arenas_.empty()) {
        PlanArena* arena = arenas_.front().get();
        arena->dropped = true;
        arena->live.clear();
        plan_release(arena);
    }
    plan_state_ = kPlanOff;
    plan_reset_recording();
    plan_clear_slots();
}

std::uint64_t Engine::plan_live_nbytes() const {
    std::uint64_t n = 0;
    for (auto& a : arenas_)
        for (auto& kv : a->live) n += kv.second.size;
    return n;
}

std::vector<std::uint64_t> Engine::step_plan_info() {
    Guard guard(*this, true);
    const PlanArena* cur = plan_state_ == kPlanPlanned && !arenas_.empty() ? arenas_.back().get() : nullptr;
    return {static_cast<std::uint64_t>(plan_state_), slot_off_.size(), cur ? cur->extent_nbytes : 0, plan_mapped_nbytes_,
            plan_served_, plan_fallback_, plan_steps_hit_, plan_steps_missed_, plans_installed_, plans_dropped_,
            plan_arena_calls_, plan_live_nbytes(), rec_cur_.size() + rec_prev_.size(), plan_recordings_abandoned_,
            plan_implicit_steps_, warmup_ && st_.num_allocs - warmup_since_ < kWarmupAllocs ? 1u : 0u};
}

// Note [The small pool's state as bytes]: the estimate's fast replay leaves a decode step's small-pool ops out
// once the small pool is at a fixed point (Note [Small pool skipped at a fixed point] in
// gpumem/estimate/fastreplay.py). It finds the fixed point by comparing the small pool's state at step ends,
// exactly: this packs, as 64-bit little-endian words, everything of it that the engine's next small-pool
// operations read. Segment mode: every small segment (by address): base, size, order, live count, dirty,
// fence, stream, and its blocks from the last (address, size, allocated, stream, the fences and pending
// streams of a freed block waiting for other streams, in full). Virtual memory: the small range (base, size,
// top, page size, its blocks as above, the empty pages in their order, the fences at its top) and every page
// with anything on it (live references, chunk mapped, dirty and user streams, fences, no access, deferred),
// then the chunks held mapped nowhere (shared by the pools) and the deferred unmaps. The pages are read up to
// the highest top the range had (VSeg::top_max, kept by extend): with one page a chunk, nothing maps, references
// or fences a page past it, so the other pages of the range's address space (hundreds of thousands: twice the
// device's memory) are not walked at every call. Not in it: a block's
// requested bytes (stats only), and the counts of live pages that decide steals and chunk sizes only (a policy
// the fast replay skips takes neither: can_skip_small_pool). Where there is no separate small pool, empty.
std::string Engine::small_pool_state() {
    Guard guard(*this, true);
    std::string out;
    auto put = [&out](std::uint64_t v) {
        char w[8];
        for (int i = 0; i < 8; ++i) w[i] = static_cast<char>((v >> (8 * i)) & 0xff);
        out.append(w, 8);
    };
    auto put_fences = [&put](const FenceMap* f) {
        if (!f) {
            put(~std::uint64_t{0});
            return;
        }
        put(f->size());
        for (auto& sn : *f) {
            put(sn.first);
            put(sn.second);
        }
    };
    auto put_blocks = [&](const VSeg* seg) {
        for (const Block* b = seg->last; b; b = b->prev) {
            put(b->addr);
            put(b->size);
            put(b->allocated ? 1 : 0);
            put(b->stream);
            put_fences(b->fences.get());
            if (!b->pending_streams) {
                put(~std::uint64_t{0});
            } else {
                put(b->pending_streams->size());
                for (auto st : *b->pending_streams) put(st);
            }
        }
        put(~std::uint64_t{0} - 1);   // end of the blocks
    };
    auto put_streams = [&put](const StreamTable& t, std::int64_t p) {
        put(t.state[p]);
        if (t.state[p] == 1) put(t.one[p]);
        else if (t.state[p] == 2) {
            const auto& v = t.many.at(p);
            put(v.size());
            for (auto st : v) put(st);
        }
    };
    if (!cfg_.separate_small_pool) return out;
    if (cfg_.segments) {
        put(1);
        std::vector<const VSeg*> small;
        for (auto& up : msegs_)
            if (up->small) small.push_back(up.get());
        std::sort(small.begin(), small.end(), [](const VSeg* a, const VSeg* b) { return a->base < b->base; });
        for (const VSeg* seg : small) {
            put(seg->base);
            put(seg->nbytes);
            put(seg->order);
            put(seg->live);
            put(seg->mdirty ? 1 : 0);
            put(seg->fence);
            put(seg->mstream);
            put_blocks(seg);
        }
        return out;
    }
    put(2);
    const VSeg* seg = vseg_by_key_[1];
    if (seg) {
        put(seg->base);
        put(seg->nbytes);
        put(seg->top);
        put(seg->page_nbytes);
        put_blocks(seg);
        put(seg->n_empty);
        for (std::int64_t p = seg->ehead; p >= 0; p = seg->enext[p]) put(static_cast<std::uint64_t>(p));
        put_fences(seg->top_fences.get());
        const bool any_fences = !seg->page_fences.empty();
        // pages past the highest top are untouched where every chunk is one page: a page is mapped, referenced or
        // fenced for a block, and blocks lie below the top (chunks of several pages may reach past it: all read)
        const std::int64_t n_scan = cfg_.growth == GrowthRule::kPages && seg->top_max < seg->nbytes
                                        ? seg->page_of(seg->top_max + seg->page_nbytes - 1)
                                        : seg->n_pages;
        for (std::int64_t p = 0; p < std::min(n_scan, seg->n_pages); ++p) {
            if (!seg->refs[p] && !seg->chunks[p] && !seg->dirty.state[p] && !seg->users.state[p] && !seg->noaccess[p] &&
                !seg->deferred[p] && !seg->in_empty[p] && !(any_fences && seg->page_fences.count(p)))
                continue;
            put(static_cast<std::uint64_t>(p));
            put(static_cast<std::uint64_t>(seg->refs[p]));
            put(static_cast<std::uint64_t>(seg->chunks[p]));
            put_streams(seg->dirty, p);
            put_streams(seg->users, p);
            put(seg->noaccess[p]);
            put(seg->deferred[p]);
            auto it = any_fences ? seg->page_fences.find(p) : seg->page_fences.end();
            put_fences(it == seg->page_fences.end() ? nullptr : &it->second);
        }
    }
    put(~std::uint64_t{0} - 2);   // end of the range
    put(unmapped_.size());
    for (ChunkHandle h : unmapped_) put(static_cast<std::uint64_t>(h));
    put(deferred_.size());
    for (const Deferred& d : deferred_) {
        put(d.seg == seg ? 1 : 0);
        put(static_cast<std::uint64_t>(d.s));
        put(static_cast<std::uint64_t>(d.h));
        put_fences(&d.fences);
    }
    return out;
}

}  // namespace gpumem
