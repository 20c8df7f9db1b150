"""The trainer's side of the snapshot tier: take snapshots (the node's keeper is started
through :mod:`unickpt.snapshot.keeper_admin`).

:class:`Snapshotter` is made once per rank after the process group is up. Every
``every`` steps, :meth:`Snapshotter.snapshot` writes this rank's state into the node's
shared memory with :func:`unickpt.async_save` (``lazy=True``: the copy runs in the
background while the next step computes; call :meth:`Snapshotter.before_update` before
the optimizer changes the tensors). A snapshot is an ordinary unickpt checkpoint whose
manifest is indexed (format 2.0): its root is committed on every node, its index cut into
one part per node, each kept by its node and the next ``parity`` nodes
(:func:`index_parts`); its metadata names the keepers of the step, so each keeper knows
where the parity of its node goes.

Snapshots are saved on their own async-save channel (``CHANNEL``): their own staging
buffer and gloo group, so a snapshot goes on at its own rhythm while a durable
``async_save`` of the trainer is still writing (host memory: one staging copy of the
rank's shard for each).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from functools import partial
from typing import Any, NamedTuple

import torch

from ..engine.background_save import AsyncSaveHandle, checkpoint_group, start_save
from ..engine.collect import FlatState, flatten_state
from ..engine.gc_pause import gc_paused
from ..engine.targets import IndexParts, NodeCopies
from ..engine.items import is_dtensor
from ..engine.save_options import SaveOptions
from ..engine.ring import RING_DIR, MappedRing, sweep
from ..engine.state import PerRank, Sharded, flatten
from ..dist import Group, all_gather_fixed, resolve_group
from ..errors import SnapshotError, UnickptError
from ..format.manifest import MANIFEST_NAME
from ..logs import log
from ..units import human_bytes
from . import paths
from .options import SnapshotOptions
from .keeper_admin import (KeeperSeen, ensure_keeper, keeper_host, network_identity, stop_keeper, unreachable_keepers,
                           wake_keeper)
from .parity import layout
from .store_commit import control_doc, store_address

# The snapshots' own async-save channel: staging buffer, gloo group and save in flight
# apart from the trainer's durable saves, so a snapshot never waits for one.
CHANNEL = "snapshot"
WRITES = SaveOptions()  # how each rank's snapshot file is written: the writers' defaults
# node, is keeper's rank, port, pid, in-progress steps, used, rank, cap bytes, IPv4, the
# job secret the node proposes (1: stored on the node already, 0: freshly drawn), and
# whether the rank's ring has a slot for the next snapshot
_INFO = struct.Struct(f"<iiiiiqqq4si{paths.SECRET_BYTES}sii")  # a RankInfo
# the slots of a rank's ring: the newest whole step, one step whose parity still runs, and
# the step being written (a snapshot is skipped while the keepers encode two)
RING_SLOTS = 3
# steps whose parity blocks a node holds at once: the newest whole one and two in progress
PARITY_STEPS = 3


class RankInfo(NamedTuple):
    """What each rank tells the others before a snapshot (``_exchange``); the keeper's
    members are zero except on a node's local rank 0."""

    node: int
    has_keeper: int  # 1 on a node's local rank 0, which speaks for the node's keeper
    port: int
    pid: int
    pending: int  # committed steps whose parity is still running
    used: int  # bytes the node's snapshots hold
    rank_bytes: int  # bytes of this rank's state
    cap: int  # the node's cap on snapshot memory
    host: bytes  # the keeper's IPv4 address (4 bytes)
    secret_stored: int  # 1 when ``secret`` is the job's stored secret, 0 when newly drawn
    secret: bytes
    ring_free: int = 1  # 1 when the rank's ring has a slot for the next snapshot
    failed: int = 0  # 1 when this rank could not make its part (raised on every rank once told)


_WHERE = struct.Struct("<i16s")  # node, network identity
# a planned stop (close(clean=False)) waits for the keepers' parity: 2 s, plus a second for
# every WHOLE_WAIT_RATE bytes of the node's last snapshot (parity encodes at 0.4 GB/s and more)
WHOLE_WAIT_S = 2.0
WHOLE_WAIT_RATE = 256 << 20


