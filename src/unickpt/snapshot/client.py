"""The trainer's side of the snapshot tier: start the node's keeper, take snapshots.

:class:`Snapshotter` is made once per rank after the process group is up. Every
``every`` steps, :meth:`Snapshotter.snapshot` writes this rank's state into the node's
shared memory with :func:`unickpt.async_save` (``lazy=True``: the copy runs in the
background while the next step computes; call :meth:`Snapshotter.before_update` before
the optimizer changes the tensors). A snapshot is an ordinary unickpt checkpoint whose
manifest is committed on every node (``manifest_copy``); its metadata names the keepers
of the step, so each keeper knows where the parity of its node goes.

Snapshots are saved on their own async-save channel (``CHANNEL``): their own staging
buffer and gloo group, so a snapshot goes on at its own rhythm while a durable
``async_save`` of the trainer is still writing (host memory: one staging copy of the
rank's shard for each).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import torch

from ..api.async_save import AsyncSaveHandle, async_save, checkpoint_group
from ..engine.items import is_dtensor
from ..engine.state import PerRank, Sharded, flatten
from ..dist import all_gather_fixed, resolve_group
from ..errors import SnapshotError, UnickptError
from ..format.manifest import MANIFEST_NAME
from ..units import human_bytes
from . import paths, wire
from .parity import layout

KEEPER_START_S = 60.0
# The snapshots' own async-save channel: staging buffer, gloo group and save in flight
# apart from the trainer's durable saves, so a snapshot never waits for one.
CHANNEL = "snapshot"
KEEPER_HOST_ENV = "UNICKPT_KEEPER_HOST"
# node, is keeper's rank, port, pid, in-progress steps, used, rank, cap bytes, IPv4, and the
# job secret the node proposes (1: stored on the node already, 0: freshly drawn)
_INFO = struct.Struct(f"<iiiiiqqq4si{paths.SECRET_BYTES}s")
_WHERE = struct.Struct("<i16s")  # node, network identity


def keeper_host(host: str | None = None, several_machines: bool = False) -> str:
    """The IPv4 address this node's keeper listens on: ``host`` or $UNICKPT_KEEPER_HOST (an
    address, or a name that resolves to one); else 127.0.0.1 when the job runs on one
    machine (one loopback: the simulated nodes); else this machine's network address
    (:func:`network_address`)."""
    named = host or os.environ.get(KEEPER_HOST_ENV)
    if named:
        try:
            return socket.gethostbyname(named)
        except OSError as e:
            raise SnapshotError(f"the keeper host {named!r} (${KEEPER_HOST_ENV}) is not an IPv4 address or a name "
                                f"that resolves to one: {e.strerror or e}") from None
    if not several_machines:
        return "127.0.0.1"
    addr = network_address()
    if addr is None:
        raise SnapshotError(f"the job's nodes run on several machines and this one has no network address to offer "
                            f"its snapshot keeper on: set ${KEEPER_HOST_ENV} to its address on the cluster network")
    return addr


def network_address() -> str | None:
    """This machine's IPv4 address where the other machines reach it: on the route to the
    job's rendezvous host ($MASTER_ADDR, which torchrun sets) when that resolves to another
    machine, else on the default route (the rendezvous host's own machine, whose host name
    may resolve to a loopback address there); None without either."""
    targets = []
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            targets.append(socket.gethostbyname(master))
        except OSError:
            pass
    targets.append("198.51.100.1")  # a documentation address: only the default route's choice matters
    for target in targets:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # UDP: picks the route and its source address, sends nothing
                addr = probe.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def network_identity() -> bytes:
    """16 bytes that exactly the processes sharing one loopback interface share: this
    kernel's boot id and the network namespace (containers on one host have their own)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return hashlib.sha256(f"{boot}/{netns}".encode()).digest()[:16]


