"""EngineTransformer: what SD3's and Flux's pipelines call instead of their SD3Transformer2DModel /
FluxTransformer2DModel.

It keeps diffusers' call (the union of both forwards' keyword arguments), ``config``, ``dtype``, ``device``
and the output class, feeds the engine exactly what the pipeline passed (the graph was exported from the
real forward: Flux's ``timestep / 1000`` and its ``guidance`` go in as given), and refuses what the
engine's graph cannot do: skip-layer guidance, a LoRA scale, ControlNet block samples.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import (
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    ZImageTransformer2DModel,
)
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ..core.errors import ArtifactError, EngineInputError
from ..lora.refit import EngineLoras, LoraNetwork
from ..runtime import Runtime
from ..spec import FluxTransformerSpec, TransformerSpec
from .base import EngineModule
from .controlnet_flux import controlnet_feeds
from .ip_adapter import NO_IP_ADAPTER, IPAdapterInputs
from .peft_adapters import PeftAdapters
from .step_cache import SplitTransformer, cache_problem, check_hooked
from .unet import normalise_timestep

# Keyword arguments of the diffusers forwards that change what the network computes, and why an engine
# cannot: each given (not None) is refused with its reason.
REFUSED = {
    "skip_layers": "SD3's skip-layer guidance (skip_guidance_layers) runs the transformer without some of its "
    "layers, and an engine's layers are fixed at build: leave skip_guidance_layers unset, or run this pipeline "
    "on PyTorch (load_pipeline without an engine)",
    "block_controlnet_hidden_states": "SD3 ControlNet block samples need a transformer graph with their inputs, "
    "which sdtrt does not export: run this pipeline on PyTorch (load_pipeline without an engine)",
    **dict.fromkeys(
        ("controlnet_block_samples", "controlnet_single_block_samples"),
        "Flux ControlNet block samples need a transformer graph with their inputs, which a FLUX.1 transformer "
        "compiled from a model with a FluxControlNetModel (a controlnet/ folder) has, and this engine's has not",
    ),
}
IGNORED_DEFAULTS = {"controlnet_blocks_repeat": False}  # Flux's: meaningful only with ControlNet samples


class EngineTransformer(EngineModule, PeftAdapters, LoraNetwork, CacheMixin, IPAdapterInputs):
    """An SD3Transformer2DModel / FluxTransformer2DModel stand-in backed by a transformer engine.

    ``EngineTransformer(runtime, …)`` makes the subclass that is an instance of the class the engine's
    graph was exported from (its spec's kind).
    """

    def __new__(cls, runtime: Runtime, *args: Any, **kwargs: Any) -> EngineTransformer:
        if cls is EngineTransformer:
            cls = STANDINS.get(runtime.spec.architecture, EngineSD3Transformer)
        return super().__new__(cls)

    def __init__(
        self, runtime: Runtime, config: dict[str, Any], dtype: torch.dtype | None = None,
        loras: EngineLoras | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, TransformerSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a pipeline's transformer needs a transformer engine"
            )
        self.spec: TransformerSpec = runtime.spec
        self.runtime = runtime
        self.loras = loras  # set_loras puts LoRA weights into the engine, from its base weights
        self.split: SplitTransformer | None = None  # the part engines step caches chain (opened_split)
        self._open_parts: Callable[[], dict[str, Runtime]] | None = None  # use_parts'
        self._part_loras: Callable[[str, Runtime], EngineLoras] | None = None
        self._in_cache_context = False
        self._bare_call: dict[str, torch.Tensor] = {}  # the last cached call outside any cache context's inputs
        self.init_ip_adapter()

    def use_parts(
        self, open_parts: Callable[[], dict[str, Runtime]], part_loras: Callable[[str, Runtime], EngineLoras]
    ) -> None:
        """Run step caches (enable_cache) on the part engines of the same transformer that ``open_parts`` opens, at
        the first enable_cache (standins/step_cache.py); ``part_loras``: a part's LoRAs, which change with the whole
        engine's."""
        self._open_parts, self._part_loras = open_parts, part_loras

    def opened_split(self) -> SplitTransformer | None:
        """The part engines, opened on the first call (None: the set has none): their blocks and head become this
        stand-in's transformer_blocks and proj_out, where diffusers' hooks go, and they take the LoRAs it runs."""
        if self.split is None and self._open_parts is not None and self._part_loras is not None:
            parts = self._open_parts()
            self.split = SplitTransformer(parts)
            self._runtimes += self.split.runtimes()
            self.take_member_loras([self._part_loras(c, runtime) for c, runtime in parts.items()])
            self.transformer_blocks, self.proj_out = self.split.blocks, self.split.head
        return self.split

    def enable_cache(self, config: Any) -> None:
        """diffusers' ``enable_cache``: FirstBlockCacheConfig, MagCacheConfig and TaylorSeerCacheConfig (lite mode)
        run on the engines of a set compiled with caches; any other config, or none of those parts, is refused."""
        if self.is_cache_enabled:
            raise EngineInputError(f"{type(self).__name__}.enable_cache: a cache is on already: disable_cache() first")
        if problem := cache_problem(config, self._open_parts is not None, self.spec.architecture):
            raise EngineInputError(f"{type(self).__name__}.enable_cache: {problem}")
        split = self.opened_split()
        assert split is not None  # cache_problem said the set has the parts
        self._bare_call = {}
        CacheMixin.enable_cache(self, config)
        if problem := check_hooked(split, config):
            CacheMixin.disable_cache(self)
            raise EngineInputError(f"{type(self).__name__}.enable_cache: {problem}")

    @contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """diffusers' ``cache_context``, remembered: SD3's pipeline calls the transformer outside any, and the cache
        hooks need one (forward opens "cond" for it: SD3 runs both guidance halves in one batch)."""
        outer, self._in_cache_context = self._in_cache_context, True
        try:
            with CacheMixin.cache_context(self, name, **kwargs):
                yield
        finally:
            self._in_cache_context = outer

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        timestep: torch.Tensor | float | int | None = None,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | float | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        attention = dict(joint_attention_kwargs or {})
        ip_embeds = attention.pop("ip_adapter_image_embeds", None) if self.spec.ip_layers else None
        samples = self._controlnet_samples(kwargs, hidden_states)
        self._refuse(attention, kwargs)
        batch, device = hidden_states.shape[0], hidden_states.device
        # FLUX.2's pipelines pass integer positions per batch row, which its forward reads from the first row.
        img_ids, txt_ids = (ids[0] if ids is not None and ids.ndim == 3 else ids for ids in (img_ids, txt_ids))
        given = {
            "hidden_states": hidden_states,
            "encoder_hidden_states": encoder_hidden_states,
            "pooled_projections": pooled_projections,
            "timestep": None if timestep is None else normalise_timestep(timestep, batch, device),
            "img_ids": None if img_ids is None else img_ids.float(),
            "txt_ids": None if txt_ids is None else txt_ids.float(),
            "guidance": None if guidance is None else normalise_timestep(guidance, batch, device),
        }
        if self.spec.ip_layers:
            given |= self.ip_adapter_inputs(ip_embeds, hidden_states)
        given |= samples
        wanted = self.spec.canonical_inputs
        present = {name: value for name, value in given.items() if value is not None}
        if missing := [name for name in wanted if name not in present]:
            raise EngineInputError(
                f"this {self.spec.architecture} engine needs {missing}, which the pipeline did not pass"
            )
        if extra := [name for name in present if name not in wanted]:
            hint = " (FLUX.1-schnell has no guidance embedding)" if "guidance" in extra else ""
            raise EngineInputError(f"this {self.spec.architecture} engine takes no {', '.join(extra)}{hint}")
        if self.is_cache_enabled:
            out = self._cached_step(present)
        else:
            feeds = {graph: present[name] for graph, name in zip(self.spec.input_names, wanted, strict=True)}
            out = self.runtime.run(feeds)[self.spec.output_name]
        out = out.to(device, hidden_states.dtype)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    def _cached_step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step on the part engines, where the cache hooks decide which of them run."""
        assert self.split is not None  # enable_cache refuses a set without parts
        if self._in_cache_context:
            return self.split(inputs)
        last, self._bare_call = self._bare_call, inputs
        if (
            last
            and all(torch.equal(last[n], inputs[n]) for n in ("timestep", "hidden_states"))
            and not torch.equal(last["encoder_hidden_states"], inputs["encoder_hidden_states"])
        ):  # true CFG's second call: the same step's latents, the negative prompt's
            self._bare_call = {}
            raise EngineInputError(
                "the pipeline called the cached transformer twice at one step, another prompt's the second, outside "
                "any cache context (true CFG: a negative prompt with true_cfg_scale > 1): both calls would share one "
                "cache state; leave out the negative prompt or true_cfg_scale, or the cache"
            )
        with self.cache_context("cond"):
            return self.split(inputs)

    def _controlnet_samples(self, kwargs: dict[str, Any], hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """A FLUX.1 ControlNet set's block samples by input name, taken out of ``kwargs``; {} for other engines (whose
        ``_refuse`` refuses the samples)."""
        if not (isinstance(self.spec, FluxTransformerSpec) and any(self.spec.controlnet_samples)):
            return {}
        blocks = kwargs.pop("controlnet_block_samples", None)
        singles = kwargs.pop("controlnet_single_block_samples", None)
        repeat = kwargs.pop("controlnet_blocks_repeat", False)
        return controlnet_feeds(self.spec, hidden_states, blocks, singles, repeat)

    def _refuse(self, attention: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """EngineInputError for a feature the engine cannot run (``attention``: the joint_attention_kwargs it does not
        take); TypeError for a keyword no forward takes."""
        self.check_call_scale(attention.pop("scale", None), "joint_attention_kwargs['scale']")
        if "ip_adapter_image_embeds" in attention:
            raise EngineInputError(f"joint_attention_kwargs['ip_adapter_image_embeds']: {NO_IP_ADAPTER}")
        if attention:
            raise EngineInputError(
                f"joint_attention_kwargs {sorted(attention)} change the engine's attention, which is fixed at build: "
                "run this pipeline on PyTorch (load_pipeline without an engine) to use them"
            )
        for name, value in kwargs.items():
            if name in REFUSED:
                if value is not None:
                    raise EngineInputError(f"{name}: {REFUSED[name]}")
            elif name not in IGNORED_DEFAULTS:
                raise TypeError(f"{type(self).__name__}.forward() got an unexpected keyword argument '{name}'")
            elif value != IGNORED_DEFAULTS[name]:
                raise EngineInputError(
                    f"{name}={value!r} needs ControlNet block samples, which an engine takes none of"
                )


# EngineModule's `to` and `save_pretrained` (first in the MRO) are the ones called.
class EngineSD3Transformer(EngineTransformer, SD3Transformer2DModel):
    """A transformer engine standing in for SD3's / SD3.5's SD3Transformer2DModel (with diffusers' CacheMixin, which
    SD3's class lacks, from EngineTransformer: step caches run on its engines as on Flux's)."""


class EngineFluxTransformer(EngineTransformer, FluxTransformer2DModel):
    """A transformer engine standing in for Flux.1's FluxTransformer2DModel."""


