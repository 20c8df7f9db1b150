"""The snapshot keeper: one process per node that owns the node's snapshots in host memory.

Started by the first local rank of a job (:func:`unickpt.snapshot.keeper_admin.ensure_keeper`),
in its own session, so it outlives a crashed trainer. It

* reaps the snapshot directories of other (dead) jobs under its shm root at start;
* watches its job directory: when a step's manifest appears (the step is committed on
  this node; the rank that wrote it wakes the keeper at once, else it looks every
  ``POLL_S``), it sends the stripes of its node's blob to the keepers that hold their
  group's parity (:mod:`.parity`: XOR, Reed-Solomon or plain copies), over TCP;
* encodes the stripes other keepers send it into the parity blocks it holds for the
  step, stored beside the data with their crc32c and every stripe's crc32c
  (``parity_g<group>_r<block>.bin`` / ``.json``);
* runs the per-step commit: once it holds its data and its parity it says so on the job's
  store when the step's manifest names one (:mod:`.store_commit`: O(N) requests a step),
  else to every keeper (``have``); a step is *whole* when all keepers said so, then older
  steps are deleted (retention: the newest whole step plus the steps in progress);
* serves byte ranges of its files to recovering trainers of any node (``read``/``blob``,
  sent with ``sendfile``), like every request only on a connection that proved the job's
  secret (:func:`.wire.challenge`; docs/SNAPSHOT.md, Security);
* flushes every whole step whose manifest names a durable directory into an ordinary
  checkpoint there, in the background (:mod:`.flush`): each keeper copies its node's
  files, the keeper of the step's node 0 commits the manifest once all are durable;
* on ``stop`` (the job ended cleanly) deletes the job's directory and exits.

Run as ``python -m unickpt.snapshot.keeper_server --root R --job J``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import socketserver
import sys
import threading
import time
from collections import Counter
from typing import Any

import crc32c as _crc
import numpy as np

from ..errors import SnapshotError
from ..storage.local import is_inside
from . import flush, paths, wire
from .store_commit import StoreCommit, StoreFlush, check_control, store_address
from .keeper_admin import keeper_alive, wake_address, wake_keeper
from .parity import blob_parts, code_name, encode, group_of, holders, read_blob, stripe_range, xor_into

POLL_S = 0.02
OWNER_CHECK_POLLS = 50  # about once a second


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} keeper[{os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _write_atomic(path: str, data: bytes | memoryview) -> None:
    """Write ``path`` whole or not at all; whatever is in its place (a directory too) is replaced."""
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.replace(tmp, path)
    except IsADirectoryError:
        paths.clear(path)
        os.replace(tmp, path)


def node_files(sdir: str) -> list[tuple[str, int]]:
    """(name, size) of the rank files a node holds for a step, in blob order."""
    return [(n, os.path.getsize(os.path.join(sdir, n))) for n in paths.data_files(sdir)]


class _WakeSocket:
    """Where the ranks of the keeper's node say that a step committed (:func:`wake_keeper`):
    the watch loop sleeps on it instead of sleeping ``POLL_S``, so a committed step is taken
    up at once (at 10 ms steps, two more committed in a 20 ms nap and the next snapshot was
    skipped). Without it (the address taken, no abstract sockets) the loop only polls."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return
        try:
            sock.bind(wake_address(os.getpid()))
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            _log(f"no wake-up socket ({e.strerror or e}): committed steps are looked for every {POLL_S} s")
            return
        self.sock = sock
        self.poller = select.poll()  # not select(): a keeper may hold over 1024 connections
        self.poller.register(sock, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Sleep until a wake-up or ``timeout`` seconds, then take every wake-up queued
        (one look finds all the steps they announce). False without the socket."""
        if self.sock is None:
            return False
        self.poller.poll(timeout * 1000)
        while True:
            try:
                self.sock.recv(64)  # its content is not read: any datagram only wakes the loop
            except OSError:  # BlockingIOError: drained
                return True

    def close(self) -> None:
        """Release the address."""
        if self.sock is not None:
            self.sock.close()


class _Server(socketserver.ThreadingTCPServer):
    """The keeper's TCP server: a thread per connection, and an accept queue deep enough
    for every rank of the job connecting at once after a failure (at the default of 5,
    the kernel drops the excess connection attempts, each then retried a second later)."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024


class Keeper:
    """The keeper's state: stripes received, steps announced and whole, the server."""

    def __init__(self, root: str, job: str, host: str) -> None:
        self.root, self.job, self.host = root, job, host
        self.jdir = paths.job_dir(root, job)
        self.lock = threading.Lock()
        # held by a poll while it picks the next step, and by a reset throughout: a poll between
        # the reset's forgetting and its deleting would take the abandoned steps for seen again,
        # and the new timeline's steps up to them would never be processed
        self.poll_lock = threading.Lock()
        # held while files are added to the job's directory, and by the clean end while it
        # deletes it: a peer's late stripe must not recreate what the end removed
        self.tree_lock = threading.Lock()
        self.partial: dict[tuple[int, int, int], dict[str, Any]] = {}  # (step, group, r) -> stripes so far
        self.groups_stored: dict[int, set[tuple[int, int]]] = {}  # step -> (group, r) of the blocks stored
        self.haves: dict[int, set[int]] = {}
        self.sent: set[int] = set()
        self.stored: set[int] = set()
        self.announced: set[int] = set()
        self.seen: set[int] = set()
        self.whole_step = -1
        self.cond = threading.Condition(self.lock)
        self.pinned: int | None = None  # the newest whole step due for a flush: kept until flushed
        self.copying: set[int] = set()  # steps whose files this keeper is copying to the durable tier
        self.reports: dict[int, dict[int, dict[str, Any]]] = {}  # flush step -> node -> its report
        self.flushing = False  # this keeper coordinates a flush now (one at a time)
        self.workers: list[threading.Thread] = []
        self.peers: dict[int, list[dict[str, Any]]] = {}
        self.conns: dict[tuple[str, int], wire.Connection] = {}
        self.planes: dict[tuple[str, str], StoreCommit] = {}  # (store, prefix) -> this keeper's commit there
        self.flush_ops: Counter[str] = Counter()  # requests sent to stores for flushes
        self.control_of: dict[int, Any] = {}  # step -> the control entry of its manifest (unchecked)
        self.calls: Counter[str] = Counter()  # requests sent to other keepers, by op ("connect": connections opened)
        self.stopping = threading.Event()
        self.server: _Server | None = None
        self.port = 0

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        """Reap other jobs' snapshots, listen, publish the address and pid."""
        base = paths.base_dir(self.root)
        paths.make_private(self.root)
        os.makedirs(self.jdir, mode=0o700, exist_ok=True)
        for name in os.listdir(base):
            full = os.path.join(base, name)
            if name != self.job and os.path.isdir(full):
                _log(f"reaping stale snapshots of job {name!r}")
                paths.remove_tree(full)
        keeper = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                keeper.handle_connection(self.request)

        self.server = _Server((self.host, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="keeper-server", daemon=True).start()
        if store_address():  # the job commits on a store: its client (torch) loaded before the first step needs it
            threading.Thread(target=_load_store_client, name="keeper-import", daemon=True).start()
        doc = {"pid": os.getpid(), "host": self.host, "port": self.port, "job": self.job}
        _write_atomic(paths.address_file(self.root), paths.seal(doc))
        _write_atomic(paths.pid_file(self.root), f"{os.getpid()}\n".encode())
        _log(f"serving job {self.job!r} on {self.host}:{self.port}")

    def run(self) -> None:
        """Watch for committed steps until stopped, or until the shm root no longer names
        this keeper (the root deleted, by hand or as a lost node's: nothing is left to
        serve, and the process must not linger and block the root for the next job)."""
        polls = 0
        wake = _WakeSocket()
        while not self.stopping.is_set():
            try:
                self.poll()
            except Exception as e:  # a keeper must not die of one bad step
                _log(f"error: {type(e).__name__}: {e}")
            polls += 1
            if polls % OWNER_CHECK_POLLS == 0 and not self.owns_root():
                _log(f"{paths.pid_file(self.root)} no longer names this keeper: exiting")
                return
            if not wake.wait(POLL_S):
                self.stopping.wait(POLL_S)
        wake.close()
        for t in list(self.workers):  # a flush in flight is finished (or given up) first
            t.join(flush.FLUSH_TIMEOUT_S)
        self.shutdown()

    def owns_root(self) -> bool:
        """True while the shm root is this keeper's: its pid file is there and names this
        process, or names no live keeper (a garbled pid file: it is written again). False
        once the pid file is gone or names another live keeper (one started in its place)."""
        path = paths.pid_file(self.root)
        if not os.path.lexists(path):
            return False
        try:
            text = paths.read_regular(path, 64).decode("ascii").strip()
            if text == str(os.getpid()):
                return True
            if text.isdigit() and keeper_alive(int(text)):
                return False
        except FileNotFoundError:  # deleted since the look above: the root is being deleted
            return False
        except (OSError, ValueError):
            pass
        try:
            _write_atomic(path, f"{os.getpid()}\n".encode())
        except FileNotFoundError:  # its directory went meanwhile: the root is being deleted
            return False
        _log(f"{path} was garbled: written again")
        return True

    def shutdown(self) -> None:
        """Delete the job's snapshots and this keeper's files (clean end of the job)."""
        with self.tree_lock:  # self.stopping is set: no writer adds files after this
            paths.remove_tree(self.jdir)
        try:
            os.unlink(os.path.join(paths.base_dir(self.root), "keeper.log"))
        except FileNotFoundError:
            pass
        for f in (paths.address_file(self.root), paths.pid_file(self.root)):
            try:
                if str(os.getpid()).encode() in paths.read_regular(f, 4096):
                    os.unlink(f)
            except OSError:
                pass
        try:
            os.rmdir(paths.base_dir(self.root))
        except OSError:
            pass

    # -- committed steps --------------------------------------------------------------
    def poll(self) -> None:
        """Process the newest committed step not seen yet (older unseen ones are skipped)."""
        with self.poll_lock:
            step = self._next_committed()
        if step is not None:
            self.process(step, paths.step_dir(self.root, self.job, step))

    def _next_committed(self) -> int | None:
        """The newest committed step not seen yet, now marked seen with every older one."""
        for step in reversed(paths.steps(self.jdir)):
            if step in self.seen or step <= self.whole_step:
                return None
            if os.path.exists(os.path.join(paths.step_dir(self.root, self.job, step), "manifest.json")):
                self.seen.update(s for s in paths.steps(self.jdir) if s <= step)
                return step
        return None

    def process(self, step: int, sdir: str) -> None:
        """Send this node's stripes of a committed step to the holders of their groups' parity."""
        snap = _snapshot_meta(sdir)
        if not snap:
            _log(f"step {step}: its manifest is unreadable or names no snapshot, left alone")
            return
        nodes, m = snap["nodes"], int(snap["parity"])
        me = self.my_index(nodes)
        if me is None:
            _log(f"step {step}: not among the step's keepers, left alone")
            return
        n = len(nodes)
        if m == 0 or n == 1:
            self.mark_whole(step)
            return
        k = int(snap.get("k", n - m))
        with self.lock:
            self.peers[step] = nodes
            if "control" in snap:
                self.control_of[step] = snap["control"]
        files = node_files(sdir)
        blob = sum(s for _, s in files)
        t0 = time.perf_counter()
        for s in range(k):
            g = group_of(me, s, n)
            lo, hi = stripe_range(blob, s, k)
            buf = memoryview(bytearray(hi - lo))
            read_blob(sdir, files, lo, buf)
            header = {"op": "stripe", "step": step, "from": me, "nodes": n, "group": g, "k": k, "m": m, "stripe": s,
                      "len": hi - lo, "crc": _crc.crc32c(buf), "files": files, "blob": blob, "peers": nodes}
            for r, j in enumerate(holders(g, m, n)):
                try:
                    self.call(nodes[j], dict(header, r=r, to=j), buf)
                except Exception as e:
                    _log(f"step {step}: cannot send stripe {s} to node {j}: {e}; the step will not be whole")
                    return
        _log(f"step {step}: sent {blob} bytes in {k} stripes to {m} holder(s) each ({code_name(k, m)}) "
             f"in {time.perf_counter() - t0:.3f} s")
        with self.lock:
            self.sent.add(step)
        self.maybe_announce(step)

    def my_index(self, nodes: list[dict[str, Any]]) -> int | None:
        """This keeper's node index in a step's keeper table, or None."""
        return next((i for i, p in enumerate(nodes) if p["port"] == self.port and p["pid"] == os.getpid()), None)

    def secret(self) -> bytes | None:
        """The job's secret, as the job's trainers stored it in this shm root (read again
        each time: a relaunched job may store it after this keeper started)."""
        return paths.read_secret(self.root, self.job)

    def call(self, peer: dict[str, Any], header: dict[str, Any], payload=None) -> dict[str, Any]:
        """One request to a peer keeper (connections are cached; a broken one is retried once)."""
        addr = (peer["host"], int(peer["port"]))
        for attempt in (0, 1):
            conn = self.conns.get(addr)
            try:
                if conn is None:
                    secret = self.secret()
                    if secret is None:
                        raise SnapshotError("this keeper holds no job secret to call its peers with")
                    self.calls["connect"] += 1
                    conn = self.conns[addr] = wire.Connection(*addr, secret)
                self.calls[str(header.get("op"))] += 1
                return conn.request(header, payload)[0]
            except Exception:
                self.conns.pop(addr, None)
                if conn is not None:
                    conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def plane_for(self, step: int, control: Any, me: int) -> StoreCommit | None:
        """This keeper's commit on the store a step's manifest names (connected on first use,
        with a thread waiting for whole steps); None when the entry is refused or the store
        cannot be reached (the step then commits by the direct round, reason logged)."""
        checked = check_control(control)
        if isinstance(checked, str):
            _log(f"step {step}: {checked}; the keepers tell each other directly")
            return None
        with self.lock:
            plane = self.planes.get(checked)
        if plane is not None:
            return plane
        try:
            plane = StoreCommit(*checked, me, f"{os.getpid()}-{self.port}")
        except Exception as e:
            _log(f"step {step}: cannot reach the store {checked[0]}: {type(e).__name__}: {e}; "
                 f"the keepers tell each other directly")
            return None
        with self.lock:
            old = list(self.planes.values())
            self.planes = {checked: plane}
        for p in old:  # a new prefix: the job's trainers started again (a new Snapshotter)
            p.closed = True
            self._forget_records(p, lambda s: False)
        threading.Thread(target=self.wait_whole, args=(plane,), name="keeper-whole", daemon=True).start()
        return plane

    def wait_whole(self, plane: StoreCommit) -> None:
        """The plane's waiter: mark every step the store says is whole, until stopped or
        replaced (the store gone: tried again every few seconds, said once)."""
        said = False
        while not self.stopping.is_set() and not plane.closed:
            try:
                step = plane.next_whole(_log)
                said = False
            except Exception as e:
                if not said:
                    _log(f"the store {plane.address} does not answer: {type(e).__name__}: {e}")
                    said = True
                self.stopping.wait(5.0)
                continue
            if step is None or plane.closed:
                continue
            if step > self.whole_step:
                self.mark_whole(step)
            self._forget_records(plane, lambda s, w=step: s > w, plane.next - 1)

    def _forget_records(self, plane: StoreCommit, keep, whole_index: int | None = None, counts: bool = False) -> None:
        """Delete this keeper's store records of the steps ``keep`` rejects (a store gone: left)."""
        try:
            plane.forget(keep, whole_index, counts)
        except Exception as e:
            _log(f"cannot delete records in the store {plane.address}: {type(e).__name__}: {e}")

    def maybe_announce(self, step: int) -> None:
        """Once this node holds its data and its parity of ``step``, say so on the step's
        store, or else tell every keeper."""
        with self.lock:
            if step in self.announced or step not in self.sent or step not in self.stored:
                return
            self.announced.add(step)
            nodes = self.peers[step]
            me = self.my_index(nodes)
            control = self.control_of.get(step)
        plane = self.plane_for(step, control, me) if control is not None and me is not None else None
        if plane is not None:
            try:
                plane.announce(step, len(nodes))
                return
            except Exception as e:
                _log(f"step {step}: the store {plane.address} failed: {type(e).__name__}: {e}; telling every keeper")
        for j, peer in enumerate(nodes):
            header = {"op": "have", "step": step, "node": me, "nodes": len(nodes)}
            if j == me:
                self.on_have(header)
                continue
            try:
                self.call(peer, header)
            except Exception as e:
                _log(f"step {step}: cannot tell node {j}: {e}")

    # -- requests ---------------------------------------------------------------------
    def handle_connection(self, sock) -> None:
        """Serve requests on one connection until it closes, once the client proved the
        job's secret."""
        try:
            # a reply is a header, then its payload, written one after the other: with Nagle's
            # algorithm the payload waited for the client's delayed ACK of the header, 40 ms a
            # request (a small read took 44 ms, not 0.4 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            refused = wire.challenge(sock, self.secret())
            if refused is not None:
                _log(f"connection from {_peer_name(sock)} refused: {refused}")
                return
            while True:
                header = wire.recv_header(sock)
                if header is None:
                    return
                payload = wire.recv_payload(sock, header)
                try:
                    parts = self.file_parts(header)
                    if parts is not None:
                        wire.send_file_parts(sock, {"ok": True}, parts)
                        continue
                    reply, data = self.dispatch(header, payload)
                    wire.send(sock, dict(reply, ok=True), data)
                except Exception as e:
                    wire.send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                if header.get("op") == "stop":
                    self.stopping.set()
                    wake_keeper(os.getpid())  # the watch loop ends now, not at its next look
                    return
        except (OSError, Exception) as e:
            if not self.stopping.is_set():
                _log(f"connection dropped: {e}")

    def file_parts(self, header: dict[str, Any]) -> list[tuple[str, int, int]] | None:
        """The file ranges a ``read`` or ``blob`` request asks for (sent with sendfile); None
        for other requests."""
        op = header.get("op")
        if op == "read":
            rel = str(header["path"])
            if not is_inside(rel):
                raise ValueError(f"refused path {rel!r}")
            return [(os.path.join(self.jdir, rel), int(header["offset"]), int(header["length"]))]
        if op == "blob":
            sdir = paths.step_dir(self.root, self.job, int(header["step"]))
            return blob_parts(sdir, node_files(sdir), int(header["offset"]), int(header["length"]))
        return None

    def dispatch(self, header: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], Any]:
        """Run one request other than a read; returns the reply header and payload."""
        op = header.get("op")
        if op == "ping":
            return {"pid": os.getpid(), "job": self.job}, None
        if op == "stop":
            return {}, None
        if op == "stripe":
            self.on_stripe(header, payload)
            return {}, None
        if op == "have":
            self.on_have(header)
            return {}, None
        if op == "reset":
            self.reset(int(header["keep_upto"]))
            return {}, None
        if op == "flush":
            self.on_flush(header)
            return {}, None
        if op == "flushed":
            self.on_flushed(header)
            return {}, None
        raise ValueError(f"unknown request {op!r}")

    def on_stripe(self, h: dict[str, Any], payload: memoryview) -> None:
        """Fold a received stripe into this node's parity block of its group (XOR: on
        arrival; Reed-Solomon and copies: once the group's k stripes are in); store the
        block with its record when complete."""
        step, n, g, r = int(h["step"]), int(h["nodes"]), int(h["group"]), int(h["r"])
        k, m = int(h["k"]), int(h["m"])
        if step <= self.whole_step or self.stopping.is_set():
            return
        with self.lock:
            part = self.partial.setdefault((step, g, r), {"acc": np.zeros(0, np.uint8), "blocks": {}, "members": {}})
            if m == 1 and k > 1:
                if part["acc"].size < payload.nbytes:
                    acc = np.zeros(payload.nbytes, np.uint8)
                    acc[: part["acc"].size] = part["acc"]
                    part["acc"] = acc
                xor_into(part["acc"], payload)
            else:
                part["blocks"][int(h["stripe"])] = payload
            part["members"][int(h["from"])] = {x: h[x] for x in ("stripe", "len", "crc", "files", "blob")}
            self.peers.setdefault(step, h["peers"])
            if len(part["members"]) < k:
                return
            del self.partial[(step, g, r)]
        t0 = time.perf_counter()
        data = part["acc"] if part["blocks"] == {} else encode(part["blocks"], k, m, r)
        part["blocks"].clear()
        meta = {"step": step, "group": g, "r": r, "k": k, "m": m, "holder": int(h["to"]), "nodes": n,
                "nbytes": int(data.nbytes), "crc": _crc.crc32c(data), "encode_s": time.perf_counter() - t0,
                "members": {str(i): x for i, x in part["members"].items()}, "peers": h["peers"]}
        sdir = paths.step_dir(self.root, self.job, step)
        with self.tree_lock:
            if self.stopping.is_set():
                return
            os.makedirs(sdir, exist_ok=True)
            _write_atomic(os.path.join(sdir, paths.parity_name(g, r, "bin")), data.data)
            _write_atomic(os.path.join(sdir, paths.parity_name(g, r, "json")), paths.seal(meta))
        with self.lock:
            got = self.groups_stored.setdefault(step, set())
            got.add((g, r))
            if len(got) < m:
                return
            self.stored.add(step)
        self.maybe_announce(step)

    def on_have(self, h: dict[str, Any]) -> None:
        """Record that a keeper holds its data and parity of a step; mark the step whole at n."""
        step = int(h["step"])
        with self.lock:
            got = self.haves.setdefault(step, set())
            got.add(int(h["node"]))
            whole = len(got) == int(h["nodes"])
        if whole:
            self.mark_whole(step)

    def _forget(self, drop) -> None:
        """Forget the in-progress records of the steps ``drop(step)`` selects (lock held)."""
        for d in (self.partial, self.haves, self.peers, self.groups_stored, self.control_of):
            for key in [key for key in d if drop(key[0] if isinstance(key, tuple) else key)]:
                del d[key]

    def reset(self, keep_upto: int) -> None:
        """Forget and delete the snapshots newer than ``keep_upto`` (a recovery resumed
        from that step: newer ones belong to an abandoned timeline)."""
        with self.poll_lock:
            self._reset(keep_upto)

    def _reset(self, keep_upto: int) -> None:
        with self.lock:
            self.whole_step = min(self.whole_step, keep_upto)
            self._forget(lambda s: s > keep_upto)
            for st in (self.sent, self.stored, self.announced, self.seen):
                st.difference_update({s for s in st if s > keep_upto})
            if self.pinned is not None and self.pinned > keep_upto:
                self.pinned = None
            planes = list(self.planes.values())
        for plane in planes:  # the abandoned timeline's records and counters: its steps are taken again
            self._forget_records(plane, lambda s: s <= keep_upto, counts=True)
        for step in paths.steps(self.jdir):
            if step > keep_upto:
                paths.remove_tree(paths.step_dir(self.root, self.job, step))
        _log(f"reset: snapshots after step {keep_upto} dropped")

    def mark_whole(self, step: int) -> None:
        """Mark ``step`` whole on this node and delete every older snapshot (retention),
        but the one a flush still needs; start the step's flush when it is due and this
        keeper is its coordinator (node 0 of the step)."""
        sdir = paths.step_dir(self.root, self.job, step)
        with self.tree_lock:
            if self.stopping.is_set() or not os.path.isdir(sdir):
                return
            _write_atomic(os.path.join(sdir, paths.WHOLE), b"")
        snap = _snapshot_meta(sdir)
        due = bool(snap.get("flush"))
        with self.lock:
            self.whole_step = max(self.whole_step, step)
            self._forget(lambda s: s < step)
            for st in (self.sent, self.stored, self.announced, self.seen):
                st.difference_update({s for s in st if s < step})
            if due:
                self.pinned = step
        self.retain()
        _log(f"step {step} whole (requests to other keepers so far: {dict(self.calls)}; "
             f"to the store: {self.store_ops()})")
        me = self.my_index(snap["nodes"]) if due else None
        if me == 0:
            self.start_flush(step, sdir, snap)
        elif me is not None:
            plane = self.flush_plane(step, snap, me)
            if plane is not None:  # the coordinator publishes the staging directory on the store
                with self.lock:
                    self.copying.add(step)
                self._spawn(self.serve_store_flush, step, sdir, snap, plane, me)

    def flush_plane(self, step: int, snap: dict[str, Any], me: int) -> StoreCommit | None:
        """The store a flush of ``step`` is coordinated on (the step's commit plane), or None:
        the coordinator then calls every keeper directly."""
        control = snap.get("control")
        return self.plane_for(step, control, me) if control is not None else None

    def store_ops(self) -> dict[str, int]:
        """Requests this keeper sent to its stores so far, by name."""
        with self.lock:
            planes = list(self.planes.values())
        return dict(sum((p.ops for p in planes), Counter()))

    def retain(self) -> None:
        """Delete the snapshots older than the newest whole step, except those a flush needs."""
        with self.lock:
            keep = self.copying | ({self.pinned} if self.pinned is not None else set())
            whole = self.whole_step
        for old in paths.steps(self.jdir):
            if old < whole and old not in keep:
                paths.remove_tree(paths.step_dir(self.root, self.job, old))

    # -- durable flush (see .flush) ---------------------------------------------------
    def _spawn(self, target, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name="keeper-flush", daemon=True)
        self.workers = [w for w in self.workers if w.is_alive()] + [t]
        t.start()

    def start_flush(self, step: int, sdir: str, snap: dict[str, Any]) -> None:
        """Coordinate the flush of whole step ``step`` in the background (one at a time:
        a step due while another flush runs is not flushed)."""
        with self.lock:
            if self.flushing:
                _log(f"step {step}: a flush is still running, this step is not flushed")
                return
            self.flushing = True
            self.copying.add(step)
            self.reports[step] = {}
        self._spawn(self.coordinate, step, sdir, snap)

    def coordinate(self, step: int, sdir: str, snap: dict[str, Any]) -> None:
        """The coordinator's flush: claim the checkpoint directory, have every keeper copy
        its files into the staging directory, commit the manifest once all reported them
        durable and complete; otherwise remove what was written."""
        from ..storage.transaction import DirectoryWrite

        nodes, target = snap["nodes"], str(snap["flush"])
        t0 = time.perf_counter()
        write, fl, published, failed = None, None, False, ""
        try:
            plane = self.flush_plane(step, snap, 0)
            fl = StoreFlush(plane.address, plane.prefix, step) if plane is not None else None
            docs = flush.documents(sdir)
            write = DirectoryWrite.begin(target, flush.MANIFEST, True, flush.checkpoint_file)
            staging = str(write.staging)
            if fl is not None:
                fl.publish(staging)
                published = True
                fl.report(self.copy_files(step, sdir, staging, 0), len(nodes))
                reports = fl.reports(flush.FLUSH_TIMEOUT_S)
            else:
                reports = self.coordinate_directly(step, sdir, staging, nodes)
            flush.check_reports(docs[flush.MANIFEST], reports, len(nodes))
            write.commit(docs)
            write = None
            _log(f"step {step} flushed to {target} in {time.perf_counter() - t0:.3f} s (requests to other keepers "
                 f"so far: {dict(self.calls)}; to the store for flushes: {dict(self.flush_ops + (fl.ops if fl else Counter()))})")
        except Exception as e:
            failed = f"step {step}: flush to {target} failed, nothing committed: {type(e).__name__}: {e}"
        finally:
            if write is not None:
                write.abort()
            if failed:  # said once what was written is removed: a reader of the log finds nothing left
                _log(failed)
            if fl is not None:
                self._end_store_flush(step, fl, published)
            with self.lock:
                self.reports.pop(step, None)
                self.flushing = False
            self.release(step)

    def _end_store_flush(self, step: int, fl: StoreFlush, published: bool) -> None:
        """The coordinator's end of a flush on the store: its keys deleted, or, when it gave
        up before publishing the staging directory, an empty one published (the keepers
        waiting for it give up too)."""
        try:
            if published:
                fl.clear()
            else:
                fl.publish("")
        except Exception as e:
            _log(f"step {step}: the store did not take the flush's end: {type(e).__name__}: {e}")
        with self.lock:
            self.flush_ops.update(fl.ops)

    def coordinate_directly(self, step: int, sdir: str, staging: str, nodes: list[dict[str, Any]]
                            ) -> dict[int, dict[str, Any]]:
        """Ask every keeper for its files (``flush``), copy this node's, and wait for their
        reports (``flushed``): node -> report."""
        for j, peer in enumerate(nodes):
            if j:
                self.call(peer, {"op": "flush", "step": step, "staging": staging, "node": j, "reply": nodes[0]})
        self.on_flushed(self.copy_files(step, sdir, staging, 0))
        deadline = time.monotonic() + flush.FLUSH_TIMEOUT_S
        with self.cond:
            got = self.reports[step]
            while len(got) < len(nodes) and not any(r.get("error") for r in got.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return dict(got)

    def serve_store_flush(self, step: int, sdir: str, snap: dict[str, Any], plane: StoreCommit, me: int) -> None:
        """A keeper's side of a flush on the store: wait for the staging directory, check it
        lies beside the step's flush target, copy this node's files, report."""
        try:
            fl = StoreFlush(plane.address, plane.prefix, step)
            try:
                staging = fl.staging(flush.FLUSH_TIMEOUT_S)
                if not staging:
                    _log(f"step {step}: the coordinator gave up the flush")
                    return
                report = self.copy_files(step, sdir, staging, me) if _inside(staging, os.path.dirname(str(snap["flush"]))) \
                    else {"node": me, "files": [], "error": f"refused: staging {staging[:200]!r} is not beside step "
                                                             f"{step}'s flush target"}
                fl.report(report, len(snap["nodes"]))
            finally:
                with self.lock:
                    self.flush_ops.update(fl.ops)
        except Exception as e:
            _log(f"step {step}: cannot take part in the flush on the store {plane.address}: {type(e).__name__}: {e}")
        finally:
            self.release(step)

    def copy_files(self, step: int, sdir: str, staging: str, node: int) -> dict[str, Any]:
        """Copy this node's files of ``step`` into ``staging``; the report for the coordinator."""
        report: dict[str, Any] = {"op": "flushed", "step": step, "node": node, "files": [], "error": None}
        try:
            if not os.path.isdir(sdir):
                raise FileNotFoundError(f"step {step} is no longer held by node {node}")
            report["files"] = flush.copy_files(sdir, staging, node_files(sdir))
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
        return report

    def on_flush(self, h: dict[str, Any]) -> None:
        """A coordinator asks for this node's files of a step: copy them in the background,
        then report."""
        step = int(h["step"])
        sdir = paths.step_dir(self.root, self.job, step)
        with self.lock:
            if not os.path.isdir(sdir):
                raise FileNotFoundError(f"step {step} is not held here")
            target = _snapshot_meta(sdir).get("flush")
            if not target or not _inside(str(h["staging"]), os.path.dirname(str(target))):
                raise ValueError(f"refused: staging {h['staging']!r} is not beside step {step}'s flush target {target!r}")
            self.copying.add(step)
        self._spawn(self.serve_flush, step, sdir, str(h["staging"]), int(h["node"]), h["reply"])

    def serve_flush(self, step: int, sdir: str, staging: str, node: int, reply: dict[str, Any]) -> None:
        """Copy this node's files of ``step`` and report to the coordinator."""
        try:
            report = self.copy_files(step, sdir, staging, node)
            self.call(reply, report)
        except Exception as e:
            _log(f"step {step}: cannot report the flush to the coordinator: {e}")
        finally:
            self.release(step)

    def on_flushed(self, h: dict[str, Any]) -> None:
        """A keeper's report on its files of a flush this keeper coordinates."""
        with self.cond:
            got = self.reports.get(int(h["step"]))
            if got is not None:
                got[int(h["node"])] = h
                self.cond.notify_all()

    def release(self, step: int) -> None:
        """A flush of ``step`` ended here: its snapshot is no longer kept for it."""
        with self.lock:
            self.copying.discard(step)
            if self.pinned == step:
                self.pinned = None
        self.retain()


def _load_store_client() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception as e:  # the step that names a store says why it cannot reach it
        _log(f"cannot load the store client: {type(e).__name__}: {e}")


def _peer_name(sock) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed socket"


def _inside(path: str, parent: str) -> bool:
    """True when ``path`` is ``parent`` or lies under it (symbolic links resolved)."""
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return os.path.commonpath([path, parent]) == parent


def _snapshot_meta(sdir: str) -> dict[str, Any]:
    """The ``snapshot`` metadata of a committed step's manifest ({} when unreadable)."""
    try:
        doc = json.loads(paths.read_regular(os.path.join(sdir, flush.MANIFEST)))
        snap = doc.get("metadata", {}).get("snapshot") if isinstance(doc, dict) else None
    except (OSError, ValueError, AttributeError):
        return {}
    return snap if isinstance(snap, dict) else {}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the keeper process."""
    p = argparse.ArgumentParser(prog="unickpt.snapshot.keeper_server")
    p.add_argument("--root", required=True, help="the node's shared-memory root")
    p.add_argument("--job", required=True, help="the job whose snapshots this keeper owns")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    args = p.parse_args(argv)
    keeper = Keeper(args.root, args.job, args.host)
    keeper.start()
    keeper.run()


if __name__ == "__main__":
    main()
