"""Text encoder and VAE stand-ins: what a diffusers pipeline calls instead of CLIPTextModel, T5EncoderModel and
AutoencoderKL.

Like EngineUNet, each keeps the module's call signature, ``config``, ``dtype``, ``device`` and output
classes, and refuses what its engine cannot do instead of silently doing something else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from ..core.errors import ArtifactError, EngineInputError
from ..core.progress import console
from ..lora.refit import LoraNetwork
from ..runtime import Runtime
from ..spec import T5EncoderSpec, TextEncoderSpec

if TYPE_CHECKING:
    from ..lora.refit import EngineLoras
    from ..sources.models import ModelSource


# Attention processors that compute what an engine's graph computes (plain scaled dot-product
# attention, fused or sliced or not): setting one changes nothing. Others (IP-Adapter, custom) would.
DEFAULT_ATTENTION = (
    "AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "XFormersAttnProcessor", "SlicedAttnProcessor",
    "AttnAddedKVProcessor", "AttnAddedKVProcessor2_0", "SlicedAttnAddedKVProcessor", "XFormersAttnAddedKVProcessor",
)  # fmt: skip
ENGINE_RECORD = "sdtrt_engine.json"  # beside a saved stand-in's PyTorch files: the engines it ran on


class EngineModule(torch.nn.Module):
    """The diffusers module protocol every stand-in shares: ``config``, ``dtype``, ``device``, ``to``, saving.

    A stand-in subclasses this first and then the class it stands in for (UNet2DConditionModel,
    AutoencoderKL, CLIPTextModel, ControlNetModel, …) without building that class's layers, so
    ``isinstance`` checks and diffusers' save/load dispatch see the real class. Methods that would change
    the network refuse with an EngineInputError naming the feature; those an engine already does are no-ops.
    """

    def __init__(self, config: Any, dtype: torch.dtype, runtimes: list[Runtime | None]) -> None:
        torch.nn.Module.__init__(self)  # not the diffusers/transformers class's: no layers
        teach_pipelines_standins()
        from diffusers.configuration_utils import ConfigMixin, FrozenDict

        if isinstance(self, ConfigMixin):
            self._internal_dict = FrozenDict(config)  # what ConfigMixin.config reads
        else:
            self.config = config  # transformers keeps its config as an attribute
        self._dtype = dtype  # the pipeline's: fp16 engines still hand fp32 callers fp32 outputs
        self._runtimes = [r for r in runtimes if r is not None]
        self.model_folder: Path | None = None  # the component's PyTorch folder (what save_pretrained writes)
        self.engine_paths: dict[str, Path] = {}  # component → artifact directory it runs on

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._runtimes[0].device if self._runtimes else torch.device("cpu")

    @property
    def label(self) -> str:
        return f"{type(self).__name__} ({', '.join(sorted(self.engine_paths)) or 'engine'})"

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """A dtype sets the one tensors are handed over in (as ``load_pipeline(dtype=…)``); a device must be the
        engine's.

        The engine computes in the precision it was compiled with either way: an fp16 engine comes from
        ``sdtrt compile --precision fp16``.
        """
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and not same_device(device, self.device):
            raise EngineInputError(
                f"{type(self).__name__} runs on its engine's device ({self.device}) and cannot move to {device}: "
                f"compile an engine for {device.type} (sdtrt compile --target …) and load that"
            )
        if dtype is not None:
            if not dtype.is_floating_point:
                raise EngineInputError(f"{type(self).__name__} hands over floating-point tensors, not {dtype}")
            self._dtype = dtype
            torch.nn.Module.to(self, dtype=dtype)  # buffers (e.g. EngineControlNet's anchor) follow
        return self

    def half(self, *args: Any) -> Any:
        return self.to(torch.float16)

    def float(self, *args: Any) -> Any:
        return self.to(torch.float32)

    # Attention: an engine's graph computes plain attention, fused by the compiler where it can.
    @property
    def attn_processors(self) -> dict[str, Any]:
        return {}

    def set_attn_processor(self, processor: Any) -> None:
        processors = processor.values() if isinstance(processor, dict) else [processor]
        if custom := sorted({type(p).__name__ for p in processors} - set(DEFAULT_ATTENTION)):
            raise EngineInputError(
                f"{', '.join(custom)} changes the attention an engine's graph computes, which is fixed at build: "
                "run this pipeline on PyTorch (load_pipeline without an engine) to use it"
            )

    def set_default_attn_processor(self) -> None:
        """A no-op: the default attention is what the engine computes."""

    def fuse_qkv_projections(self) -> None:
        """A no-op: the engine's compiler fuses the projections itself."""

    def unfuse_qkv_projections(self) -> None:
        """A no-op, as ``fuse_qkv_projections``."""

    def enable_layerwise_casting(self, *args: Any, **kwargs: Any) -> None:
        raise EngineInputError(
            "enable_layerwise_casting stores PyTorch weights in a smaller dtype; an engine's weights are built in: "
            "compile a smaller engine instead (sdtrt compile --precision fp16)"
        )

    def enable_group_offload(self, *args: Any, **kwargs: Any) -> None:
        raise EngineInputError(
            "enable_group_offload moves PyTorch weights between devices; an engine's weights stay on its device"
        )

    def save_pretrained(self, save_directory: str | os.PathLike[str], variant: str | None = None, **_: Any) -> None:
        """The component's PyTorch files as they were, plus a record of its engines (``load_pipeline`` reads it).

        ``DiffusionPipeline.from_pretrained`` on the saved folder gives the PyTorch pipeline; ``load_pipeline``
        gives this engine pipeline again. Written to a temporary folder first: never half a folder.
        """
        if self.model_folder is None:
            raise ArtifactError(
                f"{type(self).__name__} was made without its model folder, so it has no PyTorch files to save: "
                "make the pipeline with sdtrt.load_pipeline(model, engine)"
            )
        target = Path(save_directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
            staged = Path(tmp) / target.name
            shutil.copytree(self.model_folder, staged)
            if variant:
                for weights in [*staged.glob("*.safetensors"), *staged.glob("*.bin")]:
                    if len(weights.name.split(".")) == 2:  # no variant yet: name.fp16.safetensors
                        weights.rename(weights.with_suffix(f".{variant}{weights.suffix}"))
            record = {"engines": {c: str(p.resolve()) for c, p in self.engine_paths.items()}}
            (staged / ENGINE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)


def pytorch_class(module: EngineModule) -> type:
    """The diffusers/transformers class a stand-in stands in for (UNet2DConditionModel, AutoencoderKL, …)."""
    return next(c for c in type(module).__mro__ if c.__module__.split(".")[0] in ("diffusers", "transformers"))


def teach_pipelines_standins() -> None:
    """Make every diffusers pipeline record a stand-in as its PyTorch class and carry it over in ``from_pipe``.

    diffusers records each component's class in the pipeline config (``model_index.json`` once saved) from
    its module and name (``_fetch_class_library_tuple``), which for a stand-in is ``sdtrt.standins.unet.EngineUNet``:
    a saved folder that ``DiffusionPipeline.from_pretrained`` cannot load. And ``from_pipe`` keeps a
    ModelMixin component only when its ``type()`` is exactly the class the new pipeline names, so it drops
    the stand-ins and fails ("expected …, but only … were passed"). Both in diffusers'
    pipelines/pipeline_utils.py. So ``register_modules`` (every constructor goes through it) records
    stand-ins as their PyTorch class, and ``from_pipe`` passes on by name the stand-ins the new pipeline
    takes by ``isinstance``, as its warning asks callers to. Pipelines without stand-ins are unchanged.
    Installed once, when the first stand-in is made.
    """
    from diffusers import DiffusionPipeline
    from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple

    register_modules = DiffusionPipeline.register_modules
    if getattr(register_modules, "knows_standins", False):
        return
    from_pipe = DiffusionPipeline.__dict__["from_pipe"].__func__

    @wraps(register_modules)
    def register_standins_as_pytorch(self: Any, **modules: Any) -> None:
        register_modules(self, **modules)
        standins = {name: m for name, m in modules.items() if isinstance(m, EngineModule)}
        self.register_to_config(**{n: _fetch_class_library_tuple(pytorch_class(m)) for n, m in standins.items()})

    @wraps(from_pipe)
    def from_pipe_with_standins(cls: Any, pipeline: Any, **kwargs: Any) -> Any:
        wanted = cls._get_signature_types()
        for name, module in pipeline.components.items():
            classes = tuple(t for t in wanted.get(name, ()) if isinstance(t, type))
            if isinstance(module, EngineModule) and name not in kwargs and isinstance(module, classes):
                kwargs[name] = module
        return from_pipe(cls, pipeline, **kwargs)

    register_standins_as_pytorch.knows_standins = True  # type: ignore[attr-defined]
    DiffusionPipeline.register_modules = register_standins_as_pytorch  # type: ignore[attr-defined]
    DiffusionPipeline.from_pipe = classmethod(from_pipe_with_standins)  # type: ignore[attr-defined]


def same_device(wanted: torch.device, actual: torch.device) -> bool:
    """``cuda`` means the current CUDA device, as torch's own ``.to("cuda")`` does."""
    return wanted.type == actual.type and (wanted.index is None or wanted.index == actual.index)


def saved_engines(folder: Path) -> dict[str, Path]:
    """component → artifact directory, from the records stand-ins' ``save_pretrained`` left in a pipeline folder."""
    out: dict[str, Path] = {}
    for record in sorted(folder.glob(f"*/{ENGINE_RECORD}")):
        out |= {c: Path(p) for c, p in json.loads(record.read_text())["engines"].items()}
    return out


class PenultimateOnly(tuple):
    """``hidden_states`` of a text encoder engine: it has the penultimate layer's, the one ``clip_skip=1`` reads."""

    def __getitem__(self, index: Any) -> Any:
        if index in (-2, len(self) - 2):
            return super().__getitem__(index)
        raise EngineInputError(
            "this text encoder engine keeps the penultimate hidden state only (clip_skip=1), "
            f"not hidden_states[{index}]"
        )


class _TextModel(torch.nn.Module):
    """Just the part of ``CLIPTextModel.text_model`` pipelines reach into: ``final_layer_norm``."""

    def __init__(self, norm: torch.nn.Module | None) -> None:
        super().__init__()
        self.norm = norm

    def final_layer_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            raise EngineInputError("clip_skip needs the text model's final layer norm, which its weights file lacks")
        return self.norm.to(hidden.device, hidden.dtype)(hidden)


class EngineTextEncoder(EngineModule, LoraNetwork):
    """A CLIPTextModel / CLIPTextModelWithProjection stand-in backed by a text encoder engine.

    ``EngineTextEncoder(runtime, …)`` makes the subclass that is an instance of the class the engine's
    graph stands for: with a projection (``text_embeds``, SDXL's second encoder) or without.
    """

    def __new__(cls, runtime: Runtime, *args: Any, **kwargs: Any) -> EngineTextEncoder:
        if cls is EngineTextEncoder:
            projected = getattr(runtime.spec, "pooled_name", None) == "text_embeds"
            cls = EngineCLIPTextModelWithProjection if projected else EngineCLIPTextModel
        return super().__new__(cls)

    def __init__(
        self, runtime: Runtime, config: Any, final_layer_norm: torch.nn.Module | None,
        dtype: torch.dtype | None = None, loras: EngineLoras | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, TextEncoderSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a pipeline's text_encoder needs a text encoder engine"
            )
        self.spec = runtime.spec
        self.runtime = runtime
        # Pipelines apply the text model's final layer norm to hidden_states[-2] themselves (clip_skip).
        self.text_model = _TextModel(final_layer_norm)
        self.loras = loras

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None, return_dict: bool = True, **kwargs: Any,
    ) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        from transformers.models.clip.modeling_clip import CLIPTextModelOutput

        if attention_mask is not None:
            raise EngineInputError("this text encoder engine takes no attention_mask (SD's CLIP uses none)")
        hidden, pooled, penultimate = (
            self.runtime.run({self.spec.input_names[0]: input_ids})[name].to(input_ids.device, self._dtype)
            for name in self.spec.output_names
        )
        layers = self.config.num_hidden_layers
        hidden_states = PenultimateOnly((None,) * (layers - 1) + (penultimate, None))
        if self.spec.pooled_name == "text_embeds":
            out: Any = CLIPTextModelOutput(text_embeds=pooled, last_hidden_state=hidden, hidden_states=hidden_states)
        else:
            out = BaseModelOutputWithPooling(
                last_hidden_state=hidden, pooler_output=pooled, hidden_states=hidden_states
            )
        return out if return_dict else out.to_tuple()


