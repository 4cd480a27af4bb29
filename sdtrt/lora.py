"""LoRAs on engines without a rebuild: base + Σ scale·ΔW, always from the base weights.

A LoRA file (diffusers/PEFT or kohya/A1111 safetensors) is read with diffusers' own loader
(``StableDiffusionPipeline.lora_state_dict``, which converts kohya names) and split by network: the
UNet and the text encoders (``text_encoder``, SDXL's ``text_encoder_2``). Each part is renamed to
PEFT's ``<module>.lora_A/lora_B`` as diffusers' loaders rename it, so PEFT-injected names
(``….base_layer.weight``) never reach an engine: each module's ΔW = (alpha / rank)·B·A is placed
through the engine graph's weight map (sdtrt.graph_weights) onto the initializer that holds the
weight, transposed and cast as the map says. The alpha comes as diffusers takes it: kohya's
``.alpha`` keys, else the adapter metadata diffusers saves (``lora_alpha``, ``alpha_pattern``,
``use_rslora``), else alpha = rank.

Every swap recomputes each touched weight from the base weights read from the graph, and weights a
previous LoRA touched but the new set does not go back to base: LoRA B after LoRA A is B, never a
blend (NVIDIA/TensorRT#3628). Files, scales, shapes and which networks a file changes are all checked
before any engine changes, so a bad LoRA leaves every engine serving what it had.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LoraError, RequestError, one_line

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .graph_weights import WeightMap
    from .models import ModelSource

LoraSpec = tuple["str | os.PathLike[str]", float]
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save_lora_weights gives
# The networks LoRA files change, by the state-dict prefix diffusers gives each (and the pipeline attribute).
LORA_COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
# What random_lora puts adapters on: the attention and feed-forward projections LoRA trainers target.
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
RANDOM_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "text_encoder": CLIP_TARGETS,
    "text_encoder_2": CLIP_TARGETS,
}


def check_scale(scale: float, path: str | os.PathLike[str]) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise LoraError(f"LoRA scale {scale!r} for {path} is a {type(scale).__name__}, not a number (e.g. 0.8)")
    if math.isnan(scale) or math.isinf(scale) or scale < 0:
        raise LoraError(f"LoRA scale {scale} for {path} must be a finite number ≥ 0 (e.g. 0.8)")
    return float(scale)


def checked_loras(loras: Sequence[LoraSpec]) -> list[tuple[Path, float]]:
    """(file, scale) pairs with their scales checked; LoraError for anything else, such as a bare path."""
    if isinstance(loras, str | os.PathLike):
        loras = [loras]  # type: ignore[list-item]  # reported below, item by item
    checked = []
    for item in loras:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise LoraError(f'LoRAs are (file, scale) pairs, e.g. [("style.safetensors", 0.8)]; got {item!r}')
        checked.append((Path(item[0]), check_scale(item[1], item[0])))
    return checked


def parse_lora_option(value: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` → (file, scale); the scale defaults to 1.0 and is checked."""
    path, sep, tail = value.rpartition(":")
    if not sep or not path or Path(value).exists():  # no scale, or a colon that is part of the file's name
        return value, 1.0
    try:
        scale = float(tail)
    except ValueError:
        message = f"--lora {value}: '{tail}' is not a scale; write FILE[:SCALE], e.g. style.safetensors:0.8"
        raise LoraError(message) from None
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

    def add_to(self, weight: torch.Tensor, scale: float, transposed: bool) -> None:
        """weight += scale·ΔW, ΔW = (alpha/rank)·B·A, in place in one matrix product (no ΔW is made).

        ``weight`` is fp32 and 2-D: [out, in·kernel], or [in, out] where the graph holds it transposed.
        """
        up, down = self.up.flatten(1).float(), self.down.flatten(1).float()
        if transposed:
            weight.addmm_(down.T, up.T, alpha=scale * self.scale)
        else:
            weight.addmm_(up, down, alpha=scale * self.scale)


@dataclass(frozen=True)
class LoraFile:
    path: Path
    format: str  # "diffusers (PEFT)", "diffusers (legacy)", "kohya"
    parts: dict[str, dict[str, LoraModule]]  # network (LORA_COMPONENTS) → module name → its low-rank pair


