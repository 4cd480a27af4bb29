"""Checks every TensorRT name sdtrt uses against the published Python API (tensorrt-stubs).

TensorRT cannot be installed without a GPU and NVIDIA's own index, and mypy rejects the stub files
as shipped, so this reads the stubs as text: classes, their bases and members, and each method's
parameter names. It then walks sdtrt's source and checks

- every ``trt.X`` / ``trt.X.Y`` chain (classes, enum members, constants);
- every attribute used on a variable typed as a TensorRT class, by annotation (``x: trt.Builder``,
  parameters too) or by construction (``x = trt.Builder(...)``);
- every keyword argument passed to such a method;
- that nothing on the REMOVED list is used (weak-typing and pre-10 APIs that TensorRT 10/11 dropped).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class StubClass:
    bases: list[str]
    members: set[str] = field(default_factory=set)
    params: dict[str, set[str]] = field(default_factory=dict)


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

    def params(self, cls: str, method: str) -> set[str] | None:
        todo = [cls]
        while todo:
            stub = self.classes.get(todo.pop())
            if stub:
                if method in stub.params:
                    return stub.params[method]
                todo += stub.bases
        return None


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
            names = {p.split(":")[0].split("=")[0].strip().lstrip("*") for p in m.group(2).split(",")}
            current.params.setdefault(m.group(1), set()).update(names - {"self", ""})
        elif current and (m := re.match(r"^    (?:class )?(\w+)\s*[:=(]", line)):
            current.members.add(m.group(1))  # attributes, enum members, nested classes
    init = (stub_root / "tensorrt" / "__init__.pyi").read_text()
    exported = re.search(r"__all__ = \[(.*?)\]", init, re.S)
    top_level = set(re.findall(r"'(\w+)'", exported.group(1) if exported else "")) | {"__version__"}
    return Api(top_level, classes)


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
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = _target_name(node.func.value)
            if owner in typed and node.keywords:
                allowed = api.params(typed[owner], node.func.attr) or set()
                for kw in node.keywords:
                    checked += 1
                    if kw.arg not in allowed:
                        problems.append(
                            f"line {node.lineno}: {typed[owner]}.{node.func.attr}() has no parameter '{kw.arg}'"
                        )
    return problems, checked
