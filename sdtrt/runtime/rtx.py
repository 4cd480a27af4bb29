"""What loading a TensorRT-RTX plan adds to TensorRT's runtime (sdtrt/runtime/tensorrt.py runs both).

A TensorRT-RTX plan finishes compiling ("just in time") for the GPU that loads it, when its execution context is
made. The JIT kernels go to a runtime cache kept in the store, one file per GPU and TensorRT-RTX version, so a second
load (and a second process) starts in seconds; CUDA graphs are TensorRT-RTX's own, set on the runtime config. Every
call here is TensorRT-RTX's API (NVIDIA/TensorRT-RTX demo/utils/engine.py Engine.activate/deactivate and
samples/apiUsage/python/api_usage.py run_inference; tensorrt_rtx 1.7's docstrings); tests/test_rtx.py checks each
name against the installed module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core.errors import ArtifactError, EnvironmentMismatchError
from ..core.gpu import gpu_environment
from ..core.trt_products import TENSORRT_RTX, load

if TYPE_CHECKING:
    import tensorrt_rtx as rtx

CACHE_DIR = "runtime-cache"


def check_validity(rtx: ModuleType, runtime: rtx.Runtime, plan: Path, rebuild: str) -> None:
    """Refuse a plan this GPU and TensorRT-RTX cannot run, from its header alone: Runtime.get_engine_validity returns
    (EngineValidity, a bitmask of EngineInvalidityDiagnostics) and reads engine_header_size bytes (TensorRT-RTX 1.1
    release notes: "only checks the file header"; tensorrt_rtx 1.7's docstring)."""
    with plan.open("rb") as file:
        header = file.read(runtime.engine_header_size)
    validity, diagnostics = runtime.get_engine_validity(header)
    if validity == rtx.EngineValidity.INVALID:
        reasons = [
            name for name, flag in rtx.EngineInvalidityDiagnostics.__members__.items() if diagnostics & int(flag)
        ]
        raise EnvironmentMismatchError(
            f"TensorRT-RTX cannot run {plan} here ({', '.join(reasons) or 'no reason given'}); rebuild it with "
            f"`{rebuild}` (a --compute-capability list that holds this GPU's)"
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


def read_locked(path: Path) -> bytes:
    """The file's bytes, read under its lock (b"" when it is not there); a writer replaces it atomically."""
    import fcntl

    if not path.is_file():
        return b""
    try:
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            return path.read_bytes()
    except OSError:  # a read-only store: no lock file can be made, and no writer can replace the cache there
        return path.read_bytes()


def write_locked(path: Path, data: bytes) -> None:
    """Replace the file with ``data`` atomically, under its lock: two processes sharing a store never read half a
    cache (NVIDIA's demo saves its runtime cache under a lock file too)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


# One IRuntimeCache per cache file in a process, shared by every plan that loads with it, as NVIDIA's demo shares one
# across a pipeline's engines (demo/utils/pipeline.py activate_engines: engine.runtime_cache = runtime_cache): each
# plan's own cache, saved over the one file, would keep only the last plan's kernels.
_CACHES: dict[Path, Any] = {}  # the tensorrt_rtx.IRuntimeCache of each file


class RuntimeCache:
    # ``rtx`` is the tensorrt_rtx module, under the name the annotations use (mypy takes it for a variable there).
    """A runtime config with the store's runtime cache for this GPU (and CUDA graphs when asked), for
    create_execution_context; ``save`` writes what the JIT compiled, for every plan of this process, to the store."""

    def __init__(self, rtx: ModuleType, engine: rtx.ICudaEngine, path: Path, cuda_graph: bool) -> None:
        config: rtx.IRuntimeConfig = engine.create_runtime_config()  # type: ignore[name-defined]
        if config is None:
            raise ArtifactError("TensorRT-RTX could not create a runtime config")
        if cuda_graph:  # TensorRT-RTX captures and replays the whole graph itself (demo/utils/engine.py activate)
            config.cuda_graph_strategy = rtx.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        cache = _CACHES.get(path)
        if cache is None:
            fresh: rtx.IRuntimeCache = config.create_runtime_cache()  # type: ignore[name-defined]
            if fresh is None:
                raise ArtifactError("TensorRT-RTX could not create a runtime cache")
            # deserialize returns False, leaving the cache empty, for a blob of another GPU, driver or version.
            if (data := read_locked(path)) and not fresh.deserialize(data):
                print(f"[sdtrt] the runtime cache {path} does not fit this GPU or TensorRT-RTX; starting an empty one")
            cache = _CACHES[path] = fresh
        if not config.set_runtime_cache(cache):
            raise ArtifactError("TensorRT-RTX refused the runtime cache")
        self.config, self.cache, self.path = config, cache, path

    def save(self) -> None:
        """Write the cache back; a failure is a warning, never a lost result."""
        try:
            data = self.cache.serialize()
            if data is not None:
                write_locked(self.path, bytes(data))
        except OSError as exc:
            print(f"[sdtrt] could not write the runtime cache {self.path} ({exc})")
