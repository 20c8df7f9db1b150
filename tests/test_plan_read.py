"""End-to-end property test of read planning, without I/O.

A random global tensor is cut into random stored fragments (DTensor-like grids, padded
boxes, fused/stacked pieces, ZeRO-style flat partitions with padding, and mixtures of
those), each kept as contiguous bytes. Random target layouts are filled by executing the
plan the way ``unickpt.engine.tensor_reads.TensorReads`` does (span bytes viewed as the dtype,
``copy_into`` for every copy), and compared bitwise with the reference.
"""

from __future__ import annotations

import itertools
import json
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unickpt.engine.tensor_reads import copy_into, target_view
from unickpt.errors import ManifestError
from unickpt.format.checksum import block_crcs
from unickpt.format.manifest import Manifest
from unickpt.plan.box import Box, intersect, row_major_strides
from unickpt.plan.piece import Piece, box_piece, flat_pieces, whole_piece
from unickpt.plan.placement import pieces_from_indices
from unickpt.plan.read_plan import SourceFragment, plan_reads

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


# --------------------------------------------------------------------------- helpers


def region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
        t = t.narrow(d, o, n)
    return t


def piece_region(flat: torch.Tensor, p: Piece) -> torch.Tensor:
    """The region of a fragment's flat data that piece ``p`` addresses (its definition)."""
    return region(flat[p.flat_offset : p.flat_offset + prod(p.view)].view(p.view), p.local_box)


def random_data(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # every bit pattern, NaNs included: compare bitwise


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def materialize(g: torch.Tensor, shape: tuple[int, ...], pieces: list[Piece], gen: torch.Generator) -> torch.Tensor:
    """A fragment's flat data: garbage everywhere, the pieces' global boxes where they say."""
    flat = random_data(prod(shape), g.dtype, gen)
    for p in pieces:
        piece_region(flat, p).copy_(region(g, p.global_box))
    return flat


# --------------------------------------------------------------------------- layouts
# A layout is a list of fragments (shape, pieces); together they hold every element of
# the global tensor exactly once.


def cuts(draw, n: int, max_parts: int = 3) -> list[tuple[int, int]]:
    """Split [0, n) (n >= 1) into 1..max_parts consecutive non-empty (start, length) intervals."""
    k = draw(st.integers(0, min(n, max_parts) - 1))
    points = sorted(draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k, unique=True))) if k else []
    bounds = [0, *points, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def grid_cells(draw, box: Box) -> list[Box]:
    per_dim = [[(box.offsets[d] + a, m) for a, m in cuts(draw, box.lengths[d])] for d in range(box.ndim)]
    return [Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo)) for combo in itertools.product(*per_dim)]


def grid_layout(draw, box: Box) -> list[tuple[tuple[int, ...], list[Piece]]]:
    out = []
    for cell in grid_cells(draw, box):
        if cell.is_empty():
            continue
        if draw(st.booleans()):  # padded: the cell sits inside a larger local buffer (vocab padding)
            before = tuple(draw(st.integers(0, 2)) for _ in cell.lengths)
            after = tuple(draw(st.integers(0, 2)) for _ in cell.lengths)
            shape = tuple(b + n + a for b, n, a in zip(before, cell.lengths, after))
            out.append((shape, [box_piece(shape, Box(before, cell.lengths), cell)]))
        else:
            out.append((cell.lengths, [box_piece(cell.lengths, Box.whole(cell.lengths), cell)]))
    return out


def stacked_layout(draw, box: Box) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """Fused parameters: grid cells with equal trailing lengths stacked along dim 0 in one
    fragment (local rows [q; k; v] map to separated global boxes)."""
    if box.ndim == 0:
        return grid_layout(draw, box)
    cells = [c for c in grid_cells(draw, box) if not c.is_empty()]
    cells = draw(st.permutations(cells))
    out = []
    while cells:
        head = cells.pop(0)
        group = [head] + [c for c in cells if c.lengths[1:] == head.lengths[1:]][: draw(st.integers(0, 2))]
        cells = [c for c in cells if c not in group]
        shape = (sum(c.lengths[0] for c in group),) + head.lengths[1:]
        pieces, at = [], 0
        for c in group:
            pieces.append(box_piece(shape, Box((at,) + (0,) * (box.ndim - 1), c.lengths), c))
            at += c.lengths[0]
        out.append((shape, pieces))
    return out


