"""Running the device suites under NVIDIA's compute-sanitizer, and reading what it found.

``compute-sanitizer --tool memcheck`` checks every device memory access of every kernel (out of
bounds, freed or never-allocated memory) and ``--tool racecheck`` the shared-memory accesses of
kernels for races. The HIL runner (:mod:`hil.runner`, ``--sanitizer memcheck,racecheck``)
runs a suite's pytest process under the tool and keeps the tool's own report in a log file of its
own (``--log-file``), apart from pytest's output.

Note [Which processes are checked]
----------------------------------
compute-sanitizer checks the process it starts (``--target-processes application-only``, its
default), not the processes a test starts. Most suites do all their GPU work inside the pytest
process, and are run that way. Two suites do theirs in child processes (:data:`CHILD_PROCESS_SUITES`):
``engine`` drives the native C++ CUDA backend from a compiled check program, and ``pytorch`` runs each
scenario in a fresh Python process, because PyTorch's allocator can only be replaced before its first
CUDA call. Those two run with ``--target-processes all``: every child is checked once it makes a CUDA
call, and a child that never makes one (the C++ compiler) ends with the tool's "terminated before
first instrumented API call" line. Running every suite that way costs time for nothing: with the
tool's default launch timeout, the engine suite once ran past 200 s instead of 80 s and then reported
"No attachable process found".

The tool attaches when the program makes its first CUDA call, and gives up ("No attachable process
found", nothing checked) if that takes longer than its launch timeout: pytest collecting the
allocator suite, or importing PyTorch, takes longer than the default. ``--launch-timeout 0`` waits.
Under the tool a suite runs only its tests that run on the real device (``-k cuda``, which selects
the tests parametrised with ``cuda:N`` and those named for CUDA): the others run on simulated
devices, make no CUDA call and would only make the run longer (the allocator suite's simulated
property tests ran past 400 s under memcheck on the H200).

Note [Python frames under the sanitizer]
----------------------------------------
Under compute-sanitizer a Python program can keep objects alive longer than without it. On the H200
(compute-sanitizer 2025.3, CuPy 14.2, Python 3.12), after ``cupy.fft.rfft(x)`` returned, the frame
objects of ``rfft`` and ``_fft`` stayed alive with their locals (the input and the output array),
held by something outside Python's garbage collector, and their two 8 MiB blocks were never handed
back to gpumem; without the tool both were freed at once. The memory is not leaked by gpumem:
CuPy never lets go of it. A suite run under the tool gets ``GPUMEM_SANITIZER_TOOL`` (the tool's
name) in its environment (:data:`SANITIZER_ENV_VAR`), so a test that checks that every block CuPy
dropped came back checks it against the blocks CuPy still holds instead of against none.

Note [A clean run needs a control]
----------------------------------
"0 errors" means something only if the tool, as configured, would have seen an error. For the
suites checked in child processes that is not self-evident: compute-sanitizer prints one summary
for the whole process tree, and a child it failed to attach to looks the same as a clean one. So
before those suites the runner runs a control (:func:`child_control_command`): a Python process that
starts the in-flight probe (``hil.probes.inflight --path release --old``) as its child, which
frees a block and gives its memory back while a kernel still reads it, with the allocator's stream
fences switched off. memcheck must count errors there; if it counts none, the sanitizer part fails
instead of reporting the child-process suites as clean.

Note [API errors are not memory errors]
---------------------------------------
The contract suite makes failing calls on purpose (an allocation larger than the card, a free of a
pointer never allocated, a mapping refused) to check the error each raises. memcheck reports every
failing CUDA API call as an error unless told not to, which would bury the one kind of error the run
is for. The runner passes ``--report-api-errors no``: the count is of memory-access hazards (and, for
racecheck, of races), which a correct allocator and correct tests never cause. The flag is in the
recorded command, so nobody reads the count as more than it is.

Note [Which suites racecheck runs]
----------------------------------
racecheck looks only at shared memory inside kernels. gpumem launches no kernel of its own; the
suites whose tests launch kernels that use shared memory are the ones where it applies: ``allocator``
(a CuPy kernel sums a block with a shared-memory reduction while its memory is freed) and ``cupy``.
memcheck applies to every suite that touches a real device (:data:`MEMCHECK_SUITES`); the
``cuda_adapter`` suite tests the adapter against fakes of CuPy and NVML and makes no CUDA call, so
compute-sanitizer has nothing to check there ("terminated before first instrumented API call").
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

#: pytest arguments that select, in a suite, the tests that run on the real device.
DEVICE_TESTS_ONLY: tuple[str, ...] = ("-k", "cuda")

__all__ = ["CHILD_PROCESS_SUITES", "DEVICE_TESTS_ONLY", "MEMCHECK_SUITES", "NOTHING_CHECKED", "RACECHECK_SUITES",
           "SANITIZER_ENV_VAR", "SanitizerFindings", "SanitizerTool", "child_control_command", "find_compute_sanitizer",
           "parse_sanitizer_log", "sanitizer_prefix", "sanitizer_version"]


class SanitizerTool(str, enum.Enum):
    """The compute-sanitizer tools the runner can use."""

    MEMCHECK = "memcheck"
    RACECHECK = "racecheck"


#: Suites memcheck runs by default: every suite that makes CUDA calls (Note [Which suites racecheck runs]).
MEMCHECK_SUITES: tuple[str, ...] = ("contract", "allocator", "engine", "managers", "workspace", "cupy", "pytorch")
#: Environment variable that tells a suite it runs under compute-sanitizer (Note [Python frames under the sanitizer]).
SANITIZER_ENV_VAR = "GPUMEM_SANITIZER_TOOL"
#: Suites whose CUDA work runs in child processes of pytest (Note [Which processes are checked]).
CHILD_PROCESS_SUITES: tuple[str, ...] = ("engine", "pytorch")
#: Suites racecheck applies to (Note [Which suites racecheck runs]).
RACECHECK_SUITES: tuple[str, ...] = ("allocator", "cupy")

#: Where compute-sanitizer usually lives when it is not on ``PATH``.
_USUAL_DIRS = ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/nvidia/compute-sanitizer")


def find_compute_sanitizer() -> str | None:
    """The compute-sanitizer executable: on ``PATH``, under ``$CUDA_HOME``, or in the usual CUDA folders."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    dirs = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for d in [*dirs, *_USUAL_DIRS]:
        candidate = os.path.join(d, "compute-sanitizer")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def child_control_command(spec: str) -> list[str]:
    """A program whose child reads freed device memory on purpose (Note [A clean run needs a control])."""
    launcher = "import subprocess, sys; subprocess.call(sys.argv[1:])"
    return [sys.executable, "-c", launcher, sys.executable, "-m", "hil.probes.inflight", "--path", "release",
            "--old", "--device", spec]


