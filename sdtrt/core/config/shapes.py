"""The shapes an engine accepts: ``Range`` per dimension, ``ShapeProfile`` in user terms, and the size rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ConfigError
from .keys import in_key_unless


def pixel_size(height: int, width: int) -> str:
    """An image size as people read it: width first, as image tools (PIL's ``.size``) give it, and said so."""
    return f"{width}×{height} px (w×h)"


def grid_problem(name: str, value: int, multiple: int, within: Range | None = None) -> str | None:
    """Why an image side cannot be generated, or None: the one size rule every command applies. ``within``: the
    engines' range for this side (its ends are on the grid), so the size suggested is one they take."""
    if value > 0 and value % multiple == 0:
        return None
    nearest = max(multiple, round(value / multiple) * multiple)
    if within is not None:
        nearest = min(max(nearest, within.min), within.max)
    return (
        f"{name} {value} is not a positive multiple of {multiple} pixels, which this model's denoiser (its "
        f"UNet or transformer) and VAE need; use e.g. {nearest}"
    )


# The most images per prompt a profile may take: four times NVIDIA's demo/Diffusion (max_batch_size 16). A
# TensorRT engine reserves activation memory for its largest shapes and validation runs the largest batch, so a
# maximum beyond any GPU's or host's memory (1:1:1000000) would only fail later, at load or at validation.
MAX_BATCH = 64
# The most T5 tokens (max_sequence_length) SD3's and FLUX.1's pipelines take: their check_inputs refuse more.
MAX_T5_TOKENS = 512


class TokenCap(NamedTuple):
    """The most text tokens an engine's pipelines take (a spec's), for ShapeProfile.check's message."""

    most: int
    takes: str  # who takes them: "SD3 and FLUX.1 pipelines take"
    kind: str = "tokens"  # what is counted: "T5 tokens"


T5_TOKEN_CAP = TokenCap(MAX_T5_TOKENS, "SD3 and FLUX.1 pipelines take", "T5 tokens")
# An example per kind of range in Range.parse's message: images per prompt, pixels, T5 tokens.
RANGE_EXAMPLES = {"batch": "1:2:4", "height": "256:512:768", "width": "256:512:768", "tokens": "32:256:512"}


class Range(NamedTuple):
    """A dimension's minimum, optimum (what the engine is tuned for) and maximum."""

    min: int
    opt: int
    max: int

    @classmethod
    def parse(cls, text: str, what: str) -> Range:
        """Parse ``N`` (static) or ``MIN:OPT:MAX``."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) == 1:
            values *= 3
        if len(values) != 3:
            raise ConfigError(f"{what} '{text}' is not N or MIN:OPT:MAX (e.g. {RANGE_EXAMPLES[what]})")
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclass(frozen=True)
class ShapeProfile:
    """Shapes an engine must accept, in user terms: images per prompt, pixel height/width and, for models with
    T5 (SD3, Flux), its token count (``max_sequence_length``).

    With classifier-free guidance (``guidance=True``) the UNet sees twice the batch.
    """

    batch: Range = Range(1, 1, 4)
    height: Range = Range(256, 512, 768)
    width: Range = Range(256, 512, 768)
    guidance: bool = True
    # None: no T5 in the model; keyed only when set, so the keys of UNet builds stay.
    tokens: Range | None = in_key_unless(None, None)
    # FLUX.2 [klein]: the most reference images a request may give, each inside height × width; the transformer's
    # patches cover the output's and theirs (keyed only when set).
    references: int = in_key_unless(0, 0)

    @classmethod
    def around(cls, size_px: int, multiple: int) -> ShapeProfile:
        """The default profile for a model whose native resolution is ``size_px``."""
        low = max(multiple, (size_px // 2) // multiple * multiple)
        high = size_px * 3 // 2 // multiple * multiple
        return cls(Range(1, 1, 4), Range(low, size_px, high), Range(low, size_px, high))

    def to_json(self) -> dict[str, Any]:
        tokens: dict[str, Any] = {"tokens": list(self.tokens)} if self.tokens else {}
        tokens |= {"references": self.references} if self.references else {}
        return {
            "batch": list(self.batch),
            "height": list(self.height),
            "width": list(self.width),
            "guidance": self.guidance,
        } | tokens

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapeProfile:
        tokens = Range(*data["tokens"]) if data.get("tokens") else None
        return cls(
            Range(*data["batch"]), Range(*data["height"]), Range(*data["width"]), data["guidance"], tokens,
            data.get("references", 0),
        )  # fmt: skip

    def unet_batch(self) -> Range:
        """The UNet's batch: doubled by guidance, except at the minimum (guidance off, or LCM/Turbo, runs 1×).

        A static batch (min = max) stays one shape: doubled throughout.
        """
        factor = 2 if self.guidance else 1
        low = self.batch.min * factor if self.batch.min == self.batch.max else self.batch.min
        return Range(low, self.batch.opt * factor, self.batch.max * factor)

    def tokens_problem(self, tokens: int) -> str | None:
        """Why a T5 token count (``max_sequence_length``) is outside the profile, or None."""
        if self.tokens is None or self.tokens.min <= tokens <= self.tokens.max:
            return None
        return (
            f"{tokens} T5 tokens are outside the engine's profile ({self.tokens.min}..{self.tokens.max}); use a "
            "max_sequence_length inside it or rebuild the engines with a --tokens range covering it"
        )

    def size_problem(self, height: int, width: int) -> str | None:
        """Why an image of this size is outside the profile, or None."""
        for name, value, rng in (("height", height, self.height), ("width", width, self.width)):
            if not rng.min <= value <= rng.max:
                return (
                    f"{name} {value} is outside the engine's profile ({rng.min}..{rng.max} px); use a size inside "
                    f"it or rebuild the engine with `sdtrt compile --{name} MIN:OPT:MAX` covering it"
                )
        return None

    def references_problem(self, sizes: Sequence[tuple[int, int]]) -> str | None:
        """Why reference images of these (height, width) sizes, as the pipeline feeds them, are outside the
        profile, or None."""
        if len(sizes) > self.references:
            return (
                f"{len(sizes)} reference image(s), more than the {self.references} the engines were built for; "
                f"pass at most {self.references}, or rebuild the engines with a profile of more references"
            )
        for i, (height, width) in enumerate(sizes, 1):
            for name, value, rng in (("height", height, self.height), ("width", width, self.width)):
                if not rng.min <= value <= rng.max:
                    return (
                        f"reference image {i} is {pixel_size(height, width)} as the pipeline feeds it, its {name} "
                        f"outside the engines' profile ({rng.min}..{rng.max} px); resize it to fit, or rebuild the "
                        f"engines with `sdtrt compile --{name} MIN:OPT:MAX` covering it"
                    )
        return None

    def check(self, pixel_multiple: int, token_cap: TokenCap | None = T5_TOKEN_CAP) -> None:
        """Raise ConfigError unless every range is ordered, positive and on the model's grid, the tokens within the
        pipeline's ``token_cap`` (None: a network that reads none)."""
        ranges = (("batch", self.batch), ("height", self.height), ("width", self.width), ("tokens", self.tokens))
        for name, rng in ranges:
            if rng is not None and not 0 < rng.min <= rng.opt <= rng.max:
                raise ConfigError(f"{name} range {rng} must satisfy 0 < min <= opt <= max")
        if self.batch.max > MAX_BATCH:
            raise ConfigError(
                f"batch range {self.batch}: at most {MAX_BATCH} images per prompt (an engine reserves memory for its "
                "largest batch); generate larger sets in several calls"
            )
        if self.tokens is not None and token_cap is not None and self.tokens.max > token_cap.most:
            raise ConfigError(
                f"tokens range {self.tokens}: {token_cap.takes} at most {token_cap.most} {token_cap.kind} "
                f"(max_sequence_length); use a maximum of {token_cap.most} or less"
            )
        for name, rng in (("height", self.height), ("width", self.width)):
            for value in rng:
                if problem := grid_problem(name, value, pixel_multiple):
                    raise ConfigError(problem)
