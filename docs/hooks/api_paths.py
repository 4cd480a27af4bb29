"""MkDocs hook, temporary: where each documented top-level name lives until ``sdtrt`` exports it.

The API reference documents ``sdtrt.load_pipeline``, ``sdtrt.Store``, … — the names importable from the package
top. Until ``sdtrt/__init__.py`` lists a name in its ``__all__``, this hook points the page's ``::: sdtrt.NAME``
at the module that defines it today. Once every name is exported it fails the build on purpose: delete this file
and its line under ``hooks:`` in mkdocs.yml.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGE = "reference/api.md"

# The modules that define the documented names before the package top exports them.
DEFINED_IN = {
    "load_pipeline": "pipeline", "set_loras": "pipeline", "generate": "pipeline", "GenerateRequest": "request",
    "compile_model": "compile", "CompileResult": "compile", "validate": "validate", "ValidationReport": "validate",
    "resolve_model": "models", "ModelSource": "models", "Store": "store", "Artifact": "store",
    "ExportConfig": "config", "SimplifyConfig": "config", "QuantizeConfig": "config", "OrtBuildConfig": "config",
    "TrtBuildConfig": "config", "ValidationConfig": "config", "BenchConfig": "config",
}  # fmt: skip


def exported() -> set[str]:
    """The names ``sdtrt/__init__.py`` lists in ``__all__`` (read from its source, nothing imported)."""
    tree = ast.parse((REPO / "sdtrt" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:  # computed: trust it
                return set(DEFINED_IN) | {"SdtrtError"}
    return set()


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    top = exported()
    if top:
        raise ValueError(
            "sdtrt/__init__.py has an __all__ now: delete docs/hooks/api_paths.py and its line in mkdocs.yml, "
            "so the API reference documents the names it exports"
        )

    def deep(found: re.Match[str]) -> str:
        name = found.group(2)
        module = DEFINED_IN.get(name) or ("errors" if name.endswith("Error") else None)
        return f"{found.group(1)}sdtrt.{module}.{name}" if module else found.group(0)

    return re.sub(r"^(::: )sdtrt\.(\w+)$", deep, markdown, flags=re.M)
