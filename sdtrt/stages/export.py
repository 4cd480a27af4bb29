"""Export stage: one of a diffusers model's networks → ``{component}.onnx`` (+ ``.onnx.data`` over 2 GB).

IO as the component's spec says (the UNet: ``sample``, ``timestep`` (float32 ``[2B]``),
``encoder_hidden_states``, then SDXL's ``text_embeds``/``time_ids`` or LCM's ``timestep_cond``;
output ``out_sample``; a transformer: the diffusers forward's keyword arguments); batch, height, width
and T5's token count dynamic. Export-time patches are scoped and recorded
in the manifest, with the model's family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..core.artifact import Artifact
from ..core.config import ExportConfig
from ..core.errors import ExportError, one_line
from ..core.progress import quiet_loading, step
from ..core.stage_request import StageRequest, digest, environment
from ..core.store import Store
from ..graph import onnx_graph, onnx_weights
from ..sources.models import ModelSource, load_folder
from ..spec import FOLDERS, GraphSpec, component_spec

if TYPE_CHECKING:
    import torch

STAGE = "export"
# Largest sizes torch.export may assume (others: 4096): Flux's patches reach 16384 at 2048² px.
AXIS_MAX = {"batch": 1024, "patches": 1 << 16, "text_tokens": 4096 + 77}
VERSION = 4  # 3: the graph spec is part of the key; 4: torch.concat exported as torch.cat (type-promoted)
# weights="auto" streams a network whose safetensors files exceed this (SDXL's fp16 UNet: 5.1 GB).
STREAM_ABOVE = 2_000_000_000


def graph_module(spec: GraphSpec, network: Any) -> torch.nn.Module:
    """The network with positional tensor inputs and tensor outputs, in the order its spec names them."""
    import torch

    def unet(
        sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, *extras: torch.Tensor
    ) -> torch.Tensor:
        return network(sample, timestep, encoder_hidden_states, **unet_extras(spec, extras), return_dict=False)[0]

    def controlnet(
        sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor, conditioning_scale: torch.Tensor, *extras: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        down, mid = network(
            sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale,
            **unet_extras(spec, extras, first=5), return_dict=False,
        )  # fmt: skip
        return (*down, mid)

    def transformer(*inputs: torch.Tensor) -> torch.Tensor:
        # SD3's and Flux's graph inputs are named as their forward's keyword arguments.
        return network(**dict(zip(spec.canonical_inputs, inputs, strict=True)), return_dict=False)[0]

    def t5(input_ids: torch.Tensor) -> torch.Tensor:
        return network(input_ids).last_hidden_state  # no attention mask, as SD3's and Flux's pipelines call it

    def text_encoder(input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = network(input_ids, output_hidden_states=True)
        # The penultimate layer is what `clip_skip=1` (and SDXL) read, before the final layer norm.
        return out.last_hidden_state, getattr(out, spec.canonical_outputs[1]), out.hidden_states[-2]

    def vae_decoder(latent_sample: torch.Tensor) -> torch.Tensor:
        return network.decode(latent_sample, return_dict=False)[0]

    def vae_encoder(sample: torch.Tensor) -> torch.Tensor:
        return network.encode(sample).latent_dist.parameters  # mean and log-variance, stacked on channels

    # By component, or by the folder's class where a component's folder may hold several (T5 or CLIP).
    forward: dict[str, Callable[..., Any]] = {
        "T5EncoderModel": t5,
        "unet": unet,
        "transformer": transformer,
        "controlnet": controlnet,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder,
        "text_encoder_3": text_encoder,
        "vae_decoder": vae_decoder,
        "vae_encoder": vae_encoder,
    }

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.network = network  # registered, so the exporter sees its weights

        def forward(self, *inputs: torch.Tensor) -> Any:
            return forward.get(spec.architecture, forward[spec.component])(*inputs)

    return Graph().eval()


def unet_extras(spec: GraphSpec, extras: tuple[Any, ...], first: int = 3) -> dict[str, Any]:
    """The network's keyword inputs from the graph's inputs after the ``first`` positional ones.

    SDXL's ``text_embeds``/``time_ids`` become ``added_cond_kwargs``, LCM's ``timestep_cond`` stays,
    ControlNet residuals become ``down_block_additional_residuals`` + ``mid_block_additional_residual``.
    """
    given = dict(zip(spec.canonical_inputs[first:], extras, strict=True))
    kwargs: dict[str, Any] = {"timestep_cond": given.get("timestep_cond")}
    if "text_embeds" in given:
        kwargs["added_cond_kwargs"] = {"text_embeds": given["text_embeds"], "time_ids": given["time_ids"]}
    if "mid_block_res" in given:
        kwargs["down_block_additional_residuals"] = tuple(
            v for k, v in given.items() if k.startswith("down_block_res_")
        )
        kwargs["mid_block_additional_residual"] = given["mid_block_res"]
    return kwargs


def keep_attention_upcast(unet: Any) -> None:
    """Route attention through diffusers' AttnProcessor, which computes scores and softmax in fp32.

    SD 2.x UNets set ``upcast_attention`` because fp16 attention scores overflow into NaN on their
    weights; only AttnProcessor honours it (get_attention_scores), the default SDPA processor does
    not, so without this the fp16 graph would compute attention in fp16.
    """
    from diffusers.models.attention_processor import AttnProcessor

    unet.set_attn_processor(AttnProcessor())


def exporter_for(config: ExportConfig, spec: GraphSpec) -> Literal["dynamo", "torchscript"]:
    """The config's exporter; "auto" takes torch.export's for the networks whose class the spec names (SD3's and
    Flux's transformers, T5): the one exporter verified on them; and for streamed weights, which need it."""
    if config.exporter == "auto" and (spec.architecture or config.weights == "stream"):
        return "dynamo"
    return config.chosen_exporter


def weights_path(config: ExportConfig, spec: GraphSpec, model: ModelSource) -> Literal["load", "stream"]:
    """How the network's weights reach the graph: "load" (the network loaded whole, traced, its graph re-saved)
    or "stream" (traced without weights, initializers streamed from the safetensors files). "auto" streams
    only with torch.export's exporter and over STREAM_ABOVE bytes of weights on disk."""
    if config.weights != "auto":
        return config.weights
    if exporter_for(config, spec) != "dynamo":
        return "load"
    from ..graph.onnx_weights import weights_size

    return "stream" if weights_size(model.component_dir(FOLDERS[spec.component])) > STREAM_ABOVE else "load"


def weight_free_network(model: ModelSource, folder: str, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    """The folder's network built from its config with no weight data (every tensor on the meta device), in the
    dtypes ``from_pretrained(dtype=…)`` gives it; and ``attach_weights``' arguments: its safetensors tensors,
    and the values of its non-persistent buffers (computed at construction, never in the safetensors files:
    CLIP's position ids), by graph initializer name. Raise ExportError if the files lack a weight it needs."""
    import importlib

    import torch
    from accelerate import init_empty_weights

    library, class_name = model.component_class(folder)
    cls = (
        getattr(importlib.import_module(library), class_name, None)
        if library in ("diffusers", "transformers")
        else None
    )
    if cls is None:
        raise ExportError(
            f"{folder}/ of '{model.name}' is a {class_name or 'class without a name'}, which sdtrt cannot build"
        )
    path = model.component_dir(folder)
    # accelerate: parameters on the meta device, buffers computed for real (the non-persistent ones need that).
    with quiet_loading(), init_empty_weights(include_buffers=False):
        if library == "transformers":
            network = cls._from_config(cls.config_class.from_pretrained(path))
        else:
            network = cls.from_config(cls.load_config(path))
        network.to(dtype)
    if tie := getattr(network, "tie_weights", None):  # transformers ties inside init_empty_weights to copies
        tie()
    for name, module in network.named_modules():
        if set(name.split(".")) & keep_fp32_modules(network, dtype):
            module.float()
    network.eval()
    computed: dict[str, Any] = {}
    for prefix, module in network.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = getattr(module, name)
            if buffer is not None:  # numpy has no bfloat16: widen, the graph's dtype is restored when written
                value = buffer.float() if buffer.dtype == torch.bfloat16 else buffer
                computed[f"network.{prefix}{'.' if prefix else ''}{name}"] = value.numpy()
    stored = onnx_weights.safetensors_index(path)
    # Tied weights are saved once (T5's shared / encoder.embed_tokens): each name reads the one saved.
    tied: dict[int, list[str]] = {}
    for name, tensor in network.state_dict(keep_vars=True).items():
        tied.setdefault(id(tensor), []).append(name)
    for names in tied.values():
        if saved := next((stored[name] for name in names if name in stored), None):
            stored |= dict.fromkeys(names, saved)
    onnx_weights.check_sources(network.state_dict().keys(), stored, path)
    return network.to("meta"), {"sources": stored, "computed": computed, "prefix": "network."}


def keep_fp32_modules(network: Any, dtype: torch.dtype) -> set[str]:
    """The module names transformers keeps fp32 when loading in ``dtype`` (``PreTrainedModel._get_dtype_plan``:
    ``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for fp16 and bf16; T5's ``wo``)."""
    import torch

    keep = set(getattr(network, "_keep_in_fp32_modules_strict", None) or ()) if dtype != torch.float32 else set()
    if dtype == torch.float16:
        keep |= set(getattr(network, "_keep_in_fp32_modules", None) or ())
    return keep


def precision_note(spec: GraphSpec) -> dict[str, str]:
    """The graph's precision for the manifest, and why, where fp16 is not this network's default (T5)."""
    if not spec.fp16_problem:
        return {"graph": spec.precision}
    verdict = "fp32, not fp16 by default" if spec.precision == "fp32" else "fp16 as asked, against the default"
    return {"graph": spec.precision, "why": f"{verdict}: {spec.fp16_problem}"}


def spec_for(model: ModelSource, config: ExportConfig) -> GraphSpec:
    return component_spec(model, config.component, config.precision, config.io_naming)


def network_inputs(model: ModelSource, spec: GraphSpec) -> list[dict[str, Any]]:
    """What a graph traced from one of the model's networks is keyed by: the network's folder and the graph contract."""
    return [
        {"kind": "model", "digest": model.folder_digest(FOLDERS[spec.component]), **model.describe()},
        {"kind": "graph", "digest": digest(spec.to_json())},
    ]


def run(config: ExportConfig, model: ModelSource, store: Store) -> Artifact:
    request = request_for(config, model)
    config, spec = request.config, spec_for(model, request.config)
    artifact, _ = store.produce(request, lambda out_dir: _export(config, model, spec, out_dir))
    return artifact


def request_for(config: ExportConfig, model: ModelSource) -> StageRequest:
    """What ``run`` asks the store for. Keyed by the exporter that runs, not "auto": auto means torch.export's for
    streamed weights and TorchScript's otherwise for a UNet, and the two graphs must not share a key (nor one graph
    have two)."""
    spec = spec_for(model, config)
    config = dataclasses.replace(config, exporter=exporter_for(config, spec))
    return StageRequest(
        stage=STAGE,
        version=VERSION,
        config=config,
        # The graph's IO depends on more than the component's folder (SDXL's text_embeds width comes
        # from text_encoder_2, ControlNet residual inputs from controlnet/): the spec is an input too.
        inputs=network_inputs(model, spec),
        environment=environment("torch", "diffusers", "transformers", "onnx", "onnxscript"),
    )


def _export(config: ExportConfig, model: ModelSource, spec: GraphSpec, out_dir: Path) -> dict[str, Any]:
    import torch

    from .patches import export_patches

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision, torch.float32)
    timings: dict[str, float] = {}
    folder = FOLDERS[spec.component]
    weights = weights_path(config, spec, model)
    exporter = exporter_for(config, spec)
    onnx_name = f"{spec.component}.onnx"
    onnx_path = out_dir / onnx_name
    started = time.perf_counter()
    with step(f"{'Building' if weights == 'stream' else 'Loading'} the {spec.label} from {model.name}"):
        if weights == "stream":
            network, sources = weight_free_network(model, folder, dtype)
        else:
            network = load_folder(model, folder, dtype)
        if spec.component == "unet" and network.config.get("upcast_attention") and config.precision == "fp16":
            keep_attention_upcast(network)
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
                # weights, so they are attached where it starts, and the graph is what the loaded network gives.
                with (
                    before_optimize(functools.partial(onnx_weights.attach_weights, **sources)),
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
            "external_data": onnx_graph.data_file(onnx_path).exists(),
            "config": model.component_config(folder),
        },
        "reproduce": (
            f"sdtrt export --model {model.name} --component {spec.component} --precision {config.precision} "
            f"--exporter {config.exporter} --opset {config.opset} --io-naming {config.io_naming} --weights {weights}"
        ),
    }


