"""What a stage is asked to produce, and the key that names its artifact before any work is done."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .config import as_dict, cache_key

MANIFEST_FORMAT = 1


def environment(*packages: str) -> dict[str, str]:
    """Versions of the named distributions (and Python): the parts of a key no config shows."""
    env = {"python": platform.python_version()}
    for name in packages:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    return env


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class StageRequest:
    """What a stage is asked to produce; its key names the artifact before any work is done."""

    stage: str
    version: int
    config: Any  # a frozen config dataclass from sdtrt.core.config
    inputs: list[dict[str, Any]]  # each has "digest": a model digest or an upstream artifact key
    environment: dict[str, str]

    @property
    def key(self) -> str:
        return digest(
            {
                "stage": self.stage,
                "version": self.version,
                "config": cache_key(self.config),
                "inputs": [i["digest"] for i in self.inputs],
                "environment": self.environment,
            }
        )

    def base_manifest(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "stage": self.stage,
            "stage_version": self.version,
            "key": self.key,
            "config": as_dict(self.config),
            "config_key": cache_key(self.config),
            "inputs": self.inputs,
            "environment": self.environment,
        }
