"""Writes tests/data/megatron_0_15_flat/: a checkpoint of megatron-core 0.15.3's
``dist_checkpointing.save`` (torch_dist) with ``flattened_range`` ShardedTensors, which
megatron-core >= 0.16 (the version the tests install) can no longer write or read, and
``expected.pt``: what megatron-core 0.15.3's own ``dist_checkpointing.load`` returns on
every saving rank, plus the full tensors.

4 gloo ranks, TP=2 x DP=2 as Megatron's distributed optimizer lays them out: each TP
chunk of ``exp_avg.w`` ([2, 6, 4] cut on dim 1) and ``exp_avg.v`` ([10] cut in 2) is
split into uneven flat ranges over the 2 DP ranks. Regenerate with:

    pip install --no-deps --target /tmp/mc015 "megatron-core==0.15.3"
    rm -rf tests/data/megatron_0_15_flat && mkdir -p tests/data/megatron_0_15_flat/ckpt
    PYTHONPATH=/tmp/mc015:src python tests/data/make_megatron_0_15_flat.py tests/data/megatron_0_15_flat
"""

import sys

import torch

from unickpt.testing import run_ranks

W_SPLIT, V_SPLIT = ((0, 10), (10, 24)), ((0, 2), (2, 5))


def full() -> dict[str, torch.Tensor]:
    """The saved global tensors."""
    g = torch.Generator().manual_seed(3)
    return {"optimizer.state.exp_avg.w": torch.randn(2, 6, 4, generator=g),
            "optimizer.state.exp_avg.v": torch.randn(10, generator=g).bfloat16()}


def _cpu() -> None:
    import numpy

    numpy.product = numpy.prod  # megatron-core 0.15 predates numpy 2
    torch.cuda.synchronize = lambda *a, **k: None  # its writer syncs CUDA after staging
    torch.cuda.current_device = lambda: "cpu"


def shards(rank: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], int, int, int, int]]:
    """(key, flat data, local chunk shape, TP axis, TP rank, start, stop) this rank holds."""
    tp, dp = rank % 2, rank // 2
    f = full()
    w = f["optimizer.state.exp_avg.w"][:, 3 * tp:3 * tp + 3].reshape(-1)
    v = f["optimizer.state.exp_avg.v"][5 * tp:5 * tp + 5]
    (wa, wb), (va, vb) = W_SPLIT[dp], V_SPLIT[dp]
    return [("optimizer.state.exp_avg.w", w[wa:wb].clone(), (2, 3, 4), 1, tp, wa, wb),
            ("optimizer.state.exp_avg.v", v[va:vb].clone(), (5,), 0, tp, va, vb)]


def _sharded(rank: int, zeros: bool) -> dict[int, object]:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {i: ShardedTensor.from_rank_offsets_flat(
        key, torch.zeros_like(data) if zeros else data, local, (axis, tp, 2), flattened_range=slice(a, b),
        replica_id=(0, 0, 0)) for i, (key, data, local, axis, tp, a, b) in enumerate(shards(rank))}


def save(rank: int, world: int, root: str) -> None:
    """megatron-core 0.15's save of this rank's flat shards."""
    from megatron.core import dist_checkpointing

    _cpu()
    dist_checkpointing.save({**_sharded(rank, False), "iteration": 5}, root)


def load(rank: int, world: int, root: str, out: str) -> None:
    """megatron-core 0.15's own load of the same shards (zeros filled by the loader)."""
    from megatron.core import dist_checkpointing

    _cpu()
    got = dist_checkpointing.load(_sharded(rank, True), root)
    torch.save([(key, local, axis, tp, a, b, got[i]) for i, (key, _, local, axis, tp, a, b) in enumerate(shards(rank))],
               f"{out}.{rank}")


if __name__ == "__main__":
    out = sys.argv[1]
    run_ranks(save, 4, f"{out}/ckpt")
    run_ranks(load, 4, f"{out}/ckpt", f"{out}/loaded")
    torch.save({"full": full(), "megatron_load": [torch.load(f"{out}/loaded.{r}") for r in range(4)]}, f"{out}/expected.pt")
    import os

    for r in range(4):
        os.remove(f"{out}/loaded.{r}")