# transformers types `to` and `save_pretrained` differently; EngineModule's (first in the MRO) are the ones called.
class EngineCLIPTextModel(EngineTextEncoder, CLIPTextModel):  # type: ignore[misc]
    """A text encoder engine standing in for a CLIPTextModel."""


class EngineCLIPTextModelWithProjection(EngineTextEncoder, CLIPTextModelWithProjection):  # type: ignore[misc]
    """A text encoder engine standing in for a CLIPTextModelWithProjection."""


class EngineT5(EngineModule, T5EncoderModel):  # type: ignore[misc]
    """A T5EncoderModel stand-in (SD3's text_encoder_3, Flux's text_encoder_2) backed by a T5 engine.

    Its graph is T5 as the pipelines call it: token ids in, ``last_hidden_state`` out, no attention mask.
    """

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, T5EncoderSpec):
            raise ArtifactError(f"this is a {runtime.spec.component} engine; a T5 text encoder needs a T5 engine")
        self.spec = runtime.spec
        self.runtime = runtime
        self.loras = None  # LoRAs on T5: none of the formats sdtrt reads target it

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | None = None,
        return_dict: bool = True, **kwargs: Any,
    ) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutput

        refused = {
            "attention_mask": attention_mask is not None,
            "inputs_embeds": inputs_embeds is not None,
            "output_hidden_states": bool(output_hidden_states),
        }
        if given := [name for name, on in refused.items() if on]:
            raise EngineInputError(
                f"this T5 engine takes token ids alone and gives last_hidden_state alone (as SD3's and Flux's "
                f"pipelines call T5), not {', '.join(given)}"
            )
        spec = self.spec
        hidden = self.runtime.run({spec.input_names[0]: input_ids})[spec.output_names[0]]
        out = BaseModelOutput(last_hidden_state=hidden.to(input_ids.device, self._dtype))
        return out if return_dict else out.to_tuple()


