"""LoRAs on engines without a rebuild: base + Σ scale·ΔW, always from the base weights.

A LoRA file (diffusers/PEFT, kohya/A1111 or ai-toolkit safetensors) is read with diffusers' loader of the model's
family (sdtrt.lora.kinds.LORA_FAMILIES: SD's, SD3's, FLUX.1's, FLUX.2's, Z-Image's or Qwen-Image's
``lora_state_dict``, each converting its kohya and ai-toolkit names) and split by network: the denoiser (UNet, or a
transformer) and the CLIP text encoders (``text_encoder``, SDXL's and SD3's ``text_encoder_2``; T5 and LLM encoders
take none). A FLUX.1
LoRA whose down weight takes fewer input features than the engine's Linear (a FLUX.1 dev LoRA's x_embedder on
Fill's or Control's wider input) is zero-padded, as diffusers' FLUX.1 loader pads it. Each part is renamed to
PEFT's ``<module>.lora_A/lora_B`` as diffusers' loaders rename it, so PEFT-injected names
(``….base_layer.weight``) never reach an engine: each module's ΔW = (alpha / rank)·B·A is placed
through the engine graph's weight map (sdtrt.graph.graph_weights) onto the initializer that holds the
weight, transposed and cast as the map says. The alpha comes as diffusers takes it: kohya's
``.alpha`` keys, else the adapter metadata diffusers saves (``lora_alpha``, ``alpha_pattern``,
``use_rslora``), else alpha = rank.

Every swap recomputes each touched weight from the base weights read from the graph, and weights a
previous LoRA touched but the new set does not go back to base: LoRA B after LoRA A is B, never a
blend (NVIDIA/TensorRT#3628). Files, scales, shapes and which networks a file changes are all checked
before any engine changes, so a bad LoRA leaves every engine serving what it had.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineInputError, LoraError, RefitError, one_line
from .files import LoraFile, LoraModule, LoraSpec, checked_loras, for_network, network_scale, read_lora
from .kinds import LORA_FAMILIES, lora_kind

if TYPE_CHECKING:
    import numpy as np

    from ..graph.graph_weights import WeightMap

NETWORK_NAMES = {"unet": "UNet", "transformer": "transformer", "text_encoder": "text encoder",
                 "text_encoder_2": "second text encoder"}  # fmt: skip


@dataclass
class EngineLoras:
    """The LoRAs on one engine network, and the weight map and base weights that apply new ones."""

    component: str  # which part of a LoRA file it takes (LORA_COMPONENTS)
    runtime: Any  # the Runtime whose weights change
    weight_map: Callable[[], WeightMap]  # made (or found in the store) on the first LoRA
    family: str | None = None  # the model's (ModelSource.family()): whose diffusers loader reads its LoRA files
    # A part of the network (a step cache's split member): which of the network's modules it holds (the others are the
    # other parts'; the whole network's engine still refuses a module it cannot place). None: the whole network.
    holds: Callable[[str], bool] | None = None
    # A member holding some of the network's modules, whichever its graph has (DeepCache's shallow branch): it takes
    # the modules its weight map places and leaves the others to the whole network's engine, which refuses a misfit.
    placed_only: bool = False
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

        from ..graph.graph_weights import as_numpy, as_torch

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
                stored = as_torch(base)
            # Always a copy: .float() of an fp32 graph's weight would be the base itself, and adding a LoRA to it
            # would change the base every later set starts from. Cast on all cores (numpy's astype uses one).
            weight = stored.to(torch.float32, copy=True)
            for param, pair, scale in touched[name]:
                place = weight_map.mapped[param]
                if place.columns:  # a packed q/k/v MatMul: this projection's columns
                    pair.add_to(weight[:, slice(*place.columns)], scale, place.transpose)
                else:
                    pair.add_to(weight.view(len(weight), -1), scale, place.transpose)
            weights[name] = as_numpy(weight.to(stored.dtype))
        return weights, set(touched)

    def swap(self, weights: dict[str, np.ndarray], changed: set[str], active: list[tuple[Path, float]]) -> None:
        try:
            if weights:  # an unchanged engine keeps its session (ONNX Runtime) or skips a refit (TensorRT)
                self.runtime.set_weights(weights)
        except RefitError:
            # A refit that fails may have changed some weights (pyCoreDoc.h, refit_cuda_engine): count them
            # all as changed, so the next swap rewrites each from base. Other refusals changed nothing.
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
                if self.holds is not None and not self.holds(module):
                    continue
                if self.placed_only and f"{module}.weight" not in weight_map.mapped:
                    continue
                if problem := placement_problem(module, pair, weight_map, self.component, lora.pads(self.component)):
                    raise LoraError(f"{lora.path}: {problem}")
                if f"{module}.weight" in weight_map.unread:
                    continue
                shape = weight_map.mapped[f"{module}.weight"].shape
                placed.append((f"{module}.weight", pair.padded(shape[1]) if pair.shape != shape else pair, scale))
        return placed

    def _map_or_make(self) -> WeightMap:
        if self._map is None:
            self._map = self.weight_map()
        return self._map

    def _load_base(self, names: set[str]) -> None:
        from ..graph.graph_weights import read_initializers

        if missing := names - set(self._base):
            self._base |= read_initializers(self._map_or_make().graph, missing)


def apply_loras(targets: Sequence[EngineLoras], loras: Sequence[LoraSpec], elsewhere: Callable[[str], str]) -> None:
    """Put ``loras`` into each target engine, every weight computed from base before any engine changes.

    A LoRA that changes a network none of ``targets`` holds is refused: "<file> changes <network>"
    followed by ``elsewhere(network)`` (why it is not here, and where that network's LoRAs go instead).
    """
    for target in targets:
        if not callable(getattr(target.runtime, "set_weights", None)):
            raise LoraError(f"the {target.runtime.name} runtime cannot take new weights; load an ONNX Runtime or a "
                            "refittable TensorRT (build-trt --refittable) engine for LoRAs")  # fmt: skip
    started = time.perf_counter()
    checked = checked_loras(loras)
    family = next((t.family for t in targets), None)  # one pipeline's networks: one family
    files = [(read_lora(path, family), scale) for path, scale in checked]
    held = {t.component for t in targets}
    for lora, _ in files:
        if other := next((c for c in lora.parts if c not in held), None):
            raise LoraError(f"{lora.path} changes the {NETWORK_NAMES[other]} ({other}){elsewhere(other)}")
    computed = [(target, *target.weights(for_network(files, target.component))) for target in targets]
    swapped: list[str] = []
    for target, weights, changed in computed:
        try:
            target.swap(weights, changed, for_network(checked, target.component))
        except LoraError as exc:
            if swapped:  # the networks before it already run the new LoRAs: say so, not "unchanged"
                raise LoraError(f"{one_line(exc)} (the {', '.join(swapped)} already took the new LoRAs)") from exc
            raise
        swapped.append(NETWORK_NAMES[target.component])
    for target in targets:
        target.last_swap_s = time.perf_counter() - started


def sync_loras(targets: Sequence[EngineLoras], like: EngineLoras) -> None:
    """Put into ``targets`` (parts of one network, opened later) the LoRAs ``like`` (the whole network) runs now."""
    if not like.active:
        return
    files = [(read_lora(path, like.family), scale) for path, scale in like.active]
    for target in targets:
        target.swap(*target.weights(files), list(like.active))


class LoraNetwork:
    """``set_loras`` / ``clear_loras`` on an engine stand-in whose weights LoRAs change (UNet, transformer, CLIP)."""

    loras: EngineLoras | None
    # The scale of a pipeline call's LoRA adapters (cross_attention_kwargs / joint_attention_kwargs "scale") its
    # weights hold now: the pipeline's adapter registry puts it in before the call (standins/adapters.py).
    call_scale: float = 1.0
    # The LoRAs of the members a set holds beside this network's engine, once opened (a step cache's split members,
    # DeepCache's, the FreeU build): set_loras changes them with its own.
    member_loras: tuple[EngineLoras, ...] = ()

    def engine_loras(self) -> list[EngineLoras]:
        """Every engine whose weights this network's LoRAs change: its own, and its opened members'."""
        return [*([self.loras] if self.loras is not None else []), *self.member_loras]

    def take_member_loras(self, taken: Sequence[EngineLoras]) -> None:
        """Members just opened: the LoRAs this network runs now go into them, and later ones with its own."""
        if self.loras is not None:
            sync_loras(taken, self.loras)
        self.member_loras = (*self.member_loras, *taken)

    def set_loras(self, loras: Sequence[LoraSpec]) -> None:
        """Apply these (file, scale) LoRAs to this network, from its base weights (any earlier set is undone).

        LoraError, with the engine unchanged, for a bad file or scale, a weight the engine cannot take, or
        a file that changes other networks too (``sdtrt.set_loras(pipe, loras)`` changes them all).
        """
        if self.loras is None:
            raise LoraError(f"this {type(self).__name__} has no weight map; load it with sdtrt.load_pipeline for LoRAs")
        everywhere = " too: apply it to every network at once with sdtrt.set_loras(pipe, loras)"
        apply_loras(self.engine_loras(), loras, lambda _: everywhere)

    def clear_loras(self) -> None:
        """Back to the engine's base weights."""
        self.set_loras([])

    def check_call_scale(self, scale: float | None, argument: str) -> None:
        """EngineInputError unless the weights hold this call's LoRA scale (``argument``: where the pipeline passed
        it): a pipeline whose adapters were loaded with load_lora_weights puts it in at encode_prompt."""
        if (1.0 if scale is None else scale) != self.call_scale:
            raise EngineInputError(
                f"{argument} (a LoRA scale, {scale}) scales the adapters loaded with pipe.load_lora_weights, and this "
                f"engine's weights hold {self.call_scale:g}: call the pipeline, which puts a call's scale into its "
                "engines, or set LoRAs at their scales with sdtrt.set_loras(pipe, [(file, scale)])"
            )


def fuse_loras(pipe: Any, loras: Sequence[LoraSpec]) -> None:
    """PyTorch networks: diffusers loads each LoRA and fuses it at its scale (the reference engines match).

    The files pass the same checks as for engines first, shapes included (diffusers would fail deep in
    ``load_lora_weights`` with a size-mismatch dump), so both paths refuse the same input alike.
    """
    from ..sources.models import quiet_loading

    checked = checked_loras(loras)
    family = pipeline_family(pipe)
    for path, _ in checked:
        refuse_misfits(read_lora(path, family), pipe)
    networks = [c for c in LORA_FAMILIES[lora_kind(family)].networks if getattr(pipe, c, None) is not None]
    for path, scale in checked:  # one at a time: loading an adapter unmerges those fused before it
        with quiet_loading():
            pipe.load_lora_weights(str(path))
        for network in networks:  # each at its own scale (per-network scales)
            pipe.fuse_lora(components=[network], lora_scale=network_scale(scale, network))
        pipe.unload_lora_weights()  # keeps the fused weights, drops PEFT's layers


def pipeline_family(pipe: Any) -> str:
    """A diffusers pipeline's family as far as LoRAs go: its transformer's (sd3, flux, flux-schnell), else "UNet"."""
    from ..core.families import transformer_family

    transformer = getattr(pipe, "transformer", None)
    return transformer_family(dict(transformer.config)) if transformer is not None else "UNet"


def placement_problem(
    module: str, pair: LoraModule, weight_map: WeightMap, component: str, pads: bool = False
) -> str | None:
    """Why the engine's weight map cannot take this module's ΔW, or None (``pads``: LoraFile.pads)."""
    param = f"{module}.weight"
    if param in weight_map.unread:  # no output reads it: as in diffusers' fused model, a fitting LoRA changes nothing
        return shape_problem(module, pair, weight_map.unread[param], component, pads)
    if param in weight_map.unmapped:
        return f"the {NETWORK_NAMES[component]} engine's weight map cannot place {param}: {weight_map.unmapped[param]}"
    place = weight_map.mapped.get(param)
    return shape_problem(module, pair, place.shape if place else None, component, pads)


def shape_problem(
    module: str, pair: LoraModule, shape: tuple[int, ...] | None, component: str, pads: bool = False
) -> str | None:
    """Why a network whose ``module`` weight has ``shape`` (None: it has no such module) cannot take ΔW, or None.
    With ``pads`` a Linear's ΔW may take fewer input features than it has (zero-padded, as FLUX.1's loader does)."""
    network = NETWORK_NAMES[component]
    if shape is None:
        return f"'{module}' is not in this {network} (a LoRA for another architecture?)"
    linear = len(shape) == 2 == len(pair.shape) and shape[0] == pair.shape[0]
    if pads and linear and pair.shape[1] < shape[1]:
        return None
    if pads and linear and pair.shape[1] > shape[1]:  # diffusers widens the PyTorch Linear; an engine's is fixed
        return (f"'{module}' takes {pair.shape[1]} input features and this {network}'s takes {shape[1]}: diffusers "
                "widens a PyTorch transformer for such a LoRA (FLUX.1 Canny / Depth LoRAs widen x_embedder), an "
                "engine's inputs are fixed at build: compile the model the LoRA was made for (FLUX.1 Canny / Depth "
                "with its control input) and load it there")  # fmt: skip
    if shape != pair.shape:
        return (f"'{module}' changes a {list(pair.shape)} weight, this {network}'s is {list(shape)} "
                "(a LoRA for another architecture?)")  # fmt: skip
    return None


def refuse_misfits(lora: LoraFile, pipe: Any) -> None:
    """LoraError, worded as for engines, for the first module the pipeline's PyTorch networks lack or hold in
    another shape."""
    from ..stages.weight_map import lora_parameters

    for component, modules in lora.parts.items():
        network = getattr(pipe, component, None)
        if network is None:
            raise LoraError(f"{lora.path} changes the {NETWORK_NAMES[component]} ({component}), which this model lacks")
        shapes = {name: tuple(weight.shape) for name, weight in lora_parameters(network).items()}
        for module, pair in modules.items():
            if problem := shape_problem(module, pair, shapes.get(f"{module}.weight"), component, lora.pads(component)):
                raise LoraError(f"{lora.path}: {problem}")


def coverage(lora: LoraFile, maps: dict[str, WeightMap]) -> dict[str, dict[str, str]]:
    """network → module → 'ok', or why the engine's weight map cannot take it (no engine for that network)."""
    return {
        component: {
            module: (placement_problem(module, pair, maps[component], component, lora.pads(component)) or "ok")
            if component in maps
            else f"no {NETWORK_NAMES[component]} engine given"
            for module, pair in modules.items()
        }
        for component, modules in lora.parts.items()
    }
