// gpumem as PyTorch's CUDA allocator through PyTorch's C++ interface: a CUDAPluggableAllocator
// whose every hook reaches gpumem's native engine. Built by gpumem/torch_shim.py against the
// installed PyTorch (torch.utils.cpp_extension, at first use, cached); gpumem's engine is the
// gpumem._engine library, whose gpumem_torch_* functions this loads with dlsym (torch_api.cpp,
// torch_pools.cpp). No Python runs when PyTorch allocates.
//
// Note [What the C++ interface adds to the two C hooks]: from Python, PyTorch installs only an
// alloc and a free function. Built against PyTorch, the allocator is a C++ object (a subclass of
// torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator, PyTorch 2.11) and PyTorch calls it for
// - Tensor.record_stream: set_record_stream_fn, to the engine's stream-ordered fences (the memory
//   of a tensor freed while a recorded stream still uses it is not handed out before that stream's
//   work queued until the free is done);
// - CUDA graphs and torch.cuda.MemPool: beginAllocateToPool / endAllocateToPool / releasePool and
//   createOrIncrefPool / getPoolUseCount / checkPoolLiveAllocations, each pool an engine of its own
//   (Note [A private pool is an engine of its own] in torch_pools.cpp);
// - torch.cuda.empty_cache (emptyCache), set_per_process_memory_fraction (setMemoryFraction: the
//   engine's limit), memory_stats and everything built on it (getDeviceStats), reset_peak_memory_stats
//   and reset_accumulated_memory_stats, and cacheInfo (cuDNN's benchmark mode sizes its workspace
//   with it).
// What stays out of reach (PyTorch's base class raises, naming gpumem): snapshots and allocation
// history (gpumem's own trace covers them), IPC handles, restoring a graph pool's checkpoint that
// differs from its present state (Note [Checkpoints of a graph pool]), and MemPool's use_on_oom=True
// and no_split options.
#include <torch/extension.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine.h"   // EngineStats, as gpumem._engine was built with it

namespace {

namespace CA = c10::cuda::CUDACachingAllocator;
using c10::cuda::MempoolId_t;
using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using gpumem::EngineStats;

constexpr int kMaxDevices = 64;

// The gpumem_torch_* functions of gpumem._engine.
struct Lib {
    void* (*torch_malloc)(ssize_t, int, void*) = nullptr;
    void (*torch_free)(void*, ssize_t, int, void*) = nullptr;
    int (*torch_record_stream)(void*, void*) = nullptr;
    const char* (*torch_last_error)() = nullptr;
    void* (*device_engine)(int, int) = nullptr;
    void* (*pool_new)(int) = nullptr;
    void* (*pool_engine)(void*) = nullptr;
    int (*pool_delete)(void*) = nullptr;
    void* (*engine_malloc)(void*, std::uint64_t, void*, int*) = nullptr;
    int (*engine_free)(void*, void*) = nullptr;
    int (*engine_record_stream)(void*, void*, void*) = nullptr;
    int (*engine_stats)(void*, EngineStats*) = nullptr;
    int (*engine_empty_cache)(void*, std::uint64_t*) = nullptr;
    int (*engine_set_limit)(void*, std::uint64_t) = nullptr;
    int (*engine_reset_peak)(void*) = nullptr;
    std::uint64_t (*engine_stats_size)() = nullptr;
    const char* (*pool_last_error)() = nullptr;

    template <class F>
    static void sym(void* h, const char* name, F& out) {
        void* p = dlsym(h, name);
        TORCH_CHECK(p != nullptr, "gpumem's native library has no ", name,
                    ": it is older than gpumem/_shim/torch_shim.cpp (rebuild gpumem's engine)");
        out = reinterpret_cast<F>(p);
    }

