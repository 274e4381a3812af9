// gpumem._engine: the CPython binding of the native engine (plain C API, no binding library).
//
// Allocator(device, helpers, policy): an Engine over a PyDeviceBackend. allocate() and free()
// are METH_FASTCALL and run the engine's hot path with no Python frame and no device call; anything
// else (a cache miss, a free that records events, record_stream, empty_cache...) runs inside
// `device.deferred_events()`, as the Python allocator's operations do (Note [Callbacks run outside
// the allocator] in caching.py): memory events reach subscribers after the engine's lock is
// released. The GIL is held throughout (the Python backend needs it), except while waiting for the
// engine's lock (Note [Waiting for the engine's lock] in engine.h). `helpers` is the module
// gpumem.allocator.native: argument checks and error construction on slow paths.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.h"
#include "op_table.h"
#include "pybackend.h"

using gpumem::BackendError;
using gpumem::Engine;
using gpumem::EngineConfig;
using gpumem::EngineError;
using gpumem::EngineErrorKind;
using gpumem::EngineStats;
using gpumem::PyDeviceBackend;
using gpumem::StatField;
using gpumem::kStatFields;

namespace {

struct AllocObject {
    PyObject_HEAD
    Engine* engine;
    PyDeviceBackend* backend;
    PyObject* device;
    PyObject* helpers;
    PyObject* deferred;   // device.deferred_events (bound method) or null
    PyObject* spec;       // device.spec (str) for error messages
    unsigned long long round_nbytes;   // the policy's rounding, for OOM messages (helpers.oom_error)
    // frees that came back from a device call of this thread's own operation, applied when it ends
    // (Note [A free from inside a device call is deferred])
    std::vector<std::uint64_t>* deferred_frees;
};

// Note [A free from inside a device call is deferred]: a device call the engine makes under its
// lock runs Python (the simulator's code, a device wrapper), and so may run a finalizer, the
// cyclic GC or a signal handler, which may free an allocation (a tensor's __del__) on the thread
// that holds the lock. The Python allocator's lock is an RLock: the free runs at once, in the
// middle of the outer operation. The engine's lock is not taken twice by one thread (Note
// [Re-entry from the lock's thread] in engine.cpp), so such a free is queued here and applied, in
// order, when the outer operation has left the engine, before its memory events are delivered.
// Its cost: the block is cached a little later than in the Python allocator (the outer operation
// may grow where the Python one would have reused it). An error of a deferred free (a double
// free) can no longer reach its caller, which has returned: it is reported as an unraisable
// exception, as an exception in a finalizer is. Other operations re-entered that way raise
// InternalError instead of deadlocking; reads (stats, block_size...) run.

// The allocator's fields are dropped by the garbage collector's tp_clear (a reference cycle
// through it): every method first checks that it still has its engine.
bool alive(AllocObject* self) {
    if (self->engine) return true;
    PyErr_SetString(PyExc_RuntimeError,
                    "gpumem allocator: cleared by the garbage collector (it was part of a collected reference cycle)");
    return false;
}
#define CHECK_ALIVE(self) \
    if (!alive(self)) return nullptr

void* release_gil() { return PyEval_SaveThread(); }
// Counts the waits for an engine's lock this thread made with the GIL released (reacquire_gil): other
// threads may have run Python meanwhile (run_ops' device check).
thread_local std::uint64_t run_ops_gil_waits = 0;
void reacquire_gil(void* token) {
    PyEval_RestoreThread(static_cast<PyThreadState*>(token));
    ++run_ops_gil_waits;
}

PyObject* helper_attr(AllocObject* self, const char* name) {
    if (!self->helpers) {
        PyErr_SetString(PyExc_RuntimeError, "gpumem allocator: cleared by the garbage collector");
        return nullptr;
    }
    return PyObject_GetAttrString(self->helpers, name);
}

void raise_kind(AllocObject* self, const char* cls_name, const char* msg) {
    PyObject* cls = helper_attr(self, cls_name);
    if (!cls) return;
    if (PyExceptionClass_Check(cls)) PyErr_SetString(cls, msg);
    else PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.%s must be an exception class, got %.80s (%s)",
                      cls_name, Py_TYPE(cls)->tp_name, msg);
    Py_DECREF(cls);
}

// Note [Helpers' results are checked]: what a helper (gpumem.allocator.native, or a module passed
// in its place) returns is checked before it is read, so that a wrong type is a TypeError naming
// the helper, never a read through an unchecked tuple or a value taken for an int.

// helpers.<name>(arg), which must return an int: a new reference, or null with an error set.
PyObject* call_int_helper(AllocObject* self, const char* name, PyObject* arg) {
    PyObject* fn = helper_attr(self, name);
    if (!fn) return nullptr;
    PyObject* r = PyObject_CallOneArg(fn, arg);
    Py_DECREF(fn);
    if (r && !PyLong_Check(r)) {
        PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.%s returned %.80s, expected an int", name,
                     Py_TYPE(r)->tp_name);
        Py_CLEAR(r);
    }
    return r;
}

// Turns the C++ exception being handled into the Python exception the Python allocator raises.
// huge_nbytes: the request of this allocate() when it is >= 2**64 (borrowed), else null.
void set_error(AllocObject* self, PyObject* huge_nbytes = nullptr) {
    try {
        throw;
    } catch (const BackendError& e) {
        if (e.py_exc) {
            PyObject* exc = static_cast<PyObject*>(e.py_exc);
            PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(exc));
            PyObject* tb = PyException_GetTraceback(exc);
            Py_INCREF(type);
            Py_INCREF(exc);
            PyErr_Restore(type, exc, tb);
        } else {
            const char* cls = e.kind == gpumem::ErrorKind::kOutOfMemory ? "OUT_OF_MEMORY"
                              : e.kind == gpumem::ErrorKind::kDeviceLost ? "DEVICE_LOST" : "INTERNAL";
            if (e.kind == gpumem::ErrorKind::kOutOfMemory) PyErr_SetString(PyExc_MemoryError, e.what());
            else raise_kind(self, cls, e.what());
        }
    } catch (const EngineError& e) {
        switch (e.kind) {
            case EngineErrorKind::kOutOfMemory: {
                const gpumem::OomInfo& o = e.oom;
                PyObject* fn = helper_attr(self, "oom_error");
                if (!fn) break;
                PyObject* cause = o.cause_py_exc ? static_cast<PyObject*>(o.cause_py_exc) : Py_None;
                PyObject* req = huge_nbytes ? (Py_INCREF(huge_nbytes), huge_nbytes)
                                                  : PyLong_FromUnsignedLongLong(o.requested_nbytes);
                // _oom_error's segment_mode_vmm: None in virtual memory, else the device's vmm_supported now
                PyObject* seg_vmm = Py_None;
                if (o.segment_mode) {
                    seg_vmm = PyObject_GetAttrString(self->device, "vmm_supported");
                    if (!seg_vmm) {
                        Py_DECREF(fn);
                        Py_DECREF(req);
                        break;
                    }
                } else {
                    Py_INCREF(seg_vmm);
                }
                PyObject* err = PyObject_CallFunction(fn, "iNKKKLKKKOOKKKKN", static_cast<int>(o.cause), req,
                                                      (unsigned long long)o.free_nbytes,
                                                      (unsigned long long)o.total_nbytes,
                                                      (unsigned long long)o.allocated_nbytes,
                                                      (long long)o.cached_signed,
                                                      (unsigned long long)o.reserved_nbytes,
                                                      (unsigned long long)o.limit_nbytes,
                                                      (unsigned long long)o.va_nbytes, cause,
                                                      self->spec ? self->spec : Py_None, self->round_nbytes,
                                                      (unsigned long long)o.plan_mapped_nbytes,
                                                      (unsigned long long)o.plan_dropped_nbytes,
                                                      (unsigned long long)o.plan_live_nbytes, seg_vmm);
                Py_DECREF(fn);
                if (!err) break;
                if (PyExceptionInstance_Check(err))   // Note [Helpers' results are checked]
                    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err)), err);
                else
                    PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.oom_error returned %.80s, expected an "
                                 "exception", Py_TYPE(err)->tp_name);
                Py_DECREF(err);
                break;
            }
            case EngineErrorKind::kInvalidArgument:
            case EngineErrorKind::kClosed:
                raise_kind(self, "INVALID_ARGUMENT", e.what());
                break;
            case EngineErrorKind::kInvalidPointer:
                raise_kind(self, "INVALID_POINTER", e.what());
                break;
            case EngineErrorKind::kDoubleFree:
                raise_kind(self, "DOUBLE_FREE", e.what());
                break;
            case EngineErrorKind::kDeviceLost:
                raise_kind(self, "DEVICE_LOST", e.what());
                break;
            default:
                raise_kind(self, "INTERNAL", e.what());
        }
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
    } catch (const std::exception& e) {
        raise_kind(self, "INTERNAL", e.what());
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "gpumem engine: unknown error");
}

// Applies the frees deferred during the operation that just left the engine (Note [A free from
// inside a device call is deferred]); their errors are reported as unraisable.
void drain_deferred_frees(AllocObject* self) {
    std::vector<std::uint64_t>* q = self->deferred_frees;
    if (!q || !self->engine || self->engine->held_by_this_thread()) return;
    while (!q->empty() && self->engine) {
        std::uint64_t ptr = q->front();
        q->erase(q->begin());
        try {
            self->engine->free(ptr);
        } catch (...) {
            set_error(self);
        }
        if (self->backend) self->backend->clear_errors();
        if (PyErr_Occurred()) {
            PyObject* where = PyUnicode_FromFormat("gpumem: free(0x%llx) deferred from inside a device call",
                                                   static_cast<unsigned long long>(ptr));
            PyErr_WriteUnraisable(where);
            Py_XDECREF(where);
        }
    }
}

