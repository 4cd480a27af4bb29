"""Step caches at Flux.1-dev's full size on a GPU: does sdtrt's split eat the gain there?

    python benchmarks/step_cache_gpu.py                       # Flux.1-dev's architecture, random bf16 weights, CUDA
    python benchmarks/step_cache_gpu.py --size tiny --device cpu --steps 6       # the same code on tiny-flux's shape

Where TensorRT cannot run (the GPU machines sdtrt is measured on have PyTorch but no TensorRT), this runs sdtrt's own
engine transformer stand-in (standins/transformer.py: diffusers' cache hooks over the split members,
standins/step_cache.py) over runtimes that run each member's graph module (stages/graph_module.py: the module the
exporter traces) as PyTorch on the device instead of an engine. Everything between the pipeline's call and the
runtimes is what an engine pipeline runs; only the kernels differ. One process, side by side, as
benchmarks/step_cache.py does on the CPU: the uncached loop on the whole network, each cache's loop, the members'
seconds per call (timed in a separate pass, synchronised) and from them the ideal speed-up: the uncached loop less
the work the cache skipped. ``speedup/ideal`` near 1: the split and the hooks cost nothing at this size.

The loop is Flux's flow-matching Euler loop over the transformer alone (the text encoders and the VAE do not change
with a cache), 28 steps at 1024² by default: 4096 image tokens, 512 text tokens, guidance 3.5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

FLUX_DEV = {
    "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
    "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
TINY = FLUX_DEV | {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                   "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
MID = FLUX_DEV | {"num_layers": 2, "num_single_layers": 8, "attention_head_dim": 64, "num_attention_heads": 4,
                  "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (8, 28, 28)}  # fmt: skip
CACHES = ("first-block:0", "first-block:0.1", "first-block:0.3", "first-block:0.5", "taylorseer:3", "magcache:0.3")


class Configs:
    """What sdtrt's specs read of a model (spec/base.py ModelConfigs), for a transformer alone."""

    def __init__(self, transformer: dict[str, Any]) -> None:
        self.configs = {"transformer": transformer}

    def has(self, folder: str) -> bool:
        return folder in self.configs

    def component_config(self, folder: str) -> dict[str, Any]:
        return self.configs[folder]

    def component_class(self, folder: str) -> tuple[str, str]:
        return "diffusers", self.configs[folder]["_class_name"]

    def unet_config(self) -> dict[str, Any]:
        raise KeyError("unet")

    def vae_scale_factor(self) -> int:
        return 8

    def pooled_text_dim(self) -> int | None:
        return self.configs["transformer"]["pooled_projection_dim"]


class ModuleRuntime:
    """sdtrt's Runtime protocol (runtime/base.py) over a member's graph module run as PyTorch: its inputs in the
    graph's order and dtype, its outputs by the graph's names."""

    name = "torch-module"

    def __init__(self, spec: Any, network: torch.nn.Module, dtype: torch.dtype) -> None:
        from sdtrt.stages.graph_module import graph_module

        self.spec, self.network, self.dtype = spec, network, dtype
        self.module = graph_module(spec, network)
        self.seconds: list[float] = []
        self.timed = False

    @property
    def device(self) -> torch.device:
        return next(self.network.parameters()).device

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from sdtrt.runtime.base import TORCH_DTYPES

        inputs = [feeds[t.name].to(self.device, TORCH_DTYPES[t.dtype]) for t in self.spec.inputs()]
        started = self._sync()
        with torch.no_grad():
            out = self.module(*inputs)
        if self.timed:
            self.seconds.append(self._sync() - started)
        return dict(zip(self.spec.output_names, out if isinstance(out, tuple | list) else (out,), strict=True))

    def _sync(self) -> float:
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def close(self) -> None:
        pass


