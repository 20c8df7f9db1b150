"""The fault-tolerance demo: live recovery. The example trainer runs on 4 ranks under
``unickpt launch``; rank 2 is SIGKILLed mid-run; the 3 survivors go on in their own
processes from the snapshot in memory, and the replacement the launcher starts joins at
a step boundary: 4 -> 3 -> 4 ranks, no step lost, the loss on the unbroken curve.

Used by ``unickpt demo --fault-tolerance`` (``--node-loss``: the node-loss story of
:mod:`.demo_fault` instead). ``--tp 2``: FSDP2 x TP on a dp2 x tp2 mesh, whose world must
stay a multiple of 2 (``unickpt.run(fn, multiple_of=2)``): 4 -> 2 ranks + 1 hot spare ->
4 when the replacement joins.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from .demo_resume import print_rows, pyplot, save_figure
from .store_client import LIVE_WORKER_ENV

RANKS, KILLED = 4, 2
STEPS, KILL_AFTER = 24, 5
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--fsdp", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--print-every", "0"]
LOST = re.compile(r"^rank \d+ lost .*\(generation \d+\)$", re.M)
JOINED = re.compile(r"^\d+ replacements? joined; .*\(generation \d+\)$", re.M)
RESUMED = re.compile(r"^resumed step (\d+) from (memory|disk) .*$", re.M)
JOINED_AT = re.compile(r"at step (\d+)")


@dataclass
class LiveDemo:
    """What happened: the unbroken run's losses, this run's (the last value logged for
    each step) with the number of ranks that computed it, and the lines printed."""

    reference: dict[int, float]
    losses: dict[int, float]
    ranks: dict[int, int]
    killed_after: int
    resumed: str  # `resumed step S from memory (...)`, after the kill
    lost: str  # `rank 2 lost (exit -9); continuing on 3 ranks at step S+1 (generation 1)`
    joined: str  # `1 replacement joined; continuing on 4 ranks at step T (generation 2)` ('' if it never did)
    survivors_stayed: bool  # the survivors' pids are those of generation 0
    plot: str
    seconds: float
    tp: int = 1

    def spares(self, step: int) -> int:
        """Processes waiting as hot spares while ``step`` was computed (the ones alive that
        fit no multiple of tp)."""
        m = JOINED_AT.search(self.joined)
        alive = RANKS - 1 if self.resumed_step < step < (int(m.group(1)) if m else STEPS + 1) else RANKS
        return max(0, alive - self.ranks.get(step, alive))

    @property
    def resumed_step(self) -> int:
        """The step the survivors continued from (0 if none)."""
        m = RESUMED.match(self.resumed)
        return int(m.group(1)) if m else 0

    @property
    def steps_lost(self) -> int:
        """Completed steps the recovery threw away. The step whose loss was logged last
        before the kill was still in flight (its snapshot is taken after the log line):
        computed again, not lost."""
        return max(0, self.killed_after - 1 - self.resumed_step)

    @property
    def max_rel_diff(self) -> float:
        """Largest relative loss difference from the unbroken run, over every step."""
        return max(abs(v - self.reference[s]) / abs(self.reference[s]) for s, v in self.losses.items())

    @property
    def ok(self) -> bool:
        """True when every step was trained, the survivors went on in their processes from
        memory with no step lost, and every loss is within 1e-4 of the unbroken run."""
        return (sorted(self.losses) == list(range(1, STEPS + 1)) and "from memory" in self.resumed and bool(self.lost)
                and self.survivors_stayed and self.steps_lost == 0 and self.max_rel_diff <= 1e-4)


def run_live_demo(directory: str | None = None, plot_path: str = "unickpt_demo_fault.png", console: Any = None,
                  tp: int = 1) -> LiveDemo:
    """Run the story, print a table (with rich when ``console`` is given), write the PNG.
    Checkpoints, logs and the shared-memory root go under ``directory`` (kept), or a
    temporary directory removed however the demo ends. ``tp``: the tensor-parallel degree
    (1 or 2; the world stays a multiple of it, the others wait as hot spares)."""
    from .demo import demo_dir

    if tp not in (1, 2):
        raise ValueError(f"--tp {tp}: the live demo runs 4 ranks, with tp 1 or 2")
    pyplot()  # before any training: the plot needs matplotlib
    with demo_dir(directory) as base:
        return _run(os.path.abspath(base), plot_path, console, tp)  # the launch runs in it: paths absolute


def _workers(launcher: int) -> dict[str, int]:
    """The launcher's trainer processes (its children) by worker id (``0.2``: node 0, the
    third started)."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            pid = int(entry)
        except (OSError, ValueError, IndexError):
            continue
        for var in env:
            if var.startswith(LIVE_WORKER_ENV.encode() + b"="):
                out[var.split(b"=", 1)[1].decode()] = pid
    return out


def _rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.endswith("\n")]
    except FileNotFoundError:
        return []


