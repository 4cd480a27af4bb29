"""Serve: a real Triton Inference Server over a model repository that ``sdtrt deploy triton`` wrote.

The server comes from the ``nvidia-pytriton`` wheel (extra ``serve``: a tritonserver 2.51 build with
the Python backend, which runs on machines with or without a GPU), else from a ``tritonserver`` on
PATH with its own backends (NGC's ``tritonserver`` image). The wheel ships one Python-backend stub per
Python version, and Triton looks for the stub in the backend's folder: the backend is staged once
under ``~/.cache/sdtrt/triton`` with the stub for the running Python beside it. The server runs with
this interpreter's ``bin`` first on PATH, so the stub's Python sees this environment's packages (sdtrt
included).

Triton's startup output (~50 lines of tables) is held back: a server that starts shows only its warnings
and errors, one that fails shows those and says in one line which model failed and why. Once the server
is ready its output passes through. Stopping creates the stop file the models watch (``triton_model``),
so generations in flight end within a denoising step and Triton exits in seconds, not at its timeout.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..core.errors import MissingDependencyError, ServeAddressError, ServeError
from .deploy import DEPLOYMENT

STUB = "triton_python_backend_stub"
STOP_FILE_ENV = "SDTRT_STOP_FILE"  # exists once the server is stopping; the models check it between steps
# Triton's log lines are "<I|W|E>MMDD hh:mm:ss.us pid file:line] message"; warnings and errors are worth showing.
LOG_PROBLEM = re.compile(r"^(?:[WE]\d{4} \S+ \d+ \S+\] |error: )")
# ... except these, which every start on a machine without a GPU prints.
LOG_NOISE = ("pinned memory", "CudaDriverHelper", "NVML", "DCGM")
LOG_ERROR = re.compile(r'^E\d{4} \S+ \d+ \S+\] "?(?P<message>.*?)\s*"?\s*$')
LOAD_FAILED = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?:Internal: )?(?P<reason>.*?)\"?$")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # the address every endpoint binds; 0.0.0.0 serves other machines
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    start_timeout_s: float = 300.0  # until every model in the repository is ready
    exit_timeout_s: int = 10  # on stop, how long Triton waits for open connections and requests in flight

    @property
    def ports(self) -> dict[str, int]:
        """The option that sets each port → the port."""
        return {"--http-port": self.http_port, "--grpc-port": self.grpc_port, "--metrics-port": self.metrics_port}

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


def check_repository(repository: Path) -> None:
    """ServeError, before any server starts, unless ``repository`` holds a model ``sdtrt deploy triton`` wrote."""
    deploy = f"write one with `sdtrt deploy triton --engine ENGINE --out {repository}`"
    if not repository.is_dir():
        raise ServeError(f"model repository {repository} is not a directory; {deploy}")
    models = sorted(config.parent for config in repository.glob("*/config.pbtxt"))
    if not models:
        raise ServeError(f"{repository} is not a Triton model repository (no <model>/config.pbtxt in it); {deploy}")
    if not any((model / DEPLOYMENT).is_file() for model in models):
        raise ServeError(
            f"{repository} holds no model `sdtrt deploy triton` wrote (no {DEPLOYMENT} beside "
            f"{', '.join(f'{m.name}/config.pbtxt' for m in models)}); {deploy}"
        )
    # Repositories deployed before the modules moved into layer folders import the Triton model from its old path.
    if stale := [m.name for m in models if "sdtrt.triton_model" in _read(m / "1" / "model.py")]:
        raise ServeError(
            f"{', '.join(stale)} in {repository} was deployed by an older sdtrt (its 1/model.py imports "
            f"sdtrt.triton_model, now sdtrt.serving.triton_model); deploy it again: `sdtrt deploy triton --engine "
            f"ENGINE --out {repository}`"
        )


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


class TritonServer:
    """A running tritonserver; stop it with ``stop()`` or by leaving its ``with`` block.

    Its output goes to ``log`` when given; otherwise to stderr once it is ready (``wait_ready``), its
    startup's warnings and errors only before that.
    """

    def __init__(self, repository: Path, config: ServeConfig, log: IO[Any] | None = None) -> None:
        self.repository = Path(repository)
        self.config = config
        self.log = log
        check_repository(self.repository)
        check_ports(config)
        command = [
            *tritonserver_command(),
            f"--model-repository={self.repository.resolve()}",
            *(f"--{api}-address={config.host}" for api in ("http", "grpc", "metrics")),
            f"--http-port={config.http_port}",
            f"--grpc-port={config.grpc_port}",
            f"--metrics-port={config.metrics_port}",
            f"--exit-timeout-secs={config.exit_timeout_s}",
        ]
        self._stop_dir = Path(tempfile.mkdtemp(prefix="sdtrt-serve-"))
        self.stop_file = self._stop_dir / "stop"
        self._startup: collections.deque[str] = collections.deque(maxlen=2000)  # output until ready
        self._passing = False  # True once ready: output goes straight to stderr
        self._lock = threading.Lock()
        # A session of its own: the Python backend's stubs Triton starts are in its process group, which stop() clears.
        self.process = subprocess.Popen(
            command, env=_environment() | {STOP_FILE_ENV: str(self.stop_file)}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read_output, name="tritonserver-output", daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            with self._lock:
                if self.log is not None:
                    self.log.write(line)
                    self.log.flush()
                if self._passing:
                    if self.log is None:
                        sys.stderr.write(line)
                else:
                    self._startup.append(line)

    def _problems(self) -> list[str]:
        """Triton's startup warnings and errors, each cut to its first line (tracebacks come escaped)."""
        with self._lock:
            lines = list(self._startup)
        found = [line.rstrip("\n").split("\\n")[0] for line in lines if LOG_PROBLEM.match(line)]
        return [line for line in found if not any(noise in line for noise in LOG_NOISE)]

    def _show_problems(self) -> list[str]:
        """The startup's problems, printed to stderr when the output goes nowhere else; returned."""
        problems = self._problems()
        if self.log is None and problems:
            sys.stderr.write("".join(f"{line}\n" for line in problems))
        return problems

    def wait_ready(self) -> None:
        """Return once every model is loaded; ServeError when the server exits or the time runs out."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._reader.join(10)  # the rest of its output
                problems = self._show_problems()
                raise ServeError(f"tritonserver exited with code {self.process.returncode} before it was ready: "
                                 f"{_failure(problems)}{self._log_hint()}")  # fmt: skip
            if self.ready():
                self._show_problems()
                with self._lock:
                    self._passing = True
                    self._startup.clear()
                return
            time.sleep(0.25)
        self.stop()
        problems = self._show_problems()
        raise ServeError(
            f"tritonserver was not ready after {self.config.start_timeout_s:.0f} s: {_failure(problems)}"
            f"{self._log_hint()}"
        )

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.config.http_url}/v2/health/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> int:
        """Stop the server; its exit code.

        The stop file first (the models end their generations at the next step, answering 503), then
        SIGTERM (Triton waits up to ``exit_timeout_s`` for connections and requests in flight, unloads
        the models and exits), then SIGKILL if it is still running some seconds after that. Last, whatever is
        left of its process group: a server killed from outside leaves its Python backend's stubs behind (Triton's
        stub, pb_stub.cc, polls its parent and then destroys itself from that thread; one found idle 10 minutes
        after its server was killed had not exited).
        """
        if self.process.poll() is None:
            self.stop_file.touch()
            self.process.terminate()
            try:
                self.process.wait(self.config.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # none left
            os.killpg(self.process.pid, signal.SIGKILL)
        self._reader.join(10)
        shutil.rmtree(self._stop_dir, ignore_errors=True)
        return self.process.returncode

    def _log_hint(self) -> str:
        name = getattr(self.log, "name", None)
        return f" (its log is {name})" if isinstance(name, str) else ""  # else its problems are above

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


def _failure(problems: list[str]) -> str:
    """What went wrong, in a few words, from Triton's startup problems."""
    for line in problems:
        if found := LOAD_FAILED.search(line):
            return f"model '{found['model']}' failed to load: {found['reason']}"
    errors = [line.removeprefix("error: ") for line in problems if line.startswith("error: ")] or [
        found["message"] for line in problems if (found := LOG_ERROR.match(line))
    ]
    return errors[-1] if errors else "it printed no error"


def check_ports(config: ServeConfig) -> None:
    """ServeAddressError, before Triton starts, for a host that is no address here or a port taken or named twice:
    Triton binds its ports only after loading the models, tens of seconds later."""
    try:
        family, _, _, _, address = socket.getaddrinfo(config.host, None, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ServeAddressError(f"--host {config.host} is not an address ({exc.strerror})") from None
    for option, port in config.ports.items():
        if (first := next(o for o, p in config.ports.items() if p == port)) != option:
            raise ServeAddressError(f"{option} {port} is also {first}: give each its own port")
        with socket.socket(family) as probe:
            # SO_REUSEADDR: a port a stopped server left in TIME_WAIT may be bound again, one something listens on not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address[0], port, *address[2:]))  # IPv6 addresses carry flow and scope
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    problem = f"--host {config.host} is not an address of this machine ({exc.strerror})"
                    raise ServeAddressError(problem) from None
                raise ServeAddressError(
                    f"port {port} on {config.host} cannot be bound ({exc.strerror}); pass another {option}"
                ) from None


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
