"""The package's layers: a module imports only from its own layer or below, and no imports go round in a cycle.

The layers are the package's folders (``sdtrt/core/``, ``sdtrt/spec/``, …), bottom to top in ``LAYER_ORDER``: a
module's layer is the folder it is in, so a new module needs no table entry. Read from the source (AST), nothing
imported. Every import counts, lazy ones inside functions included; those under ``if TYPE_CHECKING:`` do not (they
never run).
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layer folders, bottom to top (docs/layout.md says what each holds).
LAYER_ORDER = (
    "core", "sources", "spec", "graph", "runtime", "stages", "lora", "standins", "pipeline", "tools", "serving", "cli",
)  # fmt: skip
# The only modules outside a layer folder: the package's facade (its public names are imported by name on first
# use, with importlib, so it has no import to check) sits with core; ``python -m sdtrt`` is the CLI.
TOP_LEVEL = {"sdtrt": "core", "sdtrt.__main__": "cli"}


def layers_from_folders(package: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(layer, the dotted names it covers) bottom to top, read from ``package``'s folders."""
    folders = sorted(p.parent.name for p in package.glob("*/__init__.py"))
    unknown = [f for f in folders if f not in LAYER_ORDER]
    assert not unknown, f"folders that are in no layer (add them to LAYER_ORDER, in order): {unknown}"
    return tuple(
        (layer, tuple([f"{package.name}.{layer}"] + [m for m, at in TOP_LEVEL.items() if at == layer]))
        for layer in LAYER_ORDER
    )


LAYERS = layers_from_folders(ROOT / "sdtrt")

# Core modules are imported by everything, the CLI's --help included: no heavy library at import.
HEAVY = ("torch", "diffusers", "transformers", "onnxruntime", "tensorrt", "tensorrt_rtx", "torch_tensorrt")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str  # file:line
    top_level: bool  # runs when the importer is imported (not inside a function)


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of ``package`` (a folder)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, top_level: bool = True, typing_too: bool = False):
    """(import statement, runs at import time) for every import not under ``if TYPE_CHECKING:`` (unless typing_too)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, top_level
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.body * typing_too + child.orelse:
                yield from _statements(ast.Module(body=[other], type_ignores=[]), top_level, typing_too)
        else:
            inner = top_level and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _statements(child, inner, typing_too)


def imports(package: Path, typing_too: bool = False) -> list[Import]:
    """Every import of one of ``package``'s modules by another, resolved to the module it names."""
    files = module_files(package)
    root = package.name
    out = []
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node, top_level in _statements(ast.parse(path.read_text(), str(path)), typing_too=typing_too):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from pkg import name` takes a name from pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target != root and not target.startswith(root + "."):
                    continue
                while target not in files:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    where = f"{path.relative_to(package.parent)}:{node.lineno}"
                    out.append(Import(name, target, where, top_level))
    return out


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index of the layer whose most specific entry covers ``module``."""
    covering = [
        (len(entry), index)
        for index, (_, names) in enumerate(layers)
        for entry in names
        if module == entry or module.startswith(entry + ".")
    ]
    return max(covering)[1] if covering else None


def upward_imports(found: list[Import], layers=LAYERS) -> list[str]:
    problems = []
    for imp in found:
        low, high = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
        if low is not None and high is not None and high > low:
            problems.append(
                f"{imp.importer} ({layers[low][0]}) imports {imp.imported} ({layers[high][0]}) at {imp.where}"
            )
    return problems


def cycles(found: list[Import]) -> list[str]:
    """One line per import cycle (each strongly connected component of the import graph), its path spelled out."""
    graph: dict[str, dict[str, str]] = {}
    for imp in found:
        graph.setdefault(imp.importer, {}).setdefault(imp.imported, imp.where)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_path(sorted(c), graph) for c in components]


def _cycle_path(component: list[str], graph: dict[str, dict[str, str]]) -> str:
    """The shortest way round from the component's first module back to itself, each import with its place."""
    start = component[0]
    members = set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(graph.get(node, {})):
            if succ == start:
                path = paths[node] + [start]
                hops = ", ".join(f"{a} → {b} ({graph[a][b]})" for a, b in itertools.pairwise(path))
                return f"import cycle over {len(component)} modules ({', '.join(component)}): {hops}"
            if succ in members and succ not in paths:
                paths[succ] = paths[node] + [succ]
                queue.append(succ)
    raise AssertionError(f"{component} is not a cycle")


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    return imports(ROOT / "sdtrt")


MAX_LINES = 400  # a module a reader can hold: split one that grows past it by job, never into a grab-bag


def test_no_module_is_over_the_line_limit():
    long = {m: n for m, p in module_files(ROOT / "sdtrt").items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each by job): {long}"


def test_every_module_has_a_layer():
    unplaced = [m for m in module_files(ROOT / "sdtrt") if layer_of(m) is None]
    assert not unplaced, f"modules outside the layer folders (move each into the folder of its layer): {unplaced}"


def test_no_module_imports_from_a_higher_layer(package_imports):
    problems = upward_imports(package_imports)
    assert not problems, "imports from a higher layer:\n" + "\n".join(problems)


def test_not_even_a_type_annotation_reaches_up_a_layer():
    """Type-only imports never run, but a lower layer that names a higher one's types still depends on it.

    The package's facade is the exception: it names the whole public API for type checkers.
    """
    problems = upward_imports([i for i in imports(ROOT / "sdtrt", typing_too=True) if i.importer != "sdtrt"])
    assert not problems, "type-only imports from a higher layer:\n" + "\n".join(problems)


def test_no_import_cycles(package_imports):
    found = cycles(package_imports)
    assert not found, "\n".join(found)


def test_core_modules_import_no_heavy_library():
    heavy = []
    for name, path in module_files(ROOT / "sdtrt").items():
        if layer_of(name) != 0:
            continue
        for node, top_level in _statements(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if top_level and not getattr(node, "level", 0):
                heavy += [f"{name} imports {n} at {path.name}:{node.lineno}" for n in names if n.split(".")[0] in HEAVY]
    assert not heavy, "core modules must stay light at import:\n" + "\n".join(heavy)


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """The checker itself, on a made-up package: a lazy import back up the layers is both a cycle and upward."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import X\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import low\n")
    (pkg / "high.py").write_text("from .sub import thing\n\ndef f():\n    from . import low\n")
    layers = (("low", ("pkg", "pkg.low")), ("high", ("pkg.sub", "pkg.high")))
    found = imports(pkg)
    assert upward_imports(found, layers) == []
    assert cycles(found) == []
    (pkg / "low.py").write_text("def g():\n    from .high import X\n")
    found = imports(pkg)
    assert upward_imports(found, layers) == ["pkg.low (low) imports pkg.high (high) at pkg/low.py:2"]
    assert cycles(found) == [
        "import cycle over 3 modules (pkg.high, pkg.low, pkg.sub): pkg.high → pkg.low (pkg/high.py:4), "
        "pkg.low → pkg.high (pkg/low.py:2)"
    ]
