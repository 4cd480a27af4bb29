"""bf16 graph passes (stages/graph_passes): Resize and rotary/timestep trigonometry compute in fp32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from sdtrt.stages.graph_passes import compute_in_fp32


def bf16_graph(op: onnx.NodeProto, out_shape: list[int], initializers: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """fp32 x → bf16 → ``op`` (reads "h", writes "o") → fp32 y: a bf16 computation ONNX Runtime can be fed."""
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], "to_bf16", to=TensorProto.BFLOAT16),
        op,
        helper.make_node("Cast", ["o"], ["y"], "to_fp32", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], list(initializers),
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def as_bf16(values: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_resize_computes_in_fp32_and_the_graph_then_runs():
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    resize = helper.make_node("Resize", ["h", "", "scales"], ["o"], "up", mode="linear")
    model = bf16_graph(resize, [1, 2, 6, 6], [scales])
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):  # no bf16 Resize on ONNX Runtime's CPU provider
        session(model)

    assert compute_in_fp32(model) == ["up"]
    onnx.checker.check_model(model, full_check=True)  # types still agree everywhere
    node = next(n for n in model.graph.node if n.op_type == "Resize")
    assert node.input[1:] == ["", "scales"]  # fp32 scales and the empty roi are left alone
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    got = session(model).run(None, {"x": x})[0]
    fp32 = bf16_graph(helper.make_node("Resize", ["h", "", "scales"], ["o"], mode="linear"), [1, 2, 6, 6], [scales])
    for n in fp32.graph.node:  # the same computation all in fp32, on the bf16-rounded input
        if n.op_type == "Cast":
            n.attribute[0].i = TensorProto.FLOAT
    want = as_bf16(session(fp32).run(None, {"x": as_bf16(x)})[0])
    np.testing.assert_array_equal(got, want)
    assert compute_in_fp32(model) == []  # idempotent: the Resize now computes in fp32


def test_sine_and_cosine_compute_in_fp32():
    model = bf16_graph(helper.make_node("Sin", ["h"], ["o"], "rope_sin"), [1, 2, 3, 3])
    assert compute_in_fp32(model) == ["rope_sin"]
    onnx.checker.check_model(model, full_check=True)
    x = np.linspace(-300, 300, 18, dtype=np.float32).reshape(1, 2, 3, 3)
    got = session(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, as_bf16(np.sin(as_bf16(x))))


def test_fp32_ops_are_left_alone():
    """A Resize on fp32 data (a VAE kept fp32, or one already wrapped) gets no casts."""
    scales = helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])
    model = bf16_graph(helper.make_node("Resize", ["h", "", "scales"], ["o"], "up"), [1, 2, 6, 6], [scales])
    for n in model.graph.node:
        if n.op_type == "Cast":
            n.attribute[0].i = TensorProto.FLOAT
    assert compute_in_fp32(model) == []
    assert [n.op_type for n in model.graph.node] == ["Cast", "Resize", "Cast"]


def test_a_rotary_embedding_traced_in_bf16_gets_its_trigonometry_in_fp32(tmp_path):
    """A small module whose rotary embedding runs at the module's dtype, exported in bf16 as sdtrt exports."""
    import torch

    from sdtrt.stages.graph_passes import tensor_types

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))

        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            angles = (positions[:, None] * self.inv_freq[None, :]).repeat_interleave(2, dim=-1)
            x = self.proj(x)
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * angles.cos() + rotated * angles.sin()

    module = Rotary().to(torch.bfloat16).eval()
    path = tmp_path / "rotary.onnx"
    example = (torch.randn(3, 8, dtype=torch.bfloat16), torch.arange(3, dtype=torch.bfloat16) * 300)
    torch.onnx.export(module, example, str(path), dynamo=True, opset_version=22, verbose=False)
    model = onnx.load(str(path))
    assert {tensor_types(model)[n.input[0]] for n in model.graph.node if n.op_type in ("Sin", "Cos")} == {
        TensorProto.BFLOAT16
    }
    assert len(compute_in_fp32(model)) == 2  # one Sin, one Cos
    onnx.checker.check_model(model, full_check=True)
    types = tensor_types(model)
    assert {types[n.input[0]] for n in model.graph.node if n.op_type in ("Sin", "Cos")} == {TensorProto.FLOAT}
