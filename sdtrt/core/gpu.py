"""What this machine offers for TensorRT: a CUDA GPU, the tensorrt package, and their identity.

Engines are not portable: the TensorRT version and the GPU's compute capability recorded here go
into build keys and manifests, and ``engine_mismatch`` compares them before an engine is loaded.
"""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from typing import Any

from .errors import EnvironmentMismatchError, MissingDependencyError, one_line

CONTAINER_HINT = "build and run engines in the NVIDIA container: `make docker-build && make docker-engine MODEL=…`"


def _installed(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    # A folder of type stubs (tensorrt-stubs) imports as an empty namespace package: origin None.
    return spec is not None and spec.origin is not None


def tensorrt_missing() -> str | None:
    """What stops a TensorRT build or run on this machine, or None when nothing does."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if not _installed("tensorrt"):
        return "the tensorrt Python package is not installed"
    return None


def require_tensorrt(what: str = "build a TensorRT engine") -> None:
    missing = tensorrt_missing()
    if missing:
        raise MissingDependencyError(f"cannot {what} here: {missing}; {CONTAINER_HINT}")


def torch_tensorrt_missing() -> str | None:
    """What stops wrapping an engine as TorchScript (torch-tensorrt's frontend), or None when nothing does."""
    if missing := tensorrt_missing():
        return missing
    if not _installed("torch_tensorrt"):
        return "torch-tensorrt is not installed"
    try:
        # A build without libtorchtrt.so has no TorchScript frontend, which wrapping (torch_tensorrt.ts) needs
        # (pytorch/TensorRT py/torch_tensorrt/_features.py: ENABLED_FEATURES.torchscript_frontend = _TS_FE_AVAIL).
        from torch_tensorrt._features import ENABLED_FEATURES
    except Exception as exc:  # a torch-tensorrt built for another torch or TensorRT fails here
        return f"torch-tensorrt does not import ({one_line(exc)})"
    if not ENABLED_FEATURES.torchscript_frontend:
        return "torch-tensorrt is installed without its TorchScript frontend (libtorchtrt.so)"
    return None


def require_torch_tensorrt(what: str) -> None:
    if missing := torch_tensorrt_missing():
        raise MissingDependencyError(f"cannot {what} here: {missing}; {CONTAINER_HINT}")


def gpu_environment() -> dict[str, Any]:
    """The GPU an engine is built for (the current CUDA device)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}


# The oldest compute capability whose Tensor Cores run each 8-bit format: FP8 (E4M3) from Ada and Hopper (8.9),
# INT8 from Turing (7.5). NVIDIA's demo/Diffusion refuses FP8 below 8.9 the same way (demo_diffusion/dd_argparse.py).
QUANTIZED_MIN_CAPABILITY = {"int8": (7, 5), "fp8": (8, 9)}
QUANTIZED_FALLBACK = {"int8": "--precision fp16", "fp8": "--precision int8 (compute capability 7.5 or newer)"}


def capability_version(capability: str) -> tuple[int, int]:
    """ "8.6" → (8, 6), "12" → (12, 0): a compute capability as a tuple that compares as the GPUs' generations do."""
    major, _, minor = capability.partition(".")
    return int(major), int(minor or 0)


def quantization_problem(precision: str, capability: str, gpu: str = "this GPU") -> str | None:
    """Why a GPU of compute capability ``capability`` ("8.6") cannot run a ``precision`` ("int8", "fp8") engine,
    or None when it can."""
    need = QUANTIZED_MIN_CAPABILITY[precision]
    if capability_version(capability) >= need:
        return None
    return (
        f"{precision.upper()} engines need a GPU of compute capability {need[0]}.{need[1]} or newer, and {gpu} has "
        f"{capability}; use {QUANTIZED_FALLBACK[precision]}, or build on a newer GPU"
    )


def require_quantization_support(precision: str) -> None:
    """MissingDependencyError, before anything is built, when the current GPU lacks Tensor Cores for ``precision``."""
    env = gpu_environment()
    if problem := quantization_problem(precision, env["compute_capability"], env["gpu"]):
        raise MissingDependencyError(f"cannot build a {precision.upper()} TensorRT engine here: {problem}")


def tensorrt_version() -> str:
    """The TensorRT an engine is built and run with: the module's own version, the one source both sides
    share (pip's tensorrt-cu12/-cu13 install no `tensorrt` distribution; NGC images name theirs variously)."""
    import tensorrt as trt

    return str(trt.__version__)


def refit_problem(version: str) -> str | None:
    """Why a TensorRT of ``version`` must not build REFIT engines, or None: TensorRT 11.3's "Refitting an Engine"
    page (docs.nvidia.com/deeplearning/tensorrt/11.3.0/inference-library/refitting-engines.html, a known issue of
    its release notes) says BuilderFlag::kREFIT "may produce incorrect numerical output ... A GEMM bias can be
    dropped and treated as zero", with no refit at all; 11.4's page no longer says so. REFIT_IDENTICAL is unaffected."""
    if not re.match(r"11\.3(\.|$)", version):
        return None
    return (
        f"TensorRT {version} may drop GEMM biases from refittable engines (a known issue of TensorRT 11.3), so their "
        "output can be wrong; build with another TensorRT version, or without --refittable (and without LoRAs)"
    )


def require_refit_support() -> None:
    """MissingDependencyError, before anything is built, when this TensorRT builds refittable engines wrong."""
    if problem := refit_problem(tensorrt_version()):
        raise MissingDependencyError(f"cannot build a refittable TensorRT engine here: {problem}")


# What the NVIDIA container ships and pip must never replace (docker/Dockerfile pins them).
CONTAINER_PACKAGES = re.compile(r"^(torch|torch[-_]tensorrt|tensorrt([-_].*)?|nvidia[-_].*)$", re.IGNORECASE)


def pinned_requirements() -> list[str]:
    """``name==version`` for every installed distribution the container must keep, from importlib.metadata.

    ``pip freeze`` lists NGC's own builds as ``torch @ file:///…``, which an ``==`` filter misses.
    """
    found = {d.metadata["Name"]: d.version for d in metadata.distributions() if d.metadata["Name"]}
    return sorted(f"{name}=={version}" for name, version in found.items() if CONTAINER_PACKAGES.match(name))


def engine_mismatch(built: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why an engine built in environment ``built`` cannot run in ``here``, or None when it can."""
    problems = []
    if built.get("tensorrt") != here.get("tensorrt"):
        problems.append(f"TensorRT {built.get('tensorrt')} (this machine: {here.get('tensorrt')})")
    if built.get("compute_capability") != here.get("compute_capability"):
        problems.append(
            f"compute capability {built.get('compute_capability')} on {built.get('gpu')} "
            f"(this machine: {here.get('compute_capability')} on {here.get('gpu')})"
        )
    if not problems:
        return None
    return "this engine was built for " + " and ".join(problems)


def rebuild_command(manifest: dict[str, Any]) -> str:
    """The command that builds this engine again with its own settings (the manifest's ``reproduce``)."""
    source = manifest.get("inputs", [{}])[0].get("path", "<simplify artifact>")
    return str(manifest.get("reproduce") or f"sdtrt build {source} --target tensorrt")


def check_engine_environment(manifest: dict[str, Any]) -> None:
    """Refuse an engine built with another TensorRT or for another GPU, saying how to rebuild."""
    here = {"tensorrt": tensorrt_version()} | gpu_environment()
    reason = engine_mismatch(manifest.get("environment", {}), here)
    if reason:
        raise EnvironmentMismatchError(
            f"{reason}; engines are not portable: rebuild it here with `{rebuild_command(manifest)}`"
        )


if __name__ == "__main__":  # python -m sdtrt.core.gpu > constraints.txt (docker/Dockerfile)
    print("\n".join(pinned_requirements()))
