"""What a rank tells the committing rank at the end of a save (:class:`RankReport`), and
how it travels: the binary message of ``format/rank_message.py``. The writing ranks build
reports (:mod:`unickpt.engine.commit`); the committing rank decodes the messages' heads
back into reports where it reads them (:mod:`unickpt.engine.assemble`), so that it checks
typed members, not dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import SaveError
from ..format.rank_message import FragmentRecord, decode as decode_message, encode as encode_message

__all__ = ["RankReport", "rank_message", "read_message"]


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the committing rank once its file is durable (or that it
    failed: ``error``). Travels as the binary message of ``format/rank_message.py``
    (:meth:`message`); each fragment as the JSON text the manifest stores, with what rank
    0 checks it by (a :class:`~unickpt.format.rank_message.FragmentRecord`)."""

    rank: int
    error: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # data file -> size
    fragments: list[FragmentRecord] = field(default_factory=list)
    declared: dict[str, list[Any]] = field(default_factory=dict)  # empty tensors: name -> [shape, dtype, layout]
    replicated: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    group_values: dict[str, Any] = field(default_factory=dict)
    bases: dict[str, Any] = field(default_factory=dict)  # an incremental save's referenced holders
    incremental: dict[str, Any] | None = None  # an incremental save's lineage

    @classmethod
    def failed(cls, rank: int, error: str) -> RankReport:
        """The report of a rank that failed with ``error``."""
        return cls(rank, error)

    @classmethod
    def from_head(cls, head: dict[str, Any], position: int) -> RankReport:
        """The report whose message head (decoded JSON) is ``head``, sent by the rank at
        ``position`` of the gathered messages (its rank when the head names none). The
        fragments are left out (``[]``): the committing rank checks them as the arrays
        of the decoded batch (``format.rank_message.Batch``). A member the report does not
        have, or one of the wrong kind, is a :class:`~unickpt.SaveError` naming the rank."""
        unknown = sorted(set(head) - _HEAD_MEMBERS)
        if unknown:
            raise _malformed(position, f"members {unknown} are not a report's")
        for name, kind in _KINDS.items():
            if name in head and not isinstance(head[name], kind):
                raise _malformed(position, f"its {name} is a {type(head[name]).__name__}, not a {kind.__name__}")
        rank = head.get("rank")
        return cls(**{**head, "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else position})

    def message(self) -> bytes:
        """The bytes sent to rank 0 (:func:`rank_message` of the members)."""
        return rank_message({f.name: getattr(self, f.name) for f in fields(self)})


_HEAD_MEMBERS = {f.name for f in fields(RankReport)} - {"fragments"}
_KINDS: dict[str, type] = {
    "files": dict, "declared": dict, "replicated": list, "digests": dict, "values": dict, "rank_values": dict,
    "rank_tensors": dict, "group_values": dict, "bases": dict,
}


def _malformed(rank: int, what: str) -> SaveError:
    return SaveError(f"rank {rank} sent a malformed commit message: {what}")


def rank_message(payload: dict[str, Any]) -> bytes:
    """The bytes of a report's members (``payload``: a :class:`RankReport`'s fields) in
    the binary form of ``format/rank_message.py`` (members left empty are left out)."""
    head = {k: v for k, v in payload.items() if k != "fragments" and v is not None and not (isinstance(v, (dict, list)) and not v)}
    return encode_message(head, payload.get("fragments", []))


def read_message(message: bytes) -> dict[str, Any]:
    """The members of a :func:`rank_message` (each fragment as a dict, its JSON text as bytes)."""
    return decode_message(message)
