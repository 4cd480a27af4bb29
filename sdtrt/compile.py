"""The whole chain for one model: export → simplify (→ build → wrap, per target)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import ExportConfig, SimplifyConfig
from .models import ModelSource
from .stages import export, simplify
from .store import Artifact, Store


@dataclass(frozen=True)
class CompileResult:
    """Every artifact the chain produced, in order; ``final`` is what a runtime loads."""

    artifacts: list[Artifact] = field(default_factory=list)

    @property
    def final(self) -> Artifact:
        return self.artifacts[-1]


def compile_model(
    model: ModelSource,
    store: Store,
    export_config: ExportConfig = ExportConfig(),
    simplify_config: SimplifyConfig = SimplifyConfig(),
) -> CompileResult:
    exported = export.run(export_config, model, store)
    simplified = simplify.run(simplify_config, exported, store)
    return CompileResult([exported, simplified])
