"""LoRAs on engines without a rebuild: base + Σ scale·ΔW, always from the base weights.

A LoRA file (diffusers/PEFT or kohya/A1111 safetensors) is read with diffusers' own loader
(``StableDiffusionPipeline.lora_state_dict``, which converts kohya names) and normalised to PEFT's
``<module>.lora_A/lora_B`` (``convert_unet_state_dict_to_peft``), so PEFT-injected names
(``….base_layer.weight``) never reach the engine: each module's ΔW = (alpha / rank)·B·A is placed
through the engine graph's weight map (sdtrt.stages.weight_map) onto the initializer that holds the
weight, transposed and cast as the map says. The alpha comes as diffusers takes it: kohya's
``.alpha`` keys, else the adapter metadata diffusers saves (``lora_alpha``, ``alpha_pattern``,
``use_rslora``), else alpha = rank.

Every ``set_loras`` recomputes each touched weight from the base weights read from the graph, and
weights a previous LoRA touched but the new set does not go back to base: LoRA B after LoRA A is B,
never a blend (NVIDIA/TensorRT#3628). Files, scales and shapes are all checked before the engine
changes, so a bad LoRA leaves it serving what it had.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LoraError, one_line

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .stages.weight_map import WeightMap

LoraSpec = tuple["str | os.PathLike[str]", float]
UNET_PREFIX = "unet."


def check_scale(scale: float, path: str | os.PathLike[str]) -> float:
    if not isinstance(scale, int | float) or math.isnan(scale) or math.isinf(scale) or scale < 0:
        raise LoraError(f"LoRA scale {scale} for {path} must be a finite number ≥ 0 (e.g. 0.8)")
    return float(scale)


def parse_lora_option(value: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` → (file, scale); the scale defaults to 1.0 and is checked."""
    path, sep, tail = value.rpartition(":")
    try:
        scale = float(tail) if sep else 1.0
    except ValueError:
        path, scale = value, 1.0  # a colon that is part of the path
    path = path if sep and path else value
    return path, check_scale(scale, path)


@dataclass(frozen=True)
class LoraModule:
    down: torch.Tensor  # lora_A: [rank, in, *kernel]
    up: torch.Tensor  # lora_B: [out, rank, 1, 1 | ·]
    alpha: float
    rslora: bool = False

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it changes, in PyTorch's layout."""
        return (int(self.up.shape[0]), *(int(d) for d in self.down.shape[1:]))

    def delta(self) -> torch.Tensor:
        """ΔW = scale·B·A in fp32, shaped like the weight (Linear or Conv)."""
        product = self.up.flatten(1).float() @ self.down.flatten(1).float()
        return (product * self.scale).reshape(self.shape)


@dataclass(frozen=True)
class LoraFile:
    path: Path
    format: str  # "diffusers (PEFT)", "diffusers (legacy)", "kohya"
    modules: dict[str, LoraModule]  # UNet module name (``down_blocks.0.….to_q``) → its low-rank pair


def _format(keys: list[str]) -> str | None:
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers (PEFT)"
    if any(".lora.down." in k or "lora_linear_layer" in k or "_lora.down." in k for k in keys):
        return "diffusers (legacy)"
    return None


