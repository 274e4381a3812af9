"""No import cycle between the library's modules (issue 21).

Every import counts: at module level, inside functions, under ``if TYPE_CHECKING`` and through
``importlib.import_module`` with a literal name (an f-string counts as importing every module its
constant prefix names, as ``cli.py``'s loop over the commands). A cycle is broken by moving what both
modules need to one that both can import, never by moving an import into a function, so the check
reads the whole source of each module. Importing a module runs the ``__init__`` of every package above
it first, so each of those counts too, except the importing module's own packages (being imported
already: a package importing its own submodule is no cycle).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gpumem"


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> source file of every module of the package under ``root``."""
    mods: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _targets(module: str, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    """The package's modules that ``node`` (an import, or a call of ``import_module``) makes ``module`` load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module if mods[module].name == "__init__.py" else module.rpartition(".")[0]
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        return [m for m in ([base] if len(subs) < len(node.names) else []) + subs if m in mods]
    if (isinstance(node, ast.Call) and node.args
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
        name = node.args[0]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            text, whole = name.value, True
        elif isinstance(name, ast.JoinedStr):  # f".commands.{name}": every module the constant prefix starts
            text = "".join(v.value for v in itertools.takewhile(lambda v: isinstance(v, ast.Constant), name.values))
            whole = False
        else:
            return []
        if text.startswith("."):  # relative to the package given as the second argument (``__package__``)
            package = module if mods[module].name == "__init__.py" else module.rpartition(".")[0]
            text = package + text
        return [m for m in mods if m == text or (not whole and m.startswith(text) and text.endswith("."))]
    return []


def import_graph(root: Path) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """``{module: {imported module: first line}}`` over every import of each module of the package."""
    mods = _modules(root)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        own = _packages(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for target in _targets(module, node, mods):
                for loaded in [*_packages(target), target]:
                    if loaded != module and loaded in mods and loaded not in own:
                        graph[module].setdefault(loaded, node.lineno)
    return graph, mods


def _packages(module: str) -> list[str]:
    """The packages above ``module``, outermost first (whose ``__init__`` runs before it)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_library_modules() -> None:
    graph, mods = import_graph(ROOT)
    found = cycles(graph)
    lines = []
    for component in found:
        members = set(component)
        edges = [f"{mods[a].relative_to(ROOT)}:{line} imports {b}"
                 for a in component for b, line in sorted(graph[a].items()) if b in members]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not found, "import cycles between gpumem modules:\n" + "\n".join(lines)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("a_text", [
    "from .b import x\n",                                                  # module level
    "def f():\n    from .b import x\n",                                    # inside a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpumem.b import x\n",
    "import importlib\nB = importlib.import_module('gpumem.b')\n",
    "import importlib\nfor n in ('b',):\n    importlib.import_module(f'.{n}', __package__)\n",
])
def test_the_check_sees_every_kind_of_import(tmp_path: Path, a_text: str) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "a.py": a_text, "b.py": "def g():\n    from . import a\n"})
    assert cycles(import_graph(root)[0]) == [["gpumem.a", "gpumem.b"]]


def test_a_longer_cycle_is_one_component_and_a_chain_is_none(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .sub import c\n",
                            "sub/__init__.py": "", "sub/c.py": "from ..a import thing\n", "d.py": "from . import a\n"})
    assert cycles(import_graph(root)[0]) == [["gpumem.a", "gpumem.b", "gpumem.sub.c"]]
    (root / PACKAGE / "sub" / "c.py").write_text("import os\n", encoding="utf-8")
    assert cycles(import_graph(root)[0]) == []


def test_a_package_importing_its_own_submodule_is_no_cycle(tmp_path: Path) -> None:
    """``from . import a`` in the package names the submodule, not the package's ``__init__``."""
    root = _tree(tmp_path, {"__init__.py": "from . import a\n", "a.py": "from gpumem import b\n", "b.py": ""})
    assert cycles(import_graph(root)[0]) == []


@pytest.mark.parametrize("a_text", ["def f():\n    from .pkg.c import x\n", "import gpumem.pkg.c\n",
                                    "from gpumem.pkg import c\n"])
def test_importing_a_submodule_counts_its_packages_init(tmp_path: Path, a_text: str) -> None:
    """Review rv21a: ``from .pkg.c import x`` runs ``pkg/__init__.py`` first, and that may import back (it
    hid discovery -> managers/__init__ -> managers.fallback -> discovery); a module's own packages are
    being imported already and add nothing."""
    root = _tree(tmp_path, {"__init__.py": "", "a.py": a_text, "pkg/__init__.py": "from . import d\n",
                            "pkg/c.py": "", "pkg/d.py": "def g():\n    from ..a import y\n"})
    assert cycles(import_graph(root)[0]) == [["gpumem.a", "gpumem.pkg", "gpumem.pkg.d"]]
    inner = _tree(tmp_path / "inner", {"__init__.py": "", "pkg/__init__.py": "from . import c\n",
                                       "pkg/c.py": "from gpumem.pkg.d import z\n", "pkg/d.py": ""})
    assert cycles(import_graph(inner)[0]) == []
