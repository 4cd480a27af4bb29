"""Building a preset's model folder offline: its pipeline from the recipe (presets.py) with random weights.

Each is built once with a fixed seed and saved under the models cache, so later stages see an
ordinary diffusers folder; tokenizers are made from small vocabularies, so nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from ..core.errors import RequestError
from ..core.families import QWEN_IMAGE_EDIT_PIPELINES
from .byte_level import bytes_to_unicode
from .presets import PRESETS, SD_BETAS, Network, Recipe
from .random_weights import SHARD_SIZE, empty_weights, save_random

PRESET_SEED = 0

PRESET_VERSION = 3  # 3: the multi-GB presets are written by streaming (other random values)


def ensure_preset(name: str, cache_dir: Path, networks: Collection[str] = ()) -> Path:
    """The preset's folder, built on first use; an interrupted build leaves nothing behind.

    ``networks`` (streamed presets): write only these networks' weights (``text_encoder``), in a folder of its own
    whose other networks are listed in model_index.json but absent: the parts of a model too big for the disk whole
    (qwen-image-random's 41 GB transformer beside its 17 GB text encoder) are exported one at a time. The whole
    preset, where it is built already, serves a partial one too."""
    dest = preset_dir(name, cache_dir, networks)
    for built in (preset_dir(name, cache_dir), dest):
        if (built / "model_index.json").is_file():
            return built
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        from ..core.progress import quiet_loading

        recipe = PRESETS[name]
        with quiet_loading():
            if recipe.streamed:
                save_streamed(recipe, tmp, networks=networks)
            elif networks:
                raise RequestError(
                    f"preset {name} is built whole (not streamed): it has no partial form; drop the networks"
                )
            else:
                build(recipe).save_pretrained(tmp, safe_serialization=True)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first; theirs is identical
            if not (dest / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def preset_dir(name: str, cache_dir: Path, networks: Collection[str] = ()) -> Path:
    """Where ensure_preset keeps the preset ``name`` (with only ``networks``' weights, where given)."""
    only = f"-only-{'-'.join(sorted(networks))}" if networks else ""
    return cache_dir / f"{name}-v{PRESET_VERSION}{only}"


def save_streamed(
    recipe: Recipe, folder: Path, max_shard_size: int = SHARD_SIZE, networks: Collection[str] = ()
) -> None:
    """The folder ``build(recipe).save_pretrained(folder, safe_serialization=True, max_shard_size=…)`` writes,
    its networks never in memory: each is built on the meta device and its random tensors streamed to disk
    (random_weights.py). Tokenizers, scheduler and model_index.json are saved as the pipeline saves them.
    ``networks``: only these networks get weights (default: all); the others their config alone."""
    import torch

    pipeline = build(recipe, empty=True)
    modules = [name for name, component in pipeline.components.items() if isinstance(component, torch.nn.Module)]
    if unknown := sorted(set(networks) - set(modules)):
        raise RequestError(
            f"{', '.join(unknown)}: not a network of this pipeline; its networks are {', '.join(modules)}"
        )
    for name, component in pipeline.components.items():
        if isinstance(component, torch.nn.Module):
            weights = not networks or name in networks
            save_random(component, folder / name, seed=f"{PRESET_SEED}/{name}", max_shard_size=max_shard_size,
                        weights=weights)  # fmt: skip
        elif component is not None:
            component.save_pretrained(folder / name)
    pipeline.save_config(folder)


def _byte_level_tokenizer(folder: Path, max_length: int = 77) -> Any:
    """A CLIP tokenizer over a byte-level vocabulary: every text tokenizes, nothing is downloaded.

    transformers 5.x builds a 3-token vocabulary from CLIPTokenizer(vocab_file=…), so the files are
    written to a folder and loaded with from_pretrained.
    """
    from transformers import CLIPTokenizer

    byte_chars = bytes_to_unicode()
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("an", "d</w>"), ("i", "n"), ("o", "n</w>")]
    tokens += ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=max_length)


