"""In-memory snapshots on 4 simulated nodes (one rank each, its own shm root): training
stall per snapshot against a memcpy of the same bytes and against ``async_save`` to disk,
the keepers' parity encoding (time to whole, memory overhead), and recovery from memory
after a process crash and after a node loss against a cold load from disk (each the
best of 2 in the same processes: the first also pays one-time imports).

    python -m bench.snapshot            # 1 GiB and 4 GiB states
    python -m bench.snapshot --quick    # 256 MiB
    python -m bench.snapshot --sizes 1  # GiB, any list

Run as root for cold disk reads (the page cache is dropped before the disk load). The
shm roots are /dev/shm/unickpt-bench-<i> and the disk checkpoints under ``--dir``; both
are removed at the end. Prints a markdown table (docs/PERFORMANCE.md, "In-memory snapshots").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import unickpt

from .machine import drop_caches
from .state import GiB, MiB, _reference_into, build, dims, local_bytes, max_over_ranks

NODES = 4
COMPUTE_S = 1.5


def _as_node(rank: int, roots: list[str]) -> None:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", UNICKPT_SHM_ROOT=roots[rank], UNICKPT_JOB_ID="bench")


def _whole_everywhere(roots: list[str], step: int, timeout: float = 600) -> float:
    """Seconds until ``step`` is whole on every root (the benchmark observes all nodes)."""
    t0 = time.perf_counter()
    marks = [os.path.join(r, "unickpt", "bench", f"step_{step:08d}", "whole") for r in roots]
    while not all(os.path.exists(m) for m in marks):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"step {step} not whole after {timeout} s")
        time.sleep(0.002)
    return time.perf_counter() - t0


def _encode_seconds(roots: list[str], step: int) -> float:
    """Seconds from the step's commit (its manifest on a node) to the keepers' per-step
    commit (its ``whole`` marker), the slowest node: the parity encoding and exchange."""
    _whole_everywhere(roots, step)
    out = 0.0
    for r in roots:
        sdir = os.path.join(r, "unickpt", "bench", f"step_{step:08d}")
        out = max(out, os.stat(os.path.join(sdir, "whole")).st_mtime - os.stat(os.path.join(sdir, "manifest.json")).st_mtime)
    return out


def _take(rank: int, world: int, total: int, roots: list[str], disk: str, snaps: int, out: str) -> None:
    """Phase 1: snapshots (stall, time to whole), memcpy floor, async_save to disk, and the
    durable checkpoint the cold load reads."""
    from unickpt.snapshot import Snapshotter

    _as_node(rank, roots)
    sd = build(total, "rows", fill=True)
    nbytes = local_bytes(sd)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    memcpy = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        at = 0
        for v in sd.values():
            b = v.to_local().reshape(-1).view(torch.uint8)
            dst[at : at + b.numel()].copy_(b)
            at += b.numel()
        memcpy.append(max_over_ranks(time.perf_counter() - t0))
    del dst
    snap = Snapshotter("bench", 1, 1)
    stalls, background, whole = [], [], []
    for step in range(1, snaps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        handle = snap.snapshot(sd, step)
        t1 = time.perf_counter()
        time.sleep(COMPUTE_S)  # forward/backward on an accelerator: the host is free
        t2 = time.perf_counter()
        snap.before_update()
        t3 = time.perf_counter()
        assert handle is not None
        handle.result()
        t4 = time.perf_counter()
        stalls.append(max_over_ranks((t1 - t0) + (t3 - t2)))
        background.append(max_over_ranks(t4 - t3))
        dist.barrier()
        whole.append(_encode_seconds(roots, step) if rank == 0 else 0.0)
    snap.close(clean=False)  # the keepers keep the snapshots: the next phases recover them
    async_stalls = []
    for i in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        h = unickpt.async_save(sd, os.path.join(disk, f"async_{i}"))
        async_stalls.append(max_over_ranks(time.perf_counter() - t0))
        h.result()
    unickpt.save(sd, os.path.join(disk, "durable"))
    if rank == 0:
        data = sum(os.path.getsize(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}", f)) for r in roots
                   for f in os.listdir(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}")) if f.startswith("rank_"))
        parity = sum(os.path.getsize(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}", f)) for r in roots
                     for f in os.listdir(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}")) if f.startswith("parity_") and f.endswith(".bin"))
        json.dump({"bytes": nbytes * world, "memcpy": min(memcpy), "stall": statistics.median(stalls[1:] or stalls),
                   "stall_first": stalls[0], "background": statistics.median(background), "whole": statistics.median(whole),
                   "async_disk": min(async_stalls), "data": data, "parity": parity}, open(out, "w"))


def _target(total: int) -> dict[str, torch.Tensor]:
    """The state on this rank for any world size: every tensor Shard(0), uneven when needed."""
    from torch.distributed.tensor import Shard, init_device_mesh
    import torch.distributed.tensor as dt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers, width = dims(total)
    sd = {}
    for i in range(layers):
        for name, shape in ((f"layers.{i}.weight", (width, width)), (f"layers.{i}.bias", (width,)), (f"layers.{i}.norm", (width,))):
            t = dt.zeros(shape, device_mesh=mesh, placements=[Shard(0)])
            sd[name] = t
    return sd


def _check(sd: dict[str, torch.Tensor]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in list(sd)[:6]:
        local = sd[name].to_local()
        per = -(-sd[name].shape[0] // world)
        want = torch.empty_like(local)
        _reference_into(want, int(name.split(".")[1]), sd[name].dim(), 0, rank * per)
        if not torch.equal(local, want):
            raise AssertionError(f"rank {rank}: {name} recovered wrong")


def _recover(rank: int, world: int, total: int, roots: list[str], disk: str | None, out: str) -> None:
    """Phase 2/3: recovery from memory (``disk`` None) or a cold load from disk, timed."""
    from unickpt.snapshot import Snapshotter, recover

    _as_node(rank, roots)
    sd = _target(total)
    best, line, timings = float("inf"), "disk", {}
    snap = Snapshotter("bench", 1, 1) if disk is None else None
    for _ in range(2):  # best of 2: the first in a fresh process also pays one-time imports (DTensor)
        for v in sd.values():
            v.to_local().zero_()
        dist.barrier()
        if disk is not None and rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        if snap is not None:

            def load(path, storage):
                unickpt.load(sd, path, storage=storage, manifest=storage.manifest)
                return int(storage.manifest.metadata["snapshot"]["step"])

            outcome = recover(snap, load)
            line = outcome.line
        else:
            unickpt.load(sd, disk)
        seconds = max_over_ranks(time.perf_counter() - t0)
        if seconds < best:
            best, timings = seconds, outcome.timings if snap is not None else {}
    if snap is not None:
        snap.close(clean=False)
    seconds = best
    _check(sd)
    if rank == 0:
        json.dump({"seconds": seconds, "line": line, "timings": timings}, open(out, "w"))


def _kill_keeper(root: str) -> None:
    try:
        pid = int(open(os.path.join(root, "keeper.pid")).read())
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass


def xor_speed(total: int) -> float:
    """GB/s of numpy XOR folding 3 stripes of a quarter of ``total`` each (one core)."""
    k = NODES - 1
    stripe = total // NODES // k
    bufs = [np.random.default_rng(i).integers(0, 255, stripe, dtype=np.uint8) for i in range(k)]
    acc = np.zeros(stripe, np.uint8)
    t0 = time.perf_counter()
    for b in bufs:
        np.bitwise_xor(acc, b, out=acc)
    return stripe * k / (time.perf_counter() - t0) / 1e9


def one_size(total: int, workdir: str, snaps: int) -> dict:
    """Every figure for one state size."""
    from unickpt.testing import run_ranks

    roots = [f"/dev/shm/unickpt-bench-{i}" for i in range(NODES)]
    for r in roots:
        _kill_keeper(r)
        shutil.rmtree(r, ignore_errors=True)
    disk = os.path.join(workdir, "disk")
    os.makedirs(disk, exist_ok=True)
    res = os.path.join(workdir, "res.json")
    try:
        run_ranks(_take, NODES, total, roots, disk, snaps, res, timeout=1800)
        fig = json.load(open(res))
        run_ranks(_recover, NODES, total, roots, None, res, timeout=1800)
        fig["crash"] = json.load(open(res))
        _kill_keeper(roots[-1])
        shutil.rmtree(roots[-1])
        run_ranks(_recover, NODES - 1, total, roots[:-1], None, res, timeout=1800)
        fig["node_loss"] = json.load(open(res))
        run_ranks(_recover, NODES - 1, total, roots[:-1], os.path.join(disk, "durable"), res, timeout=1800)
        fig["disk"] = json.load(open(res))
        fig["xor_gbs"] = xor_speed(total)
        fig["cold"] = drop_caches()
        return fig
    finally:
        for r in roots:
            _kill_keeper(r)
            shutil.rmtree(r, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def table(rows: dict[int, dict]) -> str:
    """The markdown table of the figures."""
    out = ["| state | memcpy (floor) | snapshot stall | async_save to disk stall | commit left after compute | commit to whole (parity) | memory (data + parity) | XOR one core | recovery, process crash | recovery, node loss (4 -> 3) | load from disk, cold (4 -> 3) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for total, f in rows.items():
        gb = f["bytes"] / 1e9
        out.append(
            f"| {total / GiB:g} GiB | {f['memcpy']:.3f} s ({gb / f['memcpy']:.1f} GB/s) | {f['stall']:.3f} s "
            f"({f['stall'] / f['memcpy']:.2f}x memcpy; first {f['stall_first']:.3f} s) | {f['async_disk']:.3f} s | "
            f"{f['background']:.2f} s | {f['whole']:.2f} s | {(f['data'] + f['parity']) / f['data']:.3f}x | {f['xor_gbs']:.1f} GB/s | "
            f"{f['crash']['seconds']:.2f} s | {f['node_loss']['seconds']:.2f} s (rebuild {f['node_loss']['timings'].get('rebuild', 0):.2f} s) "
            f"| {f['disk']['seconds']:.2f} s"
            f"{'' if f['cold'] else ' (warm: not root)'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its table."""
    p = argparse.ArgumentParser(prog="bench.snapshot", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 MiB only")
    p.add_argument("--sizes", default=None, help="comma-separated state sizes in GiB (default 1,4)")
    p.add_argument("--snaps", type=int, default=3, help="snapshots per size (the first is reported apart)")
    p.add_argument("--dir", default=".bench_tmp", help="scratch directory for the disk checkpoints")
    args = p.parse_args(argv)
    sizes = [256 * MiB] if args.quick else [int(float(s) * GiB) for s in (args.sizes or "1,4").split(",")]
    os.makedirs(args.dir, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for total in sizes:  # 4 GiB and more: one snapshot (two would hold 2 x 1.33 x the state in tmpfs)
            rows[total] = one_size(total, work, args.snaps if total < 4 * GiB else 1)
            print(json.dumps({str(total): rows[total]}), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
