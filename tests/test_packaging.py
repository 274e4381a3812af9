"""What ``pip install .`` puts on a machine: only the ``gpumem`` import name, the ``gpumem`` command and
the pytest plugin's entry point (which acts only in projects that opt in: tests/test_testing.py)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]


def find_packages(where: Path, include: list[str], exclude: list[str]) -> list[str]:
    """What setuptools' ``packages.find`` selects (setuptools itself is not installed in a fresh venv):
    folders with an ``__init__.py`` under importable parents, as dotted names, filtered by the patterns."""
    names = []

    def walk(folder: Path, prefix: str) -> None:
        for child in sorted(folder.iterdir()):
            if child.is_dir() and (child / "__init__.py").is_file():
                name = prefix + child.name
                if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
                        fnmatch.fnmatchcase(name, p) for p in exclude):
                    names.append(name)
                walk(child, name + ".")

    walk(where, "")
    return names


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_only_gpumem_is_installed():
    find = pyproject()["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(REPO, find["include"], find.get("exclude", []))
    assert "gpumem" in packages and "gpumem.sim" in packages
    assert {p.split(".")[0] for p in packages} == {"gpumem"}  # no generic top-level names such as sim or hil
    # the checkout's tooling at the top is a package each (``python -m hil run``, ``python -m sim.calibrate``)
    # and stays out of the wheel
    assert (REPO / "hil" / "__init__.py").is_file() and (REPO / "sim" / "__init__.py").is_file()
    assert not any(p.split(".")[0] in ("hil", "sim") for p in packages)


def test_entry_points():
    project = pyproject()["project"]
    assert project["scripts"] == {"gpumem": "gpumem.cli:main"}
    assert project["entry-points"]["pytest11"] == {"gpumem_hil": "gpumem.testing"}


def test_this_project_opts_in_to_its_plugin():
    assert pyproject()["tool"]["pytest"]["ini_options"]["gpumem_hil"] is True
