"""bf16 weights read by sdtrt itself, whatever the installed onnx maps BFLOAT16 to (review 4, B5 and M1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ml_dtypes = pytest.importorskip("ml_dtypes")


def _bf16_graph(folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A graph with bf16 initializers in external data, inline as raw bytes, and inline as int32_data entries."""
    rng = np.random.default_rng(0)
    values = {
        "big": rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16),
        "small": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "listed": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
    }
    inits = [
        helper.make_tensor(name, TensorProto.BFLOAT16, v.shape, v.view(np.uint16).tobytes(), raw=True)
        for name, v in values.items()
        if name != "listed"
    ]
    # make_tensor stores non-raw bf16 as one int32_data entry a value (exact here: the floats are bf16 already)
    inits.append(
        helper.make_tensor("listed", TensorProto.BFLOAT16, (2, 3), values["listed"].astype(np.float32).ravel())
    )
    nodes = [helper.make_node("Identity", [n], [f"{n}.out"]) for n in values]
    outputs = [helper.make_tensor_value_info(f"{n}.out", TensorProto.BFLOAT16, v.shape) for n, v in values.items()]
    model = helper.make_model(helper.make_graph(nodes, "g", [], outputs, inits))
    graph = folder / "g.onnx"
    onnx.save_model(model, str(graph), save_as_external_data=True, location="g.onnx.data", size_threshold=1024)
    return graph, values


def test_bf16_initializers_read_as_bf16_with_an_onnx_that_maps_bfloat16_to_float32(tmp_path, monkeypatch):
    """B5: onnx 1.16-1.18 map BFLOAT16 to float32 (onnx/mapping.py v1.17.0:49-51) and to_array widens it: external
    data would be mapped 4 bytes an element, and inline data would come back float32, which a refit rejects."""
    from onnx.external_data_helper import uses_external_data

    from sdtrt.graph.graph_weights import read_initializers

    graph, values = _bf16_graph(tmp_path)
    stored = {i.name: uses_external_data(i) for i in onnx.load(str(graph), load_external_data=False).graph.initializer}
    assert stored == {"big": True, "small": False, "listed": False}  # both paths are exercised

    real_to_array, real_np_dtype = numpy_helper.to_array, helper.tensor_dtype_to_np_dtype

    def to_array_117(tensor, base_dir=""):  # onnx 1.17 numpy_helper.py:263-266: bf16 widened to float32
        if tensor.data_type == TensorProto.BFLOAT16:
            bits = np.frombuffer(tensor.raw_data, "<u2") if tensor.raw_data else np.array(tensor.int32_data)
            return bits.astype(np.uint32).__lshift__(16).view(np.float32)
        return real_to_array(tensor, base_dir)

    monkeypatch.setattr(numpy_helper, "to_array", to_array_117)
    monkeypatch.setattr(
        helper,
        "tensor_dtype_to_np_dtype",
        lambda t: np.dtype("float32") if t == TensorProto.BFLOAT16 else real_np_dtype(t),
    )
    got = read_initializers(graph, set(values))
    for name, value in values.items():
        assert got[name].dtype.name == "bfloat16", name  # refit_weights sends bf16 by pointer on this name
        assert got[name].shape == value.shape and np.array_equal(got[name].view(np.uint16), value.view(np.uint16))


@pytest.fixture(scope="module")
def bf16_unet_graph(tiny, store):
    """The tiny UNet's bf16 graph, as the TensorRT target builds it (export and simplify run on the CPU)."""
    from sdtrt.core.config import ExportConfig, SimplifyConfig
    from sdtrt.stages import export, simplify

    return simplify.run(SimplifyConfig(), export.run(ExportConfig(precision="bf16"), tiny, store), store)


class Recording:
    """An engine runtime that takes new weights and keeps them, as a refittable TensorRT runtime would refit."""

    def __init__(self) -> None:
        self.calls: list[dict[str, np.ndarray]] = []

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.calls.append(weights)


def test_loras_on_a_bf16_graph_are_placed_and_computed_in_bf16(tiny, bf16_unet_graph, tmp_path):
    """M1: a bf16 graph's weights are matched in bf16 (they were matched as fp32, so nothing was placed), and a
    LoRA is added to the bf16 base weights through their bits (torch.from_numpy refuses ml_dtypes' bfloat16)."""
    import torch
    from safetensors.torch import load_file

    from sdtrt.graph.graph_weights import read_initializers
    from sdtrt.lora.refit import EngineLoras, apply_loras
    from sdtrt.stages import weight_map

    from .helpers import peft_lora

    made = weight_map.build(bf16_unet_graph.primary, tiny, "unet")
    assert made.graph_dtype == "bfloat16" and len(made.mapped) > 50 and not made.unmapped
    path = peft_lora(tiny, tmp_path / "a", seed=1, rank=4, alpha=8)
    runtime = Recording()
    apply_loras([EngineLoras("unet", runtime, lambda: made)], [(path, 1.0)], lambda _: "")
    (weights,) = runtime.calls
    assert weights and all(w.dtype.name == "bfloat16" for w in weights.values())

    module = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    place = made.mapped[f"{module}.weight"]
    lora = load_file(path)
    up, down = (lora[f"unet.{module}.lora_{ab}.weight"].float() for ab in "BA")
    delta = (8 / 4) * up @ down  # alpha / rank
    base = read_initializers(bf16_unet_graph.primary, {place.initializer})[place.initializer]
    base32 = torch.from_numpy(base.astype(np.float32))
    expected = base32 + (delta.T if place.transpose else delta)
    got = torch.from_numpy(weights[place.initializer].astype(np.float32))
    assert not torch.equal(got, base32)
    assert torch.allclose(got, expected, rtol=2**-7, atol=1e-6)  # within bf16's rounding of the sum
