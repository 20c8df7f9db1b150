"""MTTR of a torchrun restart: the time from a SIGKILLed trainer to the next completed
step of the relaunched job, recovering from memory (``--snapshot-every 1``) against
recovering from the last disk checkpoint (no snapshots), under the same run conditions.

    python -m bench.mttr [--kills 3] [--nproc 2] [--live [--failure crash,node,hang,grow]]

``--live`` first measures live recovery (``unickpt launch``: the survivors stay in their
processes, a replacement joins later) for each failure kind (``--failure``: a crashed
rank, a lost node, a hung rank, a replacement joining): kill -> next step split into
detection, publish, interruption, tear-down, re-forming, the user's rebuild + restore and
the first step, the medians in one table. With ``--failure`` only live recovery runs.

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


class _LogTail:
    """The complete JSON lines appended to a log since the last :meth:`new` (read from
    where the last call stopped: a poll every few milliseconds must not re-read the log)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]


SCAN_S = 0.05  # how often run_job walks /proc for the trainers (a walk costs ~10 ms of CPU)


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
    tail = _LogTail(log)
    deadline = time.monotonic() + timeout
    next_scan = 0.0

    def note_round(pids: list[int]) -> None:  # a new round: its trainers and their start times
        if len(pids) == nproc and (not rounds or [q for q, _ in rounds[-1]] != pids):
            rounds.append([(q, started_at(q)) for q in pids])

    try:
        # the log is polled every 2 ms (a kill lands right after its step); /proc, which
        # only gives the rounds (their start times are the kernel's), every SCAN_S
        while p.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun still running after {timeout} s; see {out_path}")
            now = time.time()
            seen.extend((now, int(rec["step"])) for rec in tail.new())
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + SCAN_S
                note_round(trainers(p.pid))
            since_kill = [s for t, s in seen if not kills or t > kills[-1]]
            if todo and since_kill and since_kill[-1] >= todo[0] and len(pids := trainers(p.pid)) == nproc:
                note_round(pids)
                os.kill(pids[-1], signal.SIGKILL)
                kills.append(time.time())
                todo.pop(0)
            time.sleep(0.002)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    now = time.time()
    seen.extend((now, int(rec["step"])) for rec in tail.new())
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
# interrupt: kill -> the survivor's fn ended (for a lost node, before the verdict: its collective failed at once);
# verdict: -> the survivor has the coordinator's new generation
PHASES = (("detect", "kill", "died"), ("publish", "died", "published"), ("interrupt", "kill", "interrupted"),
          ("verdict", "interrupted", "verdict"), ("teardown", "verdict", "torn_down"), ("reform", "torn_down", "formed"),
          ("rebuild+restore", "formed", "restored"), ("first_step", "restored", "first_step"),
          ("(collect)", "destroyed", "torn_down"), ("(freeze)", "formed", "frozen"))  # the part of the tear-down spent in gc.collect()
FAILURES = ("crash", "node", "hang", "grow")
HANG_TIMEOUT_S = 3.0  # --failure hang: the launcher's --hang-timeout


def _rows(log: str) -> list[dict]:
    return [json.loads(x) for x in open(log) if x.strip()] if os.path.exists(log) else []


def _wait_steps(log: str, gen: int, n: int, procs: list[subprocess.Popen]) -> dict[int, int] | None:
    """Wait until generation ``gen`` logged ``n`` steps; its ranks' pids (None: the job ended)."""
    while all(p.poll() is None for p in procs):
        mine = [r for r in _rows(log) if r["generation"] == gen]
        if len({r["step"] for r in mine}) >= n:
            return {r["rank"]: r["pid"] for r in mine}
        time.sleep(0.01)
    return None


def _phases(timings: str, killed: list[float], cause: str) -> list[dict]:
    lost = [json.loads(x) for x in open(timings)] if os.path.exists(timings) else []
    rows = []
    for t, r in zip(killed, [r for r in lost if r["cause"] == cause]):
        r["kill"] = t
        row = {name: r[b] - r[a] for name, a, b in PHASES if a in r and b in r}
        row["total_s"] = r["first_step"] - t if "first_step" in r else None
        rows.append(row)
    return rows