def _torch_export(
    module: torch.nn.Module, spec: GraphSpec, config: ExportConfig, exporter: str, path: Path, dtype: torch.dtype
) -> None:
    import torch

    pm = spec.pixel_multiple
    if exporter == "torchscript":
        # The TorchScript exporter runs the model for real; fp16 on a CPU without fp16 units is
        # slow, so trace the smallest valid input. The graph stays dynamic through dynamic_axes.
        side = max(8 * spec.vae_scale_factor, pm)
        example = spec.sample_inputs(1, side, side, dtype=dtype)
        torch.onnx.export(
            module, tuple(example.values()), str(path), dynamo=False, opset_version=config.opset,
            dynamic_axes=spec.dynamic_axes(), input_names=list(spec.input_names), output_names=list(spec.output_names),
        )  # fmt: skip
        return
    program = _dynamo_program(module, spec, config, dtype)
    program.save(str(path), external_data=True)  # what torch.onnx.export(f=path) does


def _dynamo_program(
    module: torch.nn.Module, spec: GraphSpec, config: ExportConfig, dtype: torch.dtype, fake_mode: Any = None
) -> Any:
    """torch.export's ONNXProgram for the module, traced on example inputs (fake ones in ``fake_mode``)."""
    import torch
    from torch.export import Dim

    # Distinct height and width (and a batch above 1) keep torch.export from specialising them;
    # an axis on a grid is a multiple of a free dimension, so the graph keeps that constraint.
    side = max(8 * spec.vae_scale_factor, spec.pixel_multiple)
    example = spec.sample_inputs(2, 2 * side, 3 * side, dtype=dtype)
    dims: dict[str, Any] = {}
    for axis in {d for t in spec.inputs() for d in t.shape if isinstance(d, str)}:
        multiple = getattr(spec, spec.grid[axis]) if axis in spec.grid else 1
        dims[axis] = multiple * Dim(axis, min=1, max=AXIS_MAX.get(axis, 4096))
    # torch's ONNX registry warns about every torchvision op it cannot register (sdtrt exports none).
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    # Keyed by the wrapper's one variadic parameter, ``inputs``.
    dynamic_shapes = {
        "inputs": tuple({i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} for t in spec.inputs())
    }
    # Static fake inputs: their dynamic axes are what dynamic_shapes says, as with real ones.
    inputs = tuple(fake_mode.from_tensor(t, static_shapes=True) if fake_mode else t for t in example.values())
    return torch.onnx.export(
        module, inputs, dynamo=True, opset_version=config.opset, verbose=False, dynamic_shapes=dynamic_shapes,
        input_names=list(spec.input_names), output_names=list(spec.output_names),
    )  # fmt: skip


