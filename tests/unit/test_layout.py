"""The shape of the code: no import circles in the package, no import upward across its layers, and no test
module used as a library."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> Iterator[str]:
    """Every module `path` imports, at the top or inside a function, absolute or relative."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def import_graph(package: str = "sidecar") -> dict[str, set[str]]:
    files = {_module_name(p, ROOT): p for p in (ROOT / package).rglob("*.py")}
    return {m: {t for t in _imports(p, m) if t in files and t != m} for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert "sidecar.consensus.acceptor" in graph and graph["sidecar.cli"], "the import walk found nothing"
    assert circles(graph) == []


def test_the_circle_finder_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter's contracts of `root`/pyproject.toml, checked against `root`/sidecar."""
    assert importlib.util.find_spec("importlinter"), "import-linter is missing: rerun scripts/install.sh (test extras)"
    # PYTHONPATH and cwd make grimp read `root`'s sidecar/, not the copy installed in the venv; no cache, so
    # that a stale graph never hides an import.
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
         "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    # The floors are in pyproject.toml ([tool.importlinter]) and drawn in ARCHITECTURE.md.
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout, result.stdout


def test_the_layers_contract_catches_an_upward_import(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "sidecar", tmp_path / "sidecar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    # The leaf of LSNs reaching up to the command line, and one service reaching into the other.
    with open(tmp_path / "sidecar" / "lsn.py", "a") as f:
        f.write("\nimport sidecar.cli  # noqa\n")
    with open(tmp_path / "sidecar" / "safekeeper" / "horizon.py", "a") as f:
        f.write("\nimport sidecar.proposer.limbo  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "sidecar.lsn is not allowed to import sidecar.cli" in result.stdout, result.stdout
    assert "sidecar.safekeeper is not allowed to import sidecar.proposer" in result.stdout, result.stdout


def test_the_core_imports_nothing_that_does_io() -> None:
    # sans-IO: the consensus core may import only itself and the sans-IO value modules beside it
    # (LSNs, the replication protocol's messages), which are held to the same rule.
    graph = import_graph()
    beside = {"sidecar.lsn", "sidecar.pgrepl", "sidecar.timelines"}
    core = [name for name in graph if name.startswith("sidecar.consensus")] + sorted(beside)
    assert "sidecar.consensus.proposer" in core
    for name in core:
        for target in graph[name]:
            assert target.startswith("sidecar.consensus") or target in beside, (name, target)
        path = ROOT / (name.replace(".", "/") + ("/__init__.py" if name == "sidecar.consensus" else ".py"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) \
                    else {(node.module or "").split(".")[0]}
                assert not roots & {"asyncio", "socket", "time", "os", "threading", "selectors"}, (name, roots)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "open", name


def test_no_test_module_imports_another() -> None:
    tests = ROOT / "tests"
    for path in tests.rglob("*.py"):
        name = _module_name(path, tests)
        for target in _imports(path, name):
            leaf = target.rsplit(".", 1)[-1]
            assert not leaf.startswith("test_"), f"{path.relative_to(ROOT)} imports {target}: move it to tests/support"
