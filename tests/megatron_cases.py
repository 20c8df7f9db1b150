"""Megatron-Core ``dist_checkpointing`` checkpoints written by the real Megatron-Core on gloo
ranks, and the targets both Megatron-Core's ``dist_checkpointing.load`` and ``unickpt.load``
fill (rank functions for ``run_ranks``: importable, module level)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

import unickpt
from unickpt.engine.state import Sharded
from unickpt.plan.box import Box
from unickpt.plan.piece import box_piece
from unickpt.testing import run_ranks

PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing", "unickpt", "megatron_cases"]
LAYERS, HIDDEN, FFN, VOCAB, FLAT = 3, 6, 12, 10, 60
# the distributed optimizer's flat buffer: DP rank r holds [FLAT_SPLIT[r], FLAT_SPLIT[r + 1]) (uneven)
FLAT_SPLIT = (0, 37, FLAT)
FLAT_KEY = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
COMMON = {
    "iteration": 7, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 1.5e12,
    "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 70, "decay_style": "cosine"},
}


def run_preloaded(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """``run_ranks`` with ranks forked from a server that imported Megatron-Core once."""
    run_ranks(fn, world, *args, preload=PRELOAD)


def cpu_only() -> None:
    """Megatron-Core's torch_dist writer synchronises CUDA after staging and builds its
    failure flag on the current CUDA device: on a CPU build, make both the CPU's."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.serialization.add_safe_globals([argparse.Namespace])  # Megatron-LM's own loader does this for args


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors of the saved model and optimizer (the same on every rank)."""
    g = torch.Generator().manual_seed(13)
    return {
        "embedding.word_embeddings.weight": torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(LAYERS, FFN, HIDDEN, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(LAYERS, HIDDEN, FFN, generator=g).bfloat16(),
        "decoder.final_layernorm.weight": torch.randn(HIDDEN, generator=g),
        f"{FLAT_KEY}.exp_avg": torch.randn(FLAT, generator=g),
        f"{FLAT_KEY}.exp_avg_sq": torch.rand(FLAT, generator=g),
        "grad_scaler.scale": torch.tensor(65536.0),
    }


def sharded_state(rank: int, world: int) -> dict[str, Any]:
    """What a TP=2 rank hands ``dist_checkpointing.save``: vocab- and column-parallel (dim 0)
    and row-parallel (dim 1) slices of stacked layers, a replicated norm (replica ids
    (PP, TP, DP)), the distributed optimizer's flat buffer slices and ShardedObjects."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = full_tensors()
    fc1, fc2 = full["decoder.layers.mlp.linear_fc1.weight"], full["decoder.layers.mlp.linear_fc2.weight"]
    emb = full["embedding.word_embeddings.weight"]
    sd: dict[str, Any] = {
        "embedding": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", emb.chunk(world, 0)[rank].clone(), (0, rank, world), replica_id=(0, 0, 0)),
        "fc1": [ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", fc1[i].chunk(world, 0)[rank].clone(), (0, i, LAYERS), (1, rank, world),
            replica_id=(0, 0, 0), prepend_axis_num=1) for i in range(LAYERS)],
        "fc2": [ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc2.weight", fc2[i].chunk(world, 1)[rank].clone(), (0, i, LAYERS), (2, rank, world),
            replica_id=(0, 0, 0), prepend_axis_num=1) for i in range(LAYERS)],
        "norm": ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight", full["decoder.final_layernorm.weight"].clone(), replica_id=(0, rank, 0)),
        "rng_state": ShardedObject("rng_state", [{"seed": 1234 + rank, "counts": [rank, 2]}], (world,), (rank,), replica_id=0),
        "numpy_state": ShardedObject("numpy_state", [torch.zeros(1).numpy()], (world,), (rank,), replica_id=0),
        "grad_scaler": {"scale": full["grad_scaler.scale"].clone()},
        "args": argparse.Namespace(tensor_model_parallel_size=world, lr=3e-4),
        **COMMON,
    }
    start, stop = FLAT_SPLIT[rank], FLAT_SPLIT[rank + 1]
    for state in ("exp_avg", "exp_avg_sq"):
        data = full[f"{FLAT_KEY}.{state}"][start:stop].clone()
        sd[f"opt_{state}"] = ShardedTensor(
            f"{FLAT_KEY}.{state}", data, data.dtype, tuple(data.shape), (FLAT,), (start,),
            axis_fragmentations=None, replica_id=(0, 0, 0))
    return sd


def save(rank: int, world: int, path: str) -> None:
    """``megatron.core.dist_checkpointing.save`` of :func:`sharded_state` into ``path``."""
    from megatron.core import dist_checkpointing

    cpu_only()
    dist_checkpointing.save(sharded_state(rank, world), path)


# targets: (megatron key, global shape, offsets, lengths, dtype); a different split than saved
def targets() -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Boxes that one process asks for: whole tensors, a TP=3 slice of the TP=2-saved
    stacked weights, a flat range that crosses the saving DP ranks' boundary."""
    out = []
    for name, t in full_tensors().items():
        if name != "grad_scaler.scale":
            out.append((name, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype))
    fc1, fc2 = "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight"
    out.append((fc1, (LAYERS, FFN, HIDDEN), (0, 8, 0), (LAYERS, 4, HIDDEN), torch.float32))  # TP rank 2 of 3
    out.append((fc2, (LAYERS, HIDDEN, FFN), (0, 0, 4), (LAYERS, HIDDEN, 4), torch.bfloat16))  # TP rank 1 of 3
    out.append((f"{FLAT_KEY}.exp_avg", (FLAT,), (20,), (25,), torch.float32))
    out.append(("embedding.word_embeddings.weight", (VOCAB, HIDDEN), (2, 3), (5, 3), torch.bfloat16))
    return out


def megatron_load(path: str) -> list[torch.Tensor]:
    """Megatron-Core's ``dist_checkpointing.load`` of every :func:`targets` box (one load each)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    out = []
    for key, shape, offsets, lengths, dtype in targets():
        sh = ShardedTensor(key, torch.full(lengths, 7, dtype=dtype), dtype, lengths, shape, offsets,
                           axis_fragmentations=None, replica_id=0)
        out.append(dist_checkpointing.load({"t": sh}, path)["t"])
    return out


def unickpt_load(path: str) -> list[torch.Tensor]:
    """``unickpt.load`` of the same boxes (as ``Sharded`` targets)."""
    out = []
    for key, shape, offsets, lengths, dtype in targets():
        local = torch.full(lengths, 7, dtype=dtype)
        target = Sharded(local, shape, [box_piece(lengths, Box.whole(lengths), Box(offsets, lengths))])
        unickpt.load({key: target}, path)
        out.append(local)
    return out


def compare_loads(rank: int, world: int, path: str, result: str) -> None:
    """Both loaders on this one process; their tensors saved for the test to compare."""
    cpu_only()
    torch.save({"megatron": megatron_load(path), "unickpt": unickpt_load(path)}, result)
