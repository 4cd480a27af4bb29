"""A TensorRT engine's IO: its tensors checked against its manifest, and the optimization profile that covers a
request's shapes (sdtrt/runtime/tensorrt.py binds them)."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from ..spec import GraphSpec

if TYPE_CHECKING:
    import tensorrt as trt

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]


def select_profile(profiles: list[ProfileShapes], shapes: dict[str, Shape]) -> int | None:
    """Index of the first profile whose min..max covers every input shape, or None."""
    for index, profile in enumerate(profiles):
        if all(
            all(lo <= s <= hi for s, lo, hi in zip(shapes[name], mins, maxs, strict=True))
            for name, (mins, _, maxs) in profile.items()
        ):
            return index
    return None


def out_of_profile(profiles: list[ProfileShapes], shapes: dict[str, Shape]) -> str:
    """Why no profile covers ``shapes``: the first input no profile covers (a ControlNet's control image may
    be the one out of range, not the latents), or that each fits some profile but no one profile fits all."""
    for name, shape in shapes.items():
        if select_profile([{name: p[name]} for p in profiles], {name: shape}) is None:
            return (
                f"input '{name}' has shape {shape}, outside every optimization profile of this engine "
                f"({describe_profiles(profiles, name)})"
            )
    return f"the input shapes {shapes} fit no single optimization profile of this engine together"


def _engine_profile(engine: trt.ICudaEngine, names: tuple[str, ...], index: int) -> ProfileShapes:
    """Per input (min, opt, max) shapes of one optimization profile, read back from the engine."""
    shapes: ProfileShapes = {}
    for name in names:
        lo, opt, hi = (tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, index))
        shapes[name] = (lo, opt, hi)
    return shapes


def engine_io_problem(trt: ModuleType, engine: trt.ICudaEngine, spec: GraphSpec) -> str | None:
    """Why this engine's IO differs from the spec its manifest records (names, direction, dtype), or None; ``trt``
    is the module of the product that built it (TensorRT-RTX binds the same names)."""
    import numpy as np

    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    expected = [(t, trt.TensorIOMode.INPUT) for t in spec.inputs()] + [
        (t, trt.TensorIOMode.OUTPUT) for t in spec.outputs()
    ]
    if names != {t.name for t, _ in expected}:
        return f"the engine's tensors are {sorted(names)}, its manifest says {[t.name for t, _ in expected]}"
    for tensor, mode in expected:
        if engine.get_tensor_mode(tensor.name) != mode:
            return f"'{tensor.name}' is not an {mode.name.lower()} of the engine"
        dtype = engine.get_tensor_dtype(tensor.name)
        if dtype == trt.DataType.BF16:  # numpy has no bfloat16, so trt.nptype raises for it
            same = tensor.dtype == "bfloat16"
        else:
            try:  # trt.nptype maps a TensorRT DataType to numpy's; TypeError for fp8/int4/fp4 (tensorrt/__init__.py)
                same = np.dtype(trt.nptype(dtype)) == np.dtype(tensor.dtype)
            except TypeError:
                same = False
        if not same:
            return f"'{tensor.name}' is {dtype} in the engine, {tensor.dtype} in its manifest"
    return None


def describe_profiles(profiles: list[ProfileShapes], name: str) -> str:
    return "; ".join(f"profile {i}: {p[name][0]} .. {p[name][2]}" for i, p in enumerate(profiles))
