"""EngineUNet: the module a diffusers pipeline calls instead of its UNet2DConditionModel.

It keeps the UNet's call signature, ``config``, ``dtype`` and ``device`` and its output class, so
pipelines and schedulers cannot tell the difference, and it refuses inputs the engine was not built
for instead of silently dropping them. With DeepCache on (``sdtrt.DeepCache``), its steps run on the set's DeepCache
members instead (standins/deepcache.py); with FreeU on (``enable_freeu``), on the set's FreeU build (``unet_freeu``,
spec/unet_freeu.py), fed the factors. A UNet engine compiled with an IP-Adapter is fed the image embeds the pipeline
passes and the per-layer scales ``set_ip_adapter_scale`` set (standins/ip_adapter.py); zeros without an IP image.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from ..core.config.components import FREEU_MEMBER
from ..core.errors import ArtifactError, EngineInputError
from ..lora.refit import LoraNetwork
from ..runtime import Runtime
from ..spec import UNetSpec, residual_names
from ..spec.denoiser import IMAGE_EMBEDS
from .base import EngineModule
from .deepcache import DeepCacheRun, SplitUNet, Timestep, deepcache_problem
from .ip_adapter import NO_IP_ADAPTER, IPAdapterInputs
from .peft_adapters import PeftAdapters

if TYPE_CHECKING:
    from ..lora.refit import EngineLoras

# Keyword inputs of UNet2DConditionModel.forward; those an engine's graph has are fed to it, a given
# one it lacks is refused.
OPTIONAL_INPUTS = (
    "class_labels",
    "timestep_cond",
    "attention_mask",
    "added_cond_kwargs",
    "down_block_additional_residuals",
    "mid_block_additional_residual",
    "down_intrablock_additional_residuals",
    "encoder_attention_mask",
)


def normalise_timestep(timestep: torch.Tensor | float | int, batch: int, device: torch.device) -> torch.Tensor:
    """Any timestep a scheduler hands over (number, 0-d, [1] or [B]; int or float) → float32 [B]."""
    t = torch.as_tensor(timestep, device=device).to(torch.float32).flatten()
    if t.numel() == 1:
        return t.expand(batch).contiguous()
    if t.numel() != batch:
        raise EngineInputError(f"timestep has {t.numel()} values for a batch of {batch}; pass one or one per sample")
    return t


class EngineUNet(EngineModule, PeftAdapters, UNet2DConditionModel, LoraNetwork, IPAdapterInputs):
    """A UNet2DConditionModel stand-in backed by a Runtime (ONNX Runtime, TensorRT, TorchScript)."""

    def __init__(
        self,
        runtime: Runtime,
        config: dict[str, Any],
        dtype: torch.dtype | None = None,
        loras: EngineLoras | None = None,
    ) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, UNetSpec):
            raise ArtifactError(f"this is a {runtime.spec.component} engine; a pipeline's unet needs a UNet engine")
        self.spec: UNetSpec = runtime.spec
        self.runtime = runtime
        if "projection_class_embeddings_input_dim" in config:
            # SDXL pipelines check their time ids against add_embedding.linear_1.in_features.
            width = config["projection_class_embeddings_input_dim"]
            self.add_embedding = SimpleNamespace(linear_1=SimpleNamespace(in_features=width))
        self.loras = loras
        self.split: SplitUNet | None = None  # the DeepCache members, once opened (use_parts)
        self._open_parts: Callable[[], dict[str, Runtime]] | None = None
        self.deepcache: DeepCacheRun | None = None  # while DeepCache is on
        self.freeu_engine: Runtime | None = None  # the FreeU build, once opened (use_freeu)
        self._open_freeu: Callable[[], Runtime] | None = None
        self.freeu: torch.Tensor | None = None  # FreeU's factors [s1, s2, b1, b2] while it is on
        self._member_loras: Callable[[str, Runtime], EngineLoras] | None = None  # use_members'
        self.init_ip_adapter()

    def use_members(
        self, open_parts: Callable[[], dict[str, Runtime]] | None, open_freeu: Callable[[], Runtime] | None,
        member_loras: Callable[[str, Runtime], EngineLoras],
    ) -> None:  # fmt: skip
        """Run DeepCache on the members ``open_parts`` opens and FreeU on the build ``open_freeu`` opens, each when
        first enabled (until then the pipeline holds the UNet once); ``member_loras``: an opened member's LoRAs,
        which change with this UNet's."""
        self._open_parts, self._open_freeu, self._member_loras = open_parts, open_freeu, member_loras

    def opened_split(self) -> SplitUNet | None:
        """The DeepCache members, opened on the first call (None: the set has none)."""
        if self.split is None and self._open_parts is not None:
            parts = self._open_parts()
            self.split = SplitUNet(parts)
            self._runtimes += self.split.runtimes()
            self._take_loras(parts)
        return self.split

    def enable_deepcache(self, cache_interval: int, cache_branch_id: int, step_of: Callable[[Timestep], int]) -> None:
        """DeepCache on the engines, a full step every ``cache_interval`` (``step_of``: a timestep's step, as the
        ``deepcache`` package counts them); refused without the members or at another branch.
        sdtrt.DeepCache(pipe) is the way in, with DeepCacheSDHelper's calls."""
        if self.freeu is not None:
            raise EngineInputError("DeepCache: FreeU is on, and the DeepCache members have no FreeU: disable it first")
        if problem := deepcache_problem(self.opened_split(), cache_branch_id):
            raise EngineInputError(f"DeepCache: {problem}")
        assert self.split is not None  # deepcache_problem said so
        self.deepcache = DeepCacheRun(self.split, cache_interval, step_of)

    def disable_deepcache(self) -> None:
        """Back to the whole UNet engine on every step."""
        self.deepcache = None

    def _reset_stateful_cache(self) -> None:
        """What diffusers' pipelines call on their components as a call ends (maybe_free_model_hooks): DeepCache's
        next step is a new call's first, and full."""
        if self.deepcache is not None:
            self.deepcache.reset()

    def enable_freeu(self, s1: float, s2: float, b1: float, b2: float) -> None:
        """FreeU with these factors, as UNet2DConditionModel.enable_freeu: the steps run on the set's FreeU build
        (``sdtrt compile --freeu``); refused on a set without it or with DeepCache on."""
        if self._open_freeu is None:
            raise EngineInputError(
                "enable_freeu: FreeU rescales features inside the UNet's up blocks, and this engine set has no FreeU "
                "build: recompile it with `sdtrt compile --freeu` (Python: compile_model(..., freeu=True))"
            )
        if self.deepcache is not None:
            raise EngineInputError("enable_freeu: DeepCache is on, and its members have no FreeU: disable it first")
        # diffusers' up blocks run FreeU only when all four factors are truthy: else the plain UNet, and the FreeU
        # build need not open.
        self.freeu = torch.tensor([s1, s2, b1, b2], dtype=torch.float32) if s1 and s2 and b1 and b2 else None
        if self.freeu is not None and self.freeu_engine is None:
            self.freeu_engine = self._open_freeu()
            self._runtimes.append(self.freeu_engine)
            self._take_loras({FREEU_MEMBER: self.freeu_engine})

    def disable_freeu(self) -> None:
        """Back to the plain UNet engine."""
        self.freeu = None

    def _take_loras(self, members: dict[str, Runtime]) -> None:
        """The LoRAs of members just opened (DeepCache's, the FreeU build), changed with the UNet's from now on."""
        assert self._member_loras is not None  # use_members said how
        self.take_member_loras([self._member_loras(component, runtime) for component, runtime in members.items()])

    def _load_ip_adapter_weights(self, *args: Any, **kwargs: Any) -> None:
        raise EngineInputError(f"UNet._load_ip_adapter_weights: {NO_IP_ADAPTER}")

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor,
        *args: Any,
        cross_attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> UNet2DConditionOutput | tuple[torch.Tensor]:
        if args:
            raise EngineInputError(f"EngineUNet takes extra inputs by keyword only; got {len(args)} positional")
        unknown = sorted(set(kwargs) - set(OPTIONAL_INPUTS))
        if unknown:
            raise TypeError(f"EngineUNet.forward() got unexpected keyword arguments {unknown}")
        self.check_call_scale((cross_attention_kwargs or {}).get("scale"), "cross_attention_kwargs['scale']")
        if (cross_attention_kwargs or {}).get("ip_adapter_masks") is not None:
            raise EngineInputError("ip_adapter_masks: masked IP-Adapter images are not built into engines yet")
        spec = self.spec
        t = normalise_timestep(timestep, sample.shape[0], sample.device)
        tensors = [sample, t, encoder_hidden_states, *self._extras(sample, kwargs)]
        if self.deepcache is not None:
            out = self.deepcache(dict(zip(spec.canonical_inputs, tensors, strict=True)), timestep)
        elif self.freeu is not None:
            engine = self.freeu_engine
            assert engine is not None  # enable_freeu opened it
            feeds = dict(zip(engine.spec.input_names, [*tensors, self.freeu.to(sample.device)], strict=True))
            out = engine.run(feeds)[engine.spec.output_names[0]]
        else:
            out = self.runtime.run(dict(zip(spec.input_names, tensors, strict=True)))[spec.output_name]
        out = out.to(sample.device, sample.dtype)
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)

    def _extras(self, sample: torch.Tensor, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The graph's extra inputs, in its order, from the keywords the pipeline passed; refuses the rest."""
        given = {k: v for k, v in kwargs.items() if v is not None}
        values = dict(given.pop("added_cond_kwargs", None) or {})
        if "timestep_cond" in given:
            values["timestep_cond"] = given.pop("timestep_cond")
        if self.spec.residuals:
            down = given.pop("down_block_additional_residuals", None)
            values |= self._residuals(sample, down, given.pop("mid_block_additional_residual", None))
        if self.spec.ip_layers:
            values |= self.ip_adapter_inputs(values.pop(IMAGE_EMBEDS, None), sample)
        wanted = self.spec.canonical_inputs[3:]
        if given:
            problem = f"cannot take {sorted(given)}"
        elif missing := [name for name in wanted if name not in values]:
            problem = f"needs {missing}, which the pipeline did not pass"
        elif extra := sorted(set(values) - set(wanted)):
            problem = f"has no input for {extra}"
        else:
            return [values[name] for name in wanted]
        hint = (" (ControlNet residuals need a UNet compiled from a model with a controlnet/ folder)" if "residual"
                in problem else f" ({NO_IP_ADAPTER})" if IMAGE_EMBEDS in problem else "")  # fmt: skip
        raise EngineInputError(
            f"this UNet engine takes {', '.join(wanted) or 'no inputs'} beyond sample, timestep and "
            f"encoder_hidden_states; it {problem}{hint}"
        )

    def _residuals(self, sample: torch.Tensor, down: Any, mid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """ControlNet residuals by input name; zeros when no ControlNet runs (adding zero changes nothing)."""
        names = residual_names(len(self.spec.residuals))
        if down is None and mid is None:
            batch, _, height, width = sample.shape
            return {
                name: sample.new_zeros(batch, channels, height // k, width // k)
                for name, (channels, k) in zip(names, self.spec.residuals, strict=True)
            }
        tensors = (*(down or ()), mid)
        if len(tensors) != len(names) or mid is None:
            raise EngineInputError(
                f"this UNet engine takes {len(names) - 1} down-block residuals and a mid-block one; got "
                f"{len(tensors) - 1 if mid is not None else len(tensors)} and {'one' if mid is not None else 'none'}"
            )
        return dict(zip(names, tensors, strict=True))