class EngineFlux2Transformer(EngineTransformer, Flux2Transformer2DModel):
    """A transformer engine standing in for FLUX.2's Flux2Transformer2DModel."""


class EngineZImageTransformer(EngineTransformer, ZImageTransformer2DModel):
    """A transformer engine standing in for Z-Image's ZImageTransformer2DModel: diffusers' call (lists of per-sample
    latents and captions in, a list of latents out) over the engine's padded batch (ZImageTransformerSpec), made by
    the diffusers class's own patchify and undone by its own unpatchify, which read the config alone."""

    def __init__(self, runtime: Runtime, config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(runtime, config, *args, **kwargs)
        self.in_channels = self.out_channels = config["in_channels"]  # what the pipeline and unpatchify read

    def forward(  # type: ignore[override]
        self, x: list[Any], t: torch.Tensor, cap_feats: list[Any], return_dict: bool = True,
        controlnet_block_samples: dict[int, torch.Tensor] | None = None, siglip_feats: list[Any] | None = None,
        image_noise_mask: list[list[int]] | None = None, patch_size: int = 2, f_patch_size: int = 1,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> Transformer2DModelOutput | tuple[list[torch.Tensor]]:  # fmt: skip
        self._refuse(dict(joint_attention_kwargs or {}), {"controlnet_block_samples": controlnet_block_samples})
        if isinstance(x[0], list) or siglip_feats is not None or image_noise_mask is not None:
            raise EngineInputError(
                "this Z-Image transformer engine takes one image and one caption per sample (ZImagePipeline's "
                "call), not Z-Image Omni's image lists and SigLIP features: run that pipeline on PyTorch"
            )
        if (patch_size, f_patch_size) != (self.config.all_patch_size[0], self.config.all_f_patch_size[0]):
            raise EngineInputError(
                f"patch_size={patch_size}, f_patch_size={f_patch_size}: the engine was built for the model's first "
                f"({self.config.all_patch_size[0]}, {self.config.all_f_patch_size[0]})"
            )
        patches, captions, sizes, image_ids, caption_ids, image_pad, caption_pad = (
            ZImageTransformer2DModel.patchify_and_embed(self, list(x), list(cap_feats), patch_size, f_patch_size)
        )
        if len({p.shape for p in patches}) > 1:
            raise EngineInputError("a Z-Image transformer engine takes latents of one size per call; split the batch")
        lengths = torch.tensor([len(c) for c in captions])
        # Each caption's ids past its padded length are diffusers' leftovers (its forward cuts them off).
        caption_ids = [ids[: len(c)] for ids, c in zip(caption_ids, captions, strict=True)]
        pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
        device = x[0].device
        given = {
            "hidden_states": torch.stack(patches), "timestep": normalise_timestep(t, len(x), device),
            "encoder_hidden_states": pad(captions), "img_ids": torch.stack(image_ids).int(),
            "txt_ids": pad(caption_ids).int(), "img_pad": torch.stack(image_pad).int(),
            "txt_pad": pad(caption_pad).int(),
        }  # fmt: skip
        given["txt_mask"] = (torch.arange(given["txt_pad"].shape[1]) < lengths[:, None]).int()
        feeds = {
            graph: given[name] for graph, name in zip(self.spec.input_names, self.spec.canonical_inputs, strict=True)
        }
        out = self.runtime.run(feeds)[self.spec.output_name].to(device, x[0].dtype)
        samples = ZImageTransformer2DModel.unpatchify(self, list(out.unbind(0)), sizes, patch_size, f_patch_size)
        return Transformer2DModelOutput(sample=samples) if return_dict else (samples,)


class EngineQwenImageTransformer(EngineTransformer, QwenImageTransformer2DModel):
    """A transformer engine standing in for Qwen-Image's QwenImageTransformer2DModel. The rotary embedding's angles
    are the graph's inputs (spec QwenImageTransformerSpec): computed here with diffusers' own QwenEmbedRope from the
    pipeline's ``img_shapes`` and the text length, as the forward computes them."""

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None = None, timestep: torch.Tensor | None = None,
        img_shapes: list[Any] | None = None, guidance: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None, controlnet_block_samples: Any = None,
        additional_t_cond: torch.Tensor | None = None, return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:  # fmt: skip
        self._refuse(dict(attention_kwargs or {}), {"controlnet_block_samples": controlnet_block_samples})
        given = {"guidance": guidance, "additional_t_cond": additional_t_cond}
        if unsupported := [name for name, value in given.items() if value is not None]:
            raise EngineInputError(f"this {self.spec.architecture} engine takes no {', '.join(unsupported)}")
        if img_shapes is None or timestep is None:
            raise EngineInputError(f"this {self.spec.architecture} engine needs img_shapes and timestep")
        batch, tokens = encoder_hidden_states.shape[:2]
        device = hidden_states.device
        img_freqs, txt_freqs = self.rotary()(img_shapes, max_txt_seq_len=tokens, device=torch.device("cpu"))
        mask = torch.ones(batch, tokens) if encoder_hidden_states_mask is None else encoder_hidden_states_mask
        inputs = (
            hidden_states, encoder_hidden_states, mask.int(), normalise_timestep(timestep, batch, device),
            torch.view_as_real(img_freqs).float(), torch.view_as_real(txt_freqs).float(),
        )  # fmt: skip
        if self.is_cache_enabled:  # the part engines, where the cache hooks decide which run
            out = self._cached_step(dict(zip(self.spec.canonical_inputs, inputs, strict=True)))
        else:
            out = self.runtime.run(dict(zip(self.spec.input_names, inputs, strict=True)))[self.spec.output_name]
        out = out.to(device, hidden_states.dtype)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    def rotary(self) -> Any:
        """diffusers' rotary embedding module of this transformer's config (no weights: its tables are computed)."""
        if getattr(self, "_rotary", None) is None:
            from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

            if self.config.get("use_layer3d_rope") or self.config.get("zero_cond_t"):
                raise EngineInputError(
                    f"this {self.spec.architecture} uses Qwen-Image-Edit's or Layered's conditioning (zero_cond_t, "
                    "use_layer3d_rope), which its engine's graph does not take: run it on PyTorch"
                )
            self._rotary = QwenEmbedRope(theta=10000, axes_dim=list(self.config.axes_dims_rope), scale_rope=True)
        return self._rotary


# The engine's architecture (its spec's) → the stand-in class that is an instance of that diffusers class.
STANDINS: dict[str, type[EngineTransformer]] = {
    pytorch.__name__: standin
    for pytorch, standin in (
        (SD3Transformer2DModel, EngineSD3Transformer), (FluxTransformer2DModel, EngineFluxTransformer),
        (Flux2Transformer2DModel, EngineFlux2Transformer), (ZImageTransformer2DModel, EngineZImageTransformer),
        (QwenImageTransformer2DModel, EngineQwenImageTransformer),
    )
}  # fmt: skip