def _launch(work: str, nproc: int, steps: int, sleep: float, flags: list[str], env: dict, node: tuple[int, int, int] | None = None,
            out: str = "out.log") -> subprocess.Popen:
    log = os.path.join(work, "log.jsonl")
    where = ["--standalone"] if node is None else ["--nnodes", str(node[1]), "--node-rank", str(node[0]), "--master-addr",
                                                    "127.0.0.1", "--master-port", str(node[2])]
    cmd = [sys.executable, "-m", "unickpt", "launch", *where, "--nproc-per-node", str(nproc), *flags, LIVE_LOOP,
           "--steps", str(steps), "--ckpt-dir", os.path.join(work, "ckpt"), "--log", log, "--sleep", str(sleep)]
    return subprocess.Popen(cmd, env=env, stdout=open(os.path.join(work, out), "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_live(work: str, nproc: int, kills: int, steps: int, sleep: float, failure: str = "crash") -> tuple[int, list[dict]]:
    """Live recovery under ``unickpt launch`` of tests/live_loop.py (an FSDP2 loop under
    ``unickpt.run``), one failure kind, ``kills`` times; per failure, the phases rank 0
    logged ($UNICKPT_LIVE_TIMINGS) and kill -> next step.

    - crash: SIGKILL rank 1 (one node), each once the replacement of the last has joined.
    - hang: SIGSTOP rank 1 under ``--hang-timeout 3`` (killed as hung, then as a crash).
    - node: 4 nodes of one rank (XOR parity): node 2 lost whole (launcher, worker, keeper,
      its shared memory); one job per loss.
    - grow: the pause at the step boundary where a replacement joins (last step of the old
      generation -> first step of the new), after a crash."""
    log, timings = os.path.join(work, "log.jsonl"), os.path.join(work, "timings.jsonl")
    env = dict(os.environ, UNICKPT_LIVE_TIMINGS=timings, UNICKPT_SHM_ROOT=os.path.join(work, "shm"), OMP_NUM_THREADS="1")
    if failure == "node":
        return _run_node_losses(work, kills, steps, sleep, env)
    flags = ["--max-restarts", str(kills)] + (["--hang-timeout", str(HANG_TIMEOUT_S)] if failure == "hang" else [])
    proc = _launch(work, nproc, steps, sleep, flags, env)
    killed: list[float] = []
    for k in range(kills):
        pids = _wait_steps(log, 2 * k, 3, [proc])
        if pids is None:
            break
        killed.append(time.time())
        os.kill(pids[1], signal.SIGSTOP if failure == "hang" else signal.SIGKILL)
    rc = proc.wait()
    if failure == "grow":
        return rc, _grow_pauses(log)
    return rc, _phases(timings, killed, "lost")


def _grow_pauses(log: str) -> list[dict]:
    """Per grow generation: the last step logged before it -> its first step logged."""
    rows, out = _rows(log), []
    gens = sorted({r["generation"] for r in rows})
    for g in gens[1:]:
        if g % 2:
            continue  # the odd generations follow a crash; the even ones a replacement joining
        before = max((r["t"] for r in rows if r["generation"] == g - 1), default=None)
        first = min(r["t"] for r in rows if r["generation"] == g)
        if before is not None:
            out.append({"total_s": first - before})
    return out


def _run_node_losses(work: str, kills: int, steps: int, sleep: float, env: dict) -> tuple[int, list[dict]]:
    from unickpt.testing import free_port

    rows, rc = [], 0
    for k in range(kills):
        job = os.path.join(work, f"job{k}")
        os.makedirs(job)
        timings = os.path.join(job, "timings.jsonl")
        port, procs = free_port(), []
        for n in range(4):
            e = dict(env, UNICKPT_SHM_ROOT=os.path.join(job, f"shm{n}"), UNICKPT_LIVE_TIMINGS=timings)
            procs.append(_launch(job, 1, steps, sleep, [], e, node=(n, 4, port), out=f"out{n}.log"))
            if n == 0:
                time.sleep(0.5)  # node 0 hosts the store
        if _wait_steps(os.path.join(job, "log.jsonl"), 0, 4, procs) is None:
            rc = 1
            break
        killed = time.time()
        _lose_node(procs[2], os.path.join(job, "shm2"))
        codes = [procs[n].wait() for n in (0, 1, 3)]
        rc = rc or next((c for c in codes if c), 0)
        rows += _phases(timings, [killed], "lost")
    return rc, rows


def _lose_node(launcher: subprocess.Popen, shm: str) -> None:
    """Node lost: its launcher and workers (their process group), its keeper, its memory."""
    os.killpg(launcher.pid, signal.SIGKILL)
    for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines():
        if shm in line and "unickpt.snapshot.keeper_server" in line:
            os.kill(int(line.split()[0]), signal.SIGKILL)
    shutil.rmtree(shm, ignore_errors=True)


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
    p.add_argument("--live", action="store_true", help="live recovery under `unickpt launch` (survivors stay) "
                   "first, on max(--nproc, 3) ranks")
    p.add_argument("--failure", default=None, help="with --live: the failure kinds, comma-separated, of "
                   f"{', '.join(FAILURES)} (default: all); then only live recovery is measured")
    args = p.parse_args(argv)
    if args.live:
        kinds = (args.failure or ",".join(FAILURES)).split(",")
        bad = [k for k in kinds if k not in FAILURES]
        if bad:
            p.error(f"--failure {','.join(bad)}: choose among {', '.join(FAILURES)}")
        table = []
        for kind in kinds:
            work = tempfile.mkdtemp(prefix=f"mttr-live-{kind}-")
            rc, rows = run_live(work, max(args.nproc, 3), args.kills, args.steps, args.compute_sleep, kind)
            for r in rows:
                print(f"{kind:6s} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items() if v is not None), flush=True)
            totals = [r["total_s"] for r in rows if r["total_s"] is not None]
            if not totals:
                print(f"{kind:6s} rc {rc}  no recovery completed; see {work}", flush=True)
                continue
            phases = {name: statistics.median([r[name] for r in rows if name in r]) for name, _, _ in PHASES
                      if any(name in r for r in rows)}
            table.append((kind, rc, statistics.median(totals), len(totals), phases))
            if rc == 0:
                shutil.rmtree(work, ignore_errors=True)
        names = [name for name, _, _ in PHASES]
        print("\n| failure | kill -> next step (median) | n | rc | " + " | ".join(names) + " |")
        print("|---|---|---|---|" + "---|" * len(names))
        for kind, rc, median, n, phases in table:
            cells = " | ".join(f"{phases[x]:.3f}" if x in phases else "" for x in names)
            print(f"| {kind} | {median:.2f} s | {n} | {rc} | {cells} |")
        if args.failure:
            return
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