def flat_layout(draw, box: Box) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """ZeRO / FSDP1: contiguous ranges of the flattened box, each in a 1-d buffer that may
    hold padding (or other tensors) before and after."""
    out = []
    for start, length in cuts(draw, box.volume, max_parts=5):
        before, after = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        out.append(((before + length + after,), flat_pieces(box, start, start + length, before)))
    return out


def scattered_layout(draw, box: Box) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """Like _StridedShard (FSDP2 x TP): each dim's indices dealt into groups, in any local
    order, so a fragment holds several non-adjacent boxes at various local offsets."""
    per_dim = []
    for o, n in zip(box.offsets, box.lengths):
        k = draw(st.integers(1, min(3, n)))
        owner = [draw(st.integers(0, k - 1)) for _ in range(n)]
        groups = [[o + i for i in range(n) if owner[i] == g] for g in range(k)]
        groups = [draw(st.permutations(g)) if draw(st.booleans()) else g for g in groups if g]
        per_dim.append(groups)
    out = []
    for combo in itertools.product(*per_dim):
        out.append((tuple(len(g) for g in combo), pieces_from_indices([list(g) for g in combo])))
    return out


def layout(draw, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], list[Piece]]]:
    whole = Box.whole(shape)
    kind = draw(st.sampled_from(["grid", "stacked", "flat", "scattered", "mixture", "whole"]))
    if kind == "whole":
        return [(shape, [whole_piece(shape)])]
    if kind == "grid":
        return grid_layout(draw, whole)
    if kind == "stacked":
        return stacked_layout(draw, whole)
    if kind == "scattered":
        return scattered_layout(draw, whole)
    if kind == "flat" or whole.ndim == 0:
        return flat_layout(draw, whole)
    out = []
    for start, length in cuts(draw, shape[0]):  # slabs along dim 0, each laid out its own way
        slab = Box((start,) + (0,) * (len(shape) - 1), (length,) + shape[1:])
        out += draw(st.sampled_from([grid_layout, stacked_layout, flat_layout, scattered_layout]))(draw, slab)
    return out


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from([1, 2, 2, 3, 3, 0]))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    dtype = draw(st.sampled_from(DTYPES))
    saved = layout(draw, shape)
    target = layout(draw, shape)
    blocks = [8 * draw(st.integers(2, 32)) for _ in saved]  # 16..256 bytes, per fragment
    max_span = draw(st.integers(1, 512))
    seed = draw(st.integers(0, 2**31 - 1))
    return shape, dtype, saved, target, blocks, max_span, seed


# --------------------------------------------------------------------------- executor


def execute(plan, fragments: list[SourceFragment], data: list[torch.Tensor], dtype, local: torch.Tensor, hits: torch.Tensor):
    """What ``TensorReads`` does, minus the file: read span bytes, view them, copy."""
    size = dtype.itemsize
    for sp in plan.spans:
        frag_bytes = bits(data[sp.fragment])
        buf = frag_bytes[sp.start : sp.stop].clone()
        view = buf.view(dtype)
        first = sp.start // size
        for c in sp.copies:
            copy_into(c, view, first, local)
            dst_local = c.target.local_of(c.box)
            region(target_view(hits, c.target), dst_local).add_(1)


def rows_needed(c) -> tuple[int, int]:
    """Element range [lo, hi) of the source fragment's flat data holding the whole rows
    of the source view that contain ``c.box`` (computed from the piece definition, not
    from ``Piece.row_span``)."""
    s = c.source
    flat_index = torch.arange(prod(s.view)).view(s.view) + s.flat_offset
    local = Box(tuple(b - g + lo for b, g, lo in zip(c.box.offsets, s.global_box.offsets, s.local_offsets)), c.box.lengths)
    touched = region(flat_index, local)
    if not s.view:
        return int(touched), int(touched) + 1
    rows = flat_index.narrow(0, local.offsets[0], local.lengths[0])
    assert int(touched.min()) >= int(rows.min()) and int(touched.max()) <= int(rows.max())
    return int(rows.min()), int(rows.max()) + 1


