// CudaBackend: Backend over the CUDA driver API, loaded at run time (see cuda_backend.h).
#include "cuda_backend.h"

#include <dlfcn.h>

#include <chrono>
#include <cstddef>
#include <mutex>
#include <vector>

namespace gpumem {

namespace {

// ---- the slice of cuda.h this file needs (CUDA 12 and 13 ABI) ----------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;

struct CUmemLocation {
    int type;   // CUmemLocationType
    int id;
};

struct CUmemAllocationProp {
    int type;                    // CUmemAllocationType
    int requestedHandleTypes;    // CUmemAllocationHandleType
    CUmemLocation location;
    void* win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
};

struct CUmemAccessDesc {
    CUmemLocation location;
    int flags;                   // CUmemAccess_flags
};

// Layout checks against cuda.h (x86-64 and aarch64 Linux).
static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp layout");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

// Note [Sticky errors mean a lost device]: the CUresult values of the sticky errors.
bool is_sticky(CUresult r) {
    switch (r) {
        case 214:   // CUDA_ERROR_ECC_UNCORRECTABLE
        case 700:   // CUDA_ERROR_ILLEGAL_ADDRESS
        case 714:   // CUDA_ERROR_HARDWARE_STACK_ERROR
        case 715:   // CUDA_ERROR_ILLEGAL_INSTRUCTION
        case 716:   // CUDA_ERROR_MISALIGNED_ADDRESS
        case 717:   // CUDA_ERROR_INVALID_ADDRESS_SPACE
        case 718:   // CUDA_ERROR_INVALID_PC
        case 719:   // CUDA_ERROR_LAUNCH_FAILED
            return true;
        default:
            return false;
    }
}

}  // namespace

struct CudaDriver {
    CUresult (*cuInit)(unsigned) = nullptr;
    CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
    CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
    CUresult (*cuDeviceGetCount)(int*) = nullptr;
    CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
    CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice) = nullptr;
    CUresult (*cuDeviceTotalMem)(size_t*, CUdevice) = nullptr;
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
    CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
    CUresult (*cuCtxGetDevice)(CUdevice*) = nullptr;
    CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
    CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
    CUresult (*cuCtxSynchronize)() = nullptr;
    CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
    CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                            unsigned long long) = nullptr;
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
    CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
    CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int) = nullptr;
    CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
    CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
    CUresult (*cuEventQuery)(CUevent) = nullptr;
    CUresult (*cuEventSynchronize)(CUevent) = nullptr;
    CUresult (*cuEventDestroy)(CUevent) = nullptr;
    CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
    CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;   // CUstreamCaptureStatus: 0 none, 1 active, 2 invalidated
    CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;

    std::string error_name(CUresult r) const {
        const char* name = nullptr;
        if (cuGetErrorName != nullptr && cuGetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr)
            return name;
        return "CUresult " + std::to_string(r);
    }

    // Throws the BackendError for a failed call (Note [Sticky errors mean a lost device]).
    [[noreturn]] void fail(CUresult r, const char* call) const {
        throw BackendError(cuda_error_kind(r), r, std::string(call) + " failed: " + error_name(r));
    }
    void check(CUresult r, const char* call) const {
        if (r != CUDA_SUCCESS) fail(r, call);
    }
};

ErrorKind cuda_error_kind(int cu_result) {
    if (cu_result == CUDA_ERROR_OUT_OF_MEMORY) return ErrorKind::kOutOfMemory;
    if (is_sticky(cu_result)) return ErrorKind::kDeviceLost;
    return ErrorKind::kOther;
}

namespace {

template <typename Fn>
void load(void* lib, Fn& slot, const char* name, std::string& missing) {
    void* sym = dlsym(lib, name);
    if (sym == nullptr) {
        if (!missing.empty()) missing += ", ";
        missing += name;
        return;
    }
    slot = reinterpret_cast<Fn>(sym);
}

// Note [Loading the driver once]: the library handle and entry points live for the whole process
// (libcuda is never unloaded: PyTorch may still call into memory it mapped). A failed load is
// remembered as its message, so every CudaBackend made afterwards fails with the same reason
// without retrying dlopen.
struct LoadedDriver {
    CudaDriver table;
    std::string error;   // empty when loaded

