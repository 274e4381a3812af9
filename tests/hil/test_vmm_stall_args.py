"""The VMM stall probe and the training probe refuse bad arguments before touching a GPU (no GPU here)."""

from __future__ import annotations

import pytest

from hil.probes import train, vmm_stall


@pytest.mark.parametrize("argv, why", [
    (["--queues", "one,wide"], "unknown queue or call: wide"),
    (["--calls", "unmap_touched,mmap"], "unknown queue or call: mmap"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--spin-ms", "2"], "--spin-ms > 2.5"),
    (["--held-mappings", "-1"], "--held-mappings and --interleave must be >= 0"),
    (["--interleave", "10", "--interleave-every", "0"], "--interleave-every >= 1"),
])
def test_vmm_stall_refuses_bad_arguments(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        vmm_stall.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m hil.probes.vmm_stall")
    assert why in err


def test_vmm_stall_without_cupy_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    real_import = builtins.__import__

    def no_cupy(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    assert vmm_stall.main(["--repeats", "1"]) == 2
    assert "needs CuPy and cuda-bindings" in capsys.readouterr().err


def test_vmm_stall_table_has_a_row_per_summary() -> None:
    timing = vmm_stall.CallTiming("map", "one", idle_us=[9.0, 11.0, 10.0], busy_us=[18.0, 20.0, 300.0],
                                  returned_before_end=[True, True, False], queued_left_us=[17800.0] * 3)
    row = timing.summary()
    assert (row["idle_median_us"], row["busy_median_us"], row["busy_max_us"], row["returned_before_end"]) == \
        (10.0, 20.0, 300.0, 2)
    text = vmm_stall.table([row])
    assert text.splitlines()[2] == "| map | one | 10.0 | 20.0 | 300.0 | 17800.0 | 2/3 |"


@pytest.mark.parametrize("spin", ["-1", "10000", "nan"])
def test_train_refuses_a_bad_cpu_spin(spin: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.main(["--cpu-spin-ms", spin])
    assert exc.value.code == 2
    assert "--cpu-spin-ms must be in [0, 10000)" in capsys.readouterr().err
