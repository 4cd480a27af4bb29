"""Run by tests/test_forked_cli.py as ``python -m tests.cli_probe`` in a forked CLI process: prints the process-wide
state a command could change, then changes all of it, writes below Python, and exits as argv says."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
import warnings

import torch

state = {
    "pid": os.getpid(),
    "argv0": sys.argv[0],
    "args": sys.argv[1:],
    "cwd": os.getcwd(),
    "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),  # as subprocess.DEVNULL opens it
    "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_") or k == "TERMINAL_WIDTH"},
    "rng": torch.rand(2).tolist(),
    "handlers": len(logging.getLogger().handlers),
    "warnings": len(warnings.filters),
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
}
print(json.dumps(state), flush=True)
torch.manual_seed(1234)
os.environ["PROBE_LEAKED"] = "1"
os.chdir("/")
logging.getLogger().addHandler(logging.StreamHandler())
warnings.simplefilter("error")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ctypes.CDLL(None).write(2, b"written by C\n", 13)
if "abort" in sys.argv:
    os.abort()
if "sleep" in sys.argv:
    time.sleep(120)
if "raise" in sys.argv:
    raise RuntimeError("uncaught")
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
