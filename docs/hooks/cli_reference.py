"""MkDocs hook: the CLI reference, generated from the Typer app at every build, never kept by hand.

``docs/reference/cli.md`` holds the conventions shared by every command and the marker below; this hook
replaces the marker with one section per command and subcommand (its help, usage and options), walking
``typer.main.get_command(app)`` after ``import sdtrt.cli`` has registered every command on the app.
``python docs/hooks/cli_reference.py`` prints the generated markdown.
"""

from __future__ import annotations

import html
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGE = "reference/cli.md"
MARKER = "<!-- sdtrt-cli-reference -->"
# A help line that shows a command line: "Example: sdtrt …", "Inpainting: sdtrt …" (mid-paragraph too).
EXAMPLE = re.compile(r"(?:^|(?<=\. ))([A-Z][\w -]*): (sdtrt .+)$")


def root_command() -> Any:
    """The click command Typer builds from sdtrt's app, every command registered."""
    if sys.path[:1] != [str(REPO)]:  # this checkout's sdtrt, before any installed one
        sys.path.insert(0, str(REPO))
    import typer.main

    import sdtrt.cli  # noqa: F401  (registers the command modules on the app)
    from sdtrt.cli.app import app

    return typer.main.get_command(app)


def walk(
    command: Any, path: tuple[str, ...] = ("sdtrt",), parent: Any = None
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(command path, command, its context) for the command and every subcommand below it, in registration order."""
    ctx = command.make_context(path[-1], [], parent=parent, resilient_parsing=True)
    yield path, command, ctx
    for name, sub in getattr(command, "commands", {}).items():
        if not getattr(sub, "hidden", False):
            yield from walk(sub, (*path, name), ctx)


def command_paths() -> list[str]:
    """Every command of the app as the user types it: ``sdtrt compile``, ``sdtrt cache ls``, …"""
    return [" ".join(path) for path, _, _ in walk(root_command())]


def _text(text: str) -> str:
    """Help text as markdown: code spans kept, everything else escaped (``<key>``, ``[default: …]``, pipes)."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
        else:
            escaped = html.escape(part, quote=False)
            out.append(re.sub(r"([\[\]|*_])", r"\\\1", escaped))
    return "".join(out)


def _help(text: str) -> list[str]:
    """A command's help as paragraphs, its command-line examples as shell blocks."""
    lines: list[str] = []
    for paragraph in re.split(r"\n\s*\n", (text or "").strip()):
        prose: list[str] = []
        for line in paragraph.splitlines():
            found = EXAMPLE.search(line.strip())
            if not found:
                prose.append(line.strip())
                continue
            before = line.strip()[: found.start()].strip()
            if before:
                prose.append(before)
            if prose:
                lines += [_text(" ".join(prose)), ""]
                prose = []
            lines += [f"{found.group(1)}:", "", "```bash", found.group(2), "```", ""]
        if prose:
            lines += [_text(" ".join(prose)), ""]
    return lines


def _usage(path: tuple[str, ...], command: Any, ctx: Any) -> str:
    pieces = ["[OPTIONS]"] if any(p.param_type_name == "option" for p in command.get_params(ctx)) else []
    pieces += [p.name.upper() for p in command.get_params(ctx) if p.param_type_name == "argument"]
    if getattr(command, "commands", None):
        pieces.append("COMMAND [ARGS]...")
    return " ".join([*path, *pieces])


def _params(command: Any, ctx: Any) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False) or "--help" in getattr(param, "opts", ()):
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        declaration, text = record
        if param.param_type_name == "argument":
            declaration = f"{param.name.upper()} ({declaration.split(' ', 1)[-1].strip('<>')})"
        cell = _text(" ".join((text or "").split()))
        rows.append(f"| `{declaration}` | {cell} |")
    if not rows:
        return []
    return ["| Argument or option | Description |", "|---|---|", *rows, ""]


def render() -> str:
    """The markdown of every command: help, usage, arguments and options."""
    lines: list[str] = []
    for path, command, ctx in walk(root_command()):
        level = "###" if len(path) <= 2 else "####"  # sdtrt and sdtrt compile: ###, sdtrt cache ls: ####
        name = " ".join(path)
        anchor = "-".join(path)
        lines += [f"{level} `{name}` {{#{anchor}}}", ""]
        lines += _help(command.help or "")
        lines += ["```text", _usage(path, command, ctx), "```", ""]
        lines += _params(command, ctx)
        subcommands = [n for n, c in getattr(command, "commands", {}).items() if not getattr(c, "hidden", False)]
        if subcommands:
            links = ", ".join(f"[`{' '.join((*path, n))}`](#{'-'.join((*path, n))})" for n in subcommands)
            lines += [f"Commands: {links}.", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs event: the CLI reference page gets the generated sections in place of its marker."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER!r}: the generated reference has nowhere to go")
    return markdown.replace(MARKER, render())


if __name__ == "__main__":
    print(render())
