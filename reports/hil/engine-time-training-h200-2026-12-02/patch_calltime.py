"""Device-only study patch (never committed to the library; run on the device's copy by ``run.sh``): time every
driver call checked through CudaDriver::check, each fence record and query, and the engine's indexing of the pages
fallen empty since its last look (``Engine::idle_refresh``, Note [The engine's own time] in gpumem/sim/latency.py),
and dump them at exit to $GPUMEM_CALL_LOG as ``name start_ns dur_ns arg`` lines (steady clock; ``arg``: the pages
indexed, else 0). ``reports/hil/where-replays-part-2026-11-30/patch_calltime.py`` did the calls alone, and named
the fence record and the clock's timing-event record alike; here the fence record is ``cuEventRecord:fence``."""
import re

p = "gpumem/_native/cuda_backend.cpp"
s = open(p).read()
if "calltime_tick" in s:
    raise SystemExit(f"{p} is patched already: restore it (git checkout gpumem/_native) or use a fresh copy")
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
struct CallRec { const char* name; long long start_ns, dur_ns, arg; };
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
    for (const auto& r : *g_calls) std::fprintf(f, "%s %lld %lld %lld\n", r.name, r.start_ns, r.dur_ns, r.arg);
    std::fclose(f);
}
void calltime_push(const char* name, long long start, long long dur, long long arg) {
    std::lock_guard<std::mutex> lock(g_calls_mu);
    if (!g_calls) { g_calls = new std::vector<CallRec>(); g_calls->reserve(1 << 22); std::atexit(calltime_dump); }
    g_calls->push_back({name, start, dur, arg});
}
}
extern "C" long long calltime_clock_ns() { return calltime_now(); }
extern "C" void calltime_mark(const char* name, long long start_ns, long long arg) {
    calltime_push(name, start_ns, calltime_now() - start_ns, arg);
}
static inline int calltime_tick() { g_tick_ns = calltime_now(); return 0; }
static inline void calltime_record(const char* call) {
    long long end = calltime_now();
    if (call[2] == 'C' && call[3] == 't') return;   // cuCtxGetCurrent / cuCtxPushCurrent: per call, not wanted
    calltime_push(call, g_tick_ns, end - g_tick_ns, 0);
}
'''
idx = [m.end() for m in re.finditer(r"^#include[^\n]*\n", s, re.M)][-1]
s = s[:idx] + helper + s[idx:]
old = "    void check(CUresult r, const char* call) const {\n"
assert old in s
s = s.replace(old, old + "        calltime_record(call);\n", 1)
q = "    CUresult r = drv_.cuEventQuery(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(event)));\n"
assert q in s
s = s.replace(q, "    calltime_tick();\n" + q + "    calltime_record(r == CUDA_SUCCESS ? \"cuEventQuery:done\" : \"cuEventQuery:pending\");\n", 1)
rec = "    CUresult r = drv_.cuEventRecord(ev, reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream)));\n"
assert s.count(rec) == 2, s.count(rec)   # the fence's (event_record) first, then the clock's timing event
i = s.index(rec)
s = s[:i] + "    calltime_tick();\n" + rec + "    calltime_record(\"cuEventRecord:fence\");\n" + s[i + len(rec):]
open(p, "w").write(s)

e = "gpumem/_native/engine.cpp"
t = open(e).read()
head = "void Engine::idle_refresh() {\n"
tail = "        other->fresh.clear();\n    }\n}\n"
assert t.count(head) == 1 and t.count(tail) == 1
t = t.replace(head, 'extern "C" long long calltime_clock_ns();\nextern "C" void calltime_mark(const char*, long long, long long);\n' + head
              + "    const long long calltime_t0 = calltime_clock_ns();\n", 1)
t = t.replace(tail, "        other->fresh.clear();\n    }\n    if (n_fresh) calltime_mark(\"engine_index\", calltime_t0, "
              "static_cast<long long>(n_fresh));\n}\n", 1)
open(e, "w").write(t)
print("patched", n1, "calls, the fence record and the index")
