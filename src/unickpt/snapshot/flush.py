"""Durable flush: a whole snapshot step copied by the keepers into an ordinary checkpoint.

Every ``flush_every``-th snapshot carries, in its manifest's metadata, the durable
checkpoint directory it is to be written to (``snapshot.flush``: ``<ckpt dir>/step_XXXXXXXX``,
the naming of :class:`unickpt.CheckpointManager`). When the step is whole, the keeper of
the step's node 0 (the coordinator) claims that directory and makes its staging
directory, as every unickpt save does (:class:`~unickpt.storage.transaction.DirectoryWrite`),
and hands every keeper of the step the staging path (on the job's store when the step
names one: :class:`.store_commit.StoreFlush`; else a ``flush`` request to each); each
copies its node's rank files into it with a bounded buffer, fsyncs them and reports back
(on the store, or ``flushed``) with the names and sizes it wrote. Only when every node reported and the files are exactly those
of the step's manifest does the coordinator write the manifest, last, and swap the
directory in (the commit). A failure or a killed keeper leaves no committed checkpoint:
the staging directory is removed, or left hidden for the next save to reap.

Imported by the keeper: no torch here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import SnapshotError

COPY_BUFFER_BYTES = 4 << 20  # the most a keeper holds in memory while it copies
FLUSH_TIMEOUT_S = 600.0  # the coordinator gives up on keepers that do not report by then
MANIFEST = "manifest.json"
INDEX = "fragments.jsonl"  # the index of an indexed manifest, kept whole by the step's node 0


def checkpoint_file(name: str) -> bool:
    """True for the names of a unickpt checkpoint's own files (replaced with it)."""
    return name in (MANIFEST, INDEX) or (name.startswith("rank_") and name.endswith(".safetensors"))


def documents(sdir: str) -> dict[str, bytes]:
    """The manifest of a snapshot step as the coordinator's flush commits it: the whole
    index when the manifest is indexed (each line checked against the CRC-32C its root
    lists), then the root. A SnapshotError when the index is missing or damaged."""
    from ..format.index import root_lines
    from ..format.checksum import crc32c

    with open(os.path.join(sdir, MANIFEST), "rb") as f:
        root = f.read()
    lines = root_lines(json.loads(root))
    if not lines:
        return {MANIFEST: root}
    with open(os.path.join(sdir, INDEX), "rb") as f:
        index = f.read()
    bad = [at for at, (n, crc) in lines.items() if crc32c(index[at : at + n]) != crc]
    if bad:
        raise SnapshotError(f"{INDEX}: {len(bad)} of its {len(lines)} lines fail their crc32c")
    return {INDEX: index, MANIFEST: root}


def copy_files(sdir: str, staging: str, files: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Copy ``files`` (name, size) from snapshot directory ``sdir`` into ``staging``
    through one buffer of :data:`COPY_BUFFER_BYTES`, each file fsynced; returns the
    (name, size) written. A file that is not its size is a SnapshotError."""
    buf = memoryview(bytearray(COPY_BUFFER_BYTES))
    done = []
    for name, size in files:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.path.join(sdir, name), "rb", buffering=0) as src:
            fd = os.open(os.path.join(staging, name), flags, 0o644)
            try:
                copied = 0
                while True:
                    n = src.readinto(buf)
                    if not n:
                        break
                    view = buf[:n]
                    while view.nbytes:
                        view = view[os.write(fd, view):]
                    copied += n
                if copied != size:
                    raise SnapshotError(f"{name} holds {copied} bytes, {size} expected")
                os.fsync(fd)
            finally:
                os.close(fd)
        done.append((name, size))
    return done


def check_reports(manifest: bytes, reports: dict[int, dict[str, Any]], nodes: int) -> None:
    """Raise SnapshotError unless every one of ``nodes`` reported success and, together,
    they wrote exactly the files (names and sizes) of ``manifest``."""
    failed = [f"node {i}: {r['error']}" for i, r in sorted(reports.items()) if r.get("error")]
    if failed:
        raise SnapshotError("; ".join(failed))
    missing = sorted(set(range(nodes)) - set(reports))
    if missing:
        raise SnapshotError(f"node(s) {', '.join(map(str, missing))} did not report their files durable")
    written: dict[str, int] = {}
    for r in reports.values():
        for name, size in r["files"]:
            written[name] = int(size)
    want = {k: int(v) for k, v in json.loads(manifest)["files"].items()}
    if written != want:
        raise SnapshotError(f"the keepers wrote {sorted(written.items())}, the manifest names {sorted(want.items())}")
