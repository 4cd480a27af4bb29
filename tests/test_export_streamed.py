"""Weight-free export: a network traced without weight data, its initializers streamed from the safetensors files.

The streamed graph must be the loaded path's graph (torch.export's exporter): the same nodes, the same
initializers (names, dtypes, shapes, bytes), laid out in ``.onnx.data`` as onnx.save_model lays them out,
and the same output on ONNX Runtime.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import ConfigError, ExportError
from sdtrt.core.store import Store
from sdtrt.graph import onnx_graph
from sdtrt.graph.onnx_structure import graph_structure
from sdtrt.runtime.onnxruntime import OnnxRuntime
from sdtrt.sources.models import ModelSource, load_folder, resolve_model
from sdtrt.spec import FOLDERS, ValidationCase
from sdtrt.stages import export
from sdtrt.tools.validate import Tolerances, check_tensor_row, compare_case

# (preset, component, precision): a UNet in fp32 and SDXL's in fp16 (tiny's fp16 UNet takes the same path, less
# SDXL's extra inputs), SD3's and Flux's transformers, a T5 (fp16 keeps its `wo` fp32), a CLIP text encoder (its
# position ids are a non-persistent buffer, in no safetensors file), a VAE decoder (the network's encoder weights go
# unused): every component auto streams (the VAE encoder too, its fp32 graph the loaded one up to value names:
# test_the_streamed_vae_encoder_is_the_loaded_one_up_to_names). ControlNets and the other presets' denoisers (SD 2's
# upcast attention, LCM's timestep_cond, inpainting's 9 channels, the refiner's and SDXL ControlNet's extra inputs)
# run with -m slow.
CASES = [
    ("tiny", "unet", "fp32"),
    # SDXL's fp16 UNet streamed (41 s in CI22): its extra inputs and fp16 are covered by the others; run with -m slow.
    pytest.param("tiny-sdxl", "unet", "fp16", marks=pytest.mark.slow),
    # SD3's fp32 transformer (33 s in CI30, its loaded baseline built apart): Flux's takes the same streamed path.
    pytest.param("tiny-sd3", "transformer", "fp32", marks=pytest.mark.slow),
    ("tiny-flux", "transformer", "fp16"),
    ("tiny-flux", "text_encoder_2", "fp32"),
    ("tiny-flux", "text_encoder_2", "fp16"),
    ("tiny", "text_encoder", "fp16"),
    ("tiny", "vae_decoder", "fp16"),
    *(
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [
            ("tiny-controlnet", "controlnet", "fp16"),  # 20 s: the UNet's blocks, covered by tiny's UNet
            ("tiny-sd2", "unet", "fp16"),
            ("tiny-lcm", "unet", "fp16"),
            ("tiny-inpaint", "unet", "fp16"),
            ("tiny-sdxl-refiner", "unet", "fp16"),
            ("tiny-sdxl-controlnet", "controlnet", "fp16"),
            ("tiny-sdxl", "text_encoder_2", "fp16"),
            ("tiny-qwen-image", "text_encoder", "fp32"),  # Qwen2.5-VL: saved names renamed as transformers loads them
        ]
    ),
]


def nodes(model: onnx.ModelProto) -> list[tuple]:
    return [
        (n.op_type, n.domain, list(n.input), list(n.output), [onnx.helper.printable_attribute(a) for a in n.attribute])
        for n in model.graph.node
    ]


def initializers(model: onnx.ModelProto) -> list[tuple]:
    return [(t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer]


def external_layout(path) -> list[tuple[str, int, int]]:
    """(name, offset, length) of every initializer stored in the data file, in graph order."""
    out = []
    for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
        info = {e.key: e.value for e in tensor.external_data}
        if info:
            assert info["location"] == onnx_graph.data_file(path).name
            out.append((tensor.name, int(info.get("offset", 0)), int(info["length"])))
    return out


def ort_outputs(path, spec, precision: str) -> list[np.ndarray]:
    dtype = {"fp16": torch.float16}.get(precision, torch.float32)
    feeds = {k: v.numpy() for k, v in spec.sample_inputs(2, 128, 192, dtype=dtype).items()}
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def pytorch_parity_failures(path, model, spec) -> list[str]:
    """How the graph on ONNX Runtime misses the PyTorch fp32 network, by validate's tolerances for its precision."""
    network = load_folder(model, FOLDERS[spec.component])
    runtime = OnnxRuntime(path, spec, providers=["CPUExecutionProvider"])
    try:
        row = compare_case(runtime, network, spec, ValidationCase(2, 128, 192))
    finally:
        runtime.close()
    return check_tensor_row(row, Tolerances.for_precision(spec.precision), spec.label)


