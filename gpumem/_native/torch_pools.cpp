// What PyTorch's C++ allocator interface reaches in gpumem, beyond torch_api.cpp's two hooks: the
// engines of PyTorch's private memory pools (CUDA graphs, torch.cuda.MemPool) and the controls of
// any engine (stats, limit, peaks, empty cache, record_stream). gpumem/_shim/torch_shim.cpp, built
// against the installed PyTorch, calls these through dlsym; the ctypes path of gpumem.torch does not.
//
// An engine handle (GpumemEngine*) is either a device's engine, the one torch_api.cpp makes for
// PyTorch and gpumem._engine.CudaAllocator (gpumem_torch_device_engine), or a pool's engine
// (gpumem_torch_pool_new). Functions return 0, or -1 with gpumem_torch_pool_last_error(); the
// allocation returns null with *oom set to 1 when the device (or the limit) is out of memory.
//
// Note [A private pool is an engine of its own]: PyTorch's CUDA graphs bake the addresses of the
// memory they were captured with into the graph; that memory must stay the graph's (reused only
// by allocations into the same pool) until the graph is destroyed, whatever the rest of the program
// frees and allocates. An engine per pool gives exactly that: its own address range and its own
// physical pages, which no other engine can hand out, and which empty_cache gives back once the pool
// is released. It also keeps the stream-ordered fences of a capture (events recorded on the
// capturing stream) away from the device engine's streams.
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda_backend.h"
#include "engine.h"

#define GPUMEM_EXPORT extern "C" __attribute__((visibility("default")))

namespace gpumem {
Engine& cuda_engine(int device);   // torch_api.cpp
}

extern "C" int gpumem_torch_engine_state(int device);   // torch_api.cpp
extern "C" const char* gpumem_torch_last_error();          // torch_api.cpp

using gpumem::BackendError;
using gpumem::CudaBackend;
using gpumem::Engine;
using gpumem::EngineConfig;
using gpumem::EngineError;
using gpumem::EngineErrorKind;
using gpumem::EngineStats;

struct GpumemPool {
    int device = -1;
    std::unique_ptr<CudaBackend> backend;
    std::unique_ptr<Engine> engine;
};

namespace {

thread_local std::string t_error;

int fail(const std::string& what) {
    t_error = what;
    return -1;
}

Engine* as_engine(void* handle) { return static_cast<Engine*>(handle); }

}  // namespace

// The engine of `device` (torch_api.cpp's), made now when `make` is nonzero; null when there is none
// yet and `make` is 0, or when it cannot be made (then gpumem_torch_pool_last_error() says why).
GPUMEM_EXPORT void* gpumem_torch_device_engine(int device, int make) {
    int state = gpumem_torch_engine_state(device);
    if (state < 0) {
        t_error = gpumem_torch_last_error();
        return nullptr;
    }
    if (state == 0 && !make) {
        t_error.clear();
        return nullptr;
    }
    try {
        return &gpumem::cuda_engine(device);
    } catch (const std::exception& e) {
        t_error = e.what();
        return nullptr;
    }
}

// A new private pool on `device`: an engine of its own over the driver (Note [A private pool is an
// engine of its own]). Reserves no memory yet. Null on error.
GPUMEM_EXPORT GpumemPool* gpumem_torch_pool_new(int device) {
    try {
        auto pool = std::make_unique<GpumemPool>();
        pool->device = device;
        pool->backend = std::make_unique<CudaBackend>(device);
        if (!pool->backend->info().vmm_supported)
            throw std::runtime_error("CUDA device " + std::to_string(device) +
                                     " does not support virtual memory management");
        // the default policy, whatever configure() or the GPUMEM_* variables say, but for the two knobs below: a
        // pool never marks a step, so never begins a warm-up, and the steal before a warm-up (on by default since
        // 2026-12-04) stays off in it, as before: that steal maps a chunk still used by queued work and defers the
        // unmap behind fences on the stream that took it, which has never been run or tested under a capture
        // (Note [The ordered steal before a warm-up] in backing.py; found by a review when the default changed)
        EngineConfig cfg;
        cfg.steal_before_warmup = false;
        // a pool serves CUDA graph captures, whose streams may not wait on an event recorded outside the capture:
        // the host waits (Note [Wait on the GPU, not the host] in backing.py)
        cfg.wait_on_gpu = false;
        pool->engine = std::make_unique<Engine>(*pool->backend, cfg);
        return pool.release();
    } catch (const std::exception& e) {
        t_error = std::string("gpumem could not make a memory pool on CUDA device ") + std::to_string(device) +
                  ": " + e.what();
        return nullptr;
    }
}

