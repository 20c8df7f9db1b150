"""DCP's own FileSystemWriter against unickpt's DCP storage plugin, same state, same ranks.

    python -m bench.dcp_plugin [--mib 256] [--ranks 2] [--reps 3]

The benchmark's state (``bench.state``: DTensor rows over the ranks, about ``--mib`` MiB
in all) is saved with ``dcp.save(storage_writer=...)`` through each writer, alternating,
``--reps`` times (a fresh directory each time; wall time from a barrier to a barrier),
then with ``dcp.async_save`` (thread mode, on a gloo group of its own): the stall is the
time until ``async_save`` returns (its staging, the slowest rank), the upload is awaited
before the next save; also with ``FileSystemWriter(cache_staged_state_dict=True)``, one
writer for all saves (DCP's way to reuse staging memory; it pins, so only where CUDA is
available). Prints the best and
median of each, and the ratios (DCP's / unickpt's: above 1 means unickpt is faster). Page
cache not dropped: both write into it the same way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unickpt.dcp import StorageWriter
from unickpt.testing import run_ranks

from . import state as S

MiB = 1 << 20
NAMES = {"dcp": "FileSystemWriter", "dcp_cached": "FileSystemWriter(cache_staged_state_dict=True)",
         "unickpt": "unickpt StorageWriter"}


def _writer(lib: str, path: str):
    return StorageWriter(path) if lib == "unickpt" else dcp.FileSystemWriter(path)


def _clear(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _run(rank: int, world: int, cfg: dict) -> None:
    sd = S.build(cfg["bytes"], "rows", fill=True)
    gloo = dist.new_group(backend="gloo")
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    libs = ("dcp", "dcp_cached", "unickpt") if torch.cuda.is_available() else ("dcp", "unickpt")  # it pins: CUDA only
    times: dict[str, dict[str, list[float]]] = {lib: {"save": [], "stall": [], "async": []} for lib in libs}
    cached = dcp.FileSystemWriter(os.path.join(cfg["root"], "dcp_cached"), cache_staged_state_dict=True)
    for _ in range(cfg["reps"]):
        for lib in libs:
            path = os.path.join(cfg["root"], lib)
            if lib != "dcp_cached":
                _clear(path)
                times[lib]["save"].append(S.timed(lambda: dcp.save(sd, storage_writer=_writer(lib, path))))
            _clear(path)
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=cached if lib == "dcp_cached" else _writer(lib, path), process_group=gloo)
            stall = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
            times[lib]["stall"].append(S.max_over_ranks(stall))
            times[lib]["async"].append(S.max_over_ranks(total))
    if rank == 0:
        gb = nbytes / 1e9
        print(f"state: {nbytes / MiB:.0f} MiB on {world} ranks, {cfg['reps']} reps each (best / median)")
        for what, label in (("save", "dcp.save"), ("stall", "async_save stall"), ("async", "async_save total")):
            print(f"  {label}:")
            mine = statistics.median(times["unickpt"][what])
            for lib in libs:
                t = times[lib][what]
                if not t:
                    continue
                extra = f", {gb / min(t):.2f} GB/s" if what == "save" else ""
                ratio = "" if lib == "unickpt" else f"; DCP / unickpt (median) {statistics.median(t) / mine:.2f}x"
                print(f"    {NAMES[lib]}: {min(t) * 1e3:.0f} / {statistics.median(t) * 1e3:.0f} ms{extra}{ratio}")


def main() -> None:
    """Parse the arguments and run the comparison on spawned ranks."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB (all ranks together)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="dcp_plugin_", dir=a.dir)
    try:
        run_ranks(_run, a.ranks, {"bytes": a.mib * MiB, "reps": a.reps, "root": root}, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
