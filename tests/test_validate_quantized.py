"""`sdtrt validate` on a quantized graph holds it to 8-bit tolerances and says it is 8-bit, as `compile` does."""

from __future__ import annotations

import pytest

from sdtrt.core.config import QuantizeConfig, ValidationConfig
from sdtrt.stages import quantize
from sdtrt.tools.validate import Tolerances, validate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_quantized_graph_is_held_to_8_bit_tolerances_and_labelled_so(tiny, store):
    # tests/test_quantize.py's INT8 config: a cache hit in the session's store.
    config = QuantizeConfig(
        precision="int8", level=2.5, calibration_prompts=("a lighthouse at dusk", "a red fox in the snow"),
        calibration_steps=2,
    )  # fmt: skip
    quantized = quantize.run(config, tiny, store)

    report = validate(tiny, quantized, ValidationConfig(steps=4))

    # The graph that ran is fp32 outside the Q/DQ pairs: "fp32" alone would say it is exact.
    assert report.precision == "int8 level 2.5 (ONNX Runtime graph, fp32 outside Q/DQ)"
    assert report.tolerances == Tolerances.for_precision("int8") != Tolerances.for_precision("fp32")
    assert report, report.failures  # fp32's tolerances (cosine ≥ 0.99999) fail every 8-bit graph
    assert 0.99 <= min(row["cosine"] for row in report.tensors) < 0.99999
