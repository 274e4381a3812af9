// gpumem._engine.CudaAllocator: the native engine over the CUDA driver, called from Python.
//
// Allocator (module.cpp) runs the engine over a Python Device, so every device call is a Python
// call; this type runs it over CudaBackend (cuda_backend.cpp), the engine PyTorch's hooks use on
// that device (torch_api.cpp: one engine per device, made on first use and kept for the life of
// the process). allocate() and free() are METH_FASTCALL and call the engine's fast paths without
// leaving C++; the GIL is released only around the slow paths, which may wait for the device.
//
// Note [One engine per device, shared with PyTorch]: CudaAllocator(0) and gpumem.torch on device 0
// allocate from the same engine, so a pointer from one may be freed through the other, and the
// stats describe everything gpumem holds on the device.
//
// CupyAllocator is the function gpumem.cupy_allocator installs in CuPy (Note [CuPy's allocator in C]).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "cuda_backend.h"
#include "engine.h"

namespace gpumem {
Engine& cuda_engine(int device);   // torch_api.cpp
}

using gpumem::BackendError;
using gpumem::Engine;
using gpumem::EngineError;
using gpumem::EngineErrorKind;

namespace {

struct CudaAllocObject {
    PyObject_HEAD
    Engine* engine;
    int device;
};

// The gpumem.errors class named `name` (a new reference), or null with an exception set.
PyObject* error_class(const char* name) {
    PyObject* mod = PyImport_ImportModule("gpumem.errors");
    if (!mod) return nullptr;
    PyObject* cls = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    return cls;
}

// Raises gpumem.errors.<name>(msg). CudaError takes (call, error_name): a message "<call> failed: <name>"
// (CudaBackend's) is split there. PyErr_SetString would defer the construction to the handler, where
// CudaError(msg) fails with a TypeError that hides the CUDA error (seen under RMM on the H200).
void raise_as(const char* name, const std::string& msg) {
    PyObject* cls = error_class(name);
    if (!cls) return;
    PyObject* err = nullptr;
    if (std::strcmp(name, "CudaError") == 0) {
        const std::string sep = " failed: ";
        const std::size_t cut = msg.rfind(sep);
        const std::string call = cut == std::string::npos ? msg : msg.substr(0, cut);
        const std::string error_name = cut == std::string::npos ? "CUDA error" : msg.substr(cut + sep.size());
        err = PyObject_CallFunction(cls, "ss", call.c_str(), error_name.c_str());
    } else {
        err = PyObject_CallFunction(cls, "s", msg.c_str());
    }
    Py_DECREF(cls);
    if (!err) return;   // the construction's own exception is set
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err)), err);
    Py_DECREF(err);
}

// Turns the C++ exception being handled into a gpumem.errors exception.
void set_error(int device) {
    const std::string where = "cuda:" + std::to_string(device) + ": ";
    try {
        throw;
    } catch (const EngineError& e) {
        switch (e.kind) {
            case EngineErrorKind::kOutOfMemory: {
                // OutOfMemoryError(requested, free, total, device=..., allocated_nbytes=..., cached_nbytes=...)
                PyObject* cls = error_class("OutOfMemoryError");
                if (!cls) return;
                const gpumem::OomInfo& o = e.oom;
                PyObject* args = Py_BuildValue("(KKK)", static_cast<unsigned long long>(o.requested_nbytes),
                                               static_cast<unsigned long long>(o.free_nbytes),
                                               static_cast<unsigned long long>(o.total_nbytes));
                PyObject* kw = Py_BuildValue("{s:s,s:K,s:L,s:s}", "device", ("cuda:" + std::to_string(device)).c_str(),
                                             "allocated_nbytes", static_cast<unsigned long long>(o.allocated_nbytes),
                                             "cached_nbytes", static_cast<long long>(o.cached_signed),
                                             "hint", e.what());
                PyObject* err = (args && kw) ? PyObject_Call(cls, args, kw) : nullptr;
                Py_XDECREF(args);
                Py_XDECREF(kw);
                Py_DECREF(cls);
                if (err) {
                    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err)), err);
                    Py_DECREF(err);
                }
                return;
            }
            case EngineErrorKind::kInvalidPointer: raise_as("InvalidPointerError", where + e.what()); return;
            case EngineErrorKind::kDoubleFree: raise_as("DoubleFreeError", where + e.what()); return;
            case EngineErrorKind::kDeviceLost: raise_as("DeviceLostError", where + e.what()); return;
            case EngineErrorKind::kInternal: raise_as("InternalError", where + e.what()); return;
            default: raise_as("InvalidArgumentError", where + e.what()); return;
        }
    } catch (const BackendError& e) {
        raise_as(e.kind == gpumem::ErrorKind::kDeviceLost ? "DeviceLostError"
                 : e.kind == gpumem::ErrorKind::kOutOfMemory ? "OutOfMemoryError" : "CudaError",
                 where + e.what());
        if (e.kind == gpumem::ErrorKind::kOutOfMemory && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();   // OutOfMemoryError takes numbers: say it as a MemoryError instead
            PyErr_SetString(PyExc_MemoryError, (where + e.what()).c_str());
        }
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
    } catch (const std::exception& e) {
        raise_as("BackendUnavailableError", where + e.what());
    }
}

