"""Parity at a scale that does not fit: an exported graph checked by parts, never with all its weights loaded.

``check_graph``: the graph's IO as its spec says, its output shapes from shape inference on the weight-free
graph, and its initializers against the model's parameters as the safetensors headers list them (nothing
loaded). ``check_blocks``: single blocks cut out of the exported graph (the module scopes torch.export's
exporter records on every node), each run on ONNX Runtime with only that block's initializers (streamed by
their external-data offsets) against the same PyTorch block loaded alone from the model's shards, on the
same seeded inputs. Peak memory: the weight-free graph plus one block's weights, twice.

A BlockParityReport is truthy when everything passes; ``raise_for_status()`` raises ParityError (CLI exit 3).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.errors import ParityError, RequestError, WrongArtifactError
from ...graph import onnx_graph
from ...spec import FOLDERS
from .compare import block_failures, compare_block
from .cut import cut_block
from .graph_check import check_graph
from .matching import Arguments
from .scopes import NO_SCOPES, blocks_summary, graph_modules
from .shapes import check_size, concrete_shapes
from .stored import loaded_tensors
from .torch_block import meta_network, trace_calls

if TYPE_CHECKING:
    from ...core.artifact import Artifact
    from ...sources.models import ModelSource
    from ..validate import Tolerances

# The blocks checked by default, per ModuleList (a path in the network): Flux's first and last double-stream block
# and one single-stream block, SD3's first and last, a UNet's first down block and its last up block (skip
# connections), a text encoder's first and last layer (CLIP's, SDXL's second CLIP's, T5's; an LLM's first and last
# decoder layer the graph runs: Qwen3's, Qwen2.5-VL's language model's), Z-Image's first and last main layer and
# its first noise and caption refiner (the caption's takes no timestep modulation).
DEFAULT_BLOCKS = {"transformer_blocks": (0, -1), "single_transformer_blocks": (0,), "down_blocks": (0,),
                  "up_blocks": (-1,), "encoder.layers": (0, -1), "text_model.encoder.layers": (0, -1),
                  "encoder.block": (0, -1), "model.layers": (0, -1),
                  "model.language_model.layers": (0, -1), "noise_refiner": (0,), "context_refiner": (0,),
                  "layers": (0, -1)}  # fmt: skip
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear", "TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear")


@dataclass
class BlockParityReport:
    graph: str
    model: str
    precision: str
    tolerances: dict[str, float]
    checks: dict[str, Any] = field(default_factory=dict)  # check_graph's result
    blocks: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.failures

    def raise_for_status(self) -> None:
        if self.failures:
            more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            raise ParityError(
                f"the graph does not match the model by parts: {self.failures[0]}{more}; re-export it, "
                "or see the report (--json) for every check"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"passed": bool(self)}


def default_blocks(network: Any, in_graph: Collection[str]) -> list[str]:
    """DEFAULT_BLOCKS of the network's module lists, as paths (transformer_blocks.0, transformer_blocks.18, …), picked
    among the blocks the graph runs (``in_graph``): an LLM encoder's graph ends at the last layer its pipeline reads."""
    out = []
    for path, picks in DEFAULT_BLOCKS.items():
        try:
            modules = network.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(modules, "__len__") and len(modules):  # a ModuleList (a module of that name may be no list)
            present = [f"{path}.{i}" for i in range(len(modules)) if f"{path}.{i}" in in_graph]
            out += list(dict.fromkeys(present[i] for i in picks)) if present else []
    return out


def block_tolerances(precision: str) -> Tolerances:
    """validate's tolerances for fp16/bf16; fp32 blocks at cosine 0.9999 (one block, not the whole network)."""
    from dataclasses import replace

    from ..validate import Tolerances

    base = Tolerances.for_precision("fp32" if precision == "fp32" else precision)  # type: ignore[arg-type]
    return replace(base, min_cosine=0.9999) if precision == "fp32" else base


