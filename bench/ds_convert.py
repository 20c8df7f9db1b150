"""DeepSpeed ZeRO -> universal checkpoint conversion: unickpt vs DeepSpeed's ``ds_to_universal``.

    python -m bench.ds_convert [--dim 768 --layers 6 --vocab 8192] [--no-write]

Trains the example model for one step with DeepSpeed ZeRO-2 on 2 CPU ranks
(tests/ds_train.py), saves, then converts the same checkpoint with both tools, each in
its own process (``/usr/bin/time`` gives wall time and peak RSS), alternating, twice.
Reports the best time and the highest peak RSS of each, their ratios, and checks that both
outputs hold the same parameters and moments bitwise. Needs DeepSpeed (see README).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .report import write_into

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one command."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return wall, int(r.stderr.strip().splitlines()[-1]) / 1024


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _same(a: str, b: str) -> int:
    """Compare the two universal outputs tensor by tensor; returns the tensors compared."""
    n = 0
    for param in sorted(os.listdir(os.path.join(a, "zero"))):
        pa = os.path.join(a, "zero", param)
        if not os.path.isdir(pa):
            continue
        for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            x = torch.load(os.path.join(pa, f), weights_only=True)["param"]
            y = torch.load(os.path.join(b, "zero", param, f), weights_only=True)["param"]
            if x.shape != y.shape or not torch.equal(x, y):
                raise AssertionError(f"{param}/{f} differs between the two outputs")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    """Run the conversion benchmark and report."""
    ap = argparse.ArgumentParser(prog="python -m bench.ds_convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/PERFORMANCE.md alone")
    args = ap.parse_args(argv)
    base = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ds_", dir=base)
    started = time.time()
    try:
        ckpt = os.path.join(root, "ckpt")
        print("training one ZeRO-2 step on 2 ranks and saving ...", flush=True)
        subprocess.run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
            os.path.join(REPO, "tests", "ds_train.py"), "--stage", "2", "--steps", "1", "--save-dir", ckpt,
            "--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab),
            "--heads", "12", "--kv-heads", "4",
        ], env=ENV, check=True, capture_output=True)
        tag = os.path.join(ckpt, "global_step1")
        size = _tree_bytes(tag)
        tools = {
            "ds_to_universal": lambda out: [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                            "--input_folder", tag, "--output_folder", out, "--inject_missing_state"],
            "unickpt": lambda out: [sys.executable, "-m", "unickpt", "convert", tag, out, "--to", "deepspeed"],
        }
        best = {k: (float("inf"), 0.0) for k in tools}
        for rep in range(args.reps):
            for name, cmd in tools.items():
                out = os.path.join(root, f"{name}_{rep}")
                wall, rss = _timed(cmd(out))
                print(f"  {name}: {wall:.2f} s, peak RSS {rss:.0f} MiB", flush=True)
                best[name] = (min(best[name][0], wall), max(best[name][1], rss))
        compared = _same(os.path.join(root, "ds_to_universal_0"), os.path.join(root, "unickpt_0"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (dt, dm), (ut, um) = best["ds_to_universal"], best["unickpt"]
    text = "\n".join([
        "### DeepSpeed ZeRO-2 -> universal conversion",
        "",
        f"`python -m bench.ds_convert` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}): a ZeRO-2 checkpoint of the example model "
        f"(dim {args.dim}, {args.layers} layers, vocabulary {args.vocab}) saved by DeepSpeed on 2 ranks, "
        f"{size / 2**20:.0f} MiB on disk. Each tool runs in its own process (imports included), best of {args.reps}; "
        f"both outputs were compared bitwise ({compared} tensors equal).",
        "",
        "| tool | wall time | peak RSS |",
        "|---|---|---|",
        f"| DeepSpeed `ds_to_universal` | {dt:.2f} s | {dm:.0f} MiB |",
        f"| unickpt `convert --to deepspeed` | {ut:.2f} s | {um:.0f} MiB |",
        f"| ratio (DeepSpeed / unickpt) | {dt / ut:.2f}x | {dm / um:.2f}x |",
        "",
        "Targets: at least 5x faster and at most a quarter of the peak memory.",
    ])
    print()
    print(text)
    if not args.no_write:
        doc = os.path.join(REPO, "docs", "PERFORMANCE.md")
        write_into(doc, text, "ds_convert")
        print(f"\nwritten into {doc}")


if __name__ == "__main__":
    main()
