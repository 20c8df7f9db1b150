"""Reading a lost node's files straight from the survivors' data and parity (degraded reads).

After a node loss, nothing is rebuilt ahead of the load: a rank whose read plan needs
bytes of a lost node's file gets them from a :class:`DegradedReader`, which computes
exactly those bytes from the same byte range of the other blocks of their parity group
(the surviving data stripes and the parity blocks, RAID style): XOR for ``m = 1``,
zfec's Reed-Solomon decoding for ``m >= 2``, a plain read of the neighbour's copy for
replicas. The work is spread over the ranks that need the bytes (each decodes only what
its own shards need, in parallel, in chunks of ``CHUNK`` bytes), the decoded bytes land
in the load's own buffers (no rebuilt file is written to memory and read again), and
every one of them is then checked by the load against its block's crc32c, like any
read. When such a check fails, :func:`diagnose` checks each input block against its own
crc32c to name the corrupt one.

Blocks held by the reading rank's own node are read from its shm root; the others come
from their keepers (``blob``/``read`` requests on pooled connections): the requests for
one chunk's inputs are all sent at once and the local blocks read while the keepers
answer, so a chunk waits for the slowest input, not for the sum of them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c as _crc
import numpy as np

from ..storage.local import FileReader
from . import paths, wire
from .parity import decode, group_of, members, open_record, read_blob, stripe_range, xor_into

CHUNK = 4 << 20  # bytes decoded at a time: the inputs stay in cache between read and use
_EXT = {"parity": "bin", "record": "json"}  # a parity block's file, its record's


class Peers:
    """Connections to the keepers of the current job's nodes, pooled by node: a request
    takes an idle connection (or opens one), so the load's threads read in parallel."""

    def __init__(self, table: list[dict[str, Any]], secret: bytes) -> None:
        self.table, self.secret = table, secret
        self.idle: dict[int, list[wire.Connection]] = {}
        self.opened: list[wire.Connection] = []
        self.received = 0  # payload bytes received from the keepers so far
        self._lock = threading.Lock()

    def read_views(self, node: int, header: dict[str, Any], views: list[memoryview]) -> None:
        """One ranged request (``read`` or ``blob``) to node ``node``'s keeper, received
        into ``views`` (see :meth:`wire.Connection.read_views`)."""
        self.read_all([(node, header, views)])

    def read_all(self, requests: list[tuple[int, dict[str, Any], list[memoryview]]],
                 meanwhile: Callable[[], None] | None = None) -> None:
        """Ranged requests ``(node, header, views)`` in flight at once, each on its own
        connection: all are sent, ``meanwhile`` runs (reads of this node's own blocks)
        while the keepers answer, then every reply is received into its views. A
        connection whose request failed, or was cut short by another's failure, is
        closed, never pooled."""
        started: list[tuple[int, wire.Connection, list[memoryview]]] = []
        try:
            for node, header, views in requests:
                conn = self._take(node)
                views = [memoryview(v).cast("B") for v in views]
                conn.start_read(header, sum(v.nbytes for v in views))
                started.append((node, conn, views))
            if meanwhile is not None:
                meanwhile()
            while started:
                node, conn, views = started[0]
                conn.finish_read(views)
                started.pop(0)
                with self._lock:
                    self.idle[node].append(conn)
                    self.received += sum(v.nbytes for v in views)
        except BaseException:
            for _, conn, _ in started:
                conn.close()
            raise

    def _take(self, node: int) -> wire.Connection:
        """An idle connection to ``node``'s keeper, or a new one."""
        with self._lock:
            pool = self.idle.setdefault(node, [])
            if pool:
                return pool.pop()
        peer = self.table[node]
        conn = wire.Connection(peer["host"], int(peer["port"]), self.secret)
        with self._lock:
            self.opened.append(conn)
        return conn

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            conns, self.opened, self.idle = self.opened, [], {}
        for c in conns:
            c.close()


