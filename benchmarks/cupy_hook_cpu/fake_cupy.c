/* Stand-ins for CuPy 14.2's pieces that gpumem's CuPy hook calls, doing the same work, for timing the hook
 * without CuPy (benchmarks/cupy_hook_cpu/run.py).
 *
 * UnownedMemory and MemoryPointer: C types as Cython makes CuPy's cdef classes (cupy/cuda/memory.pyx):
 * tp_new, then tp_init given the arguments as a tuple, converted to C fields; collected by the GC (they
 * hold objects). fake_make_types() returns the two.
 *
 * The C functions that read the current stream:
 *
 *   cupy.cuda.stream.get_current_stream_ptr()     its thread-local (`_thread_local.tls`), then
 *     -> cupy_backends.cuda.stream.get_current_stream_ptr()
 *          its thread-local, runtime.getDevice(), current_stream[device]
 *   cupy_backends.cuda.stream.get_stream_ptr(device)
 *          its thread-local, current_stream[device]
 *
 * CuPy's `tls` is a cdef class whose list field is read in C; here `tls` is that list itself.
 * fake_cuda_get_device stands for cudaGetDevice (a thread-local read in the runtime).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>

static PyObject* g_local_cupy;      /* cupy.cuda.stream._thread_local */
static PyObject* g_local_backends;  /* cupy_backends.cuda.stream._thread_local */
static PyObject* g_tls_name;
static _Thread_local int g_device;

int fake_set(PyObject* local_cupy, PyObject* local_backends) {
    Py_INCREF(local_cupy);
    Py_INCREF(local_backends);
    g_local_cupy = local_cupy;
    g_local_backends = local_backends;
    g_tls_name = PyUnicode_InternFromString("tls");
    return g_tls_name ? 0 : -1;
}

__attribute__((noinline)) int fake_cuda_get_device(int* d) { *d = g_device; return 0; }

static intptr_t backends_stream(int device) {
    PyObject* tls = PyObject_GetAttr(g_local_backends, g_tls_name);
    if (!tls) return -1;
    PyObject* item = PyList_GetItem(tls, device);   /* borrowed; IndexError as CuPy's list */
    intptr_t s = item ? (intptr_t)PyLong_AsSsize_t(item) : -1;
    Py_DECREF(tls);
    return s;
}

intptr_t fake_backends_get_stream_ptr(int device) { return backends_stream(device); }

intptr_t fake_backends_get_current_stream_ptr(void) {
    int device = 0;
    fake_cuda_get_device(&device);
    return backends_stream(device);
}

intptr_t fake_cupy_get_current_stream_ptr(void) {
    PyObject* tls = PyObject_GetAttr(g_local_cupy, g_tls_name);   /* read, then not used, as CuPy's */
    if (!tls) return -1;
    Py_DECREF(tls);
    return fake_backends_get_current_stream_ptr();
}

typedef struct {
    PyObject_HEAD
    intptr_t ptr;
    size_t size;
    int device_id;
    PyObject* owner;
} MemObject;

typedef struct {
    PyObject_HEAD
    intptr_t ptr;
    int device_id;
    PyObject* mem;
} PtrObject;

static PyTypeObject* g_mem_type;

static int mem_init(PyObject* self, PyObject* args, PyObject* kwds) {
    MemObject* m = (MemObject*)self;
    Py_ssize_t ptr = 0;
    unsigned long long size = 0;
    PyObject* owner = NULL;
    int device_id = -1;
    static char* kwlist[] = {"ptr", "size", "owner", "device_id", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nKO|i", kwlist, &ptr, &size, &owner, &device_id)) return -1;
    m->ptr = (intptr_t)ptr;
    m->size = (size_t)size;
    m->device_id = device_id;
    Py_INCREF(owner);
    Py_XSETREF(m->owner, owner);
    return 0;
}

static int mem_traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(((MemObject*)self)->owner);
    return 0;
}

static int mem_clear(PyObject* self) {
    Py_CLEAR(((MemObject*)self)->owner);
    return 0;
}

static void mem_dealloc(PyObject* self) {
    PyTypeObject* type = Py_TYPE(self);   /* a heap type: each instance holds a reference to it */
    PyObject_GC_UnTrack(self);
    mem_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static int ptr_init(PyObject* self, PyObject* args, PyObject* kwds) {
    PtrObject* p = (PtrObject*)self;
    PyObject* mem = NULL;
    Py_ssize_t offset = 0;
    static char* kwlist[] = {"mem", "offset", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!n", kwlist, g_mem_type, &mem, &offset)) return -1;
    p->ptr = ((MemObject*)mem)->ptr + offset;
    p->device_id = ((MemObject*)mem)->device_id;
    Py_INCREF(mem);
    Py_XSETREF(p->mem, mem);
    return 0;
}

static int ptr_traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(((PtrObject*)self)->mem);
    return 0;
}

static int ptr_clear(PyObject* self) {
    Py_CLEAR(((PtrObject*)self)->mem);
    return 0;
}

static void ptr_dealloc(PyObject* self) {
    PyTypeObject* type = Py_TYPE(self);   /* a heap type: each instance holds a reference to it */
    PyObject_GC_UnTrack(self);
    ptr_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMemberDef mem_members[] = {
    {"ptr", T_PYSSIZET, offsetof(MemObject, ptr), READONLY, NULL},
    {"size", T_ULONGLONG, offsetof(MemObject, size), READONLY, NULL},
    {"device_id", T_INT, offsetof(MemObject, device_id), READONLY, NULL},
    {"_owner", T_OBJECT, offsetof(MemObject, owner), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef ptr_members[] = {
    {"ptr", T_PYSSIZET, offsetof(PtrObject, ptr), READONLY, NULL},
    {"device_id", T_INT, offsetof(PtrObject, device_id), READONLY, NULL},
    {"mem", T_OBJECT, offsetof(PtrObject, mem), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyObject* fake_make_types(void) {
    PyType_Slot mem_slots[] = {
        {Py_tp_init, (void*)mem_init}, {Py_tp_new, (void*)PyType_GenericNew}, {Py_tp_dealloc, (void*)mem_dealloc},
        {Py_tp_traverse, (void*)mem_traverse}, {Py_tp_clear, (void*)mem_clear}, {Py_tp_members, mem_members},
        {0, NULL}};
    PyType_Spec mem_spec = {"fake_cupy.UnownedMemory", sizeof(MemObject), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, mem_slots};
    PyType_Slot ptr_slots[] = {
        {Py_tp_init, (void*)ptr_init}, {Py_tp_new, (void*)PyType_GenericNew}, {Py_tp_dealloc, (void*)ptr_dealloc},
        {Py_tp_traverse, (void*)ptr_traverse}, {Py_tp_clear, (void*)ptr_clear}, {Py_tp_members, ptr_members},
        {0, NULL}};
    PyType_Spec ptr_spec = {"fake_cupy.MemoryPointer", sizeof(PtrObject), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, ptr_slots};
    PyObject* mem = PyType_FromSpec(&mem_spec);
    if (!mem) return NULL;
    g_mem_type = (PyTypeObject*)mem;
    Py_INCREF(mem);   /* kept by g_mem_type */
    PyObject* ptr = PyType_FromSpec(&ptr_spec);
    if (!ptr) return NULL;
    return Py_BuildValue("(NN)", mem, ptr);
}
