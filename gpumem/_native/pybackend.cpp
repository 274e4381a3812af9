// PyDeviceBackend: the engine's device calls made on a Python gpumem.device.Device, through its
// public methods, exactly as the Python allocator makes them (same methods, same arguments), so
// that the device's validation, the simulator's sanitizer and fault injection, and its memory
// events behave the same under both engines. See pybackend.h.
#include "pybackend.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

namespace gpumem {

namespace {
PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

std::uint64_t as_u64(PyObject* o, bool* ok) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    *ok = !(v == static_cast<unsigned long long>(-1) && PyErr_Occurred());
    return v;
}
}  // namespace

PyDeviceBackend::PyDeviceBackend(PyObject* device, PyObject* oom_error_cls, PyObject* device_lost_cls)
    : device_(device), oom_cls_(oom_error_cls), lost_cls_(device_lost_cls) {
    Py_INCREF(device_);
    Py_INCREF(oom_cls_);
    Py_INCREF(lost_cls_);
    n_properties_ = intern("properties");
    n_mem_info_ = intern("mem_info");
    n_address_reserve_ = intern("address_reserve");
    n_address_free_ = intern("address_free");
    n_mem_create_ = intern("mem_create");
    n_mem_release_ = intern("mem_release");
    n_mem_map_ = intern("mem_map");
    n_mem_set_access_ = intern("mem_set_access");
    n_mem_unmap_ = intern("mem_unmap");
    n_event_record_ = intern("event_record");
    n_event_query_ = intern("event_query");
    n_event_synchronize_ = intern("event_synchronize");
    n_stream_wait_event_ = intern("stream_wait_event");
    n_event_destroy_ = intern("event_destroy");
    n_stream_synchronize_ = intern("stream_synchronize");
    n_synchronize_ = intern("synchronize");
    n_free_nbytes_ = intern("free_nbytes");
    n_total_nbytes_ = intern("total_nbytes");
    n_granularity_nbytes_ = intern("granularity_nbytes");
    n_vmm_supported_ = intern("vmm_supported");
    n_malloc_ = intern("malloc");
    n_free_ = intern("free");
    n_now_s_ = intern("now_s");
    n_engine_work_ = intern("engine_work");
    if (n_engine_work_) {   // a stand-in device may have none, or None: the work goes untold (as backing.py decides)
        PyObject* f = PyObject_GetAttr(device_, n_engine_work_);
        if (!f) PyErr_Clear();   // a property that raises counts as none
        if (!f || f == Py_None) {
            Py_DECREF(n_engine_work_);
            n_engine_work_ = nullptr;
        }
        Py_XDECREF(f);
    }
    ok_ = n_vmm_supported_ != nullptr && n_malloc_ != nullptr && n_free_ != nullptr;
}

PyDeviceBackend::~PyDeviceBackend() {
    auto all = std::move(errors_);
    errors_.clear();
    for (auto& kv : all)
        for (PyObject* e : kv.second) Py_DECREF(e);
    for (PyObject* o : chunks_) Py_XDECREF(o);
    for (PyObject* o : events_) Py_XDECREF(o);
    Py_XDECREF(device_);
    Py_XDECREF(oom_cls_);
    Py_XDECREF(lost_cls_);
}

void PyDeviceBackend::clear_errors() {
    auto it = errors_.find(PyThread_get_thread_ident());
    if (it == errors_.end()) return;
    std::vector<PyObject*> mine = std::move(it->second);
    errors_.erase(it);
    for (PyObject* e : mine) Py_DECREF(e);   // may run Python (finalizers): the tables are consistent
}

// The Python exception being raised, classified (out of memory, device lost, other) and kept
// (Note [Device exceptions live for one operation]).
void PyDeviceBackend::raise_current() {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) throw BackendError(ErrorKind::kOther, 0, "device call failed with no exception set");
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    Py_XDECREF(tb);
    Py_XDECREF(type);
    if (!value) throw BackendError(ErrorKind::kOther, 0, "device call failed");
    ErrorKind kind = ErrorKind::kOther;
    if (PyErr_GivenExceptionMatches(value, oom_cls_)) kind = ErrorKind::kOutOfMemory;
    else if (PyErr_GivenExceptionMatches(value, lost_cls_)) kind = ErrorKind::kDeviceLost;
    std::string what;
    PyObject* s = PyObject_Str(value);
    if (s) {
        const char* u = PyUnicode_AsUTF8(s);
        if (u) what = u;
        Py_DECREF(s);
    }
    PyErr_Clear();
    bool fatal = !PyErr_GivenExceptionMatches(value, PyExc_Exception);   // Note [Only Exception is caught]
    errors_[PyThread_get_thread_ident()].push_back(value);   // owned until this thread's clear_errors()
    throw BackendError(kind, 0, what, value, fatal);
}

