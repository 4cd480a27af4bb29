"""ONNX Runtime: runs fp16 and fp32 graphs of every component on the CPU here, with the CUDA provider where present."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.config import ShapeProfile
from ..core.errors import ArtifactError, one_line
from ..spec import GraphSpec
from .base import TORCH_DTYPES, check_feeds, typed_inputs

NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32, "int32": np.int32, "int64": np.int64}


def default_providers() -> list[str]:
    import onnxruntime as ort

    have = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in have]


def quiet_default_logger() -> None:
    """Errors only from ONNX Runtime's default logger too: its graph optimizers log there whatever a session's level
    ("UnsqueezeElimination cannot remove node …", in ANSI colours, per kept Unsqueeze of a streamed graph), and
    onnx-graphsurgeon's fold_constants opens sessions with default options."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)


def session_options(threads: int = 0, preoptimized: bool = False, lean: bool = False):  # -> ort.SessionOptions
    """ONNX Runtime's options for sdtrt's sessions. ``lean`` for sessions that run a big graph once to check it
    (simplify's check, check-blocks): basic graph optimizations only and no memory arena. ORT's extended and layout
    optimizations (ORT_ENABLE_ALL) copy an fp16 graph's weights into fp32 (NCHWc convolutions, prepacked MatMuls)
    at load: SD 1.5's fp16 UNet (1.6 GiB of weights) peaked at 5.8 GiB to load and run once, 3.1 GiB lean
    (measured: docs/guide/big-networks.md)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # A pipeline runs several sessions one after another (text encoders, the denoiser or a step cache's split
    # members, the VAE): threads left spinning after one session's run take the cores from the next. Measured on 2
    # cores with Flux's four split members chained: spinning made the chain take ~2× the whole transformer.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    quiet_default_logger()
    if preoptimized:  # the build stage already applied and saved the graph optimizations
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif lean:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.enable_cpu_mem_arena = False  # the arena keeps each run's largest buffers: 0.8 GiB more on SD 1.5
    return options


class OnnxRuntime:
    """An InferenceSession over one component's graph.

    On the CPU, inputs reach ONNX Runtime as numpy views of the torch tensors (no copy when dtype
    and layout already match) and outputs come back as torch views of ONNX Runtime's arrays. With
    the CUDA provider, device tensors are bound in place with IOBinding.
    """

    name = "onnxruntime"

    def __init__(
        self,
        path: Path,
        spec: GraphSpec,
        profile: ShapeProfile | None = None,
        providers: Sequence[str] | None = None,
        threads: int = 0,
        preoptimized: bool = False,
        lean: bool = False,
    ) -> None:
        import onnxruntime as ort

        self.spec = spec
        self.profile = profile
        self._path, self._threads, self._preoptimized, self._lean = path, threads, preoptimized, lean
        self._providers = list(providers or default_providers())
        self._overrides: dict[str, ort.OrtValue] = {}  # replaced initializers; ORT reads them in place
        self._session = self._open(self._overrides)

    def _open(self, overrides: dict[str, Any]) -> Any:  # -> ort.InferenceSession
        import onnxruntime as ort

        options = session_options(self._threads, self._preoptimized, self._lean)
        for name, value in overrides.items():
            options.add_initializer(name, value)
        try:
            return ort.InferenceSession(str(self._path), options, providers=self._providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/… types for unreadable graphs
            raise ArtifactError(
                f"ONNX Runtime cannot load {self._path}: {one_line(exc)}; rebuild the artifact that holds it"
            ) from exc

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Replace the named initializers (the others keep their values) in a new session, swapped in once it loads.

        ``SessionOptions.add_initializer`` overrides a graph initializer by name; ORT uses the OrtValue's
        buffer without copying, so the values are kept as long as the session. A failure leaves the old session.
        """
        import onnxruntime as ort

        values = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for name, a in weights.items()}
        overrides = self._overrides | values
        self._session = self._open(overrides)
        self._overrides = overrides

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self._providers[0] == "CUDAExecutionProvider" else "cpu")

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, self.profile, feeds)
        typed = typed_inputs(self.spec, feeds, self.device)
        if self.device.type == "cuda":
            return self._run_bound(typed)
        arrays = {name: t.numpy() for name, t in typed.items()}
        names = list(self.spec.output_names)
        return {name: torch.from_numpy(r) for name, r in zip(names, self._session.run(names, arrays), strict=True)}

    def _run_bound(self, typed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shapes = self.spec.output_shapes({name: tuple(t.shape) for name, t in typed.items()})
        device = next(iter(typed.values())).device
        outputs = {
            t.name: torch.empty(shapes[t.name], dtype=TORCH_DTYPES[t.dtype], device=device) for t in self.spec.outputs()
        }
        binding = self._session.io_binding()
        for t, bind in [(t, binding.bind_input) for t in self.spec.inputs()] + [
            (t, binding.bind_output) for t in self.spec.outputs()
        ]:
            tensor = outputs[t.name] if t.name in outputs else typed[t.name]
            bind(t.name, "cuda", tensor.device.index or 0, NUMPY_DTYPES[t.dtype], list(tensor.shape), tensor.data_ptr())
        torch.cuda.current_stream().synchronize()  # ORT runs on its own stream; inputs must be ready
        self._session.run_with_iobinding(binding)
        return outputs

    def close(self) -> None:
        self._session = None
