"""Stamped blocks (graph/onnx_stamp.py): a network traced with STAMP_FROM copies of each repeated block list and
stamped to its full length is the network traced whole, up to the names of nodes and values
(graph/onnx_structure.py), with the same output on ONNX Runtime.

Default suite: a small network of repeated blocks shaped as Flux's (two streams, symbolic shapes computed once, the
last block's unread result dropped by torch.export), through torch.export's exporter. With -m slow: a tiny Flux
transformer with 6 double- and 7 single-stream blocks through the export stage, stamped against whole.
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
from sdtrt.graph.onnx_stamp import STAMP_FROM, stamp_blocks
from sdtrt.graph.onnx_structure import graph_structure
from sdtrt.stages.export_stream import before_optimize


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
def exported(count: int, stamp_to: int | None = None) -> tuple[ir.Model, ir.Model]:
    """Blocks(count) through torch.export's exporter, and the graph its optimizer was given; with ``stamp_to``,
    stamped to that many blocks before the optimizer, their weights (as attach_weights gives them) from
    Blocks(stamp_to). Cached: tests read, never change them."""
    full = Blocks(stamp_to or count).state_dict()
    unoptimized = []

    def stamp(model: ir.Model) -> None:
        if stamp_to:
            stamp_blocks(model, {"blocks": stamp_to})
            for name, value in model.graph.initializers.items():
                value.const_value = ir.tensor(full[name].numpy(), name=name)
        unoptimized.append(copy(model))

    inputs = (torch.randn(2, 5, 8), torch.randn(2, 3, 8))
    dims = ({0: Dim("batch"), 1: Dim("tokens")}, {0: Dim("batch"), 1: Dim("text")})
    with before_optimize(stamp):
        program = torch.onnx.export(Blocks(count), inputs, dynamo=True, dynamic_shapes=dims, verbose=False)
    return program.model, unoptimized[0]


def copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def run(model: ir.Model, x: np.ndarray, context: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: v for i, v in zip(session.get_inputs(), (x, context), strict=True)})[0]


def test_stamped_blocks_are_the_whole_trace_up_to_names():
    (whole, _), (stamped, _) = exported(6), exported(STAMP_FROM, stamp_to=6)
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


def test_a_list_whose_copies_differ_is_refused():
    _, unoptimized = exported(6)  # six copies traced, not STAMP_FROM
    with pytest.raises(ExportError, match="cannot stamp blocks: the trace holds copies"):
        stamp_blocks(copy(unoptimized), {"blocks": 9})


def test_the_optimizer_bounded_by_use_gives_onnxscripts_graph():
    whole, unoptimized = exported(6)
    graphs = copy(unoptimized), copy(unoptimized)
    onnxscript.optimizer.optimize_ir(graphs[0])
    with multi_output_matches_by_use():
        onnxscript.optimizer.optimize_ir(graphs[1])
    assert graph_structure(graphs[1]).differences(graph_structure(graphs[0])) == []
    assert graph_structure(graphs[0]).differences(graph_structure(whole)) == []
    # Each block's gate and value: two Slices of one value, the candidates SlicesSplit's search now draws from.
    assert sum(n.op_type == "Slice" for n in unoptimized.graph) >= 2 * 6


@pytest.mark.slow  # two exports of a 13-block transformer: 80 s on 2 cores
def test_flux_transformer_stamped_is_its_whole_export(tmp_path, monkeypatch):
    from sdtrt.core.config import ExportConfig
    from sdtrt.core.store import Store
    from sdtrt.sources.models import resolve_model
    from sdtrt.sources.preset_build import with_network_config
    from sdtrt.spec.transformer import FluxTransformerSpec
    from sdtrt.stages import export

    tiny = resolve_model("tiny-flux")
    folder = with_network_config(tiny.path, "transformer", tmp_path / "flux-6-7", num_layers=6, num_single_layers=7)
    model, config = resolve_model(str(folder)), ExportConfig("fp16", component="transformer")
    stamped = export.run(config, model, Store(tmp_path / "stamped"))
    blocks = {"network.transformer_blocks": 6, "network.single_transformer_blocks": 7}
    assert stamped.manifest["details"]["stamped"] == {"traced_copies": STAMP_FROM, "blocks": blocks}
    monkeypatch.setattr(FluxTransformerSpec, "repeated_blocks", {})
    whole = export.run(config, model, Store(tmp_path / "whole"))
    assert whole.manifest["details"]["stamped"] == {}
    assert graph_structure(ir.load(stamped.primary)).differences(graph_structure(ir.load(whole.primary))) == []
    spec = export.spec_for(model, config)
    feeds = {k: v.numpy() for k, v in spec.sample_inputs(2, 128, 192, dtype=torch.float16).items()}
    sessions = [ort.InferenceSession(str(a.primary), providers=["CPUExecutionProvider"]) for a in (stamped, whole)]
    outputs = [session.run(None, feeds) for session in sessions]
    assert np.array_equal(outputs[0][0], outputs[1][0])
