"""No third-party error reaches the user on an engine pipeline (issue 37): every public method a stand-in inherits
from diffusers' mixins (ModelMixin, CacheMixin, PeftAdapterMixin, AttentionMixin, ConfigMixin, the loaders …) and
transformers' PeftAdapterMixin either works or raises sdtrt's one-line error, on tiny SD 1.x and Flux engine sets;
and so do the pipelines' own LoRA, IP-Adapter, FreeU and QKV-fusion methods.
"""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)
from peft import LoraConfig

from sdtrt.core.errors import EngineInputError, LoraError, SdtrtError
from sdtrt.pipeline.loading import load_pipeline, set_loras
from sdtrt.sources.models import resolve_model
from sdtrt.standins.base import EngineModule, pytorch_class

PRESETS = ("tiny", "tiny-flux")
LIBRARIES = ("diffusers",)
PEFT_MIXIN = "transformers.integrations.peft"  # the part of a text encoder's transformers surface walked here

# Methods not called, and why. Everything else public is called (with ARGS where it needs arguments).
SKIPPED = {
    "forward": "the pipelines call it: test_conformance.py and test_transformer_pipelines.py check it",
    "from_pretrained": "a classmethod that builds a PyTorch model: no stand-in takes part",
    "from_config": "a classmethod that builds a PyTorch model: no stand-in takes part",
    "from_single_file": "a classmethod that builds a PyTorch model: no stand-in takes part",
    "from_unet": "a classmethod that builds a PyTorch ControlNet from a UNet: no stand-in takes part",
    "load_config": "a classmethod that reads a config file: no stand-in takes part",
    "get_config_dict": "a classmethod that reads a config file: no stand-in takes part",
    "extract_init_dict": "a classmethod that splits a config dict: no stand-in takes part",
    "register_for_auto_class": "a classmethod that registers the class with AutoModel: no stand-in takes part",
    "push_to_hub": "needs the Hugging Face Hub (tests run offline); it uploads what save_pretrained writes",
    **dict.fromkeys(
        ("get_time_embed", "get_class_embed", "get_aug_embed", "process_encoder_hidden_states"),
        "a step of UNet2DConditionModel.forward, which the engine replaces; only that forward calls it",
    ),
}


def args_for(name: str, module: EngineModule, tmp: str) -> tuple[tuple, dict]:
    """Plausible arguments for the methods that need some."""
    latents = torch.zeros(1, getattr(module.config, "latent_channels", 4), 16, 16)
    image = torch.zeros(1, 3, 128, 128)
    tiles = (torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), 2)
    lora = {"x.lora_A.weight": torch.zeros(1, 1), "x.lora_B.weight": torch.zeros(1, 1)}
    table: dict[str, tuple[tuple, dict]] = {
        "to": ((torch.float32,), {}),
        "set_attn_processor": (({},), {}),
        "set_attention_slice": (("auto",), {}),
        "set_attention_backend": (("native",), {}),
        "set_use_memory_efficient_attention_xformers": ((False,), {}),
        "set_use_npu_flash_attention": ((False,), {}),
        "set_use_xla_flash_attention": ((False, None), {}),
        "enable_cache": ((FirstBlockCacheConfig(threshold=0.2),), {}),
        "cache_context": (("cond",), {}),
        "enable_freeu": ((), dict(s1=0.9, s2=0.2, b1=1.2, b2=1.4)),
        "enable_parallelism": ((), {"config": None}),
        "add_adapter": ((LoraConfig(r=4, target_modules=["to_q", "q_proj"]),), {}),
        "load_adapter": ((f"{tmp}/no-adapter",), {}),
        "load_lora_adapter": ((lora,), {}),
        "load_attn_procs": ((lora,), {}),
        "save_lora_adapter": ((f"{tmp}/lora",), {}),
        "save_attn_procs": ((f"{tmp}/procs",), {}),
        "set_adapter": (("default",), {}),
        "set_adapters": (("default",), {}),
        "delete_adapter": (("default",), {}),
        "delete_adapters": (("default",), {}),
        "enable_lora_hotswap": ((), {"target_rank": 4}),
        "enable_peft_hotswap": ((), {"target_rank": 4}),
        "save_pretrained": ((f"{tmp}/saved",), {}),
        "save_config": ((f"{tmp}/config",), {}),
        "to_json_file": ((f"{tmp}/config.json",), {}),
        "register_to_config": ((), {}),
        "decode": ((latents,), {}),
        "tiled_decode": ((latents,), {}),
        "encode": ((image,), {}),
        "tiled_encode": ((image,), {}),
        "blend_h": (tiles, {}),
        "blend_v": (tiles, {}),
    }
    return table.get(name, ((), {}))


