"""The documentation site: it builds with ``mkdocs build --strict``, every page in its nav exists, its CLI reference
lists every command of the Typer app, and its Python snippets import from the package top and run as written."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import REPO

DOCS = REPO / "docs"
# What library users saw before: see test_readme.py.
NOISE = ("deprecated", "Loading pipeline components", "Loading weights", "it/s]")


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def nav_pages(nav: list) -> list[str]:
    """Every page file mkdocs.yml's nav lists, in order."""
    out = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def mkdocs_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with the venv's mkdocs into a temporary folder (strict: any warning fails it)."""
    out = tmp_path_factory.mktemp("site")
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return out


def test_every_page_in_the_nav_exists_and_is_built(site):
    pages = nav_pages(mkdocs_config()["nav"])
    assert len(pages) >= 20
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, f"pages in mkdocs.yml's nav that docs/ lacks: {missing}"
    for page in pages:  # guide/lora.md → guide/lora/index.html, families/index.md → families/index.html
        folder = page.removesuffix(".md").removesuffix("index").rstrip("/")
        assert (site / folder / "index.html").is_file(), f"{page} was not built"


def test_every_page_of_docs_is_in_the_nav():
    """A page left out of the nav is built but unreachable: mkdocs only logs it at INFO, so --strict passes."""
    pages = set(nav_pages(mkdocs_config()["nav"]))
    files = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md") if "hooks" not in path.relative_to(DOCS).parts}
    assert files - pages == set()


def cli_commands() -> list[tuple[str, ...]]:
    """Every command and subcommand of the Typer app, as paths (``("sdtrt", "cache", "ls")``)."""
    import typer.main

    import sdtrt.cli  # noqa: F401  (registers the commands on the app)
    from sdtrt.cli.app import app

    def walk(command, path):
        yield path
        for name, sub in getattr(command, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                yield from walk(sub, (*path, name))

    return list(walk(typer.main.get_command(app), ("sdtrt",)))


def test_the_cli_reference_lists_every_command_with_its_options(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    commands = cli_commands()
    assert len(commands) >= 20 and ("sdtrt", "cache", "ls") in commands
    missing = [" ".join(path) for path in commands if f'id="{"-".join(path)}"' not in page]
    assert not missing, f"commands the CLI reference does not list: {missing}"
    # Options are there too, with their help: one per command group is enough to tell.
    for option in ("--compute-capability", "--weight-streaming-budget", "--older-than", "--metrics-port"):
        assert option in page, option


def test_the_layer_list_names_every_layer(site):
    page = (site / "architecture" / "index.html").read_text()
    for name in ("core", "sources", "runtime", "stages", "standins", "cli"):
        assert name in page, name


# Every ```python block of the docs and the READMEs: (file, index, code).
DOC_SNIPPETS = [
    (str(path.relative_to(REPO)), i, code)
    for path in sorted([*DOCS.rglob("*.md"), REPO / "README.md"])
    if path.is_file() and "hooks" not in path.parts
    for i, code in enumerate(python_blocks(path))
]


def sdtrt_imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each ``import sdtrt…`` / ``from sdtrt… import …`` in a snippet."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sdtrt":
            out.append((node.module or "", [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "sdtrt"]
    return out


@pytest.mark.parametrize("where,index,code", DOC_SNIPPETS)
def test_docs_snippets_import_only_from_the_package_top(where, index, code):
    deep = [module for module, _ in sdtrt_imports(code) if module != "sdtrt"]
    assert not deep, f"{where} snippet {index} imports {deep}: use `from sdtrt import …`"


def exported() -> set[str]:
    """The public names ``sdtrt/__init__.py`` lists in ``__all__``."""
    import sdtrt

    return set(sdtrt.__all__)


def test_the_api_reference_documents_every_exported_name():
    names = exported()
    page = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: sdtrt\.(\w+)$", page, flags=re.M))
    assert names - {"__version__"} <= documented, f"exported but not documented: {sorted(names - documented)}"


@pytest.mark.parametrize("readme", ["README.md", "CONTRIBUTING.md"])
def test_the_readmes_links_reach_files_of_the_repository(readme):
    """The READMEs link into docs/ by path (GitHub renders them), which mkdocs --strict does not check."""
    path = REPO / readme
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in link]
    broken = [link for link in links if link and not (REPO / link).exists()]
    assert not broken, f"{readme} links to what the repository lacks: {broken}"
