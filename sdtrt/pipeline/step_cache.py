"""``--cache``: a step cache named in one string, turned into diffusers' own config and enabled on a pipeline.

``first-block[:THRESHOLD]``   diffusers' FirstBlockCacheConfig (default threshold 0.05, diffusers' own)
``taylorseer[:INTERVAL]``     TaylorSeerCacheConfig in lite mode (default interval 5): the output predicted between
                              full steps; its default mode predicts layers inside the blocks, which engines run whole
``magcache[:THRESHOLD]``      MagCacheConfig with diffusers' FLUX_MAG_RATIOS (Flux only; default threshold 0.06)
``deepcache[:INTERVAL]``      DeepCache on a UNet (sdtrt.DeepCache, DeepCacheSDHelper's API): a full step every INTERVAL
                              (default 3), the steps between on the shallow branch

Each runs on the split members of an engine set compiled with ``--caches`` (standins/step_cache.py,
standins/deepcache.py); the transformer caches run on the PyTorch pipeline the same way, so the two can be compared.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

from ..core.artifact import Artifact
from ..core.config import TRANSFORMER_PARTS, UNET_PARTS
from ..core.errors import ConfigError, EngineInputError
from ..spec import denoiser_component, folder_architecture
from ..spec.base import ModelConfigs
from ..spec.transformer_split import reference_problem, splits

CacheKind = Literal["first-block", "taylorseer", "magcache", "deepcache"]
DEFAULTS: dict[str, float] = {"first-block": 0.05, "taylorseer": 5, "magcache": 0.06, "deepcache": 3}
INTERVALS = ("taylorseer", "deepcache")  # the kinds whose value is a whole number of steps
SYNTAX = "first-block[:THRESHOLD], taylorseer[:INTERVAL], magcache[:THRESHOLD], deepcache[:INTERVAL] or auto[:KIND]"


@dataclass(frozen=True)
class StepCache:
    """A step cache and its one setting: a threshold (first-block, magcache) or a full-step interval (taylorseer)."""

    kind: CacheKind
    value: float

    @classmethod
    def parse(cls, text: str) -> StepCache:
        """``KIND[:VALUE]``; ConfigError, saying the syntax, for anything else."""
        kind, colon, value = text.strip().partition(":")
        if kind not in DEFAULTS:
            raise ConfigError(f"--cache {text}: unknown step cache {kind!r}; give {SYNTAX}")
        try:
            number = float(value) if colon else float(DEFAULTS[kind])
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ConfigError(f"--cache {text}: {value!r} is not a number; give {SYNTAX}")
        if kind in INTERVALS and (number < 1 or not number.is_integer()):
            raise ConfigError(f"--cache {text}: {kind} takes a whole number of steps, 1 or more")
        if number <= 0:
            raise ConfigError(f"--cache {text}: {kind} takes a threshold over 0")
        return cls(kind, number)  # type: ignore[arg-type]  # checked against DEFAULTS above

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.value:g}"

    def config(self, pipe: Any, steps: int) -> Any:
        """diffusers' config for this cache, for ``pipe`` generating ``steps`` steps."""
        import diffusers.hooks as hooks
        import torch

        if self.kind == "first-block":
            return hooks.FirstBlockCacheConfig(threshold=self.value)
        if self.kind == "taylorseer":
            # fp32 Taylor factors (diffusers' default is bf16): a predicted step is then as precise as the engines.
            return hooks.TaylorSeerCacheConfig(
                cache_interval=int(self.value), use_lite_mode=True, taylor_factors_dtype=torch.float32
            )
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return hooks.MagCacheConfig(threshold=self.value, num_inference_steps=steps, mag_ratios=FLUX_MAG_RATIOS)


def model_problem(cache: StepCache, model: ModelConfigs, name: str, from_image: bool = False) -> str | None:
    """Why ``cache`` cannot run on model ``name``'s pipeline (``from_image``: img2img or inpainting), or None."""
    if (denoiser_component(model) == "unet") != (cache.kind == "deepcache"):
        what, use = (
            ("UNet", "deepcache")
            if cache.kind != "deepcache"
            else ("transformer", "first-block, taylorseer or magcache")
        )
        return f"--cache {cache.kind} cannot run on {name}: its denoiser is a {what}; use {use}"
    architecture = folder_architecture(model, "transformer")
    if problem := reference_problem(architecture, cache.kind):
        return f"--cache {cache.kind} cannot run on {name}: {problem}"
    flux = architecture == "FluxTransformer2DModel"
    if cache.kind == "magcache" and not flux:
        return (
            "--cache magcache needs the model's magnitude ratios, which diffusers publishes for Flux.1 only: use "
            "MagCacheConfig(calibrate=True) in Python to measure them, or another --cache"
        )
    if cache.kind == "magcache" and from_image:
        return (
            "--cache magcache reads its ratios from the schedule's first step, and img2img and inpainting start "
            "later: use first-block or taylorseer"
        )
    return None