@pytest.mark.parametrize(("preset", "component", "precision"), CASES, ids=lambda v: str(v))
def test_streamed_export_is_the_loaded_export(preset, component, precision, loaded_store, streamed_export):
    model = resolve_model(preset)
    config = ExportConfig(precision, exporter="dynamo", component=component, weights="load")
    loaded = export.run(config, model, loaded_store)
    assert loaded.manifest["details"]["weights"] == "load"
    # Over a 1000-byte threshold the streamed weights go to .onnx.data, the layout real (multi-GB) models get.
    streamed = streamed_export(model, component, precision)  # the one test_block_parity cuts blocks from
    assert streamed.manifest["details"]["weights"] == "stream"
    assert streamed.manifest["details"]["weights_reason"] == "asked for with --weights stream"
    # Nothing stamped on a tiny preset, and its manifest says why: T5's and Flux's lists are short, the others none.
    spec = export.spec_for(model, config)
    short = "no block list is longer than the 4 copies a stamped trace traces"
    none = f"the {spec.label} lists no repeated blocks to stamp"
    assert streamed.manifest["details"]["stamped"] == {}
    assert streamed.manifest["details"]["stamped_reason"] == f"traced whole: {short if spec.repeated_blocks else none}"
    assert loaded.manifest["details"]["stamped_reason"] == (
        "traced whole: only a streamed export (--weights stream) stamps blocks"
    )
    assert "--weights stream" in streamed.manifest["reproduce"]

    want = onnx.load(str(loaded.primary))
    got = onnx.load(str(streamed.primary))
    assert nodes(got) == nodes(want)
    assert initializers(got) == initializers(want)
    assert got.graph.input == want.graph.input and got.graph.output == want.graph.output
    # onnx.save_model's layout: large initializers appended in graph order, no gaps; small ones inline.
    layout = external_layout(streamed.primary)
    offsets = [offset for _, offset, _ in layout]
    assert offsets == [sum(length for _, _, length in layout[:i]) for i in range(len(layout))]
    assert sum(length for _, _, length in layout) == onnx_graph.data_file(streamed.primary).stat().st_size
    inline = {t.name for t in got.graph.initializer} - {name for name, _, _ in layout}
    assert all(len(t.raw_data) < 1024 - 33 for t in got.graph.initializer if t.name in inline)

    # Both graphs load and run (tiny-sdxl fp16: its get_aug_embed concat of fp16 and fp32 is cast, patches.py),
    # give the same output, and that output is the PyTorch fp32 network's within the graph precision's tolerances.
    outputs = ort_outputs(streamed.primary, spec, precision), ort_outputs(loaded.primary, spec, precision)
    for a, b in zip(*outputs, strict=True):
        assert np.array_equal(a, b)
    assert pytorch_parity_failures(streamed.primary, model, spec) == []


def test_the_streamed_vae_encoder_is_the_loaded_one_up_to_names(loaded_store, streamed_export):
    """Streamed, the VAE encoder's fp32 trace numbers some values otherwise (its fp16 one is byte for byte the loaded
    one): the same nodes, wiring, scopes, types, shapes and weights (graph_structure), the same ONNX Runtime outputs,
    bit for bit."""
    model = resolve_model("tiny")
    config = ExportConfig("fp32", exporter="dynamo", component="vae_encoder", weights="load")
    loaded, streamed = export.run(config, model, loaded_store), streamed_export(model, "vae_encoder", "fp32")
    assert (loaded.manifest["details"]["weights"], streamed.manifest["details"]["weights"]) == ("load", "stream")
    assert loaded.key != streamed.key
    assert nodes(onnx.load(str(streamed.primary))) != nodes(onnx.load(str(loaded.primary)))  # not byte for byte
    structures = (graph_structure(ir.load(str(a.primary))) for a in (streamed, loaded))
    assert next(structures).differences(next(structures)) == []
    spec = export.spec_for(model, config)
    for a, b in zip(*(ort_outputs(a.primary, spec, "fp32") for a in (streamed, loaded)), strict=True):
        assert np.array_equal(a, b)
    assert pytorch_parity_failures(streamed.primary, model, spec) == []


