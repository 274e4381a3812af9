"""`python -m gpumem estimate` of a 7B (Llama-2 shape, prompt 2,048) from checkouts side by side, alternated, in wall
seconds (medians, min-max) and the CPU seconds of the command and the children it reaped; checks that every run of
a length printed the same bytes.

    python bench.py base=<checkout>,new=<checkout> 100,1000,4000,16000 5 [extra estimate options]

Each checkout is put on PYTHONPATH (its native engine built in place); the commands run in a scratch directory.
"""
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = ("--hidden-size 4096 --intermediate-size 11008 --layers 32 --vocab-size 32000 --heads 32 "
         "--prompt-len 2048").split()
checkouts = [c.split("=", 1) for c in sys.argv[1].split(",")]
tokens = [int(x) for x in sys.argv[2].split(",")]
reps = int(sys.argv[3])
extra = sys.argv[4:]
res: dict = {}
scratch = tempfile.mkdtemp()
print("CPUs", os.cpu_count(), "load average at start", os.getloadavg())
for r in range(reps):
    for n in tokens:
        for name, path in checkouts:
            env = dict(os.environ, PYTHONPATH=path)
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "gpumem", "estimate", *SHAPE, "--new-tokens", str(n), "--json",
                                  *extra], env=env, cwd=scratch, capture_output=True)
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            assert out.returncode == 0, out.stderr
            res.setdefault((n, name), []).append(dt)
            res.setdefault((n, name, "cpu"), []).append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            res.setdefault((n, name, "out"), set()).add(out.stdout)
print("load average at end", os.getloadavg())
names = [c[0] for c in checkouts]
print("new tok " + " ".join(f"{n:>22}" for n in names) + "  same bytes   CPU s (median)   ratio to the first")
for n in tokens:
    row = [res[(n, c)] for c in names]
    same = len(set().union(*[res[(n, c, "out")] for c in names])) == 1
    cpu = [statistics.median(res[(n, c, "cpu")]) for c in names]
    print(f"{n:7d} " + " ".join(f"{statistics.median(v):6.2f} ({min(v):.2f}-{max(v):.2f})" for v in row)
          + f"  {same}   " + " ".join(f"{c:.2f}" for c in cpu) + "   "
          + " ".join(f"{statistics.median(v) / statistics.median(row[0]):.2f}x" for v in row[1:]))
