"""An output folder of another tool's format (a Hugging Face export, a DCP checkpoint),
written so that a failure or a crash never costs the folder it replaces.

On a local file system the data files are written into a hidden staging directory inside
the folder (``.unickpt-<random>``), under the folder's exclusive lock (one writer at a
time), and the commit renames them in: the old commit document (the index, DCP's
``.metadata``) is removed durably first, the new files are renamed over the old names,
the new commit document last, then the old files the new output does not replace are
removed (:class:`~unickpt.storage.transaction.DirectoryWrite` in place). Until the
commit the old output is untouched; a crash leaves it whole plus a hidden directory the
next write removes. Files the user keeps in the folder (a tokenizer, a README) are never
moved: that is why the staging directory is inside, not beside, the folder.

On an object store, where nothing can be renamed atomically, the old commit document and
the old data files are removed first (the prefix never looks complete with a mix of old
and new files) and the commit writes the documents last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Storage
from .open import is_remote, open_storage
from .transaction import DirectoryWrite


class OutputFolder:
    """Where one output's data files go (``storage``) and how it is committed."""

    storage: Storage

    def commit(self, documents: dict[str, bytes]) -> None:
        """Write ``documents`` (small files, the commit document last) and make the
        output whole, durably."""
        raise NotImplementedError

    def abort(self) -> None:
        """Give up: remove what this write made; the old output stays as it was."""
        raise NotImplementedError


class _LocalOutput(OutputFolder):
    def __init__(self, write: DirectoryWrite) -> None:
        self._write = write
        try:
            self.storage = open_storage(str(write.staging))
        except BaseException:
            write.abort()
            raise

    def commit(self, documents: dict[str, bytes]) -> None:
        self._write.commit(documents)

    def abort(self) -> None:
        self._write.abort()


class _RemoteOutput(OutputFolder):
    def __init__(self, storage: Storage, commit_name: str, owned: Callable[[str], bool]) -> None:
        self.storage = storage
        storage.prepare()
        old = [n for n in storage.list_files() if owned(n)]
        storage.remove(commit_name)  # first: the prefix never looks complete with old and new files
        for name in old:
            if name != commit_name:
                storage.remove(name)

    def commit(self, documents: dict[str, bytes]) -> None:
        for name, data in documents.items():
            self.storage.write_atomic(name, data)

    def abort(self) -> None:
        pass  # the writer removes its partial data file; without the commit document nothing looks whole


def begin_output(dst: str, commit_name: str, owned: Callable[[str], bool],
                 storage_options: dict[str, Any] | None = None) -> OutputFolder:
    """Start writing an output folder at ``dst`` whose commit document is ``commit_name``;
    ``owned(name)`` says which names of an old output at ``dst`` the new one replaces (the
    caller has already checked that replacing it is allowed). Raises
    :class:`~unickpt.SaveError` when another write holds the folder."""
    if is_remote(dst):
        return _RemoteOutput(open_storage(dst, storage_options), commit_name, owned)
    return _LocalOutput(DirectoryWrite.begin(dst, commit_name, True, owned, in_place=True))
