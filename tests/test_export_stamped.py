"""Stamped blocks (graph/onnx_stamp.py): a network traced with STAMP_FROM copies of each repeated block list and
stamped to its full length is the network traced whole, up to the names of nodes and values
(graph/onnx_structure.py), with the same output on ONNX Runtime.

Default suite: a small network of repeated blocks shaped as Flux's (two streams, symbolic shapes computed once, the
last block's unread result dropped by torch.export), through torch.export's exporter. With -m slow: a tiny Flux
transformer with 6 double- and 7 single-stream blocks, and the other kinds that declare repeated blocks (FLUX.2's,
Qwen-Image's, T5's), through the export stage, stamped against whole.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
import pytest
import torch
from torch.export import Dim

from sdtrt.core.errors import ExportError
from sdtrt.graph.onnx_optimizer import multi_output_matches_by_use
from sdtrt.graph.onnx_scopes import NAME_SCOPES
from sdtrt.graph.onnx_stamp import STAMP_FROM, stamp_blocks
from sdtrt.graph.onnx_structure import graph_structure
from sdtrt.spec.transformer import FluxTransformerSpec
from sdtrt.spec.transformer_split import part_class
from sdtrt.stages.export_stream import before_optimize, stamped_blocks


class Block(torch.nn.Module):
    """Two streams in, two out: each reshaped by its symbolic length (traced once, reused by later blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(8, 8)
        self.context = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        joint = torch.cat([context, x], dim=1)
        joint = torch.nn.functional.gelu(self.mix(joint)).reshape(x.shape[0], -1, 8)
        gate, value = joint[..., :4], joint[..., 4:]  # two Slices of one value: SlicesSplit's pattern
        joint = torch.cat([value * torch.sigmoid(gate), gate], dim=-1)
        return joint[:, context.shape[1] :] + x, self.context(joint[:, : context.shape[1]])


class Blocks(torch.nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(count))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x, context = block(x, context)  # the last block's context is read by nothing
        return x * 2


@functools.cache
def exported(count: int, stamp_to: int | None = None) -> tuple[ir.Model, ir.Model, ir.Model]:
    """Blocks(count) through torch.export's exporter, the graph its optimizer was given and the trace; with
    ``stamp_to``, stamped to that many blocks before the optimizer, their weights (as attach_weights gives them) from
    Blocks(stamp_to). Cached: tests read, never change them."""
    full = Blocks(stamp_to or count).state_dict()
    unoptimized, traced = [], []

    def stamp(model: ir.Model) -> None:
        traced.append(copy(model))
        if stamp_to:
            stamp_blocks(model, {"blocks": stamp_to})
            for name, value in model.graph.initializers.items():
                value.const_value = ir.tensor(full[name].numpy(), name=name)
        unoptimized.append(copy(model))

    inputs = (torch.randn(2, 5, 8), torch.randn(2, 3, 8))
    dims = ({0: Dim("batch"), 1: Dim("tokens")}, {0: Dim("batch"), 1: Dim("text")})
    with before_optimize(stamp):
        program = torch.onnx.export(Blocks(count), inputs, dynamo=True, dynamic_shapes=dims, verbose=False)
    return program.model, unoptimized[0], traced[0]


def copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def run(model: ir.Model, x: np.ndarray, context: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: v for i, v in zip(session.get_inputs(), (x, context), strict=True)})[0]


def test_stamped_blocks_are_the_whole_trace_up_to_names():
    (whole, *_), (stamped, *_) = exported(6), exported(STAMP_FROM, stamp_to=6)
    assert graph_structure(stamped).differences(graph_structure(whole)) == []
    assert {"blocks.4.mix.bias", "blocks.5.mix.bias"} <= graph_structure(stamped).weights  # stamped, named by block
    rng = np.random.default_rng(0)
    x, context = rng.standard_normal((1, 4, 8), np.float32), rng.standard_normal((1, 6, 8), np.float32)
    assert np.array_equal(run(stamped, x, context), run(whole, x, context))
    # The comparison sees one node's inputs swapped.
    changed = copy(whole)
    mul = next(n for n in changed.graph if n.op_type == "Mul" and n.inputs[0] is not n.inputs[1])
    first, second = mul.inputs
    mul.replace_input_with(0, second)
    mul.replace_input_with(1, first)
    assert graph_structure(changed).differences(graph_structure(whole))
    # And one node's module scopes moved to another block (block parity cuts the graph by them).
    moved = copy(whole)
    node = next(n for n in moved.graph if "blocks.4" in n.metadata_props.get(NAME_SCOPES, ""))
    node.metadata_props[NAME_SCOPES] = node.metadata_props[NAME_SCOPES].replace("blocks.4", "blocks.3")
    assert graph_structure(moved).differences(graph_structure(whole))