def job_id(ckpt_dir: str | None = None) -> str:
    """The job's name in the shm root: ``$UNICKPT_JOB_ID``, else derived from the durable
    checkpoint directory (stable across relaunches), else ``default``."""
    env = os.environ.get("UNICKPT_JOB_ID")
    if env:
        return env
    if ckpt_dir:
        return "job-" + hashlib.blake2b(os.path.abspath(ckpt_dir).encode(), digest_size=6).hexdigest()
    return "default"


def node_position(rank: int | None = None) -> tuple[int, int]:
    """(node index, local rank) from torchrun's environment; one node when not under
    torchrun, where the local rank is ``$RANK``, else ``rank`` (the process group's: ranks
    spawned by other launchers, such as ``unickpt.testing.run_ranks``, set no variable)."""
    fallback = os.environ.get("RANK", str(rank or 0))
    return int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", fallback))


def local_tensors(state: dict[str, Any] | FlatState) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor this rank holds in ``state`` (or in a state flattened already), by
    name: a per-rank value's, a ``Sharded``'s local part, a DTensor's local shard."""
    for leaf in state.leaves if isinstance(state, FlatState) else flatten(state):
        v = leaf.value
        if isinstance(v, PerRank):
            v = v.value
        if isinstance(v, Sharded):
            v = v.local
        if isinstance(v, torch.Tensor):
            yield leaf.name, (v.to_local() if is_dtensor(v) else v)


def state_bytes(state: dict[str, Any] | FlatState) -> int:
    """Bytes of the tensors this rank holds in ``state`` (local shards of DTensors)."""
    return sum(v.numel() * v.element_size() for _, v in local_tensors(state))


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
        try:  # the shm root's bytes are not trusted: an unreadable manifest is no step in progress
            doc = json.loads(paths.read_regular(os.path.join(jdir, paths.step_name(s), MANIFEST_NAME)))
            nodes = doc["metadata"]["snapshot"]["nodes"]
            count += all((int(k["port"]), int(k["pid"])) in live for k in nodes)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    return count


def default_max_bytes(root: str, held: int = 0) -> int:
    """Half the size of the shm root's file system (tmpfs: half of what it may take of RAM),
    and no more than the node can give the snapshots now (:func:`host_memory`; ``held``:
    what the job's snapshots already hold there)."""
    st = os.statvfs(_existing(root))
    return min(st.f_blocks * st.f_frsize // 2, host_memory(root)["available"] + held)


def _existing(path: str) -> str:
    """``path``, or its nearest parent that exists (a shm root is made at the first start)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def mem_available() -> int | None:
    """The kernel's estimate of the memory available without swapping (``MemAvailable``
    of /proc/meminfo), in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory(root: str) -> dict[str, int]:
    """What the node can give snapshots now: ``shm_free`` (free space of the shm root's
    file system), ``mem_available`` (MemAvailable; the shm free space where unknown) and
    ``available``, the smaller: a tmpfs page is RAM, whatever the file system's size says."""
    st = os.statvfs(_existing(root))
    free = st.f_bavail * st.f_frsize
    mem = mem_available()
    mem = free if mem is None else mem
    return {"shm_free": free, "mem_available": mem, "available": min(free, mem)}


def check_host_memory(root: str, job: str, cap: int | None, said: str = "max_bytes") -> None:
    """Raise SnapshotError when the node cannot give the snapshots ``cap`` bytes of host
    memory (the free space of the shm root and MemAvailable, plus what the job's snapshots
    already hold there, which a relaunch reuses): called when the manager is made, so
    that a node without the memory fails at once, not at a later step. ``said`` names the
    option as the user wrote it."""
    if cap is None:
        return
    mem = host_memory(root)
    held = paths.dir_bytes(paths.job_dir(root, job))
    if cap > mem["available"] + held:
        raise SnapshotError(
            f"{said}={cap} ({human_bytes(cap)}) is more host memory than this node can give the snapshots: "
            f"{human_bytes(mem['shm_free'])} free in the shm root {root}, {human_bytes(mem['mem_available'])} "
            f"available (MemAvailable)" + (f", {human_bytes(held)} held by the job's snapshots already" if held else "")
            + f"; lower {said}, or free memory (`unickpt snapshots {root} --free` frees what a killed job left)")