def read_lora(path: str | os.PathLike[str]) -> LoraFile:
    """The UNet part of a LoRA file, in PEFT form; LoraError naming the first thing sdtrt cannot use."""
    import safetensors

    from .models import quiet_loading

    path = Path(path)
    if not path.is_file():
        raise LoraError(f"LoRA file {path} does not exist")
    try:
        with safetensors.safe_open(str(path), "pt") as handle:
            keys = list(handle.keys())
    except Exception as exc:  # SafetensorError for truncated or foreign files, OSError, …
        raise LoraError(f"{path} is not a readable safetensors file ({one_line(exc)})") from exc
    kind = _format(keys)
    if kind is None:
        raise LoraError(f"{path} is not a LoRA file sdtrt knows (first key '{keys[0] if keys else '(none)'}')")
    with quiet_loading():
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_unet_state_dict_to_peft
    try:
        state_dict, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
            str(path), use_safetensors=True, local_files_only=True, return_lora_metadata=True
        )
    except Exception as exc:  # diffusers raises ValueError for names it cannot convert
        raise LoraError(f"diffusers cannot read the LoRA {path}: {one_line(exc)}") from exc
    if other := next((k for k in state_dict if not k.startswith(UNET_PREFIX)), None):
        raise LoraError(f"{path}: '{other}' is not a UNet weight; sdtrt applies UNet LoRAs only")
    unet = convert_unet_state_dict_to_peft({k[len(UNET_PREFIX) :]: v for k, v in state_dict.items()})
    # kohya's alphas come keyed by diffusers' intermediate names (`….processor.to_q_lora.down.weight.alpha`):
    # the same renaming as the weights gives their module.
    renamed = convert_unet_state_dict_to_peft(
        {k[len(UNET_PREFIX) : -len(".alpha")]: v for k, v in (alphas or {}).items()}
    )
    module_alphas = {k.split(".lora_A.")[0]: float(v) for k, v in renamed.items()}
    return LoraFile(path, kind, _modules(path, unet, module_alphas, metadata or {}))


def _modules(
    path: Path, unet: dict[str, torch.Tensor], alphas: dict[str, float], metadata: dict[str, Any]
) -> dict[str, LoraModule]:
    config = {k[len(UNET_PREFIX) :]: v for k, v in metadata.items() if k.startswith(UNET_PREFIX)}
    if config.get("use_dora"):
        raise LoraError(f"{path} is a DoRA adapter; sdtrt applies plain LoRAs only")
    patterns = config.get("alpha_pattern") or {}
    modules = {}
    for key in unet:
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise LoraError(
                f"{path}: '{key}' is not a LoRA up/down weight (DoRA, biases and LyCORIS are not supported)"
            )
        if part == "B.weight":
            continue
        up = unet.get(f"{module}.lora_B.weight")
        if up is None:
            raise LoraError(f"{path}: '{module}' has a down (lora_A) weight but no up (lora_B) weight")
        down = unet[key]
        alpha = alphas.get(module)
        if alpha is None:
            pattern = next((p for p in patterns if module == p or module.endswith("." + p)), None)
            alpha = patterns[pattern] if pattern else config.get("lora_alpha", down.shape[0])
        modules[module] = LoraModule(down, up, float(alpha), bool(config.get("use_rslora")))
    return modules


