"""What rank 0 tells every rank of a collective save at its two decisions, the claim of
the location (:mod:`unickpt.engine.targets`) and the commit (:mod:`unickpt.engine.commit`):
ok, with what the ranks need, or the error every rank then raises. The error crosses the
ranks as itself, its class among unickpt's errors and what it carries (a
:class:`~unickpt.SaveError`'s failed ranks, a :class:`~unickpt.CheckpointExistsError`'s
location), so that every rank can catch the same type.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import errors
from ..dist import Group, broadcast_bytes
from ..errors import CheckpointExistsError, SaveError, UnickptError

__all__ = ["Outcome", "decided_by_rank0"]

# the errors an outcome may carry to every rank: unickpt's own, by name
_ERRORS: dict[str, type[UnickptError]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, UnickptError)
}


@dataclass(frozen=True)
class Outcome:
    """Rank 0's decision, as every rank receives it: ``payload`` (what the ranks need: the
    manifest committed, where to write; None: nothing), or the error (the name of its
    class among unickpt's errors, its message, a SaveError's map of failed ranks, a
    CheckpointExistsError's location)."""

    payload: bytes | None = None
    error: str | None = None
    message: str = ""
    failures: dict[int, str] = field(default_factory=dict)
    location: str | None = None

    @classmethod
    def of(cls, e: Exception, wrap: type[UnickptError] = SaveError) -> Outcome:
        """The outcome of a step that failed on rank 0 with ``e`` (anything not unickpt's
        own: a ``wrap`` naming it, a SaveError by default)."""
        if isinstance(e, UnickptError):
            return cls(error=type(e).__name__, message=str(e), failures=getattr(e, "failures", {}),
                       location=getattr(e, "location", None))
        text = f"{type(e).__name__}: {e}"
        return cls(error=wrap.__name__, message=text, failures={0: text} if issubclass(wrap, SaveError) else {})

    def encode(self) -> bytes:
        """The bytes rank 0 broadcasts."""
        if self.error is None:
            return b"ok" if self.payload is None else b"ok\n" + self.payload
        failures = {str(r): text for r, text in self.failures.items()}
        return b"error\n" + json.dumps({"error": self.error, "message": self.message, "failures": failures,
                                        "location": self.location}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Outcome:
        """The outcome rank 0 broadcast (bytes of this job's own rank 0: a malformed one is
        a SaveError saying so)."""
        if data == b"ok":
            return cls()
        kind, _, rest = data.partition(b"\n")
        if kind == b"ok":
            return cls(payload=rest)
        try:
            doc = json.loads(rest)
            return cls(None, str(doc["error"]), str(doc["message"]), {int(r): str(t) for r, t in doc["failures"].items()},
                       doc.get("location"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(error="SaveError", message=f"rank 0's outcome is unreadable: {data[:200]!r}")

    def shared(self, group: Group) -> Outcome:
        """Collective: rank 0's outcome (this one on rank 0; the others' is not sent) as
        every rank receives it; its error raised on every rank, if it carries one."""
        outcome = Outcome.decode(broadcast_bytes(group, self.encode() if group.rank == 0 else b"", 0))
        outcome.raise_error()
        return outcome

    def raise_error(self) -> None:
        """Raise the error this outcome carries, if any."""
        if self.error is None:
            return
        cls = _ERRORS.get(self.error, SaveError)
        if issubclass(cls, CheckpointExistsError):
            if self.location is not None:
                raise cls(self.location)
            cls = SaveError
        if issubclass(cls, SaveError):
            raise cls(self.message, self.failures)
        raise cls(self.message)


def decided_by_rank0(group: Group, decide: Callable[[], bytes], wrap: type[UnickptError] = UnickptError) -> bytes:
    """Collective: what ``decide()`` returns on rank 0, on every rank. Its error is raised
    on every rank as itself (anything not unickpt's own: a ``wrap`` naming it), so that no
    rank is left waiting for the answer (a listing of an object store, a directory rank 0
    may not read)."""
    outcome, cause = Outcome(), None
    if group.rank == 0:
        try:
            outcome = Outcome(payload=decide())
        except Exception as e:
            outcome, cause = Outcome.of(e, wrap), e
    try:
        return outcome.shared(group).payload or b""
    except UnickptError as raised:
        if cause is None or raised is cause:
            raise
        raise raised from cause  # rank 0 keeps the traceback of what failed
