"""Pure tests of unickpt.plan.placement against torch's own DTensor index arithmetic.

Oracles (no process group needed):
* ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset`` for the
  local shape and global offset of a mesh coordinate;
* the placements' own ``_split_tensor`` applied left to right to a global ``arange``
  (what ``distribute_tensor`` does) for the exact local contents;
* ``_StridedShard._local_shard_size_and_offset`` for the global indices of strided shards.
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter, defaultdict
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from unickpt.errors import LayoutError
from unickpt.plan.box import Box, intersect
from unickpt.plan.placement import (
    chunk_range,
    dtensor_pieces,
    pieces_from_indices,
    replica_group,
    shard_indices,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
        t = t.narrow(d, o, n)
    return t


def torch_local(global_t: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The local tensor torch's placements give ``coordinate`` (split left to right)."""
    t = global_t
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            shards, _ = p._split_tensor(t, mesh_shape[mesh_dim], with_padding=False, contiguous=True)
            t = shards[coordinate[mesh_dim]]
    return t


def rebuild_local(global_t: torch.Tensor, pieces) -> torch.Tensor:
    """The local tensor described by ``pieces`` (box-in-box form), filled from ``global_t``;
    elements no piece covers are -1, elements covered twice fail the test."""
    assert pieces, "no pieces"
    view = pieces[0].view
    out = torch.full(view, -1, dtype=global_t.dtype)
    hits = torch.zeros(view, dtype=torch.int64)
    for p in pieces:
        assert p.view == view and p.flat_offset == 0
        region(out, p.local_box).copy_(region(global_t, p.global_box))
        region(hits, p.local_box).add_(1)
    assert int(hits.max()) == 1 and int(hits.min()) == 1, "pieces must tile the local tensor exactly once"
    return out


def oracle(global_shape, mesh_shape, coordinate, placements):
    return _compute_local_shape_and_global_offset(tuple(global_shape), tuple(mesh_shape), list(coordinate), placements)


def strided_offsets(p: _StridedShard, size: int, n: int, k: int) -> tuple[int, list[int]]:
    """torch's ``_StridedShard._local_shard_size_and_offset`` with every offset materialised."""
    params = inspect.signature(p._local_shard_size_and_offset).parameters
    if "offset_mode" in params:
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

        got_size, offs = p._local_shard_size_and_offset(size, n, k, offset_mode=_StridedShardOffsetMode.ALL)
    else:  # older torch returns the full list
        got_size, offs = p._local_shard_size_and_offset(size, n, k)
    return int(got_size), [int(o) for o in list(offs)[: int(got_size)]]


def oracle_indices(global_shape, mesh_shape, coordinate, placements) -> list[list[int]]:
    """Per tensor dim, the global indices held, chained like torch's
    ``_get_shard_size_and_offsets`` (previous_offsets[index])."""
    idx = [list(range(n)) for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        cur = idx[p.dim]
        n, k = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(p, _StridedShard):
            size, offs = strided_offsets(p, len(cur), n, k)
            idx[p.dim] = [cur[o] for o in offs]
        else:
            size, start = Shard.local_shard_size_and_offset(len(cur), n, k)
            idx[p.dim] = cur[int(start) : int(start) + int(size)]
    return idx


def piece_indices(pieces) -> list[list[int]]:
    """Per tensor dim, the global index of each local position, read off the pieces."""
    view = pieces[0].view
    idx: list[list[int | None]] = [[None] * n for n in view]
    for p in pieces:
        for d in range(len(view)):
            for j in range(p.global_box.lengths[d]):
                g = p.global_box.offsets[d] + j
                prev = idx[d][p.local_offsets[d] + j]
                assert prev is None or prev == g, "inconsistent index maps between pieces"
                idx[d][p.local_offsets[d] + j] = g
    assert all(i is not None for dim in idx for i in dim)
    return idx  # type: ignore[return-value]


# --------------------------------------------------------------------------- strategies


@st.composite
def layouts(draw, strided: bool = False):
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(mesh_ndim))
    kinds = ["R", "S", "SS"] if strided else ["R", "S"]
    placements = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(kinds))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(draw(st.integers(0, ndim - 1))))
        else:
            placements.append(_StridedShard(draw(st.integers(0, ndim - 1)), split_factor=draw(st.integers(1, 3))))
    return global_shape, mesh_shape, placements


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


