"""Print the versions of the packages an sdtrt image must carry; exit 1 naming any that is missing.

Runs at `docker build` time, where there is no GPU (BuildKit gives build steps none), so it reads package
metadata and imports nothing: `import torch_tensorrt` calls torch.cuda.current_device() through default
arguments (`device: Device = Device._current_device()` in py/torch_tensorrt/ts/_compiler.py and
dynamo/_compiler.py; `_Device._current_device` is `torch.cuda.current_device()`) and fails without a
driver. docker/entrypoint.sh does the real import when the container starts on a GPU.
"""

from __future__ import annotations

import sys
from importlib import metadata

# Import name -> what to call it. The distribution behind an import name varies: pip's TensorRT is
# tensorrt-cu12-bindings, NGC images ship their own `tensorrt` wheel.
MODULES = {"torch": "torch", "tensorrt": "TensorRT", "torch_tensorrt": "torch-tensorrt", "sdtrt": "sdtrt"}


def installed_version(module: str) -> str | None:
    """The version of the distribution that installs ``module``, without importing it."""
    for name in [*metadata.packages_distributions().get(module, []), module]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def main() -> int:
    found = {label: installed_version(module) for module, label in MODULES.items()}
    print(" ".join(f"{label} {version}" for label, version in found.items() if version))
    missing = [label for label, version in found.items() if version is None]
    if missing:
        print(
            f"not installed: {', '.join(missing)}; the image needs all of {', '.join(MODULES.values())}",
            file=sys.stderr,
        )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
