"""How long the command line takes before it does anything, side by side with `python -c pass`.

Each command runs as a fresh process, `--repeats` times after one untimed warm-up (which also builds
the tiny preset and the export artifact, so `export` is then a full cache hit). Prints the median
wall time and peak RSS of each, and the ratio to `python -c pass` measured in the same run.

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

GOALS = {"--help": 1.0, "cache ls": 1.0, "export (cache hit)": 2.0}  # seconds, from issue 8


def timed(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process (its own rusage, from wait4)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engines = tempfile.mkdtemp(prefix="sdtrt-startup-")
    sdtrt = [sys.executable, "-m", "sdtrt"]
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "--help": [*sdtrt, "--help"],
        "--version": [*sdtrt, "--version"],
        "cache ls": [*sdtrt, "cache", "ls", "--engines", engines],
        "export (cache hit)": [*sdtrt, "export", "--model", "tiny", "--engines", engines],
    }
    rows = []
    for name, argv in commands.items():
        timed(argv)  # warm-up: file cache, preset and export artifact
        runs = [timed(argv) for _ in range(args.repeats)]
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
