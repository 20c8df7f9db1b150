"""Fixed costs per tensor: save, load, convert and verify of many small tensors.

    python -m bench.many_tensors [--tensors 2000] [--shape 64,64] [--reps 3]

One process, no process group, page cache warm: what is measured is the time spent per
tensor outside the bytes themselves (manifest, pieces, planning). Prints the best of
``reps`` for each operation, and ms per tensor. Prints only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

import unickpt

from .machine import best_time


def main(argv: list[str] | None = None) -> None:
    """Run and print."""
    ap = argparse.ArgumentParser(prog="python -m bench.many_tensors", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--shape", default="64,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    base = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="many_", dir=base)
    ck, out = os.path.join(root, "ck"), os.path.join(root, "consolidated")
    sd = {f"layers.{i}.w": torch.randn(shape) for i in range(args.tensors)}
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    try:
        def convert() -> None:
            shutil.rmtree(out, ignore_errors=True)
            unickpt.convert(ck, out, consolidate=True)

        times = {
            "save": best_time(lambda: unickpt.save(sd, ck, overwrite=True), args.reps),
            "load": best_time(lambda: unickpt.load(target, ck), args.reps),
            "convert --consolidate": best_time(convert, args.reps),
            "verify": best_time(lambda: unickpt.verify(ck), args.reps),
        }
        assert all(torch.equal(target[k], v) for k, v in sd.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.tensors} tensors of shape {shape} (float32), best of {args.reps}:")
    for name, secs in times.items():
        print(f"  {name:<22} {secs:6.3f} s   {1000 * secs / args.tensors:.3f} ms per tensor")


if __name__ == "__main__":
    main()