def _run(root: str, plot_path: str, console: Any, tp: int = 1) -> LiveDemo:
    start = time.time()
    say = console.print if console is not None else print
    from .examples.train import run

    say(f"1. the unbroken reference: {STEPS} steps in one process ...")
    reference = {r["step"]: r["loss"] for r in run(FLAGS)}
    log = os.path.join(root, "run.jsonl")
    layout = ["--tp", str(tp)] if tp > 1 else []
    cmd = [sys.executable, "-m", "unickpt", "launch", "--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "1",
           "-m", "unickpt.examples.train", *FLAGS, *layout, "--snapshot-every", "1", "--ckpt-dir", os.path.join(root, "ckpt"),
           "--loss-log", log, "--compute-sleep", "0.2"]
    shape = f"FSDP2 x TP on dp{RANKS // tp} x tp{tp} (the world stays a multiple of {tp})" if tp > 1 else f"FSDP2 on {RANKS} ranks"
    say(f"2. unickpt launch --nproc-per-node {RANKS} --max-restarts 1: {shape}, a snapshot in memory every step ...")
    env = dict(os.environ, UNICKPT_SHM_ROOT=os.path.join(root, "shm"), OMP_NUM_THREADS="1")
    out_path = os.path.join(root, "launch.log")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while max((r["step"] for r in _rows(log)), default=0) < KILL_AFTER:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the run did not reach step {KILL_AFTER}:\n{_tail(out_path)}")
            time.sleep(0.02)
        before = _workers(proc.pid)
        killed_after = max(r["step"] for r in _rows(log))
        os.kill(before[f"0.{KILLED}"], signal.SIGKILL)
        say(f"3. rank {KILLED} SIGKILLed after step {killed_after}: the survivors go on in their own processes; "
            "the launcher starts a replacement ...")
        survivors = {w: p for w, p in before.items() if w != f"0.{KILLED}"}
        stayed = True
        while proc.poll() is None:
            now = _workers(proc.pid)
            stayed = stayed and all(now.get(w, p) == p for w, p in survivors.items())
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run did not end:\n{_tail(out_path)}")
            time.sleep(0.05)
        if proc.returncode:
            raise RuntimeError(f"unickpt launch failed (exit {proc.returncode}):\n{_tail(out_path)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = re.sub(r"^\[rank\d+\]: ", "", open(out_path, errors="replace").read(), flags=re.M)  # the launcher's prefix
    resumed = [m.group(0) for m in RESUMED.finditer(text)]
    rows = _rows(log)
    losses = {r["step"]: r["loss"] for r in rows}  # a step redone after the kill: its last value
    ranks = {r["step"]: r["ranks"] for r in rows}
    lost, joined = LOST.search(text), JOINED.search(text)
    result = LiveDemo(reference, losses, ranks, killed_after, resumed[0] if resumed else "", lost.group(0) if lost else "",
                      joined.group(0) if joined else "", stayed, os.path.abspath(plot_path), time.time() - start, tp)
    for line in (result.resumed, result.lost, result.joined):
        if line:
            say(f"   {line}")
    save_figure(plot_figure(result), plot_path)
    _table(result, say, console)
    return result


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(x for x in f.read().splitlines() if "socket.cpp" not in x)[-3000:]
    except OSError:
        return ""


def plot_figure(r: LiveDemo) -> Any:
    """The demo's figure: the loss of the unbroken run and of this run per step, and the
    number of ranks per step on a second axis, the kill marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    ax.plot(list(r.reference), list(r.reference.values()), "-", color="#888888", label="unbroken run")
    steps = sorted(r.losses)
    ax.plot(steps, [r.losses[s] for s in steps], "o", color="#1f77b4", markersize=4, label="this run")
    ax.axvline(r.resumed_step + 0.5, color="#d62728", linestyle=":", linewidth=1)
    ax.annotate(f"rank {KILLED} killed (SIGKILL)\nthe survivors go on from step {r.resumed_step + 1}",
                xy=(r.resumed_step + 0.5, max(r.reference.values())),
                xytext=(6, -4), textcoords="offset points", ha="left", va="top", fontsize=8, color="#d62728")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(loc="lower left", fontsize=8)
    size = ax.twinx()
    size.step(steps, [r.ranks[s] for s in steps], where="mid", color="#2ca02c", linewidth=1.5, label="ranks training")
    if any(r.spares(s) for s in steps):
        size.step(steps, [r.spares(s) for s in steps], where="mid", color="#9467bd", linewidth=1.2, linestyle="--",
                  label="hot spares")
        size.legend(loc="lower right", fontsize=8)
    size.set_ylabel("ranks (world size)", color="#2ca02c")
    size.set_ylim(0, RANKS + 1)
    size.set_yticks(range(RANKS + 1))
    ax.set_title("unickpt launch: a rank dies, the survivors go on, a replacement joins"
                 + (f" (tp {r.tp}: multiple_of={r.tp})" if r.tp > 1 else ""))
    fig.tight_layout()
    return fig


def _table(r: LiveDemo, say: Any, console: Any) -> None:
    rows = []
    for step, ref in r.reference.items():
        got = r.losses.get(step)
        note = ""
        if step == r.killed_after:
            note = f"rank {KILLED} killed" + (" (step redone)" if r.resumed_step < step else "")
        elif step > 1 and r.ranks.get(step) != r.ranks.get(step - 1):
            note = "replacement joined" if r.ranks.get(step, 0) > r.ranks.get(step - 1, 0) else "survivors go on"
        rel = "" if got is None else f"{abs(got - ref) / abs(ref):.1e}"
        rows.append((str(step), f"{ref:.6f}", "" if got is None else f"{got:.6f}", str(r.ranks.get(step, "")),
                     str(r.spares(step)), rel, note))
    print_rows(say, console, "loss: unbroken run vs a run that loses a rank and gets a replacement",
               ("step", "unbroken", "this run", "ranks", "spares", "rel. diff", "note"), rows, left=("note",))
    verdict = "OK" if r.ok else "MISMATCH"
    diff = f"{r.max_rel_diff:.1e}" if r.losses else "n/a"
    say(f"{verdict}: {r.steps_lost} steps lost, survivors in their own processes: {r.survivors_stayed}, max relative "
        f"difference {diff} (bound 1e-4); plot: {r.plot}; {r.seconds:.0f} s")
