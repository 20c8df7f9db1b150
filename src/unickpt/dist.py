"""The few collectives unickpt needs, over any backend (gloo on CPU, NCCL on CUDA).

Byte payloads travel as uint8 tensors on the backend's device, so nothing here pickles.
With no process group (a single process) every function degrades to the local case.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import UnickptError
from .kept_connections import is_kept


def is_dtensor(t: Any) -> bool:
    """True for a DTensor."""
    # no DTensor can exist before its module is imported, and importing it costs ~1 s
    # (sympy), which a command-line conversion never needs
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


class GroupAbandoned(RuntimeError):
    """A collective asked of a group whose generation live recovery tore down."""


class PeerLost(UnickptError, dist.DistNetworkError):
    """A connection of the generation's process group was lost while ``fn`` ran: a peer
    died, cut its connections, or a collective with it timed out (gloo then closes the
    pair). The error ``fn`` ended with is its ``__cause__``.

    Why a type of unickpt's: torch 2.13's gloo raises a plain ``RuntimeError`` for such a
    failure, whatever the collective (``all_reduce``, ``all_gather``, ``broadcast``, DDP's
    gradient all-reduce in ``backward``: "Connection closed by peer", "Read error ...
    Connection reset by peer", "Timed out waiting ... for recv operation"), which only its
    message tells from a user's ``RuntimeError``. :func:`links_lost` reads the evidence off
    the group's connections instead (tests/peer_loss_probe.py shows each case). A
    ``UnickptError`` too: a job that cannot go on ends with it."""


@dataclass
class Group:
    """A process group (or none) with this process's rank and the group's size. ``stop``,
    when given and set, refuses every collective from then on (:meth:`handle`)."""

    pg: Any
    rank: int
    size: int
    stop: threading.Event | None = field(default=None, compare=False, repr=False)

    def handle(self) -> Any:
        """``pg``, for a collective about to start; GroupAbandoned once ``stop`` is set.
        Why: a background save abandoned at a re-forming may reach its next collective
        while the tear-down shuts the old groups down, and a gloo collective queued on a
        group that is shut down waits forever (torch 2.13: no error, no timeout; the
        process then never exits, waiting for the thread). The tear-down sets ``stop``
        first, cuts the sockets, and waits for such threads before it destroys a group."""
        if self.stop is not None and self.stop.is_set():
            raise GroupAbandoned("the process group's generation was torn down (live recovery): no collective "
                                 "starts on it any more")
        return self.pg

    @property
    def active(self) -> bool:
        """True when there are other ranks to talk to."""
        return self.pg is not None and self.size > 1

    def device(self) -> torch.device:
        """The device collectives of this group must use."""
        if self.active and "nccl" in str(dist.get_backend(self.pg)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def group_rank_of(self, global_rank: int) -> int | None:
        """The group rank of a global rank, or None when it is not in the group."""
        if not self.active:
            return global_rank if global_rank == 0 else None
        r = dist.get_group_rank(self.pg, global_rank)
        return None if r is None or r < 0 else r

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a member of this group."""
        if not self.active:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)


def resolve_group(process_group: Any = None) -> Group:
    """The group to use: the given one, else the default one when initialised, else none."""
    if not dist.is_available() or not dist.is_initialized():
        return Group(None, 0, 1)
    pg = process_group if process_group is not None else dist.group.WORLD
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


def gather_bytes(group: Group, payload: bytes, dst: int = 0) -> list[bytes] | None:
    """Gather one byte string per rank onto group rank ``dst`` (others get None).

    Every rank's string travels padded to the longest (one ``gather`` of equal sizes, as
    every backend can): ``dst`` receives world size x the longest string."""
    if not group.active:
        return [payload]
    dev = group.device()
    n = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(group.size)]
    dist.all_gather(sizes, n, group=group.handle())
    lengths = torch.cat(sizes).tolist()
    longest = max(lengths)
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    dst_global = group.global_rank(dst)
    if group.rank == dst:
        out = torch.empty((group.size, longest), dtype=torch.uint8, device=dev)
        dist.gather(buf, list(out.unbind(0)), dst=dst_global, group=group.handle())
        if not longest:
            return [b""] * group.size
        raw = memoryview(out.cpu().numpy()).cast("B")  # a slice per rank, no tensor op per rank (16,384 of them)
        return [bytes(raw[r * longest : r * longest + k]) for r, k in enumerate(lengths)]
    dist.gather(buf, None, dst=dst_global, group=group.handle())
    return None


