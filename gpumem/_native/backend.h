// The device a native engine allocates from: the C++ twin of gpumem.device.Device's memory calls.
//
// Two implementations: PyDeviceBackend (pybackend.cpp) calls a Python gpumem.device.Device (the
// simulator, the CuPy adapter, test fakes); CudaBackend (cuda_backend.cpp) calls the CUDA driver
// (libcuda, loaded at run time with dlopen: no CUDA toolkit at build time) and never touches Python,
// so PyTorch can call the engine from any thread (torch_api.cpp).
//
// Note [Backend errors are exceptions]: every call either succeeds or throws BackendError with the
// kind the Python allocator distinguishes (out of memory, device lost, anything else). A call that
// throws did nothing the engine must account for (the device's contract, as in Python). The Python
// backend keeps the Python exception in BackendError::py_exc (a new reference, or null) so that the
// binding re-raises the very exception the device raised.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace gpumem {

enum class ErrorKind : int {
    kOutOfMemory = 1,     // gpumem.errors.OutOfMemoryError (CUDA_ERROR_OUT_OF_MEMORY)
    kDeviceLost = 2,      // gpumem.errors.DeviceLostError (sticky CUDA errors: the context is dead)
    kOther = 3,           // anything else (TransientDeviceError, CudaError, MappingError...)
};

struct BackendError : std::runtime_error {
    ErrorKind kind;
    int code;             // the CUDA error code where there is one, else 0
    void* py_exc;         // PyObject* from the Python backend (see pybackend.h), else nullptr
    // The Python exception is not an Exception (KeyboardInterrupt, SystemExit...): the engine lets
    // it through where the Python allocator catches `Exception` (Note [Only Exception is caught]).
    bool fatal = false;
    BackendError(ErrorKind k, int c, const std::string& what, void* exc = nullptr, bool is_fatal = false)
        : std::runtime_error(what), kind(k), code(c), py_exc(exc), fatal(is_fatal) {}
};

// A physical chunk from mem_create: an opaque id (CUmemGenericAllocationHandle, or an index into
// the Python backend's table of PhysicalHandle objects).
using ChunkHandle = std::uint64_t;
// An event from event_record (CUevent, or an index into the Python backend's table of Event objects).
using EventHandle = std::uint64_t;
// A stream handle, as the Python API takes it (an int in [0, 2**64): a cudaStream_t; 0 = default).
using StreamHandle = std::uint64_t;

struct DeviceInfo {
    std::uint64_t total_nbytes = 0;
    std::uint64_t granularity_nbytes = 0;   // VMM allocation granularity (2 MiB on NVIDIA GPUs)
    bool vmm_supported = false;
};

class Backend {
  public:
    virtual ~Backend() = default;
    virtual DeviceInfo info() = 0;
    // (free, total) bytes now, as Device.mem_info()
    virtual void mem_info(std::uint64_t* free_nbytes, std::uint64_t* total_nbytes) = 0;

    virtual std::uint64_t address_reserve(std::uint64_t nbytes, std::uint64_t alignment) = 0;
    virtual void address_free(std::uint64_t va, std::uint64_t nbytes) = 0;
    virtual ChunkHandle mem_create(std::uint64_t nbytes) = 0;
    virtual void mem_release(ChunkHandle handle) = 0;
    virtual void mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) = 0;
    virtual void mem_set_access(std::uint64_t va, std::uint64_t nbytes) = 0;
    virtual void mem_unmap(std::uint64_t va, std::uint64_t nbytes) = 0;

    virtual EventHandle event_record(StreamHandle stream) = 0;
    virtual bool event_query(EventHandle event) = 0;
    virtual void event_synchronize(EventHandle event) = 0;
    virtual void event_destroy(EventHandle event) = 0;
    // Device.stream_wait_event: work queued on `stream` after this call runs once `event` has completed (GPU-side;
    // the host does not wait). Note [Wait on the GPU, not the host] in backing.py.
    virtual void stream_wait_event(StreamHandle stream, EventHandle event) = 0;
    virtual void stream_synchronize(StreamHandle stream) = 0;
    virtual void synchronize() = 0;

    // Device.engine_work: the engine indexed `pages_indexed` pages before a steal (Note [The engine's own time] in
    // gpumem/sim/latency.py). A real device's time passes by itself: nothing to do; the simulator's backend lets it pass.
    virtual void engine_work(std::uint64_t pages_indexed) { (void)pages_indexed; }

    // Segment mode (SegmentBacking): Device.malloc / Device.free. Only the Python backend has them: the
    // engine runs malloc'd segments over the simulator (and any Python Device) only; CudaBackend keeps
    // these defaults, and the engines it serves (torch_api.cpp) are always in virtual-memory mode.
    virtual std::uint64_t segment_malloc(std::uint64_t nbytes) {
        (void)nbytes;
        throw BackendError(ErrorKind::kOther, 0, "segment mode (malloc'd segments) is simulator-only in the native "
                                                 "engine: this backend has no malloc");
    }
    virtual void segment_free(std::uint64_t ptr) {
        (void)ptr;
        throw BackendError(ErrorKind::kOther, 0, "segment mode (malloc'd segments) is simulator-only in the native "
                                                 "engine: this backend has no free");
    }
};

}  // namespace gpumem