// Runs `f` (returns a new reference, or throws) inside device.deferred_events().
template <class F>
PyObject* run_op(AllocObject* self, F f, PyObject* huge_nbytes = nullptr) {
    PyObject* cm = nullptr;
    if (self->deferred) {
        cm = PyObject_CallNoArgs(self->deferred);
        if (!cm) return nullptr;
        PyObject* entered = PyObject_CallMethod(cm, "__enter__", nullptr);
        if (!entered) {
            Py_DECREF(cm);
            return nullptr;
        }
        Py_DECREF(entered);
    }
    PyObject* result = nullptr;
    try {
        result = f();
    } catch (...) {
        set_error(self, huge_nbytes);
    }
    if (self->backend) self->backend->clear_errors();
    if (self->deferred_frees && !self->deferred_frees->empty()) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        drain_deferred_frees(self);
        PyErr_Restore(et, ev, etb);
    }
    if (cm) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject* r = PyObject_CallMethod(cm, "__exit__", "OOO", Py_None, Py_None, Py_None);
        Py_DECREF(cm);
        if (!r) {   // a subscriber's BaseException: it wins, as in a `finally`
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
            Py_XDECREF(result);
            return nullptr;
        }
        Py_DECREF(r);
        PyErr_Restore(et, ev, etb);
    }
    return result;
}

// An int argument that fits in [0, 2**64): true and *out; false (no error set) otherwise.
inline bool exact_u64(PyObject* o, std::uint64_t* out) {
    if (!PyLong_CheckExact(o)) return false;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    *out = v;
    return true;
}

// A validated Python int to u64, clamping values past 2**64 (requests that can never fit).
bool to_u64_clamped(PyObject* o, std::uint64_t* out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return false;
        PyErr_Clear();
        v = UINT64_MAX;
    }
    *out = v;
    return true;
}

// Note [The policy and the stats from one table each]: the engine's config is read from the
// AllocatorPolicy object itself, by walking kPolicyFields, which has one row per field of the
// dataclass: how the engine takes it (a u64, a double, a bool, the growth rule) and where it goes in
// EngineConfig, or why the engine does not read it (a label, a segment-mode knob, the choice of
// engine made in Python); a page size of a pool's own is a u64 or None (0: the granularity). The stats dict is built by
// walking kStatFields (engine.h: one row per EngineStats member, the AllocatorStats counters, then
// the backing's own; torch_api.cpp walks it too). Both tables are exported (POLICY_FIELDS, STATS_FIELDS, BACKING_STATS_FIELDS) and
// tests/allocator/test_native_differential.py holds them to dataclasses.fields(): a field added to
// AllocatorPolicy or AllocatorStats that the engine does not know fails a test, where a hand-written
// list of keyword arguments let it be dropped silently.
enum class FieldKind { kU64, kF64, kBool, kGrowth, kMustBeNone, kNotRead, kU64OrNone };
struct PolicyField {
    const char* name;
    FieldKind kind;
    std::size_t offset;   // in EngineConfig; unused for kMustBeNone and kNotRead
};
#define CFG(name, kind) {#name, FieldKind::kind, offsetof(EngineConfig, name)}
#define NOT_READ(name) {#name, FieldKind::kNotRead, 0}
const PolicyField kPolicyFields[] = {
    NOT_READ(name), NOT_READ(description),
    NOT_READ(vmm),   // CachingAllocator decides the mode (Allocator(..., segments=True): malloc'd segments)
    CFG(round_nbytes, kU64), CFG(small_max_nbytes, kU64), CFG(separate_small_pool, kBool),
    NOT_READ(segment_rule), NOT_READ(small_segment_nbytes),   // segment mode only: read_segment_fields
    CFG(min_split_small_nbytes, kU64), CFG(min_split_large_nbytes, kU64), CFG(va_reserve_factor, kF64),
    CFG(steal_empty_pages, kBool), CFG(page_slack, kF64), CFG(page_slack_min_nbytes, kU64),
    CFG(growth, kGrowth), CFG(chunk_max_fraction, kF64),
    CFG(chunk_max_nbytes, kU64),
    // None: 0, the granularity (Note [Pages of a pool's own size] in engine.cpp)
    {"small_page_nbytes", FieldKind::kU64OrNone, offsetof(EngineConfig, small_page_nbytes)},
    {"large_page_nbytes", FieldKind::kU64OrNone, offsetof(EngineConfig, large_page_nbytes)},
    NOT_READ(segments_top_down),   // segment mode only
    CFG(grow_ahead_fraction, kF64), CFG(busy_slack, kF64), CFG(stream_ordered_steal, kBool),
    CFG(wait_own_stream, kBool), CFG(wait_on_gpu, kBool), CFG(plan_warmup, kBool), CFG(warmup_give_back, kBool),
    CFG(steal_after_warmup, kBool), CFG(steal_before_warmup, kBool),
};
#undef CFG
#undef NOT_READ

void invalid_argument(PyObject* helpers, const char* msg) {
    PyObject* cls = PyObject_GetAttrString(helpers, "INVALID_ARGUMENT");
    if (!cls) return;
    if (PyExceptionClass_Check(cls)) PyErr_SetString(cls, msg);
    else PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.INVALID_ARGUMENT must be an exception class (%s)", msg);
    Py_DECREF(cls);
}

// Reads `policy`'s field `f` into `cfg`; false with an error set (INVALID_ARGUMENT naming the field).
bool read_policy_field(PyObject* helpers, PyObject* policy, const PolicyField& f, EngineConfig& cfg) {
    if (f.kind == FieldKind::kNotRead) return true;
    PyObject* v = PyObject_GetAttrString(policy, f.name);
    if (!v) return false;
    char* at = reinterpret_cast<char*>(&cfg) + f.offset;
    const char* expected = nullptr;
    switch (f.kind) {
        case FieldKind::kU64:
            if (PyLong_Check(v) && !PyBool_Check(v)) {
                unsigned long long x = PyLong_AsUnsignedLongLong(v);
                if (!(x == static_cast<unsigned long long>(-1) && PyErr_Occurred())) {
                    *reinterpret_cast<std::uint64_t*>(at) = x;
                    break;
                }
                PyErr_Clear();
            }
            expected = "an int in [0, 2**64)";
            break;
        case FieldKind::kF64:
            if ((PyFloat_Check(v) || PyLong_Check(v)) && !PyBool_Check(v)) {
                double x = PyFloat_AsDouble(v);
                if (!(x == -1.0 && PyErr_Occurred())) {
                    *reinterpret_cast<double*>(at) = x;
                    break;
                }
                PyErr_Clear();
            }
            expected = "a number";
            break;
        case FieldKind::kBool:
            if (PyBool_Check(v)) *reinterpret_cast<bool*>(at) = v == Py_True;
            else expected = "a bool";
            break;
        case FieldKind::kGrowth: {   // GrowthRule, a str enum: "pages" or "chunks"
            PyObject* value = PyObject_GetAttrString(v, "value");
            if (!value) {
                PyErr_Clear();
                value = (Py_INCREF(v), v);
            }
            if (PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, "chunks") == 0)
                *reinterpret_cast<gpumem::GrowthRule*>(at) = gpumem::GrowthRule::kChunks;
            else if (PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, "pages") == 0)
                *reinterpret_cast<gpumem::GrowthRule*>(at) = gpumem::GrowthRule::kPages;
            else
                expected = "'pages' or 'chunks'";
            Py_DECREF(value);
            break;
        }
        case FieldKind::kMustBeNone:
            if (v != Py_None) expected = "None (the native engine has one page size, the device granularity)";
            break;
        case FieldKind::kNotRead:
            break;
        case FieldKind::kU64OrNone:   // a page size (> 0) or None (0: the device granularity)
            if (v == Py_None) {
                *reinterpret_cast<std::uint64_t*>(at) = 0;
                break;
            }
            if (PyLong_Check(v) && !PyBool_Check(v)) {
                unsigned long long x = PyLong_AsUnsignedLongLong(v);
                if (!(x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) && x > 0) {
                    *reinterpret_cast<std::uint64_t*>(at) = x;
                    break;
                }
                PyErr_Clear();
            }
            expected = "None or an int in [1, 2**64)";
            break;
    }
    if (expected) {
        char msg[256];
        std::snprintf(msg, sizeof msg, "policy.%s must be %s, got a %.60s", f.name, expected, Py_TYPE(v)->tp_name);
        invalid_argument(helpers, msg);
    }
    Py_DECREF(v);
    return expected == nullptr;
}

// Segment mode's knobs (segment_rule, small_segment_nbytes, segments_top_down), which kPolicyFields marks
// NOT_READ (the virtual-memory engine ignores them): read here when the allocator runs malloc'd segments.
bool read_segment_fields(PyObject* helpers, PyObject* policy, EngineConfig& cfg) {
    static const PolicyField size_field = {"small_segment_nbytes", FieldKind::kU64, offsetof(EngineConfig, small_segment_nbytes)};
    static const PolicyField top_down_field = {"segments_top_down", FieldKind::kBool, offsetof(EngineConfig, segments_top_down)};
    if (!read_policy_field(helpers, policy, size_field, cfg) || !read_policy_field(helpers, policy, top_down_field, cfg))
        return false;
    PyObject* v = PyObject_GetAttrString(policy, "segment_rule");   // SegmentRule, a str enum
    if (!v) return false;
    PyObject* value = PyObject_GetAttrString(v, "value");
    if (!value) {
        PyErr_Clear();
        value = (Py_INCREF(v), v);
    }
    Py_DECREF(v);
    static const char* const names[] = {"granular", "pytorch", "exact"};
    bool found = false;
    for (int i = 0; i < 3 && !found; ++i)
        if (PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, names[i]) == 0) {
            cfg.segment_rule = static_cast<gpumem::SegmentRule>(i);
            found = true;
        }
    Py_DECREF(value);
    if (!found) invalid_argument(helpers, "policy.segment_rule must be 'granular', 'pytorch' or 'exact'");
    return found;
}

