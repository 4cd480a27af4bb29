"""Stage keys are stable: a store built before a refactor still gives cache hits after it.

The keys below were computed by the tree before the modules moved into layer folders (bca8638); a key depends on
the stage, its version, the config's key fields and values, the inputs and the environment, never on where a class
lives. If a change here is intended (a stage's output changed), bump that stage's VERSION and update the key.
"""

from __future__ import annotations

import pytest

from sdtrt import ExportConfig, OrtBuildConfig, QuantizeConfig, SimplifyConfig, TrtBuildConfig, WrapConfig
from sdtrt.core.stage_request import StageRequest
from sdtrt.stages import build_ort, build_trt, engine_set, export, quantize, simplify, wrap

KEYS = {
    "export": (export, ExportConfig(), "6cec41044102002c788abc7b98378b2adccd5ee2b40eb03f3bad5b4fc3d53350"),
    "export-fp32-vae": (
        export,
        ExportConfig(precision="fp32", component="vae_decoder"),
        "e6bb5544c3080ebf595279fc829e7cacbcaa82966849812169bb96991f87e88d",
    ),
    "simplify": (simplify, SimplifyConfig(), "7a5b5cca0022fa4f09dcac517c265bff0cf4c257bf79de24f27f58ea1076f9ec"),
    "quantize": (quantize, QuantizeConfig(), "6ac49437a455a3cf08a6128652bfeb77a9dfe2607a3a8058095a67c08881f7f2"),
    "build-ort": (build_ort, OrtBuildConfig(), "bbd451b1c19859fb3e0c4a297672d79c2924c61a3c0562c50c74176db91cf040"),
    "build-trt": (build_trt, TrtBuildConfig(), "03c8a9478185950e52d28c302bfa8a82979231ce467e992fa707d881e25e093d"),
    "build-trt-refit-o5": (
        build_trt,
        TrtBuildConfig(refittable=True, optimization_level=5, weight_streaming=True),
        "e3fd5db379fb17d7b5416e7abcb7934bdb108e8e6c116bd1b8916934cd75d199",
    ),
    "build-trt-rtx": (
        build_trt,
        TrtBuildConfig(product="tensorrt-rtx"),
        "4341a8b00a9bff8f93d98b40e14479297e3cc2c1a54965b4ec2a8351558f33b3",
    ),
    "wrap": (wrap, WrapConfig(), "60acb38ef731913d2b7cd7ecb0a21f81d474247a999b1a4ba3bd9d90e3207a18"),
    "set": (
        engine_set,
        engine_set.EngineSetConfig(components=("unet", "vae_decoder")),
        "e83d09a5ad1a9cc165bbdceb298c154df50e4fbee60ad8b75ceee36f4db42274",
    ),
}


@pytest.mark.parametrize("case", KEYS)
def test_a_stage_key_is_what_the_tree_before_the_move_computed(case):
    stage, config, key = KEYS[case]
    request = StageRequest(stage.STAGE, stage.VERSION, config, [{"digest": "input"}], {"python": "3.11"})
    assert request.key == key
