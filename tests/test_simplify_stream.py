"""Simplify without loading the weights (``--method stream``): the output of its input, the weights where they were.

The stream method must work on graphs whose weights do not fit in memory; the last test proves it on one: a child
process whose address space cannot hold the graph's weights simplifies it (``auto`` picks stream) and stores it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import SimplifyConfig
from sdtrt.core.store import Store
from sdtrt.stages import simplify

from .helpers import REPO, external_copy, last_line, run_cli

HUGE = 3 * 2**28  # 768 MiB of fp16 weight: more than the child below may allocate


def external_weights(path: Path) -> dict[str, tuple[str, int | None, int | None]]:
    """name → (file, offset, length) of each initializer held in external data, read without the data."""
    graph = onnx.load(str(path), load_external_data=False).graph
    infos = {t.name: ExternalDataInfo(t) for t in graph.initializer}
    return {name: (i.location, i.offset, i.length) for name, i in infos.items() if i.location}


def weight_values(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def append_weight(
    model: onnx.ModelProto, data_file: Path, name: str, values: np.ndarray | None, shape: tuple[int, ...]
):
    """An fp16 initializer stored at the (page-aligned) end of ``data_file``: ``values``, or a hole of zeros that
    takes no disk (``None``)."""
    nbytes = int(np.prod(shape)) * 2
    with data_file.open("r+b") as data:
        end = data.seek(0, 2)
        offset = end + -end % 4096
        data.truncate(offset + nbytes)
        if values is not None:
            data.seek(offset)
            data.write(values.astype(np.float16).tobytes())
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT16, dims=shape, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", data_file.name), ("offset", offset), ("length", nbytes)):
        tensor.external_data.add(key=key, value=str(value))
    model.graph.initializer.append(tensor)


def test_stream_keeps_the_weights_file_and_the_output(tiny_export, tmp_path):
    source = external_copy(tiny_export, tmp_path / "export")
    result = simplify.run(SimplifyConfig(method="stream"), source, Store(tmp_path / "engines"))

    details = result.manifest["details"]
    assert (details["method"], details["method_reason"]) == ("stream", "asked for with --method")
    assert details["weights_carried"].startswith("copied unet.onnx.data to unet.sim.onnx.data in the kernel, offsets")
    assert details["nodes_after"] < details["nodes_before"]
    assert "Identity" not in details["op_counts_after"]
    # ONNX Runtime ran both graphs on the same input: the same output.
    assert details["check"]["cosine"] > 0.9999 and details["check"]["max_abs"] < 1e-3
    before, after = external_weights(source.primary), external_weights(result.primary)
    assert after == {name: ("unet.sim.onnx.data", offset, length) for name, (_, offset, length) in before.items()}
    values = weight_values(result.primary)
    assert all(value.tobytes() == values[name].tobytes() for name, value in weight_values(source.primary).items())
    assert result.file_problems(rehash=True) == []


def test_stream_rewrites_the_weights_when_cleanup_drops_one(tiny_export, tmp_path):
    def add_dead_weight(model, data_file):
        append_weight(model, data_file, "dead_weight", np.arange(64), (8, 8))

    source = external_copy(tiny_export, tmp_path / "export", add_dead_weight)
    result = simplify.run(SimplifyConfig(method="stream"), source, Store(tmp_path / "engines"))

    details = result.manifest["details"]
    assert details["weights_carried"].startswith("rewrote unet.sim.onnx.data by streaming")
    assert "cleanup dropped 1 unused initializers" in details["weights_carried"]
    assert details["check"]["cosine"] > 0.9999
    data_out = result.path / "unet.sim.onnx.data"
    assert not data_out.samefile(source.path / "unet.onnx.data")
    after = external_weights(result.primary)
    assert "dead_weight" not in after and all(offset % 4096 == 0 for _, offset, _ in after.values())
    before = weight_values(source.primary)
    assert set(after) == set(before) - {"dead_weight"}
    for name, value in weight_values(result.primary).items():
        if name in after:
            assert value.dtype == before[name].dtype and value.tobytes() == before[name].tobytes(), name


def test_a_memory_budget_streams_and_skips_the_check_it_cannot_afford(tiny_export, tmp_path):
    """--memory-budget is what auto plans with: a budget under the graph's weights streams them and skips the ONNX
    Runtime check (~4x the weights), saying so; a malformed one is a usage error before any work."""
    source = external_copy(tiny_export, tmp_path / "export")
    engines = ["--engines", str(tmp_path / "engines")]
    result = run_cli("simplify", str(source.path), "--memory-budget", "100KB", *engines)
    assert result.returncode == 0, result.stderr
    assert "Simplified with stream (" in result.stderr and "over the memory budget (100.0 kB)" in result.stderr
    assert "Not checking the simplified graph on ONNX Runtime" in result.stderr
    details = Artifact.open(last_line(result.stdout)).manifest["details"]
    assert details["method"] == "stream" and details["check_skipped"] and details["memory_budget"] == 100_000
    affordable = run_cli("simplify", str(source.path), *engines)  # not the unchecked graph from under the budget
    assert affordable.returncode == 0 and last_line(affordable.stdout) != last_line(result.stdout)
    assert Artifact.open(last_line(affordable.stdout)).manifest["details"]["check"]["cosine"] > 0.9999
    bad = run_cli("simplify", str(source.path), "--memory-budget", "lots", *engines)
    assert bad.returncode == 2 and "--memory-budget: 'lots' is not a size" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


def test_cli_stream_says_how_the_weights_were_carried(tiny_export, tmp_path):
    source = external_copy(tiny_export, tmp_path / "export")
    result = run_cli("simplify", str(source.path), "--method", "stream", "--engines", str(tmp_path / "engines"))
    assert result.returncode == 0, result.stderr
    assert "Simplified with stream (asked for with --method)" in result.stderr
    assert "weights: copied unet.onnx.data to unet.sim.onnx.data in the kernel" in result.stderr
    assert Artifact.open(last_line(result.stdout)).manifest["details"]["method"] == "stream"


CHILD = """
import resource, sys
import onnx, onnx_graphsurgeon, onnxruntime  # what the stage imports, before the limit
from sdtrt.core.config import SimplifyConfig
from sdtrt.stages import simplify
from sdtrt.core.artifact import Artifact
from sdtrt.core.store import Store

size = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 2**29, size + 2**29))  # 512 MiB more: less than the weights
try:
    onnx.load(sys.argv[1])
    sys.exit("the graph's weights loaded under the limit: the test proves nothing")
except MemoryError:
    pass
budget = 2 * 2**30  # a machine with 2 GiB
print(simplify.run(SimplifyConfig(memory_budget=budget), Artifact.open(sys.argv[1]), Store(sys.argv[2])).path)
"""


def test_auto_streams_a_graph_whose_weights_do_not_fit(tiny_export, tmp_path):
    def add_huge_weight(model, data_file):
        """A 768 MiB weight (a hole: zeros) the output depends on: out_sample + huge[0], equal to out_sample."""
        append_weight(model, data_file, "huge", None, (HUGE // 2,))
        output = model.graph.output[0].name
        for node in model.graph.node:
            node.output[:] = [f"{output}_before_huge" if name == output else name for name in node.output]
        model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "huge_index"))
        model.graph.node.extend([
            helper.make_node("Gather", ["huge", "huge_index"], ["huge_first"]),
            helper.make_node("Add", [f"{output}_before_huge", "huge_first"], [output]),
        ])  # fmt: skip

    source = external_copy(tiny_export, tmp_path / "export", add_huge_weight)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(source.primary), str(tmp_path / "engines")],
        capture_output=True, text=True, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    result = Artifact.open(last_line(child.stdout))

    details = result.manifest["details"]
    assert details["method"] == "stream" and "over the memory budget (2.00 GiB)" in details["method_reason"]
    assert details["check"] is None and "over the memory budget (2.00 GiB)" in details["check_skipped"]
    assert "Not checking the simplified graph on ONNX Runtime" in child.stderr
    assert (result.path / "unet.sim.onnx.data").stat().st_blocks * 512 < HUGE  # the copy kept the hole a hole
    huge = external_weights(source.primary)["huge"]
    assert external_weights(result.primary)["huge"] == ("unet.sim.onnx.data", *huge[1:])


def test_auto_streams_every_graph_over_64_mib_and_keeps_onnxsim_for_small_ones():
    method, why = simplify.choose_method("auto", 1_700_000_000, 64 * 2**30)  # SD 1.5's fp16 UNet, a big machine
    assert method == "stream" and why.startswith("1.70 GB of weights, over the 64.0 MiB auto loads")
    assert simplify.choose_method("auto", 6_000_000, 64 * 2**30)[0] == "onnxsim"  # the tiny presets' graphs
    assert "over the memory budget" in simplify.choose_method("auto", 6_000_000, 2**20)[1]