def on_fake_cpu(module: torch.nn.Module) -> Any:
    """Replace the module's meta-device parameters and buffers by fake CPU tensors, which hold no data either;
    the FakeTensorMode they belong to, for the example inputs.

    Not traced on the meta device itself: operators dispatch by device, and on "meta" some take another path
    (scaled_dot_product_attention's decomposition reshapes differently), so the graph would not be the CPU one.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # As torch.onnx.enable_fake_mode did before torch 2.13 removed it: one mode, with a shape environment.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes: dict[int, torch.nn.Parameter] = {}  # by the meta parameter: tied weights (T5's embeddings) stay tied
    with fake_mode:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None:
                    if id(param) not in fakes:
                        fakes[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"), False)
                    owner._parameters[name] = fakes[id(param)]
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None:
                    owner._buffers[name] = torch.empty_like(buffer, device="cpu")
    return fake_mode


def _save_streamed(program: Any, spec: GraphSpec, onnx_path: Path, scratch: Path) -> int:
    """Save the program with its initializers streamed to disk one at a time, axes named; the node count."""
    import onnx

    weight_bytes = sum(value.const_value.nbytes for value in program.model.graph.initializers.values())
    external = weight_bytes > onnx_graph.EXTERNAL_DATA_THRESHOLD
    onnx_weights.save_streamed(program.model, onnx_path, external, scratch)
    proto = onnx_graph.load_graph(onnx_path)  # the graph alone: its external weights stay on disk
    onnx_graph.name_dynamic_axes(proto, spec)
    onnx.save_model(proto, str(onnx_path))  # the initializers' external data references as they are
    return len(proto.graph.node)


@contextlib.contextmanager
def before_optimize(hook: Callable[[Any], None]) -> Iterator[None]:
    """Call ``hook(onnx_ir_model)`` inside torch.onnx.export(dynamo=True) just before it optimizes the model.

    torch 2.13's exporter (torch/onnx/_internal/exporter/_core.py ``export``) converts the opset, then calls
    ``onnx_program.optimize()``, then renames inputs, outputs and axes: hooking there keeps that order.
    """
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    original = ONNXProgram.optimize

    def optimize(self: Any) -> None:
        hook(self.model)
        original(self)

    ONNXProgram.optimize = optimize  # type: ignore[method-assign]
    try:
        yield
    finally:
        ONNXProgram.optimize = original  # type: ignore[method-assign]
