"""The base checkpoints an incremental checkpoint references, checked on disk.

A reference is only as good as its holder: the holder must still be the committed
checkpoint that was referenced (its ``manifest.json`` there, with the digest recorded in
the referencing manifest). Every reader checks this when it opens an incremental
checkpoint, so a missing or replaced base is named at once instead of surfacing as a
missing file in the middle of a load. The bytes themselves are covered by the CRC-32C
blocks copied from the holder's manifest, checked on every read.
"""

from __future__ import annotations

import os
import re
import stat

from ..errors import CorruptionError, UnickptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.refs import split_key
from ..storage.open import open_storage

_TAIL = re.compile(rb',"digest":"(sha256:[0-9a-f]{64})"\}\s*\Z')
_TAIL_BYTES = 256


def holder_dir(path: str | os.PathLike, base: str) -> str:
    """The directory of holder ``base`` (a path relative to the checkpoint at ``path``)."""
    return os.path.normpath(os.path.join(os.fspath(path), base))


def manifest_digest_on_disk(directory: str) -> str | None:
    """The digest stored at the end of ``directory``'s manifest, or None when there is no
    committed manifest (or it carries no digest)."""
    storage = open_storage(directory)
    try:
        reader = storage.reader(MANIFEST_NAME)
        tail = bytearray(min(_TAIL_BYTES, reader.size))
        reader.pread_into(reader.size - len(tail), memoryview(tail))
    except (UnickptError, OSError):
        return None
    finally:
        storage.close()
    m = _TAIL.search(bytes(tail))
    return m.group(1).decode("ascii") if m else None


def base_problems(path: str | os.PathLike, manifest: Manifest) -> list[tuple[str, str]]:
    """``(base path, what is wrong)`` for every holder of ``manifest`` (the manifest of the
    checkpoint at ``path``) that is missing or is no longer the checkpoint referenced."""
    out = []
    for base, ref in sorted(manifest.bases.items()):
        n = sum(1 for e in _entries(manifest) for f in e.fragments if f.base == base)
        where = holder_dir(path, base)
        found = manifest_digest_on_disk(where)
        if found is None:
            what = "is missing" if not os.path.isdir(where) else "is not a committed checkpoint any more (no manifest.json)"
            out.append((base, f"base checkpoint {base} ({where}) {what}: this incremental checkpoint references "
                              f"{n} fragment(s) of it"))
        elif found != ref.digest:
            out.append((base, f"base checkpoint {base} ({where}) was replaced: its manifest digest is {found[:23]}..., "
                              f"this checkpoint references {ref.digest[:23]}... ({n} fragment(s))"))
    return out


def file_problems(path: str | os.PathLike, manifest: Manifest, names: set[str]) -> list[str]:
    """What is wrong with each of ``names`` (keys of ``manifest.files``: a file of the
    checkpoint at ``path``, or ``holder/file`` of a checkpoint it references), sorted: it
    is missing, or not the size the manifest records. One stat per file, no byte read: a
    byte changed in place is left to the CRC-32C check of every read."""
    out = []
    for key in sorted(names):
        holder, name = split_key(key)
        where = os.path.join(os.fspath(path) if holder is None else holder_dir(path, holder), name)
        expected = manifest.files.get(key)
        try:
            st = os.stat(where)
        except FileNotFoundError:
            out.append(f"data file {where} is missing")
            continue
        except OSError as e:
            out.append(f"data file {where} cannot be examined ({type(e).__name__}: {e.strerror})")
            continue
        if not stat.S_ISREG(st.st_mode):
            out.append(f"data file {where} is not a regular file")
        elif expected is not None and st.st_size != expected:
            out.append(f"data file {where} has {st.st_size} bytes, its manifest records {expected}"
                       + (" (truncated)" if st.st_size < expected else ""))
    return out


def check_bases(path: str | os.PathLike, manifest: Manifest) -> None:
    """Raise :class:`~unickpt.CorruptionError` naming the first base of ``manifest`` that
    is missing or replaced (nothing to do for a self-contained checkpoint)."""
    if not manifest.bases:
        return
    problems = base_problems(path, manifest)
    if problems:
        raise CorruptionError(
            f"{path}: {problems[0][1]}; the checkpoint cannot be read without it "
            "(`unickpt convert --consolidate` makes a self-contained copy while the base exists)"
        )


def _entries(manifest: Manifest):
    yield from manifest.tensors.values()
    for row in manifest.rank_tensors.values():
        yield from (e for e in row if e is not None)
