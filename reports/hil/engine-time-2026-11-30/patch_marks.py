"""Study patch (never committed to the library): time marks inside the native engine's slow allocation path, kept in
memory and written at exit to $MK_LOG as 'MK name ns_since_allocate_slow value' lines. Apply it to a copy of the
repository, then build there (section 1 of ``reports/hil/engine-time-2026-11-30.md``)::

    git worktree add ../marks HEAD && cd ../marks
    python reports/hil/engine-time-2026-11-30/patch_marks.py && python setup.py -q build_ext --inplace
    MK_LOG=$PWD/marks.txt PYTHONPATH=. python reports/hil/engine-time-2026-11-30/marks.py \\
        reports/hil/where-replays-part-2026-11-30/ct-b-b16.gmt.gz
"""
import re

p = "gpumem/_native/engine.cpp"
s = open(p).read()
helper = r'''
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
namespace {
long long mk_now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
thread_local long long mk_t0 = 0;
struct MkRec { const char* n; long long t; unsigned long long v; };
std::vector<MkRec>* mk_buf = nullptr;
void mk_dump() {
    const char* path = std::getenv("MK_LOG");
    FILE* f = path && mk_buf ? std::fopen(path, "w") : nullptr;
    if (!f) return;
    for (auto& r : *mk_buf) std::fprintf(f, "MK %s %lld %llu\n", r.n, r.t, r.v);
    std::fclose(f);
}
void MKv(const char* n, unsigned long long v) {
    if (!mk_buf) { mk_buf = new std::vector<MkRec>(); mk_buf->reserve(1 << 20); std::atexit(mk_dump); }
    mk_buf->push_back({n, mk_t0 ? mk_now() - mk_t0 : -1, v});
}
void MK(const char* n) { if (mk_t0) MKv(n, 0); }
}
'''
idx = [m.end() for m in re.finditer(r"^#include[^\n]*\n", s, re.M)][-1]
s = s[:idx] + helper + s[idx:]


def after(anchor: str, text: str) -> None:
    global s
    assert anchor in s, anchor
    s = s.replace(anchor, anchor + text, 1)


after("std::uint64_t Engine::allocate_slow(std::uint64_t nbytes, std::uint64_t size, bool small, std::uint64_t stream) {\n",
      '    mk_t0 = mk_now(); MKv("begin", size);\n    struct E { ~E() { MK("end"); mk_t0 = 0; } } e_;\n')
after("    plan_check_warmup();   // Note [A memory-first warm-up] in plan.py\n", '    MK("warm");\n')
after("        b = grow(small, stream, size, fl, nbytes);\n", '        MK("grown");\n')
after("    if (!committed_) {\n        b = split(b, size, small, fl);\n", '        MK("split");\n')
after("    // pages held may reach this before a steal\n", '    MK("map_runs");\n')
after("bool Engine::steal_chunk(VSeg* seg, std::int64_t first, std::int64_t last, std::int64_t max_pages,\n"
      "                         std::uint64_t requested, std::uint64_t stream, ChunkHandle* out) {\n", '    MK("steal_chunk");\n')
after("    idle_walk(fits, seg, first, last, max_pages);   // Note [An index of idle chunks] in backing.py\n", '    MK("idle_walked");\n')
after("std::uint64_t Engine::fences_record(std::uint64_t stream) {\n", '    MK("record");\n')
after("    if (n_fresh) backend_.engine_work(n_fresh);\n", '    MK("told");\n')   # the device told: a Python call here
after("                if (!take_cached(rem, &h))\n", '                    MK("chunk_for"),\n')
after("void Engine::idle_refresh() {\n",
      '    { unsigned long long n = 0; for (auto& up : vsegs_) n += up->fresh.size(); MKv("fresh", n); }\n')
open(p, "w").write(s)
print("patched", p)