class EngineHalf(torch.nn.Module):
    """One half of a VAE on an engine (encoder + quant conv, or post-quant conv + decoder, as exported)."""

    def __init__(self, runtime: Runtime, fallback: PyTorchHalf) -> None:
        super().__init__()
        self.runtime = runtime
        self.fallback = fallback  # for tiles below the engine's profile
        self.said_fallback = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the engine; an edge tile smaller than the profile through the PyTorch half instead.

        Padding such a tile up to the profile would join the padding into the decoder's GroupNorm statistics
        (seen: edge pixels off by up to 3.0 at 800 px on tiny); the PyTorch half gives diffusers' own result.
        """
        spec = self.runtime.spec
        low_h, low_w = self.smallest_input()
        height, width = x.shape[-2:]
        if height < low_h or width < low_w:
            if not self.said_fallback:  # once per VAE half
                self.said_fallback = True
                console.print(
                    f"[yellow]note:[/] a {spec.component} tile of {height}×{width} is below the engine's smallest "
                    f"input {low_h}×{low_w}, so such tiles run on the PyTorch VAE; to keep every tile on the engine, "
                    "build the VAE with a smaller --height/--width minimum or pick a size whose tiles fit"
                )
            return self.fallback(x)
        return self.runtime.run({spec.input_names[0]: x})[spec.output_names[0]].to(x.device, x.dtype)

    def smallest_input(self) -> tuple[int, int]:
        """The smallest input height and width the engine's profile takes (in latents for the decoder)."""
        profile = getattr(self.runtime, "profile", None)
        if profile is None:
            return 0, 0
        per = getattr(self.runtime.spec, "vae_scale_factor", 8) if self.runtime.spec.component == "vae_decoder" else 1
        return -(-profile.height.min // per), -(-profile.width.min // per)


class PyTorchHalf(torch.nn.Module):
    """The half of a VAE an engine set lacks, on the PyTorch VAE (loaded on first use)."""

    def __init__(self, load: Callable[[], Any], encoder: bool) -> None:
        super().__init__()
        self.load, self.encoder = load, encoder
        self.vae: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.vae = self.load()
        vae = self.vae.to(x.device, x.dtype)
        if self.encoder:
            h = vae.encoder(x)
            return vae.quant_conv(h) if vae.quant_conv is not None else h
        return vae.decoder(vae.post_quant_conv(x) if vae.post_quant_conv is not None else x)


class EngineVAE(EngineModule, AutoencoderKL):
    """An AutoencoderKL stand-in: its ``encoder`` and ``decoder`` are engines; a half the set lacks runs in PyTorch.

    AutoencoderKL's own ``encode``/``decode`` run over them, so slicing (a batch loop) and tiling (tiles
    decoded through the same engine, blended as diffusers blends them) work as on the PyTorch VAE. Tiles
    are as large as diffusers makes them, and no larger than the engine's profile.
    """

    def __init__(
        self, config: dict[str, Any], decoder: Runtime | None, encoder: Runtime | None,
        pytorch: Callable[[], Any], dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype, [decoder, encoder])
        self.decoder_runtime, self.encoder_runtime = decoder, encoder
        on_pytorch = PyTorchHalf(pytorch, encoder=True), PyTorchHalf(pytorch, encoder=False)
        self.encoder = EngineHalf(encoder, on_pytorch[0]) if encoder is not None else on_pytorch[0]
        self.decoder = EngineHalf(decoder, on_pytorch[1]) if decoder is not None else on_pytorch[1]
        self.quant_conv, self.post_quant_conv = InGraph(dtype), InGraph(dtype)  # the halves apply them
        self.use_slicing = self.use_tiling = False
        self.tile_overlap_factor = 0.25
        size = self.config.sample_size
        sample_px = size[0] if isinstance(size, list | tuple) else size
        scale = 2 ** (len(self.config.block_out_channels) - 1)
        # One tuple: min() of a lone int (no engine profile on record, as for a graph) is a TypeError.
        self.tile_latent_min_size = min(
            (sample_px // scale, *tile_limits(decoder, scale), *tile_limits(encoder, scale))
        )
        self.tile_sample_min_size = self.tile_latent_min_size * scale


class InGraph(torch.nn.Identity):
    """A quant conv the engine's graph already applies, with an empty parameter in the VAE's dtype: SDXL
    pipelines read ``vae.post_quant_conv``'s parameter dtype when they upcast the VAE."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype_anchor = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def tile_limits(runtime: Runtime | None, scale: int) -> tuple[int, ...]:
    """The largest latent tile an engine's profile takes, or nothing when it has no profile on record."""
    profile = getattr(runtime, "profile", None)
    if profile is None:
        return ()
    return (min(profile.height.max, profile.width.max) // scale,)


def text_encoder_config(source: ModelSource, folder: str = "text_encoder") -> Any:
    """The transformers config of a text encoder (pipelines read it, e.g. use_attention_mask, projection_dim)."""
    import transformers

    from ..sources.models import quiet_loading

    _, class_name = source.component_class(folder)
    with quiet_loading():
        return getattr(transformers, class_name).config_class.from_pretrained(source.component_dir(folder))


def final_layer_norm(source: ModelSource, config: Any, folder: str = "text_encoder") -> torch.nn.Module | None:
    """The text model's final LayerNorm, read alone from the weights (clip_skip applies it in the pipeline).

    transformers 4 saved it as ``text_model.final_layer_norm.*``, transformers 5 as ``final_layer_norm.*``.
    """
    from safetensors import safe_open

    path = source.component_dir(folder) / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as weights:
        names = set(weights.keys())
        for prefix in ("text_model.final_layer_norm.", "final_layer_norm."):
            if {prefix + "weight", prefix + "bias"} <= names:
                norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                norm.load_state_dict({p: weights.get_tensor(prefix + p) for p in ("weight", "bias")})
                return norm.eval()
    return None