PyObject* PyDeviceBackend::call(PyObject* name, PyObject* a, PyObject* b, PyObject* c, PyObject* d) {
    // Note [A twin that runs the program's GPU work]: the device's clock is the twin's at each call made there
    Lag* lag = twin_ && twin_->lag && !twin_->device_closed ? twin_->lag.get() : nullptr;
    if (lag) {   // the later of the two (the device's clock moved by other calls, e.g. advance(), counts too)
        PyObject* dev_now = PyObject_GetAttr(lag->clock, n_now_s_);
        const double t = dev_now ? PyFloat_AsDouble(dev_now) : -1.0;
        Py_XDECREF(dev_now);
        int bad = !dev_now || (t == -1.0 && PyErr_Occurred()) ? -1 : 0;
        if (!bad && t > lag->now_s) {
            lag->now_s = t;
            lag->through_now = false;
            lag->fresh_start = false;
        }
        PyObject* now = bad ? nullptr : PyFloat_FromDouble(lag->now_s);
        bad = now ? PyObject_SetAttr(lag->clock, n_now_s_, now) : -1;
        Py_XDECREF(now);
        if (bad < 0) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(c);
            Py_XDECREF(d);
            raise_current();
        }
    }
    PyObject* args[5] = {device_, a, b, c, d};
    std::size_t n = 1;
    if (a) ++n;
    if (b) ++n;
    if (c) ++n;
    if (d) ++n;
    PyObject* r = PyObject_VectorcallMethod(name, args, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    Py_XDECREF(d);
    if (lag) {   // the call's time, read back (an exception raised by the call kept across the read)
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject* now = PyObject_GetAttr(lag->clock, n_now_s_);
        double t = now ? PyFloat_AsDouble(now) : -1.0;
        Py_XDECREF(now);
        if (!now || (t == -1.0 && PyErr_Occurred())) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            Py_XDECREF(r);
            raise_current();
        }
        PyErr_Restore(type, value, tb);
        if (t != lag->now_s) {
            lag->now_s = t;
            lag->through_now = false;
            lag->fresh_start = false;
        }
    }
    if (!r) raise_current();
    return r;
}

void PyDeviceBackend::call_void(PyObject* name, PyObject* a, PyObject* b, PyObject* c, PyObject* d) {
    Py_DECREF(call(name, a, b, c, d));
}

std::uint64_t PyDeviceBackend::put(std::vector<PyObject*>& table, std::vector<std::uint64_t>& free_ids, PyObject* obj) {
    if (!free_ids.empty()) {
        std::uint64_t id = free_ids.back();
        free_ids.pop_back();
        table[id - 1] = obj;
        return id;
    }
    table.push_back(obj);
    return table.size();
}

PyObject* PyDeviceBackend::get(const std::vector<PyObject*>& table, std::uint64_t id, const char* what) {
    if (id == 0 || id > table.size() || !table[id - 1])
        throw BackendError(ErrorKind::kOther, 0, std::string("unknown ") + what + " id " + std::to_string(id));
    return table[id - 1];
}

PyObject* PyDeviceBackend::chunk_object(ChunkHandle id) const {
    if (id == 0 || id > chunks_.size()) return nullptr;
    return chunks_[id - 1];
}

int PyDeviceBackend::traverse(visitproc visit, void* arg) {
    Py_VISIT(device_);
    Py_VISIT(oom_cls_);
    Py_VISIT(lost_cls_);
    for (PyObject* o : chunks_) Py_VISIT(o);
    for (PyObject* o : events_) Py_VISIT(o);
    if (twin_ && twin_->lag) Py_VISIT(twin_->lag->clock);
    for (auto& kv : errors_)
        for (PyObject* o : kv.second) Py_VISIT(o);
    return 0;
}

static PyObject* u64(std::uint64_t v) { return PyLong_FromUnsignedLongLong(v); }

DeviceInfo PyDeviceBackend::info() {
    DeviceInfo out;
    PyObject* props = call(n_properties_);
    PyObject* total = PyObject_GetAttr(props, n_total_nbytes_);
    PyObject* gran = total ? PyObject_GetAttr(props, n_granularity_nbytes_) : nullptr;
    PyObject* vmm = gran ? PyObject_GetAttr(device_, n_vmm_supported_) : nullptr;
    Py_DECREF(props);
    bool ok1 = false, ok2 = false;
    if (vmm) {
        out.total_nbytes = as_u64(total, &ok1);
        out.granularity_nbytes = ok1 ? as_u64(gran, &ok2) : 0;
        int t = ok2 ? PyObject_IsTrue(vmm) : -1;
        out.vmm_supported = t == 1;
        ok2 = ok2 && t >= 0;
    }
    Py_XDECREF(total);
    Py_XDECREF(gran);
    Py_XDECREF(vmm);
    if (!ok2) raise_current();
    return out;
}