# --------------------------------------------------------------------------- chunk_range


@pytest.mark.parametrize("num_chunks", range(1, 10))
def test_chunk_range_is_torch_chunk(num_chunks):
    for size in range(0, 41):
        chunks = torch.arange(size).chunk(num_chunks) if size else ()
        covered = 0
        for i in range(num_chunks):
            start, length = chunk_range(size, num_chunks, i)
            assert 0 <= start <= size and length >= 0 and start + length <= size
            if i < len(chunks):
                assert torch.equal(torch.arange(start, start + length), chunks[i]), (size, num_chunks, i)
            else:
                assert length == 0, (size, num_chunks, i)  # torch.chunk returns fewer chunks: trailing empties
            # DTensor's own Shard arithmetic (uneven and empty shards included)
            tsize, toff = Shard.local_shard_size_and_offset(size, num_chunks, i)
            assert (int(tsize), int(toff) if tsize else None) == (length, start if length else None)
            covered += length
        assert covered == size


def test_chunk_range_is_not_tensor_split():
    """DTensor follows torch.chunk (ceil-sized chunks first), not tensor_split (remainder
    spread over the first chunks): 5 into 4 is 2,2,1,0 — not 2,1,1,1."""
    assert [chunk_range(5, 4, i)[1] for i in range(4)] == [2, 2, 1, 0]
    assert [len(c) for c in torch.arange(5).tensor_split(4)] == [2, 1, 1, 1]


# --------------------------------------------------------------------------- dtensor_pieces


@SETTINGS
@given(layouts())
def test_dtensor_pieces_match_torch(layout):
    global_shape, mesh_shape, placements = layout
    g = torch.arange(prod(global_shape)).view(global_shape)
    for c in coords(mesh_shape):
        pieces = dtensor_pieces(global_shape, mesh_shape, c, placements)
        shape, offset = oracle(global_shape, mesh_shape, c, placements)
        expected = torch_local(g, mesh_shape, c, placements)
        assert tuple(expected.shape) == tuple(shape)
        if prod(shape) == 0:
            assert pieces == []
            continue
        # Shard/Replicate only: one box, exactly torch's local shape and offset
        assert len(pieces) == 1
        (p,) = pieces
        assert p.global_box == Box(tuple(offset), tuple(shape))
        assert p.local_offsets == (0,) * len(shape) and p.view == tuple(shape) and p.flat_offset == 0
        assert torch.equal(rebuild_local(g, pieces), expected)


@SETTINGS
@given(layouts())
def test_dtensor_pieces_tile_global_tensor(layout):
    """Every element is held once per replica; the replica-0 holders tile it exactly."""
    global_shape, mesh_shape, placements = layout
    _, replicas = replica_group(mesh_shape, (0,) * len(mesh_shape), placements)
    assert replicas == prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    all_hits = torch.zeros(global_shape, dtype=torch.int64)
    first_hits = torch.zeros(global_shape, dtype=torch.int64)
    for c in coords(mesh_shape):
        index, size = replica_group(mesh_shape, c, placements)
        assert size == replicas and 0 <= index < size
        for p in dtensor_pieces(global_shape, mesh_shape, c, placements):
            region(all_hits, p.global_box).add_(1)
            if index == 0:
                region(first_hits, p.global_box).add_(1)
    assert bool((all_hits == replicas).all())
    assert bool((first_hits == 1).all())


