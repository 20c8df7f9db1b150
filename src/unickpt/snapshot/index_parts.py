"""The index of a snapshot's manifest, read from the nodes that keep its parts.

A snapshot's manifest is indexed (format 2.0): every node holds the root, the index is cut
into one part per node at line starts (``format.index.part_bounds``), part ``j`` kept by
node ``j`` and copied on the next ``parity`` nodes, and node 0 keeps the whole index
(``client.index_parts``). A recovering rank reads only the lines its load needs: the part
holding a line is fetched once (from this node's shm root when it holds it, else from a
keeper that does), and each line is checked against the CRC-32C the root lists for it. A
part that is missing, truncated or fails a line's check is skipped with its reason and the
next holder tried; when none is left the load fails with every reason, and recovery tries
the next step.
"""

from __future__ import annotations

import bisect
import json
import os
import stat
import threading
from typing import Any

from ..errors import CorruptionError, UnickptError
from ..format.checksum import crc32c
from ..format.index import INDEX_NAME, part_bounds, part_name, root_lines
from .degraded import Peers


class IndexSource:
    """``index(offset, length) -> bytes`` for ``Manifest.from_json`` over the parts of a
    snapshot's index the planned nodes hold (``plan["index"]``: name -> ``[[node, path
    under the job directory], ...]``)."""

    def __init__(self, plan: dict[str, Any], node: int, jdir: str, peers: Peers) -> None:
        doc = json.loads(plan["manifest"])
        nodes = ((doc.get("metadata") or {}).get("snapshot") or {}).get("nodes") or [None]
        self.lines = root_lines(doc)
        self.bounds = part_bounds(list(self.lines), int((doc.get("index") or {}).get("size", 0)), len(nodes))
        self.holders: dict[str, list[Any]] = plan.get("index") or {}
        self.node, self.jdir, self.peers = node, jdir, peers
        self.parts: dict[int, bytes] = {}  # part -> its bytes, from the first holder whose lines checked
        self.fetched = 0  # bytes of index parts read
        self._lock = threading.Lock()

    def __call__(self, offset: int, length: int) -> bytes:
        want = self.lines.get(offset)
        if want is None or want[0] != length:
            raise CorruptionError(f"{INDEX_NAME}: bytes {offset}-{offset + length} are no line the manifest lists")
        j = min(bisect.bisect_right(self.bounds, offset), len(self.bounds) - 1) - 1
        lo, size = self.bounds[j], self.bounds[j + 1] - self.bounds[j]
        with self._lock:
            data = self.parts.get(j)
            if data is not None and _line_ok(data, offset - lo, want):
                return data[offset - lo : offset - lo + length]
            reasons = []
            for holder, rel, at in self._sources(j, lo):
                try:
                    data = self._read(holder, rel, at, size)
                except (OSError, UnickptError, ValueError) as e:
                    reasons.append(f"node {holder}'s {os.path.basename(rel)}: {e}")
                    continue
                if not _line_ok(data, offset - lo, want):
                    reasons.append(f"node {holder}'s {os.path.basename(rel)}: bytes {offset}-{offset + length} fail "
                                   "their crc32c")
                    continue
                self.parts[j] = data
                return data[offset - lo : offset - lo + length]
        raise CorruptionError(f"no node holds a valid copy of part {j} of the manifest's index "
                              f"({'; '.join(reasons) or 'no surviving node keeps it'})")

    def _sources(self, j: int, lo: int) -> list[tuple[int, str, int]]:
        """(node, path, offset of the part in that file) of every copy of part ``j``, this
        node's first; the part's own copies before the whole index's."""
        out = []
        for name, at in ((part_name(j), 0), (INDEX_NAME, lo)):
            held = sorted(self.holders.get(name, []), key=lambda h: h[0] != self.node)
            out += [(int(node), str(rel), at) for node, rel in held]
        return out

    def _read(self, holder: int, rel: str, at: int, size: int) -> bytes:
        buf = bytearray(size)
        if holder == self.node:
            fd = os.open(os.path.join(self.jdir, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError("not a regular file")
                got = os.preadv(fd, [buf], at) if size else 0
            finally:
                os.close(fd)
            if got != size:
                raise OSError(f"truncated: {got} of its {size} bytes at {at}")
        elif size:
            self.peers.read_views(holder, {"op": "read", "path": rel, "offset": at}, [memoryview(buf)])
        self.fetched += size
        return bytes(buf)


def _line_ok(data: bytes, at: int, want: tuple[int, int]) -> bool:
    length, crc = want
    return 0 <= at and at + length <= len(data) and crc32c(data[at : at + length]) == crc
