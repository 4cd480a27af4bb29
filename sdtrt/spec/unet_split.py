"""The graph contracts of a UNet cut for DeepCache: the whole UNet that also hands out its deep feature, and the
shallow branch that takes it back in.

DeepCache (Ma et al. 2023; the ``deepcache`` package's DeepCacheSDHelper) runs the whole UNet every ``cache_interval``
steps and keeps the feature that enters one of the last up blocks' layers from below; on the steps between only the
shallow branch runs: conv_in and the time embedding, the down path up to the cut's mirror, the up path from the cut
with the kept feature, conv_out. ``cache_branch_id`` names the cut, three per up block counted from the output end:
up block ``id // 3``, its layer ``id % 3`` counted from the block's end (a layer past the block's first means the whole
block). A monolithic engine has no cut, so an engine set compiled with ``caches=("deepcache",)`` holds the UNet twice
more: ``unet_deep`` (the whole UNet, plus the feature) and ``unet_shallow`` (the branch, the feature in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision
from ..core.errors import ConfigError
from .base import NAMED_OUTPUT, ModelConfigs, TensorSpec, scaled_axis
from .unet import UNetSpec

DEEP_FEATURE = "deep_feature"
# DeepCacheSDHelper's default branch, the shallowest cut (the most a step skips); the one compile builds.
DEFAULT_BRANCH = 0
BRANCHES_PER_BLOCK = 3  # DeepCache numbers three cuts per up block, whatever its layer count
# The block classes whose layers (a resnet, then a transformer where it has one) the parts run one by one.
DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D")


@dataclass(frozen=True)
class Branch:
    """A DeepCache cut: up block ``block`` and its layer ``layer``, both counted from the output end."""

    block: int
    layer: int

    @classmethod
    def of(cls, branch_id: int) -> Branch:
        return cls(*divmod(branch_id, BRANCHES_PER_BLOCK))


def branch_problem(unet_config: dict[str, Any], branch_id: int) -> str | None:
    """Why this UNet has no DeepCache branch ``branch_id``, or None."""
    branches = BRANCHES_PER_BLOCK * len(unet_config["up_block_types"])
    if not 0 <= branch_id < branches:
        return f"cache_branch_id {branch_id} is not a branch of this UNet: it has {branches}, 0 to {branches - 1}"
    return None


def split_problem(unet_config: dict[str, Any], controlnet: bool) -> str | None:
    """Why this UNet cannot be cut for DeepCache, or None."""
    if controlnet:
        return "the DeepCache members take no ControlNet residuals yet; compile without --caches"
    blocks = [*unet_config["down_block_types"], *unet_config["up_block_types"]]
    if odd := sorted({b for b in blocks if b not in DOWN_BLOCKS + UP_BLOCKS}):
        return f"the DeepCache members run {', '.join(DOWN_BLOCKS + UP_BLOCKS)} layer by layer, not {', '.join(odd)}"
    return None


def branch_reads_text(unet_config: dict[str, Any], branch_id: int) -> bool:
    """Whether a block the shallow branch runs has cross-attention: the down blocks before the cut's mirror (and the
    mirror, where the branch runs some of its layers), the cut's up block and those after it."""
    branch, ups = Branch.of(branch_id), unet_config["up_block_types"]
    downs = unet_config["down_block_types"][: branch.block + 1 if branch.layer else branch.block]
    return any(name.startswith("CrossAttn") for name in [*downs, *ups[len(ups) - 1 - branch.block :]])


def deep_feature(unet_config: dict[str, Any], branch_id: int) -> tuple[int, int]:
    """(channels, downscale) of the feature that enters the cut from below, as UNet2DConditionModel builds its up
    blocks: up block ``b`` from the end works at the latent size / 2**b with block_out_channels[b] channels and
    takes the block below's output (channels[b + 1], the mid block's for the deepest) into its first layer."""
    branch, channels = Branch.of(branch_id), list(unet_config["block_out_channels"])
    per_block = unet_config.get("layers_per_block", 2)
    layers = (per_block if isinstance(per_block, int) else per_block[branch.block]) + 1
    whole_block = branch.layer >= layers - 1
    width = channels[min(branch.block + 1, len(channels) - 1)] if whole_block else channels[branch.block]
    return width, 2**branch.block


@dataclass(frozen=True)
class UNetPartSpec(UNetSpec):
    """One of the UNet's DeepCache members: the UNet's contract, plus the deep feature at the branch's cut."""

    cache_branch_id: int = DEFAULT_BRANCH
    feature_channels: int = 0
    feature_scale: int = 1

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> UNetPartSpec:
        return cls.at_branch(model, DEFAULT_BRANCH, precision, io_naming)

    @classmethod
    def at_branch(
        cls, model: ModelConfigs, branch_id: int, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> UNetPartSpec:
        """This member cut at DeepCache's branch ``branch_id`` (compile builds DEFAULT_BRANCH's: for_model)."""
        config = model.unet_config()
        if problem := split_problem(config, model.has("controlnet")) or branch_problem(config, branch_id):
            raise ConfigError(f"cannot cut this UNet for DeepCache: {problem}")
        whole = UNetSpec.for_model(model, precision, io_naming)
        fields = {f.name: getattr(whole, f.name) for f in dataclasses.fields(whole)}
        return cls(**fields, **cls.branch_fields(config, branch_id))

    @classmethod
    def branch_fields(cls, unet_config: dict[str, Any], branch_id: int) -> dict[str, Any]:
        """The fields the branch decides."""
        channels, scale = deep_feature(unet_config, branch_id)
        return {"cache_branch_id": branch_id, "feature_channels": channels, "feature_scale": scale}

    @property
    def feature_shape(self) -> tuple[int | str, ...]:
        k = self.feature_scale
        return ("batch", self.feature_channels, scaled_axis("height", k), scaled_axis("width", k))


@dataclass(frozen=True)
class UNetDeepSpec(UNetPartSpec):
    """The whole UNet, run on DeepCache's full steps: its output, and the feature the steps between reuse."""

    component: ClassVar[Component] = "unet_deep"
    label: ClassVar[str] = "UNet's deep pass (DeepCache)"
    canonical_outputs: ClassVar[tuple[str, ...]] = (NAMED_OUTPUT, DEEP_FEATURE)

    def outputs(self) -> list[TensorSpec]:
        return [*super().outputs(), TensorSpec(self.output_names[1], self.dtype, self.feature_shape)]


@dataclass(frozen=True)
class UNetShallowSpec(UNetPartSpec):
    """The shallow branch, run on the steps between: the UNet's inputs and the kept deep feature, its output."""

    component: ClassVar[Component] = "unet_shallow"
    label: ClassVar[str] = "UNet's shallow branch (DeepCache)"

    # Whether a block on the branch has cross-attention; where none has (SDXL's outer blocks), the text is no input:
    # the exporter drops an input the graph never reads.
    reads_text: bool = True

    @classmethod
    def branch_fields(cls, unet_config: dict[str, Any], branch_id: int) -> dict[str, Any]:
        return super().branch_fields(unet_config, branch_id) | {"reads_text": branch_reads_text(unet_config, branch_id)}

    @property
    def canonical_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        names = super().canonical_inputs
        return names if self.reads_text else tuple(n for n in names if n != "encoder_hidden_states")

    def extra_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        return [*super().extra_tensors(), (DEEP_FEATURE, self.feature_shape)]


PART_CLASSES: tuple[type[UNetPartSpec], ...] = (UNetDeepSpec, UNetShallowSpec)
