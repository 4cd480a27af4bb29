"""Every command README.md shows runs, and so does every Python snippet of the README and the getting-started page.

- ``sdtrt …`` lines of the README's shell blocks run for real, in order, in a folder whose ``engines`` is the
  session's store (the ``engines/set/<key>`` a later line names is the one the compile before it printed);
- ``make …`` lines are checked with ``make -n`` (the target exists and its recipe expands): CI itself runs
  ``make setup`` and ``make test`` (.ci/run), test_docs.py builds the docs, and the docker targets need Docker;
- Python snippets (those that need CUDA run in the gpu tests) run as written, in a fresh process, without the
  third-party noise library users saw before.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

README = REPO / "README.md"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
# What library users saw before: diffusers' deprecation of sdtrt's own torch_dtype argument and the
# loading bars of diffusers and transformers.
NOISE = ("deprecated", "Loading pipeline components", "Loading weights", "it/s]")


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def shell_lines(path: Path) -> list[str]:
    """The commands of a page's ```bash blocks, comments stripped."""
    lines = [line.split(" #", 1)[0].strip() for block in blocks(path, "bash") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def python_snippets() -> list[tuple[str, str]]:
    """(where, code) of the CPU snippets of README.md and the getting-started page, each code once."""
    seen: dict[str, str] = {}
    for path in (README, GETTING_STARTED):
        for index, code in enumerate(blocks(path, "python")):
            if "cuda" not in code:
                seen.setdefault(code, f"{path.name}:{index}")
    return [(where, code) for code, where in seen.items()]


SNIPPETS = python_snippets()
COMMANDS = shell_lines(README)


def test_the_readme_is_short_and_shows_the_commands_and_a_script():
    assert len(README.read_text().splitlines()) < 250
    assert {"make setup", "make demo", "make test"} <= set(COMMANDS)
    assert any(line.startswith("sdtrt compile") for line in COMMANDS)
    assert len(SNIPPETS) >= 2


def run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SDTRT_ENGINES", "SDTRT_DEBUG")}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout
    )


def test_every_command_of_the_readme_runs(tmp_path, store):
    (tmp_path / "engines").symlink_to(store.root, target_is_directory=True)
    printed: str | None = None
    for line in COMMANDS:
        words = shlex.split(line)
        if words[0] == "make":
            result = run(["make", "-n", "-C", str(REPO), *words[1:]], tmp_path, timeout=60)
        elif words[0] == "sdtrt":
            if printed is not None:
                words = [w.replace("engines/set/<key>", printed) for w in words]
            assert not any("<" in w for w in words), f"{line}: names a placeholder no earlier command printed"
            result = run([sys.executable, "-m", "sdtrt", *words[1:]], tmp_path)
            if words[1] == "compile" and result.returncode == 0:
                printed = result.stdout.strip().splitlines()[-1]
        else:
            raise AssertionError(f"README command {line!r}: neither make nor sdtrt, so no test runs it")
        assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("where,code", SNIPPETS, ids=[where for where, _ in SNIPPETS])
def test_python_snippet_runs_as_written_without_third_party_noise(where, code, tmp_path, store):
    """In a folder whose ``engines`` is the session's store: the snippets start from the store `make demo` filled,
    so their compiles are the cache hits they say they are."""
    (tmp_path / "engines").symlink_to(store.root, target_is_directory=True)
    result = run([sys.executable, "-c", code], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in NOISE:
        assert noise not in result.stderr, f"library use printed {noise!r}:\n{result.stderr[-2000:]}"
