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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <exception>
#include <string>

#include "backend.h"
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

void raise_as(const char* name, const std::string& msg) {
    PyObject* cls = error_class(name);
    if (!cls) return;
    PyErr_SetString(cls, msg.c_str());
    Py_DECREF(cls);
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

PyMethodDef CudaAlloc_methods[] = {
    {"allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CudaAlloc_allocate)), METH_FASTCALL,
     "allocate(nbytes, stream=0) -> int: a device pointer from the device's engine."},
    {"free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CudaAlloc_free)), METH_FASTCALL,
     "free(ptr): give the allocation back to the engine's cache (stream-ordered)."},
    {"empty_cache", reinterpret_cast<PyCFunction>(CudaAlloc_empty_cache), METH_NOARGS,
     "empty_cache() -> int: give cached memory back to the device; returns the bytes released."},
    {"reserved_nbytes", reinterpret_cast<PyCFunction>(CudaAlloc_reserved), METH_NOARGS,
     "reserved_nbytes() -> int: device memory the engine holds now."},
    {"allocated_nbytes", reinterpret_cast<PyCFunction>(CudaAlloc_allocated), METH_NOARGS,
     "allocated_nbytes() -> int: bytes in live blocks."},
    {"peaks", reinterpret_cast<PyCFunction>(CudaAlloc_peaks), METH_NOARGS,
     "peaks() -> dict: peak allocated/requested/reserved bytes and device-call counts."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject CudaAllocType = {PyVarObject_HEAD_INIT(nullptr, 0)};

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
    if (PyType_Ready(&CudaAllocType) < 0) return -1;
    Py_INCREF(&CudaAllocType);
    if (PyModule_AddObject(module, "CudaAllocator", reinterpret_cast<PyObject*>(&CudaAllocType)) < 0) {
        Py_DECREF(&CudaAllocType);
        return -1;
    }
    return 0;
}
