"""DTensor placements -> pieces, computed from mesh coordinates alone (no communication).

The function takes plain values (global shape, mesh shape, this rank's coordinate and the
placements) and is pure. Shard(d) follows ``torch.chunk`` semantics (uneven and empty
shards included); ``_StridedShard`` is delegated to the placement's own index arithmetic so
the layout is exactly the one torch produced, even where the local rows are not contiguous
in the global tensor (FSDP2 x TP).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ..errors import LayoutError
from .box import Box
from .piece import Piece


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` is split like ``torch.chunk``."""
    full = -(-size // num_chunks) if size else 0
    start = min(size, full * index)
    return start, max(0, min(size, start + full) - start)


def _runs(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values: (local_start, global_start, length)."""
    if isinstance(indices, range) and indices.step == 1:
        return [(0, indices.start, len(indices))] if len(indices) else []
    runs: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            ls, gs, n = runs[-1]
            runs[-1] = (ls, gs, n + 1)
        else:
            runs.append((pos, g, 1))
    return runs


def _strided_indices(p: Any, idx: Sequence[int], n: int, k: int) -> list[int]:
    """Indices kept by ``_StridedShard`` at position k of n, using torch's own split."""
    import torch

    t = torch.tensor(list(idx), dtype=torch.int64).view([1] * p.dim + [-1])
    shards, _ = p._split_tensor(t, n, with_padding=False)
    return shards[k].reshape(-1).tolist() if k < len(shards) else []


def shard_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    shard_order: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> list[Sequence[int]]:
    """Per tensor dimension, the global indices this coordinate holds, in local order.

    ``shard_order`` optionally lists ``(tensor_dim, mesh_dims)`` giving the order in
    which mesh dims shard a tensor dim (torch's ``DTensorSpec.shard_order``); by
    default mesh dims apply left to right.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise LayoutError(f"{len(placements)} placements for a mesh of shape {tuple(mesh_shape)}")
    order: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            if not 0 <= p.dim < len(global_shape):
                raise LayoutError(f"placement {p} shards dim {p.dim} of a {len(global_shape)}-d tensor")
            order.setdefault(p.dim, []).append(mesh_dim)
        elif isinstance(p, Partial):
            raise LayoutError("Partial placements hold unreduced values; reduce them before saving")
        elif not isinstance(p, Replicate):
            raise LayoutError(f"unsupported placement {p!r}")
    if shard_order:
        for tensor_dim, mesh_dims in shard_order:
            order[tensor_dim] = list(mesh_dims)
    indices: list[Sequence[int]] = [range(n) for n in global_shape]
    for tensor_dim, mesh_dims in order.items():
        idx = indices[tensor_dim]
        for mesh_dim in mesh_dims:
            p = placements[mesh_dim]
            n, k = mesh_shape[mesh_dim], coordinate[mesh_dim]
            if isinstance(p, _StridedShard):
                idx = _strided_indices(p, idx, n, k)
            else:
                start, length = chunk_range(len(idx), n, k)
                idx = idx[start : start + length]
        indices[tensor_dim] = idx
    return indices


def pieces_from_indices(indices: Sequence[Sequence[int]]) -> list[Piece]:
    """Pieces of a local tensor whose dim d holds global indices ``indices[d]``."""
    local_shape = tuple(len(i) for i in indices)
    if any(n == 0 for n in local_shape):
        return []
    per_dim = [_runs(i) for i in indices]
    pieces = []
    for combo in itertools.product(*per_dim):
        local = tuple(r[0] for r in combo)
        glob = tuple(r[1] for r in combo)
        lens = tuple(r[2] for r in combo)
        pieces.append(Piece(Box(glob, lens), local, local_shape, 0))
    return pieces


def dtensor_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    shard_order: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> list[Piece]:
    """Pieces of the local shard a mesh coordinate holds of a DTensor."""
    return pieces_from_indices(shard_indices(global_shape, mesh_shape, coordinate, placements, shard_order))


def replica_group(mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]) -> tuple[int, int]:
    """``(index, size)`` of this coordinate among the replicas holding the same shard.

    Replicas differ only in the coordinates of Replicate mesh dims; the index is the
    row-major position in those dims. Computed locally, no communication.
    """
    from torch.distributed.tensor import Replicate

    index, size = 0, 1
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            index = index * mesh_shape[mesh_dim] + coordinate[mesh_dim]
            size *= mesh_shape[mesh_dim]
    return index, size
