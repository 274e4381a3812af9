"""The ``gpumem`` command: ``devices`` and ``replay``, exit codes and error messages."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gpumem.cli import EXIT_OOM, EXIT_OK, EXIT_USAGE, build_parser, main
from gpumem.replay import replay_trace
from gpumem.trace import Trace, load_trace, save_trace
from gpumem.units import GiB, KiB, MiB
from gpumem.validate import parse_limit

GB = 10**9


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def small_trace(name: str = "tiny") -> Trace:
    sizes = [1, 700, 4 * KiB, 300 * KiB, 1 * MiB + 1, 3 * MiB, 24 * MiB]
    ops = []
    t = 0.0
    for i in range(40):
        ops.append((0, i, sizes[i % len(sizes)], 0, t, 0x1000 * (i + 1)))
        t += 1
        if i % 2:
            ops.append((1, i - 1, sizes[(i - 1) % len(sizes)], 0, t, 0x1000 * i))
            t += 1
    return Trace.from_ops(name, "gpumem", ops)


@pytest.fixture
def trace_file(tmp_path):
    return save_trace(small_trace(), tmp_path / "tiny.gmt")


@pytest.fixture
def big_trace_file(tmp_path):
    """3 GiB live at once: does not fit a 2 GB card."""
    ops = [(0, i, 1 * GiB, 0, float(i), 0x1_0000_0000 * (i + 1)) for i in range(3)]
    ops += [(1, i, 1 * GiB, 0, 10.0 + i, 0x1_0000_0000 * (i + 1)) for i in range(3)]
    return save_trace(Trace.from_ops("big", "gpumem", ops), tmp_path / "big.gmt.gz")


# -- devices --------------------------------------------------------------------------------------------


def test_devices_json(capsys):
    code, out, err = run(capsys, "devices", "--json")
    assert code == EXIT_OK
    rows = json.loads(out)
    sims = [r for r in rows if r["kind"] == "sim"]
    assert len(sims) >= 13
    for r in rows:
        assert {"spec", "kind", "name", "total_bytes", "free_bytes"} <= set(r)
        assert isinstance(r["total_bytes"], int) and isinstance(r["free_bytes"], int)
        assert 0 < r["free_bytes"] <= r["total_bytes"]
        assert r["spec"].startswith(r["kind"] + ":")
    totals = sorted(r["total_bytes"] for r in sims)
    assert totals[0] <= 2 * GiB
    assert totals[-1] >= 80 * GB
    specs = {r["spec"] for r in sims}
    assert "sim:h200-141gb" in specs
    assert len(specs) == len(sims)


def test_devices_text(capsys):
    code, out, err = run(capsys, "devices")
    assert code == EXIT_OK
    assert out.splitlines()[0].split()[:5] == ["SPEC", "KIND", "NAME", "TOTAL", "FREE"]
    assert "sim:h200-141gb" in out and "sim:jetson-nano-2gb" in out
    assert "GiB" in out


# -- replay ---------------------------------------------------------------------------------------------


def test_replay_text(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb")
    assert code == EXIT_OK, err
    expected = replay_trace(load_trace(trace_file), "sim:t4-16gb", progress=False)
    for label in ("trace", "device", "policy", "peak live", "peak reserv", "overhead", "ooms", "time"):
        assert label in out
    assert "tiny" in out and "sim:t4-16gb" in out and "gpumem" in out
    assert f"{expected.overhead:.2%}" in out
    assert "ooms           0" in out
    assert "Traceback" not in err


def test_replay_json(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb", "--policy", "bestfit", "--json")
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert {"trace", "device", "policy", "n_ops", "n_allocs", "peak_live_bytes", "peak_reserved_bytes", "overhead",
            "ooms", "wall_s", "ns_per_op"} <= set(data)
    trace = small_trace()
    assert data["trace"] == "tiny" and data["device"] == "sim:t4-16gb" and data["policy"] == "bestfit"
    assert data["n_ops"] == trace.n_ops and data["n_allocs"] == trace.n_allocs
    assert data["peak_live_bytes"] == trace.peak_live_nbytes
    assert data["peak_reserved_bytes"] >= data["peak_live_bytes"]
    assert data["overhead"] >= 0 and data["ooms"] == 0 and "oom" not in data


@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
def test_replay_every_policy(capsys, trace_file, policy):
    code, out, err = run(capsys, "replay", str(trace_file), "--policy", policy, "--json")
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert data["policy"] == policy and data["device"] == "sim:h200-141gb"  # the default device


def test_replay_summary(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--summary")
    assert code == EXIT_OK
    assert "gpumem memory summary" in out and "Peak overhead" in out


def test_replay_export_snapshot(capsys, trace_file, tmp_path):
    path = tmp_path / "out.pickle"
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(path))
    assert code == EXIT_OK, err
    back = load_trace(path)
    assert back.ops_equal(small_trace(), times=False, addrs=False)


def test_replay_export_snapshot_keeps_the_source_stacks(capsys, tmp_path):
    """A PyTorch snapshot with stacks, replayed and exported, keeps who allocated what (the export wrote
    ``frames: []`` for every block before, so reports of the exported file lost their allocation sites)."""
    from gpumem.trace.pytorch_export import snapshot_frames

    source = Path(__file__).resolve().parents[1] / "data" / "traces" / "resnet_train.snapshot.pickle.gz"
    path = tmp_path / "out.pickle.gz"
    code, out, err = run(capsys, "replay", str(source), "--export-snapshot", str(path))
    assert code == EXIT_OK, err
    assert f"wrote the PyTorch snapshot to {path}" in err
    want, got = snapshot_frames(source), snapshot_frames(path)
    assert want is not None and any(want)
    assert got == want


def test_replay_oom(capsys, big_trace_file):
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb")
    assert code == EXIT_OOM
    assert "ooms           1" in out
    assert "replayed       1 of 6 ops (stopped by out of memory at op 2)" in out
    # printed once (it was two or three times, with op counts that disagreed), on stderr only
    assert err.count("out of memory") == 1 and out.count("out of memory") == 1  # the "replayed" line
    assert "gpumem replay: out of memory on sim:gtx-1050-2gb" in err
    assert "1.00 GiB (1,073,741,824 bytes) at op 2 of 6" in err
    assert "894.00 MiB free of 1.95 GiB" in err
    # what the whole trace needs, not what it reached before it stopped, and where it fits
    assert "this trace needs 3.00 GiB (3,221,225,472 bytes) live at its peak" in err
    fits = err.split("room for that peak: ")[1]
    assert fits.startswith("sim:gtx-1650-4gb") and "gtx-1050" not in fits
    assert "try: replay on a larger device (--device sim:gtx-1650-4gb)" in err
    # the context is this process's own, not "other processes"; no Python-only advice
    assert "80.00 MiB for this process's CUDA context" in err and "other processes" not in err
    assert "device=" not in err and "format=" not in err and "limit`" not in err
    assert "injected" not in err
    assert "Traceback" not in err and "Traceback" not in out


def _odd_sizes_file(tmp_path):
    """Many odd-sized allocations (each rounded up by the device's pages), then more than a 2 GB card holds."""
    ops = [(0, i, 3 * MiB + 4321, 0, float(i), 0x1_0000_0000 * (i + 1)) for i in range(700)]
    return save_trace(Trace.from_ops("odd", "gpumem", ops), tmp_path / "odd.gmt")


def test_oom_report_names_no_invented_tenants(capsys, tmp_path):
    path = _odd_sizes_file(tmp_path)
    code, out, err = run(capsys, "replay", str(path), "--device", "sim:gtx-1050-2gb", "--policy", "cupy")
    assert code == EXIT_OOM, err
    assert "tenant" not in err and "pressure" not in err  # the spec has no pressure: no tenants, no such advice
    assert "granularity rounding" in err


def test_oom_report_tenants_are_the_simulators(capsys, tmp_path):
    import re

    path = _odd_sizes_file(tmp_path)
    code, out, err = run(capsys, "replay", str(path), "--device", "sim:gtx-1050-2gb?pressure=step",
                         "--policy", "cupy")
    assert code == EXIT_OOM, err
    held = re.search(r"([0-9.]+ [KMG]iB) held by other tenants \(the spec's pressure scenario\)", err)
    assert held is not None, err
    assert held.group(1) == "500.00 MiB"  # the step preset takes a quarter of the 2 GB card (page-rounded)
    assert "replay without the spec's pressure scenario" in err


def test_replay_text_labels_are_whole_and_aligned(capsys, big_trace_file):
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb")
    rows = out.splitlines()
    labels = ["trace", "device", "policy", "engine", "gpu timing", "replayed", "peak live", "peak reserved", "overhead", "ext. frag.",
              "ooms", "time"]
    assert [r[:15].rstrip() for r in rows] == labels
    assert all(r[15] != " " and r[13:15] == "  " for r in rows)  # every value starts in one column, after two spaces
    assert "peak reserv " not in out


@pytest.mark.parametrize("argv, verbose", [
    (["replay", "-v", "T"], 1), (["-v", "replay", "T"], 1), (["replay", "T", "-vv"], 2),
    (["-v", "replay", "--verbose", "T"], 2), (["devices", "-v"], 1), (["replay", "T"], 0),
])
def test_verbose_before_or_after_the_command(argv, verbose):
    args = build_parser().parse_args(argv)
    assert args.verbose + args.command_verbose == verbose


def test_verbose_after_the_command_logs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = ("import logging, sys\nfrom gpumem.cli import main\ncode = main(sys.argv[1:])\n"
            "print('root level', logging.getLogger().level, file=sys.stderr)\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, "devices", "-vv"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "root level 10" in proc.stderr and "unrecognized" not in proc.stderr


def test_limit_above_the_device_memory_is_warned(capsys, caplog, trace_file):
    import logging

    with caplog.at_level(logging.WARNING, logger="gpumem"):
        code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:h200-141gb", "--limit", "200GiB")
    assert code == EXIT_OK, err
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "--limit 200GiB" in r.getMessage()]
    assert len(warned) == 1 and "sim:h200-141gb" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:h200-141gb", "--limit", "100GiB")
    assert code == EXIT_OK and not [r for r in caplog.records if "--limit" in r.getMessage()]


def test_limit_warning_reaches_stderr(trace_file):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "gpumem", "replay", str(trace_file), "--limit", "200GiB"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stderr.startswith("WARNING gpumem: --limit 200GiB (200.00 GiB) is more than sim:h200-141gb has")


def test_unknown_format_message_names_the_option_once(capsys, tmp_path):
    odd = tmp_path / "odd.dat"
    odd.write_text("hello\n")
    code, out, err = run(capsys, "replay", str(odd))
    assert code == EXIT_USAGE
    assert "pass --format NAME to force one" in err and err.count("--format") == 1, err


def test_cli_names_with_and_without_the_aside():
    from gpumem.cli import _cli_names

    assert _cli_names("x; pass format= (the command line's --format) to force one") == \
        "x; pass --format NAME to force one"
    assert _cli_names("pass format= to force one") == "pass --format NAME to force one"
    assert _cli_names("pass device= (the command line's --device-index) to pick") == "pass --device-index N to pick"


def test_a_folder_given_as_the_trace(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path))
    assert code == EXIT_USAGE and out == ""
    assert err == (f"gpumem replay: {tmp_path} is a folder, not a trace file; give one trace file, or replay every "
                   f"trace in the folder with: python benchmarks/replay_bench.py --traces {tmp_path}\n")