def test_a_trace_without_stamp_from_copies_is_refused():
    *_, traced = exported(6)  # six copies traced, not STAMP_FROM: the graph does not run the list as stamping needs
    with pytest.raises(ExportError, match=r"cannot stamp blocks: the trace holds copies \[0, 1, 2, 3, 4, 5\]"):
        stamp_blocks(copy(traced), {"blocks": 9})


class BlocksWithSamplesBetween(Blocks):
    """Blocks chained through an addition outside them, as FLUX.1's transformer adds a ControlNet's samples."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.samples = torch.nn.Parameter(torch.randn(count, 8))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index, block in enumerate(self.blocks):
            x, context = block(x, context)
            x = x + self.samples[index]
        return x * 2


def test_blocks_chained_through_a_value_between_them_are_refused():
    """Stamped copies wire block to block: a value computed between two blocks would be skipped (a wrong graph, no
    error), so the stamper refuses the trace."""
    traced = []
    inputs = (torch.randn(2, 5, 8), torch.randn(2, 3, 8))
    dims = ({0: Dim("batch"), 1: Dim("tokens")}, {0: Dim("batch"), 1: Dim("text")})
    with before_optimize(lambda model: traced.append(copy(model))):
        torch.onnx.export(BlocksWithSamplesBetween(STAMP_FROM), inputs, dynamo=True, dynamic_shapes=dims, verbose=False)
    with pytest.raises(ExportError, match="cannot stamp blocks: its blocks are chained through nodes outside them"):
        stamp_blocks(traced[0], {"blocks": 6})


def test_copies_that_differ_by_one_attribute_are_refused():
    *_, traced = exported(STAMP_FROM, stamp_to=6)
    changed = copy(traced)
    stamp_blocks(copy(traced), {"blocks": 6})  # as traced, the copies are alike
    concat = next(n for n in changed.graph if n.op_type == "Concat" and "blocks.2" in n.metadata_props[NAME_SCOPES])
    concat.attributes["axis"] = ir.AttrInt64("axis", concat.attributes["axis"].value + 1)  # the ops stay the same
    with pytest.raises(ExportError, match="cannot stamp blocks: its copies 1 and 2 differ"):
        stamp_blocks(changed, {"blocks": 6})


def test_a_transformer_part_stamps_nothing():
    config = {"num_layers": 19, "num_single_layers": 38}  # FLUX.1's
    lists = {"network.transformer_blocks": 19, "network.single_transformer_blocks": 38}
    assert stamped_blocks(FluxTransformerSpec("fp32", "named", 8), config) == lists
    for part in ("transformer_embed", "transformer_first_block", "transformer_rest", "transformer_out"):
        assert stamped_blocks(part_class(part, "FluxTransformer2DModel")("fp32", "named", 8), config) == {}


def test_the_optimizer_bounded_by_use_gives_onnxscripts_graph():
    whole, unoptimized, _ = exported(6)
    graphs = copy(unoptimized), copy(unoptimized)
    onnxscript.optimizer.optimize_ir(graphs[0])
    with multi_output_matches_by_use():
        onnxscript.optimizer.optimize_ir(graphs[1])
    assert graph_structure(graphs[1]).differences(graph_structure(graphs[0])) == []
    assert graph_structure(graphs[0]).differences(graph_structure(whole)) == []
    # Each block's gate and value: two Slices of one value, the candidates SlicesSplit's search now draws from.
    assert sum(n.op_type == "Slice" for n in unoptimized.graph) >= 2 * 6


def halves(order: tuple[str, ...]) -> ir.Model:
    """x[2, 8] sliced into halves on its static last axis, the upper half read through an Identity: the Identity's
    removal moves that Slice onto x after the lower one, so x's readers are listed out of graph order."""
    const = {
        k: ir.node("Constant", [], {"value": ir.tensor([v])}) for k, v in (("0", 0), ("4", 4), ("8", 8), ("-1", -1))
    }
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 8]))
    y = ir.node("Identity", [x])
    nodes = {
        "id": y,
        "hi": ir.node("Slice", [y.outputs[0], *(const[k].outputs[0] for k in ("4", "8", "-1"))]),
        "lo": ir.node("Slice", [x, *(const[k].outputs[0] for k in ("0", "4", "-1"))]),
    }
    graph = ir.Graph(
        [x],
        [nodes["lo"].outputs[0], nodes["hi"].outputs[0]],
        nodes=[*const.values(), *(nodes[k] for k in order)],
        opset_imports={"": 18},
    )
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize(
    "order, split", [(("id", "hi", "lo"), True), (("id", "lo", "hi"), False), (("lo", "id", "hi"), False)]
)
def test_the_bounded_matcher_tries_readers_in_graph_order(order, split):
    """SlicesSplit rewrites only where the upper half's Slice comes first in the graph (onnxscript tries candidates
    in graph order and checks only the first structural match): the bounded search does the same, node for node."""
    from onnxscript.rewriter import _matcher

    ours, theirs = halves(order), halves(order)
    onnxscript.optimizer.optimize_ir(theirs)
    with multi_output_matches_by_use():
        assert _matcher.SimplePatternMatcher.match.__qualname__.startswith("_bounded")  # onnxscript verified: patched
        onnxscript.optimizer.optimize_ir(ours)
    assert [n.op_type for n in theirs.graph] == (["Split"] if split else ["Slice", "Slice"])
    assert ir.to_proto(ours.graph) == ir.to_proto(theirs.graph)