void PyDeviceBackend::mem_info(std::uint64_t* free_nbytes, std::uint64_t* total_nbytes) {
    PyObject* mi = call(n_mem_info_);
    PyObject* f = PyObject_GetAttr(mi, n_free_nbytes_);
    PyObject* t = f ? PyObject_GetAttr(mi, n_total_nbytes_) : nullptr;
    Py_DECREF(mi);
    bool ok1 = false, ok2 = false;
    if (t) {
        *free_nbytes = as_u64(f, &ok1);
        *total_nbytes = ok1 ? as_u64(t, &ok2) : 0;
    }
    Py_XDECREF(f);
    Py_XDECREF(t);
    if (!ok2) raise_current();
}

std::uint64_t PyDeviceBackend::address_reserve(std::uint64_t nbytes, std::uint64_t alignment) {
    // as VirtualBacking._segment calls it: device.address_reserve(va_nbytes)
    PyObject* r = alignment ? call(n_address_reserve_, u64(nbytes), u64(alignment)) : call(n_address_reserve_, u64(nbytes));
    bool ok;
    std::uint64_t va = as_u64(r, &ok);
    Py_DECREF(r);
    if (!ok) raise_current();
    if (twin_) twin_->reservations.emplace_back(va, nbytes);   // kept after a close too: frees still check
    return va;
}

void PyDeviceBackend::address_free(std::uint64_t va, std::uint64_t nbytes) {
    if (twin_makes_calls()) {   // the device refuses to free a range with mappings in it: so does the twin, first
        auto& rs = twin_->reservations;
        auto it = std::find(rs.begin(), rs.end(), std::make_pair(va, nbytes));
        if (it == rs.end()) twin_refuses("address_free of a range that is not a reservation");
        auto m = twin_->maps.lower_bound(va);
        if (m != twin_->maps.end() && m->first < va + nbytes) twin_refuses("address_free of a range still mapped");
        call_void(n_address_free_, u64(va), u64(nbytes));
        rs.erase(it);
        return;
    }
    call_void(n_address_free_, u64(va), u64(nbytes));
}

ChunkHandle PyDeviceBackend::mem_create(std::uint64_t nbytes) {
    PyObject* h = call(n_mem_create_, u64(nbytes));
    ChunkHandle id = put(chunks_, free_chunk_ids_, h);
    if (twin_) {
        if (twin_->chunk_nbytes.size() < chunks_.size()) {
            twin_->chunk_nbytes.resize(chunks_.size(), 0);
            twin_->chunk_maps.resize(chunks_.size(), 0);
        }
        twin_->chunk_nbytes[id - 1] = nbytes;
    }
    return id;
}

void PyDeviceBackend::mem_release(ChunkHandle handle) {
    PyObject* h = get(chunks_, handle, "chunk");
    // the device would keep a released chunk's memory until its last mapping goes, which it never sees here
    if (twin_makes_calls() && twin_->chunk_maps[handle - 1]) twin_refuses("mem_release of a chunk still mapped");
    Py_INCREF(h);
    call_void(n_mem_release_, h);
    Py_DECREF(chunks_[handle - 1]);
    chunks_[handle - 1] = nullptr;
    free_chunk_ids_.push_back(handle);
    if (twin_) twin_->chunk_nbytes[handle - 1] = 0;
}

// Note [An idle device's bookkeeping calls made here]
//     A long decode under the gpumem policy moves pages every step, a million mem_map/mem_unmap pairs and as
//     many event calls in a 6,000-token estimate, and the simulated device's Python methods were about 77 % of
//     its time (reports/estimate-speed.md, round 9). On a device where nothing else can happen (SimDevice.runs_alone: no
//     tenants, no planned faults, no GPU work, no call that waits for the device) those calls change only the
//     device's books of mappings and events and its clock; every event is complete when recorded. The twin keeps
//     the same books in C++ and makes those calls itself: mem_map, mem_set_access and mem_unmap with the
//     device's checks (granular arguments, inside a reservation, not over a mapping, a chunk large enough,
//     whole mappings unmapped, a mapped range given access), event_record/query/synchronize/destroy (complete
//     at once). Memory itself (mem_create, mem_release, mem_info), reservations and synchronisation still go to
//     the device, so its free memory, out-of-memory errors and allocation faults are the device's own; a chunk
//     released while the twin still maps it is refused (the device would keep its memory until the unmap). So
//     the engine sees the same results, call for call (tests/estimate/test_idle_twin.py compares whole
//     estimates and the engine's calls); the device's call counts and clock then leave these calls out. Only
//     gpumem.estimate turns it on, on devices it opened itself.
void PyDeviceBackend::twin_refuses(const std::string& what) {
    throw BackendError(ErrorKind::kOther, 0, "idle device twin: " + what);
}

