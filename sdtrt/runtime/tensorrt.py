"""TensorRT: runs a serialized engine (``{component}.plan``) of any component on a CUDA stream it owns.

IO buffers are torch tensors; each call sets input shapes and tensor addresses, binds one buffer per
output (a text encoder has three) and enqueues
``execute_async_v3`` without synchronising the host. The runtime's stream waits for the caller's
stream before it runs and the caller's stream waits for it afterwards (events, no host sync): on the
legacy default stream, which diffusers pipelines run on, TensorRT would add device-wide syncs
(``execute_async_v3`` in pyCoreDoc.h). A request runs on the first optimization profile that covers
its shapes. With ``cuda_graph=True`` the engine call is captured into one CUDA graph and replayed;
a new shape re-captures it, so a graph never replays against context state bound for another shape
(trtexec captures "for the current execution context"; Torch-TensorRT re-records on a shape change).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ArtifactError, EngineInputError, EnvironmentMismatchError, LoraError
from ..gpu import engine_mismatch, gpu_environment, require_tensorrt, tensorrt_version
from ..spec import GraphSpec
from .base import TORCH_DTYPES, CudaRuntime, check_feeds, typed_inputs

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


def engine_io_problem(engine: trt.ICudaEngine, spec: GraphSpec) -> str | None:
    """Why this engine's IO differs from the spec its manifest records (names, direction, dtype), or None."""
    import numpy as np
    import tensorrt as trt

    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    expected = [(t, trt.TensorIOMode.INPUT) for t in spec.inputs()] + [
        (t, trt.TensorIOMode.OUTPUT) for t in spec.outputs()
    ]
    if names != {t.name for t, _ in expected}:
        return f"the engine's tensors are {sorted(names)}, its manifest says {[t.name for t, _ in expected]}"
    for tensor, mode in expected:
        if engine.get_tensor_mode(tensor.name) != mode:
            return f"'{tensor.name}' is not an {mode.name.lower()} of the engine"
        dtype = engine.get_tensor_dtype(tensor.name)
        try:  # trt.nptype maps a TensorRT DataType to numpy's; TypeError for bf16/fp8/int4/fp4 (tensorrt/__init__.py)
            same = np.dtype(trt.nptype(dtype)) == np.dtype(tensor.dtype)
        except TypeError:
            same = False
        if not same:
            return f"'{tensor.name}' is {dtype} in the engine, {tensor.dtype} in its manifest"
    return None


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


