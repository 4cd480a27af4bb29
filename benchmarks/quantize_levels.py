"""Image PSNR against the fp32 pipeline, per quantization precision and level, on ONNX Runtime (CPU).

Each (precision, level) is compiled for the ONNX Runtime target with only the UNet quantized (quantize →
simplify → build-ort, cached in the store), then validated: one seeded generation through both pipelines and the
UNet's tensor parity against PyTorch fp32. Prints a table; no thresholds (random-weight presets say how far each
level moves the image, not how good a trained model stays).

    python benchmarks/quantize_levels.py --model tiny --levels 1,2,2.5,3 --steps 8
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--precisions", default="int8,fp8")
    parser.add_argument("--levels", default="1,2,2.5,3")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps of the compared generation")
    parser.add_argument("--calibration-prompts", type=int, default=2)
    parser.add_argument("--calibration-steps", type=int, default=2)
    parser.add_argument("--engines", default=os.environ.get("SDTRT_ENGINES", "engines"))
    args = parser.parse_args()

    from sdtrt.core.config import CALIBRATION_PROMPTS, QuantizeConfig, ValidationConfig
    from sdtrt.core.store import Store
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    model, store = resolve_model(args.model), Store(args.engines)
    rows = []
    for precision in args.precisions.split(","):
        for level in (float(v) for v in args.levels.split(",")):
            config = QuantizeConfig(
                precision=precision,  # type: ignore[arg-type]
                level=level,
                calibration_prompts=CALIBRATION_PROMPTS[: args.calibration_prompts],
                calibration_steps=args.calibration_steps,
            )
            started = time.perf_counter()
            result = compile_model(
                model, store, "onnxruntime", components=("unet",), quantize_config=config,
                validation=ValidationConfig(steps=args.steps),
            )  # fmt: skip
            report = result.validation
            assert report is not None and report.image is not None
            worst = min(report.tensors, key=lambda row: row["cosine"])
            layers = len(result.artifacts[0].manifest["details"]["quantized_layers"])
            rows.append(
                (precision, level, layers, report.image["psnr_db"], worst["cosine"], time.perf_counter() - started)
            )
    print(f"\n{args.model}: image PSNR vs the fp32 pipeline ({args.steps} steps), ONNX Runtime CPU")
    print(f"{'precision':<10}{'level':>6}{'layers':>8}{'PSNR dB':>10}{'min cosine':>12}{'seconds':>9}")
    for precision, level, layers, psnr, cosine, seconds in rows:
        print(f"{precision:<10}{level:>6g}{layers:>8}{psnr:>10.1f}{cosine:>12.5f}{seconds:>9.0f}")


if __name__ == "__main__":
    main()
