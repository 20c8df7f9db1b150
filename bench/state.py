"""The benchmark's state: transformer-like layers (a large weight, two small vectors) as
DTensors sharded on dim 0 over the ranks, and the other layouts loads target."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .machine import drop_caches

GiB = 1 << 30
MiB = 1 << 20


def dims(total: int) -> tuple[int, int]:
    """(layers, width) of a state of about ``total`` bytes: 64 MiB weights from 1 GiB on,
    4 MiB weights below."""
    width = 4096 if total >= GiB else 1024
    return max(1, total // (width * width * 4)), width


def build(total: int, layout: str, fill: bool) -> dict[str, torch.Tensor]:
    """The state on this rank: ``layout`` "rows" (weights and vectors Shard(0), as saved)
    or "cols" (weights Shard(1), vectors replicated: the resharded load's target).
    ``fill`` puts the reference values in; else zeros (memory touched either way)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    layers, width = dims(total)
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name, shape in ((f"layers.{i}.weight", (width, width)), (f"layers.{i}.bias", (width,)), (f"layers.{i}.norm", (width,))):
            if layout == "rows" or (len(shape) == 1 and layout != "cols"):
                dim, placement = 0, Shard(0)
            elif len(shape) == 2:
                dim, placement = 1, Shard(1)
            else:
                dim, placement = None, Replicate()
            local_shape = list(shape)
            offset = 0
            if dim is not None:
                local_shape[dim] //= world
                offset = rank * local_shape[dim]
            local = torch.empty(local_shape)
            if fill:
                _reference_into(local, i, len(shape), dim, offset)
            else:
                local.zero_()
            sd[name] = DTensor.from_local(local, mesh, [placement], run_check=False)
    return sd


def _reference_into(local: torch.Tensor, layer: int, ndim: int, dim: int | None, offset: int) -> None:
    """Deterministic values: element (r, c) of layer i is i + r * 1e-3 + c * 1e-7 (rows and
    columns in global coordinates), so any layout can be checked."""
    if ndim == 1:
        n = local.shape[0]
        torch.arange(offset, offset + n, out=local).mul_(1e-3).add_(layer)
        return
    r0, c0 = (offset, 0) if dim == 0 else (0, offset)
    rows = torch.arange(r0, r0 + local.shape[0], dtype=torch.float32).mul_(1e-3).add_(layer)
    cols = torch.arange(c0, c0 + local.shape[1], dtype=torch.float32).mul_(1e-7)
    torch.add(rows[:, None], cols[None, :], out=local)


def check(sd: dict[str, torch.Tensor], total: int, layout: str) -> None:
    """Raise if a loaded state differs from the reference values."""
    ref = build(total, layout, fill=True)
    for k, v in sd.items():
        if not torch.equal(v.to_local(), ref[k].to_local()):
            raise AssertionError(f"rank {dist.get_rank()}: {k} loaded wrong")


def local_bytes(sd: dict[str, torch.Tensor]) -> int:
    """Bytes of this rank's shards."""
    return sum(v.to_local().nbytes for v in sd.values())


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of a collective step, from a barrier to a barrier (the slowest rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def cold() -> bool:
    """Drop the page cache between a write and a read (rank 0 does it for the machine)."""
    dist.barrier()
    ok = drop_caches() if dist.get_rank() == 0 else True
    dist.barrier()
    return ok


def max_over_ranks(x: float) -> float:
    """The largest value of ``x`` over the ranks."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
