"""Device-only study patch (never committed to the library): time every driver call checked through
CudaDriver::check and dump them at exit to $GPUMEM_CALL_LOG as 'name start_ns dur_ns' lines (steady clock)."""
import re
p = "gpumem/_native/cuda_backend.cpp"
s = open(p).read()
n1 = len(re.findall(r"drv_\.check\(drv_\.cu", s))
s = re.sub(r"drv_\.check\(drv_\.cu", "drv_.check((calltime_tick(), drv_.cu", s)
s, n2 = re.subn(r'\),(\s*)"cu(\w+)"\)', r')),\1"cu\2")', s)
assert n1 == n2, (n1, n2)
helper = r'''
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>
namespace {
struct CallRec { const char* name; long long start_ns, dur_ns; };
std::vector<CallRec>* g_calls = nullptr;
std::mutex g_calls_mu;
thread_local long long g_tick_ns = 0;
long long calltime_now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
void calltime_dump() {
    const char* path = std::getenv("GPUMEM_CALL_LOG");
    if (!path || !g_calls) return;
    FILE* f = std::fopen(path, "w");
    if (!f) return;
    for (const auto& r : *g_calls) std::fprintf(f, "%s %lld %lld\n", r.name, r.start_ns, r.dur_ns);
    std::fclose(f);
}
}
static inline int calltime_tick() { g_tick_ns = calltime_now(); return 0; }
static inline void calltime_record(const char* call) {
    long long end = calltime_now();
    if (call[2] == 'C' && call[3] == 't') return;   // cuCtxGetCurrent / cuCtxPushCurrent: per call, not wanted
    std::lock_guard<std::mutex> lock(g_calls_mu);
    if (!g_calls) { g_calls = new std::vector<CallRec>(); g_calls->reserve(1 << 20); std::atexit(calltime_dump); }
    g_calls->push_back({call, g_tick_ns, end - g_tick_ns});
}
'''
# after the last #include line at the top
idx = [m.end() for m in re.finditer(r"^#include[^\n]*\n", s, re.M)][-1]
s = s[:idx] + helper + s[idx:]
old = "    void check(CUresult r, const char* call) const {\n"
assert old in s
s = s.replace(old, old + "        calltime_record(call);\n", 1)
q = "    CUresult r = drv_.cuEventQuery(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event)));\n"
assert q in s
s = s.replace(q, "    calltime_tick();\n" + q + "    calltime_record(r == CUDA_SUCCESS ? \"cuEventQuery:done\" : \"cuEventQuery:pending\");\n", 1)
rec = "    CUresult r = drv_.cuEventRecord(ev, reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)));\n"
assert rec in s
s = s.replace(rec, "    calltime_tick();\n" + rec + "    calltime_record(\"cuEventRecord\");\n", 1)
open(p, "w").write(s)
print("patched", n1, "calls")