def test_a_weight_missing_from_the_shards_fails_clearly_and_leaves_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = resolve_model("tiny")
    folder = tmp_path / "model"
    shutil.copytree(tiny.path, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    del tensors["mid_block.attentions.0.proj_out.weight"]
    save_file(tensors, weights)

    store = Store(tmp_path / "engines")
    with pytest.raises(ExportError, match=r"lack 1 weight.*mid_block\.attentions\.0\.proj_out\.weight"):
        export.run(ExportConfig(weights="stream"), ModelSource("broken", "folder", folder), store)
    assert not [p for p in (tmp_path / "engines").rglob("*") if p.is_file() and ".onnx" in p.name]


def test_auto_streams_every_network_torch_export_traces_and_keys_the_graph_not_the_path(tiny, tiny_export, monkeypatch):
    # export.run's manifest (the session's tiny UNet, auto) says why auto loaded it: its size, not an exporter asked.
    details = tiny_export.manifest["details"]
    assert details["weights"] == "load"
    assert re.fullmatch(r"3\.\d MiB of weights, under the 64\.0 MiB auto streams above.*", details["weights_reason"])
    spec = export.spec_for(tiny, ExportConfig())

    def plan(**options) -> tuple[str, str, str]:
        config = ExportConfig(**options)
        return export.exporter_for(config, spec, tiny), *export.weights_path(config, spec, tiny)

    exporter, weights, why = plan()
    assert (exporter, weights) == ("torchscript", "load"), "tiny's 3 MB UNet"
    assert re.fullmatch(r"3\.\d MiB of weights, under the 64\.0 MiB auto streams above: TorchScript's exporter.*", why)
    assert plan(exporter="dynamo")[:2] == ("dynamo", "stream")
    assert plan(weights="stream")[:2] == ("dynamo", "stream")
    with pytest.raises(ConfigError, match=r"torch\.export"):
        ExportConfig(exporter="torchscript", weights="stream")
    encoder = ExportConfig(component="vae_encoder", exporter="dynamo")  # its values numbered otherwise when streamed
    why = "torch.export's exporter traces the network without its weights"
    assert export.weights_path(encoder, export.spec_for(tiny, encoder), tiny) == ("stream", why)
    # Its streamed graph names some values otherwise than its loaded one: the loaded graph has its own key.
    keys = {
        w: export.request_for(dataclasses.replace(encoder, weights=w), tiny).key for w in ("auto", "stream", "load")
    }
    assert keys["auto"] == keys["stream"] != keys["load"]
    monkeypatch.setattr(export, "STREAM_ABOVE", 1000)  # tiny's UNet as if it were SD 1.5's
    assert plan() == ("dynamo", "stream", "torch.export's exporter traces the network without its weights")
    assert plan(weights="load") == ("dynamo", "load", "asked for with --weights load"), "auto's graph, loaded"
    assert plan(exporter="torchscript")[:2] == ("torchscript", "load")
    # The key follows the graph: the exporter that runs, never how the weights reached it.
    keys = {options: export.request_for(ExportConfig(**dict(options)), tiny).key for options in (
        (), (("weights", "load"),), (("exporter", "dynamo"),), (("exporter", "torchscript"),)
    )}  # fmt: skip
    assert len(set(keys.values())) == 2 and keys[()] == keys[(("weights", "load"),)] == keys[(("exporter", "dynamo"),)]


def test_a_vae_saved_with_the_old_attention_names_streams_as_it_loads(tmp_path, loaded_store):
    """diffusers renames a VAE's attention weights saved as query/key/value/proj_attn on load (SD 2.1-base's):
    streamed, their values reach the same graph."""
    from safetensors.torch import load_file, save_file

    tiny = resolve_model("tiny")
    folder = tmp_path / "model"
    shutil.copytree(tiny.path, folder)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    old_names = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    renamed = {
        next((key.replace(new, old) for new, old in old_names.items() if ".attentions." in key and new in key), key): v
        for key, v in load_file(weights).items()
    }
    assert len(set(renamed) - set(load_file(weights))) == 16
    save_file(renamed, weights)

    config = ExportConfig("fp16", exporter="dynamo", component="vae_decoder", weights="load")
    want = onnx.load(str(export.run(config, tiny, loaded_store).primary))  # the default case's baseline
    streamed = export.run(
        dataclasses.replace(config, weights="stream"), resolve_model(str(folder)), Store(tmp_path / "s")
    )
    got = onnx.load(str(streamed.primary))
    assert nodes(got) == nodes(want)
    assert initializers(got) == initializers(want)
