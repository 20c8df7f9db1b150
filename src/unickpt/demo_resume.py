"""The resume-anywhere demo: train on one parallel layout, "lose" the job, resume on
another layout and world size, and show the loss curve continuing as if nothing happened.

Used by ``unickpt demo``. Ranks are processes with a gloo group on localhost, forked from
one server that imported torch and the example trainer once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .errors import UnickptError
from .testing import run_ranks

COMMON = ["--steps", "16", "--seed", "0", "--print-every", "0"]
BEFORE = ("tp2 x dp2 (FSDP2), 4 ranks", ["--tp", "2", "--fsdp"], 4)
AFTER = ("dp3 (FSDP2), 3 ranks", ["--fsdp"], 3)
RESUME_STEP = 8
# imported once by the server the ranks are forked from (a spawned rank spends seconds on them)
RANK_IMPORTS = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "unickpt",
                "unickpt.examples.train"]


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
        return max(rel_diffs(self.reference, self.resumed).values())

    @property
    def ok(self) -> bool:
        """True when every resumed loss is within 1e-4 relative of the reference."""
        return sorted(self.resumed) == list(range(RESUME_STEP + 1, 17)) and self.max_rel_diff <= 1e-4


def rel_diffs(reference: dict[int, float], resumed: dict[int, float]) -> dict[int, float]:
    """Relative loss difference ``|resumed - unbroken| / |unbroken|`` of every resumed step."""
    return {s: abs(resumed[s] - reference[s]) / abs(reference[s]) for s in resumed}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed). The demos' plots are
    all unickpt needs matplotlib for: without it (the ``demo`` extra), a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise UnickptError("the demo draws its plot with matplotlib, which is not installed: "
                           "pip install 'unickpt[demo]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    """Write a demo's figure to ``path`` (PNG) and free it."""
    fig.savefig(path)
    pyplot().close(fig)


def plot_figure(reference: dict[int, float], resumed: dict[int, float]) -> Any:
    """The demo's matplotlib figure, two panels: both loss curves, then the relative
    difference on a log scale (a 1e-3 error is invisible on the first, obvious on the second)."""
    plt = pyplot()
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    resume_label = f"job lost after step {RESUME_STEP}, resumed on {AFTER[2]} ranks"
    ax.plot(list(reference), list(reference.values()), "-o", color="#888888", label=f"unbroken: {BEFORE[0]}")
    ax.plot(list(resumed), list(resumed.values()), "x", color="#d62728", markersize=9, mew=2,
            label=f"resumed at step {RESUME_STEP} on {AFTER[0]}")
    ax.set_ylabel("training loss")
    ax.set_title("unickpt: a job resumed on another layout continues its loss curve")

    diffs = rel_diffs(reference, resumed)
    floor = min([d for d in diffs.values() if d > 0] + [1e-7]) / 10  # where an exact 0 is drawn
    exact = [s for s, d in diffs.items() if d == 0]
    dx.semilogy(list(diffs), [max(d, floor) for d in diffs.values()], "x-", color="#d62728", mew=2,
                label="|resumed - unbroken| / unbroken")
    if exact:
        dx.semilogy(exact, [floor] * len(exact), "o", mfc="none", color="#2ca02c", label="0: bitwise equal")
    dx.axhline(1e-4, color="black", linestyle="--", linewidth=1, label="bound of the check: 1e-4")
    dx.set_ylim(floor / 3, max([1e-2, *diffs.values()]) * 3)
    dx.set_xlabel("step")
    dx.set_ylabel("relative difference")
    for a in (ax, dx):
        a.axvline(RESUME_STEP + 0.5, color="#d62728", linestyle=":", linewidth=1,
                  label=resume_label if a is ax else None)
        a.legend(fontsize=8, loc="upper right" if a is ax else "upper left")  # where the curves are not
    fig.tight_layout()
    return fig


def run_resume_demo(directory: str | None = None, plot_path: str = "unickpt_demo_resume.png", console: Any = None) -> ResumeDemo:
    """Run the story and print a table (with rich, when ``console`` is given). Checkpoints
    go under ``directory`` (kept), or a temporary directory removed at the end."""
    from .demo import demo_dir

    pyplot()  # before minutes of training: the plot needs matplotlib
    start = time.time()
    say = console.print if console is not None else print
    with demo_dir(directory) as base:
        root = str(base)
        ck = os.path.join(root, "checkpoints")
        say(f"1. training the reference on {BEFORE[0]} for 16 steps, checkpointing every {RESUME_STEP} ...")
        run_ranks(_train, BEFORE[2], [(BEFORE[1] + ["--save-every", str(RESUME_STEP), "--ckpt-dir", ck], f"{root}/reference.json")],
                  preload=RANK_IMPORTS)
        say(f"2. the job is lost after step {RESUME_STEP}; resuming from {ck}/step_{RESUME_STEP:08d} on {AFTER[0]} ...")
        resume_from = os.path.join(ck, f"step_{RESUME_STEP:08d}")
        run_ranks(_train, AFTER[2], [(AFTER[1] + ["--resume", resume_from], f"{root}/resumed.json")], preload=RANK_IMPORTS)
        reference = {r["step"]: r["loss"] for r in json.load(open(f"{root}/reference.json"))}
        resumed = {r["step"]: r["loss"] for r in json.load(open(f"{root}/resumed.json"))}
    save_figure(plot_figure(reference, resumed), plot_path)
    result = ResumeDemo(reference, resumed, os.path.abspath(plot_path), time.time() - start)
    _table(result, say, console)
    return result


def print_rows(say: Any, console: Any, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]],
               left: tuple[str, ...] = ()) -> None:
    """A demo's table: the title on a line of its own (a table title would wrap in a
    narrow terminal), then the rows under ``columns`` (a rich table on a console, else
    plain lines); the columns named in ``left`` are left-aligned, the others right."""
    try:
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Table = None
    say(title)
    if console is not None and Table is not None:
        t = Table()
        for col in columns:
            t.add_column(col, justify="left" if col in left else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)
    else:
        for r in [columns, *rows]:
            say("  ".join(r))


def _table(result: ResumeDemo, say: Any, console: Any) -> None:
    rows = []
    for step, ref in result.reference.items():
        got = result.resumed.get(step)
        rel = "" if got is None else f"{abs(got - ref) / abs(ref):.1e}"
        rows.append((str(step), f"{ref:.6f}", "" if got is None else f"{got:.6f}", rel))
    print_rows(say, console, f"loss: unbroken ({BEFORE[0]}) vs resumed at step {RESUME_STEP} ({AFTER[0]})",
               ("step", "unbroken", "resumed", "rel. diff"), rows)
    verdict = "OK" if result.ok else "MISMATCH"
    say(f"{verdict}: max relative difference after the resume {result.max_rel_diff:.1e} (bound 1e-4); "
        f"plot: {result.plot}; {result.seconds:.0f} s")
