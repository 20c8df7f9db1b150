"""Recovery after a node loss at 256, 1,024 and 2,048 nodes of 8 ranks, by the model of
docs/SCALE.md, its rates calibrated on this machine in the same run.

    python -m bench.scale_recovery            # calibrate (about a minute), then the model
    python -m bench.scale_recovery --mib 64   # smaller calibration transfers

The job: the Llama-3-405B-shaped model of ``bench.scale`` (TP8 x PP16 x DP, ZeRO-1 over
dp; 14 bytes a parameter), snapshotted in host memory with XOR parity. One node is lost;
the survivors form TP8 x PP16 x DP-1 and load the snapshot onto it. What each rank reads
comes from the real shapes (``bench.scale_model.local_shapes``) and the cut ``load`` uses
to share replicated shards (``engine.replicated``): whole, every rank reads its model
shard's bf16 weights (replicated over dp) and its ZeRO-1 partition; shared, each replica
reads 1/dp of the weights and the replicas broadcast the rest.

Measured here, each in this run (``calibrate``): the rate of one process reading a file in
shared memory and checking every 4 MiB checksum block (a rank reading its own node's
snapshot), of reading from a real keeper over its socket (a rank reading another node's
snapshot), and of a gloo broadcast between local processes, each replica broadcasting its
share as ``ShardedReplicas.finish`` does (the training network, when it is gloo). The
modelled time = the snapshot's recovery plan (rank 0's CPU, measured in this run by
``bench.scale_snapshot.plan_cpu`` with a node lost, and the plan broadcast at the broadcast
rate) + the load plan (measured by ``bench.scale``: 0.25-0.29 s worst at 16K ranks) + the
rebuild of a lost node's file (8 ranks' files, decoded in parallel by the ranks reading
them: ``k`` bytes read from ``k`` nodes for each byte rebuilt, at the read rate) + the
bytes read / the read rate + the bytes broadcast / the broadcast rate. ``k`` is the
layout's (``snapshot.parity.layout``: at most 8 by default); ``--stripes N`` models wider
groups (``0``: ``k = n - 1``, parity over every node). Printed with this machine's rates and with a
cluster's (a 25 GB/s NIC per node shared by 8 ranks; NCCL broadcast at 20 GB/s a rank),
the ratios of the two printed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import time
from math import prod
from typing import Any

from unickpt.engine.replicated import BROADCAST_RATE, READ_RATE, sharing_pays
from unickpt.rules.coords import Coords

from .scale_model import LLAMA_405B, ModelSpec, local_shapes

PLAN_S = 0.29  # worst per-rank load plan at 16K ranks (bench.scale, docs/SCALE.md)
CLUSTER = {"read": 25e9 / 8, "broadcast": BROADCAST_RATE["nccl"]}
TARGET_S = 5.0


# -- calibration -------------------------------------------------------------------------
def _shm_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix="unickpt-cal-", dir=base)


def _read_checked(read, nbytes: int) -> float:
    """Seconds to read ``nbytes`` with ``read(offset, view)`` in 64 MiB requests, checking
    the CRC-32C of every 4 MiB block as a load does."""
    from unickpt.format.checksum import crc32c

    buf = memoryview(bytearray(64 << 20))
    t0 = time.perf_counter()
    for at in range(0, nbytes, len(buf)):
        n = min(len(buf), nbytes - at)
        read(at, buf[:n])
        for b in range(0, n, 4 << 20):
            crc32c(buf[b : min(n, b + (4 << 20))])
    return time.perf_counter() - t0


def shm_read_rate(nbytes: int) -> float:
    """Bytes/s of one process reading a file in shared memory through the reader ``load``
    uses for it, checking the CRC-32C of every 4 MiB block."""
    from pathlib import Path

    from unickpt.storage.local import memory_file_reader

    d = _shm_dir()
    try:
        path = Path(d) / "rank_00000.safetensors"
        path.write_bytes(os.urandom(1 << 20) * (nbytes >> 20))
        reader = memory_file_reader(path)
        took = _read_checked(reader.pread_into, nbytes)
        reader.close()
        return nbytes / took
    finally:
        shutil.rmtree(d, ignore_errors=True)


def keeper_read_rate(nbytes: int) -> float:
    """Bytes/s of reading a snapshot file from a real keeper over its socket (loopback
    here), in 64 MiB requests on one connection, checking every 4 MiB block's CRC-32C, as a
    rank reads another node's files."""
    from unickpt.snapshot import paths
    from unickpt.snapshot.degraded import Peers
    from unickpt.snapshot.keeper_admin import ensure_keeper, stop_keeper

    root = _shm_dir()
    job = "calibrate"
    try:
        secret = secrets.token_bytes(paths.SECRET_BYTES)
        paths.make_private(root)
        paths.write_secret(root, job, secret)
        sdir = paths.step_dir(root, job, 1)
        os.makedirs(sdir)
        with open(os.path.join(sdir, "rank_00000.safetensors"), "wb") as f:
            f.write(os.urandom(1 << 20) * (nbytes >> 20))
        doc = ensure_keeper(root, job)
        peers = Peers([{"host": doc["host"], "port": doc["port"], "pid": doc["pid"]}], secret)
        rel = f"{paths.step_name(1)}/rank_00000.safetensors"

        def read(at: int, view: memoryview) -> None:
            peers.read_views(0, {"op": "read", "path": rel, "offset": at}, [view])

        read(0, memoryview(bytearray(1 << 20)))  # connect, authenticate
        took = _read_checked(read, nbytes)
        peers.close()
        return nbytes / took
    finally:
        stop_keeper(root)
        shutil.rmtree(root, ignore_errors=True)