def sanitizer_version(executable: str) -> str | None:
    """The tool's version line (``compute-sanitizer --version``), or None if it does not answer."""
    try:
        res = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in res.stdout.splitlines() if "version" in ln.lower()]
    return lines[-1] if lines else None


def sanitizer_prefix(executable: str, tool: SanitizerTool, log_file: Path, *, children: bool = False) -> list[str]:
    """The command-line prefix that runs a program under ``tool`` (Note [API errors are not memory errors]);
    ``children``: check the processes it starts too (Note [Which processes are checked])."""
    prefix = [executable, "--tool", tool.value, "--target-processes", "all" if children else "application-only",
              "--launch-timeout", "0",
              "--print-limit", "200", "--log-file", str(log_file)]
    if tool is SanitizerTool.MEMCHECK:
        prefix += ["--report-api-errors", "no"]
    return prefix


@dataclasses.dataclass
class SanitizerFindings:
    """What a compute-sanitizer log says: how many processes it checked, errors found, first few reports."""

    processes: int
    errors: int
    first_reports: list[str]

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# the line ends there: "ERROR SUMMARY: 27 errors were not printed. Use --print-limit ..." is not a summary
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?\s*$", re.MULTILINE)
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards? displayed\s*\((\d+)\s+errors?")
# the first line of one report ("Warp illegal address", "Invalid __global__ read of size 8 bytes", ...); the
# lines that detail it are indented further, and the tool's own lines are not reports
# (racecheck: "Error: Race reported between ...", or in hazard mode "ERROR: Potential WAW hazard detected ...")
_REPORT_START = re.compile(r"^=+ (Invalid|Race|Error|ERROR: Potential|Uninitialized|Program hit|Barrier|Leaked|"
                           r"Malloc|Warp|Lane|Out-of-range|Address|Cuda API|Illegal|Misaligned|Hazard)")
#: The tool's own "Error:" lines, about the run and not about a memory access.
_NOT_A_REPORT = ("Error: Target application", "Error: No attachable process", "Error: process didn't terminate",
                 "Error: Unable to", "Error: Could not", "Error: Failed to")
#: What compute-sanitizer prints when it failed itself: nothing it counted can be trusted.
INTERNAL_ERROR = "Internal Sanitizer Error"


#: What compute-sanitizer says when the program it ran made no CUDA call at all.
NOTHING_CHECKED = "Target application terminated before first instrumented API call"


def parse_sanitizer_log(text: str, max_reports: int = 5) -> SanitizerFindings:
    """Sum the ``ERROR SUMMARY`` lines of every checked process in a compute-sanitizer log.

    A program that made no CUDA call (:data:`NOTHING_CHECKED`) gives ``processes == 0``. A log without
    any summary line otherwise means the tool did not finish checking a process (it crashed or was
    killed): ``ValueError``, so the caller reports it instead of reading zero errors."""
    if INTERNAL_ERROR in text:
        raise ValueError(f"compute-sanitizer reported an {INTERNAL_ERROR}: what it counted cannot be trusted")
    if NOTHING_CHECKED in text and "ERROR SUMMARY" not in text:
        return SanitizerFindings(processes=0, errors=0, first_reports=[])
    summaries = [int(m.group(1)) for m in _SUMMARY.finditer(text)]
    races = [int(m.group(2)) for m in _RACE_SUMMARY.finditer(text)]
    if not summaries and not races:
        raise ValueError("the compute-sanitizer log has no ERROR SUMMARY line: the tool did not finish")
    summary_ends = [m.end() for m in _SUMMARY.finditer(text)] + [m.end() for m in _RACE_SUMMARY.finditer(text)]
    last_summary_end = max(summary_ends)
    headers: list[str] = []
    after_last_summary = 0  # reports of a process whose summary never came (it was killed, the tool crashed)
    offset = 0
    for line in text.splitlines(keepends=True):
        if _REPORT_START.match(line.rstrip()) and not line.lstrip("= ").startswith(_NOT_A_REPORT):
            headers.append(line.strip().lstrip("= ").strip())
            after_last_summary += offset >= last_summary_end
        offset += len(line)
    # race errors are not always in the ERROR SUMMARY, and a report the summaries do not count (printed
    # after the last one) is still an error: never fewer errors than either says
    errors = max(sum(summaries), sum(races), len(headers) - after_last_summary) + after_last_summary
    return SanitizerFindings(processes=max(len(summaries), len(races)), errors=errors,
                             first_reports=headers[:max_reports])


def check_tools(names: Sequence[str]) -> list[SanitizerTool]:
    """``["memcheck", "racecheck"]`` → the tools; ``ValueError`` naming the known ones otherwise."""
    tools = []
    for name in names:
        try:
            tool = SanitizerTool(name.strip())
        except ValueError:
            raise ValueError(f"unknown compute-sanitizer tool {name!r}; the runner knows: "
                             f"{', '.join(t.value for t in SanitizerTool)}") from None
        if tool not in tools:
            tools.append(tool)
    return tools