def check_checkable(artifact: Artifact, blocks: Sequence[str] = ()) -> None:
    """What ``check_blocks`` cannot check, refused (exit 2) from the weight-free graph before any model loads: an
    artifact with no graph (an engine set), a quantized (Q/DQ) graph or one without module scopes
    (WrongArtifactError), a block the graph has no module of or no block named for a graph without DEFAULT_BLOCKS
    (RequestError)."""
    if artifact.primary.suffix != ".onnx":
        raise WrongArtifactError(
            f"{artifact.path} is a {artifact.stage} artifact, which holds no graph: check-blocks checks an export "
            "(the folder `sdtrt export --exporter dynamo` prints, or an export row of `sdtrt cache ls`)"
        )
    graph = onnx_graph.load_graph(artifact.primary).graph
    if artifact.stage == "quantize" or any(node.op_type in QDQ_OPS for node in graph.node):
        raise WrongArtifactError(
            f"{artifact.path} is a quantized (Q/DQ) graph: check-blocks compares the blocks of an export with the "
            "model's fp32 PyTorch blocks, which quantized blocks do not match by design; check the export "
            "(sdtrt export --exporter dynamo), and the quantized graph whole with `sdtrt validate --engine` or layer "
            "by layer with `sdtrt debug`"
        )
    modules = graph_modules(graph)
    if not modules:
        raise WrongArtifactError(NO_SCOPES)
    if not blocks and not any(module.startswith(f"{key}.") for module in modules for key in DEFAULT_BLOCKS):
        raise RequestError(
            f"the graph has none of {', '.join(DEFAULT_BLOCKS)}, the block lists check-blocks picks from by default; "
            f"name blocks with --block (its blocks: {blocks_summary(modules)})"
        )
    if unknown := [b for b in blocks if b not in modules]:
        example = next((m for m in modules if m.count(".") >= 4), max(modules, key=lambda m: m.count(".")))
        raise RequestError(
            f"--block {unknown[0]}: the graph has no module of that name; its blocks: {blocks_summary(modules)} "
            f"(or a module inside one, such as {example})"
        )


def check_blocks(
    model: ModelSource, artifact: Artifact, blocks: Sequence[str] = (), graph_checks: bool = True,
    min_cosine: float | None = None, max_abs: float | None = None,
) -> BlockParityReport:  # fmt: skip
    """Check an export artifact (or an .onnx with a manifest) against its model part by part: ``check_graph``, then
    each block (``blocks``, default: DEFAULT_BLOCKS) cut out and compared with the PyTorch block loaded alone.

    Never loads the graph's weights, nor more than one block of the model's.
    """
    from dataclasses import replace

    from ...core.progress import step
    from ...stages.graph_module import block_patches
    from ...stages.patches import replaced

    check_checkable(artifact, blocks)
    spec = onnx_graph.artifact_spec(artifact)
    graph_path = artifact.primary
    tol = block_tolerances(spec.precision)
    tol = replace(tol, **{k: v for k, v in (("min_cosine", min_cosine), ("max_abs", max_abs)) if v is not None})
    report = BlockParityReport(str(graph_path), model.name, spec.precision, asdict(tol))
    folder = FOLDERS[spec.component]
    network = meta_network(model, folder)
    params = loaded_tensors(network, model.component_dir(folder))
    if graph_checks:
        with step("Checking the graph's IO, inferred shapes and initializers (weights not loaded)"):
            checked = check_graph(graph_path, spec, model, params)
        report.checks = asdict(checked)
        report.failures += checked.failures
    proto = onnx_graph.load_graph(graph_path)
    blocks = list(blocks) or default_blocks(network, set(graph_modules(proto.graph)))  # check_checkable saw one
    batch, height, width, tokens = check_size(spec)
    shapes = concrete_shapes(proto, spec.input_shapes(batch, height, width, tokens))
    calls = trace_calls(network, spec, blocks)
    work = Path(tempfile.mkdtemp(prefix="sdtrt-blocks-"))
    try:
        with replaced(block_patches(spec)):  # each block runs as the graph's forward runs it
            for i, block in enumerate(blocks):
                with step(f"Comparing {block} on ONNX Runtime with PyTorch (loaded alone)"):
                    arguments = Arguments(calls[block], proto.graph, shapes)
                    cut = cut_block(
                        proto, graph_path.parent, block, shapes, work / f"block{i}.onnx", arguments.is_argument
                    )
                    row = compare_block(cut, calls[block], arguments, network, block, params, seed=i)
                row["failures"] = [f"{block}: {f}" for f in block_failures(row, tol)]
                report.blocks.append(row)
                report.failures += row["failures"]
                for leftover in work.iterdir():
                    leftover.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report
