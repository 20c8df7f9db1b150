"""MTTR of a torchrun restart: the time from a SIGKILLed trainer to the next completed
step of the relaunched job, recovering from memory (``--snapshot-every 1``) against
recovering from the last disk checkpoint (no snapshots), under the same run conditions.

    python -m bench.mttr [--kills 3] [--nproc 2] [--live]

``--live`` first measures live recovery (``unickpt launch``: the survivors stay in their
processes, a replacement joins later): kill -> next step split into detection, publish,
interruption, tear-down, re-forming, the user's rebuild + restore and the first step.

Runs the example trainer under ``torchrun --standalone --max-restarts K`` (with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless ``--shared-store``: without snapshots
nothing cleans the default group's keys in torch's shared store) and SIGKILLs
local rank 1 K times. The times come from outside the job: the loss log is polled every
2 ms (a line is a completed step), the relaunched trainers' start times are read from
/proc. Per kill it prints: total (kill -> first step of the new round), relaunch (kill
-> new trainer process started: torchrun's detection, stopping the survivors and the
new rendezvous), start (process start -> the recovery line: imports, process group,
model), recover (the trainer's own figure for the load) and the steps lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
TINY = ["--seed", "3", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--dataset-size", "240",
        "--print-every", "0"]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    with open("/proc/stat") as f:
        return float(next(line for line in f if line.startswith("btime")).split()[1])


def trainers(agent: int) -> list[int]:
    """The trainer processes (not the agent, not a snapshot keeper) under torchrun ``agent``."""
    from unickpt.testing import descendants

    out = []
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"unickpt.examples.train" in cmd and b"torchrun" not in cmd:
            out.append(pid)
    return sorted(out)


def started_at(pid: int) -> float | None:
    """The wall-clock time process ``pid`` started (10 ms resolution), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return _boot_time() + ticks / CLOCK_TICKS


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def run_job(work: str, flags: list[str], kill_after: list[int], nproc: int = 2, timeout: float = 600,
            extra_env: dict[str, str] | None = None) -> dict:
    """Run the example trainer under torchrun in ``work`` with ``--max-restarts
    len(kill_after)``; SIGKILL local rank 1 once the loss log holds each of the steps in
    ``kill_after``. Returns the exit code, the output, every (time seen, step) of the
    loss log, the kill times and the trainers of each round with their start times."""
    log = os.path.join(work, "loss.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=os.path.join(work, "shm"), **(extra_env or {}))
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={len(kill_after)}",
           "-m", "unickpt.examples.train", *flags, "--loss-log", log]
    out_path = os.path.join(work, "out.log")
    with open(out_path, "w") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    seen: list[tuple[float, int]] = []
    kills: list[float] = []
    rounds: list[list[tuple[int, float | None]]] = []
    todo = list(kill_after)
    deadline = time.monotonic() + timeout
    try:
        while p.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun still running after {timeout} s; see {out_path}")
            now = time.time()
            for rec in _lines(log)[len(seen):]:
                seen.append((now, int(rec["step"])))
            pids = trainers(p.pid)
            if len(pids) == nproc and (not rounds or [q for q, _ in rounds[-1]] != pids):
                rounds.append([(q, started_at(q)) for q in pids])
            since_kill = [s for t, s in seen if not kills or t > kills[-1]]
            if todo and since_kill and since_kill[-1] >= todo[0] and len(pids) == nproc:
                os.kill(pids[-1], signal.SIGKILL)
                kills.append(time.time())
                todo.pop(0)
            time.sleep(0.002)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    now = time.time()
    for rec in _lines(log)[len(seen):]:
        seen.append((now, int(rec["step"])))
    with open(out_path) as f:
        output = f.read()
    return {"rc": p.returncode, "output": output, "seen": seen, "kills": kills, "rounds": rounds, "log": log}


# the snapshot tier's line, the trainer's own resume line (no snapshots), a fresh start
RECOVERY = re.compile(r"^(?:resumed step (\d+) from (memory|disk).*?([0-9.]+) s\)|resumed from \S+ at step (\d+)|"
                      r"starting fresh.*|no checkpoint in .*)$", re.M)


def breakdown(job: dict) -> list[dict]:
    """Per kill: seconds from the kill to the first step of the new round, split up."""
    lines = RECOVERY.findall(job["output"])[1:]  # the first is the initial start
    out = []
    for k, kill in enumerate(job["kills"]):
        after = [(t, s) for t, s in job["seen"] if t > kill]
        last_before = max((s for t, s in job["seen"] if t <= kill), default=0)
        resumed = int(lines[k][0] or lines[k][3] or 0) if k < len(lines) else 0
        first = next(((t, s) for t, s in after if s == resumed + 1), None)
        rnd = job["rounds"][k + 1] if k + 1 < len(job["rounds"]) else []
        start = min((t for _, t in rnd if t is not None), default=None)
        row = {"total_s": first[0] - kill if first else None, "relaunch_s": start - kill if start else None,
               "recover_s": float(lines[k][2]) if k < len(lines) and lines[k][2] else None,
               "from": (lines[k][1] or ("disk" if lines[k][3] else "fresh")) if k < len(lines) else None, "steps_lost": last_before - resumed}
        if first and start:
            row["start_to_step_s"] = first[0] - start
        out.append(row)
    return out