@pytest.mark.parametrize("raised", ["format", "isadir"])
def test_a_folder_reported_by_the_readers(capsys, tmp_path, monkeypatch, raised):
    """The trace readers say "is a directory" themselves (TraceFormatError); the CLI gives the same advice."""
    import gpumem.cli
    import gpumem.trace
    from gpumem.errors import TraceFormatError

    def reader(path, *args, **kwargs):
        if raised == "format":
            raise TraceFormatError(str(path), "is a directory")
        raise IsADirectoryError(21, "Is a directory", str(path))

    monkeypatch.setattr(gpumem.trace, "load_trace", reader)
    monkeypatch.setattr(gpumem.cli, "_check_trace_path", lambda path: None)
    code, out, err = run(capsys, "replay", str(tmp_path / "t.gmt"))
    assert code == EXIT_USAGE and "is a folder, not a trace file" in err and "replay_bench.py --traces" in err


def test_a_fifo_given_as_the_trace_does_not_hang(capsys, tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out, err = run(capsys, "replay", str(fifo))
    assert code == EXIT_USAGE and "is a FIFO (named pipe), not a trace file" in err


def test_replay_summary_with_json(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--json", "--summary")
    assert code == EXIT_OK, err
    data = json.loads(out)
    code, text_out, err = run(capsys, "replay", str(trace_file), "--summary")
    assert isinstance(data["summary"], str) and data["summary"] and data["summary"] in text_out
    code, out, err = run(capsys, "replay", str(trace_file), "--json")
    assert "summary" not in json.loads(out)


def test_replay_oom_json(capsys, big_trace_file):
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb", "--json")
    assert code == EXIT_OOM
    data = json.loads(out)
    assert data["ooms"] == 1 and "out of memory" in data["oom"]
    assert data["completed_ops"] < data["n_ops"]
    assert data["oom_op"] == 1 and data["oom_injected"] is False and data["limit_bytes"] is None
    assert data["trace_peak_live_bytes"] == 3 * GiB
    assert data["oom_report"] == err.strip()  # the same report, once on stderr
    assert err.count("out of memory") == 1
    # the failed op (op 2, 0-based 1) is not completed: JSON and text agree, the time per op is over op 1 only
    assert data["completed_ops"] == data["oom_op"] == 1
    assert data["ns_per_op"] == pytest.approx(data["wall_s"] * 1e9 / 1)
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb")
    assert f"replayed       {data['completed_ops']:,} of 6 ops" in out


@pytest.mark.parametrize("limit, text", [
    ("0.001", "--limit allows 15.10 MiB"),
    (str(8 * MiB), "--limit allows 8.00 MiB"),
    ("8MiB", "--limit allows 8.00 MiB"),
    ("8388608B", "--limit allows 8.00 MiB"),
    ("0.1%", "--limit allows 15.10 MiB"),
    ("10MB", "--limit allows 9.54 MiB"),
])
def test_replay_limit(capsys, trace_file, limit, text):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb", "--limit", limit)
    assert code == EXIT_OOM, err
    assert text in err and "raise --limit" in err
    assert err.count("out of memory") == 1


@pytest.mark.parametrize("limit", ["90%", "0.9", "1.0", "100%", "8GiB", "512MB", "512MiB", "1.5GiB", str(GiB)])
def test_replay_limit_that_fits(capsys, trace_file, limit):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb", "--limit", limit, "--json")
    assert code == EXIT_OK, err
    data = json.loads(out)
    assert data["ooms"] == 0 and "oom_report" not in data
    assert data["limit_bytes"] == parse_limit(limit, 15_835_594_752)  # the total sim:t4-16gb reports


@pytest.mark.parametrize("limit, text", [
    ("2.5", "fraction of the device"),  # was 2 bytes
    ("1", "ambiguous"),  # 1 byte, or the whole device?
    ("inf", "not a finite number"),  # was a traceback
    ("nan", "not a finite number"),
    ("-5", "negative"),
    ("0", "must be positive"),
    ("8G", "write GB or GiB"),
    ("0.3KiB", "not a whole number of bytes"),
    ("1e9", "fraction of the device"),
    ("150%", "(0%, 100%]"),
    ("abc", "cannot read"),
    ("8 parsecs", "unknown unit"),
    ("5XB", "unknown unit"),
])
def test_replay_bad_limit(capsys, trace_file, limit, text):
    with pytest.raises(SystemExit) as info:
        main(["replay", str(trace_file), "--limit", limit])
    assert info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --limit" in err and text in err
    assert "Traceback" not in err


def test_replay_limit_below_one_byte(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb", "--limit", "1e-12")
    assert code == EXIT_USAGE and out == ""
    assert "--limit" in err and "less than one byte" in err


def test_replay_missing_file(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path / "nope.gmt"))
    assert code == EXIT_USAGE
    assert "no such trace file" in err and "nope.gmt" in err
    assert "Traceback" not in err


def test_replay_directory_is_not_a_trace(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path))
    assert code == EXIT_USAGE
    assert "is a folder" in err and "no such trace file" not in err


@pytest.mark.parametrize("name, content", [
    ("garbage.gmt", b"this is not a trace\n"),
    ("truncated.gmt", b'{"format": "gpumem-trace", "version": 1, "name": "x", "n_ops": 5}\na 0 100 0 0 1000\n'),
    ("badline.gmt", b'{"format": "gpumem-trace", "version": 1, "name": "x", "source": "gpumem", "n_ops": 1, '
                    b'"n_allocs": 1, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}\nq 0 1 2\n'),
    ("unknown.txt", b"hello"),
    ("empty.pickle", b""),
    ("broken.pickle.gz", gzip.compress(b"\x80\x04not really a pickle")),
    ("bad.csv", b"Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,zz,nan,0\n"),
])
def test_replay_malformed_trace(capsys, tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    code, out, err = run(capsys, "replay", str(path))
    assert code == EXIT_USAGE
    assert err.startswith("gpumem replay: ")
    assert name in err
    assert "Traceback" not in err and out == ""


def test_replay_bad_device(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:no-such-card")
    assert code == EXIT_USAGE
    assert "no-such-card" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["replay", "x.gmt", "--policy", "tcmalloc"], ["replay", "x.gmt", "--limit", "abc"],
                                  [], ["frobnicate"], ["replay"]])
def test_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["devices", "--help"], ["replay", "--help"]])
def test_help(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gpumem")
    if argv[0] == "replay":
        for option in ("--device", "--policy", "--limit", "--json", "--summary", "--export-snapshot"):
            assert option in out
        for policy in ("gpumem", "bestfit", "pytorch", "cupy"):
            assert policy in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("gpumem ")


def test_parser_lists_both_commands():
    text = build_parser().format_help()
    assert "devices" in text and "replay" in text


# -- issue 6: options, outputs, exit codes ---------------------------------------------------------------


def _snapshot(entries_per_device: list[list[tuple[str, int, int]]]) -> dict:
    return {"segments": [], "device_traces": [
        [{"action": a, "addr": addr, "size": n, "stream": 0, "time_us": t, "frames": []}
         for t, (a, addr, n) in enumerate(entries)]
        for entries in entries_per_device
    ]}


@pytest.fixture
def two_gpu_snapshot(tmp_path):
    """A PyTorch snapshot with traces on GPUs 0 and 1 (1 MiB live on GPU 0, 3 MiB at once on GPU 1)."""
    import pickle

    gpu0 = [("alloc", 0x1000, MiB), ("free_requested", 0x1000, MiB), ("free_completed", 0x1000, MiB)]
    gpu1 = [("alloc", 0x1000, MiB), ("alloc", 0x200000, 2 * MiB), ("free_completed", 0x1000, MiB),
            ("free_completed", 0x200000, 2 * MiB)]
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_snapshot([gpu0, gpu1]), protocol=4))
    return path


