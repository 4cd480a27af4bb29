"""Which kind of model a LoRA file is for (UNet, SD3, FLUX.1, FLUX.2, Z-Image, Qwen-Image), from its safetensors
header alone: the module names only some kinds have, and where FLUX.1 and FLUX.2 share BFL's block names (kohya's
and ai-toolkit's files), the width of their fused MLP inputs. Each kind's diffusers loader (LoraFamily) is what
sdtrt.lora.files reads it with.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import LoraError, LoraFamilyError


@dataclass(frozen=True)
class LoraFamily:
    """How one kind of model takes LoRAs: the diffusers pipeline whose ``lora_state_dict`` reads its files
    (and converts its kohya names), and the networks they change (that loader's ``_lora_loadable_modules``)."""

    label: str
    loader: str
    networks: tuple[str, ...]
    # lora_state_dict's keywords for (state dict, alphas, metadata): FluxPipeline's returns alphas only when
    # asked, StableDiffusion3Pipeline's has none (diffusers loaders/lora_pipeline.py).
    loader_kwargs: tuple[tuple[str, bool], ...] = ()
    # FLUX.1's loader zero-pads a LoRA's down weight that takes fewer input features than its Linear (a FLUX.1 dev
    # LoRA's x_embedder on Fill's 384 or Control's 128 channels: FluxLoraLoaderMixin._maybe_expand_lora_state_dict).
    pads_inputs: bool = False


# By model family (ModelSource.family()). T5 (SD3's text_encoder_3, Flux's text_encoder_2) takes no LoRAs: diffusers
# loads none into it (its loaders list no T5), so a file with T5 weights is refused by name. FLUX.2's LLMs (klein's
# Qwen3, dev's Mistral3) take none either (Flux2LoraLoaderMixin, both pipelines' loader, loads the transformer only);
# klein's and dev's transformers share their module names, and a LoRA of the other's width is refused by its shapes.
LORA_FAMILIES = {
    "unet": LoraFamily(
        "UNet (SD 1.x/2.x, SDXL)", "StableDiffusionPipeline", ("unet", "text_encoder", "text_encoder_2")
    ),
    "sd3": LoraFamily("SD3", "StableDiffusion3Pipeline", ("transformer", "text_encoder", "text_encoder_2")),
    "flux": LoraFamily(
        "FLUX.1", "FluxPipeline", ("transformer", "text_encoder"), (("return_alphas", True),), pads_inputs=True
    ),
    "flux2": LoraFamily("FLUX.2", "Flux2KleinPipeline", ("transformer",)),
    # ZImageLoraLoaderMixin and QwenImageLoraLoaderMixin load the transformer only, converting kohya's,
    # ai-toolkit's (diffusion_model.) and PEFT-default names
    "zimage": LoraFamily("Z-Image", "ZImagePipeline", ("transformer",)),
    "qwenimage": LoraFamily("Qwen-Image", "QwenImagePipeline", ("transformer",)),
}
# Module names only some kinds' LoRAs have (diffusers', kohya's, ai-toolkit's), as patterns searched in its keys, each
# with the kinds that have them: a file is for the kinds every marker it names allows. SD3.5's joint blocks have a
# second attention (attn2) that Flux's have not, and UNet keys name theirs under unet; FLUX.1 and FLUX.2 share kohya's
# and ai-toolkit's block names, and differ in their MLPs, single-block projections and modulation layers (SD3.0's
# LoRAs name nothing FLUX.1's could not). BFL names with PEFT's lora_A/B (ai-toolkit's) are FLUX.2's: FLUX.1's loader
# converts BFL names only as kohya's down/up (FluxLoraLoaderMixin.lora_state_dict).
FLUX1, FLUXES = frozenset({"flux"}), frozenset({"flux", "flux2"})
FAMILY_MARKERS: tuple[tuple[str, frozenset[str]], ...] = (
    (r"down_blocks|up_blocks|mid_block", frozenset({"unet"})),
    (r"^transformer\.transformer_blocks\.\d+\.attn2\.", frozenset({"sd3"})),
    (
        r"proj_mlp|single_transformer_blocks\.\d+\.(proj_out|attn\.to_[qkv]\.|norm\.linear)|(img|txt)_mod[._]lin|"
        r"single_blocks[._]\d+[._]modulation[._]lin|vector_in",
        FLUX1,
    ),
    (r"ff(_context)?\.net\.", frozenset({"unet", "sd3", "flux"})),
    (
        r"to_qkv_mlp_proj|ff(_context)?\.linear_(in|out)|_stream_modulation|single_transformer_blocks\.\d+\.attn\.to_out|"
        r"time_guidance_embed|^diffusion_model\.(double|single)_blocks\.\d+\..*\.lora_[AB]\.",
        frozenset({"flux2"}),
    ),
    (r"single_transformer_blocks|lora_unet_(double|single)_blocks_|(^|\.)(double|single)_blocks\.", FLUXES),
    # Z-Image's blocks (layers, the refiners) and their attention / SwiGLU names; Qwen-Image's MLPs and modulation
    # (its attention has FLUX.1's and SD3's joint-block names, which say nothing)
    (
        r"(layers|noise_refiner|context_refiner)[._]\d+[._](attention[._]to_|feed_forward[._]w[123])|adaLN_modulation|"
        r"all_x_embedder|cap_embedder",
        frozenset({"zimage"}),
    ),
    (r"(img|txt)_mlp[._]net[._]|(img|txt)_mod[._]1|txt_norm", frozenset({"qwenimage"})),
)
# Where the names say FLUX.1 or FLUX.2 (kohya's BFL names), the fused MLP inputs' widths do, as multiples of the
# hidden size (the down weight's input): single blocks' linear1 is q, k, v and the MLP's input (FLUX.1 3 + 4,
# FLUX.2 3 + 2 x 3 for its SwiGLU), double blocks' img_mlp.0 / txt_mlp.0 the MLP's input (4 and 6).
FLUX_WIDTHS = (
    (r"single_blocks[._]\d+[._]linear1", {7: "flux", 9: "flux2"}),
    (r"(img|txt)_mlp[._]0", {4: "flux", 6: "flux2"}),
)
UP_TO_DOWN = {".lora_up.": ".lora_down.", ".lora_B.": ".lora_A."}
# SD3's, FLUX.1's, FLUX.2's and Qwen-Image's joint blocks name their attention alike in diffusers (to_q/k/v, to_out.0,
# add_q/k/v_proj, to_add_out), so an attention-only LoRA is told by its width, every projection's input features, and
# the blocks it names: SD3 Medium / SD3.5 Medium are 1536 wide, SD3.5 Large 2432 (their published configs, as
# sd3-random's and sd35-random's), FLUX.1, FLUX.2 [klein] 4B and Qwen-Image 3072, of which only Qwen-Image has joint
# blocks past FLUX.1's 19 (its 60; klein's 5); FLUX.2 [klein] 9B 4096 and [dev] 6144 (heads × head size, diffusers'
# Flux2Transformer2DModel). Other widths (tiny models) say nothing.
JOINT_ATTENTION = r"(?<!single_)transformer_blocks[._](\d+)[._]attn[._](to_[qkv]|to_out|add_[qkv]_proj|to_add_out)"
ATTENTION_WIDTHS = {
    1536: frozenset({"sd3"}), 2432: frozenset({"sd3"}), 3072: frozenset({"flux", "flux2", "qwenimage"}),
    4096: frozenset({"flux2"}), 6144: frozenset({"flux2"}),
}  # fmt: skip
FLUX_JOINT_BLOCKS = 19


def lora_kind(family: str) -> str:
    """The LORA_FAMILIES key of a model family: sd3, flux2, flux (dev and schnell, Fill, Control, Kontext), zimage,
    qwenimage or unet (every UNet family); LoraError for a transformer family none of them reads, whose LoRAs the
    UNet's loader would misread."""
    from ..core.families import TRANSFORMERS

    kind = max((kind for kind in LORA_FAMILIES if family.startswith(kind)), key=len, default=None)  # flux2, not flux
    if kind is None and family in TRANSFORMERS.values():
        model = next(name for name, of in TRANSFORMERS.items() if of == family)
        built = ", ".join(f.label for f in LORA_FAMILIES.values())
        raise LoraError(
            f"LoRAs on a {family} model ({model}) are not built yet (sdtrt applies {built} ones): load the LoRA into "
            "the PyTorch pipeline with diffusers' load_lora_weights"
        )
    return kind or "unet"


def named_kinds(keys: Sequence[str]) -> tuple[frozenset[str] | None, str | None]:
    """The kinds of model a LoRA's key names allow (None where they do not say), and the key that says most."""
    hits = _marker_hits(keys)
    if not hits:
        return None, None
    allowed = frozenset.intersection(*(kinds for kinds, _ in hits))
    return allowed, min(hits, key=lambda hit: len(hit[0]))[1]


def _marker_hits(keys: Sequence[str]) -> list[tuple[frozenset[str], str]]:
    return [(kinds, key) for pattern, kinds in FAMILY_MARKERS if (key := next(_matching(keys, pattern), None))]


def _matching(keys: Sequence[str], pattern: str) -> Iterator[str]:
    return (k for k in keys if re.search(pattern, k))


def kind_label(kinds: frozenset[str]) -> str:
    """The labels of these kinds, in LORA_FAMILIES' order: "FLUX.1", "FLUX.1 or FLUX.2"."""
    return " or ".join(family.label for kind, family in LORA_FAMILIES.items() if kind in kinds)


def kind_for(path: Path, keys: list[str], family: str | None) -> str:
    """The LORA_FAMILIES key to read a file with: the model family's (None: the kind the file says); LoraFamilyError
    where the file is for another kind of model, or names modules of two (before diffusers' converters fail on
    them, or a LoRA lands where it fits by chance)."""
    allowed, key = named_kinds(keys)
    if allowed == frozenset():
        first = min(_marker_hits(keys), key=lambda hit: len(hit[0]))
        other = next(hit for hit in _marker_hits(keys) if not first[0] <= hit[0])  # one exists: the meet is empty
        raise LoraFamilyError(f"{path} names modules of {kind_label(first[0])} ('{first[1]}') and of "
                              f"{kind_label(other[0])} ('{other[1]}'): a merged or corrupt file no model takes; "
                              "pass a LoRA trained for one")  # fmt: skip
    if allowed == FLUXES and (by_width := _flux_by_width(path, keys)):
        allowed, key = by_width
    if allowed is None and (by_attention := _attention_kinds(path, keys)):
        allowed, key = by_attention
    if family is None:  # the kind the file says (SD3 or a UNet where it says nothing, FLUX.1 where either FLUX)
        default = "sd3" if any(k.startswith("transformer.") for k in keys) else "unet"
        return default if not allowed or default in allowed else next(k for k in LORA_FAMILIES if k in allowed)
    kind = lora_kind(family)
    if allowed is not None and kind not in allowed:
        raise LoraFamilyError(f"{path} is a {kind_label(allowed)} LoRA ('{key}'); this model ({family}) takes "
                              f"{LORA_FAMILIES[kind].label} LoRAs")  # fmt: skip
    return kind


def _flux_by_width(path: Path, keys: list[str]) -> tuple[frozenset[str], str] | None:
    """FLUX.1 or FLUX.2 by FLUX_WIDTHS, from the shapes in the file's header (no tensor is read); None where the file
    has no fused MLP input (attention-only) or a width neither has."""
    import safetensors

    with safetensors.safe_open(str(path), "pt") as handle:
        for pattern, kinds in FLUX_WIDTHS:
            for up in _matching(keys, pattern):
                down = next((up.replace(u, d) for u, d in UP_TO_DOWN.items() if u in up), None)
                if down is None or down not in keys:
                    continue
                rows, columns = handle.get_slice(up).get_shape()[0], handle.get_slice(down).get_shape()[1]
                if kind := kinds.get(rows // columns) if rows % columns == 0 else None:
                    return frozenset({kind}), f"{up}: {rows} outputs for {columns} inputs"
    return None


def _attention_kinds(path: Path, keys: list[str]) -> tuple[frozenset[str], str] | None:
    """The kinds a LoRA naming joint-block attention is for, by ATTENTION_WIDTHS and the deepest block it names, from
    the shape of one down weight in the file's header (no tensor is read); None where it names no such attention with a
    down weight, or its width is in no table."""
    import safetensors

    blocks = {key: int(found.group(1)) for key in keys if (found := re.search(JOINT_ATTENTION, key))}
    down = next((key for key in blocks if any(d in key for d in UP_TO_DOWN.values())), None)
    if down is None:
        return None
    with safetensors.safe_open(str(path), "pt") as handle:
        width = handle.get_slice(down).get_shape()[1]
    kinds = ATTENTION_WIDTHS.get(width)
    if kinds is None:
        return None
    deepest = max(blocks, key=blocks.__getitem__)
    if "qwenimage" in kinds and blocks[deepest] >= FLUX_JOINT_BLOCKS:
        return frozenset({"qwenimage"}), f"{deepest}: joint block {blocks[deepest]} of a {width}-wide transformer"
    return kinds, f"{down}: {width} input features"
