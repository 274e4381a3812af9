"""``gpumem info [--json]``: the backend summary on the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpumem import sim
from gpumem.cli import EXIT_OK, EXIT_USAGE, main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_text(capsys):
    code, out, err = run(capsys, "info")
    assert code == EXIT_OK and err == ""
    assert out.startswith("cuda: ")
    assert "sim: available (memory only, no compute" in out and "cpu: available" in out
    for profile in sim.BUILTIN_PROFILES:
        assert profile.spec in out
    assert "best available: " in out
    if "cuda: unavailable" in out:
        line = out.splitlines()[0]
        assert len(line) > len("cuda: unavailable: ")  # it says why


def test_info_json(capsys):
    code, out, _ = run(capsys, "info", "--json")
    assert code == EXIT_OK
    data = json.loads(out)
    assert [b["backend"] for b in data["backends"]] == ["cuda", "sim", "cpu"]
    cuda, simb, cpu = data["backends"]
    assert cuda["available"] or cuda["reason"]
    assert simb["available"] and simb["real_compute"] is False and len(simb["devices"]) == len(sim.BUILTIN_PROFILES)
    h200 = next(d for d in simb["devices"] if d["spec"] == "sim:h200-141gb")
    assert h200["compute_capability"] == [9, 0] and h200["unified_memory"] is False
    assert 0 < h200["free_bytes"] < h200["total_bytes"]
    assert cpu["devices"][0]["spec"] == "cpu" and cpu["devices"][0]["compute_capability"] is None
    assert data["best_available"] in ("cuda", "cpu")
    assert data["best_available"] == ("cuda" if cuda["available"] else "cpu")


def test_info_help_and_bad_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["info", "--bogus"])
    assert info.value.code == EXIT_USAGE
    _, err = capsys.readouterr()
    assert "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit) as info:
        main(["info", "--help"])
    assert info.value.code == 0
    out, _ = capsys.readouterr()
    assert "--json" in out and "simulator is memory only" in " ".join(out.split())


def test_info_is_listed_in_gpumem_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out, _ = capsys.readouterr()
    assert "info" in out


def test_info_as_a_process():
    proc = subprocess.run([sys.executable, "-m", "gpumem", "info", "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backends"][1]["backend"] == "sim"


def test_devices_without_a_driver_says_the_driver_is_missing_not_to_install_the_extra(monkeypatch, capsys):
    """Issue 20 item 7: with nvidia-ml-py installed but no driver, `gpumem devices` told the user to install the
    CUDA extra that was installed; it says what discovery found instead."""
    import gpumem.cuda.backend as backend
    from gpumem import cli
    from tests.managers.test_discovery import DriverNvml

    monkeypatch.setattr(backend, "import_nvml", lambda: (DriverNvml(init_error=12), None))
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "(no CUDA device listed: no NVIDIA driver (libnvidia-ml not found))" in out
    assert "gpumem[cuda12]" not in out
