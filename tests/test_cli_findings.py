"""The findings of a newcomer's trial from a fresh clone: CLI messages, options and output, each as the user met it."""

from __future__ import annotations

import pytest

from sdtrt.core.artifact import Artifact
from tests.helpers import last_line, run_cli


def one_line_usage_error(result) -> str:
    """The one stderr line of a usage error (exit 2)."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("command", ["quantize", "compile"])
def test_a_malformed_level_is_one_line_naming_the_levels(command):
    stderr = one_line_usage_error(run_cli(command, "--level", "abc"))
    assert "'abc'" in stderr and "2.5: convolutions, feed-forward and Q/K/V projections" in stderr


ENGINE_COMMANDS = {
    "generate": ["generate", "--engine"],
    "validate": ["validate", "--engine"],
    "check-blocks": ["check-blocks", "--engine"],
    "profile": ["profile", "--out", "unused", "--engine"],
    "deploy triton": ["deploy", "triton", "--out", "unused", "--engine"],
    "lora inspect": ["lora", "inspect", "README.md", "--engine"],
    "debug": ["debug"],
}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_an_engine_that_names_no_artifact_is_a_usage_error(command, tmp_path):
    """A path that does not exist, or a folder that is no artifact, is a usage error saying what to pass instead."""
    missing = one_line_usage_error(run_cli(*ENGINE_COMMANDS[command], str(tmp_path / "no-such-engine")))
    assert "does not exist" in missing and "pass the directory a stage printed" in missing
    if command in ("validate", "debug"):  # an option and an argument
        not_artifact = one_line_usage_error(run_cli(*ENGINE_COMMANDS[command], str(tmp_path)))
        assert "is not an sdtrt artifact" in not_artifact


def test_sizes_show_in_the_units_given():
    """1MB is 10^6 bytes and shows as 1.0 MB, 1MiB as 1.0 MiB; measured sizes show in binary units."""
    from sdtrt.core.config import format_size, parse_size
    from sdtrt.stages.simplify import choose_method

    given = {"1MB": "1.0 MB", "1mib": "1.0 MiB", "8GB": "8.00 GB", "8GiB": "8.00 GiB", "512MB": "512.0 MB",
             "100KB": "100.0 kB", "1TB": "1.00 TB", "0.5TiB": "512.00 GiB"}  # fmt: skip
    assert {text: format_size(parse_size(text)) for text in given} == given
    assert (parse_size("1MB"), parse_size("1MiB"), parse_size("1TiB")) == (10**6, 2**20, 2**40)
    assert format_size(1_719_664_640) == "1.60 GiB"  # a measured size
    _, reason = choose_method("auto", 3 * 10**6, parse_size("1MB"))
    assert "over the memory budget (1.0 MB)" in reason


def test_compile_takes_the_memory_budget_and_weights_options(tmp_path):
    """compile passes --weights to its exports and --memory-budget (or SDTRT_MEMORY_BUDGET) to its simplify steps,
    as export and simplify take them; a malformed budget is a usage error before anything loads."""
    malformed = one_line_usage_error(run_cli("compile", "--memory-budget", "lots"))
    assert "--memory-budget: 'lots' is not a size" in malformed
    result = run_cli(
        "compile", "--target", "onnxruntime", "--components", "text_encoder", "--no-validate", "--weights", "stream",
        "--engines", str(tmp_path), env={"SDTRT_MEMORY_BUDGET": "100KB"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    built = Artifact.open(last_line(result.stdout))
    simplified, exported = built.lineage()[1:3]
    assert exported.manifest["details"]["weights"] == "stream"
    details = simplified.manifest["details"]
    assert details["method"] == "stream" and "over the memory budget (100.0 kB)" in details["method_reason"]
    assert details["memory_budget"] == 100_000


def test_onnx_runtimes_optimizer_notes_stay_out_of_the_output(tmp_path):
    """A streamed UNet graph (the memory budget's pick) makes ONNX Runtime's optimizer warn per Unsqueeze it keeps, in
    ANSI colours, through its default logger, which the session's log level does not reach."""
    result = run_cli(
        "compile", "--target", "onnxruntime", "--components", "unet", "--no-validate", "--memory-budget", "1MB",
        "--engines", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Cleaning up without loading the weights" in result.stderr  # the streamed graph, which made them
    assert "[W:onnxruntime" not in result.stderr, result.stderr


def test_a_cache_hit_compile_says_each_stage_was_reused_without_its_tables():
    args = ("compile", "--target", "onnxruntime", "--components", "text_encoder", "--no-validate")
    assert run_cli(*args).returncode == 0  # built, or already in the session's store
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    for stage in ("export", "simplify", "build-ort"):
        assert again.stderr.count(f"✓ {stage}: cached") == 1, again.stderr
    assert "Simplified with" not in again.stderr and "before" not in again.stderr, again.stderr


@pytest.fixture(scope="module")
def clip_export(tiny, store):
    """tiny's fp32 text encoder exported by torch.export (module scopes on its nodes), ~20 s."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.stages import export

    return export.run(ExportConfig(precision="fp32", exporter="dynamo", component="text_encoder"), tiny, store)


def with_a_weight_qdq_pair(model) -> None:
    """A QuantizeLinear → DequantizeLinear pair (INT8, per tensor) on the first MatMul weight, as quantizers put it."""
    import onnx

    graph = model.graph
    weights = {init.name for init in graph.initializer}
    matmul = next(n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights)
    weight = matmul.input[1]
    graph.initializer.extend([
        onnx.helper.make_tensor("qdq.scale", onnx.TensorProto.FLOAT, [], [0.01]),
        onnx.helper.make_tensor("qdq.zero_point", onnx.TensorProto.INT8, [], [0]),
    ])  # fmt: skip
    graph.node.insert(0, onnx.helper.make_node("DequantizeLinear", ["qdq.q", "qdq.scale", "qdq.zero_point"], ["qdq.w"]))
    graph.node.insert(0, onnx.helper.make_node("QuantizeLinear", [weight, "qdq.scale", "qdq.zero_point"], ["qdq.q"]))
    matmul.input[1] = "qdq.w"


@pytest.fixture(scope="module")
def qdq_copy(clip_export, tmp_path_factory):
    """A copy of the export with a weight Q/DQ pair: a Q/DQ graph ONNX Runtime runs, outside the store."""
    import json
    import shutil

    import onnx

    from sdtrt.core.artifact import describe_files
    from sdtrt.core.stage_request import digest

    folder = tmp_path_factory.mktemp("qdq") / "export"
    shutil.copytree(clip_export.path, folder)
    graph_path = folder / clip_export.primary.name
    model = onnx.load(str(graph_path), load_external_data=False)
    with_a_weight_qdq_pair(model)
    onnx.save_model(model, str(graph_path))
    manifest = clip_export.manifest | {"key": digest([clip_export.key, "with a Q/DQ pair"])}
    (folder / "manifest.json").write_text(json.dumps(manifest | {"files": describe_files(folder)}))
    return Artifact.open(folder)


def test_check_blocks_names_the_blocks_when_a_block_is_unknown(clip_export, tiny, store):
    """An unknown --block, or none for a graph without the block lists picked by default (a VAE's): one line naming
    the blocks, a module that only wraps a list looked into; an engine set, which holds no graph: one line too."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.stages import engine_set, export
    from sdtrt.stages.engine_set import EngineSetConfig

    stderr = one_line_usage_error(run_cli("check-blocks", "--engine", str(clip_export.path), "--block", "nope"))
    assert "--block nope: the graph has no module of that name" in stderr
    assert "its blocks: embeddings, encoder.layers.0…1, final_layer_norm (or a module inside one, such as " in stderr
    vae = export.run(ExportConfig(precision="fp32", exporter="dynamo", component="vae_decoder"), tiny, store)
    stderr = one_line_usage_error(run_cli("check-blocks", "--engine", str(vae.path)))
    assert "name blocks with --block (its blocks: post_quant_conv, decoder.conv_in, decoder.mid_block, " in stderr
    assert "decoder.up_blocks.0…3, decoder.conv_norm_out" in stderr
    members = {"text_encoder": clip_export, "vae_decoder": vae}
    engines = engine_set.run(EngineSetConfig(("text_encoder", "vae_decoder")), members, store, tiny)
    stderr = one_line_usage_error(run_cli("check-blocks", "--engine", str(engines.path)))
    assert "is a set artifact, which holds no graph: check-blocks checks an export" in stderr


def test_check_blocks_refuses_a_quantized_graph_saying_what_to_run(qdq_copy):
    check = ("check-blocks", "--engine", str(qdq_copy.path), "--model", "tiny", "--block", "encoder.layers.0")
    stderr = one_line_usage_error(run_cli(*check))
    assert "is a quantized (Q/DQ) graph" in stderr and "sdtrt validate" in stderr and "sdtrt debug" in stderr


def test_simplify_of_a_qdq_graph_says_the_method_it_ran_and_why_once(qdq_copy, tmp_path):
    result = run_cli("simplify", str(qdq_copy.path), "--engines", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Simplified with fold (a Q/DQ graph: constants folded with its Q/DQ nodes kept" in result.stderr
    assert result.stderr.count("Q/DQ graph") == 1 and "onnxsim fits" not in result.stderr, result.stderr
    details = Artifact.open(last_line(result.stdout)).manifest["details"]
    assert details["op_counts_after"]["QuantizeLinear"] == 1


def test_the_block_table_says_what_its_columns_are():
    """The check-blocks table: a result column in words (returned[1][0]), and a legend with the tolerances."""
    from rich.console import Console

    from sdtrt.cli.run import print_block_report
    from sdtrt.tools.block_parity import BlockParityReport

    stats = {"output": "add_7", "max_abs": 1e-6, "mean_abs": 1e-7, "cosine": 1.0, "finite": True}
    report = BlockParityReport("g.onnx", "tiny", "fp32", {"min_cosine": 0.9999, "max_abs": 1e-3, "min_psnr_db": 30})
    report.blocks.append({"block": "down_blocks.0", "outputs": [stats | {"result": "1.0"}], "failures": []})
    out = Console(record=True, soft_wrap=True)
    print_block_report(report, out)
    text = out.export_text()
    assert "returned[1][0]" in text and "result: which of the PyTorch block's results the row compares" in text
    assert "cosine: their cosine similarity" in text and "tolerances: cosine ≥ 0.9999, max abs ≤ 0.001" in text


def test_build_and_compile_share_the_tensorrt_options(tiny):
    """with_trt_options declares the TensorRT options once; each command gets them as one TrtOptions."""
    import inspect

    from sdtrt.cli import compile, stages
    from sdtrt.cli.build_options import TrtOptions
    from sdtrt.spec import denoiser_spec

    for command in (stages.build, compile.compile):
        names = list(inspect.signature(command).parameters)
        assert names[-10:] == ["static", "workspace_gb", "optimization_level", "timing_cache", "refittable", "tf32",
                               "weight_streaming", "strip_weights", "compute_capability", "engines"]  # fmt: skip
    profile = denoiser_spec(tiny).default_profile()
    config = TrtOptions(static=True, optimization_level=2, timing_cache=None).config(profile, "tensorrt")
    assert (config.profiles, config.static_shapes, config.optimization_level) == ((profile,), True, 2)


def test_graph_surgery_on_an_fp8_graph_prints_no_third_party_warnings(tmp_path):
    """onnx-graphsurgeon warns that FP8 tensors have no NumPy type (and then that `colored` is missing) while keeping
    them as they are: a quantized compile printed both. In a fresh process, since it warns once per process."""
    import subprocess
    import sys

    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    fp8 = helper.make_tensor("zero_point", TensorProto.FLOAT8E4M3FN, [1], [0.0])
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [1], np.ones(1, np.float32))
    node = helper.make_node("QuantizeLinear", ["x", "scale", "zero_point"], ["y"])
    graph = helper.make_graph(
        [node], "fp8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [4])], [scale, fp8],
    )  # fmt: skip
    path = tmp_path / "fp8.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))

    def imported_with(call: str) -> str:
        code = f"import onnx, onnx_graphsurgeon as gs, sdtrt.graph.onnx_graph as g; {call}(onnx.load({str(path)!r}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return done.stdout + done.stderr

    assert "Could not convert: FLOAT8E4M3FN" in imported_with("gs.import_onnx")  # what it prints unmuted
    assert imported_with("g.import_for_surgery") == ""
