"""How fast the command line starts: ``unickpt --help`` (and ``import unickpt``) run
repeatedly in fresh interpreters, hyperfine-style; prints the best and median wall time
and the best CPU time (user + sys: steadier than wall time on a shared machine). The
target of issue 15: ``--help`` under 0.3 s. Run it with ``PYTHONPATH`` naming the tree to
measure.

    python -m bench.cli_startup [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": ["-c", "pass"],
    "import unickpt": ["-c", "import unickpt"],
    "unickpt --help": ["-m", "unickpt", "--help"],
    "import torch": ["-c", "import torch"],
}


def measure(args: list[str], runs: int) -> tuple[float, float, float]:
    """Best wall, median wall and best CPU seconds of ``runs`` runs of ``python args``."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, env=os.environ)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(walls), statistics.median(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{'command':<18} {'best wall':>10} {'median wall':>12} {'best cpu':>9}   (load average {os.getloadavg()[0]:.1f})")
    for name, argv in CASES.items():
        best, median, cpu = measure(argv, args.runs)
        print(f"{name:<18} {best:>9.3f}s {median:>11.3f}s {cpu:>8.3f}s")


if __name__ == "__main__":
    main()
