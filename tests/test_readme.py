"""Every Python snippet in README.md runs as written (those that need a CUDA GPU run in the gpu tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .helpers import REPO

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
CPU_SNIPPETS = [s for s in SNIPPETS if "cuda" not in s]
# What library users saw before: diffusers' deprecation of sdtrt's own torch_dtype argument and the
# loading bars of diffusers and transformers.
NOISE = ("deprecated", "Loading pipeline components", "Loading weights", "it/s]")


def test_the_readme_has_cpu_snippets_to_run():
    assert len(CPU_SNIPPETS) >= 2


@pytest.mark.parametrize("snippet", CPU_SNIPPETS, ids=[f"snippet{i}" for i in range(len(CPU_SNIPPETS))])
def test_readme_snippet_runs_as_written_without_third_party_noise(snippet, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SDTRT_ENGINES", "SDTRT_DEBUG")}
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in NOISE:
        assert noise not in result.stderr, f"library use printed {noise!r}:\n{result.stderr[-2000:]}"
