"""Builders of hostile trace files, and a loader that runs in a memory-capped child process.

Each builder reproduces an attack measured against the readers (issue 6): the
files are small on disk and expand, or would have expanded, into gigabytes.
Large gzip files are written as many identical gzip *members* (a gzip file may
hold several; readers decompress them all), so building a 7.8 MB file that
inflates to 7.8 GB takes milliseconds.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

ENTRY = {"action": "alloc", "addr": 0x1000, "size": 64, "stream": 0, "time_us": 1}


def _short_str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def entry_opcodes(entry: dict[str, Any]) -> bytes:
    """Protocol-2+ opcodes pushing ``entry`` (str keys, str or small int values), without memo ops."""
    out = [b"}(", ]
    for key, value in entry.items():
        out.append(_short_str(key))
        out.append(_short_str(value) if isinstance(value, str) else b"J" + struct.pack("<i", value))
    out.append(b"u")
    return b"".join(out)


def write_gzip_members(path: Path, parts: list[tuple[bytes, int]]) -> Path:
    """Write ``parts`` (content, repeat count) as gzip members; each distinct content is compressed once."""
    with open(path, "wb") as f:
        for content, count in parts:
            member = gzip.compress(content, compresslevel=9, mtime=0)
            for _ in range(count):
                f.write(member)
    return path


def memo_bomb_pickle(path: Path, n_batches: int = 100_000, batch: int = 1000, *, gz: bool = True) -> Path:
    """A snapshot whose one device trace repeats a memo reference to a single entry ``n_batches * batch`` times.

    With the defaults: about 200 KB gzipped, 200 MB of pickle, 100 million entries
    (the issue's 219 KB file that grew to 9.4 GB).
    """
    head = (b"\x80\x02}q\x00" + _short_str("device_traces") + b"q\x01]q\x02]q\x03"
            + entry_opcodes(ENTRY) + b"q\x04a")
    body = b"(" + b"h\x04" * batch + b"e"
    tail = b"as."
    if not gz:
        with open(path, "wb") as f:
            f.write(head)
            for _ in range(n_batches):
                f.write(body)
            f.write(tail)
        return path
    per_member = max(1, (1 << 20) // len(body))
    full, rest = divmod(n_batches, per_member)
    parts = [(head, 1), (body * per_member, full)] + ([(body * rest, 1)] if rest else []) + [(tail, 1)]
    return write_gzip_members(path, parts)


def segments_memo_bomb_pickle(path: Path, n_batches: int = 200_000, batch: int = 500) -> Path:
    """A valid one-entry snapshot whose ``segments`` list (never walked by the reader) holds lists of
    ``batch`` memo references, ``n_batches`` of them: one object per list, 8 bytes per reference.

    With the defaults: 200 MB of pickle, 100 million references, 0.8 GB to load (the review's
    t3_pickle_refs.py, 1.1 MB gzipped at 178x). Identical gzip members compress past the 200x ratio
    cap; tests raise ``max_compression_ratio`` to show that the memory budget alone stops it.
    """
    head = (b"\x80\x04}" + _short_str("device_traces") + b"]]" + entry_opcodes(ENTRY) + b"aas"
            + _short_str("segments") + b"]" + _short_str("s") + b"\x94" + b"0")  # memo 0, popped
    body = b"(" + b"h\x00" * batch + b"e"
    per_member = max(1, (1 << 20) // len(body))
    full, rest = divmod(n_batches, per_member)
    parts = [(head, 1), (body * per_member, full)] + ([(body * rest, 1)] if rest else []) + [(b"s.", 1)]
    return write_gzip_members(path, parts)


def rmm_event_bomb(path: Path, n_events: int = 4_000_000) -> Path:
    """A well-formed RMM log of ``n_events`` alloc/free lines (the review's t1b_rmm_bomb.py: 4 million
    events, 0.9 MB of .gz at 165x; identical members compress further, so raise ``max_compression_ratio``)."""
    pair = b"0,00:00:01.000000,allocate,0x1000,1,0\n0,00:00:01.000001,free,0x1000,1,0\n"
    per_member = 10_000
    full, rest = divmod(n_events // 2, per_member)
    parts = ([(b"Thread,Time,Action,Pointer,Size,Stream\n", 1), (pair * per_member, full)]
             + ([(pair * rest, 1)] if rest else []))
    return write_gzip_members(path, parts)


def rmm_long_line_bomb(path: Path, n_mib: int = 7_800) -> Path:
    """An RMM log whose second line is ``n_mib`` MiB of digits in the Size field (7.8 MB gzipped by default)."""
    head = b"Thread,Time,Action,Pointer,Size,Stream\n1,21:50:47.674565,allocate,0x10,"
    return write_gzip_members(path, [(head, 1), (b"9" * (1 << 20), n_mib), (b",0\n", 1)])


def rmm_blank_lines_bomb(path: Path, n_mib: int = 7_800) -> Path:
    """An RMM log of one allocation followed by ``n_mib`` MiB of blank lines."""
    head = b"Thread,Time,Action,Pointer,Size,Stream\n1,21:50:47.674565,allocate,0x10,8,0\n"
    return write_gzip_members(path, [(head, 1), (b"\n" * (1 << 20), n_mib)])


def nested_tuple_key_pickle(path: Path, depth: int = 1_000_000) -> Path:
    """A dict whose key is a tuple nested ``depth`` deep: hashing it overflowed the C stack (a crash)."""
    data = b"\x80\x04}N" + b"\x85" * depth + b"K\x01s."
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


CHILD = textwrap.dedent("""
    import json, os, resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from gpumem.errors import TraceFormatError
    from gpumem.trace import TraceLimits, load_trace
    limits = TraceLimits(**json.loads(os.environ.get("GPUMEM_TEST_LIMITS", "{}")))
    out = []
    for path in sys.argv[2:]:
        try:
            t = load_trace(path, progress=False, limits=limits)
            outcome = ["trace", t.n_ops]
        except TraceFormatError as e:
            outcome = ["TraceFormatError", str(e)[:400], len(str(e))]
        except BaseException as e:
            outcome = [type(e).__name__, str(e)[:400], len(str(e))]
        out.append(outcome)
    # VmHWM belongs to this process's own memory map; ru_maxrss would carry the parent's peak across exec
    try:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.append(peak)
    print(json.dumps(out))
""")


def load_in_child(paths: list[Path], address_space_nbytes: int = 2 << 30, timeout_s: float = 120,
                  limits: dict[str, Any] | None = None) -> tuple[list[Any], int]:
    """Load each path with ``load_trace`` in a child whose address space is capped (RLIMIT_AS).

    ``limits`` (keyword arguments of ``TraceLimits``) replaces the default limits.

    Returns ``(outcomes, peak_rss_nbytes)``: an outcome is ``["trace", n_ops]`` or
    ``[exception type name, message prefix, message length]``. A crash of the child
    (a signal, which is what a stack overflow is) fails with its exit status.
    """
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", GPUMEM_TEST_LIMITS=json.dumps(limits or {}))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(address_space_nbytes), *map(str, paths)],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"loader child exited with {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result[:-1], result[-1]
