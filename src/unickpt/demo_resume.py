"""The resume-anywhere demo: train on one parallel layout, "lose" the job, resume on
another layout and world size, and show the loss curve continuing as if nothing happened.

Used by ``unickpt demo``. Ranks are spawned processes with a gloo group on localhost.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from .testing import run_ranks

COMMON = ["--steps", "16", "--seed", "0"]
BEFORE = ("tp2 x dp2 (FSDP2), 4 ranks", ["--tp", "2", "--fsdp"], 4)
AFTER = ("dp3 (FSDP2), 3 ranks", ["--fsdp"], 3)
RESUME_STEP = 8


def _train(rank: int, world: int, jobs: list[tuple[list[str], str]]) -> None:
    import torch.distributed as dist

    from .examples.train import run

    for flags, out in jobs:
        records = run(COMMON + flags)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(records, f)
        dist.barrier()


@dataclass
class ResumeDemo:
    """Losses of the unbroken reference run and of the run resumed on another layout."""

    reference: dict[int, float]
    resumed: dict[int, float]
    plot: str
    seconds: float

    @property
    def max_rel_diff(self) -> float:
        """Largest relative loss difference after the resume."""
        return max(abs(self.resumed[s] - self.reference[s]) / abs(self.reference[s]) for s in self.resumed)

    @property
    def ok(self) -> bool:
        """True when every resumed loss is within 1e-4 relative of the reference."""
        return sorted(self.resumed) == list(range(RESUME_STEP + 1, 17)) and self.max_rel_diff <= 1e-4


def _plot(reference: dict[int, float], resumed: dict[int, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(list(reference), list(reference.values()), "-o", color="#888888", label=f"unbroken: {BEFORE[0]}")
    ax.plot(list(resumed), list(resumed.values()), "x", color="#d62728", markersize=9, mew=2,
            label=f"resumed at step {RESUME_STEP} on {AFTER[0]}")
    ax.axvline(RESUME_STEP + 0.5, color="#d62728", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("unickpt: a job resumed on another layout continues its loss curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_resume_demo(directory: str | None = None, plot_path: str = "unickpt_demo_resume.png", console: Any = None) -> ResumeDemo:
    """Run the story and print a table (with rich, when ``console`` is given)."""
    start = time.time()
    root = directory or tempfile.mkdtemp(prefix="unickpt-demo-")
    ck = os.path.join(root, "checkpoints")
    say = console.print if console is not None else print
    say(f"1. training the reference on {BEFORE[0]} for 16 steps, checkpointing every {RESUME_STEP} ...")
    run_ranks(_train, BEFORE[2], [(BEFORE[1] + ["--save-every", str(RESUME_STEP), "--ckpt-dir", ck], f"{root}/reference.json")])
    say(f"2. the job is lost after step {RESUME_STEP}; resuming from {ck}/step_{RESUME_STEP:08d} on {AFTER[0]} ...")
    resume_from = os.path.join(ck, f"step_{RESUME_STEP:08d}")
    run_ranks(_train, AFTER[2], [(AFTER[1] + ["--resume", resume_from], f"{root}/resumed.json")])
    reference = {r["step"]: r["loss"] for r in json.load(open(f"{root}/reference.json"))}
    resumed = {r["step"]: r["loss"] for r in json.load(open(f"{root}/resumed.json"))}
    _plot(reference, resumed, plot_path)
    result = ResumeDemo(reference, resumed, os.path.abspath(plot_path), time.time() - start)
    _table(result, say, console)
    return result


def _table(result: ResumeDemo, say: Any, console: Any) -> None:
    try:
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Table = None
    rows = []
    for step, ref in result.reference.items():
        got = result.resumed.get(step)
        rel = "" if got is None else f"{abs(got - ref) / abs(ref):.1e}"
        rows.append((str(step), f"{ref:.6f}", "" if got is None else f"{got:.6f}", rel))
    if console is not None and Table is not None:
        t = Table(title=f"loss: unbroken ({BEFORE[0]}) vs resumed at step {RESUME_STEP} ({AFTER[0]})")
        for col in ("step", "unbroken", "resumed", "rel. diff"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
    else:
        for r in rows:
            say("  ".join(r))
    verdict = "OK" if result.ok else "MISMATCH"
    say(f"{verdict}: max relative difference after the resume {result.max_rel_diff:.1e} (bound 1e-4); "
        f"plot: {result.plot}; {result.seconds:.0f} s")
