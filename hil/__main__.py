"""``python -m hil``: the hardware-in-the-loop runner's command line.

Commands:

``run``  run the device suites, the peer benchmark, the simulator fidelity check and the sanitizer
         runs on each ``--device`` and write one record (:mod:`hil.runner`);
``env``  describe one device and the software around it, as a record names them.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence

from hil.process import timeout_seconds
from hil.runner import EXIT_BAD_INPUT, HilRunError, Part, RunOptions, exit_code_of, run
from hil.sanitizer import check_tools
from hil.suites import SUITES, suite_named

PROG = "python -m hil"

_RUN_EPILOG = """\
suites (--suites, default all):
{suites}

parts (--parts, default all): suites; peers (the peer benchmark, real GPU only); fidelity (simulator
against the real device); sanitizer (the suites under compute-sanitizer, real GPU only).

examples:
  {prog} run --device cuda:0 --out reports/hil/
  {prog} run --device cuda:0 --out reports/hil/ --parts suites,sanitizer --sanitizer memcheck
  {prog} run --device cuda:0 --parts peers,fidelity --resume reports/hil/hil-<device>-<date>.json
  {prog} run --device sim:h200-141gb --out build/hil --suites contract,allocator   (no GPU: the simulator)

exit status: 0 every part run passed, nothing skipped; 1 a suite or part failed; 2 bad input or no
usable device; 3 nothing failed, but a suite or part was skipped; 130 interrupted (Ctrl-C), 143 or 129
stopped by SIGTERM or SIGHUP: no record written, every child process killed.
"""


#: Exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (a CI job cancelled, ``timeout``): unwinds like Ctrl-C, so the child's group is killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signum)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _parts(text: str) -> list[Part]:
    out = []
    for name in _csv(text):
        try:
            out.append(Part(name))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown part {name!r}; the parts are: {', '.join(p.value for p in Part)}") from None
    if not out:
        raise argparse.ArgumentTypeError("name at least one part")
    return sorted(set(out), key=list(Part).index)


def _suites(text: str) -> list[str]:
    names = _csv(text)
    if not names:
        raise argparse.ArgumentTypeError("name at least one suite")
    for name in names:
        try:
            suite_named(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return list(dict.fromkeys(names))


def _tools(text: str) -> list:
    try:
        tools = check_tools(_csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not tools:
        raise argparse.ArgumentTypeError("name at least one tool (memcheck, racecheck)")
    return tools


def _repeat(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be from 1 to 100, got {value}")
    return value


def _split(texts: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(s for text in texts for s in _csv(text)))


def _out_dir(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)


def _device(text: str) -> str:
    specs = _csv(text)
    if not specs:
        raise argparse.ArgumentTypeError("empty device spec")
    for spec in specs:
        if not (spec.startswith("cuda:") or spec.startswith("sim:")):
            raise argparse.ArgumentTypeError(f"{spec!r} is not a device spec: use cuda:N (a real GPU) or sim:PROFILE")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    suites = "\n".join(f"  {s.name:<13}{s.description}" for s in SUITES)
    p = sub.add_parser("run", help="run the HIL suites, peer benchmark, fidelity and sanitizer; write a record",
                       description="Run every device suite, the peer benchmark, the simulator fidelity check and the "
                                   "sanitizer runs on each device, and write one JSON record and a Markdown summary.",
                       epilog=_RUN_EPILOG.format(suites=suites, prog=PROG),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", action="append", required=True, type=_device, metavar="SPEC",
                   help="a device to run on: cuda:N (a real GPU) or sim:PROFILE; repeat or comma-separate for several")
    p.add_argument("--out", type=_out_dir, default=None, metavar="DIR",
                   help="where the record, the summary and the logs go (default: reports/hil; with --resume, beside "
                        "the record resumed)")
    p.add_argument("--parts", type=_parts, default=list(Part), metavar="LIST",
                   help="comma-separated parts to run: suites, peers, fidelity, sanitizer (default: all)")
    p.add_argument("--suites", type=_suites, default=[s.name for s in SUITES], metavar="LIST",
                   help="comma-separated suites to run (default: all; see below)")
    p.add_argument("--sanitizer", type=_tools, default=None, metavar="TOOLS",
                   help="compute-sanitizer tools for the sanitizer part: memcheck, racecheck (default: both)")
    p.add_argument("--sanitizer-suites", type=_suites, default=None, metavar="LIST",
                   help="suites to run under memcheck (default: the suites run); racecheck runs only where kernels "
                        "use shared memory (allocator, cupy)")
    p.add_argument("--traces", type=Path, default=None, metavar="DIR",
                   help="traces for the peer benchmark and fidelity (default: the repository's data/traces)")
    p.add_argument("--sim", default=None, metavar="SPEC",
                   help="the simulated device fidelity compares with (default: the profile named like the GPU, "
                        "else sim:h200-141gb)")
    p.add_argument("--repeat", type=_repeat, default=3, metavar="N", help="timed passes per peer and trace (default 3)")
    p.add_argument("--suite-timeout", type=timeout_seconds, default=1800.0, metavar="SECONDS",
                   help="kill a suite's pytest run after this long (default 1800)")
    p.add_argument("--part-timeout", type=timeout_seconds, default=3600.0, metavar="SECONDS",
                   help="kill the peer benchmark or the fidelity check after this long (default 3600)")
    p.add_argument("--resume", type=Path, default=None, metavar="RECORD.json",
                   help="add this call's parts to an earlier record of the same devices (for runners that limit "
                        "how long one command runs)")
    p.add_argument("--repo", type=Path, default=None, metavar="DIR",
                   help="the gpumem checkout whose tests/ hold the suites (default: here, or the package's own)")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    e = sub.add_parser("env", help="describe a device and the software around it (what a record names)",
                       description="Open one device and print what a HIL record says about it: name, memory, "
                                   "driver and CUDA versions, package versions, compute-sanitizer.")
    e.add_argument("--device", required=True, type=_device, metavar="SPEC", help="cuda:N or sim:PROFILE")
    e.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    if args.command == "env":
        from hil.environment import probe

        if len(_csv(args.device)) != 1:
            print(f"{PROG} env: one device at a time (got {args.device})", file=sys.stderr)
            return EXIT_BAD_INPUT
        report = probe(args.device).as_json()
        if report["error"] and not args.json:
            print(f"{PROG} env: {report['error']}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.json:
            print(json.dumps(report, indent=1, default=str))
        else:
            for key, value in report.items():
                print(f"{key}: {value}")
        return EXIT_BAD_INPUT if report["error"] else 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        import pytest  # noqa: F401 - the suites run under it
    except ImportError:
        print(f"{PROG} run: the suites need pytest and hypothesis: pip install -e \".[dev]\"", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.out is not None and args.resume is not None and args.out.resolve() != args.resume.resolve().parent:
        print(f"{PROG} run: --out {args.out} and --resume {args.resume}: a resumed record stays where it is; "
              "give one or the other", file=sys.stderr)
        return EXIT_BAD_INPUT
    opts = RunOptions(
        devices=_split(args.device), out_dir=args.out if args.out is not None else Path("reports/hil"), parts=args.parts, suites=args.suites,
        sanitizer_suites=args.sanitizer_suites, traces=args.traces, repo_root=args.repo, sim=args.sim,
        suite_timeout_s=args.suite_timeout, part_timeout_s=args.part_timeout, peers_repeat=args.repeat,
        resume=args.resume, command=" ".join([PROG, *map(shlex.quote, sys.argv[1:] if argv is None else argv)]))
    if args.sanitizer is not None:
        opts.sanitizer_tools = args.sanitizer
    previous_term = signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the running child's group is killed
    previous_hup = signal.signal(signal.SIGHUP, _terminated)
    try:
        record, paths = run(opts)
    except _Terminated as exc:
        print(f"{PROG} run: stopped by signal {exc.signum}; no record written", file=sys.stderr)
        return 128 + exc.signum
    except HilRunError as exc:
        print(f"{PROG} run: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the running child and what it started were killed (hil.process)
        print(f"{PROG} run: interrupted; no record written"
              + (f" ({opts.resume} is unchanged)" if opts.resume is not None else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGHUP, previous_hup)
    print(f"{PROG}: {record['status']}; wrote {paths[0]}, {paths[1]} and the logs in {paths[2]}/")
    return exit_code_of(record, opts.parts)


if __name__ == "__main__":
    sys.exit(main())
