"""Incremental saves: write only the fragments whose bytes changed since a base checkpoint.

Identity: each fragment's xxh3-128 identity (``format.checksum.identity``), which every
save records as it writes (same pass as the CRC-32C). An incremental save hashes the
fragments it is about to write (about 16 GB/s per core: a hash in memory is far cheaper
than reading the base's bytes back to compare them) and compares each with the base's
fragment of the same tensor, pieces, shape, dtype and block size. Equal: the new manifest
references the bytes where they lie (the base's file, or the file of the checkpoint the
base references in turn: references are flattened, so a chain never has to be followed
to read). The unit is a fragment (one tensor's shard on one rank): a tensor is written
whole or not at all.

Retention (:func:`prune`) deletes a checkpoint only when no kept checkpoint references it,
newest first, each one manifest first: a kill at any point leaves every committed
checkpoint whole (references only point to older checkpoints, and those go last).
"""

from __future__ import annotations

import os
import posixpath
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..storage.open import is_remote
from ..adapters.detect import open_manifest
from ..engine.bases import holder_dir, manifest_digest_on_disk
from ..engine.items import TensorItem
from ..engine.writer import as_bytes
from ..errors import SaveError, UnickptError
from ..format.checksum import block_digests, block_digests_and_crc, identity
from ..format.dtypes import dtype_name
from ..format.manifest import MANIFEST_NAME, Fragment, Manifest
from ..format.refs import BaseRef, check_base_path, rebase, ref_key, split_key
from ..storage.local import remove_checkpoint

# Test hook: SIGKILL this process right after the N-th file removal of a prune (tests kill
# retention at every step with it). Read at each removal; unset in normal use.
KILL_AFTER_UNLINK_ENV = "UNICKPT_TEST_KILL_AFTER_UNLINK"


def _key(name: str, pieces: list, shape: tuple, dtype: str, block_bytes: int, rank: int | None) -> tuple:
    """What must be equal for a fragment to stand for another (besides its bytes); ``rank``
    only for per-rank tensors."""
    return (name, tuple(pieces), tuple(shape), dtype, block_bytes, rank)


@dataclass
class BaseIndex:
    """What an incremental save needs of its base: the identities of its fragments and
    where their bytes lie, seen from the new checkpoint."""

    path: str  # the base, relative to the new checkpoint
    manifest: Manifest
    fragments: dict[tuple, Fragment] = field(default_factory=dict)  # by _key
    holders: dict[str, BaseRef] = field(default_factory=dict)  # holder path -> digest, referenced files

    def lineage(self) -> dict[str, Any]:
        """The ``incremental`` member of the new manifest."""
        depth = (self.manifest.incremental or {}).get("depth", 0) + 1
        return {"base": self.path, "digest": self.manifest.digest, "depth": depth}


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
                index.fragments[_key(entry.name, f.pieces, f.shape, entry.dtype, f.block_bytes, None)] = f
    for name, row in manifest.rank_tensors.items():
        for r, entry in enumerate(row):
            if entry is not None and len(entry.fragments) == 1 and entry.fragments[0].xxh3 is not None:
                f = entry.fragments[0]
                index.fragments[_key(name, f.pieces, f.shape, entry.dtype, f.block_bytes, r)] = f
    return index


def _reference(index: BaseIndex, item: TensorItem, found: Fragment, rank: int) -> Fragment:
    """The new checkpoint's fragment for ``item``, referencing the bytes of ``found``."""
    holder_from_base, name = split_key(found.file)
    holder = rebase(holder_from_base, index.path)
    digest = index.manifest.digest if holder_from_base is None else index.manifest.bases[holder_from_base].digest
    ref = index.holders.setdefault(holder, BaseRef(holder, digest or "", {}))
    ref.files[name] = index.manifest.files[found.file]
    return Fragment(ref_key(holder, name), found.offset, tuple(found.shape), list(item.pieces), list(found.crc32c),
                    found.block_bytes, rank, found.xxh3)


def split_unchanged(
    index: BaseIndex, items: list[TensorItem], rank: int, block_bytes: int, threads: int = 4,
    data: Callable[[int], memoryview | None] | None = None, crcs: dict[int, int] | None = None,
) -> tuple[list[int], list[tuple[int, Fragment]]]:
    """Which of ``items`` to write: ``(indices of changed items, [(index, referencing
    fragment)] for the unchanged)``. Hashes the candidates on ``threads`` threads, reading
    item ``k``'s bytes from ``data(k)`` (default: ``items[k].local``, staged; None: write it).
    ``crcs``, when given, receives for each item index it holds (as a key) and that is
    hashed the CRC-32C of the item's whole data, computed in the same pass (the agreement
    digest of a replicated tensor)."""
    candidates = []
    for k, item in enumerate(items):
        per_rank = rank if item.layout == "per-rank" else None
        hit = index.fragments.get(_key(item.name, item.pieces, item.local.shape, dtype_name(item.local.dtype), block_bytes, per_rank))
        if hit is not None:
            candidates.append((k, hit))

    def same(c: tuple[int, Fragment]) -> bool:
        k, f = c
        view = as_bytes(items[k].local) if data is None else data(k)
        if view is None:
            return False
        if crcs is None or k not in crcs:
            return identity(block_digests(view, block_bytes)) == f.xxh3
        digests, crc = block_digests_and_crc(view, block_bytes)
        crcs[k] = crc
        return identity(digests) == f.xxh3

    if len(candidates) > 1 and threads > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            verdicts = list(pool.map(same, candidates))
    else:
        verdicts = [same(c) for c in candidates]
    refs = [(k, _reference(index, items[k], f, rank)) for (k, f), ok in zip(candidates, verdicts) if ok]
    unchanged = {k for k, _ in refs}
    return [k for k in range(len(items)) if k not in unchanged], refs


def holders_json(index: BaseIndex | None) -> dict[str, Any]:
    """The holders a rank references, for its report to rank 0."""
    if index is None:
        return {}
    return {p: {"digest": b.digest, "files": b.files} for p, b in index.holders.items()}


def merge_holders(manifest: Manifest, reports: list[dict[str, Any]]) -> None:
    """Add the holders every rank referenced to the manifest being assembled."""
    for rep in reports:
        for p, d in rep.items():
            ref = manifest.bases.setdefault(p, BaseRef(p, d["digest"], {}))
            ref.files.update(d["files"])
            manifest.files.update({ref_key(p, n): size for n, size in d["files"].items()})


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
