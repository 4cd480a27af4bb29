"""Qwen2.5-VL's vision tower (``model.visual`` of a Qwen2_5_VLForConditionalGeneration, the text encoder of the
Qwen-Image-Edit pipelines): its graph contract.

The processor cuts each image into patches (``[patches, C*T*P*P]``, 2×2 neighbours adjacent) and a grid
``(t, h, w)``; the tower embeds each patch, runs its blocks with 2D rotary angles, windowed attention in most blocks
and attention over each frame in ``fullatt_block_indexes``, and merges each 2×2 group into one image embedding.
What depends on the grid alone is reckoned outside the graph (``grid_inputs``, transformers' own helpers): the patch
order that makes each window contiguous, the rotary angles, and which window and which frame each patch belongs to.
The graph takes the patches in that order and masks attention from the two segment ids, so it runs any grid as one
batch-free sequence (transformers splits it by ``cu_seqlens.tolist()``, which no graph can); the caller restores the
processor's order of the merged embeddings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..core.config import Component, IONaming, Precision, Range, ShapeProfile
from ..core.families import QWEN_EDIT_IMAGES, QWEN_EDIT_VISION_AREA
from .base import FOLDERS, GraphSpec, ModelConfigs, TensorSpec

if TYPE_CHECKING:
    import torch

# Qwen2.5-VL's processor (its preprocessor_config.json, which the Qwen-Image-Edit checkpoints' processor/ folders
# keep): (min_pixels, max_pixels), the resized image's bounds.
CHECKPOINT_PIXELS = (3136, 12845056)


class VisionGrid(NamedTuple):
    """What a grid gives the tower's graph besides the patches (spec docstring), and the orders between them."""

    order: torch.Tensor  # patch index, window-contiguous → the processor's
    restore: torch.Tensor  # merged token index: the processor's order from the graph's
    cos: torch.Tensor  # [patches, head_dim] fp32, in the graph's order
    sin: torch.Tensor
    window_segments: torch.Tensor  # [patches] int32: the window each patch attends within
    frame_segments: torch.Tensor  # [patches] int32: the frame each patch attends within (full-attention blocks)


