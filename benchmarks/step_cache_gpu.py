"""Step caches at full size on a GPU: does sdtrt's split eat the gain there?

    python benchmarks/step_cache_gpu.py                  # Flux.1-dev's transformer, random bf16 weights, CUDA
    python benchmarks/step_cache_gpu.py --size sd15      # SD 1.5's UNet, fp16, DeepCache
    python benchmarks/step_cache_gpu.py --size tiny --device cpu --steps 6       # the same code on tiny-flux's shape

Where TensorRT cannot run (the GPU machines sdtrt is measured on have PyTorch but no TensorRT), this runs sdtrt's own
engine stand-ins (standins/transformer.py with diffusers' cache hooks over the split members, standins/step_cache.py;
standins/unet.py with DeepCache's two members, standins/deepcache.py) over runtimes that run each member's graph
module (stages/graph_module.py: the module the exporter traces) as PyTorch on the device instead of an engine.
Everything between the pipeline's call and the runtimes is what an engine pipeline runs; only the kernels differ.
One process, side by side, as benchmarks/step_cache.py does on the CPU: the uncached loop on the whole network, each
cache's loop, the members' seconds per call (timed in a separate pass, synchronised) and from them the ideal
speed-up: the uncached loop less the work the cache skipped. ``speedup/ideal`` near 1: the split and the hooks cost
nothing at this size.

The loops run the denoiser alone (the text encoders and the VAE do not change with a cache): Flux's flow-matching
Euler loop, 28 steps at 1024² (4096 image tokens, 512 text tokens, guidance 3.5); SD's, 50 steps at 512² with
classifier-free guidance's batch of 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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
SD15 = {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8}  # sd15-random's UNet: 859.5 M
TINY_UNET = {"sample_size": 32, "block_out_channels": (32, 64), "layers_per_block": 2, "cross_attention_dim": 32,
             "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"), "attention_head_dim": 8,
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "norm_num_groups": 32}  # fmt: skip
SIZES = {"flux-dev": FLUX_DEV, "mid": MID, "tiny": TINY, "sd15": SD15, "tiny-unet": TINY_UNET}
UNET_MEMBERS = ("unet_deep", "unet_shallow")
UNET_CACHES = ("deepcache:1", "deepcache:2", "deepcache:3", "deepcache:5")
PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CACHES = ("first-block:0", "first-block:0.1", "first-block:0.3", "first-block:0.5", "taylorseer:3", "magcache:0.3")


class Configs:
    """What sdtrt's specs read of a model (spec/base.py ModelConfigs), for a transformer alone."""

    def __init__(self, configs: dict[str, dict[str, Any]]) -> None:
        self.configs = configs

    def has(self, folder: str) -> bool:
        return folder in self.configs

    def component_config(self, folder: str) -> dict[str, Any]:
        return self.configs[folder]

    def component_class(self, folder: str) -> tuple[str, str]:
        return "diffusers", self.configs[folder].get("_class_name", "UNet2DConditionModel")

    def unet_config(self) -> dict[str, Any]:
        return self.configs["unet"]

    def vae_scale_factor(self) -> int:
        return 8

    def pooled_text_dim(self) -> int | None:
        return self.configs["transformer"]["pooled_projection_dim"] if "transformer" in self.configs else None


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


@dataclass
class Bench:
    """What is measured: the stand-in, its runtimes by member, one denoising loop (latents, seconds), how a cache
    goes on and off, and how often each member runs per step when nothing is skipped."""

    loop: Callable[[], tuple[torch.Tensor, float]]
    runtimes: dict[str, ModuleRuntime]
    enable: Callable[[Any], None]
    disable: Callable[[], None]
    baseline: dict[str, int]  # calls per step of each split member with nothing skipped
    skipped_member: str  # the member whose calls say how many steps ran in full