// Runs `op` with the GIL released (the engine may wait for the device); a C++ exception it throws
// becomes the Python exception, set with the GIL held again. Returns false when one was set.
template <class Op>
bool without_gil(int device, Op&& op) {
    std::exception_ptr failure;
    Py_BEGIN_ALLOW_THREADS
    try {
        op();
    } catch (...) {
        failure = std::current_exception();
    }
    Py_END_ALLOW_THREADS
    if (!failure) return true;
    try {
        std::rethrow_exception(failure);
    } catch (...) {
        set_error(device);
    }
    return false;
}

// An integer in [0, 2**64) (any integer type, through __index__, as gpumem.validate takes it; bool
// refused), or -1 with InvalidArgumentError set.
int as_u64(PyObject* o, const char* what, std::uint64_t* out) {
    if (PyLong_CheckExact(o)) {   // the common case, without PyNumber_Index's new reference
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (!(v == static_cast<unsigned long long>(-1) && PyErr_Occurred())) {
            *out = v;
            return 0;
        }
        PyErr_Clear();   // negative or too large: said below
    }
    PyObject* i = PyBool_Check(o) ? nullptr : PyNumber_Index(o);
    if (!i) {
        PyErr_Clear();
        raise_as("InvalidArgumentError", std::string(what) + " must be an int, got " + Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        raise_as("InvalidArgumentError", std::string(what) + " must be an int in [0, 2**64)");
        return -1;
    }
    *out = v;
    return 0;
}

PyObject* CudaAlloc_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    static const char* kwlist[] = {"device", nullptr};
    int device = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", const_cast<char**>(kwlist), &device)) return nullptr;
    Engine* engine = nullptr;
    if (!without_gil(device, [&] { engine = &gpumem::cuda_engine(device); })) return nullptr;
    auto* self = reinterpret_cast<CudaAllocObject*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    self->engine = engine;
    self->device = device;
    return reinterpret_cast<PyObject*>(self);
}

void CudaAlloc_dealloc(CudaAllocObject* self) { Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self)); }

PyObject* CudaAlloc_allocate(CudaAllocObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        raise_as("InvalidArgumentError", "allocate(nbytes, stream=0) takes 1 or 2 arguments");
        return nullptr;
    }
    std::uint64_t nbytes = 0, stream = 0;
    if (as_u64(args[0], "nbytes", &nbytes) < 0) return nullptr;
    if (nbytes == 0) {
        raise_as("InvalidArgumentError", "nbytes must be positive, got 0");
        return nullptr;
    }
    if (nargs == 2 && as_u64(args[1], "stream", &stream) < 0) return nullptr;
    std::uint64_t p = 0;
    try {
        p = self->engine->try_allocate_fast(nbytes, stream);
    } catch (...) {
        set_error(self->device);
        return nullptr;
    }
    if (p == 0 && !without_gil(self->device, [&] { p = self->engine->allocate(nbytes, stream); })) return nullptr;
    return PyLong_FromUnsignedLongLong(p);
}

PyObject* CudaAlloc_free(CudaAllocObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 1) {
        raise_as("InvalidArgumentError", "free(ptr) takes 1 argument");
        return nullptr;
    }
    std::uint64_t ptr = 0;
    if (as_u64(args[0], "ptr", &ptr) < 0) return nullptr;
    try {
        if (!self->engine->try_free_fast(ptr)) self->engine->free(ptr);
    } catch (...) {
        set_error(self->device);
        return nullptr;
    }
    Py_RETURN_NONE;
}

// record_stream(ptr, stream): the block is in use on `stream` too; free() then returns it for reuse only once
// the work queued on `stream` by then has run (PythonEngine.record_stream; a no-op on the block's own
// stream). gpumem.rmm_resource calls it when RMM frees a block on another stream than it was allocated on.
PyObject* CudaAlloc_record_stream(CudaAllocObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 2) {
        raise_as("InvalidArgumentError", "record_stream(ptr, stream) takes 2 arguments");
        return nullptr;
    }
    std::uint64_t ptr = 0, stream = 0;
    if (as_u64(args[0], "ptr", &ptr) < 0 || as_u64(args[1], "stream", &stream) < 0) return nullptr;
    try {
        self->engine->record_stream(ptr, stream);
    } catch (...) {
        set_error(self->device);
        return nullptr;
    }
    Py_RETURN_NONE;
}

PyObject* CudaAlloc_empty_cache(CudaAllocObject* self, PyObject*) {
    std::uint64_t released = 0;
    if (!without_gil(self->device, [&] { released = self->engine->empty_cache(); })) return nullptr;
    return PyLong_FromUnsignedLongLong(released);
}

PyObject* CudaAlloc_reserved(CudaAllocObject* self, PyObject*) {
    return PyLong_FromUnsignedLongLong(self->engine->reserved_nbytes());
}