def test_replay_device_index(capsys, two_gpu_snapshot):
    code, out, err = run(capsys, "replay", str(two_gpu_snapshot))
    assert code == EXIT_USAGE
    assert "pass --device-index N" in err and "device=" not in err  # CLI users get the CLI's option name
    for index, peak in ((0, MiB), (1, 3 * MiB)):
        code, out, err = run(capsys, "replay", str(two_gpu_snapshot), "--device-index", str(index), "--json")
        assert code == EXIT_OK, err
        assert json.loads(out)["peak_live_bytes"] == peak
    code, out, err = run(capsys, "replay", str(two_gpu_snapshot), "--device-index", "2")
    assert code == EXIT_USAGE and "no device 2" in err


def test_replay_device_index_only_for_snapshots(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device-index", "0")
    assert code == EXIT_USAGE and "PyTorch snapshots only" in err and out == ""


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_replay_bad_device_index(capsys, trace_file, value):
    with pytest.raises(SystemExit) as info:
        main(["replay", str(trace_file), "--device-index", value])
    assert info.value.code == EXIT_USAGE and "--device-index" in capsys.readouterr().err


def test_replay_format(capsys, tmp_path, trace_file):
    # a native trace under a name that says nothing: detected by content, or read by the forced reader
    odd = tmp_path / "trace.data"
    odd.write_bytes(trace_file.read_bytes())
    code, out, err = run(capsys, "replay", str(odd), "--format", "gpumem", "--json")
    assert code == EXIT_OK, err
    assert json.loads(out)["n_ops"] == small_trace().n_ops
    # forcing the wrong reader reads it with that reader, which refuses it
    code, out, err = run(capsys, "replay", str(odd), "--format", "rmm-log")
    assert code == EXIT_USAGE and "cannot read the trace" in err and "trace.data" in err
    # an unrecognised file names the option, not a Python keyword
    unknown = tmp_path / "mystery.bin"
    unknown.write_bytes(b"\x01\x02 nothing known")
    code, out, err = run(capsys, "replay", str(unknown))
    assert code == EXIT_USAGE and "pass --format NAME" in err and "format=" not in err
    with pytest.raises(SystemExit) as info:
        main(["replay", str(odd), "--format", "tcmalloc"])
    assert info.value.code == EXIT_USAGE


def test_replay_empty_trace_is_an_error(capsys, tmp_path):
    path = save_trace(Trace.empty(), tmp_path / "empty.gmt")
    code, out, err = run(capsys, "replay", str(path))
    assert code == EXIT_USAGE and out == ""
    assert "no allocation" in err and "empty.gmt" in err


@pytest.mark.parametrize("where", ["missing-folder/out.pickle", "a-folder", "a-file/out.pickle"])
def test_export_path_checked_before_the_replay(capsys, trace_file, tmp_path, monkeypatch, where):
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("x")
    import gpumem.replay

    def no_replay(*args, **kwargs):
        raise AssertionError("the replay must not start")

    monkeypatch.setattr(gpumem.replay, "replay", no_replay)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(tmp_path / where))
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("gpumem replay: --export-snapshot: ") and "Traceback" not in err


