"""The end of a checkpoint write, taken once: its commit, refused once the write was
abandoned, or its abort, which does nothing once the write committed (or was aborted).
Both hold one reentrant lock, so that a commit and an abort from another thread (live
recovery abandoning a save) run one after the other, and a failed commit may abort."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import SaveError


class WriteEnd:
    """Whether a write at ``where`` (for messages) has ended, and the lock its ends share."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.ended = False
        self._lock = threading.RLock()

    @contextmanager
    def commit(self) -> Iterator[None]:
        """Around a commit: a SaveError when the write ended already; ended once the body
        returns (a body that raises leaves it as it was)."""
        with self._lock:
            if self.ended:
                raise SaveError(f"cannot commit {self.where}: the save was abandoned")
            yield
            self.ended = True

    @contextmanager
    def abort(self) -> Iterator[bool]:
        """Around an abort's clean-up: the write is ended from here on; yields True when this
        call ended it (clean up), False when it had ended already (leave everything)."""
        with self._lock:
            first = not self.ended
            self.ended = True
            yield first
