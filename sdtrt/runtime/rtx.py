"""What loading a TensorRT-RTX plan adds to TensorRT's runtime (sdtrt/runtime/tensorrt.py runs both).

A TensorRT-RTX plan finishes compiling ("just in time") for the GPU that loads it, when its execution context is
made. The JIT kernels go to a runtime cache kept in the store, one file per GPU and TensorRT-RTX version, so a second
load (and a second process) starts in seconds; the file is read and replaced whole under a lock (sdtrt.core.locks).
CUDA graphs are TensorRT-RTX's own, set on the runtime config, as is the USER_MANAGED strategy of a context that takes
a pipeline's shared activation buffer (sdtrt.runtime.device_memory). Every call here is TensorRT-RTX's API
(NVIDIA/TensorRT-RTX demo/utils/engine.py Engine.activate/deactivate and samples/apiUsage/python/api_usage.py
run_inference; tensorrt_rtx 1.7's docstrings); tests/test_rtx.py checks each name, and each call's arguments, against
the installed module.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from ..core.errors import ArtifactError, EnvironmentMismatchError
from ..core.gpu import gpu_environment
from ..core.locks import read_locked, replace_locked
from ..core.progress import console
from ..core.trt_products import TENSORRT_RTX, load

if TYPE_CHECKING:
    import tensorrt_rtx as rtx

CACHE_DIR = "runtime-cache"


# What to do about each EngineInvalidityDiagnostics flag (NVIDIA's TensorRT-RTX docs, "Engine Compatibility": an old
# CUDA driver or runtime wants CUDA updated, not a new plan; tensorrt_rtx 1.7's enum docstrings name each flag).
REMEDIES = {
    "VERSION_MISMATCH": (
        "rebuild it with this machine's TensorRT-RTX (`{rebuild}`), or install the version it was built with"
    ),
    "UNSUPPORTED_CC": "rebuild it with a --compute-capability list that holds this GPU's (`{rebuild}`)",
    "OLD_CUDA_DRIVER": "update the NVIDIA driver",
    "OLD_CUDA_RUNTIME": "update the CUDA runtime (the tensorrt-rtx wheel for this CUDA, or the CUDA toolkit)",
    "INSUFFICIENT_GPU_MEMORY": "free GPU memory, or load it on a GPU with more",
    "MALFORMED_ENGINE": "the file is damaged or not a plan: rebuild it (`{rebuild}`)",
    "CUDA_ERROR": "repair the CUDA driver or runtime installation (`nvidia-smi` should list the GPU)",
}


def check_validity(rtx: ModuleType, runtime: rtx.Runtime, plan: Path, rebuild: str) -> None:
    """Refuse a plan this GPU and TensorRT-RTX cannot run, and say so of one it runs below its best, from its header
    alone: Runtime.get_engine_validity returns (EngineValidity, a bitmask of EngineInvalidityDiagnostics) and reads
    engine_header_size bytes (TensorRT-RTX 1.1 release notes: "only checks the file header"; tensorrt_rtx 1.7's
    docstrings: SUBOPTIMAL "Engine is likely to be valid but may show reduced performance")."""
    with plan.open("rb") as file:
        header = file.read(runtime.engine_header_size)
    validity, diagnostics = runtime.get_engine_validity(header)
    # int() whether the binding gives the bitmask as an int or as a flag (pybind11 enums take no `&`).
    bits = int(diagnostics)
    reasons = [name for name, flag in rtx.EngineInvalidityDiagnostics.__members__.items() if bits & int(flag)]
    if validity == rtx.EngineValidity.INVALID:
        remedies = dict.fromkeys(REMEDIES[r].format(rebuild=rebuild) for r in reasons if r in REMEDIES)
        raise EnvironmentMismatchError(
            f"TensorRT-RTX cannot run {plan} here ({', '.join(reasons) or 'no reason given'}); "
            f"{'; '.join(remedies) or f'rebuild it here with `{rebuild}`'}"
        )
    if validity == rtx.EngineValidity.SUBOPTIMAL:
        console.print(
            f"[yellow]![/] {escape(str(plan))} runs on this GPU below its best performance "
            f"({escape(', '.join(reasons) or 'no reason given')}, says TensorRT-RTX); for full performance rebuild it "
            f"with a --compute-capability list that includes this GPU's, changed from `{escape(rebuild)}`"
        )


def cache_file(store_root: Path, gpu: str, compute_capability: str, version: str) -> Path:
    """The store's runtime cache for one GPU model and TensorRT-RTX version (a cache from another environment is
    rejected by IRuntimeCache.deserialize anyway: tensorrt_rtx 1.7's docstring)."""
    name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{gpu}-sm{compute_capability}-tensorrt-rtx-{version}").strip("-")
    return store_root / CACHE_DIR / f"{name}.cache"


