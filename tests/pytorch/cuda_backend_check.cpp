// Checks gpumem's CudaBackend (gpumem/_native/cuda_backend.cpp) against the real CUDA driver.
//
// Built and run by tests/torch/test_cuda_backend.py:
//   cuda_backend_check device      - every Backend call on device 0, memory written and read back
//                                    through the driver, error kinds for out of memory and bad calls;
//   cuda_backend_check no-driver   - on a machine without libcuda: CudaBackend(0) must throw
//                                    BackendError(kOther) saying that the driver cannot be loaded.
// Prints "OK <what>" lines and exits 0 on success; prints "FAIL <why>" and exits 1 otherwise.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_backend.h"

using gpumem::BackendError;
using gpumem::CudaBackend;
using gpumem::ErrorKind;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "OK" : "FAIL", what.c_str());
    if (!ok) ++failures;
}

template <typename F>
void expect_error(ErrorKind kind, const std::string& what, F&& f) {
    try {
        f();
        expect(false, what + ": no error raised");
    } catch (const BackendError& e) {
        expect(e.kind == kind, what + " -> kind " + std::to_string(static_cast<int>(e.kind)) + " (" + e.what() + ")");
    }
}

int check_device() {
    CudaBackend b(0);
    gpumem::DeviceInfo info = b.info();
    expect(info.vmm_supported, "device supports virtual memory management");
    expect(info.granularity_nbytes == (2u << 20), "granularity is 2 MiB: " + std::to_string(info.granularity_nbytes));
    std::uint64_t free0 = 0, total = 0;
    b.mem_info(&free0, &total);
    expect(total == info.total_nbytes && free0 > 0 && free0 <= total, "mem_info: free " + std::to_string(free0) +
                                                                          " of " + std::to_string(total));

    const std::uint64_t g = info.granularity_nbytes;
    std::uint64_t va = b.address_reserve(4 * g, 0);
    expect(va != 0 && va % g == 0, "address_reserve gives an aligned range");
    gpumem::ChunkHandle c1 = b.mem_create(2 * g);
    gpumem::ChunkHandle c2 = b.mem_create(g);
    std::uint64_t free1 = 0;
    b.mem_info(&free1, &total);
    expect(free1 + 3 * g <= free0, "mem_create takes device memory");
    b.mem_map(va, 2 * g, c1, 0);
    b.mem_map(va + 2 * g, g, c2, 0);
    b.mem_set_access(va, 3 * g);

    // Write and read back through the driver: the mapping is real and readable/writable. The
    // backend made no context current on this thread (it pushes its own for each call): do it here.
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    using PrimaryRetain = int (*)(void**, int);
    using SetCurrent = int (*)(void*);
    void* ctx = nullptr;
    expect(reinterpret_cast<PrimaryRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"))(&ctx, 0) == 0 &&
               reinterpret_cast<SetCurrent>(dlsym(lib, "cuCtxSetCurrent"))(ctx) == 0,
           "the primary context made current for the checks below");
    using MemsetD8 = int (*)(unsigned long long, unsigned char, size_t);
    using MemcpyDtoH = int (*)(void*, unsigned long long, size_t);
    auto memset_d8 = reinterpret_cast<MemsetD8>(dlsym(lib, "cuMemsetD8_v2"));
    auto memcpy_dtoh = reinterpret_cast<MemcpyDtoH>(dlsym(lib, "cuMemcpyDtoH_v2"));
    expect(memset_d8(va, 0x5a, 3 * g) == 0, "cuMemsetD8 over the mapped range");
    std::vector<unsigned char> host(3 * g);
    expect(memcpy_dtoh(host.data(), va, 3 * g) == 0, "cuMemcpyDtoH from the mapped range");
    bool all = true;
    for (unsigned char x : host) all = all && x == 0x5a;
    expect(all, "memory reads back what was written");

    gpumem::EventHandle ev = b.event_record(0);
    b.event_synchronize(ev);
    expect(b.event_query(ev), "event_query after event_synchronize is true");
    b.event_destroy(ev);
    // Note [Recycled events]: a recycled event is recorded again and behaves as a new one
    gpumem::EventHandle again = b.event_record(0);
    expect(again == ev, "a destroyed event is recycled");
    b.event_synchronize(again);
    expect(b.event_query(again), "a recycled event completes");
    std::vector<gpumem::EventHandle> many;
    for (int i = 0; i < 8; ++i) many.push_back(b.event_record(0));
    b.stream_synchronize(0);
    bool done = true;
    for (gpumem::EventHandle e : many) done = done && b.event_query(e);
    expect(done, "events recorded before a stream synchronize are complete after it");
    for (gpumem::EventHandle e : many) b.event_destroy(e);
    b.event_destroy(again);
    b.stream_synchronize(0);
    b.synchronize();

    // Error kinds.
    expect_error(ErrorKind::kOutOfMemory, "mem_create past the device's memory",
                 [&] { b.mem_create(((total / g) + 16) * g); });
    expect_error(ErrorKind::kOther, "mem_map over a mapped range", [&] { b.mem_map(va, g, c2, 0); });
    expect_error(ErrorKind::kOther, "mem_create of a size that is not a multiple of the granularity",
                 [&] { b.mem_create(g + 4096); });
    expect(gpumem::cuda_error_kind(700) == ErrorKind::kDeviceLost, "illegal address is a lost device");
    expect(gpumem::cuda_error_kind(719) == ErrorKind::kDeviceLost, "launch failure is a lost device");
    expect(gpumem::cuda_error_kind(1) == ErrorKind::kOther, "invalid value is another error");

    b.mem_unmap(va, 2 * g);
    b.mem_unmap(va + 2 * g, g);
    b.mem_release(c1);
    b.mem_release(c2);
    b.address_free(va, 4 * g);
    std::uint64_t free2 = 0;
    b.mem_info(&free2, &total);
    expect(free2 + g >= free0, "memory comes back after unmap and release");
    expect_error(ErrorKind::kOther, "a device that does not exist", [] { CudaBackend(1 << 20); });
    return failures == 0 ? 0 : 1;
}

int check_no_driver() {
    try {
        CudaBackend b(0);
        expect(false, "CudaBackend(0) without a driver raised nothing");
    } catch (const BackendError& e) {
        expect(e.kind == ErrorKind::kOther && std::strstr(e.what(), "libcuda.so.1") != nullptr,
               std::string("no driver -> ") + e.what());
    }
    return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    try {
        if (mode == "device") return check_device();
        if (mode == "no-driver") return check_no_driver();
    } catch (const std::exception& e) {
        std::printf("FAIL uncaught: %s\n", e.what());
        return 1;
    }
    std::printf("FAIL usage: %s device|no-driver\n", argv[0]);
    return 2;
}