def public_methods(module: EngineModule) -> list[str]:
    """The public names the stand-in's diffusers classes define (and, for text encoders, transformers' PEFT mixin)."""
    names: set[str] = set()
    for cls in type(module).__mro__:
        if cls.__module__.split(".")[0] in LIBRARIES or cls.__module__ == PEFT_MIXIN:
            names |= {n for n in vars(cls) if not n.startswith("_")}
    return sorted(names)


def outcome(module: EngineModule, name: str, tmp: str) -> str:
    """'works', 'refused' or 'skipped'; any other exception fails the test, naming the method."""
    if name in SKIPPED:
        return "skipped"
    try:
        attribute = getattr(module, name)  # properties run here
        if inspect.ismethod(attribute) or inspect.isfunction(attribute):
            args, kwargs = args_for(name, module, tmp)
            result = attribute(*args, **kwargs)
            if hasattr(result, "__enter__"):  # cache_context
                with result:
                    pass
    except SdtrtError as exc:
        assert "\n" not in str(exc), f"{type(module).__name__}.{name}: a refusal is one line: {exc}"
        return "refused"
    except Exception as exc:  # the point: name the method that let a third-party error out
        pytest.fail(f"{type(module).__name__}.{name} raised {type(exc).__name__}: {exc}")
    return "works"


@pytest.fixture(scope="module", params=PRESETS)
def engine_pipe(request, fp32_engine_sets):
    return load_pipeline(resolve_model(request.param), fp32_engine_sets(request.param))


def test_every_public_mixin_method_works_or_refuses_in_one_line(engine_pipe, tmp_path):
    counts: Counter[str] = Counter()
    refused: set[str] = set()
    for component, module in engine_pipe.components.items():
        if not isinstance(module, EngineModule):
            continue
        for name in public_methods(module):
            result = outcome(module, name, str(tmp_path / component))
            counts[result] += 1
            refused |= {name} if result == "refused" else set()
    print(dict(counts))  # -s shows the walk's counts
    assert counts["works"] > 70 and counts["refused"] > 50, counts
    assert counts["skipped"] < counts["works"] / 3, "the skip table stays short"
    assert {"load_lora_adapter", "set_adapters", "fuse_lora", "enable_gradient_checkpointing"} <= refused
    denoiser = "transformer" if hasattr(engine_pipe, "transformer") else "unet"
    assert denoiser in engine_pipe.get_list_adapters()  # its add_adapter works (test_peft_adapters.py)
    set_loras(engine_pipe, [])  # forget the walk's adapter
    denoiser = getattr(engine_pipe, "transformer", None) or engine_pipe.unet
    assert ("enable_cache" in refused) == hasattr(denoiser, "enable_cache")


@pytest.mark.parametrize(
    "config",
    [
        FirstBlockCacheConfig(threshold=0.2),
        PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2),
        FasterCacheConfig(spatial_attention_block_skip_range=2),
        TaylorSeerCacheConfig(),
        MagCacheConfig(mag_ratios=torch.ones(2), num_inference_steps=2),
    ],
    ids=lambda c: type(c).__name__,
)
def test_caching_on_an_engine_transformer_without_split_members_is_refused_and_reports_off(fp32_engine_sets, config):
    """A set compiled without --caches has no engines for the blocks to skip (tests/test_step_cache.py: with them)."""
    transformer = load_pipeline(resolve_model("tiny-flux"), fp32_engine_sets("tiny-flux")).transformer
    inside = type(config).__name__ in ("PyramidAttentionBroadcastConfig", "FasterCacheConfig")
    why = "attention layers inside the blocks" if inside else "recompile with `sdtrt compile --caches first-block`"
    with pytest.raises(EngineInputError, match=rf"enable_cache: .*{why}"):
        transformer.enable_cache(config)
    assert transformer.is_cache_enabled is False
    transformer.disable_cache()  # as diffusers with no cache on: a no-op (it logs a warning)


