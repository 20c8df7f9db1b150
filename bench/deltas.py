"""The per-step delta log of the example trainer (``--log-deltas``): its cost per step, and
the steps a crash loses with it against full checkpoints alone.

    python -m bench.deltas            # 2 ranks (FSDP2), 0.1 s of compute per step
    python -m bench.deltas --quick    # fewer steps and kills

* **overhead**: the example trainer on 2 spawned ranks (FSDP2), ``--compute-sleep``
  standing in for accelerator compute, full checkpoints every K steps in both arms; the
  step time (the trainer's own ``s/step`` lines, the first interval dropped) with and
  without ``--log-deltas``, arms alternated in the same processes, median over reps.
* **steps lost**: the trainer (1 process) SIGKILLed at random moments between full
  checkpoints; steps done (its loss log) minus the step recovery reaches: from the
  newest full checkpoint alone, and from it plus the log (the plan a relaunch makes,
  :func:`unickpt.api.deltas.log.replayable`, with every entry's checksums verified).

Prints a markdown table (docs/PERFORMANCE.md, "Per-step delta log").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from unickpt.api.deltas.log import replayable, step_of
from unickpt.testing import run_ranks

K = 10


def _step_times(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"([0-9.]+) s/step", text)]


def overhead_rank(rank: int, world: int, cfg: dict) -> None:
    """Alternate runs with and without the log; rank 0 writes the step times to ``out``."""
    from unickpt.examples import delta_replay
    from unickpt.examples.train import run

    rows: dict[str, list[float]] = {"base": [], "log": [], "stall": []}
    capture = delta_replay.TrainerDeltas.capture

    logs = []

    def timed_capture(self, job, step):  # what the loop waits for: the host copy and the queue
        t0 = time.perf_counter()
        capture(self, job, step)
        rows["stall"].append(time.perf_counter() - t0)
        if self.log not in logs:
            logs.append(self.log)

    delta_replay.TrainerDeltas.capture = timed_capture
    for rep in range(cfg["reps"]):
        for arm in ("base", "log"):
            d = os.path.join(cfg["dir"], f"{arm}_{rep}")
            flags = ["--fsdp", "--steps", str(cfg["steps"]), "--save-every", str(K), "--ckpt-dir", d,
                     "--compute-sleep", str(cfg["sleep"]), "--print-every", "5", *cfg["model"]]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                run(flags + (["--log-deltas"] if arm == "log" else []))
            rows[arm] += _step_times(printed.getvalue())[1:]
    n = sum(log.stats["entries"] for log in logs)
    rows["write_s"] = [sum(log.stats["write_s"] for log in logs) / n]
    rows["write_cpu_s"] = [sum(log.stats["write_cpu_s"] for log in logs) / n]
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)


def overhead(model: list[str], sleep: float, steps: int, reps: int, tmp: str) -> dict:
    """Median step time with and without the log, and the log's entry size."""
    out = os.path.join(tmp, "overhead.json")
    cfg = {"dir": tmp, "out": out, "steps": steps, "reps": reps, "sleep": sleep, "model": model}
    run_ranks(overhead_rank, 2, cfg, timeout=1200, preload=["unickpt.examples.train"])
    rows = json.load(open(out))
    base, log = statistics.median(rows["base"]), statistics.median(rows["log"])
    entry = os.path.join(tmp, "log_0", "deltas")
    sizes = [sum(os.path.getsize(os.path.join(entry, n, f)) for f in os.listdir(os.path.join(entry, n)))
             for n in os.listdir(entry)] if os.path.isdir(entry) else [0]
    return {"base": base, "log": log, "overhead": (log - base) / base, "entry_bytes": max(sizes),
            "stall": statistics.median(rows["stall"]), "stall_max": max(rows["stall"]),
            "write_s": rows["write_s"][0], "write_cpu_s": rows["write_cpu_s"][0]}


