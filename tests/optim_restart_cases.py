"""Processes for tests/test_optimizer_restart.py: train, save ``{"model": model, "optim":
optimizer}``, and resume in a new process into a freshly built model and optimizer.

Run as a script (``python optim_restart_cases.py ROOT``) it is the new process of a
single-process restart: for every optimizer kind it builds a fresh model and optimizer,
loads ``ROOT/<kind>/ckpt`` and writes what it loaded and what it trained next.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

import unickpt

KINDS = ("adamw", "sgd", "adagrad")
SAVED_AT, MORE = 3, 3

PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "torch.distributed.checkpoint.state_dict", "unickpt", "unickpt.testing",
    "optim_restart_cases",
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of ``kind``: AdamW with two groups (decay and no decay), SGD with
    momentum, Adagrad."""
    if kind == "adamw":
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
        rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, nesterov=True)
    return torch.optim.Adagrad(model.parameters(), lr=5e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, first: int, steps: int) -> list[float]:
    """Train ``steps`` steps on batches fixed by the step number; returns the losses."""
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    return losses


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, whole, by name (torch's ids for the state)."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()

    out = {f"param.{n}": whole(p) for n, p in model.named_parameters()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"state.{pid}.{k}"] = whole(v)
    return out


def resume_all(root: str) -> None:
    """The new process: fresh model and optimizer of each kind, load, train on."""
    for kind in KINDS:
        torch.manual_seed(99)  # other weights than the saved run: the load must set them all
        model = Net()
        opt = optimizer(kind, model)
        unickpt.load({"model": model, "optim": opt}, f"{root}/{kind}/ckpt")
        loaded = snapshot(model, opt)
        groups = opt.state_dict()["param_groups"]
        losses = train(model, opt, SAVED_AT, MORE)
        save_file(loaded, f"{root}/{kind}/loaded.safetensors")
        save_file(snapshot(model, opt), f"{root}/{kind}/final.safetensors")
        with open(f"{root}/{kind}/resumed.json", "w") as f:
            json.dump({"losses": losses, "param_groups": groups}, f)


# --- two ranks: FSDP2 save, resume into fresh FSDP2 and TP models ---------------------

def _fsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    return model


def _tp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _named_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    msd, osd = get_state_dict(model, opt)
    for k, v in msd.items():
        out[f"model.{k}"] = v
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().contiguous() for k, v in out.items()}


def fsdp_save(rank: int, world: int, root: str) -> None:
    """FSDP2 over 2 ranks: train, save the plain Stateful objects, record what follows."""
    torch.manual_seed(0)
    model = _fsdp(Net(), world)
    opt = optimizer("adamw", model)
    train(model, opt, 0, SAVED_AT)
    unickpt.save({"model": model, "optim": opt}, f"{root}/fsdp")
    saved = _named_state(model, opt)
    losses = train(model, opt, SAVED_AT, MORE)
    if rank == 0:
        save_file(saved, f"{root}/saved.safetensors")
        with open(f"{root}/losses.json", "w") as f:
            json.dump(losses, f)
    dist.barrier()


def resume_fsdp_and_tp(rank: int, world: int, root: str) -> None:
    """Fresh FSDP2 (same layout: bitwise) and TP (other layout: exact state) models with
    never-stepped AdamW optimizers load the FSDP2 checkpoint and train on."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    saved = load_file(f"{root}/saved.safetensors")
    with open(f"{root}/losses.json") as f:
        expected = json.load(f)
    for layout in (_fsdp, _tp):
        torch.manual_seed(7)
        model = layout(Net(), world)
        opt = optimizer("adamw", model)
        assert not opt.state
        unickpt.load({"model": model, "optim": opt}, f"{root}/fsdp")
        for p in model.parameters():
            st = opt.state[p]
            if isinstance(p, DTensor):
                assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements, layout.__name__
        got = _named_state(model, opt)
        assert set(got) == set(saved), (layout.__name__, set(got) ^ set(saved))
        for k in saved:
            assert torch.equal(got[k], saved[k]), f"{layout.__name__}: {k} differs after load"
        losses = train(model, opt, SAVED_AT, MORE)
        if layout is _fsdp:
            assert losses == expected, (losses, expected)
        else:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    resume_all(sys.argv[1])