def unreachable_keepers(hosts: list[str], machines: list[bytes]) -> str | None:
    """Why keepers at ``hosts`` (by node) on ``machines`` cannot all reach each other, or
    None: a keeper listening on a loopback address serves only its own machine."""
    if len(set(machines)) < 2:
        return None
    local = [n for n, h in enumerate(hosts) if ipaddress.ip_address(h).is_loopback]
    if not local:
        return None
    which = ", ".join(map(str, local))
    return (f"the job's nodes run on {len(set(machines))} machines, but the snapshot keeper of node{'s' if len(local) > 1 else ''} "
            f"{which} listens on {hosts[local[0]]}, which the other machines cannot reach: set ${KEEPER_HOST_ENV} to each "
            f"node's address on the cluster network (or give torchrun a rendezvous endpoint that is not a loopback address)")


def job_id(ckpt_dir: str | None = None) -> str:
    """The job's name in the shm root: ``$UNICKPT_JOB_ID``, else derived from the durable
    checkpoint directory (stable across relaunches), else ``default``."""
    env = os.environ.get("UNICKPT_JOB_ID")
    if env:
        return env
    if ckpt_dir:
        return "job-" + hashlib.blake2b(os.path.abspath(ckpt_dir).encode(), digest_size=6).hexdigest()
    return "default"


def node_position() -> tuple[int, int]:
    """(node index, local rank) from torchrun's environment; one node when not under torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    return int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", str(rank)))


def _alive(pid: int) -> bool:
    """True when ``pid`` is a running (not zombie) keeper process."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"unickpt.snapshot.keeper" in f.read()
    except (FileNotFoundError, IndexError):
        return False


def running_keeper(root: str) -> dict[str, Any] | None:
    """The address document of the live keeper of this shm root, or None."""
    try:
        with open(paths.address_file(root)) as f:
            doc = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return doc if _alive(int(doc["pid"])) else None


_CHILDREN: list[subprocess.Popen] = []

# The keeper needs neither torch nor the rest of unickpt: it is started with a bare
# ``unickpt`` package (its __init__, which imports torch, is skipped), so it starts in a
# fraction of a second and holds no torch runtime in memory.
_KEEPER_BOOT = (
    "import sys, types; pkg = types.ModuleType('unickpt'); pkg.__path__ = [sys.argv.pop(1)]; "
    "sys.modules['unickpt'] = pkg; from unickpt.snapshot.keeper import main; main(sys.argv[1:])"
)


def ensure_keeper(root: str, job: str, host: str = "127.0.0.1") -> dict[str, Any]:
    """The node's keeper for ``job`` listening on ``host`` (started, detached in its own
    session, when none runs; one of the job on another address is replaced). A live keeper
    of another job on the same root is a SnapshotError."""
    for p in list(_CHILDREN):  # reap keepers this process started that have died
        if p.poll() is not None:
            _CHILDREN.remove(p)
    doc = running_keeper(root)
    if doc is not None:
        if doc["job"] != job:
            raise SnapshotError(
                f"the snapshot keeper (pid {doc['pid']}) in {root} serves job {doc['job']!r}, not {job!r}; "
                f"give each job its own UNICKPT_SHM_ROOT, or stop that keeper (kill {doc['pid']}: the snapshots it "
                f"holds are then deleted at the next keeper's start)"
            )
        if doc["host"] == host:
            return doc
        _replace_keeper(doc)
    paths.make_private(root)
    log_path = os.path.join(paths.base_dir(root), "keeper.log")
    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", _KEEPER_BOOT, package, "--root", root, "--job", job, "--host", host]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    log.close()
    _CHILDREN.append(proc)
    deadline = time.monotonic() + KEEPER_START_S
    while time.monotonic() < deadline:
        doc = running_keeper(root)
        if doc is not None and int(doc["pid"]) == proc.pid:
            return doc
        if proc.poll() is not None:
            raise SnapshotError(f"the snapshot keeper exited at start (code {proc.returncode}: {_last_line(log_path)}); "
                                f"see {log_path}")
        time.sleep(0.01)
    raise SnapshotError(f"the snapshot keeper did not start within {KEEPER_START_S:.0f} s; see {log_path}")


