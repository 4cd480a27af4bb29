"""The streamed writer (sdtrt/onnx_weights.py) on hand-made onnx_ir models: what it writes and what disk it frees."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from sdtrt.onnx_weights import save_streamed


def test_weights_copied_out_of_the_scratch_file_free_its_disk(tmp_path):
    """The exporter's folded constants wait in a scratch file; once the writer has copied one into ``.onnx.data`` its
    blocks there are released, so a 23 GB network never holds 47 GB of disk."""
    import onnx_ir as ir

    scratch = tmp_path / "folded.bin"
    arrays = [np.random.default_rng(i).standard_normal((256, 1024), dtype=np.float32) for i in range(4)]  # 1 MiB each
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
    graph = ir.Graph(values, summed.outputs, nodes=[summed], initializers=[*values, inline], opset_imports={"": 18})
    allocated_before = scratch.stat().st_blocks
    (tmp_path / "out").mkdir()

    save_streamed(ir.Model(graph, ir_version=9), tmp_path / "out" / "net.onnx", external=True, scratch=scratch)

    written = onnx.load(str(tmp_path / "out" / "net.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    assert all(np.array_equal(got[f"w{i}"], array) for i, array in enumerate(arrays)) and got["b"].tolist() == [1, 1]
    assert scratch.stat().st_size == 4 * arrays[0].nbytes  # offsets stay valid while the file lives
    assert scratch.stat().st_blocks < allocated_before / 8, "the copied tensors' blocks are still allocated"
