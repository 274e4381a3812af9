// gpumem._engine.PtrTable: op id -> device pointer, for Allocator.run_ops (module.cpp).
//
// Note [A step's ops in one call]: the estimate's fast replay (gpumem/estimate/fastreplay.py,
// PlainSink) sends every op of a decode step to an allocator: an allocation names a new op id and
// keeps the pointer it got under that id; a free names the id of an earlier allocation, forgets it
// and frees its pointer (none for a zero-byte allocation, or an id never seen). Done in Python, the
// loop and the id -> pointer dict cost more than the native engine's own work. Allocator.run_ops
// takes the step as three arrays (kinds, op ids, bytes) and a PtrTable, and does the same per op in
// C++: the same engine calls in the same order, the same checks, the same errors (see run_ops in
// module.cpp for what it keeps of allocate() and free()).
//
// The table is a map and not an array indexed by op id: the fast replay's ids are dense (the
// emitter numbers allocations 0, 1, 2, ...) but unbounded with the length (a 7B model's decode step
// makes about a thousand allocations, so 4000 new tokens name four million ids) while only a few
// thousand are live at once (the weights from the prefill, the last two steps' tensors). An array
// would grow with every id ever named, or need a window that some long-lived ids (the weights)
// fall out of; a hash map holds what is live, exactly. It is open addressing with linear probing
// and backward-shift deletion (no tombstones: a map with as many inserts as erases stays short),
// load at most 1/2, keyed by the id's bits times a Fibonacci constant. One id is reserved as the
// empty slot's marker: -2**63, refused everywhere (an OverflowError for a key, an
// InvalidArgumentError in run_ops' ids). The table owns no Python object (no GC) and is shared by
// the sink's per-op path (its mapping methods: t[id] = ptr, t.pop(id, 0)) and run_ops, so the two
// can alternate: the steps the emitter makes go op by op, the ones made from the step template
// (Note [Decode step template] in fastreplay.py) in one call.
#ifndef GPUMEM_NATIVE_OP_TABLE_H
#define GPUMEM_NATIVE_OP_TABLE_H

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem {

class OpPtrMap {
  public:
    static constexpr std::int64_t kEmpty = INT64_MIN;   // no key: the reserved id
    OpPtrMap() { slots_.assign(16, Slot{kEmpty, 0}); mask_ = 15; shift_ = 60; }
    bool get(std::int64_t key, std::uint64_t* out) const {
        for (std::size_t i = home(key);; i = (i + 1) & mask_) {
            const Slot& s = slots_[i];
            if (s.key == key) { *out = s.value; return true; }
            if (s.key == kEmpty) return false;
        }
    }
    // Inserts or overwrites; may throw std::bad_alloc (growing), the map unchanged then.
    void put(std::int64_t key, std::uint64_t value) {
        if ((n_ + 1) * 2 > slots_.size()) grow_to(slots_.size() * 2);
        if (logging_) log_.push_back(value);   // before the insert: a throw leaves the map unchanged
        std::size_t i = home(key);
        for (; slots_[i].key != kEmpty; i = (i + 1) & mask_)
            if (slots_[i].key == key) { slots_[i].value = value; return; }
        slots_[i] = Slot{key, value};
        ++n_;
    }
    // Room for `extra` more keys without growing (may throw std::bad_alloc, the map unchanged then).
    void reserve_more(std::size_t extra) {
        std::size_t want = slots_.size();
        while ((n_ + extra) * 2 > want) want *= 2;
        if (want != slots_.size()) grow_to(want);
    }
    bool pop(std::int64_t key, std::uint64_t* out) {
        std::size_t i = home(key);
        for (;; i = (i + 1) & mask_) {
            if (slots_[i].key == key) break;
            if (slots_[i].key == kEmpty) return false;
        }
        *out = slots_[i].value;
        // backward-shift deletion: move later entries of the run back over the hole when their home
        // is not cyclically within (hole, their slot]
        for (std::size_t j = (i + 1) & mask_; slots_[j].key != kEmpty; j = (j + 1) & mask_) {
            std::size_t h = home(slots_[j].key);
            bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
            if (!stays) {
                slots_[i] = slots_[j];
                i = j;
            }
        }
        slots_[i].key = kEmpty;
        --n_;
        return true;
    }
    std::size_t size() const { return n_; }
    void clear() {
        std::vector<Slot> fresh(16, Slot{kEmpty, 0});
        slots_.swap(fresh);
        mask_ = 15;
        shift_ = 60;
        n_ = 0;
    }
    template <class F> void for_each(F f) const {
        for (const Slot& s : slots_) if (s.key != kEmpty) f(s.key, s.value);
    }
    // Note [The pointers a run got]: while logging, every value put is also appended to a log, in order; run_ops
    // puts each allocation's pointer once, in op order (0 for a zero-byte one), so the log of a run is the
    // pointer of each of its allocations: the estimate's fast replay reads the small allocations' addresses of a
    // step sent whole (gpumem/estimate/fastreplay.py, NativeSkippingSink).
    void set_logging(bool on) {
        logging_ = on;
        if (!on) log_.clear();
    }
    std::vector<std::uint64_t>& log() { return log_; }

  private:
    struct Slot {
        std::int64_t key;
        std::uint64_t value;
    };
    std::size_t home(std::int64_t key) const {
        return static_cast<std::size_t>((static_cast<std::uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >> shift_);
    }
    void grow_to(std::size_t cap) {
        std::vector<Slot> old(cap, Slot{kEmpty, 0});
        old.swap(slots_);   // may throw above, before anything changed
        mask_ = cap - 1;
        shift_ = 64;
        for (std::size_t c = cap; c > 1; c >>= 1) --shift_;
        for (const Slot& s : old) {
            if (s.key == kEmpty) continue;
            std::size_t i = home(s.key);
            while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
            slots_[i] = s;
        }
    }
    std::vector<Slot> slots_;
    std::size_t n_ = 0, mask_ = 0;
    int shift_ = 60;
    bool logging_ = false;
    std::vector<std::uint64_t> log_;
};

struct PtrTableObject {
    PyObject_HEAD
    OpPtrMap* map;
    Py_ssize_t last_ops_done;   // what the last run_ops over this table completed (Allocator.run_ops)
};

}  // namespace gpumem

// The PtrTable type (op_table.cpp): whether `o` is one, and its registration in the module.
bool gpumem_is_ptr_table(PyObject* o);
int gpumem_add_ptr_table(PyObject* module);

#endif  // GPUMEM_NATIVE_OP_TABLE_H
