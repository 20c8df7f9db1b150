"""Pure tests of unickpt.plan.box: boxes, intersection, flat ranges -> boxes."""

from __future__ import annotations

import itertools
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unickpt.plan.box import Box, first_overlap, flat_range_to_boxes, intersect, row_major_strides, tiling_problem

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def boxes(draw, ndim=None, max_off=5, max_len=4):
    n = draw(st.integers(0, 3)) if ndim is None else ndim
    offs = tuple(draw(st.integers(0, max_off)) for _ in range(n))
    lens = tuple(draw(st.integers(0, max_len)) for _ in range(n))
    return Box(offs, lens)


@st.composite
def box_pairs(draw):
    n = draw(st.integers(0, 3))
    return draw(boxes(ndim=n)), draw(boxes(ndim=n))


def points(b: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.lengths))))


# --------------------------------------------------------------------------- intersect


@SETTINGS
@given(box_pairs())
def test_intersect_commutative(pair):
    a, b = pair
    assert intersect(a, b) == intersect(b, a)


@SETTINGS
@given(box_pairs())
def test_intersect_matches_brute_force(pair):
    a, b = pair
    common = points(a) & points(b)
    got = intersect(a, b)
    if not common:
        assert got is None
        return
    assert got is not None
    assert not got.is_empty()
    assert a.contains(got) and b.contains(got)
    assert got.volume == len(common)
    assert points(got) == common


@SETTINGS
@given(boxes())
def test_intersect_with_self_is_self_unless_empty(a):
    got = intersect(a, a)
    if a.is_empty():
        assert got is None
    else:
        assert got == a


def test_intersect_zero_d():
    z = Box((), ())
    assert intersect(z, z) == z
    assert z.volume == 1 and not z.is_empty()


def test_intersect_touching_boxes_is_none():
    assert intersect(Box((0, 0), (2, 3)), Box((2, 0), (2, 3))) is None
    assert intersect(Box((0,), (3,)), Box((3,), (1,))) is None


def test_intersect_rank_mismatch():
    with pytest.raises(ValueError, match="rank"):
        intersect(Box((0,), (1,)), Box((0, 0), (1, 1)))


# --------------------------------------------------------------------------- strides


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4))
def test_row_major_strides_match_torch(shape):
    shape = tuple(shape)
    got = row_major_strides(shape)
    assert len(got) == len(shape)
    if all(n > 0 for n in shape):
        assert got == torch.empty(shape).stride()
    # definition independent of torch (torch reports arbitrary strides around 0-sized dims)
    for d in range(len(shape)):
        assert got[d] == prod(shape[d + 1 :])


# --------------------------------------------------------------------------- flat ranges


@st.composite
def flat_cases(draw):
    n = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(n))
    offs = tuple(draw(st.integers(0, 3)) for _ in range(n))
    total = prod(shape)
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return Box(offs, shape), start, stop


@SETTINGS
@given(flat_cases())
def test_flat_range_to_boxes(case):
    box, start, stop = case
    out = flat_range_to_boxes(box, start, stop)
    if start == stop:
        assert out == []
        return
    n = box.ndim
    assert 1 <= len(out) <= max(1, 2 * n - 1)
    for b in out:
        assert b.ndim == n
        assert not b.is_empty()
        assert box.contains(b)
    for x, y in itertools.combinations(out, 2):
        assert intersect(x, y) is None
    # Reference: global index -> row-major position inside ``box``.
    ref = torch.arange(box.volume).view(box.lengths)
    got = []
    for b in out:
        local = b.relative_to(box.offsets)
        region = ref
        for d in range(n):
            region = region.narrow(d, local.offsets[d], local.lengths[d])
        got.append(region.reshape(-1))
    assert torch.equal(torch.cat(got), torch.arange(start, stop))
    assert sum(b.volume for b in out) == stop - start


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_flat_range_count_bound_on_whole_boxes(shape, data):
    """Boxes of positive lengths starting at zero (the common ZeRO case): never more than 2n-1."""
    box = Box.whole(tuple(shape))
    total = box.volume
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    out = flat_range_to_boxes(box, start, stop)
    assert len(out) <= 2 * len(shape) - 1