    LoadedDriver() {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
            const char* why = dlerror();
            error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (why ? why : "unknown reason") +
                    "; gpumem's CUDA backend needs an NVIDIA driver";
            return;
        }
        std::string missing;
        CudaDriver& d = table;
        // Versioned names: the _v2 entry points are the ones cuda.h's macros select since CUDA 4.
        load(lib, d.cuInit, "cuInit", missing);
        load(lib, d.cuGetErrorName, "cuGetErrorName", missing);
        load(lib, d.cuDeviceGet, "cuDeviceGet", missing);
        load(lib, d.cuDeviceGetCount, "cuDeviceGetCount", missing);
        load(lib, d.cuDeviceGetAttribute, "cuDeviceGetAttribute", missing);
        load(lib, d.cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", missing);
        load(lib, d.cuDeviceTotalMem, "cuDeviceTotalMem_v2", missing);
        load(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", missing);
        load(lib, d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", missing);
        load(lib, d.cuCtxGetCurrent, "cuCtxGetCurrent", missing);
        load(lib, d.cuCtxGetDevice, "cuCtxGetDevice", missing);
        load(lib, d.cuCtxPushCurrent, "cuCtxPushCurrent_v2", missing);
        load(lib, d.cuCtxPopCurrent, "cuCtxPopCurrent_v2", missing);
        load(lib, d.cuCtxSynchronize, "cuCtxSynchronize", missing);
        load(lib, d.cuMemGetInfo, "cuMemGetInfo_v2", missing);
        load(lib, d.cuMemAddressReserve, "cuMemAddressReserve", missing);
        load(lib, d.cuMemAddressFree, "cuMemAddressFree", missing);
        load(lib, d.cuMemCreate, "cuMemCreate", missing);
        load(lib, d.cuMemRelease, "cuMemRelease", missing);
        load(lib, d.cuMemMap, "cuMemMap", missing);
        load(lib, d.cuMemUnmap, "cuMemUnmap", missing);
        load(lib, d.cuMemSetAccess, "cuMemSetAccess", missing);
        load(lib, d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", missing);
        load(lib, d.cuEventCreate, "cuEventCreate", missing);
        load(lib, d.cuEventRecord, "cuEventRecord", missing);
        load(lib, d.cuEventQuery, "cuEventQuery", missing);
        load(lib, d.cuEventSynchronize, "cuEventSynchronize", missing);
        load(lib, d.cuEventDestroy, "cuEventDestroy_v2", missing);
        std::string optional;   // only the trace's GPU clock needs it (a stand-in driver may lack it)
        load(lib, d.cuEventElapsedTime, "cuEventElapsedTime", optional);
        load(lib, d.cuStreamIsCapturing, "cuStreamIsCapturing", optional);
        load(lib, d.cuStreamSynchronize, "cuStreamSynchronize", missing);
        load(lib, d.cuStreamWaitEvent, "cuStreamWaitEvent", missing);
        if (!missing.empty()) {
            error = "the CUDA driver lacks " + missing + " (gpumem needs a driver for CUDA 10.2 or later)";
            return;
        }
        CUresult r = d.cuInit(0);
        if (r != CUDA_SUCCESS) error = "cuInit failed: " + d.error_name(r);
    }
};

}  // namespace

const CudaDriver& cuda_driver() {
    static const LoadedDriver loaded;   // thread-safe initialisation (C++11)
    if (!loaded.error.empty()) throw BackendError(ErrorKind::kOther, 0, loaded.error);
    return loaded.table;
}

int current_context_device() noexcept {
    try {
        const CudaDriver& d = cuda_driver();
        // CUdevice handles are ordinals in every driver so far; mapped anyway, once, for the devices there
        static const std::vector<CUdevice> handles = [&d] {
            std::vector<CUdevice> h;
            int n = 0;
            if (d.cuDeviceGetCount(&n) != CUDA_SUCCESS) return h;
            for (int i = 0; i < n; ++i) {
                CUdevice dev = -1;
                h.push_back(d.cuDeviceGet(&dev, i) == CUDA_SUCCESS ? dev : -1);
            }
            return h;
        }();
        // One driver call: cuCtxGetDevice reads the current context and fails (CUDA_ERROR_INVALID_CONTEXT)
        // where none is current, as cuCtxGetCurrent's null did before it (CuPy's hook pays this per allocation)
        CUdevice dev = -1;
        if (d.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return -1;
        if (dev >= 0 && static_cast<std::size_t>(dev) < handles.size() && handles[static_cast<std::size_t>(dev)] == dev)
            return static_cast<int>(dev);   // the handle is the ordinal, as in every driver so far
        for (std::size_t i = 0; i < handles.size(); ++i)
            if (handles[i] == dev) return static_cast<int>(i);
    } catch (...) {
    }
    return -1;
}

// Note [The primary context]: pushes the backend's primary context for one call when another
// (or none) is current, and pops it after.
class CudaBackend::ContextScope {
  public:
    explicit ContextScope(const CudaBackend& b) : drv_(b.drv_) {
        CUcontext current = nullptr;
        drv_.check(drv_.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
        if (current != b.primary_) {
            drv_.check(drv_.cuCtxPushCurrent(b.primary_), "cuCtxPushCurrent");
            pushed_ = true;
        }
    }
    ~ContextScope() {
        if (pushed_) {
            CUcontext popped = nullptr;
            drv_.cuCtxPopCurrent(&popped);
        }
    }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

  private:
    const CudaDriver& drv_;
    bool pushed_ = false;
};

// Note [Time in driver calls]: adds the wall time from its making to its end (the call and its context scope,
// made after it) to `counter`, also when the call throws.
class CudaBackend::Timed {
  public:
    explicit Timed(std::atomic<std::uint64_t>& counter) : counter_(counter), t0_(std::chrono::steady_clock::now()) {}
    ~Timed() {
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
        counter_.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
    }
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;

  private:
    std::atomic<std::uint64_t>& counter_;
    std::chrono::steady_clock::time_point t0_;
};

namespace {

CUmemAllocationProp device_prop(int device) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

}  // namespace

CudaBackend::CudaBackend(int ordinal) : drv_(cuda_driver()), ordinal_(ordinal) {
    int count = 0;
    drv_.check(drv_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count)
        throw BackendError(ErrorKind::kOther, 0,
                           "no CUDA device " + std::to_string(ordinal) + " (this process sees " +
                               std::to_string(count) + ")");
    drv_.check(drv_.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
    CUcontext ctx = nullptr;
    drv_.check(drv_.cuDevicePrimaryCtxRetain(&ctx, device_), "cuDevicePrimaryCtxRetain");
    primary_ = ctx;
    try {
        int vmm = 0;
        drv_.check(drv_.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_),
                   "cuDeviceGetAttribute");
        size_t total = 0;
        drv_.check(drv_.cuDeviceTotalMem(&total, device_), "cuDeviceTotalMem");
        info_.total_nbytes = total;
        info_.vmm_supported = vmm != 0;
        if (info_.vmm_supported) {
            ContextScope scope(*this);
            CUmemAllocationProp prop = device_prop(device_);
            size_t gran = 0;
            drv_.check(drv_.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                       "cuMemGetAllocationGranularity");
            info_.granularity_nbytes = gran;
            // Note [Peers read mapped memory]: every device that can reach this one gets access too.
            for (int other = 0; other < count; ++other) {
                CUdevice peer = 0;
                int can = 0;
                if (other != ordinal && drv_.cuDeviceGet(&peer, other) == CUDA_SUCCESS &&
                    drv_.cuDeviceCanAccessPeer(&can, peer, device_) == CUDA_SUCCESS && can == 1)
                    peers_.push_back(other);
            }
        }
    } catch (...) {
        drv_.cuDevicePrimaryCtxRelease(device_);
        throw;
    }
}

CudaBackend::~CudaBackend() {
    if (primary_ == nullptr) return;
    try {
        ContextScope scope(*this);
        for (void* ev : event_pool_) drv_.cuEventDestroy(ev);
    } catch (const BackendError&) {
        // the context is gone (process teardown): the driver frees the events with it
    }
    event_pool_.clear();
    drv_.cuDevicePrimaryCtxRelease(device_);
}

DeviceInfo CudaBackend::info() { return info_; }

void CudaBackend::mem_info(std::uint64_t* free_nbytes, std::uint64_t* total_nbytes) {
    ContextScope scope(*this);
    size_t f = 0, t = 0;
    drv_.check(drv_.cuMemGetInfo(&f, &t), "cuMemGetInfo");
    *free_nbytes = f;
    *total_nbytes = t;
}

std::uint64_t CudaBackend::address_reserve(std::uint64_t nbytes, std::uint64_t alignment) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    CUdeviceptr va = 0;
    drv_.check(drv_.cuMemAddressReserve(&va, nbytes, alignment, 0, 0), "cuMemAddressReserve");
    return va;
}

void CudaBackend::address_free(std::uint64_t va, std::uint64_t nbytes) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuMemAddressFree(va, nbytes), "cuMemAddressFree");
}

ChunkHandle CudaBackend::mem_create(std::uint64_t nbytes) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    CUmemAllocationProp prop = device_prop(device_);
    CUmemGenericAllocationHandle handle = 0;
    drv_.check(drv_.cuMemCreate(&handle, nbytes, &prop, 0), "cuMemCreate");
    return handle;
}

void CudaBackend::mem_release(ChunkHandle handle) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuMemRelease(handle), "cuMemRelease");
}

