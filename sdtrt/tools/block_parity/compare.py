"""One block compared: the cut on ONNX Runtime and the PyTorch block loaded alone on the same seeded arguments,
statistics per output, and the failures they make at the tolerances."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.errors import ArtifactError
from .torch_block import load_block, replace_leaves, tensor_leaves

if TYPE_CHECKING:
    from ..validate import Tolerances
    from .cut import Cut
    from .matching import Arguments
    from .stored import StoredTensor
    from .torch_block import BlockCall


def compare_block(
    cut: Cut, call: BlockCall, arguments: Arguments, network: Any, block: str, params: dict[str, StoredTensor],
    seed: int,
) -> dict[str, Any]:  # fmt: skip
    """The cut on ONNX Runtime and the PyTorch block on the same seeded arguments: statistics per output.

    Cut outputs that are no result of the block (values the exporter computed once and shares with later blocks)
    are listed, not compared."""
    import onnx
    import onnxruntime as ort
    import torch

    from ...runtime.compare import tensor_stats
    from ...runtime.onnxruntime import session_options

    np_dtype = onnx.helper.tensor_dtype_to_np_dtype
    matched = arguments.match([name for name, _, _ in cut.data_inputs])
    graph_dtype = {matched[name]: np_dtype(elem) for name, elem, _ in cut.data_inputs}
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for path, meta in tensor_leaves(call.arguments):
        if not meta.is_floating_point():  # ids at 0; a boolean mask lets every key in (none: NaN attention)
            values[path] = (torch.ones if meta.dtype == torch.bool else torch.zeros)(meta.shape, dtype=meta.dtype)
            continue
        # Rounded through the graph's dtype, so that both sides compute on the same numbers.
        drawn = torch.randn(tuple(meta.shape), generator=gen).numpy()
        values[path] = torch.from_numpy(drawn.astype(graph_dtype.get(path, np.float32)).astype(np.float32))
    feeds = {name: values[matched[name]].numpy().astype(np_dtype(elem)) for name, elem, _ in cut.data_inputs}
    feeds |= {name: np.zeros(shape, np_dtype(elem)) for name, elem, shape in cut.shape_inputs}
    names = [name for name, _, _ in cut.outputs]
    session = ort.InferenceSession(str(cut.path), session_options(lean=True), providers=["CPUExecutionProvider"])
    got = dict(zip(names, session.run(names, feeds), strict=True))
    del session
    module = load_block(network, block, params)
    with torch.no_grad():
        # Bound again, so that **kwargs reach the block as keywords (CLIP's layers attend causally by is_causal).
        bound = inspect.BoundArguments(inspect.signature(module.forward), replace_leaves(call.arguments, values))
        expected = dict(tensor_leaves(module(*bound.args, **bound.kwargs)))
    del module  # its weights go before the next block's come
    outputs, side = [], []
    for name in names:
        paths = arguments.results(name, call.output)
        if not paths:
            side.append(name)
            continue
        if any(not torch.equal(expected[p], expected[paths[0]]) for p in paths[1:]):
            raise ArtifactError(f"{block}: the cut's output {name} could be any of {len(paths)} different results "
                                "of the PyTorch block; it cannot be compared")  # fmt: skip
        stats = tensor_stats(torch.from_numpy(got[name]), expected[paths[0]])
        outputs.append({"output": name, "result": ".".join(map(str, paths[0])), "shape": list(got[name].shape)} | stats)
    return {
        "block": block, "nodes": cut.nodes, "weight_bytes": cut.weight_bytes,
        "inputs": {name: ".".join(map(str, path)) for name, path in matched.items()},
        "shape_inputs": [n for n, _, _ in cut.shape_inputs], "not_compared": side,
        "outputs": sorted(outputs, key=lambda out: out["result"]),  # returned[0] before returned[1]
    }  # fmt: skip


def block_failures(row: dict[str, Any], tol: Tolerances) -> list[str]:
    failures = []
    for out in row["outputs"]:
        if not out["finite"]:
            failures.append(f"output {out['output']} contains NaN or inf")
        elif out["cosine"] < tol.min_cosine:
            failures.append(f"output {out['output']}: cosine {out['cosine']:.6f} < {tol.min_cosine}")
        elif out["max_abs"] > tol.max_abs:
            failures.append(f"output {out['output']}: max abs error {out['max_abs']:.3g} > {tol.max_abs}")
    return failures