// The engine handle of a pool.
GPUMEM_EXPORT void* gpumem_torch_pool_engine(GpumemPool* pool) { return pool ? pool->engine.get() : nullptr; }

// Closes a pool whose memory is all freed (waits for its streams, gives every page back) and
// deletes it. -1, and the pool unchanged, while any of its blocks is live.
GPUMEM_EXPORT int gpumem_torch_pool_delete(GpumemPool* pool) {
    if (pool == nullptr) return 0;
    try {
        std::uint64_t live = pool->engine->stats().num_live_blocks;
        if (live != 0)
            return fail("gpumem_torch_pool_delete: the pool still has " + std::to_string(live) + " live blocks");
        pool->engine->close();
    } catch (const std::exception& e) {
        return fail(e.what());
    }
    delete pool;
    return 0;
}

// `nbytes` (> 0) on `stream` from an engine. Null with *oom = 1 when out of memory (the message,
// with the device's figures, in gpumem_torch_pool_last_error()), null with *oom = 0 on other errors.
GPUMEM_EXPORT void* gpumem_torch_engine_malloc(void* handle, std::uint64_t nbytes, void* stream, int* oom) {
    *oom = 0;
    Engine* e = as_engine(handle);
    const std::uint64_t s = reinterpret_cast<std::uintptr_t>(stream);
    try {
        std::uint64_t p = e->try_allocate_fast(nbytes, s);
        if (p == 0) p = e->allocate(nbytes, s);
        return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
    } catch (const EngineError& err) {
        if (err.kind == EngineErrorKind::kOutOfMemory) {
            *oom = 1;
            const auto& o = err.oom;
            t_error = "CUDA out of memory. Tried to allocate " + std::to_string(nbytes) +
                      " bytes through gpumem: the device has " + std::to_string(o.free_nbytes) + " of " +
                      std::to_string(o.total_nbytes) + " bytes free; this engine holds " +
                      std::to_string(o.reserved_nbytes) + " (" + std::to_string(o.allocated_nbytes) +
                      " allocated). " + err.what();
        } else {
            t_error = err.what();
        }
    } catch (const BackendError& err) {
        t_error = err.what();
    } catch (const std::exception& err) {
        t_error = err.what();
    }
    return nullptr;
}

GPUMEM_EXPORT int gpumem_torch_engine_free(void* handle, void* ptr) {
    const std::uint64_t p = reinterpret_cast<std::uintptr_t>(ptr);
    try {
        Engine* e = as_engine(handle);
        if (!e->try_free_fast(p)) e->free(p);
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

// Tensor.record_stream: `ptr` (live in this engine) is also used on `stream`; its memory is not
// reused before the work queued on `stream` until its free has completed (the engine's fences).
GPUMEM_EXPORT int gpumem_torch_engine_record_stream(void* handle, void* ptr, void* stream) {
    try {
        as_engine(handle)->record_stream(reinterpret_cast<std::uintptr_t>(ptr), reinterpret_cast<std::uintptr_t>(stream));
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

GPUMEM_EXPORT int gpumem_torch_engine_stats(void* handle, EngineStats* out) {
    try {
        *out = as_engine(handle)->stats();
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

GPUMEM_EXPORT int gpumem_torch_engine_empty_cache(void* handle, std::uint64_t* released_nbytes) {
    try {
        std::uint64_t released = as_engine(handle)->empty_cache();
        if (released_nbytes) *released_nbytes = released;
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

// The engine's limit on reserved memory (0: none), for torch.cuda.set_per_process_memory_fraction.
GPUMEM_EXPORT int gpumem_torch_engine_set_limit(void* handle, std::uint64_t limit_nbytes) {
    try {
        as_engine(handle)->set_limit_nbytes(limit_nbytes);
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

GPUMEM_EXPORT int gpumem_torch_engine_reset_peak(void* handle) {
    try {
        as_engine(handle)->reset_peak_stats();
        return 0;
    } catch (const std::exception& err) {
        return fail(err.what());
    }
}

// The size of EngineStats this library was built with: the shim checks it matches its own.
GPUMEM_EXPORT std::uint64_t gpumem_torch_engine_stats_size() { return sizeof(EngineStats); }

// The message of this thread's last failed gpumem_torch_pool_* / gpumem_torch_engine_* call.
GPUMEM_EXPORT const char* gpumem_torch_pool_last_error() { return t_error.c_str(); }
