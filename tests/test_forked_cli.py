"""helpers.run_cli's forked commands (tests/forked_cli.py) keep what a subprocess per command proved: a fresh
process each (the state a command changes dies with it, the test process's is untouched, it starts as a process of
its own does), output captured at the file descriptor and C stdio flushed, exit codes and signals as subprocess
reports them, timeouts, sdtrt's output as a subprocess prints it, and what is read at import (SDTRT_DEBUG,
TERMINAL_WIDTH) in a fresh interpreter. The probe: tests/cli_probe.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from tests.forked_cli import CommandTimeout, run_forked, server
from tests.helpers import REPO, run_cli

SERVER_ARGV = ["-m", "tests.forked_cli"]


def probe(*args: str, cwd=REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PROBE_GIVEN": "yes", "SDTRT_DEBUG": "0"}
    return run_forked(list(args), env, cwd, timeout, module="tests.cli_probe")


def state(result: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(result.stdout.splitlines()[0])


def test_each_command_starts_as_a_process_of_its_own_and_leaves_nothing_behind(tmp_path):
    """The probe changes the environment, cwd, torch's RNG, logging, warnings and a signal handler: the next command
    starts without those changes, in the state a process of its own starts in, and the test process never had them."""
    mine = (dict(os.environ), os.getcwd(), torch.get_rng_state(), logging.getLogger().handlers[:], warnings.filters[:])
    first, second = (state(probe("a b", "0", cwd=tmp_path)) for _ in range(2))
    assert first["interpreter_argv"] == SERVER_ARGV, server().printed()  # forked, not a fresh interpreter
    env = os.environ | {"PROBE_GIVEN": "yes", "SDTRT_DEBUG": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))  # finds `tests` from tmp
    alone = subprocess.run(
        [sys.executable, "-m", "tests.cli_probe", "a b", "0"],
        capture_output=True, text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, check=True,
    )  # fmt: skip
    reference = state(alone)
    assert reference.pop("interpreter_argv") == ["-m", "tests.cli_probe", "a b", "0"]
    assert first.pop("pid") != second.pop("pid") != os.getpid()
    first.pop("interpreter_argv"), second.pop("interpreter_argv"), reference.pop("pid")
    # torch's, numpy's and Python's generators seeded afresh in each, as their imports seed a process of its own
    draws = [first.pop("rng"), second.pop("rng"), reference.pop("rng")]
    assert all(len({repr(draw[kind]) for draw in draws}) == 3 for kind in range(3)), draws
    assert first == second == reference
    assert first["args"] == ["a b", "0"] and first["argv0"] == str(REPO / "tests" / "cli_probe.py")
    assert first["cwd"] == str(tmp_path) and first["stdin_is_devnull"]
    # the call's environment and what the CLI's import sets in a process of its own; nothing the probe set
    assert first["env"] == {"PROBE_GIVEN": "yes", "TERMINAL_WIDTH": "160"}
    assert first["sigterm"] == str(signal.SIG_DFL)
    environ, cwd, rng, handlers, filters = mine
    assert dict(os.environ) == environ and os.getcwd() == cwd and torch.equal(torch.get_rng_state(), rng)
    assert logging.getLogger().handlers == handlers and warnings.filters == filters


def test_output_below_python_is_captured_and_c_stdio_flushed_at_exit():
    """The probe fully buffers C's stdout (as C does for a file when Python is not run unbuffered) and printf's
    without a newline: only exit's flush writes it."""
    result = probe("0")
    assert result.stderr == "written by C\n"
    assert result.stdout.splitlines()[1:] == ["printed by C"]


def test_exit_codes_crashes_and_uncaught_errors_as_subprocess_reports_them():
    assert probe("3").returncode == 3
    assert probe("-1").returncode == 255  # the interpreter's exit status is the code's low byte: not a signal
    assert probe("abort").returncode == -signal.SIGABRT
    raised = probe("raise")
    assert raised.returncode == 1 and raised.stderr.strip().endswith("RuntimeError: uncaught")


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs():
    """The server is warm first: the limit runs out on the command, not on the server's imports."""
    assert probe("0").returncode == 0
    with pytest.raises(CommandTimeout) as timed_out:
        probe("sleep", timeout=2)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(timed_out.value.pid, 0)
    assert probe("0").returncode == 0


def test_sdtrt_prints_what_its_own_process_prints():
    """A usage error: typer's program name (python -m sdtrt) and rich's box at the CLI's width without a terminal."""
    forked, alone = (run_cli("export", "--precision", "fp8", forked=forked) for forked in (True, False))
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    assert forked.returncode == 2 and "python -m sdtrt export" in forked.stderr


def test_a_command_that_imports_torch_and_diffusers_prints_what_its_own_process_prints(tiny, tmp_path):
    """Whatever their imports print (a warning, a C++ log line) is in its own process's output: the fork's too."""
    out = tmp_path / "random.safetensors"
    args = ("lora", "random", "--model", "tiny", "--out", str(out), "--rank", "4")
    forked, alone = (run_cli(*args, forked=forked) for forked in (True, False))
    assert (forked.returncode, forked.stdout, untimed(forked.stderr)) == (0, alone.stdout, untimed(alone.stderr))
    assert forked.stdout.strip().endswith(str(out))


def untimed(output: str) -> str:
    """Without the steps' times: its own process's first step includes the imports."""
    return re.sub(r"\(\d+\.\d s\)", "(s)", output)


def test_what_is_read_at_import_runs_in_a_fresh_interpreter():
    """SDTRT_DEBUG (sdtrt/cli/app.py) and TERMINAL_WIDTH (typer) are read when the CLI is imported: a call that sets
    them other than the server's imports saw them gets a fresh interpreter."""
    debug = run_cli("export", "--model", "no-such-preset", env={"SDTRT_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    narrow, wide = (run_cli("export", "--precision", "fp8", env={"TERMINAL_WIDTH": width}) for width in ("100", "160"))
    assert max(map(len, narrow.stderr.splitlines())) == 100 < max(map(len, wide.stderr.splitlines()))
