/* Stand-ins for CuPy 14.2's C functions that read the current stream, doing the same work, for timing
 * gpumem's CuPy hook without CuPy (benchmarks/cupy_hook_cpu/run.py):
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