def _no_replay(monkeypatch):
    import gpumem.replay

    def no_replay(*args, **kwargs):
        raise AssertionError("the replay must not start")

    monkeypatch.setattr(gpumem.replay, "replay", no_replay)


def test_export_name_too_long_is_a_usage_error(capsys, trace_file, tmp_path, monkeypatch):
    _no_replay(monkeypatch)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(tmp_path / ("a" * 300 + ".pickle")))
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("gpumem replay: --export-snapshot: cannot write ") and "too long" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and len(err) < 300


def test_export_empty_name_is_refused(capsys, trace_file, monkeypatch):
    _no_replay(monkeypatch)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", "")
    assert code == EXIT_USAGE and out == ""
    assert err == "gpumem replay: --export-snapshot: the file name is empty\n"


def test_export_name_ending_with_a_slash_is_refused(capsys, trace_file, tmp_path, monkeypatch):
    _no_replay(monkeypatch)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(tmp_path / "newdir") + "/")
    assert code == EXIT_USAGE and "names a folder" in err
    assert not (tmp_path / "newdir").exists()


@pytest.mark.parametrize("kind", ["dangling", "fifo", "device", "proc", "dirlink"])
def test_export_target_must_be_a_regular_file(capsys, trace_file, tmp_path, monkeypatch, kind):
    import os

    target = {"device": "/dev/null", "proc": "/proc/r.pickle"}.get(kind, str(tmp_path / "out.pickle"))
    if kind == "dangling":
        os.symlink(tmp_path / "missing" / "x", target)
    elif kind == "fifo":
        os.mkfifo(target)  # no reader: opening it for writing must not hang
    elif kind == "dirlink":
        os.symlink(tmp_path, target)
    _no_replay(monkeypatch)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", target)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("gpumem replay: --export-snapshot: ") and len(err.splitlines()) == 1
    expected = {"dangling": "link to a missing file", "fifo": "FIFO", "device": "character device",
                "proc": "cannot write", "dirlink": "is a folder"}[kind]
    assert expected in err