def memory_plan(rank_bytes: list[int], parity: int, k: int) -> dict[str, int]:
    """The host memory a node's snapshots hold at most, from its ranks' state bytes: the
    ranks' rings (``RING_SLOTS`` copies of each rank's state, taken once), and the parity
    blocks (or neighbours' copies) it holds for ``PARITY_STEPS`` steps at once."""
    state = sum(rank_bytes)
    ring = RING_SLOTS * state
    par = PARITY_STEPS * (state * parity) // max(k, 1)
    return {"state": state, "ring": ring, "parity": par, "total": ring + par, "ring_slots": RING_SLOTS}


def estimated_file_bytes(state: dict[str, Any], rank: int) -> tuple[int, bool]:
    """The size of the rank file a snapshot of ``state`` writes when the rank writes every
    tensor it holds (exact then; else the first snapshot resizes the ring's slot), and
    whether any tensor is on CUDA."""
    from ..engine.writer import data_file_layout

    class _Item(NamedTuple):
        name: str
        local: torch.Tensor

    items = [_Item(name, v.detach()) for name, v in local_tensors(state)]
    cuda = any(item.local.is_cuda for item in items)
    return data_file_layout(rank, items)[2], cuda and torch.cuda.is_available()  # type: ignore[arg-type]


def index_parts(rows: list[RankInfo], nodes: int, parity: int) -> IndexParts:
    """Where a snapshot's manifest goes (format 2.0, docs/SCALE.md): the root on every
    node; its index cut into one part per node, part ``j`` kept by node ``j`` (its local
    rank 0) and copied on the next ``parity`` nodes (as many nodes may be lost as the
    parity rebuilds); node 0, whose keeper coordinates flushes, keeps the whole index."""
    copies = min(parity, nodes - 1)
    return IndexParts(nodes, tuple(tuple(sorted({(r.node - c) % nodes for c in range(copies + 1)})) if r.has_keeper else ()
                                   for r in rows))


_WARNED = ".parity-warned"  # in a job's shm folder: the job's protection warning was printed


def _first_warning(jdir: str) -> bool:
    """True the first time a job (its shm folder, which a relaunch and every re-forming
    keep) warns about the protection it cannot have: once per job, not at every start."""
    try:
        os.makedirs(jdir, exist_ok=True)
        with open(os.path.join(jdir, _WARNED), "x"):
            return True
    except FileExistsError:
        return False
    except OSError:
        return True


