"""`sdtrt` commands in processes forked from a server that imported the CLI and its heavy libraries once.

A subprocess per command pays Python's, torch's, diffusers' and onnx's imports every time (3–8 s of CPU). A fork of
a process that imported them and ran nothing pays none of it, and keeps what the subprocess proved: each command
runs in a process of its own (its exit code, a crash's signal, what it does to the environment, torch's RNG,
logging, warnings filters, cwd and signal handlers end with it; torch and numpy are seeded afresh, as their imports
seed a process), on file descriptors 0–2 of its own (C and C++ output is captured, C stdio flushed at exit), as
``python -m sdtrt`` runs (its __main__, argv[0], click's program name), and exits as the interpreter does (uncaught
exceptions, threads joined, atexit handlers). It skips what ``os._exit`` skips: module teardown, the ``__del__`` of
objects still alive (ONNX Runtime sessions, a finalizer's temp dir) and C++'s static destructors, so what a command
leaves behind at exit is checked with ``forked=False``, as is anything that depends on Python's string-hash seed
(the order a set is walked in): the forks share the server's, which no fork can draw afresh.

What a fork cannot keep is what the server read at its start or its imports: a command whose environment differs
there (READ_AT_IMPORT: SDTRT_DEBUG, PYTHONPATH, HF_HOME, ...) replaces its forked process with a fresh interpreter,
as do all of them when the imports printed something (each command's stderr would miss it) or started a thread pool
(a fork's child cannot use it). The variables the CLI's import sets (third-party quieting, TERMINAL_WIDTH) are set in
each command's environment as that import sets them. tests/test_forked_cli.py proves each of these.

Run as ``python -m tests.forked_cli``: one JSON request a line on stdin (module, args, env, cwd, out, err files); for
each it forks, answers the command's pid, then its exit code as subprocess reports it (a signal's is negative).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a command imports lazily, imported once: the server runs nothing of them.
PRELOADED = (
    "torch",
    "onnx",
    "onnxruntime",
    "diffusers",
    "transformers",
    "sdtrt.tools.compile",
    "sdtrt.pipeline.loading",
)
# Read at interpreter start or at a library's import (interpreter options, libgomp, huggingface_hub's constants,
# diffusers' and transformers' verbosity, tqdm's and rich's defaults, typer's width, sdtrt's debug switch, the locale).
READ_AT_IMPORT = re.compile(
    r"PYTHON|SDTRT_DEBUG$|HF_|TRANSFORMERS_|DIFFUSERS_|TQDM_|TORCH_|OMP_|MKL_|TERMINAL_WIDTH$|NO_COLOR$|FORCE_COLOR$|LC_|LANG$"
    r"|HOME$|XDG_|TMPDIR$|USE_(TF|TORCH|SAFETENSORS)$"  # huggingface_hub's cache paths, tempfile's, transformers'
)
libc = ctypes.CDLL(None)


class CommandTimeout(subprocess.TimeoutExpired):
    """A command killed past its timeout; ``pid``: the process killed (reaped by then)."""

    def __init__(self, cmd: list[str], timeout: float, pid: int) -> None:
        super().__init__(cmd, timeout)
        self.pid = pid


class CliServer:
    """The forking server, started on first use by this (test) process with the environment calls start from."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  the server's stderr, read while it lives: its imports' output
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_cli"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=REPO,
            bufsize=0,
        )
        self.pending = b""  # replies read from the pipe, not yet taken (unbuffered: select sees what is unread)

    def run(
        self, module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory(prefix="sdtrt-cli-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            assert self.process.stdin
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            pid = 0
            try:
                pid = int(self.reply(max(timeout, 600)))  # the first waits for the server's imports
                code = int(self.reply(timeout))
            except subprocess.TimeoutExpired:
                self.abandon(pid)
                if not pid:  # a server that does not answer
                    raise
                raise CommandTimeout(["sdtrt", *args], timeout, pid) from None
            except BaseException:  # interrupted mid-command (pytest-timeout, Ctrl-C): its answers would be out of step
                self.abandon(pid)
                raise
            return subprocess.CompletedProcess(["sdtrt", *args], code, out.read_text(), err.read_text())

    def abandon(self, pid: int) -> None:
        """Kill the command ``pid`` (0: none started), as subprocess.run kills its child: the server reaps it and
        answers its exit, so the two are in step again; a server that does not answer is stopped, and the next call
        starts another rather than read this command's late answers as its own."""
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):  # it ended between the deadline and now
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reply(60)
                return
        self.stop()

    def reply(self, timeout: float) -> str:
        assert self.process.stdout
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("sdtrt", timeout)
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the forking CLI server exited ({self.process.wait()}):\n{self.printed()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def printed(self) -> str:
        """What the server wrote to its stderr: its imports' output, its refusal to fork, its traceback."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        assert self.process.stdin
        self.process.stdin.close()  # the server exits at the end of its input, or is stopped if still importing
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.stop()


_servers: list[CliServer] = []


def server() -> CliServer:
    """This process's server, started if none runs."""
    if not _servers or _servers[0].process.poll() is not None:
        _servers[:] = [CliServer(os.environ | {"SDTRT_DEBUG": "0"})]
        atexit.register(_servers[0].close)
    return _servers[0]


def run_forked(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float, module: str = "sdtrt"
) -> subprocess.CompletedProcess[str]:
    """``python -m sdtrt *args`` in a fork of this process's server, captured as ``subprocess.run(capture_output=True)``
    returns it (``module``: tests/test_forked_cli.py's probe of what a fork keeps apart)."""
    return server().run(module, args, env, cwd, timeout)


# In the server: the environment variables its imports set; why its commands cannot run in the forks ("" if they can).
IMPORT_SET: dict[str, str] = {}
CANNOT_FORK = ""


def serve(requests: int, replies: int) -> dict | None:
    """The server's loop: in a forked child, returns the child's request; in the server, None once stdin closes."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # nothing run writes the protocol or the server's log
    os.close(null)
    lines = os.fdopen(requests, "r")
    for line in lines:
        sys.stdout.flush()
        sys.stderr.flush()
        libc.fflush(None)  # nothing buffered is written again by each child
        pid = os.fork()
        if pid == 0:
            lines.close()  # not held open by what the command leaves running
            os.close(replies)
            return json.loads(line)
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    return None


def run_command(request: dict) -> None:
    """In the forked child: the command's cwd, environment and file descriptors, ``python -m MODULE``, then the
    interpreter's exit without C++'s: torch's import started a thread the child has no copy of, and its static
    destructors wait on it forever. A command the fork cannot run as its own process would replaces it with one."""
    import runpy
    import threading

    os.chdir(request["cwd"])
    written = os.O_WRONLY | os.O_CREAT
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], written), (2, request["err"], written)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    env = request["env"]
    if CANNOT_FORK or differs_at_import(env, dict(os.environ)):
        for name in ("SIGPIPE", "SIGXFSZ"):  # as subprocess restores them for its child
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.execve(sys.executable, [sys.executable, "-m", request["module"], *request["args"]], env)
    os.environ.clear()
    os.environ.update(env)
    for name, value in IMPORT_SET.items():  # as the CLI's import sets them in a process of its own (setdefault)
        os.environ.setdefault(name, value)
    import numpy
    import torch

    torch.seed()  # a seed of its own, as torch's and numpy's imports draw one (Python's random: reseeded at fork)
    numpy.random.seed()
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = ["-m", *request["args"]]  # runpy writes argv[0]
    code, killed_by = 0, 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # as the interpreter reads it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        killed_by = signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: its threads joined, then atexit's
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    libc.fflush(None)  # C stdio's buffers, as exit() flushes them (os._exit does not)
    if killed_by:  # as the interpreter exits on an uncaught KeyboardInterrupt
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    os._exit(code & 0xFF)


def differs_at_import(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether ``env`` differs from the server's (after its imports) in a variable read at import, as a process of
    its own would see it: with what the CLI's import sets where ``env`` does not."""
    own = {name: value for name, value in IMPORT_SET.items() if name not in env} | env
    names = {name for name in own.keys() | server_env.keys() if READ_AT_IMPORT.match(name)}
    return any(own.get(name) != server_env.get(name) for name in names)


def parallel_ops_hang_in_a_fork(limit: float = 60) -> bool:
    """Whether a fork's first parallel torch ops fail to finish: they do once an import ran one and started OpenMP's
    pool (the fork has no copy of its threads). The pools the imports start now (numpy's and scipy's OpenBLAS,
    onnxruntime's) are safe: a trial, as the thread count depends on the machine's cores."""
    pid = os.fork()
    if pid == 0:
        import torch

        torch.mm(torch.ones(256, 256), torch.ones(256, 256)).add_(1).sum()
        os._exit(0)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


if __name__ == "__main__":
    import importlib

    # The protocol moves off fds 0-1, which the imports see as a command's: no terminal, fd 1 on the log as fd 2 is.
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    before = dict(os.environ)
    import sdtrt.cli  # noqa: F401  first, as `python -m sdtrt` imports it: it quiets the libraries below

    for name in PRELOADED:
        importlib.import_module(name)
    IMPORT_SET = {name: value for name, value in os.environ.items() if before.get(name) != value}
    sys.stdout.flush()
    sys.stderr.flush()
    libc.fflush(None)
    if os.fstat(2).st_size:
        CANNOT_FORK = "the imports printed the lines above: a forked command's stderr would not show them"
    elif parallel_ops_hang_in_a_fork():
        CANNOT_FORK = "a parallel torch op does not finish in a fork: an import started a pool a fork cannot use"
    if CANNOT_FORK:
        print(f"tests.forked_cli: each command runs in a fresh interpreter: {CANNOT_FORK}", file=sys.stderr, flush=True)
    child_request = serve(requests, replies)
    if child_request is None:
        os._exit(0)  # the server ran nothing: no teardown of torch's and diffusers' modules to wait for (seconds)
    run_command(child_request)