void PyDeviceBackend::twin_check_range(const char* call, std::uint64_t va, std::uint64_t nbytes) const {
    const std::uint64_t g = twin_->gran;
    if (va == 0 || nbytes == 0 || va % g || nbytes % g || va + nbytes < va)
        twin_refuses(std::string(call) + ": va and nbytes must be positive multiples of the granularity");
    for (const auto& r : twin_->reservations)
        if (va >= r.first && va + nbytes <= r.first + r.second) return;
    twin_refuses(std::string(call) + ": the range is not inside one reservation");
}

std::string PyDeviceBackend::use_idle_twin(const GpuLag* lag_spec, PyObject* clock) {
    if (twin_) return "the idle device twin is on already";
    std::unique_ptr<Lag> lag;
    if (lag_spec) {   // checked first: a refusal changes nothing
        const GpuLag& m = *lag_spec;
        const double us[] = {m.cpu_op_s, m.kernel_min_s, m.touch_factor, m.launch_us, m.event_record_us,
                             m.event_query_us, m.event_destroy_us, m.synchronize_us, m.mem_map_us, m.set_access_us,
                             m.set_access_mapping_us, m.set_access_mib_us, m.unmap_us, m.unmap_mapping_us,
                             m.unmap_mib_us, m.stream_wait_event_us};
        for (double v : us)
            if (!(v >= 0) || !std::isfinite(v)) return "the GPU lag's times must be finite numbers >= 0";
        if (!(m.bandwidth_bps > 0) || !std::isfinite(m.bandwidth_bps)) return "the GPU lag's bandwidth must be > 0";
        if (m.queue_depth < 1) return "the GPU lag's queue depth must be >= 1";
        if (!clock) return "the GPU lag needs the device's clock";
        PyObject* now = PyObject_GetAttr(clock, n_now_s_);
        if (!now) return "";
        const double t = PyFloat_AsDouble(now);
        Py_DECREF(now);
        if (t == -1.0 && PyErr_Occurred()) return "";
        if (!std::isfinite(t)) return "the device's clock is not finite";
        lag = std::make_unique<Lag>();
        lag->m = m;
        lag->now_s = t;
        Py_INCREF(clock);
        lag->clock = clock;
    }
    for (PyObject* o : chunks_)
        if (o) return "the idle device twin must be turned on while the engine holds no chunk";
    for (PyObject* o : events_)
        if (o) return "the idle device twin must be turned on while the engine holds no event";
    auto twin = std::make_unique<IdleTwin>();
    try {
        twin->gran = info().granularity_nbytes;
    } catch (const BackendError& e) {
        clear_errors();
        return std::string("the device's granularity: ") + e.what();
    }
    if (twin->gran == 0) return "the device's granularity is 0";
    PyObject* maps = PyObject_CallMethod(device_, "mapping_ranges", nullptr);
    if (!maps) return "";
    Py_ssize_t n_maps = PyObject_Length(maps);
    Py_DECREF(maps);
    if (n_maps < 0) return "";
    if (n_maps != 0) return "the idle device twin needs a device with no mapping";
    PyObject* rs = PyObject_CallMethod(device_, "reservation_ranges", nullptr);
    PyObject* seq = rs ? PySequence_Fast(rs, "reservation_ranges() must return a sequence") : nullptr;
    Py_XDECREF(rs);
    if (!seq) return "";
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
        unsigned long long va = 0, nb = 0;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &va, &nb)) {
            Py_DECREF(seq);
            return "";
        }
        twin->reservations.emplace_back(va, nb);
    }
    Py_DECREF(seq);
    twin->lag = std::move(lag);
    twin_ = std::move(twin);
    return {};
}

bool PyDeviceBackend::twin_event(EventHandle event) {
    if (!(event & kTwinEvent)) return false;
    if (!twin_makes_calls()) {   // the device closed under the twin: its own refusal, as its event calls make it
        PyObject* r = PyObject_CallMethod(device_, "_check_usable", nullptr);
        if (!r) raise_current();
        Py_DECREF(r);
    }
    return true;
}

PyObject* PyDeviceBackend::twin_mapping_ranges() {
    PyObject* out = PyList_New(0);
    if (!out || !twin_) return out;
    for (const auto& m : twin_->maps) {
        PyObject* h = chunks_[m.second.chunk - 1];
        PyObject* handle = PyObject_GetAttrString(h, "handle");
        PyObject* t = handle ? Py_BuildValue("(KKN)", static_cast<unsigned long long>(m.first),
                                             static_cast<unsigned long long>(m.second.nbytes), handle) : nullptr;
        if (!t || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return nullptr;
        }
        Py_DECREF(t);
    }
    return out;
}

