"""Step caches on a transformer engine: diffusers' own cache hooks, over engines that stand in for its blocks.

diffusers' First-Block Cache and MagCache hook a transformer's first and last blocks, and TaylorSeer's lite mode its
blocks and ``proj_out``; on a step they decide to skip, the hooks return a cached residual or a prediction instead of
calling the block. A monolithic engine has no blocks to hook, so an engine set compiled with
``caches=("first-block",)`` holds the transformer a second time in four parts (spec/transformer_split.py), and the
stand-in names them as the hooks look for them: ``transformer_blocks[0]`` runs the first block's engine,
``transformer_blocks[1]`` the engine of every other block, ``proj_out`` the output head's. diffusers' own hooks then
decide, on the engines' tensors, which steps skip — the same code as on the PyTorch transformer.

With no cache enabled the stand-in runs the whole-transformer engine, as before: the split costs the uncached path
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import ArtifactError
from ..runtime import Runtime
from ..spec.transformer_split import TransformerPartSpec, reference_problem

# The cache configs an engine can honour (diffusers.hooks' class names, with --cache's names), and why the others
# cannot.
HONOURED = {"FirstBlockCacheConfig": "first-block", "MagCacheConfig": "magcache", "TaylorSeerCacheConfig": "taylorseer"}
INSIDE_BLOCKS = (
    "caches the attention layers inside the blocks, which an engine runs as one graph: use FirstBlockCacheConfig, "
    "MagCacheConfig or TaylorSeerCacheConfig(use_lite_mode=True)"
)
UNHONOURED = {
    "PyramidAttentionBroadcastConfig": INSIDE_BLOCKS,
    "FasterCacheConfig": INSIDE_BLOCKS,
    "TextKVCacheConfig": INSIDE_BLOCKS,
    "SeaCacheConfig": "reads each step's spectral indicators from the PyTorch network's callbacks, which an engine "
    "does not call: use FirstBlockCacheConfig or MagCacheConfig",
}


class PartEngine(torch.nn.Module):
    """One part of a split denoiser (a transformer's, or a UNet's for DeepCache): its runtime, fed by canonical names,
    its outputs in the spec's order."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime
        self.calls = 0  # engine runs: bench counts the steps a cache skipped from the blocks' runs

    def run(self, **tensors: torch.Tensor) -> list[torch.Tensor]:
        spec = self.runtime.spec
        feeds = {graph: tensors[name] for graph, name in zip(spec.input_names, spec.canonical_inputs, strict=True)}
        self.calls += 1
        outputs = self.runtime.run(feeds)
        return [outputs[name] for name in spec.output_names]


class TransformerPartEngine(PartEngine):
    """One part of the split transformer, its contract (``part``) what the chain reads its extras from."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        if not isinstance(runtime.spec, TransformerPartSpec):
            raise ArtifactError(f"this is a {runtime.spec.component} engine, not a part of a split transformer")
        self.part = runtime.spec


class EngineBlock(TransformerPartEngine):
    """A block part's engine, called as diffusers' forward calls a block: its rotary embedding the pair
    ``image_rotary_emb`` (Flux's cos and sin, Qwen-Image's image and text angles), the rest by the names the part
    takes them (temb, Qwen-Image's text mask, FLUX.2's modulations); the engine reads those its graph takes."""

    def run_block(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None, extras: dict[str, torch.Tensor],
    ) -> list[torch.Tensor]:  # fmt: skip
        rotary = dict(zip(self.part.rotary_pair, image_rotary_emb or (), strict=True))
        return self.run(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, **rotary, **extras)


class EngineFirstBlock(EngineBlock):
    """The first block's engine, called as a diffusers block: (encoder_hidden_states, hidden_states) out."""

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None, **extras: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        encoder, hidden = self.run_block(hidden_states, encoder_hidden_states, image_rotary_emb, extras)
        return encoder, hidden


class EngineOtherBlocks(EngineBlock):
    """Every block after the first, one engine called as the last diffusers block. The text tokens it returns are
    those it was given: after the last block the transformer reads only the image tokens (norm_out, proj_out)."""

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None, **extras: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        (hidden,) = self.run_block(hidden_states, encoder_hidden_states, image_rotary_emb, extras)
        return encoder_hidden_states, hidden