void CudaBackend::mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuMemMap(va, nbytes, offset, handle, 0), "cuMemMap");
}

// Note [Peers read mapped memory]
// cudaMalloc memory is readable by a peer GPU once peer access is enabled (and copies between devices
// work even without it, staged by the driver). Memory mapped with cuMemMap is readable only by the
// devices cuMemSetAccess names, whatever cudaDeviceEnablePeerAccess says: a copy from device 0's
// gpumem block into device 1 (CuPy's `cupy.asarray` under Device(1), PyTorch's `.to("cuda:1")`, NCCL's
// peer transfers) fails with cudaErrorInvalidValue, as the two-GPU HIL probe showed on two H200s. PyTorch's
// expandable segments grant a peer access lazily, when its copy path enables peer access; gpumem cannot
// see that call under CuPy, so it grants access at mapping time to every device that
// cuDeviceCanAccessPeer says can reach this one (found once, at construction). One call names them all;
// on a one-GPU machine the call is what it was.
void CudaBackend::mem_set_access(std::uint64_t va, std::uint64_t nbytes) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    std::vector<CUmemAccessDesc> access(1 + peers_.size());
    for (std::size_t i = 0; i < access.size(); ++i) {
        access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access[i].location.id = i == 0 ? ordinal_ : peers_[i - 1];
        access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    drv_.check(drv_.cuMemSetAccess(va, nbytes, access.data(), access.size()), "cuMemSetAccess");
}

