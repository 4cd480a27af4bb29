"""The quantize stage's artifacts, one per member: the denoiser and the split members a step cache needs, whose graphs
one calibration wrote (quantize.py ``run_members``); what each manifest says, and the check that members made later
share the stored denoiser's calibration."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.artifact import Artifact
from ..core.config.components import FREEU_MEMBER
from ..core.errors import ArtifactError
from ..graph import onnx_graph
from ..sources.models import ModelSource
from ..spec import GraphSpec, denoiser_component
from .qdq import qdq_counts

if TYPE_CHECKING:
    import torch


def calibration_result(network: torch.nn.Module) -> str:
    """A digest of what calibration decided: every ModelOpt quantizer's buffers (amax; SmoothQuant's pre-quant scale,
    which also decides how it rescales the weights). Two calibrations with one digest give the same Q/DQ graphs."""
    digest = hashlib.sha256()
    for name, tensor in sorted(network.state_dict().items()):
        if "quantizer" in name:
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def same_calibration(denoiser: Artifact | None, written: dict[str, dict[str, Any]], member: str) -> None:
    """ArtifactError unless the stored ``denoiser`` was calibrated as the members just ``written`` were: a split
    member with other scales than its whole would make a step cache's chain compute another network."""
    stored = denoiser.manifest["details"].get("calibration_result") if denoiser is not None else None
    made = written[member]["shared"]["details"]["calibration_result"]
    if denoiser is not None and stored != made:
        why = "predates sdtrt's record of its calibration" if stored is None else "was calibrated to other scales"
        raise ArtifactError(
            f"the stored quantized {denoiser.component()} ({denoiser.path}) {why}, so the split members made now "
            f"would not share its Q/DQ scales; delete that folder and compile again (it is quantized anew)"
        )


def member_manifest(model: ModelSource, component: str, member: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Move one member's graphs (and their weight files) from the scratch folder into its artifact; its manifest."""
    folder: Path = member["folder"]
    graphs: dict[str, str] = member["graphs"]
    specs: dict[str, GraphSpec] = member["specs"]
    for name in set(graphs.values()):
        for path in (folder / name, onnx_graph.data_file(folder / name)):
            if path.exists():
                shutil.move(path, out_dir / path.name)
    shared = member["shared"]
    details = shared["details"] | {"qdq": {role: qdq_counts(out_dir / n) for role, n in graphs.items()}}
    reproduce = shared["reproduce"]
    if component != (denoiser := denoiser_component(model)):
        # The denoiser's layers are listed in its own manifest; a member says whose it is and how it is made.
        details = {k: v for k, v in details.items() if k not in ("quantized_layers", "kept_high_precision")}
        details["split_member_of"] = denoiser
        cache = "deepcache" if denoiser == "unet" else "first-block"
        made_by = "--freeu" if component == FREEU_MEMBER else f"--caches {cache}"
        reproduce = (
            f"sdtrt compile --model {model.name} --precision {shared['precision']['quantized']} --level "
            f"{details['level']:g} {made_by}"
        )
    return shared | {
        "primary": graphs["onnxruntime"],
        "io": specs["onnxruntime"].to_json(),
        "precision": shared["precision"]
        | {
            "graph": {role: spec.precision for role, spec in specs.items()},  # outside the Q/DQ pairs
            "why": {role: graph_precision_why(role, spec) for role, spec in specs.items()},
        },
        "graphs": graphs,
        "timings": dict(shared["timings"]),  # each artifact's own: the store adds its stage_s
        "details": details,
        "reproduce": reproduce,
    }


def graph_precision_why(role: str, spec: GraphSpec) -> str:
    if spec.precision == "fp32":
        return "fp32 outside the Q/DQ pairs: what ONNX Runtime's CPU provider runs well, with the same scales"
    if role == "onnxruntime":
        return "fp16 outside the Q/DQ pairs: ModelOpt exports FP8 attention only from a 16-bit module"
    fp32_ops = " (Resize, Sin and Cos computed in fp32, as for sdtrt's bf16 graphs)" if spec.precision == "bf16" else ""
    return (
        f"{spec.precision} outside the Q/DQ pairs{fp32_ops}, as NVIDIA exports this family's quantized denoiser: a "
        "strongly typed TensorRT build runs every op in the graph's type"
    )


def holds_qdq(quantized: Artifact) -> bool:
    """Whether a quantize artifact's graphs hold Q/DQ nodes: a split member of NVIDIA's kept layers alone (Flux's
    embedders, its output head) holds none, and computes in its graph's precision."""
    counts = quantized.manifest.get("details", {}).get("qdq")
    return counts is None or any(n for role in counts.values() for n in role.values())
