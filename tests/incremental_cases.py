"""Rank functions of the incremental-save tests (run by ``unickpt.testing.run_ranks``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import unickpt

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "unickpt", "unickpt.testing"]
# r: a plain tensor, the same on every rank (replicated; the ranks' digests are compared)
PLACEMENTS = {"a": Shard(0), "b": Shard(0), "w": Shard(0), "v": Shard(1), "q": Replicate(), "r": None}


def full_state(k: int) -> dict:
    """The state after save ``k`` of a chain (1: the full one): ``w`` changes in its second
    half (one rank's shard) at save 2, ``v`` at save 3; the rest stays frozen."""
    g = torch.Generator().manual_seed(0)
    model = {
        "a": torch.randn(64, 32, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "w": torch.randn(16, 8, generator=g),
        "v": torch.randn(10, 4, generator=g),
        "q": torch.randn(6, generator=g),
        "r": torch.randn(8, generator=g),
    }
    if k >= 2:
        model["w"][8:] += 1
    if k >= 3:
        model["v"] += 1
    return {"model": model, "step": k}


def sharded(sd: dict, mesh) -> dict:
    """``sd`` with its tensors distributed over ``mesh`` as PLACEMENTS says."""
    model = {n: t if PLACEMENTS[n] is None else distribute_tensor(t, mesh, [PLACEMENTS[n]]) for n, t in sd["model"].items()}
    return {"model": model, "step": sd["step"]}


def zeros_like_state(sd: dict) -> dict:
    """A target of the same structure, all zeros."""
    model = {n: torch.zeros_like(t) for n, t in sd["model"].items()}
    return {"model": model, "step": -1}


def check(sd: dict, k: int, where: str) -> None:
    """Bitwise equal to ``full_state(k)``."""
    ref = full_state(k)
    assert sd["step"] == k, where
    for n, t in sd["model"].items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        assert full.dtype == ref["model"][n].dtype and torch.equal(full, ref["model"][n]), f"{where}: {n} differs"


def two_ranks(rank: int, world: int, root: str) -> None:
    """1 -> 2: load the single-process incremental checkpoint ``root/single/s3`` onto two
    ranks' shards. Then save a chain on two ranks (full, incremental, async incremental)
    for the test to load onto one process."""
    mesh = init_device_mesh("cpu", (world,))
    target = zeros_like_state(sharded(full_state(1), mesh))
    unickpt.load(target, f"{root}/single/s3")
    check(target, 3, f"rank {rank}: single/s3 loaded onto 2 ranks")
    unickpt.save(sharded(full_state(1), mesh), f"{root}/two/s1")
    unickpt.save(sharded(full_state(2), mesh), f"{root}/two/s2", base=f"{root}/two/s1")
    unickpt.async_save(sharded(full_state(3), mesh), f"{root}/two/s3", base=f"{root}/two/s2").result()
    target = zeros_like_state(sharded(full_state(1), mesh))
    unickpt.load(target, f"{root}/two/s3")
    check(target, 3, f"rank {rank}: two/s3 loaded on the same layout")
