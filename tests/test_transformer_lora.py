"""LoRAs on SD3's and Flux's transformer engines (ONNX Runtime) without a rebuild (issue 20, item 7).

Checked at component level against diffusers' own ``load_lora_weights`` + ``fuse_lora`` on the PyTorch
transformer, on the same seeded inputs. The LoRA files are made here: random diffusers/PEFT ones
(``random_lora``, as `sdtrt lora random` makes them) and a kohya-named Flux file written as kohya's
trainer names its keys, beside the diffusers-format file with the same weights.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import LoraError
from sdtrt.lora.files import random_lora, read_lora
from sdtrt.lora.refit import EngineLoras, apply_loras, fuse_loras
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import component_spec
from sdtrt.stages import weight_map
from sdtrt.stages.engine_set import engine_members
from sdtrt.tools.compile import compile_model

from .helpers import run_cli

MODELS = ("tiny-flux", "tiny-sd3")
# Weights the map must place after export + simplify + ONNX Runtime's optimizer: attention (q/k/v packed or not,
# the context stream's add_*_proj) and feed-forward Linears of both kinds of block.
EXPECTED = {
    "tiny-flux": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj",
                  "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.0.proj",
                  "transformer_blocks.0.ff_context.net.2", "single_transformer_blocks.0.attn.to_k",
                  "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"],
    "tiny-sd3": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
                 "transformer_blocks.0.attn2.to_v", "transformer_blocks.0.attn.to_out.0",
                 "transformer_blocks.0.ff.net.2", "transformer_blocks.0.ff_context.net.0.proj"],
}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    return {name: resolve_model(name) for name in MODELS}


@pytest.fixture(scope="module")
def engines(models, store):
    """The transformer of each preset's fp32 engine set (the one the pipeline tests build: a cache hit)."""
    sets = {
        name: compile_model(model, store, "onnxruntime", ExportConfig(precision="fp32"))
        for name, model in models.items()
    }
    return {name: engine_members(result.final)["transformer"] for name, result in sets.items()}


@pytest.fixture(scope="module")
def targets(models, engines):
    """Each transformer engine's LoRAs, as load_pipeline sets them up for an engine stand-in."""
    return {
        name: EngineLoras(
            "transformer",
            open_runtime(engines[name], model),
            partial(weight_map.for_engine, engines[name], model, "transformer"),
            family=model.family(),
        )
        for name, model in models.items()
    }


@pytest.fixture(scope="module")
def loras(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformer-loras")
    made = {"folder": folder}
    for name, model in models.items():
        made[name, "a"] = str(random_lora(model, folder / f"{name}-a.safetensors", rank=4, alpha=8, seed=1))
        made[name, "b"] = str(random_lora(model, folder / f"{name}-b.safetensors", rank=2, alpha=1, seed=2))
    return made


@pytest.fixture(scope="module")
def feeds(models):
    """One seeded denoising step's inputs per model, fp32 as the engines take them."""
    out = {}
    for name, model in models.items():
        spec = component_spec(model, "transformer", "fp32")
        case = spec.validation_cases(spec.default_profile())[1]
        out[name] = spec.sample_inputs(
            case.batch, case.height, case.width, seed=1, timestep=500.0, tokens=case.tokens
        )  # fmt: skip
    return out


def engine_output(target: EngineLoras, feeds: dict[str, torch.Tensor]) -> np.ndarray:
    (out,) = target.runtime.run(feeds).values()
    return out.float().numpy()


def pytorch_output(model, loras, feeds: dict[str, torch.Tensor]) -> np.ndarray:
    """diffusers' own: the family's pipeline, load_lora_weights + fuse_lora per file, the fp32 transformer."""
    import diffusers

    pipe = getattr(diffusers, model.pipeline_class()).from_pretrained(model.path, local_files_only=True)
    fuse_loras(pipe, loras)
    spec = component_spec(model, "transformer", "fp32")
    inputs = {name: feeds[name] for name in spec.canonical_inputs}
    with torch.no_grad():
        return pipe.transformer(**inputs, return_dict=False)[0].numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("name", MODELS)
def test_weight_map_places_every_transformer_linear(name, models, targets):
    made = targets[name].weight_map()
    parameters = weight_map.lora_parameters(load_folder(models[name], "transformer"))
    assert made.unmapped == {} and set(made.mapped) == set(parameters)
    assert all(f"{module}.weight" in made.mapped for module in EXPECTED[name])


@pytest.mark.parametrize("name", MODELS)
def test_loras_match_diffusers_fused_transformer_and_switch_from_base(name, models, targets, loras, feeds):
    target, inputs = targets[name], feeds[name]
    apply_loras([target], [], lambda _: "")
    base = engine_output(target, inputs)
    for case in ([(loras[name, "a"], 0.8)], [(loras[name, "a"], 0.8), (loras[name, "b"], 0.5)]):
        apply_loras([target], case, lambda _: "")
        got, reference = engine_output(target, inputs), pytorch_output(models[name], case, inputs)
        error, effect = np.abs(got - reference).max(), np.abs(reference - base).max()
        assert cosine(got, reference) > 0.9999 and error < 0.05 * effect, (case, error, effect)
    apply_loras([target], [(loras[name, "a"], 0.8)], lambda _: "")
    with_a = engine_output(target, inputs)
    apply_loras([target], [(loras[name, "b"], 1.0)], lambda _: "")
    assert not np.array_equal(engine_output(target, inputs), with_a)
    apply_loras([target], [(loras[name, "a"], 0.8)], lambda _: "")
    assert np.array_equal(engine_output(target, inputs), with_a)  # A → B → A: A, bit for bit, not a blend
    apply_loras([target], [], lambda _: "")
    assert np.array_equal(engine_output(target, inputs), base) and target.active == []


# kohya's Flux names (sd-scripts networks/lora_flux.py, as diffusers' _convert_kohya_flux_lora_to_diffusers reads
# them) → the diffusers modules of one double-stream block; q/k/v are one fused Linear there.
KOHYA_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",), "txt_mlp_2": ("ff_context.net.2",),
}  # fmt: skip


