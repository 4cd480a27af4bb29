"""Export stage: one of a diffusers model's networks → ``{component}.onnx`` (+ ``.onnx.data`` over 2 GB).

IO as the component's spec says (the UNet: ``sample``, ``timestep`` (float32 ``[2B]``),
``encoder_hidden_states``, then SDXL's ``text_embeds``/``time_ids`` or LCM's ``timestep_cond``;
output ``out_sample``; a transformer: the diffusers forward's keyword arguments); batch, height, width
and T5's token count dynamic. Export-time patches are scoped and recorded
in the manifest, with the model's family.

Here: the stage (its key, its choices, its manifest); the network's wrapper is graph_module.py's, the exporter calls
exporters.py's, the weight-free path (``weights="stream"``) export_stream.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from ..core.artifact import Artifact
from ..core.config import IMAGE_ENCODER, ExportConfig, format_size
from ..core.errors import ExportError, one_line
from ..core.progress import step
from ..core.stage_request import StageRequest, digest, environment
from ..core.store import Store
from ..graph import onnx_graph, onnx_weights
from ..sources.ip_adapters import IPAdapterFiles, ip_adapter_files
from ..sources.models import ModelSource, load_folder
from ..spec import (
    FOLDERS,
    DenoiserSpec,
    GraphSpec,
    ImageEncoderSpec,
    LLMEncoderSpec,
    component_spec,
    denoiser_component,
)
from .export_stream import (
    _save_streamed,
    before_optimize,
    graph_hook,
    on_fake_cpu,
    stamp_overrides,
    stamped_blocks,
    stamped_reason,
    stamping,
    weight_free_network,
)
from .exporters import _dynamo_program, _torch_export
from .graph_module import graph_module

STAGE = "export"
VERSION = 4  # 3: the graph spec is part of the key; 4: torch.concat exported as torch.cat (type-promoted)
# Auto streams every network torch.export's exporter traces, and gives that exporter (so as to stream them) the
# networks it would give TorchScript's whose safetensors files exceed this: every Stable Diffusion network (the
# smallest, an fp16 VAE: 167 MB), never the tiny presets' (6 MB at most), which TorchScript's exporter traces ~10x
# faster (the tiny fp16 UNet: 1.8 s, 20 s with torch.export's) and whose weights cost nothing to load.
STREAM_ABOVE = 64 * 2**20
# Networks whose streamed graph is the loaded one up to the names of its values (the same structure and ONNX Runtime
# outputs), not byte for byte (tests/test_export_streamed.py): auto streams them as the others; their streamed graph
# is keyed apart from their loaded one (--weights load, or a size under STREAM_ABOVE).
STREAMED_UP_TO_NAMES = ("vae_encoder",)


def keep_attention_upcast(unet: Any) -> None:
    """Route attention through diffusers' AttnProcessor, which computes scores and softmax in fp32.

    SD 2.x UNets set ``upcast_attention`` because fp16 attention scores overflow into NaN on their
    weights; only AttnProcessor honours it (get_attention_scores), the default SDPA processor does
    not, so without this the fp16 graph would compute attention in fp16.
    """
    from diffusers.models.attention_processor import AttnProcessor

    unet.set_attn_processor(AttnProcessor())


def exporter_for(config: ExportConfig, spec: GraphSpec, model: ModelSource) -> Literal["dynamo", "torchscript"]:
    """The config's exporter; "auto" takes torch.export's for the networks whose class the spec names (SD3's and
    Flux's transformers, T5): the one exporter verified on them; for streamed weights, which need it; and for every
    network over STREAM_ABOVE, so that auto streams it. An IP-Adapter's image encoder and a denoiser the adapter goes
    into are loaded whatever their size: they keep the config's choice. An fp32 LLM text encoder loaded whole (up to
    STREAM_ABOVE) takes TorchScript's: both give its hidden states to 1e-7 (tests/test_flux2_klein.py), and
    torch.export's takes 5× longer over its dozens of layers; fp16 and bf16 keep torch.export's (TorchScript's
    mis-types fp16 text encoders' norms: ExportConfig)."""
    llm = isinstance(spec, LLMEncoderSpec) and config.precision == "fp32" and config.weights != "stream"
    if config.exporter == "auto" and llm and folder_size(model, spec) <= STREAM_ABOVE:
        return "torchscript"
    if config.exporter == "auto" and (spec.architecture or config.weights == "stream"):
        return "dynamo"
    if config.exporter != "auto" or spec.component == IMAGE_ENCODER or ip_denoiser(spec):
        return config.chosen_exporter
    return "dynamo" if folder_size(model, spec) > STREAM_ABOVE else config.chosen_exporter


def weights_path(config: ExportConfig, spec: GraphSpec, model: ModelSource) -> tuple[Literal["load", "stream"], str]:
    """How the network's weights reach the graph, and why (for the manifest): "load" (the network loaded whole,
    traced, its graph re-saved) or "stream" (traced without weights, initializers streamed from the safetensors
    files: the same graph, tests/test_export_streamed.py). "auto" streams wherever torch.export's exporter runs
    (exporter_for gives it every network over STREAM_ABOVE), but for an IP-Adapter's image encoder (in the adapter's
    folder, not the model's: 1.2 GB at most) and a denoiser the adapter goes into (diffusers loads the adapter into a
    loaded network; an explicit "stream" is refused)."""
    if spec.component == IMAGE_ENCODER:
        return "load", "an IP-Adapter's image encoder, loaded from the adapter's folder (1.2 GB at most)"
    if config.weights != "auto":
        return config.weights, f"asked for with --weights {config.weights}"
    if ip_denoiser(spec):
        return "load", "diffusers loads an IP-Adapter into a loaded denoiser"
    if exporter_for(config, spec, model) == "dynamo":
        return "stream", "torch.export's exporter traces the network without its weights"
    if config.exporter == "torchscript":
        return "load", "TorchScript's exporter runs the network on its weights (torch.export's streams them)"
    size, limit = format_size(folder_size(model, spec)), format_size(STREAM_ABOVE)
    return "load", f"{size} of weights, under the {limit} auto streams above: TorchScript's exporter, ~10x faster"


def ip_denoiser(spec: GraphSpec) -> bool:
    """A denoiser exported with an IP-Adapter's layers (it is loaded: diffusers loads the adapter into a network)."""
    return isinstance(spec, DenoiserSpec) and bool(spec.ip_layers)


def folder_size(model: ModelSource, spec: GraphSpec) -> int:
    """Bytes of the safetensors files of the network's folder in the model."""
    from ..graph.onnx_weights import weights_size

    return weights_size(model.component_dir(FOLDERS[spec.component]))


def precision_note(spec: GraphSpec) -> dict[str, str]:
    """The graph's precision for the manifest, and why, where fp16 is not this network's default (T5, an LLM)."""
    if not spec.fp16_problem:
        return {"graph": spec.precision}
    verdict = "fp16 as asked, against the default" if spec.precision == "fp16" else f"{spec.precision}, not fp16"
    if spec.fp16_fallback != "fp32":
        verdict += f" (fp16 is built as {spec.fp16_fallback}, or fp32 where the target lacks {spec.fp16_fallback})"
    return {"graph": spec.precision, "why": f"{verdict}: {spec.fp16_problem}"}


def spec_for(model: ModelSource, config: ExportConfig) -> GraphSpec:
    """The graph contract: the component's, with the IP-Adapter's inputs for a UNet exported with one; an IP-Adapter's
    image encoder's from the adapter's files."""
    if config.component == IMAGE_ENCODER and config.ip_adapter:
        files = ip_adapter_files(config)
        return ImageEncoderSpec.from_config(files.image_encoder_config(), config.precision, config.io_naming)
    spec = component_spec(model, config.component, config.precision, config.io_naming)
    if config.ip_adapter and config.component in ("unet", "transformer"):
        from .ip_adapter import with_ip_adapter

        assert isinstance(spec, DenoiserSpec)
        return with_ip_adapter(spec, ip_adapter_files(config), model)
    return spec


def network_inputs(model: ModelSource, spec: GraphSpec) -> list[dict[str, Any]]:
    """What a graph traced from one of the model's networks is keyed by: the network's folder and the graph contract."""
    return [
        {"kind": "model", "digest": model.folder_digest(FOLDERS[spec.component]), **model.describe()},
        {"kind": "graph", "digest": digest(spec.to_json())},
    ]


def adapter_inputs(config: ExportConfig, spec: GraphSpec) -> list[dict[str, Any]]:
    """What an IP-Adapter's image encoder's graph is keyed by: its folder in the adapter and the graph contract."""
    files = ip_adapter_files(config)
    return [
        {"kind": "ip_adapter", "digest": files.image_encoder_digest(), "path": str(files.image_encoder)},
        {"kind": "graph", "digest": digest(spec.to_json())},
    ]


def run(config: ExportConfig, model: ModelSource, store: Store) -> Artifact:
    request = request_for(config, model)
    spec = spec_for(model, config)
    weights = weights_path(config, spec, model)  # from the config as given: why auto chose is the manifest's reason
    artifact, _ = store.produce(request, lambda out_dir: _export(request.config, model, spec, out_dir, weights))
    return artifact


def request_for(config: ExportConfig, model: ModelSource) -> StageRequest:
    """What ``run`` asks the store for. Keyed by the exporter that runs, not "auto": auto means torch.export's for
    a network over STREAM_ABOVE and often TorchScript's for a smaller one (exporter_for), and the two graphs must not
    share a key (nor one graph have two).
    Not by the weights path: a streamed graph is the loaded one, byte for byte; but for the STREAMED_UP_TO_NAMES
    networks, whose streamed graph has its own key, and a graph with stamped blocks (its values named otherwise)."""
    spec = spec_for(model, config)
    streamed = weights_path(config, spec, model)[0] == "stream"
    streamed_otherwise = spec.component in STREAMED_UP_TO_NAMES and streamed
    # A stamped graph is the full trace's up to the names of its values (graph/onnx_stamp.py): keyed apart.
    stamped = stamped_blocks(spec, model.component_config(FOLDERS[spec.component])) if streamed else {}
    config = dataclasses.replace(config, exporter=exporter_for(config, spec, model))
    # The graph's IO depends on more than the component's folder (SDXL's text_embeds width comes
    # from text_encoder_2, ControlNet residual inputs from controlnet/): the spec is an input too.
    inputs = adapter_inputs(config, spec) if spec.component == IMAGE_ENCODER else network_inputs(model, spec)
    return StageRequest(
        stage=STAGE,
        version=VERSION,
        config=config,
        inputs=[
            *inputs,
            *([{"kind": "weights", "digest": "stream"}] if streamed_otherwise else []),
            *([{"kind": "stamped", "digest": digest(stamping(stamped))}] if stamped else []),
        ],
        environment=environment("torch", "diffusers", "transformers", "onnx", "onnxscript"),
    )


def _export(
    config: ExportConfig, model: ModelSource, spec: GraphSpec, out_dir: Path, weights_and_reason: tuple[str, str]
) -> dict[str, Any]:
    import torch

    from .patches import export_patches

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision, torch.float32)
    timings: dict[str, float] = {}
    folder = FOLDERS[spec.component]
    weights, weights_reason = weights_and_reason
    exporter = config.chosen_exporter  # request_for resolved auto
    onnx_name = f"{spec.component}.onnx"
    onnx_path = out_dir / onnx_name
    started = time.perf_counter()
    ip_adapter = ip_denoiser(spec)
    if ip_adapter and weights == "stream":  # compile refuses it before any export; export.run's callers here
        raise ExportError("an IP-Adapter goes into a loaded denoiser, not a streamed one: export with --weights load")
    files = ip_adapter_files(config) if config.ip_adapter else None
    origin = files.image_encoder if files and spec.component == IMAGE_ENCODER else model.name
    with step(f"{'Building' if weights == 'stream' else 'Loading'} the {spec.label} from {origin}"):
        stamped = stamped_blocks(spec, model.component_config(folder)) if weights == "stream" else {}
        if weights == "stream":
            network, sources = weight_free_network(model, folder, dtype, stamp_overrides(spec, stamped))
        elif files and spec.component == IMAGE_ENCODER:
            network = files.load_image_encoder(dtype)
        else:
            network = load_folder(model, folder, dtype)
        if folder == "unet" and network.config.get("upcast_attention") and config.precision == "fp16":
            keep_attention_upcast(network)
        if ip_adapter:  # after the upcast: its processors replace those of the layers it adds to
            from .ip_adapter import load_ip_adapter_weights

            assert files is not None  # a denoiser with IP-Adapter layers is exported from its adapter
            load_ip_adapter_weights(network, files)
        module = graph_module(spec, network)
    timings["load_s"] = round(time.perf_counter() - started, 3)

    raw_dir = out_dir / "raw"
    raw_dir.mkdir()
    started = time.perf_counter()
    how = "weight-free, " if weights == "stream" else ""
    description = f"Exporting {spec.label} to ONNX ({config.precision}, {how}{exporter} exporter, opset {config.opset})"
    with (
        step(description), export_patches(exporter) as patches, torch.no_grad(), warnings.catch_warnings(),
        contextlib.redirect_stdout(sys.stderr),  # torch.export's exporter prints its progress: stdout is for results
    ):  # fmt: skip
        # The exporters warn about every Python branch on a shape, constant folding they skip and their
        # own deprecations: nothing a user acts on, and the graph is checked numerically afterwards.
        if os.environ.get("SDTRT_DEBUG", "") in ("", "0"):
            warnings.simplefilter("ignore")
        try:
            if weights == "stream":
                # The exporter's optimizer folds constants (the Transpose of every Linear weight): it reads the
                # weights, so they are attached where it starts (after the stamped blocks are added), and the graph
                # is what the loaded network gives.
                with (
                    before_optimize(graph_hook(sources, stamped)),
                    onnx_weights.folded_constants_on_disk(raw_dir / "folded.bin"),
                ):
                    program = _dynamo_program(module, spec, config, dtype, fake_mode=on_fake_cpu(module))
            else:
                _torch_export(module, spec, config, exporter, raw_dir / onnx_name, dtype)
        except ExportError:
            raise
        except Exception as exc:
            other = "torchscript" if exporter == "dynamo" else "dynamo"
            raise ExportError(
                f"the {exporter} exporter failed: {one_line(exc)}; try --exporter {other}, "
                "or SDTRT_DEBUG=1 for the traceback"
            ) from exc
    timings["export_s"] = round(time.perf_counter() - started, 3)
    del module, network

    started = time.perf_counter()
    if weights == "stream":
        with step("Streaming the weights from the model's safetensors files into the graph"):
            node_count = _save_streamed(program, spec, onnx_path, scratch=raw_dir / "folded.bin")
    else:
        with step("Naming axes, packing weights and checking the graph"):
            proto = onnx_graph.load_graph(raw_dir / onnx_name, with_weights=True)
            onnx_graph.name_dynamic_axes(proto, spec)
            onnx_graph.save(proto, onnx_path, onnx_graph.weights_on_disk(raw_dir))
            node_count = len(proto.graph.node)
            del proto
    shutil.rmtree(raw_dir)
    onnx_graph.check(onnx_path)
    timings["finalize_s"] = round(time.perf_counter() - started, 3)

    return {
        "primary": onnx_name,
        "family": model.family(),
        "io": spec.to_json(),
        "precision": precision_note(spec),
        "patches": patches,
        "timings": timings,
        "details": {
            "nodes": node_count,
            "exporter": exporter,
            "weights": weights,
            "weights_reason": weights_reason,
            # Repeated blocks traced a few times each and stamped to their count (module path → count).
            "stamped": stamping(stamped),
            "stamped_reason": stamped_reason(spec, weights, stamped),
            "external_data": onnx_graph.data_file(onnx_path).exists(),
            "config": files.image_encoder_config()
            if files and spec.component == IMAGE_ENCODER
            else model.component_config(folder),
        },
        "reproduce": reproduce(model, config, spec, weights, files),
    }


def reproduce(
    model: ModelSource, config: ExportConfig, spec: GraphSpec, weights: str, files: IPAdapterFiles | None
) -> str:
    """The command that exports this graph again: an IP-Adapter's graphs come from compile (export takes no
    adapter), which exports the denoiser and the image encoder together, each with auto's exporter unless another
    was asked for (one --exporter is both members')."""
    if files is None:
        return (f"sdtrt export --model {model.name} --component {spec.component} --precision {config.precision} "
                f"--exporter {config.exporter} --opset {config.opset} --io-naming {config.io_naming} "
                f"--weights {weights}")  # fmt: skip
    auto = exporter_for(dataclasses.replace(config, exporter="auto"), spec, model) == config.exporter
    options = f"--precision {config.precision}{'' if auto else f' --exporter {config.exporter}'} --opset {config.opset}"
    encoder = f" --ip-adapter-image-encoder {files.image_encoder}" if config.ip_adapter_image_encoder else ""
    return (f"sdtrt compile --model {model.name} --target onnxruntime --components {denoiser_component(model)} "
            f"{options} --ip-adapter {files.weights}{encoder}")  # fmt: skip
