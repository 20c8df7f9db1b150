"""PyTorch DCP variants written on gloo ranks by the real torch writers: a save without
collectives (``use_collectives=False``: one ``__{rank}.metadata`` per rank) and DCP's
Hugging Face safetensors storage (with and without ``save_distributed``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import unickpt

PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "unickpt", "dcp_variant_cases"]
ROWS, COLS = 7, 4  # 7 rows on 2 ranks: uneven shards (4 + 3)


def full() -> dict[str, torch.Tensor]:
    """The global tensors (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(ROWS, COLS, generator=g).bfloat16(), "norm": torch.randn(COLS, generator=g)}


def state(rank: int, world: int) -> dict[str, Any]:
    """A row-sharded DTensor, a replicated plain tensor, a per-rank and a common value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    f = full()
    return {"model": {"w": distribute_tensor(f["w"], mesh, [Shard(0)]), "norm": f["norm"].clone()},
            "seed": 100 + rank, "lr": 0.5}


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    """The same structure with tensors set to 7 and values reset."""
    out = {"model": {}, "seed": -1, "lr": -1.0}
    for k, v in sd["model"].items():
        t = v.detach().clone()
        (t.to_local() if hasattr(t, "to_local") else t).fill_(7)
        out["model"][k] = t
    return out


def save_variants(rank: int, world: int, root: str) -> None:
    """Write the variants, then on each rank: DCP's own load of the rank-local checkpoint
    (it reads this rank's ``__{rank}.metadata``) and ``unickpt.load`` agree bitwise."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = state(rank, world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=f"{root}/no_collectives", use_collectives=False)
        model = {f"model.{k}": v for k, v in sd["model"].items()}
        dcp.save(model, storage_writer=HuggingFaceStorageWriter(f"{root}/hf_distributed", save_distributed=True))
        dcp.save(model, storage_writer=HuggingFaceStorageWriter(f"{root}/hf_overwritten"))
        torch.distributed.barrier()
        ref, got = _blank(sd), _blank(sd)
        dcp.load(ref, checkpoint_id=f"{root}/no_collectives")
    got["seed"] = unickpt.PerRank(-1)  # saved differently by each rank: a per-rank value
    unickpt.load(got, f"{root}/no_collectives")
    for k in ref["model"]:
        a, b = ref["model"][k], got["model"][k]
        a, b = (a.to_local(), b.to_local()) if hasattr(a, "to_local") else (a, b)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"rank {rank}: {k}"
    assert ref["seed"] == got["seed"].value == 100 + rank and ref["lr"] == got["lr"] == 0.5, (ref, got)