// Allocator(device, helpers, policy=None, *, limit_nbytes=0, gc_threshold=0.0, segments=False): `policy` has the
// fields of AllocatorPolicy (Note [The policy and the stats from one table each]); None: the
// engine's defaults.
PyObject* Alloc_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    static const char* kwlist[] = {"device", "helpers", "policy", "limit_nbytes", "gc_threshold", "segments", nullptr};
    PyObject *device, *helpers, *policy = Py_None, *limit_obj = nullptr;
    EngineConfig cfg;
    unsigned long long limit = 0;
    double gc = 0.0;
    int segments = 0;   // segment mode (Note [Segment mode] in engine.cpp)
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$Odp", const_cast<char**>(kwlist), &device, &helpers, &policy,
                                     &limit_obj, &gc, &segments))
        return nullptr;
    if (limit_obj != nullptr) {   // checked: the "K" format wrapped 2**64 + 5 to a limit of 5 bytes
        if (PyLong_Check(limit_obj) && !PyBool_Check(limit_obj)) {
            limit = PyLong_AsUnsignedLongLong(limit_obj);
            if (limit == static_cast<unsigned long long>(-1) && PyErr_Occurred()) PyErr_Clear();
            else limit_obj = nullptr;
        }
        if (limit_obj != nullptr) {
            invalid_argument(helpers, "limit_nbytes must be an int in [0, 2**64) (0: no limit)");
            return nullptr;
        }
    }
    if (policy != Py_None)
        for (const PolicyField& f : kPolicyFields)
            if (!read_policy_field(helpers, policy, f, cfg)) return nullptr;
    cfg.segments = segments != 0;
    if (cfg.segments && policy != Py_None && !read_segment_fields(helpers, policy, cfg)) return nullptr;
    // the floats go into the engine's arithmetic as they are: a NaN or an infinity (or a factor whose
    // reservation cannot be counted in 64 bits) would be undefined behaviour there
    const double factor = cfg.va_reserve_factor, slack = cfg.page_slack;
    if (!(std::isfinite(factor) && factor >= 1.0 && factor <= 4096.0) || !(std::isfinite(slack) && slack >= 0.0) ||
        !(std::isfinite(gc) && gc >= 0.0)) {
        char msg[256];
        std::snprintf(msg, sizeof msg,
                      "va_reserve_factor must be a finite number in [1, 4096], page_slack and gc_threshold finite "
                      "and non-negative (got %g, %g, %g)",
                      factor, slack, gc);
        invalid_argument(helpers, msg);
        return nullptr;
    }
    if (!(cfg.busy_slack >= 0.0)) {   // NaN or negative; inf is no bound
        invalid_argument(helpers, "busy_slack must be a number >= 0 (inf: no bound)");
        return nullptr;
    }
    cfg.limit_nbytes = limit;
    cfg.gc_threshold = gc;

    AllocObject* self = reinterpret_cast<AllocObject*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    Py_INCREF(device);
    Py_INCREF(helpers);
    self->device = device;
    self->helpers = helpers;
    self->round_nbytes = cfg.round_nbytes;
    self->deferred_frees = new (std::nothrow) std::vector<std::uint64_t>();
    if (!self->deferred_frees) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->deferred = PyObject_GetAttrString(device, "deferred_events");
    if (!self->deferred) PyErr_Clear();
    self->spec = PyObject_GetAttrString(device, "spec");
    if (!self->spec) {
        PyErr_Clear();
        self->spec = PyUnicode_FromString("");
    }
    PyObject* oom = PyObject_GetAttrString(helpers, "OUT_OF_MEMORY");
    PyObject* lost = oom ? PyObject_GetAttrString(helpers, "DEVICE_LOST") : nullptr;
    if (!lost) {
        Py_XDECREF(oom);
        Py_DECREF(self);
        return nullptr;
    }
    try {
        self->backend = new PyDeviceBackend(device, oom, lost);
    } catch (...) {
        self->backend = nullptr;
    }
    Py_DECREF(oom);
    Py_DECREF(lost);
    if (!self->backend) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    try {
        self->engine = new Engine(*self->backend, cfg);
    } catch (...) {
        set_error(self);
        self->backend->clear_errors();
        Py_DECREF(self);
        return nullptr;
    }
    gpumem::LockHooks hooks;
    hooks.release = release_gil;
    hooks.reacquire = reacquire_gil;
    self->engine->set_lock_hooks(hooks);
    return reinterpret_cast<PyObject*>(self);
}

// GC support: a cycle through the allocator (device -> allocator -> device, an attribute of the
// device naming its allocator) is collected as the Python allocator would be. Clearing drops the
// engine and its backend without device calls (the Python allocator has no finalizer either); the
// engine goes first, so that nothing is left that could call into the cleared device.
int Alloc_traverse(AllocObject* self, visitproc visit, void* arg) {
    Py_VISIT(self->device);
    Py_VISIT(self->helpers);
    Py_VISIT(self->deferred);
    Py_VISIT(self->spec);
    if (self->backend) {
        int r = self->backend->traverse(visit, arg);
        if (r) return r;
    }
    return 0;
}

int Alloc_clear(AllocObject* self) {
    Engine* engine = self->engine;
    PyDeviceBackend* backend = self->backend;
    self->engine = nullptr;   // methods called from here on (finalizers run by the drops) raise
    self->backend = nullptr;
    delete engine;
    delete backend;           // drops its device, handles and events
    Py_CLEAR(self->device);
    Py_CLEAR(self->helpers);
    Py_CLEAR(self->deferred);
    Py_CLEAR(self->spec);
    return 0;
}

void Alloc_dealloc(AllocObject* self) {
    PyObject_GC_UnTrack(self);
    Alloc_clear(self);
    delete self->deferred_frees;
    self->deferred_frees = nullptr;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// Note [No memory from a closed device]: a cache hit makes no device call (Note [The hot path
// makes no device call] in caching.py), so after device.close() it would hand out an address into
// memory the device has given back. allocate() therefore asks the device first, as
// PythonEngine.allocate does (device.closed); a closed device raises what the Python allocator
// raises: DeviceLostError once the device was lost, InvalidArgumentError once the allocator was
// closed, else DeviceClosedError. The binding reads the flag behind the property, Device._closed
// (an instance attribute: a dictionary lookup, not a Python call, on the hot path), and the
// property where a device has no such attribute.
bool device_closed(AllocObject* self) {
    static PyObject* flag = PyUnicode_InternFromString("_closed");
    static PyObject* property = PyUnicode_InternFromString("closed");
    if (!flag || !property) {
        PyErr_Clear();
        return false;
    }
    PyObject* v = PyObject_GetAttr(self->device, flag);
    if (!v) {
        PyErr_Clear();
        v = PyObject_GetAttr(self->device, property);
    }
    if (!v) {   // a device without `closed` never closes
        PyErr_Clear();
        return false;
    }
    bool closed = v == Py_True || (v != Py_False && PyObject_IsTrue(v) == 1);
    Py_DECREF(v);
    PyErr_Clear();
    return closed;
}

PyObject* closed_device_error(AllocObject* self) {
    try {
        self->engine->check_open();
    } catch (...) {
        set_error(self);
        return nullptr;
    }
    PyObject* msg = PyUnicode_FromFormat("%S is closed", self->spec ? self->spec : Py_None);
    PyObject* cls = msg ? helper_attr(self, "DEVICE_CLOSED") : nullptr;
    if (cls && PyExceptionClass_Check(cls)) PyErr_SetObject(cls, msg);
    else if (cls) PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.DEVICE_CLOSED must be an exception class");
    Py_XDECREF(cls);
    Py_XDECREF(msg);
    return nullptr;
}

// allocate(nbytes, stream=0) -> int
PyObject* Alloc_allocate(AllocObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    CHECK_ALIVE(self);
    PyObject* o_nbytes = nullptr;
    PyObject* o_stream = nullptr;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs >= 1) o_nbytes = args[0];
    if (nargs >= 2) o_stream = args[1];
    if (nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "allocate() takes at most 2 positional arguments");
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < nkw; ++i) {
        PyObject* k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(k, "stream") == 0 && !o_stream) o_stream = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "nbytes") == 0 && !o_nbytes) o_nbytes = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "allocate() got an unexpected keyword argument %R", k);
            return nullptr;
        }
    }
    if (!o_nbytes) {
        PyErr_SetString(PyExc_TypeError, "allocate() missing required argument 'nbytes'");
        return nullptr;
    }
    std::uint64_t nbytes = 0, stream = 0;
    bool fast = exact_u64(o_nbytes, &nbytes) && nbytes > 0 && (!o_stream || exact_u64(o_stream, &stream));
    if (!fast) {
        PyObject* fn = helper_attr(self, "check_alloc_args");
        if (!fn) return nullptr;
        PyObject* zero = o_stream ? nullptr : PyLong_FromLong(0);
        PyObject* r = PyObject_CallFunctionObjArgs(fn, o_nbytes, o_stream ? o_stream : zero, nullptr);
        Py_XDECREF(zero);
        Py_DECREF(fn);
        if (!r) return nullptr;
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !PyLong_Check(PyTuple_GET_ITEM(r, 0)) ||
            !PyLong_Check(PyTuple_GET_ITEM(r, 1))) {   // Note [Helpers' results are checked]
            PyErr_Format(PyExc_TypeError, "gpumem allocator: helpers.check_alloc_args returned %.80s, expected a "
                         "tuple (nbytes, stream) of two ints", Py_TYPE(r)->tp_name);
            Py_DECREF(r);
            return nullptr;
        }
        bool ok = to_u64_clamped(PyTuple_GET_ITEM(r, 0), &nbytes) && to_u64_clamped(PyTuple_GET_ITEM(r, 1), &stream);
        if (ok && nbytes == UINT64_MAX) {
            // a request past 2**64 bytes can never fit: the engine sees UINT64_MAX, the error the real number
            PyObject* huge = PyTuple_GET_ITEM(r, 0);
            Py_INCREF(huge);
            Py_DECREF(r);
            if (device_closed(self)) {
                Py_DECREF(huge);
                return closed_device_error(self);
            }
            PyObject* out = run_op(
                self, [&]() { return PyLong_FromUnsignedLongLong(self->engine->allocate(nbytes, stream)); }, huge);
            Py_DECREF(huge);
            return out;
        }
        Py_DECREF(r);
        if (!ok) return nullptr;
    }
    if (device_closed(self)) return closed_device_error(self);
    try {
        std::uint64_t p = self->engine->try_allocate_fast(nbytes, stream);
        if (p) return PyLong_FromUnsignedLongLong(p);
    } catch (...) {
        set_error(self);
        self->backend->clear_errors();
        return nullptr;
    }
    return run_op(self, [&]() { return PyLong_FromUnsignedLongLong(self->engine->allocate(nbytes, stream)); });
}