def _broadcast_rank(rank: int, world: int, nbytes: int, out: str) -> None:
    """Each of ``world`` replicas broadcasts its 1/world share of ``nbytes`` to the others
    (as ``ShardedReplicas.finish`` does); rank 0 writes the bytes received per rank / s."""
    import torch
    import torch.distributed as dist

    share = nbytes // world
    bufs = [torch.zeros(share, dtype=torch.uint8) for _ in range(world)]
    dist.broadcast(bufs[0][: 1 << 20], src=0)  # warm the connections
    dist.barrier()
    t0 = time.perf_counter()
    for src in range(world):
        dist.broadcast(bufs[src], src=src)
    dist.barrier()
    took = time.perf_counter() - t0
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(share * (world - 1) / took))


def gloo_broadcast_rate(nbytes: int, world: int) -> float:
    """Bytes/s each of ``world`` local processes receives while they broadcast their shares over gloo."""
    from unickpt.testing import run_ranks

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rate")
        run_ranks(_broadcast_rank, world, nbytes, out, preload=["torch.distributed"])
        return float(open(out).read())


def calibrate(nbytes: int, world: int) -> dict[str, float]:
    """Every rate, measured now."""
    return {"shm": shm_read_rate(nbytes), "keeper": keeper_read_rate(nbytes), "gloo": gloo_broadcast_rate(nbytes, world)}


# -- the model ---------------------------------------------------------------------------
def stage_bytes(spec: ModelSpec, tp: int, pp: int) -> list[tuple[int, int]]:
    """(bf16 weight bytes, parameters) of each pipeline stage's tensor-parallel shard."""
    rules = spec.rules()
    out = []
    for s in range(pp):
        shapes = local_shapes(spec, rules, Coords(tp=tp, pp=pp, dp=1, pp_rank=s))
        n = sum(prod(v) for v in shapes.values())
        out.append((2 * n, n))
    return out