def _unigram_t5_tokenizer(max_length: int = 512) -> Any:
    """A T5 tokenizer over a Unigram vocabulary of single characters (▁-prefixed word starts, SentencePiece's
    way): every text tokenizes, nothing is downloaded. Special tokens as T5's: <pad> 0, </s> 1, <unk> 2."""
    import string

    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    pieces += [("▁" + w, -1.0) for w in ("the", "and", "a", "of")]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build(recipe: Recipe, empty: bool = False) -> Any:
    """The recipe's pipeline, its networks with random weights; ``empty``: their parameters on the meta device."""
    import diffusers
    import torch

    from ..core.families import accepted

    torch.manual_seed(PRESET_SEED)
    with default_dtype(recipe.dtype), empty_weights() if empty else contextlib.nullcontext():
        parts = _networks(recipe)
    scheduler_class, scheduler_kwargs = recipe.scheduler
    scheduler_cls = getattr(diffusers, scheduler_class)
    # SD's noise schedule for the DDPM-style schedulers; flow-matching ones (SD3, Flux) have no betas.
    betas = SD_BETAS if "beta_start" in inspect.signature(scheduler_cls).parameters else {}
    scheduler = scheduler_cls(**(betas | scheduler_kwargs))
    if betas:  # other schedulers built from this config (DDIM from PNDM's) read clip_sample: SD's is False
        scheduler.register_to_config(clip_sample=False)
    pipeline_class = getattr(diffusers, recipe.pipeline)
    optional = {"safety_checker": None, "feature_extractor": None, "image_encoder": None,
                "requires_safety_checker": False}  # fmt: skip
    pipe = pipeline_class(**accepted(pipeline_class, optional | parts | {"scheduler": scheduler} | recipe.settings))
    if "processor" in parts:  # named as an Edit checkpoint names it; the loader makes it ImageQwen2VLProcessor
        pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    return pipe


def _networks(recipe: Recipe) -> dict[str, Any]:
    """The recipe's networks and tokenizers by pipeline component name."""
    import diffusers

    denoiser_class, denoiser_kwargs = recipe.denoiser
    parts: dict[str, Any] = {
        recipe.denoiser_folder: getattr(diffusers, denoiser_class)(**denoiser_kwargs),
        "vae": getattr(diffusers, recipe.vae_class)(**recipe.vae),
    }
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizers = {"clip": _byte_level_tokenizer(Path(tok_dir)), "t5": _unigram_t5_tokenizer()}
    if recipe.vae_class == "AutoencoderKLFlux2":
        from .qwen_encoder import random_latent_statistics

        random_latent_statistics(parts["vae"])
    if denoiser_class == "ZImageTransformer2DModel":
        _random_pad_tokens(parts["transformer"])
    for i, network in enumerate(recipe.text_encoders):
        suffix = f"_{i + 1}" if i else ""
        encoder, tokenizer = _text_encoder(network, tokenizers, vision=recipe.pipeline in QWEN_IMAGE_EDIT_PIPELINES)
        parts |= {f"text_encoder{suffix}": encoder, f"tokenizer{suffix}": tokenizer}
    if recipe.pipeline in QWEN_IMAGE_EDIT_PIPELINES:  # the processor that cuts its condition image into patches
        from .qwen_processor import TINY_PIXELS, new_edit_processor

        parts["processor"] = new_edit_processor(parts["tokenizer"], TINY_PIXELS)
    if recipe.controlnet is not None:
        parts["controlnet"] = _random_controlnet(parts[recipe.denoiser_folder], recipe.controlnet)
    return parts