def random_network(cls: Any, config: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    """A diffusers network with seeded random weights, built in ``dtype`` on the device (Flux.1-dev: 23.8 GB)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    finally:
        torch.set_default_dtype(previous)


def flux_bench(config: dict[str, Any], args: argparse.Namespace, dtype: torch.dtype) -> Bench:
    """sdtrt's engine transformer over the whole network and its four split members; Flux's Euler loop over the
    transformer alone in the pipeline's cache context (4096 image and 512 text tokens at 1024², guidance 3.5)."""
    from diffusers import FluxTransformer2DModel

    from sdtrt.core.config.components import TRANSFORMER_PARTS
    from sdtrt.lora.refit import EngineLoras
    from sdtrt.pipeline.step_cache import StepCache
    from sdtrt.spec import component_spec
    from sdtrt.standins.transformer import EngineTransformer

    network = random_network(FluxTransformer2DModel, config, args.device, dtype)
    configs, precision = Configs({"transformer": config}), PRECISIONS[dtype]
    whole = ModuleRuntime(component_spec(configs, "transformer", precision), network, dtype)
    parts = {c: ModuleRuntime(component_spec(configs, c, precision), network, dtype) for c in TRANSFORMER_PARTS}
    transformer = EngineTransformer(whole, dict(network.config), dtype)
    transformer.use_parts(lambda: parts, lambda c, runtime: EngineLoras("transformer", runtime, lambda: None))
    side, seed = args.pixels // 16, torch.Generator().manual_seed(0)
    grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
    inputs = {
        "hidden_states": torch.randn(1, side * side, config["in_channels"], generator=seed),
        "encoder_hidden_states": torch.randn(1, 512, config["joint_attention_dim"], generator=seed),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=seed),
        "txt_ids": torch.zeros(512, 3),
        "img_ids": torch.stack(grid, -1).reshape(-1, 3),
        "guidance": torch.full((1,), 3.5),
    }
    inputs = {k: v.to(args.device, dtype if k != "guidance" else v.dtype) for k, v in inputs.items()}
    sigmas = torch.cat([torch.linspace(1.0, 1 / args.steps, args.steps), torch.zeros(1)]).to(args.device)

    def loop() -> tuple[torch.Tensor, float]:
        latents, started = inputs["hidden_states"].clone(), synchronised()
        for sigma, next_sigma in itertools.pairwise(sigmas):
            with transformer.cache_context("cond"):
                step = inputs | {"hidden_states": latents, "timestep": sigma.expand(1)}
                noise = transformer(**step, return_dict=False)[0]
            latents = (latents.float() + (next_sigma - sigma) * noise.float()).to(latents.dtype)
        seconds = synchronised() - started
        transformer._reset_stateful_cache()  # what the pipeline's maybe_free_model_hooks does after a call
        return latents, seconds

    def enable(label: str) -> None:
        kind, _, value = label.partition(":")
        cache = StepCache(kind, float(value))  # type: ignore[arg-type]  # first-block:0, the chain on every step
        transformer.enable_cache(cache.config(None, args.steps))

    print(f"{args.size} transformer, {side * side} image tokens, {args.steps} steps, on {args.device} ({dtype})")
    return Bench(loop, {"transformer": whole, **parts}, enable, transformer.disable_cache,
                 dict.fromkeys(TRANSFORMER_PARTS, 1), "transformer_rest")  # fmt: skip


def unet_bench(config: dict[str, Any], args: argparse.Namespace, dtype: torch.dtype) -> Bench:
    """sdtrt's engine UNet over the whole UNet and DeepCache's two members; an Euler loop over the UNet with
    classifier-free guidance's batch of 2 (SD 1.5 at 512²: 64² latents, 77 CLIP tokens)."""
    from diffusers import UNet2DConditionModel

    from sdtrt.spec import component_spec
    from sdtrt.standins.unet import EngineUNet

    network = random_network(UNet2DConditionModel, config, args.device, dtype)
    configs, precision = Configs({"unet": dict(network.config)}), PRECISIONS[dtype]
    whole = ModuleRuntime(component_spec(configs, "unet", precision), network, dtype)
    parts = {c: ModuleRuntime(component_spec(configs, c, precision), network, dtype) for c in UNET_MEMBERS}
    unet = EngineUNet(whole, dict(network.config), dtype)
    unet.use_parts(lambda: parts)
    side, seed = args.pixels // 8, torch.Generator().manual_seed(0)
    sample = torch.randn(1, config.get("in_channels", 4), side, side, generator=seed).to(args.device, dtype)
    text = torch.randn(2, 77, config["cross_attention_dim"], generator=seed).to(args.device, dtype)
    timesteps = torch.linspace(999, 0, args.steps).round()

    def loop() -> tuple[torch.Tensor, float]:
        latents, started = sample.clone(), synchronised()
        for t in timesteps:
            noise = unet(torch.cat([latents] * 2), t, text).sample
            latents = latents - noise.chunk(2)[0] / args.steps  # a step's arithmetic; the UNet's work is measured
        seconds = synchronised() - started
        unet._reset_stateful_cache()
        return latents, seconds

    def enable(label: str) -> None:
        steps = {float(t): i for i, t in enumerate(timesteps)}
        unet.enable_deepcache(int(label.partition(":")[2]), 0, lambda t: steps[float(t)])

    print(f"{args.size} UNet, {side}² latents, batch 2, {args.steps} steps, on {args.device} ({dtype})")
    return Bench(loop, {"unet": whole, **parts}, enable, unet.disable_deepcache, {"unet_deep": 1, "unet_shallow": 0},
                 "unet_deep")  # fmt: skip


