"""helpers.run_cli's forked commands (tests/forked_cli.py) keep what a subprocess per command proved: a fresh
process each (the state a command changes dies with it, the test process's is untouched), output captured at the
file descriptor, exit codes and signals as subprocess reports them, timeouts, sdtrt's output as a subprocess prints
it, and SDTRT_DEBUG (read at import) in a subprocess of its own. The probe: tests/cli_probe.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import warnings

import pytest
import torch

from tests.forked_cli import run_forked
from tests.helpers import REPO, run_cli


def probe(*args: str, cwd=REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PROBE_GIVEN": "yes"}
    return run_forked(list(args), env, cwd, timeout, module="tests.cli_probe")


def test_each_command_starts_from_the_same_fresh_state_and_leaves_none_behind(tmp_path):
    """The probe changes the environment, cwd, torch's RNG, logging, warnings and a signal handler: the next command
    starts without those changes, and the test process never had them."""
    mine = (dict(os.environ), os.getcwd(), torch.get_rng_state(), logging.getLogger().handlers[:], warnings.filters[:])
    first, second = (json.loads(probe("a b", "0", cwd=tmp_path).stdout) for _ in range(2))
    assert first.pop("pid") != second.pop("pid") != os.getpid()
    assert first == second
    assert first["args"] == ["a b", "0"] and first["argv0"] == str(REPO / "tests" / "cli_probe.py")
    assert first["cwd"] == str(tmp_path) and first["stdin_is_devnull"]
    # the call's environment and what the CLI's import sets in a process of its own; nothing the probe set
    assert first["env"] == {"PROBE_GIVEN": "yes", "TERMINAL_WIDTH": "160"}
    assert first["sigterm"] == str(signal.SIG_DFL)
    environ, cwd, rng, handlers, filters = mine
    assert dict(os.environ) == environ and os.getcwd() == cwd and torch.equal(torch.get_rng_state(), rng)
    assert logging.getLogger().handlers == handlers and warnings.filters == filters


def test_output_below_python_is_captured():
    assert probe("0").stderr == "written by C\n"


def test_exit_codes_crashes_and_uncaught_errors_as_subprocess_reports_them():
    assert probe("3").returncode == 3
    assert probe("abort").returncode == -signal.SIGABRT
    raised = probe("raise")
    assert raised.returncode == 1 and raised.stderr.strip().endswith("RuntimeError: uncaught")


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs():
    with pytest.raises(subprocess.TimeoutExpired):
        probe("sleep", timeout=2)
    assert probe("0").returncode == 0


def test_sdtrt_prints_what_its_own_process_prints():
    """A usage error: typer's program name (python -m sdtrt) and rich's box at the CLI's width without a terminal."""
    forked, alone = (run_cli("export", "--precision", "fp8", forked=forked) for forked in (True, False))
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    assert forked.returncode == 2 and "python -m sdtrt export" in forked.stderr


def test_sdtrt_debug_runs_in_a_process_of_its_own():
    """SDTRT_DEBUG is read when the CLI is imported: run_cli runs a call that turns it on as a subprocess."""
    result = run_cli("export", "--model", "no-such-preset", env={"SDTRT_DEBUG": "1"})
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