def kohya_flux_pair(model, folder, rank: int = 4, scale: float = 2.0) -> tuple[str, str]:
    """One LoRA twice: kohya-named (a fused q/k/v module's down weights stacked, its up weights block-diagonal,
    as a rank-3r LoRA of the fused Linear; ``alpha`` = scale·rank) and in diffusers/PEFT names (alpha = rank,
    the scale in lora_B). Single-stream blocks get their linear2 (proj_out): diffusers converts a kohya
    linear1 only at Flux.1's full width."""
    from safetensors.torch import save_file

    transformer = load_folder(model, "transformer")
    shapes = {name: tuple(p.shape) for name, p in transformer.named_parameters()}
    generator = torch.Generator().manual_seed(11)
    kohya, peft = {}, {}
    blocks = [(f"lora_unet_double_blocks_{i}_{k}", [f"transformer_blocks.{i}.{m}" for m in modules])
              for i in range(transformer.config.num_layers) for k, modules in KOHYA_DOUBLE.items()]  # fmt: skip
    blocks += [(f"lora_unet_single_blocks_{i}_linear2", [f"single_transformer_blocks.{i}.proj_out"])
               for i in range(transformer.config.num_single_layers)]  # fmt: skip
    for key, modules in blocks:
        downs, ups = [], []
        for module in modules:
            out_dim, in_dim = shapes[f"{module}.weight"]
            downs.append(torch.randn(rank, in_dim, generator=generator) * 0.3)
            ups.append(torch.randn(out_dim, rank, generator=generator) * 0.3)
            peft[f"transformer.{module}.lora_A.weight"] = downs[-1]
            peft[f"transformer.{module}.lora_B.weight"] = ups[-1] * scale
        kohya[f"{key}.lora_down.weight"] = torch.cat(downs)
        kohya[f"{key}.lora_up.weight"] = torch.block_diag(*ups)
        kohya[f"{key}.alpha"] = torch.tensor(scale * rank * len(modules))
    save_file(kohya, str(folder / "flux-kohya.safetensors"))
    save_file(peft, str(folder / "flux-peft.safetensors"))
    return str(folder / "flux-kohya.safetensors"), str(folder / "flux-peft.safetensors")


def test_a_kohya_flux_lora_gives_the_weights_of_its_diffusers_twin(models, targets, loras, feeds):
    model, target = models["tiny-flux"], targets["tiny-flux"]
    kohya, peft = kohya_flux_pair(model, loras["folder"])
    read = read_lora(kohya, model.family())
    assert (
        read.format == "kohya"
        and read.family == "FLUX.1"
        and "transformer_blocks.0.attn.add_k_proj" in (read.parts["transformer"])
    )
    kohya_weights, _ = target.weights([(read, 0.7)])
    peft_weights, _ = target.weights([(read_lora(peft, model.family()), 0.7)])
    assert kohya_weights.keys() == peft_weights.keys() and len(kohya_weights) > 0
    assert all(np.array_equal(kohya_weights[k], peft_weights[k]) for k in kohya_weights)
    apply_loras([target], [(kohya, 0.7)], lambda _: "")
    got, reference = (
        engine_output(target, feeds["tiny-flux"]),
        pytorch_output(model, [(kohya, 0.7)], feeds["tiny-flux"]),
    )
    assert cosine(got, reference) > 0.9999  # diffusers' Flux loader converts the kohya names the same way
    apply_loras([target], [], lambda _: "")