def synchronised() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(bench: Bench, label: str, args: argparse.Namespace, reference: torch.Tensor) -> dict[str, Any]:
    """One cache's row: its members' seconds per call (synchronised, in a pass of its own), then alternating uncached
    and cached loops, the ideal speed-up from the work skipped, and the latents against the uncached ones."""
    for runtime in bench.runtimes.values():
        runtime.timed, runtime.seconds = True, []
    bench.enable(label)
    bench.loop()
    bench.disable()
    calls = {c: len(r.seconds) for c, r in bench.runtimes.items()}
    per_call = {c: sum(r.seconds) / len(r.seconds) for c, r in bench.runtimes.items() if r.seconds}
    for runtime in bench.runtimes.values():
        runtime.timed = False
    loops: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeats):  # alternating, so drift hits both
        loops["uncached"].append(bench.loop()[1])
        bench.enable(label)
        latents, seconds = bench.loop()
        bench.disable()
        loops["cached"].append(seconds)
    uncached, cached = min(loops["uncached"]), min(loops["cached"])
    saved = sum((args.steps * every - calls.get(c, 0)) * per_call.get(c, 0.0) for c, every in bench.baseline.items())
    ideal = uncached / max(uncached - saved, 1e-9)
    error = ((latents.float() - reference.float()).norm() / reference.float().norm()).item()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    row = {
        "size": args.size, "pixels": args.pixels, "steps": args.steps, "device": device, "cache": label,
        "full_steps": calls.get(bench.skipped_member, 0), "uncached_s": round(uncached, 3),
        "cached_s": round(cached, 3), "speedup": round(uncached / cached, 3), "ideal_speedup": round(ideal, 3),
        "speedup_vs_ideal": round(uncached / cached / ideal, 3),
        "member_call_ms": {c: round(t * 1000, 2) for c, t in per_call.items()}, "latent_rel_error": round(error, 5),
    }  # fmt: skip
    print(
        f"{label:>17}: {row['full_steps']}/{args.steps} full, {uncached:.3f} → {cached:.3f} s = {row['speedup']:.2f}× "
        f"(ideal {ideal:.2f}×, ratio {row['speedup_vs_ideal']:.2f}), latents off by {error:.2%}; ms per call "
        f"{row['member_call_ms']}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(SIZES), default="flux-dev",
                        help="The network: Flux.1-dev's transformer, 2 + 8 blocks of 256, tiny-flux's; SD 1.5's UNet "
                        "or the tiny preset's (DeepCache).")  # fmt: skip
    parser.add_argument("--pixels", type=int, default=0, help="Image side in pixels (default: 1024 Flux, 512 SD).")
    parser.add_argument("--steps", type=int, default=0, help="Denoising steps (default: 28 Flux, 50 SD).")
    parser.add_argument("--repeats", type=int, default=2, help="Alternating uncached/cached loops per cache.")
    parser.add_argument("--device", default="cuda", help="cuda (16 bits) or cpu (fp32).")
    parser.add_argument("--caches", default="", help="Comma-separated KIND:VALUE settings, as --cache.")
    parser.add_argument("--json", type=Path, default=Path("step-cache-gpu.json"), help="Where the rows go.")
    args = parser.parse_args()
    config = SIZES[args.size]
    unet = "cross_attention_dim" in config
    args.pixels, args.steps = args.pixels or (512 if unet else 1024), args.steps or (50 if unet else 28)
    dtype = torch.float32 if args.device == "cpu" else torch.float16 if unet else torch.bfloat16
    bench = (unet_bench if unet else flux_bench)(config, args, dtype)
    reference, _ = bench.loop()  # warm-up, and the uncached latents
    caches = args.caches or ",".join(UNET_CACHES if unet else CACHES)
    rows = [measure(bench, label, args, reference) for label in caches.split(",")]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