class Snapshotter:
    """One rank's handle on the snapshot tier (collective methods: every rank calls them),
    configured by one :class:`~unickpt.SnapshotOptions` (checked when it was built):
    a snapshot every ``every`` steps; ``parity`` M: parity blocks per group across nodes
    (1: XOR, M >= 2: Reed-Solomon, 0: local memory only; default 1, or 0 with
    ``replicas``); ``replicas`` R >= 2: a full copy of each node's snapshot on the next
    R - 1 nodes instead; ``stripes``: the most data stripes in a parity group (memory
    ``1 + M/k``; a lost byte is rebuilt from ``k`` bytes); ``max_bytes``: the cap on the
    node's host memory; ``flush_every`` F: every Fth snapshot written by the keepers as a
    checkpoint under ``flush_dir``. See :mod:`unickpt.snapshot.parity`.

    Args:
        job: The job's name in the shm root (:func:`job_id`).
        options: The snapshots' options (``every`` at least 1).
        root: The shm root (None: ``$UNICKPT_SHM_ROOT`` or ``/dev/shm``).
        process_group: The job's group (default: the default group).
        host: The address the keepers listen on (None: chosen).
        flush_dir: Where flushed snapshots go (needed with ``flush_every``).
        position: This rank's (node index, local rank): the node whose keeper holds its
            snapshots (None: from torchrun's environment, see :func:`node_position`;
            ``unickpt.run``'s world passes it through the manager).

    Raises:
        SnapshotError: No snapshot interval, a flush without ``flush_dir``, an shm root
            that cannot hold snapshots, unreachable keepers.
    """

    def __init__(self, job: str, options: SnapshotOptions, *, root: str | None = None, process_group: Any = None,
                 host: str | None = None, flush_dir: str | None = None, position: tuple[int, int] | None = None) -> None:
        if not isinstance(options, SnapshotOptions):
            raise SnapshotError(f"Snapshotter takes a SnapshotOptions, not {type(options).__name__} ({options!r})")
        if not options.every:
            raise SnapshotError("a Snapshotter needs SnapshotOptions.every of at least 1 step, not 0")
        if options.flush_every and not flush_dir:
            raise SnapshotError("SnapshotOptions.flush_every needs a checkpoint directory (flush_dir)")
        self.job, self.options = job, options
        self.flush_dir = os.path.abspath(flush_dir) if flush_dir else None
        self.root = root or paths.shm_root()
        self.jdir = paths.job_dir(self.root, job)
        replicas = options.replicas
        user_set = options.parity is not None or replicas > 1  # the default's protection is not warned about
        parity = (0 if replicas > 1 else 1) if options.parity is None else options.parity  # XOR by default
        self.process_group = process_group
        self.group = checkpoint_group(resolve_group(process_group), CHANNEL)
        self.node, self.local_rank = position if position is not None else node_position(self.group.rank)
        where = [_WHERE.unpack(b) for b in all_gather_fixed(self.group, _WHERE.pack(self.node, network_identity()))]
        self.machines = dict(where)  # node -> network identity
        self.host = keeper_host(host, len(set(self.machines.values())) > 1)
        self.keeper: dict[str, Any] | None = None
        self._seen: KeeperSeen | None = None  # the keeper last ensured, watched (a poll a snapshot)
        self._default_cap: int | None = None  # without max_bytes: fixed at the first look (_cap)
        self.secret: bytes | None = None
        setup: Exception | None = None
        if self.local_rank == 0:
            try:
                self._prepare_root()
            except Exception as e:  # raised in the exchange, on every rank
                setup = e
        # the exchange starts the node's keeper and agrees on the job's secret (self.secret)
        self.table = self._exchange(None, setup)[0]
        why = unreachable_keepers([t["host"] for t in self.table], [self.machines[n] for n in range(len(self.table))])
        if why:  # every keeper listens on self.host for the Snapshotter's life: checked once
            raise SnapshotError(why)
        if self.local_rank == 0 and paths.read_secret(self.root, job) != self.secret:
            paths.write_secret(self.root, job, self.secret)
        self.k, self.parity = layout(len(self.table), parity, replicas, options.stripes)
        # the keepers' commit on the job's store (.store_commit), under a prefix drawn for this
        # Snapshotter by rank 0: a relaunch or a re-formed job never meets an earlier one's keys
        address = store_address()
        token = all_gather_fixed(self.group, secrets.token_bytes(8))[0]
        self.control = control_doc(address, job, token) if address else None
        asked = replicas - 1 if replicas > 1 else parity
        if self.parity < asked and self.group.rank == 0 and user_set and _first_warning(self.jdir):
            what = (f"{self.nodes} nodes hold at most {self.parity} parity block(s) per group: snapshots protected "
                    f"against {self.parity} lost node(s), not {asked}" if self.nodes > 1 else
                    "one node: snapshots survive a crashed process, not the loss of the node (protection "
                    "against lost nodes needs 2 nodes or more)")
            log.warning(f"unickpt: {what}")
        # the rank's ring of mapped files in the shm root that its snapshots are written into
        self.ring = MappedRing.shared(os.path.join(self.jdir, RING_DIR), self.group.rank, RING_SLOTS)
        self.memory: dict[str, Any] = {}  # the node's host memory for snapshots (memory_plan), once known
        self.handle: AsyncSaveHandle | None = None
        self.stall_s = 0.0  # seconds the training loop spent in snapshot() and before_update()
        self.taken = 0
        self.skipped = 0
        self.node_bytes = 0  # bytes of this node's last snapshot (a planned stop waits for them to be whole)
        self.failures: list[str] = []

    @property
    def nodes(self) -> int:
        """Number of nodes of the job."""
        return len(self.table)

    def due(self, step: int) -> bool:
        """True when ``step`` is a snapshot step."""
        return step % self.options.every == 0

    def flush_due(self, step: int) -> bool:
        """True when the snapshot of ``step`` is to be flushed to the durable tier (every
        ``flush_every``-th snapshot step)."""
        flush_every = self.options.flush_every
        return bool(flush_every) and step % (self.options.every * flush_every) == 0

    def _prepare_root(self) -> None:
        """A node's local rank 0: make the shm root ready for the node's keeper."""
        try:
            if os.path.exists(self.root) and not os.path.isdir(self.root):
                raise NotADirectoryError(0, "not a directory")
            if not os.path.exists(self.root):  # ours: a clean close() removes it again when empty
                os.makedirs(self.root, exist_ok=True)
                open(os.path.join(self.root, paths.MADE_MARK), "w").close()
            paths.make_private(self.root)
        except OSError as e:
            raise SnapshotError(f"the shm root {self.root} (${paths.SHM_ROOT_ENV}) cannot hold snapshots: "
                                f"{e.strerror or e}") from None

    def _exchange(self, state: FlatState | None,
                  failed_before: Exception | None = None) -> tuple[list[dict[str, Any]], list[RankInfo]]:
        """Collective: every rank's node, keeper and memory figures (the bytes of ``state``,
        flattened, this rank holds); the keeper table by node. The first time, also the job's
        secret: the one stored on the lowest node that holds one (a relaunch keeps it, whichever
        nodes survived), else one the first node drew. What fails on one rank (starting the
        node's keeper; ``failed_before``: its shm root, a Stateful's ``state_dict()``) is told
        to the others in the exchange itself and raised on every rank as a SnapshotError: no
        rank is left waiting in the exchange, and each goes on alike."""
        ring = getattr(self, "ring", None)
        free = int(ring is None or ring.available())
        mine = RankInfo(self.node, 0, 0, 0, 0, 0, 0, 0, b"\0" * 4, 0, b"\0" * paths.SECRET_BYTES, free)
        error = failed_before
        if error is None:
            try:
                mine = self._my_row(mine, state)
            except Exception as e:
                error = e
        if error is not None:
            mine = mine._replace(failed=1)
        rows = [RankInfo._make(_INFO.unpack(b)) for b in all_gather_fixed(self.group, _INFO.pack(*mine))]
        failed = [r for r, row in enumerate(rows) if row.failed]
        if isinstance(error, SnapshotError):
            raise error
        if error is not None:
            raise SnapshotError(f"{type(error).__name__}: {error}") from error
        if failed:
            raise SnapshotError(f"rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} failed (see "
                                f"{'their' if len(failed) > 1 else 'its'} own output for why)")
        keepers = {r.node: r for r in rows if r.has_keeper}
        if sorted(keepers) != list(range(len(keepers))) or {r.node for r in rows} != set(keepers):
            raise SnapshotError(f"every node needs one local rank 0; got nodes {sorted({r.node for r in rows})}")
        if self.secret is None:
            proposals = [keepers[n] for n in sorted(keepers)]
            self.secret = next((r.secret for r in proposals if r.secret_stored), proposals[0].secret)
        table = [{"host": socket.inet_ntoa(keepers[n].host), "port": keepers[n].port, "pid": keepers[n].pid} for n in sorted(keepers)]
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
        flat, failed = None, None
        try:  # once: its bytes are exchanged, then it is saved
            with gc_paused():  # thousands of small objects, none in a cycle (engine/gc_pause.py)
                flat = flatten_state(state)
        except Exception as e:  # a Stateful's state_dict() that fails: told to the others in the exchange
            failed = e
        self.table, rows = self._exchange(flat, failed)
        if any(r.pending >= 2 for r in rows if r.has_keeper):
            self.skipped += 1  # the keepers still encode two snapshots
            return None
        self.node_bytes = sum(r.rank_bytes for r in rows if r.node == self.node)
        self._check_memory(rows, step)
        if self.local_rank == 0:
            self._sweep_ring(rows)
        meta = {"snapshot": {"step": step, "job": self.job, "parity": self.parity, "k": self.k,
                             "replicas": self.options.replicas, "nodes": self.table}}
        if self.control:
            meta["snapshot"]["control"] = self.control
        if flush and self.flush_due(step) and self.flush_dir:
            meta["snapshot"]["flush"] = os.path.join(self.flush_dir, f"step_{step:08d}")
        path = paths.step_dir(self.root, self.job, step)
        parts = index_parts(rows, self.nodes, self.parity)
        wake = partial(wake_keeper, int(self.table[self.node]["pid"]))  # the node's keeper, once its manifest is in
        self.handle = start_save(flat, path, WRITES, lazy=True, metadata=meta, overwrite=True,
                                  target=NodeCopies(parts, committed=wake),
                                  process_group=self.process_group, channel=CHANNEL,
                                  ring=self.ring if rows[self.group.rank].ring_free else None)
        self.taken += 1
        return self.handle

    def _my_row(self, mine: RankInfo, state: FlatState | None) -> RankInfo:
        """This rank's row of the exchange: the bytes of its state; on a node's local rank
        0 also the node's keeper (started, or started again when it was killed), memory and
        proposed secret."""
        mine = mine._replace(rank_bytes=state_bytes(state) if state is not None else 0)
        if self.local_rank != 0:
            return mine
        if self._seen is None or not self._seen.running():  # a file read and /proc entries only when it ended
            if self._seen is not None:
                self._seen.close()
            self.keeper = ensure_keeper(self.root, self.job, self.host)
            self._seen = KeeperSeen(int(self.keeper["pid"]))
        used = paths.dir_bytes(self.jdir)
        pending = in_progress(self.jdir, getattr(self, "table", []))
        stored = self.secret or paths.read_secret(self.root, self.job)
        proposal = (1, stored) if stored else (0, secrets.token_bytes(paths.SECRET_BYTES))
        return RankInfo(self.node, 1, int(self.keeper["port"]), int(self.keeper["pid"]), pending, used, mine.rank_bytes,
                        self._cap(used), socket.inet_aton(self.keeper["host"]), *proposal, mine.ring_free)

    def _cap(self, used: int) -> int:
        """The node's cap on snapshot memory: ``max_bytes``, else the default fixed at the
        first look (what the node could give then: a later dip of MemAvailable does not
        fail a snapshot the ring already holds the memory of)."""
        if self.options.max_bytes is not None:
            return self.options.max_bytes
        if self._default_cap is None:
            self._default_cap = default_max_bytes(self.root, used)
        return self._default_cap

    def _check_memory(self, rows: list[RankInfo], step: int) -> None:
        """Raise SnapshotError on every rank when a node's snapshots would hold more host
        memory than its cap (its ring and its share of parity, :func:`memory_plan`);
        record this node's figures (``unickpt snapshots`` shows them)."""
        for n in range(self.nodes):
            plan = memory_plan([r.rank_bytes for r in rows if r.node == n], self.parity, self.k)
            # a rank whose slots are all held (a keeper late to delete the step before the whole
            # one) writes this step to a fresh file beside its ring, as snapshots did before it
            extra = sum(r.rank_bytes for r in rows if r.node == n and not r.ring_free)
            cap = next(r.cap for r in rows if r.node == n and r.has_keeper)
            if n == self.node:
                self.memory = {**plan, "cap": cap}
            if plan["total"] + extra > cap:
                raise SnapshotError(
                    f"snapshots of step {step} would hold {human_bytes(plan['total'] + extra)} of host memory on node {n} "
                    f"(a ring of {RING_SLOTS} x {human_bytes(plan['state'])} of state: {human_bytes(plan['ring'])}; "
                    f"parity {self.parity} of {PARITY_STEPS} steps: {human_bytes(plan['parity'])}"
                    + (f"; {human_bytes(extra)} written beside full rings" if extra else "") + "), above the cap of "
                    f"{human_bytes(cap)}; raise max_bytes or snapshot less state")
        if self.local_rank == 0:
            try:
                paths.write_memory(self.jdir, self.node, self.memory)
            except OSError as e:  # only `unickpt snapshots` reads it: the snapshot goes on, on every rank alike
                log.warning(f"unickpt: cannot record the node's snapshot memory in {self.jdir}: {e}")

    def _sweep_ring(self, rows: list[RankInfo]) -> None:
        """Delete the ring slots of ranks no longer on this node that no step holds (a
        relaunch on another layout leaves them)."""
        sweep(os.path.join(self.jdir, RING_DIR), {i for i, r in enumerate(rows) if r.node == self.node})

    def prepare(self, state: dict[str, Any]) -> None:
        """Take the ring's memory now, in the background (files sized, mapped, pinned for
        CUDA tensors), so that the first snapshot pays none of it: called by
        :class:`~unickpt.CheckpointManager` once it first sees the state."""
        size, pin = estimated_file_bytes(state, self.group.rank)
        cap = self._cap(paths.dir_bytes(self.jdir))
        alone = memory_plan([size], self.parity, self.k)  # this rank's share alone; the node's is checked at the first snapshot
        if alone["total"] > cap:
            raise SnapshotError(
                f"snapshots of this rank's state would hold {human_bytes(alone['total'])} of host memory on node "
                f"{self.node} (a ring of {RING_SLOTS} x {human_bytes(size)}: {human_bytes(alone['ring'])}; parity "
                f"{self.parity} of {PARITY_STEPS} steps: {human_bytes(alone['parity'])}), above the cap of "
                f"{human_bytes(cap)}; raise max_bytes or snapshot less state")
        self.ring.prepare(size, pin)

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
                log.warning(f"unickpt: snapshot failed, training goes on: {e}")
        self.handle = None

    def _wait_whole(self, timeout: float) -> None:
        """Wait until the node's keepers hold every committed snapshot whole (its parity
        encoded and announced), so that a relaunch finds the newest one; a warning, not an
        error, when they take longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while in_progress(self.jdir, self.table):
            if time.monotonic() > deadline:
                log.warning(f"unickpt: the keepers did not make the newest snapshot whole within {timeout:.0f} s; a "
                            f"relaunch resumes from the newest whole one")
                return
            time.sleep(0.005)

    def close(self, clean: bool = True) -> None:
        """Finish the snapshot in flight; on a clean end of the job, stop the node's keeper,
        which deletes the job's snapshots (no shared memory is left behind; a shm root
        that a Snapshotter created goes too, once empty). Otherwise (a planned stop that
        is to resume from memory) the node's rank 0 waits until the keepers hold the newest
        snapshot whole, so a relaunch at once resumes from it. The
        snapshot channel's process group is then left to :func:`unickpt.dist.release_groups`
        (a Snapshotter kept alive to the interpreter's exit does not keep it alive)."""
        try:
            self.settle()
            self.ring.close()  # unmapped: the files stay with the steps that hold them
            if clean:
                all_gather_fixed(self.group, b"\x01")  # every rank is done with the snapshots
                if self.local_rank == 0:
                    stop_keeper(self.root)
                    paths.remove_if_empty(self.root)
            elif self.local_rank == 0:
                self._wait_whole(WHOLE_WAIT_S + self.node_bytes / WHOLE_WAIT_RATE)
        finally:
            if self._seen is not None:
                self._seen.close()
            self.group = Group(None, self.group.rank, self.group.size)