@dataclass(frozen=True)
class QwenVisionTowerSpec(GraphSpec):
    """``pixel_values [vision_patches, C*T*P*P]`` in window order, the rotary ``cos``/``sin`` and the segment ids
    (each of window and frame that a block attends within) → ``image_embeds [vision_tokens, out_hidden_size]``
    (vision_tokens = patches / merge²), in window order. A profile's height and width are the processor's resized
    image (multiples of patch × merge), its batch the number of images."""

    component: ClassVar[Component] = "vision_encoder"
    label: ClassVar[str] = "Qwen2.5-VL vision tower"
    architecture: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"
    reads_pixels: ClassVar[bool] = True
    canonical_outputs: ClassVar[tuple[str, ...]] = ("image_embeds",)
    fp16_problem: ClassVar[str] = (
        "Qwen2.5-VL is a bf16 model (Qwen-Image-Edit ships it in bf16) of the Qwen family whose activations overflow "
        "fp16 (transformers pull request 33312, on Qwen2-VL)"
    )
    fp16_fallback: ClassVar[Precision] = "bf16"

    hidden_size: int = 1280
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    rope_theta: float = 10000.0
    # Whether some block attends within windows, some over each frame (fullatt_block_indexes): a graph takes the
    # segment ids of the attention its blocks run, no other (an exporter drops an input no block reads).
    window_blocks: bool = True
    frame_blocks: bool = True
    # The pixels the model's processor resizes an image within (processor_pixels; the checkpoints' by default).
    min_pixels: int = CHECKPOINT_PIXELS[0]
    max_pixels: int = CHECKPOINT_PIXELS[1]
    # The pipeline's condition images for the tower: about this many pixels each, up to this many a call (the Plus
    # pipeline's three 384² ones; QwenImageEditPipeline's one ~1024²).
    condition_area: int = 1024 * 1024
    condition_images: int = 1

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> QwenVisionTowerSpec:
        """From the text encoder's ``vision_config`` (transformers' defaults where it leaves a field out)."""
        from transformers import Qwen2_5_VLVisionConfig

        stored = model.component_config(FOLDERS[cls.component])["vision_config"]
        config: dict[str, Any] = Qwen2_5_VLVisionConfig(**stored).to_dict()
        fields = ("hidden_size", "num_heads", "out_hidden_size", "in_channels", "patch_size", "temporal_patch_size",
                  "spatial_merge_size", "window_size")  # fmt: skip
        full = [index in config["fullatt_block_indexes"] for index in range(config["depth"])]
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=1, **{f: config[f] for f in fields},
            rope_theta=float(config["rope_parameters"]["rope_theta"]), window_blocks=not all(full),
            frame_blocks=any(full), **tower_fields(model),
        )  # fmt: skip

    @property
    def canonical_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        segments = {"window_segments": self.window_blocks, "frame_segments": self.frame_blocks}
        return ("pixel_values", "cos", "sin", *(name for name, used in segments.items() if used))

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def pixel_multiple(self) -> int:
        return self.patch_size * self.spatial_merge_size  # the processor resizes to these (smart_resize's factor)

    def unread_parameters(self, config: Mapping[str, Any], names: Collection[str]) -> frozenset[str]:
        """Everything but the tower: the language model and its head."""
        return frozenset(n for n in names if not n.startswith(("visual.", "model.visual.")))

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        patches = batch * (height_px // self.patch_size) * (width_px // self.patch_size)
        return {"vision_patches": patches, "vision_tokens": patches // self.spatial_merge_size**2}

    def output_shapes(self, input_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        patches = input_shapes[self.input_names[0]][0]
        return {self.output_names[0]: (patches // self.spatial_merge_size**2, self.out_hidden_size)}

    def inputs(self) -> list[TensorSpec]:
        pixels, cos, sin, *segments = self.input_names
        head_dim = self.hidden_size // self.num_heads
        return [
            TensorSpec(pixels, self.dtype, ("vision_patches", self.patch_values)),
            TensorSpec(cos, "float32", ("vision_patches", head_dim)),  # the rotary angles stay fp32, as transformers'
            TensorSpec(sin, "float32", ("vision_patches", head_dim)),
            *(TensorSpec(name, "int32", ("vision_patches",)) for name in segments),
        ]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_names[0], self.dtype, ("vision_tokens", self.out_hidden_size))]

    def batch_range(self, profile: ShapeProfile) -> Range:
        return profile.batch  # one image a prompt

    def default_profile(self) -> ShapeProfile:
        """The Edit pipelines' condition image: about 1024² pixels (their calculate_dimensions), which the processor
        rounds to 28-pixel multiples within its min and max pixels (transformers' smart_resize). The checkpoints'
        processors set max_pixels 12845056 (Qwen2.5-VL's preprocessor_config.json), so it is not resized: 5184 to
        5580 patches over aspect ratios 1:3 to 3:1, a square 1024² image 1036² (5476), the most held by a 1064²
        square (5776), the smallest image 56² (16); transformers' class default, 28² × 1280, gives 4860 to 5084 (980²
        tuned, 1008² the most). The Plus pipeline's up to three 384² images: their patches together, a 392² one
        tuned. tests/test_qwen_image_edit.py holds this (smart_resize here) to transformers' smart_resize."""
        multiple, sizes = self.pixel_multiple, edit_condition_sizes(self.condition_area)
        resized = [smart_resize(h, w, multiple, self.min_pixels, self.max_pixels) for w, h in sizes]
        most = max(height * width for height, width in resized) // self.patch_size**2 * self.condition_images
        high = math.ceil(math.sqrt(most) / self.spatial_merge_size) * multiple  # a square of at least that many
        low = max(multiple, math.ceil(math.sqrt(self.min_pixels) / multiple) * multiple)
        side = Range(low, resized[0][0], high)
        return ShapeProfile(Range(1, 1, 1), side, side)

    def member_profile(self, profile: ShapeProfile) -> ShapeProfile:
        """In a set, the default profile whatever the set's: its images are the processor's of the ~1024² condition
        image, not of the output's size, which the set's height and width are; its batch is the set's (an image a
        prompt)."""
        return dataclasses.replace(self.default_profile(), batch=profile.batch)

    def image_tokens(self) -> Range:
        """The merged tokens one image of the default profile puts in a prompt, at its smallest, tuned and largest
        size (4:1369:1444 for Qwen2.5-VL's patches and merge): what an Edit prompt holds besides its text."""
        profile = self.default_profile()
        sizes = zip(profile.height, profile.width, strict=True)
        return Range(*(self.axis_sizes(1, height, width)["vision_tokens"] for height, width in sizes))

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, dtype: torch.dtype | None = None,
        tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Random patches of ``batch`` images of that size, and their grid's inputs."""
        import torch

        grid_thw = torch.tensor([[1, height_px // self.patch_size, width_px // self.patch_size]] * batch)
        grid = self.grid_inputs(grid_thw)
        gen = torch.Generator().manual_seed(seed)
        pixels = torch.randn(int(grid.order.numel()), self.patch_values, generator=gen).to(dtype or torch.float32)
        return self.feeds(pixels[grid.order], grid)

    def feeds(self, ordered_pixels: torch.Tensor, grid: VisionGrid) -> dict[str, torch.Tensor]:
        """The graph's inputs by name: patches already in the graph's order, the grid's angles and the segments its
        blocks attend within."""
        values = {"pixel_values": ordered_pixels, "cos": grid.cos, "sin": grid.sin}
        values |= {"window_segments": grid.window_segments, "frame_segments": grid.frame_segments}
        names = zip(self.input_names, self.canonical_inputs, strict=True)
        return {name: values[canonical] for name, canonical in names}

    def grid_inputs(self, grid_thw: torch.Tensor) -> VisionGrid:
        """What the tower reckons from its grid before its blocks run, as Qwen2_5_VisionTransformerPretrainedModel
        does (transformers' vision_utils helpers and rotary module), the patches reordered into windows."""
        import torch
        from transformers import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionRotaryEmbedding
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

        config = Qwen2_5_VLVisionConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads,
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta},
        )  # fmt: skip
        merge, unit = self.spatial_merge_size, self.spatial_merge_size**2
        positions = get_vision_position_ids(grid_thw, merge)
        window_index, cu_windows = get_vision_window_index(grid_thw, merge, self.window_size, self.patch_size)
        order = (window_index[:, None] * unit + torch.arange(unit)).flatten()
        cos, sin = Qwen2_5_VLVisionRotaryEmbedding(config)(torch.empty(0), positions)
        frames = get_vision_cu_seqlens(grid_thw).long()  # frames stay contiguous in window order
        return VisionGrid(
            order, torch.argsort(window_index), cos[order].float(), sin[order].float(),
            segments(cu_windows.long()), segments(frames),
        )  # fmt: skip


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) as Qwen2-VL's image processor resizes an image: sides rounded to ``factor``, then scaled into
    ``min_pixels``..``max_pixels`` at its aspect ratio (transformers' smart_resize, written out: a spec imports no
    transformers before a request is checked, and transformers imports torch)."""
    height_bar, width_bar = round(height / factor) * factor, round(width / factor) * factor
    if height_bar * width_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        return max(factor, math.floor(height / beta / factor) * factor), max(
            factor, math.floor(width / beta / factor) * factor
        )
    if height_bar * width_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return height_bar, width_bar


def condition_tokens(model: ModelConfigs) -> Range:
    """One condition image's vision tokens in an Edit folder's prompt (QwenVisionTowerSpec.image_tokens) by its
    processor and its tower's patch and merge sizes, read from the configs alone (no transformers)."""
    stored = model.component_config(FOLDERS["vision_encoder"]).get("vision_config", {})
    sizes = {name: stored[name] for name in ("patch_size", "spatial_merge_size") if name in stored}
    tower = QwenVisionTowerSpec(precision="fp32", io_naming="named", vae_scale_factor=1, **sizes, **tower_fields(model))
    return tower.image_tokens()


def processor_pixels(model: ModelConfigs) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the model's processor (``processor/``: the image processor in a
    processor_config.json as transformers 5 saves it, which transformers reads first, else preprocessor_config.json
    as the checkpoints keep it), the checkpoints' where it names none."""
    if not model.is_pipeline:
        return CHECKPOINT_PIXELS
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        path = model.path / "processor" / name
        config = json.loads(path.read_text()) if path.is_file() else {}
        if key:
            config = config.get(key, {})
        if not config:
            continue
        size = config.get("size") or {}
        low = config.get("min_pixels") or size.get("shortest_edge") or CHECKPOINT_PIXELS[0]
        high = config.get("max_pixels") or size.get("longest_edge") or CHECKPOINT_PIXELS[1]
        return int(low), int(high)
    return CHECKPOINT_PIXELS


def tower_fields(model: ModelConfigs) -> dict[str, Any]:
    """What a model folder says of the tower's images: its processor's pixels (processor_pixels) and, in an Edit
    pipeline folder, its condition images (QWEN_EDIT_VISION_AREA, QWEN_EDIT_IMAGES)."""
    low, high = processor_pixels(model)
    pipeline = model.pipeline_class() if model.is_pipeline else ""
    if pipeline not in QWEN_EDIT_IMAGES:
        return {"min_pixels": low, "max_pixels": high}
    return {"min_pixels": low, "max_pixels": high, "condition_area": QWEN_EDIT_VISION_AREA[pipeline],
            "condition_images": QWEN_EDIT_IMAGES[pipeline]}  # fmt: skip


@functools.cache
def edit_condition_sizes(area: int = 1024 * 1024) -> tuple[tuple[int, int], ...]:
    """QwenImageEditPipeline's condition image sizes (width, height) at aspect ratios 1:3 to 3:1, a square's first:
    its calculate_dimensions of ``area`` pixels (1024²; the Plus pipeline's tower's 384²), written out here (a spec
    is made before diffusers is imported: the CLI refuses a request first; tests/test_qwen_image_edit.py holds these
    to diffusers' function)."""
    ratios = [1.0] + [math.exp(math.log(3) * (i / 1000 - 1)) for i in range(2001)]
    return tuple(condition_size(area, ratio) for ratio in ratios)


def condition_size(area: int, ratio: float) -> tuple[int, int]:
    """The (width, height) the Edit pipelines resize an image of aspect ratio ``ratio`` (width / height) to for about
    ``area`` pixels (their calculate_dimensions: 1024² for the VAE, the Plus pipeline's 384² for the vision tower)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def segments(boundaries: torch.Tensor) -> torch.Tensor:
    """Each position's segment number (int32) from cumulative boundaries ``[0, b1, …, n]``."""
    import torch

    lengths = boundaries[1:] - boundaries[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
