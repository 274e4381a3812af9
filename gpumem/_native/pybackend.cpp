// PyDeviceBackend: the engine's device calls made on a Python gpumem.device.Device, through its
// public methods, exactly as the Python allocator makes them (same methods, same arguments), so
// that the device's validation, the simulator's sanitizer and fault injection, and its memory
// events behave the same under both engines. See pybackend.h.
#include "pybackend.h"

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
    n_event_destroy_ = intern("event_destroy");
    n_stream_synchronize_ = intern("stream_synchronize");
    n_synchronize_ = intern("synchronize");
    n_free_nbytes_ = intern("free_nbytes");
    n_total_nbytes_ = intern("total_nbytes");
    n_granularity_nbytes_ = intern("granularity_nbytes");
    n_vmm_supported_ = intern("vmm_supported");
    n_malloc_ = intern("malloc");
    n_free_ = intern("free");
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
    return va;
}

void PyDeviceBackend::address_free(std::uint64_t va, std::uint64_t nbytes) {
    call_void(n_address_free_, u64(va), u64(nbytes));
}

ChunkHandle PyDeviceBackend::mem_create(std::uint64_t nbytes) {
    PyObject* h = call(n_mem_create_, u64(nbytes));
    return put(chunks_, free_chunk_ids_, h);
}

void PyDeviceBackend::mem_release(ChunkHandle handle) {
    PyObject* h = get(chunks_, handle, "chunk");
    Py_INCREF(h);
    call_void(n_mem_release_, h);
    Py_DECREF(chunks_[handle - 1]);
    chunks_[handle - 1] = nullptr;
    free_chunk_ids_.push_back(handle);
}

void PyDeviceBackend::mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) {
    PyObject* h = get(chunks_, handle, "chunk");
    Py_INCREF(h);
    call_void(n_mem_map_, u64(va), u64(nbytes), h, u64(offset));
}

void PyDeviceBackend::mem_set_access(std::uint64_t va, std::uint64_t nbytes) {
    call_void(n_mem_set_access_, u64(va), u64(nbytes));
}

void PyDeviceBackend::mem_unmap(std::uint64_t va, std::uint64_t nbytes) {
    call_void(n_mem_unmap_, u64(va), u64(nbytes));
}

EventHandle PyDeviceBackend::event_record(StreamHandle stream) {
    PyObject* ev = call(n_event_record_, u64(stream));
    return put(events_, free_event_ids_, ev);
}

bool PyDeviceBackend::event_query(EventHandle event) {
    PyObject* ev = get(events_, event, "event");
    Py_INCREF(ev);
    PyObject* r = call(n_event_query_, ev);
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (t < 0) raise_current();
    return t == 1;
}

void PyDeviceBackend::event_synchronize(EventHandle event) {
    PyObject* ev = get(events_, event, "event");
    Py_INCREF(ev);
    call_void(n_event_synchronize_, ev);
}

void PyDeviceBackend::event_destroy(EventHandle event) {
    PyObject* ev = get(events_, event, "event");
    // the engine never uses an event again once it tried to destroy it (StreamFences._retire)
    events_[event - 1] = nullptr;
    free_event_ids_.push_back(event);
    call_void(n_event_destroy_, ev);   // steals the table's reference
}

void PyDeviceBackend::stream_synchronize(StreamHandle stream) {
    call_void(n_stream_synchronize_, u64(stream));
}

void PyDeviceBackend::synchronize() { call_void(n_synchronize_); }

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