def test_export_file_created_up_front_is_removed_when_the_replay_fails(capsys, trace_file, tmp_path):
    out_path = tmp_path / "out.pickle"
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:a100-80gb?lost_at_s=0",
                         "--export-snapshot", str(out_path))
    assert code == 3 and not out_path.exists()
    bad = tmp_path / "bad.gmt"
    bad.write_text("nonsense")
    code, out, err = run(capsys, "replay", str(bad), "--export-snapshot", str(out_path))
    assert code == EXIT_USAGE and not out_path.exists()
    # a file that was there before is kept (with its content) when the replay fails
    out_path.write_bytes(b"old")
    code, out, err = run(capsys, "replay", str(bad), "--export-snapshot", str(out_path))
    assert code == EXIT_USAGE and out_path.read_bytes() == b"old"
    # and replaced when it succeeds
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(out_path))
    assert code == EXIT_OK and out_path.stat().st_size > 3


def test_export_failure_after_the_replay_keeps_the_results(capsys, trace_file, tmp_path, monkeypatch):
    import gpumem.trace

    def disk_full(history, path, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpumem.trace, "save_pytorch_snapshot", disk_full)
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(tmp_path / "out.pickle"))
    assert code == EXIT_USAGE
    assert "overhead" in out  # the results were printed first
    assert "cannot write" in err and "No space left on device" in err
    assert not (tmp_path / "out.pickle").exists()  # created by the up-front check, removed again


