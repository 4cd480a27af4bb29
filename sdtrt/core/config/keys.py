"""What decides a stage's cache key: every config field enters it unless declared with ``not_in_key()`` (or
``in_key_unless()`` at its old value); ``cache_key`` returns exactly the fields that do, ``as_dict`` all of them."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def not_in_key(default: Any) -> Any:
    """A config field that does not change the artifact (checks, verbosity, tolerances)."""
    return field(default=default, metadata={"in_key": False})


def in_key_unless(default: Any, value: Any) -> Any:
    """A config field that enters the key only when it is not ``value`` (what every earlier build did), so
    adding the field changes no existing key."""
    return field(default=default, metadata={"key_unless": value})


def cache_key(config: Any) -> dict[str, Any]:
    """The fields of a config dataclass that change its stage's output, as plain JSON data."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.metadata.get("in_key", True):
            continue
        if "key_unless" in f.metadata and getattr(config, f.name) == f.metadata["key_unless"]:
            continue
        out[f.name] = _plain(getattr(config, f.name))
    return out


def as_dict(config: Any) -> dict[str, Any]:
    """Every field of a config, for the manifest."""
    return {k: _plain(v) for k, v in dataclasses.asdict(config).items()}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return cache_key(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
