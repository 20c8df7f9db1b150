"""One writer of a checkpoint directory at a time, and a commit that swaps it in whole.

A save (or a consolidation) never writes into the directory it replaces. It claims the
directory with an exclusive lock (``flock`` on ``.unickpt.lock`` inside it: released by
the kernel when the process dies, so a crashed save never leaves a stale lock), writes
every file into a fresh staging directory beside it (``.<name>.unickpt-<random>``), and
commits by exchanging the two directories in one atomic ``renameat2(RENAME_EXCHANGE)``
after every byte is durable. A crash at any moment leaves the directory holding either
the old checkpoint or the new one, both whole; leftovers are hidden staging directories
that the next save to the same path removes. A failed save removes its staging
directory, so the space it took is free again.

Where the exchange is impossible (the directory is a mount point, or the file system
has no ``RENAME_EXCHANGE``, as NFS), the staging directory is made inside the target
and its files are renamed in: the old manifest is removed (durably) first, then the
data files are renamed over the old ones, the new manifest last. A crash during that
short sequence leaves the directory uncommitted (never committed with mixed files).

Every file is created under a fresh name (``O_EXCL``), and renames replace a name,
never follow it: a symbolic link planted in the directory is replaced, never written
through.

:meth:`DirectoryWrite.swap_in` commits an in-place staging directory whose entries are
directories too (DeepSpeed's universal ``zero/`` tree): a directory that replaces an old
one is exchanged with it in one ``RENAME_EXCHANGE``; where the file system refuses, the
old one is first renamed aside into the staging directory (``.aside/<name>``), and the
next write of the directory puts it back if a crash came before the new one was in.
Setting ``UNICKPT_NO_RENAME_EXCHANGE=1`` takes that fallback everywhere (for tests, and
for file systems that claim the exchange but do it wrong).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointExistsError, SaveError
from .local import fsync_path, libc_function
from .write_end import WriteEnd

LOCK_NAME = ".unickpt.lock"
_STAGING_TAG = ".unickpt-"
_ASIDE = ".aside"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EBUSY, errno.ENOTSUP}


_renameat2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (both must exist). False when the file
    system or platform cannot (then nothing changed)."""
    if _renameat2 is None or os.environ.get("UNICKPT_NO_RENAME_EXCHANGE") == "1":
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