# NvInferRuntime.h, IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment."
TENSOR_ALIGNMENT = 256


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when TensorRT may address it, else an aligned copy (views can start anywhere)."""
    return tensor if tensor.data_ptr() % TENSOR_ALIGNMENT == 0 else tensor.clone()


def require(ok: bool, what: str) -> None:
    """set_input_shape, set_tensor_address and execute_async_v3 report failure by returning False (pyCore.cpp)."""
    if not ok:
        raise EngineInputError(f"TensorRT refused to {what}; see the TensorRT messages above")


class TensorRTRuntime(CudaRuntime):
    name = "tensorrt"

    def __init__(self, plan: Path, spec: GraphSpec, manifest: dict[str, Any], cuda_graph: bool = False) -> None:
        require_tensorrt("run a TensorRT engine")
        source = manifest.get("inputs", [{}])[0].get("path", "<simplify artifact>")
        check_engine_environment(manifest, source)
        import tensorrt as trt

        self.spec = spec
        self.cuda_graph = cuda_graph
        self._source = source  # the simplify artifact the plan was parsed from: its initializers name the weights
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime: trt.Runtime = trt.Runtime(self._logger)
        engine: trt.ICudaEngine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {plan}; rebuild it with `sdtrt build {source}`")
        self._engine: trt.ICudaEngine = engine
        if problem := engine_io_problem(engine, spec):
            raise ArtifactError(
                f"{plan} does not match its manifest: {problem}; rebuild it with `sdtrt build {source}`"
            )
        # create_execution_context returns None when it cannot allocate the activation memory.
        context: trt.IExecutionContext | None = engine.create_execution_context()
        if context is None:
            raise ArtifactError(f"TensorRT could not create an execution context for {plan} (GPU memory?)")
        self._context = context
        self._profiles = [_engine_profile(engine, spec.input_names, i) for i in range(engine.num_optimization_profiles)]
        self._active_profile = 0
        # The engine, its context and stream belong to the device current now; run() makes it current again.
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)  # never the legacy default stream
        # CUDA graph mode: the one captured graph, the shapes it was captured for and its static buffers.
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_shapes: tuple[Shape, ...] | None = None
        self._static: dict[str, torch.Tensor] = {}

    def _bind(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Select the profile, set shapes and addresses (each checked); returns the output buffers it bound."""
        shapes = {name: tuple(t.shape) for name, t in inputs.items()}
        index = select_profile(self._profiles, shapes)
        if index is None:
            sample = self.spec.input_names[0]
            raise EngineInputError(
                f"input '{sample}' has shape {shapes[sample]}, outside every optimization profile of this engine "
                f"({describe_profiles(self._profiles, sample)}); rebuild with --batch/--height/--width covering it"
            )
        if index != self._active_profile:
            # Its binding raises RuntimeError where the C++ call returns false (pyCore.cpp, PY_ASSERT_RUNTIME_ERROR).
            try:
                self._context.set_optimization_profile_async(index, self._stream.cuda_stream)
            except RuntimeError as exc:
                raise EngineInputError(f"TensorRT refused to switch to optimization profile {index} ({exc})") from exc
            self._active_profile = index
        for name, tensor in inputs.items():
            require(self._context.set_input_shape(name, shapes[name]), f"set input '{name}' to shape {shapes[name]}")
            require(self._context.set_tensor_address(name, tensor.data_ptr()), f"bind input '{name}'")
        outputs = {}
        for output in self.spec.outputs():
            # get_tensor_shape gives -1 for dimensions it cannot infer yet (pyCoreDoc.h).
            shape = tuple(self._context.get_tensor_shape(output.name))
            require(all(d >= 0 for d in shape), f"infer the shape of '{output.name}' (got {shape})")
            out = torch.empty(shape, dtype=TORCH_DTYPES[output.dtype], device=self.device)
            require(self._context.set_tensor_address(output.name, out.data_ptr()), f"bind output '{output.name}'")
            outputs[output.name] = out
        return outputs

    def _execute(self) -> None:
        require(self._context.execute_async_v3(self._stream.cuda_stream), "enqueue the engine (execute_async_v3)")

    @property
    def device(self) -> torch.device:
        return self._device

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.cuda.device(self._device):  # streams and output buffers on the engine's device
            return self._run(feeds)

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, None, feeds)  # names, dtypes, grid; profiles are checked in _bind
        inputs = {name: aligned(t) for name, t in typed_inputs(self.spec, feeds, self.device).items()}
        caller = torch.cuda.current_stream()  # on the engine's device: inputs were made or copied there on it
        self._stream.wait_stream(caller)
        for tensor in inputs.values():
            tensor.record_stream(self._stream)  # allocated on the caller's stream, read on ours
        if self.cuda_graph:
            outputs = self._replay(inputs)
        else:
            outputs = self._bind(inputs)
            for out in outputs.values():
                out.record_stream(self._stream)  # allocated on the caller's stream, written on ours
            self._execute()
        caller.wait_stream(self._stream)
        return outputs

    def _replay(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shapes = tuple(tuple(t.shape) for t in inputs.values())
        if shapes != self._graph_shapes:
            self._graph = None  # its context state is about to be re-bound: never replay it again
            with torch.cuda.stream(self._stream):
                static = {name: t.clone() for name, t in inputs.items()}
                outputs = self._bind(static)
                self._execute()  # one run outside capture: TensorRT allocates lazily
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self._stream):
                    self._execute()
            self._graph, self._graph_shapes, self._static = graph, shapes, static | outputs
        assert self._graph is not None
        with torch.cuda.stream(self._stream):
            for name, tensor in inputs.items():
                self._static[name].copy_(tensor)
            self._graph.replay()
            # The graph writes into static buffers; hand out copies so the next call cannot change them.
            outputs = {name: self._static[name].clone() for name in self.spec.output_names}
        for out in outputs.values():
            out.record_stream(torch.cuda.current_stream())
        return outputs

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Refit the named weights in place (an engine built with --refittable); the others keep their values.

        The calls as TensorRT 10/11 bind them (python/src/infer/pyCore.cpp "Refitter", pyCoreDoc.h
        RefitterDoc): set_named_weights returns False for a name that is not refittable, or a size or
        dtype unlike get_weights_prototype's; get_missing_weights names the weights TensorRT combined
        with one that was set, which must be supplied too — with their current (graph) values, as
        demo/Diffusion's Engine.refit does; refit_cuda_engine is undefined while work is enqueued (so
        the stream is drained first) and returns False when validation fails. Execution contexts stay
        valid after a refit; a captured CUDA graph is dropped and re-captured on the next call.
        """
        with torch.cuda.device(self._device):  # the Refitter works on the current device's engine
            self._refit(weights)

    def _refit(self, weights: dict[str, np.ndarray]) -> None:
        import tensorrt as trt

        from ..graph_weights import read_initializers
        from ..store import Artifact

        if not self._engine.refittable:
            raise LoraError(
                f"this TensorRT engine was built without --refittable; rebuild it with "
                f"`sdtrt build {self._source} --target tensorrt --refittable` to take LoRAs"
            )
        refitter: trt.Refitter = trt.Refitter(self._engine, self._logger)
        held = []  # TensorRT reads the host buffers until refit_cuda_engine returns

        def put(name: str, array: np.ndarray) -> None:
            held.append(np.ascontiguousarray(array))
            if not refitter.set_named_weights(name, trt.Weights(held[-1])):
                raise LoraError(f"TensorRT refused new weights for '{name}' (not refittable, or another size/dtype)")

        for name, array in weights.items():
            put(name, array)
        if missing := set(refitter.get_missing_weights()) - set(weights):
            for name, array in read_initializers(Artifact.open(self._source).primary, missing).items():
                put(name, array)
        self._stream.synchronize()
        if not refitter.refit_cuda_engine():
            raise LoraError("TensorRT could not refit the engine (refit_cuda_engine returned False); see its messages")
        self._graph, self._graph_shapes = None, None

    def close(self) -> None:
        # Memory bound to the context must outlive the work queued on it (pyCoreDoc.h, execute_async_v3).
        with torch.cuda.device(self._device):
            self._stream.synchronize()
        self._graph = None
        self._static = {}
        self._context = None
        self._engine = None