PyObject* CudaAlloc_allocated(CudaAllocObject* self, PyObject*) {
    return PyLong_FromUnsignedLongLong(self->engine->allocated_nbytes());
}

PyObject* CudaAlloc_peaks(CudaAllocObject* self, PyObject*) {
    gpumem::EngineStats st = self->engine->stats();
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}",
                         "peak_allocated_nbytes", static_cast<unsigned long long>(st.peak_allocated_nbytes),
                         "peak_requested_nbytes", static_cast<unsigned long long>(st.peak_requested_nbytes),
                         "peak_reserved_nbytes", static_cast<unsigned long long>(st.peak_reserved_nbytes),
                         "device_calls", static_cast<unsigned long long>(st.device_calls),
                         "event_calls", static_cast<unsigned long long>(st.event_calls),
                         "num_allocs", static_cast<unsigned long long>(st.num_allocs));
}

PyObject* CudaAlloc_block_size(CudaAllocObject* self, PyObject* arg) {
    std::uint64_t ptr = 0, size = 0;
    if (as_u64(arg, "ptr", &ptr) < 0) return nullptr;
    try {
        size = self->engine->block_size(ptr);
    } catch (...) {
        set_error(self->device);
        return nullptr;
    }
    return PyLong_FromUnsignedLongLong(size);
}

PyObject* pairs_list(const std::vector<std::pair<std::uint64_t, std::uint64_t>>& pairs) {
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(pairs.size()));
    if (!out) return nullptr;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
        PyObject* t = Py_BuildValue("(KK)", static_cast<unsigned long long>(pairs[i].first),
                                    static_cast<unsigned long long>(pairs[i].second));
        if (!t) {
            Py_DECREF(out);
            return nullptr;
        }
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), t);
    }
    return out;
}

PyObject* CudaAlloc_live_blocks(CudaAllocObject* self, PyObject*) {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> blocks;
    if (!without_gil(self->device, [&] { blocks = self->engine->live_blocks(); })) return nullptr;
    return pairs_list(blocks);
}

// The engine's own invariants (blocks tile their ranges, free lists, byte counts): the driver does not
// list a process's mappings, so unlike Allocator.consistency_problems there is no device side to compare.
PyObject* CudaAlloc_consistency_problems(CudaAllocObject* self, PyObject*) {
    std::vector<std::string> problems;
    if (!without_gil(self->device, [&] { problems = self->engine->consistency_problems(Engine::ListDevice()); }))
        return nullptr;
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(problems.size()));
    if (!out) return nullptr;
    for (std::size_t i = 0; i < problems.size(); ++i) {
        PyObject* s = PyUnicode_FromString(problems[i].c_str());
        if (!s) {
            Py_DECREF(out);
            return nullptr;
        }
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), s);
    }
    return out;
}

