"""Typed errors. Every message says what failed, why, and what to do about it."""

from __future__ import annotations


class SdtrtError(Exception):
    """Base of every error sdtrt raises on purpose; the CLI prints it as one line (exit 1)."""

    exit_code = 1


class ModelNotFoundError(SdtrtError):
    """The --model value names no preset, local diffusers folder or reachable hub id (or lacks a folder the command
    needs); a usage error (exit 2), as an --engine that names no artifact is."""

    exit_code = 2


class UnsupportedModelError(SdtrtError):
    """The model exists but its UNet needs inputs sdtrt does not export yet."""


class ConfigError(SdtrtError):
    """A stage configuration or shape profile is inconsistent."""


class RequestError(SdtrtError):
    """A request no model or engine could serve (image size, seed, steps); the CLI treats it as a usage error."""

    exit_code = 2


class ArtifactError(SdtrtError):
    """An input artifact is missing, incomplete, corrupt, or of the wrong stage."""


class ArtifactNotFoundError(ArtifactError):
    """A path or key that names no artifact (nothing there, no manifest, no key of the store, or a key prefix several
    share); given as --engine, a usage error (the CLI maps it)."""


class WrongArtifactError(ArtifactError):
    """An artifact of a kind the command cannot take (a Q/DQ graph, or one without module scopes, for check-blocks);
    a usage error (exit 2): the message names what to pass instead."""

    exit_code = 2


class StoreError(SdtrtError):
    """The artifact store cannot be used (not writable, not a directory, …)."""


class ExportError(SdtrtError):
    """torch → ONNX export failed."""


class SimplifyError(SdtrtError):
    """Both onnxsim and the constant-folding fallback failed, or the result does not match."""


class BuildError(SdtrtError):
    """An engine build failed; the message points at its log."""


class EnvironmentMismatchError(SdtrtError):
    """An engine was built for another TensorRT version or GPU and must be rebuilt here."""


class EngineMismatchError(SdtrtError):
    """An engine and a model that do not belong together (other family, shapes or weights).

    A usage error (exit 2), like RequestError: the command line pairs them, and it is refused before
    any model loads; the fix is the right --model, or none (the engine's own).
    """

    exit_code = 2


class MissingDependencyError(SdtrtError):
    """An optional dependency (CUDA, TensorRT, torch-tensorrt) is not available here."""


class EngineInputError(SdtrtError):
    """A request's shape, dtype or extra inputs do not fit what the engine was built for."""


class LoraError(SdtrtError, ValueError):
    """A LoRA cannot be applied: unreadable file, another architecture, a weight the map cannot place, a bad scale.

    Raised before the engine's weights change: the engine keeps serving the weights it had. A ValueError too, as
    diffusers' LoRA API raises for the same problems, so code written against it catches it on engines.
    """


class LoraFamilyError(LoraError):
    """A LoRA for another family of model than the one it is given to, told by its names or shapes: a usage error
    (exit 2)."""

    exit_code = 2


class RefitError(LoraError):
    """An engine's refit failed after it began: some of its weights may have changed (next swap rewrites them)."""


class ServeError(SdtrtError):
    """Triton Inference Server did not start, stopped, or answered a request with an error."""


class ServeAddressError(ServeError):
    """``sdtrt serve``'s host or one of its ports cannot be bound: a usage error (exit 2), refused before Triton
    starts."""

    exit_code = 2


class BenchError(SdtrtError):
    """Every engine backend a benchmark was asked for failed: it measured no engine (exit 1, after its table)."""


class ParityError(SdtrtError):
    """An engine's outputs do not match the PyTorch reference within tolerance (CLI exit 3)."""

    exit_code = 3


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line for a message: its first line, or where it was raised when it has no message."""
    text = str(exc).strip()
    if text:
        return text.splitlines()[0][:limit]
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    cause = f" (caused by {type(exc.__cause__).__name__}: {one_line(exc.__cause__, limit)})" if exc.__cause__ else ""
    return f"no message, raised{where}{cause}"
