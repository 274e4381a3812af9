// CudaBackend: the Backend over the CUDA driver API, for engines that run without Python (PyTorch).
//
// libcuda is loaded at run time (dlopen "libcuda.so.1", then dlsym of each entry point by its
// versioned name), so building gpumem needs no CUDA toolkit and importing it needs no GPU: the
// driver is looked for only when a CudaBackend is made. The few driver types and structures used
// are declared in cuda_backend.cpp to match the CUDA 12 and 13 ABI (cuda.h).
//
// Note [The primary context]: every call runs in the device's primary context, the one the CUDA
// runtime (and so PyTorch and CuPy) uses. The backend retains it when made. A call made on a thread
// whose current context is that one (the common case: PyTorch sets the device before it allocates)
// costs one cuCtxGetCurrent; otherwise the primary context is pushed for the call and popped after,
// so a caller's own current context is left as it was.
//
// Note [Recycled events]: the engine records an event whenever memory goes back with work still
// queued (hundreds per training step) and destroys it once done. Creating and destroying a CUDA
// event costs a driver call each; the backend keeps destroyed events (up to kMaxPooledEvents) and
// records into them again: cuEventRecord replaces an event's previous state, so a recycled event
// behaves as a new one. Handles are opaque to the engine, so it cannot tell.
//
// Note [Sticky errors mean a lost device]: CUDA reports a fault in a kernel (illegal address,
// launch failure, uncorrectable ECC error...) on whatever call comes next, and every later call in
// that context fails the same way. Those errors are mapped to ErrorKind::kDeviceLost, out of memory
// to kOutOfMemory, everything else to kOther; the message carries the driver's name for the error
// (cuGetErrorName) and the call that failed. The same set as gpumem.cuda.errors.STICKY_ERROR_NAMES.
//
// Note [Time in driver calls]: what a policy costs in step time is mostly the driver calls it makes (a map, a
// set-access and an unmap per steal: tens of microseconds each), and step times on a shared host move by more
// than that cost (issue 18's rounds: 10-20 %). So the backend sums the host's wall time inside its calls, by
// kind: memory calls (create, map, set access, unmap, release, address reserve and free), event calls
// (record, query, destroy) and waits (event, stream and device synchronize). The time the launching thread
// spends in gpumem's driver calls is measured directly, beside the call counts; where the program's host
// thread sets its step time, that is what a policy adds to it. Two steady-clock reads a call (tens of
// nanoseconds), relaxed atomics: the engine calls from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"

namespace gpumem {

struct CudaDriver;   // the table of driver entry points (cuda_backend.cpp)

// The driver's table, loaded once per process (thread-safe). Throws BackendError(kOther) saying
// why when libcuda cannot be loaded or lacks an entry point (driver older than CUDA 10.2), and
// when cuInit fails.
const CudaDriver& cuda_driver();

// The ordinal of the device of the calling thread's current context (what the CUDA runtime's
// cudaGetDevice reports once a device is in use), or -1 when no context is current or the driver cannot
// be loaded. Never throws; costs one driver call, cuCtxGetDevice (no Python: gpumem._engine.CupyAllocator's
// hot path).
int current_context_device() noexcept;

// How a CUresult maps onto the Backend's error kinds (exposed for tests).
ErrorKind cuda_error_kind(int cu_result);

class CudaBackend final : public Backend {
  public:
    // Opens device `ordinal` (0-based, as CUDA_VISIBLE_DEVICES presents them): loads the driver,
    // retains the primary context and reads the allocation granularity. Throws BackendError.
    explicit CudaBackend(int ordinal);
    ~CudaBackend() override;
    CudaBackend(const CudaBackend&) = delete;
    CudaBackend& operator=(const CudaBackend&) = delete;

    int ordinal() const { return ordinal_; }

    // Backend's interface (backend.h): C++ declares the overrides in each backend, so this list repeats
    DeviceInfo info() override;
    void mem_info(std::uint64_t* free_nbytes, std::uint64_t* total_nbytes) override;

    std::uint64_t address_reserve(std::uint64_t nbytes, std::uint64_t alignment) override;
    void address_free(std::uint64_t va, std::uint64_t nbytes) override;
    ChunkHandle mem_create(std::uint64_t nbytes) override;
    void mem_release(ChunkHandle handle) override;
    void mem_map(std::uint64_t va, std::uint64_t nbytes, ChunkHandle handle, std::uint64_t offset) override;
    void mem_set_access(std::uint64_t va, std::uint64_t nbytes) override;
    void mem_unmap(std::uint64_t va, std::uint64_t nbytes) override;

    EventHandle event_record(StreamHandle stream) override;
    bool event_query(EventHandle event) override;
    void event_synchronize(EventHandle event) override;
    void event_destroy(EventHandle event) override;
    void stream_wait_event(StreamHandle stream, EventHandle event) override;
    void stream_synchronize(StreamHandle stream) override;
    void synchronize() override;

    // Events with timing, for the trace's GPU clock only (Note [The trace's GPU clock] in torch_api.cpp): made
    // and recorded on `stream`; query and synchronize them with event_query / event_synchronize.
    // `recorded_ns`, when given, gets the steady clock's nanoseconds just before cuEventRecord (the event made).
    EventHandle timing_event_record(StreamHandle stream, std::int64_t* recorded_ns = nullptr);
    // Milliseconds from `start` to `end`, both complete (cuEventElapsedTime: about half a microsecond's resolution).
    double timing_elapsed_ms(EventHandle start, EventHandle end);
    // Destroys a timing event (not pooled: the pool's events are recorded without timing).
    void timing_event_destroy(EventHandle event);
    // Whether `stream` is being captured into a CUDA graph (false where the driver cannot say).
    bool stream_capturing(StreamHandle stream);

    static constexpr std::size_t kMaxPooledEvents = 4096;

    // Nanoseconds of host wall time spent inside this backend's driver calls since it was made, by kind (Note
    // [Time in driver calls]).
    struct CallTimes {
        std::uint64_t memory_ns = 0;   // create, map, set access, unmap, release, address reserve and free
        std::uint64_t event_ns = 0;    // event record, query and destroy (the pooled events)
        std::uint64_t wait_ns = 0;     // event, stream and device synchronize
    };
    CallTimes call_times() const noexcept {
        return {memory_ns_.load(std::memory_order_relaxed), event_ns_.load(std::memory_order_relaxed),
                wait_ns_.load(std::memory_order_relaxed)};
    }

  private:
    class ContextScope;
    class Timed;                           // adds a call's wall time to one of the counters below
    std::atomic<std::uint64_t> memory_ns_{0}, event_ns_{0}, wait_ns_{0};   // Note [Time in driver calls]
    std::mutex event_mutex_;               // guards event_pool_ (Note [Recycled events])
    std::vector<void*> event_pool_;        // CUevents ready to be recorded again
    const CudaDriver& drv_;
    int ordinal_;
    int device_ = 0;              // CUdevice
    std::vector<int> peers_;      // ordinals of the devices that can reach this one (Note [Peers read mapped memory])
    void* primary_ = nullptr;     // CUcontext (retained)
    DeviceInfo info_;
};

}  // namespace gpumem
