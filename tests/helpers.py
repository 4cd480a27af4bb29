"""Helpers for tests: drive the CLI as a user would, read graphs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sdtrt.pipeline.loading import GenerateRequest

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = False, forked: bool = True, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sdtrt`` as a user would, capturing its output: in a process forked from one that imported the
    CLI's libraries once (tests/forked_cli.py: a fresh interpreter where ``env`` changes what is read at import), or
    with ``forked=False`` as a subprocess of its own, for what only that shows (its imports, what it leaves at exit)."""
    full_env = os.environ | {"SDTRT_DEBUG": "0"} | (env or {})
    cwd, timeout = kwargs.pop("cwd", REPO), kwargs.pop("timeout", 600)
    if forked and not kwargs:
        from tests.forked_cli import run_forked

        result = run_forked(list(args), full_env, Path(cwd), timeout)
    else:
        result = subprocess.run(
            [sys.executable, "-m", "sdtrt", *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            **kwargs,
        )
    if check and result.returncode != 0:
        raise AssertionError(f"sdtrt {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def private_store(artifact, root: Path) -> Path:
    """A new store at ``root`` holding copies (not links: tests corrupt and lock them) of ``artifact`` and the ones
    it was made from: a test that needs a store of its own starts from cache hits instead of recompiling tiny."""
    for made in artifact.lineage():
        shutil.copytree(made.path, root / made.stage / made.path.name)
    return root


def plant_fp16_overflow(simplified, path: Path):
    """A bare copy of a simplified fp16 UNet at ``path`` whose middle conv's weights are 60000: past fp16's range.
    Returns the conv node planted."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(simplified.primary))
    weights = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.input[1] in weights]
    planted = convs[len(convs) // 2]
    tensor = weights[planted.input[1]]
    tensor.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(tensor), 60000.0), tensor.name))
    onnx.save(model, str(path))
    return planted


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def softmax_input_types(graph_path: Path) -> set[int]:
    """The ONNX element types Softmax nodes take in a graph (weights not loaded)."""
    import onnx

    graph = onnx.shape_inference.infer_shapes(onnx.load(str(graph_path), load_external_data=False)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input]}
    return {types[node.input[0]] for node in graph.node if node.op_type == "Softmax"}


CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"],
    "text_encoder": CLIP_TARGETS,
    "text_encoder_2": CLIP_TARGETS,
}


def peft_lora(model, folder, seed: int, rank: int, alpha: int, networks=("unet",)) -> str:
    """PEFT adapters with random weights on ``networks``, saved by diffusers (SDXL's saver knows all three)."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from sdtrt.sources.models import load_folder

    torch.manual_seed(seed)
    layers = {}
    for network in networks:
        module = load_folder(model, network)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS[network], init_lora_weights=False)
        module.add_adapter(config)
        layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
        layers[f"{network}_lora_adapter_metadata"] = config.to_dict()
    StableDiffusionXLPipeline.save_lora_weights(folder, **layers)
    return str(folder / "pytorch_lora_weights.safetensors")


def external_copy(artifact, folder: Path, edit=None):
    """A copy of an ONNX artifact in ``folder`` with every initializer in ``<component>.onnx.data``, as big exports are
    laid out; ``edit(model, data_file)`` may change the graph (loaded without its weights) and the data file first."""
    import json

    import onnx

    from sdtrt.core.artifact import Artifact, describe_files
    from sdtrt.core.stage_request import digest

    folder.mkdir(parents=True)
    path = folder / artifact.primary.name
    data_file = path.with_name(path.name + ".data")
    model = onnx.load(str(artifact.primary))
    onnx.save_model(model, str(path), save_as_external_data=True, location=data_file.name, size_threshold=0)
    if edit is not None:
        model = onnx.load(str(path), load_external_data=False)
        edit(model, data_file)
        onnx.save_model(model, str(path))
    manifest = artifact.manifest | {"key": digest([artifact.key, "external copy", str(folder)])}
    (folder / "manifest.json").write_text(json.dumps(manifest | {"files": describe_files(folder)}))
    return Artifact.open(folder)


class Family:
    """A preset compiled once to fp32 ONNX Runtime engines, its (PyTorch fp32, engine) pipelines per task, and the
    requests its tests make (``extra``: what each is asked with besides prompt, steps and seed)."""

    def __init__(self, name: str, store, extra: dict) -> None:
        from sdtrt.core.config import ExportConfig
        from sdtrt.sources.models import resolve_model
        from sdtrt.tools.compile import compile_model

        self.name, self.source = name, resolve_model(name)
        self.engine = compile_model(self.source, store, "onnxruntime", ExportConfig(precision="fp32")).final
        self.pipes: dict[str, tuple] = {}
        self.extra = extra

    def pipelines(self, task: str = "txt2img") -> tuple:
        """(PyTorch fp32, engine) pipelines for ``task``, made once."""
        from sdtrt.pipeline.loading import load_pipeline

        if task not in self.pipes:
            self.pipes[task] = (
                load_pipeline(self.source, task=task),
                load_pipeline(self.source, self.engine, task=task),
            )
        return self.pipes[task]

    def request(self, **kwargs) -> GenerateRequest:
        from sdtrt.pipeline.loading import GenerateRequest

        return GenerateRequest(**({"prompt": "a red fox in the snow", "steps": 2, "seed": 3} | self.extra | kwargs))


def assert_images_match(family: Family, request: GenerateRequest, task: str = "txt2img") -> float:
    """The engine pipeline's image against the PyTorch fp32 one's for ``request``: same shape, not flat, >= 35 dB
    PSNR (returned)."""
    from sdtrt.pipeline.loading import generate
    from sdtrt.tools.image_quality import psnr_db

    reference, engine = family.pipelines(task)
    a, b = (generate(p, request, output_type="np").images[0] for p in (reference, engine))
    psnr = psnr_db(b, a)
    print(f"{family.name} {task} {request.height}x{request.width}: PSNR {psnr:.1f} dB")
    assert a.shape == b.shape == (request.height, request.width, 3) and a.std() > 0.01
    assert psnr >= 35.0
    return psnr


def centre_mask(height: int, width: int):
    """An inpainting mask (PIL, L) whose middle half is white: the part repainted."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((height, width), dtype=np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
    return Image.fromarray(pixels)


def assert_every_network_is_an_engine(pipe, reads_images: bool = False) -> dict[str, Any]:
    """Every torch network among ``pipe``'s components an engine stand-in, its VAE's decoder an engine, and, for a
    pipeline that reads an input image (``reads_images``: img2img, inpainting, edits), its VAE's encoder too (not the
    PyTorch half a set without one falls back to). Returns the networks by component name."""
    import torch

    from sdtrt.standins.base import EngineModule

    networks = {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert networks and all(isinstance(m, EngineModule) for m in networks.values()), networks
    assert pipe.vae.decoder_runtime is not None and (pipe.vae.encoder_runtime is not None or not reads_images)
    return networks


def stored_parameters(source) -> dict[str, Any]:
    """The transformer's parameters as its safetensors files store them."""
    from safetensors.numpy import load_file

    stored: dict[str, Any] = {}
    for file in sorted(source.component_dir("transformer").glob("*.safetensors")):
        stored |= load_file(file)
    return stored


def dropped_parameters(graph: Path, stored: dict[str, Any], dtype: str = "float32") -> set[str]:
    """Those of ``stored`` whose values, cast to the graph's ``dtype``, are in no initializer of ``graph``, as they
    are or transposed."""
    import numpy as np

    from sdtrt.graph.graph_weights import initializer_values
    from sdtrt.graph.onnx_weights import numpy_dtype

    held = set()
    for _, value in initializer_values(graph):
        held |= {(v.shape, np.ascontiguousarray(v).tobytes()) for v in (value, value.T)}
    cast = numpy_dtype(dtype)
    return {name for name, v in stored.items() if (v.shape, v.astype(cast).tobytes()) not in held}
