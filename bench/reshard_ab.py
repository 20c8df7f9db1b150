"""Is the resharded load disk-bound? An A/B of unickpt and DCP with CPU time per rank.

    python -m bench.reshard_ab [--gib 1] [--reps 2]

Saves the benchmark's state (``bench.state``, rows) with both libraries on 4 ranks, then
loads each on 2 ranks with weights split by columns (the ``bench.run`` resharded load),
page cache dropped before every load, and prints per load the wall time and the CPU
seconds of each rank (``getrusage``). Last, the same files are read cold in one stream
(as ``dd bs=64M``): the time the disk alone needs for those bytes. Prints only.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.testing import run_ranks

from . import state as S
from .machine import drop_caches

GiB = 1 << 30


def _save(rank: int, world: int, cfg: dict) -> None:
    sd = S.build(cfg["bytes"], "rows", fill=True)
    unickpt.save(sd, os.path.join(cfg["root"], "unickpt"))
    dcp.save(sd, checkpoint_id=os.path.join(cfg["root"], "dcp"))


def _load(rank: int, world: int, cfg: dict) -> None:
    target = S.build(cfg["bytes"], "cols", fill=False)
    for lib in ("unickpt", "dcp"):
        path = os.path.join(cfg["root"], lib)
        for _ in range(cfg["reps"]):
            for v in target.values():
                v.to_local().zero_()
            S.cold()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            wall = S.timed(lambda: unickpt.load(target, path) if lib == "unickpt" else dcp.load(target, checkpoint_id=path))
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
            print(f"  rank {rank} {lib}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        S.check(target, cfg["bytes"], "cols")


def _cold_read(paths: list[str]) -> tuple[int, float]:
    drop_caches()
    buf = bytearray(64 << 20)
    n, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Run the A/B and print it."""
    ap = argparse.ArgumentParser(prog="python -m bench.reshard_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="reshard_", dir=base)
    cfg = {"root": root, "bytes": int(args.gib * GiB), "reps": args.reps}
    try:
        print(f"saving {args.gib} GiB on 4 ranks with both libraries ...", flush=True)
        run_ranks(_save, 4, cfg, timeout=3600)
        print("loading on 2 ranks, weights by columns, cold:", flush=True)
        run_ranks(_load, 2, cfg, timeout=3600)
        files = sorted(os.path.join(root, "unickpt", f) for f in os.listdir(os.path.join(root, "unickpt")) if f.endswith(".safetensors"))
        n, secs = _cold_read(files)
        print(f"cold read of the same {n / 1e9:.2f} GB in one stream: {secs:.2f} s ({n / 1e9 / secs:.2f} GB/s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
