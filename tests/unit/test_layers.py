"""The installed package's import graph against the layers docs/architecture.md writes down:
no circle, no import of a lower layer (a higher number) or of a peer, every module in a layer,
no private module imported from another package, and every moved name's alias still resolving
(with its warning)."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def package_files(root: Path) -> dict[str, Path]:
    """Every module of the installed package, by its dotted name, from the ``package-dir``
    mapping in ``pyproject.toml`` (``producers/`` installs as ``perfloop.producers`` …)."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = conf["package-dir"]
    out: dict[str, Path] = {}
    for pkg in conf["packages"]:
        base = pkg.split(".")
        for i in range(len(base), 0, -1):  # the longest mapped prefix
            head = ".".join(base[:i])
            if head in dirs:
                folder = root / dirs[head] / Path(*base[i:])
                break
        else:
            folder = root / Path(*base)
        for f in sorted(folder.glob("*.py")):
            name = pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"
            out[name] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in it (top level, functions, type-only
    blocks); ``from a import b`` counts as ``a.b`` when that is a module, else as ``a``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.stem == "__init__"
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted:
            if dotted in known:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - (0 if is_pkg else 1)]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            hit = resolve(t)
            if hit is not None and hit != name:
                found.add(hit)
    return found


def read_layers(doc: Path) -> list[tuple[int, str, list[str]]]:
    """``(number, name, module prefixes)`` of each row of the layer table in ``doc``."""
    rows = []
    for line in doc.read_text().splitlines():
        m = re.fullmatch(r"\|\s*(\d+)\s*\|\s*([a-z ]+?)\s*\|(.*)\|\s*", line)
        if m:
            rows.append((int(m[1]), m[2], re.findall(r"`([\w.]+)`", m[3])))
    return rows


def layer_of(module: str, layers: list[tuple[int, str, list[str]]]) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for number, lname, prefixes in layers:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (number, len(p), lname)
    return None if best is None else (best[0], best[2])


def violations(graph: dict[str, set[str]], layers: list[tuple[int, str, list[str]]]) -> list[str]:
    """One line per module outside every layer and per import against the order."""
    out = []
    for a in sorted(graph):
        la = layer_of(a, layers)
        if la is None:
            out.append(f"{a}: in no layer of docs/architecture.md")
            continue
        for b in sorted(graph[a]):
            lb = layer_of(b, layers)
            if lb is None:
                continue  # reported as its own line
            if lb[0] > la[0] or (lb[0] == la[0] and lb[1] != la[1]):
                out.append(f"{a} ({la[1]}) imports {b} ({lb[1]})")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """One line per import of a private module (``_name``) from outside its own package."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            parent, _, last = b.rpartition(".")
            if (
                last.startswith("_")
                and not last.startswith("__")
                and not a.startswith(parent + ".")
            ):
                out.append(f"{a} imports {b}, private to {parent}")
    return out


def graph_of(root: Path) -> dict[str, set[str]]:
    files = package_files(root)
    known = set(files)
    return {name: imports(name, path, known) for name, path in files.items()}


def test_the_package_has_no_import_circle() -> None:
    assert circles(graph_of(ROOT)) == []


def test_no_import_runs_against_the_documented_layers() -> None:
    layers = read_layers(DOC)
    assert len(layers) >= 9, "the layer table of docs/architecture.md was not read"
    assert violations(graph_of(ROOT), layers) == []


def test_no_private_module_is_imported_from_another_package() -> None:
    assert private_imports(graph_of(ROOT)) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.low"]\n'
        '[tool.setuptools.package-dir]\n"pkg" = "pkg"\n"pkg.low" = "low"\n'
    )
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_the_checks_find_a_circle_and_an_import_against_the_order(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/base.py": "def f():\n    from pkg import roof\n",  # inside a function
            "pkg/roof.py": "from pkg.base import f\nfrom pkg.low import a\n",
            "low/__init__.py": "",
            "low/a.py": "from . import b\n",  # relative, a folder mapped to pkg.low
            "low/b.py": "import pkg.low.a\n",
            "low/_own.py": "",
            "low/c.py": "from pkg.low import _own\n",  # its own package's: fine
            "pkg/other.py": "from pkg.low._own import x\n",
        },
    )
    graph = graph_of(root)
    assert graph["pkg.low.a"] == {"pkg.low.b"}
    assert sorted(circles(graph)) == [["pkg.base", "pkg.roof"], ["pkg.low.a", "pkg.low.b"]]
    layers = [(1, "base", ["pkg", "pkg.base"]), (2, "low", ["pkg.low"]), (3, "roof", ["pkg.roof"])]
    assert violations(graph, layers) == [
        "pkg.base (base) imports pkg.roof (roof)",
        "pkg.other (base) imports pkg.low._own (low)",
    ]
    peers = [(1, "base", ["pkg"]), (2, "low", ["pkg.low.a"]), (2, "other", ["pkg.low.b"])]
    assert "pkg.low.a (low) imports pkg.low.b (other)" in violations(graph, peers)
    assert private_imports(graph) == ["pkg.other imports pkg.low._own, private to pkg.low"]
    assert violations(graph, [(1, "base", ["pkg.base"])])[0] == (
        "pkg: in no layer of docs/architecture.md"
    )


def _aliases() -> list[tuple[str, str, str]]:
    out = []
    for name, path in sorted(package_files(ROOT).items()):
        if not re.search(r"^__getattr__ = moved\(", path.read_text(), re.M):
            continue
        getattr_ = importlib.import_module(name).__getattr__
        out += [(name, n, new) for n, new in sorted(getattr_.moved.items())]
    return out


@pytest.mark.parametrize(("old", "name", "new"), _aliases())
def test_a_moved_name_still_resolves_with_a_warning(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"{old}.{name} moved to {new}.{name}" in str(caught[0].message)


def _call(name: str) -> tuple[object, ...]:
    if name == "goodput":
        from perfloop.models.batch_size import StepTimeModel

        return (64.0, 100.0, 32.0, StepTimeModel(overhead_s=0.1, per_example_s=0.001))
    from perfloop.actuators.signing import sign
    from perfloop.schemas import Command

    cmd = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="k", value=1,
                  expires_ts_ns=2)  # fmt: skip
    return (sign(cmd, b"key"), b"key")


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [("perfloop.models", "goodput", "perfloop.models.batch_size"),
     ("perfloop.actuators", "verify", "perfloop.actuators.signing")],
)  # fmt: skip
def test_a_moved_module_named_like_its_packages_function_still_calls_it(
    package: str, name: str, home: str
) -> None:
    """The first import of the old module makes the package's name the module (Python binds
    a submodule on its package); calling that name still reaches the function, with the
    function's answer."""
    pkg = importlib.import_module(package)
    function = getattr(importlib.import_module(home), name)
    assert callable(function) and not isinstance(function, type(pkg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module(f"{package}.{name}")
    assert isinstance(old, type(pkg)) and old is not function
    before = getattr(pkg, name)
    setattr(pkg, name, old)  # what that first import does
    try:
        args = _call(name)
        assert getattr(pkg, name)(*args) == function(*args)
        assert function(*args)  # a real answer: a goodput above 0, a signature that holds
    finally:
        setattr(pkg, name, before)
