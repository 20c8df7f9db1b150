"""Spawned rank functions of tests/test_scale.py (importable by the rank processes)."""

from __future__ import annotations

import json
import os
import sys
import zlib

import torch
import torch.distributed as dist

import unickpt
from unickpt.api.load import load_into

PRELOAD = ["torch", "torch.distributed.tensor", "unickpt", "unickpt.rules", "scale_cases"]


def balance_rank(rank: int, world: int, root: str) -> None:
    """2x2 mesh: 16 fully replicated and 8 half-replicated (Shard(0), Replicate()) 64x64
    tensors, saved for real; each rank writes its share of the replicas. Loaded back as
    plain tensors, then as DTensors whose replicas share their reads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(7)
    full = {f"full.{i}": torch.randn(64, 64, generator=gen) for i in range(16)}
    half = {f"half.{i}": torch.randn(64, 64, generator=gen) for i in range(8)}
    state = dict(full)
    state.update({k: distribute_tensor(v, mesh, [Shard(0), Replicate()]) for k, v in half.items()})
    unickpt.save(state, os.path.join(root, "ck"))
    target = {k: torch.zeros(64, 64) for k in list(full) + list(half)}
    unickpt.load(target, os.path.join(root, "ck"))
    for k, v in {**full, **half}.items():
        assert torch.equal(target[k], v), k
    # loaded back as DTensors replicated over mesh dim 1: the 2 ranks holding each shard
    # split its reads when sharing (on; by default through an fsspec URL), bitwise the same
    got, reads = [], []
    for share, where in ((False, ""), (True, ""), (None, ""), (None, "local://")):
        dts = {k: distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0), Replicate()]) for k in half}
        record = load_into(dts, where + os.path.join(root, "ck"), broadcast_replicated=share)
        got.append(dts)
        reads.append(record.bytes_read)
    for dts in got:
        for k, v in half.items():
            assert torch.equal(dts[k].full_tensor(), v), k
    shard_bytes = len(half) * 32 * 64 * 4
    assert reads[2] == reads[0] and reads[3] == reads[1], reads  # the default: whole from files, shared via fsspec
    assert reads[0] - reads[1] >= 0.8 * shard_bytes / 2, (reads, shard_bytes)


SPEC_ARGS = dict(layers=4, hidden=16, heads=4, kv_heads=2, head_dim=4, vocab=50, ffn=32)
LAYOUT = dict(tp=2, pp=2, dp=2)
BLOCK = 256


def _fill(coords):
    def make(name, shape, dtype):
        # replicas (same tp, pp) hold the same model weights; optimizer partitions differ
        seed = zlib.crc32(f"{name} {coords.tp_rank} {coords.pp_rank} {0 if dtype == torch.bfloat16 else coords.dp_rank}".encode())
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return make


def message_rank(rank: int, world: int, root: str, repo: str) -> None:
    """A real 8-rank save of the bench's model (TP2 x PP2 x DP2, ZeRO-1) with the message
    each rank sends to rank 0 recorded, next to the message the simulation computes."""
    sys.path.insert(0, repo)
    from bench.scale_model import ModelSpec, rank_state, simulated_message
    from unickpt.engine import commit as save_api
    from unickpt.rules.coords import Coords

    spec = ModelSpec(**SPEC_ARGS)
    rules = spec.rules()
    c = Coords.from_rank(rank, **LAYOUT)
    sent = []
    real_gather = save_api.gather_bytes

    def recording_gather(group, payload, dst=0):
        sent.append(payload)
        return real_gather(group, payload, dst)

    save_api.gather_bytes = recording_gather
    state = rank_state(spec, rules, c, "save", fill=_fill(c))
    unickpt.save(state, os.path.join(root, "ck"), block_bytes=BLOCK)
    simulated, _ = simulated_message(spec, rules, c, rank, world, BLOCK)
    with open(os.path.join(root, f"msg{rank}.json"), "w") as f:
        json.dump({"real": sent[0].hex(), "simulated": simulated.hex()}, f)
    dist.barrier()


def gather_rank(rank: int, world: int) -> None:
    """gather_bytes with messages of different lengths (rank 0's empty), then all empty;
    scatter_bytes likewise (each rank gets its own)."""
    from unickpt.dist import gather_bytes, resolve_group, scatter_bytes

    group = resolve_group()
    for dst in (0, world - 1):
        got = gather_bytes(group, bytes([65 + rank]) * (3 * rank), dst)
        assert got == ([bytes([65 + r]) * (3 * r) for r in range(world)] if rank == dst else None), got
        got = gather_bytes(group, b"", dst)
        assert got == ([b""] * world if rank == dst else None), got
        sent = [bytes([97 + r]) * (5 * r) for r in range(world)]
        assert scatter_bytes(group, sent if rank == dst else None, dst) == sent[rank]
        assert scatter_bytes(group, [b""] * world if rank == dst else None, dst) == b""


def replicated_load_rank(rank: int, world: int, root: str, repo: str) -> None:
    """The bench's model saved by 8 real ranks (TP2 x PP2 x DP2), then loaded onto TP2 x
    PP2 x DP2 and TP1 x PP2 x DP4, each rank reading everything it needs, and with
    ``broadcast_replicated=True`` (the replicas of a shard split its reads): the same
    tensors, fewer bytes read. By default the rule decides: from local files (read
    faster than gloo broadcasts) each reads whole; through an fsspec URL (an object
    store's rate) the replicas share, bitwise the same tensors."""
    sys.path.insert(0, repo)
    from bench.scale_model import ModelSpec, rank_state
    from unickpt.engine.state import Sharded, flatten
    from unickpt.rules.coords import Coords

    spec = ModelSpec(**SPEC_ARGS)
    rules = spec.rules()
    c = Coords.from_rank(rank, **LAYOUT)
    unickpt.save(rank_state(spec, rules, c, "save", fill=_fill(c)), os.path.join(root, "ck"), block_bytes=BLOCK)
    zeros = lambda name, shape, dtype: torch.zeros(shape, dtype=dtype)  # noqa: E731
    for layout in (LAYOUT, dict(tp=1, pp=2, dp=4)):
        t = Coords.from_rank(rank, **layout)
        got, reads = [], []
        for share, where in ((False, ""), (True, ""), (None, ""), (None, "local://")):
            state = rank_state(spec, rules, t, "load", fill=zeros)
            record = load_into(state, where + os.path.join(root, "ck"), broadcast_replicated=share)
            got.append({leaf.name: leaf.value.local for leaf in flatten(state) if isinstance(leaf.value, Sharded)})
            reads.append(record.bytes_read)
            replicated = [v.local for v in (leaf.value for leaf in flatten(state)) if isinstance(v, Sharded) and v.replicas > 1]
        weights = sum(t.numel() * t.element_size() for t in replicated)
        assert weights, "no replicated shard to share"
        assert all(g.keys() == got[0].keys() and all(torch.equal(got[0][k], g[k]) for k in got[0]) for g in got), layout
        assert reads[2] == reads[0] and reads[3] == reads[1], (layout, reads)  # the default: whole from files, shared via fsspec
        assert any(v.abs().sum() > 0 for v in got[0].values())
        dp = layout["dp"]
        # each replica reads about 1/dp of the replicated weights (checksum blocks widen a little), all of the rest
        assert reads[0] - reads[1] >= 0.8 * weights * (dp - 1) / dp, (layout, reads, weights)
    dist.barrier()