def engines_problem(cache: StepCache, members: dict[str, Artifact] | None, model: ModelConfigs) -> str | None:
    """Why ``cache`` cannot run on these engine members (None: the PyTorch pipeline), or None."""
    if members is None:
        if cache.kind == "deepcache":
            return "--cache deepcache runs on engines: pass --engine, a set compiled with `--caches deepcache`"
        if not has_enable_cache(kind := folder_architecture(model, "transformer")):
            use = "sdtrt builds no step cache for it"
            if splits(kind):
                use = "pass --engine, a set compiled with `--caches first-block`"
            return f"--cache {cache.kind}: diffusers' {kind} has no enable_cache; {use}"
        return None
    if not any(c in members for c in (UNET_PARTS if cache.kind == "deepcache" else TRANSFORMER_PARTS)):
        architecture = folder_architecture(model, "transformer")
        if cache.kind != "deepcache" and architecture and not splits(architecture):
            return f"--cache {cache.kind}: sdtrt builds no step cache for a {architecture}; generate without --cache"
        kind = "deepcache" if cache.kind == "deepcache" else "first-block"
        return (
            f"--cache {cache.kind}: the engine set has no split members for it; recompile it with `sdtrt compile "
            f"--caches {kind}`"
        )
    return None


def has_enable_cache(architecture: str) -> bool:
    """Whether diffusers' transformer class of this name has CacheMixin's enable_cache (SD3's and Z-Image's have
    not)."""
    import diffusers
    from diffusers.models.cache_utils import CacheMixin

    return issubclass(getattr(diffusers, architecture), CacheMixin)


def enable_step_cache(pipe: Any, cache: StepCache, steps: int) -> None:
    """Enable ``cache`` on the pipeline's transformer (engines or PyTorch) or, DeepCache, its engine UNet;
    EngineInputError where it cannot run."""
    if cache.kind == "deepcache":
        from .deepcache import DeepCache

        helper = DeepCache(pipe)
        helper.set_params(cache_interval=int(cache.value))
        helper.enable()
        return
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise EngineInputError(f"--cache {cache.label} skips a transformer's blocks, and this pipeline has none")
    if not hasattr(transformer, "enable_cache"):  # diffusers' SD3Transformer2DModel has no CacheMixin; engines do
        raise EngineInputError(f"--cache {cache.label}: diffusers' {type(transformer).__name__} has no enable_cache")
    transformer.enable_cache(cache.config(pipe, steps))


def opens_cache_context(pipeline: type) -> bool:
    """Whether a diffusers pipeline class opens a cache context around its transformer calls (diffusers 0.42.1:
    FluxPipeline, FLUX.2 [klein]'s and Qwen-Image's, "cond" and "uncond"), read from its ``__call__``'s code: the
    cache hooks need one, and the others (FLUX.1 img2img, Kontext, Fill, Control, ControlNet, SD3, FLUX.2 [dev],
    Z-Image) open none."""
    return "cache_context" in inspect.unwrap(pipeline.__call__).__code__.co_names


def true_cfg(pipe: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``pipe`` with ``kwargs`` runs true CFG: a negative prompt and true_cfg_scale over 1, where
    the pipeline takes one (its transformer then runs twice a step, the negative prompt's second)."""
    scale = inspect.signature(pipe.__call__).parameters.get("true_cfg_scale")
    negative = kwargs.get("negative_prompt") is not None or kwargs.get("negative_prompt_embeds") is not None
    return scale is not None and negative and kwargs.get("true_cfg_scale", scale.default) > 1


def cache_call_context(pipe: Any, kwargs: dict[str, Any]) -> AbstractContextManager[Any]:
    """The context a call of ``pipe`` with ``kwargs`` runs in: with a step cache on in a pipeline that opens no cache
    context, its transformer's "cond" (what the hooks need; the pipeline calls the transformer once a step, so this is
    the reference its engines match), else none. EngineInputError, before any network runs, for true CFG there: its
    two transformer calls a step would share one cache state."""
    transformer: Any = getattr(pipe, "transformer", None)
    if not getattr(transformer, "is_cache_enabled", False) or opens_cache_context(type(pipe)):
        return contextlib.nullcontext()
    if true_cfg(pipe, kwargs):
        raise EngineInputError(
            f"a step cache with true CFG (a negative prompt, true_cfg_scale > 1) in diffusers' {type(pipe).__name__}, "
            "which opens no cache context: both transformer calls a step would share one cache state; leave out the "
            "negative prompt or true_cfg_scale, or the cache"
        )
    return transformer.cache_context("cond")


def disable_step_cache(pipe: Any) -> None:
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None and getattr(transformer, "is_cache_enabled", False):
        transformer.disable_cache()
    if getattr(getattr(pipe, "unet", None), "deepcache", None) is not None:
        pipe.unet.disable_deepcache()


def split_calls(pipe: Any) -> tuple[int, int] | None:
    """(full evaluations, steps) the engines' split members have run so far: a transformer's other-blocks engine and
    its embedders' (which every cached step runs), a UNet's deep pass and its deep + shallow passes; None while no
    split member is open (PyTorch, or before a cache first ran)."""
    if (split := getattr(getattr(pipe, "transformer", None), "split", None)) is not None:
        return int(split.rest.calls), int(split.embed.calls)
    if (split := getattr(getattr(pipe, "unet", None), "split", None)) is not None:
        return int(split.deep.calls), int(split.deep.calls + split.shallow.calls)
    return None
