"""The fault-tolerance demo: 4 simulated nodes train with in-memory snapshots, one node is
lost mid-run, and the job continues on the 3 survivors from memory.

Used by ``unickpt demo --fault-tolerance``. Each node is one torchrun agent on localhost
with its own shared-memory root (``UNICKPT_SHM_ROOT``); losing a node is SIGKILL of its
processes (trainer and snapshot keeper) and deletion of its shm root. The other nodes'
trainers are stopped too, as a scheduler restarting the job would; their keepers, and the
snapshots they hold, live on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from .demo_resume import print_rows, pyplot, save_figure
from .testing import free_port, kill_session

NODES, LOST = 4, 2
STEPS, SNAPSHOT_EVERY, SAVE_EVERY = 16, 2, 8
FAIL_AFTER = 11  # the node is lost once step 11 has run (the snapshot of step 10 is whole)
FLAGS = ["--steps", str(STEPS), "--seed", "0", "--fsdp", "--snapshot-every", str(SNAPSHOT_EVERY),
         "--save-every", str(SAVE_EVERY)]


@dataclass
class FaultDemo:
    """What happened: losses of the unbroken run and of the run that lost a node."""

    reference: dict[int, float]
    before: dict[int, float]
    after: dict[int, float]
    line: str
    failed_at: int
    recovery_s: float
    plot: str
    seconds: float

    @property
    def resumed_step(self) -> int:
        """The step the survivors resumed from (0 if none)."""
        return int(self.line.split()[2]) if self.line.startswith("resumed step") else 0

    @property
    def max_rel_diff(self) -> float:
        """Largest relative loss difference after the recovery."""
        return max(abs(v - self.reference[s]) / abs(self.reference[s]) for s, v in self.after.items())

    @property
    def ok(self) -> bool:
        """True when the survivors resumed from memory and their losses match within 1e-4."""
        return ("from memory" in self.line and sorted(self.after) == list(range(self.resumed_step + 1, STEPS + 1))
                and self.max_rel_diff <= 1e-4)


def _launch(root: str, shm: list[str], flags: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    procs = []
    for i, r in enumerate(shm):
        cmd = [torchrun, f"--nnodes={len(shm)}", f"--node-rank={i}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--log-dir={os.path.join(root, f'node{i}-torchrun')}",
               "-m", "unickpt.examples.train", *flags]  # --log-dir: torchrun's own folder, else a torchelastic_* left in /tmp
        env = dict(os.environ, UNICKPT_SHM_ROOT=r, UNICKPT_JOB_ID="demo", OMP_NUM_THREADS="1")
        out = open(os.path.join(root, f"node{i}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _kill_keeper(shm: str) -> None:
    try:
        os.kill(int(open(os.path.join(shm, "keeper.pid")).read()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass


def _losses(path: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))} if os.path.exists(path) else {}


def _whole(shm: str, step: int) -> bool:
    return os.path.exists(os.path.join(shm, "unickpt", "demo", f"step_{step:08d}", "whole"))


def _logs(root: str, count: int) -> str:
    """The last lines of the nodes' logs, for an error raised before ``root`` is removed."""
    tails = []
    for i in range(count):
        try:
            with open(os.path.join(root, f"node{i}.log"), errors="replace") as f:
                tails.append(f"--- node {i} (last lines) ---\n" + "\n".join(f.read().splitlines()[-15:]))
        except OSError:
            pass
    return "\n".join(tails)


def run_fault_demo(directory: str | None = None, plot_path: str = "unickpt_demo_fault.png", console: Any = None) -> FaultDemo:
    """Run the story, print a table (with rich when ``console`` is given), write the PNG.
    Checkpoints, logs and the nodes' shared-memory roots go under ``directory`` (kept), or
    a temporary directory removed however the demo ends (a failure's error carries the
    last lines of the nodes' logs)."""
    from .demo import demo_dir

    pyplot()  # before minutes of training: the plot needs matplotlib
    with demo_dir(directory) as base:
        return _run(os.path.abspath(base), plot_path, console)  # the jobs run in it: paths absolute