def test_closed_pipe_is_not_a_traceback(trace_file):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    for argv in (["devices", "--json"], ["replay", str(trace_file), "--json"], ["replay", str(trace_file)]):
        proc = subprocess.Popen([sys.executable, "-m", "gpumem", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        proc.stdout.close()  # the reader is gone before the command writes anything: `| head -c 0`
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert proc.wait(timeout=120) == 141, err
        assert err == "", err


@pytest.mark.parametrize("command", ["devices", "replay"])
def test_closed_stdout_is_not_a_traceback(trace_file, command):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    argv = ["devices"] if command == "devices" else ["replay", str(trace_file)]
    proc = subprocess.run([sys.executable, "-m", "gpumem", *argv], stderr=subprocess.PIPE, env=env, timeout=120,
                          preexec_fn=lambda: os.close(1))  # as `gpumem ... >&-`
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert err == f"gpumem {command}: standard output is closed: nothing to print the results to\n"


def test_stdout_none_in_process(capsys, trace_file, monkeypatch):
    monkeypatch.setattr("sys.stdout", None)
    assert main(["replay", str(trace_file)]) == 141


def test_ctrl_c_while_building_the_parser(capsys, monkeypatch):
    import gpumem.cli

    def interrupted():
        raise KeyboardInterrupt  # as a Ctrl-C during the imports that build_parser does

    monkeypatch.setattr(gpumem.cli, "build_parser", interrupted)
    code, out, err = run(capsys, "replay", "x")
    assert code == 130 and out == "" and err == "gpumem: interrupted\n"


@pytest.fixture
def python_sigint():
    """SIGINT handled as Python does by default, for the test's duration: a shell's background job (CI started
    with ``&``) inherits SIGINT ignored, and then neither Python nor :func:`main` raise KeyboardInterrupt."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_as_in_a_terminal() -> None:
    """For a child process: SIGINT back to its default disposition, so Python installs its own handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_surfacing_as_an_import_error(capsys, monkeypatch, python_sigint):
    """A SIGINT during a C extension's import can come out as ImportError (numpy's): still 130, one line."""
    import os
    import signal

    import gpumem.cli

    def interrupted_import():
        os.kill(os.getpid(), signal.SIGINT)  # the handler main() installed sets its flag, raises KeyboardInterrupt
        raise AssertionError("not reached")

    def build_parser():
        try:
            interrupted_import()
        except KeyboardInterrupt:
            raise ImportError("numpy: initialisation failed") from None

    monkeypatch.setattr(gpumem.cli, "build_parser", build_parser)
    code, out, err = run(capsys, "replay", "x")
    assert code == 130 and err == "gpumem: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

    def broken():
        raise ImportError("a real import error, no Ctrl-C")

    monkeypatch.setattr(gpumem.cli, "build_parser", broken)
    with pytest.raises(ImportError):
        main(["replay", "x"])


def test_ctrl_c_early_in_a_real_process():
    """SIGINT at several moments once main() runs (building the parser, importing the trace readers and
    the allocator, replaying): 130 and one line, never a traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    # the console script imports gpumem.cli, then calls main(): the signal comes once main() may run. No
    # handshake on stdin: under load, the child's wake-up from a read took longer than the shortest delay, and
    # the signal came before main() (a KeyboardInterrupt of the test's own code: rc -2)
    code = ("import sys\n"
            "from gpumem.cli import main\n"
            "print('ready', flush=True)\n"
            "sys.exit(main(sys.argv[1:]))\n")
    # a trace that takes seconds to read and replay, so that every signal comes while main() runs (one that
    # comes after main() returned meets Python's own handling, as in any program)
    long_trace = root / "data" / "traces" / "llama_generate.trace.pickle.gz"
    if not long_trace.is_file():
        pytest.skip("needs data/traces/llama_generate.trace.pickle.gz")
    for delay in (0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.15, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", code, "replay", str(long_trace)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                                preexec_fn=_sigint_as_in_a_terminal)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and len(err.splitlines()) == 1 and err.endswith("interrupted\n"), err


def test_exit_codes_for_device_errors(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb?lost_at_s=0")
    assert code == 3, err
    assert "the device was lost" in err and "Traceback" not in err
    assert "WARNING" not in err  # no log line per page that could not be given back to the lost device


def test_interrupt_is_quiet(capsys, trace_file, monkeypatch):
    import gpumem.replay

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpumem.replay, "replay", interrupted)
    code, out, err = run(capsys, "replay", str(trace_file))
    assert code == 130 and err == "gpumem replay: interrupted\n"


def test_exit_code_for_other_device_errors(capsys, monkeypatch):
    import argparse

    from gpumem.commands._common import run_command
    from gpumem.errors import CudaError, DeviceLostError, InvalidArgumentError

    cases = [(CudaError("cuMemUnmap", "CUDA_ERROR_UNKNOWN", "injected fault"), 4),
             (DeviceLostError("gone"), 3), (InvalidArgumentError("pass device= to choose"), 2)]
    for exc, code in cases:
        def fail(args, exc=exc):
            raise exc
        assert run_command(argparse.Namespace(func=fail, command="replay")) == code
        err = capsys.readouterr().err
        assert err.startswith("gpumem replay: ") and "device=" not in err


class _Stub:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _oom_result(exc, n_ops=100, op=41, peak=3 * GiB, device="sim:t4-16gb"):
    return _Stub(oom_error=exc, oom_op=op, completed_ops=op, n_ops=n_ops, trace_peak_live_bytes=peak,
                 device=device)


def test_oom_report_injected_fault():
    from gpumem import sim
    from gpumem.managers.forensics import replay_oom_report as oom_report
    from gpumem.errors import OutOfMemoryError

    dev = sim.SimDevice(sim.get_profile("t4-16gb"))
    exc = OutOfMemoryError(2 * MiB, 14 * GiB, 15 * GiB, device=dev.spec, allocated_nbytes=0, cached_nbytes=0,
                           injected=True)
    text = oom_report(_oom_result(exc), _Stub(uses_vmm=True), dev)
    dev.close()
    assert "an injected fault" in text and "nothing was out of memory" in text and "op 42 of 100" in text
    assert "needs" not in text and "try:" not in text  # no advice about a shortage that did not happen


@pytest.mark.parametrize("profile, advised", [("t4-16gb", True), ("jetson-nano-2gb", False)])
def test_oom_report_virtual_memory_advice_only_where_supported(profile, advised):
    from gpumem import sim
    from gpumem.managers.forensics import replay_oom_report as oom_report
    from gpumem.errors import OutOfMemoryError

    dev = sim.SimDevice(sim.get_profile(profile))
    info = dev.mem_info()
    exc = OutOfMemoryError(64 * MiB, 10 * MiB, info.total_nbytes, device=dev.spec, allocated_nbytes=100 * MiB,
                           cached_nbytes=300 * MiB)
    text = oom_report(_oom_result(exc, peak=GiB, device=dev.spec), _Stub(uses_vmm=False), dev)
    dev.close()
    assert ("--policy gpumem" in text) is advised
    assert "this trace needs 1.00 GiB" in text


def test_replay_with_injected_faults_says_so(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb?fail_rate=1&seed=1")
    assert code == EXIT_OOM
    assert err.count("out of memory") <= 1 and "inject" in err


def test_replay_trace_takes_a_path(trace_file):
    from pathlib import Path

    by_trace = replay_trace(load_trace(trace_file), "sim:t4-16gb", progress=False)
    for path in (trace_file, str(trace_file), Path(trace_file)):
        res = replay_trace(path, "sim:t4-16gb", progress=False)
        assert (res.n_ops, res.peak_live_bytes, res.peak_reserved_bytes) == (
            by_trace.n_ops, by_trace.peak_live_bytes, by_trace.peak_reserved_bytes)
    with pytest.raises(FileNotFoundError):
        replay_trace(trace_file.parent / "missing.gmt", "sim:t4-16gb", progress=False)
    with pytest.raises(ValueError):
        replay_trace(42, "sim:t4-16gb", progress=False)  # type: ignore[arg-type]


def test_text_output_explains_overhead_and_fragmentation(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file))
    assert code == EXIT_OK
    assert "peak reserved / peak live - 1" in out
    assert "external fragmentation" in out and "largest free cached block" in out


def test_help_documents_exit_codes_and_options(capsys):
    for argv in (["--help"], ["replay", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "exit status:" in out
        for code in ("0", "1", "2", "3", "4", "130", "141"):
            assert f"\n  {code} " in out
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = capsys.readouterr().out
    for text in ("--format", "--device-index", "8GiB", "90%", "peak reserved / peak live - 1",
                 "external fragmentation", "pytorch-snapshot", "rmm-log"):
        assert text in out


@pytest.mark.parametrize("probe", ["sim.calibrate", "hil.probes.inflight"])
def test_hil_probes_without_cupy_say_which_extra(capsys, monkeypatch, probe):
    import importlib
    import sys

    module = importlib.import_module(probe)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError, as without CuPy
    argv = [] if probe == "sim.calibrate" else ["--path", "release"]
    monkeypatch.setattr(sys, "argv", [probe, *argv])
    if probe == "sim.calibrate":
        with pytest.raises(SystemExit) as info:
            module.main()
        code = info.value.code
    else:
        code = module.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and 'pip install "gpumem[cuda13]"' in err
    assert err.startswith(f"python -m {probe}: needs CuPy")


def test_ctrl_c_while_the_handler_is_installed_is_quiet(capsys, monkeypatch):
    """A SIGINT that lands inside installing gpumem's own handler (seen once on a loaded CI box, as a
    traceback) ends as any other interruption: status 130 and one line."""
    from gpumem import cli

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._SigintFlag, "__init__", interrupted)
    code, out, err = run(capsys, "devices")
    assert code == 130 and err == "gpumem: interrupted\n"


def test_replay_oom_does_not_offer_the_device_that_just_failed(capsys, tmp_path):
    """The peak live bytes (1.76 GiB) fit the GTX 1050, but the bucket pool rounds 600 MiB up to 1 GiB and
    fails there: the report used to list sim:gtx-1050-2gb among the profiles 'with room'."""
    ops = [(0, i, 600 * MiB, 0, float(i), 0x1_0000_0000 * (i + 1)) for i in range(3)]
    ops += [(1, i, 600 * MiB, 0, 10.0 + i, 0x1_0000_0000 * (i + 1)) for i in range(3)]
    path = save_trace(Trace.from_ops("buckets", "gpumem", ops), tmp_path / "buckets.gmt")
    code, out, err = run(capsys, "replay", str(path), "--device", "sim:gtx-1050-2gb", "--policy", "bucket")
    assert code == EXIT_OOM, err
    assert "the peak live bytes fit sim:gtx-1050-2gb; under this policy the replay needed more" in err
    fits = err.split("have room for that peak: ")[1].split("(see")[0]
    assert "gtx-1050-2gb" not in fits and "jetson-nano-2gb" not in fits
    assert "--device sim:gtx-1050-2gb" not in err


def test_replay_oom_says_what_the_policy_needed_when_it_failed(capsys):
    """New user 10: README's gpt2-on-a-T4 example printed peak reserved 13.23 GiB, then "the 14.12 GiB this
    policy had reached when it failed": it never held 14.12 GiB; that is what it held plus the failed request."""
    trace = Path(__file__).resolve().parents[1] / "data" / "traces" / "gpt2_train.snapshot.pickle.gz"
    code, out, err = run(capsys, "replay", str(trace), "--device", "sim:t4-16gb", "--limit", "90%")
    assert code == EXIT_OOM, err
    flat = " ".join(err.split())
    assert "had reached" not in flat
    assert ("this policy needed when it failed (what it held, live and cached, plus the failed request)"
            in flat)


def test_sigint_ignored_by_the_caller_stays_ignored(capsys, trace_file):
    """Started with SIGINT ignored (``nohup``, a background job of a script), main() keeps it ignored, as Python
    does, instead of installing a handler that would make the job interruptible."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, out, err = run(capsys, "replay", str(trace_file))
        assert code == 0, err
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_replay_oom_under_a_limit_below_the_peak_says_no_allocator_could_fit(capsys, tmp_path):
    """Issue 20 item 5: with --limit below the trace's peak live bytes the report said 'the peak live bytes fit
    the device; under this policy the replay needed more', where no policy could fit."""
    ops = [(0, i, 600 * MiB, 0, float(i), 0x1_0000_0000 * (i + 1)) for i in range(3)]
    ops += [(1, i, 600 * MiB, 0, 10.0 + i, 0x1_0000_0000 * (i + 1)) for i in range(3)]
    path = save_trace(Trace.from_ops("three", "gpumem", ops), tmp_path / "three.gmt")
    code, out, err = run(capsys, "replay", str(path), "--device", "sim:a100-80gb", "--limit", "1GiB")
    assert code == EXIT_OOM, err
    assert "the peak live bytes fit" not in err
    assert "--limit allows 1.00 GiB, less than the 1.76 GiB this trace has live at its peak" in err
    assert "no allocator could replay it under this limit" in err
    # a limit above the peak that the policy still exceeds keeps the policy explanation, naming the limit
    code, out, err = run(capsys, "replay", str(path), "--device", "sim:a100-80gb", "--policy", "bucket",
                         "--limit", "1800MiB")
    assert code == EXIT_OOM, err
    assert "the peak live bytes fit sim:a100-80gb under --limit 1.76 GiB; under this policy the replay needed more" in err


def test_export_snapshot_says_it_runs_on_the_python_engine(capsys, tmp_path, trace_file):
    """Issue 20 item 7: --export-snapshot switched to the (slower) Python engine without a word."""
    from gpumem.native import load_engine

    if load_engine() is None:
        pytest.skip("the native engine is not built: nothing switches")
    code, out, err = run(capsys, "replay", str(trace_file), "--export-snapshot", str(tmp_path / "out.pickle"))
    assert code == 0, err
    assert "runs on it, several times slower per operation than the native engine" in err
    code, out, err = run(capsys, "replay", str(trace_file))
    assert "Python engine" not in err


def test_summary_names_the_growth_rule_once(capsys, trace_file):
    """Issue 20 item 7: the summary printed '1349 chunks (chunks)'."""
    code, out, err = run(capsys, "replay", str(trace_file), "--summary")
    assert code == 0, err
    assert "chunks (chunks)" not in out and "chunks (pages)" not in out
    assert "(growth=chunks)" in out or "(growth=pages)" in out or "virtual memory" not in out


@pytest.mark.parametrize("argv", [
    ["report", "T", "--out", "R", "--policy", "gpumem", "pytorch"],
    ["report", "T", "--out", "R", "--policy", "gpumem", "--policy", "pytorch"],
    ["sweep", "T", "--out", "R", "--device", "sim:t4-16gb", "--policy", "gpumem", "pytorch"],
    ["sweep", "T", "--out", "R", "--device", "sim:t4-16gb", "--policy", "gpumem", "--policy", "pytorch"],
])
def test_several_values_both_ways_in_every_command(argv):
    """Issue 20 item 3: `report --policy A B` was refused while `sweep` took it; `sweep --policy A --policy B`
    silently kept only B."""
    from gpumem.cli import build_parser

    args = build_parser().parse_args(argv)
    assert args.policy == ["gpumem", "pytorch"]


def test_a_single_value_option_given_twice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:   # argparse's usage error, as for any bad option
        main(["replay", "T", "--device", "sim:t4-16gb", "--device", "sim:a100-80gb"])
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--device given twice: it takes one value (the second was 'sim:a100-80gb')" in err


def test_sweep_limits_both_ways_and_none_by_default():
    from gpumem.cli import build_parser

    p = build_parser()
    base = ["sweep", "T", "--out", "R", "--device", "sim:t4-16gb", "--policy", "gpumem"]
    assert p.parse_args(base).limit is None
    assert p.parse_args(base + ["--limit", "8GiB", "--limit", "90%"]).limit == ["8GiB", "90%"]
    assert p.parse_args(base + ["--limit", "8GiB", "90%"]).limit == ["8GiB", "90%"]
