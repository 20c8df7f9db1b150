"""How fast one rank writes its snapshot into the keeper's shared memory, against the
machine's limit measured in the same run: a ``memcpy`` of the same bytes into an
already-mapped buffer in the shm root (pages faulted in before the timing).

One rank, one simulated node (``parity=0``: no parity to compute), the real code path
(``unickpt.snapshot.Snapshotter``: the ring of mapped files, the checksums, the commit),
``--steps`` snapshots back to back, each timed from ``snapshot()`` to its commit
(``handle.result()``). The parts that explain the gap are measured beside it: a fresh
file per step (page faults), rewriting an existing file with ``pwrite``, CRC-32C and
xxh3-128 over the bytes (one thread; and with threads, which shows whether they release
the GIL), and a copy with its CRC-32C computed while each piece is still in cache.

    python -m bench.snapshot_rate                # 1 GiB, 6 steps
    python -m bench.snapshot_rate --gib 0.25     # any size
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import crc32c as _crc
import numpy as np
import torch
import xxhash

from .machine import best_time

GiB = 1 << 30
MiB = 1 << 20
PIECE = 1 << 20  # the copy-and-checksum piece: fits the L2 cache
PREPARE_S = 2.0  # between prepare() and the first snapshot: the restore and the first step's compute


def _state(total: int) -> dict[str, torch.Tensor]:
    """Plain CPU tensors of about ``total`` bytes (64 MiB weights, small vectors)."""
    width = 4096 if total >= GiB else 1024
    layers = max(1, total // (width * width * 4))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(layers):
        sd[f"layers.{i}.weight"] = torch.rand((width, width), generator=g)
        sd[f"layers.{i}.bias"] = torch.rand((width,), generator=g)
    return sd


def _flat(sd: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [v.reshape(-1).view(torch.uint8) for v in sd.values()]


def _hash_rates(view: memoryview, nbytes: int) -> dict[str, float]:
    """Seconds of CRC-32C and xxh3-128 over ``view`` in 4 MiB pieces, one thread and four
    (four are faster only where the hash releases the GIL)."""
    pieces = range(0, nbytes, 4 * MiB)

    def crc(i: int) -> int:
        return _crc.crc32c(view[i : i + 4 * MiB])

    def xxh(i: int) -> bytes:
        return xxhash.xxh3_128_digest(view[i : i + 4 * MiB])

    out = {"crc32c": best_time(lambda: [crc(i) for i in pieces]), "xxh3": best_time(lambda: [xxh(i) for i in pieces])}
    with ThreadPoolExecutor(4) as pool:
        out["crc32c_4_threads"] = best_time(lambda: list(pool.map(crc, pieces)))
        out["xxh3_4_threads"] = best_time(lambda: list(pool.map(xxh, pieces)))
    view.release()
    return out


def _mapped_rates(m: mmap.mmap, flats: list[torch.Tensor]) -> dict[str, float]:
    """Seconds of copying the state into the mapped buffer ``m`` (its pages faulted in
    first): torch's copy and numpy's (one thread), the faster being the limit; and the
    copy with each 1 MiB piece's CRC-32C computed while it is in cache."""
    dst = torch.frombuffer(m, dtype=torch.uint8)
    dst.fill_(1)  # every page faulted in once: the mapped buffer a ring reuses
    d = dst.numpy()

    def copy() -> None:
        at = 0
        for f in flats:
            dst[at : at + f.numel()].copy_(f)
            at += f.numel()

    def copy_np() -> None:  # one thread's memcpy
        at = 0
        for f in flats:
            np.copyto(d[at : at + f.numel()], f.numpy())
            at += f.numel()

    def copy_crc() -> None:
        at = 0
        for f in flats:
            src = f.numpy()
            for lo in range(0, f.numel(), PIECE):
                hi = min(f.numel(), lo + PIECE)
                np.copyto(d[at + lo : at + hi], src[lo:hi])
                _crc.crc32c(d[at + lo : at + hi])
            at += f.numel()

    return {"memcpy_mapped": min(best_time(copy), best_time(copy_np)), "copy_crc_in_cache": best_time(copy_crc)}


def limits(sd: dict[str, torch.Tensor], shm: str) -> dict[str, float]:
    """Seconds (best of 3) of each way of putting the state's bytes into the shm root."""
    flats = _flat(sd)
    nbytes = sum(f.numel() for f in flats)
    path = os.path.join(shm, f"unickpt-rate-{os.getpid()}.bin")
    out: dict[str, float] = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
        out.update(_mapped_rates(m, flats))
        out.update(_hash_rates(memoryview(m), nbytes))
        m.close()

        def pwrite_all(target: int) -> None:
            at = 0
            for f in flats:
                os.pwrite(target, f.numpy(), at)
                at += f.numel()

        out["pwrite_existing_file"] = best_time(lambda: pwrite_all(fd))

        def fresh() -> None:
            os.unlink(path)
            f2 = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pwrite_all(f2)
            finally:
                os.close(f2)

        out["pwrite_fresh_file"] = best_time(fresh)
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)
    out["bytes"] = nbytes
    return out