PyObject* bad_pointer(AllocObject* self, const char* op, PyObject* ptr) {
    PyObject* fn = helper_attr(self, "bad_pointer");
    if (!fn) return nullptr;
    bool lost = self->engine->lost();
    PyObject* lost_what = Py_None;
    Py_INCREF(lost_what);
    if (lost) {
        // the message the engine would give: ask it
        try {
            self->engine->record_stream(0, 0);
        } catch (const EngineError& e) {
            Py_DECREF(lost_what);
            std::string w = e.what();
            const std::string prefix = "the device was lost: ";
            lost_what = PyUnicode_FromString(w.compare(0, prefix.size(), prefix) == 0 ? w.c_str() + prefix.size() : w.c_str());
        } catch (...) {
        }
    }
    PyObject* r = PyObject_CallFunction(fn, "sOOO", op, ptr, self->engine->closed() ? Py_True : Py_False, lost_what);
    Py_DECREF(fn);
    Py_XDECREF(lost_what);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "bad_pointer did not raise");
    return nullptr;
}

// free(ptr)
PyObject* Alloc_free(AllocObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "free() takes exactly one argument (ptr)");
        return nullptr;
    }
    CHECK_ALIVE(self);
    std::uint64_t ptr;
    if (exact_u64(args[0], &ptr)) {
        if (!self->engine->held_by_this_thread()) {
            try {
                if (self->engine->try_free_fast(ptr)) Py_RETURN_NONE;
            } catch (...) {
                set_error(self);
                self->backend->clear_errors();
                return nullptr;
            }
        }
    } else {
        PyObject* r = call_int_helper(self, "as_ptr", args[0]);
        if (!r) return nullptr;
        unsigned long long v = PyLong_AsUnsignedLongLong(r);
        if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
            PyErr_Clear();
            PyObject* out = bad_pointer(self, "free", r);
            Py_DECREF(r);
            return out;
        }
        Py_DECREF(r);
        ptr = v;
    }
    if (self->engine->held_by_this_thread()) {   // Note [A free from inside a device call is deferred]
        try {
            self->deferred_frees->push_back(ptr);
        } catch (const std::bad_alloc&) {
            return PyErr_NoMemory();
        }
        Py_RETURN_NONE;
    }
    return run_op(self, [&]() {
        self->engine->free(ptr);
        Py_RETURN_NONE;
    });
}

PyObject* Alloc_record_stream(AllocObject* self, PyObject* args, PyObject* kwds) {
    CHECK_ALIVE(self);
    static const char* kwlist[] = {"ptr", "stream", nullptr};
    PyObject *o_ptr, *o_stream;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", const_cast<char**>(kwlist), &o_ptr, &o_stream)) return nullptr;
    PyObject* p = call_int_helper(self, "as_ptr", o_ptr);
    if (!p) return nullptr;
    PyObject* s = call_int_helper(self, "check_stream", o_stream);
    if (!s) {
        Py_DECREF(p);
        return nullptr;
    }
    std::uint64_t stream = PyLong_AsUnsignedLongLong(s);
    Py_DECREF(s);
    if (stream == static_cast<std::uint64_t>(-1) && PyErr_Occurred()) {   // check_stream let past 2**64 through
        Py_DECREF(p);
        return nullptr;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(p);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        PyObject* out = bad_pointer(self, "record_stream", p);
        Py_DECREF(p);
        return out;
    }
    Py_DECREF(p);
    std::uint64_t ptr = v;
    return run_op(self, [&]() {
        self->engine->record_stream(ptr, stream);
        Py_RETURN_NONE;
    });
}

PyObject* Alloc_empty_cache(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() { return PyLong_FromUnsignedLongLong(self->engine->empty_cache()); });
}

PyObject* Alloc_synchronize(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() {
        self->engine->synchronize();
        Py_RETURN_NONE;
    });
}

PyObject* Alloc_close(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() {
        self->engine->close();
        Py_RETURN_NONE;
    });
}

// The rows of kStatFields whose `counter` is `counters`, as a dict of their values now.
PyObject* stats_dict(AllocObject* self, bool counters) {
    CHECK_ALIVE(self);
    EngineStats st;
    try {
        st = self->engine->stats();
    } catch (...) {
        set_error(self);
        return nullptr;
    }
    PyObject* d = PyDict_New();
    if (!d) return nullptr;
    for (const StatField& f : kStatFields) {
        if (f.counter != counters) continue;
        PyObject* o = PyLong_FromUnsignedLongLong(st.*f.member);
        if (!o || PyDict_SetItemString(d, f.name, o) < 0) {
            Py_XDECREF(o);
            Py_DECREF(d);
            return nullptr;
        }
        Py_DECREF(o);
    }
    return d;
}

// The names of the rows of `table` that `keep` accepts, as a tuple; null with an error set.
template <class Row, std::size_t N, class Keep>
PyObject* field_names(const Row (&table)[N], Keep keep) {
    PyObject* out = PyList_New(0);
    for (const Row& row : table) {
        if (!out || !keep(row)) continue;
        PyObject* name = PyUnicode_FromString(row.name);
        if (!name || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    PyObject* tuple = out ? PyList_AsTuple(out) : nullptr;
    Py_XDECREF(out);
    return tuple;
}

PyObject* Alloc_stats(AllocObject* self, PyObject*) { return stats_dict(self, true); }
PyObject* Alloc_backing_stats(AllocObject* self, PyObject*) { return stats_dict(self, false); }

PyObject* Alloc_reserved_nbytes(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return PyLong_FromUnsignedLongLong(self->engine->reserved_nbytes());
}

PyObject* Alloc_allocated_nbytes(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return PyLong_FromUnsignedLongLong(self->engine->allocated_nbytes());
}

// releasable_nbytes(with_carried=False): PythonEngine.releasable_nbytes
PyObject* Alloc_releasable_nbytes(AllocObject* self, PyObject* args, PyObject* kwargs) {
    CHECK_ALIVE(self);
    int with_carried = 0;
    static const char* kwlist[] = {"with_carried", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p:releasable_nbytes", const_cast<char**>(kwlist),
                                     &with_carried))
        return nullptr;
    return run_op(self, [&]() {
        return PyLong_FromUnsignedLongLong(self->engine->releasable_nbytes(with_carried != 0));
    });
}

// block_size(ptr): ptr as CachingAllocator.block_size takes it (any integer, through as_ptr).
PyObject* Alloc_block_size(AllocObject* self, PyObject* ptr) {
    CHECK_ALIVE(self);
    std::uint64_t p;
    PyObject* as_int = nullptr;   // ptr as an int, when it was not one
    bool found = false;
    if (!exact_u64(ptr, &p)) {
        as_int = call_int_helper(self, "as_ptr", ptr);   // np.int64 and other integers; a list raises
        if (!as_int) return nullptr;
        ptr = as_int;
        unsigned long long v = PyLong_AsUnsignedLongLong(as_int);
        found = !(v == static_cast<unsigned long long>(-1) && PyErr_Occurred());
        PyErr_Clear();   // outside [0, 2**64): never a live block
        p = v;
    } else {
        found = true;
    }
    std::uint64_t size = 0;
    std::string why;   // the engine's message (a pointer inside a step plan's arena says so)
    if (found) {
        try {
            size = self->engine->block_size(p);
        } catch (const EngineError& e) {
            found = false;
            if (e.kind == EngineErrorKind::kInvalidPointer) why = e.what();
        } catch (...) {
            set_error(self);
            Py_XDECREF(as_int);
            return nullptr;
        }
    }
    if (!found) {
        PyObject* cls = helper_attr(self, "INVALID_POINTER");
        if (cls) {
            if (why.empty()) {   // outside [0, 2**64): in hex, as the engine's and plan.py's messages
                PyObject* hexed = PyNumber_ToBase(ptr, 16);
                if (hexed) {
                    PyErr_Format(cls, "%U is not a live allocation", hexed);
                    Py_DECREF(hexed);
                }
            } else {
                PyErr_SetString(cls, why.c_str());
            }
            Py_DECREF(cls);
        }
        Py_XDECREF(as_int);
        return nullptr;
    }
    Py_XDECREF(as_int);
    return PyLong_FromUnsignedLongLong(size);
}

PyObject* Alloc_live_blocks(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    auto blocks = self->engine->live_blocks();
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(blocks.size()));
    if (!out) return nullptr;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
        PyObject* t = Py_BuildValue("(KK)", (unsigned long long)blocks[i].first, (unsigned long long)blocks[i].second);
        if (!t) {
            Py_DECREF(out);
            return nullptr;
        }
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
    }
    return out;
}