def lost_on_kill(tmp: str, kills: int, sleep: float, seed: int) -> list[tuple[int, int, int]]:
    """(steps done, lost with full checkpoints only, lost with the log) per SIGKILL."""
    rng = random.Random(seed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = []
    for i in range(kills):
        d = os.path.join(tmp, f"kill_{i}")
        log = os.path.join(d, "loss.jsonl")
        os.makedirs(d)
        target = K + rng.randrange(1, K)  # a step between the full checkpoints of K and 2K
        p = subprocess.Popen([sys.executable, "-m", "unickpt.examples.train", "--steps", str(3 * K), "--save-every", str(K),
                              "--ckpt-dir", os.path.join(d, "ck"), "--log-deltas", "--loss-log", log,
                              "--compute-sleep", str(sleep), "--print-every", "0"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        while not (os.path.exists(log) and sum(1 for _ in open(log)) >= target):
            if p.poll() is not None:
                raise RuntimeError(f"the trainer ended early (exit {p.returncode})")
            time.sleep(0.005)
        time.sleep(rng.uniform(0, sleep))  # anywhere in the next step
        p.send_signal(signal.SIGKILL)
        p.wait()
        done = max(json.loads(line)["step"] for line in open(log))
        ck = os.path.join(d, "ck")
        latest = _latest(ck)
        full = step_of(latest) if latest else 0
        plan = replayable(ck, os.path.join(ck, "deltas"))
        out.append((done, done - full, done - plan.step))
    return out


def drift(tmp: str) -> dict[str, tuple[float, float, int]]:
    """Per --delta-dtype: after a stop at step 2K-1 and a relaunch that replays K-1 logged
    steps, the largest relative loss difference from an unbroken run over the steps that
    follow, the largest weight difference in the full checkpoint of step 2K; an entry's bytes."""
    import unickpt
    from unickpt.examples.train import run

    steps = 3 * K - 5
    base = ["--steps", str(steps), "--save-every", str(K), "--print-every", "0"]
    with contextlib.redirect_stdout(io.StringIO()):
        ref = {r["step"]: r["loss"] for r in run([*base, "--ckpt-dir", os.path.join(tmp, "drift_ref")])}
        out = {}
        for dtype in ("exact", "bf16"):
            d = os.path.join(tmp, f"drift_{dtype}")
            flags = [*base, "--ckpt-dir", d, "--log-deltas", "--delta-dtype", dtype]
            run([*flags, "--stop-after", str(2 * K - 1)])
            after = run(flags)
            rel = max(abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]) for r in after)
            entry = os.path.join(d, "deltas", f"step_{steps:08d}")
            a, b = os.path.join(d, f"step_{2 * K:08d}"), os.path.join(tmp, "drift_ref", f"step_{2 * K:08d}")
            weights = max((unickpt.load_tensor(a, n) - unickpt.load_tensor(b, n)).abs().max().item()
                          for n in unickpt.read_manifest(a).tensors if n.startswith("model."))
            out[dtype] = (rel, weights, sum(os.path.getsize(os.path.join(entry, f)) for f in os.listdir(entry)))
    return out


def _latest(ck: str) -> str | None:
    import unickpt

    return unickpt.CheckpointManager(ck).latest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds of compute per step (a sleep)")
    ap.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="unickpt-bench-deltas-", dir=a.dir)
    steps, reps, kills = (25, 1, 3) if a.quick else (45, 2, 6)  # not a multiple of K: entries remain to measure
    try:
        models = {"default (dim 64, 4 layers)": [], "dim 256, 4 layers": ["--dim", "256"]}
        print("| model | entry per step (both ranks) | step time | with --log-deltas | difference | loop's wait per step (median / max) | entry write, background (wall / CPU) |")
        print("|---|---|---|---|---|---|---|")
        for name, flags in models.items():
            sub = os.path.join(tmp, re.sub(r"\W+", "_", name))
            os.makedirs(sub)
            r = overhead(flags, a.sleep, steps, reps, sub)
            print(f"| {name} | {r['entry_bytes'] / 1e6:.2f} MB | {r['base']:.4f} s | {r['log']:.4f} s | "
                  f"{100 * r['overhead']:+.1f}% | {1e3 * r['stall']:.2f} ms ({100 * r['stall'] / r['base']:.1f}%) / "
                  f"{1e3 * r['stall_max']:.1f} ms | {1e3 * r['write_s']:.1f} ms / {1e3 * r['write_cpu_s']:.1f} ms |", flush=True)
        print(f"\n| --delta-dtype | entry (1 rank) | after replaying {K - 1} steps: largest relative loss difference "
              f"(steps {2 * K}..{3 * K - 5}) | largest weight difference (step {2 * K}) |")
        print("|---|---|---|---|")
        for dtype, (rel, weights, nbytes) in drift(tmp).items():
            print(f"| {dtype} | {nbytes / 1e6:.2f} MB | {rel:.2e} | {weights:.2e} |", flush=True)
        rows = lost_on_kill(tmp, kills, a.sleep, seed=1)
        print(f"\n| SIGKILL after step | lost, full checkpoints every {K} | lost, with the log |")
        print("|---|---|---|")
        for done, full, log in rows:
            print(f"| {done} | {full} | {log} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
