"""Real torch parallelism (tensor parallel plans, FSDP2) saving and loading with unickpt."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import unickpt

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # older torch
    from torch.distributed._composable.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 20) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 5, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _full(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            for k2, v2 in _full(v).items():
                out[f"{k}.{k2}"] = v2
        elif isinstance(v, torch.Tensor):
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def tp_fsdp_save(rank: int, world: int, root: str) -> None:
    """2x2 mesh: TP on 'tp' (column/row-wise), FSDP2 on 'dp' -> _StridedShard placements."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _train(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 2}
    placements = {str(v.placements) for v in msd.values() if isinstance(v, DTensor)}
    unickpt.save(state, f"{root}/tp_fsdp")
    full = _full({"model": msd, "optim": osd})
    if rank == 0:
        save_file(full, f"{root}/reference.safetensors")
        with open(f"{root}/placements.txt", "w") as f:
            f.write("\n".join(sorted(placements)))
    dist.barrier()


def _check(full: dict, ref: dict, where: str) -> None:
    assert set(full) == set(ref), f"{where}: keys differ: {set(full) ^ set(ref)}"
    for k in ref:
        assert torch.equal(full[k], ref[k]), f"{where}: {k} differs"


def fsdp_load(rank: int, world: int, root: str) -> None:
    """2 ranks, FSDP2 only: load the TP x FSDP checkpoint, compare the gathered state."""
    torch.manual_seed(5)
    model = Net()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _train(model, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    unickpt.load(state, f"{root}/tp_fsdp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 2
    msd, osd = get_state_dict(model, opt)
    _check(_full({"model": msd, "optim": osd}), load_file(f"{root}/reference.safetensors"), f"fsdp rank {rank}")


def tp_load(rank: int, world: int, root: str) -> None:
    """2 ranks, TP only, other plan (up row-wise, down column-wise would not fit: use tp=2 same plan)."""
    torch.manual_seed(7)
    model = Net()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for b in model.blocks:
        parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = _train(model, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    unickpt.load(state, f"{root}/tp_fsdp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    _check(_full({"model": msd, "optim": osd}), load_file(f"{root}/reference.safetensors"), f"tp rank {rank}")


def tp_in_ddp_save(rank: int, world: int, root: str) -> None:
    """TP DTensors on the 'tp' sub-mesh of a 2x2 job; the 'dp' ranks hold plain replicas."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    sd = model.state_dict()
    unickpt.save({"model": sd}, f"{root}/tp_in_ddp")
    full = _full({"model": sd})
    if rank == 0:
        save_file(full, f"{root}/reference_tp_in_ddp.safetensors")
    dist.barrier()