// Note [A twin that runs the program's GPU work]
//     The idle twin completes every event when recorded, so the estimate's replay of a long decode steals pages
//     the GPU would still be reading: its gpumem figure fell under live runs until a stand-in (a 24 MiB "decode
//     slack") was added, which overshoots by up to 54 MiB and sets off a storm of page moves
//     (reports/decode-lag-2026-11-29.md). The simulator's `model` GPU timing (Note [The GPU runs behind the CPU]
//     in gpumem/sim/gpu_work.py) predicts seven live decodes 4-6 MiB from above, but runs in SimPy. Turned on with
//     a GpuLag, the twin keeps that timing's clock itself, as SimPy would keep it for a program alone on the
//     device: lag_before() is ProgramGpu.before (the CPU's time per op), lag_after() ProgramGpu.after (the
//     kernel after an allocation, FIFO per stream, the launch queue bounded, a launch touching memory not mapped
//     with access refused), every call the twin makes costs the device's latency for it, an event is the end of
//     its stream's last unfinished work when recorded, a synchronisation waits for it, and mem_unmap of memory
//     that unfinished work touches is refused (the simulator's sanitizer). The calls that still go to the device
//     (memory, reservations, synchronisation) run at the twin's time: its clock is set before each and read
//     after, so the device's latency model prices them. Done means what SimPy's clock does: an end before now, or
//     at now once the clock waited for it. The same arithmetic in the same order gives the same times to the
//     bit; tests/estimate/test_gpu_lag_twin.py holds the estimate to replay_trace(..., gpu_timing="model").
//     Only a device whose latency model prices every call idle (no busy factor) and whose sanitizer raises takes
//     it; a refusal is an InternalError (the simulator's MemoryHazardError), as it means an engine bug. Limits: the
//     device's own synchronize() and advance() (called by others than the engine) do not see the twin's work, and
//     its clock is the twin's only as of the last call made there (the twin takes the later of the two at the next
//     one); work of several streams ending at one instant (kernels shorter than the clock's resolution, latencies
//     zero) is done together after a wait, where SimPy may finish it one event at a time; a kernel refused as not
//     finite is refused before a full launch queue's wait, where the simulator waits first.
void PyDeviceBackend::lag_prune() {
    Lag& lag = *twin_->lag;
    for (auto& kv : lag.streams)
        while (!kv.second.empty() && lag_done(kv.second.front().end_s)) kv.second.pop_front();
}

bool PyDeviceBackend::lag_done(double end_s) const {
    const Lag& lag = *twin_->lag;
    return end_s < lag.now_s || (end_s == lag.now_s && lag.through_now);
}

// SimClock.advance of cost_us * 1e-6 s: the events due before the new time run (run_to stops at
// now + (until - now)), else the clock just moves.
void PyDeviceBackend::lag_advance(double cost_us) { lag_advance_s(cost_us * 1e-6); }

void PyDeviceBackend::lag_advance_s(double seconds) {
    Lag& lag = *twin_->lag;
    const double until = lag.now_s + seconds;
    if (!(until > lag.now_s)) return;
    const double stop = lag.now_s + (until - lag.now_s);
    if (stop != until) {   // where run_to stops differs (rarely: not when the subtraction is exact): was one due?
        bool due = lag.fresh_start;
        if (!due) {
            lag_prune();
            for (const auto& kv : lag.streams) due = due || (!kv.second.empty() && kv.second.front().end_s <= until);
        }
        lag.now_s = due ? stop : until;
    } else {
        lag.now_s = until;
    }
    lag.through_now = false;
    lag.fresh_start = false;
}

// SimClock.wait for the work ending at end_s: the clock at its end, that work (and all before it) done.
void PyDeviceBackend::lag_wait(double end_s) {
    Lag& lag = *twin_->lag;
    if (lag_done(end_s)) return;
    if (end_s > lag.now_s) lag.now_s = end_s;
    lag.through_now = true;
    lag.fresh_start = false;
}

void PyDeviceBackend::lag_wait_stream(const Fifo<LagWork>& q) {
    if (!q.empty()) lag_wait(q.back().end_s);
}

// Note [Ranges known mapped]
//     The sanitizer's launch check (lag_after) walks the twin's mappings over the kernel's bytes. A range it found
//     mapped with access stays so until an unmap (a map adds mappings, mem_set_access only grants access), so the
//     twin keeps a few such ranges and a launch within one of them needs no walk: the same answer as the walk,
//     made from the walks before it. Every unmap forgets them all. Until 2026-12-05 one range was kept: the 7B
//     decode's kernels land in the KV caches and the step's temporaries, far apart, and 375,916 of the 4,568,298
//     launches of its gpumem replay at 4,000 new tokens walked the map (lag_stats()["mapping_walks"]); with
//     kOkRanges of them, the oldest replaced, checked in turn, 65,417 did, and the replay at 16,000 took 0.92x
//     the time (3.30 -> 3.02 s, reports/estimate-speed-2026-12-05.md). A range found next to or over one known is
//     merged with it (their union has no gap: both are mapped with access).
bool PyDeviceBackend::lag_known_mapped(std::uint64_t lo, std::uint64_t hi) const {
    const Lag& lag = *twin_->lag;
    for (unsigned k = 0; k < lag.ok_n; ++k)
        if (lo >= lag.ok[k].first && hi <= lag.ok[k].second) return true;
    return false;
}

