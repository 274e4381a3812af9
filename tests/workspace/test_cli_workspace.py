"""``gpumem workspace``: text, JSON, exit statuses."""

from __future__ import annotations

import json

import pytest

from gpumem.cli import EXIT_DEVICE_ERROR, EXIT_DEVICE_LOST, EXIT_OK, EXIT_OOM, EXIT_USAGE, main
from gpumem.workspace import calculate_gpu_workspace_size


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["workspace", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_documented_keys_and_matches_the_function(capsys):
    code, out, _ = _run(capsys, "--in-features", "4096", "--out-features", "11008", "--qtype", "tl2",
                        "--device", "sim:t4-16gb", "--json")
    assert code == EXIT_OK
    data = json.loads(out)
    expected = calculate_gpu_workspace_size(4096, 11008, "tl2", "sim:t4-16gb")
    for key in ("workspace_bytes", "batch_size", "available_bytes", "device"):
        assert data[key] == getattr(expected, key)
    assert data["qtype"] == "tl2" and data["gpu_class"] == "8-24 GB" and data["batch_size"] == 256


@pytest.mark.parametrize("qtype", ["i2s", "tl1", "tl2", "I2S"])
def test_text_output_for_each_qtype(capsys, qtype):
    code, out, _ = _run(capsys, "--in-features", "1024", "--out-features", "2048", "--qtype", qtype,
                        "--device", "sim:jetson-nano-2gb")
    assert code == EXIT_OK
    assert "batch       64" in out and "< 4 GB class" in out and "workspace" in out


def test_max_batch_size_option(capsys):
    code, out, _ = _run(capsys, "--in-features", "64", "--out-features", "64", "--qtype", "i2s",
                        "--device", "sim:h200-141gb", "--max-batch-size", "7", "--json")
    assert code == EXIT_OK and json.loads(out)["batch_size"] == 7


def test_too_little_memory_exits_1_naming_required_and_available(capsys):
    code, out, err = _run(capsys, "--in-features", "8", "--out-features", "1000000000", "--qtype", "i2s",
                          "--device", "sim:gtx-1050-2gb", "--json")
    assert code == EXIT_OOM
    data = json.loads(out)
    assert data["error"] == "insufficient_memory" and data["required_bytes"] == 4_000_000_000
    assert data["device"] == "sim:gtx-1050-2gb" and 0 < data["available_bytes"] < data["required_bytes"]
    assert "4000000000" in err and "sim:gtx-1050-2gb" in err


@pytest.mark.parametrize("argv", [
    ["--in-features", "0", "--out-features", "10", "--qtype", "i2s"],
    ["--in-features", "999999999999999999999999", "--out-features", "2", "--qtype", "tl2"],
    ["--in-features", "2", "--out-features", str(2**31 + 1), "--qtype", "tl2"],
    ["--in-features", "10", "--out-features", "x", "--qtype", "i2s"],
    ["--in-features", "10", "--out-features", "10", "--qtype", "q4"],
    ["--out-features", "10", "--qtype", "i2s"],
])
def test_bad_options_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["workspace", *argv])
    assert exc.value.code == EXIT_USAGE
    assert "usage" in capsys.readouterr().err


def test_bad_device_exits_2(capsys):
    code, _, err = _run(capsys, "--in-features", "10", "--out-features", "10", "--qtype", "i2s", "--device", "sim:nope")
    assert code == EXIT_USAGE and "--device sim:nope" in err


def test_help_explains_the_rule(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["workspace", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("< 4 GB: 64", ">= 24 GB: 512", "fp16 for i2s and tl1", "exit status"):
        assert text in out


def test_a_lost_device_exits_3_with_a_json_error(capsys):
    # found by review: a lost device exited 4 (the query error wrapping it) and printed nothing with --json
    code, out, err = _run(capsys, "--in-features", "4096", "--out-features", "11008", "--qtype", "i2s",
                          "--device", "sim:t4-16gb?lost_at_s=0", "--json")
    assert code == EXIT_DEVICE_LOST
    data = json.loads(out)
    assert data["error"] == "device_lost" and data["cause"] == "DeviceLostError"
    assert data["device"] == "sim:t4-16gb?lost_at_s=0" and "lost" in data["message"]
    assert "the device was lost" in err
    code, out, err = _run(capsys, "--in-features", "4096", "--out-features", "11008", "--qtype", "i2s",
                          "--device", "sim:t4-16gb?lost_at_s=0")
    assert code == EXIT_DEVICE_LOST and out == "" and "the device was lost" in err


def test_another_device_error_exits_4_with_a_json_error(capsys, monkeypatch):
    import gpumem.specs

    real_open = gpumem.specs.open_device

    def closed_device(spec):  # a device whose queries fail with something other than loss
        dev = real_open(spec)
        dev.close()
        return dev

    monkeypatch.setattr(gpumem.specs, "open_device", closed_device)
    code, out, err = _run(capsys, "--in-features", "4096", "--out-features", "11008", "--qtype", "i2s",
                          "--device", "sim:t4-16gb", "--json")
    assert code == EXIT_DEVICE_ERROR
    data = json.loads(out)
    assert data["error"] == "device_error" and data["cause"] == "DeviceClosedError"
    assert "device error" in err


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_exit_status_is_the_commands_own(capsys):
    # found by review: workspace --help (and gpumem --help) copied replay's exit-status words
    status = _help(capsys, "workspace").split("exit status:")[1]
    for word in ("trace", "replay", "--limit"):
        assert word not in status
    for code in ("0", "1", "2", "3", "4", "130", "141"):
        assert f"\n  {code} " in status
    assert "minimum workspace" in status and "lost" in status
    top = _help(capsys).split("exit status:")[1]
    assert "trace" not in top and "replay" not in top and "the device was lost" in top
    replay = _help(capsys, "replay").split("exit status:")[1]
    assert "the trace does not fit" in replay and "during the replay" in replay
