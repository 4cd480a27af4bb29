"""A LoRA swap against a fresh compile of the same target (ONNX Runtime, UNet only), on the CPU.

Makes two random rank-8 LoRAs on the attention and feed-forward projections (sdtrt.lora.files.random_lora,
as `sdtrt lora random` does), compiles the UNet into a fresh temporary store (export → simplify →
build-ort, no validation), then times on the loaded pipeline: the first LoRA (weight map made and
base weights read), a swap to a second one, a swap back, and `clear_loras()`. Each swap recomputes
base + Σ scale·ΔW and opens a new ONNX Runtime session with the replaced initializers.

    python benchmarks/lora_swap.py --model tiny
    python benchmarks/lora_swap.py --model sd15-random
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from sdtrt.core.store import Store
from sdtrt.lora.files import random_lora
from sdtrt.pipeline.loading import load_pipeline
from sdtrt.sources.models import resolve_model
from sdtrt.tools.compile import compile_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        a = random_lora(model, Path(tmp) / "a.safetensors", seed=1)
        b = random_lora(model, Path(tmp) / "b.safetensors", seed=2)
        started = time.perf_counter()
        engine = compile_model(model, Store(Path(tmp) / "engines"), target="onnxruntime", components=("unet",)).final
        compile_s = time.perf_counter() - started
        pipe = load_pipeline(model, engine)
        swaps = {}
        for label, loras in (("first (map made)", [(a, 0.8)]), ("A→B", [(b, 0.8)]), ("B→A", [(a, 0.8)]), ("clear", [])):
            pipe.unet.set_loras(loras)
            swaps[label] = round(pipe.unet.loras.last_swap_s, 3)
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        json.dumps(
            {"model": args.model, "compile_s": round(compile_s, 2), "swap_s": swaps, "peak_rss_gb": round(peak_gb, 1)}
        )
    )


if __name__ == "__main__":
    main()
