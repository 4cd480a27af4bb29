"""The exporter's optimizer bounded by use (graph/onnx_optimizer.py) makes onnxscript's own graph, proto for proto, on
every network a tiny preset exports: each network traced once through the export stage (torch.export's exporter,
weights streamed), the graph its optimizer was given optimized by both, bounded and unpatched.

Default suite: tiny-flux's transformer (Slices of one value, SlicesSplit's pattern, which never rewrites there: a
rule that fires is tests/test_export_stamped.py's synthetic graph), from the session's streamed fp16 export of it
(conftest.py's streamed_export, the one tests/test_export_streamed.py checks: one trace for both; a second only
where another worker traced it first), about 2 s of CPU past that trace. With -m slow: every component of every
tiny preset, a test per preset. Stamped against whole: tests/test_export_stamped.py (the tiny presets hold fewer
blocks than stamping starts at).
"""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
import pytest

from sdtrt.core.config import ExportConfig
from sdtrt.core.store import Store
from sdtrt.graph.onnx_optimizer import multi_output_matches_by_use
from sdtrt.sources.models import resolve_model
from sdtrt.sources.presets import PRESETS
from sdtrt.spec import model_components
from sdtrt.stages import export

CHEAP = [("tiny-flux", "transformer")]
TINY_PRESETS = [p for p in PRESETS if p.startswith("tiny")]


def optimizer_input(model, component: str, store: Store) -> ir.Model:
    """The export stage's graph as its optimizer gets it (stamped, weights attached)."""
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    given = []
    original = ONNXProgram.optimize

    def optimize(self) -> None:
        given.append(ir.from_proto(ir.to_proto(self.model)))
        original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ONNXProgram, "optimize", optimize)
        export.run(ExportConfig(exporter="dynamo", component=component, weights="stream"), model, store)
    assert len(given) == 1, "the network was traced once, and optimized once"
    return given[0]


def bounded_is_onnxscripts(given: ir.Model) -> bool:
    """Both optimizers on copies of an export's optimizer input ``given`` (the export's own result holds its folded
    constants in a scratch file, gone once it is saved)."""
    ours, theirs = ir.from_proto(ir.to_proto(given)), given
    from onnxscript.rewriter import _matcher

    with multi_output_matches_by_use():
        # on an onnxscript the bound was not verified on, both sides would run unpatched and prove nothing
        assert _matcher.SimplePatternMatcher.match.__qualname__.startswith("_bounded"), "onnxscript runs unpatched"
        onnxscript.optimizer.optimize_ir(ours)
    onnxscript.optimizer.optimize_ir(theirs)  # unpatched: onnxscript's own search
    return ir.to_proto(ours) == ir.to_proto(theirs)


@pytest.mark.parametrize(("preset", "component"), CHEAP)
def test_the_bounded_optimizer_makes_onnxscripts_graph(preset, component, streamed_export, optimizer_inputs, tmp_path):
    model = resolve_model(preset)
    optimizer_inputs[key := (str(model.path), component, "fp16")] = None  # asked for: kept where it is traced
    streamed_export(model, component, "fp16")  # traced here, or a cache hit of a trace another worker made
    given = optimizer_inputs.pop(key)
    assert bounded_is_onnxscripts(given or optimizer_input(model, component, Store(tmp_path)))


@pytest.mark.slow  # a test per preset, each under pytest's timeout: all 78 networks in one took over 15 minutes
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_the_bounded_optimizer_makes_onnxscripts_graph_on_every_tiny_network(preset, tmp_path):
    components = [c for c in model_components(resolve_model(preset)) if (preset, c) not in CHEAP]
    assert components, "every preset has networks"
    model = resolve_model(preset)
    differ = [c for c in components if not bounded_is_onnxscripts(optimizer_input(model, c, Store(tmp_path / c)))]
    assert differ == []
