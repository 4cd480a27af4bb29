"""Graph passes for bf16 graphs headed to TensorRT: the ops that must not compute in bf16 get fp32 around them.

Both passes wrap a node in casts: its bf16 float inputs are cast to fp32, its outputs computed in fp32 and
cast back to bf16, so the rest of the strongly typed graph keeps its types.

- **Resize**: NVIDIA's demo/Diffusion casts Resize I/O to fp32 for strongly typed bf16 builds
  (demo_diffusion/model/base_model.py ``optimize``: "TRT does not support BF16 for the Resize operator";
  utils_modelopt.py ``cast_resize_io``), although onnx-tensorrt's docs/operators.md for TensorRT 10 lists
  Resize as FP32, FP16, BF16. Kept as the demo builds it: an interpolation in fp32 costs little and rounds
  to bf16 once, at its output.
- **Sin and Cos** — the rotary position embedding (Flux, SD3.5) and the sinusoidal timestep embedding: an
  angle of a few hundred radians keeps no fraction in bf16's 8-bit mantissa, so a sine computed on it is
  noise. NVIDIA's demo keeps Flux's rotary embedding in fp32. diffusers already computes the angles in
  fp64/fp32 and applies them in fp32 (``FluxPosEmbed``, ``apply_rotary_emb``'s ``x.float()``), so on its
  graphs the pass finds little to change; it guards any graph whose trigonometry a bf16 trace left in bf16.

The passes work on the graph without its weights (they add nodes only), so they cost the same for a 12 B
transformer as for the tiny UNet. The simplify stage applies them to bf16 graphs, after onnxsim or constant
folding, which would otherwise be free to fold the casts away again.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

# Ops computed in fp32 inside bf16 graphs, and why (the manifest records it).
FP32_OPS = {
    "Resize": "as NVIDIA demo/Diffusion builds bf16 graphs (it casts Resize I/O to fp32)",
    "Sin": "rotary and timestep embeddings: angles keep no fraction in bf16",
    "Cos": "rotary and timestep embeddings: angles keep no fraction in bf16",
}
LOW = TensorProto.BFLOAT16


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed tensor: graph IO, initializers and what shape inference derives."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    types |= {i.name: i.data_type for i in graph.initializer}
    for node in graph.node:
        for attribute in node.attribute if node.op_type == "Constant" else ():
            if attribute.name == "value":
                types[node.output[0]] = attribute.t.data_type
    return types


def compute_in_fp32(model: onnx.ModelProto, op_types: tuple[str, ...] = tuple(FP32_OPS)) -> list[str]:
    """Wrap every node of ``op_types`` whose inputs are bf16 in casts (in place); returns the wrapped nodes' names.

    Inputs that are not bf16 (Resize's fp32 scales, int64 sizes, an empty roi) are left alone, as are nodes
    that already compute in fp32.
    """
    types = tensor_types(model)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    wrapped = []
    for index, node in enumerate(graph.node):
        if node.op_type not in op_types or not any(types.get(name) == LOW for name in node.input if name):
            nodes.append(node)
            continue
        label = node.name or f"{node.op_type}_{index}"
        for slot, name in enumerate(node.input):
            if name and types.get(name) == LOW:
                node.input[slot] = f"{name}__fp32_for_{label}"
                cast = helper.make_node(
                    "Cast", [name], [node.input[slot]], f"{label}/cast_in_{slot}", to=TensorProto.FLOAT
                )
                nodes.append(cast)
        nodes.append(node)
        for slot, name in enumerate(node.output):
            if name:
                node.output[slot] = f"{name}__fp32"
                nodes.append(helper.make_node("Cast", [node.output[slot]], [name], f"{label}/cast_out_{slot}", to=LOW))
        wrapped.append(label)
    graph.ClearField("node")
    graph.node.extend(nodes)  # the wrapped outputs keep their names and bf16 types: consumers are unchanged
    return wrapped


def compute_in_fp32_file(path: Path) -> list[str]:
    """``compute_in_fp32`` on an ONNX file, rewriting only its graph: external weights stay where they are."""
    model = onnx.load(str(path), load_external_data=False)
    wrapped = compute_in_fp32(model)
    if wrapped:
        onnx.save_model(model, str(path))
    return wrapped
