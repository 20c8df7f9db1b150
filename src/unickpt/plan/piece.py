"""Pieces: "this region of my local data is that box of the global tensor".

A fragment is the contiguous row-major data one rank stores for one global tensor.
A piece addresses a region of it in the most general form the field needs:

    region = flat_data[flat_offset : flat_offset + prod(view)].view(view)[local_box]

and says that region equals ``global_box`` of the global tensor. Two common cases:

* box-in-box (DTensor shards, Megatron TP slices, fused sub-parameters):
  ``flat_offset = 0``, ``view`` = the fragment's shape, ``local_offsets`` = where the
  box sits in it;
* flat (ZeRO / FSDP1 partitions): ``view`` = the global box's lengths,
  ``local_offsets`` = zeros, ``flat_offset`` = where the run starts in the flat data.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from math import prod

from .box import Box, flat_range_to_boxes, intersect, row_major_strides


@dataclass(frozen=True, slots=True)
class Piece:
    """One region of a fragment's data and the global box it holds."""

    global_box: Box
    local_offsets: tuple[int, ...]
    view: tuple[int, ...]
    flat_offset: int = 0

    def __post_init__(self) -> None:
        if len(self.local_offsets) != self.global_box.ndim or len(self.view) != self.global_box.ndim:
            raise ValueError(f"piece rank mismatch: {self}")
        if not Box.whole(self.view).contains(self.local_box):
            raise ValueError(f"piece local box {self.local_box} outside its view {self.view}")

    @property
    def local_box(self) -> Box:
        """The region inside ``view``, in view coordinates."""
        return Box(self.local_offsets, self.global_box.lengths)

    @property
    def flat_extent(self) -> tuple[int, int]:
        """Element range ``[start, stop)`` of the fragment's flat data this piece's view spans."""
        return self.flat_offset, self.flat_offset + prod(self.view)

    def local_of(self, sub: Box) -> Box:
        """Map a sub-box of ``global_box`` (global coordinates) into view coordinates."""
        if self.local_offsets == self.global_box.offsets:
            return sub
        return sub.shift(tuple(map(operator.sub, self.local_offsets, self.global_box.offsets)))

    def row_span(self, sub: Box) -> tuple[int, int]:
        """The contiguous element range of flat data that holds ``sub`` (a sub-box of
        ``global_box``): whole rows of the view's first dimension, so one read suffices."""
        local = self.local_of(sub)
        if local.ndim == 0:
            return self.flat_offset, self.flat_offset + 1
        row = row_major_strides(self.view)[0]
        return (
            self.flat_offset + local.offsets[0] * row,
            self.flat_offset + (local.offsets[0] + local.lengths[0]) * row,
        )


def box_piece(local_shape: tuple[int, ...], local_box: Box, global_box: Box) -> Piece:
    """A box-in-box piece: ``local_box`` of a fragment of ``local_shape`` is ``global_box``."""
    if local_box.lengths != global_box.lengths:
        raise ValueError(f"local box {local_box} and global box {global_box} differ in size")
    return Piece(global_box, local_box.offsets, tuple(local_shape), 0)


def whole_piece(shape: tuple[int, ...]) -> Piece:
    """The single piece of an unsharded tensor: all of it."""
    return _whole_piece(tuple(int(n) for n in shape))


@functools.lru_cache(maxsize=4096)
def _whole_piece(shape: tuple[int, ...]) -> Piece:
    box = Box.whole(shape)
    return Piece(box, box.offsets, shape, 0)  # pieces are immutable: one per shape is shared


def flat_pieces(global_box: Box, start: int, stop: int, local_flat_offset: int = 0) -> list[Piece]:
    """Pieces for a flat partition: elements ``[start, stop)`` of ``global_box`` in row-major
    order, stored contiguously in the fragment from element ``local_flat_offset`` on."""
    pieces = []
    at = local_flat_offset
    for b in flat_range_to_boxes(global_box, start, stop):
        pieces.append(Piece(b, tuple(0 for _ in b.lengths), b.lengths, at))
        at += b.volume
    return pieces


def overlap(a: Piece, b: Piece) -> Box | None:
    """The global box two pieces have in common, or None."""
    return intersect(a.global_box, b.global_box)
