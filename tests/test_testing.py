"""The gpumem_hil pytest plugin, run in child pytest processes on a throw-away test file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpumem import testing as plugin

REPO = Path(__file__).resolve().parents[1]

TESTS = textwrap.dedent('''
    import pytest

    def test_opens(device, device_spec):
        assert device.spec.startswith(device_spec.split("?")[0])

    @pytest.mark.requires_vmm
    def test_vmm(device):
        assert device.vmm_supported

    @pytest.mark.sim_only
    def test_sim(device):
        pass

    @pytest.mark.cuda
    def test_cuda(device):
        pass

    def test_leaks(device):
        device.malloc(4096)

    def test_fails_and_leaks(device):
        device.malloc(4096)
        assert False, "on purpose"

    @pytest.mark.parametrize("device_spec", ["sim:l4-24gb"])
    def test_own_device(device):
        assert device.spec == "sim:l4-24gb"

    def test_no_device():
        pass
''')


OTHER_PROJECT_TESTS = textwrap.dedent('''
    import pytest

    def test_uses_device(device):
        pass

    @pytest.mark.parametrize("device_spec", ["mine"])
    def test_own_param(device_spec):
        assert device_spec == "mine"

    def test_plain():
        pass
''')


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None, opt_in: bool = True,
         autoload: bool = False, tests: str = TESTS) -> subprocess.CompletedProcess:
    """pytest in a child process on a throw-away project in ``tmp_path`` that opts in to the plugin (its
    pytest.ini sets ``gpumem_hil = true``) or not; the plugin comes through ``-p`` or, with ``autoload``,
    through its installed entry point, as in any project of a machine where gpumem is installed."""
    (tmp_path / "test_hil_sample.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text("[pytest]\n" + ("gpumem_hil = true\n" if opt_in else ""))
    full_env = {k: v for k, v in os.environ.items() if k not in (plugin.ENV_VAR, "PYTEST_ADDOPTS")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    load = []
    if autoload:
        full_env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    else:
        full_env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # so -p loads the plugin whether gpumem is installed or not
        load = ["-p", "gpumem.testing"]
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", *load, "-p", "no:cacheprovider", "-q", "-rA",
         "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), str(tmp_path), *args],
        capture_output=True, text=True, env=full_env, cwd=tmp_path, timeout=120,
    )


def _entry_point_installed() -> bool:
    from importlib import metadata

    return any(ep.value == "gpumem.testing" for ep in metadata.entry_points(group="pytest11"))


@pytest.mark.parametrize("autoload", [False, True])
def test_projects_that_do_not_opt_in_are_untouched(tmp_path, autoload):
    if autoload and not _entry_point_installed():
        pytest.skip("gpumem is not installed (pip install -e .): no pytest11 entry point to autoload")
    res = _run(tmp_path, "-v", opt_in=False, autoload=autoload, env={plugin.ENV_VAR: "sim:t4-16gb"},
               tests=OTHER_PROJECT_TESTS)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "gpumem devices" not in out  # no report header
    assert "fixture 'device' not found" in out  # no fixtures
    assert "PASSED test_hil_sample.py::test_own_param[mine]" in out  # no parametrisation over devices
    assert "PASSED test_hil_sample.py::test_plain" in out and "2 passed, 1 error" in out
    res = _run(tmp_path, "--markers", opt_in=False, autoload=autoload, tests=OTHER_PROJECT_TESTS)
    assert "@pytest.mark.requires_vmm" not in res.stdout and "@pytest.mark.sim_only" not in res.stdout
    res = _run(tmp_path, "--fixtures", opt_in=False, autoload=autoload, tests=OTHER_PROJECT_TESTS)
    assert "gpumem_device_specs" not in res.stdout and "\ndevice " not in res.stdout
    res = _run(tmp_path, "--help", opt_in=False, autoload=autoload, tests=OTHER_PROJECT_TESTS)
    assert "--gpumem-device=SPEC" in res.stdout and "gpumem_hil" in res.stdout  # the way to opt in is listed


@pytest.mark.parametrize("how", [["--gpumem-device", "sim:t4-16gb"], ["-o", "gpumem_hil=true"]])
def test_opting_in_from_the_command_line(tmp_path, how):
    res = _run(tmp_path, "-v", "-k", "opens", *how, opt_in=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpumem devices (" in res.stdout and "test_opens[sim:t4-16gb]" in res.stdout


def test_default_devices_markers_leaks_and_record(tmp_path):
    record_dir = tmp_path / "records"
    res = _run(tmp_path, "--gpumem-record", str(record_dir))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    specs = plugin.DEFAULT_DEVICE_SPECS
    for spec in specs:
        assert f"PASSED test_hil_sample.py::test_opens[{spec}]" in out, out
        assert f"cuda: {spec} is not a real device" in out
        assert f"ERROR test_hil_sample.py::test_leaks[{spec}]" in out
        assert f"ERROR test_hil_sample.py::test_fails_and_leaks[{spec}]" not in out  # no leak error on failure
    assert "requires_vmm: sim:jetson-nano-2gb does not support VMM" in out
    assert "the test left 1 live allocation" in out

    [json_path] = record_dir.glob("contract-*.json")
    [md_path] = record_dir.glob("contract-*.md")
    assert json_path.stem == md_path.stem
    assert json_path.name.startswith("contract-sim-nvidia-tegra-x1-jetson-nano-2gb-and-3-more-20")
    rec = json.loads(json_path.read_text())
    n = len(specs)
    # as in pytest's own summary, a test whose call passed and whose teardown failed counts in both
    assert rec["counts"]["passed"] == n * 4 - 1 + 2  # opens, sim, leaks, vmm (not jetson); own device, no device
    assert rec["counts"]["failed"] == n
    assert rec["counts"]["errors"] == n
    assert rec["counts"]["skipped"] == n + 1  # cuda everywhere, vmm on the jetson
    assert [d["spec"] for d in rec["devices"]] == list(specs)
    assert rec["devices"][-1]["name"] == "NVIDIA H200"
    assert rec["devices"][-1]["properties"]["total_nbytes"] == 150_109_880_320
    assert rec["devices"][0]["counts"] == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1}
    assert len(rec["failed"]) == n and all("test_fails_and_leaks" in t for t in rec["failed"])
    assert len(rec["errors"]) == n and all("test_leaks" in t for t in rec["errors"])
    assert rec["date"].endswith("+00:00") and rec["host"] and rec["versions"]["gpumem"]
    assert rec["exit_status"] == 1
    md = md_path.read_text()
    assert "NVIDIA H200" in md and "test_fails_and_leaks" in md and "| `sim:t4-16gb` |" in md
    assert "gpumem: recorded this run in" in out

    again = _run(tmp_path, "--gpumem-record", str(record_dir))  # a second run never overwrites the first
    assert again.returncode == 1
    assert len(list(record_dir.glob("contract-*.json"))) == 2


def test_choosing_devices(tmp_path):
    res = _run(tmp_path, "--gpumem-device", "sim:t4-16gb, sim:a100-80gb", "--gpumem-device", "sim:t4-16gb",
               "-k", "opens")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 passed" in res.stdout and "test_opens[sim:t4-16gb]" in res.stdout

    res = _run(tmp_path, "-k", "opens", "-v", env={plugin.ENV_VAR: "sim:h100-80gb?seed=3"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpumem devices (GPUMEM_DEVICE): sim:h100-80gb?seed=3" in res.stdout
    assert "1 passed" in res.stdout and "test_opens[sim:h100-80gb?seed=3]" in res.stdout

    res = _run(tmp_path, "--gpumem-device", "sim:all", "-k", "opens")
    assert res.returncode == 0 and f"{len(__import__('gpumem.sim', fromlist=['x']).profile_names())} passed" in res.stdout


@pytest.mark.parametrize("spec", ["sim:no-such-card", "gpu:0", "cuda:zero", "sim:t4-16gb?bogus=1"])
def test_bad_device_is_a_usage_error(tmp_path, spec):
    res = _run(tmp_path, "--gpumem-device", spec)
    assert res.returncode == 4, res.stdout + res.stderr  # pytest's usage error
    assert "bad device spec" in res.stderr


@pytest.mark.parametrize("where", ["a-file", "a-file/below", ""])
def test_a_record_dir_that_cannot_be_one_is_a_usage_error_before_the_tests_run(tmp_path, where):
    """Review rv21a: ``--gpumem-record`` naming a file (or a path under one) ran every test, then failed
    at the end of the session with FileExistsError and no record (a whole HIL run lost); an empty value
    recorded nothing, silently. Both are refused at once, before any test runs."""
    (tmp_path / "a-file").write_text("not a directory\n")
    res = _run(tmp_path, "-k", "opens", "--gpumem-record", str(tmp_path / where) if where else "")
    assert res.returncode == 4, res.stdout + res.stderr  # pytest's usage error
    assert "--gpumem-record" in res.stderr and "passed" not in res.stdout
    assert (tmp_path / "a-file").read_text() == "not a directory\n"


def test_help_texts(tmp_path):
    res = _run(tmp_path, "--help")
    assert res.returncode == 0
    assert "--gpumem-device=SPEC" in res.stdout and "--gpumem-record=DIR" in res.stdout
    assert "GPUMEM_DEVICE" in res.stdout and "sim:h200-141gb" in res.stdout
    res = _run(tmp_path, "--markers")
    for marker in ("requires_vmm", "sim_only", "cuda"):
        assert f"@pytest.mark.{marker}:" in res.stdout


def test_split_specs_and_record_stem():
    assert plugin.split_specs(["a:1,b:2", " a:1 ", "", "c:3"]) == ["a:1", "b:2", "c:3"]
    rec = {"date": "2026-11-20T10:00:00+00:00",
           "devices": [{"spec": "cuda:0", "kind": "cuda", "name": "NVIDIA H200"}]}
    assert plugin.record_stem(rec) == "contract-nvidia-h200-2026-11-20"


def test_git_commit_names_a_modified_tree_and_takes_the_runners_word(tmp_path, monkeypatch):
    """A record must not claim a clean commit for a tree that differs from it (a copy sent to a GPU runner
    carried a stale ``.git``, and its records named a commit hours old); ``GPUMEM_GIT_COMMIT`` overrides."""
    import subprocess

    from gpumem.testing import GIT_COMMIT_ENV, _git_commit

    monkeypatch.delenv(GIT_COMMIT_ENV, raising=False)
    assert _git_commit(tmp_path) is None  # not a repository
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": __import__("os").environ["PATH"]}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True, env=env)
    (tmp_path / "f.txt").write_text("one\n")
    subprocess.run(["git", "add", "f.txt"], cwd=tmp_path, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "one"], cwd=tmp_path, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert _git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("two\n")
    assert _git_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv(GIT_COMMIT_ENV, "abc123")
    assert _git_commit(tmp_path) == "abc123"
