"""Runtimes: one small interface over every backend that can run a component's graph (see base.py)."""

from .base import Runtime, artifact_profile, open_runtime

__all__ = ["Runtime", "artifact_profile", "open_runtime"]
