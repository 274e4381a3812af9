// The native engine's cost per operation on a trace, as CuPy's hook calls it, without Python or a GPU
// (issue 19): built and run by benchmarks/engine_hotpath_bench.py, which writes each trace as a binary
// op list (u64 count, then per op: u8 kind (0 alloc, 1 free), u32 slot, u64 nbytes).
//
// Per allocation: try_allocate_fast, else allocate (as CupyAllocator's vectorcall), then the block's size;
// per free: try_free_fast, else free. The device is an in-memory fake of the CUDA driver's VMM calls
// (calls counted, events always complete), so the figure is the engine's own time.
//
// Usage: engine_hotpath_bench OPS_FILE PASSES [PAGE_SLACK]
// Prints one line: ns per op (median of the timed passes), device calls in the last pass, the peak of
// reserved bytes over all passes, reserved bytes after the last pass, the peak of allocated bytes (live blocks).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../gpumem/_native/backend.h"
#include "../gpumem/_native/engine.h"

namespace {

class FakeDevice : public gpumem::Backend {
  public:
    gpumem::DeviceInfo info() override { return {143771090944ULL, 2ULL << 20, true}; }
    void mem_info(std::uint64_t* f, std::uint64_t* t) override {
        *t = 143771090944ULL;
        *f = *t > created_ ? *t - created_ : 0;
    }
    std::uint64_t address_reserve(std::uint64_t nbytes, std::uint64_t) override {
        std::uint64_t va = next_va_;
        next_va_ += (nbytes + (1ULL << 30)) & ~((1ULL << 30) - 1);
        return va;
    }
    void address_free(std::uint64_t, std::uint64_t) override {}
    gpumem::ChunkHandle mem_create(std::uint64_t nbytes) override {
        created_ += nbytes;
        return ++next_handle_;
    }
    void mem_release(gpumem::ChunkHandle) override {}
    void mem_map(std::uint64_t, std::uint64_t, gpumem::ChunkHandle, std::uint64_t) override {}
    void mem_set_access(std::uint64_t, std::uint64_t) override {}
    void mem_unmap(std::uint64_t, std::uint64_t) override {}
    gpumem::EventHandle event_record(gpumem::StreamHandle) override { return ++next_event_; }
    bool event_query(gpumem::EventHandle) override { return true; }
    void event_synchronize(gpumem::EventHandle) override {}
    void event_destroy(gpumem::EventHandle) override {}
    void stream_synchronize(gpumem::StreamHandle) override {}
    void synchronize() override {}

  private:
    std::uint64_t next_va_ = 1ULL << 44, next_handle_ = 0, next_event_ = 0, created_ = 0;
};

struct Op {
    std::uint8_t kind;
    std::uint32_t slot;
    std::uint64_t nbytes;
};

double replay(gpumem::Engine& e, const std::vector<Op>& ops, std::vector<std::uint64_t>& live) {
    volatile std::uint64_t sink = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (const Op& op : ops) {
        if (op.kind == 0) {
            std::uint64_t size = 0;
#ifdef GPUMEM_BENCH_TWO_CALLS   // the hook before the size came with the pointer
            std::uint64_t p = e.try_allocate_fast(op.nbytes, 0);
            if (!p) p = e.allocate(op.nbytes, 0);
            size = e.block_size(p);
#else
            std::uint64_t p = e.try_allocate_fast(op.nbytes, 0, &size);
            if (!p) {
                p = e.allocate(op.nbytes, 0);
                size = e.block_size(p);
            }
#endif
            sink = sink + size;
            live[op.slot] = p;
        } else if (live[op.slot]) {
            std::uint64_t p = live[op.slot];
            live[op.slot] = 0;
            if (!e.try_free_fast(p)) e.free(p);
        }
    }
    auto t1 = std::chrono::steady_clock::now();
    for (auto& p : live)
        if (p) {
            e.free(p);
            p = 0;
        }
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(ops.size());
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s OPS_FILE PASSES [PAGE_SLACK]\n", argv[0]);
        return 2;
    }
    std::FILE* f = std::fopen(argv[1], "rb");
    if (!f) {
        std::perror(argv[1]);
        return 2;
    }
    std::uint64_t n = 0;
    if (std::fread(&n, 8, 1, f) != 1) return 2;
    std::vector<Op> ops(n);
    std::uint32_t max_slot = 0;
    for (auto& op : ops) {
        if (std::fread(&op.kind, 1, 1, f) != 1 || std::fread(&op.slot, 4, 1, f) != 1 ||
            std::fread(&op.nbytes, 8, 1, f) != 1)
            return 2;
        max_slot = std::max(max_slot, op.slot);
    }
    std::fclose(f);
    const int passes = std::atoi(argv[2]);
    gpumem::EngineConfig cfg;
    if (argc > 3) cfg.page_slack = std::atof(argv[3]);
#ifdef GPUMEM_BENCH_EXPANDABLE
    // AllocatorPolicy "expandable" (Note [Expandable segments] in gpumem/allocator/policy.py): pages of 2 / 20 MiB
    cfg.va_reserve_factor = 1.125;
    cfg.steal_empty_pages = false;
    cfg.page_slack = 0.0;
    cfg.growth = gpumem::GrowthRule::kPages;
    cfg.small_page_nbytes = std::uint64_t{2} << 20;
    cfg.large_page_nbytes = std::uint64_t{20} << 20;
#endif
    FakeDevice dev;
    gpumem::Engine e(dev, cfg);
    std::vector<std::uint64_t> live(max_slot + 1, 0);
    replay(e, ops, live);   // growth pass
    std::vector<double> times;
    std::uint64_t calls = 0;
    for (int k = 0; k < passes; ++k) {
        std::uint64_t before = e.stats().device_calls;
        times.push_back(replay(e, ops, live));
        calls = e.stats().device_calls - before;
    }
    std::sort(times.begin(), times.end());
    const gpumem::EngineStats st = e.stats();
    std::printf("%.2f %llu %llu %llu %llu\n", times[times.size() / 2], static_cast<unsigned long long>(calls),
                static_cast<unsigned long long>(st.peak_reserved_nbytes),
                static_cast<unsigned long long>(e.reserved_nbytes()),
                static_cast<unsigned long long>(st.peak_allocated_nbytes));
    return 0;
}
