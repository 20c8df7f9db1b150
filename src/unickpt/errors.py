"""Exceptions raised by unickpt. All derive from ``UnickptError`` (an ``Exception``)."""

from __future__ import annotations

import errno
from collections.abc import Mapping

__all__ = [
    "UnickptError", "NotACheckpointError", "FormatVersionError", "ManifestError", "CorruptionError", "LayoutError",
    "MismatchError", "InconsistentStateError", "SaveError", "CheckpointExistsError", "UnsafePickleError", "SnapshotError",
    "StorageError",
]


class UnickptError(Exception):
    """Base class of every error unickpt raises on purpose."""


class NotACheckpointError(UnickptError):
    """The path holds no committed checkpoint (no manifest)."""


class FormatVersionError(UnickptError):
    """The checkpoint was written by a newer, incompatible format version."""


class ManifestError(UnickptError):
    """The manifest is malformed or unsafe (for example a path escaping the checkpoint)."""


class CorruptionError(UnickptError):
    """Stored bytes do not match their checksum, or a file is truncated or missing."""


class LayoutError(UnickptError):
    """A tensor's layout cannot be expressed, or saved and target layouts do not fit."""


class MismatchError(UnickptError):
    """Saved and target state disagree (missing key, shape or dtype mismatch)."""


class InconsistentStateError(UnickptError):
    """Ranks hold different values for state that must be identical on every rank."""


class SaveError(UnickptError):
    """Saving failed on at least one rank; the message names the ranks and causes.

    Args:
        message: What failed (the ranks and causes, the file, the remedy).
        failures: Each rank that failed and its cause.

    Attributes:
        failures: Each rank that failed, mapped to its cause as that rank reported it (the
            same map on every rank); empty when the save failed as a whole (its
            arguments, the claim on its location).
        ranks: The failed ranks, in order.
    """

    def __init__(self, message: str = "", failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed, in order."""
        return sorted(self.failures)

    def __reduce__(self):  # pickled across processes (multiprocessing, DCP) with its map
        return type(self), (str(self), self.failures)


class CheckpointExistsError(SaveError):
    """The save's location already holds a committed checkpoint and ``overwrite`` was not
    given: nothing was written. Raised on every rank of a collective save (rank 0's claim
    of the location sends it to the others as itself, with its location).

    Args:
        location: The directory or URL of the save.

    Attributes:
        location: The directory or URL, as a string.
    """

    def __init__(self, location: object) -> None:
        super().__init__(f"{location} already holds a committed checkpoint; pass overwrite=True to replace it")
        self.location = str(location)

    def __reduce__(self):
        return type(self), (self.location,)


class UnsafePickleError(UnickptError):
    """A foreign checkpoint's pickle names a class or function that is not allowed: it was
    refused, never run."""


class SnapshotError(UnickptError):
    """The in-memory snapshot tier cannot do what was asked (host memory cap, keeper
    start-up, an unsupported parity), or a snapshot cannot be rebuilt or verified."""


class StorageError(UnickptError):
    """A checkpoint location that cannot be opened: an unsupported URL scheme, a storage
    service that refuses or goes away."""


def os_error_text(e: OSError) -> str:
    """An OSError's message with its symbolic code (``No space left on device (ENOSPC)``)."""
    code = errno.errorcode.get(e.errno or 0)
    text = e.strerror or str(e)
    return f"{text} ({code})" if code else text


def one_line(e: BaseException) -> str:
    """An error's message on one line (a SaveError's ``save failed, nothing was committed:``
    followed by each failing rank's cause, joined), for a warning or a table cell."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())
