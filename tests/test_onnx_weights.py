"""The streamed writer (graph/onnx_weights.py) on hand-made onnx_ir models: what it writes and what disk it frees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from sdtrt.graph.onnx_weights import save_streamed


def spilled_model(tmp_path: Path) -> tuple[object, Path, list[np.ndarray]]:
    """A graph summing four 1 MiB initializers that live in a scratch file (as the exporter's spilled folds do),
    and one small inline one."""
    import onnx_ir as ir

    scratch = tmp_path / "folded.bin"
    arrays = [np.random.default_rng(i).standard_normal((256, 1024), dtype=np.float32) for i in range(4)]
    with scratch.open("wb") as f:
        for array in arrays:
            f.write(array.tobytes())
    values = []
    for i, array in enumerate(arrays):
        tensor = ir.ExternalTensor(
            scratch.name, i * array.nbytes, array.nbytes, ir.DataType.FLOAT, shape=ir.Shape(array.shape),
            name=f"w{i}", base_dir=tmp_path,
        )  # fmt: skip
        values.append(ir.Value(name=f"w{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=tensor.shape))
        values[-1].const_value = tensor
    inline = ir.Value(name="b", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    inline.const_value = ir.tensor(np.ones(2, np.float32), name="b")
    summed = ir.node("Sum", values)
    graph = ir.Graph(
        values, summed.outputs, nodes=[summed], initializers=[*values, inline], opset_imports={"": 18}, name="sum"
    )
    return ir.Model(graph, ir_version=9), scratch, arrays


def written_initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_weights_copied_out_of_the_scratch_file_free_its_disk(tmp_path):
    """The exporter's folded constants wait in a scratch file; once the writer has copied one into ``.onnx.data`` its
    blocks there are released, so a 23 GB network never holds 47 GB of disk."""
    model, scratch, arrays = spilled_model(tmp_path)
    allocated_before = scratch.stat().st_blocks
    (tmp_path / "out").mkdir()

    save_streamed(model, tmp_path / "out" / "net.onnx", external=True, scratch=scratch)

    got = written_initializers(tmp_path / "out" / "net.onnx")
    assert all(np.array_equal(got[f"w{i}"], array) for i, array in enumerate(arrays)) and got["b"].tolist() == [1, 1]
    assert scratch.stat().st_size == 4 * arrays[0].nbytes  # offsets stay valid while the file lives
    assert scratch.stat().st_blocks < allocated_before / 8, "the copied tensors' blocks are still allocated"


def test_a_graph_saved_inline_takes_its_spilled_weights_along(tmp_path):
    """Under protobuf's limit the graph holds its weights: none may point into the scratch file, deleted after."""
    model, scratch, arrays = spilled_model(tmp_path)
    (tmp_path / "out").mkdir()

    save_streamed(model, tmp_path / "out" / "net.onnx", external=False, scratch=scratch)
    scratch.unlink()

    graph = onnx.load(str(tmp_path / "out" / "net.onnx"), load_external_data=False).graph
    assert not [t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    got = written_initializers(tmp_path / "out" / "net.onnx")
    assert all(np.array_equal(got[f"w{i}"], array) for i, array in enumerate(arrays))
    assert list((tmp_path / "out").iterdir()) == [tmp_path / "out" / "net.onnx"]


def test_two_graphs_saved_from_one_proto_each_get_their_data_file(tmp_path, monkeypatch):
    """Quantize level 4 saves the TensorRT graph, rewrites the proto, then saves the ONNX Runtime graph: the second
    must not point into the first one's data file (onnx.save_model moves the weights out of the proto it saves)."""
    from onnx import helper

    from sdtrt.graph import onnx_graph

    monkeypatch.setattr(onnx_graph, "EXTERNAL_DATA_THRESHOLD", 1000)
    weight = np.arange(4096, dtype=np.float32).reshape(64, 64)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    proto = helper.make_model(graph)
    onnx_graph.save_keeping_weights(proto, tmp_path / "unet.trt.onnx", weight.nbytes)
    onnx_graph.save(proto, tmp_path / "unet.onnx", weight.nbytes)

    files = ["unet.onnx", "unet.onnx.data", "unet.trt.onnx", "unet.trt.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    (tmp_path / "unet.trt.onnx.data").unlink()  # the second graph stands alone
    assert np.array_equal(written_initializers(tmp_path / "unet.onnx")["w"], weight)


def test_only_the_files_from_pretrained_reads_without_a_variant_are_streamed_and_counted(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from sdtrt.graph.onnx_weights import safetensors_index, weights_size

    sharded, single = tmp_path / "sharded", tmp_path / "single"
    for folder, name, variant in (
        (sharded, "model-00001-of-00001.safetensors", "model.fp16-00001-of-00001.safetensors"),
        (single, "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"),
    ):
        folder.mkdir()
        save_file({"w": torch.ones(4)}, folder / name)
        save_file({"w": torch.ones(4, dtype=torch.float16)}, folder / variant)  # sorts after: it won before
        save_file({"w": torch.ones(4).to(torch.float8_e4m3fn)}, folder / name.replace("model", "model.fp8"))
    for index in ("model.safetensors.index.json", "model.safetensors.index.fp16.json"):
        shard = "model-00001-of-00001.safetensors" if "fp16" not in index else "model.fp16-00001-of-00001.safetensors"
        (sharded / index).write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))

    for folder, name in (
        (sharded, "model-00001-of-00001.safetensors"),
        (single, "diffusion_pytorch_model.safetensors"),
    ):
        stored = safetensors_index(folder)  # the fp8 variant's dtype, which sdtrt cannot stream, is never read
        assert (stored["w"].file.name, stored["w"].dtype) == (name, "float32")
        assert weights_size(folder) == (folder / name).stat().st_size


def transposed_weights_model(read: list[str], dtype: str = "float16", perm: list[int] | None = None) -> object:
    """x @ Transpose(w) + x @ Transpose(v) @ Transpose(v)ᵀ…: ``w`` read by its Transpose alone (``perm``: its
    attribute, None for none: the reversed axes), ``v`` by two nodes (onnxscript keeps a large Transpose whose input
    another node reads); both lazy, as attach_weights gives them, in ``dtype``, each read recorded in ``read``."""
    import ml_dtypes
    import onnx_ir as ir

    numpy = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    arrays = {n: np.random.default_rng(i).standard_normal((96, 128)).astype(numpy) for i, n in enumerate("wv")}
    onnx_dtype = ir.DataType.FLOAT16 if dtype == "float16" else ir.DataType.BFLOAT16

    def lazy(name: str) -> ir.Value:
        def load() -> ir.TensorProtocol:
            read.append(name)
            return ir.tensor(arrays[name])

        tensor = ir.LazyTensor(load, dtype=onnx_dtype, shape=ir.Shape([96, 128]), name=name)
        return ir.Value(name=name, type=ir.TensorType(onnx_dtype), shape=tensor.shape, const_value=tensor)

    x = ir.Value(name="x", type=ir.TensorType(onnx_dtype), shape=ir.Shape([4, 128]))
    w, v = lazy("w"), lazy("v")
    wt = ir.node("Transpose", [w], attributes={} if perm is None else {"perm": perm})
    vt = ir.node("Transpose", [v])
    a, b = ir.node("MatMul", [x, wt.outputs[0]]), ir.node("MatMul", [x, vt.outputs[0]])
    c = ir.node("MatMul", [b.outputs[0], v])
    nodes = [wt, vt, a, b, c]
    graph = ir.Graph([x], [a.outputs[0], c.outputs[0]], nodes=nodes, initializers=[w, v], opset_imports={"": 18})
    return ir.Model(graph, ir_version=9)


@pytest.mark.parametrize(("dtype", "perm"), [("float16", [1, 0]), ("bfloat16", None)])
def test_a_streamed_weights_transpose_folds_unread_and_unspilled_into_onnxscripts_graph(dtype, perm, tmp_path):
    """Under folded_constants_on_disk the optimizer folds Transpose(w) as onnxscript does (the same graph, proto for
    proto, once the weights are read) without reading w, spilling nothing; w's transposed bytes are computed when
    the writer asks for them. v, which another node reads, is left as onnxscript leaves it."""
    import onnx_ir as ir
    import onnxscript.optimizer

    from sdtrt.graph.onnx_weights import folded_constants_on_disk

    read: list[str] = []
    ours, theirs = transposed_weights_model(read, dtype, perm), transposed_weights_model([], dtype, perm)
    with folded_constants_on_disk(tmp_path / "folded.bin"):
        onnxscript.optimizer.optimize_ir(ours)
    assert read == [] and (tmp_path / "folded.bin").stat().st_size == 0
    assert isinstance(ours.graph.initializers["val_0"].const_value, ir.LazyTensor)
    onnxscript.optimizer.optimize_ir(theirs)  # onnxscript's own fold: it reads w and holds its transpose
    assert ir.to_proto(ours) == ir.to_proto(theirs)
    assert sorted(ours.graph.initializers) == ["v", "val_0"], "w's Transpose folded, v's kept"
    from onnxscript.optimizer import _constant_folding

    assert _constant_folding.registry.lookup_evaluators("", "Transpose", 18) == [], "the evaluator outlived the export"


def test_a_transpose_whose_perm_is_no_permutation_is_left_as_onnxscript_leaves_it(tmp_path):
    """onnxscript cannot evaluate a Transpose whose perm does not permute its input's axes and keeps it: so does the
    fold when written (it would make an initializer of the wrong shape)."""
    import onnx_ir as ir
    import onnxscript.optimizer

    from sdtrt.graph.onnx_weights import folded_constants_on_disk

    ours, theirs = transposed_weights_model([], perm=[0, 0]), transposed_weights_model([], perm=[0, 0])
    with folded_constants_on_disk(tmp_path / "folded.bin"):
        onnxscript.optimizer.optimize_ir(ours)
    onnxscript.optimizer.optimize_ir(theirs)
    assert ir.to_proto(ours) == ir.to_proto(theirs)
    assert "w" in ours.graph.initializers, "the Transpose of w is kept"