@SETTINGS
@given(layouts())
def test_replica_group(layout):
    global_shape, mesh_shape, placements = layout
    groups: dict[tuple, list] = defaultdict(list)
    for c in coords(mesh_shape):
        key = tuple(x for x, p in zip(c, placements) if not isinstance(p, Replicate))
        groups[key].append((c, replica_group(mesh_shape, c, placements)))
    for members in groups.values():
        sizes = {size for _, (_, size) in members}
        assert sizes == {len(members)}
        assert sorted(i for _, (i, _) in members) == list(range(len(members)))
        # replicas hold the same pieces
        held = {tuple(dtensor_pieces(global_shape, mesh_shape, c, placements)) for c, _ in members}
        assert len(held) == 1


def test_replica_group_row_major():
    pl = [Replicate(), Shard(0), Replicate()]
    assert replica_group((2, 3, 4), (1, 2, 3), pl) == (1 * 4 + 3, 8)
    assert replica_group((2, 3, 4), (1, 2, 0), pl) == (4, 8)
    assert replica_group((2, 3, 4), (0, 1, 2), pl) == (2, 8)
    assert replica_group((2, 3, 4), (0, 1, 0), pl) == (0, 8)
    assert replica_group((2, 3), (1, 2), [Shard(0), Shard(1)]) == (0, 1)


def test_several_mesh_dims_shard_one_dim():
    """(Shard(0), Shard(0)) on a 2x3 mesh: mesh dim 0 splits first, then mesh dim 1."""
    shape = (10, 2)
    pl = [Shard(0), Shard(0)]
    got = {c: dtensor_pieces(shape, (2, 3), c, pl) for c in coords((2, 3))}
    # 10 -> [0,5) [5,10); 5 -> 2,2,1
    assert got[(0, 0)][0].global_box == Box((0, 0), (2, 2))
    assert got[(0, 2)][0].global_box == Box((4, 0), (1, 2))
    assert got[(1, 1)][0].global_box == Box((7, 0), (2, 2))
    for c, ps in got.items():
        shape_o, off_o = oracle(shape, (2, 3), c, pl)
        assert ps[0].global_box == Box(tuple(off_o), tuple(shape_o))


# --------------------------------------------------------------------------- _StridedShard


@pytest.mark.parametrize("dim_size", [8, 9, 12, 13, 3, 0])
def test_strided_shard_fsdp2_x_tp(dim_size):
    """FSDP2 x TP: mesh (dp=2, tp=2), placements (_StridedShard(0, split_factor=2), Shard(0))."""
    shape, mesh = (dim_size, 3), (2, 2)
    pl = [_StridedShard(0, split_factor=2), Shard(0)]
    g = torch.arange(prod(shape)).view(shape)
    for c in coords(mesh):
        shape_o, _ = oracle(shape, mesh, c, pl)
        pieces = dtensor_pieces(shape, mesh, c, pl)
        if prod(shape_o) == 0:
            assert pieces == []
            continue
        assert pieces[0].view == tuple(shape_o)
        assert piece_indices(pieces) == oracle_indices(shape, mesh, c, pl)
        assert torch.equal(rebuild_local(g, pieces), torch_local(g, mesh, c, pl))


def test_strided_shard_alone_gives_several_boxes():
    """_StridedShard(0, sf=2) over 2 ranks on 8 rows: rank 0 holds rows [0,1] and [4,5]."""
    pl = [_StridedShard(0, split_factor=2)]
    pieces = dtensor_pieces((8, 2), (2,), (0,), pl)
    assert sorted((p.global_box for p in pieces), key=lambda b: b.offsets) == [Box((0, 0), (2, 2)), Box((4, 0), (2, 2))]
    assert sorted(p.local_offsets for p in pieces) == [(0, 0), (2, 0)]
    assert piece_indices(pieces) == oracle_indices((8, 2), (2,), (0,), pl)


def test_strided_shard_on_dim_1():
    """FSDP2 with a shard_placement_fn choosing dim 1, composed with row-parallel TP Shard(1)."""
    shape, mesh = (3, 8), (2, 2)
    pl = [_StridedShard(1, split_factor=2), Shard(1)]
    g = torch.arange(prod(shape)).view(shape)
    for c in coords(mesh):
        pieces = dtensor_pieces(shape, mesh, c, pl)
        assert piece_indices(pieces) == oracle_indices(shape, mesh, c, pl)
        assert torch.equal(rebuild_local(g, pieces), torch_local(g, mesh, c, pl))


