"""Install torch into the running interpreter's environment (`make setup`), the build that fits the machine.

PyPI's Linux torch is the CUDA build, with ~20 nvidia-* packages and several GB. Without an NVIDIA GPU the
CPU build from PyTorch's CPU index is what runs, so that index is used when it answers within a few
seconds; where there is a GPU, or the index cannot be reached, the plain requirement goes to pip's
configured indexes. It says which it chose and why (`make setup` then prints the build it got).

    python scripts/install_torch.py "torch==2.13.0" [--dry-run]

Environment: SDTRT_NVIDIA_GPU=1|0 overrides the GPU detection (nvidia-smi on PATH or /proc/driver/nvidia),
TORCH_CPU_INDEX the CPU index URL, TORCH_INDEX_TIMEOUT the seconds its probe may take (default 5).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    forced = os.environ.get("SDTRT_NVIDIA_GPU", "")
    if forced in ("0", "1"):
        return forced == "1"
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()


def unreachable(url: str, timeout: float) -> str | None:
    """Why ``url`` cannot be fetched within ``timeout`` seconds, or None when it can.

    A thread bounds the whole probe: urlopen's timeout does not cover the DNS lookup, and pip's own
    default timeout (180 s here) would make a firewalled machine wait minutes before falling back.
    """
    errors: list[str] = []

    def fetch() -> None:
        try:
            urllib.request.urlopen(url, timeout=timeout).close()
        except Exception as error:
            errors.append(str(error))

    probe = threading.Thread(target=fetch, daemon=True)
    probe.start()
    probe.join(timeout)
    if probe.is_alive():
        return f"no answer within {timeout:g} s"
    return errors[0] if errors else None


def pip_command(spec: str) -> list[str]:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if has_nvidia_gpu():
        print("install-torch: NVIDIA GPU found: installing the plain requirement (the CUDA build)")
        return [*pip, spec]
    index = os.environ.get("TORCH_CPU_INDEX", CPU_INDEX)
    why = unreachable(f"{index.rstrip('/')}/torch/", float(os.environ.get("TORCH_INDEX_TIMEOUT", "5")))
    if why is None:
        print(f"install-torch: no NVIDIA GPU: installing the CPU build from {index}")
        return [*pip, "--index-url", index, spec]
    print(
        f"install-torch: no NVIDIA GPU, but PyTorch's CPU index {index} cannot be reached ({why}): "
        "installing the plain requirement from pip's configured indexes (on Linux, PyPI's is the CUDA build, "
        "unless pip's configuration serves a CPU wheel; the line after the install says which came)"
    )
    return [*pip, spec]


def main(argv: list[str]) -> int:
    spec = next((a for a in argv if not a.startswith("--")), "torch")
    command = pip_command(spec)
    if "--dry-run" in argv:
        print("install-torch: would run:", " ".join(command))
        return 0
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
