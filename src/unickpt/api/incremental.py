"""Incremental saves: write only the fragments whose bytes changed since a base checkpoint.

Identity: each fragment's xxh3-128 identity (``format.checksum.identity``), which every
save records as it writes (same pass as the CRC-32C). An incremental save hashes the
fragments it is about to write (about 16 GB/s per core: a hash in memory is far cheaper
than reading the base's bytes back to compare them) and compares each with the base's
fragment of the same tensor, pieces, shape, dtype and block size. Equal: the new manifest
references the bytes where they lie (the base's file, or the file of the checkpoint the
base references in turn: references are flattened, so a chain never has to be followed
to read). The unit is a fragment (one tensor's shard on one rank): a tensor is written
whole or not at all. Opening the base checks that every file it may reference is there
with the size its manifest records (one stat each, no byte read; a byte changed in place
is caught by the CRC-32C checked on every read of the new checkpoint).

Retention (:func:`prune`) deletes a checkpoint only when no kept checkpoint references it,
newest first, each one manifest first: a kill at any point leaves every committed
checkpoint whole (references only point to older checkpoints, and those go last).
"""

from __future__ import annotations

import os
import posixpath
import signal

from ..adapters.detect import open_manifest
from ..engine.bases import file_problems, holder_dir, manifest_digest_on_disk
from ..engine.unchanged import BaseIndex, fragment_key
from ..errors import SaveError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.refs import check_base_path, rebase, split_key
from ..storage.local import remove_checkpoint
from ..storage.open import is_remote

# Test hook: SIGKILL this process right after the N-th file removal of a prune (tests kill
# retention at every step with it). Read at each removal; unset in normal use.
KILL_AFTER_UNLINK_ENV = "UNICKPT_TEST_KILL_AFTER_UNLINK"


def relative_base(base: str | os.PathLike, target: str | os.PathLike) -> str:
    """``base`` as a path relative to the checkpoint directory ``target`` (``/``-separated)."""
    rel = os.path.relpath(os.path.abspath(base), os.path.abspath(target)).replace(os.sep, "/")
    try:
        return check_base_path(rel)
    except UnickptError:
        raise SaveError(f"base {base} cannot be referenced from {target} (relative path {rel!r})") from None


def open_base(base: str | os.PathLike, target: str | os.PathLike) -> BaseIndex:
    """Open the base of an incremental save to ``target``: a committed unickpt checkpoint
    whose own bases are all there. SaveError when it cannot serve as one."""
    if is_remote(base) or is_remote(target):
        raise SaveError(f"base={base}: incremental saves need local paths (references between checkpoints "
                        "are relative paths; an object store holds whole checkpoints only)")
    try:
        manifest = open_manifest(os.fspath(base))
    except UnickptError as e:
        raise SaveError(f"base {base} cannot serve for an incremental save: {e}") from None
    if manifest.provenance.get("format", "unickpt") != "unickpt" or manifest.digest is None:
        raise SaveError(f"base {base} is not a unickpt checkpoint of format 1.1 or later; save a full checkpoint first")
    rel = relative_base(base, target)
    index = BaseIndex(rel, manifest)
    target_abs = os.path.abspath(target)
    for holder_from_base in [None, *manifest.bases]:
        try:
            holder = rebase(holder_from_base, rel)
        except UnickptError:
            holder = "."
        if os.path.abspath(holder_dir(target_abs, holder)) == target_abs:
            raise SaveError(f"cannot save to {target} incrementally: its base {base} references the checkpoint there")
    for entry in manifest.tensors.values():
        for f in entry.fragments:
            if f.xxh3 is not None:
                index.fragments[fragment_key(entry.name, f.pieces, f.shape, entry.dtype, f.block_bytes, None)] = f
    for name, row in manifest.rank_tensors.items():
        for r, entry in enumerate(row):
            if entry is not None and len(entry.fragments) == 1 and entry.fragments[0].xxh3 is not None:
                f = entry.fragments[0]
                index.fragments[fragment_key(name, f.pieces, f.shape, entry.dtype, f.block_bytes, r)] = f
    _check_base_files(os.fspath(base), index)
    return index