PyMethodDef CudaAlloc_methods[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CudaAlloc_allocate)), METH_FASTCALL,
     "allocate(nbytes, stream=0) -> int: a device pointer from the device's engine."},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CudaAlloc_free)), METH_FASTCALL,
     "free(ptr): give the allocation back to the engine's cache (stream-ordered)."},
    {"record_stream", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CudaAlloc_record_stream)),
     METH_FASTCALL, "record_stream(ptr, stream): the block is used on stream too; its free waits for that work."},
    {"empty_cache", reinterpret_cast<PyCFunction>(CudaAlloc_empty_cache), METH_NOARGS,
     "empty_cache() -> int: give cached memory back to the device; returns the bytes released."},
    {"reserved_nbytes", reinterpret_cast<PyCFunction>(CudaAlloc_reserved), METH_NOARGS,
     "reserved_nbytes() -> int: device memory the engine holds now."},
    {"allocated_nbytes", reinterpret_cast<PyCFunction>(CudaAlloc_allocated), METH_NOARGS,
     "allocated_nbytes() -> int: bytes in live blocks."},
    {"peaks", reinterpret_cast<PyCFunction>(CudaAlloc_peaks), METH_NOARGS,
     "peaks() -> dict: peak allocated/requested/reserved bytes and device-call counts."},
    {"block_size", reinterpret_cast<PyCFunction>(CudaAlloc_block_size), METH_O,
     "block_size(ptr) -> int: the size of the live block at ptr (the request rounded as the engine rounds it)."},
    {"live_blocks", reinterpret_cast<PyCFunction>(CudaAlloc_live_blocks), METH_NOARGS,
     "live_blocks() -> list of (ptr, size) of every live block, by address."},
    {"consistency_problems", reinterpret_cast<PyCFunction>(CudaAlloc_consistency_problems), METH_NOARGS,
     "consistency_problems() -> list[str]: the engine's broken invariants (empty: consistent)."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject CudaAllocType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Note [CuPy's allocator in C]: CuPy calls its allocator once per array (cupy.cuda.alloc(nbytes) ->
// MemoryPointer) and frees when the last reference to the memory object goes. Done in Python
// (gpumem.cupy_allocator.CupyMalloc over a CachingAllocator), each call paid a Python frame, a dict
// read for the device's allocator, the CachingAllocator's argument checks and a Python finaliser per
// free: 2.6-4.8 us against CuPy's pool 1.4-2.6. CupyAllocator does the same in C: the current device
// is the current context's (one driver call), the stream comes from CuPy's own C function (given at
// construction: nothing here imports CuPy; Note [CuPy's stream in C]), the device's engine (the one
// CudaAllocator(device) and PyTorch use) is cached per device, the engine's hot path runs without
// leaving C++, and CuPy's UnownedMemory and MemoryPointer are called with argument tuples kept between
// calls (Note [CuPy's objects, made for less]). The owner CuPy keeps is a CupyBlock, whose deallocator
// (C, no Python frame) gives the block back to its engine, stream-ordered on the stream it was
// allocated on. The memory's size is the block's (the request rounded, a multiple of 512 B), as CuPy's
// pool reports it and as CuPy code reads it (test_percentile_memory_access). A block whose owner fails
// to be made is freed at once; the owner is made before anything else can fail, so none leaks.
constexpr int kMaxCupyDevices = 64;   // as torch_api.cpp's kMaxDevices
constexpr std::size_t kSizeInts = 64;   // Note [CuPy's objects, made for less]

struct CupyBlockObject {
    PyObject_HEAD
    Engine* engine;
    unsigned long long ptr;
    int device;
};

void free_block(Engine* engine, std::uint64_t ptr, int device) {
    try {
        if (!engine->try_free_fast(ptr)) engine->free(ptr);
    } catch (...) {
        // never raise from a deallocator: the failure is reported as unraisable, an exception in
        // flight is kept
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        set_error(device);
        PyErr_WriteUnraisable(nullptr);
        PyErr_Restore(type, value, tb);
    }
}

void CupyBlock_dealloc(CupyBlockObject* self) {
    if (self->ptr) free_block(self->engine, self->ptr, self->device);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMemberDef CupyBlock_members[] = {
    {const_cast<char*>("ptr"), T_ULONGLONG, offsetof(CupyBlockObject, ptr), READONLY,
     const_cast<char*>("the block's device pointer")},
    {const_cast<char*>("device"), T_INT, offsetof(CupyBlockObject, device), READONLY,
     const_cast<char*>("the CUDA device it is on")},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject CupyBlockType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// CuPy's own C functions for its current stream, which this allocator calls when it is given their capsule
// instead of a Python function (no Python call), Note [CuPy's stream in C].
using StreamPtrFn = std::intptr_t (*)();                 // cupy.cuda.stream.get_current_stream_ptr
using DeviceStreamPtrFn = std::intptr_t (*)(int device);  // cupy_backends.cuda.stream.get_stream_ptr

// Note [CuPy's per-thread default stream]: with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 CuPy's current
// stream is cudaStreamPerThread (handle 2) in every thread, a different stream in each. The engine keys
// its free lists and its fences by the handle, so a block freed by one thread could be handed at once to
// another thread's stream while the first thread's kernels still use it (CuPy's pool keys by thread
// there). The hook refuses that stream, saying so, rather than race.
constexpr long long kPerThreadStream = 2;   // cudaStreamPerThread
constexpr const char* kPerThreadMessage =
    "gpumem's CuPy hook does not serve CuPy's per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): "
    "one handle names a different stream in each thread; use an explicit cupy.cuda.Stream per thread";
constexpr const char* kStreamPtrCapsule = "intptr_t (void)";
constexpr const char* kDeviceStreamPtrCapsule = "intptr_t (int)";

// Note [CuPy's stream in C]: CuPy 14's cupy.cuda.stream.get_current_stream_ptr() (`cdef intptr_t ...()
// except? -1`, exported in its module's __pyx_capi__ under the signature "intptr_t (void)") reads its own
// thread-local object and does not use it, then calls cupy_backends.cuda.stream.get_current_stream_ptr(),
// which reads that module's thread-local object, asks the runtime for the current device (cudaGetDevice)
// and returns current_stream[device]: two thread-local attribute reads and a runtime call. The hook has
// found the device already (the current context's, which is what cudaGetDevice reports: the runtime uses
// the context current on the thread), so given cupy_backends' get_stream_ptr(device) ("intptr_t (int)",
// CuPy 14) it reads the same current_stream[device] with one thread-local read and no runtime call. CuPy
// 13 has no get_stream_ptr: gpumem.cupy_allocator.native_hook then gives the first function, and where
// neither capsule is there, a Python function (call_int). Either C function returns -1 with an exception
// set when it fails (Cython's `except? -1`), which the hook raises.

struct CupyAllocObject {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject* get_device;       // () -> int: CuPy's current device
    PyObject* get_stream;       // () -> int: CuPy's current stream (its pointer); or a capsule of the C function
    StreamPtrFn stream_fn;      // from that capsule ("intptr_t (void)"), or null
    DeviceStreamPtrFn device_stream_fn;   // from that capsule ("intptr_t (int)": the device's stream), or null
    PyObject* unowned_memory;   // UnownedMemory(ptr, size, owner, device_id)
    PyObject* memory_pointer;   // MemoryPointer(mem, offset)
    PyObject* on_oom;           // (nbytes, device, gpumem error) -> the exception to raise
    PyObject* zero;
    Engine* engines[kMaxCupyDevices];   // made on a device's first allocation; written with the GIL held
    PyObject* mem_args;   // the argument tuples of UnownedMemory and MemoryPointer, kept between calls (Note
    PyObject* ptr_args;   // [CuPy's objects, made for less]); null until the first call or while one is in use
    PyObject* size_ints[kSizeInts];   // the block sizes' ints, by kSizeInts slots (null: none yet)
};

// Calls `fn()` and reads an int in [lo, hi) from it; false with an exception set otherwise.
bool call_int(PyObject* fn, const char* what, long long lo, long long hi, long long* out) {
    PyObject* r = PyObject_CallNoArgs(fn);
    if (!r) return false;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) return false;
    if (v < lo || v >= hi) {
        raise_as("InvalidArgumentError", std::string(what) + " is " + std::to_string(v) + ", outside [" +
                 std::to_string(lo) + ", " + std::to_string(hi) + ")");
        return false;
    }
    *out = v;
    return true;
}

// Sets the Python error for `failure` (an allocation's): out of memory goes through on_oom (CuPy's
// OutOfMemoryError, which CuPy code catches, caused by gpumem's); the rest as CudaAllocator raises it.
void set_alloc_error(CupyAllocObject* self, std::exception_ptr failure, std::uint64_t nbytes, int device) {
    bool oom = false;
    try {
        std::rethrow_exception(failure);
    } catch (const EngineError& e) {
        oom = e.kind == EngineErrorKind::kOutOfMemory;
        set_error(device);
    } catch (const BackendError& e) {
        oom = e.kind == gpumem::ErrorKind::kOutOfMemory;
        set_error(device);
    } catch (...) {
        set_error(device);
    }
    if (!oom || !PyErr_Occurred()) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    PyObject* exc = PyObject_CallFunction(self->on_oom, "KiO", static_cast<unsigned long long>(nbytes), device, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (!exc) return;   // on_oom's own error
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
    Py_DECREF(exc);
}

// Note [CuPy's objects, made for less]: CuPy's contract is a MemoryPointer(UnownedMemory(ptr, size, owner,
// device), 0) per allocation; CuPy's classes are Cython types, which take their arguments as a tuple, so a
// vectorcall of one built a tuple, called the type with it and freed it, twice per allocation. The hook
// keeps the two tuples instead, between calls, filled with None while idle: a call takes its tuple out of
// the object (a call made meanwhile, re-entrant through a finaliser or from a thread the call let run,
// finds none and builds its own), fills it, calls the type with it (PyObject_Call: the type's tp_call,
// what the vectorcall came to) and puts it back emptied only if nothing else kept a reference (a Python
// __init__(*args) gets a tuple of its own; BaseException keeps the one it is given: a callee that kept ours
// keeps it, intact, and the next call builds another). The tuples are not tracked by the collector, so
// gc.get_objects() never hands one out while it is filled. The ints CuPy converts are the pointer, the
// block's size and the device (a small int, cached by Python): kSizeInts sizes' ints are kept, one per
// slot by size (a block size, a multiple of 512 B, recurs: a training step asks for the same ones), so a
// size seen before costs no int. Same objects, same values, same owner as before: 8 % fewer instructions
// per allocate+free on the CPU harness (reports/cupy-hook-outside-engine.md).

// The int of `size` (a new reference), from the cache when it holds it; null with an exception set.
PyObject* size_int(CupyAllocObject* self, std::uint64_t size) {
    PyObject*& slot = self->size_ints[(size >> 9) % kSizeInts];
    if (slot != nullptr && PyLong_AsUnsignedLongLong(slot) == size) {
        Py_INCREF(slot);
        return slot;
    }
    PyObject* o = PyLong_FromUnsignedLongLong(size);
    if (!o) return nullptr;
    Py_INCREF(o);
    Py_XSETREF(slot, o);
    return o;
}

// Calls `type(*items)` through the tuple kept in `slot` (stealing each item), or a new one where it is in use
// or was kept by the callee; returns the result or null with an exception set.
PyObject* call_with_kept_tuple(PyObject*& slot, PyObject* type, PyObject* const* items, Py_ssize_t n) {
    PyObject* args = slot;
    slot = nullptr;
    if (args != nullptr && Py_REFCNT(args) != 1) {   // someone holds it: leave it to them
        Py_DECREF(args);
        args = nullptr;
    }
    if (args == nullptr) {
        args = PyTuple_New(n);
        if (!args) {
            for (Py_ssize_t i = 0; i < n; ++i) Py_DECREF(items[i]);
            return nullptr;
        }
        if (PyObject_GC_IsTracked(args)) PyObject_GC_UnTrack(args);
        for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(args, i, items[i]);
    } else {
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* old = PyTuple_GET_ITEM(args, i);
            PyTuple_SET_ITEM(args, i, items[i]);
            Py_XDECREF(old);
        }
    }
    PyObject* out = PyObject_Call(type, args, nullptr);   // a Cython type: its tp_call with this tuple
    if (Py_REFCNT(args) == 1 && slot == nullptr) {   // ours alone: emptied (None) and kept for the next call
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* old = PyTuple_GET_ITEM(args, i);
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(args, i, Py_None);
            Py_DECREF(old);
        }
        if (slot == nullptr) {   // the decrefs above may have run a finaliser that filled it
            slot = args;
            return out;
        }
    }
    // Someone kept the tuple (a class that stores its arguments, as BaseException's .args does): give it
    // back to the garbage collector, or a reference cycle through it could never be collected.
    if (Py_REFCNT(args) > 1 && !PyObject_GC_IsTracked(args)) PyObject_GC_Track(args);
    Py_DECREF(args);
    return out;
}

// MemoryPointer(UnownedMemory(ptr, size, owner, device), 0); `owner` is stolen.
PyObject* cupy_pointer(CupyAllocObject* self, std::uint64_t ptr, std::uint64_t size, PyObject* owner, int device) {
    PyObject* ptr_o = PyLong_FromUnsignedLongLong(ptr);
    PyObject* size_o = ptr_o ? size_int(self, size) : nullptr;
    PyObject* dev_o = size_o ? PyLong_FromLong(device) : nullptr;
    if (!dev_o) {
        Py_XDECREF(ptr_o);
        Py_XDECREF(size_o);
        Py_DECREF(owner);   // without a memory object, the block goes back here
        return nullptr;
    }
    PyObject* mem_items[4] = {ptr_o, size_o, owner, dev_o};   // stolen: the memory object keeps the owner
    PyObject* mem = call_with_kept_tuple(self->mem_args, self->unowned_memory, mem_items, 4);
    if (!mem) return nullptr;
    Py_INCREF(self->zero);
    PyObject* ptr_items[2] = {mem, self->zero};
    return call_with_kept_tuple(self->ptr_args, self->memory_pointer, ptr_items, 2);
}

// The device an allocation goes to: the device of the current context is CuPy's current device once
// CuPy has used it (cudaSetDevice makes its primary context current); before that (no context yet),
// CuPy's own function says. False with an exception set.
bool current_device(CupyAllocObject* self, int* out) {
    long long dev = gpumem::current_context_device();
    if ((dev < 0 || dev >= kMaxCupyDevices) &&
        !call_int(self->get_device, "CuPy's current device", 0, kMaxCupyDevices, &dev))
        return false;
    *out = static_cast<int>(dev);
    return true;
}

// CuPy's current stream (its handle) on `device` (the current device), refused where it is the per-thread
// default stream. False with an exception set.
bool current_stream(CupyAllocObject* self, int device, long long* out) {
    long long stream = 0;
    if (self->stream_fn || self->device_stream_fn) {
        stream = static_cast<long long>(self->device_stream_fn ? self->device_stream_fn(device) : self->stream_fn());
        if (stream == -1 && PyErr_Occurred()) return false;
        if (stream < 0) {
            raise_as("InvalidArgumentError", "CuPy's current stream is " + std::to_string(stream));
            return false;
        }
    } else if (!call_int(self->get_stream, "CuPy's current stream", 0, LLONG_MAX, &stream)) {
        return false;
    }
    if (stream == kPerThreadStream) {
        raise_as("BackendUnavailableError", kPerThreadMessage);
        return false;
    }
    *out = stream;
    return true;
}

PyObject* CupyAlloc_vectorcall(PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    auto* self = reinterpret_cast<CupyAllocObject*>(callable);
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        raise_as("InvalidArgumentError", "CupyAllocator(nbytes) takes 1 positional argument");
        return nullptr;
    }
    std::uint64_t nbytes = 0;
    if (as_u64(args[0], "nbytes", &nbytes) < 0) return nullptr;
    int device = 0;
    if (!current_device(self, &device)) return nullptr;
    if (nbytes == 0) {   // no memory, as CuPy's pool gives a size-0 array
        Py_INCREF(Py_None);
        return cupy_pointer(self, 0, 0, Py_None, device);
    }
    long long stream = 0;
    if (!current_stream(self, device, &stream)) return nullptr;
    Engine* engine = self->engines[device];
    if (engine == nullptr) {
        if (!without_gil(device, [&] { engine = &gpumem::cuda_engine(device); })) return nullptr;
        self->engines[device] = engine;
    }
    const std::uint64_t s = static_cast<std::uint64_t>(stream);
    std::uint64_t p = 0, size = 0;
    std::exception_ptr failure;
    try {
        p = engine->try_allocate_fast(nbytes, s, &size);   // the size under the same lock
    } catch (...) {
        failure = std::current_exception();
    }
    if (p == 0 && !failure) {
        Py_BEGIN_ALLOW_THREADS
        try {
            p = engine->allocate(nbytes, s);
        } catch (...) {
            failure = std::current_exception();
        }
        Py_END_ALLOW_THREADS
    }
    if (!failure && size == 0) {   // the slow path: the size asked for
        try {
            size = engine->block_size(p);
        } catch (...) {
            failure = std::current_exception();
            free_block(engine, p, device);
        }
    }
    if (failure) {
        set_alloc_error(self, failure, nbytes, device);
        return nullptr;
    }
    CupyBlockObject* owner = PyObject_New(CupyBlockObject, &CupyBlockType);
    if (!owner) {
        free_block(engine, p, device);
        return nullptr;
    }
    owner->engine = engine;
    owner->ptr = p;
    owner->device = device;
    return cupy_pointer(self, p, size, reinterpret_cast<PyObject*>(owner), device);
}

PyObject* CupyAlloc_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    static const char* kwlist[] = {"get_device_id", "get_current_stream_ptr", "unowned_memory", "memory_pointer",
                                   "on_out_of_memory", nullptr};
    PyObject* f[5] = {};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO", const_cast<char**>(kwlist), &f[0], &f[1], &f[2], &f[3],
                                     &f[4]))
        return nullptr;
    StreamPtrFn stream_fn = nullptr;
    DeviceStreamPtrFn device_stream_fn = nullptr;
    if (PyCapsule_CheckExact(f[1])) {
        const char* name = PyCapsule_GetName(f[1]);
        const bool by_device = name && std::strcmp(name, kDeviceStreamPtrCapsule) == 0;
        if (!name || (!by_device && std::strcmp(name, kStreamPtrCapsule) != 0)) {
            PyErr_Clear();
            raise_as("InvalidArgumentError", std::string("CupyAllocator: the stream capsule must hold a C function '") +
                     kStreamPtrCapsule + "' or '" + kDeviceStreamPtrCapsule + "', it holds '" + (name ? name : "?") +
                     "'");
            return nullptr;
        }
        void* fn = PyCapsule_GetPointer(f[1], name);
        if (!fn) return nullptr;
        if (by_device)
            device_stream_fn = reinterpret_cast<DeviceStreamPtrFn>(fn);
        else
            stream_fn = reinterpret_cast<StreamPtrFn>(fn);
    }
    const bool stream_in_c = stream_fn || device_stream_fn;
    for (int i = 0; i < 5; ++i)
        if (!(i == 1 && stream_in_c) && !PyCallable_Check(f[i])) {
            raise_as("InvalidArgumentError", std::string("CupyAllocator: ") + kwlist[i] + " must be callable, got " +
                     Py_TYPE(f[i])->tp_name);
            return nullptr;
        }
    auto* self = reinterpret_cast<CupyAllocObject*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    self->vectorcall = CupyAlloc_vectorcall;
    self->stream_fn = stream_fn;
    self->device_stream_fn = device_stream_fn;
    PyObject** slots[5] = {&self->get_device, &self->get_stream, &self->unowned_memory, &self->memory_pointer,
                           &self->on_oom};
    for (int i = 0; i < 5; ++i) {
        Py_INCREF(f[i]);
        *slots[i] = f[i];
    }
    self->zero = PyLong_FromLong(0);
    for (auto& e : self->engines) e = nullptr;
    self->mem_args = nullptr;
    self->ptr_args = nullptr;
    for (auto& o : self->size_ints) o = nullptr;
    if (!self->zero) {
        Py_DECREF(self);
        return nullptr;
    }
    return reinterpret_cast<PyObject*>(self);
}

