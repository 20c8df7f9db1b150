"""Rank functions for tests/test_dcp.py: real ``dcp.save`` / ``dcp.load`` of FSDP2 and TP
states, against unickpt reading and writing DCP checkpoints."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


import unickpt
from unickpt.engine.state import flatten
from unickpt.testing import run_ranks

from torch_parallel_cases import Net, _train

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # older torch
    from torch.distributed._composable.fsdp import fully_shard

# plain values saved next to the model: an int, a string, a list, a list of dicts (which
# DCP flattens to extra.sched.0.gamma and unickpt keeps whole)
EXTRA = {"tag": "run-1", "sizes": [1, 2], "sched": [{"gamma": 0.5, "milestones": [3, 6]}]}
PLACEHOLDER = {"tag": None, "sizes": None, "sched": [{"gamma": None, "milestones": None}]}


# what every rank needs, imported once by the fork server instead of once per rank
PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "unickpt", "unickpt.testing", "dcp_cases",
]


def run_ranks_preloaded(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> None:
    """``unickpt.testing.run_ranks`` with ranks forked from a server that imported ``PRELOAD``."""
    run_ranks(fn, world, *args, timeout=timeout, preload=PRELOAD)


def build(kind: str, world: int, steps: int = 0) -> dict[str, Any]:
    """Model + AdamW state of ``Net`` as ``get_state_dict`` gives it: ``fsdp`` (FSDP2 over
    all ranks), ``tp`` (column-/row-wise TP over all ranks) or ``plain`` (one process)."""
    torch.manual_seed(0)
    model = Net()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for b in model.blocks:
            parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif kind != "plain":
        raise ValueError(kind)
    opt = _train(model, steps) if steps else torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_all(rank: int, world: int, root: str) -> None:
    """``dcp.save`` of a trained FSDP2 and a trained TP state; the TP state also with
    ``unickpt.save`` (the source of the reverse direction)."""
    for kind in ("fsdp", "tp"):
        state = build(kind, world, steps=2)
        state["step"] = 2
        state["extra"] = copy.deepcopy(EXTRA)
        dcp.save(state, checkpoint_id=f"{root}/{kind}_dcp")
        if kind == "tp":
            unickpt.save(state, f"{root}/tp_unickpt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(ref: dict[str, Any], got: dict[str, Any], where: str) -> int:
    """Bitwise equality of two loaded states (DTensors: same placements, same local data).
    Returns the number of tensors compared."""
    a, b = flatten(ref), flatten(got)
    assert [x.name for x in a] == [x.name for x in b], f"{where}: the states' keys differ"
    n = 0
    for x, y in zip(a, b):
        if isinstance(x.value, torch.Tensor):
            assert type(x.value) is type(y.value), f"{where}: {x.name} is a {type(y.value).__name__}"
            u, v = x.value, y.value
            if isinstance(u, DTensor):
                assert u.placements == v.placements, f"{where}: {x.name} placements differ"
                u, v = u.to_local(), v.to_local()
            assert u.dtype == v.dtype and u.shape == v.shape, f"{where}: {x.name} dtype/shape differ"
            assert torch.equal(_bits(u), _bits(v)), f"{where}: {x.name} differs from dcp.load"
            n += 1
        else:
            assert x.value == y.value, f"{where}: value {x.name}: {y.value!r} != dcp.load's {x.value!r}"
    return n


def load_jobs(rank: int, world: int, root: str, jobs: list[tuple[str, str, str]]) -> None:
    """For each (DCP checkpoint, unickpt source, target kind): ``dcp.load`` of the DCP
    checkpoint and ``unickpt.load`` of the source into two identical fresh targets must
    agree bit for bit, and bring back the saved values."""
    for dcp_dir, src_dir, kind in jobs:
        where = f"{dcp_dir} -> {kind} on {world} (rank {rank})"
        ref, got = build(kind, world), build(kind, world)
        for s in (ref, got):
            s["step"] = 0
            s["extra"] = copy.deepcopy(PLACEHOLDER)
        if world == 1:
            dcp.load(ref, checkpoint_id=f"{root}/{dcp_dir}", no_dist=True)
        else:
            dcp.load(ref, checkpoint_id=f"{root}/{dcp_dir}")
        unickpt.load(got, f"{root}/{src_dir}")
        assert got["step"] == 2 and got["extra"] == EXTRA, f"{where}: values {got['step']!r} {got['extra']!r}"
        assert compare(ref, got, where) >= 30
