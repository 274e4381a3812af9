// PyDeviceBackend: the engine's Backend over a Python gpumem.device.Device (see pybackend.cpp).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend.h"

namespace gpumem {

// Note [The lag's queues a ring each]: the twin's GPU work queues (per stream, and the launch queue) are FIFOs that
// take a push and a pop per kernel (4.6 million kernels in the estimate's 7B decode of 4,000 new tokens). A
// std::deque gave and took back a block of its memory every 21 kernels (its push_back 3 % of that replay's perf
// samples, 2026-12-05); a ring of a power of two, grown by doubling and never shrunk, keeps its memory. Same
// order, same elements: only where they live changed.
template <class T>
class Fifo {
  public:
    bool empty() const { return n_ == 0; }
    std::size_t size() const { return n_; }
    const T& front() const { return buf_[head_]; }
    T& front() { return buf_[head_]; }
    const T& back() const { return buf_[(head_ + n_ - 1) & (buf_.size() - 1)]; }
    void pop_front() {
        head_ = (head_ + 1) & (buf_.size() - 1);
        --n_;
    }
    void push_back(const T& v) {
        if (n_ == buf_.size()) grow();
        buf_[(head_ + n_) & (buf_.size() - 1)] = v;
        ++n_;
    }
    class const_iterator {
      public:
        const_iterator(const Fifo* f, std::size_t i) : f_(f), i_(i) {}
        const T& operator*() const { return f_->buf_[(f_->head_ + i_) & (f_->buf_.size() - 1)]; }
        const_iterator& operator++() {
            ++i_;
            return *this;
        }
        bool operator!=(const const_iterator& o) const { return i_ != o.i_; }

      private:
        const Fifo* f_;
        std::size_t i_;
    };
    const_iterator begin() const { return const_iterator(this, 0); }
    const_iterator end() const { return const_iterator(this, n_); }

  private:
    void grow() {   // the elements, oldest first, at the start of a ring twice as large (16 at first)
        std::vector<T> bigger(buf_.empty() ? 16 : 2 * buf_.size());
        for (std::size_t i = 0; i < n_; ++i) bigger[i] = buf_[(head_ + i) & (buf_.size() - 1)];
        buf_.swap(bigger);
        head_ = 0;
    }
    std::vector<T> buf_;
    std::size_t head_ = 0, n_ = 0;
};

// Every method is called with the GIL held. Python handle objects (PhysicalHandle, Event) live in
// tables indexed by the ChunkHandle / EventHandle ids the engine sees (id = index + 1, never 0).
//
// Note [Device exceptions live for one operation]: a device call that raises is thrown as a
// BackendError whose py_exc points to the Python exception; the backend keeps that exception
// (a reference in the calling thread's list in `errors_`) until clear_errors(), which the binding
// calls on that thread at the end of each operation, after it has re-raised the one that escaped.
// So an exception the engine handles and drops (a failed event_destroy, an undo that failed) is
// not leaked, and the one re-raised is the very object the device raised. py_exc is therefore a
// borrowed pointer, valid until then. The lists are per thread (keyed by the thread's ident, under
// the GIL): one thread ending its operation never drops an exception that another thread's
// operation, still running in the engine, points to.
class PyDeviceBackend : public Backend {
  public:
    // Borrows nothing: keeps its own references. Raises (Python error set, returns false from
    // ok()) when the device lacks what the engine needs.
    PyDeviceBackend(PyObject* device, PyObject* oom_error_cls, PyObject* device_lost_cls);
    ~PyDeviceBackend() override;
    bool ok() const { return ok_; }

    // Backend's interface (backend.h): C++ declares the overrides in each backend, so this list repeats
    DeviceInfo info() override;
    void mem_info(std::uint64_t* free_nbytes, std::uint64_t* total_nbytes) override;
    std::uint64_t address_reserve(std::uint64_t nbytes, std::uint64_t alignment) override;
    void address_free(std::uint64_t va, std::uint64_t nbytes) override;
    ChunkHandle mem_create(std::uint64_t nbytes) override;
    void mem_release(ChunkHandle handle) override;
    void mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) override;
    void mem_set_access(std::uint64_t va, std::uint64_t nbytes) override;
    void mem_unmap(std::uint64_t va, std::uint64_t nbytes) override;
    EventHandle event_record(StreamHandle stream) override;
    bool event_query(EventHandle event) override;
    void event_synchronize(EventHandle event) override;
    void stream_wait_event(StreamHandle stream, EventHandle event) override;
    void event_destroy(EventHandle event) override;
    void engine_work(std::uint64_t pages_indexed) override;
    void stream_synchronize(StreamHandle stream) override;
    void synchronize() override;
    std::uint64_t segment_malloc(std::uint64_t nbytes) override;   // device.malloc(nbytes)
    void segment_free(std::uint64_t ptr) override;                 // device.free(ptr)

