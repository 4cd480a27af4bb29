"""Path-based ONNX helpers.

Large UNets exceed protobuf's 2 GB limit, so these functions take paths, keep weights as external
data where needed, and never call ``ModelProto.ByteSize()`` (it raises on > 2 GB models).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from ..core.artifact import Artifact
from ..core.config import IONaming, Precision
from ..core.errors import ArtifactError
from ..spec import NAMED_INPUTS, GraphSpec, ModelConfigs, TensorSpec, UNetSpec, spec_from_json

# Artifacts whose primary file is an ONNX graph.
ONNX_STAGES = ("export", "quantize", "simplify", "build-ort", "external")
# Save weights beside the graph above this size; protobuf cannot hold a 2 GiB message.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def data_file(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + ".data")


def import_for_surgery(model: onnx.ModelProto) -> Any:
    """``onnx_graphsurgeon.import_onnx(model)`` without its warnings: it warns that FP8 (float8e4m3fn) tensors have no
    NumPy type while keeping them as they are, then that the `colored` module is missing; neither is for a user."""
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.logger import G_LOGGER

    severity, G_LOGGER.severity = G_LOGGER.severity, G_LOGGER.ERROR
    try:
        return gs.import_onnx(model)
    finally:
        G_LOGGER.severity = severity


def load_graph(path: Path, with_weights: bool = False) -> onnx.ModelProto:
    if path.suffix != ".onnx":  # e.g. the manifest.json an engine set or a TorchScript module has for primary
        raise ArtifactError(f"'{path}' is not an ONNX graph; pass an export or simplify artifact, or an .onnx file")
    try:
        return onnx.load(str(path), load_external_data=with_weights)
    except Exception as exc:  # protobuf's DecodeError, OSError, …: all mean "not a usable ONNX file"
        raise ArtifactError(
            f"'{path}' is not a readable ONNX model ({type(exc).__name__}: {exc}); re-export it"
        ) from exc


def check(path: Path) -> None:
    """onnx.checker on the path, so models with external data over 2 GB are checked too."""
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except Exception as exc:
        raise ArtifactError(f"'{path}' fails onnx.checker: {exc}") from exc


def op_counts(path: Path) -> Counter[str]:
    return Counter(node.op_type for node in load_graph(path).graph.node)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """A tensor's size from its type and shape: nothing of its data, inline or external, is read."""
    return math.prod(tensor.dims) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def initializer_bytes(model: onnx.ModelProto) -> int:
    """The size of a graph's weights, from a model loaded without them (``load_graph``'s default)."""
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def weights_on_disk(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def save(model: onnx.ModelProto, path: Path, weight_bytes: int) -> None:
    """Save as one .onnx, or .onnx + one .onnx.data when the weights would not fit in protobuf."""
    if weight_bytes > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(
            model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
            location=data_file(path).name, size_threshold=1024,
        )  # fmt: skip
    else:
        onnx.save_model(model, str(path))


def save_keeping_weights(model: onnx.ModelProto, path: Path, weight_bytes: int) -> None:
    """``save``, leaving the weights in ``model``: onnx.save_model moves them out into the data file it writes (the
    proto then points there), so a second graph saved from the same proto would have no data file of its own."""
    save(model, path, weight_bytes)
    if weight_bytes > EXTERNAL_DATA_THRESHOLD:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, str(path.parent))


def normalise_layout(path: Path, weight_bytes: int) -> None:
    """Re-save ``path`` if its weights are not laid out as ``save`` would lay them out.

    Downstream stages rely on one convention: ``X.onnx`` alone, or ``X.onnx`` + ``X.onnx.data``.
    """
    others = sorted(f for f in path.parent.iterdir() if f != path)
    expected = [data_file(path)] if weight_bytes > EXTERNAL_DATA_THRESHOLD else []
    if others == expected:
        return
    model = load_graph(path, with_weights=True)
    for f in others:
        f.unlink()
    save(model, path, weight_bytes)


def name_dynamic_axes(model: onnx.ModelProto, spec: GraphSpec) -> None:
    """Give graph inputs/outputs the spec's axis names (exporters name them ``s0``, ``2*h``, …)."""
    wanted = {t.name: t for t in spec.inputs() + spec.outputs()}
    for value in list(model.graph.input) + list(model.graph.output):
        target = wanted.get(value.name)
        if target is None:
            continue
        for dim, axis in zip(value.type.tensor_type.shape.dim, target.shape, strict=False):
            if isinstance(axis, str):
                dim.ClearField("dim_value")
                dim.dim_param = axis


def graph_io(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Graph inputs and outputs as TensorSpecs, read without loading weights."""
    graph = load_graph(path).graph

    def spec_of(value: onnx.ValueInfoProto) -> TensorSpec:
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        shape = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        return TensorSpec(value.name, dtype, shape)

    initializers = {i.name for i in graph.initializer}
    inputs = [spec_of(v) for v in graph.input if v.name not in initializers]
    return inputs, [spec_of(v) for v in graph.output]


def artifact_spec(artifact: Artifact, model: ModelConfigs | None = None) -> GraphSpec:
    """The artifact's graph contract: from its manifest, else from its graph's IO (and the model, if known).

    A bare .onnx without a manifest is taken for an SD UNet when its inputs say so.
    """
    if io := artifact.manifest.get("io"):
        return spec_from_json(io)
    inputs, _ = graph_io(artifact.primary)
    names = tuple(t.name for t in inputs)
    if names not in (NAMED_INPUTS, ("input_0", "input_1", "input_2")):
        raise ArtifactError(
            f"'{artifact.primary}' has no sdtrt manifest and does not look like an SD UNet graph (inputs "
            f"{list(names)}, expected {list(NAMED_INPUTS)}); export it with `sdtrt export`"
        )
    precisions: dict[str, Precision] = {"float16": "fp16", "bfloat16": "bf16"}
    precision = precisions.get(inputs[0].dtype, "fp32")
    io_naming: IONaming = "named" if names == NAMED_INPUTS else "indexed"
    if model is not None:
        return UNetSpec.from_config(model.unet_config(), model.vae_scale_factor(), precision, io_naming)
    channels, text_dim = inputs[0].shape[1], inputs[2].shape[2]
    if not isinstance(channels, int) or not isinstance(text_dim, int):
        raise ArtifactError(f"'{artifact.primary}': sample channels and text embedding width must be static")
    # Without the model, assume SD 1.x/2.x proportions (8x VAE, four down blocks, 64-latent native size).
    return UNetSpec(
        precision=precision, io_naming=io_naming, vae_scale_factor=8, in_channels=channels, out_channels=channels,
        cross_attention_dim=text_dim, latent_sample_size=64, latent_multiple=8,
    )  # fmt: skip


def graph_of(engine: Artifact, refusal: str) -> Artifact:
    """The ONNX graph an engine runs: itself, or for a TensorRT plan the graph it was built from.

    Other artifacts raise ArtifactError(``refusal``), which says what the caller needs instead.
    """
    if engine.stage in ONNX_STAGES:
        return engine
    if engine.stage == "build-trt":
        return engine.lineage()[1]
    raise ArtifactError(refusal)