class Source:
    """Where the blocks of a snapshot step are: this node's shm root, other nodes' keepers."""

    def __init__(self, peers: Peers, node: int, jdir: str, step: int) -> None:
        self.peers, self.node, self.jdir, self.step = peers, node, jdir, step
        self.sdir = os.path.join(jdir, paths.step_name(step))

    def blob(self, node: int, files: list[tuple[str, int]], offset: int, out: memoryview) -> None:
        """Bytes ``offset..`` of the blob of rank files ``files`` held by ``node``."""
        self.fetch([("blob", node, files, offset, out)])

    def parity(self, node: int, g: int, r: int, offset: int, out: memoryview) -> None:
        """Bytes ``offset..`` of parity block ``r`` of group ``g`` held by ``node``."""
        self.fetch([("parity", node, (g, r), offset, out)])

    def fetch(self, jobs: list[tuple[str, int, Any, int, memoryview]]) -> None:
        """Fill each job's ``out``: ``("blob", node, files, offset, out)``, ``("parity",
        node, (group, block), offset, out)`` or ``("record", ...)`` (the block's record). The other nodes' keepers are all asked at
        once and this node's own blocks read while they answer."""
        remote = [(node, self._request(kind, what, offset), [out]) for kind, node, what, offset, out in jobs if node != self.node]
        mine = [job for job in jobs if job[1] == self.node]

        def read_mine() -> None:
            for kind, _, what, offset, out in mine:
                if kind == "blob":
                    read_blob(self.sdir, [(str(n), int(s)) for n, s in what], offset, out)
                    continue
                reader = FileReader(Path(self.sdir) / paths.parity_name(what[0], what[1], _EXT[kind]))
                try:
                    reader.pread_into(offset, out)
                finally:
                    reader.close()

        if remote:
            self.peers.read_all(remote, read_mine)
        else:
            read_mine()

    def _request(self, kind: str, what: Any, offset: int) -> dict[str, Any]:
        """The keeper request for a ``fetch`` job."""
        if kind == "blob":
            return {"op": "blob", "step": self.step, "offset": offset}
        return {"op": "read", "path": f"{paths.step_name(self.step)}/{paths.parity_name(what[0], what[1], _EXT[kind])}",
                "offset": offset}


class _Scratch(threading.local):
    """Per-thread chunk buffers, reused from one chunk to the next."""

    bufs: list[np.ndarray] | None = None
    spare: np.ndarray | None = None

    def get(self, count: int) -> list[np.ndarray]:
        """``count`` chunk buffers for the inputs of a decode."""
        if self.bufs is None or len(self.bufs) < count:
            self.bufs = [np.empty(CHUNK, np.uint8) for _ in range(count)]
        return self.bufs

    def out(self) -> np.ndarray:
        """A chunk buffer for a decoded chunk that spans several of the caller's buffers."""
        if self.spare is None:
            self.spare = np.empty(CHUNK, np.uint8)
        return self.spare


