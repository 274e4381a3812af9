"""The ``gpumem`` command: ``devices`` and ``replay``, exit codes and error messages."""

from __future__ import annotations

import gzip
import json

import pytest

from gpumem.cli import EXIT_OOM, EXIT_OK, EXIT_USAGE, build_parser, main
from gpumem.replay import replay_trace
from gpumem.trace import Trace, load_trace, save_trace
from gpumem.units import GiB, KiB, MiB

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
    assert "ooms        0" in out
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


def test_replay_oom(capsys, big_trace_file):
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb")
    assert code == EXIT_OOM
    assert "ooms        1" in out
    assert "does not fit sim:gtx-1050-2gb" in err
    assert "out of memory" in err and "(1073741824 bytes)" in err and "free of" in err and "Try:" in err
    assert "Traceback" not in err and "Traceback" not in out


def test_replay_oom_json(capsys, big_trace_file):
    code, out, err = run(capsys, "replay", str(big_trace_file), "--device", "sim:gtx-1050-2gb", "--json")
    assert code == EXIT_OOM
    data = json.loads(out)
    assert data["ooms"] == 1 and "out of memory" in data["oom"]
    assert data["completed_ops"] < data["n_ops"]
    assert "out of memory" in err


@pytest.mark.parametrize("limit, text", [("0.001", "its limit is 15.10 MiB"), (str(8 * MiB), "its limit is 8.00 MiB")])
def test_replay_limit(capsys, trace_file, limit, text):
    code, out, err = run(capsys, "replay", str(trace_file), "--device", "sim:t4-16gb", "--limit", limit)
    assert code == EXIT_OOM
    assert text in err and "raise `limit`" in err


def test_replay_missing_file(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path / "nope.gmt"))
    assert code == EXIT_USAGE
    assert "no such trace file" in err and "nope.gmt" in err
    assert "Traceback" not in err


def test_replay_directory_is_not_a_trace(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path))
    assert code == EXIT_USAGE
    assert "no such trace file" in err


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


def test_replay_bad_limit(capsys, trace_file):
    code, out, err = run(capsys, "replay", str(trace_file), "--limit", "-5")
    assert code == EXIT_USAGE
    assert "limit" in err


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
