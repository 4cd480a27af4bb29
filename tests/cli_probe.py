"""Run by tests/test_forked_cli.py as ``python -m tests.cli_probe`` in a forked CLI process (or in a process of its own,
the reference): imports what a command imports, prints the process-wide state a command could change, then changes
all of it, writes below Python (C stdio's fully buffered stdout, a raw write to stderr), and exits as argv says."""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import random
import signal
import sys
import time
import warnings

import sdtrt.cli  # noqa: F401  as `python -m sdtrt` imports it first
from tests.forked_cli import PRELOADED

for name in PRELOADED:
    importlib.import_module(name)
import numpy  # noqa: E402
import torch  # noqa: E402

state = {
    "interpreter_argv": sys.orig_argv[1:],  # the server's in a fork; this module's in a fresh interpreter
    "pid": os.getpid(),
    "argv0": sys.argv[0],
    "args": sys.argv[1:],
    "cwd": os.getcwd(),
    "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),  # as subprocess.DEVNULL opens it
    "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_") or k == "TERMINAL_WIDTH"},
    "rng": [torch.rand(2).tolist(), numpy.random.rand(2).tolist(), random.random()],  # seeded afresh: not compared
    "handlers": [repr(handler) for handler in logging.getLogger().handlers],
    "warnings": [repr(entry) for entry in warnings.filters],
    "sigterm": str(signal.getsignal(signal.SIGTERM)),
}
print(json.dumps(state), flush=True)
torch.manual_seed(1234)
os.environ["PROBE_LEAKED"] = "1"
os.chdir("/")
logging.getLogger().addHandler(logging.StreamHandler())
warnings.simplefilter("error")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
libc = ctypes.CDLL(None)
stdout = ctypes.c_void_p.in_dll(libc, "stdout")
libc.setvbuf(stdout, None, 0, 4096)  # _IOFBF: as C stdio buffers a file when Python is not told to be unbuffered
libc.printf(b"printed by C")  # no newline: only exit's flush writes it
libc.write(2, b"written by C\n", 13)
if "abort" in sys.argv:
    os.abort()
if "sleep" in sys.argv:
    time.sleep(120)
if "raise" in sys.argv:
    raise RuntimeError("uncaught")
sys.exit(int(sys.argv[-1]) if sys.argv[-1].lstrip("-").isdigit() else 0)
