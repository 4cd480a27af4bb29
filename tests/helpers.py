"""Helpers for tests that drive the CLI as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = False, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sdtrt`` as a user would, capturing its output."""
    full_env = os.environ | {"SDTRT_DEBUG": "0"} | (env or {})
    result = subprocess.run(
        [sys.executable, "-m", "sdtrt", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=kwargs.pop("cwd", REPO),
        stdin=subprocess.DEVNULL,
        timeout=kwargs.pop("timeout", 600),
        **kwargs,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"sdtrt {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