    explicit Lib(const std::string& path) {
        void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        TORCH_CHECK(h != nullptr, "gpumem: cannot load its native library ", path, ": ", dlerror());
        // the throwing export: a failure must reach PyTorch as an exception (torch.OutOfMemoryError), and
        // gpumem_torch_malloc, the C function, returns null instead (Note [Two alloc functions: one for C,
        // one for PyTorch] in torch_api.cpp); with it, memory fraction's OOM came back as a null pointer
        sym(h, "gpumem_torch_alloc_hook", torch_malloc);
        sym(h, "gpumem_torch_free", torch_free);
        sym(h, "gpumem_torch_record_stream", torch_record_stream);
        sym(h, "gpumem_torch_last_error", torch_last_error);
        sym(h, "gpumem_torch_device_engine", device_engine);
        sym(h, "gpumem_torch_pool_new", pool_new);
        sym(h, "gpumem_torch_pool_engine", pool_engine);
        sym(h, "gpumem_torch_pool_delete", pool_delete);
        sym(h, "gpumem_torch_engine_malloc", engine_malloc);
        sym(h, "gpumem_torch_engine_free", engine_free);
        sym(h, "gpumem_torch_engine_record_stream", engine_record_stream);
        sym(h, "gpumem_torch_engine_stats", engine_stats);
        sym(h, "gpumem_torch_engine_empty_cache", engine_empty_cache);
        sym(h, "gpumem_torch_engine_set_limit", engine_set_limit);
        sym(h, "gpumem_torch_engine_reset_peak", engine_reset_peak);
        sym(h, "gpumem_torch_engine_stats_size", engine_stats_size);
        sym(h, "gpumem_torch_pool_last_error", pool_last_error);
        TORCH_CHECK(engine_stats_size() == sizeof(EngineStats),
                    "gpumem's native library and its PyTorch shim were built from different sources "
                    "(EngineStats has ", engine_stats_size(), " bytes there, ", sizeof(EngineStats), " here)");
        // the handle stays open: the allocator lives until the process ends
    }