def test_flat_range_needs_2n_minus_1():
    box = Box.whole((3, 3, 3))
    out = flat_range_to_boxes(box, 1, 26)
    assert len(out) == 5
    assert sum(b.volume for b in out) == 25


def test_flat_range_zero_d():
    z = Box((), ())
    assert flat_range_to_boxes(z, 0, 1) == [z]
    assert flat_range_to_boxes(z, 0, 0) == []
    assert flat_range_to_boxes(z, 1, 1) == []


@pytest.mark.parametrize("start,stop", [(-1, 2), (3, 2), (0, 25), (25, 25)])
def test_flat_range_out_of_bounds(start, stop):
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes(Box.whole((4, 6)), start, stop)


# --------------------------------------------------------------------------- Box itself


def test_box_validation():
    with pytest.raises(ValueError, match="rank mismatch"):
        Box((0, 0), (1,))
    with pytest.raises(ValueError, match="negative"):
        Box((-1,), (2,))
    with pytest.raises(ValueError, match="negative"):
        Box((0,), (-2,))
    with pytest.raises(ValueError, match="negative"):
        Box((0, 0), (2, 3)).shift((-1, 0))


def test_box_helpers():
    b = Box((1, 2), (3, 4))
    assert b.ends == (4, 6)
    assert b.volume == 12 and b.ndim == 2
    assert Box.whole([2, 5]) == Box((0, 0), (2, 5))
    assert b.contains(Box((2, 3), (1, 1)))
    assert not b.contains(Box((0, 3), (2, 1)))
    assert b.contains(Box((4, 6), (0, 0)))  # an empty box at the far corner
    assert b.shift((1, -2)) == Box((2, 0), (3, 4))
    assert b.relative_to((1, 1)) == Box((0, 1), (3, 4))
    assert Box((0, 0), (3, 0)).is_empty() and Box((0, 0), (3, 0)).volume == 0


@SETTINGS
@given(st.integers(1, 3).flatmap(lambda n: st.lists(boxes(ndim=n), min_size=0, max_size=8)))
def test_first_overlap_matches_brute_force(bs):
    """Two boxes sharing an element when, and only when, some pair of them does."""
    pairs = [(a, b) for a, b in itertools.combinations(bs, 2) if intersect(a, b) is not None]
    got = first_overlap(bs)
    assert (got is None) == (not pairs), (bs, got)
    if got is not None:
        assert intersect(*got) is not None


def test_tiling_problem_names_what_is_wrong():
    rows = [Box((0, 0), (3, 8)), Box((3, 0), (3, 8))]
    assert tiling_problem((6, 8), rows) is None
    assert tiling_problem((6, 8), rows[:1]) == "its pieces hold 24 of its 48 elements"
    assert tiling_problem((6, 8), [rows[0], rows[0]]) == (
        "its pieces [0:3, 0:8] and [0:3, 0:8] overlap, so as many elements are held by none")
    assert tiling_problem((6, 8), [rows[0], Box((3, 0), (3, 9))]) == "its piece [3:6, 0:9] lies outside its shape (6, 8)"
    assert tiling_problem((), [Box((), ())]) is None and tiling_problem((0, 4), []) is None
    assert tiling_problem((), [Box((), ()), Box((), ())]) == "its pieces hold 2 of its 1 elements"  # a scalar stored twice
    # ZeRO's flat partitions of a 5 x 7 tensor in 4 parts tile it: rows cut part-way meet no other part
    cuts = [0, 9, 18, 27, 35]
    flat = [b for lo, hi in zip(cuts, cuts[1:]) for b in flat_range_to_boxes(Box.whole((5, 7)), lo, hi)]
    assert tiling_problem((5, 7), flat) is None
