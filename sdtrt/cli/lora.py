"""`sdtrt lora inspect`: what a LoRA file holds, and whether an engine's weight map can take it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import LoraError
from ..progress import results
from . import options as o

app = typer.Typer(
    help="LoRA files: inspect what they change and whether an engine can take them.", no_args_is_help=True
)


@app.command(name="inspect")
def inspect_command(
    file: Annotated[Path, typer.Argument(help="A LoRA .safetensors file (diffusers/PEFT or kohya/A1111).")],
    engine: Annotated[str | None, typer.Option(help=f"{o.ENGINE_HELP}; check its weight map covers the LoRA.")] = None,
    model: o.EngineModelOpt = None,
    engines: o.EnginesOpt = None,
) -> None:
    """Format, rank, alpha and scale, the modules a LoRA touches in the UNet and text encoders, and (with
    --engine, a UNet engine or an engine set) whether the engine's weight maps take them.

    Example: sdtrt lora inspect style.safetensors --engine engines/set/2a06c39aaf814d52
    """
    from rich.table import Table

    from ..lora import coverage, describe, read_lora

    lora = read_lora(file)
    summary = describe(lora)
    for key in ("file", "format", "networks", "ranks", "alphas", "scales"):
        results.print(f"{key}: {summary[key]}")
    fits = None
    if engine:
        from ..pipeline import engine_members
        from ..stages.weight_map import for_engine

        artifact = o.find_engine(engine, engines)
        members, source = engine_members(artifact), o.model_for(model, artifact)
        fits = coverage(lora, {c: for_engine(members[c], source, c) for c in lora.parts if c in members})
    table = Table(title="Modules (scale = alpha / rank, times the scale you give)", title_justify="left")
    for column in ("network", "module", "rank", "alpha", "scale", *(["engine"] if fits else [])):
        table.add_column(column, justify="left" if column in ("network", "module", "engine") else "right")
    for component, modules in lora.parts.items():
        for name, pair in modules.items():
            row = [component, name, str(pair.rank), f"{pair.alpha:g}", f"{pair.scale:g}"]
            table.add_row(*row, *([fits[component][name]] if fits else []))
    results.print(table)
    if fits is not None:
        verdicts = {f"{c}: {m}": v for c, modules in fits.items() for m, v in modules.items()}
        bad = {k: v for k, v in verdicts.items() if v != "ok"}
        results.print(f"engine: covers {len(verdicts) - len(bad)}/{len(verdicts)} modules")
        if bad:
            first = next(iter(bad))
            raise LoraError(f"the engine cannot take {len(bad)} of the LoRA's modules, first '{first}': {bad[first]}")
