"""UNetSpec and ShapeProfile: everything derived from unet.config, ranges checked."""

from __future__ import annotations

import pytest

from sdtrt.core.config import Range, ShapeProfile
from sdtrt.core.errors import ConfigError
from sdtrt.spec import UNetSpec

SD15 = {"in_channels": 4, "out_channels": 4, "cross_attention_dim": 768, "sample_size": 64,
        "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"]}  # fmt: skip


def test_sd15_spec_and_default_profile():
    spec = UNetSpec.from_config(SD15, vae_scale_factor=8)
    assert spec.latent_multiple == 8 and spec.pixel_multiple == 64
    profile = spec.default_profile()
    assert profile.height == Range(256, 512, 768) and profile.batch == Range(1, 1, 4)
    shapes = spec.profile_shapes(profile)
    assert shapes["sample"] == ((1, 4, 32, 32), (2, 4, 64, 64), (8, 4, 96, 96))
    assert shapes["timestep"] == ((1,), (2,), (8,))
    assert shapes["encoder_hidden_states"][2] == (8, 77, 768)
    assert spec.dynamic_axes()["sample"] == {0: "batch", 2: "height", 3: "width"}


def test_check_shapes_names_the_allowed_range():
    spec = UNetSpec.from_config(SD15, vae_scale_factor=8)
    profile = spec.default_profile()
    assert spec.check_shapes(spec.input_shapes(2, 512, 512), profile) is None
    reason = spec.check_shapes(spec.input_shapes(2, 1024, 512), profile)
    assert "outside the engine's profile (1, 4, 32, 32) .. (8, 4, 96, 96)" in reason


def test_indexed_naming():
    spec = UNetSpec.from_config(SD15, vae_scale_factor=8, io_naming="indexed")
    assert spec.input_names == ("input_0", "input_1", "input_2") and spec.output_name == "output_0"
    assert UNetSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(("text", "expected"), [("512", Range(512, 512, 512)), ("256:512:768", Range(256, 512, 768))])
def test_range_parse(text, expected):
    assert Range.parse(text, "height") == expected


@pytest.mark.parametrize("text", ["256:512", "a:b:c", ""])
def test_range_parse_rejects(text):
    with pytest.raises(ConfigError, match="MIN:OPT:MAX"):
        Range.parse(text, "height")


def test_profile_checks_order_and_grid():
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        ShapeProfile(height=Range(512, 256, 768)).check(64)
    with pytest.raises(ConfigError, match=r"width 520 is not a positive multiple of 64 pixels.*use e\.g\. 512"):
        ShapeProfile(width=Range(256, 520, 768)).check(64)
    assert ShapeProfile(batch=Range(1, 2, 4)).unet_batch() == Range(1, 4, 8)
    assert ShapeProfile(batch=Range(2, 2, 2)).unet_batch() == Range(4, 4, 4), "a static batch stays static"


def test_bf16_graphs_have_bfloat16_tensors_and_export_with_torch_export():
    import torch

    from sdtrt.core.config import ExportConfig
    from sdtrt.runtime.base import TORCH_DTYPES

    spec = UNetSpec.from_config(SD15, 8, "bf16")
    assert spec.dtype == "bfloat16" and TORCH_DTYPES[spec.dtype] is torch.bfloat16
    assert [t.dtype for t in spec.inputs()] == ["bfloat16", "float32", "bfloat16"]  # timestep stays fp32
    assert ExportConfig(precision="bf16").chosen_exporter == "dynamo"
    with pytest.raises(ConfigError, match="fp16, bf16, fp32"):
        ExportConfig(precision="int8")  # type: ignore[arg-type]