void CudaBackend::mem_unmap(std::uint64_t va, std::uint64_t nbytes) {
    Timed timed(memory_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuMemUnmap(va, nbytes), "cuMemUnmap");
}

EventHandle CudaBackend::event_record(StreamHandle stream) {
    Timed timed(event_ns_);
    ContextScope scope(*this);
    CUevent ev = nullptr;
    {
        std::lock_guard<std::mutex> lock(event_mutex_);
        if (!event_pool_.empty()) {
            ev = event_pool_.back();
            event_pool_.pop_back();
        }
    }
    if (ev == nullptr) drv_.check(drv_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    CUresult r = drv_.cuEventRecord(ev, reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)));
    if (r != CUDA_SUCCESS) {
        drv_.cuEventDestroy(ev);   // the failed call leaves nothing behind (Note [Backend errors are exceptions])
        drv_.fail(r, "cuEventRecord");
    }
    return reinterpret_cast<std::uintptr_t>(ev);
}

bool CudaBackend::event_query(EventHandle event) {
    Timed timed(event_ns_);
    ContextScope scope(*this);
    CUresult r = drv_.cuEventQuery(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event)));
    if (r == CUDA_SUCCESS) return true;
    if (r == CUDA_ERROR_NOT_READY) return false;
    drv_.fail(r, "cuEventQuery");
}

