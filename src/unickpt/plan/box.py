"""Boxes: axis-aligned regions of an n-dimensional tensor, and their algebra.

A box is a pair of tuples (offsets, lengths), one entry per dimension. A 0-d tensor
has the empty box ``Box((), ())`` whose volume is 1. Everything here is pure.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box: ``offsets[d] <= i_d < offsets[d] + lengths[d]`` for each dim d."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box rank mismatch: offsets {self.offsets}, lengths {self.lengths}")
        if self.offsets and (min(self.offsets) < 0 or min(self.lengths) < 0):
            raise ValueError(f"box with negative offset or length: {self.offsets}, {self.lengths}")

    def __str__(self) -> str:
        """The box as the slices that select it, as messages show it: ``[0:3, 0:8]``."""
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"

    @staticmethod
    def whole(shape: tuple[int, ...] | list[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return _whole(tuple(int(n) for n in shape))

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.lengths)

    @property
    def volume(self) -> int:
        """Number of elements in the box (1 for a 0-d box)."""
        return prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive upper corner."""
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def is_empty(self) -> bool:
        """True when the box holds no element."""
        return any(n == 0 for n in self.lengths)

    def contains(self, other: Box) -> bool:
        """True when ``other`` lies entirely inside this box."""
        return all(
            so <= oo and oo + on <= so + sn
            for so, sn, oo, on in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def shift(self, delta: tuple[int, ...]) -> Box:
        """The same box moved by ``delta`` (which may be negative; the result must be valid)."""
        return Box(tuple(map(operator.add, self.offsets, delta)), self.lengths)

    def relative_to(self, origin: tuple[int, ...]) -> Box:
        """This box expressed in coordinates whose zero is ``origin``."""
        return Box(tuple(o - z for o, z in zip(self.offsets, origin)), self.lengths)


@functools.lru_cache(maxsize=4096)
def _whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), shape)  # boxes are immutable: one per shape is shared


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same rank, or None when it holds no element."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets = []
    lengths = []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo = max(ao, bo)
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (of one rank) that share an element, or None when they are pairwise
    disjoint. A sweep along the dimension where their offsets differ most, each box compared
    only with those still open there: about n log n for pieces cut along one or two
    dimensions (row or column shards, their grid, ZeRO's flat partitions)."""
    live = [b for b in boxes if not b.is_empty()]
    if len(live) < 2:
        return None
    if live[0].ndim == 0:
        return live[0], live[1]  # two 0-d boxes: the same one element
    d = max(range(live[0].ndim), key=lambda k: len({b.offsets[k] for b in live}))
    live.sort(key=lambda b: b.offsets[d])
    still: list[Box] = []
    for b in live:
        still = [o for o in still if o.offsets[d] + o.lengths[d] > b.offsets[d]]
        for o in still:
            if intersect(o, b) is not None:
                return o, b
        still.append(b)
    return None


def tiling_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """What keeps ``boxes`` from tiling a tensor of ``shape`` exactly (every element in
    exactly one box; the boxes lie inside it), or None. Equal volumes are not enough: two
    boxes that overlap leave an equal gap elsewhere."""
    whole = Box.whole(shape)
    outside = next((b for b in boxes if b.ndim != whole.ndim or not whole.contains(b)), None)
    if outside is not None:
        return f"its piece {outside} lies outside its shape {tuple(shape)}"
    total, stored = whole.volume, sum(b.volume for b in boxes)
    if stored != total:
        return f"its pieces hold {stored} of its {total} elements"
    pair = first_overlap(boxes)
    if pair is not None:
        return f"its pieces {pair[0]} and {pair[1]} overlap, so as many elements are held by none"
    return None


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def flat_range_to_boxes(box: Box, start: int, stop: int) -> list[Box]:
    """Decompose elements ``[start, stop)`` of ``box``'s row-major order into boxes.

    The result lists disjoint boxes (in global coordinates) in row-major order whose
    concatenated row-major elements are exactly that range. For an n-d box it has at
    most ``2n - 1`` boxes. This is how a ZeRO/FSDP1 flat partition maps onto a tensor.
    """
    total = box.volume
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a box of {total} elements")
    if start == stop:
        return []
    if box.ndim == 0:
        return [box]
    return [b for b in _flat_boxes(box.offsets, box.lengths, start, stop) if not b.is_empty()]


def _flat_boxes(offsets: tuple[int, ...], lengths: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if len(lengths) == 1:
        return [Box((offsets[0] + start,), (stop - start,))]
    row = prod(lengths[1:])
    first_row, first_col = divmod(start, row)
    last_row, last_col = divmod(stop, row)
    inner_off = offsets[1:]
    inner_len = lengths[1:]

    def lift(r: int, inner: list[Box]) -> list[Box]:
        return [Box((offsets[0] + r,) + b.offsets, (1,) + b.lengths) for b in inner]

    if first_row == last_row:
        return lift(first_row, _flat_boxes(inner_off, inner_len, first_col, last_col))
    out: list[Box] = []
    whole_from = first_row
    if first_col:
        out += lift(first_row, _flat_boxes(inner_off, inner_len, first_col, row))
        whole_from += 1
    if last_row > whole_from:
        out.append(Box((offsets[0] + whole_from,) + inner_off, (last_row - whole_from,) + inner_len))
    if last_col:
        out += lift(last_row, _flat_boxes(inner_off, inner_len, 0, last_col))
    return out
