"""The accuracy guard: quantize, validate against fp32, return the worst layers to high precision, again.

``compile --precision int8 --min-psnr 30`` asks for an 8-bit engine whose image stays within 30 dB PSNR of the
fp32 pipeline's. Each round quantizes the denoiser (sdtrt.stages.quantize) with the layers kept in high
precision so far, builds the engine and validates it (sdtrt.tools.validate: one generation against the fp32
pipeline). Below the target, the quantized layers are ranked by how far each one's own output moves when its
quantizers are on, and the worst go back to high precision for the next round; a bounded number of rounds.

Why rank in PyTorch, with ModelOpt's quantizers switched per layer, and not with ``sdtrt debug``'s
layer-by-layer graph comparison: an error spreads downstream, so in the graph every tensor after a bad layer
diverges too and the largest errors sit late in the network, far from their cause. Feeding each layer the
fp32 input it would see and comparing its output with and without its own quantizers isolates that layer's
error (one fp32 pass over the inputs, each quantized layer run once more, nothing kept in memory); and its
names are the module names ``keep_high_precision`` takes, where graph nodes would have to be mapped back.
ModelOpt's own ``compute_quantization_mse`` measures each quantizer's tensor in absolute terms, not what the
layer computes from it, which does not compare across layers of different scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..core.config import QuantizeConfig, ValidationConfig
from ..core.errors import ConfigError, ParityError

if TYPE_CHECKING:
    import torch

    from ..core.store import Store
    from ..sources.models import ModelSource
    from .compile import CompileResult


@dataclass(frozen=True)
class GuardConfig:
    """The image PSNR (dB, against the fp32 pipeline) an 8-bit compile must reach, in at most ``rounds``
    quantizations, returning ``layers_per_round`` layers to high precision after each one that falls short."""

    min_psnr_db: float = 30.0
    rounds: int = 3
    layers_per_round: int = 2

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.layers_per_round < 1:
            raise ConfigError("the accuracy guard needs at least one round and one layer per round")


@dataclass
class GuardRound:
    psnr_db: float
    engine: str  # the final artifact this round compiled
    kept: list[str]  # the layers the guard kept in high precision for this round
    returned: list[str] = field(default_factory=list)  # the worst layers, kept from the next round on
    worst: list[dict[str, Any]] = field(default_factory=list)  # the ranking's top: layer, error


@dataclass
class GuardReport:
    """Truthy when the last round reached the target; ``result`` is that round's compile."""

    min_psnr_db: float
    rounds: list[GuardRound]
    result: CompileResult = field(repr=False)

    def __bool__(self) -> bool:
        return self.rounds[-1].psnr_db >= self.min_psnr_db

    @property
    def kept(self) -> list[str]:
        return self.rounds[-1].kept

    def raise_for_status(self) -> None:
        if not self:
            kept = f"{len(self.kept)} layers kept in high precision" if self.kept else "no layer kept"
            raise ParityError(
                f"the image PSNR stays at {self.rounds[-1].psnr_db:.1f} dB < {self.min_psnr_db:g} dB after "
                f"{len(self.rounds)} rounds ({kept}); allow more rounds (--guard-rounds), a lower --min-psnr, "
                "or a lower --level"
            )

    def to_json(self) -> dict[str, Any]:
        rounds = [asdict(r) for r in self.rounds]
        return {"min_psnr_db": self.min_psnr_db, "passed": bool(self), "kept": self.kept, "rounds": rounds}


def guard(
    model: ModelSource,
    store: Store,
    quantize_config: QuantizeConfig,
    config: GuardConfig = GuardConfig(),
    validation: ValidationConfig = ValidationConfig(),
    **compile_options: Any,
) -> GuardReport:
    """``compile_model`` with ``quantize_config``, validated, until the image PSNR reaches ``config.min_psnr_db``.

    After a round below it, the quantized layers are ranked (``layer_errors``, on the calibration set's inputs)
    and the worst go back to high precision (``keep_high_precision``) for the next; every round's artifacts are
    cached, so a second run with the same settings repeats no work. Does not raise: ``raise_for_status``.
    """
    from .compile import compile_model

    validation = replace(validation, min_psnr_db=config.min_psnr_db)
    guarded: list[str] = []
    rounds: list[GuardRound] = []
    while True:
        quantizing = replace(quantize_config, keep_high_precision=quantize_config.keep_high_precision + tuple(guarded))
        result = compile_model(model, store, quantize_config=quantizing, validation=validation, **compile_options)
        assert result.validation is not None and result.validation.image is not None  # validation asked for images
        rounds.append(GuardRound(result.validation.image["psnr_db"], str(result.final.path), list(guarded)))
        if rounds[-1].psnr_db >= config.min_psnr_db or len(rounds) == config.rounds:
            return GuardReport(config.min_psnr_db, rounds, result)
        errors = rank_layers(quantizing, model)
        returned = worst_layers(errors, config.layers_per_round, quantizing.keep_high_precision)
        if not returned:  # every quantized layer is kept already: nothing left to return
            return GuardReport(config.min_psnr_db, rounds, result)
        rounds[-1].returned = returned
        rounds[-1].worst = [{"layer": n, "error": errors[n]} for n in worst_layers(errors, 5)]
        guarded += returned


