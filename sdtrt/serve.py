"""Serve: a real Triton Inference Server over a model repository that ``sdtrt deploy triton`` wrote.

The server comes from the ``nvidia-pytriton`` wheel (extra ``serve``: a tritonserver 2.51 build with
the Python backend, which runs on machines with or without a GPU), else from a ``tritonserver`` on
PATH with its own backends (NGC's ``tritonserver`` image). The wheel ships one Python-backend stub per
Python version, and Triton looks for the stub in the backend's folder: the backend is staged once
under ``~/.cache/sdtrt/triton`` with the stub for the running Python beside it. The server runs with
this interpreter's ``bin`` first on PATH, so the stub's Python sees this environment's packages (sdtrt
included).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import MissingDependencyError, ServeError

STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # the address every endpoint binds; 0.0.0.0 serves other machines
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    start_timeout_s: float = 300.0  # until every model in the repository is ready

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


def tritonserver_command() -> list[str]:
    """tritonserver and its backend directory: the nvidia-pytriton wheel's, else the one on PATH."""
    try:
        import pytriton
    except ImportError:
        found = shutil.which("tritonserver")
        if found is None:
            raise MissingDependencyError(
                "no tritonserver here: `pip install 'sdtrt[serve]'` (nvidia-pytriton bundles one) or run in NGC's "
                "tritonserver image (make docker-serve)"
            ) from None
        return [found]
    dist = Path(pytriton.__file__).parent / "tritonserver"
    return [str(dist / "bin" / "tritonserver"), f"--backend-directory={_staged_backends(dist)}"]


def _staged_backends(dist: Path) -> Path:
    """A backend directory whose python/ holds the wheel's Python backend and the stub for this Python."""
    from importlib import metadata

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / python / STUB
    if not stub.is_file():
        raise MissingDependencyError(f"nvidia-pytriton has no Python-backend stub for Python {python}")
    root = Path.home() / ".cache" / "sdtrt" / "triton" / f"pytriton-{metadata.version('nvidia-pytriton')}-py{python}"
    if not (root / "python" / STUB).is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root.parent))
        shutil.copytree(dist / "backends", staging, dirs_exist_ok=True)
        shutil.copy2(stub, staging / "python" / STUB)
        try:
            staging.rename(root)
        except OSError:  # staged meanwhile by another process
            shutil.rmtree(staging)
    return root


def _environment() -> dict[str, str]:
    """This interpreter's ``bin`` first on PATH and its ``libpython`` first on LD_LIBRARY_PATH: the stub then
    embeds the very Python that runs sdtrt (another 3.x build's libpython fails on its extension modules)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = [str(sysconfig.get_config_var("LIBDIR"))] if sysconfig.get_config_var("Py_ENABLE_SHARED") else []
    try:
        import pytriton
    except ImportError:
        pass
    else:
        libs.append(str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


class TritonServer:
    """A running tritonserver; stop it with ``stop()`` or by leaving its ``with`` block."""

    def __init__(self, repository: Path, config: ServeConfig, log: IO[Any] | None = None) -> None:
        self.repository = Path(repository)
        self.config = config
        self.log = log
        if not self.repository.is_dir():
            raise ServeError(f"model repository {repository} is not a directory; write one with `sdtrt deploy triton`")
        command = [
            *tritonserver_command(),
            f"--model-repository={self.repository.resolve()}",
            *(f"--{api}-address={config.host}" for api in ("http", "grpc", "metrics")),
            f"--http-port={config.http_port}",
            f"--grpc-port={config.grpc_port}",
            f"--metrics-port={config.metrics_port}",
        ]
        self.process = subprocess.Popen(
            command, env=_environment(), stdin=subprocess.DEVNULL, stdout=log or sys.stderr, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        """Return once every model is loaded; ServeError when the server exits or the time runs out."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServeError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready ({self._log_hint()})"
                )
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServeError(f"tritonserver was not ready after {self.config.start_timeout_s:.0f} s ({self._log_hint()})")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.config.http_url}/v2/health/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the server (SIGTERM: Triton finishes its requests in flight first, then SIGKILL); its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _log_hint(self) -> str:
        name = getattr(self.log, "name", None)
        return f"its log is {name}" if isinstance(name, str) else "its log is above"

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(repository: Path, config: ServeConfig = ServeConfig(), log: IO[Any] | None = None) -> TritonServer:
    """Start tritonserver on ``repository`` and wait until its models are ready; the server's log goes to ``log``
    (default: stderr)."""
    server = TritonServer(repository, config, log)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` TCP ports free on ``host`` now (the OS picks them; another process may take one later)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
