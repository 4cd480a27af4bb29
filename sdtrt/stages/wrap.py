"""Wrap stage: embed a TensorRT engine in a TorchScript module (``{component}.ts``) with torch-tensorrt.

``torch.jit.load("unet.ts")`` (after ``import torch_tensorrt``) gives a module called with one tensor
per engine input — ``module(sample, timestep, encoder_hidden_states)`` — that returns the output
tensor, or a tuple in the manifest's output order for engines with several outputs (a text encoder's
three: pytorch/TensorRT core/compiler.cpp, ``AddEngineToGraph``; the Python docstring's ``Tensor[]``
is misleading). The stand-ins (EngineUNet, EngineTextEncoder, EngineVAE) adapt that call to the
module's. The module runs optimization profile 0 only: Torch-TensorRT's TRTEngine selects no other
through 2.13 (no ``setOptimizationProfileAsync`` in ``core/runtime`` on ``release/2.13`` or
``release/ngc/25.01``; selection came in 2.14), so engines with several profiles are not wrapped.

For engines exported with ``--io-naming indexed`` (input_0…, output_0) the equivalent command is
``torchtrtc unet.plan unet.ts --embed-engine --device-type=gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import WrapConfig
from ..core.errors import ArtifactError
from ..core.gpu import check_engine_environment, gpu_environment, require_torch_tensorrt, tensorrt_version
from ..core.progress import step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..graph.onnx_graph import artifact_spec

STAGE = "wrap"
VERSION = 2  # 2: the module is named after its component


def run(config: WrapConfig, engine: Artifact, store: Store) -> Artifact:
    if engine.stage != "build-trt":
        raise ArtifactError(f"wrap takes a TensorRT engine (build-trt artifact), not a '{engine.stage}' artifact")
    if (profiles := len(engine.manifest.get("profiles", []))) > 1:
        raise ArtifactError(
            f"{engine.path} has {profiles} optimization profiles, and a TorchScript-wrapped engine runs profile 0 "
            "only (Torch-TensorRT selects no other); load the build-trt artifact directly, or build one profile"
        )
    if not engine.manifest.get("weights", {}).get("in_plan", True):
        raise ArtifactError(
            f"{engine.path} holds no weights (built with --strip-weights), and a TorchScript-wrapped engine is never "
            "refilled from its graph; load the build-trt artifact directly, or build without --strip-weights"
        )
    require_torch_tensorrt("wrap a TensorRT engine as TorchScript")
    # A plan from another GPU or TensorRT would fail inside torch-tensorrt ("Unable to deserialize"): say why.
    check_engine_environment(engine.manifest)
    env = environment("torch-tensorrt", "torch") | {"tensorrt": tensorrt_version()} | gpu_environment()
    request = StageRequest(STAGE, VERSION, config, [engine.as_input()], env)
    artifact, _ = store.produce(request, lambda out_dir: _wrap(engine, out_dir))
    return artifact


def _wrap(engine: Artifact, out_dir: Path) -> dict[str, Any]:
    import torch
    import torch_tensorrt

    spec = artifact_spec(engine)
    name = f"{spec.component}.ts"
    with step("Embedding the engine in a TorchScript module"):
        module = torch_tensorrt.ts.embed_engine_in_new_module(
            engine.primary.read_bytes(),
            input_binding_names=list(spec.input_names),
            output_binding_names=list(spec.output_names),
            # The default is Device._current_device(), evaluated once at import (ts/_compiler.py): name it.
            device=torch_tensorrt.Device(gpu_id=torch.cuda.current_device()),
        )
        torch.jit.save(module, str(out_dir / name))
    return {
        "primary": name,
        "io": spec.to_json(),
        "profile": engine.manifest.get("profile"),
        "target": "tensorrt",
        "details": {"call": f"module({', '.join(spec.input_names)}) -> {', '.join(spec.output_names)}"},
        "reproduce": f"sdtrt wrap {engine.path}",
    }
