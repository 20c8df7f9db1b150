"""Incremental saves of a fine-tune with 95% of the state frozen.

    python -m bench.incremental [--gib 1] [--tensors 200] [--changed 0.05] [--reps 3] [--dir DIR]

One process, no process group. The state is ``--tensors`` fp32 tensors of equal size,
``--gib`` GiB together; at each step the same ``--changed`` share of them (the trainable
ones) changes, the rest stays frozen. Measured, best of ``--reps`` (wall clock, fsync
included, page cache as it is):

* a full save, and an incremental save against the previous checkpoint (sync ``save``
  and ``async_save`` to commit): bytes written (the checkpoint's own files) and time;
  the time an ``async_save`` call blocks, full and incremental;
* the identity decision itself: xxh3-128 over every byte (1 and 4 threads), against the
  alternative of comparing with the base's bytes read back from its file (page cache
  warm, the best case for the comparison);
* what identities cost every save: the checksum pass with and without xxh3-128;
* a load of the incremental checkpoint (it reads from two checkpoints), against a load of
  the full one.

Prints a table and the ratios; writes nothing else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import unickpt
from unickpt.api.incremental import stored_bytes
from unickpt.engine.writer import as_bytes
from unickpt.format.checksum import block_crcs, block_digests, block_sums, identity
from unickpt.format.manifest import DEFAULT_BLOCK_BYTES

from .machine import best_time


def _hash_all(sd: dict, threads: int) -> None:
    def one(t: torch.Tensor) -> str:
        return identity(block_digests(as_bytes(t), DEFAULT_BLOCK_BYTES))

    if threads == 1:
        [one(t) for t in sd.values()]
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, sd.values()))


def _compare_all(sd: dict, path: str) -> None:
    """Read every fragment of the checkpoint at ``path`` back and compare it with ``sd``."""
    m = unickpt.read_manifest(path)
    for name, t in sd.items():
        frag = m.tensors[name].fragments[0]
        buf = torch.empty_like(t)
        with open(os.path.join(path, frag.file), "rb") as f:
            f.seek(frag.offset)
            f.readinto(memoryview(buf.numpy()).cast("B"))
        torch.equal(buf, t)


def main(argv: list[str] | None = None) -> None:
    """Run and print."""
    ap = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--changed", type=float, default=0.05, help="share of the tensors that change per step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: ./.bench_tmp)")
    args = ap.parse_args(argv)
    numel = int(args.gib * (1 << 30)) // 4 // args.tensors
    sd = {f"layers.{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    trainable = list(sd)[: max(1, round(args.changed * args.tensors))]
    total = sum(t.numel() * 4 for t in sd.values())
    scratch = os.path.abspath(args.dir or ".bench_tmp")
    os.makedirs(scratch, exist_ok=True)
    root = tempfile.mkdtemp(prefix="incremental_", dir=scratch)
    base, full, inc, inc_async = (os.path.join(root, n) for n in ("base", "full", "inc", "inc_async"))

    def step() -> None:
        for n in trainable:
            sd[n].add_(1e-3)

    def fresh(path: str):
        return lambda: (shutil.rmtree(path, ignore_errors=True), step())

    try:
        unickpt.save(sd, base)
        t_full = best_time(lambda: unickpt.save(sd, full), args.reps, fresh(full))
        t_inc = best_time(lambda: unickpt.save(sd, inc, base=base), args.reps, fresh(inc))
        t_async = best_time(lambda: unickpt.async_save(sd, inc_async, base=base).result(), args.reps, fresh(inc_async))
        calls = {"full": float("inf"), "incremental": float("inf")}
        # how long the training loop is blocked: the call (each kind in a row, after one
        # warm-up, so the staging buffer has the size that kind keeps)
        for kind, path, kw in (("full", full, {}), ("incremental", inc_async, {"base": base})):
            for _ in range(args.reps + 1):
                fresh(path)()
                t0 = time.perf_counter()
                h = unickpt.async_save(sd, path, **kw)
                calls[kind] = min(calls[kind], time.perf_counter() - t0)
                h.result()
        full_bytes = stored_bytes(unickpt.read_manifest(full))[0]
        inc_bytes, referenced = stored_bytes(unickpt.read_manifest(inc))
        t_hash1 = best_time(lambda: _hash_all(sd, 1), args.reps)
        t_hash4 = best_time(lambda: _hash_all(sd, 4), args.reps)
        t_cmp = best_time(lambda: _compare_all(sd, full), args.reps)
        views = [as_bytes(t) for t in sd.values()]
        t_crc = best_time(lambda: [block_crcs(v, DEFAULT_BLOCK_BYTES) for v in views], args.reps)
        t_sums = best_time(lambda: [block_sums(v, DEFAULT_BLOCK_BYTES) for v in views], args.reps)
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        t_load_full = best_time(lambda: unickpt.load(target, full), args.reps)
        t_load_inc = best_time(lambda: unickpt.load(target, inc_async), args.reps)  # holds the current state
        assert all(torch.equal(target[k], v) for k, v in sd.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gib = total / (1 << 30)
    print(f"state: {args.tensors} fp32 tensors, {gib:.2f} GiB; {len(trainable)} change per step "
          f"({100 * len(trainable) / args.tensors:.0f}%), the rest frozen; best of {args.reps}")
    rows = [
        ("full save", t_full, full_bytes),
        ("incremental save", t_inc, inc_bytes),
        ("incremental async_save (to commit)", t_async, inc_bytes),
    ]
    print(f"{'':38} {'time':>9} {'written':>12}")
    for name, t, b in rows:
        print(f"{name:38} {t:8.3f}s {b / (1 << 20):9.1f} MiB")
    print(f"incremental: {referenced / (1 << 20):.1f} MiB referenced in the base")
    print(f"async_save call (training blocked): full {calls['full']:.3f}s, incremental {calls['incremental']:.3f}s")
    print(f"ratio written: {inc_bytes / full_bytes:.4f} of a full save ({100 * inc_bytes / full_bytes:.2f}%)")
    print(f"ratio time:    {t_inc / t_full:.4f} of a full save (sync), {t_async / t_full:.4f} (async, to commit)")
    print(f"identity decision over {gib:.2f} GiB: xxh3-128 {t_hash1:.3f}s (1 thread, {gib / t_hash1:.1f} GiB/s), "
          f"{t_hash4:.3f}s (4 threads); read back + compare {t_cmp:.3f}s ({gib / t_cmp:.1f} GiB/s, page cache warm)")
    print(f"checksum pass of every save, 1 thread: CRC-32C only {t_crc:.3f}s, CRC-32C + xxh3-128 identity {t_sums:.3f}s "
          f"(+{t_sums - t_crc:.3f}s per {gib:.2f} GiB)")
    print(f"load: full {t_load_full:.3f}s, incremental {t_load_inc:.3f}s")


if __name__ == "__main__":
    main()
