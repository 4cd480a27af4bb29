"""`sdtrt` commands in processes forked from a server that imported the CLI and its heavy libraries once.

A subprocess per command pays Python's, torch's, diffusers' and onnx's imports every time (3–8 s of CPU). A fork of
a process that imported them and ran nothing pays none of it, and keeps what the subprocess proved: each command runs
in a process of its own (its exit code, a crash's signal, what it does to the environment, torch's RNG, logging,
warnings filters, cwd and signal handlers end with it), on file descriptors 0–2 of its own (C++ and third-party
output is captured), as ``python -m sdtrt`` runs (its __main__, argv[0], click's program name), and exits as the
interpreter does (uncaught exceptions, threads joined, atexit handlers), C++'s static destructors aside. What it
cannot keep is what the server read at import: SDTRT_DEBUG is (sdtrt/cli/app.py), so helpers.run_cli runs a call
that turns it on as a subprocess; the variables the CLI's import sets (third-party quieting, TERMINAL_WIDTH) are set
in each command's environment as that import sets them. tests/test_forked_cli.py proves each of these.

Run as ``python -m tests.forked_cli``: one JSON request a line on stdin (module, args, env, cwd, out, err files); for
each it forks, answers the command's pid, then its exit code as subprocess reports it (a signal's is negative).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a command imports lazily, imported once: the server runs nothing of them (no thread pool is started before the
# forks: a forked child of a process whose OpenMP pool ran can hang on it).
PRELOADED = (
    "torch",
    "onnx",
    "onnxruntime",
    "diffusers",
    "transformers",
    "sdtrt.tools.compile",
    "sdtrt.pipeline.loading",
)


class CliServer:
    """The forking server, started on first use by this (test) process with the environment calls start from."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_cli"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
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
            try:
                pid = int(self.reply(timeout))  # the first waits for the server's imports
            except subprocess.TimeoutExpired:  # a server that does not answer is stopped: the next call starts another
                self.process.kill()
                self.process.wait()
                raise
            try:
                code = int(self.reply(timeout))
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does to its child; the server reaps it and answers
                self.reply(60)
                raise subprocess.TimeoutExpired(["sdtrt", *args], timeout) from None
            return subprocess.CompletedProcess(["sdtrt", *args], code, out.read_text(), err.read_text())

    def reply(self, timeout: float) -> str:
        assert self.process.stdout
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("sdtrt", timeout)
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the forking CLI server exited ({self.process.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        assert self.process.stdin
        self.process.stdin.close()  # the server exits at the end of its input, or is stopped if still importing
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_servers: list[CliServer] = []
IMPORT_SET: dict[str, str] = {}  # in the server: the environment variables its imports set


def run_forked(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float, module: str = "sdtrt"
) -> subprocess.CompletedProcess[str]:
    """``python -m sdtrt *args`` in a fork of this process's server, captured as ``subprocess.run(capture_output=True)``
    returns it (``module``: tests/test_forked_cli.py's probe of what a fork keeps apart)."""
    if not _servers or _servers[0].process.poll() is not None:
        _servers[:] = [CliServer(os.environ | {"SDTRT_DEBUG": "0"})]
        atexit.register(_servers[0].close)
    return _servers[0].run(module, args, env, cwd, timeout)


def serve() -> dict | None:
    """The server's loop: in a forked child, returns the child's request; in the server, None once stdin closes."""
    requests, replies = os.fdopen(os.dup(0), "r"), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # nothing imported or run reads or writes the protocol
        os.dup2(null, fd)
    os.close(null)
    for line in requests:
        pid = os.fork()
        if pid == 0:
            requests.close()  # not held open by what the command leaves running
            os.close(replies)
            return json.loads(line)
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    return None


def run_command(request: dict) -> None:
    """In the forked child: the command's cwd, environment and file descriptors, ``python -m MODULE``, then the
    interpreter's exit without C++'s: torch's import started a thread the child has no copy of, and its static
    destructors wait on it forever."""
    import runpy
    import threading

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in IMPORT_SET.items():  # as the CLI's import sets them in a process of its own (setdefault)
        os.environ.setdefault(name, value)
    written = os.O_WRONLY | os.O_CREAT
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], written), (2, request["err"], written)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = ["-m", *request["args"]]  # runpy writes argv[0]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter reads it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: its threads joined, then atexit's
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # killed by the signal, as the interpreter exits on an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    import importlib

    before = dict(os.environ)
    import sdtrt.cli  # noqa: F401  first, as `python -m sdtrt` imports it: it quiets the libraries below

    for name in PRELOADED:
        importlib.import_module(name)
    IMPORT_SET = {name: value for name, value in os.environ.items() if before.get(name) != value}
    child_request = serve()
    if child_request is None:
        os._exit(0)  # the server ran nothing: no teardown of torch's and diffusers' modules to wait for (seconds)
    run_command(child_request)
