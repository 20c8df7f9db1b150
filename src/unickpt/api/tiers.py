"""One tier of a :class:`~unickpt.CheckpointManager`: numbered checkpoints
(``step_00000100``) under a root that is a local directory or an object-store URL, with
what the manager needs of it: list the committed steps, check one, remove one, clean what
dead saves left, and copy a committed checkpoint into it.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import UnickptError, one_line
from ..format.index import INDEX_NAME
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.refs import split_key
from ..storage.local import LocalStorage, list_subdirs, remove_checkpoint
from ..storage.open import is_remote, local_path, open_storage
from ..storage.transaction import remove_abandoned
from ..engine.bases import file_problems
from ..engine.commit import checkpoint_file, claim

STEP = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    """The name of the checkpoint of ``step`` under a tier's root."""
    return f"step_{step:08d}"


class Tier:
    """Numbered checkpoints under ``root`` (a directory or a URL), keeping the newest
    ``keep`` (all when None)."""

    def __init__(self, root: str | os.PathLike, keep: int | None = None, storage_options: dict[str, Any] | None = None) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise UnickptError(f"keep must be a whole number >= 1 or None (keep all), not {keep!r}")
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise UnickptError(f"the checkpoints' root must be a directory or a URL (a str or a path), not {root!r}")
        self.remote = is_remote(root)
        self.root = str(root).rstrip("/") if self.remote else local_path(root)
        if not self.remote and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise UnickptError(f"the checkpoints' root {self.root} is a file, not a directory")
        self.keep = keep
        self.storage_options = storage_options

    def __repr__(self) -> str:
        return f"Tier({self.root!r}, keep={self.keep})"

    def path_for(self, step: int) -> str:
        """Location of the checkpoint of ``step``."""
        return f"{self.root}/{step_name(step)}" if self.remote else os.path.join(self.root, step_name(step))

    def _listing(self) -> tuple[list[int], list[str]]:
        """(committed steps sorted, names of uncommitted step prefixes); one listing of the
        store for a remote tier."""
        if not self.remote:
            committed, other = [], []
            for name in list_subdirs(self.root):
                m = STEP.match(name)
                if m:
                    if open_storage(os.path.join(self.root, name)).exists(MANIFEST_NAME):
                        committed.append(int(m.group(1)))
                    else:
                        other.append(name)
            return sorted(committed), other
        names = open_storage(self.root, self.storage_options).list_files()
        prefixes = {n.split("/", 1)[0] for n in names if "/" in n and STEP.match(n.split("/", 1)[0])}
        committed = {p for p in prefixes if f"{p}/{MANIFEST_NAME}" in names}
        return sorted(int(STEP.match(p).group(1)) for p in committed), sorted(prefixes - committed)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        return self._listing()[0]

    def uncommitted(self) -> list[str]:
        """Names of the step directories (prefixes) that hold no manifest."""
        return self._listing()[1]

    def is_valid(self, path: str, verify: bool = False) -> bool:
        """True when ``path`` is a committed checkpoint whose files are all there, whole
        (sizes; every checksum too with ``verify``)."""
        from .load import read_manifest

        try:
            manifest = read_manifest(path, self.storage_options)
            storage = open_storage(path, self.storage_options)
            if any(storage.size(f) != n for f, n in manifest.files.items()):
                return False
            if verify:
                from .verify import verify as verify_checkpoint

                return verify_checkpoint(path, storage_options=self.storage_options).ok
            return True
        except (UnickptError, OSError):  # a manifest that is a directory, an unreadable file: not valid
            return False

    def remove(self, step: int) -> None:
        """Delete the checkpoint of ``step``: its manifest first (a crash midway leaves an
        uncommitted prefix, never a committed checkpoint with missing files)."""
        path = self.path_for(step)
        if not self.remote:
            remove_checkpoint(path, MANIFEST_NAME)
            return
        storage = open_storage(path, self.storage_options)
        storage.remove(MANIFEST_NAME)
        storage.remove_many(storage.list_files())

    def apply_retention(self, pinned: set[int] = frozenset()) -> None:
        """Remove the oldest committed checkpoints beyond ``keep`` (not those ``pinned``)."""
        if self.keep is None:
            return
        for old in self.steps()[: -self.keep]:
            if old not in pinned:
                self.remove(old)

    def clean_leftovers(self, busy: set[int] = frozenset()) -> None:
        """Remove what saves that died left (their space comes back): local staging
        directories of saves no process holds; on an object store the files and unfinished
        uploads of uncommitted step prefixes, except those of steps in ``busy`` (being
        written now)."""
        if not self.remote:
            if os.path.isdir(self.root):
                remove_abandoned(self.root)
            return
        root = open_storage(self.root, self.storage_options)
        keep = {step_name(s) for s in busy}
        for name in self._listing()[1]:
            if name not in keep:
                prefix = root.child(name)
                prefix.remove_many(prefix.list_files())
        root.abort_uploads(skip=lambda key: key.split("/", 1)[0] in keep)

    def copy_in(self, src: str, step: int, threads: int = 4, src_options: dict[str, Any] | None = None) -> str:
        """Copy the committed checkpoint at ``src`` (any location) as this tier's checkpoint
        of ``step``: the data files (several at once; large ones uploaded in parts), then
        the manifest, the commit. Returns the new location."""
        dst = self.path_for(step)
        source = open_storage(src, src_options)
        doc = source.read_small(MANIFEST_NAME)
        manifest = Manifest.from_json(doc)
        write, out = claim(dst, overwrite=True, storage_options=self.storage_options)
        try:
            files = sorted(n for n in manifest.files if checkpoint_file(n))
            if source.exists(INDEX_NAME):  # an indexed manifest's fragment lines (format 2.0)
                files.append(INDEX_NAME)
            if isinstance(source, LocalStorage) and hasattr(out, "fs"):
                # the file system's own upload: multipart, several parts in flight
                def one(name: str) -> None:
                    out._call(name, "upload", lambda: out.fs.put_file(str(source.path(name)), out.full(name)))
            else:
                def one(name: str) -> None:
                    copy_file(source, out, name, source.size(name))
            with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files) or 1))) as pool:
                list(pool.map(one, files))
            write.commit({MANIFEST_NAME: doc})
        except BaseException:
            write.abort()
            raise
        finally:
            source.close()
        return dst


