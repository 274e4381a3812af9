// gpumem._engine.PtrTable: a mapping op id (an int in (-2**63, 2**63)) -> pointer (an int in
// [0, 2**64)), held in C++ so that Allocator.run_ops reads and writes it without Python objects
// (Note [A step's ops in one call] in op_table.h). Its mapping methods are those of a dict of ints:
// t[id] = ptr, t[id], del t[id], id in t, len(t), t.get(id, default), t.pop(id[, default]),
// t.items(), t.clear().
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <new>

#include "op_table.h"

using gpumem::OpPtrMap;
using gpumem::PtrTableObject;

namespace {

PyTypeObject PtrTableType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// An op id: 1 and *out; 0 when it is an int no key can be (out of range, or the reserved -2**63), no
// error set; -1 with TypeError set when it is not an int.
int table_key(PyObject* o, std::int64_t* out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "PtrTable: op ids are ints, got %.80s", Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v == OpPtrMap::kEmpty) return 0;
    *out = v;
    return 1;
}

int key_or_raise(PyObject* o, std::int64_t* out) {
    int r = table_key(o, out);
    if (r == 0)
        PyErr_Format(PyExc_OverflowError, "PtrTable: an op id must be in (-2**63, 2**63), got %S", o);
    return r == 1 ? 0 : -1;
}

PyObject* Table_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
    if ((args && PyTuple_GET_SIZE(args)) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "PtrTable() takes no arguments");
        return nullptr;
    }
    PtrTableObject* self = reinterpret_cast<PtrTableObject*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    self->map = new (std::nothrow) OpPtrMap();
    self->last_ops_done = 0;
    if (!self->map) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return reinterpret_cast<PyObject*>(self);
}

void Table_dealloc(PtrTableObject* self) {
    delete self->map;
    self->map = nullptr;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

Py_ssize_t Table_len(PtrTableObject* self) { return static_cast<Py_ssize_t>(self->map->size()); }

PyObject* Table_getitem(PtrTableObject* self, PyObject* key) {
    std::int64_t k;
    int r = table_key(key, &k);
    if (r < 0) return nullptr;
    std::uint64_t v;
    if (r == 0 || !self->map->get(k, &v)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return nullptr;
    }
    return PyLong_FromUnsignedLongLong(v);
}

int Table_setitem(PtrTableObject* self, PyObject* key, PyObject* value) {
    std::int64_t k;
    if (key_or_raise(key, &k) < 0) return -1;
    if (!value) {   // del t[key]
        std::uint64_t old;
        if (self->map->pop(k, &old)) return 0;
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "PtrTable: pointers are ints, got %.80s", Py_TYPE(value)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "PtrTable: a pointer must be in [0, 2**64), got %S", value);
        return -1;
    }
    try {
        self->map->put(k, v);
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int Table_contains(PtrTableObject* self, PyObject* key) {
    std::int64_t k;
    int r = table_key(key, &k);
    if (r <= 0) return r;
    std::uint64_t v;
    return self->map->get(k, &v) ? 1 : 0;
}

// pop() and get(): (id[, default]), the id as table_key reads it (-1: an error is set, wrong arguments too)
int table_key_args(const char* name, PyObject* const* args, Py_ssize_t nargs, std::int64_t* k) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes an op id and an optional default", name);
        return -1;
    }
    return table_key(args[0], k);
}

// pop(id[, default])
PyObject* Table_pop(PtrTableObject* self, PyObject* const* args, Py_ssize_t nargs) {
    std::int64_t k;
    int r = table_key_args("pop", args, nargs, &k);
    if (r < 0) return nullptr;
    std::uint64_t v;
    if (r == 1 && self->map->pop(k, &v)) return PyLong_FromUnsignedLongLong(v);
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return nullptr;
}

// get(id, default=None)
PyObject* Table_get(PtrTableObject* self, PyObject* const* args, Py_ssize_t nargs) {
    std::int64_t k;
    int r = table_key_args("get", args, nargs, &k);
    if (r < 0) return nullptr;
    std::uint64_t v;
    if (r == 1 && self->map->get(k, &v)) return PyLong_FromUnsignedLongLong(v);
    PyObject* d = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(d);
    return d;
}