void PyDeviceBackend::lag_note_mapped(std::uint64_t lo, std::uint64_t hi) {
    Lag& lag = *twin_->lag;
    for (unsigned k = 0; k < lag.ok_n; ++k) {
        auto& r = lag.ok[k];
        if (lo <= r.second && r.first <= hi) {   // touching or overlapping: one run of mapped memory
            r.first = std::min(r.first, lo);
            r.second = std::max(r.second, hi);
            return;
        }
    }
    if (lag.ok_n < Lag::kOkRanges) {
        lag.ok[lag.ok_n++] = {lo, hi};
        return;
    }
    lag.ok[lag.ok_next] = {lo, hi};
    lag.ok_next = (lag.ok_next + 1) % Lag::kOkRanges;
}

void PyDeviceBackend::lag_before() {
    if (!gpu_lag()) return;
    if (!twin_makes_calls()) twin_event(kTwinEvent);   // a closed device: its own refusal
    Lag& lag = *twin_->lag;
    if (lag.m.cpu_op_s) lag_advance_s(lag.m.cpu_op_s);   // SimDevice.advance(cpu_op_us * 1e-6)
}

void PyDeviceBackend::lag_after(StreamHandle stream, std::uint64_t ptr, std::uint64_t nbytes) {
    if (!gpu_lag()) return;
    if (!twin_makes_calls()) twin_event(kTwinEvent);
    Lag& lag = *twin_->lag;
    if (!nbytes) return;   // ModelGpu.after: a zero-byte allocation queues nothing
    if (ptr + nbytes < ptr) twin_refuses("launch: ptr + nbytes is past the end of the address space");
    const double duration_s = lag.m.kernel_min_s + lag.m.touch_factor * static_cast<double>(nbytes) / lag.m.bandwidth_bps;
    if (!duration_s) return;
    if (!std::isfinite(duration_s)) twin_refuses("launch: the kernel's time is not finite");
    auto& launched = lag.launched;
    while (!launched.empty() && lag_done(launched.front())) launched.pop_front();
    if (launched.size() >= lag.m.queue_depth) {   // the launch queue is full: the CPU waits for its oldest
        ++lag.queue_full_waits;
        lag_wait(launched.front());
        while (!launched.empty() && lag_done(launched.front())) launched.pop_front();
    }
    if (ptr && nbytes && !lag_known_mapped(ptr, ptr + nbytes)) {   // the sanitizer's launch check
        ++lag.ok_walks;
        auto& maps = twin_->maps;
        auto it = maps.upper_bound(ptr);
        bool ok = it != maps.begin();
        std::uint64_t lo = 0, pos = ptr;
        if (ok) {
            --it;
            lo = it->first;
            while (pos < ptr + nbytes) {
                if (it == maps.end() || it->first > pos || it->first + it->second.nbytes <= pos || !it->second.access) {
                    ok = false;
                    break;
                }
                pos = it->first + it->second.nbytes;
                ++it;
            }
        }
        if (!ok) twin_refuses("launch: the kernel after an allocation touches memory not mapped with access");
        lag_note_mapped(lo, pos);
    }
    Fifo<LagWork>* qp = lag.queue(stream);
    const double tail_s = qp && !qp->empty() ? qp->back().end_s : lag.now_s;   // checked before anything moves
    if (!std::isfinite(std::max(tail_s, lag.now_s) + lag.m.launch_us * 1e-6 + duration_s))
        twin_refuses("launch: the kernel would end past the largest finite time");
    lag_advance(lag.m.launch_us);
    if (!qp) {
        lag.streams.emplace_back(stream, Fifo<LagWork>{});
        qp = &lag.streams.back().second;
    }
    auto& q = *qp;
    while (!q.empty() && lag_done(q.front().end_s)) q.pop_front();
    double start = lag.now_s;
    if (!q.empty()) start = q.back().end_s;   // runs when the work before it has
    if (q.empty()) lag.fresh_start = true;    // a new stream process, started now
    q.push_back(LagWork{start + duration_s, ptr, ptr ? nbytes : 0});   // ptr 0 touches nothing (ModelGpu)
    launched.push_back(start + duration_s);
    ++lag.launches;
}

