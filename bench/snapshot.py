"""In-memory snapshots on 4 simulated nodes (one rank each, its own shm root): training
stall per snapshot against a memcpy of the same bytes and against ``async_save`` to disk,
the keepers' parity encoding (time to whole, memory overhead), and recovery from memory
after a process crash and after a node loss against a cold load from disk (each the
best of 2 in the same processes: the first also pays one-time imports), and the floor of
a node-loss recovery on this machine (copy + crc32c of every byte, plus the bytes the
recovery fetched from other nodes' keepers at the loopback TCP rate measured in the run).

    python -m bench.snapshot            # 1 GiB and 4 GiB states
    python -m bench.snapshot --quick    # 256 MiB
    python -m bench.snapshot --sizes 1  # GiB, any list
    python -m bench.snapshot --rate-only --rate-gib 1   # only the first part (below)

First, always: the rate at which one rank writes its snapshot into the keeper's shared
memory, back to back, against a memcpy into an already-mapped buffer measured in the same
run, and the ratio (``bench/snapshot_rate.py``, which also measures where the time can
go: fresh files, pwrite, CRC-32C, xxh3).

Cold disk reads: the durable checkpoint is fsynced and its files evicted from the page
cache (``POSIX_FADV_DONTNEED``) before each load from disk; ``fincore`` reports what
stayed resident. ``--frequency 1,2,5,10`` adds the step-time sweep of the example
trainer (2 simulated nodes, a sleep standing in for accelerator compute). The
shm roots are <shm>/unickpt-bench-<i> (``--shm``, default /dev/shm; a tmpfs mounted with
``huge=within_size`` shows what huge pages give) and the disk checkpoints under ``--dir``;
both are removed at the end. Prints a markdown table (docs/PERFORMANCE.md, "In-memory snapshots").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import crc32c as _crc
import numpy as np
import torch
import torch.distributed as dist

import unickpt

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


def _copy_all(sd: dict[str, torch.Tensor], dst: torch.Tensor, crc: bool) -> float:
    """Seconds (slowest rank) to copy every local byte of ``sd`` into ``dst``, with a
    crc32c of each tensor's copy when ``crc``: the floors a snapshot and a verified load
    are measured against."""
    dist.barrier()
    t0 = time.perf_counter()
    at = 0
    for v in sd.values():
        b = v.to_local().reshape(-1).view(torch.uint8)
        dst[at : at + b.numel()].copy_(b)
        if crc:
            _crc.crc32c(dst[at : at + b.numel()].numpy())
        at += b.numel()
    return max_over_ranks(time.perf_counter() - t0)


def _take(rank: int, world: int, total: int, roots: list[str], disk: str | None, snaps: int, out: str,
          parity: int = 1, replicas: int = 1) -> None:
    """Phase 1: snapshots (stall, time to whole), memcpy floor, and (``disk`` given)
    async_save to disk and the durable checkpoint the cold load reads."""
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter

    _as_node(rank, roots)
    sd = build(total, "rows", fill=True)
    nbytes = local_bytes(sd)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    memcpy = [_copy_all(sd, dst, crc=False) for _ in range(2)]
    # what any verified load from memory must do: copy every byte and crc32c it
    floor = [_copy_all(sd, dst, crc=True) for _ in range(2)]
    del dst
    snap = Snapshotter("bench", SnapshotOptions(every=1, parity=parity, replicas=replicas))
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
    async_stalls = [0.0]
    if disk is not None:
        async_stalls = []
        for i in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            h = unickpt.async_save(sd, os.path.join(disk, f"async_{i}"))
            async_stalls.append(max_over_ranks(time.perf_counter() - t0))
            h.result()
        unickpt.save(sd, os.path.join(disk, "durable"))  # fsynced: the cold load evicts its pages
        dist.barrier()
        if rank == 0:  # the recoveries are measured without this phase's files in the page cache
            for i in range(2):
                shutil.rmtree(os.path.join(disk, f"async_{i}"))
            evict(os.path.join(disk, "durable"))
    if rank == 0:
        data = sum(os.path.getsize(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}", f)) for r in roots
                   for f in os.listdir(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}")) if f.startswith("rank_"))
        parity = sum(os.path.getsize(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}", f)) for r in roots
                     for f in os.listdir(os.path.join(r, "unickpt", "bench", f"step_{snaps:08d}")) if f.startswith("parity_") and f.endswith(".bin"))
        json.dump({"bytes": nbytes * world, "memcpy": min(memcpy), "copy_crc": min(floor), "stall": statistics.median(stalls[1:] or stalls),
                   "stall_first": stalls[0], "background": statistics.median(background), "whole": statistics.median(whole),
                   "async_disk": min(async_stalls), "data": data, "parity": parity,
                   "encode_s": _encode_times(roots, snaps)}, open(out, "w"))


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


def _recover(rank: int, world: int, total: int, roots: list[str], disk: str | None, out: str,
             parity: int = 1, replicas: int = 1) -> None:
    """Phase 2/3: recovery from memory (``disk`` None) or a cold load from disk, timed."""
    from unickpt.api.load import load_into
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter, recover

    _as_node(rank, roots)
    sd = _target(total)
    best, line, timings, resident, fetched = float("inf"), "disk", {}, None, 0
    snap = Snapshotter("bench", SnapshotOptions(every=1, parity=parity, replicas=replicas)) if disk is None else None
    for _ in range(2):  # best of 2: the first in a fresh process also pays one-time imports (DTensor)
        for v in sd.values():
            v.to_local().zero_()
        dist.barrier()
        if disk is not None and rank == 0:
            resident = evict(disk)
        dist.barrier()
        t0 = time.perf_counter()
        if snap is not None:

            def load(path, storage):
                load_into(sd, path, storage=storage, manifest=storage.manifest)
                return int(storage.manifest.metadata["snapshot"]["step"])

            outcome = recover(snap, load)
            line = outcome.line
        else:
            unickpt.load(sd, disk)
        seconds = max_over_ranks(time.perf_counter() - t0)
        received = torch.tensor([outcome.fetched if snap is not None else 0], dtype=torch.int64)
        dist.all_reduce(received)
        if seconds < best:
            best, timings, fetched = seconds, outcome.timings if snap is not None else {}, int(received)
    if snap is not None:
        snap.close(clean=False)
    seconds = best
    _check(sd)
    if rank == 0:
        json.dump({"seconds": seconds, "line": line, "timings": timings, "resident_after_evict": resident,
                   "fetched": fetched}, open(out, "w"))


def _encode_times(roots: list[str], step: int) -> float:
    """The slowest parity block's encoding time of ``step`` (seconds, from the keepers' records)."""
    out = 0.0
    for r in roots:
        sdir = os.path.join(r, "unickpt", "bench", f"step_{step:08d}")
        for f in os.listdir(sdir):
            if f.startswith("parity_") and f.endswith(".json"):
                out = max(out, json.load(open(os.path.join(sdir, f))).get("encode_s", 0.0))
    return out


def evict(ckpt: str) -> int | None:
    """Evict a (fsynced) checkpoint's files from the page cache (``POSIX_FADV_DONTNEED`` on
    each, after an fsync), so the next load reads the disk; returns the bytes still
    resident according to ``fincore`` (None when it is not installed)."""
    files = [os.path.join(ckpt, f) for f in os.listdir(ckpt)]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else None


def _send_file(sock, path: str, nbytes: int) -> None:
    conn, _ = sock.accept()
    with open(path, "rb") as f:
        conn.recv(1)
        conn.sendfile(f, 0, nbytes)
    conn.close()


def _receive(port: int, nbytes: int, start, out) -> None:
    import socket

    buf = bytearray(nbytes)  # touched, as the load's targets are
    view = memoryview(buf)
    s = socket.create_connection(("127.0.0.1", port))
    start.wait()
    t0 = time.perf_counter()
    s.send(b"x")
    while view.nbytes:
        view = view[s.recv_into(view):]
    out.put((t0, time.perf_counter()))


def loopback_bandwidth(shm: str, flows: int = 3, nbytes: int = 256 * MiB) -> float:
    """GB/s over TCP on 127.0.0.1, all ``flows`` at once (best of 2): each a sender
    process ``sendfile``-ing a tmpfs file, as a keeper serves its files, and a receiver
    process taking it into a touched buffer, as a recovering rank does. On one machine
    this is the "network" that simulated nodes share: the limit of every byte a
    recovery must fetch from another node."""
    import multiprocessing
    import socket

    ctx = multiprocessing.get_context("fork")
    path = os.path.join(shm, "unickpt-bench-loopback.bin")
    with open(path, "wb") as f:
        block = np.random.default_rng(0).integers(0, 255, MiB, dtype=np.uint8).tobytes()
        for _ in range(nbytes // MiB):
            f.write(block)
    best = 0.0
    try:
        for _ in range(2):
            start, out, procs = ctx.Barrier(flows), ctx.Queue(), []
            for _ in range(flows):
                sock = socket.create_server(("127.0.0.1", 0))
                procs.append(ctx.Process(target=_send_file, args=(sock, path, nbytes)))
                procs.append(ctx.Process(target=_receive, args=(sock.getsockname()[1], nbytes, start, out)))
                procs[-2].start()
                procs[-1].start()
                sock.close()
            spans = [out.get(timeout=600) for _ in range(flows)]
            for p in procs:
                p.join()
            best = max(best, flows * nbytes / (max(e for _, e in spans) - min(b for b, _ in spans)) / 1e9)
    finally:
        os.unlink(path)
    return best


def _kill_keeper(root: str) -> None:
    try:
        pid = int(open(os.path.join(root, "keeper.pid")).read())
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass


def code_speeds(total: int) -> dict[str, float]:
    """GB/s (data bytes in per second, one core, best of 3) of the encoders on the
    stripes of a ``total``-byte state over 4 nodes: numpy XOR (k=3, m=1: one parity
    block) and zfec Reed-Solomon (k=3, m=1 and k=2, m=2: each holder computes its block,
    timed for one block), and zfec decoding two lost stripes (k=2, m=2)."""
    import zfec

    out = {}
    for name, k, m in (("xor_k3_m1", 3, 1), ("rs_k3_m1", 3, 1), ("rs_k2_m2", 2, 2)):
        stripe = total // NODES // k
        bufs = [np.random.default_rng(i).integers(0, 255, stripe, dtype=np.uint8) for i in range(k)]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            if name.startswith("xor"):
                acc = np.zeros(stripe, np.uint8)
                for b in bufs:
                    np.bitwise_xor(acc, b, out=acc)
            else:
                parity = zfec.Encoder(k, k + m).encode(tuple(bufs), (k,))
            best = min(best, time.perf_counter() - t0)
        out[name] = stripe * k / best / 1e9
        if name == "rs_k2_m2":
            blocks = zfec.Encoder(k, k + m).encode(tuple(bufs), (2, 3))
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                zfec.Decoder(k, k + m).decode(tuple(blocks), (2, 3))
                best = min(best, time.perf_counter() - t0)
            out["rs_k2_m2_decode"] = stripe * k / best / 1e9
    del parity
    return out


def _fresh(roots: list[str]) -> None:
    for r in roots:
        _kill_keeper(r)
        shutil.rmtree(r, ignore_errors=True)


def one_size(total: int, workdir: str, snaps: int, protections: bool = True, shm: str = "/dev/shm") -> dict:
    """Every figure for one state size: XOR parity (snapshots, recovery after a crash and
    after a node loss, against a cold load from disk), then Reed-Solomon m = 2 and copies
    on a neighbour (snapshots, memory, recovery after node losses)."""
    from unickpt.testing import run_ranks

    roots = [os.path.join(shm, f"unickpt-bench-{i}") for i in range(NODES)]
    _fresh(roots)
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
        fig["loopback_gbs"] = loopback_bandwidth(shm)
        run_ranks(_recover, NODES - 1, total, roots[:-1], os.path.join(disk, "durable"), res, timeout=1800)
        fig["disk"] = json.load(open(res))
        fig["codes"] = code_speeds(total)
        if protections:
            for name, parity, replicas, lost in (("rs2", 2, 1, 2), ("copy", 0, 2, 1)):
                _fresh(roots)
                run_ranks(_take, NODES, total, roots, None, 2, res, parity, replicas, timeout=1800)
                fig[name] = json.load(open(res))
                for r in roots[NODES - lost:]:
                    _kill_keeper(r)
                    shutil.rmtree(r)
                run_ranks(_recover, NODES - lost, total, roots[: NODES - lost], None, res, parity, replicas, timeout=1800)
                fig[name]["node_loss"] = json.load(open(res))
        return fig
    finally:
        _fresh(roots)
        shutil.rmtree(disk, ignore_errors=True)


def mount_of(path: str) -> str:
    """The file system holding ``path`` and its huge-page option, from /proc/mounts."""
    best, out = "", "unknown file system"
    try:
        lines = open("/proc/mounts").read().splitlines()
    except OSError:
        return out
    real = os.path.realpath(path)
    for line in lines:
        dev, point, kind, opts = line.split()[:4]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            huge = next((o for o in opts.split(",") if o.startswith("huge=")), "huge=never")
            best, out = point, f"{kind} at {point}" + (f" ({huge})" if kind == "tmpfs" else "")
    return out


def table(rows: dict[int, dict]) -> str:
    """The markdown tables of the figures."""
    out = ["| state | memcpy (floor) | snapshot stall | async_save to disk stall | commit left after compute | commit to whole (parity) | memory (data + parity) | copy + crc32c of every byte (recovery floor) | recovery, process crash | recovery, node loss (4 -> 3) | load from disk, cold (4 -> 3) | speed-up crash / node loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for total, f in rows.items():
        gb = f["bytes"] / 1e9
        disk = f["disk"]["seconds"]
        res = f["disk"].get("resident_after_evict")
        out.append(
            f"| {total / GiB:g} GiB | {f['memcpy']:.3f} s ({gb / f['memcpy']:.1f} GB/s) | {f['stall']:.3f} s "
            f"({f['stall'] / f['memcpy']:.2f}x memcpy; first {f['stall_first']:.3f} s) | {f['async_disk']:.3f} s | "
            f"{f['background']:.2f} s | {f['whole']:.2f} s | {(f['data'] + f['parity']) / f['data']:.3f}x | "
            f"{f['copy_crc']:.3f} s | {f['crash']['seconds']:.2f} s | {f['node_loss']['seconds']:.2f} s "
            f"| {disk:.2f} s ({'page cache evicted' if res is None else f'{res / 2**20:.0f} MiB resident after eviction'}) "
            f"| {disk / f['crash']['seconds']:.1f}x / {disk / f['node_loss']['seconds']:.1f}x |"
        )
    out += ["", "| state | protection | memory (data + parity) | commit to whole | slowest block's encode | snapshot stall | recovery after node loss |",
            "|---|---|---|---|---|---|---|"]
    for total, f in rows.items():
        kinds = [("XOR, m = 1 (k = 3)", f, "1 node lost, 4 -> 3")]
        kinds += [(label, f[key], lost) for key, label, lost in (("rs2", "Reed-Solomon, m = 2 (k = 2)", "2 nodes lost, 4 -> 2"),
                                                                   ("copy", "copy on the next node (2 replicas)", "1 node lost, 4 -> 3"))
                  if key in f]
        for label, g, lost in kinds:
            out.append(f"| {total / GiB:g} GiB | {label} | {(g['data'] + g['parity']) / g['data']:.3f}x | {g['whole']:.2f} s | "
                       f"{g['encode_s']:.2f} s | {g['stall']:.3f} s | {g['node_loss']['seconds']:.2f} s "
                       f"({lost}) |")
    out += ["", "| state | copy + crc32c of every byte | received from other nodes' keepers, node loss (all ranks) | "
            "loopback TCP, 3 flows at once | floor of a node-loss recovery (estimate) | recovery, node loss | "
            "load from disk, cold | highest speed-up this machine allows after a node loss (disk / floor) |",
            "|---|---|---|---|---|---|---|---|"]
    for total, f in rows.items():
        if "loopback_gbs" not in f:
            continue
        got, bw = f["node_loss"].get("fetched", 0), f["loopback_gbs"]
        floor = f["copy_crc"] + got / (bw * 1e9)
        nl, disk = f["node_loss"]["seconds"], f["disk"]["seconds"]
        out.append(f"| {total / GiB:g} GiB | {f['copy_crc']:.3f} s | {got / 2**20:.0f} MiB | {bw:.2f} GB/s | {floor:.3f} s | "
                   f"{nl:.2f} s ({nl / floor:.1f}x the floor) | {disk:.2f} s | {disk / floor:.1f}x |")
    codes = next(iter(rows.values()))["codes"]
    out += ["", "Encoders, one core, GB/s of data in: " + ", ".join(f"{k} {v:.2f}" for k, v in codes.items())]
    return "\n".join(out)


def _step_times(text: str) -> list[float]:
    """Per-step seconds from the example trainer's progress lines (``--print-every 1``)."""
    import re

    return [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+ .* ([0-9.]+) s/step$", text, re.M)]


def frequency(workdir: str, every: list[int], steps: int, sleep: float, model: list[str], repeats: int = 2) -> dict:
    """Step time of the example trainer on 2 simulated nodes (one rank each, FSDP, XOR
    parity between them) with a sleep standing in for accelerator compute, without
    snapshots and with a snapshot every N steps; runs interleaved, ``repeats`` times.
    Returns {N (0: none): [mean step seconds of each run, steps 3..]}."""
    from unickpt.testing import free_port

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    import re

    out: dict[int, list[float]] = {}
    stalls: dict[int, list[float]] = {}
    for rep in range(repeats):
        for n in [0, *every]:
            roots = [f"/dev/shm/unickpt-freq-{i}" for i in range(2)]
            _fresh(roots)
            port = free_port()
            flags = ["--fsdp", "--steps", str(steps), "--print-every", "1", "--compute-sleep", str(sleep), *model]
            if n:
                flags += ["--snapshot-every", str(n), "--ckpt-dir", os.path.join(workdir, f"freq_{n}_{rep}")]
            procs = []
            for i, root in enumerate(roots):
                cmd = [torchrun, "--nnodes=2", f"--node-rank={i}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "unickpt.examples.train", *flags]
                env = dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=root)
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            texts = [p.communicate(timeout=1800)[0] for p in procs]
            _fresh(roots)
            if any(p.returncode for p in procs):
                raise RuntimeError(f"trainer failed:\n{texts[0][-3000:]}")
            times = _step_times(texts[0])[2:]
            out.setdefault(n, []).append(statistics.mean(times))
            stall = re.search(r"training loop stalled ([0-9.]+) s \(([0-9.]+) ms per snapshot", texts[0])
            if stall:
                stalls.setdefault(n, []).append(float(stall.group(2)) / 1000)
            print(json.dumps({"every": n, "rep": rep, "mean_step_s": out[n][-1],
                              "stall_per_snapshot_s": stalls.get(n, [None])[-1]}), flush=True)
    out["stall"] = stalls  # type: ignore[assignment]
    return out


def frequency_table(fig: dict, sleep: float) -> str:
    """The markdown table of the frequency sweep: step time against no snapshots, and the
    training loop's own stall per snapshot (snapshot() + before_update(), rank 0) over
    the step time, which is what one snapshot every N steps costs: stall / (N x step)."""
    base = statistics.mean(fig[0])
    stalls = fig.get("stall", {})
    rows = ["| snapshot every | mean step time (runs) | step time vs no snapshots | loop stall per snapshot | stall / (N x step time) |",
            "|---|---|---|---|---|", f"| never | {base:.3f} s ({', '.join(f'{t:.3f}' for t in fig[0])}) | - | - | - |"]
    for n, ts in fig.items():
        if n in (0, "stall"):
            continue
        t = statistics.mean(ts)
        st = statistics.mean(stalls[n]) if stalls.get(n) else float("nan")
        rows.append(f"| {n} step{'s' if n > 1 else ''} | {t:.3f} s ({', '.join(f'{x:.3f}' for x in ts)}) | "
                    f"{(t / base - 1) * 100:+.1f}% | {st * 1000:.1f} ms | {st / (n * base) * 100:.2f}% |")
    return "\n".join(rows) + f"\n\n(compute stand-in: {sleep} s of sleep per step)"


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its tables."""
    p = argparse.ArgumentParser(prog="bench.snapshot", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 MiB only")
    p.add_argument("--sizes", default=None, help="comma-separated state sizes in GiB (default 1,4; 0: none)")
    p.add_argument("--snaps", type=int, default=3, help="snapshots per size (the first is reported apart)")
    p.add_argument("--no-protections", action="store_true", help="XOR only (no Reed-Solomon m = 2 and copies)")
    p.add_argument("--frequency", default=None,
                   help="comma-separated snapshot intervals for the step-time sweep of the example trainer (e.g. 1,2,5,10)")
    p.add_argument("--freq-steps", type=int, default=24, help="steps per run of the sweep")
    p.add_argument("--freq-sleep", type=float, default=0.5, help="seconds of sleep per step standing in for compute")
    p.add_argument("--freq-model", default="--dim 512 --layers 4 --vocab 4096 --seq 64",
                   help="the example trainer's model flags for the sweep")
    p.add_argument("--dir", default=".bench_tmp", help="scratch directory for the disk checkpoints")
    p.add_argument("--shm", default="/dev/shm", help="where the simulated nodes' shm roots go (a tmpfs)")
    p.add_argument("--rate-gib", type=float, default=1.0, help="the rank's state for the write-rate part, GiB")
    p.add_argument("--rate-steps", type=int, default=6, help="snapshots back to back in the write-rate part")
    p.add_argument("--rate-only", action="store_true", help="only the write-rate part")
    args = p.parse_args(argv)
    from . import snapshot_rate

    rate = snapshot_rate.measure(int(args.rate_gib * GiB), args.rate_steps, args.shm)
    print(json.dumps({"rate": rate}), flush=True)
    print(snapshot_rate.report(rate), flush=True)
    if args.rate_only:
        return
    sizes = [256 * MiB] if args.quick else [int(float(s) * GiB) for s in (args.sizes or "1,4").split(",") if float(s)]
    os.makedirs(args.dir, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for total in sizes:  # 4 GiB and more: one snapshot (two would hold 2 x 1.33 x the state in tmpfs)
            big = total >= 4 * GiB
            rows[total] = one_size(total, work, args.snaps if not big else 1, not (big or args.no_protections), args.shm)
            print(json.dumps({str(total): rows[total]}), flush=True)
        if rows:
            print(f"shm roots under {args.shm}: {mount_of(args.shm)}")
            print(table(rows))
        if args.frequency:
            every = [int(x) for x in args.frequency.split(",")]
            fig = frequency(work, every, args.freq_steps, args.freq_sleep, args.freq_model.split())
            print(frequency_table(fig, args.freq_sleep))


if __name__ == "__main__":
    main()
