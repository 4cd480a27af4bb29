"""TensorRT: runs a serialized engine (``{component}.plan``) of any component on a non-default CUDA stream.

The stream is a ``torch.cuda.Stream``, which PyTorch draws round-robin from its per-device stream pool
(at::cuda::getStreamFromPool), so another runtime may get the same stream; nothing here relies on owning it.

IO buffers are torch tensors; each call sets input shapes and tensor addresses, binds one buffer per
output (a text encoder has three) and enqueues
``execute_async_v3`` without synchronising the host. The runtime's stream waits for the caller's
stream before it runs and the caller's stream waits for it afterwards (events, no host sync): on the
legacy default stream, which diffusers pipelines run on, TensorRT would add device-wide syncs
(``execute_async_v3`` in pyCoreDoc.h). A request runs on the first optimization profile that covers
its shapes. With ``cuda_graph=True`` the engine call is captured into one CUDA graph and replayed;
a new shape re-captures it, so a graph never replays against context state bound for another shape
(trtexec captures "for the current execution context"; Torch-TensorRT re-records on a shape change).
A re-capture costs a stream sync and two engine runs (one outside capture, as trtexec's
``sampleInference.cpp`` does, so TensorRT allocates lazily before capture): CUDA graphs pay off in
loops at one shape, such as a denoising loop, not for requests whose shapes keep changing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..core.config import WeightBudget
from ..core.errors import (
    ArtifactError,
    EngineInputError,
    EnvironmentMismatchError,
    LoraError,
    MissingDependencyError,
    RefitError,
)
from ..core.gpu import check_engine_environment, rebuild_command, require_tensorrt
from ..core.trt_products import TENSORRT_RTX, load, product, rtx_gpu_problem, rtx_runtime_missing
from ..spec import GraphSpec
from . import rtx
from .base import TORCH_DTYPES, CudaRuntime, check_feeds, typed_inputs
from .device_memory import SharedDeviceMemory
from .trt_engine_io import Shape, _engine_profile, engine_io_problem, out_of_profile, select_profile
from .trt_refill import refill_graph, refill_weights
from .trt_refit import BaseWeights, parsed_graph, refit_weights
from .trt_weight_streaming import set_weight_budget

if TYPE_CHECKING:
    import tensorrt as trt


# NvInferRuntime.h, IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment."
TENSOR_ALIGNMENT = 256


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when TensorRT may address it, else an aligned copy (views can start anywhere)."""
    return tensor if tensor.data_ptr() % TENSOR_ALIGNMENT == 0 else tensor.clone()


def require(ok: bool, what: str) -> None:
    """set_input_shape, set_tensor_address and execute_async_v3 report failure by returning False (pyCore.cpp)."""
    if not ok:
        raise EngineInputError(f"TensorRT refused to {what}; see the TensorRT messages above")


@dataclass
class CapturedGraph:
    """The one CUDA graph of an execution context, the input shapes it was captured for and its static buffers.

    They are dropped together before the context is re-bound, so a capture that fails (a request outside
    every profile) leaves nothing that a later request at the old shape could replay.
    """

    graph: Any = None  # a torch.cuda.CUDAGraph
    shapes: tuple[Shape, ...] | None = None
    static: dict[str, torch.Tensor] = field(default_factory=dict)

    def replayable(self, shapes: tuple[Shape, ...]) -> bool:
        return self.graph is not None and shapes == self.shapes

    def drop(self) -> None:
        self.graph, self.shapes, self.static = None, None, {}

    def capture(self, shapes: tuple[Shape, ...], capture: Callable[[], tuple[Any, dict[str, torch.Tensor]]]) -> None:
        """Re-capture for ``shapes`` unless the graph held is for them; ``capture`` gives (graph, static buffers)."""
        if self.replayable(shapes):
            return
        self.drop()  # its context state is about to be re-bound: never replay it again, even if capture fails
        self.graph, self.static = capture()
        self.shapes = shapes