PyObject* PyDeviceBackend::lag_stats() {
    if (!gpu_lag()) Py_RETURN_NONE;
    Lag& lag = *twin_->lag;
    std::size_t pending = 0;
    for (const auto& kv : lag.streams)
        for (const LagWork& w : kv.second) pending += !lag_done(w.end_s);
    return Py_BuildValue("{s:d,s:K,s:K,s:n,s:K}", "now_s", lag.now_s, "launches",
                         static_cast<unsigned long long>(lag.launches), "queue_full_waits",
                         static_cast<unsigned long long>(lag.queue_full_waits), "pending",
                         static_cast<Py_ssize_t>(pending), "mapping_walks",
                         static_cast<unsigned long long>(lag.ok_walks));
}

void PyDeviceBackend::mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) {
    PyObject* h = get(chunks_, handle, "chunk");
    if (twin_makes_calls()) {
        twin_check_range("mem_map", va, nbytes);
        if (offset % twin_->gran || offset + nbytes > twin_->chunk_nbytes[handle - 1] || offset + nbytes < offset)
            twin_refuses("mem_map: offset + nbytes exceeds the chunk");
        auto& maps = twin_->maps;
        auto next = maps.lower_bound(va);
        if ((next != maps.end() && next->first < va + nbytes) ||
            (next != maps.begin() && std::prev(next)->first + std::prev(next)->second.nbytes > va))
            twin_refuses("mem_map: the range is already mapped");
        if (twin_->lag) lag_advance(twin_->lag->m.mem_map_us);
        maps.emplace_hint(next, va, TwinMap{nbytes, handle, false});
        ++twin_->chunk_maps[handle - 1];
        return;
    }
    Py_INCREF(h);
    call_void(n_mem_map_, u64(va), u64(nbytes), h, u64(offset));
}

void PyDeviceBackend::mem_set_access(std::uint64_t va, std::uint64_t nbytes) {
    if (twin_makes_calls()) {
        twin_check_range("mem_set_access", va, nbytes);
        auto& maps = twin_->maps;
        auto it = maps.upper_bound(va);
        if (it == maps.begin()) twin_refuses("mem_set_access: the range is not mapped");
        --it;
        auto first = it;
        std::uint64_t pos = va, n_maps = 0;
        while (pos < va + nbytes) {   // mappings that cover [va, va + nbytes) without a gap
            if (it == maps.end() || it->first > pos || it->first + it->second.nbytes <= pos)
                twin_refuses("mem_set_access: the range is not mapped");
            pos = it->first + it->second.nbytes;
            ++it;
            ++n_maps;
        }
        if (twin_->lag) {   // SimDevice._do_mem_set_access's cost, in its order of operations
            const GpuLag& m = twin_->lag->m;
            lag_advance(m.set_access_us + m.set_access_mapping_us * static_cast<double>(n_maps) +
                        m.set_access_mib_us * static_cast<double>(nbytes) / 1048576.0);
        }
        for (; first != it; ++first) first->second.access = true;
        return;
    }
    call_void(n_mem_set_access_, u64(va), u64(nbytes));
}

void PyDeviceBackend::mem_unmap(std::uint64_t va, std::uint64_t nbytes) {
    if (twin_makes_calls()) {
        twin_check_range("mem_unmap", va, nbytes);
        auto& maps = twin_->maps;
        auto first = maps.find(va);
        auto it = first;
        std::uint64_t pos = va;
        while (pos < va + nbytes) {   // whole mappings, end to end, exactly the range: checked before any goes
            if (it == maps.end() || it->first != pos) twin_refuses("mem_unmap: the range is not whole mappings");
            pos += it->second.nbytes;
            ++it;
        }
        if (pos != va + nbytes) twin_refuses("mem_unmap: the range is not whole mappings");
        if (twin_->lag) {   // the sanitizer looks first (SimDevice._do_mem_unmap), then the call's cost
            Lag& lag = *twin_->lag;
            lag_prune();
            for (const auto& kv : lag.streams)
                for (const LagWork& w : kv.second)
                    if (w.ptr < va + nbytes && va < w.ptr + w.nbytes)
                        twin_refuses("mem_unmap of memory that queued GPU work still touches (wait for its event first)");
            std::uint64_t n_maps = 0;
            for (auto m = first; m != it; ++m) ++n_maps;
            lag_advance(lag.m.unmap_us + lag.m.unmap_mapping_us * static_cast<double>(n_maps) +
                        lag.m.unmap_mib_us * static_cast<double>(nbytes) / 1048576.0);
            lag.ok_n = lag.ok_next = 0;   // Note [Ranges known mapped]
        }
        for (auto m = first; m != it; ++m) --twin_->chunk_maps[m->second.chunk - 1];
        maps.erase(first, it);
        return;
    }
    call_void(n_mem_unmap_, u64(va), u64(nbytes));
}

