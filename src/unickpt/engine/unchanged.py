"""The fragments of an incremental save that need not be written: those whose bytes equal
the base's (same xxh3-128 identity), found by :func:`split_unchanged` against a
:class:`BaseIndex` (opened by :func:`unickpt.api.incremental.open_base`) and referenced
where their bytes lie. See :mod:`unickpt.api.incremental` for the whole scheme."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..format.checksum import block_digests, block_digests_and_crc, identity
from ..format.dtypes import dtype_name
from ..format.manifest import Fragment, Manifest
from ..format.refs import BaseRef, rebase, ref_key, split_key
from .items import TensorItem
from .writer import as_bytes

__all__ = ["BaseIndex", "fragment_key", "split_unchanged"]

def fragment_key(name: str, pieces: list, shape: tuple, dtype: str, block_bytes: int, rank: int | None) -> tuple:
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
        hit = index.fragments.get(fragment_key(item.name, item.pieces, item.local.shape, dtype_name(item.local.dtype), block_bytes, per_rank))
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

