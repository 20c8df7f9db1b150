"""The options of the memory snapshots (:class:`SnapshotOptions`), one group checked when
built: what :class:`~unickpt.snapshot.client.Snapshotter` takes, and what
:class:`unickpt.CheckpointManager` builds from its flat ``snapshot_*`` keywords (the group
is exported as ``unickpt.SnapshotOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..engine.save_options import Checked, Spelling, at_least_one, whole
from ..errors import SnapshotError, UnickptError
from .parity import STRIPES

__all__ = ["SnapshotOptions"]


@dataclass(frozen=True)
class SnapshotOptions(Checked):
    """The in-memory snapshots: host shared memory held by a keeper process per node.

    Args:
        every: A snapshot every ``every`` steps (0: none). Flat keyword: ``snapshot_every``.
        parity: Parity blocks per group across nodes (None: 1, XOR; 0: local only;
            2 or more: Reed-Solomon).
        replicas: Full copies of each node's snapshot, its own included, on neighbour
            nodes (instead of parity). Flat keyword: ``snapshot_replicas``.
        flush_every: The keepers write every ``flush_every``-th snapshot as an ordinary
            checkpoint under the root (0: never; needs a local root).
        max_bytes: A cap on the host memory per node (None: half the shm file system).
            Flat keyword: ``snapshot_max_bytes``.
        stripes: The most nodes whose data one parity block covers (the code's ``k``;
            default 8): parity takes ``parity/k`` of the memory, and rebuilding a lost
            byte reads ``k`` bytes from ``k`` nodes. Flat keyword: ``snapshot_stripes``.

    Raises:
        SnapshotError: A value out of range, a snapshot option without ``every``, or
            ``replicas`` beside ``parity``.
    """

    KEYWORDS: ClassVar[dict[str, str]] = {"every": "snapshot_every", "replicas": "snapshot_replicas",
                                          "max_bytes": "snapshot_max_bytes", "stripes": "snapshot_stripes"}
    ERROR: ClassVar[type[UnickptError]] = SnapshotError

    every: int = 1
    parity: int | None = None
    replicas: int = 1
    flush_every: int = 0
    max_bytes: int | None = None
    stripes: int = STRIPES

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        whole(v, said, "every")
        whole(v, said, "flush_every")
        at_least_one(v, said, "stripes")
        at_least_one(v, said, "replicas")
        at_least_one(v, said, "max_bytes", optional=True)
        if v.parity is not None and (not isinstance(v.parity, int) or isinstance(v.parity, bool) or v.parity < 0):
            said.fail(f"{said.name('parity')} must be a whole number >= 0 or None, not {v.parity!r}")
        if not v.every:
            for field, value in (("parity", v.parity), ("flush_every", v.flush_every or None),
                                 ("max_bytes", v.max_bytes), ("replicas", v.replicas if v.replicas > 1 else None)):
                if value is not None:
                    said.fail(f"{said.said(field, value)} configures the memory snapshots: set {said.name('every')} too")
        if v.replicas > 1 and v.parity:
            said.fail(f"{said.said('replicas', v.replicas)} and {said.said('parity', v.parity)} exclude each other: "
                      "a node's snapshot is protected by copies on neighbours or by parity, not both")