// An int in [0, 2**64) from a helper's or a device listing's result; otherwise false with a
// TypeError (or OverflowError) set that says what `what` should have been.
bool result_u64(PyObject* o, const char* what, std::uint64_t* out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "gpumem allocator: %s must be an int, got %.80s", what, Py_TYPE(o)->tp_name);
        return false;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
    *out = v;
    return true;
}

// A sequence of `n`-tuples of ints (the device's listings) into `out`; false with an error set.
bool int_tuples(PyObject* seq_obj, Py_ssize_t n, const char* what, std::vector<std::uint64_t>& out) {
    PyObject* seq = PySequence_Fast(seq_obj, what);
    if (!seq) return false;
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
        PyObject* t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) {
            PyErr_Format(PyExc_TypeError, "gpumem allocator: %s: entry %zd must be a tuple of %zd ints, got %.80s",
                         what, i, n, Py_TYPE(t)->tp_name);
            ok = false;
            break;
        }
        for (Py_ssize_t k = 0; ok && k < n; ++k) {
            std::uint64_t v;
            ok = result_u64(PyTuple_GET_ITEM(t, k), what, &v);
            if (ok) out.push_back(v);
        }
    }
    Py_DECREF(seq);
    return ok;
}

// consistency_problems(list_device) -> list[str]. list_device() returns (mappings, reservations):
// [(va, nbytes, handle int)] as Device.mapping_ranges() gives them, and [(va, nbytes)] or None; the
// engine calls it under its lock (Engine::consistency_problems), so that the listings match its state.
PyObject* Alloc_consistency_problems(AllocObject* self, PyObject* list_device) {
    CHECK_ALIVE(self);
    if (list_device != Py_None && !PyCallable_Check(list_device)) {
        PyErr_SetString(PyExc_TypeError, "consistency_problems(list_device): list_device must be callable or None");
        return nullptr;
    }
    Engine::ListDevice list;
    if (list_device != Py_None) {
        list = [self, list_device](Engine::DeviceMaps& maps, Engine::Reservations& res) -> bool {
            PyDeviceBackend* backend = self->backend;
            PyObject* r = PyObject_CallNoArgs(list_device);
            if (!r) backend->raise_current();   // the device's exception, as a device call's
            std::vector<std::uint64_t> m, v;
            bool have_res = false;
            bool ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2;
            if (!ok)
                PyErr_Format(PyExc_TypeError, "gpumem allocator: list_device() must return (mappings, reservations), "
                             "got %.80s", Py_TYPE(r)->tp_name);
            ok = ok && int_tuples(PyTuple_GET_ITEM(r, 0), 3, "the device's mapping_ranges()", m);
            if (ok && PyTuple_GET_ITEM(r, 1) != Py_None) {
                have_res = true;
                ok = int_tuples(PyTuple_GET_ITEM(r, 1), 2, "the device's reservation_ranges()", v);
            }
            Py_DECREF(r);
            if (!ok) backend->raise_current();
            // device handle value -> chunk id; a handle object without an int `handle` (a device
            // that returned something else from mem_create) matches no mapping, as in Python
            std::unordered_map<std::uint64_t, gpumem::ChunkHandle> by_value;
            for (std::size_t id = 1; id <= backend->chunk_table_size(); ++id) {
                PyObject* h = backend->chunk_object(id);
                if (!h) continue;
                PyObject* hv_obj = PyObject_GetAttrString(h, "handle");
                if (!hv_obj) {
                    if (!PyErr_ExceptionMatches(PyExc_Exception)) backend->raise_current();
                    PyErr_Clear();
                    continue;
                }
                unsigned long long hv = PyLong_Check(hv_obj) ? PyLong_AsUnsignedLongLong(hv_obj) : 0;
                bool hv_ok = PyLong_Check(hv_obj) && !(hv == static_cast<unsigned long long>(-1) && PyErr_Occurred());
                PyErr_Clear();
                Py_DECREF(hv_obj);
                if (hv_ok) by_value[hv] = id;
            }
            for (std::size_t i = 0; i + 2 < m.size(); i += 3) {
                auto it = by_value.find(m[i + 2]);
                maps.emplace_back(m[i], m[i + 1], it == by_value.end() ? 0 : it->second);
            }
            for (std::size_t i = 0; i + 1 < v.size(); i += 2) res.emplace_back(v[i], v[i + 1]);
            return have_res;
        };
    }
    return run_op(self, [&]() -> PyObject* {
        auto problems = self->engine->consistency_problems(list);
        PyObject* out = PyList_New(0);
        if (!out) return nullptr;
        for (auto& p : problems) {
            PyObject* s = PyUnicode_FromString(p.c_str());
            if (!s || PyList_Append(out, s) < 0) {
                Py_XDECREF(s);
                Py_DECREF(out);
                return nullptr;
            }
            Py_DECREF(s);
        }
        return out;
    });
}

PyObject* Alloc_describe(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return PyUnicode_FromString(self->engine->describe().c_str());
}

// Note [An idle device's bookkeeping calls made here] in pybackend.cpp: on while the engine holds no chunk, no
// event and the device no mapping. use_idle_twin(lag=None, clock=None): with lag (Note [A twin that runs the
// program's GPU work]) = (cpu_op_s, kernel_min_s, touch_factor, bandwidth_bps, queue_depth, then the latencies in us
// of launch, event_record, event_query, event_destroy, synchronize, mem_map, mem_set_access (per call, per mapping,
// per MiB), mem_unmap (the same three)) and clock the device's SimClock. Refusals are InvalidArgumentError (a
// TypeError or OverflowError for arguments of the wrong type), before anything changes.
PyObject* Alloc_use_idle_twin(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    PyObject *o_lag = Py_None, *clock = Py_None;
    if (!PyArg_ParseTuple(args, "|OO:use_idle_twin", &o_lag, &clock)) return nullptr;
    PyDeviceBackend::GpuLag m;
    const bool with_lag = o_lag != Py_None;
    if (with_lag) {
        if (!PyTuple_Check(o_lag)) {
            PyErr_Format(PyExc_TypeError, "use_idle_twin: lag must be a tuple of the GPU lag's constants, not %.60s",
                         Py_TYPE(o_lag)->tp_name);
            return nullptr;
        }
        Py_ssize_t depth = 0;
        if (!PyArg_ParseTuple(o_lag, "ddddnddddddddddddd:use_idle_twin", &m.cpu_op_s, &m.kernel_min_s, &m.touch_factor,
                              &m.bandwidth_bps, &depth, &m.launch_us, &m.event_record_us, &m.event_query_us,
                              &m.event_destroy_us, &m.synchronize_us, &m.mem_map_us, &m.set_access_us,
                              &m.set_access_mapping_us, &m.set_access_mib_us, &m.unmap_us, &m.unmap_mapping_us,
                              &m.unmap_mib_us, &m.stream_wait_event_us))
            return nullptr;
        m.queue_depth = depth > 0 ? static_cast<std::size_t>(depth) : 0;
    }
    if (self->engine->closed()) {
        invalid_argument(self->helpers, "allocator is closed");
        return nullptr;
    }
    std::string why = self->backend->use_idle_twin(with_lag ? &m : nullptr, clock == Py_None ? nullptr : clock);
    if (PyErr_Occurred()) return nullptr;
    if (!why.empty()) {
        invalid_argument(self->helpers, why.c_str());
        return nullptr;
    }
    Py_RETURN_NONE;
}

// A backend call of the lagged twin outside an engine operation, its BackendError raised as set_error does.
template <class F>
bool lag_call(AllocObject* self, F f) {
    try {
        f();
        return true;
    } catch (...) {
        set_error(self);
        self->backend->clear_errors();
        return false;
    }
}

// The lag's calls on a closed allocator say so, as its other calls do.
bool lag_open(AllocObject* self) {
    if (!self->engine->closed()) return true;
    invalid_argument(self->helpers, "allocator is closed");
    return false;
}

// lag_before(): the CPU reaches the program's next op (ProgramGpu.before); nothing when the lag is off.
PyObject* Alloc_lag_before(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    if (!lag_open(self)) return nullptr;
    if (!lag_call(self, [&]() { self->backend->lag_before(); })) return nullptr;
    Py_RETURN_NONE;
}

// lag_after(stream, ptr, nbytes): the kernel after an allocation (ProgramGpu.after); nothing when the lag is off.
// Each argument an int in [0, 2**64) (a negative one is an OverflowError, not a wrapped number).
PyObject* Alloc_lag_after(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "O!O!O!:lag_after", &PyLong_Type, &o[0], &PyLong_Type, &o[1], &PyLong_Type, &o[2]))
        return nullptr;
    unsigned long long v[3];
    for (int k = 0; k < 3; ++k) {
        v[k] = PyLong_AsUnsignedLongLong(o[k]);
        if (v[k] == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
    }
    if (!lag_open(self)) return nullptr;
    if (!lag_call(self, [&]() { self->backend->lag_after(v[0], v[1], v[2]); })) return nullptr;
    Py_RETURN_NONE;
}

PyObject* Alloc_lag_stats(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    if (!lag_open(self)) return nullptr;
    return self->backend->lag_stats();
}

// The device closed under the twin (SimDevice calls it): the device's calls go to the device again.
PyObject* Alloc_twin_device_closed(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    self->backend->twin_device_closed();
    Py_RETURN_NONE;
}

// The twin's mappings as Device.mapping_ranges() lists them; None when the twin is off.
PyObject* Alloc_twin_mapping_ranges(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    if (!self->backend->idle_twin()) Py_RETURN_NONE;
    return self->backend->twin_mapping_ranges();
}

