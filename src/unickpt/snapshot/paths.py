"""Where the snapshot tier keeps its files in a node's host shared memory.

    <shm root>/keeper.pid                      the node's keeper process id (plain text)
    <shm root>/unickpt/keeper.json             its address and job: {"pid", "host", "port", "job"}
    <shm root>/unickpt/<job>/step_00000012/    a snapshot: an ordinary unickpt checkpoint
        manifest.json                          (on every node: the root of an indexed manifest),
        fragments_00003.jsonl                  the parts of its index this node keeps (node 0:
                                               fragments.jsonl, the whole index), this node's rank files,
        parity_g3_r0.bin, parity_g3_r0.json    the parity blocks this node holds for the step
                                               (group 3, block 0), with their crc32c,
        whole                                  written once every keeper holds data + parity
    <shm root>/unickpt/<job>/recover_00000012/ the manifest a recovery loads through

The shm root is ``UNICKPT_SHM_ROOT`` (default ``/dev/shm``, a tmpfs: host memory that
outlives the processes that wrote it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from typing import Any

from ..errors import SnapshotError

SHM_ROOT_ENV = "UNICKPT_SHM_ROOT"
SECRET_BYTES = 32
PARITY_PREFIX = "parity_"
WHOLE = "whole"
_STEP = re.compile(r"^step_(\d+)$")


def shm_root() -> str:
    """The node's shared-memory root (``$UNICKPT_SHM_ROOT`` or ``/dev/shm``)."""
    return os.environ.get(SHM_ROOT_ENV) or "/dev/shm"


MADE_MARK = ".made-by-unickpt"  # in a shm root that a Snapshotter created


def remove_if_empty(root: str) -> None:
    """After a clean end: the jobs' directory under the shm root when empty, and the root
    itself when a Snapshotter created it (``MADE_MARK``) and nothing else is in it."""
    try:
        os.rmdir(base_dir(root))
    except FileNotFoundError:  # the keeper removed it
        pass
    except OSError:  # another job's snapshots are there
        return
    try:
        if sorted(os.listdir(root)) == [MADE_MARK]:
            os.unlink(os.path.join(root, MADE_MARK))
            os.rmdir(root)
    except OSError:  # gone already, or something else appeared
        pass


def base_dir(root: str) -> str:
    """The directory holding every job's snapshots under ``root``."""
    return os.path.join(root, "unickpt")


def pid_file(root: str) -> str:
    """``<root>/keeper.pid``: the keeper's process id."""
    return os.path.join(root, "keeper.pid")


def address_file(root: str) -> str:
    """The keeper's address document."""
    return os.path.join(base_dir(root), "keeper.json")


def job_dir(root: str, job: str) -> str:
    """The directory of one job's snapshots."""
    return os.path.join(base_dir(root), job)


def secret_file(root: str, job: str) -> str:
    """The job's secret (mode 0600), which every connection to its keepers must prove."""
    return os.path.join(job_dir(root, job), "secret")


def read_secret(root: str, job: str) -> bytes | None:
    """The job's secret stored under ``root``, or None when there is none yet, or none that
    can be read (not a file, or not ``SECRET_BYTES`` long)."""
    try:
        data = read_regular(secret_file(root, job), SECRET_BYTES + 1)
    except OSError:
        return None
    return data if len(data) == SECRET_BYTES else None


def write_secret(root: str, job: str, secret: bytes) -> None:
    """Store the job's secret under ``root``, readable by this user only (atomically)."""
    path = secret_file(root, job)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    if os.path.isdir(path) and not os.path.islink(path):
        clear(path)
    os.replace(tmp, path)


def make_private(root: str) -> None:
    """Create ``<root>/unickpt`` readable by this user only (and make it so if it exists):
    the snapshots, the keeper's log and the job's secret lie under it."""
    base = base_dir(root)
    os.makedirs(base, mode=0o700, exist_ok=True)
    if os.stat(base).st_mode & 0o077:
        os.chmod(base, 0o700)


def step_name(step: int) -> str:
    """Directory name of the snapshot of ``step``."""
    return f"step_{step:08d}"


def step_dir(root: str, job: str, step: int) -> str:
    """The directory of the snapshot of ``step``."""
    return os.path.join(job_dir(root, job), step_name(step))


