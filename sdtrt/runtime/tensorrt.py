"""TensorRT: runs a serialized engine (``unet.plan``) on torch's current CUDA stream.

IO buffers are torch tensors; each call sets input shapes and tensor addresses and enqueues
``execute_async_v3`` without synchronising the host. A request runs on the first optimization
profile that covers its shapes. With ``cuda_graph=True``, each distinct shape is captured once
into a CUDA graph and replayed afterwards (for static-shape engines: it removes launch overhead).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ArtifactError, EngineInputError, EnvironmentMismatchError
from ..gpu import engine_mismatch, gpu_environment, require_tensorrt, tensorrt_version
from ..spec import UNetSpec
from . import CudaRuntime, check_feeds, typed_inputs

if TYPE_CHECKING:
    import tensorrt as trt

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]


def select_profile(profiles: list[ProfileShapes], shapes: dict[str, Shape]) -> int | None:
    """Index of the first profile whose min..max covers every input shape, or None."""
    for index, profile in enumerate(profiles):
        if all(
            all(lo <= s <= hi for s, lo, hi in zip(shapes[name], mins, maxs, strict=True))
            for name, (mins, _, maxs) in profile.items()
        ):
            return index
    return None


def _engine_profile(engine: trt.ICudaEngine, names: tuple[str, ...], index: int) -> ProfileShapes:
    """Per input (min, opt, max) shapes of one optimization profile, read back from the engine."""
    shapes: ProfileShapes = {}
    for name in names:
        lo, opt, hi = (tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, index))
        shapes[name] = (lo, opt, hi)
    return shapes


def describe_profiles(profiles: list[ProfileShapes], name: str) -> str:
    return "; ".join(f"profile {i}: {p[name][0]} .. {p[name][2]}" for i, p in enumerate(profiles))


def check_engine_environment(manifest: dict[str, Any], source: str) -> None:
    """Refuse an engine built with another TensorRT or for another GPU, saying how to rebuild."""
    here = {"tensorrt": tensorrt_version()} | gpu_environment()
    reason = engine_mismatch(manifest.get("environment", {}), here)
    if reason:
        raise EnvironmentMismatchError(
            f"{reason}; engines are not portable: rebuild it here with `sdtrt build {source} --target tensorrt`"
        )


class TensorRTRuntime(CudaRuntime):
    name = "tensorrt"

    def __init__(self, plan: Path, spec: UNetSpec, manifest: dict[str, Any], cuda_graph: bool = False) -> None:
        require_tensorrt("run a TensorRT engine")
        source = manifest.get("inputs", [{}])[0].get("path", "<simplify artifact>")
        check_engine_environment(manifest, source)
        import tensorrt as trt

        self.spec = spec
        self.cuda_graph = cuda_graph
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime: trt.Runtime = trt.Runtime(self._logger)
        engine: trt.ICudaEngine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {plan}; rebuild it with `sdtrt build {source}`")
        self._engine = engine
        self._context: trt.IExecutionContext = engine.create_execution_context()
        self._profiles = [_engine_profile(engine, spec.input_names, i) for i in range(engine.num_optimization_profiles)]
        self._active_profile = 0
        self._graphs: dict[tuple[Shape, ...], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def _bind(self, inputs: dict[str, torch.Tensor], stream: torch.cuda.Stream) -> torch.Tensor:
        """Select the profile, set shapes and addresses; returns the output buffer it bound."""
        shapes = {name: tuple(t.shape) for name, t in inputs.items()}
        index = select_profile(self._profiles, shapes)
        if index is None:
            sample = self.spec.input_names[0]
            raise EngineInputError(
                f"input '{sample}' has shape {shapes[sample]}, outside every optimization profile of this engine "
                f"({describe_profiles(self._profiles, sample)}); rebuild with --batch/--height/--width covering it"
            )
        if index != self._active_profile:
            self._context.set_optimization_profile_async(index, stream.cuda_stream)
            self._active_profile = index
        for name, tensor in inputs.items():
            self._context.set_input_shape(name, shapes[name])
            self._context.set_tensor_address(name, tensor.data_ptr())
        out_name = self.spec.output_name
        out = torch.empty(tuple(self._context.get_tensor_shape(out_name)), dtype=self.dtype, device=self.device)
        self._context.set_tensor_address(out_name, out.data_ptr())
        return out

    def _execute(self, stream: torch.cuda.Stream) -> None:
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise EngineInputError("TensorRT's execute_async_v3 failed; see the TensorRT messages above")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, None, feeds)  # names, dtypes, grid; profiles are checked in _bind
        inputs = typed_inputs(self.spec, feeds, self.device)
        stream = torch.cuda.current_stream()
        if not self.cuda_graph:
            out = self._bind(inputs, stream)
            self._execute(stream)
            return {self.spec.output_name: out}
        return {self.spec.output_name: self._replay(inputs)}

    def _replay(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        key = tuple(tuple(t.shape) for t in inputs.values())
        if key not in self._graphs:
            static = {name: t.clone() for name, t in inputs.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._bind(static, side)
                self._execute(side)  # one run outside capture: TensorRT allocates lazily
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    self._execute(side)
            torch.cuda.current_stream().wait_stream(side)
            self._graphs[key] = (graph, static | {self.spec.output_name: out})
        graph, buffers = self._graphs[key]
        for name, tensor in inputs.items():
            buffers[name].copy_(tensor)
        graph.replay()
        # The graph writes into one static buffer; hand out a copy so the next call cannot change it.
        return buffers[self.spec.output_name].clone()

    def close(self) -> None:
        self._graphs.clear()
        self._context = None
        self._engine = None