PyObject* Alloc_closed(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return PyBool_FromLong(self->engine->closed());
}
PyObject* Alloc_lost(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return PyBool_FromLong(self->engine->lost());
}

// -- step plans (Note [Step plans] in gpumem/allocator/plan.py) ------------------------------------------
PyObject* Alloc_mark_step(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() { return PyLong_FromLong(self->engine->mark_step()); });
}
PyObject* Alloc_start_plan_warmup(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() { return PyBool_FromLong(self->engine->start_plan_warmup()); });
}
PyObject* Alloc_stop_plan_warmup(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() { return PyBool_FromLong(self->engine->stop_plan_warmup()); });
}

// step_template(missing_ok=False): (nbytes, streams, free_own, free_next, generation); None with missing_ok
// when no step waits (Note [Step plans and threads] in plan.py)
PyObject* Alloc_step_template(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    int missing_ok = 0;
    if (!PyArg_ParseTuple(args, "|p:step_template", &missing_ok)) return nullptr;
    return run_op(self, [&]() -> PyObject* {
        std::vector<Engine::StepRecord> rec;
        std::uint64_t generation = 0;
        if (!self->engine->ready_step(&rec, &generation)) {
            if (missing_ok) Py_RETURN_NONE;
            rec = self->engine->step_template();   // raises: no step waits
        }
        PyObject* lists[4];
        for (auto& l : lists) l = PyList_New(static_cast<Py_ssize_t>(rec.size()));
        if (!lists[0] || !lists[1] || !lists[2] || !lists[3]) {
            for (auto& l : lists) Py_XDECREF(l);
            return nullptr;
        }
        for (std::size_t i = 0; i < rec.size(); ++i) {
            const Py_ssize_t j = static_cast<Py_ssize_t>(i);
            PyList_SET_ITEM(lists[0], j, PyLong_FromUnsignedLongLong(rec[i].nbytes));
            PyList_SET_ITEM(lists[1], j, PyLong_FromUnsignedLongLong(rec[i].stream));
            PyList_SET_ITEM(lists[2], j, PyLong_FromLongLong(rec[i].free_own));
            PyList_SET_ITEM(lists[3], j, PyLong_FromLongLong(rec[i].free_next));
        }
        for (auto& l : lists)
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(l); ++j)
                if (!PyList_GET_ITEM(l, j)) {
                    for (auto& m : lists) Py_DECREF(m);
                    return nullptr;
                }
        return Py_BuildValue("(NNNNK)", lists[0], lists[1], lists[2], lists[3], (unsigned long long)generation);
    });
}

// install_plan(offsets, generation): generation -1 for none (NativeEngine.install_plan checks it)
PyObject* Alloc_install_plan(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    PyObject* arg = nullptr;
    long long generation = -1;
    if (!PyArg_ParseTuple(args, "O|L:install_plan", &arg, &generation)) return nullptr;
    PyObject* seq = PySequence_Fast(arg, "install_plan: offsets must be a sequence of ints");
    if (!seq) return nullptr;
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(PySequence_Fast_GET_SIZE(seq)));
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
        PyObject* idx = PyNumber_Index(PySequence_Fast_GET_ITEM(seq, i));
        long long v = idx ? PyLong_AsLongLong(idx) : -1;
        Py_XDECREF(idx);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return nullptr;
        }
        offsets[static_cast<std::size_t>(i)] = v;
    }
    Py_DECREF(seq);
    return run_op(self, [&]() { return PyBool_FromLong(self->engine->install_plan(offsets, generation)); });
}

PyObject* Alloc_reset_peak_stats(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() {
        self->engine->reset_peak_stats();
        Py_RETURN_NONE;
    });
}

PyObject* Alloc_step_plan_info(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() -> PyObject* {
        std::vector<std::uint64_t> v = self->engine->step_plan_info();
        PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(v.size()));
        if (!t) return nullptr;
        for (std::size_t i = 0; i < v.size(); ++i) {
            PyObject* x = PyLong_FromUnsignedLongLong(v[i]);
            if (!x) {
                Py_DECREF(t);
                return nullptr;
            }
            PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), x);
        }
        return t;
    });
}

// set_early_leave_steps(steps): NativeEngine.set_early_leave_steps checked it (plan.py check_early_leave_steps);
// checked again here (the binding is reachable), and run as an operation: a call re-entered from a device call
// inside an allocation raises InternalError instead of a C++ exception unwinding through Python (attacker 45, F1)
PyObject* Alloc_set_early_leave_steps(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    unsigned long long steps = 0;
    if (!PyArg_ParseTuple(args, "K:set_early_leave_steps", &steps)) return nullptr;
    if (steps > (1ULL << 40)) {
        PyErr_SetString(PyExc_ValueError, "set_early_leave_steps: steps must be in [0, 2**40]");
        return nullptr;
    }
    return run_op(self, [&]() -> PyObject* {
        self->engine->set_early_leave_steps(steps);
        Py_RETURN_NONE;
    });
}

// set_step_record_limit(records): NativeEngine.set_step_record_limit checked it (plan.py check_record_limit)
PyObject* Alloc_set_step_record_limit(AllocObject* self, PyObject* args) {
    CHECK_ALIVE(self);
    unsigned long long records = 0;
    if (!PyArg_ParseTuple(args, "K:set_step_record_limit", &records)) return nullptr;
    if (records < 1 || records > (1ULL << 40)) {
        PyErr_SetString(PyExc_ValueError, "set_step_record_limit: records must be in [1, 2**40]");
        return nullptr;
    }
    return run_op(self, [&]() -> PyObject* {   // re-entered from a device call: InternalError (attacker 45, F1)
        self->engine->set_step_record_limit(records);
        Py_RETURN_NONE;
    });
}

// -- run_ops: a step's ops in one call (Note [A step's ops in one call] in op_table.h) ----------------------

// A 1-D C-contiguous buffer of `itemsize`-byte signed ints (int8 also as uint8): true with `view` held;
// false with InvalidArgumentError set and nothing held.
bool ops_buffer(AllocObject* self, PyObject* o, const char* name, Py_ssize_t itemsize, Py_buffer* view) {
    const char* want = itemsize == 1 ? "int8" : "int64";
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        char msg[200];
        std::snprintf(msg, sizeof msg, "run_ops: %s must be a 1-D contiguous %s array, got a %.60s", name, want,
                      Py_TYPE(o)->tp_name);
        raise_kind(self, "INVALID_ARGUMENT", msg);
        return false;
    }
    const char* f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || (PY_LITTLE_ENDIAN && *f == '<')) ++f;
    bool ok = view->ndim == 1 && view->itemsize == itemsize && f[0] && !f[1] &&
              (itemsize == 1 ? (f[0] == 'b' || f[0] == 'B') : (f[0] == 'q' || f[0] == 'l'));
    if (!ok) {
        char msg[200];
        std::snprintf(msg, sizeof msg, "run_ops: %s must be a 1-D contiguous %s array, got format '%.20s', %zd-byte "
                      "items, %d dimensions", name, want, view->format ? view->format : "B", view->itemsize,
                      view->ndim);
        PyBuffer_Release(view);
        raise_kind(self, "INVALID_ARGUMENT", msg);
        return false;
    }
    return true;
}