def rank_layers(config: QuantizeConfig, model: ModelSource) -> dict[str, float]:
    """``layer_errors`` of the model's denoiser quantized with ``config``, on the calibration set's inputs."""
    from ..core.progress import step
    from ..stages import calibration, quantize

    quantized = quantize.quantized_denoiser(config, model)
    with step("Recording the calibration inputs to rank the quantized layers"):
        pipe = calibration.load_reference_pipeline(model)
        calls = calibration.record(pipe, calibration.pipeline_denoiser(pipe, model), config).calls
        del pipe
    with step(f"Ranking {len(quantized.plan.quantized)} quantized layers by their own output error"):
        return layer_errors(quantized.network, calls)


def _tensor(output: Any) -> torch.Tensor:
    """A module's main output: the tensor itself, or the first of a tuple (diffusers' attention returns one)."""
    return output if not isinstance(output, tuple | list) else output[0]


def layer_errors(
    network: torch.nn.Module, calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]]
) -> dict[str, float]:
    """Each quantized layer of a ModelOpt fake-quant ``network`` → the relative RMS error its own quantizers put
    into its output, over ``calls`` (the network's (positional, keyword) arguments, as calibration records them).

    A layer is a module owning enabled quantizers (ModelOpt's ``TensorQuantizer`` children: a Linear's or Conv's
    input and weight quantizers, an attention's bmm ones). The network runs in fp32 (every quantizer off); at
    each such layer, its own quantizers are switched on to run it again on the same input: error
    sqrt(Σ‖quantized − fp32‖² / Σ‖fp32‖²). Every quantizer is left as it was.
    """
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer

    quantizers = [m for m in network.modules() if isinstance(m, TensorQuantizer)]
    enabled = {id(q): q.is_enabled for q in quantizers}
    owned = {
        name: [c for c in module.children() if isinstance(c, TensorQuantizer) and c.is_enabled]
        for name, module in network.named_modules()
    }
    layers = {name: module for name, module in network.named_modules() if owned[name]}
    sums = {name: [0.0, 0.0] for name in layers}  # Σ‖error‖², Σ‖fp32‖²
    rerunning = False  # the layer's second run calls its children: their hooks stay out of it

    def measure(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            nonlocal rerunning
            if rerunning:
                return
            rerunning = True
            try:
                for quantizer in owned[name]:
                    quantizer.enable()
                quantized = _tensor(module.forward(*args, **kwargs)).float()
            finally:
                for quantizer in owned[name]:
                    quantizer.disable()
                rerunning = False
            reference = _tensor(output).float()
            sums[name][0] += float((quantized - reference).pow(2).sum())
            sums[name][1] += float(reference.pow(2).sum())

        return hook

    handles = [module.register_forward_hook(measure(name), with_kwargs=True) for name, module in layers.items()]
    try:
        for quantizer in quantizers:
            quantizer.disable()
        with torch.no_grad():
            for args, kwargs in calls:
                network(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        for quantizer in quantizers:
            quantizer.enable() if enabled[id(quantizer)] else quantizer.disable()
    return {name: (error / max(norm, 1e-30)) ** 0.5 for name, (error, norm) in sums.items()}


def worst_layers(errors: Mapping[str, float], count: int, kept: Iterable[str] = ()) -> list[str]:
    """The ``count`` layers with the largest errors, largest first, leaving out those already ``kept``."""
    skip = set(kept)
    ranked = sorted((name for name in errors if name not in skip), key=lambda name: errors[name], reverse=True)
    return ranked[:count]