int CupyAlloc_traverse(CupyAllocObject* self, visitproc visit, void* arg) {
    Py_VISIT(self->get_device);
    Py_VISIT(self->get_stream);
    Py_VISIT(self->unowned_memory);
    Py_VISIT(self->memory_pointer);
    Py_VISIT(self->on_oom);
    Py_VISIT(self->mem_args);
    Py_VISIT(self->ptr_args);
    return 0;
}

int CupyAlloc_clear(CupyAllocObject* self) {
    Py_CLEAR(self->get_device);
    Py_CLEAR(self->get_stream);
    Py_CLEAR(self->unowned_memory);
    Py_CLEAR(self->memory_pointer);
    Py_CLEAR(self->on_oom);
    Py_CLEAR(self->zero);
    Py_CLEAR(self->mem_args);
    Py_CLEAR(self->ptr_args);
    for (auto& o : self->size_ints) Py_CLEAR(o);
    return 0;
}

void CupyAlloc_dealloc(CupyAllocObject* self) {
    PyObject_GC_UnTrack(self);
    CupyAlloc_clear(self);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* CupyAlloc_engine_devices(CupyAllocObject* self, PyObject*) {
    PyObject* out = PyList_New(0);
    if (!out) return nullptr;
    for (int d = 0; d < kMaxCupyDevices; ++d) {
        if (!self->engines[d]) continue;
        PyObject* i = PyLong_FromLong(d);
        if (!i || PyList_Append(out, i) < 0) {
            Py_XDECREF(i);
            Py_DECREF(out);
            return nullptr;
        }
        Py_DECREF(i);
    }
    return out;
}

PyObject* CupyAlloc_stream_in_c(CupyAllocObject* self, PyObject*) {
    return PyBool_FromLong(self->stream_fn != nullptr || self->device_stream_fn != nullptr);
}

PyObject* CupyAlloc_stream_by_device(CupyAllocObject* self, PyObject*) {
    return PyBool_FromLong(self->device_stream_fn != nullptr);
}

PyObject* CupyAlloc_current_device(CupyAllocObject* self, PyObject*) {
    int device = 0;
    return current_device(self, &device) ? PyLong_FromLong(device) : nullptr;
}

PyObject* CupyAlloc_current_stream(CupyAllocObject* self, PyObject*) {
    int device = 0;
    long long stream = 0;
    if (self->device_stream_fn && !current_device(self, &device)) return nullptr;
    return current_stream(self, device, &stream) ? PyLong_FromLongLong(stream) : nullptr;
}

PyMethodDef CupyAlloc_methods[] = {
    {"reads_stream_in_c", reinterpret_cast<PyCFunction>(CupyAlloc_stream_in_c), METH_NOARGS,
     "reads_stream_in_c() -> bool: whether CuPy's current stream is read through CuPy's C function (a capsule)."},
    {"reads_stream_by_device", reinterpret_cast<PyCFunction>(CupyAlloc_stream_by_device), METH_NOARGS,
     "reads_stream_by_device() -> bool: whether that C function is cupy_backends' get_stream_ptr(device), given the "
     "device the hook found (Note [CuPy's stream in C])."},
    {"current_device", reinterpret_cast<PyCFunction>(CupyAlloc_current_device), METH_NOARGS,
     "current_device() -> int: the device an allocation now goes to, found as each allocation finds it (the current "
     "context's device, else CuPy's current device)."},
    {"current_stream", reinterpret_cast<PyCFunction>(CupyAlloc_current_stream), METH_NOARGS,
     "current_stream() -> int: CuPy's current stream, read as each allocation reads it (the per-thread default "
     "stream refused)."},
    {"devices", reinterpret_cast<PyCFunction>(CupyAlloc_engine_devices), METH_NOARGS,
     "devices() -> list[int]: the devices this allocator has allocated on (CudaAllocator(d) reads each one)."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject CupyAllocType = {PyVarObject_HEAD_INIT(nullptr, 0)};

int add_type(PyObject* module, PyTypeObject* type, const char* name) {
    if (PyType_Ready(type) < 0) return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, reinterpret_cast<PyObject*>(type)) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

}  // namespace

// Adds CudaAllocator to the module (called from PyInit__engine in module.cpp); -1 on error.
int gpumem_add_cuda_allocator(PyObject* module) {
    CudaAllocType.tp_name = "gpumem._engine.CudaAllocator";
    CudaAllocType.tp_basicsize = sizeof(CudaAllocObject);
    CudaAllocType.tp_flags = Py_TPFLAGS_DEFAULT;
    CudaAllocType.tp_doc = "CudaAllocator(device=0): the native engine over the CUDA driver on one device, shared "
                           "with gpumem.torch (Note [One engine per device, shared with PyTorch]).";
    CudaAllocType.tp_new = CudaAlloc_new;
    CudaAllocType.tp_dealloc = reinterpret_cast<destructor>(CudaAlloc_dealloc);
    CudaAllocType.tp_methods = CudaAlloc_methods;
    if (add_type(module, &CudaAllocType, "CudaAllocator") < 0) return -1;

    CupyBlockType.tp_name = "gpumem._engine.CupyBlock";
    CupyBlockType.tp_basicsize = sizeof(CupyBlockObject);
    CupyBlockType.tp_flags = Py_TPFLAGS_DEFAULT;
    CupyBlockType.tp_doc = "A block of a device's engine that CuPy holds; freed when CuPy lets go of it.";
    CupyBlockType.tp_dealloc = reinterpret_cast<destructor>(CupyBlock_dealloc);
    CupyBlockType.tp_members = CupyBlock_members;
    if (add_type(module, &CupyBlockType, "CupyBlock") < 0) return -1;

    CupyAllocType.tp_name = "gpumem._engine.CupyAllocator";
    CupyAllocType.tp_basicsize = sizeof(CupyAllocObject);
    CupyAllocType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
    CupyAllocType.tp_vectorcall_offset = offsetof(CupyAllocObject, vectorcall);
    CupyAllocType.tp_call = PyVectorcall_Call;
    CupyAllocType.tp_doc = "CupyAllocator(get_device_id, get_current_stream_ptr, unowned_memory, memory_pointer, "
                           "on_out_of_memory): the function gpumem.cupy_allocator installs in CuPy (Note [CuPy's "
                           "allocator in C]).";
    CupyAllocType.tp_new = CupyAlloc_new;
    CupyAllocType.tp_dealloc = reinterpret_cast<destructor>(CupyAlloc_dealloc);
    CupyAllocType.tp_traverse = reinterpret_cast<traverseproc>(CupyAlloc_traverse);
    CupyAllocType.tp_clear = reinterpret_cast<inquiry>(CupyAlloc_clear);
    CupyAllocType.tp_methods = CupyAlloc_methods;
    return add_type(module, &CupyAllocType, "CupyAllocator");
}
