"""EngineModule: the diffusers module protocol every stand-in shares (``config``, ``dtype``, ``device``, ``to``,
refusals, saving), and how diffusers pipelines are taught to record and carry stand-ins.

The stand-ins themselves: text_encoders (EngineTextEncoder, EngineT5), vae (EngineVAE), unet (EngineUNet),
transformer (EngineTransformer), controlnet (EngineControlNet).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import wraps
from pathlib import Path
from typing import Any

import torch

from ..core.errors import ArtifactError, EngineInputError, LoraError, SdtrtError
from ..runtime import Runtime
from .ip_adapter import RECOMPILE_WITH_IP_ADAPTER

# Attention processors that compute what an engine's graph computes (plain scaled dot-product
# attention, fused or sliced or not): setting one changes nothing. Others (IP-Adapter, custom) would.
DEFAULT_ATTENTION = (
    "AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "XFormersAttnProcessor", "SlicedAttnProcessor",
    "AttnAddedKVProcessor", "AttnAddedKVProcessor2_0", "SlicedAttnAddedKVProcessor", "XFormersAttnAddedKVProcessor",
)  # fmt: skip
ENGINE_RECORD = "sdtrt_engine.json"  # beside a saved stand-in's PyTorch files: the engines it ran on

PYTORCH_ONLY = "run this pipeline on PyTorch (load_pipeline without an engine) to use it"
USE_SET_LORAS = "use the pipeline's LoRA API (pipe.load_lora_weights, set_adapters …) or sdtrt.set_loras(pipe, loras)"
# PEFT's adapter methods (diffusers' and transformers' PeftAdapterMixin, the UNet's attention-processor loaders):
# they add or drive adapter layers in PyTorch modules, and a stand-in has none (PEFT would fail on no target). The
# stand-ins LoRAs change define their own add_adapter (standins/peft_adapters.py); T5's and the VAE's refuse it.
PEFT_METHODS = (
    "add_adapter", "load_adapter", "load_lora_adapter", "save_lora_adapter", "set_adapter", "set_adapters",
    "delete_adapter", "delete_adapters", "fuse_lora", "unfuse_lora", "unload_lora", "enable_lora", "disable_lora",
    "enable_adapters", "disable_adapters", "active_adapters", "active_adapter", "get_adapter_state_dict",
    "enable_lora_hotswap", "enable_peft_hotswap", "load_attn_procs", "save_attn_procs",
)  # fmt: skip
# The diffusers/transformers methods a stand-in cannot honour: name → (error, why and what to do). A stand-in class
# refuses each its PyTorch class has (EngineModule.__init_subclass__) unless the stand-in defines its own.
REFUSED_METHODS: dict[str, tuple[type[SdtrtError], str]] = {
    name: (LoraError, f"adds or drives PEFT adapter layers in PyTorch modules, and an engine has none: {USE_SET_LORAS}")
    for name in PEFT_METHODS
} | {
    "enable_gradient_checkpointing": (EngineInputError, "saves memory when training PyTorch networks, and an engine "
                                      "runs inference only: " + PYTORCH_ONLY),
    "compile_repeated_blocks": (EngineInputError, "runs torch.compile on the PyTorch blocks, and an engine is compiled "
                                "already: leave it out"),
    "dequantize": (EngineInputError, "undoes a PyTorch quantization, and an engine's precision is built in: compile "
                   "an engine at the precision you want (sdtrt compile --precision fp16 or fp32)"),
    "enable_parallelism": (EngineInputError, "splits PyTorch attention across GPUs, and an engine runs on one device: "
                           + PYTORCH_ONLY),
}  # fmt: skip
# The pipeline's own methods that would reach PyTorch-only code (IP-Adapter loaders): on a pipeline
# with a stand-in they fail deep inside diffusers/PEFT. diffusers' other LoRA methods run on engines (adapters.py), and
# the IP-Adapter ones on a UNet engine compiled with the adapter (ip_adapter.py).
IP_ADAPTER_BUILD = (
    f"for a UNet or Flux's transformer, {RECOMPILE_WITH_IP_ADAPTER}; IP-Adapter on SD3's engines is not built yet: "
    + PYTORCH_ONLY
)
PIPELINE_REFUSALS: dict[str, tuple[type[SdtrtError], str]] = {
    name: (EngineInputError, f"{what}, and this pipeline's engines were compiled without one: {IP_ADAPTER_BUILD}")
    for name, what in (
        ("load_ip_adapter", "adds an IP-Adapter's image-projection inputs and attention layers to the denoiser"),
        ("set_ip_adapter_scale", "sets the scale of an IP-Adapter compiled into the denoiser"),
        ("unload_ip_adapter", "takes out an IP-Adapter compiled into the denoiser"),
    )
}


def refusal(name: str, error: type[SdtrtError], why: str) -> Any:
    """A method that refuses in one line, whatever it is given: ``<Class>.<name> <why>``."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise error(f"{type(self).__name__}.{name} {why}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused on engines: {why}"
    return refuse


