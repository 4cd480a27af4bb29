"""``sdtrt deploy triton``, ``sdtrt serve`` and ``sdtrt client``: engines on Triton Inference Server."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from ..pipeline.request import GenerateRequest
from ..serving.client import TIMEOUT_S
from ..serving.deploy import InstanceKind, TritonDeployConfig
from . import request_options, result_files, store_options

deploy_app = typer.Typer(help="Write a serving deployment of an engine.", no_args_is_help=True)

ModelNameOpt = Annotated[str, typer.Option("--model-name", help="The model's name in the Triton repository.")]


def register(app: typer.Typer) -> None:
    app.add_typer(deploy_app, name="deploy")
    app.command(name="serve")(serve_command)
    app.command(name="client")(client_command)


@deploy_app.command("triton")
def deploy_triton_command(
    engine: Annotated[
        str, typer.Option(help=f"{store_options.ENGINE_HELP}; an engine set serves every network on engines.")
    ],
    out: Annotated[Path, typer.Option(help="The Triton model repository to write the model into.")],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="The engine's model, where its manifest names none here.")
    ] = None,
    name: ModelNameOpt = TritonDeployConfig.name,
    instances: Annotated[
        int, typer.Option(min=1, help="Model instances (per GPU with KIND_GPU).")
    ] = TritonDeployConfig.instances,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Images per execution (at most the engine's batch).")
    ] = TritonDeployConfig.max_batch,
    dynamic_batching: Annotated[
        bool, typer.Option(help="Batch requests that share size, steps and guidance.")
    ] = TritonDeployConfig.dynamic_batching,
    max_steps: Annotated[
        int, typer.Option(min=1, help="The most denoising steps one request may ask for; more get HTTP 400.")
    ] = TritonDeployConfig.max_steps,
    queue_delay_us: Annotated[
        int, typer.Option(min=0, help="How long a request waits to be batched (µs).")
    ] = TritonDeployConfig.max_queue_delay_us,
    kind: Annotated[
        InstanceKind, typer.Option(help="auto (GPU for TensorRT engines), cpu or gpu.")
    ] = TritonDeployConfig.kind,
    weight_streaming_budget: request_options.WeightBudgetOpt = None,
    cache: request_options.CacheOpt = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Write a Triton model repository: a Python-backend model serving the model's tasks on the engine.

    Text to image, and where the model's family has them img2img and inpainting: a request's images (image, mask_image,
    control_image, as UINT8 arrays) pick its task.

    With --cache every request runs with that step cache (the set compiled with --caches; auto: its calibration at
    --max-steps steps).

    Example: sdtrt deploy triton --engine engines/set/2a06c39aaf814d52 --out model_repository
    """
    from ..serving.deploy import deploy_triton
    from ..sources.models import resolve_model

    budget = request_options.weight_budget(weight_streaming_budget)  # exit 2 when malformed, before anything loads
    request_options.step_cache(cache)
    artifact = store_options.find_engine(engine, engines)
    source = resolve_model(model) if model else None
    # auto: the calibration at --max-steps steps serves every request, whatever its steps
    step_cache = request_options.resolve_cache(cache, artifact, source or store_options.model_for(None, artifact),
                                               max_steps, None)  # fmt: skip
    config = TritonDeployConfig(
        name=name, instances=instances, max_batch=max_batch, max_steps=max_steps,
        dynamic_batching=dynamic_batching, max_queue_delay_us=queue_delay_us, kind=kind,
        weight_budget=budget.text if budget else None, cache=step_cache.label if step_cache else None,
    )  # fmt: skip
    deployment = deploy_triton(artifact, out, config, source)
    typer.echo(deployment.folder)


def serve_command(
    repository: Annotated[Path, typer.Argument(help="A model repository `sdtrt deploy triton` wrote.")],
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface).")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option(help="HTTP/REST port.")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port.")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port.")] = 8002,
) -> None:
    """Run Triton Inference Server on a model repository until interrupted.

    Ctrl-C or SIGTERM stops it within seconds: generations in flight end at their next step (HTTP 503).

    Example: sdtrt serve model_repository --http-port 8000
    """
    from ..core.progress import console
    from ..serving.serve import ServeConfig, start_server

    def interrupt(signum: int, _frame: object) -> None:
        # SIGTERM (docker stop, Kubernetes) and SIGHUP (its terminal closed; the server, in a session of its own, does
        # not get that one) stop the server like Ctrl-C.
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    config = ServeConfig(host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    with start_server(repository, config) as server:
        console.print(f"[green]✓[/] serving {repository}: http://{config.http_url}, metrics {config.metrics_url}")
        try:
            code = server.process.wait()
        except KeyboardInterrupt:
            code = server.stop()
    raise typer.Exit(code)


def client_command(
    url: Annotated[str, typer.Option(help="The server's HTTP address, host:port.")] = "127.0.0.1:8000",
    prompt: request_options.PromptOpt = GenerateRequest.prompt,
    negative_prompt: request_options.NegativePromptOpt = None,
    steps: request_options.StepsOpt = GenerateRequest.steps,
    guidance: request_options.GuidanceOpt = GenerateRequest.guidance,
    seed: request_options.SeedOpt = GenerateRequest.seed,
    height: request_options.HeightPxOpt = None,
    width: request_options.WidthPxOpt = None,
    image: request_options.ImageOpt = None,
    mask: request_options.MaskOpt = None,
    control_image: request_options.ControlImageOpt = None,
    reference_image: request_options.ReferenceImageOpt = None,
    strength: request_options.StrengthOpt = None,
    model_name: ModelNameOpt = TritonDeployConfig.name,
    out: Annotated[Path, typer.Option(help="Where to write the PNG.")] = Path("image.png"),
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for the image.")] = TIMEOUT_S,
) -> None:
    """Ask a Triton server for an image and save it as a PNG.

    The images given (--image, --mask, --control-image, --reference-image) pick the served task, as --task does for
    generate: none text-to-image, --image img2img, --image and --mask inpainting.

    Example: sdtrt client --url 127.0.0.1:8000 --prompt "a red fox" --seed 1 --out fox.png
    Inpainting: sdtrt client --prompt "a red fox" --image photo.png --mask mask.png --strength 0.8 --out fox.png
    """
    from PIL import Image

    from ..serving.client import remote_image

    result_files.ensure_image_file(out, "--out")
    request = GenerateRequest(
        prompt, negative_prompt, steps, guidance, seed, height, width, strength=strength,
        **request_options.task_images(image, mask),
        control_image=request_options.open_image(control_image, "RGB", "--control-image"),
        image_reference=request_options.open_image(reference_image, "RGB", "--reference-image"),
    )  # fmt: skip
    Image.fromarray(remote_image(url, request, model_name, timeout_s=timeout)).save(out)
    typer.echo(out)
