"""Rank functions for tests/test_dcp_plugin.py: real ``dcp.save`` / ``dcp.async_save`` /
``dcp.load`` of FSDP2 states through unickpt's DCP storage plugin."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from unickpt.dcp import StorageReader, StorageWriter
from unickpt.engine.state import flatten

from dcp_cases import EXTRA, PLACEHOLDER, build


class Opaque:
    """A non-tensor object unickpt cannot store as a plain value: DCP pickles it."""

    def __init__(self, x: Any) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


def full_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` as a whole CPU tensor (DTensors gathered), by flat name."""
    out = {}
    for leaf in flatten(state):
        v = leaf.value
        if isinstance(v, torch.Tensor):
            out[leaf.name] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _state(world: int, steps: int) -> dict[str, Any]:
    state = build("fsdp", world, steps=steps)
    state["step"] = steps
    state["extra"] = copy.deepcopy(EXTRA)
    state["opaque"] = Opaque({"seen": [1, 2]})
    return state


def save_fsdp(rank: int, world: int, root: str) -> None:
    """FSDP2 on ``world`` ranks: ``dcp.save`` with unickpt's StorageWriter; then
    ``dcp.async_save`` (thread) twice, the live state changed while each save is in
    flight, the second reusing the first's staging buffer; rank 0 keeps the full
    tensors each save must hold."""
    state = _state(world, steps=2)
    ref = full_state(state)
    dcp.save(state, storage_writer=StorageWriter(f"{root}/fsdp"))
    for k in range(2):
        saved = full_state(state)  # (collectives: not while the save in flight uses the group)
        fut = dcp.async_save(state, storage_writer=StorageWriter(f"{root}/async{k}"))
        with torch.no_grad():  # training goes on: the save must hold the state as it was staged
            for leaf in flatten(state):
                if isinstance(leaf.value, torch.Tensor) and leaf.value.is_floating_point():
                    (leaf.value.to_local() if isinstance(leaf.value, DTensor) else leaf.value).add_(1.0)
        fut.result()
        if rank == 0:
            torch.save(saved, f"{root}/async{k}_ref.pt")
    if rank == 0:
        torch.save(ref, f"{root}/ref.pt")


def load_fsdp(rank: int, world: int, root: str, ds_dir: str, ds_ref: str) -> None:
    """``dcp.load`` through unickpt's StorageReader onto FSDP2 over ``world`` ranks: the
    full tensors equal what was saved, bit for bit, and the values come back; then a
    DeepSpeed ZeRO checkpoint onto Shard(0) DTensors equals DeepSpeed's zero_to_fp32 of it
    (``ds_ref``, saved by the test); last, a save that fails on rank 1 commits nothing."""
    state = build("fsdp", world)
    state["step"] = 0
    state["extra"] = copy.deepcopy(PLACEHOLDER)
    state["opaque"] = None
    dcp.load(state, storage_reader=StorageReader(f"{root}/fsdp"))
    assert state["step"] == 2 and state["extra"] == EXTRA and state["opaque"] == Opaque({"seen": [1, 2]})
    ref = torch.load(f"{root}/ref.pt", weights_only=True)
    got = full_state(state)
    assert sorted(got) == sorted(ref) and len(ref) >= 30
    for name, want in ref.items():
        assert _same_bits(got[name], want), f"rank {rank}: {name} differs after dcp.load"

    want = torch.load(ds_ref, weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    target = {"model": {n: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for n, t in want.items()}}
    dcp.load(target, storage_reader=StorageReader(ds_dir))
    for n, t in want.items():
        assert _same_bits(target["model"][n].full_tensor(), t), f"rank {rank}: {n} differs from zero_to_fp32"

    # a save failing on one rank commits nothing and leaves the old checkpoint as it was
    old = f"{root}/fsdp_old"
    if rank == 0:
        shutil.copytree(f"{root}/fsdp", old)
    dist.barrier()
    before = open(f"{old}/manifest.json", "rb").read()
    try:
        dcp.save({f"w{rank}": torch.ones(4)}, storage_writer=StorageWriter(old, overwrite=True), planner=_FailsOnRank1())
    except CheckpointException as e:
        assert "nothing was committed" in str(e) and "rank 1: RuntimeError: disk on fire" in str(e), str(e)
    else:
        raise AssertionError("the failed save did not raise")
    dist.barrier()
    assert open(f"{old}/manifest.json", "rb").read() == before
    assert not [n for n in os.listdir(root) if n.startswith(".")], os.listdir(root)  # no staging directory left


class _FailsOnRank1(DefaultSavePlanner):
    """DCP's default planner, except that rank 1 cannot produce its data."""

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("disk on fire")
        return super().resolve_data(write_item)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