def _format(keys: list[str]) -> str | None:
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers (PEFT)"
    if any(".lora.down." in k or "lora_linear_layer" in k or "_lora.down." in k for k in keys):
        return "diffusers (legacy)"
    return None


def read_lora(path: str | os.PathLike[str]) -> LoraFile:
    """A LoRA file's UNet and text encoder parts, in PEFT form; LoraError naming the first thing sdtrt cannot use."""
    import safetensors

    from .models import quiet_loading

    path = Path(path)
    if path.is_dir():  # a folder save_lora_weights wrote: its file, as diffusers' load_lora_weights finds it
        if not (path / DIFFUSERS_LORA_FILE).is_file():
            raise LoraError(f"{path} is a folder without {DIFFUSERS_LORA_FILE}; pass the LoRA's .safetensors file")
        path = path / DIFFUSERS_LORA_FILE
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
    try:
        state_dict, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
            str(path), use_safetensors=True, local_files_only=True, return_lora_metadata=True
        )
    except Exception as exc:  # diffusers raises ValueError for names it cannot convert
        raise LoraError(f"diffusers cannot read the LoRA {path}: {one_line(exc)}") from exc
    prefixes = tuple(f"{c}." for c in LORA_COMPONENTS)
    if other := next((k for k in state_dict if not k.startswith(prefixes)), None):
        raise LoraError(
            f"{path}: '{other}' is not a weight of the {', '.join(LORA_COMPONENTS)} networks sdtrt applies LoRAs to"
        )
    parts = {}
    for component in LORA_COMPONENTS:
        prefix = f"{component}."
        weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not weights:
            continue
        # kohya's alphas come keyed by diffusers' intermediate weight names (`….to_q_lora.down.weight.alpha`):
        # the renaming that gives the weights their modules gives the alphas theirs.
        alpha_keys = {k[len(prefix) : -len(".alpha")]: v for k, v in (alphas or {}).items() if k.startswith(prefix)}
        try:
            module_alphas = {k.split(".lora_A.")[0]: float(v) for k, v in peft_names(component, alpha_keys).items()}
            renamed = peft_names(component, weights)
        except ValueError as exc:  # diffusers' converters: "Could not automatically infer state dict type"
            raise LoraError(f"diffusers cannot convert the {component} part of {path}: {one_line(exc)}") from exc
        config = {k[len(prefix) :]: v for k, v in (metadata or {}).items() if k.startswith(prefix)}
        parts[component] = _modules(path, renamed, module_alphas, config)
    return LoraFile(path, kind, parts)