def after_node_loss(spec: ModelSpec, nodes: int, per_node: int = 8, tp: int = 8, pp: int = 16) -> dict[str, Any]:
    """Bytes the most-loaded target rank reads (whole and shared) and receives by broadcast,
    after the loss of one node of ``nodes``."""
    ranks = nodes * per_node
    dp = ranks // (tp * pp)
    tdp = dp - 1  # the survivors: one data-parallel replica fewer
    stages = stage_bytes(spec, tp, pp)
    worst = max(stages)
    weights, params = worst
    zero = 12 * params // tdp  # the fp32 master and Adam moments of its ZeRO-1 partition
    lost = spec.parameters * 14 // ranks * per_node  # the lost node's files
    return {"nodes": nodes, "ranks": ranks, "dp": dp, "tdp": tdp, "whole": weights + zero,
            "shared": weights // tdp + zero, "broadcast": weights * (tdp - 1) // tdp, "lost": lost,
            "rebuild": lost // per_node}


def with_plan(row: dict[str, Any], stripes: int) -> dict[str, Any]:
    """``row`` with the layout's ``k`` (XOR, at most ``stripes``; 0: every node) and rank 0's
    recovery plan after the loss of node 0, measured now: its CPU seconds and bytes."""
    from unickpt.snapshot.parity import layout

    from .scale_snapshot import plan_cpu

    p = plan_cpu(row["nodes"], 0, stripes=stripes)
    return dict(row, k=layout(row["nodes"], 1, stripes=stripes or row["nodes"])[0], plan_s=p["cpu_s"],
                plan_bytes=p["plan_bytes"])


def recovery_s(row: dict[str, Any], read: float, broadcast: float, shared: bool) -> float:
    """Modelled seconds: the recovery plan (rank 0's CPU + its broadcast) + the load plan +
    the rebuild of a lost file (``k`` bytes read per byte) + bytes read / read rate (+ the
    broadcast of shared replicas)."""
    t = row["plan_s"] + row["plan_bytes"] / broadcast + PLAN_S + row["rebuild"] * row["k"] / read
    if shared:
        return t + row["shared"] / read + row["broadcast"] / broadcast
    return t + row["whole"] / read


def main(argv: list[str] | None = None) -> None:
    """Calibrate, then print the model at each scale."""
    ap = argparse.ArgumentParser(prog="python -m bench.scale_recovery", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes of each calibration transfer (MiB)")
    ap.add_argument("--replicas", type=int, default=4, help="local processes of the gloo broadcast")
    ap.add_argument("--nodes", type=int, nargs="*", default=[256, 1024, 2048])
    ap.add_argument("--stripes", type=int, default=8, help="the most data stripes in a parity group (0: every node)")
    args = ap.parse_args(argv)
    rates = calibrate(args.mib << 20, args.replicas)
    here = {"read": rates["keeper"], "broadcast": rates["gloo"]}
    print(f"calibration on this machine ({args.mib} MiB each; 2 shared cores, so noisy: compare within the run):")
    print(f"  shm read + crc32c, one process:        {rates['shm'] / 1e9:6.2f} GB/s")
    print(f"  keeper socket read (loopback):         {rates['keeper'] / 1e9:6.2f} GB/s "
          f"= {rates['keeper'] / rates['shm']:.2f}x the shm read; library figure {READ_RATE['keeper'] / 1e9:.2f} GB/s "
          f"(measured / figure {rates['keeper'] / READ_RATE['keeper']:.2f})")
    print(f"  gloo broadcast, {args.replicas} local replicas, each its share: {rates['gloo'] / 1e9:6.2f} GB/s received a rank "
          f"= {rates['gloo'] / rates['keeper']:.2f}x the keeper read; library figure {BROADCAST_RATE['gloo'] / 1e9:.2f} GB/s "
          f"(measured / figure {rates['gloo'] / BROADCAST_RATE['gloo']:.2f})")
    pays = sharing_pays(rates["keeper"], rates["gloo"])
    print(f"  the rule (share when the broadcast outruns the read): {'shares' if pays else 'reads whole'} with these "
          f"rates; the cluster's (read {CLUSTER['read'] / 1e9:.2f} GB/s a rank, NCCL {CLUSTER['broadcast'] / 1e9:.0f} GB/s): "
          f"{'shares' if sharing_pays(CLUSTER['read'], CLUSTER['broadcast']) else 'reads whole'}")
    spec = LLAMA_405B
    print("\nafter the loss of one node (TP8 x PP16 x DP -> DP-1 on the survivors; the most-loaded rank):")
    print("| nodes x 8 | ranks | k | recovery plan: CPU, broadcast | lost node's files | rebuild reads a rank "
          "| read whole | read shared + broadcast | here whole / shared | cluster whole / shared "
          "| cluster shared, k = n - 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.nodes:
        row = with_plan(after_node_loss(spec, n), args.stripes)
        wide = with_plan(after_node_loss(spec, n), 0)
        hw, hs = (recovery_s(row, **here, shared=s) for s in (False, True))
        cw, cs = (recovery_s(row, **CLUSTER, shared=s) for s in (False, True))
        print(f"| {n:,} | {row['ranks']:,} | {row['k']} | {row['plan_s']:.3f} s, {row['plan_bytes'] / 1e6:.2f} MB | "
              f"{row['lost'] / 1e9:.1f} GB | {row['rebuild'] * row['k'] / 1e9:.1f} GB | {row['whole'] / 1e9:.2f} GB | "
              f"{row['shared'] / 1e9:.2f} + {row['broadcast'] / 1e9:.2f} GB | {hw:.1f} / {hs:.1f} s | "
              f"{cw:.1f} / {cs:.1f} s | {recovery_s(wide, **CLUSTER, shared=True):,.0f} s |", flush=True)
    best_cluster = recovery_s(row, **CLUSTER, shared=True)
    print(f"\n{row['ranks']:,} ranks, k = {row['k']}: shared, {best_cluster:.1f} s on the cluster's rates "
          f"(target <= {TARGET_S:.0f} s: {'met' if best_cluster <= TARGET_S else 'MISSED'}), "
          f"{recovery_s(row, **here, shared=pays):.1f} s on this machine's; whole, "
          f"{recovery_s(row, **CLUSTER, shared=False):.1f} s and {recovery_s(row, **here, shared=False):.1f} s")


if __name__ == "__main__":
    main()