class EngineOutputHead(TransformerPartEngine):
    """norm_out and proj_out (and SD3's patches back into latents) as one engine, where TaylorSeer-lite predicts."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        tensors = {"hidden_states": hidden_states, "temb": temb}
        if "latents" in self.runtime.spec.canonical_inputs:
            tensors["latents"] = latents
        return self.run(**tensors)[0]


def register_blocks() -> None:
    """Tell diffusers' cache hooks where our blocks' outputs are, as it is told for its own blocks (the registry of
    diffusers/hooks/_helpers.py, which its hooks read by class): (encoder_hidden_states, hidden_states)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

    for cls in (EngineFirstBlock, EngineOtherBlocks):
        TransformerBlockRegistry.register(
            model_class=cls,
            metadata=TransformerBlockMetadata(return_hidden_states_index=1, return_encoder_hidden_states_index=0),
        )


class SplitTransformer:
    """The transformer's four part engines, chained as its forward chains its layers; the block and head modules
    are what the stand-in registers under diffusers' names (transformer_blocks, proj_out)."""

    def __init__(self, parts: dict[str, Runtime]) -> None:
        register_blocks()
        self.embed = TransformerPartEngine(parts["transformer_embed"])
        self.first = EngineFirstBlock(parts["transformer_first_block"])
        self.rest = EngineOtherBlocks(parts["transformer_rest"])
        self.blocks = torch.nn.ModuleList([self.first, self.rest])
        self.head = EngineOutputHead(parts["transformer_out"])

    def runtimes(self) -> list[Runtime]:
        return [self.embed.runtime, self.first.runtime, self.rest.runtime, self.head.runtime]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's output for its canonical inputs, each block and the head called as diffusers calls them
        (so the cache hooks on them see what they see on PyTorch)."""
        spec = self.embed.part
        # The block extras: computed by the embedders (Flux's and FLUX.2's) or the whole call's (Qwen-Image's).
        given = inputs | dict(zip(spec.canonical_outputs, self.embed.run(**inputs), strict=True))
        extras: dict[str, Any] = {name: given[name] for name in ("temb", *spec.block_extras())}
        if spec.rotary_pair:
            extras["image_rotary_emb"] = tuple(extras.pop(name) for name in spec.rotary_pair)
        encoder, hidden = given["embedded_encoder_hidden_states"], given["embedded_hidden_states"]
        for block in self.blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, **extras)
        return self.head(hidden_states=hidden, temb=given["temb"], latents=inputs["hidden_states"])


def cache_problem(config: Any, has_parts: bool, architecture: str) -> str | None:
    """Why an engine transformer of this class (``has_parts``: its set has the split members) cannot run ``config``
    (a diffusers cache config), or None when it can."""
    import diffusers.hooks as hooks

    name = type(config).__name__
    for refused, why in UNHONOURED.items():
        if isinstance(config, getattr(hooks, refused, ())):  # a subclass too
            return f"{name} {why}"
    kind = next((kind for n, kind in HONOURED.items() if isinstance(config, getattr(hooks, n))), None)
    if kind is None:
        return f"{name} is not a step cache sdtrt knows; engines run {', '.join(HONOURED)}"
    if problem := reference_problem(architecture, kind):
        return f"{name}: {problem}"
    if not has_parts:
        return (
            "this engine set has no split members for step caches: recompile with `sdtrt compile --caches "
            "first-block` (Python: compile_model(..., caches=('first-block',)))"
        )
    return None


def check_hooked(split: SplitTransformer, config: Any) -> str | None:
    """Why the cache hooks diffusers registered do not cover an engine part (TaylorSeer's default identifiers name
    the attention layers inside the blocks), or None when they do."""
    hooked = any(getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks for m in (*split.blocks, split.head))
    if hooked:
        return None
    return (
        f"{type(config).__name__} as configured hooks layers inside the blocks, which an engine runs as one graph: "
        "use TaylorSeerCacheConfig(use_lite_mode=True), which predicts the transformer's output (proj_out)"
    )
