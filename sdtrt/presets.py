"""Offline presets: whole pipelines of every supported family, built from configs with random weights.

Each is built once with a fixed seed and saved under the models cache, so later stages see an
ordinary diffusers folder. ``tiny*`` presets follow their family's shape rules (channel counts,
head dims, conditioning sizes) at test size; ``*-random`` ones have the real architectures.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_SEED = 0

PRESET_VERSION = 2


def ensure_preset(name: str, cache_dir: Path) -> Path:
    """The preset's folder, built on first use; an interrupted build leaves nothing behind."""
    dest = cache_dir / f"{name}-v{PRESET_VERSION}"
    if (dest / "model_index.json").is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        from .progress import quiet_loading

        with quiet_loading():
            build(PRESETS[name]).save_pretrained(tmp, safe_serialization=True)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first; theirs is identical
            if not (dest / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _byte_level_tokenizer(folder: Path, max_length: int = 77) -> Any:
    """A CLIP tokenizer over a byte-level vocabulary: every text tokenizes, nothing is downloaded.

    transformers 5.x builds a 3-token vocabulary from CLIPTokenizer(vocab_file=…), so the files are
    written to a folder and loaded with from_pretrained.
    """
    from transformers import CLIPTokenizer

    byte_chars = _bytes_to_unicode()
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("an", "d</w>"), ("i", "n"), ("o", "n</w>")]
    tokens += ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=max_length)


def _bytes_to_unicode() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (the GPT-2/CLIP table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


# Stable Diffusion's noise schedule, shared by every family here.
SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
TINY_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(16, 16, 32, 32),
    norm_num_groups=16, sample_size=256, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)  # fmt: skip  # four blocks: the VAE scale factor is 8, as in real SD
SD_VAE = dict(
    block_out_channels=(128, 256, 512, 512), latent_channels=4, layers_per_block=2, sample_size=512,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)  # fmt: skip
TINY_UNET = dict(
    sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    norm_num_groups=16, cross_attention_dim=32, attention_head_dim=8,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
)  # fmt: skip
TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# SDXL at test size: two 32-wide text encoders (cross-attention 64), 8-dim time-id sinusoids.
TINY_SDXL_UNET = dict(
    sample_size=32, layers_per_block=1, block_out_channels=(32, 64), norm_num_groups=16,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=8, cross_attention_dim=64,
    projection_class_embeddings_input_dim=32 + 6 * 8,
)  # fmt: skip
TINY_SDXL_CLIP = dict(TINY_CLIP, projection_dim=32, hidden_act="gelu")
SDXL_EULER = ("EulerDiscreteScheduler", dict(steps_offset=1, timestep_spacing="leading"))


@dataclass(frozen=True)
class Recipe:
    """A pipeline to build: its class, each network's config kwargs and the scheduler."""

    pipeline: str
    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any] | None  # CLIPTextModel; None: the pipeline has none (SDXL refiner)
    text_encoder_2: dict[str, Any] | None = None  # CLIPTextModelWithProjection (SDXL)
    scheduler: tuple[str, dict[str, Any]] = ("PNDMScheduler", {})
    settings: dict[str, Any] = field(default_factory=dict)  # pipeline __init__ settings
    half: bool = False  # build in fp16 (multi-GB architectures: half the memory and disk)
    controlnet: dict[str, Any] | None = None  # ControlNetModel.from_unet kwargs; None: no ControlNet


def build(recipe: Recipe) -> Any:
    import diffusers
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .families import accepted

    torch.manual_seed(PRESET_SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if recipe.half else torch.float32)
    try:
        parts: dict[str, Any] = {
            "unet": diffusers.UNet2DConditionModel(**recipe.unet),
            "vae": diffusers.AutoencoderKL(**recipe.vae),
        }
        with tempfile.TemporaryDirectory() as tok_dir:
            tokenizer = _byte_level_tokenizer(Path(tok_dir))
        for name, kwargs, cls in (("", recipe.text_encoder, CLIPTextModel),
                                  ("_2", recipe.text_encoder_2, CLIPTextModelWithProjection)):  # fmt: skip
            if kwargs is None:
                parts |= {f"text_encoder{name}": None, f"tokenizer{name}": None}
                continue
            text = dict(kwargs)
            config = CLIPTextConfig(
                vocab_size=max(len(tokenizer), text.pop("vocab_size", 0)), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=77,
                **text,
            )  # fmt: skip
            parts |= {f"text_encoder{name}": cls(config), f"tokenizer{name}": tokenizer}
        if recipe.controlnet is not None:
            parts["controlnet"] = _random_controlnet(parts["unet"], recipe.controlnet)
    finally:
        torch.set_default_dtype(previous)
    scheduler_class, scheduler_kwargs = recipe.scheduler
    scheduler = getattr(diffusers, scheduler_class)(**(SD_BETAS | scheduler_kwargs))
    # Other schedulers built from this config (DDIM from PNDM's) read clip_sample: SD's is False.
    scheduler.register_to_config(clip_sample=False)
    pipeline_class = getattr(diffusers, recipe.pipeline)
    optional = {"safety_checker": None, "feature_extractor": None, "image_encoder": None,
                "requires_safety_checker": False}  # fmt: skip
    return pipeline_class(**accepted(pipeline_class, optional | parts | {"scheduler": scheduler} | recipe.settings))


