"""The LoRA weight map streams: graph initializers memory-mapped one at a time, the network's weights read one at a
time from its safetensors (no network loaded), and the map is the one fully loaded weights give."""

from __future__ import annotations

import onnx
import pytest
from onnx import numpy_helper

from sdtrt.core.config import ExportConfig, SimplifyConfig
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import FOLDERS
from sdtrt.stages import export, simplify, weight_map

from .helpers import external_copy


def loaded_map(path, model, component):
    """The map from the whole graph loaded with its weights and the whole network loaded, as it was made before."""
    return weight_map.match(
        path,
        lambda: [(i.name, numpy_helper.to_array(i)) for i in onnx.load(str(path)).graph.initializer if len(i.dims) > 1],
        lambda dtype: weight_map.lora_parameters(load_folder(model, FOLDERS[component], dtype)).items(),
    )


@pytest.mark.parametrize(
    "preset, component", [("tiny", "unet"), ("tiny-sdxl", "text_encoder_2"), ("tiny-flux", "transformer")]
)
def test_streamed_map_is_the_map_of_loaded_weights(preset, component, store, tmp_path):
    model = resolve_model(preset)
    exported = export.run(ExportConfig(component=component), model, store)
    graph = simplify.run(SimplifyConfig(check=False), exported, store)  # onnxsim packs CLIP's q/k/v: packed columns
    for path in (graph.primary, external_copy(graph, tmp_path / "external").primary):  # inline, then external data
        streamed = weight_map.build(path, model, component)
        assert streamed.mapped
        assert streamed.to_json() == loaded_map(path, model, component).to_json()