    // Drops the exceptions kept for the calling thread's operation (GIL held).
    void clear_errors();
    // The PhysicalHandle object of a chunk id (borrowed), or null.
    PyObject* chunk_object(ChunkHandle id) const;
    std::size_t chunk_table_size() const { return chunks_.size(); }
    // Visits the Python objects it holds (the allocator's tp_traverse).
    int traverse(visitproc visit, void* arg);
    bool idle_twin() const { return twin_ != nullptr; }
    // The device closed: from now on the twin sends every call to the device, which raises as it does when closed.
    void twin_device_closed() {
        if (twin_) twin_->device_closed = true;
    }
    // Device.mapping_ranges() of the twin's mappings (a new list), for the consistency check.
    PyObject* twin_mapping_ranges();

    // Note [A twin that runs the program's GPU work] (pybackend.cpp): the `model` GPU timing's constants, the
    // device's latencies (us) of the calls the twin makes, and the device's clock (a gpumem.sim.clock.SimClock).
    struct GpuLag {
        double cpu_op_s = 0, kernel_min_s = 0, touch_factor = 0, bandwidth_bps = 1;
        std::size_t queue_depth = 1;
        double launch_us = 0, event_record_us = 0, event_query_us = 0, event_destroy_us = 0, synchronize_us = 0,
               mem_map_us = 0, set_access_us = 0, set_access_mapping_us = 0, set_access_mib_us = 0, unmap_us = 0,
               unmap_mapping_us = 0, unmap_mib_us = 0, stream_wait_event_us = 0;
    };
    // Note [An idle device's bookkeeping calls made here] (pybackend.cpp). Turns it on: "" when done, else why
    // not (a Python error may be set: then the text is empty too, check PyErr_Occurred). Refused while a chunk, an
    // event or a mapping exists or the twin is on; the device's granularity and reservations are read.
    // With `lag` (and the device's SimClock `clock`) the twin runs the program's GPU work from the start (Note [A twin
    // that runs the program's GPU work]); its constants are checked before anything changes.
    std::string use_idle_twin(const GpuLag* lag = nullptr, PyObject* clock = nullptr);
    bool gpu_lag() const { return twin_ && twin_->lag; }
    // The CPU reaches the program's next op (ProgramGpu.before); after an allocation of `nbytes` at `ptr` on
    // `stream`, the kernel that follows it is queued (ProgramGpu.after). Throw BackendError on a refusal.
    void lag_before();
    void lag_after(StreamHandle stream, std::uint64_t ptr, std::uint64_t nbytes);
    // What the lagged twin did: a new dict (now_s, launches, queue_full_waits, pending), or None when off.
    PyObject* lag_stats();
    // Throws the Python exception being raised as a BackendError, classified and kept as a device
    // call's (Note [Device exceptions live for one operation]): for Python code the binding runs
    // on the engine's behalf inside an operation (the device listings of consistency_problems).
    [[noreturn]] void raise_current();

  private:
    PyObject* call(PyObject* name, PyObject* a = nullptr, PyObject* b = nullptr, PyObject* c = nullptr,
                   PyObject* d = nullptr);
    void call_void(PyObject* name, PyObject* a = nullptr, PyObject* b = nullptr, PyObject* c = nullptr,
                   PyObject* d = nullptr);
    static std::uint64_t put(std::vector<PyObject*>& table, std::vector<std::uint64_t>& free_ids, PyObject* obj);
    PyObject* get(const std::vector<PyObject*>& table, std::uint64_t id, const char* what);