def refuse_pytorch_only(pipe: Any) -> None:
    """Make a pipeline with a stand-in refuse, in one line, its methods in PIPELINE_REFUSALS (but where its UNet engine
    was compiled with an IP-Adapter: diffusers' IP-Adapter API runs on it, standins/ip_adapter.py), and run diffusers'
    LoRA adapter API (load_lora_weights, set_adapters, fuse_lora …) on its engines (standins.adapters)."""
    from . import ip_adapter
    from .adapters import install

    if ip_adapter.takes_ip_adapter(pipe):
        ip_adapter.install(pipe)
    else:
        for name, (error, why) in PIPELINE_REFUSALS.items():
            if hasattr(type(pipe), name):
                setattr(pipe, name, refusal(name, error, why).__get__(pipe))
    install(pipe)


class EngineModule(torch.nn.Module):
    """The diffusers module protocol every stand-in shares: ``config``, ``dtype``, ``device``, ``to``, saving.

    A stand-in subclasses this first and then the class it stands in for (UNet2DConditionModel,
    AutoencoderKL, CLIPTextModel, ControlNetModel, …) without building that class's layers, so
    ``isinstance`` checks and diffusers' save/load dispatch see the real class. Methods that would change
    the network refuse with an EngineInputError naming the feature; those an engine already does are no-ops.
    """

    original_attn_processors: dict[str, Any] | None = None  # diffusers' QKV-fusion bookkeeping

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse the REFUSED_METHODS the PyTorch class has and the stand-in does not define itself."""
        super().__init_subclass__(**kwargs)
        for name, (error, why) in REFUSED_METHODS.items():
            owner = next((c for c in cls.__mro__ if name in vars(c)), None)
            if owner is not None and owner.__module__.split(".")[0] in ("diffusers", "transformers"):
                setattr(cls, name, refusal(name, error, why))

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

    def cuda(self, device: int | torch.device | None = None) -> Any:
        """As ``to``: a CUDA device must be the engine's."""
        return self.to(torch.device("cuda", device) if isinstance(device, int) else device or torch.device("cuda"))

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
        """A no-op: the engine's compiler fuses the projections itself (diffusers' bookkeeping is kept, so its own
        ``unfuse_qkv_projections`` finds what it restores)."""
        self.original_attn_processors = self.attn_processors

    def unfuse_qkv_projections(self) -> None:
        """A no-op, as ``fuse_qkv_projections``."""

    def enable_layerwise_casting(self, *args: Any, **kwargs: Any) -> None:
        raise EngineInputError(
            "enable_layerwise_casting stores PyTorch weights in a smaller dtype; an engine's weights are built in: "
            "compile a smaller engine instead (sdtrt compile --precision fp16)"
        )

    def disable_gradient_checkpointing(self) -> None:
        """A no-op: an engine never checkpoints."""

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
        if standins:
            refuse_pytorch_only(self)
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