def _run(root: str, plot_path: str, console: Any) -> FaultDemo:
    start = time.time()
    shm = [os.path.join(root, f"shm{i}") for i in range(NODES)]
    say = console.print if console is not None else print
    from .examples.train import run

    say(f"1. the unbroken reference: {STEPS} steps in one process ...")
    reference = {r["step"]: r["loss"] for r in run(FLAGS[:4])}
    log = os.path.join(root, "run.jsonl")
    flags = [*FLAGS, "--ckpt-dir", os.path.join(root, "ckpt"), "--loss-log", log]
    say(f"2. training on {NODES} simulated nodes (FSDP, 1 rank each), snapshot every {SNAPSHOT_EVERY} steps "
        f"with XOR parity, durable checkpoint every {SAVE_EVERY} ...")
    procs = _launch(root, shm, [*flags, "--compute-sleep", "0.3"])
    try:
        deadline = time.monotonic() + 600
        while not (max(_losses(log), default=0) >= FAIL_AFTER and all(_whole(r, FAIL_AFTER - 1) for r in shm)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the run did not reach step {FAIL_AFTER}:\n{_logs(root, NODES)}")
            time.sleep(0.05)
        failed_at = max(_losses(log))
        say(f"3. node {LOST} lost after step {failed_at}: its trainer and keeper SIGKILLed, its shared memory deleted; "
            "the job is restarted on the 3 survivors ...")
        kill_session(procs[LOST])
        _kill_keeper(shm[LOST])
        shutil.rmtree(shm[LOST], ignore_errors=True)
        for p in procs:
            kill_session(p)
        before = _losses(log)
        survivors = [r for i, r in enumerate(shm) if i != LOST]
        procs = _launch(root, survivors, flags)
        for p in procs:
            p.wait(600)
        outs = [open(os.path.join(root, f"node{i}.log")).read() for i in range(len(survivors))]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"the survivors failed:\n{_logs(root, len(survivors))}")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_session(p)
        for r in shm:
            _kill_keeper(r)
    line = next((x for o in outs for x in o.splitlines() if x.startswith(("resumed step", "starting fresh"))), "")
    after = {s: v for s, v in _losses(log).items() if s > int(line.split()[2])} if line.startswith("resumed") else {}
    before = {s: v for s, v in before.items() if s <= failed_at}
    recovery_s = float(line.rsplit(" ", 2)[-2]) if line.endswith(" s)") else float("nan")
    result = FaultDemo(reference, before, after, line, failed_at, recovery_s, os.path.abspath(plot_path), time.time() - start)
    save_figure(plot_figure(result), plot_path)
    _table(result, say, console)
    return result


def plot_figure(r: FaultDemo) -> Any:
    """The demo's figure (a matplotlib Figure): both loss curves, the node loss marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    ax.plot(list(r.reference), list(r.reference.values()), "-", color="#888888", label="unbroken run")
    ax.plot(list(r.before), list(r.before.values()), "o", color="#1f77b4", label=f"{NODES} nodes")
    ax.plot(list(r.after), list(r.after.values()), "x", color="#d62728", markersize=9, mew=2,
            label=f"{NODES - 1} survivors, resumed from memory at step {r.resumed_step}")
    ax.axvline(r.failed_at + 0.5, color="#d62728", linestyle=":", linewidth=1)
    # the note goes on the wider side of the line (the failure comes late in the run: text
    # to its right would run past the frame)
    late = r.failed_at + 0.5 > (min(r.reference) + max(r.reference)) / 2
    ax.annotate(f"node {LOST} lost after step {r.failed_at}\ndecoded from parity, "
                f"recovered in {r.recovery_s:.2f} s", xy=(r.failed_at + 0.5, max(r.reference.values())),
                xytext=(-6 if late else 6, -4), textcoords="offset points", ha="right" if late else "left", va="top",
                fontsize=8, color="#d62728")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("unickpt: a lost node, the job continues on the survivors from memory")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return fig


def _table(r: FaultDemo, say: Any, console: Any) -> None:
    rows = []
    for step, ref in r.reference.items():
        if step in r.after:
            got, where = r.after[step], f"{NODES - 1} nodes" + (" (redone)" if step in r.before else "")
        elif step in r.before:
            got, where = r.before[step], f"{NODES} nodes" + (" (lost)" if step > r.resumed_step else "")
        else:
            got, where = None, ""
        note = ""
        if step == r.resumed_step:
            note = "last whole snapshot"
        if step == r.failed_at:
            note = f"node {LOST} lost"
        rel = "" if got is None else f"{abs(got - ref) / abs(ref):.1e}"
        rows.append((str(step), f"{ref:.6f}", "" if got is None else f"{got:.6f}", where, rel, note))
    print_rows(say, console, "loss: unbroken run vs a run that loses a node",
               ("step", "unbroken", "this run", "on", "rel. diff", "note"), rows, left=("on", "note"))
    say(f"recovery: {r.line}")
    verdict = "OK" if r.ok else "MISMATCH"
    diff = f"{r.max_rel_diff:.1e}" if r.after else "n/a"
    say(f"{verdict}: max relative difference after the recovery {diff} (bound 1e-4); plot: {r.plot}; {r.seconds:.0f} s")