def store_cache_file(plan: Path) -> Path:
    """The runtime cache of the store the plan is in (STORE/build-trt/KEY/unet.plan) for this GPU and TensorRT-RTX."""
    env = gpu_environment()
    return cache_file(plan.resolve().parents[2], env["gpu"], env["compute_capability"], load(TENSORRT_RTX).__version__)


# One IRuntimeCache per cache file in a process, shared by every plan that loads with it, as NVIDIA's demo shares one
# across a pipeline's engines (demo/utils/pipeline.py activate_engines: engine.runtime_cache = runtime_cache): each
# plan's own cache, saved over the one file, would keep only the last plan's kernels.
_CACHES: dict[Path, Any] = {}  # the tensorrt_rtx.IRuntimeCache of each file


class RuntimeCache:
    # ``rtx`` is the tensorrt_rtx module, under the name the annotations use (mypy takes it for a variable there).
    """A runtime config with the store's runtime cache for this GPU (and CUDA graphs when asked; activation memory the
    caller gives, with ``user_managed``), for create_execution_context; ``save`` writes what the JIT compiled, for every
    plan of this process, to the store."""

    def __init__(
        self, rtx: ModuleType, engine: rtx.ICudaEngine, path: Path, cuda_graph: bool, user_managed: bool = False
    ) -> None:
        config: rtx.IRuntimeConfig = engine.create_runtime_config()  # type: ignore[name-defined]
        if config is None:
            raise ArtifactError("TensorRT-RTX could not create a runtime config")
        if cuda_graph:  # TensorRT-RTX captures and replays the whole graph itself (demo/utils/engine.py activate)
            config.cuda_graph_strategy = rtx.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        if user_managed:
            # The context made from this config holds no activation memory: IExecutionContext.set_device_memory gives it
            # some (ExecutionContextAllocationStrategy.USER_MANAGED, "The user supplies custom allocation to the
            # execution context"; the setter returns None: tensorrt_rtx 1.7's docstrings), as NVIDIA's
            # demo/utils/engine.py Engine.activate does for a pipeline's shared memory and TensorRT-RTX's
            # samples/memoryManagement/python/memory_management.py for its USER_MANAGED strategy.
            config.set_execution_context_allocation_strategy(rtx.ExecutionContextAllocationStrategy.USER_MANAGED)
        cache = _CACHES.get(path)
        if cache is None:
            fresh: rtx.IRuntimeCache = config.create_runtime_cache()  # type: ignore[name-defined]
            if fresh is None:
                raise ArtifactError("TensorRT-RTX could not create a runtime cache")
            # deserialize returns False, leaving the cache empty, for a blob of another GPU, driver or version.
            if (data := read_locked(path)) and not fresh.deserialize(data):
                console.print(
                    f"[yellow]![/] the runtime cache {escape(str(path))} does not fit this GPU or TensorRT-RTX; "
                    "starting an empty one"
                )
            cache = _CACHES[path] = fresh
        if not config.set_runtime_cache(cache):
            raise ArtifactError("TensorRT-RTX refused the runtime cache")
        self.config, self.cache, self.path = config, cache, path

    def save(self) -> None:
        """Write the cache back; a failure is a warning, never a lost result."""
        try:
            data = self.cache.serialize()
            if data is not None:
                replace_locked(self.path, bytes(data))
        except OSError as exc:
            console.print(
                f"[yellow]![/] could not write the runtime cache {escape(str(self.path))} ({escape(str(exc))})"
            )
