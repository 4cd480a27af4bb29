"""How long the command line takes before it does anything, side by side with `python -c pass`.

Each command runs as a fresh process, `--repeats` times after one untimed warm-up (which also builds
the tiny preset and the export artifact, so `export` is then a full cache hit). Prints the median
wall time and peak RSS of each, and the ratio to `python -c pass` measured in the same run.

`generate` rows use tiny's ONNX Runtime engine set (compiled first, without validation): one step, nearly all of it
importing diffusers' pipeline (and torch with it); a usage error (`--image` on a txt2img model) comes before that.

    python benchmarks/cli_startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

GOALS = {"--help": 1.0, "cache ls": 1.0, "export (cache hit)": 2.0, "generate usage error": 2.0}  # seconds


def timed(argv: list[str], expected: int = 0) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process (its own rusage, from wait4) that exits ``expected``."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != expected:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
    return seconds, usage.ru_maxrss / 1024


def tiny_set(engines: str) -> str:
    """The path of tiny's ONNX Runtime engine set, compiled into ``engines`` (a cache hit after the first time)."""
    argv = [sys.executable, "-m", "sdtrt", "compile", "--model", "tiny", "--target", "onnxruntime", "--no-validate"]
    done = subprocess.run([*argv, "--engines", engines], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engines = tempfile.mkdtemp(prefix="sdtrt-startup-")
    sdtrt = [sys.executable, "-m", "sdtrt"]
    out = os.path.join(engines, "image.png")
    generate = [*sdtrt, "generate", "--engine", tiny_set(engines), "--steps", "1", "--out", out]
    commands = {
        "python -c pass": ([sys.executable, "-c", "pass"], 0),
        "--help": ([*sdtrt, "--help"], 0),
        "--version": ([*sdtrt, "--version"], 0),
        "cache ls": ([*sdtrt, "cache", "ls", "--engines", engines], 0),
        "export (cache hit)": ([*sdtrt, "export", "--model", "tiny", "--engines", engines], 0),
        "generate (1 step)": (generate, 0),
        # --image: the image the row above wrote; tiny's pipeline (txt2img) takes none, exit 2
        "generate usage error": ([*generate, "--image", out], 2),
    }
    rows = []
    for name, (argv, expected) in commands.items():
        timed(argv, expected)  # warm-up: file cache, preset and export artifact
        runs = [timed(argv, expected) for _ in range(args.repeats)]
        seconds = [r[0] for r in runs]
        rows.append((name, statistics.median(seconds), min(seconds), max(seconds), max(r[1] for r in runs)))
    baseline = rows[0][1]
    print(f"{'command':22s} {'median s':>9s} {'min–max s':>15s} {'vs python':>10s} {'RSS MB':>7s}  goal")
    for name, median, lo, hi, rss in rows:
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"< {goal:.0f} s: {'met' if median < goal else 'MISSED'}"
        print(f"{name:22s} {median:9.3f} {lo:7.3f}–{hi:7.3f} {median / baseline:9.1f}x {rss:7.0f}  {verdict}")


if __name__ == "__main__":
    main()
