"""Review findings on device specs and the ``gpumem devices`` / ``info`` / ``replay`` commands: a repeated spec
option (1), an ambiguous profile prefix (2), ``cpu`` (3), the install hint without a GPU (4) and
``--limit -1GiB`` (8)."""

from __future__ import annotations

import pytest

from gpumem.cli import EXIT_OK, EXIT_USAGE, main
from gpumem.errors import DeviceNotFoundError, InvalidArgumentError
from gpumem.specs import open_device, parse_spec
from gpumem.trace import Trace, save_trace


@pytest.fixture
def trace_file(tmp_path):
    t = Trace.from_ops("tiny", "gpumem", [(0, 0, 1000, 0, 0.0, 0x1000), (1, 0, 1000, 0, 1.0, 0x1000)])
    return str(save_trace(t, tmp_path / "tiny.gmt"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- 1: a repeated option ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, name", [
    ("sim:h200-141gb?pressure=spikes&pressure=step", "pressure ('spikes', 'step')"),
    ("sim:h200?seed=3&seed=4", "seed ('3', '4')"),
    ("sim:t4-16gb?fail.mem_unmap=0.1&seed=1&fail.mem_unmap=0.2", "fail.mem_unmap ('0.1', '0.2')"),
])
def test_repeated_spec_option_is_refused(spec, name):
    with pytest.raises(InvalidArgumentError, match="option\\(s\\) given more than once") as info:
        parse_spec(spec)
    assert name in str(info.value)


def test_distinct_options_still_parse():
    assert parse_spec("sim:h200?pressure=spikes&seed=7").options == {"pressure": "spikes", "seed": "7"}


def test_replay_refuses_a_repeated_option(capsys, trace_file):
    code, _, err = run(capsys, "replay", trace_file, "--device", "sim:h200-141gb?pressure=spikes&pressure=step")
    assert code == EXIT_USAGE and "given more than once: pressure ('spikes', 'step')" in err


# -- 2: an ambiguous profile prefix ----------------------------------------------------------------------------


def test_ambiguous_profile_prefix_lists_the_candidates():
    with pytest.raises(DeviceNotFoundError, match="'a100' is ambiguous: it could be a100-40gb, a100-80gb"):
        open_device("sim:a100")


def test_unique_prefix_and_unknown_profile_unchanged():
    dev = open_device("sim:h200")
    assert dev.spec == "sim:h200-141gb"
    dev.close()
    with pytest.raises(DeviceNotFoundError, match="unknown simulated profile 'b200'"):
        open_device("sim:b200")


def test_replay_names_the_candidates(capsys, trace_file):
    code, _, err = run(capsys, "replay", trace_file, "--device", "sim:a100")
    assert code == EXIT_USAGE and "ambiguous: it could be a100-40gb, a100-80gb" in err


# -- 3: cpu ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["cpu", "CPU", "cpu:0"])
def test_cpu_spec_says_it_is_the_cpu_fallback(spec):
    with pytest.raises(InvalidArgumentError, match="'cpu' is the CPU backend that `gpumem info` lists "
                                                   r"\(the CPU fallback"):
        parse_spec(spec)


def test_replay_on_cpu_explains(capsys, trace_file):
    code, _, err = run(capsys, "replay", trace_file, "--device", "cpu")
    assert code == EXIT_USAGE
    assert "CPU fallback" in err and "no CPU device to open or replay on" in err
    assert "must look like" not in err


# -- 4: the install hint without a GPU ---------------------------------------------------------------------------


def _no_pynvml(monkeypatch):
    """Discovery as on a machine without nvidia-ml-py, whatever this machine has."""
    from gpumem import discovery
    from gpumem.cuda import backend

    monkeypatch.setattr(backend, "import_nvml", lambda: (None, f"nvidia-ml-py (pynvml) is not installed (no); "
                                                               f"{backend.INSTALL_HINT}"))
    monkeypatch.setattr("gpumem.cuda.nvml.list_cuda_devices", lambda *a, **k: [])
    return discovery


@pytest.mark.parametrize("command", [["devices"], ["info"], ["info", "--json"]])
def test_no_install_hint_without_a_gpu(capsys, monkeypatch, command):
    _no_pynvml(monkeypatch)
    monkeypatch.setattr("gpumem.commands.devices.nvidia_gpu_present", lambda: False)
    code, out, _ = run(capsys, *command)
    assert code == EXIT_OK
    assert "pip install" not in out and "no NVIDIA GPU found on this machine" in out


@pytest.mark.parametrize("command", [["devices"], ["info"]])
def test_install_hint_where_a_gpu_is_present(capsys, monkeypatch, command):
    _no_pynvml(monkeypatch)
    monkeypatch.setattr("gpumem.commands.devices.nvidia_gpu_present", lambda: True)
    code, out, _ = run(capsys, *command)
    assert code == EXIT_OK and 'pip install "gpumem[cuda12]"' in out and "no NVIDIA GPU found" not in out


def test_nvidia_gpu_present_probes(tmp_path):
    from gpumem.commands.devices import nvidia_gpu_present

    def no_lib(name):
        raise OSError(name)

    assert not nvidia_gpu_present(dev_dir=str(tmp_path), which=lambda _: None, load=no_lib)
    assert nvidia_gpu_present(dev_dir=str(tmp_path), which=lambda _: "/usr/bin/nvidia-smi", load=no_lib)
    assert nvidia_gpu_present(dev_dir=str(tmp_path), which=lambda _: None, load=lambda name: object())
    (tmp_path / "nvidiactl").touch()   # the control node alone is no GPU
    assert not nvidia_gpu_present(dev_dir=str(tmp_path), which=lambda _: None, load=no_lib)
    (tmp_path / "nvidia0").touch()
    assert nvidia_gpu_present(dev_dir=str(tmp_path), which=lambda _: None, load=no_lib)


# -- 8: --limit -1GiB --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--limit", "-1GiB"], ["--limit=-1GiB"]])
def test_negative_limit_gets_the_value_message_both_ways(capsys, trace_file, argv):
    with pytest.raises(SystemExit) as info:
        main(["replay", trace_file, "--device", "sim:t4-16gb", *argv])
    err = capsys.readouterr().err
    assert info.value.code == EXIT_USAGE
    assert "argument --limit: limit: '-1GiB' is negative" in err and "expected one argument" not in err


@pytest.mark.parametrize("value", ["-50%", "-0.5", "-.5"])
def test_other_negative_limits_reach_the_check(capsys, trace_file, value):
    with pytest.raises(SystemExit):
        main(["replay", trace_file, "--device", "sim:t4-16gb", "--limit", value])
    err = capsys.readouterr().err
    assert "argument --limit:" in err and "expected one argument" not in err


def test_an_option_after_limit_is_still_an_option(capsys, trace_file):
    with pytest.raises(SystemExit):
        main(["replay", trace_file, "--limit", "--json"])
    assert "argument --limit: expected one argument" in capsys.readouterr().err


def test_get_profile_names_an_ambiguous_prefix_for_every_caller() -> None:
    """The ambiguity is in gpumem.sim.get_profile itself, so a caller other than a device spec (a custom
    profile's base, a backend preference) hears it too."""
    from gpumem.errors import DeviceNotFoundError
    from gpumem.sim import custom_profile, get_profile

    with pytest.raises(DeviceNotFoundError, match=r"'a100' is ambiguous: it could be a100-40gb, a100-80gb"):
        get_profile("a100")
    with pytest.raises(DeviceNotFoundError, match="ambiguous"):
        custom_profile("mine", 2**30, base="a100")
    assert get_profile("h200").name == "h200-141gb"