@SETTINGS
@given(layouts(strided=True))
def test_strided_pieces_match_torch(layout):
    global_shape, mesh_shape, placements = layout
    g = torch.arange(prod(global_shape)).view(global_shape)
    hits = torch.zeros(global_shape, dtype=torch.int64)
    for c in coords(mesh_shape):
        shape_o, _ = oracle(global_shape, mesh_shape, c, placements)
        expected = torch_local(g, mesh_shape, c, placements)
        assert tuple(expected.shape) == tuple(shape_o)
        pieces = dtensor_pieces(global_shape, mesh_shape, c, placements)
        if prod(shape_o) == 0:
            assert pieces == []
            continue
        assert pieces[0].view == tuple(shape_o)
        assert piece_indices(pieces) == oracle_indices(global_shape, mesh_shape, c, placements)
        assert torch.equal(rebuild_local(g, pieces), expected)
        if replica_group(mesh_shape, c, placements)[0] == 0:
            for p in pieces:
                region(hits, p.global_box).add_(1)
    assert bool((hits == 1).all())


# --------------------------------------------------------------------------- pieces_from_indices


def test_pieces_from_indices_non_contiguous():
    idx = [[0, 1, 4, 5, 6], [3, 2], [7]]
    pieces = pieces_from_indices(idx)
    # dim 0 has runs [0,1] [4,5,6]; dim 1 has runs [3] [2]; dim 2 one run
    assert len(pieces) == 4
    g = torch.arange(10 * 5 * 9).view(10, 5, 9)
    expected = g[torch.tensor(idx[0])][:, torch.tensor(idx[1])][:, :, torch.tensor(idx[2])]
    assert torch.equal(rebuild_local(g, pieces), expected)
    for a, b in itertools.combinations(pieces, 2):
        assert intersect(a.global_box, b.global_box) is None


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=6, unique=True), min_size=1, max_size=3))
def test_pieces_from_indices_random(idx):
    pieces = pieces_from_indices(idx)
    if any(len(i) == 0 for i in idx):
        assert pieces == []
        return
    g = torch.arange(10 ** len(idx)).view((10,) * len(idx))
    expected = g
    for d, i in enumerate(idx):
        expected = expected.index_select(d, torch.tensor(i))
    assert torch.equal(rebuild_local(g, pieces), expected)
    runs = [sum(1 for j in range(len(i)) if j == 0 or i[j] != i[j - 1] + 1) for i in idx]
    assert len(pieces) == prod(runs)


def test_pieces_from_indices_ranges():
    assert pieces_from_indices([range(2, 5), range(0, 3)])[0].global_box == Box((2, 0), (3, 3))
    assert pieces_from_indices([range(0)]) == []


# --------------------------------------------------------------------------- errors


def test_layout_errors():
    with pytest.raises(LayoutError, match="Partial"):
        dtensor_pieces((4,), (2,), (0,), [Partial()])
    with pytest.raises(LayoutError, match="placements"):
        dtensor_pieces((4,), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(LayoutError, match="dim 2"):
        dtensor_pieces((4, 4), (2,), (0,), [Shard(2)])
    with pytest.raises(LayoutError):
        shard_indices((4,), (2,), (0,), ["not a placement"])


def test_shard_order_overrides_left_to_right():
    """shard_order lists the mesh dims sharding a tensor dim in application order."""
    shape, mesh, pl = (8,), (2, 2), [Shard(0), Shard(0)]
    default = [shard_indices(shape, mesh, c, pl)[0] for c in coords(mesh)]
    reordered = [list(shard_indices(shape, mesh, c, pl, shard_order=[(0, [1, 0])])[0]) for c in coords(mesh)]
    assert [list(i) for i in default] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert reordered == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert Counter(x for i in reordered for x in i) == Counter(range(8))
