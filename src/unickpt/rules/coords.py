"""A rank's place in a job: tensor-, pipeline-, data- and expert-parallel degree and rank.

The four axes are independent here: the job has ``tp * pp * dp * ep`` ranks. Dense
parameters are replicated over the ``dp`` and ``ep`` axes; expert parameters are
partitioned over ``ep`` and replicated over ``dp`` (Megatron's "expert data parallel"
group is this ``dp``). ZeRO partitions over the ``dp`` axis.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import LayoutError

AXES = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True)
class Coords:
    """Parallel degrees and this rank's index on each axis (all default to a single process)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        for axis in AXES:
            n, r = getattr(self, axis), getattr(self, f"{axis}_rank")
            if not isinstance(n, int) or not isinstance(r, int) or n < 1 or not 0 <= r < n:
                raise LayoutError(f"invalid coordinates: {axis}={n!r}, {axis}_rank={r!r}")

    @property
    def world_size(self) -> int:
        """Number of ranks of the job: ``tp * pp * dp * ep``."""
        return self.tp * self.pp * self.dp * self.ep

    def degree(self, axis: str) -> int:
        """The degree of ``axis`` (``"tp"``, ``"pp"``, ``"dp"`` or ``"ep"``)."""
        return int(getattr(self, axis))

    def rank_on(self, axis: str) -> int:
        """This rank's index on ``axis``."""
        return int(getattr(self, f"{axis}_rank"))

    def rank(self, order: str = "tp-ep-dp-pp") -> int:
        """This rank's global rank when axes are laid out in ``order`` (first = fastest)."""
        r = 0
        for axis in reversed(_order(order)):
            r = r * self.degree(axis) + self.rank_on(axis)
        return r

    @staticmethod
    def from_rank(rank: int, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, order: str = "tp-ep-dp-pp") -> Coords:
        """The coordinates of global ``rank`` in a job of these degrees; ``order`` lists the
        axes from fastest- to slowest-varying (Megatron's default puts tp fastest)."""
        degrees = {"tp": tp, "pp": pp, "dp": dp, "ep": ep}
        world = tp * pp * dp * ep
        if not 0 <= rank < world:
            raise LayoutError(f"rank {rank} outside a job of {world} ranks")
        ranks = {}
        for axis in _order(order):
            rank, ranks[axis] = divmod(rank, degrees[axis])
        return Coords(tp, ranks["tp"], pp, ranks["pp"], dp, ranks["dp"], ep, ranks["ep"])

    def with_(self, **changes: int) -> Coords:
        """A copy with some fields changed."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(changes)
        return Coords(**d)

    def to_json(self) -> dict[str, int]:
        """The coordinates as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        """Short text, e.g. ``tp=4 pp=2 dp=1 ep=1``."""
        return " ".join(f"{a}={self.degree(a)}" for a in AXES)


def _order(order: str) -> list[str]:
    axes = order.split("-")
    if sorted(axes) != sorted(AXES):
        raise LayoutError(f"order {order!r} must name each of {', '.join(AXES)} once")
    return axes


def split_sizes(total: int, parts: int, split: str | list[int] | tuple[int, ...] = "chunk") -> list[int]:
    """Sizes of ``parts`` consecutive pieces of ``total`` items.

    ``"chunk"``: like ``torch.chunk`` and DTensor ``Shard`` (each ``ceil(total/parts)``,
    the last ones shorter or empty); ``"balanced"``: like ``numpy.array_split`` (sizes
    differ by at most one, the first ones larger); a list: the sizes themselves.
    """
    if parts < 1:
        raise LayoutError(f"cannot split into {parts} parts")
    if isinstance(split, (list, tuple)):
        sizes = [int(s) for s in split]
        if len(sizes) != parts or sum(sizes) != total or any(s < 0 for s in sizes):
            raise LayoutError(f"widths {sizes} do not split {total} into {parts} parts")
        return sizes
    if split == "chunk":
        full = -(-total // parts) if total else 0
        return [max(0, min(total, full * (i + 1)) - min(total, full * i)) for i in range(parts)]
    if split == "balanced":
        q, r = divmod(total, parts)
        return [q + (1 if i < r else 0) for i in range(parts)]
    raise LayoutError(f"unknown split {split!r}: use 'chunk', 'balanced' or a list of widths")


def split_range(total: int, parts: int, index: int, split: str | list[int] | tuple[int, ...] = "chunk") -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of :func:`split_sizes`."""
    sizes = split_sizes(total, parts, split)
    return sum(sizes[:index]), sizes[index]
