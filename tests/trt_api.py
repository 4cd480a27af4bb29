"""Checks every TensorRT name sdtrt uses against the published Python API (tensorrt-stubs).

TensorRT cannot be installed without a GPU and NVIDIA's own index, and mypy rejects the stub files
as shipped, so this reads the stubs as text: classes, their bases and members, and each method's
parameter names. It then walks sdtrt's source and checks

- every ``trt.X`` / ``trt.X.Y`` chain (classes, enum members, constants);
- every attribute used on a variable typed as a TensorRT class, by annotation (``x: trt.Builder``,
  parameters too) or by construction (``x = trt.Builder(...)``);
- every call of such a method, and of a ``trt.X(...)`` constructor, against the stub's parameters: keyword
  names, how many positional arguments, required parameters given, none given twice (some overload must fit);
- that nothing on the REMOVED list is used (weak-typing and pre-10 APIs that TensorRT 10/11 dropped).
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

# APIs removed in TensorRT 10 (implicit batch, bindings) and 11 (weak typing, implicit quantization);
# TensorRT 11's list: docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/
# tensorrt-10x-to-11x-python-api-reference.html. BuilderFlag.DIRECT_IO and
# ICudaEngine.device_memory_size_v2 are not on it: the issue-9 review of 11.1's pyCore.cpp found both still bound.
REMOVED = {
    "BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.INT8", "BuilderFlag.FP8", "BuilderFlag.INT4",
    "BuilderFlag.FP4", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS", "BuilderFlag.PREFER_PRECISION_CONSTRAINTS",
    "IBuilderConfig.int8_calibrator", "IBuilderConfig.set_calibration_profile",
    "IBuilderConfig.get_calibration_profile", "IBuilderConfig.set_quantization_flag",
    "IBuilderConfig.get_quantization_flag", "IBuilderConfig.quantization_flags",
    "IBuilderConfig.clear_quantization_flag", "ICudaEngine.device_memory_size",
    "Builder.platform_has_fast_fp16", "Builder.platform_has_fast_int8",
    "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "IExecutionContext.execute_async_v2",
    "IExecutionContext.set_binding_shape", "ICudaEngine.get_binding_index", "IBuilderConfig.max_workspace_size",
    "Builder.build_engine",
}  # fmt: skip


@dataclass(frozen=True)
class Signature:
    params: tuple[str, ...]  # in order, without self
    required: frozenset[str]  # those without a default
    variadic: bool  # *args or **kwargs: any call fits
    positional: int | None = None  # how many may be given positionally, where a bare * ends them

    @classmethod
    def parse(cls, text: str) -> Signature:
        params: list[str] = []
        required, variadic, positional = set(), False, None
        for part in _top_level_split(text):
            name = part.split(":")[0].split("=")[0].strip()
            if name == "*":
                positional = len(params)
            elif name.startswith("*"):
                variadic = True
            elif name and name not in ("self", "/"):
                params.append(name)
                if "=" not in part:
                    required.add(name)
        return cls(tuple(params), frozenset(required), variadic, positional)

    def problem(self, positional: int, keywords: list[str]) -> str | None:
        """Why a call with this many positional arguments and these keywords does not fit, or None."""
        if self.variadic:
            return None
        # pybind11 names unnamed arguments arg0, arg1, …: those cannot be given by keyword
        if unknown := next((k for k in keywords if k not in self.params or re.fullmatch(r"arg\d+", k)), None):
            return f"has no parameter '{unknown}'"
        if positional > (most := len(self.params) if self.positional is None else self.positional):
            return f"takes {most} arguments, not {positional}"
        if twice := next((k for k in keywords if self.params.index(k) < positional), None):
            return f"gets '{twice}' twice"
        if missing := sorted(self.required - set(self.params[:positional]) - set(keywords)):
            return f"misses {', '.join(repr(m) for m in missing)}"
        return None


def _top_level_split(text: str) -> list[str]:
    """Split a parameter list at the commas outside brackets (``dict[str, int]`` stays whole)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "[(") - (char in "])")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


@dataclass
class StubClass:
    bases: list[str]
    members: set[str] = field(default_factory=set)
    signatures: dict[str, list[Signature]] = field(default_factory=dict)  # method → its overloads


@dataclass
class Api:
    top_level: set[str]
    classes: dict[str, StubClass]

    def members(self, cls: str) -> set[str]:
        found: set[str] = set()
        todo = [cls]
        while todo:
            stub = self.classes.get(todo.pop())
            if stub:
                found |= stub.members
                todo += stub.bases
        return found

    def signatures(self, cls: str, method: str) -> list[Signature]:
        todo = [cls]
        while todo:
            stub = self.classes.get(todo.pop())
            if stub:
                if method in stub.signatures:
                    return stub.signatures[method]
                todo += stub.bases
        return []

    def call_problem(self, cls: str, method: str, call: ast.Call) -> str | None:
        """Why ``call`` fits none of the method's overloads (the first overload's reason), or None."""
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return None  # *args / **kwargs at the call: nothing to count
        keywords = [k.arg for k in call.keywords if k.arg]
        signatures = self.signatures(cls, method)
        if not signatures and method == "__init__" and cls in self.classes:
            return "has no Python constructor"  # pybind11: "No constructor defined"
        problems = [sig.problem(len(call.args), keywords) for sig in signatures]
        return None if not problems or None in problems else problems[0]


