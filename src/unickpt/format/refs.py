"""References of an incremental checkpoint to the checkpoints that hold its unchanged bytes.

An incremental checkpoint stores only the fragments whose bytes changed since its base;
each other fragment names a data file of an earlier checkpoint (its *holder*) as
``<relative path of the holder>/<file name>``, e.g. ``../step_00000100/rank_00000.safetensors``.
The manifest's ``bases`` lists every holder with the digest of the holder's manifest and
the sizes of the files referenced in it. References are flat: a holder is always the
checkpoint that wrote the bytes, never one that references them in turn.

Pure path arithmetic and validation; no I/O (see ``engine/bases.py`` for the checks on disk).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from ..errors import ManifestError

_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}"
_BASE_PATH = re.compile(rf"^(?:\.\./)*{_NAME}(?:/{_NAME})*$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_BASE_PATH = 4096


@dataclass
class BaseRef:
    """A checkpoint holding bytes that this one references: its path relative to this
    checkpoint's directory, its manifest's digest, and the referenced files' sizes."""

    path: str
    digest: str
    files: dict[str, int] = field(default_factory=dict)


def check_base_path(path: object) -> str:
    """Refuse a base path that is not relative and normalised: ``..`` components first,
    then plain names (``../step_00000100``, ``../../run1/step_5``)."""
    if not isinstance(path, str) or len(path) > MAX_BASE_PATH or not _BASE_PATH.fullmatch(path) or any(
        ".." in part for part in path.split("/") if part != ".."
    ):
        raise ManifestError(f"malformed manifest: base path {path!r:.80} is not a relative path of '..' and plain names")
    return path


def check_digest_text(digest: object, what: str) -> str:
    """A manifest digest as the format writes it (``sha256:<64 hex>``)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ManifestError(f"malformed manifest: {what} digest {digest!r:.80} is not 'sha256:<64 hex digits>'")
    return digest


def ref_key(base: str, name: str) -> str:
    """The location of file ``name`` of holder ``base``, relative to the referencing checkpoint."""
    return f"{base}/{name}"


def split_key(key: str) -> tuple[str | None, str]:
    """``(holder path, file name)`` of a fragment's file; the holder is None for a file
    of the checkpoint itself."""
    base, sep, name = key.rpartition("/")
    return (base, name) if sep else (None, key)


def rebase(holder_from_base: str | None, base_from_target: str) -> str:
    """Path of a holder relative to the new checkpoint, from its path relative to the base
    (None: the base itself holds the bytes) and the base's path relative to the new one."""
    joined = base_from_target if holder_from_base is None else posixpath.join(base_from_target, holder_from_base)
    return check_base_path(posixpath.normpath(joined))