def test_qkv_fusion_keeps_diffusers_bookkeeping(engine_pipe):
    for module in engine_pipe.components.values():
        if isinstance(module, EngineModule) and hasattr(pytorch_class(module), "fuse_qkv_projections"):
            module.fuse_qkv_projections()
            assert module.original_attn_processors is not None
            pytorch_class(module).unfuse_qkv_projections(module)  # diffusers' own, as its pipelines call it
            module.unfuse_qkv_projections()


PIPELINE_CALLS = {
    "load_lora_weights": (("lora.safetensors",), {}),
    "fuse_lora": ((), {"lora_scale": 0.5}),
    "unfuse_lora": ((), {}),
    "set_adapters": (("default",), {}),
    "unload_lora_weights": ((), {}),
    "delete_adapters": (("default",), {}),
    "enable_lora": ((), {}),
    "disable_lora": ((), {}),
    "load_ip_adapter": (("h94/IP-Adapter",), {"subfolder": "models", "weight_name": "ip-adapter_sd15.bin"}),
    "set_ip_adapter_scale": ((0.6,), {}),
    "unload_ip_adapter": ((), {}),
    "enable_freeu": ((), dict(s1=0.9, s2=0.2, b1=1.2, b2=1.4)),
    "disable_freeu": ((), {}),
    "fuse_qkv_projections": ((), {}),
    "unfuse_qkv_projections": ((), {}),
    "get_active_adapters": ((), {}),
    "get_list_adapters": ((), {}),
    "enable_lora_hotswap": ((), {"target_rank": 4}),
}
# diffusers' LoRA API runs on engines (standins/adapters.py; test_lora_diffusers_api.py checks it): here, with no
# such adapter or file, these three refuse; fuse_lora, unfuse_lora, enable/disable_lora, enable_lora_hotswap (engines
# need no preparation) and the rest work.
EXPECTED = {"load_lora_weights": LoraError, "set_adapters": LoraError, "delete_adapters": LoraError,
            "load_ip_adapter": EngineInputError, "set_ip_adapter_scale": EngineInputError,
            "unload_ip_adapter": EngineInputError, "enable_freeu": EngineInputError}  # fmt: skip


def test_pipeline_mixin_methods_work_or_refuse_in_one_line(engine_pipe):
    called = 0
    for name, (args, kwargs) in PIPELINE_CALLS.items():
        if not hasattr(engine_pipe, name):
            continue
        called += 1
        if name in EXPECTED:
            with pytest.raises(EXPECTED[name]) as refusal:
                getattr(engine_pipe, name)(*args, **kwargs)
            message = str(refusal.value)
            assert "\n" not in message and name in message
            if name == "load_lora_weights":
                assert "lora.safetensors is no LoRA file on disk" in message
            elif EXPECTED[name] is LoraError:
                assert "'default' not in the list of present adapters; loaded: none" in message
            elif "ip_adapter" in name:
                assert "recompile with `sdtrt compile --ip-adapter PATH`" in message
            else:
                assert "sdtrt compile --freeu" in message
        else:
            getattr(engine_pipe, name)(*args, **kwargs)  # works (no-ops where the engine already does it)
    assert called >= 13


def test_a_pipeline_made_from_standins_refuses_as_load_pipeline_does(engine_pipe):
    """The refusals come with the stand-ins (the constructor, from_pipe), not only from load_pipeline."""
    again = type(engine_pipe)(**engine_pipe.components)
    with pytest.raises(LoraError, match=r"is no LoRA file on disk"):  # diffusers' LoRA API on engines
        again.load_lora_weights("lora.safetensors")
    with pytest.raises(EngineInputError, match=r"set_ip_adapter_scale .*sdtrt compile --ip-adapter PATH"):
        again.set_ip_adapter_scale(0.6)
    for module in again.components.values():  # PEFT's add_adapter works on them, DoRA is refused
        if isinstance(module, EngineModule) and hasattr(module, "add_adapter"):
            with pytest.raises(LoraError, match=r"add_adapter.*load_lora_weights"):
                module.add_adapter(LoraConfig(r=4, target_modules=["to_q", "q_proj"], use_dora=True))
