"""Degraded reads of a lost node's files (unickpt.snapshot.degraded) on real files: every
node's rank files and the parity blocks written by the real encoders into one directory
(all blocks local to the reading node), then any byte range of a lost file, scattered
over buffers that cross chunk and stripe boundaries, must come back exact: XOR, Reed-
Solomon with two nodes lost, and copies on the neighbour. The multi-node path (keepers,
sockets) is covered by tests/test_snapshot.py."""

from __future__ import annotations

import contextlib
import os

import crc32c
import numpy as np
import pytest

from unickpt.errors import SnapshotError
from unickpt.snapshot import degraded, paths
from unickpt.snapshot.parity import encode, group_of, holders, layout, members, stripe_range


def _write_step(sdir: str, n: int, parity: int, replicas: int, sizes: list[list[int]]):
    """Rank files of n nodes (node i: files of ``sizes[i]`` bytes) and every group's parity."""
    rng = np.random.default_rng(7)
    k, m = layout(n, parity, replicas)
    recs, blobs = {}, {}
    for i in range(n):
        files, parts = [], []
        for j, size in enumerate(sizes[i]):
            name = f"rank_{i * 10 + j:05d}.safetensors"
            data = rng.integers(0, 256, size, dtype=np.uint8)
            data.tofile(os.path.join(sdir, name))
            files.append([name, size])
            parts.append(data)
        blobs[i] = np.concatenate(parts)
        recs[i] = {"files": files, "blob": int(blobs[i].size)}
    blocks = {}  # (group, r) -> [nbytes, crc32c, record length], as a summary lists a record
    for g in range(n):
        stripes, described = {}, {}
        for i, s in members(g, k, n):
            lo, hi = stripe_range(recs[i]["blob"], s, k)
            stripes[s] = memoryview(blobs[i][lo:hi])
            described[str(i)] = dict(recs[i], stripe=s, len=hi - lo, crc=crc32c.crc32c(stripes[s]))
        for r, holder in enumerate(holders(g, m, n)):
            block = encode(stripes, k, m, r)
            block.tofile(os.path.join(sdir, paths.parity_name(g, r, "bin")))
            meta = {"step": 0, "group": g, "r": r, "k": k, "m": m, "holder": holder, "nodes": n, "nbytes": block.size,
                    "crc": crc32c.crc32c(block), "members": described}
            raw = paths.seal(meta)
            with open(os.path.join(sdir, paths.parity_name(g, r, "json")), "wb") as f:
                f.write(raw)
            blocks[(g, r)] = [block.size, meta["crc"], len(raw)]
    return k, m, recs, blobs, blocks


def _rebuild(n: int, k: int, m: int, recs: dict, lost: list[int], blocks: dict) -> dict:
    """The plan's rebuild record (shape of recovery_plan.plan_candidates) with every block on node 0."""
    groups: dict[str, list] = {}
    for g in sorted({group_of(x, s, n) for x in lost for s in range(k)}):
        need = sum(i in lost for i, _ in members(g, k, n))
        groups[str(g)] = [[0, r, *blocks[(g, r)]] for r in range(m)][:need]
    info = {str(i): dict(recs[i], at=None if i in lost else 0) for i in range(n)}
    return {"k": k, "m": m, "nodes": n, "lost": lost, "groups": groups, "info": info}


