"""The Docker images build without a GPU, and `make setup` installs the torch build the machine can run.

`docker build` steps get no GPU (BuildKit), and `import torch_tensorrt` calls torch.cuda.current_device():
the images read versions from package metadata while building and import TensorRT at container start.
The torch installer runs for real against local addresses: a closed port, a server that never answers,
a PEP 503 page it serves.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .helpers import REPO

DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.triton"]
GPU_AT_IMPORT = re.compile(r"import[^\n;]*\b(tensorrt|torch_tensorrt)\b|torch\.cuda")


def instructions(dockerfile: str, keyword: str) -> list[str]:
    """The arguments of every ``keyword`` instruction, continuation lines joined, comments dropped."""
    lines = [line for line in (REPO / dockerfile).read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.split(None, 1)[:1] == [keyword]]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=REPO, env=os.environ | (env or {}), capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_no_build_step_needs_a_gpu_and_versions_come_from_metadata(dockerfile):
    steps = instructions(dockerfile, "RUN")
    assert steps
    for step in steps:
        assert not GPU_AT_IMPORT.search(step), f"{dockerfile}: this build step needs a GPU: {step}"
    assert any("docker/versions.py" in step for step in steps)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_starts_through_the_entrypoint_it_copies(dockerfile):
    (entrypoint,) = (json.loads(args)[0] for args in instructions(dockerfile, "ENTRYPOINT"))
    (workdir,) = instructions(dockerfile, "WORKDIR")
    source = Path(entrypoint).relative_to(workdir)
    assert any(str(source) in copy.split()[:-1] for copy in instructions(dockerfile, "COPY"))
    assert any("docker/versions.py" in copy.split()[:-1] for copy in instructions(dockerfile, "COPY"))
    assert os.access(REPO / source, os.X_OK), f"{source} is not executable"


def write_distribution(site: Path, name: str, version: str, top_level: str | None = None) -> None:
    """An installed distribution's metadata, and no module: importing it would fail."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")


def test_versions_are_read_without_importing_the_gpu_packages(tmp_path):
    # pip's TensorRT installs its `tensorrt` module from tensorrt-cu12-bindings.
    write_distribution(tmp_path, "tensorrt_cu12_bindings", "10.7.0.post1", top_level="tensorrt")
    write_distribution(tmp_path, "torch_tensorrt", "2.6.0")
    result = run([sys.executable, "docker/versions.py"], env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert result.returncode == 0, result.stderr
    assert "TensorRT 10.7.0.post1" in result.stdout and "torch-tensorrt 2.6.0" in result.stdout
    assert "torch 2." in result.stdout and "sdtrt 0." in result.stdout


def test_versions_name_what_the_image_lacks():
    result = run([sys.executable, "docker/versions.py"])
    assert result.returncode == 1
    assert "not installed: TensorRT, torch-tensorrt" in result.stderr


def test_entrypoint_without_a_gpu_says_so_in_one_line_and_runs_the_command():
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # its python3 has torch
        "CUDA_VISIBLE_DEVICES": "",  # no GPU, also on a machine that has one
        "SDTRT_NGC_ENTRYPOINT_DONE": "1",  # NGC's entrypoint, where a machine has one, is not ours to run
    }
    result = run(["docker/entrypoint.sh", "sh", "-c", "echo ran; exit 7"], env=env)
    assert (result.returncode, result.stdout) == (7, "ran\n")
    (line,) = result.stderr.splitlines()
    assert "no NVIDIA GPU is visible" in line and "docker run --gpus all" in line


# --- make setup: torch ---------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cpu_index(tmp_path):
    """A PEP 503 index on 127.0.0.1 with a torch page: PyTorch's CPU index, reachable."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html><body></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def install_torch(env: dict[str, str]) -> list[str]:
    """What scripts/install_torch.py says and would run (--dry-run), as lines."""
    result = run([sys.executable, "scripts/install_torch.py", "torch==2.13.0", "--dry-run"], env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_without_a_gpu_torch_comes_from_the_cpu_index(cpu_index):
    said, command = install_torch({"SDTRT_NVIDIA_GPU": "0", "TORCH_CPU_INDEX": cpu_index})
    assert "no NVIDIA GPU: installing the CPU build" in said
    assert command.endswith(f"pip install -q --index-url {cpu_index} torch==2.13.0")


def test_an_unreachable_cpu_index_falls_back_to_the_plain_requirement_and_says_so():
    index = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    said, command = install_torch({"SDTRT_NVIDIA_GPU": "0", "TORCH_CPU_INDEX": index})
    assert f"CPU index {index} cannot be reached" in said and "CUDA build" in said
    assert command.endswith("pip install -q torch==2.13.0")


def test_a_cpu_index_that_never_answers_falls_back():
    with socket.socket() as silent:  # accepts connections (the kernel does) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        index = f"http://127.0.0.1:{silent.getsockname()[1]}"
        said, command = install_torch({"SDTRT_NVIDIA_GPU": "0", "TORCH_CPU_INDEX": index, "TORCH_INDEX_TIMEOUT": "1"})
    assert "cannot be reached" in said
    assert command.endswith("pip install -q torch==2.13.0")


def test_with_an_nvidia_gpu_the_plain_requirement_is_installed(cpu_index, tmp_path):
    nvidia_smi = tmp_path / "bin" / "nvidia-smi"
    nvidia_smi.parent.mkdir()
    nvidia_smi.write_text("#!/bin/sh\n")
    nvidia_smi.chmod(0o755)
    path = f"{nvidia_smi.parent}{os.pathsep}{os.environ['PATH']}"
    said, command = install_torch({"PATH": path, "TORCH_CPU_INDEX": cpu_index, "SDTRT_NVIDIA_GPU": ""})
    assert "NVIDIA GPU found" in said
    assert command.endswith("pip install -q torch==2.13.0")


def test_make_setup_installs_torch_through_the_installer_and_prints_the_build(tmp_path):
    result = run(["make", "-n", "-B", "setup", f"VENV={tmp_path}/venv"])
    assert result.returncode == 0, result.stderr
    assert f'{tmp_path}/venv/bin/python scripts/install_torch.py "torch==2.13.0"' in result.stdout
    assert 'pip install -q "torch' not in result.stdout
    assert "torch.version.cuda" in result.stdout