// items() -> list of (id, ptr), in no particular order
PyObject* Table_items(PtrTableObject* self, PyObject*) {
    PyObject* out = PyList_New(0);
    if (!out) return nullptr;
    bool ok = true;
    self->map->for_each([&](std::int64_t k, std::uint64_t v) {
        if (!ok) return;
        PyObject* t = Py_BuildValue("(LK)", static_cast<long long>(k), static_cast<unsigned long long>(v));
        ok = t && PyList_Append(out, t) == 0;
        Py_XDECREF(t);
    });
    if (!ok) Py_CLEAR(out);
    return out;
}

PyObject* Table_clear(PtrTableObject* self, PyObject*) {
    try {
        self->map->clear();
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

// log_puts(on): start (True) or stop (False, the log dropped) logging the values put (Note [The pointers a run
// got] in op_table.h)
PyObject* Table_log_puts(PtrTableObject* self, PyObject* on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return nullptr;
    self->map->set_logging(v != 0);
    Py_RETURN_NONE;
}

// take_log() -> bytes: the values put since the last take (native-endian uint64 each), the log emptied
PyObject* Table_take_log(PtrTableObject* self, PyObject*) {
    std::vector<std::uint64_t>& log = self->map->log();
    PyObject* out = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(log.data()),
                                              static_cast<Py_ssize_t>(log.size() * sizeof(std::uint64_t)));
    if (out) log.clear();
    return out;
}

PyObject* Table_last_ops_done(PtrTableObject* self, void*) { return PyLong_FromSsize_t(self->last_ops_done); }

PyMappingMethods Table_mapping = {
    reinterpret_cast<lenfunc>(Table_len),
    reinterpret_cast<binaryfunc>(Table_getitem),
    reinterpret_cast<objobjargproc>(Table_setitem),
};

PySequenceMethods Table_sequence = {};

PyMethodDef Table_methods[] = {
    {"pop", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Table_pop)), METH_FASTCALL,
     "pop(id[, default]) -> the pointer kept under id, forgotten"},
    {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Table_get)), METH_FASTCALL,
     "get(id, default=None) -> the pointer kept under id"},
    {"items", reinterpret_cast<PyCFunction>(Table_items), METH_NOARGS, "items() -> list of (id, pointer)"},
    {"clear", reinterpret_cast<PyCFunction>(Table_clear), METH_NOARGS, "forget every id"},
    {"log_puts", reinterpret_cast<PyCFunction>(Table_log_puts), METH_O,
     "log_puts(on): log every pointer put from now on (True), or stop and drop the log (False)"},
    {"take_log", reinterpret_cast<PyCFunction>(Table_take_log), METH_NOARGS,
     "take_log() -> bytes: the pointers put since the last take, as native uint64s; the log emptied"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef Table_getset[] = {
    {"last_ops_done", reinterpret_cast<getter>(Table_last_ops_done), nullptr,
     "ops the last Allocator.run_ops over this table completed (all of them, or those before the one that raised); "
     "a call refused for bad input (before any op runs) leaves it as it was",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

}  // namespace

bool gpumem_is_ptr_table(PyObject* o) { return PyObject_TypeCheck(o, &PtrTableType); }

int gpumem_add_ptr_table(PyObject* module) {
    PtrTableType.tp_name = "gpumem._engine.PtrTable";
    PtrTableType.tp_basicsize = sizeof(PtrTableObject);
    PtrTableType.tp_flags = Py_TPFLAGS_DEFAULT;
    PtrTableType.tp_doc = "PtrTable(): op id -> device pointer, for Allocator.run_ops (a dict of ints held in C++)";
    PtrTableType.tp_new = Table_new;
    PtrTableType.tp_dealloc = reinterpret_cast<destructor>(Table_dealloc);
    PtrTableType.tp_as_mapping = &Table_mapping;
    Table_sequence.sq_contains = reinterpret_cast<objobjproc>(Table_contains);
    PtrTableType.tp_as_sequence = &Table_sequence;
    PtrTableType.tp_methods = Table_methods;
    PtrTableType.tp_getset = Table_getset;
    if (PyType_Ready(&PtrTableType) < 0) return -1;
    Py_INCREF(&PtrTableType);
    if (PyModule_AddObject(module, "PtrTable", reinterpret_cast<PyObject*>(&PtrTableType)) < 0) {
        Py_DECREF(&PtrTableType);
        return -1;
    }
    return 0;
}
