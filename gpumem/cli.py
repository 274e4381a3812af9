"""The ``gpumem`` command.

``gpumem devices [--json]``
    Real CUDA devices (through NVML, without creating a CUDA context) and every
    simulated profile, with total and free bytes.

``gpumem replay TRACE [--device SPEC] [--policy NAME] [--limit LIMIT] [--format NAME]
[--device-index N] [--json] [--summary] [--export-snapshot PATH]``
    Replay an allocation trace (PyTorch snapshot, RMM log or gpumem trace)
    through gpumem's caching allocator and report peak live and reserved bytes,
    overhead, external fragmentation, out-of-memory errors and time per operation.

Exit status (:data:`EXIT_CODES`): 0 done; 1 out of memory (the trace does not fit the
device or the limit); 2 bad input (a bad option, device spec, trace file or output
path); 3 the device was lost; 4 another device error during the replay (a failed
device call, a memory hazard the simulator caught, an internal consistency error);
130 interrupted (Ctrl-C); 141 standard output was closed: the output pipe closed early
(``gpumem replay ... --json | head``), as for a command that SIGPIPE ended, or no standard output
at all (``gpumem replay ... >&-``: the command stops before it starts, with one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from typing import Any, Sequence

from . import __version__
from .commands._common import (EXIT_BROKEN_PIPE, EXIT_CODES, EXIT_DEVICE_ERROR, EXIT_DEVICE_LOST,  # noqa: F401
                               EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM, EXIT_USAGE, FRAGMENTATION_MEANING,
                               GENERAL_EXIT_CODES, OVERHEAD_MEANING, OutputFile, _DEFAULT_DEVICE, _LIMIT_HELP,
                               _UsageError, _add_verbose, _check_trace_path, _cli_names, _device_index,
                               _exit_codes_text, _folder_message, _limit_syntax, _shorten_path, check_output_path,
                               run_command)
from .commands.devices import cmd_devices  # noqa: F401 - the old names, importable from gpumem.cli
from .errors import DeviceLostError, GpumemError, InvalidArgumentError, OutOfMemoryError, TraceFormatError  # noqa: F401

log = logging.getLogger("gpumem")


def __getattr__(name: str) -> Any:
    """``cmd_replay``, an old name importable from here, loaded on first use: its module imports numpy, which
    :func:`main` keeps for after :func:`_one_blas_thread` (Note [One BLAS thread for the estimate])."""
    if name == "cmd_replay":
        from .commands.replay import cmd_replay
        return cmd_replay
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Note [One BLAS thread for the estimate]
#     numpy's OpenBLAS starts a thread per CPU when numpy is imported, and each spins about 0.1 s of CPU before it
#     sleeps (perf on `gpumem estimate`: 6.6 % of the samples of a 7B replay at 8,000 new tokens in
#     blas_thread_server). gpumem computes no linear algebra, so on the 2-CPU machine of
#     reports/estimate-speed-2026-12-05.md that spin only took a CPU from the replay and from the worker
#     processes the estimate starts (Note [Policies replayed apart]). The commands that replay at length
#     (`estimate`, `fit`) therefore ask for one BLAS thread, through OPENBLAS_NUM_THREADS, which OpenBLAS reads
#     when numpy loads it: set only where the user set nothing, only while numpy is not yet imported (in a process
#     that imported it, as a test calling main(), nothing is changed), and inherited by those worker processes.
#     The other commands keep the environment as it was (`record` passes it to the program it runs).
_ONE_BLAS_THREAD_COMMANDS = ("estimate", "fit")


def _one_blas_thread(argv: Sequence[str]) -> bool:
    """Set OPENBLAS_NUM_THREADS=1 where ``argv``'s command replays at length and nothing has loaded numpy or set
    the variable (Note [One BLAS thread for the estimate]); whether it was set."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if (command not in _ONE_BLAS_THREAD_COMMANDS or "numpy" in sys.modules
            or "OPENBLAS_NUM_THREADS" in os.environ):
        return False
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    return True