// run_ops(kinds, ids, nbytes, table, stream=0) -> number of ops (Note [A step's ops in one call] in
// op_table.h): op q allocates nbytes[q] on `stream` and keeps the pointer under table[ids[q]] when
// kinds[q] == 0 (a zero-byte request keeps 0 and calls nothing), and pops table[ids[q]] and frees it
// when kinds[q] == 1 (nothing when it pops 0 or no entry), exactly as the Python loop
//     for k, i, n in zip(kinds, ids, nbytes):
//         if k == 0: table[i] = allocate(n, stream) if n else 0
//         else:
//             p = table.pop(i, 0)
//             if p: free(p)
// does with allocate() and free(): the same engine calls in the same order (the fast paths, then the
// full operation where they step aside), the same slow paths (run_op: device.deferred_events(), the
// deferred frees), the same errors. The fast paths run in runs under one lock (Note [One lock for a
// run of fast paths] in engine.cpp), each slow path under a lock of its own, as allocate() and free()
// run it. allocate()'s check that the device is not closed (Note [No memory from a closed device]) is
// made before a run and again after any op that may have run Python (a slow path, or a wait for the
// engine's lock that let other threads run: then the run stops after its first op): only Python code
// closes a device, so the check sees what the loop's check before each allocation would. The first error stops the run and is raised
// as allocate() or free() raises it; table.last_ops_done says how many ops completed before it (the
// failed allocation keeps nothing in the table, the failed free's entry is gone: as in the loop). Bad
// input (arrays of another type, length or shape, a kind not 0 or 1, the reserved id -2**63; called
// from inside a device call) is an InvalidArgumentError (InternalError for the last) before any op runs. The
// arrays are read once, at the call: what Python writes into them mid-batch does not change the batch.
//
// Note [Stopping before a slow allocation]: with stop_at_slow=True, run_ops returns before the first
// allocation its fast path cannot serve (one that needs allocate()'s full operation: a new segment, pages to
// map under a cached block, or anything else the fast path leaves to it), that op not run and nothing of it
// changed (the fast path changes nothing when it steps aside), with the number of ops completed
// (table.last_ops_done too). The estimate's fast replay skipping the small pool (NativeSkippingSink in
// gpumem/estimate/fastreplay.py) decides there, as the Python sink does before a large allocation that finds
// no cached block, whether that one could grow past the limit; every allocation the fast path serves (a
// cached block, its pages mapped: no device call, no growth) goes on in the same call.
PyObject* Alloc_run_ops(AllocObject* self, PyObject* args, PyObject* kwds) {
    CHECK_ALIVE(self);
    static const char* kwlist[] = {"kinds", "ids", "nbytes", "table", "stream", "stop_at_slow", nullptr};
    PyObject *o_kinds, *o_ids, *o_nbytes, *o_table, *o_stream = nullptr;
    int stop_at_slow = 0;   // Note [Stopping before a slow allocation]
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O$p:run_ops", const_cast<char**>(kwlist), &o_kinds, &o_ids,
                                     &o_nbytes, &o_table, &o_stream, &stop_at_slow))
        return nullptr;
    if (!gpumem_is_ptr_table(o_table)) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "run_ops: table must be a gpumem._engine.PtrTable, got a %.60s",
                      Py_TYPE(o_table)->tp_name);
        raise_kind(self, "INVALID_ARGUMENT", msg);
        return nullptr;
    }
    gpumem::PtrTableObject* table = reinterpret_cast<gpumem::PtrTableObject*>(o_table);
    std::uint64_t stream = 0;
    if (o_stream && !exact_u64(o_stream, &stream)) {
        PyObject* s = call_int_helper(self, "check_stream", o_stream);
        if (!s) return nullptr;
        stream = PyLong_AsUnsignedLongLong(s);
        bool bad = stream == static_cast<std::uint64_t>(-1) && PyErr_Occurred();
        Py_DECREF(s);
        if (bad) return nullptr;
    }
    Py_buffer vk, vi, vn;
    if (!ops_buffer(self, o_kinds, "kinds", 1, &vk)) return nullptr;
    if (!ops_buffer(self, o_ids, "ids", 8, &vi)) {
        PyBuffer_Release(&vk);
        return nullptr;
    }
    if (!ops_buffer(self, o_nbytes, "nbytes", 8, &vn)) {
        PyBuffer_Release(&vk);
        PyBuffer_Release(&vi);
        return nullptr;
    }
    struct Release {
        Py_buffer* v[3];
        ~Release() {
            for (Py_buffer* b : v) PyBuffer_Release(b);
        }
    } release{{&vk, &vi, &vn}};
    const Py_ssize_t n = vk.shape[0];
    char msg[200];
    if (vi.shape[0] != n || vn.shape[0] != n) {
        std::snprintf(msg, sizeof msg, "run_ops: kinds, ids and nbytes must have one length, got %zd, %zd and %zd",
                      n, vi.shape[0], vn.shape[0]);
        raise_kind(self, "INVALID_ARGUMENT", msg);
        return nullptr;
    }
    // The ops are copied before they are checked: a slow path runs Python (a device call, a subscriber) that
    // may write into the caller's arrays, and an id or kind changed after the check (the reserved id -2**63
    // put into the table as its empty marker, popped from an empty slot's stale pointer: a free of another
    // block) would break the table. The batch is the arrays as they were at the call.
    std::vector<std::int8_t> kinds_copy;
    std::vector<std::int64_t> ids_copy, sizes_copy;
    try {
        kinds_copy.assign(static_cast<const std::int8_t*>(vk.buf), static_cast<const std::int8_t*>(vk.buf) + n);
        ids_copy.assign(static_cast<const std::int64_t*>(vi.buf), static_cast<const std::int64_t*>(vi.buf) + n);
        sizes_copy.assign(static_cast<const std::int64_t*>(vn.buf), static_cast<const std::int64_t*>(vn.buf) + n);
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
    const std::int8_t* kinds = kinds_copy.data();
    const std::int64_t* ids = ids_copy.data();
    const std::int64_t* sizes = sizes_copy.data();
    std::size_t n_allocs = 0;
    const bool kinds_unsigned = vk.format && std::strchr(vk.format, 'B');   // uint8 kinds: say 255, not -1
    for (Py_ssize_t q = 0; q < n; ++q) {
        if ((kinds[q] != 0 && kinds[q] != 1) || ids[q] == gpumem::OpPtrMap::kEmpty) {
            if (ids[q] == gpumem::OpPtrMap::kEmpty)
                std::snprintf(msg, sizeof msg, "run_ops: op %zd names the id -2**63, which a PtrTable cannot hold", q);
            else
                std::snprintf(msg, sizeof msg, "run_ops: op %zd has kind %d (0: allocate, 1: free)", q,
                              kinds_unsigned ? static_cast<int>(static_cast<std::uint8_t>(kinds[q])) : kinds[q]);
            raise_kind(self, "INVALID_ARGUMENT", msg);
            return nullptr;
        }
        n_allocs += kinds[q] == 0;
    }
    if (self->engine->held_by_this_thread()) {   // Note [A free from inside a device call is deferred]
        raise_kind(self, "INTERNAL", "run_ops from inside one of this allocator's device calls");
        return nullptr;
    }
    // Note [A twin that runs the program's GPU work] in pybackend.cpp: each op's CPU time, each allocation's kernel
    PyDeviceBackend& backend = *self->backend;
    const bool lag = backend.gpu_lag();
    if (lag && stop_at_slow) {   // an op it stops before has had its CPU time: it cannot be sent again
        raise_kind(self, "INVALID_ARGUMENT", "run_ops: stop_at_slow with the twin's GPU lag on (an op it stops before "
                                        "has had its CPU time)");
        return nullptr;
    }
    gpumem::OpPtrMap& map = *table->map;
    try {
        map.reserve_more(n_allocs);   // the allocations' entries need no growth below (may still: another thread)
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
    table->last_ops_done = 0;
    Engine& engine = *self->engine;
    std::uint64_t waits = run_ops_gil_waits;
    bool check_device = true;   // allocate()'s device check is due before the next allocation
    Py_ssize_t q = 0;
    bool failed = false;
    while (q < n && !failed) {
        if (!self->engine) {   // cleared by the collector during a slow path
            alive(self);
            failed = true;
            break;
        }
        // the device check, made now for the run below (no Python runs in it: the device cannot close there)
        waits = run_ops_gil_waits;
        bool closed = false;
        if (check_device) {
            closed = device_closed(self);
            check_device = false;
        }
        // a run of fast paths under one lock (Note [One lock for a run of fast paths] in engine.cpp), up to the
        // first op that needs more: a slow path, an error, allocate()'s argument checks
        try {
            engine.hold_for_fast_run();
        } catch (...) {
            set_error(self);
            self->backend->clear_errors();
            failed = true;
            break;
        }
        // a wait for the lock let other threads run Python (the device may have closed since the check): one op
        // in this run, as the loop's op that waited, then the check again
        const Py_ssize_t run_end = run_ops_gil_waits != waits ? q + 1 : n;
        if (run_end != n) check_device = true;
        enum class Stop { kNone, kSlowAlloc, kSlowFree, kArgs, kClosed, kError, kNoMemory } stop = Stop::kNone;
        std::uint64_t p = 0;
        std::exception_ptr err;
        try {
            for (; q < run_end; ++q) {
                const std::int64_t id = ids[q];
                if (lag) backend.lag_before();
                if (kinds[q] == 0) {
                    const std::int64_t nb = sizes[q];
                    p = 0;
                    if (nb < 0) {
                        stop = Stop::kArgs;
                        break;
                    }
                    if (nb > 0) {
                        if (closed) {
                            stop = Stop::kClosed;
                            break;
                        }
                        p = engine.try_allocate_fast_held(static_cast<std::uint64_t>(nb), stream);
                        if (!p) {
                            stop = Stop::kSlowAlloc;
                            break;
                        }
                    }
                    map.put(id, p);   // room reserved above: no allocation
                    if (lag && p) backend.lag_after(stream, p, static_cast<std::uint64_t>(nb));
                } else {
                    if (!map.pop(id, &p) || !p) continue;
                    if (!engine.try_free_fast_held(p)) {
                        stop = Stop::kSlowFree;
                        break;
                    }
                }
            }
        } catch (const std::bad_alloc&) {   // as set_error() turns it (or map.put's growth: a table filled meanwhile)
            stop = Stop::kNoMemory;
        } catch (...) {
            stop = Stop::kError;
            err = std::current_exception();
        }
        engine.release_for_fast_run();
        switch (stop) {
            case Stop::kNone:
                continue;
            case Stop::kNoMemory:
                PyErr_NoMemory();
                failed = true;
                continue;
            case Stop::kClosed:
                closed_device_error(self);
                failed = true;
                continue;
            case Stop::kError:   // the fast path's exception, raised as allocate() or free() raises it
                try {
                    std::rethrow_exception(err);
                } catch (...) {
                    set_error(self);
                    self->backend->clear_errors();
                }
                failed = true;
                continue;
            default:
                break;
        }
        if (stop == Stop::kSlowAlloc && stop_at_slow) {   // Note [Stopping before a slow allocation]: op q not run
            table->last_ops_done = q;
            return PyLong_FromSsize_t(q);
        }
        failed = true;   // until the op below completes
        check_device = true;
        const std::int64_t id = ids[q];
        if (stop == Stop::kSlowAlloc) {
            const std::uint64_t nb = static_cast<std::uint64_t>(sizes[q]);
            PyObject* r = run_op(self, [&]() { return PyLong_FromUnsignedLongLong(self->engine->allocate(nb, stream)); });
            if (!r) continue;
            p = PyLong_AsUnsignedLongLong(r);
            Py_DECREF(r);
        } else if (stop == Stop::kArgs) {   // allocate() raises its argument error (or takes what its checks return)
            PyObject* o_nb = PyLong_FromLongLong(sizes[q]);
            PyObject* st = o_nb ? PyLong_FromUnsignedLongLong(stream) : nullptr;
            PyObject* call_args[2] = {o_nb, st};
            PyObject* r = st ? Alloc_allocate(self, call_args, 2, nullptr) : nullptr;
            Py_XDECREF(o_nb);
            Py_XDECREF(st);
            if (!r) continue;
            p = PyLong_AsUnsignedLongLong(r);
            Py_DECREF(r);
            if (p == static_cast<std::uint64_t>(-1) && PyErr_Occurred()) continue;
        } else if (stop == Stop::kSlowFree) {
            PyObject* r = run_op(self, [&]() {
                self->engine->free(p);
                Py_RETURN_NONE;
            });
            if (!r) continue;
            Py_DECREF(r);
        }
        if (stop != Stop::kSlowFree) {
            try {
                map.put(id, p);
            } catch (const std::bad_alloc&) {
                PyErr_NoMemory();
                continue;
            }
            if (lag && p && !lag_call(self, [&]() { backend.lag_after(stream, p, static_cast<std::uint64_t>(sizes[q])); }))
                continue;
        }
        failed = false;
        ++q;
    }
    table->last_ops_done = q;
    if (failed) return nullptr;
    return PyLong_FromSsize_t(n);
}

// small_pool_state() -> bytes: Note [The small pool's state as bytes] in engine.cpp (the estimate's fast replay).
PyObject* Alloc_small_pool_state(AllocObject* self, PyObject*) {
    CHECK_ALIVE(self);
    return run_op(self, [&]() -> PyObject* {
        std::string s = self->engine->small_pool_state();
        return PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
    });
}

PyMethodDef Alloc_methods[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Alloc_allocate)),
     METH_FASTCALL | METH_KEYWORDS, "allocate(nbytes, stream=0) -> device pointer"},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Alloc_free)), METH_FASTCALL,
     "free(ptr): return the block to the cache"},
    {"record_stream", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Alloc_record_stream)),
     METH_VARARGS | METH_KEYWORDS, "record_stream(ptr, stream)"},
    {"empty_cache", reinterpret_cast<PyCFunction>(Alloc_empty_cache), METH_NOARGS, "give cached memory back"},
    {"synchronize", reinterpret_cast<PyCFunction>(Alloc_synchronize), METH_NOARGS, "wait for the device"},
    {"close", reinterpret_cast<PyCFunction>(Alloc_close), METH_NOARGS, "give everything back"},
    {"stats", reinterpret_cast<PyCFunction>(Alloc_stats), METH_NOARGS, "the AllocatorStats counters, as a dict"},
    {"backing_stats", reinterpret_cast<PyCFunction>(Alloc_backing_stats), METH_NOARGS,
     "the backing's counters (chunks, steals, waits, ranges, address space, page, leaked), as a dict"},
    {"reserved_nbytes", reinterpret_cast<PyCFunction>(Alloc_reserved_nbytes), METH_NOARGS, "reserved bytes"},
    {"allocated_nbytes", reinterpret_cast<PyCFunction>(Alloc_allocated_nbytes), METH_NOARGS, "allocated bytes"},
    {"releasable_nbytes", reinterpret_cast<PyCFunction>(Alloc_releasable_nbytes), METH_VARARGS | METH_KEYWORDS,
     "releasable_nbytes(with_carried=False): what giving the cache back would release now"},
    {"block_size", reinterpret_cast<PyCFunction>(Alloc_block_size), METH_O, "size of a live block"},
    {"live_blocks", reinterpret_cast<PyCFunction>(Alloc_live_blocks), METH_NOARGS, "(ptr, size) of live blocks"},
    {"consistency_problems", reinterpret_cast<PyCFunction>(Alloc_consistency_problems), METH_O,
     "consistency_problems(list_device) -> list of problems; list_device() -> (mappings, reservations)"},
    {"describe", reinterpret_cast<PyCFunction>(Alloc_describe), METH_NOARGS, "the backing, in words"},
    {"closed", reinterpret_cast<PyCFunction>(Alloc_closed), METH_NOARGS, "whether close() ran"},
    {"lag_before", reinterpret_cast<PyCFunction>(Alloc_lag_before), METH_NOARGS,
     "lag_before(): the CPU reaches the program's next op"},
    {"lag_after", reinterpret_cast<PyCFunction>(Alloc_lag_after), METH_VARARGS,
     "lag_after(stream, ptr, nbytes): the kernel after an allocation"},
    {"lag_stats", reinterpret_cast<PyCFunction>(Alloc_lag_stats), METH_NOARGS,
     "lag_stats() -> dict or None: what the lagged twin did"},
    {"use_idle_twin", reinterpret_cast<PyCFunction>(Alloc_use_idle_twin), METH_VARARGS,
     "make an idle device's map, access, unmap and event calls in C++ (while no chunk or event is held)"},
    {"twin_device_closed", reinterpret_cast<PyCFunction>(Alloc_twin_device_closed), METH_NOARGS,
     "the device closed: its calls go to it again"},
    {"twin_mapping_ranges", reinterpret_cast<PyCFunction>(Alloc_twin_mapping_ranges), METH_NOARGS,
     "(va, nbytes, handle) of the idle twin's mappings; None when it is off"},
    {"lost", reinterpret_cast<PyCFunction>(Alloc_lost), METH_NOARGS, "whether the device was lost"},
    {"mark_step", reinterpret_cast<PyCFunction>(Alloc_mark_step), METH_NOARGS, "a step boundary (step plans)"},
    {"start_plan_warmup", reinterpret_cast<PyCFunction>(Alloc_start_plan_warmup), METH_NOARGS,
     "grow memory-first until a step plan is installed (Note [A memory-first warm-up] in plan.py)"},
    {"stop_plan_warmup", reinterpret_cast<PyCFunction>(Alloc_stop_plan_warmup), METH_NOARGS,
     "stop the memory-first warm-up as if it had not begun (its idle cache goes back); whether it was on"},
    {"step_template", reinterpret_cast<PyCFunction>(Alloc_step_template), METH_VARARGS,
     "step_template(missing_ok=False): the recorded step waiting for its plan: (nbytes, streams, free_own, "
     "free_next, generation); None with missing_ok when none waits"},
    {"install_plan", reinterpret_cast<PyCFunction>(Alloc_install_plan), METH_VARARGS,
     "install_plan(offsets, generation=-1) -> whether it was installed"},
    {"reset_peak_stats", reinterpret_cast<PyCFunction>(Alloc_reset_peak_stats), METH_NOARGS,
     "peaks down to the values now"},
    {"step_plan_info", reinterpret_cast<PyCFunction>(Alloc_step_plan_info), METH_NOARGS, "the plan layer's counters"},
    {"set_early_leave_steps", reinterpret_cast<PyCFunction>(Alloc_set_early_leave_steps), METH_VARARGS,
     "set_early_leave_steps(steps): planned steps within which a step that leaves the plan drops it (0: never)"},
    {"set_step_record_limit", reinterpret_cast<PyCFunction>(Alloc_set_step_record_limit), METH_VARARGS,
     "set_step_record_limit(records): records a recorded step may hold before it is abandoned"},
    {"run_ops", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Alloc_run_ops)),
     METH_VARARGS | METH_KEYWORDS,
     "run_ops(kinds, ids, nbytes, table, stream=0, *, stop_at_slow=False) -> ops run: a step's ops in one call"},
    {"small_pool_state", reinterpret_cast<PyCFunction>(Alloc_small_pool_state), METH_NOARGS,
     "small_pool_state() -> bytes: the small pool's state, exactly (the estimate's fast replay compares it)"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject AllocType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef engine_module = {PyModuleDef_HEAD_INIT, "gpumem._engine",
                             "gpumem's native allocator engine (see gpumem/_native/engine.h).", -1, nullptr,
                             nullptr, nullptr, nullptr, nullptr};

}  // namespace