def check_plan(plan, targets: list[Piece], fragments: list[SourceFragment], itemsize: int, max_span: int) -> None:
    assert plan.covered == [t.global_box.volume for t in targets]
    needed = 0  # bytes of whole source-view rows holding the intersections (the planner's unit)
    n_copies = [0] * len(fragments)
    for t in targets:
        for f in fragments:
            for s in f.pieces:
                common = intersect(t.global_box, s.global_box)
                if common is not None:
                    rows = common.lengths[0] if common.ndim else 1
                    needed += rows * (row_major_strides(s.view)[0] if s.view else 1) * itemsize
    read = 0
    for sp in plan.spans:
        assert sp.copies
        f = fragments[sp.fragment]
        # the span is exactly the block hull of the whole source rows its copies need
        needed_rows = [rows_needed(c) for c in sp.copies]
        assert sp.first_block == min(lo * itemsize for lo, _ in needed_rows) // f.block_bytes
        assert sp.end_block == max(-(-hi * itemsize // f.block_bytes) for _, hi in needed_rows)
        assert sp.file == f.file
        assert 0 <= sp.start < sp.stop <= f.nbytes, (sp, f.nbytes)
        assert sp.start == sp.first_block * f.block_bytes
        assert sp.stop == min(f.nbytes, sp.end_block * f.block_bytes)
        assert sp.first_block < sp.end_block
        if len(sp.copies) > 1:  # merging never makes a span larger than the cap
            assert (sp.end_block - sp.first_block) * f.block_bytes <= max(max_span, f.block_bytes)
        read += sp.stop - sp.start
        for c in sp.copies:
            n_copies[sp.fragment] += 1
            assert any(c.source is p for p in f.pieces)
            assert c.target is targets[c.target_index]
            assert c.source.global_box.contains(c.box) and c.target.global_box.contains(c.box)
            assert not c.box.is_empty()
            lo, hi = rows_needed(c)
            assert sp.start <= lo * itemsize and hi * itemsize <= sp.stop, "copy reads outside its span"
    # Each copy reads its rows widened by at most one block on either side; merged spans
    # only share blocks, so the sum over copies bounds the bytes read.
    bound = needed + sum(2 * f.block_bytes * n for f, n in zip(fragments, n_copies))
    assert read <= bound, (read, needed, bound)


# --------------------------------------------------------------------------- the property


@SETTINGS
@given(cases())
def test_plan_reads_reshards_bitwise(case):
    shape, dtype, saved, target, blocks, max_span, seed = case
    gen = torch.Generator().manual_seed(seed)
    g = random_data(prod(shape), dtype, gen).view(shape)
    data = [materialize(g, fshape, pieces, gen) for fshape, pieces in saved]
    fragments = [
        SourceFragment(f"rank_{i:05d}.safetensors", 8 * i, d.numel() * dtype.itemsize, blocks[i], tuple(pieces))
        for i, (d, (_, pieces)) in enumerate(zip(data, saved))
    ]
    # every stored element of g is held exactly once
    held = torch.zeros(shape, dtype=torch.int64)
    for _, pieces in saved:
        for p in pieces:
            region(held, p.global_box).add_(1)
    assert bool((held == 1).all())

    for tshape, tpieces in target:
        local = random_data(prod(tshape), dtype, gen).view(tshape)
        expected = local.clone()
        want_hits = torch.zeros(tshape, dtype=torch.int64)
        for p in tpieces:
            region(target_view(expected, p), p.local_box).copy_(region(g, p.global_box))
            region(target_view(want_hits, p), p.local_box).add_(1)
        plan = plan_reads(list(tpieces), fragments, dtype.itemsize, max_span_bytes=max_span)
        check_plan(plan, list(tpieces), fragments, dtype.itemsize, max_span)
        hits = torch.zeros(tshape, dtype=torch.int64)
        execute(plan, fragments, data, dtype, local, hits)
        assert torch.equal(hits, want_hits), "every target element is written exactly once, nothing else"
        assert torch.equal(bits(local), bits(expected))


# --------------------------------------------------------------------------- fixed cases


def _single(shape, dtype, block):
    g = torch.arange(prod(shape)).to(dtype).view(shape)
    data = [g.reshape(-1).clone()]
    f = SourceFragment("a", 0, g.numel() * dtype.itemsize, block, (whole_piece(shape),))
    return g, data, [f]


def test_zero_to_tp_fixed():
    """A ZeRO-style flat partition of a (6, 4) tensor read into a column-parallel shard."""
    shape = (6, 4)
    g = torch.arange(24, dtype=torch.int64).view(shape)
    frags, data = [], []
    for i, (a, b) in enumerate([(0, 7), (7, 15), (15, 24)]):
        ps = flat_pieces(Box.whole(shape), a, b)
        frags.append(SourceFragment(f"f{i}", 0, (b - a) * 8, 16, tuple(ps)))
        data.append(g.reshape(-1)[a:b].clone())
    target = box_piece((6, 2), Box.whole((6, 2)), Box((0, 2), (6, 2)))
    plan = plan_reads([target], frags, 8, max_span_bytes=64)
    check_plan(plan, [target], frags, 8, 64)
    local = torch.full((6, 2), -1, dtype=torch.int64)
    execute(plan, frags, data, torch.int64, local, torch.zeros(6, 2, dtype=torch.int64))
    assert torch.equal(local, g[:, 2:])


def test_span_cap_splits_rows_and_big_rows_stay_whole():
    g, data, frags = _single((8, 4), torch.float32, 16)
    target = whole_piece((8, 4))
    plan = plan_reads([target], frags, 4, max_span_bytes=32)  # two 16-byte rows per span
    assert len(plan.spans) == 4 and all(sp.stop - sp.start == 32 for sp in plan.spans)
    plan = plan_reads([target], frags, 4, max_span_bytes=5)  # smaller than one row: one row each
    assert len(plan.spans) == 8
    local = torch.empty(8, 4)
    execute(plan, frags, data, torch.float32, local, torch.zeros(8, 4, dtype=torch.int64))
    assert torch.equal(local, g)


def test_no_overlap_means_nothing_read():
    shape = (4, 4)
    f = SourceFragment("a", 0, 32, 16, (box_piece((2, 4), Box.whole((2, 4)), Box((0, 0), (2, 4))),))
    target = box_piece((2, 4), Box.whole((2, 4)), Box((2, 0), (2, 4)))
    plan = plan_reads([target], [f], 4)
    assert plan.spans == [] and plan.covered == [0]
    assert Box.whole(shape).contains(target.global_box)


@pytest.mark.parametrize("dtype,block", [(torch.int64, 12), (torch.float32, 6), (torch.int64, 20)])
def test_block_size_not_multiple_of_itemsize(dtype, block):
    """A fragment whose checksum block size is not a multiple of the element size must
    either be refused when the manifest is parsed, or load correctly. Today it is
    accepted, and the loader computes ``first = sp.start // itemsize`` on a span that
    starts mid-element, so the copy takes the wrong bytes (or ``view`` fails)."""
    from unickpt.format.dtypes import dtype_name

    shape = (6,)
    g = torch.arange(6).to(dtype) * 3 + 1
    raw = bits(g).numpy().tobytes()
    frag = {
        "rank": 0, "file": "r.safetensors", "offset": 0, "shape": list(shape), "block_bytes": block,
        "crc32c": block_crcs(memoryview(raw), block), "pieces": [{"global": [0], "lengths": [6]}],
    }
    doc = {
        "format": "unickpt", "version": "1.0", "files": {"r.safetensors": len(raw)},
        "tensors": {"t": {"shape": list(shape), "dtype": dtype_name(dtype), "fragments": [frag]}},
    }
    try:
        m = Manifest.from_json(json.dumps(doc))
    except ManifestError:
        return  # refusing is a correct answer
    f = m.tensors["t"].fragments[0]
    src = [SourceFragment(f.file, f.offset, len(raw), f.block_bytes, tuple(f.pieces))]
    for a, n in [(2, 2), (1, 3), (3, 3), (2, 1)]:
        target = box_piece((n,), Box.whole((n,)), Box((a,), (n,)))
        plan = plan_reads([target], src, dtype.itemsize)
        local = torch.zeros(n, dtype=dtype)
        try:
            execute(plan, src, [g], dtype, local, torch.zeros(n, dtype=torch.int64))
        except RuntimeError as e:  # torch refuses to view a misaligned byte run
            pytest.fail(f"loading elements [{a}, {a + n}) with block_bytes={block} fails: {e}")
        assert torch.equal(local, g[a : a + n]), (
            f"elements [{a}, {a + n}) with block_bytes={block}: got {local.tolist()}, want {g[a:a + n].tolist()}"
        )


def test_spans_of_a_large_piece_never_read_a_block_twice():
    # 1000 rows of 48 bytes, 4 KiB checksum blocks, spans capped at 16 KiB: the cuts fall
    # on block boundaries (every 256 rows share one), so no block is read by two spans
    shape, item = (1000, 12), 4
    frag = SourceFragment("f", 0, prod(shape) * item, 4096, (whole_piece(shape),))
    plan = plan_reads([whole_piece(shape)], [frag], item, max_span_bytes=16 * 1024)
    blocks = [b for sp in plan.spans for b in range(sp.first_block, sp.end_block)]
    assert len(blocks) == len(set(blocks)) and len(plan.spans) > 1
    assert sum(sp.stop - sp.start for sp in plan.spans) == prod(shape) * item
    assert plan.covered == [prod(shape)]
