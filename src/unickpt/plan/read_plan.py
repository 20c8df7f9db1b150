"""Read plans: which bytes of which stored fragments fill which parts of a target tensor.

For each target piece and each stored piece, the common global box is copied. The bytes
holding it are a run of whole rows of the stored view (one read); runs of one fragment
are merged, capped at ``max_span_bytes``, and widened to checksum-block boundaries so
every byte read is verified. Pure: the result is a list of byte spans and copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

from .box import Box, first_overlap, intersect, row_major_strides
from .piece import Piece


@dataclass(frozen=True)
class SourceFragment:
    """What the planner needs to know of a stored fragment."""

    file: str
    offset: int
    nbytes: int
    block_bytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Copy:
    """Copy ``box`` (global coordinates) from a stored piece into a target piece."""

    box: Box
    source: Piece
    target: Piece
    target_index: int


@dataclass
class Span:
    """A byte range of one fragment to read and verify: blocks ``[first_block, end_block)``."""

    fragment: int
    file: str
    first_block: int
    end_block: int
    start: int
    stop: int
    copies: list[Copy] = field(default_factory=list)


@dataclass
class ReadPlan:
    """The spans to read, the volume of the target each target piece receives, and for
    each target piece two stored pieces that overlap inside it (None: none do)."""

    spans: list[Span]
    covered: list[int]
    overlaps: list[tuple[Box, Box] | None] = field(default_factory=list)


def _split_rows(box: Box, rows: int, source: Piece | None = None, itemsize: int = 1, block_bytes: int = 0) -> list[Box]:
    """``box`` cut into runs of at most ``rows`` rows. With ``source`` (the stored piece
    holding it) the cuts fall where a checksum block of the fragment starts whenever the
    rows allow, so that two spans never both read (and check) the same block."""
    if box.ndim == 0 or box.lengths[0] <= rows:
        return [box]
    cuts = _aligned_cuts(box, rows, source, itemsize, block_bytes) if source is not None and block_bytes else None
    if cuts is None:
        cuts = list(range(rows, box.lengths[0], rows))
    out = []
    for a, b in zip([0] + cuts, cuts + [box.lengths[0]]):
        out.append(Box((box.offsets[0] + a,) + box.offsets[1:], (b - a,) + box.lengths[1:]))
    return out


def _aligned_cuts(box: Box, rows: int, source: Piece, itemsize: int, block_bytes: int) -> list[int] | None:
    """Row cuts (relative to ``box``) at the fragment's block boundaries, at most ``rows``
    apart; None when the rows never meet a block boundary that often."""
    row_bytes = row_major_strides(source.view)[0] * itemsize
    first = source.local_of(box).offsets[0]  # the box's first row in the piece's view
    base = source.flat_offset * itemsize + first * row_bytes  # its byte offset in the fragment
    g = gcd(row_bytes, block_bytes)
    period = block_bytes // g  # rows between two rows starting on a block boundary
    if base % g or period > rows:
        return None
    # the first row r >= 0 (from the box's first) with base + r * row_bytes a multiple of block_bytes
    r = (-(base // g) * pow(row_bytes // g, -1, period)) % period if period > 1 else 0
    step = (rows // period) * period
    cuts = [r] if r else []
    cuts += range(r + step, box.lengths[0], step)
    return [c for c in cuts if 0 < c < box.lengths[0]]


def plan_reads(
    targets: list[Piece],
    fragments: list[SourceFragment],
    itemsize: int,
    max_span_bytes: int = 64 << 20,
) -> ReadPlan:
    """Plan the reads that fill ``targets`` (pieces of one target tensor) from ``fragments``."""
    covered = [0] * len(targets)
    commons: list[list[Box]] = [[] for _ in targets]
    runs: dict[int, list[tuple[int, int, Copy]]] = {}
    for ti, t in enumerate(targets):
        for fi, f in enumerate(fragments):
            for s in f.pieces:
                common = intersect(t.global_box, s.global_box)
                if common is None:
                    continue
                covered[ti] += common.volume
                commons[ti].append(common)
                row_bytes = itemsize * (row_major_strides(s.view)[0] if s.view else 1)
                rows = max(1, max_span_bytes // max(1, row_bytes))
                for part in _split_rows(common, rows, s, itemsize, f.block_bytes):
                    lo, hi = s.row_span(part)
                    runs.setdefault(fi, []).append((lo * itemsize, hi * itemsize, Copy(part, s, t, ti)))
    spans: list[Span] = []
    for fi, items in runs.items():
        f = fragments[fi]
        items.sort(key=lambda x: (x[0], x[1]))
        cur: Span | None = None
        first_new = len(spans)
        for lo, hi, c in items:
            b0, b1 = lo // f.block_bytes, max(lo // f.block_bytes + 1, -(-hi // f.block_bytes))
            if cur is not None and b0 < cur.end_block and (max(b1, cur.end_block) - cur.first_block) * f.block_bytes <= max(max_span_bytes, f.block_bytes):
                cur.end_block = max(cur.end_block, b1)
            else:
                cur = Span(fi, f.file, b0, b1, 0, 0)
                spans.append(cur)
            cur.copies.append(c)
        for sp in spans[first_new:]:
            sp.start = sp.first_block * f.block_bytes
            sp.stop = min(f.nbytes, sp.end_block * f.block_bytes)
    return ReadPlan(spans, covered, [first_overlap(c) for c in commons])