    PyObject* device_;
    PyObject* oom_cls_;
    PyObject* lost_cls_;
    bool ok_ = false;
    std::vector<PyObject*> chunks_, events_;
    std::unordered_map<unsigned long, std::vector<PyObject*>> errors_;   // thread ident -> exceptions kept
    std::vector<std::uint64_t> free_chunk_ids_, free_event_ids_;
    PyObject *n_properties_, *n_mem_info_, *n_address_reserve_, *n_address_free_, *n_mem_create_, *n_mem_release_,
        *n_mem_map_, *n_mem_set_access_, *n_mem_unmap_, *n_event_record_, *n_event_query_, *n_event_synchronize_,
        *n_event_destroy_, *n_stream_wait_event_, *n_stream_synchronize_, *n_synchronize_, *n_free_nbytes_, *n_total_nbytes_,
        *n_granularity_nbytes_, *n_vmm_supported_;
    PyObject *n_malloc_ = nullptr, *n_free_ = nullptr;   // segment mode
    PyObject* n_now_s_ = nullptr;                         // SimClock.now_s (the twin's GPU lag)
    PyObject* n_engine_work_ = nullptr;                   // Device.engine_work; null: the device has none

    // What the device's books would hold for the calls the twin makes (Note [An idle device's bookkeeping
    // calls made here]); its events are ids with kTwinEvent set.
    struct TwinMap {
        std::uint64_t nbytes;
        ChunkHandle chunk;
        bool access;   // mem_set_access covered it (a launch touches only such memory)
    };
    // The program's GPU work (Note [A twin that runs the program's GPU work]).
    struct LagWork {
        double end_s;
        std::uint64_t ptr, nbytes;
    };
    struct Lag {
        GpuLag m;
        PyObject* clock = nullptr;   // owned: the device's SimClock, its now_s kept equal to now_s at device calls
        double now_s = 0;
        bool through_now = false;    // work ending at exactly now_s is done (the clock waited for it)
        bool fresh_start = false;    // a stream started since the clock last moved (SimPy's Initialize is due)
        // unfinished work, FIFO per stream (an idle stream keeps its empty queue: no allocation per restart)
        std::vector<std::pair<StreamHandle, Fifo<LagWork>>> streams;
        Fifo<LagWork>* queue(StreamHandle stream) {
            for (auto& kv : streams)
                if (kv.first == stream) return &kv.second;
            return nullptr;
        }
        Fifo<double> launched;     // ProgramGpu's launch queue: the ends of the work launched, oldest first
        std::unordered_map<EventHandle, double> events;   // twin event -> the end of the work it waits for
        std::uint64_t launches = 0, queue_full_waits = 0;
        // Ranges launches found mapped with access, [lo, hi) each, 0 to kOkRanges of them (cleared by unmaps:
        // Note [Ranges known mapped]); the oldest gives way to a new one.
        static constexpr unsigned kOkRanges = 8;
        std::pair<std::uint64_t, std::uint64_t> ok[kOkRanges] = {};
        unsigned ok_n = 0, ok_next = 0;
        std::uint64_t ok_walks = 0;   // launches whose range no known one held (the mappings walked)
        ~Lag() { Py_XDECREF(clock); }
    };
    struct IdleTwin {
        std::uint64_t gran = 0;
        std::map<std::uint64_t, TwinMap> maps;   // va -> mapping
        std::vector<std::pair<std::uint64_t, std::uint64_t>> reservations;     // (va, nbytes)
        std::vector<std::uint64_t> chunk_nbytes;   // by chunk id - 1; 0: no such chunk
        std::vector<std::uint32_t> chunk_maps;     // mappings of each chunk
        std::uint64_t events = 0;                  // recorded so far
        bool device_closed = false;                // twin_device_closed() was called
        std::unique_ptr<Lag> lag;                  // use_idle_twin(lag): the program's GPU runs behind
    };
    static constexpr EventHandle kTwinEvent = EventHandle{1} << 63;
    std::unique_ptr<IdleTwin> twin_;
    [[noreturn]] static void twin_refuses(const std::string& what);
    void twin_check_range(const char* call, std::uint64_t va, std::uint64_t nbytes) const;
    // Whether the twin makes the calls now (on, and the device not closed under it).
    bool twin_makes_calls() const { return twin_ && !twin_->device_closed; }
    // Whether `event` is one of the twin's (complete); once the device is closed, the device's own refusal.
    bool twin_event(EventHandle event);
    // The lag's clock (Note [A twin that runs the program's GPU work]).
    void lag_advance(double cost_us);
    void lag_advance_s(double seconds);
    bool lag_done(double end_s) const;
    void lag_wait(double end_s);
    void lag_prune();
    bool lag_known_mapped(std::uint64_t lo, std::uint64_t hi) const;
    void lag_note_mapped(std::uint64_t lo, std::uint64_t hi);
    void lag_wait_stream(const Fifo<LagWork>& q);
};

}  // namespace gpumem