def create_new(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to a file that must not exist yet (a planted link is never followed),
    and make it durable unless told not to."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An exclusive ``flock`` on ``path`` (created if needed), or None when another
    process holds it. Retries when the file was replaced or removed while locking."""
    for _ in range(50):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a planted symbolic link: replace it
                os.unlink(path)
                continue
            if e.errno == errno.ENOENT:  # the directory was removed meanwhile
                path.parent.mkdir(parents=True, exist_ok=True)
                continue
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            now = os.stat(path, follow_symlinks=False)
            held = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # locked a file that is no longer the directory's lock: again
    raise SaveError(f"cannot lock {path}: it keeps being replaced")


class DirectoryWrite:
    """This process's exclusive claim on checkpoint directory ``root`` and the staging
    directory its files are written to (see the module docstring).

    ``owned(name)`` says which names of the old directory belong to the checkpoint being
    replaced (they go with it); other files the user keeps there stay.
    """

    def __init__(self, root: Path, staging: Path, locks: list[int], created_root: bool, inside: bool,
                 owned: Callable[[str], bool]) -> None:
        self.root, self.staging = root, staging
        self._locks, self._created_root, self._inside, self._owned = locks, created_root, inside, owned
        # committed or aborted: a later abort (live recovery's, of a save it abandoned) leaves
        # the directory alone
        self._end = WriteEnd(str(root))

    @classmethod
    def begin(cls, root: str | os.PathLike, manifest_name: str, overwrite: bool,
              owned: Callable[[str], bool], in_place: bool = False) -> DirectoryWrite:
        """Claim ``root`` (creating it if needed) and make a fresh staging directory
        (inside ``root`` with ``in_place``: the commit then renames the files in, and
        files of the user's in ``root`` never move). Raises :class:`SaveError` when
        another save holds it, when it already holds a committed checkpoint and not
        ``overwrite``, or when it cannot be prepared."""
        root = Path(os.path.realpath(root))
        created = False
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            try:
                root.mkdir()
                created = True
            except FileExistsError:
                if not root.is_dir():
                    raise SaveError(f"cannot save to {root}: it exists and is not a directory") from None
            lock = _try_lock(root / LOCK_NAME)
        except OSError as e:
            raise SaveError(f"cannot prepare {root}: {e}") from None
        if lock is None:
            raise SaveError(f"another save to {root} is in progress (it holds {root / LOCK_NAME}); nothing was written")
        write = cls(root, root, [lock], created, False, owned)
        try:
            write._inside = in_place or os.path.ismount(root)
            write._make_staging()  # first: it puts back what a crashed commit left aside
            if (root / manifest_name).exists() and not overwrite:
                raise CheckpointExistsError(root)
            if not write._inside:  # after the exchange this file is the directory's lock: hold it too
                staging_lock = _try_lock(write.staging / LOCK_NAME)
                if staging_lock is not None:
                    write._locks.append(staging_lock)
        except BaseException as e:
            write.abort()
            if isinstance(e, OSError):
                raise SaveError(f"cannot prepare {root}: {e}") from None
            raise
        return write

    def _make_staging(self) -> None:
        """Make the staging directory: beside the target, or inside it when the target is
        a mount point or its parent is not writable."""
        while True:
            base, prefix = (self.root, _STAGING_TAG) if self._inside else (self.root.parent, f".{self.root.name}{_STAGING_TAG}")
            self._remove_stale(base, prefix)
            self.staging = base / f"{prefix}{secrets.token_hex(8)}"
            try:
                self.staging.mkdir(mode=0o755)
                return
            except PermissionError:
                if self._inside:
                    raise
                self._inside = True
            except OSError as e:
                if self._inside or e.errno != errno.EROFS:
                    raise
                self._inside = True

    @property
    def staging_from_target(self) -> str:
        """The staging directory relative to the target directory (``../.<name>.unickpt-..``
        beside it, or a name inside it): every rank finds it from its own view of the path."""
        return self.staging.name if self._inside else os.path.join(os.pardir, self.staging.name)

    @staticmethod
    def _remove_stale(base: Path, prefix: str) -> None:
        """Remove staging directories left by crashed saves of this directory (we hold
        its lock: no other save of it is running)."""
        pattern = re.compile(re.escape(prefix) + r"[0-9a-f]{16}")
        for name in os.listdir(base):
            if pattern.fullmatch(name):
                _restore_aside(base / name / _ASIDE, base)
                shutil.rmtree(base / name, ignore_errors=True)

    def commit(self, documents: dict[str, bytes]) -> None:
        """:meth:`_commit` unless the write was aborted (a SaveError then)."""
        with self._end.commit():
            self._commit(documents)

    def swap_in(self, uncommit: Callable[[], None]) -> None:
        """:meth:`_swap_in` unless the write was aborted (a SaveError then)."""
        with self._end.commit():
            self._swap_in(uncommit)

    def _commit(self, documents: dict[str, bytes]) -> None:
        """Write ``documents`` (small files, the manifest last) into the staging
        directory, make it durable, and swap it in (the commit); then remove the old
        checkpoint and release the lock. The staging directory's other files must
        already be durable. On failure before the swap, everything written is removed."""
        try:
            for name, data in documents.items():
                create_new(self.staging / name, data, durable=False)
            # the documents and the directory's entries become durable together: fsyncs
            # issued at once share a journal commit instead of waiting for one each
            paths = [self.staging / name for name in documents] + [self.staging]
            with ThreadPoolExecutor(max_workers=len(paths)) as pool:
                list(pool.map(fsync_path, paths))
            if not self._inside and exchange(self.staging, self.root):
                committed_in = self.root.parent
                old = self.staging
            else:
                committed_in, old = self.root, None
                self._move_in(list(documents)[-1])
            fsync_path(committed_in)
        except OSError as e:
            self.abort()
            raise SaveError(f"cannot commit {self.root}: {e}") from None
        except BaseException:
            self.abort()
            raise
        try:
            if old is not None:
                self._keep_user_entries(old)
                shutil.rmtree(old, ignore_errors=True)
        finally:
            self._release()

    def _swap_in(self, uncommit: Callable[[], None]) -> None:
        """Commit an in-place staging directory whose entries (files and directories) are
        already durable: call ``uncommit`` (which removes what marks the old checkpoint as
        committed), then put every staged entry in place of the old one of the same name
        (a directory by an atomic exchange, else renamed aside and the new one renamed
        in), durably; remove the old entries and release the lock. Entries of the target
        the staging directory does not hold are never touched. On failure before
        ``uncommit``, everything written is removed."""
        try:
            fsync_path(self.staging)
            new = [n for n in os.listdir(self.staging) if n not in (LOCK_NAME, _ASIDE)]
            uncommit()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise SaveError(f"cannot commit {self.root}: {e}") from None
            raise
        try:
            for name in new:
                source, target = self.staging / name, self.root / name
                if source.is_dir() and target.is_dir() and not target.is_symlink():
                    if exchange(source, target):
                        continue
                    aside = self.staging / _ASIDE
                    aside.mkdir(exist_ok=True)
                    os.rename(target, aside / name)
                    fsync_path(self.staging)  # the old tree is recoverable before the new one goes in
                os.rename(source, target)
            fsync_path(self.root)
        except OSError as e:
            raise SaveError(f"cannot commit {self.root}: {e} (the next write to it restores or removes "
                            "what this one left)") from None
        finally:
            self._release()
        shutil.rmtree(self.staging, ignore_errors=True)

    def _move_in(self, manifest_name: str) -> None:
        """Commit without an exchange: uncommit the old checkpoint durably, rename the
        new files in, the manifest last."""
        new = [n for n in os.listdir(self.staging) if n != LOCK_NAME]
        old_manifest = self.root / manifest_name
        if os.path.lexists(old_manifest):
            os.unlink(old_manifest)
            fsync_path(self.root)
        for name in new:
            if name != manifest_name:
                os.rename(self.staging / name, self.root / name)
        fsync_path(self.root)
        os.rename(self.staging / manifest_name, old_manifest)
        for name in os.listdir(self.root):
            if name not in new and name != manifest_name and self._owned(name):
                _remove_entry(self.root / name)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _keep_user_entries(self, old: Path) -> None:
        """Move what the user kept in the replaced directory (not the old checkpoint's
        files, not hidden names) into the new one."""
        for name in os.listdir(old):
            if name.startswith(".") or self._owned(name) or os.path.lexists(self.root / name):
                continue
            try:
                os.rename(old / name, self.root / name)
            except OSError:
                pass

    def abort(self) -> None:
        """Remove everything this write created (the staging directory, and the target
        directory when this write created it and it is still empty) and release the lock;
        nothing once it committed (or was aborted already)."""
        with self._end.abort() as first:
            if not first:
                return
            try:
                if self.staging != self.root:
                    shutil.rmtree(self.staging, ignore_errors=True)
            finally:
                self._release()
            if self._created_root:
                try:
                    os.rmdir(self.root)
                except OSError:
                    pass

    def _release(self) -> None:
        """Remove the directory's lock file (while holding it: a process waiting on the
        removed file finds it replaced and locks the new one) and unlock."""
        held = {(st.st_dev, st.st_ino) for st in map(os.fstat, self._locks)}
        try:
            st = os.stat(self.root / LOCK_NAME, follow_symlinks=False)
            if (st.st_dev, st.st_ino) in held:
                os.unlink(self.root / LOCK_NAME)
        except OSError:
            pass
        for fd in self._locks:
            os.close(fd)
        self._locks = []


_ABANDONED = re.compile(r"\.(.+)" + re.escape(_STAGING_TAG) + r"[0-9a-f]{16}")


def remove_abandoned(parent: str | os.PathLike) -> None:
    """Remove the staging directories that crashed saves left in ``parent`` (for
    directories that no save holds now)."""
    parent = Path(parent)
    for name in os.listdir(parent):
        m = _ABANDONED.fullmatch(name)
        target = parent / m.group(1) if m else None
        if target is None or not target.is_dir() or target.is_symlink():
            continue
        lock = _try_lock(target / LOCK_NAME)
        if lock is None:
            continue  # a save of that directory is running: its staging directory is live
        try:
            shutil.rmtree(parent / name, ignore_errors=True)
        finally:
            DirectoryWrite(target, target, [lock], False, True, lambda _: False)._release()
        try:
            os.rmdir(target)  # the directory the crashed save made for itself, if it is empty
        except OSError:
            pass


def _restore_aside(aside: Path, root: Path) -> None:
    """Put back into ``root`` the old entries a crashed :meth:`DirectoryWrite.swap_in`
    renamed aside and did not replace."""
    try:
        names = os.listdir(aside)
    except OSError:
        return
    for name in names:
        if not os.path.lexists(root / name):
            os.rename(aside / name, root / name)
            fsync_path(root)


def _remove_entry(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