void CudaBackend::event_synchronize(EventHandle event) {
    Timed timed(wait_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuEventSynchronize(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event))),
               "cuEventSynchronize");
}

void CudaBackend::stream_wait_event(StreamHandle stream, EventHandle event) {
    Timed timed(event_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuStreamWaitEvent(reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)),
                                      reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event)), 0),
               "cuStreamWaitEvent");
}

void CudaBackend::event_destroy(EventHandle event) {
    Timed timed(event_ns_);
    CUevent ev = reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event));
    {
        std::lock_guard<std::mutex> lock(event_mutex_);   // Note [Recycled events]
        if (event_pool_.size() < kMaxPooledEvents) {
            event_pool_.push_back(ev);
            return;
        }
    }
    ContextScope scope(*this);
    drv_.check(drv_.cuEventDestroy(ev), "cuEventDestroy");
}

void CudaBackend::stream_synchronize(StreamHandle stream) {
    Timed timed(wait_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuStreamSynchronize(reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream))),
               "cuStreamSynchronize");
}

EventHandle CudaBackend::timing_event_record(StreamHandle stream, std::int64_t* recorded_ns) {
    ContextScope scope(*this);
    CUevent ev = nullptr;
    drv_.check(drv_.cuEventCreate(&ev, 0), "cuEventCreate");   // flags 0: with timing
    if (recorded_ns != nullptr)
        *recorded_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now().time_since_epoch()).count();
    CUresult r = drv_.cuEventRecord(ev, reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)));
    if (r != CUDA_SUCCESS) {
        drv_.cuEventDestroy(ev);
        drv_.fail(r, "cuEventRecord");
    }
    return reinterpret_cast<std::uintptr_t>(ev);
}

double CudaBackend::timing_elapsed_ms(EventHandle start, EventHandle end) {
    if (drv_.cuEventElapsedTime == nullptr)
        throw BackendError(ErrorKind::kOther, 0, "the CUDA driver lacks cuEventElapsedTime");
    ContextScope scope(*this);
    float ms = 0.0f;
    drv_.check(drv_.cuEventElapsedTime(&ms, reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(start)),
                                       reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(end))),
               "cuEventElapsedTime");
    return static_cast<double>(ms);
}

bool CudaBackend::stream_capturing(StreamHandle stream) {
    if (drv_.cuStreamIsCapturing == nullptr) return false;   // a driver without graphs captures nothing
    ContextScope scope(*this);
    int status = 0;
    drv_.check(drv_.cuStreamIsCapturing(reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)), &status),
               "cuStreamIsCapturing");
    return status != 0;
}

void CudaBackend::timing_event_destroy(EventHandle event) {
    ContextScope scope(*this);   // never pooled: the pool's events are recorded without timing
    drv_.check(drv_.cuEventDestroy(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event))), "cuEventDestroy");
}

void CudaBackend::synchronize() {
    Timed timed(wait_ns_);
    ContextScope scope(*this);
    drv_.check(drv_.cuCtxSynchronize(), "cuCtxSynchronize");
}

}  // namespace gpumem