EventHandle PyDeviceBackend::event_record(StreamHandle stream) {
    if (twin_makes_calls()) {
        const EventHandle id = kTwinEvent | ++twin_->events;   // idle: complete at once, no work is ever queued
        if (Lag* lag = twin_->lag.get()) {   // the stream's last unfinished work (SimDevice._do_event_record)
            lag_advance(lag->m.event_record_us);
            const Fifo<LagWork>* q = lag->queue(stream);
            if (q && !q->empty() && !lag_done(q->back().end_s)) lag->events.emplace(id, q->back().end_s);
        }
        return id;
    }
    PyObject* ev = call(n_event_record_, u64(stream));
    return put(events_, free_event_ids_, ev);
}

bool PyDeviceBackend::event_query(EventHandle event) {
    if (twin_event(event)) {
        Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr;
        if (!lag) return true;
        lag_advance(lag->m.event_query_us);
        auto it = lag->events.find(event);
        return it == lag->events.end() || lag_done(it->second);
    }
    PyObject* ev = get(events_, event, "event");
    Py_INCREF(ev);
    PyObject* r = call(n_event_query_, ev);
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (t < 0) raise_current();
    return t == 1;
}

void PyDeviceBackend::event_synchronize(EventHandle event) {
    if (twin_event(event)) {
        Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr;
        if (!lag) return;
        lag_advance(lag->m.synchronize_us);
        auto it = lag->events.find(event);
        if (it != lag->events.end()) lag_wait(it->second);
        return;
    }
    PyObject* ev = get(events_, event, "event");
    Py_INCREF(ev);
    call_void(n_event_synchronize_, ev);
}

// SimDevice._do_stream_wait_event: an event not complete queues a zero-length marker on `stream` that ends when the
// event's work does (StreamEngine._run: it starts when the work before it has, and waits for the event's)
void PyDeviceBackend::stream_wait_event(StreamHandle stream, EventHandle event) {
    if (twin_event(event)) {
        Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr;
        if (!lag) return;
        lag_advance(lag->m.stream_wait_event_us);
        auto it = lag->events.find(event);
        if (it == lag->events.end() || lag_done(it->second)) return;
        Fifo<LagWork>* qp = lag->queue(stream);
        if (!qp) {
            lag->streams.emplace_back(stream, Fifo<LagWork>{});
            qp = &lag->streams.back().second;
        }
        auto& q = *qp;
        while (!q.empty() && lag_done(q.front().end_s)) q.pop_front();
        if (q.empty()) lag->fresh_start = true;   // a new stream process, started now
        const double start = q.empty() ? lag->now_s : q.back().end_s;
        q.push_back(LagWork{std::max(start, it->second), 0, 0});
        return;
    }
    PyObject* ev = get(events_, event, "event");
    Py_INCREF(ev);
    call_void(n_stream_wait_event_, u64(stream), ev);
}

void PyDeviceBackend::event_destroy(EventHandle event) {
    if (twin_event(event)) {
        Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr;
        if (!lag) return;
        lag_advance(lag->m.event_destroy_us);
        lag->events.erase(event);
        return;
    }
    PyObject* ev = get(events_, event, "event");
    // the engine never uses an event again once it tried to destroy it (StreamFences._retire)
    events_[event - 1] = nullptr;
    free_event_ids_.push_back(event);
    call_void(n_event_destroy_, ev);   // steals the table's reference
}

// Device.engine_work, through call(): with the twin's GPU lag the device's clock is the twin's before it and read
// back after, so the engine's time moves the twin's clock as it moves SimPy's
void PyDeviceBackend::engine_work(std::uint64_t pages_indexed) {
    if (n_engine_work_) call_void(n_engine_work_, u64(pages_indexed));
}

void PyDeviceBackend::stream_synchronize(StreamHandle stream) {
    call_void(n_stream_synchronize_, u64(stream));   // its cost on the device; then the twin's work, if any
    if (Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr) {
        if (const Fifo<LagWork>* q = lag->queue(stream)) lag_wait_stream(*q);
    }
}

void PyDeviceBackend::synchronize() {
    call_void(n_synchronize_);
    if (Lag* lag = twin_makes_calls() ? twin_->lag.get() : nullptr)
        for (const auto& kv : lag->streams) lag_wait_stream(kv.second);   // SimDevice._do_synchronize: every tail
}

std::uint64_t PyDeviceBackend::segment_malloc(std::uint64_t nbytes) {
    // as SegmentBacking.new_segment calls it: device.malloc(seg_nbytes)
    PyObject* r = call(n_malloc_, u64(nbytes));
    bool ok;
    std::uint64_t ptr = as_u64(r, &ok);
    Py_DECREF(r);
    if (!ok) raise_current();
    return ptr;
}

void PyDeviceBackend::segment_free(std::uint64_t ptr) { call_void(n_free_, u64(ptr)); }

}  // namespace gpumem