def broadcast_bytes(group: Group, payload: bytes | None, src: int = 0) -> bytes:
    """Send ``payload`` from group rank ``src`` to every rank and return it everywhere."""
    if not group.active:
        return payload or b""
    dev = group.device()
    src_global = group.global_rank(src)
    n = torch.tensor([len(payload) if group.rank == src else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=src_global, group=group.handle())
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if group.rank == src and payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev))
    if buf.numel():
        dist.broadcast(buf, src=src_global, group=group.handle())
    return bytes(buf.cpu().numpy())


def scatter_bytes(group: Group, payloads: list[bytes] | None, src: int = 0) -> bytes:
    """Send ``payloads[r]`` from group rank ``src`` to each rank ``r`` (others pass None);
    every rank returns its own. One ``scatter`` of equal sizes: each string travels padded
    to the longest, after a broadcast of the lengths."""
    if not group.active:
        return (payloads or [b""])[0]
    dev = group.device()
    src_global = group.global_rank(src)
    n = torch.tensor([len(p) for p in payloads] if group.rank == src and payloads else [0] * group.size,
                     dtype=torch.int64, device=dev)
    dist.broadcast(n, src=src_global, group=group.handle())
    lengths = n.tolist()
    longest = max(lengths)
    if not longest:
        return b""
    buf = torch.empty(longest, dtype=torch.uint8, device=dev)
    chunks = None
    if group.rank == src and payloads:
        out = torch.zeros((group.size, longest), dtype=torch.uint8, pin_memory=dev.type == "cuda")
        for r, p in enumerate(payloads):
            if p:
                out[r, : len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
        chunks = list(out.to(dev, non_blocking=True).unbind(0))  # pinned: NCCL's scatter is ordered after the copy
    dist.scatter(buf, chunks, src=src_global, group=group.handle())
    return bytes(buf[: lengths[group.rank]].cpu().numpy())


def first_said(group: Group, text: str) -> tuple[int, str] | None:
    """Collective: the lowest group rank whose ``text`` is not empty, and that text, the
    same on every rank (None when no rank said anything): a failure agreed on by all,
    named once. One gather and one broadcast."""
    said = gather_bytes(group, text.encode(), 0)
    first = next((f"{r}\n".encode() + t for r, t in enumerate(said or []) if t), b"")
    got = broadcast_bytes(group, first if group.rank == 0 else None, 0)
    if not got:
        return None
    rank, _, rest = got.partition(b"\n")
    return int(rank), rest.decode(errors="replace")


def all_true(group: Group, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (one small all-reduce)."""
    if not group.active:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group.device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.handle())
    return bool(t.item())


def all_gather_fixed(group: Group, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` (all of the same length) on every rank, in group-rank order."""
    if not group.active:
        return [payload]
    dev = group.device()
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    outs = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(outs, mine, group=group.handle())
    return [bytes(o.cpu().numpy()) for o in outs]


_CACHES: list[dict] = []  # every cache of process groups unickpt made (see group_cache)
_TEARDOWN_HOOKS: list[tuple[bool, Callable[[], Any]]] = []  # what else a generation leaves (see on_teardown)


def group_cache() -> dict:
    """A new dict for a module to keep the process groups it makes in; every such dict is
    emptied by :func:`release_groups`."""
    cache: dict = {}
    _CACHES.append(cache)
    return cache


def on_teardown(reset: Callable[[], Any] | None = None, *, after_cut: bool = False) -> Any:
    """Register ``reset``: called when live recovery tears a generation down after a
    failure (``unickpt.live.regroup.teardown``), for process-global state a module keeps
    that holds the generation's groups and is not a :func:`group_cache` (the savers still
    in flight on them, say): before the groups' sockets are cut, or (``after_cut``) after
    the cut and before the groups are destroyed. Returns ``reset`` (usable as a decorator,
    bare or with ``after_cut=True``)."""
    if reset is None:
        return lambda fn: on_teardown(fn, after_cut=after_cut)
    _TEARDOWN_HOOKS.append((after_cut, reset))
    return reset


def run_teardown_hooks(after_cut: bool = False) -> None:
    """Call the :func:`on_teardown` resets of one phase, in the order they were registered."""
    for phase, reset in _TEARDOWN_HOOKS:
        if phase == after_cut:
            reset()


@atexit.register
def release_groups(collect: bool = True) -> None:
    """Drop unickpt's references to the process groups it made (async-save and snapshot
    channels, groups of replicas), so that each is destroyed now, its gloo threads
    joined. ``dist.destroy_process_group()`` does not stop the threads of a gloo group
    that is still referenced: one that lives on into the interpreter's finalization is
    destroyed with Python half torn down, where a gloo thread that drops a tensor's last
    reference needs the GIL, is ended by the interpreter, and the process aborts
    ("terminate called without an active exception"). Runs at exit, before the
    interpreter finalizes; call it after ``destroy_process_group()`` to free them sooner.
    The groups are made again, collectively, at their next use.

    It then collects cyclic garbage: a training loop's objects that hold groups through
    reference cycles (an FSDP2 module's hooks and device mesh, a framework's trainer) are
    freed by the cyclic collector only, which otherwise first runs during finalization:
    the same abort. Measured (2-rank FSDP2 loop under torchrun, then return; the loop of
    tests/user_loop.py with nothing to save): 1 abort in 8 runs without the collection,
    0 in 24 with it."""
    for cache in _CACHES:
        cache.clear()
    if collect:  # live recovery collects at its own time (~0.3 s with torch loaded)
        gc.collect()


_FD_DIR = "/proc/self/fd"
_GROUP_SOCKETS: dict[int, str] = {}  # the sockets unickpt's groups opened (see shut_group_sockets)

def open_sockets() -> dict[int, str]:
    """This process's socket fds and their inodes (``socket:[N]``); empty off Linux."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def opened_since(before: dict[int, str]) -> dict[int, str]:
    """The sockets open now that were not open in ``before``."""
    return {fd: inode for fd, inode in open_sockets().items() if before.get(fd) != inode}


@contextlib.contextmanager
def _duplicate(fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a duplicate of ``fd`` (None when ``fd`` is closed meanwhile),
    closed on leaving: ``fd`` itself stays the owner's (gloo's, a store's)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        yield dup
    finally:
        dup.close()


def _to_peer(sock: socket.socket, kept_too: bool = False) -> bool:
    """Whether ``sock`` is a group's connection to a peer: not a listening socket (gloo's
    listener thread aborts the process when its accept fails), not a connection to a store
    or a keeper another thread opened while the group was made (see
    :mod:`unickpt.kept_connections`; ``kept_too``: such a connection counts)."""
    try:
        return not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and (kept_too or not is_kept(sock))
    except OSError:
        return False


def links(sockets: dict[int, str]) -> dict[int, str]:
    """The connections among ``sockets`` (of a group just made: :func:`opened_since`) that
    lead to its peers (:func:`_to_peer`)."""
    out = {}
    for fd, inode in sockets.items():
        with _duplicate(fd) as dup:
            if dup is not None and _to_peer(dup):
                out[fd] = inode
    return out


_TCP_ESTABLISHED = 1  # tcp_info's first byte, tcpi_state (linux/tcp_states.h)


def links_lost(connections: dict[int, str]) -> bool:
    """True when one of ``connections`` (:func:`links` of a group) is no longer the
    connection it was: closed (gloo closes a pair whose peer closed it, reset it, or
    timed out: torch 2.13, measured by tests/peer_loss_probe.py) or no longer established
    (the peer's FIN read before gloo closed it; or this process cut it). A process that
    destroys none of these (live recovery's default group: only the tear-down does) sees
    them all established until a peer is lost. False off Linux (no ``/proc/self/fd``)."""
    now = open_sockets()
    for fd, inode in connections.items():
        if now.get(fd) != inode:
            return True
        with _duplicate(fd) as dup:
            if dup is None:
                return True  # closed since open_sockets() read it
            try:
                if dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _TCP_ESTABLISHED:
                    return True
            except OSError:
                pass  # not TCP (a unix socket): nothing to read
    return False


def connected_to(sockets: dict[int, str], port: int) -> dict[int, str]:
    """The connections among ``sockets`` whose far end listens on ``port`` (this process's
    connection to a store, found among the sockets that appeared while it was made)."""
    out = {}
    for fd, inode in sockets.items():
        with _duplicate(fd) as dup:
            try:
                if dup is not None and int(dup.getpeername()[1]) == port:
                    out[fd] = inode
            except (OSError, IndexError, TypeError, ValueError):
                continue  # not connected, or not an IP socket
    return out


def shut_down(sockets: dict[int, str], kept_too: bool = False) -> int:
    """``shutdown(SHUT_RDWR)`` every connection to a peer (:func:`_to_peer`) among
    ``sockets`` still open under the same inode (an fd reused since is left alone);
    ``kept_too``: a connection to a store or a keeper as well (a listening socket never).
    Returns how many were shut down."""
    now = open_sockets()
    done = 0
    for fd, inode in sockets.items():
        if now.get(fd) != inode:
            continue
        with _duplicate(fd) as dup:
            if dup is None or not _to_peer(dup, kept_too):
                continue
            try:
                dup.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
    return done


_TRACKING = False


def track_group_sockets() -> None:
    """Record the sockets of every process group torch makes from now on in this process
    (the default group, a DeviceMesh's groups, FSDP2's and TP's, a user's ``new_group``),
    for :func:`shut_group_sockets`. Every such group is built by torch's
    ``_new_process_group_helper``: it is wrapped once, and the gloo connections each call
    opens are kept (gloo connects its full mesh there). Idempotent; live recovery turns it
    on, so that a re-forming cuts every group of the old generation, whoever made it.
    (A group made by ``split_group``, NCCL's path, is not seen here: NCCL's
    communicators are aborted instead.)"""
    global _TRACKING
    if _TRACKING:
        return
    c10d = dist.distributed_c10d
    make = c10d._new_process_group_helper

    def recorded(*args: Any, **kwargs: Any) -> Any:
        before = open_sockets()
        try:
            return make(*args, **kwargs)
        finally:
            _GROUP_SOCKETS.update(opened_since(before))

    recorded.__wrapped__ = make  # type: ignore[attr-defined]
    c10d._new_process_group_helper = recorded
    _TRACKING = True


def shut_group_sockets(also: dict[int, str] | None = None) -> int:
    """Shut down the sockets of every group :func:`new_group` made (and ``also``: the
    default group's, say) and forget them. gloo cannot abort a collective in flight, and a
    group's connections can outlive every Python reference to it (held from C++): shut
    down (never closed: gloo owns the fds), this process's gloo loop wakes and the peers
    get a FIN, so a collective blocked on the group fails at once here and in every peer.
    Linux only (``/proc/self/fd``); a no-op elsewhere."""
    mine = dict(_GROUP_SOCKETS)
    _GROUP_SOCKETS.clear()
    return shut_down({**mine, **(also or {})})


def new_group(ranks: list[int] | None = None, backend: str | None = None, local: bool = False, parent: Any = None) -> Any:
    """``dist.new_group`` (``local``: ``use_local_synchronization``, made by its members
    only) whose rendezvous keys are deleted from the store once every member has joined;
    with ``parent`` (a group of the same ranks, or the default group when the new group
    spans the world), the keys left in the parent's namespace too (its own, and those of
    the groups made under it: every member has passed their creation by then).

    Why: torchrun (torch >= 2.4) hands its workers the agent's store and keeps it, with
    its keys, for the whole job; a group's name (a counter, or a hash of its ranks) comes
    out the same in every restart round. The addresses the members of a round published
    are still there in the next round, where a member that reads its peer's key before
    the restarted peer rewrote it connects to a dead process (gloo: ``connectFullMesh
    failed ... Connection refused``, or both sides wait for each other): the new round
    dies. Deleted once all members are connected, they cannot mislead a later round.
    Returns None on a rank outside ``ranks``."""
    before = open_sockets()
    pg = dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=local)
    _GROUP_SOCKETS.update(opened_since(before))
    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    dist.barrier(group=pg)  # every member returned from new_group (and from parent's creation before it)
    if dist.get_rank(pg) == 0:
        for g in (pg, parent):
            if g is not None:
                _drop_rendezvous_keys(g)
    return pg


def _drop_rendezvous_keys(pg: Any) -> None:
    """Delete every key under ``pg``'s namespace of the store (nothing when the store
    cannot list its keys: FileStore, HashStore, which torchrun does not share)."""
    store_of = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    if store_of is None:
        return
    try:
        store = store_of(pg)
        for key in store.list_keys():
            store.delete_key(key)
    except (RuntimeError, NotImplementedError, KeyError):
        pass


def barrier(group: Group) -> None:
    """Wait for every rank of the group (a no-op alone)."""
    if group.active:
        broadcast_bytes(group, b"", 0)