def copy_file(source: Any, out: Any, name: str, size: int, chunk: int = 16 << 20) -> None:
    """Copy one file between two storages, chunk by chunk."""
    writer = out.open_writer(name, size)
    try:
        reader = source.reader(name)
        buf = bytearray(min(chunk, max(size, 1)))
        for at in range(0, size, chunk):
            n = min(chunk, size - at)
            view = memoryview(buf)[:n]
            reader.pread_into(at, view)
            writer.pwrite(at, bytes(view))
    except BaseException:
        writer.close(durable=False)
        raise
    writer.close(durable=True)


def describe_root(root: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The ``step_*`` checkpoints under a manager's ``root``, oldest first, committed or
    not: ``name``, ``step``, ``committed`` (its manifest is there), ``whole`` (every file
    the manifest lists is there at its size, those of the base checkpoints an incremental
    checkpoint references too, and each base is still the checkpoint referenced; None when
    not committed), ``files``, ``bytes`` (of its own files present) and ``problem`` (why
    it is not whole or not committed, else None). Sizes only: ``unickpt verify``
    re-checks every checksum."""
    from .load import read_manifest

    tier = Tier(root, storage_options=storage_options)
    committed, other = tier._listing()
    rows = [(s, step_name(s), True) for s in committed] + [(int(STEP.match(n).group(1)), n, False) for n in other]
    out = []
    for step, name, done in sorted(rows):
        storage = open_storage(tier.path_for(step), storage_options)
        sizes = {n: storage.size(n) for n in storage.names() if checkpoint_file(n)}
        row = {"name": name, "step": step, "committed": done, "whole": None, "files": len(sizes),
               "bytes": sum(sizes.values()), "problem": None if done else "not committed (a save in progress, or killed)"}
        if done:
            try:
                manifest = read_manifest(tier.path_for(step), storage_options)  # its bases too: there, not replaced
                row["whole"], row["problem"] = _whole(tier.path_for(step), manifest, sizes)
            except (UnickptError, OSError) as e:
                row["whole"], row["problem"] = False, one_line(e)
        out.append(row)
    return out


def _whole(path: str, manifest: Manifest, sizes: dict[str, int]) -> tuple[bool, str | None]:
    """(whole, why not) of the committed checkpoint at ``path``: its own files against
    ``sizes`` (those listed there), and the files of the checkpoints it references
    (``holder/file`` keys of an incremental checkpoint, local only) each stat-ed."""
    own = {f: n for f, n in manifest.files.items() if split_key(f)[0] is None}
    bad = [f"{f}: {sizes.get(f, 0)} of {n} bytes" if f in sizes else f"{f} missing"
           for f, n in own.items() if sizes.get(f) != n]
    bad += file_problems(path, manifest, set(manifest.files) - set(own))
    return not bad, "; ".join(bad) or None