    // Checks an engine call's status: a failure raises with the library's message.
    void ok(int rc, const char* what) const {
        TORCH_CHECK(rc == 0, "gpumem: ", what, " failed: ", pool_last_error());
    }
};

// A private pool (CUDA graph or torch.cuda.MemPool) and what PyTorch's pool protocol counts.
struct Pool {
    int device = -1;
    void* handle = nullptr;   // GpumemPool*
    void* engine = nullptr;
    int use_count = 0;        // createOrIncrefPool / beginAllocateToPool minus releasePool
    std::unordered_set<void*> live;
};

struct PoolState : CA::AllocatorState {   // getCheckpointState
    int device = -1;
    MempoolId_t id;
    std::unordered_set<void*> live;
};

struct Capture {   // an open beginAllocateToPool
    int device;
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
};

struct Counters {   // what resetAccumulatedStats subtracts from the engine's counters
    std::uint64_t allocs = 0, frees = 0, retries = 0, ooms = 0;
};

// Note [Device calls while a graph is captured]: a pool's engine grows during capture (mapping
// pages: cuMemCreate, cuMemMap, cuMemSetAccess), calls CUDA counts as potentially unsafe, which the
// default (global) capture mode refuses and which would invalidate the capture. They are safe here:
// they enqueue no work on any stream. So the pool's calls run with this thread in relaxed capture
// mode (cudaThreadExchangeStreamCaptureMode), restored right after, as CUDA's own libraries do.
class RelaxedCapture {
  public:
    explicit RelaxedCapture(bool on) : on_(on) {
        if (on_) C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_));
    }
    ~RelaxedCapture() {
        if (on_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
    }
    RelaxedCapture(const RelaxedCapture&) = delete;
    RelaxedCapture& operator=(const RelaxedCapture&) = delete;

  private:
    bool on_;
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

class GpumemAllocator final : public Pluggable {
  public:
    explicit GpumemAllocator(const std::string& lib_path)
        : Pluggable([this](size_t n, int dev, cudaStream_t s) { return alloc(n, dev, s); },
                    [this](void* p, size_t n, int dev, cudaStream_t s) { release(p, n, dev, s); }),
          lib_(lib_path) {
        set_record_stream_fn([this](void* p, cudaStream_t s) { record(p, s); });
        set_reset_fn([this] { empty_all(); });
        set_memory_fraction_fn([this](double f, int dev) { set_fraction(f, dev); });
    }

    std::string name() override { return "gpumem"; }

    // ---- allocation -----------------------------------------------------------------------
    void* alloc(size_t nbytes, int device, cudaStream_t stream) {
        if (capturing(device)) {
            std::lock_guard<std::mutex> lock(mutex_);
            for (const Capture& c : captures_) {
                if (c.device != device || !c.filter(stream)) continue;
                Pool& pool = pools_.at({device, c.id});
                if (nbytes == 0) return nullptr;
                int oom = 0;
                void* p = nullptr;
                {
                    RelaxedCapture relaxed(true);
                    p = lib_.engine_malloc(pool.engine, nbytes, stream, &oom);
                }
                if (p == nullptr) {
                    TORCH_CHECK_WITH(OutOfMemoryError, !oom, lib_.pool_last_error(), " (memory pool ",
                                     c.id.first, ",", c.id.second, " on GPU ", device, ")");
                    TORCH_CHECK(false, "gpumem could not allocate ", nbytes, " bytes in memory pool ", c.id.first,
                                ",", c.id.second, " on GPU ", device, ": ", lib_.pool_last_error());
                }
                pool.live.insert(p);
                owner_.emplace(p, &pool);
                return p;
            }
        }
        RelaxedCapture relaxed(capturing(device));
        return lib_.torch_malloc(static_cast<ssize_t>(nbytes), device, stream);
    }

    bool capturing(int device) const {
        return device >= 0 && device < kMaxDevices && capturing_[device].load(std::memory_order_acquire) > 0;
    }

    void release(void* ptr, size_t nbytes, int device, cudaStream_t stream) {
        if (ptr == nullptr) return;
        if (n_pools_.load(std::memory_order_acquire) > 0) {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = owner_.find(ptr);
            if (it != owner_.end()) {
                Pool* pool = it->second;
                owner_.erase(it);
                pool->live.erase(ptr);
                RelaxedCapture relaxed(true);
                if (lib_.engine_free(pool->engine, ptr) != 0)
                    std::fprintf(stderr, "gpumem: free of %p in a memory pool failed: %s\n", ptr, lib_.pool_last_error());
                if (pool->use_count == 0 && pool->live.empty()) drop_locked(*pool);
                return;
            }
        }
        RelaxedCapture relaxed(capturing(device));
        lib_.torch_free(ptr, static_cast<ssize_t>(nbytes), device, stream);   // never throws
    }

    void record(void* ptr, cudaStream_t stream) {
        if (ptr == nullptr) return;
        if (n_pools_.load(std::memory_order_acquire) > 0) {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = owner_.find(ptr);
            if (it != owner_.end()) {
                lib_.ok(lib_.engine_record_stream(it->second->engine, ptr, stream), "record_stream");
                return;
            }
        }
        TORCH_CHECK(lib_.torch_record_stream(ptr, stream) == 0, "gpumem: record_stream: ", lib_.torch_last_error());
    }

    // ---- private pools ----------------------------------------------------------------------
    void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id, std::shared_ptr<CA::CUDAAllocator> allocator) override {
        TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                    "gpumem is PyTorch's CUDA allocator in this process: a torch.cuda.MemPool takes its memory from "
                    "gpumem (create it without an allocator); another allocator (", allocator ? allocator->name() : "",
                    ") cannot serve a pool under it");
        std::lock_guard<std::mutex> lock(mutex_);
        incref_locked(device, id);
    }

    int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pools_.find({device, id});
        return it == pools_.end() ? 0 : it->second.use_count;
    }

    void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const Capture& c : captures_)
            TORCH_CHECK(!(c.device == device && c.id == id), "gpumem: memory pool ", id.first, ",", id.second,
                        " on GPU ", static_cast<int>(device), " is already being allocated to");
        incref_locked(device, id);
        captures_.push_back(Capture{device, id, std::move(filter)});
        capturing_[device].fetch_add(1, std::memory_order_release);
    }

    void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = std::find_if(captures_.begin(), captures_.end(),
                               [&](const Capture& c) { return c.device == device && c.id == id; });
        TORCH_CHECK(it != captures_.end(), "gpumem: endAllocateToPool for memory pool ", id.first, ",", id.second,
                    " on GPU ", static_cast<int>(device), ", which is not being allocated to");
        captures_.erase(it);
        capturing_[device].fetch_sub(1, std::memory_order_release);
    }

    void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pools_.find({device, id});
        TORCH_CHECK(it != pools_.end() && it->second.use_count > 0, "gpumem: releasePool of memory pool ", id.first,
                    ",", id.second, " on GPU ", static_cast<int>(device), ", which is not in use");
        Pool& pool = it->second;
        if (--pool.use_count == 0 && pool.live.empty()) drop_locked(pool);
        // a pool released with live tensors goes when its last one is freed (release above)
    }

    // MemPool's destructor resets use_on_oom to false on every pool (a throw there ends the process):
    // false is gpumem's only behaviour, a pool's memory is never taken for allocations outside it.
    void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
        TORCH_CHECK(!use_on_oom, "gpumem does not use a memory pool's memory when another allocation runs out "
                    "(torch.cuda.MemPool(use_on_oom=True)); pool ", id.first, ",", id.second, " on GPU ",
                    static_cast<int>(device));
    }

    bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                  const std::unordered_set<void*>& expected) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pools_.find({device, id});
        if (it == pools_.end()) return expected.empty();
        return it->second.live == expected;
    }

    // Note [Checkpoints of a graph pool]: torch.compile's CUDA-graph trees take a checkpoint of
    // the pool after recording each graph, and restore one (setCheckpointPoolState) before recording
    // a new graph after replaying others, expecting the allocator to free the blocks allocated since
    // and to re-create the ones freed since, at their old addresses. gpumem's checkpoint is the set
    // of the pool's live blocks; a restore that finds exactly that set has nothing to do (the usual
    // case of a fixed training loop); one that would have to re-create or free blocks raises.
    std::shared_ptr<CA::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
        auto state = std::make_shared<PoolState>();
        state->device = device;
        state->id = id;
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pools_.find({device, id});
        if (it != pools_.end()) state->live = it->second.live;
        return state;
    }

    CA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<CA::AllocatorState> pps) override {
        auto* state = dynamic_cast<PoolState*>(pps.get());
        TORCH_CHECK(state != nullptr && state->device == device, "gpumem: a pool checkpoint of another allocator or GPU");
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pools_.find({device, state->id});
        const std::unordered_set<void*> none;
        const auto& live = it == pools_.end() ? none : it->second.live;
        std::size_t extra = 0, missing = 0;
        for (void* p : live) extra += state->live.count(p) == 0;
        for (void* p : state->live) missing += live.count(p) == 0;
        TORCH_CHECK(extra == 0 && missing == 0, "gpumem cannot restore a checkpoint of CUDA-graph pool ",
                    state->id.first, ",", state->id.second, " (torch.compile's CUDA-graph trees after a change of "
                    "path): ", extra, " blocks allocated since would have to be freed and ", missing,
                    " freed since re-created at their old addresses (Note [Checkpoints of a graph pool])");
        return {};
    }

    // ---- cache, limits, stats ---------------------------------------------------------------
    // Note [A pool in use keeps its cache]: a CUDA graph replays into the memory its pool held at
    // capture, freed blocks included; only a pool no graph or MemPool uses any more (use count 0,
    // kept for its live tensors) gives its cached memory back, as PyTorch's own allocator does.
    void emptyCache(MempoolId_t id) override {
        if (id.first == 0 && id.second == 0) return empty_all();
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, pool] : pools_)
            if (key.second == id && pool.use_count == 0)
                lib_.ok(lib_.engine_empty_cache(pool.engine, nullptr), "empty_cache of a memory pool");
    }

    void empty_all() {
        for (int dev = 0; dev < kMaxDevices; ++dev)
            if (void* e = lib_.device_engine(dev, 0)) lib_.ok(lib_.engine_empty_cache(e, nullptr), "empty_cache");
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, pool] : pools_)
            if (pool.use_count == 0) lib_.ok(lib_.engine_empty_cache(pool.engine, nullptr), "empty_cache of a memory pool");
    }

    void set_fraction(double fraction, int device) {
        TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "gpumem: memory fraction must be in [0, 1], got ", fraction);
        TORCH_CHECK(device >= 0 && device < kMaxDevices, "gpumem: bad CUDA device ", device);
        void* e = engine_of(device, true);
        size_t free_b = 0, total_b = 0;
        {
            c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
            C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
        }
        // the engine's limit 0 is "none": fraction 1 lifts it, fraction 0 leaves one byte (every allocation fails)
        const std::uint64_t limit = fraction >= 1.0 ? 0
            : std::max<std::uint64_t>(1, static_cast<std::uint64_t>(fraction * static_cast<double>(total_b)));
        lib_.ok(lib_.engine_set_limit(e, limit), "set_per_process_memory_fraction");
        std::lock_guard<std::mutex> lock(mutex_);
        fraction_[device] = fraction;
    }

    double getMemoryFraction(c10::DeviceIndex device) override {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = fraction_.find(device);
        return it == fraction_.end() ? 1.0 : it->second;
    }

    void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
        EngineStats st{};
        if (void* e = engine_of(device, false)) lib_.ok(lib_.engine_stats(e, &st), "cacheInfo");
        *largest = static_cast<size_t>(st.largest_free_nbytes);
    }

    c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
        // Note [Stats of several engines]: the device's engine and its pools' engines are summed;
        // their peaks add up too, an upper bound of the device's peak when they peaked apart.
        EngineStats sum{};
        auto add = [&sum](const EngineStats& s) {
            sum.allocated_nbytes += s.allocated_nbytes;
            sum.peak_allocated_nbytes += s.peak_allocated_nbytes;
            sum.requested_nbytes += s.requested_nbytes;
            sum.peak_requested_nbytes += s.peak_requested_nbytes;
            sum.reserved_nbytes += s.reserved_nbytes;
            sum.peak_reserved_nbytes += s.peak_reserved_nbytes;
            sum.active_nbytes += s.active_nbytes;
            sum.inactive_split_nbytes += s.inactive_split_nbytes;
            sum.num_allocs += s.num_allocs;
            sum.num_frees += s.num_frees;
            sum.num_live_blocks += s.num_live_blocks;
            sum.num_segments += s.num_segments;
            sum.num_alloc_retries += s.num_alloc_retries;
            sum.num_ooms += s.num_ooms;
        };
        EngineStats st{};
        if (void* e = engine_of(device, false)) {
            lib_.ok(lib_.engine_stats(e, &st), "memory_stats");
            add(st);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, pool] : pools_) {
            if (key.first != device) continue;
            lib_.ok(lib_.engine_stats(pool.engine, &st), "memory_stats of a memory pool");
            add(st);
        }
        const Counters& base = counters_[device];
        c10::CachingDeviceAllocator::DeviceStats out;
        const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        auto set = [agg](c10::CachingAllocator::StatArray& a, std::uint64_t cur, std::uint64_t peak) {
            a[agg].current = static_cast<int64_t>(cur);
            a[agg].peak = static_cast<int64_t>(std::max(cur, peak));
        };
        set(out.allocated_bytes, sum.allocated_nbytes, sum.peak_allocated_nbytes);
        set(out.requested_bytes, sum.requested_nbytes, sum.peak_requested_nbytes);
        set(out.reserved_bytes, sum.reserved_nbytes, sum.peak_reserved_nbytes);
        set(out.active_bytes, sum.active_nbytes, sum.active_nbytes);
        set(out.inactive_split_bytes, sum.inactive_split_nbytes, sum.inactive_split_nbytes);
        set(out.allocation, sum.num_live_blocks, sum.num_live_blocks);
        set(out.segment, sum.num_segments, sum.num_segments);
        out.allocation[agg].allocated = static_cast<int64_t>(sum.num_allocs - base.allocs);
        out.allocation[agg].freed = static_cast<int64_t>(sum.num_frees - base.frees);
        out.num_alloc_retries = static_cast<int64_t>(sum.num_alloc_retries - base.retries);
        out.num_ooms = static_cast<int64_t>(sum.num_ooms - base.ooms);
        return out;
    }

    void resetPeakStats(c10::DeviceIndex device) override {
        if (void* e = engine_of(device, false)) lib_.ok(lib_.engine_reset_peak(e), "reset_peak_memory_stats");
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, pool] : pools_)
            if (key.first == device) lib_.ok(lib_.engine_reset_peak(pool.engine), "reset_peak_memory_stats");
    }

    void resetAccumulatedStats(c10::DeviceIndex device) override {
        auto now = getDeviceStats(device);
        const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        std::lock_guard<std::mutex> lock(mutex_);
        Counters& base = counters_[device];
        base.allocs += static_cast<std::uint64_t>(now.allocation[agg].allocated);
        base.frees += static_cast<std::uint64_t>(now.allocation[agg].freed);
        base.retries += static_cast<std::uint64_t>(now.num_alloc_retries);
        base.ooms += static_cast<std::uint64_t>(now.num_ooms);
    }

    // For gpumem.torch_shim and its tests: (device, id, use count, live blocks) of every pool.
    std::vector<std::tuple<int, unsigned long long, unsigned long long, int, size_t>> pool_table() {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<std::tuple<int, unsigned long long, unsigned long long, int, size_t>> out;
        for (auto& [key, pool] : pools_)
            out.emplace_back(key.first, key.second.first, key.second.second, pool.use_count, pool.live.size());
        return out;
    }

  private:
    void* engine_of(int device, bool make) {
        void* e = lib_.device_engine(device, make ? 1 : 0);
        if (e == nullptr && make) TORCH_CHECK(false, "gpumem could not start on GPU ", device, ": ", lib_.pool_last_error());
        return e;
    }

    void incref_locked(int device, MempoolId_t id) {
        auto it = pools_.find({device, id});
        if (it != pools_.end()) {
            ++it->second.use_count;
            return;
        }
        void* handle = lib_.pool_new(device);
        TORCH_CHECK(handle != nullptr, lib_.pool_last_error());
        Pool& pool = pools_[{device, id}];
        pool.device = device;
        pool.handle = handle;
        pool.engine = lib_.pool_engine(handle);
        pool.use_count = 1;
        n_pools_.fetch_add(1, std::memory_order_release);
    }

    // A pool nobody uses and no tensor lives in: its engine waits for its streams, gives its pages back.
    void drop_locked(Pool& pool) {
        void* handle = pool.handle;
        for (auto it = pools_.begin(); it != pools_.end(); ++it) {
            if (&it->second != &pool) continue;
            pools_.erase(it);
            n_pools_.fetch_sub(1, std::memory_order_release);
            break;
        }
        if (lib_.pool_delete(handle) != 0)
            std::fprintf(stderr, "gpumem: could not close a released memory pool: %s\n", lib_.pool_last_error());
    }

    Lib lib_;
    std::mutex mutex_;
    std::map<std::pair<int, MempoolId_t>, Pool> pools_;
    std::unordered_map<void*, Pool*> owner_;
    std::vector<Capture> captures_;
    std::atomic<int> capturing_[kMaxDevices] = {};
    std::atomic<int> n_pools_{0};
    std::map<int, double> fraction_;
    std::map<int, Counters> counters_;
};

// Note [One allocator per process]: PyTorch takes its allocator once, before CUDA is initialised;
// the object is kept here (and by PyTorch) for the life of the process.
std::shared_ptr<GpumemAllocator>& the_allocator() {
    static auto* a = new std::shared_ptr<GpumemAllocator>();
    return *a;
}

void install(const std::string& lib_path) {
    auto& a = the_allocator();
    if (a) return;
    auto made = std::make_shared<GpumemAllocator>(lib_path);
    made->init(0);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(made);
    a = made;
}

bool installed() { return static_cast<bool>(the_allocator()); }

std::vector<std::tuple<int, unsigned long long, unsigned long long, int, size_t>> pool_table() {
    auto& a = the_allocator();
    TORCH_CHECK(a, "gpumem's PyTorch shim is not installed");
    return a->pool_table();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "gpumem as PyTorch's CUDA allocator through torch::cuda::CUDAPluggableAllocator (gpumem.torch_shim)";
    m.def("install", &install, "Make gpumem PyTorch's CUDA allocator (before CUDA is initialised).");
    m.def("installed", &installed, "Whether install() has run in this process.");
    m.def("pool_table", &pool_table, "(device, id, id, use count, live blocks) of every private pool.");
}