class DegradedReader:
    """A lost node's rank file, read by decoding each asked range from its parity group.

    ``rebuild`` is the plan's (:mod:`.recovery_plan`): ``k``, ``m``, ``nodes``, ``lost``,
    ``info`` (old node -> its blob's length, files and the node holding them now) and
    ``groups`` (group -> the parity blocks read: ``[node now, block, nbytes, crc32c,
    record length]``); each group's data members follow from the layout."""

    def __init__(self, source: Source, rebuild: dict[str, Any], node: int, name: str) -> None:
        self.source, self.node = source, node
        self.k, self.m, self.n = int(rebuild["k"]), int(rebuild["m"]), int(rebuild["nodes"])
        self.groups, self.info = rebuild["groups"], rebuild["info"]
        self.lost = {int(x) for x in rebuild["lost"]}
        rec = self.info[str(node)]
        self.blob = int(rec["blob"])
        self.start, self.size = 0, 0
        for f, size in rec["files"]:
            if f == name:
                self.size = int(size)
                break
            self.start += int(size)
        self.stripe = -(-self.blob // self.k)
        self._scratch = _Scratch()

    def pread_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes at ``offset``, decoded chunk by chunk."""
        self.preadv_into(offset, [out])

    def preadv_into(self, offset: int, views: list[memoryview]) -> None:
        """Fill the buffers one after the other from ``offset`` on: the whole range is
        decoded in chunks of at most ``CHUNK`` bytes (one request per input block and
        chunk, however many buffers), straight into a buffer that holds a whole chunk,
        else into scratch and copied out."""
        views = [memoryview(v).cast("B") for v in views]
        at = self.start + offset
        k, pos = 0, 0  # the buffer and the byte in it where the next chunk lands
        left = sum(v.nbytes for v in views)
        while left:
            s, off = divmod(at, self.stripe)
            n = min(left, self.stripe - off, CHUNK)
            while views[k].nbytes == pos:
                k, pos = k + 1, 0
            if views[k].nbytes - pos >= n:
                self._chunk(s, off, views[k][pos : pos + n])
                pos += n
            else:
                tmp = memoryview(self._scratch.out())[:n]
                self._chunk(s, off, tmp)
                done = 0
                while done < n:
                    while views[k].nbytes == pos:
                        k, pos = k + 1, 0
                    c = min(n - done, views[k].nbytes - pos)
                    views[k][pos : pos + c] = tmp[done : done + c]
                    pos, done = pos + c, done + c
            at, left = at + n, left - n

    def _chunk(self, s: int, off: int, out: memoryview) -> None:
        """Bytes ``[off, off + len(out))`` of this node's stripe ``s``, from its group."""
        g = group_of(self.node, s, self.n)
        blocks_read = self.groups[str(g)]
        n = out.nbytes
        target = np.frombuffer(out, np.uint8)
        if self.k == 1:  # a copy: the parity block is the stripe
            node, r = blocks_read[0][:2]
            self.source.parity(int(node), g, int(r), off, out)
            return
        bufs = self._scratch.get(self.k)
        jobs, inputs, free = [], [], []  # free: the lost members' buffers, for the parity blocks
        for j, (i, s_i) in enumerate(members(g, self.k, self.n)):
            if i in self.lost:
                free.append(j)
                continue
            rec = self.info[str(i)]
            lo, hi = stripe_range(int(rec["blob"]), s_i, self.k)
            got = max(0, min(n, hi - lo - off))  # a shorter stripe ends early
            if got:
                jobs.append(("blob", int(rec["at"]), rec["files"], lo + off, memoryview(bufs[j][:got])))
            inputs.append((s_i, bufs[j][:n], got))
        if self.m == 1:  # XOR: the parity chunk straight into the output, the data chunks XORed onto it
            node, r = blocks_read[0][:2]
            self.source.fetch([("parity", int(node), (g, int(r)), off, out), *jobs])
            for _, b, got in inputs:
                if got:
                    xor_into(target, b[:got])
            return
        blocks: dict[int, np.ndarray] = {}
        for s_i, b, got in inputs:
            blocks[s_i] = b
        for j, (node, r) in zip(free, ((e[0], e[1]) for e in blocks_read), strict=True):
            b = bufs[j][:n]
            jobs.append(("parity", int(node), (g, int(r)), off, memoryview(b)))
            blocks[self.k + int(r)] = b
        self.source.fetch(jobs)
        for _, b, got in inputs:
            b[got:] = 0  # a shorter stripe is zero-padded inside the code
        target[:] = decode(blocks, self.k, self.m, [s])[s][:n]

    def close(self) -> None:
        """Nothing to release (the connections belong to the storage)."""


def diagnose(rebuild: dict[str, Any], source: Source) -> str | None:
    """After a rebuilt byte failed its check: the first input block of the rebuild that
    fails its own crc32c, named (a parity block or a data stripe), or None. A data
    stripe's crc32c is read from its group's parity record (checked), which the holder's
    keeper sends."""
    k, n = int(rebuild["k"]), int(rebuild["nodes"])
    lost = {int(x) for x in rebuild["lost"]}
    step = source.step
    for g, blocks_read in sorted(rebuild["groups"].items(), key=lambda kv: int(kv[0])):
        g = int(g)
        for node, r, nbytes, crc, size in blocks_read:
            buf = np.empty(int(nbytes), np.uint8)
            source.parity(int(node), g, int(r), 0, memoryview(buf))
            if _crc.crc32c(buf) != int(crc):
                return f"the parity of step {step} held by node {node} (group {g}, block {r}) fails its crc32c"
        node, r, _, _, size = blocks_read[0]
        raw = np.empty(int(size), np.uint8)
        source.fetch([("record", int(node), (g, int(r)), 0, memoryview(raw))])
        stripes = open_record(raw.tobytes())["members"]
        for i, s in members(g, k, n):
            if i in lost:
                continue
            rec = rebuild["info"][str(i)]
            lo, hi = stripe_range(int(rec["blob"]), s, k)
            buf = np.empty(hi - lo, np.uint8)
            source.blob(int(rec["at"]), rec["files"], lo, memoryview(buf))
            if str(i) not in stripes or _crc.crc32c(buf) != int(stripes[str(i)]["crc"]):
                return f"data stripe {s} of node {i} (step {step}) fails its crc32c"
    return None
