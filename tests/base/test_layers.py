"""The package's layers (docs/architecture.md): a module imports only from its own layer or lower ones, and
the command line's entry point loads no torch until a command runs."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tforce"
# Lowest first. Root modules are the base; each subpackage is a layer; tforce/__init__ and __main__ are the top.
LAYERS = [
    {"errors", "version", "paths", "config", "transfer", "threads", "cpu_features"},
    {"cache"},
    {"model"},
    {"snapshot", "text"},
    {"engine"},
    {"auto"},
    {"parallel"},
    {"bench", "eval"},
    {"serve"},
    {"cli"},
]


def _layer(module: str) -> int:
    """tforce.X[.Y] -> X's layer; the package itself (tforce, tforce.__main__) -> above every layer."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def _imports(path: Path):
    """(importing module, imported module) for each tforce import in the file, relative ones resolved;
    `from PACKAGE import NAME` counts NAME when it is a module of PACKAGE."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    here = parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[:len(here) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            folder = PACKAGE.parent / Path(*base.split("."))
            targets = [f"{base}.{a.name}" if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir()
                       else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "tforce" or target.startswith("tforce."):
                yield module, target


def test_every_module_belongs_to_a_layer():
    names = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    assert names - {"__init__", "__main__"} <= set().union(*LAYERS)


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} -> {b}" for path in PACKAGE.rglob("*.py") for a, b in _imports(path) if _layer(b) > _layer(a)]
    assert upward == []


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """A control: the check above would fail on a cache module that imports the engine."""
    fake = tmp_path / "tforce"
    (fake / "cache").mkdir(parents=True)
    (fake / "engine").mkdir()
    (fake / "engine" / "session.py").write_text("")
    (fake / "cache" / "full.py").write_text("from ..engine import session\nfrom ..errors import UsageError\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = [(a, b) for a, b in _imports(fake / "cache" / "full.py") if _layer(b) > _layer(a)]
    assert found == [("tforce.cache.full", "tforce.engine.session")]


def test_the_command_line_help_loads_no_torch():
    code = ("import sys\nfrom tforce.cli import app\nfrom typer.main import get_command\n"
            "get_command(app).main(['--help'], standalone_mode=False)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"


def _circles(package: Path = PACKAGE) -> list[list[str]]:
    """The import circles among the package's modules (function-level imports included): each strongly
    connected component of more than one module, sorted. A package's __init__ is left out: importing a
    submodule runs it anyway, so an edge to it is no circle of the code's making."""
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for a, b in _imports(path):
            if path.name != "__init__.py" and not (package.parent / Path(*b.split("."))).is_dir():
                graph.setdefault(a, set()).add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle():
    """No module's imports lead back to it, by any path."""
    assert _circles() == []


def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    """A control: two modules that import each other inside functions are one circle."""
    fake = tmp_path / "tforce"
    (fake / "model").mkdir(parents=True)
    (fake / "model" / "weights.py").write_text("def f():\n    from .gguf import g\n")
    (fake / "model" / "gguf.py").write_text("def g():\n    from .weights import f\n")
    (fake / "model" / "network.py").write_text("from .weights import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _circles(fake) == [["tforce.model.gguf", "tforce.model.weights"]]


def _private_imports(root: Path) -> list[str]:
    """`from X import _name` of tforce's own modules, in every file under root."""
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tforce")):
                found += [f"{path.name}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name(tmp_path):
    """What one module takes from another is its public surface; the tests' and scripts' too. A control
    file shows the check sees one."""
    root = PACKAGE.parent
    assert [x for folder in ("tforce", "tests", "scripts") for x in _private_imports(root / folder)] == []
    (tmp_path / "bad.py").write_text("from tforce.engine.generate import _secret\n")
    assert _private_imports(tmp_path) == ["bad.py: _secret"]
