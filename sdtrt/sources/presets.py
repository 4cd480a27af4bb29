"""Offline presets: whole pipelines of every supported family, built from configs with random weights.

Each is built once with a fixed seed and saved under the models cache (preset_build.py), so later stages see an
ordinary diffusers folder. ``tiny*`` presets follow their family's shape rules (channel counts,
head dims, conditioning sizes) at test size; ``*-random`` ones have the real architectures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


Network = tuple[str, dict[str, Any]]  # a network's class name and its config kwargs


@dataclass(frozen=True)
class Recipe:
    """A pipeline to build: its class, each network's class and config kwargs, and the scheduler.

    ``text_encoders`` fill text_encoder, text_encoder_2, … in order (None: the pipeline has none there,
    as SDXL's refiner has no first one); each gets the tokenizer its class reads.
    """

    pipeline: str
    denoiser: Network  # UNet2DConditionModel → unet/, a *Transformer2DModel → transformer/
    vae: dict[str, Any]
    text_encoders: tuple[Network | None, ...]
    scheduler: tuple[str, dict[str, Any]] = ("PNDMScheduler", {})
    settings: dict[str, Any] = field(default_factory=dict)  # pipeline __init__ settings
    dtype: str = "float32"  # the networks' torch dtype (multi-GB architectures: fp16, or bf16 as their checkpoints)
    streamed: bool = False  # networks written by streaming random tensors (random_weights.py), never built whole
    # ControlNetModel.from_unet kwargs, FluxControlNetModel.from_transformer's for a transformer; None: no ControlNet
    controlnet: dict[str, Any] | None = None
    # FLUX.2's: AutoencoderKLFlux2 (its latents' batch-norm statistics); Qwen-Image's: AutoencoderKLQwenImage
    vae_class: str = "AutoencoderKL"

    @property
    def denoiser_folder(self) -> str:
        return "unet" if self.denoiser[0] == "UNet2DConditionModel" else "transformer"


def unet(config: dict[str, Any] | None = None, **overrides: Any) -> Network:
    return ("UNet2DConditionModel", (config or {}) | overrides)


def clip(kwargs: dict[str, Any], projection: bool = False) -> Network:
    """A CLIP text tower; ``projection``: with the pooled projection SDXL and SD3 read (text_embeds)."""
    return ("CLIPTextModelWithProjection" if projection else "CLIPTextModel", kwargs)


def t5(config: dict[str, Any], **overrides: Any) -> Network:
    return ("T5EncoderModel", config | overrides)


# fmt: off
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
# The transformer generation: 16-channel VAEs without quant convs, the shift and scale their pipelines apply.
SD3_VAE = dict(latent_channels=16, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False,
               use_post_quant_conv=False)  # fmt: skip
FLUX_VAE = dict(SD3_VAE, shift_factor=0.1159, scaling_factor=0.3611)
SD3_FLOW = ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0))
FLUX_DEV_FLOW = ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                 max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096))  # fmt: skip
FLUX_SCHNELL_FLOW = ("FlowMatchEulerDiscreteScheduler", dict(shift=1.0))
# Qwen-Image's published scheduler: the dynamic shift up to 8192 tokens, exponential, ending at σ 0.02.
QWEN_IMAGE_FLOW = ("FlowMatchEulerDiscreteScheduler", dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                   max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                   time_shift_type="exponential"))  # fmt: skip
# T5 v1.1 (gated GELU) at test size; its width is the transformers' joint_attention_dim, at least CLIP-L + CLIP-G.
TINY_T5 = dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, relative_attention_num_buckets=8,
               feed_forward_proj="gated-gelu")  # fmt: skip
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu")  # fmt: skip
# SD3 at test size, with SD3.5's dual-attention layer and qk RMS-norm; pooled = CLIP-L + CLIP-G projections.
TINY_SD3 = ("SD3Transformer2DModel", dict(
    sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
    num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64,
    pos_embed_max_size=96, dual_attention_layers=(0,), qk_norm="rms_norm",
))
# Flux at test size: 16 latent channels packed 2×2 (64), rotary axes summing to the head size.
TINY_FLUX = ("FluxTransformer2DModel", dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
))
TINY_SD3_ENCODERS = (clip(TINY_SDXL_CLIP, projection=True), clip(TINY_SDXL_CLIP, projection=True), t5(TINY_T5))
TINY_FLUX_ENCODERS = (clip(TINY_CLIP), t5(TINY_T5))

# FLUX.2 [klein] at test size: a 28-layer Qwen3 (the pipeline stacks layers 9, 18 and 27: joint width 3 × 32), a
# Flux2 DiT on 2×2-patchified 4-channel latents (16), four rotary axes summing to the head size, no guidance
# embedding; a classifier-free-guided "base" (is_distilled False: two transformer passes a step).
TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=28, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)  # fmt: skip
TINY_FLUX2 = ("Flux2Transformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=96, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
))
# FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B; sizes as published, not re-read offline): 5 double- + 20
# single-stream blocks, 24 heads × 128, joint width 3 × 2560 from Qwen3-4B (36 layers, 32 query / 8 key-value heads
# of 128, vocabulary 151,936); AutoencoderKLFlux2 with 32 latent channels. Streamed in bf16 as the checkpoint.
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000})  # fmt: skip
FLUX2_KLEIN_4B = ("Flux2Transformer2DModel", dict(
    patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, axes_dims_rope=(32, 32, 32, 32), guidance_embeds=False,
))
# Z-Image at test size: a single-stream DiT (2×2 patches of 16 Flux-VAE channels; refiners for the image and the
# caption before the joint layers), three rotary axes summing to the head size; its Qwen3 (a bare Qwen3Model, as the
# published checkpoints name it) gives the penultimate layer's hidden states (4 layers: layer 3), their width the
# transformer's cap_feat_dim.
TINY_ZIMAGE = ("ZImageTransformer2DModel", dict(
    in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
    axes_dims=[4, 6, 6], axes_lens=[1024, 128, 128],
))
FLUX2_VAE = dict(latent_channels=32, block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=1024)

# Qwen-Image at test size: a 2-layer Qwen2.5-VL language model 32 wide (three rotary sections over the head's 4
# frequency pairs) with a one-block vision tower the text path never runs, a 2-block QwenImage MMDiT on 2×2-packed
# 4-channel latents, and the causal 3D VAE (scale factor 8 from its three temporal stages) with fixed, non-trivial
# latent statistics, which the pipeline applies itself.
TINY_QWEN25_VL = dict(
    text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                             "rope_theta": 1_000_000}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                       fullatt_block_indexes=[0]),
)  # fmt: skip
# FLUX.2 [dev] at test size: a Mistral3 language model 32 wide with 31 layers, one past the (10, 20, 30) Flux2Pipeline
# reads, so hidden_states[30] is a layer's raw output as in the real 40-layer model, not the final norm's (no sliding
# window, as Mistral-Small-3.x), a one-layer Pixtral vision tower the text path never runs, and klein's tiny
# transformer with dev's guidance embedding.
TINY_MISTRAL3 = dict(
    text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=31, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, sliding_window=None),
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                       image_size=64, patch_size=16),
)  # fmt: skip
TINY_QWEN_IMAGE = ("QwenImageTransformer2DModel", dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
))
TINY_QWEN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=[0.05, -0.09, 0.05, -0.02],
                     latents_std=[1.4, 1.33, 0.64, 0.79])  # fmt: skip  # lists: the class concatenates them

# Qwen-Image (Qwen/Qwen-Image; configs as published, not re-read offline): a 60-layer MMDiT of 24 heads × 128 on
# 2×2-packed 16-channel latents (64 in), text width 3584 (20.4 B parameters, 40.9 GB in bf16); Qwen2.5-VL-7B-Instruct
# (28 decoder layers 3584 wide, 28 query / 4 key-value heads, vocabulary 152,064, rotary sections 16/24/24; the
# 32-block vision tower, 1280 wide: 8.3 B in all); the causal 3D VAE at diffusers' defaults (its published config).
QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                     rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1_000_000}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
    tie_word_embeddings=False,
)  # fmt: skip
QWEN_IMAGE_20B = ("QwenImageTransformer2DModel", dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
))

PRESETS: dict[str, Recipe] = {
    "tiny": Recipe("StableDiffusionPipeline", unet(TINY_UNET), TINY_VAE, (clip(TINY_CLIP),), scheduler=SD1_PNDM),
    "tiny-sd2": Recipe(
        "StableDiffusionPipeline",
        unet(TINY_UNET, attention_head_dim=(2, 4), use_linear_projection=True, upcast_attention=True),
        TINY_VAE,
        (clip(dict(TINY_CLIP, hidden_act="gelu")),),
        scheduler=SD2_DDIM_V,
    ),
    "tiny-inpaint": Recipe(
        "StableDiffusionInpaintPipeline", unet(TINY_UNET, in_channels=9), TINY_VAE, (clip(TINY_CLIP),),
        scheduler=SD1_PNDM,
    ),
    "tiny-lcm": Recipe(
        "LatentConsistencyModelPipeline",
        unet(TINY_UNET, time_cond_proj_dim=32),
        TINY_VAE,
        (clip(TINY_CLIP),),
        scheduler=("LCMScheduler", {}),
    ),
    "tiny-sdxl": Recipe(
        "StableDiffusionXLPipeline", unet(TINY_SDXL_UNET), TINY_VAE,
        (clip(TINY_CLIP), clip(TINY_SDXL_CLIP, projection=True)), scheduler=SDXL_EULER,
    ),
    "tiny-sdxl-refiner": Recipe(
        "StableDiffusionXLImg2ImgPipeline",
        unet(TINY_SDXL_UNET, cross_attention_dim=32, projection_class_embeddings_input_dim=32 + 5 * 8),
        TINY_VAE,
        (None, clip(TINY_SDXL_CLIP, projection=True)),
        scheduler=SDXL_EULER,
        settings={"requires_aesthetics_score": True},
    ),
    "tiny-controlnet": Recipe(
        "StableDiffusionControlNetPipeline", unet(TINY_UNET), TINY_VAE, (clip(TINY_CLIP),), scheduler=SD1_PNDM,
        controlnet=dict(conditioning_embedding_out_channels=(8, 8, 16, 16)),
    ),
    "tiny-sdxl-controlnet": Recipe(
        "StableDiffusionXLControlNetPipeline", unet(TINY_SDXL_UNET), TINY_VAE,
        (clip(TINY_CLIP), clip(TINY_SDXL_CLIP, projection=True)),
        scheduler=SDXL_EULER, controlnet=dict(conditioning_embedding_out_channels=(8, 8, 16, 16)),
    ),
    # SD3 / SD3.5: CLIP-L + CLIP-G + T5, an MMDiT transformer, flow matching.
    "tiny-sd3": Recipe("StableDiffusion3Pipeline", TINY_SD3, dict(TINY_VAE, **SD3_VAE), TINY_SD3_ENCODERS,
                       scheduler=SD3_FLOW),
    # Flux.1 dev (guidance embedding) and schnell (none): CLIP-L (pooled) + T5, a DiT on packed latents.
    "tiny-flux": Recipe("FluxPipeline", TINY_FLUX, dict(TINY_VAE, **FLUX_VAE), TINY_FLUX_ENCODERS,
                        scheduler=FLUX_DEV_FLOW),
    "tiny-flux-schnell": Recipe(
        "FluxPipeline", (TINY_FLUX[0], dict(TINY_FLUX[1], guidance_embeds=False)), dict(TINY_VAE, **FLUX_VAE),
        TINY_FLUX_ENCODERS, scheduler=FLUX_SCHNELL_FLOW,
    ),
    # FLUX.1 Fill (masked-image latents + the 8×8 mask packed: 64 + 64 + 256 channels in), Canny / Depth control (the
    # control image's latents: 64 + 64), Kontext (a reference image's latents as more tokens; dev's transformer).
    "tiny-flux-fill": Recipe("FluxFillPipeline", (TINY_FLUX[0], dict(TINY_FLUX[1], in_channels=384, out_channels=64)),
                             dict(TINY_VAE, **FLUX_VAE), TINY_FLUX_ENCODERS, scheduler=FLUX_DEV_FLOW),
    "tiny-flux-control": Recipe(
        "FluxControlPipeline", (TINY_FLUX[0], dict(TINY_FLUX[1], in_channels=128, out_channels=64)),
        dict(TINY_VAE, **FLUX_VAE), TINY_FLUX_ENCODERS, scheduler=FLUX_DEV_FLOW,
    ),
    "tiny-flux-kontext": Recipe("FluxKontextPipeline", TINY_FLUX, dict(TINY_VAE, **FLUX_VAE), TINY_FLUX_ENCODERS,
                                scheduler=FLUX_DEV_FLOW),
    # A FLUX.1 ControlNet (InstantX's kind: the control image's packed latents in) of one double and one single block
    # beside tiny-flux: built last, so every other network is tiny-flux's, weights and exports alike.
    "tiny-flux-controlnet": Recipe(
        "FluxControlNetPipeline", TINY_FLUX, dict(TINY_VAE, **FLUX_VAE), TINY_FLUX_ENCODERS, scheduler=FLUX_DEV_FLOW,
        controlnet=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2),
    ),
    "tiny-flux2-klein": Recipe(
        "Flux2KleinPipeline", TINY_FLUX2, dict(TINY_VAE, latent_channels=4), (("Qwen3ForCausalLM", TINY_QWEN3),),
        scheduler=FLUX_DEV_FLOW, settings={"is_distilled": False}, vae_class="AutoencoderKLFlux2",
    ),
    "tiny-flux2": Recipe(
        "Flux2Pipeline", (TINY_FLUX2[0], dict(TINY_FLUX2[1], guidance_embeds=True)), dict(TINY_VAE, latent_channels=4),
        (("Mistral3ForConditionalGeneration", TINY_MISTRAL3),), scheduler=FLUX_DEV_FLOW, vae_class="AutoencoderKLFlux2",
    ),
    "tiny-zimage": Recipe(
        "ZImagePipeline", TINY_ZIMAGE, dict(TINY_VAE, **FLUX_VAE),
        (("Qwen3Model", dict(TINY_QWEN3, num_hidden_layers=4)),), scheduler=SD3_FLOW,
    ),
    "tiny-qwen-image": Recipe(
        "QwenImagePipeline", TINY_QWEN_IMAGE, TINY_QWEN_VAE, (("Qwen2_5_VLForConditionalGeneration", TINY_QWEN25_VL),),
        scheduler=FLUX_DEV_FLOW, vae_class="AutoencoderKLQwenImage",
    ),
    "tiny-qwen-image-edit": Recipe("QwenImageEditPipeline", TINY_QWEN_IMAGE, TINY_QWEN_VAE, (  # + a processor
        ("Qwen2_5_VLForConditionalGeneration", dict(TINY_QWEN25_VL, vision_config=dict(
            TINY_QWEN25_VL["vision_config"], depth=2, fullatt_block_indexes=[1]))),  # a windowed block, a full one
    ), scheduler=FLUX_DEV_FLOW, vae_class="AutoencoderKLQwenImage"),
    # Stable Diffusion 1.5's architecture (UNet 859.5 M parameters).
    "sd15-random": Recipe(
        "StableDiffusionPipeline",
        unet(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
        SD_VAE,
        (clip(CLIP_L),),
        scheduler=SD1_PNDM,
    ),
    # Stable Diffusion 2.1 (768, v-prediction): OpenCLIP-H text encoder, linear projections, upcast attention.
    "sd21-random": Recipe(
        "StableDiffusionPipeline",
        unet(
            sample_size=96,
            cross_attention_dim=1024,
            attention_head_dim=(5, 10, 20, 20),
            use_linear_projection=True,
            upcast_attention=True,
        ),
        SD_VAE,
        (clip(OPENCLIP_H),),
        scheduler=SD2_DDIM_V,
    ),
    # SDXL base 1.0 (UNet 2.6 B parameters): CLIP-L + OpenCLIP-bigG, written in fp16 by streaming.
    "sdxl-random": Recipe(
        "StableDiffusionXLPipeline",
        unet(
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
        (clip(CLIP_L), clip(OPENCLIP_BIGG, projection=True)),
        scheduler=SDXL_EULER,
        dtype="float16",
        streamed=True,
    ),
    # SD3.5 Medium (stabilityai/stable-diffusion-3.5-medium transformer/config.json): MMDiT-X, 24 layers of
    # 24 × 64 heads, dual attention in layers 0-12, qk RMS-norm; 2.24 B parameters plus a 0.23 B positional
    # embedding buffer (384² × 1536) = 2.47 B in the state dict, the real 4.94 GB bf16 file. CLIP-L and
    # OpenCLIP-bigG whole; T5-XXL at full width but 2 of its 24 layers (this preset is about the transformer;
    # the whole T5 would add 9 GB). Written in fp16 by streaming.
    "sd35-medium-random": Recipe(
        "StableDiffusion3Pipeline",
        ("SD3Transformer2DModel", dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, caption_projection_dim=1536, joint_attention_dim=4096, pooled_projection_dim=2048,
            pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
        )),
        dict(SD_VAE, sample_size=1024, **SD3_VAE),
        (clip(CLIP_L, projection=True), clip(OPENCLIP_BIGG, projection=True), t5(T5_XXL, num_layers=2)),
        scheduler=SD3_FLOW,
        dtype="float16",
        streamed=True,
    ),
    # FLUX.1 dev (black-forest-labs/FLUX.1-dev transformer/config.json): 19 double-stream + 38 single-stream blocks,
    # 24 heads × 128 = 3072 wide, T5 width 4096, pooled CLIP 768, guidance embedding, rotary axes (16, 56, 56):
    # 11.9 B parameters, 23.8 GB in bf16 as the real checkpoint. CLIP-L (pooled), the whole T5-XXL encoder
    # (google/t5-v1_1-xxl, 4.76 B), Flux's VAE (vae/config.json: SD's layout, 16 latent channels). ~34 GB on disk.
    "flux-random": Recipe(
        "FluxPipeline",
        ("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )),
        dict(SD_VAE, sample_size=1024, **FLUX_VAE),
        (clip(CLIP_L), t5(T5_XXL)),
        scheduler=FLUX_DEV_FLOW,
        dtype="bfloat16",
        streamed=True,
    ),
    # SD3.5 Large (stabilityai/stable-diffusion-3.5-large transformer/config.json): MMDiT, 38 layers of 38 × 64
    # heads (2432 wide), no dual attention, qk RMS-norm, positional grid 192²: 8.1 B parameters. CLIP-L,
    # OpenCLIP-bigG, the whole T5-XXL; bf16 as the real checkpoint.
    "sd35-large-random": Recipe(
        "StableDiffusion3Pipeline",
        ("SD3Transformer2DModel", dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
            num_attention_heads=38, caption_projection_dim=2432, joint_attention_dim=4096, pooled_projection_dim=2048,
            pos_embed_max_size=192, qk_norm="rms_norm",
        )),
        dict(SD_VAE, sample_size=1024, **SD3_VAE),
        (clip(CLIP_L, projection=True), clip(OPENCLIP_BIGG, projection=True), t5(T5_XXL)),
        scheduler=SD3_FLOW,
        dtype="bfloat16",
        streamed=True,
    ),
    "flux2-klein-random": Recipe(
        "Flux2KleinPipeline", FLUX2_KLEIN_4B, FLUX2_VAE, (("Qwen3ForCausalLM", QWEN3_4B),), scheduler=FLUX_DEV_FLOW,
        settings={"is_distilled": True}, dtype="bfloat16", streamed=True, vae_class="AutoencoderKLFlux2",
    ),
    "qwen-image-random": Recipe(
        "QwenImagePipeline", QWEN_IMAGE_20B, {}, (("Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),),
        scheduler=QWEN_IMAGE_FLOW, dtype="bfloat16", streamed=True, vae_class="AutoencoderKLQwenImage",
    ),
}
# fmt: on
