"""MkDocs hook: the package's layer table on the architecture page, generated from the table the tests enforce.

``tests/test_layers.py`` holds ``LAYER_ORDER`` (the package's folders, bottom to top) and fails when a module imports
from a layer above its own or lies outside the layer folders. This hook reads that order from the test's source (AST,
nothing imported), walks each folder and reads each module's docstring, and replaces the marker in ``docs/architecture.md``
with one section per layer, so the page cannot drift from what the tests check.
"""

from __future__ import annotations

import ast
import html
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGE = "architecture.md"
MARKER = "<!-- sdtrt-layers -->"
TABLE = REPO / "tests" / "test_layers.py"


def layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layers bottom to top, each a folder of the package (``LAYER_ORDER`` of tests/test_layers.py, read from
    its source) with the top-level modules ``TOP_LEVEL`` places in it."""
    tree = ast.parse(TABLE.read_text(), str(TABLE))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("LAYER_ORDER", "TOP_LEVEL"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    if set(found) != {"LAYER_ORDER", "TOP_LEVEL"}:
        raise ValueError(f"{TABLE} has no LAYER_ORDER and TOP_LEVEL")
    return [
        (folder, (f"sdtrt.{folder}", *(m for m, at in found["TOP_LEVEL"].items() if at == folder)))
        for folder in found["LAYER_ORDER"]
    ]


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, as markdown (RST ``code`` becomes `code`)."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    sentence = re.split(r"(?<=\.)\s+(?=[A-Z])", paragraph, maxsplit=1)[0]
    parts = re.split(r"(``[^`]+``|`[^`]+`)", sentence)
    return "".join(
        f"`{p.strip('`')}`" if p.startswith("`") else html.escape(p, quote=False).replace("*", r"\*") for p in parts
    )


def submodules(package: Path) -> list[tuple[str, Path]]:
    """(dotted name, file) of the modules directly inside a package folder, sorted."""
    root = package.parent
    out = []
    for path in sorted(root.iterdir()):
        if path.suffix == ".py" and path.name != "__init__.py":
            out.append((path.stem, path))
        elif (path / "__init__.py").is_file():
            out.append((path.name, path / "__init__.py"))
    return out


def render() -> str:
    lines: list[str] = []
    for number, (name, modules) in enumerate(layers(), start=1):
        lines += [f"### {number}. {name}", ""]
        for module in modules:
            path = module_file(module)
            if path is None:
                lines.append(f"- `{module}`")
                continue
            lines.append(f"- `{module}`: {summary(path)}")
            if path.name == "__init__.py" and module != "sdtrt":
                for sub, sub_path in submodules(path):
                    lines.append(f"    - `{module}.{sub}`: {summary(sub_path)}")
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs event: the architecture page gets the layer sections in place of its marker."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER!r}: the layer table has nowhere to go")
    return markdown.replace(MARKER, render())


if __name__ == "__main__":
    print(render())