LIVE_LOOP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "live_loop.py")
PHASES = (("detect", "kill", "died"), ("publish", "died", "published"), ("interrupt", "published", "interrupted"),
          ("teardown", "interrupted", "torn_down"), ("reform", "torn_down", "formed"),
          ("rebuild+restore", "formed", "restored"), ("first_step", "restored", "first_step"),
          ("(collect)", "destroyed", "torn_down"), ("(freeze)", "formed", "frozen"))  # the part of the tear-down spent in gc.collect()


def run_live(work: str, nproc: int, kills: int, steps: int, sleep: float) -> tuple[int, list[dict]]:
    """Live recovery: ``unickpt launch --max-restarts K`` of tests/live_loop.py (an FSDP2
    loop under ``unickpt.run``); SIGKILL rank 1 K times, each once the replacement of the
    last kill has joined. Per kill, the phases rank 0 logged ($UNICKPT_LIVE_TIMINGS)."""
    log, timings = os.path.join(work, "log.jsonl"), os.path.join(work, "timings.jsonl")
    env = dict(os.environ, UNICKPT_LIVE_TIMINGS=timings, UNICKPT_SHM_ROOT=os.path.join(work, "shm"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "unickpt", "launch", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
           str(kills), LIVE_LOOP, "--steps", str(steps), "--ckpt-dir", os.path.join(work, "ckpt"), "--log", log,
           "--sleep", str(sleep)]
    with open(os.path.join(work, "out.log"), "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        killed: list[float] = []
        for k in range(kills):
            gen, pid = 2 * k, None
            while pid is None and proc.poll() is None:
                rows = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
                mine = [r for r in rows if r["generation"] == gen]
                if len({r["step"] for r in mine}) >= 3:
                    pid = next(r["pid"] for r in mine if r["rank"] == 1)
                time.sleep(0.01)
            if pid is None:
                break
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
        rc = proc.wait()
    lost = [json.loads(x) for x in open(timings)] if os.path.exists(timings) else []
    lost = [r for r in lost if r["cause"] == "lost"]
    rows = []
    for t, r in zip(killed, lost):
        r["kill"] = t
        row = {name: r[b] - r[a] for name, a, b in PHASES if a in r and b in r}
        row["total_s"] = r["first_step"] - t if "first_step" in r else None
        rows.append(row)
    return rc, rows


def main(argv: list[str] | None = None) -> None:
    """Measure the MTTR from memory and from disk; print one line per kill and medians."""
    p = argparse.ArgumentParser(prog="bench.mttr")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--shared-store", action="store_true",
                   help="leave torchrun's store shared across restart rounds (torch's default): without snapshots "
                   "no unickpt group cleans the default group's keys, and torch's own restarts can fail")
    p.add_argument("--compute-sleep", type=float, default=0.05, help="seconds per step standing in for compute")
    p.add_argument("--live", action="store_true", help="also live recovery under `unickpt launch` (survivors stay), "
                   "first, on max(--nproc, 3) ranks")
    args = p.parse_args(argv)
    if args.live:
        work = tempfile.mkdtemp(prefix="mttr-live-")
        rc, rows = run_live(work, max(args.nproc, 3), args.kills, args.steps, args.compute_sleep)
        for r in rows:
            print("live   " + "  ".join(f"{k} {v:.3f}" for k, v in r.items() if v is not None), flush=True)
        totals = [r["total_s"] for r in rows if r["total_s"] is not None]
        print(f"live   rc {rc}  kill -> next step median {statistics.median(totals):.3f} s over {len(totals)} kills"
              if totals else f"live   rc {rc}  no recovery completed; see {work}/out.log", flush=True)
        if rc == 0:
            shutil.rmtree(work, ignore_errors=True)
    gap = args.steps // (args.kills + 1)
    kill_after = [gap * (k + 1) + args.save_every // 2 for k in range(args.kills)]
    base = ["--dp", str(args.nproc), "--fsdp", "--steps", str(args.steps), "--save-every", str(args.save_every),
            "--compute-sleep", str(args.compute_sleep), *TINY]
    for name, flags in (("memory", ["--snapshot-every", "1"]), ("disk", [])):
        work = tempfile.mkdtemp(prefix=f"mttr-{name}-")
        env = {} if args.shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        resume = [] if flags else ["--resume", "latest"]
        job = run_job(work, [*base, "--ckpt-dir", os.path.join(work, "ckpt"), *flags, *resume], kill_after, args.nproc,
                      extra_env=env)
        rows = breakdown(job)
        for r in rows:
            print(f"{name:6s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        totals = [r["total_s"] for r in rows if r["total_s"] is not None]
        print(f"{name:6s} rc {job['rc']}  MTTR median {statistics.median(totals):.3f} s over {len(totals)} kills"
              if totals else f"{name:6s} rc {job['rc']}  no restart completed; see {work}/out.log", flush=True)
        if job["rc"] == 0:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
