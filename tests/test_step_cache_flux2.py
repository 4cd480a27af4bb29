"""Step caches on FLUX.2 engines: diffusers' TaylorSeer (lite) and MagCache hooks on the FLUX.2 split (its
modulations and rotary embedding computed by the embedders' part, handed to each block), against the same configs
on the PyTorch Flux2KleinPipeline (true CFG: a cond and an uncond pass a step, each in its cache context) and on the
PyTorch Flux2Pipeline ([dev]: one transformer call a step, in no cache context of its own; the call runs inside the
transformer's "cond", as sdtrt's generate runs it).

A step's decision is whether the blocks after the first ran: the engines' other-blocks part, the PyTorch last
single-stream block's attention. First-Block Cache fails on the PyTorch FLUX.2 transformer (diffusers issue 14280),
so the engines refuse it in one line. One fp32 ONNX Runtime set with the split members for the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from PIL import Image

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import ConfigError, EngineInputError
from sdtrt.pipeline.loading import load_pipeline
from sdtrt.sources.models import resolve_model
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db

STEPS = 6
CALL = {"num_inference_steps": STEPS, "height": 128, "width": 128, "output_type": "np"}


@pytest.fixture(scope="module")
def klein(store):
    """The PyTorch pipeline and the engine pipeline of tiny FLUX.2 [klein]'s fp32 set with the split members
    (``--caches taylorseer``; the other members are test_flux2_klein's, cache hits in the session store)."""
    source = resolve_model("tiny-flux2-klein")
    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32"), caches=("taylorseer",))
    return load_pipeline(source), load_pipeline(source, engine.final)


@pytest.fixture(scope="module")
def dev(store):
    """The same for tiny FLUX.2 [dev] (Flux2Pipeline; the other members are test_flux2_dev's)."""
    source = resolve_model("tiny-flux2")
    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32"), caches=("taylorseer",))
    return load_pipeline(source), load_pipeline(source, engine.final)


def image(pipe, config=None, **call: object) -> np.ndarray:
    if config is not None:
        pipe.transformer.enable_cache(config)
    # Flux2Pipeline opens no cache context: its call inside "cond" (the engines open it alone too), as generate runs it
    context: AbstractContextManager[object] = nullcontext()
    if config is not None and type(pipe).__name__ == "Flux2Pipeline":
        context = pipe.transformer.cache_context("cond")
    try:
        with context:
            prompt = "a red fox in the snow"
            return pipe(prompt=prompt, generator=torch.Generator().manual_seed(0), **CALL, **call).images
    finally:
        if config is not None:
            pipe.transformer.disable_cache()


@contextmanager
def decisions(transformer: torch.nn.Module, runs: Callable[[], int]) -> Iterator[list[str]]:
    """Per transformer call, "C" where the blocks after the first ran (``runs`` went up), "s" where they did not."""
    made, last = [], [runs()]

    def record(*_: object) -> None:
        made.append("C" if runs() > last[0] else "s")
        last[0] = runs()

    handle = transformer.register_forward_hook(record)
    try:
        yield made
    finally:
        handle.remove()


def counted(module: torch.nn.Module) -> Callable[[], int]:
    """How many times ``module`` has run (a PyTorch block's attention: skipped with its block)."""
    runs = [0]
    module.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return lambda: runs[0]


def check_parity(pipes, config_of: Callable[[], object], **call: object) -> str:
    """The cache on both pipelines (``call``: the pipeline call's other arguments): the same decisions on every call
    (klein's two a step, dev's one), some skipped, images ≥ 35 dB apart; the uncached engine image again after
    disable_cache. Returns the decisions."""
    reference, engines = pipes
    calls = 1 if type(reference).__name__ == "Flux2Pipeline" else 2
    uncached = image(engines, **call)
    pytorch_runs = counted(reference.transformer.single_transformer_blocks[-1].attn)
    with decisions(reference.transformer, pytorch_runs) as on_pytorch:
        expected = image(reference, config_of(), **call)
    rest = engines.transformer.opened_split() or pytest.fail("the set has no split members")
    with decisions(engines.transformer, lambda: rest.rest.calls) as on_engines:
        cached = image(engines, config_of(), **call)
    made = "".join(on_engines)
    assert made == "".join(on_pytorch) and "s" in made and len(made) == calls * STEPS, (made, on_pytorch)
    psnr, skipped = psnr_db(cached, expected), psnr_db(cached, uncached)
    name = f"{type(reference).__name__} {type(config_of()).__name__}"
    print(f"{name}: {made}, {psnr:.1f} dB vs PyTorch, {skipped:.1f} dB vs uncached")
    assert psnr >= 35.0 and skipped < 80.0  # matched, and steps were skipped
    assert np.array_equal(image(engines, **call), uncached)  # disable_cache: the whole engine again, bit for bit
    return made


def magcache() -> MagCacheConfig:
    return MagCacheConfig(threshold=0.3, num_inference_steps=STEPS, mag_ratios=FLUX_MAG_RATIOS)


def taylorseer_lite() -> TaylorSeerCacheConfig:
    return TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=2, use_lite_mode=True, taylor_factors_dtype=torch.float32
    )


@pytest.mark.slow  # the four parts' export, ~80 s of CPU, over the default suite's budget: test_step_cache.py's
def test_taylorseer_lite_on_the_engines_predicts_the_steps_pytorch_predicts(klein):  # chained parts stay there
    check_parity(klein, taylorseer_lite)


@pytest.mark.slow
def test_taylorseer_lite_with_a_reference_image_matches_pytorch(klein):
    """Klein's editing task: the reference's tokens join the image tokens, and its positions the rotary embedding's,
    through every part."""
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    widths: list[int] = []
    split = klein[1].transformer.opened_split()
    split.first.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    check_parity(klein, taylorseer_lite, image=Image.fromarray(noise))
    assert set(widths) == {2 * (128 // 16) ** 2}  # the output's 64 patches and the reference's 64


@pytest.mark.slow
def test_magcache_on_the_engines_skips_the_steps_pytorch_skips(klein):
    """MagCache's residual on FLUX.2 is the joined stream's image tokens minus the first block's input; on the
    engines the other-blocks part returns the image tokens alone. Flux.1's ratios stand in for ratios calibrated on
    FLUX.2 (MagCache decides from the ratios and the step alone)."""
    check_parity(klein, magcache)


def test_first_block_cache_is_refused_on_flux2_before_any_export(store):
    with pytest.raises(ConfigError, match="First-Block Cache fails on the PyTorch Flux2Transformer2DModel"):
        compile_model(resolve_model("tiny-flux2-klein"), store, "onnxruntime", caches=("first-block",))


@pytest.mark.slow  # on the compiled parts: the fixture's export
def test_first_block_cache_is_refused_on_flux2_engines_in_one_line(klein):
    _, engines = klein
    with pytest.raises(EngineInputError, match="issue 14280") as refused:
        engines.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    assert "\n" not in str(refused.value) and not engines.transformer.is_cache_enabled


@pytest.mark.slow  # tiny-flux2's parts' export, as klein's
@pytest.mark.parametrize("config_of", [taylorseer_lite, magcache], ids=["taylorseer-lite", "magcache"])
def test_step_caches_on_flux2_dev_engines_match_pytorch_inside_cond(dev, config_of):
    """Flux2Pipeline opens no cache context, but calls its transformer once a step: the PyTorch pipeline inside an
    outer "cond" is the reference, as SD3's is."""
    check_parity(dev, config_of)