@pytest.mark.parametrize("n, parity, replicas, lost", [(4, 1, 1, [3]), (4, 2, 1, [1, 2]), (3, 0, 2, [0])])
def test_any_range_of_a_lost_file_decodes_exactly(tmp_path, monkeypatch, n, parity, replicas, lost):
    monkeypatch.setattr(degraded, "CHUNK", 4096)  # many chunks per read, on small files
    sizes = [[30001, 7], [12289], [5, 40000], [25000, 999]][:n]
    source = degraded.Source(None, 0, str(tmp_path), 0)  # node 0 holds every block: no keeper needed
    os.makedirs(source.sdir)
    k, m, recs, blobs, blocks = _write_step(source.sdir, n, parity, replicas, sizes)
    rebuild = _rebuild(n, k, m, recs, lost, blocks)
    for x in lost:
        at = 0
        for name, size in recs[x]["files"]:
            want = blobs[x][at : at + size]
            reader = degraded.DegradedReader(source, rebuild, x, name)
            for lo, cuts in ((0, [size]), (1, [3, 5000, 1]), (size // 3, [4095, 4097, 10]), (max(0, size - 9), [9])):
                cuts = [c for c in cuts if c > 0]
                lens = []
                for c in cuts:  # buffers of these lengths while the file lasts
                    c = min(c, size - lo - sum(lens))
                    if c > 0:
                        lens.append(c)
                views = [np.full(c, 0xAB, np.uint8) for c in lens]
                reader.preadv_into(lo, [memoryview(v) for v in views])
                got = np.concatenate(views) if views else np.zeros(0, np.uint8)
                assert np.array_equal(got, want[lo : lo + got.size]), (name, lo, lens)
            at += size


@pytest.mark.parametrize("n, parity, lost", [(4, 1, [3]), (4, 2, [1, 2])])
def test_diagnose_names_the_corrupt_input(tmp_path, n, parity, lost):
    """After a rebuilt byte fails its check, ``diagnose`` names the input block that fails
    its own crc32c: a parity block by the plan's crc32c, a surviving data stripe by the
    one its group's parity record keeps (read and checked); nothing when all are sound."""
    source = degraded.Source(None, 0, str(tmp_path), 0)
    os.makedirs(source.sdir)
    k, m, recs, _, blocks = _write_step(source.sdir, n, parity, 1, [[30001, 7], [12289], [5, 40000], [25000, 999]][:n])
    rebuild = _rebuild(n, k, m, recs, lost, blocks)
    assert degraded.diagnose(rebuild, source) is None

    def flip(name: str, at: int) -> None:
        with open(os.path.join(source.sdir, name), "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 1]))

    g = min(int(x) for x in rebuild["groups"])
    node, r = rebuild["groups"][str(g)][0][:2]
    flip(paths.parity_name(g, r, "bin"), 3)
    assert degraded.diagnose(rebuild, source) == f"the parity of step 0 held by node 0 (group {g}, block {r}) fails its crc32c"
    flip(paths.parity_name(g, r, "bin"), 3)
    i, s = next((i, s) for i, s in members(g, k, n) if i not in lost)
    lo, _ = stripe_range(recs[i]["blob"], s, k)
    for name, size in recs[i]["files"]:  # the file holding the stripe's first byte
        if lo < size:
            break
        lo -= size
    flip(name, lo)
    assert degraded.diagnose(rebuild, source) == f"data stripe {s} of node {i} (step 0) fails its crc32c"


@contextlib.contextmanager
def _keeper_serving(tmp_path, job: str, name: str, data: bytes):
    """A real keeper of ``job`` holding ``step_00000001/<name>`` = ``data``: its address
    document and the job's secret; stopped (and killed if need be) after."""
    from unickpt.snapshot.keeper_admin import ensure_keeper, stop_keeper

    from snapshot_helpers import kill_keeper

    root = str(tmp_path / "shm")
    doc = ensure_keeper(root, job)
    secret = b"s" * paths.SECRET_BYTES
    paths.write_secret(root, job, secret)
    try:
        sdir = os.path.join(paths.job_dir(root, job), "step_00000001")
        os.makedirs(sdir)
        with open(os.path.join(sdir, name), "wb") as f:
            f.write(data)
        yield doc, secret
    finally:
        stop_keeper(root)
        kill_keeper(root)


@pytest.mark.multiprocess
def test_peers_count_the_bytes_a_keeper_sent(tmp_path):
    """What a recovery fetched from other nodes (``Outcome.fetched``) is counted by
    ``Peers`` as a real keeper sends it: every payload byte received, once."""
    data = np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8)
    with _keeper_serving(tmp_path, "count", "x.bin", data.tobytes()) as (doc, secret):
        peers = degraded.Peers([{"host": doc["host"], "port": doc["port"]}], secret)
        try:
            a, b = np.zeros(1000, np.uint8), np.zeros(3000, np.uint8)
            peers.read_views(0, {"op": "read", "path": "step_00000001/x.bin", "offset": 10}, [memoryview(a), memoryview(b)])
            assert np.array_equal(np.concatenate([a, b]), data[10:4010]) and peers.received == 4000
            peers.read_views(0, {"op": "read", "path": "step_00000001/x.bin", "offset": 0}, [memoryview(a)])
            assert peers.received == 5000
            # several requests in flight at once (each on its own connection), the local work meanwhile
            c, d, ran = np.zeros(2000, np.uint8), np.zeros(7, np.uint8), []
            peers.read_all([(0, {"op": "read", "path": "step_00000001/x.bin", "offset": 3000}, [memoryview(c)]),
                            (0, {"op": "read", "path": "step_00000001/x.bin", "offset": 4993}, [memoryview(d)])],
                           lambda: ran.append(True))
            assert np.array_equal(c, data[3000:]) and np.array_equal(d, data[4993:]) and ran == [True]
            assert peers.received == 7007 and len(peers.idle[0]) == 2
            # a failed request: an error, and neither its connection nor the other one's pooled
            with pytest.raises(SnapshotError, match="no-such.bin"):
                peers.read_all([(0, {"op": "read", "path": "step_00000001/x.bin", "offset": 0}, [memoryview(c)]),
                                (0, {"op": "read", "path": "step_00000001/no-such.bin", "offset": 0}, [memoryview(d)])])
            assert len(peers.idle[0]) == 1  # the first one came back before the failure
            peers.read_views(0, {"op": "read", "path": "step_00000001/x.bin", "offset": 1}, [memoryview(d)])
            assert np.array_equal(d, data[1:8])
        finally:
            peers.close()


@pytest.mark.multiprocess
def test_a_keepers_small_replies_go_out_at_once(tmp_path):
    """A reply is a header, then its payload, written one after the other: on a socket
    with Nagle's algorithm the payload waited for the client's delayed ACK of the header
    (40 ms on Linux), so every small read from a keeper (an index part, a parity record,
    a peer keeper's call) took 44 ms where a round trip takes well under one. The median
    of 30 reads must stay below the delayed ACK."""
    import statistics
    import time

    from unickpt.snapshot import wire

    data = os.urandom(4096)
    with _keeper_serving(tmp_path, "prompt", "part.jsonl", data) as (doc, secret):
        conn = wire.Connection(doc["host"], int(doc["port"]), secret)
        try:
            out, took = bytearray(700), []
            for _ in range(30):
                t0 = time.perf_counter()
                conn.read("step_00000001/part.jsonl", 100, memoryview(out))
                took.append(time.perf_counter() - t0)
            assert bytes(out) == data[100:800]
        finally:
            conn.close()
    assert statistics.median(took) < 0.03, [round(t * 1000, 1) for t in took]  # the delayed ACK: >= 40 ms


@pytest.mark.multiprocess
def test_a_keeper_queues_every_rank_connecting_at_once(tmp_path):
    """After a failure every rank of a job may connect to a keeper at once: while the
    keeper cannot accept (stopped here), the kernel completes the handshakes of 64
    connections for it. With a short accept queue the excess attempts are dropped and
    retried a second later (1 s stalls seen in node-loss recoveries)."""
    import select
    import signal
    import socket

    from unickpt.snapshot.keeper_admin import ensure_keeper, stop_keeper

    from snapshot_helpers import kill_keeper

    root = str(tmp_path / "shm")
    doc = ensure_keeper(root, "queue")
    pid = int(doc["pid"])
    socks: list[socket.socket] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(64):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((doc["host"], int(doc["port"])))
            socks.append(s)
        pending = set(socks)
        deadline = 0.5
        while pending and deadline > 0:
            _, ready, _ = select.select([], list(pending), [], 0.05)
            deadline -= 0.05
            for s in ready:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                pending.discard(s)
        assert not pending, f"{len(pending)} of 64 connections not taken within 0.5 s"
    finally:
        os.kill(pid, signal.SIGCONT)
        for s in socks:
            s.close()
        stop_keeper(root)
        kill_keeper(root)