def steps(jdir: str) -> list[int]:
    """Steps of the snapshot directories (committed or not) under a job directory, oldest first."""
    try:
        names = os.listdir(jdir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP.match(n)))


def parity_name(group: int, r: int, ext: str) -> str:
    """File name of parity block ``r`` of ``group`` (``ext``: ``bin`` the bytes, ``json`` its record)."""
    return f"{PARITY_PREFIX}g{group}_r{r}.{ext}"


def parity_metas(sdir: str) -> list[str]:
    """The parity records (``parity_*.json``) a node holds in a snapshot directory, sorted
    (directories of such a name are no record)."""
    return sorted(n for n in _entries(sdir) if n.startswith(PARITY_PREFIX) and n.endswith(".json"))


def data_files(sdir: str) -> list[str]:
    """The rank files a node holds in a snapshot directory, sorted (its parity blob's order);
    a directory of such a name holds nothing (other files are checked by size and checksum)."""
    return sorted(n for n in _entries(sdir) if n.startswith("rank_") and n.endswith(".safetensors"))


def index_files(sdir: str) -> list[str]:
    """The parts of a snapshot's index (``fragments_00003.jsonl``) and the whole index
    (``fragments.jsonl``) a node holds in a snapshot directory, sorted."""
    return sorted(n for n in _entries(sdir) if _INDEX.match(n))


_INDEX = re.compile(r"^fragments(_\d{5,})?\.jsonl$")


def _entries(sdir: str) -> list[str]:
    """Names in ``sdir`` that are not directories (nor links to one); [] when it cannot be listed."""
    try:
        with os.scandir(sdir) as it:
            return [e.name for e in it if not e.is_dir()]
    except OSError:
        return []


def read_regular(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); OSError when it is
    missing, unreadable or not a regular file (a directory, a link, a pipe)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.path.basename(path)} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit)
    finally:
        os.close(fd)


def seal(doc: dict[str, Any]) -> bytes:
    """A JSON document as the keepers store it in the shm root (``keeper.json``, parity
    records): with the SHA-256 of the rest of it as ``digest``, so a changed byte is seen."""
    return json.dumps(dict(doc, digest=_digest(doc)), sort_keys=True).encode()


def unseal(raw: bytes) -> dict[str, Any]:
    """The document :func:`seal` stored, its digest checked (and removed); a SnapshotError
    says what is wrong."""
    doc = json_object(raw)
    if doc.pop("digest", None) != _digest(doc):
        raise SnapshotError("its digest does not match its content (changed after it was written)")
    return doc


def json_object(raw: bytes | bytearray, what: str = "") -> dict[str, Any]:
    """The JSON object ``raw`` holds; a SnapshotError when it is not JSON or not an object."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise SnapshotError(f"{what}not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"{what}not a JSON object")
    return doc


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dir_bytes(path: str) -> int:
    """Total size of the regular files below ``path``, each file once (a ring slot and the
    step's rank file it is linked as are one file)."""
    total, seen = 0, set()
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


MEMORY = "memory.json"  # in a job directory: what the node's snapshots hold at most (memory_plan)


def write_memory(jdir: str, node: int, plan: dict[str, int]) -> None:
    """Record the node's host memory for snapshots (``unickpt snapshots`` shows it), when
    it changed."""
    data = json.dumps({"node": node, **plan}, sort_keys=True).encode()
    path = os.path.join(jdir, MEMORY)
    try:
        if read_regular(path, 4096) == data:
            return
    except OSError:
        pass
    os.makedirs(jdir, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    if os.path.isdir(path) and not os.path.islink(path):
        clear(path)
    os.replace(tmp, path)


def read_memory(jdir: str) -> dict[str, int] | None:
    """The node's recorded snapshot memory (None: none recorded, or not readable)."""
    try:
        doc = json.loads(read_regular(os.path.join(jdir, MEMORY), 4096))
    except (OSError, ValueError):
        return None
    keys = ("state", "ring", "parity", "total", "ring_slots", "cap", "node")
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool) for k in keys):
        return None
    return {k: doc[k] for k in keys}


def remove_tree(path: str) -> None:
    """Delete a directory tree, ignoring what is already gone."""
    shutil.rmtree(path, ignore_errors=True)


def clear(path: str) -> None:
    """Delete whatever is at ``path`` (a file, a link, a directory tree), if anything."""
    if os.path.isdir(path) and not os.path.islink(path):
        remove_tree(path)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
