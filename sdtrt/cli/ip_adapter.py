"""`sdtrt ip-adapter random`: an IP-Adapter with random weights, to try `compile --ip-adapter` with offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.progress import step
from . import store_options

app = typer.Typer(help="IP-Adapters: make random ones to try `compile --ip-adapter` with.", no_args_is_help=True)


@app.command(name="random")
def random_command(
    out: Annotated[Path, typer.Option(help="The folder to write the adapter and its image_encoder/ into.")],
    model: store_options.ModelOpt = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same files.")] = 0,
) -> None:
    """Make a plain IP-Adapter with random weights for the model's denoiser, in the published layout (h94's for a
    UNet, XLabs' for Flux) with a tiny CLIP image encoder beside it; prints the weight file to pass to `compile
    --ip-adapter`.

    Example: sdtrt ip-adapter random --model tiny --out ip-adapter && sdtrt compile --model tiny --target onnxruntime
    --ip-adapter ip-adapter
    """
    from ..sources.ip_adapters import random_ip_adapter
    from ..sources.models import resolve_model

    with step(f"Making a random IP-Adapter for {model}"):
        files = random_ip_adapter(resolve_model(model), out, seed=seed)
    typer.echo(files.weights)