def peft_names(component: str, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Keys renamed to PEFT's ``<module>.lora_A/B.weight`` the way diffusers' loaders rename them.

    The UNet as ``load_lora_into_unet`` does; text encoders as ``_load_lora_into_text_encoder`` does
    (diffusers loaders/lora_base.py), with CLIP's ``text_model.`` prefix dropped: recent transformers
    flatten CLIPTextModel, and weight maps name text encoder weights without it (weight_map.lora_parameters).
    """
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    if component == "unet":
        return convert_unet_state_dict_to_peft(state_dict)
    renamed = convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict)) if state_dict else {}
    return {k.removeprefix("text_model."): v for k, v in renamed.items()}


def _modules(
    path: Path, weights: dict[str, torch.Tensor], alphas: dict[str, float], config: dict[str, Any]
) -> dict[str, LoraModule]:
    """One network's modules; ``config`` is its adapter metadata (lora_alpha, alpha_pattern, use_rslora, …)."""
    if config.get("use_dora"):
        raise LoraError(f"{path} is a DoRA adapter; sdtrt applies plain LoRAs only")
    patterns = config.get("alpha_pattern") or {}
    modules = {}
    for key in weights:
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise LoraError(
                f"{path}: '{key}' is not a LoRA up/down weight (DoRA, biases and LyCORIS are not supported)"
            )
        if part == "B.weight":
            continue
        up = weights.get(f"{module}.lora_B.weight")
        if up is None:
            raise LoraError(f"{path}: '{module}' has a down (lora_A) weight but no up (lora_B) weight")
        down = weights[key]
        alpha = alphas.get(module)
        if alpha is None:
            pattern = next((p for p in patterns if module == p or module.endswith("." + p)), None)
            alpha = patterns[pattern] if pattern else config.get("lora_alpha", down.shape[0])
        modules[module] = LoraModule(down, up, float(alpha), bool(config.get("use_rslora")))
    return modules


NETWORK_NAMES = {"unet": "UNet", "text_encoder": "text encoder", "text_encoder_2": "second text encoder"}


@dataclass
class EngineLoras:
    """The LoRAs on one engine network, and the weight map and base weights that apply new ones."""

    component: str  # which part of a LoRA file it takes (LORA_COMPONENTS)
    runtime: Any  # the Runtime whose weights change
    weight_map: Callable[[], WeightMap]  # made (or found in the store) on the first LoRA
    active: list[tuple[Path, float]] = field(default_factory=list)
    last_swap_s: float | None = None  # read + compute + engine swap time of the last set of LoRAs
    _map: WeightMap | None = None
    _base: dict[str, np.ndarray] = field(default_factory=dict)  # base weights of what LoRAs touched so far
    _changed: set[str] = field(default_factory=set)  # initializers that differ from base now

    def weights(self, files: Sequence[tuple[LoraFile, float]]) -> tuple[dict[str, np.ndarray], set[str]]:
        """Engine weights for these LoRAs, and which of them differ from base.

        Base + Σ scale·ΔW where the LoRAs touch, in fp32, cast to the graph's dtype; base where only
        the previous set touched.
        """
        import torch

        if not self._changed and not any(self.component in lora.parts for lora, _ in files):
            return {}, set()  # at base and staying there: no weight map to make, nothing to swap
        weight_map = self._map_or_make()
        touched: dict[str, list[tuple[str, LoraModule, float]]] = {}  # initializer → what LoRAs add to it
        for param, pair, scale in self._placed(files):
            touched.setdefault(weight_map.mapped[param].initializer, []).append((param, pair, scale))
        names = set(touched) | self._changed
        self._load_base(names)
        weights = {}
        for name in names:
            base = self._base[name]
            if name not in touched:
                weights[name] = base
                continue
            with warnings.catch_warnings():  # base is read-only (onnx's to_array); it is only read here
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                stored = torch.from_numpy(base)
            weight = stored.float()  # a copy, cast on all cores (numpy's astype uses one)
            for param, pair, scale in touched[name]:
                place = weight_map.mapped[param]
                if place.columns:  # a packed q/k/v MatMul: this projection's columns
                    pair.add_to(weight[:, slice(*place.columns)], scale, place.transpose)
                else:
                    pair.add_to(weight.view(len(weight), -1), scale, place.transpose)
            weights[name] = weight.to(stored.dtype).numpy()
        return weights, set(touched)

    def swap(self, weights: dict[str, np.ndarray], changed: set[str], active: list[tuple[Path, float]]) -> None:
        try:
            if weights:  # an unchanged engine keeps its session (ONNX Runtime) or skips a refit (TensorRT)
                self.runtime.set_weights(weights)
        except LoraError:
            # A refit that fails may have changed some weights (pyCoreDoc.h, refit_cuda_engine): count them
            # all as changed, so the next swap rewrites each from base.
            self._changed |= set(weights)
            raise
        self._changed, self.active = changed, active

    def _placed(self, files: Sequence[tuple[LoraFile, float]]) -> list[tuple[str, LoraModule, float]]:
        """(parameter, low-rank pair, scale) of every module in ``files`` for this network; LoraError for the
        first module the map cannot place or whose shape differs."""
        weight_map = self._map_or_make()
        placed = []
        for lora, scale in files:
            for module, pair in lora.parts.get(self.component, {}).items():
                if problem := placement_problem(module, pair, weight_map, self.component):
                    raise LoraError(f"{lora.path}: {problem}")
                placed.append((f"{module}.weight", pair, scale))
        return placed

    def _map_or_make(self) -> WeightMap:
        if self._map is None:
            self._map = self.weight_map()
        return self._map

    def _load_base(self, names: set[str]) -> None:
        from .graph_weights import read_initializers

        if missing := names - set(self._base):
            self._base |= read_initializers(self._map_or_make().graph, missing)


def apply_loras(targets: Sequence[EngineLoras], loras: Sequence[LoraSpec], elsewhere: str) -> None:
    """Put ``loras`` into each target engine, every weight computed from base before any engine changes.

    A LoRA that changes a network none of ``targets`` holds is refused: "<file> changes <network>"
    followed by ``elsewhere`` (where that network's LoRAs go instead).
    """
    for target in targets:
        if not callable(getattr(target.runtime, "set_weights", None)):
            raise LoraError(f"the {target.runtime.name} runtime cannot take new weights; load an ONNX Runtime or a "
                            "refittable TensorRT (build-trt --refittable) engine for LoRAs")  # fmt: skip
    started = time.perf_counter()
    checked = checked_loras(loras)
    files = [(read_lora(path), scale) for path, scale in checked]
    held = {t.component for t in targets}
    for lora, _ in files:
        if other := next((c for c in lora.parts if c not in held), None):
            raise LoraError(f"{lora.path} changes the {NETWORK_NAMES[other]} ({other}){elsewhere}")
    computed = [(target, *target.weights(files)) for target in targets]
    swapped: list[str] = []
    for target, weights, changed in computed:
        try:
            target.swap(weights, changed, checked)
        except LoraError as exc:
            if swapped:  # the networks before it already run the new LoRAs: say so, not "unchanged"
                raise LoraError(f"{one_line(exc)} (the {', '.join(swapped)} already took the new LoRAs)") from exc
            raise
        swapped.append(NETWORK_NAMES[target.component])
    for target in targets:
        target.last_swap_s = time.perf_counter() - started


class LoraNetwork:
    """``set_loras`` / ``clear_loras`` on an engine stand-in whose weights LoRAs change (UNet, text encoders)."""

    loras: EngineLoras | None

    def set_loras(self, loras: Sequence[LoraSpec]) -> None:
        """Apply these (file, scale) LoRAs to this network, from its base weights (any earlier set is undone).

        LoraError, with the engine unchanged, for a bad file or scale, a weight the engine cannot take, or
        a file that changes other networks too (``sdtrt.pipeline.set_loras(pipe, loras)`` changes them all).
        """
        if self.loras is None:
            raise LoraError(
                f"this {type(self).__name__} has no weight map; load it with sdtrt.pipeline.load_pipeline for LoRAs"
            )
        apply_loras(
            [self.loras], loras, " too: apply it to every network at once with sdtrt.pipeline.set_loras(pipe, loras)"
        )

    def clear_loras(self) -> None:
        """Back to the engine's base weights."""
        self.set_loras([])


def fuse_loras(pipe: Any, loras: Sequence[LoraSpec]) -> None:
    """PyTorch networks: diffusers loads each LoRA and fuses it at its scale (the reference engines match).

    The files pass the same checks as for engines first, shapes included (diffusers would fail deep in
    ``load_lora_weights`` with a size-mismatch dump), so both paths refuse the same input alike.
    """
    from .models import quiet_loading

    checked = checked_loras(loras)
    for path, _ in checked:
        refuse_misfits(read_lora(path), pipe)
    networks = [c for c in LORA_COMPONENTS if getattr(pipe, c, None) is not None]
    for path, scale in checked:  # one at a time: loading an adapter unmerges those fused before it
        with quiet_loading():
            pipe.load_lora_weights(str(path))
        pipe.fuse_lora(components=networks, lora_scale=scale)
        pipe.unload_lora_weights()  # keeps the fused weights, drops PEFT's layers


def placement_problem(module: str, pair: LoraModule, weight_map: WeightMap, component: str) -> str | None:
    """Why the engine's weight map cannot take this module's ΔW, or None."""
    param = f"{module}.weight"
    if param in weight_map.unmapped:
        return f"the {NETWORK_NAMES[component]} engine's weight map cannot place {param}: {weight_map.unmapped[param]}"
    place = weight_map.mapped.get(param)
    return shape_problem(module, pair, place.shape if place else None, component)


def shape_problem(module: str, pair: LoraModule, shape: tuple[int, ...] | None, component: str) -> str | None:
    """Why a network whose ``module`` weight has ``shape`` (None: it has no such module) cannot take ΔW, or None."""
    network = NETWORK_NAMES[component]
    if shape is None:
        return f"'{module}' is not in this {network} (a LoRA for another architecture?)"
    if shape != pair.shape:
        return (f"'{module}' changes a {list(pair.shape)} weight, this {network}'s is {list(shape)} "
                "(a LoRA for another architecture?)")  # fmt: skip
    return None


def refuse_misfits(lora: LoraFile, pipe: Any) -> None:
    """LoraError, worded as for engines, for the first module the pipeline's PyTorch networks lack or hold in
    another shape."""
    from .stages.weight_map import lora_parameters

    for component, modules in lora.parts.items():
        network = getattr(pipe, component, None)
        if network is None:
            raise LoraError(f"{lora.path} changes the {NETWORK_NAMES[component]} ({component}), which this model lacks")
        shapes = {name: tuple(weight.shape) for name, weight in lora_parameters(network).items()}
        for module, pair in modules.items():
            if problem := shape_problem(module, pair, shapes.get(f"{module}.weight"), component):
                raise LoraError(f"{lora.path}: {problem}")


def coverage(lora: LoraFile, maps: dict[str, WeightMap]) -> dict[str, dict[str, str]]:
    """network → module → 'ok', or why the engine's weight map cannot take it (no engine for that network)."""
    return {
        component: {
            module: (placement_problem(module, pair, maps[component], component) or "ok")
            if component in maps
            else f"no {NETWORK_NAMES[component]} engine given"
            for module, pair in modules.items()
        }
        for component, modules in lora.parts.items()
    }


def describe(lora: LoraFile) -> dict[str, Any]:
    """What `sdtrt lora inspect` prints: format, networks, modules, ranks, alphas, scales."""
    pairs = [pair for modules in lora.parts.values() for pair in modules.values()]
    return {
        "file": str(lora.path),
        "format": lora.format,
        "networks": ", ".join(f"{c} ({len(m)} modules)" for c, m in lora.parts.items()),
        "ranks": sorted({m.rank for m in pairs}),
        "alphas": sorted({m.alpha for m in pairs}),
        "scales": sorted({round(m.scale, 6) for m in pairs}),
    }


def lora_out(out: str | os.PathLike[str]) -> Path:
    """Where a new LoRA file goes; RequestError unless it is a .safetensors file."""
    if Path(out).suffix != ".safetensors":
        raise RequestError(f"{out}: a LoRA file is .safetensors, e.g. style.safetensors")
    return Path(out)


def random_lora(
    model: ModelSource,
    out: str | os.PathLike[str],
    *,
    rank: int = 8,
    alpha: int = 8,
    seed: int = 0,
    text_encoders: bool = False,
) -> Path:
    """A LoRA with random weights, to try LoRAs without training one: PEFT's ``LoraConfig`` on the model's
    UNet (and, with ``text_encoders``, each text encoder it has), saved by the model's own pipeline class
    with ``save_lora_weights`` as diffusers' training scripts save theirs. Written whole or not at all."""
    import tempfile

    import diffusers
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from .models import load_folder, quiet_loading

    out = lora_out(out)
    if not model.has("unet"):
        raise LoraError(f"'{model.name}' has no UNet in a pipeline folder; random LoRAs are made for UNet pipelines")
    with quiet_loading():
        pipeline = getattr(diffusers, model.pipeline_class(), None)
    if pipeline is None or not hasattr(pipeline, "save_lora_weights"):
        raise LoraError(f"diffusers' {model.pipeline_class() or 'pipeline'} of '{model.name}' cannot save LoRAs")
    networks = ["unet", *(c for c in LORA_COMPONENTS[1:] if text_encoders and model.has(c))]
    layers: dict[str, Any] = {}
    with torch.random.fork_rng():  # seeded without changing the caller's random state
        torch.manual_seed(seed)
        for network in networks:
            module = load_folder(model, network)
            config = LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=RANDOM_TARGETS[network], init_lora_weights=False
            )
            module.add_adapter(config)
            layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
            layers[f"{network}_lora_adapter_metadata"] = config.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        pipeline.save_lora_weights(tmp, weight_name=out.name, **layers)
        os.replace(Path(tmp) / out.name, out)
    return out