def build_parser() -> argparse.ArgumentParser:
    """The ``gpumem`` argument parser (``devices`` and ``replay``, and the commands of :mod:`gpumem.commands`)."""
    from .commands._args import hint_swallowed_positionals, refuse_repeated_options

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="gpumem",
        formatter_class=raw,
        description="GPU memory management, simulation first: list devices, replay allocation traces.\n"
                    "Run `gpumem COMMAND --help` for a command's options.",
        epilog="device specs: 'sim:<profile>' (see `gpumem devices`), with options such as\n"
               "'sim:h200-141gb?pressure=spikes&seed=3', or 'cuda:<index>' for a real GPU.\n\n" + _exit_codes_text(),
    )
    parser.add_argument("--version", action="version", version=f"gpumem {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True


    import importlib

    from .commands import COMMAND_MODULES
    for name in COMMAND_MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(sub, raw)
    refuse_repeated_options(parser)  # Note [Options behave the same in every command]
    hint_swallowed_positionals(parser)
    _take_negative_values(parser)
    return parser


#: What argparse takes for a value, not an option, after an option that wants one: a '-' then a digit (or '.'
#: and a digit), units or '%' after it allowed. Python 3.11's own pattern takes bare numbers only.
_NEGATIVE_VALUE = re.compile(r"^-\.?[0-9]")


def _take_negative_values(parser: argparse.ArgumentParser) -> None:
    """Let every option of ``parser`` and its subcommands take a value that starts with '-' and a digit.

    Note [Negative values]: argparse takes a word that starts with '-' for an option unless it looks like a
    negative number, by its pattern ``^-\\d+$|^-\\d*\\.\\d+$``: so ``--limit -1GiB`` failed with "expected one
    argument" while ``--limit=-1GiB`` reached the check that says what is wrong with the value. No gpumem
    option looks like a negative number (argparse itself would then take such words for options again),
    so a word of '-' and a digit can be nothing but a value: the pattern is widened to any such word
    (Python 3.13 widened its own the same way), through the parser's ``_negative_number_matcher``, the one
    attribute argparse reads it from; where a Python has no such attribute nothing changes (the
    ``--limit=-1GiB`` form works everywhere).
    """
    if hasattr(parser, "_negative_number_matcher") and not getattr(parser, "_has_negative_number_optionals", [True]):
        parser._negative_number_matcher = _NEGATIVE_VALUE
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _take_negative_values(sub)


def _stdout_closed() -> bool:
    """Whether standard output is missing or closed (Python sets ``sys.stdout`` to None when the process
    starts with file descriptor 1 closed)."""
    out = sys.stdout
    if out is None or getattr(out, "closed", False):
        return True
    try:
        fd = out.fileno()
    except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (captured output)
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpumem`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Ctrl-C anywhere in here, the imports that building the parser and the commands do included, ends with
    one line on stderr and status 130. (Python's own start-up and the imports of the ``gpumem`` package
    and of this module, about the first 0.15 s of the process, come before this function runs: a Ctrl-C
    then still ends as for any Python program, with Python's traceback and death by SIGINT, which a shell
    reports as status 130 too.)
    """
    command = ""
    sigint: _SigintFlag | None = None
    try:
        # inside the try: a Ctrl-C while the handler is being installed is an interruption like any other
        sigint = _SigintFlag()
        _one_blas_thread(sys.argv[1:] if argv is None else argv)
        parser = build_parser()
        from .commands._args import strip_bookkeeping

        args = strip_bookkeeping(_parse(parser, argv))
        command = f" {args.command}"
        return _main(args)
    except KeyboardInterrupt:
        pass
    except Exception:
        # a Ctrl-C inside a C extension's import (numpy's) can come out as an ImportError or SystemError
        if sigint is None or not sigint.seen:
            raise
    finally:
        if sigint is not None:
            sigint.restore()
    if sys.stderr is not None:
        print(f"gpumem{command}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that words no option takes are refused by the subcommand's parser:
    ``gpumem replay t.gmt --foo`` prints replay's usage and ``gpumem replay: error: unrecognized arguments:
    --foo``, not the top-level usage (argparse hands them up to the top-level parser, which knows nothing of
    the subcommand's options)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub = subs.choices.get(getattr(args, "command", None) or "", parser)
        sub.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


class _SigintFlag:
    """Python's SIGINT handling (``KeyboardInterrupt``) that also remembers that SIGINT came, for :func:`main`.

    Installed only over Python's default handler, in the main thread; :meth:`restore` puts it back.
    """

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            try:
                signal.signal(signal.SIGINT, self._previous)
            except ValueError:  # pragma: no cover
                pass
            self._previous = None


def _main(args: argparse.Namespace) -> int:
    level = logging.WARNING - 10 * min(args.verbose + getattr(args, "command_verbose", 0), 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if _stdout_closed():
        # started with stdout closed (`gpumem replay T >&-`): the results could go nowhere; end at once, as
        # for a closed pipe, with one line on stderr (if there is one) and no traceback
        if sys.stderr is not None:
            print(f"gpumem {args.command}: standard output is closed: nothing to print the results to",
                  file=sys.stderr)
        return EXIT_BROKEN_PIPE
    try:
        code = run_command(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away (`| head`): as CPython's documentation recommends, point stdout at devnull so that
        # the interpreter's final flush does not fail again, and end quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