def _rank(rank: int, world: int, total: int, steps: int, root: str, out: str) -> None:
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter

    os.environ.update(UNICKPT_SHM_ROOT=root, UNICKPT_JOB_ID="rate")
    sd = _state(total)
    os.makedirs(root, exist_ok=True)
    fig = limits(sd, root)
    snap = Snapshotter("rate", SnapshotOptions(every=1, parity=0))
    t0 = time.perf_counter()
    snap.prepare(sd)  # as CheckpointManager.restore does: the ring is made in the background
    prepare_call = time.perf_counter() - t0
    time.sleep(PREPARE_S)  # the restore and the first step's compute
    times, staged, skipped = [], [], 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        handle = snap.snapshot(sd, step)
        if handle is None:
            skipped += 1
            continue
        snap.before_update()
        t1 = time.perf_counter()
        handle.result()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        staged.append(t1 - t0)
    memory = dict(snap.memory)
    snap.close()
    fig.update(snapshot_first=times[0], snapshot=statistics.median(times[1:] or times), snapshot_all=times,
               staged=statistics.median(staged[1:] or staged), skipped=skipped, memory=memory, prepare_call=prepare_call)
    json.dump(fig, open(out, "w"))


def measure(total: int, steps: int, shm: str = "/dev/shm") -> dict:
    """Every figure for a ``total``-byte state (one rank in a process of its own)."""
    from unickpt.testing import run_ranks

    root = os.path.join(shm, "unickpt-bench-rate")
    shutil.rmtree(root, ignore_errors=True)
    with tempfile.TemporaryDirectory() as work:
        res = os.path.join(work, "rate.json")
        try:
            run_ranks(_rank, 1, total, steps, root, res, timeout=1800)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return json.load(open(res))


def _mem(m: dict) -> str:
    if not m:
        return "none"
    return (f"ring {m['ring_slots']} x {m['state'] / MiB:.0f} MiB = {m['ring'] / MiB:.0f} MiB, parity {m['parity'] / MiB:.0f} MiB, "
            f"cap {m['cap'] / MiB:.0f} MiB")


def report(f: dict) -> str:
    """The figures as lines: each beside the limit of the same run, and the ratio."""
    gb = f["bytes"] / 1e9

    def rate(s: float) -> str:
        return f"{gb / s:.2f} GB/s ({s * 1000:.0f} ms)"

    lim = f["memcpy_mapped"]
    lines = [
        f"state: {f['bytes'] / MiB:.0f} MiB on one rank",
        f"limit: memcpy into an already-mapped shm buffer: {rate(lim)}",
        f"snapshot written into the keeper's shared memory, back to back (median of steps 2..): {rate(f['snapshot'])}",
        f"ratio snapshot / memcpy: {lim / f['snapshot']:.2f}x",
        f"  first snapshot ({PREPARE_S:g} s after prepare(), which returned in {f['prepare_call'] * 1000:.1f} ms): "
        f"{rate(f['snapshot_first'])}; copied (before_update returns): {rate(f['staged'])}; skipped: {f['skipped']}",
        f"  host memory stated for the node: {_mem(f['memory'])}",
        "where the time can go (same bytes, same run):",
        f"  pwrite into a fresh /dev/shm file (page faults): {rate(f['pwrite_fresh_file'])}",
        f"  pwrite over an existing file: {rate(f['pwrite_existing_file'])}",
        f"  copy + CRC-32C per 1 MiB piece in cache: {rate(f['copy_crc_in_cache'])}",
        f"  CRC-32C, 1 thread: {rate(f['crc32c'])}; 4 threads: {rate(f['crc32c_4_threads'])}",
        f"  xxh3-128, 1 thread: {rate(f['xxh3'])}; 4 threads: {rate(f['xxh3_4_threads'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure and print."""
    p = argparse.ArgumentParser(prog="bench.snapshot_rate", description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="the rank's state in GiB")
    p.add_argument("--steps", type=int, default=6, help="snapshots back to back")
    p.add_argument("--shm", default="/dev/shm", help="where the shm root goes (a tmpfs)")
    args = p.parse_args(argv)
    fig = measure(int(args.gib * GiB), args.steps, args.shm)
    print(json.dumps(fig))
    print(report(fig))


if __name__ == "__main__":
    main()