def _check_base_files(base: str, index: BaseIndex) -> None:
    """SaveError naming the first file that ``index`` may reference (the base's own, or
    those of the checkpoints it references in turn) and that is missing or not the size
    the base's manifest records: an unchanged fragment is referenced, not written, so the
    new checkpoint would commit without bytes it needs. Called on every rank as it opens
    the base: a failure is that rank's, and the commit fails the save on every rank."""
    problems = file_problems(base, index.manifest, {f.file for f in index.fragments.values()})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SaveError(f"base {base} cannot serve for an incremental save: {problems[0]}{more}; its unchanged "
                        "fragments would be referenced there, not written (save without base=, or pick another base)")


# ---------------------------------------------------------------- retention


def holders_of(path: str) -> set[str]:
    """Absolute directories of the checkpoints whose bytes the checkpoint at ``path`` references."""
    manifest = open_manifest(path, bases=False)
    return {os.path.abspath(holder_dir(path, b)) for b in manifest.bases}


def _kill_hook():
    """The test hook of :data:`KILL_AFTER_UNLINK_ENV`: a callback counting removals that
    SIGKILLs this process after the N-th; None when the variable is unset."""
    kill_at = int(os.environ.get(KILL_AFTER_UNLINK_ENV) or 0)
    if not kill_at:
        return None
    count = [0]

    def after_unlink() -> None:
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return after_unlink


def prune(committed: list[str], keep: int, candidates_without_manifest: list[str] = ()) -> list[str]:
    """Retention: of the committed checkpoints (paths, oldest first), keep the newest
    ``keep`` and every checkpoint one of those references; delete the rest, newest first,
    and the directories in ``candidates_without_manifest`` (deletions a kill interrupted)
    that nothing kept references. Returns the paths deleted.

    While a kept checkpoint's manifest cannot be read (what it references is unknown), no
    committed checkpoint is deleted.

    Order matters for a kill at any point: references point only to older checkpoints,
    so deleting newest first never leaves a committed checkpoint whose holder is gone,
    and a checkpoint loses its manifest before any of its files."""
    kept = committed[-keep:] if keep else list(committed)
    needed = {os.path.abspath(p) for p in kept}
    unknown = False
    for p in kept:
        try:
            needed |= holders_of(p)
        except UnickptError:
            unknown = True  # what it references is unknown: delete no committed checkpoint
    doomed = [] if unknown else [p for p in reversed(committed) if os.path.abspath(p) not in needed]
    doomed += [p for p in candidates_without_manifest if os.path.abspath(p) not in needed]
    hook = _kill_hook()
    for p in doomed:
        remove_checkpoint(p, MANIFEST_NAME, hook)
    return doomed


def stored_bytes(manifest: Manifest) -> tuple[int, int]:
    """``(bytes written in the checkpoint's own files, bytes referenced in its bases)``."""
    own = sum(n for k, n in manifest.files.items() if split_key(k)[0] is None)
    referenced = 0
    for entry in list(manifest.tensors.values()) + [e for row in manifest.rank_tensors.values() for e in row if e is not None]:
        referenced += sum(f.nbytes(entry.dtype) for f in entry.fragments if f.base is not None)
    return own, referenced


def chain(path: str, limit: int = 1000) -> list[tuple[str, str]]:
    """The bases the checkpoint at ``path`` was saved against, nearest first, as
    ``(path relative to it, state)`` with state ``"ok"``, ``"missing"`` or ``"replaced"``;
    it stops at a full checkpoint or a base that is gone."""
    out: list[tuple[str, str]] = []
    here = os.path.abspath(path)
    manifest = open_manifest(path, bases=False)
    rel = ""
    while manifest.incremental is not None and len(out) < limit:
        inc = manifest.incremental
        rel = posixpath.normpath(posixpath.join(rel, inc["base"])) if rel else inc["base"]
        here = holder_dir(here, inc["base"])
        found = manifest_digest_on_disk(here)
        if found is None or found != inc["digest"]:
            out.append((rel, "missing" if found is None else "replaced"))
            break
        out.append((rel, "ok"))
        manifest = open_manifest(here, bases=False)
    return out