class TensorRTRuntime(CudaRuntime):
    name = "tensorrt"

    def __init__(
        self,
        plan: Path,
        spec: GraphSpec,
        manifest: dict[str, Any],
        cuda_graph: bool = False,
        weight_budget: WeightBudget | None = None,
        device_memory: SharedDeviceMemory | None = None,
    ) -> None:
        """``weight_budget`` limits the GPU memory of an engine built with weight streaming; without one it keeps
        all its weights on the GPU. ``device_memory``: the activation buffer this engine shares with the other
        members of its pipeline (sdtrt.runtime.device_memory), a TensorRT or TensorRT-RTX plan alike; without one
        its context holds its own, as does a TensorRT-RTX plan opened with ``cuda_graph`` (its graphs are
        TensorRT-RTX's)."""
        which = product(manifest.get("target", "tensorrt"))  # a TensorRT-RTX plan loads through TensorRT-RTX
        if which is TENSORRT_RTX:  # its validity is read from the plan's header below
            if missing := rtx_runtime_missing():
                raise MissingDependencyError(f"cannot run a TensorRT-RTX plan here: {missing}")
            if problem := rtx_gpu_problem(manifest.get("details", {})):
                raise EnvironmentMismatchError(f"cannot run the TensorRT-RTX plan {plan} on this GPU: {problem}")
        else:
            require_tensorrt("run a TensorRT engine")
            check_engine_environment(manifest)
        refill_from = refill_graph(manifest, plan)  # checked before the plan is read: a stripped plan needs it
        # The product's module under the name the annotations use (they name TensorRT's classes for
        # tests/test_tensorrt_api.py; mypy takes this local for a variable there, hence the ignores).
        trt = self._trt = load(which)

        self.spec = spec
        # TensorRT-RTX captures CUDA graphs itself, through its runtime config: no torch capture around it.
        self.cuda_graph = cuda_graph and which is not TENSORRT_RTX
        self._rebuild = rebuild_command(manifest)
        self._parsed_graph = parsed_graph(manifest, plan)  # a refit's missing weights come from it
        # Stripped without --refittable (REFIT_IDENTICAL): refits may bring only the graph's own values.
        self._identical_refits_only = refill_from is not None and not manifest.get("config", {}).get("refittable")
        self._base: BaseWeights | None = None  # made on the first refit
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime: trt.Runtime = trt.Runtime(self._logger)  # type: ignore[name-defined]
        if which is TENSORRT_RTX:
            rtx.check_validity(trt, self._runtime, plan, self._rebuild)
        engine: trt.ICudaEngine = self._runtime.deserialize_cuda_engine(plan.read_bytes())  # type: ignore[name-defined]
        if engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {plan}; rebuild it with `{self._rebuild}`")
        self._engine: trt.ICudaEngine = engine  # type: ignore[name-defined]
        if problem := engine_io_problem(trt, engine, spec):
            raise ArtifactError(f"{plan} does not match its manifest: {problem}; rebuild it with `{self._rebuild}`")
        if refill_from is not None:
            refill_weights(trt, engine, self._logger, refill_from, plan)
        if weight_budget is not None:  # before the execution context: TensorRT fixes the split when making it
            set_weight_budget(engine, weight_budget, plan, self._rebuild)
        # The pipeline's shared activation buffer, for a context of either product, but not for a TensorRT-RTX
        # context that captures its own CUDA graphs: sdtrt cannot drop those if the buffer is replaced.
        self._shared = None if which is TENSORRT_RTX and cuda_graph else device_memory
        self._bound = 0  # the buffer generation bound
        # TensorRT-RTX compiles the plan for this GPU here, with the store's runtime cache (and its own CUDA graphs).
        self._jit: rtx.RuntimeCache | None = None
        if which is TENSORRT_RTX:
            shared = self._shared is not None
            self._jit = rtx.RuntimeCache(trt, engine, rtx.store_cache_file(plan), cuda_graph, user_managed=shared)
        if self._jit is not None:  # its allocation strategy is set on the runtime config
            strategy_or_config: Any = self._jit.config
        elif self._shared is not None:
            # USER_MANAGED: the context holds no activation memory until set_device_memory gives it some
            # (create_execution_context(strategy), pyCore.cpp 10.8:1319, 11.1:1422).
            strategy_or_config = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        else:
            strategy_or_config = trt.ExecutionContextAllocationStrategy.STATIC  # TensorRT's default: its own memory
        # create_execution_context returns None when it cannot allocate the activation memory.
        context: trt.IExecutionContext | None = engine.create_execution_context(  # type: ignore[name-defined]
            strategy_or_config
        )
        if context is None:
            raise ArtifactError(f"TensorRT could not create an execution context for {plan} (GPU memory?)")
        if self._jit is not None:  # most of the JIT ran in create_execution_context: kept even if close() never runs
            self._jit.save()
        if self._shared is not None:
            # Enough for every shape its profiles admit: device_memory_size_v2 is what STATIC allocates, "the maximum
            # size across all profiles" (ExecutionContextAllocationStrategy's docstring), and set_device_memory asks
            # for "at least" it; update_device_memory_size_for_shapes, the need of the shapes set, is never more
            # ("less memory than the profile maximum": TensorRT-RTX samples/memoryManagement), so it is not read.
            # Read after the budget, which adds streaming scratch memory, and after the context is made, where
            # TensorRT-RTX's JIT runs (the sample reads it there too); a read-only int64 property (pyCore.cpp
            # 10.8:1335, 11.1:1428; tensorrt_rtx 1.7's docstrings). The buffer is made on the pipeline's first run.
            self._shared.reserve(int(engine.device_memory_size_v2))
        self._context = context
        self._profiles = [_engine_profile(engine, spec.input_names, i) for i in range(engine.num_optimization_profiles)]
        self._active_profile = 0
        # The engine, its context and stream belong to the device current now; run() makes it current again.
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)  # never the legacy default stream
        self._graph = CapturedGraph()  # CUDA graph mode

    def _bind(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Select the profile, set shapes and addresses (each checked); returns the output buffers it bound."""
        shapes = {name: tuple(t.shape) for name, t in inputs.items()}
        index = select_profile(self._profiles, shapes)
        if index is None:
            raise EngineInputError(
                f"{out_of_profile(self._profiles, shapes)}; rebuild the engine with --batch/--height/--width "
                f"covering it, changed from `{self._rebuild}`"
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
        self._attach_shared_memory()
        if self.cuda_graph:
            outputs = self._replay(inputs)
        else:
            outputs = self._bind(inputs)
            for out in outputs.values():
                out.record_stream(self._stream)  # allocated on the caller's stream, written on ours
            self._execute()
        caller.wait_stream(self._stream)
        return outputs

    def _attach_shared_memory(self) -> None:
        """Point the context at the pipeline's shared buffer: once, and again if the buffer was replaced."""
        if self._shared is None:
            return
        buffer = self._shared.buffer()
        if self._bound == self._shared.generation:
            return
        buffer.record_stream(self._stream)  # not reused while work queued on our stream may still read it
        # set_device_memory(memory, size) is setDeviceMemoryV2 (pyCore.cpp 10.8:1195, 10.13:1324, 11.1:1301), in
        # TensorRT-RTX too: "256-byte aligned device memory" of "at least" device_memory_size_v2 bytes; it returns None
        # (tensorrt_rtx 1.7's docstring).
        self._context.set_device_memory(buffer.data_ptr(), buffer.numel())
        # A graph captured on the old buffer would replay against its address. Only sdtrt's own graphs can be dropped:
        # a TensorRT-RTX context that captures its own (WHOLE_GRAPH_CAPTURE) never takes the shared buffer.
        self._graph.drop()
        self._bound = self._shared.generation

    def _replay(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._graph.capture(tuple(tuple(t.shape) for t in inputs.values()), lambda: self._capture(inputs))
        static = self._graph.static
        with torch.cuda.stream(self._stream):
            for name, tensor in inputs.items():
                static[name].copy_(tensor)
            self._graph.graph.replay()
            # The graph writes into static buffers; hand out copies so the next call cannot change them.
            outputs = {name: static[name].clone() for name in self.spec.output_names}
        for out in outputs.values():
            out.record_stream(torch.cuda.current_stream())
        return outputs

    def _capture(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        """Bind static copies of ``inputs``, run once, then capture the engine call: (graph, static buffers).

        The run outside capture lets TensorRT allocate lazily first, as trtexec does before capturing
        (samples/common/sampleInference.cpp); torch.cuda.graph synchronises the device around capture.
        """
        with torch.cuda.stream(self._stream):
            static = {name: t.clone() for name, t in inputs.items()}
            outputs = self._bind(static)
            self._execute()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                self._execute()
        return graph, static | outputs

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
        trt = self._trt
        if self._identical_refits_only:
            # A REFIT_IDENTICAL engine is refittable ("Create a refittable engine under the assumption that the refit
            # weights will be identical"), but other values are undefined behaviour (NvInfer.h kREFIT_IDENTICAL).
            raise LoraError(
                f"this TensorRT engine was built with --strip-weights but without --refittable, so it takes back only "
                f"its graph's own weights; rebuild it with `{self._rebuild} --refittable` to take LoRAs"
            )
        if not self._engine.refittable:
            raise LoraError(
                f"this TensorRT engine was built without --refittable; rebuild it with "
                f"`{self._rebuild} --refittable` to take LoRAs"
            )
        refitter: trt.Refitter = trt.Refitter(self._engine, self._logger)  # type: ignore[name-defined]
        held = []  # TensorRT reads the host buffers until refit_cuda_engine returns

        def put(name: str, array: np.ndarray) -> None:
            held.append(np.ascontiguousarray(array))
            if not refitter.set_named_weights(name, refit_weights(trt, held[-1])):
                raise LoraError(f"TensorRT refused new weights for '{name}' (not refittable, or another size/dtype)")

        for name, array in weights.items():
            put(name, array)
        if missing := set(refitter.get_missing_weights()) - set(weights):
            self._base = self._base or BaseWeights(self._parsed_graph)
            for name, array in self._base(missing).items():
                put(name, array)
        self._stream.synchronize()
        try:
            if not refitter.refit_cuda_engine():
                raise RefitError(
                    "TensorRT could not refit the engine (refit_cuda_engine returned False); see its messages"
                )
        finally:  # "a subset of weights may have been refitted" even when it fails (pyCoreDoc.h refit_cuda_engine)
            self._graph.drop()

    def close(self) -> None:
        # Memory bound to the context must outlive the work queued on it (pyCoreDoc.h, execute_async_v3).
        with torch.cuda.device(self._device):
            self._stream.synchronize()
        if self._jit is not None:  # what TensorRT-RTX compiled for this GPU, for the next load
            self._jit.save()
        self._graph.drop()
        self._context = None
        self._engine = None