def load_api(stub_root: Path) -> Api:
    """Parse tensorrt_bindings/tensorrt.pyi and tensorrt/__init__.pyi by lines (they are not valid Python)."""
    classes: dict[str, StubClass] = {}
    current: StubClass | None = None
    for line in (stub_root / "tensorrt_bindings" / "tensorrt.pyi").read_text().splitlines():
        if m := re.match(r"^class (\w+)(?:\((.*)\))?:", line):
            bases = [b.strip().split(".")[-1] for b in (m.group(2) or "").split(",") if b.strip()]
            current = classes.setdefault(m.group(1), StubClass(bases))
        elif current and (m := re.match(r"^    def (\w+)\((.*?)\)\s*(->|:)", line)):
            current.members.add(m.group(1))
            current.signatures.setdefault(m.group(1), []).append(Signature.parse(m.group(2)))
        elif current and (m := re.match(r"^    (?:class )?(\w+)\s*[:=(]", line)):
            current.members.add(m.group(1))  # attributes, enum members, nested classes
    init = (stub_root / "tensorrt" / "__init__.pyi").read_text()
    exported = re.search(r"__all__ = \[(.*?)\]", init, re.S)
    top_level = set(re.findall(r"'(\w+)'", exported.group(1) if exported else "")) | {"__version__"}
    return Api(top_level, classes)


def load_module_api(module: ModuleType) -> Api:
    """The Api of an installed pybind11 module (tensorrt_rtx, which installs without a GPU), read from the module
    itself: its names, each class's members (dir), and each method's parameters from the signature lines pybind11
    writes at the top of its docstring ("name(self: ..., a: int, b: T = ...) -> R", numbered per overload)."""
    classes: dict[str, StubClass] = {}
    for name, cls in vars(module).items():
        if not isinstance(cls, type):
            continue
        stub = classes[name] = StubClass([b.__name__ for b in cls.__bases__ if b.__name__ in vars(module)])
        stub.members = set(dir(cls))
        for method in stub.members:
            if isinstance(inspect.getattr_static(cls, method, None), property):
                continue  # an attribute: used, never called
            doc = getattr(getattr(cls, method, None), "__doc__", None) or ""
            numbered = r"\d+\. " if "Overloaded function" in doc else ""  # not the (*args, **kwargs) line above
            if found := re.findall(rf"^{numbered}{re.escape(method)}\((.*)\)\s*->", doc, re.M):
                stub.signatures[method] = [Signature.parse(text) for text in found]
    return Api(set(dir(module)), classes)


def _trt_chain(node: ast.AST, alias: str) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == alias:
        return list(reversed(parts))
    return None


def _target_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _called(call: ast.Call, typed: dict[str, str], alias: str) -> tuple[str, str] | None:
    """(class, method) a call runs: ``typed_name.method(...)``, or ``trt.X(...)`` (X's __init__)."""
    if not isinstance(call.func, ast.Attribute):
        return None
    if (owner := _target_name(call.func.value)) in typed:
        return typed[owner], call.func.attr
    if (chain := _trt_chain(call.func, alias)) and len(chain) == 1:
        return chain[0], "__init__"
    return None


def check_source(source: str, api: Api, alias: str = "trt") -> tuple[list[str], int]:
    """Problems found in one file, and how many TensorRT uses were checked."""
    tree = ast.parse(source)
    problems: list[str] = []
    checked = 0
    typed: dict[str, str] = {}

    def record_type(target: ast.AST, type_node: ast.AST | None) -> None:
        if isinstance(type_node, ast.BinOp) and isinstance(type_node.op, ast.BitOr):  # `trt.X | None`
            type_node = type_node.left
        chain = _trt_chain(type_node, alias) if type_node is not None else None
        name = _target_name(target)
        if name and chain and len(chain) == 1:
            typed[name] = chain[0]

    for node in ast.walk(tree):  # pass 1: what is typed as a TensorRT class
        if isinstance(node, ast.AnnAssign):
            record_type(node.target, node.annotation)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            record_type(ast.Name(node.arg), node.annotation)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            record_type(node.targets[0], node.value.func)

    for node in ast.walk(tree):  # `self._context = context`: the attribute takes the name's type
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Name)):
            continue
        if (name := _target_name(node.targets[0])) and node.value.id in typed:
            typed[name] = typed[node.value.id]

    for node in ast.walk(tree):  # pass 2: check every use
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == alias:
            checked += 1
            if node.attr not in api.top_level:
                problems.append(f"line {node.lineno}: trt.{node.attr} does not exist")
        if isinstance(node, ast.Attribute) and (chain := _trt_chain(node, alias)) and len(chain) == 2:
            cls, member = chain
            checked += 1
            if member not in api.members(cls):
                problems.append(f"line {node.lineno}: trt.{cls}.{member} does not exist")
            if f"{cls}.{member}" in REMOVED:
                problems.append(f"line {node.lineno}: trt.{cls}.{member} is removed in TensorRT 10/11")
        if isinstance(node, ast.Attribute) and (owner := _target_name(node.value)) in typed:
            cls = typed[owner]
            checked += 1
            if node.attr not in api.members(cls):
                problems.append(f"line {node.lineno}: {owner}.{node.attr}: {cls} has no member '{node.attr}'")
            if f"{cls}.{node.attr}" in REMOVED:
                problems.append(f"line {node.lineno}: {cls}.{node.attr} is removed in TensorRT 10/11")
        if isinstance(node, ast.Call) and (called := _called(node, typed, alias)):
            cls, method = called
            checked += 1
            if problem := api.call_problem(cls, method, node):
                shown = f"{cls}()" if method == "__init__" else f"{cls}.{method}()"
                problems.append(f"line {node.lineno}: {shown} {problem}")
    return problems, checked