def stand_in(config: dict[str, Any], device: str, dtype: torch.dtype) -> tuple[Any, dict[str, ModuleRuntime]]:
    """sdtrt's engine transformer over the whole network and, for its step caches, the four split members."""
    from diffusers import FluxTransformer2DModel

    from sdtrt.core.config.components import TRANSFORMER_PARTS
    from sdtrt.lora.refit import EngineLoras
    from sdtrt.spec import component_spec
    from sdtrt.standins.transformer import EngineTransformer

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 on the device: Flux.1-dev's 11.9 B parameters are 23.8 GB
    try:
        with torch.device(device):
            network = FluxTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    finally:
        torch.set_default_dtype(previous)
    configs, precision = Configs(config), {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    whole = ModuleRuntime(component_spec(configs, "transformer", precision), network, dtype)
    runtimes = {c: ModuleRuntime(component_spec(configs, c, precision), network, dtype) for c in TRANSFORMER_PARTS}
    transformer = EngineTransformer(whole, dict(network.config), dtype)
    transformer.use_parts(lambda: runtimes, lambda c, runtime: EngineLoras("transformer", runtime, lambda: None))
    return transformer, {"transformer": whole, **runtimes}


def denoise(transformer: Any, inputs: dict[str, torch.Tensor], sigmas: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Flux's Euler loop over the transformer in its pipeline's cache context; the latents and the loop's seconds."""
    latents = inputs["hidden_states"].clone()
    sync = torch.cuda.synchronize if latents.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for sigma, next_sigma in itertools.pairwise(sigmas):
        with transformer.cache_context("cond"):
            noise = transformer(**inputs | {"hidden_states": latents, "timestep": sigma.expand(1)}, return_dict=False)[
                0
            ]
        latents = (latents.float() + (next_sigma - sigma) * noise.float()).to(latents.dtype)
    sync()
    seconds = time.perf_counter() - started
    transformer._reset_stateful_cache()  # what the pipeline's maybe_free_model_hooks does after a call
    return latents, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size",
        choices=("flux-dev", "mid", "tiny"),
        default="flux-dev",
        help="The transformer's architecture: Flux.1-dev's, 2 + 8 blocks of 256, or tiny-flux's.",
    )
    parser.add_argument("--pixels", type=int, default=1024, help="Image side in pixels (1024: 4096 image tokens).")
    parser.add_argument("--steps", type=int, default=28, help="Euler steps.")
    parser.add_argument("--repeats", type=int, default=2, help="Alternating uncached/cached loops per cache.")
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32).")
    parser.add_argument("--caches", default=",".join(CACHES), help="Comma-separated KIND:VALUE settings, as --cache.")
    parser.add_argument("--json", type=Path, default=Path("step-cache-gpu.json"), help="Where the rows go.")
    args = parser.parse_args()
    from sdtrt.pipeline.step_cache import StepCache

    config = {"flux-dev": FLUX_DEV, "mid": MID, "tiny": TINY}[args.size]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformer, runtimes = stand_in(config, args.device, dtype)
    tokens, seed = (args.pixels // 16) ** 2, torch.Generator().manual_seed(0)
    side = args.pixels // 16
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
    img_ids = torch.stack(grid, -1)
    inputs = {
        "hidden_states": torch.randn(1, tokens, config["in_channels"], generator=seed),
        "encoder_hidden_states": torch.randn(1, 512, config["joint_attention_dim"], generator=seed),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=seed),
        "txt_ids": torch.zeros(512, 3),
        "img_ids": img_ids.reshape(-1, 3).float(),
        "guidance": torch.full((1,), 3.5),
    }
    inputs = {
        k: v.to(args.device, dtype if v.is_floating_point() and k != "guidance" else v.dtype) for k, v in inputs.items()
    }
    sigmas = torch.linspace(1.0, 1 / args.steps, args.steps).to(args.device)
    sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    print(f"{args.size} transformer, {tokens} image tokens, {args.steps} steps, on {args.device} ({dtype})", flush=True)
    reference, _ = denoise(transformer, inputs, sigmas)  # warm-up, and the uncached latents
    rows = []
    for label in args.caches.split(","):
        kind, _, value = label.partition(":")
        cache = StepCache(kind, float(value))  # type: ignore[arg-type]  # first-block:0, the chain on every step
        # The members' seconds per call, synchronised, in a pass of its own (the loops below are not).
        for runtime in runtimes.values():
            runtime.timed, runtime.seconds = True, []
        transformer.enable_cache(cache.config(None, args.steps))
        _, _ = denoise(transformer, inputs, sigmas)
        transformer.disable_cache()
        calls = {c: len(r.seconds) for c, r in runtimes.items()}
        per_call = {c: sum(r.seconds) / len(r.seconds) for c, r in runtimes.items() if r.seconds}
        for runtime in runtimes.values():
            runtime.timed = False
        loops: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):  # alternating, so drift hits both
            loops["uncached"].append(denoise(transformer, inputs, sigmas)[1])
            transformer.enable_cache(cache.config(None, args.steps))
            latents, seconds = denoise(transformer, inputs, sigmas)
            transformer.disable_cache()
            loops["cached"].append(seconds)
        uncached, cached = min(loops["uncached"]), min(loops["cached"])
        # Calls each member makes when nothing is skipped: every one, every step.
        saved = sum((args.steps - calls.get(c, 0)) * t for c, t in per_call.items() if c != "transformer")
        ideal = uncached / max(uncached - saved, 1e-9)
        error = ((latents.float() - reference.float()).norm() / reference.float().norm()).item()
        row = {
            "size": args.size, "pixels": args.pixels, "steps": args.steps, "device": torch.cuda.get_device_name()
            if args.device == "cuda" else "cpu", "cache": label, "rest_calls": calls.get("transformer_rest", 0),
            "uncached_s": round(uncached, 3), "cached_s": round(cached, 3), "speedup": round(uncached / cached, 3),
            "ideal_speedup": round(ideal, 3), "speedup_vs_ideal": round(uncached / cached / ideal, 3),
            "member_call_ms": {c: round(t * 1000, 2) for c, t in per_call.items()}, "latent_rel_error": round(error, 5),
        }  # fmt: skip
        rows.append(row)
        print(
            f"{label:>17}: the other blocks ran {row['rest_calls']}/{args.steps}, {uncached:.3f} → {cached:.3f} s = "
            f"{row['speedup']:.2f}× (ideal {ideal:.2f}×, ratio {row['speedup_vs_ideal']:.2f}), latents off by "
            f"{error:.2%}; ms per call {row['member_call_ms']}",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