def _text_encoder(network: Network | None, tokenizers: dict[str, Any], vision: bool = False) -> tuple[Any, Any]:
    """A random text encoder of the network's class and the tokenizer it reads (``vision``: a Qwen2.5-VL's with its
    vision tokens); (None, None) for no network."""
    if network is None:
        return None, None
    import transformers

    class_name, kwargs = network
    text = dict(kwargs)
    if class_name in ("Qwen3ForCausalLM", "Qwen3Model"):
        from .qwen_encoder import qwen3_config, qwen_chat_tokenizer

        tokenizer = qwen_chat_tokenizer()
        config: Any = qwen3_config(tokenizer, text)
    elif class_name == "Qwen2_5_VLForConditionalGeneration":
        from .qwen_encoder import qwen_chat_tokenizer, qwen_vl_config, qwen_vl_tokenizer

        tokenizer = qwen_vl_tokenizer() if vision else qwen_chat_tokenizer()
        config = qwen_vl_config(tokenizer, text)
    elif class_name == "Mistral3ForConditionalGeneration":
        from .mistral_encoder import mistral3_config, mistral_chat_tokenizer

        tokenizer = mistral_chat_tokenizer()
        config = mistral3_config(tokenizer, text)
    elif class_name == "T5EncoderModel":
        tokenizer = tokenizers["t5"]
        config = transformers.T5Config(
            vocab_size=max(len(tokenizer), text.pop("vocab_size", 0)), pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, **text,
        )  # fmt: skip
    else:
        tokenizer = tokenizers["clip"]
        config = transformers.CLIPTextConfig(
            vocab_size=max(len(tokenizer), text.pop("vocab_size", 0)), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=77,
            **text,
        )  # fmt: skip
    return getattr(transformers, class_name)(config), tokenizer


def _random_pad_tokens(transformer: Any) -> None:
    """Distinct random pad tokens for a ZImageTransformer2DModel (diffusers starts both at zero; trained ones are not):
    a graph that swapped the image's and the caption's, or padded with zeros, then gives other images."""
    import torch

    with torch.no_grad():
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()


def _random_controlnet(denoiser: Any, kwargs: dict[str, Any]) -> Any:
    """A ControlNet copied from the UNet (or FLUX.1's transformer), its zero-initialised output layers made random.

    A fresh ControlNet adds exactly zero (its "zero convolutions", FLUX.1's zero linears on the control latents and
    the samples), so engines that dropped its residuals would still match; random ones make every residual count.
    """
    import torch
    from diffusers import ControlNetModel, FluxControlNetModel, FluxTransformer2DModel

    if isinstance(denoiser, FluxTransformer2DModel):
        controlnet = FluxControlNetModel.from_transformer(denoiser, **kwargs)
        zero_convs = [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks,
                      controlnet.controlnet_x_embedder]  # fmt: skip
    else:
        controlnet = ControlNetModel.from_unet(denoiser, **kwargs)
        zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                      controlnet.controlnet_cond_embedding.conv_out]  # fmt: skip
    with torch.no_grad():
        for conv in zero_convs:
            conv.weight.normal_(std=0.05)
    return controlnet


@contextlib.contextmanager
def default_dtype(name: str) -> Iterator[None]:
    """Networks built inside get parameters of torch dtype ``name`` (``bfloat16``)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, name))
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def with_network_config(source: Path, folder: str, dest: Path, *, dtype: str = "float32", **overrides: Any) -> Path:
    """A copy of the model folder ``source`` whose ``folder`` network (a diffusers one, by its config's
    ``_class_name``, or a transformers one, by its ``architectures``) is rebuilt from its config with ``overrides``
    (Flux's ``num_layers=19``: the same network with more blocks) and random weights keyed by name, so that the
    tensors both networks have hold the same values; its other folders are links to the source's. Built once, its
    weights in ``dtype`` (a bf16 preset's: half the disk of fp32)."""
    import diffusers
    import transformers

    if (dest / "model_index.json").is_file():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        for entry in source.iterdir():
            if entry.name != folder:
                (tmp / entry.name).symlink_to(entry.resolve())
        config = json.loads((source / folder / "config.json").read_text())
        with default_dtype(dtype), empty_weights():
            if "_class_name" in config:
                network = getattr(diffusers, config["_class_name"]).from_config({**config, **overrides})
            else:
                cls = getattr(transformers, config["architectures"][0])
                network = cls(cls.config_class.from_dict({**config, **overrides}))
        save_random(network, tmp / folder, seed=f"{PRESET_SEED}/{folder}")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