@dataclass
class EngineLoras:
    """The LoRAs on one engine, and the weight map and base weights that apply new ones."""

    weight_map: Callable[[], WeightMap]  # made (or found in the store) on the first LoRA
    active: list[tuple[Path, float]] = field(default_factory=list)
    last_swap_s: float | None = None  # compute + engine swap time of the last set_loras
    _map: WeightMap | None = None
    _base: dict[str, np.ndarray] = field(default_factory=dict)  # base weights of what LoRAs touched so far
    _changed: set[str] = field(default_factory=set)  # initializers that differ from base now

    def apply(self, runtime: Any, loras: Sequence[LoraSpec]) -> None:
        if not callable(getattr(runtime, "set_weights", None)):
            raise LoraError(f"the {runtime.name} runtime cannot take new weights; load an ONNX Runtime or a "
                            "refittable TensorRT (build-trt --refittable) engine for LoRAs")  # fmt: skip
        started = time.perf_counter()
        checked = [(Path(path), check_scale(scale, path)) for path, scale in loras]
        files = [(read_lora(path), scale) for path, scale in checked]
        weights, changed = self.weights(files)
        runtime.set_weights(weights)
        self._changed, self.active = changed, checked
        self.last_swap_s = time.perf_counter() - started

    def weights(self, files: Sequence[tuple[LoraFile, float]]) -> tuple[dict[str, np.ndarray], set[str]]:
        """Engine weights for these LoRAs, and which of them differ from base.

        Base + Σ scale·ΔW where the LoRAs touch, in fp32, cast to the graph's dtype; base where only
        the previous set touched.
        """
        import numpy as np
        import torch

        weight_map = self._map_or_make()
        deltas = self._deltas(files)
        touched = {weight_map.mapped[param].initializer: param for param in deltas}
        names = set(touched) | self._changed
        self._load_base(names)
        weights = {}
        for name in names:
            base = self._base[name]
            if (param := touched.get(name)) is None:
                weights[name] = base
                continue
            delta = deltas[param].T if weight_map.mapped[param].transpose else deltas[param]
            weights[name] = (torch.from_numpy(base.astype(np.float32)) + delta).numpy().astype(base.dtype)
        return weights, set(touched)

    def _deltas(self, files: Sequence[tuple[LoraFile, float]]) -> dict[str, torch.Tensor]:
        """param → Σ scale·ΔW; LoraError for the first module the map cannot place or whose shape differs."""
        weight_map = self._map_or_make()
        out: dict[str, torch.Tensor] = {}
        for lora, scale in files:
            for module, pair in lora.modules.items():
                if problem := placement_problem(module, pair, weight_map):
                    raise LoraError(f"{lora.path}: {problem}")
                param = f"{module}.weight"
                delta = pair.delta() * scale
                out[param] = out[param] + delta if param in out else delta
        return out

    def _map_or_make(self) -> WeightMap:
        if self._map is None:
            self._map = self.weight_map()
        return self._map

    def _load_base(self, names: set[str]) -> None:
        from .stages.weight_map import read_initializers

        if missing := names - set(self._base):
            self._base |= read_initializers(self._map_or_make().graph, missing)


def fuse_loras(pipe: Any, loras: Sequence[LoraSpec]) -> None:
    """A PyTorch UNet: diffusers loads each LoRA and fuses it at its scale (the reference engines match).

    The files pass the same checks as for engines first, so both paths refuse the same input alike.
    """
    from .models import quiet_loading

    checked = [(path, check_scale(scale, path)) for path, scale in loras]
    for path, _ in checked:
        read_lora(path)
    for path, scale in checked:  # one at a time: loading an adapter unmerges those fused before it
        with quiet_loading():
            pipe.load_lora_weights(str(path))
        pipe.fuse_lora(components=["unet"], lora_scale=scale)
        pipe.unload_lora_weights()  # keeps the fused weights, drops PEFT's layers


def placement_problem(module: str, pair: LoraModule, weight_map: WeightMap) -> str | None:
    """Why the engine's weight map cannot take this module's ΔW, or None."""
    param = f"{module}.weight"
    if param in weight_map.unmapped:
        return f"the engine's weight map cannot place {param}: {weight_map.unmapped[param]}"
    place = weight_map.mapped.get(param)
    if place is None:
        return f"'{module}' is not in this UNet (a LoRA for another architecture?)"
    if place.shape != pair.shape:
        return (f"'{module}' changes a {list(pair.shape)} weight, this UNet's is {list(place.shape)} "
                "(a LoRA for another architecture?)")  # fmt: skip
    return None


def coverage(lora: LoraFile, weight_map: WeightMap) -> dict[str, str]:
    """module → 'ok', or why the engine's weight map cannot take it."""
    return {module: placement_problem(module, pair, weight_map) or "ok" for module, pair in lora.modules.items()}


def describe(lora: LoraFile) -> dict[str, Any]:
    """What `sdtrt lora inspect` prints: format, ranks, alphas, scales, modules."""
    ranks = sorted({m.rank for m in lora.modules.values()})
    alphas = sorted({m.alpha for m in lora.modules.values()})
    return {
        "file": str(lora.path),
        "format": lora.format,
        "modules": len(lora.modules),
        "ranks": ranks,
        "alphas": alphas,
        "scales": sorted({round(m.scale, 6) for m in lora.modules.values()}),
    }