def test_an_onnxscript_not_verified_runs_unpatched(monkeypatch, caplog):
    from onnxscript.rewriter import _matcher

    from sdtrt.graph import onnx_optimizer

    original = _matcher.SimplePatternMatcher.match
    with multi_output_matches_by_use(), multi_output_matches_by_use():  # reentrant: restored on the last exit
        patched = _matcher.SimplePatternMatcher.match
    assert patched is not original and _matcher.SimplePatternMatcher.match is original
    monkeypatch.setattr(onnx_optimizer, "VERIFIED_ONNXSCRIPT", ("0.0.0",))
    with multi_output_matches_by_use():
        assert _matcher.SimplePatternMatcher.match is original
    assert "its optimizer runs unpatched" in caplog.text


# (preset, component, block counts past STAMP_FROM): every kind whose spec declares repeated blocks.
STAMPED_KINDS = [
    ("tiny-flux", "transformer", {"num_layers": 6, "num_single_layers": 7}),
    ("tiny-flux2-klein", "transformer", {"num_layers": 6, "num_single_layers": 7}),
    ("tiny-qwen-image", "transformer", {"num_layers": 6}),
    ("tiny-flux", "text_encoder_2", {"num_layers": 6}),  # T5
]


@pytest.mark.parametrize(("preset", "component", "counts"), STAMPED_KINDS)
def test_a_kinds_repeated_blocks_are_its_networks_lists(preset, component, counts):
    """Each declared list is a module list of the network, counted by the config key named (a wrong path or key
    would stamp nothing, or fail at export): cheap, the networks built on the meta device."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.graph.onnx_scopes import WRAPPER
    from sdtrt.sources.models import resolve_model
    from sdtrt.spec import FOLDERS
    from sdtrt.stages import export
    from sdtrt.stages.export_stream import weight_free_network

    model = resolve_model(preset)
    spec = export.spec_for(model, ExportConfig(component=component))
    config = model.component_config(FOLDERS[component])
    network, _ = weight_free_network(model, FOLDERS[component], torch.float32)
    modules = dict(network.named_modules())
    assert set(spec.repeated_blocks.values()) == set(counts)
    for path, key in spec.repeated_blocks.items():
        assert len(modules[path]) == config[key]
    grown = {WRAPPER + path: counts[key] for path, key in spec.repeated_blocks.items()}
    assert stamped_blocks(spec, config | counts) == grown


@pytest.mark.slow  # two exports of a 13-block network: 1 to 3 min each on 2 cores
@pytest.mark.parametrize(("preset", "component", "counts"), STAMPED_KINDS)
def test_a_stamped_export_is_the_whole_export(preset, component, counts, tmp_path, monkeypatch):
    from sdtrt.core.config import ExportConfig
    from sdtrt.core.store import Store
    from sdtrt.graph.onnx_scopes import WRAPPER
    from sdtrt.sources.models import resolve_model
    from sdtrt.sources.preset_build import with_network_config
    from sdtrt.spec import FOLDERS
    from sdtrt.stages import export

    tiny = resolve_model(preset)
    folder = with_network_config(tiny.path, FOLDERS[component], tmp_path / "grown", **counts)
    model, config = resolve_model(str(folder)), ExportConfig("fp16", component=component, weights="stream")
    spec = export.spec_for(model, config)
    stamped = export.run(config, model, Store(tmp_path / "stamped"))
    blocks = {WRAPPER + path: counts[key] for path, key in spec.repeated_blocks.items()}
    assert stamped.manifest["details"]["stamped"] == {"traced_copies": STAMP_FROM, "blocks": blocks}
    assert (
        stamped.manifest["details"]["stamped_reason"]
        == f"streamed: {STAMP_FROM} copies of {', '.join(spec.repeated_blocks)} traced, the others stamped (shorter "
        "lists whole)"
    )
    monkeypatch.setattr(type(spec), "repeated_blocks", {})
    whole = export.run(config, model, Store(tmp_path / "whole"))
    assert whole.manifest["details"]["stamped"] == {}
    assert graph_structure(ir.load(stamped.primary)).differences(graph_structure(ir.load(whole.primary))) == []
    feeds = {k: v.numpy() for k, v in spec.sample_inputs(2, 128, 192, dtype=torch.float16).items()}
    sessions = [ort.InferenceSession(str(a.primary), providers=["CPUExecutionProvider"]) for a in (stamped, whole)]
    outputs = [session.run(None, feeds) for session in sessions]
    assert np.array_equal(outputs[0][0], outputs[1][0])