int gpumem_add_cuda_allocator(PyObject* module);   // cuda_allocator.cpp

PyMODINIT_FUNC PyInit__engine(void) {
    AllocType.tp_name = "gpumem._engine.Allocator";
    AllocType.tp_basicsize = sizeof(AllocObject);
    AllocType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    AllocType.tp_traverse = reinterpret_cast<traverseproc>(Alloc_traverse);
    AllocType.tp_clear = reinterpret_cast<inquiry>(Alloc_clear);
    AllocType.tp_doc = "Allocator(device, helpers, policy=None, *, limit_nbytes=0, gc_threshold=0.0): the native "
                       "caching allocator engine over a "
                       "Python gpumem.device.Device (virtual-memory mode).";
    AllocType.tp_new = Alloc_new;
    AllocType.tp_dealloc = reinterpret_cast<destructor>(Alloc_dealloc);
    AllocType.tp_methods = Alloc_methods;
    if (PyType_Ready(&AllocType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&engine_module);
    if (!m) return nullptr;
    Py_INCREF(&AllocType);
    if (PyModule_AddObject(m, "Allocator", reinterpret_cast<PyObject*>(&AllocType)) < 0) {
        Py_DECREF(&AllocType);
        Py_DECREF(m);
        return nullptr;
    }
    // Note [The policy and the stats from one table each]: the tables' names, for the test that holds
    // them to the dataclasses
    const std::pair<const char*, PyObject*> names[] = {
        {"POLICY_FIELDS", field_names(kPolicyFields, [](const PolicyField&) { return true; })},
        {"STATS_FIELDS", field_names(kStatFields, [](const StatField& f) { return f.counter; })},
        {"BACKING_STATS_FIELDS", field_names(kStatFields, [](const StatField& f) { return !f.counter; })},
    };
    bool ok = true;
    for (const auto& [attr, value] : names) {
        if (ok && value && PyModule_AddObject(m, attr, value) == 0) continue;   // the reference is stolen
        ok = false;
        Py_XDECREF(value);
    }
    if (!ok) {
        Py_DECREF(m);
        return nullptr;
    }
    if (gpumem_add_cuda_allocator(m) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    if (gpumem_add_ptr_table(m) < 0) {   // Note [A step's ops in one call] (op_table.h)
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