def _replace_keeper(doc: dict[str, Any]) -> None:
    """Stop a keeper of the job that listens on another address than this start asks for
    (a relaunch whose nodes are now on other machines); the snapshots it holds stay in the
    shm root for the keeper started in its place."""
    pid = int(doc["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KEEPER_START_S
    mine = [p for p in _CHILDREN if p.pid == pid]
    try:
        if mine:  # this process started it: wait for (and reap) it
            mine[0].wait(KEEPER_START_S)
            _CHILDREN.remove(mine[0])
        while _alive(pid):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(pid), KEEPER_START_S)
            time.sleep(0.01)
    except subprocess.TimeoutExpired:
        raise SnapshotError(f"the snapshot keeper (pid {pid}) listening on {doc['host']} did not exit on SIGTERM") from None


def _last_line(path: str) -> str:
    """The last line of a log file (what a keeper that died at start said last)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no log"


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in ``state`` (local shards of DTensors)."""
    total = 0
    for leaf in flatten(state):
        v = leaf.value
        if isinstance(v, PerRank):
            v = v.value
        if isinstance(v, Sharded):
            v = v.local
        if isinstance(v, torch.Tensor):
            if is_dtensor(v):
                v = v.to_local()
            total += v.numel() * v.element_size()
    return total


def in_progress(jdir: str, keepers: list[dict[str, Any]]) -> int:
    """Committed steps newer than the node's newest whole step whose parity is still
    running: steps whose keepers are all among ``keepers`` (the job's live ones; a step
    that names a keeper since replaced can never become whole and is not waited for)."""
    live = {(int(k["port"]), int(k["pid"])) for k in keepers}
    whole = [s for s in paths.steps(jdir) if os.path.exists(os.path.join(jdir, paths.step_name(s), paths.WHOLE))]
    newest_whole = max(whole, default=-1)
    count = 0
    for s in paths.steps(jdir):
        if s <= newest_whole:
            continue
        try:
            with open(os.path.join(jdir, paths.step_name(s), MANIFEST_NAME)) as f:
                nodes = ((json.load(f).get("metadata") or {}).get("snapshot") or {}).get("nodes", [])
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        count += all((int(k["port"]), int(k["pid"])) in live for k in nodes)
    return count


def default_max_bytes(root: str) -> int:
    """Half the size of the shm root's file system (tmpfs: half of what it may take of RAM)."""
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize // 2


class Snapshotter:
    """One rank's handle on the snapshot tier (collective methods: every rank calls them).

    ``parity`` M: parity blocks per group across nodes (1: XOR, M >= 2: Reed-Solomon,
    0: local memory only; default 1, or 0 with ``replicas``); ``replicas`` R >= 2: a full
    copy of each node's snapshot on the next R - 1 nodes instead (excludes M > 0). See
    :mod:`unickpt.snapshot.parity`."""

    def __init__(self, job: str, every: int, parity: int | None = None, *, root: str | None = None,
                 max_bytes: int | None = None, process_group: Any = None, host: str | None = None,
                 flush_every: int = 0, flush_dir: str | None = None, replicas: int = 1) -> None:
        if every < 1:
            raise SnapshotError(f"snapshot interval must be at least 1 step, not {every}")
        if flush_every < 0 or (flush_every and not flush_dir):
            raise SnapshotError("a durable flush needs a positive interval (in snapshots) and a checkpoint directory")
        self.job, self.every = job, every
        self.flush_every = flush_every
        self.flush_dir = os.path.abspath(flush_dir) if flush_dir else None
        self.root = root or paths.shm_root()
        self.jdir = paths.job_dir(self.root, job)
        if parity is None:  # XOR by default; none with copies on neighbours
            parity = 0 if replicas > 1 else 1
        layout(1 << 30, parity, replicas)  # a bad combination fails before any process starts
        self.process_group = process_group
        self.group = checkpoint_group(resolve_group(process_group), CHANNEL)
        self.node, self.local_rank = node_position()
        where = [_WHERE.unpack(b) for b in all_gather_fixed(self.group, _WHERE.pack(self.node, network_identity()))]
        self.machines = dict(where)  # node -> network identity
        self.host = keeper_host(host, len(set(self.machines.values())) > 1)
        self.keeper: dict[str, Any] | None = None
        if self.local_rank == 0:
            try:
                if os.path.exists(self.root) and not os.path.isdir(self.root):
                    raise NotADirectoryError(0, "not a directory")
                os.makedirs(self.root, exist_ok=True)
                paths.make_private(self.root)
            except OSError as e:
                raise SnapshotError(f"the shm root {self.root} (${paths.SHM_ROOT_ENV}) cannot hold snapshots: "
                                    f"{e.strerror or e}") from None
            self.keeper = ensure_keeper(self.root, job, self.host)
        self.max_bytes = max_bytes
        self.requested_parity, self.replicas = parity, replicas
        self.secret: bytes | None = None
        self.table = self._exchange(0)[0]  # also agrees on the job's secret (self.secret)
        if self.local_rank == 0 and paths.read_secret(self.root, job) != self.secret:
            paths.write_secret(self.root, job, self.secret)
        self.k, self.parity = layout(len(self.table), parity, replicas)
        asked = replicas - 1 if replicas > 1 else parity
        if self.parity < asked and self.group.rank == 0:
            what = (f"{self.nodes} nodes hold at most {self.parity} parity block(s) per group: snapshots protected "
                    f"against {self.parity} lost node(s), not {asked}" if self.nodes > 1 else
                    "one node: snapshots survive a crashed process, not the loss of the node (protection "
                    "against lost nodes needs 2 nodes or more)")
            print(f"unickpt: {what}", file=sys.stderr, flush=True)
        self.handle: AsyncSaveHandle | None = None
        self.stall_s = 0.0  # seconds the training loop spent in snapshot() and before_update()
        self.taken = 0
        self.skipped = 0
        self.failures: list[str] = []

    @property
    def nodes(self) -> int:
        """Number of nodes of the job."""
        return len(self.table)

    def due(self, step: int) -> bool:
        """True when ``step`` is a snapshot step."""
        return step % self.every == 0

    def flush_due(self, step: int) -> bool:
        """True when the snapshot of ``step`` is to be flushed to the durable tier (every
        ``flush_every``-th snapshot step)."""
        return bool(self.flush_every) and step % (self.every * self.flush_every) == 0

    def _exchange(self, rank_bytes: int) -> tuple[list[dict[str, Any]], list[tuple[int, ...]]]:
        """Collective: every rank's node, keeper and memory figures; the keeper table by node.
        The first time, also the job's secret: the one stored on the lowest node that holds
        one (a relaunch keeps it, whichever nodes survived), else one the first node drew."""
        mine = (self.node, 0, 0, 0, 0, 0, rank_bytes, 0, b"\0" * 4, 0, b"\0" * paths.SECRET_BYTES)
        if self.local_rank == 0:
            self.keeper = ensure_keeper(self.root, self.job, self.host)  # a killed keeper is recreated here
            used = paths.dir_bytes(self.jdir)
            cap = self.max_bytes if self.max_bytes is not None else default_max_bytes(self.root)
            pending = in_progress(self.jdir, getattr(self, "table", []))
            stored = self.secret or paths.read_secret(self.root, self.job)
            proposal = (1, stored) if stored else (0, secrets.token_bytes(paths.SECRET_BYTES))
            mine = (self.node, 1, int(self.keeper["port"]), int(self.keeper["pid"]), pending, used, rank_bytes,
                    cap, socket.inet_aton(self.keeper["host"]), *proposal)
        rows = [_INFO.unpack(b) for b in all_gather_fixed(self.group, _INFO.pack(*mine))]
        keepers = {r[0]: r for r in rows if r[1]}
        if sorted(keepers) != list(range(len(keepers))) or {r[0] for r in rows} != set(keepers):
            raise SnapshotError(f"every node needs one local rank 0; got nodes {sorted({r[0] for r in rows})}")
        if self.secret is None:
            proposals = [keepers[n] for n in sorted(keepers)]
            self.secret = next((r[10] for r in proposals if r[9]), proposals[0][10])
        table = [{"host": socket.inet_ntoa(keepers[n][8]), "port": keepers[n][2], "pid": keepers[n][3]} for n in sorted(keepers)]
        why = unreachable_keepers([t["host"] for t in table], [self.machines.get(n, b"") for n in sorted(keepers)])
        if why:
            raise SnapshotError(why)
        return table, rows

    def snapshot(self, state: dict[str, Any], step: int, flush: bool = True) -> AsyncSaveHandle | None:
        """Snapshot ``state`` as of ``step`` (collective). Returns the save's handle, or None
        when skipped because the keepers still encode two earlier snapshots. Raises
        SnapshotError when the snapshot would exceed ``max_bytes`` of host memory on a node.
        When the step is due for a flush (and ``flush``: pass False when the trainer writes
        this step's durable checkpoint itself), the keepers write it, once whole, as an
        ordinary checkpoint ``<flush_dir>/step_XXXXXXXX`` in the background."""
        t0 = time.perf_counter()
        try:
            return self._snapshot(state, step, flush)
        finally:
            self.stall_s += time.perf_counter() - t0

    def _snapshot(self, state: dict[str, Any], step: int, flush: bool) -> AsyncSaveHandle | None:
        self.settle()
        self.table, rows = self._exchange(state_bytes(state))
        if any(r[4] >= 2 for r in rows if r[1]):
            self.skipped += 1
            return None
        k = self.k
        for n in range(self.nodes):
            node_bytes = sum(r[6] for r in rows if r[0] == n)
            used, cap = next((r[5], r[7]) for r in rows if r[0] == n and r[1])
            need = used + node_bytes + (node_bytes * self.parity) // k
            if need > cap:
                raise SnapshotError(
                    f"snapshot of step {step} would hold {human_bytes(need)} of host memory on node {n} "
                    f"({human_bytes(used)} held now + {human_bytes(node_bytes)} of state, parity {self.parity}), "
                    f"above the cap of {human_bytes(cap)}; raise max_bytes or snapshot less state"
                )
        meta = {"snapshot": {"step": step, "job": self.job, "parity": self.parity, "k": self.k,
                             "replicas": self.replicas, "nodes": self.table}}
        if flush and self.flush_due(step) and self.flush_dir:
            meta["snapshot"]["flush"] = os.path.join(self.flush_dir, f"step_{step:08d}")
        path = paths.step_dir(self.root, self.job, step)
        self.handle = async_save(state, path, lazy=True, metadata=meta, overwrite=True, manifest_copy=self.local_rank == 0,
                                 process_group=self.process_group, channel=CHANNEL)
        self.taken += 1
        return self.handle

    def before_update(self) -> None:
        """Block until the snapshot in flight has copied the state (call before the
        optimizer or anything else changes saved tensors in place)."""
        if self.handle is not None:
            t0 = time.perf_counter()
            self.handle.wait_staged()
            self.stall_s += time.perf_counter() - t0

    def settle(self) -> None:
        """Wait for the snapshot in flight; its failure is recorded, never raised (a failed
        snapshot must not stop training: the next one replaces it)."""
        if self.handle is None:
            return
        try:
            self.handle.result()
        except UnickptError as e:
            self.failures.append(str(e))
            if self.group.rank == 0:
                print(f"unickpt: snapshot failed, training goes on: {e}", file=sys.stderr, flush=True)
        self.handle = None

    def close(self, clean: bool = True) -> None:
        """Finish the snapshot in flight; on a clean end of the job, stop the node's keeper,
        which deletes the job's snapshots (no shared memory is left behind)."""
        self.settle()
        if not clean:
            return
        all_gather_fixed(self.group, b"\x01")  # every rank is done with the snapshots
        if self.local_rank == 0:
            stop_keeper(self.root)


def stop_keeper(root: str, timeout: float = 30.0) -> None:
    """Ask the keeper of ``root`` to delete its job's snapshots and exit, and wait for it."""
    doc = running_keeper(root)
    if doc is None:
        return
    secret = paths.read_secret(root, str(doc["job"]))
    try:
        if secret is None:  # a keeper never given its job's secret (a start that failed): it holds nothing
            os.kill(int(doc["pid"]), signal.SIGTERM)
        else:
            conn = wire.Connection(doc["host"], int(doc["port"]), secret)
            try:
                conn.request({"op": "stop"})
            finally:
                conn.close()
    except (SnapshotError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(int(doc["pid"])):
        for p in _CHILDREN:
            p.poll()
        time.sleep(0.01)
