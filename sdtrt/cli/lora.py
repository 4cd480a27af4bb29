"""`sdtrt lora inspect`: what a LoRA file holds, and whether an engine's weight map can take it.
`sdtrt lora random`: a LoRA with random weights, to try LoRAs with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..core.errors import LoraError
from ..core.progress import results, step
from . import store_options

app = typer.Typer(
    help="LoRA files: inspect what they change and whether an engine can take them; make random ones to try.",
    no_args_is_help=True,
)


@app.command(name="inspect")
def inspect_command(
    file: Annotated[Path, typer.Argument(help="A LoRA .safetensors file (diffusers/PEFT or kohya/A1111).")],
    engine: Annotated[
        str | None, typer.Option(help=f"{store_options.ENGINE_HELP}; check its weight map covers the LoRA.")
    ] = None,
    model: store_options.EngineModelOpt = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Format, family, rank, alpha and scale, the modules a LoRA touches in the denoiser (UNet, or SD3's, FLUX.1's,
    FLUX.2's, Z-Image's or Qwen-Image's transformer) and CLIP text encoders, and (with --engine, a denoiser engine or
    an engine set) whether the engine's weight maps take them. The file is read with the diffusers loader of the
    engine's (or --model's) family; with neither, of the family its names point to.

    Example: sdtrt lora inspect style.safetensors --engine engines/set/2a06c39aaf814d52
    """
    from rich.table import Table

    from ..lora.files import describe, read_lora
    from ..lora.refit import coverage

    artifact = store_options.find_engine(engine, engines) if engine else None
    source = store_options.model_for(model, artifact) if artifact or model else None
    lora = read_lora(file, source.family() if source else None)
    summary = describe(lora)
    for key in ("file", "format", "family", "networks", "ranks", "alphas", "scales"):
        results.print(escape(f"{key}: {summary[key]}"))
    fits = None
    if artifact and source:
        from ..pipeline.loading import engine_members
        from ..stages.weight_map import for_engine

        members = engine_members(artifact)
        fits = coverage(lora, {c: for_engine(members[c], source, c) for c in lora.parts if c in members})
    table = Table(title="Modules (scale = alpha / rank, times the scale you give)", title_justify="left")
    for column in ("network", "module", "rank", "alpha", "scale", *(["engine"] if fits else [])):
        table.add_column(column, justify="left" if column in ("network", "module", "engine") else "right")
    for component, modules in lora.parts.items():
        for name, pair in modules.items():
            row = [component, name, str(pair.rank), f"{pair.alpha:g}", f"{pair.scale:g}"]
            table.add_row(*map(escape, row), *([escape(fits[component][name])] if fits else []))
    results.print(table)
    if fits is not None:
        verdicts = {f"{c}: {m}": v for c, modules in fits.items() for m, v in modules.items()}
        bad = {k: v for k, v in verdicts.items() if v != "ok"}
        results.print(f"engine: covers {len(verdicts) - len(bad)}/{len(verdicts)} modules")
        if bad:
            first = next(iter(bad))
            raise LoraError(f"the engine cannot take {len(bad)} of the LoRA's modules, first '{first}': {bad[first]}")


@app.command(name="random")
def random_command(
    out: Annotated[Path, typer.Option(help="The .safetensors file to write.")],
    model: store_options.ModelOpt = "tiny",
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 8,
    alpha: Annotated[int, typer.Option(min=1, help="LoRA alpha (scale = alpha / rank).")] = 8,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same file.")] = 0,
    text_encoders: Annotated[
        bool,
        typer.Option("--text-encoders", help="Also change the CLIP text encoders (not T5), not only the denoiser."),
    ] = False,
) -> None:
    """Make a LoRA with random weights on the attention and feed-forward projections (PEFT) of the model's
    UNet, or SD3's, FLUX.1's, FLUX.2's, Z-Image's or Qwen-Image's transformer, saved as diffusers saves LoRAs:
    something to try `generate --lora` and `lora inspect` with.

    Example: sdtrt lora random --model tiny --out style.safetensors --text-encoders
    """
    from ..lora.files import lora_out, random_lora
    from ..sources.models import resolve_model

    out = lora_out(out)  # a usage error, before the model loads
    with step(f"Making a random rank-{rank} LoRA for {model}"):
        path = random_lora(resolve_model(model), out, rank=rank, alpha=alpha, seed=seed, text_encoders=text_encoders)
    typer.echo(path)
