"""How long a live job runs short a rank: kill -> the job back at full size (the
replacement started, joined at a step boundary and trained a step), with the workers
spawned (torchrun's way: a fresh interpreter imports torch and FSDP) against forked from
the launcher's fork server (``unickpt launch --start-method forkserver``), in the same run.

    python -m bench.replacement [--kills 3] [--nproc 3]

One ``unickpt launch --max-restarts K`` of tests/live_loop.py (FSDP2 under
``unickpt.run``, a snapshot every step) per start method; rank 1 is SIGKILLed K times,
each once the job is whole again and trained 3 steps. Prints, per start method, the
median and each kill's time to the first step on all ranks again, and the ratio.
Also the machine's busy CPU seconds during each launch (/proc/stat: run it on an
otherwise quiet machine), which the imports of every spawned worker add to.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

from bench.mttr import _launch, _rows


def _whole_again(log: str, after: float, nproc: int, killed: int, proc) -> float | None:
    """When the first step after ``after`` was logged by ``nproc`` ranks, none of them
    pid ``killed`` (None: the job ended first)."""
    while proc.poll() is None:
        rows = [r for r in _rows(log) if r["t"] > after and r["size"] == nproc and r["pid"] != killed]
        by_step: dict[tuple[int, int], set[int]] = {}
        for r in rows:
            by_step.setdefault((r["generation"], r["step"]), set()).add(r["rank"])
        done = [k for k, ranks in by_step.items() if len(ranks) == nproc]
        if done:
            first = min(done)
            return max(r["t"] for r in rows if (r["generation"], r["step"]) == first)
        time.sleep(0.01)
    return None


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def run(work: str, method: str, nproc: int, kills: int, sleep: float) -> tuple[list[float], float]:
    """One launch: each kill's seconds short a rank, and the machine's busy CPU seconds."""
    log = os.path.join(work, "log.jsonl")
    env = dict(os.environ, UNICKPT_SHM_ROOT=os.path.join(work, "shm"), OMP_NUM_THREADS="1")
    cpu0 = _busy_s()
    proc = _launch(work, nproc, 100000, sleep, ["--max-restarts", str(kills), "--start-method", method], env)
    took: list[float] = []
    try:
        pids: dict[int, int] = {}
        deadline = time.monotonic() + 120
        while len(pids) < nproc:  # generation 0 trained a step on every rank
            assert proc.poll() is None and time.monotonic() < deadline, open(os.path.join(work, "out.log")).read()[-3000:]
            pids = {r["rank"]: r["pid"] for r in _rows(log) if r["step"] >= 3}
            time.sleep(0.02)
        for _ in range(kills):
            victim = pids[1]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            back = _whole_again(log, killed, nproc, victim, proc)
            if back is None:
                break
            took.append(back - killed)
            time.sleep(3 * sleep)
            newest = max(r["generation"] for r in _rows(log))
            pids = {r["rank"]: r["pid"] for r in _rows(log) if r["generation"] == newest}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    return took, _busy_s() - cpu0


def main(argv: list[str] | None = None) -> None:
    """Print both start methods' time short a rank and their ratio."""
    p = argparse.ArgumentParser(prog="bench.replacement")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds per step standing in for compute")
    args = p.parse_args(argv)
    got = {}
    for method in ("spawn", "forkserver"):
        with tempfile.TemporaryDirectory(prefix=f"unickpt_bench_{method}_") as work:
            got[method] = run(work, method, args.nproc, args.kills, args.sleep)
        took, cpu = got[method]
        each = ", ".join(f"{t:.2f}" for t in took)
        print(f"{method:10s} kill -> whole again: median {statistics.median(took):.2f} s ({each}); "
              f"the machine's CPU during the launch {cpu:.1f} s", flush=True)
    spawn, forked = (statistics.median(got[m][0]) for m in ("spawn", "forkserver"))
    print(f"forkserver / spawn: {forked / spawn:.2f}x the time short a rank")


if __name__ == "__main__":
    main()