# fmt: off
def _random_controlnet(unet: Any, kwargs: dict[str, Any]) -> Any:
    """A ControlNet copied from the UNet, its zero-initialised output convolutions made random.

    A fresh ControlNet adds exactly zero (its "zero convolutions"), so engines that dropped its
    residuals would still match; random ones make every residual count.
    """
    import torch
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet, **kwargs)
    zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                  controlnet.controlnet_cond_embedding.conv_out]  # fmt: skip
    with torch.no_grad():
        for conv in zero_convs:
            conv.weight.normal_(std=0.05)
    return controlnet


def _clip(hidden: int, layers: int, heads: int, projection: int, act: str = "quick_gelu") -> dict[str, Any]:
    """A full-size CLIP text tower: 49,408 tokens, a 4× MLP."""
    return dict(vocab_size=49408, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, projection_dim=projection, hidden_act=act)  # fmt: skip


CLIP_L = _clip(768, 12, 12, 768)  # SD 1.x, SDXL's first
OPENCLIP_H = _clip(1024, 23, 16, 512, "gelu")  # SD 2.x
OPENCLIP_BIGG = _clip(1280, 32, 20, 1280, "gelu")  # SDXL's second


SD1_PNDM = ("PNDMScheduler", dict(skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False))
SD2_DDIM_V = (
    "DDIMScheduler",
    dict(clip_sample=False, steps_offset=1, set_alpha_to_one=False, prediction_type="v_prediction"),
)
PRESETS: dict[str, Recipe] = {
    "tiny": Recipe("StableDiffusionPipeline", TINY_UNET, TINY_VAE, TINY_CLIP, scheduler=SD1_PNDM),
    "tiny-sd2": Recipe(
        "StableDiffusionPipeline",
        dict(TINY_UNET, attention_head_dim=(2, 4), use_linear_projection=True, upcast_attention=True),
        TINY_VAE,
        dict(TINY_CLIP, hidden_act="gelu"),
        scheduler=SD2_DDIM_V,
    ),
    "tiny-inpaint": Recipe(
        "StableDiffusionInpaintPipeline", dict(TINY_UNET, in_channels=9), TINY_VAE, TINY_CLIP, scheduler=SD1_PNDM
    ),
    "tiny-lcm": Recipe(
        "LatentConsistencyModelPipeline",
        dict(TINY_UNET, time_cond_proj_dim=32),
        TINY_VAE,
        TINY_CLIP,
        scheduler=("LCMScheduler", {}),
    ),
    "tiny-sdxl": Recipe(
        "StableDiffusionXLPipeline", TINY_SDXL_UNET, TINY_VAE, TINY_CLIP, TINY_SDXL_CLIP, scheduler=SDXL_EULER
    ),
    "tiny-sdxl-refiner": Recipe(
        "StableDiffusionXLImg2ImgPipeline",
        dict(TINY_SDXL_UNET, cross_attention_dim=32, projection_class_embeddings_input_dim=32 + 5 * 8),
        TINY_VAE,
        None,
        TINY_SDXL_CLIP,
        scheduler=SDXL_EULER,
        settings={"requires_aesthetics_score": True},
    ),
    "tiny-controlnet": Recipe(
        "StableDiffusionControlNetPipeline", TINY_UNET, TINY_VAE, TINY_CLIP, scheduler=SD1_PNDM,
        controlnet=dict(conditioning_embedding_out_channels=(8, 8, 16, 16)),
    ),
    "tiny-sdxl-controlnet": Recipe(
        "StableDiffusionXLControlNetPipeline", TINY_SDXL_UNET, TINY_VAE, TINY_CLIP, TINY_SDXL_CLIP,
        scheduler=SDXL_EULER, controlnet=dict(conditioning_embedding_out_channels=(8, 8, 16, 16)),
    ),
    # Stable Diffusion 1.5's architecture (UNet 859.5 M parameters).
    "sd15-random": Recipe(
        "StableDiffusionPipeline",
        dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
        SD_VAE,
        CLIP_L,
        scheduler=SD1_PNDM,
    ),
    # Stable Diffusion 2.1 (768, v-prediction): OpenCLIP-H text encoder, linear projections, upcast attention.
    "sd21-random": Recipe(
        "StableDiffusionPipeline",
        dict(
            sample_size=96,
            cross_attention_dim=1024,
            attention_head_dim=(5, 10, 20, 20),
            use_linear_projection=True,
            upcast_attention=True,
        ),
        SD_VAE,
        OPENCLIP_H,
        scheduler=SD2_DDIM_V,
    ),
    # SDXL base 1.0 (UNet 2.6 B parameters): CLIP-L + OpenCLIP-bigG, built in fp16.
    "sdxl-random": Recipe(
        "StableDiffusionXLPipeline",
        dict(
            sample_size=128,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(5, 10, 20),
            transformer_layers_per_block=(1, 2, 10),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        ),
        dict(SD_VAE, sample_size=1024, scaling_factor=0.13025),
        CLIP_L,
        OPENCLIP_BIGG,
        scheduler=SDXL_EULER,
        half=True,
    ),
}
# fmt: on