def test_a_lora_of_another_family_is_refused_before_the_engine_changes(models, targets, loras, feeds, tmp_path):
    from safetensors.torch import save_file

    sd1 = random_lora(resolve_model("tiny"), tmp_path / "sd1.safetensors", seed=3)
    t5 = tmp_path / "t5.safetensors"
    t5_query = "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q"  # Flux's T5
    save_file({f"{t5_query}.lora_A.weight": torch.ones(4, 64), f"{t5_query}.lora_B.weight": torch.ones(64, 4)}, str(t5))
    cases = [
        ("tiny-sd3", loras["tiny-flux", "a"], r"is a FLUX.1 LoRA \('transformer.single_transformer_blocks.*this model "
                                              r"\(sd3\) takes SD3 LoRAs"),
        ("tiny-flux", str(sd1), r"is a UNet \(SD 1.x/2.x, SDXL\) LoRA .*this model \(flux\) takes FLUX.1 LoRAs"),
        ("tiny-flux", str(t5), r"'text_encoder_2.encoder.* is not a weight of the transformer, text_encoder networks "
                               r"sdtrt applies FLUX.1 LoRAs to \(T5 and LLM text encoders take none"),
    ]  # fmt: skip
    for name, path, message in cases:
        target = targets[name]
        apply_loras([target], [(loras[name, "a"], 0.8)], lambda _: "")
        with_a = engine_output(target, feeds[name])
        with pytest.raises(LoraError, match=message) as caught:
            apply_loras([target], [(path, 1.0)], lambda _: "")
        assert "\n" not in str(caught.value)
        assert np.array_equal(engine_output(target, feeds[name]), with_a) and target.active[0][1] == 0.8
        apply_loras([target], [], lambda _: "")


def test_random_transformer_loras_and_their_coverage(models, engines, loras, tmp_path):
    from sdtrt.lora.files import describe

    sd3 = describe(read_lora(random_lora(models["tiny-sd3"], tmp_path / "sd3.safetensors", text_encoders=True)))
    assert sd3["family"] == "SD3" and ", text_encoder (12 modules), text_encoder_2 (12 modules)" in sd3["networks"]
    out = tmp_path / "flux.safetensors"
    run_cli("lora", "random", "--model", "tiny-flux", "--out", str(out), "--rank", "4", "--text-encoders", check=True)
    inspected = run_cli("lora", "inspect", str(out), "--engine", str(engines["tiny-flux"].path))
    assert "family: FLUX.1" in inspected.stdout and "ranks: [4]" in inspected.stdout
    flux = describe(read_lora(out, "flux"))["networks"]  # CLIP-L changes, T5 (text_encoder_2) does not
    assert flux.startswith("transformer (") and flux.endswith("text_encoder (12 modules)")
    modules = int(flux.split("(")[1].split()[0])
    assert f"engine: covers {modules}/{modules + 12} modules" in inspected.stdout  # the text encoder has no engine
    assert inspected.returncode == 1 and "no text encoder engine given" in inspected.stderr


def test_a_lora_wider_than_the_engines_input_is_refused_in_one_line(models, targets, loras, feeds):
    """A FLUX.1 Control LoRA (x_embedder on 128 channels) on FLUX.1 dev (64): diffusers widens a PyTorch transformer
    for it; an engine's input is fixed at build, so it is refused before any change, on both paths."""
    control = random_lora(resolve_model("tiny-flux-control"), loras["folder"] / "control.safetensors", seed=5)
    target, message = targets["tiny-flux"], "'x_embedder' takes 128 input features and this transformer's takes 64"
    apply_loras([target], [(loras["tiny-flux", "a"], 0.8)], lambda _: "")
    with_a = engine_output(target, feeds["tiny-flux"])
    with pytest.raises(LoraError, match=message) as caught:
        apply_loras([target], [(control, 1.0)], lambda _: "")
    assert "\n" not in str(caught.value) and np.array_equal(engine_output(target, feeds["tiny-flux"]), with_a)
    with pytest.raises(LoraError, match=message):
        pytorch_output(models["tiny-flux"], [(control, 1.0)], feeds["tiny-flux"])
    apply_loras([target], [], lambda _: "")
