"""``unickpt.run(fn)``: a training function that survives the loss of its peers in the
same process.

Under ``unickpt launch``, :func:`run` joins the job's current generation (see
:mod:`.control`), initialises the default process group for it and calls ``fn(world)``.
When a peer dies (its launcher publishes a new generation) a watcher thread raises
:class:`Interrupted` into the main thread; a collective blocked on the dead peer fails
on its own once the survivors next to it have dropped the old group (gloo cannot abort
a collective in flight, but closed sockets end it). Every reference to the old groups
is then dropped, the group is formed again on the survivors (dense ranks, in the old
order, under the new generation's store prefix) and ``fn(world)`` is called again: the
imports, the CUDA context and the node's snapshot keeper stay, and the
``CheckpointManager`` in ``fn`` restores from memory onto the new world. A replacement
that is ready joins at a step boundary (:func:`step_boundary`, called by
``CheckpointManager.maybe_save``), after that step's snapshot.

Under torchrun or plain ``python``, :func:`run` calls ``fn`` once.
"""

from __future__ import annotations

import faulthandler
import gc
import inspect
import json
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..dist import GroupAbandoned, PeerLost, links_lost, release_groups, track_group_sockets
from ..errors import UnickptError
from ..logs import log, say
from ..store_client import (LIVE_DEBUG_ENV, LIVE_NODE_STORE_ENV, LIVE_STORE_ENV, LIVE_TIMINGS_ENV,
                            LIVE_WORKER_ENV, torchrun_env)
from .. import store_client
from . import control
from .control import Cause, Generation, key
from . import membership, regroup
from .interrupt import clear_pending, guard_thread_starts, raise_in_thread
from .nccl_abort import join_aborts
from .watcher import Watcher

__all__ = ["run", "World", "Interrupted"]

NETWORK_ERROR_WAIT_S = 15.0  # after a failed collective, how long to wait for the coordinator's verdict
LINK_GRACE_S = 1.0  # an untyped error of fn while every connection is up: how long to watch them for a loss (_typed)


class Interrupted(BaseException):
    """Raised into ``fn`` when the job's membership changes (a peer lost, or a replacement
    joining at this step boundary); ``unickpt.run`` catches it and calls ``fn`` again.
    A BaseException, so that ``except Exception`` in a training loop lets it through."""


@dataclass(frozen=True)
class World:
    """Where this process stands in the current generation of the job.

    Attributes:
        rank: This process's rank (dense: 0 .. size-1, in the old order after a re-forming).
        size: The number of ranks now.
        local_rank: The rank among this node's processes.
        generation: How many times the job has re-formed (0: never).
        local_size: The processes on this node.
        node: This node's index.
        nodes: The number of nodes.
    """

    rank: int
    size: int
    local_rank: int
    generation: int
    local_size: int = 1
    node: int = 0
    nodes: int = 1


# this thread's live-recovery state under `unickpt launch` (set by run; the manager reads it)
_CURRENT: ContextVar["_Live | None"] = ContextVar("unickpt_live", default=None)


def run(fn: Callable[[World], Any], backend: str | None = None, multiple_of: int = 1,
        recover: bool | tuple[type[BaseException], ...] = False) -> Any:
    """Initialise the default process group, call ``fn(world)`` and destroy the group when
    it returns; returns what ``fn`` returned.

    Under ``unickpt launch``, when a peer dies (or a replacement is ready to join), ``fn``
    is interrupted, every process group is torn down, the world is formed again from the
    survivors (dense ranks, in the old order) and ``fn(world)`` is called again in this
    same process. Under torchrun or plain ``python`` ``fn`` is called once. ``backend``:
    torch's default for the device when None. ``fn`` must not call
    ``init_process_group`` or ``destroy_process_group`` itself.

    ``multiple_of=K`` (a layout of tensor x pipeline parallel degree K): at every
    generation the active world is the largest multiple of K not above the ranks
    available; ``fn`` runs on those, and the others wait inside ``run`` as hot spares
    (their imports, CUDA context and keeper kept), first in line at the next failure,
    which then re-forms at the same size. Whole nodes are kept together (see
    :meth:`unickpt.live.control.Generation.active`).

    An exception ``fn`` raises is a bug, not a failure of the process: under ``unickpt
    launch`` it ends the job on every node (exit 1, the rank and the error named), since it
    would happen again after a re-forming. ``recover`` names the exceptions that are
    failures of the process instead (``recover=(torch.cuda.OutOfMemoryError,)``, or True
    for any): the rank that raised one is lost and the others go on without it, as after
    a crash. A failed collective (a peer lost) is always recovered from.

    Args:
        fn: The training function; called with the current :class:`World`.
        backend: The process group's backend (None: torch's default for the device).
        multiple_of: The active world's size is always a multiple of this.
        recover: Exception types (or True: all) that drop the rank instead of ending the job.

    Returns:
        What ``fn`` returned (in its last generation).

    Raises:
        UnickptError: The default process group is already initialised; ``fn`` is not a
            function of one argument; ``backend`` is not one torch knows; ``multiple_of``
            is not a positive integer, or (under torchrun) does not divide the world.
    """
    _check_arguments(fn, backend)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise UnickptError(f"unickpt.run(fn, multiple_of={multiple_of!r}): expected a positive integer "
                           "(the tensor x pipeline parallel degree the world must be a multiple of)")
    if dist.is_initialized():
        raise UnickptError("unickpt.run(fn) initialises the process group itself: call it before "
                           "init_process_group, not after (and not from inside another unickpt.run); a framework's "
                           "object built before run() may have initialised it (Hugging Face TrainingArguments, through "
                           "accelerate): build it inside fn")
    if not control.under_launch():
        return _run_once(fn, backend, multiple_of)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's stack on stderr (a stuck worker)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    track_group_sockets()  # every group of a generation (a DeviceMesh's too) is cut when it ends
    regroup.import_before_forming()  # before any group: torch's FSDP keeps the one alive at its import
    live = _Live(os.environ[LIVE_STORE_ENV], os.environ[LIVE_WORKER_ENV], os.environ.get(LIVE_NODE_STORE_ENV),
                 multiple_of, recover)
    token = _CURRENT.set(live)
    try:
        return live.loop(fn, backend)
    finally:
        live.watcher.stop()  # neither thread left blocked in a store whose server goes away at exit
        join_aborts()  # an NCCL communicator half aborted at the interpreter's exit can hang it
        _CURRENT.reset(token)
        gc.unfreeze()  # the interpreter's last collection frees what was frozen (extensions check for leaks)


def _check_arguments(fn: Any, backend: Any) -> None:
    """A UnickptError naming what is wrong with ``fn`` or ``backend``, before anything
    starts (not a TypeError inside the first generation)."""
    if not callable(fn):
        raise UnickptError(f"unickpt.run(fn): fn must be a function taking the World, not {type(fn).__name__} "
                           f"({fn!r:.80}): pass the function itself, run(train), not run(train())")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise UnickptError(f"unickpt.run(fn): {getattr(fn, '__name__', repr(fn))}{inspect.signature(fn)} must take "
                           "one argument, the World (its rank, size and generation)") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
    if backend is None:
        return
    names = [part.rpartition(":")[2].strip() for part in str(backend).split(",")] if isinstance(backend, str) else []
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if not names or any(n.lower() not in known for n in names):
        raise UnickptError(f"unickpt.run(fn, backend={backend!r}): not a backend torch knows "
                           f"({', '.join(known)}, or 'cpu:gloo,cuda:nccl'; None: torch's default for the device)")


def _run_once(fn: Callable[[World], Any], backend: str | None, multiple_of: int = 1) -> Any:
    """torchrun or plain python: one group, one call."""
    size = int(os.environ.get("WORLD_SIZE", 1))
    if size % multiple_of:
        raise UnickptError(f"unickpt.run(fn, multiple_of={multiple_of}): the world has {size} rank(s), not a multiple "
                           f"of {multiple_of} (hot spares need `unickpt launch`)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # a single process: a group of one, no rendezvous
        dist.init_process_group(backend or "gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), 0,
                  int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("GROUP_RANK", 0)),
                  int(os.environ.get("GROUP_WORLD_SIZE", 1)))
    try:
        result = fn(world)
    except BaseException as e:
        try:
            _check_group_kept(e)
        finally:
            if dist.is_initialized():  # an error leaves no group behind (a caller in the same process goes on)
                dist.destroy_process_group()
                release_groups()
        raise
    _check_group_kept(None)
    dist.destroy_process_group()
    release_groups()
    return result


def _check_group_kept(error: BaseException | None) -> None:
    """A clear error when ``fn`` initialised or destroyed the default group itself: fn's
    error raised by ``init_process_group`` (its frame, not its message: torch's refusal of
    a second default group is a plain ValueError), or no default group once fn ended."""
    if isinstance(error, ValueError) and _raised_in(error, dist.init_process_group):
        raise UnickptError("fn called init_process_group: unickpt.run(fn) initialises the default process group "
                           "itself (and forms it again after a failure); remove that call from fn") from error
    if not dist.is_initialized():
        raise UnickptError("fn called destroy_process_group: unickpt.run(fn) destroys the default process group "
                           "when fn returns (and tears it down after a failure); remove that call from fn") from error


def _raised_in(error: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``error`` was raised in the body of ``function`` (torch's, unwrapped)."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    frames = traceback.extract_tb(error.__traceback__)
    return code is not None and any(f.filename == code.co_filename and f.name == code.co_name for f in frames)


def position() -> tuple[int, int] | None:
    """(node index, local rank) of this worker in the current generation under ``unickpt
    launch`` (the snapshot tier's place, passed in by the manager); None elsewhere."""
    live = _CURRENT.get()
    if live is None or live.world is None:
        return None
    return live.world.node, live.world.local_rank


def step_boundary(step: int) -> bool:
    """Called by ``CheckpointManager.maybe_save`` after each step: reports progress to the
    launcher (its hang detection) and says whether the job re-forms after this step (a
    replacement is ready: the caller snapshots the step, then raises :class:`Interrupted`).
    False, at no cost, outside ``unickpt launch``."""
    live = _CURRENT.get()
    if live is None or live.gen is None:
        return False
    return live.boundary(step)


def restored(step: int) -> None:
    """Called by ``CheckpointManager.restore``: rank 0 prints the re-forming's line
    (``rank 2 lost (exit -9); continuing on 3 ranks at step 14 (generation 1)``) once the
    step the survivors continue from is known."""
    live = _CURRENT.get()
    if live is not None:
        live.mark("restored")
        live.say(step + 1)


def interrupted() -> type[BaseException]:
    """The exception to raise at a step boundary where the job re-forms."""
    return Interrupted


class _Live:
    """One worker's side of a live-recovery job."""

    def __init__(self, address: str, worker: str, node_address: str | None = None, multiple_of: int = 1,
                 recover: bool | tuple[type[BaseException], ...] = False) -> None:
        self.address, self.worker, self.multiple_of = address, worker, multiple_of
        self.recover = recover  # the exceptions of fn that drop this rank instead of ending the job
        self.store = store_client.connect(address)
        # progress and liveness go to this node's launcher only: its own store, not the job's
        self.node_address = node_address or address
        self.node_store = store_client.connect(node_address) if node_address else self.store
        self.gen: Generation | None = None
        self.world: World | None = None
        self.main = threading.get_ident()
        guard_thread_starts(self.main)  # the watcher's Interrupted never lands in a thread it starts
        self.lock = threading.Lock()
        self.in_fn = False
        self.grow_at: int | None = None
        self.note: str | None = None
        self.times: dict[str, float] = {}
        self.watcher = Watcher(worker, address, self.node_address, self.node_store, self._on_generation)
        self.prev_active: list[str] = []  # the active members of the generation before (the lines rank 0 prints)
        self.links: dict[int, str] = {}  # the default group's connections to its peers (see _typed)
        self.forming: Generation | None = None  # the generation whose group is forming now
        self.rendezvous: regroup.Rendezvous | None = None  # its connection to the store (see form)
        self.pending: Generation | None = None  # the newest generation the watcher saw while fn did not run

    # -- the generations ------------------------------------------------------------------
    def loop(self, fn: Callable[[World], Any], backend: str | None) -> Any:
        self.store.set(key("run", self.worker), "1")  # the launcher treats this worker's death as recoverable
        said = self.store.compare_set(control.MULTIPLE_KEY, "", str(self.multiple_of)).decode()
        if said != str(self.multiple_of):
            raise UnickptError(f"unickpt.run(fn, multiple_of={self.multiple_of}): another rank of this job said "
                               f"multiple_of={said}; every rank must give the same")
        self.watcher.start_beats()  # from here a stopped worker is told from a slow one (the launcher's hang check)
        gen = self.join()
        while True:
            if gen.place(self.worker, self.multiple_of) is None:  # a hot spare: no group, no fn
                self._check_enough(gen)
                gen = self.wait_as_spare(gen)
                continue
            if not self.arrive(gen):  # a member was lost while the others gathered
                gen = self.newer()
                continue
            nxt = self.form(gen, backend)
            if nxt is not None:  # a member was lost while the group formed
                gen = nxt
                continue
            regroup.freeze_heap()
            self.mark("frozen")
            try:
                with self.interruptible():
                    result = fn(self.world)
            except BaseException as raised:  # noqa: BLE001 — sorted below: a membership change or a real error
                # again: an Interrupted that lands as the with-block ends (fn ended otherwise, by a
                # signal's KeyboardInterrupt or an error) is raised before __exit__ runs, and a
                # watcher still told "in fn" raised the next generation's into the verdict's waits.
                # One more may land in leave_fn itself (from its first instruction): taken here
                while True:
                    try:
                        self.leave_fn()
                        break
                    except Interrupted:
                        continue
                self.mark("interrupted")
                e = _typed(raised, self.links)  # before the cut below, which ends every link
                # this generation is over here: cut every group now, so that a peer blocked in
                # any collective fails at once instead of waiting on this process
                self.cut()
                if not isinstance(e, Interrupted) and _network_error(e):
                    # a peer vanished (a lost node closes its connections at once): the
                    # coordinator confirms with the nodes' launchers before declaring it
                    control.post_event(self.store, control.Suspect(self.worker, time.time()))
                nxt = self.verdict(e)
                self.mark("verdict")
                if nxt is None:
                    try:
                        _check_group_kept(raised)
                    except UnickptError as misuse:  # fn's own init_process_group: reported as what it is
                        e = misuse
                    _report_raised(self, e)
                    self.teardown()
                    raise e  # the error of fn as it was, or the PeerLost it is the cause of
                _forget_exception(e)  # its frames (and its chain's: raised) hold the model, the mesh, the groups
                del e, raised
                self.teardown()
                gen = nxt
                continue
            # fn returned: no step follows, so the launcher's hang check must not read the
            # time this process takes to tear down and exit as a hang
            self.node_store.set(key("beat", self.worker), "done")
            try:
                _check_group_kept(None)
            except UnickptError as misuse:  # an error of fn (it destroyed the group), not a lost rank
                _report_raised(self, misuse)
                raise
            self.teardown(collect=True)
            return result

    def join(self) -> Generation:
        """The first generation this worker belongs to (a replacement says it is ready and
        waits for the coordinator to take it in)."""
        n = control.newest(self.store)
        while n < 0:
            time.sleep(0.01)
            n = control.newest(self.store)
        gen = control.read(self.store, n)
        if self.worker in gen.members:
            self.watcher.seen = n
            return gen
        control.post_event(self.store, control.Ready(self.worker, control.node_of(self.worker)))
        self.node_store.set(key("beat", self.worker), "joining")
        while True:
            if not self.store.check([key("g", n + 1)]):
                self.node_store.add(key("alive", self.worker), 1)
                time.sleep(0.01)
                continue
            n += 1
            gen = control.read(self.store, n)
            membership.end_if_over(gen)
            if self.worker in gen.members:
                self.watcher.seen = n
                return gen

    def _check_enough(self, gen: Generation) -> None:
        """A clear error when fewer ranks are left than ``multiple_of`` (none could train)."""
        if not gen.active(self.multiple_of):
            raise UnickptError(f"unickpt.run(fn, multiple_of={self.multiple_of}): only {len(gen.members)} rank(s) "
                               f"available, fewer than multiple_of={self.multiple_of}")

    def wait_as_spare(self, gen: Generation) -> Generation:
        """A hot spare of ``gen``: wait, in this process, for the next generation (a failure
        it may cover, a join, the job's end); returns it."""
        self.gen, self.world = gen, None
        self.watcher.seen = max(self.watcher.seen, gen.number)
        if not self.prev_active:  # warm while it waits: what fn imports lazily, frozen (see regroup.freeze_heap)
            regroup.freeze_heap()
        self.node_store.set(key("beat", self.worker), f"spare g{gen.number}")  # not a step: no hang check
        n = gen.number + 1
        while True:
            name = control.watch_key(self.worker, n) if self.node_address != self.address else key("g", n)
            if store_client.wait_key(self.node_store, name, 3600.0):
                break
        self.watcher.seen = max(self.watcher.seen, n)
        nxt = control.read(self.store, n)
        membership.end_if_over(nxt)
        if self.worker not in nxt.members:
            raise SystemExit(f"unickpt: this worker ({self.worker}) was left out of generation {n}")
        self.prev_active = gen.active(self.multiple_of)
        return nxt

    def form(self, gen: Generation, backend: str | None) -> Generation | None:
        """Initialise the default group of ``gen`` (its own store prefix, on its own
        connection to the store: :class:`.regroup.Rendezvous`) and this process's torchrun
        variables for it. Returns None once it has formed; or, when a member of ``gen`` was
        lost while the group formed, the generation to go on in: the watcher cuts the
        rendezvous as soon as a newer generation is published (gloo's would otherwise wait
        for the lost member's address until the generation's timeout, see
        :meth:`_on_generation`), and a rendezvous that failed on its own waits for the
        coordinator's verdict, as a failed collective does."""
        place = gen.place(self.worker, self.multiple_of)
        assert place is not None
        # a framework fn builds (Lightning, accelerate) reads its place from torchrun's variables
        os.environ.update(torchrun_env(place["rank"], place["size"], place["local_rank"], place["local_size"],
                                       place["node"], place["nodes"], gen.number))
        if not self.watcher.started:  # before the first rendezvous: a generation published during it ends it
            self.watcher.start()
        rendezvous = regroup.Rendezvous(self.address)
        with self.lock:
            self.forming, self.rendezvous = gen, rendezvous
            if self.pending is not None and self._supersedes(self.pending, gen):
                rendezvous.abandon()  # published since this worker gathered with the others
        try:
            if not rendezvous.abandoned:
                self.links = regroup.form(rendezvous.store, gen.number, place["rank"], place["size"], backend)
        except Exception as error:  # noqa: BLE001 — a rendezvous cut, or failed on a lost peer
            return self._not_formed(gen, error)
        finally:
            with self.lock:
                self.forming = None
        if rendezvous.abandoned:  # cut as it completed: a newer generation was published
            return self._not_formed(gen, None)
        self.gen, self.grow_at = gen, None
        self.world = World(place["rank"], place["size"], place["local_rank"], gen.number, place["local_size"],
                           place["node"], place["nodes"])
        self.node_store.set(key("beat", self.worker), f"g{gen.number}")
        self.mark("formed")
        self.times["published"] = gen.at
        if gen.number > 0 and gen.cause in (Cause.LOST, Cause.GROW):
            self.note = _describe(gen, self.multiple_of, self.prev_active) + " at step {} " + f"(generation {gen.number})"
        self.prev_active = gen.active(self.multiple_of)
        return None

    def _not_formed(self, gen: Generation, error: Exception | None) -> Generation:
        """``gen``'s group did not form: ``error`` ended its rendezvous (None: the watcher
        abandoned it, for a newer generation). Whatever of the group was made is cut (its
        peers' rendezvous fail too) and torn down; returns the generation to go on in, or
        raises ``error`` when no newer one is published within NETWORK_ERROR_WAIT_S."""
        rendezvous = self.rendezvous
        assert rendezvous is not None
        abandoned = rendezvous.abandoned
        rendezvous.abandon()
        if dist.is_initialized():
            regroup.teardown(crashed=True)
        self.rendezvous = None
        if not abandoned:  # the coordinator confirms a lost node with the launchers (as after a failed collective)
            try:
                control.post_event(self.store, control.Suspect(self.worker, time.time()))
            except RuntimeError:
                pass  # the job's store is gone: newer() below says so
        nxt = self.newer_within(gen.number, 0.0 if abandoned else NETWORK_ERROR_WAIT_S)
        if nxt is None:
            assert error is not None
            _report_raised(self, error)
            raise error
        if error is not None:
            _forget_exception(error)
        return nxt

    def _supersedes(self, newer: Generation, gen: Generation) -> bool:
        """Whether ``newer`` ends ``gen`` (not only a spare of it lost: the same active world)."""
        return newer.number > gen.number and not self._keeps(newer, gen.active(self.multiple_of))

    def verdict(self, error: BaseException) -> Generation | None:
        """The generation to go on in after ``error`` ended ``fn``, or None when ``error``
        is the training's own (no membership change): raised as it is."""
        gen = self.gen
        assert gen is not None
        wait_s = 3600.0 if isinstance(error, Interrupted) else NETWORK_ERROR_WAIT_S if _network_error(error) else 0.0
        return self.newer_within(gen.number, wait_s)

    def newer_within(self, number: int, wait_s: float) -> Generation | None:
        """The newest generation once one after ``number`` is published, waiting up to
        ``wait_s`` for it (one wake-up when the coordinator publishes, no polling); None
        when none is."""
        deadline = time.monotonic() + wait_s
        if wait_s > 0:
            store_client.wait_key(self.store, key("g", number + 1), wait_s)
        while True:
            if control.newest(self.store) > number:
                return membership.newer(self.store, self.worker)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def newer(self) -> Generation:
        """The newest generation (this worker must be in it): after :meth:`arrive` said one
        newer than the generation it gathered for was published."""
        return membership.newer(self.store, self.worker)

    def arrive(self, gen: Generation) -> bool:
        """Gather with ``gen``'s members before its group forms (:func:`.membership.arrive`);
        False when a newer generation was published meanwhile."""
        return membership.arrive(self.store, gen, self.multiple_of)

    def teardown(self, collect: bool = False) -> None:
        """Tear the generation down (:func:`.regroup.teardown`): after a failure or a
        re-forming its collectives are cut and its saves abandoned; ``collect`` when ``fn``
        returned. With $UNICKPT_LIVE_DEBUG, what still holds the old default group is logged."""
        old = weakref.ref(dist.group.WORLD) if dist.is_initialized() else None
        regroup.teardown(crashed=self.gen is not None and not collect, mark=self.mark)
        self.rendezvous = None
        self.mark("torn_down")
        if old is not None and old() is not None and os.environ.get(LIVE_DEBUG_ENV):
            held = [type(r).__name__ + ":" + repr(r)[:120] for r in gc.get_referrers(old())]
            log.warning(f"unickpt: the old group is still referenced by {held}")

    def cut(self) -> None:
        """Shut the generation's gloo sockets down (:func:`.regroup.cut`), and its
        connection to the store (a group ``fn`` makes may wait there for a lost peer)."""
        regroup.cut()
        if self.rendezvous is not None:
            self.rendezvous.cut()


    # -- interrupting fn --------------------------------------------------------------------
    def interruptible(self) -> "_InFn":
        return _InFn(self)

    def leave_fn(self) -> None:
        """``fn`` is over: the watcher raises no more :class:`Interrupted` into the main
        thread, and one set but not raised yet is dropped."""
        with self.lock:
            self.in_fn = False
            clear_pending(self.main)

    def _on_generation(self, gen: Generation) -> None:
        """The watcher saw ``gen``: one that changes the active world ends ``fn`` at once
        (its collectives cut, :class:`Interrupted` raised into the main thread); one that
        only lost a spare is noted; a grow is taken at the step boundary."""
        if gen.cause == Cause.GROW and self.worker in gen.members:
            return
        with self.lock:
            if self.forming is not None:  # the rendezvous may wait for a member lost meanwhile
                if self._supersedes(gen, self.forming) and self.rendezvous is not None:
                    self.rendezvous.abandon()
                else:
                    self.pending = gen
                return
            if not self.in_fn:  # between two generations, or before fn: taken as fn is entered (_InFn)
                self.pending = gen
                return
            if self.gen is not None and self._unchanged(gen):
                self._adopt(gen)
                return
            if self.gen is not None and gen.number > self.gen.number:
                self.cut()  # the main thread may be blocked in a gloo collective
                raise_in_thread(self.main, Interrupted)

    def _adopt(self, gen: Generation) -> None:
        """``gen`` lost only spares: the active world trains on, in its groups (rank 0 says so)."""
        self.gen = gen
        if self.world is not None and self.world.rank == 0 and gen.lost:
            say(_describe(gen, self.multiple_of, self.prev_active) + f" (generation {gen.number})")

    def _unchanged(self, gen: Generation) -> bool:
        """True when ``gen`` keeps this generation's active world as it is (only spares or
        pending replacements changed): nothing to re-form."""
        return self._keeps(gen, self.prev_active)

    def _keeps(self, gen: Generation, active: list[str]) -> bool:
        """True when ``gen`` lost members but keeps ``active`` as its active world."""
        return gen.cause == Cause.LOST and gen.active(self.multiple_of) == active

    # -- the step boundary ------------------------------------------------------------------
    def boundary(self, step: int) -> bool:
        store, gen, world = self.store, self.gen, self.world
        assert gen is not None and world is not None
        self.node_store.set(key("beat", self.worker), str(step))
        if "first_step" not in self.times and "formed" in self.times:
            self.mark("first_step")
            self.say(step)
            self._report()
        if self.grow_at is None:
            grow = key("g", gen.number, "grow_at")
            ready = key("g", gen.number, "ready")
            if world.rank == 0 and store.check([ready]) and self._grows(int(store.get(ready) or b"1")):
                # every rank reaches maybe_save(step + 1) only after a collective rank 0 joins
                # after this line, so each sees grow_at there at the latest
                store.set(grow, str(step + 1))
            if store.check([grow]):
                self.grow_at = int(store.get(grow))
        return self.grow_at == step

    def _grows(self, pending: int) -> bool:
        """True when ``pending`` more ranks grow the active world (not only the spares)."""
        assert self.gen is not None
        k = self.multiple_of
        return (len(self.gen.members) + pending) // k * k > len(self.prev_active)

    def say(self, step: int) -> None:
        """Rank 0 prints the pending re-forming line, now that the step is known."""
        if self.note is None:
            return
        line, self.note = self.note.format(step), None
        if self.world is not None and self.world.rank == 0:
            say(line)

    def mark(self, what: str) -> None:
        self.times[what] = time.time()

    def _report(self) -> None:
        """Rank 0 appends the last re-forming's phases to $UNICKPT_LIVE_TIMINGS (bench)."""
        path = os.environ.get(LIVE_TIMINGS_ENV)
        if not path or self.world is None or self.world.rank != 0 or self.gen is None or self.gen.number == 0:
            self.times.clear()
            return
        doc = {"generation": self.gen.number, "cause": self.gen.cause, "size": self.world.size,
               "died": self.gen.lost[0].get("at") if self.gen.lost else None, **self.times}
        with open(path, "a") as f:
            f.write(json.dumps(doc) + "\n")
        self.times.clear()


class _InFn:
    """While ``fn`` runs: the watcher may raise :class:`Interrupted` into the main thread."""

    def __init__(self, live: _Live) -> None:
        self.live = live

    def __enter__(self) -> None:
        """``fn`` may be interrupted from here; a generation published since the group
        formed ends this one at once (or is adopted, when it lost only spares)."""
        live = self.live
        with live.lock:
            pending, live.pending = live.pending, None
            over = pending is not None and live.gen is not None and pending.number > live.gen.number
            if over and live._unchanged(pending):
                live._adopt(pending)
                over = False
            live.in_fn = not over
        if over:  # (not in fn: the watcher raises nothing more into the tear-down that follows)
            raise Interrupted

    def __exit__(self, *exc: Any) -> None:
        self.live.leave_fn()


def _report_raised(live: _Live, error: BaseException) -> None:
    """Tell the coordinator what ended ``fn`` for good on this rank (before the process
    exits): an error of ``fn`` ends the job (exit 1) unless it is a failure of the process
    (a failed collective, a signal's KeyboardInterrupt, one of ``run(recover=...)``'s)."""
    if isinstance(error, SystemExit) and error.code in (0, None):
        return  # an early exit 0: the coordinator judges it by its peers
    recover = live.recover
    chosen = recover is True or (recover not in (False, None) and isinstance(error, recover))
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "fn"
    try:
        control.post_event(live.store, control.Raised(live.worker, f"{type(error).__name__}: {error}"[:300], where,
                                                      bool(chosen or _network_error(error) or isinstance(error, KeyboardInterrupt))))
    except RuntimeError:
        pass  # the job's store is gone: nothing to tell


def _forget_exception(error: BaseException) -> None:
    """Clear the frames of ``error``'s traceback and of every exception chained to it (a
    collective's error re-raised through autograd or a hook keeps the original, with
    frames that hold the model and its groups, as ``__context__``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        todo += [x.__cause__, x.__context__]
        x.__traceback__ = x.__cause__ = x.__context__ = None



def _describe(gen: Generation, multiple_of: int = 1, before: list[str] | None = None) -> str:
    """The first part of a re-forming's line: who was lost or who joined (or which spare
    stepped in), and the new size (and spares)."""
    active = gen.active(multiple_of)
    spares = len(gen.members) - len(active)
    size = f"{len(active)} ranks" + (f" ({spares} spare{'s' if spares != 1 else ''})" if spares else "")
    stepped = [m for m in active if before and m not in before and m not in gen.joined]
    if gen.cause == Cause.GROW or not gen.lost:
        n = len(gen.joined)
        return f"{n} replacement{'s' if n != 1 else ''} joined; continuing on {size}"
    ranks = [int(x["rank"]) for x in gen.lost]
    why = ", ".join(str(x["why"]) for x in gen.lost)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    joined = f", {len(gen.joined)} joined" if gen.joined else ""
    if stepped and len(active) == len(before or []):  # the same size: spares stepped in
        return f"{'spare' if len(stepped) == 1 else 'spares'} took {who}'s place{joined}; continuing on {size}"
    return f"{who} lost ({why}){joined}; continuing on {size}"


def _network_error(error: BaseException) -> bool:
    """True for an error a dead or departed peer causes, by its type (never its message: a
    user's ``RuntimeError("bad connection string")`` is fn's own error). What torch 2.13
    raises in a survivor (tests/peer_loss_probe.py, gloo on CPU): a TCPStore call
    (``get``, ``add``, ``set``, ``check``, ``wait``, ``compare_set``, ``multi_get``) whose
    host is gone, ``DistNetworkError``; a store wait that timed out and ``new_group`` with
    a dead member, ``DistStoreError``: each a ``DistError``, as NCCL's are (its process
    group throws ``DistBackendError`` on a timeout or a communicator's error: read in
    torch's source, not measured here). gloo's collectives raise a plain ``RuntimeError``
    instead (a peer killed, its connections cut, a timeout; DDP's backward too):
    :func:`_typed` makes it a ``PeerLost`` (a ``DistNetworkError``) from the state of the
    group's connections. A collective through a group of a torn-down generation:
    unickpt's ``GroupAbandoned``."""
    return isinstance(error, (dist.DistError, GroupAbandoned))


def _typed(error: BaseException, links: dict[int, str], grace_s: float = LINK_GRACE_S) -> BaseException:
    """``error``, or a :class:`~unickpt.dist.PeerLost` whose cause it is when ``fn`` ended
    with an error of no network type while a connection of this generation's default group
    (``links``, made by :func:`.regroup.form`) is lost, or is lost within ``grace_s``: the
    evidence that a peer died, cut its connections or timed out, read off the connections,
    not off the message (gloo's collectives raise a plain ``RuntimeError``). The grace: the
    error may come from another group's connection (a DeviceMesh's) a moment before the
    peer's end reaches the default group's, the dying process closing its sockets one by
    one (a race seen under load in tests/test_live.py's TP layout). A user's error, raised
    while every connection stays up, is kept as it is (``grace_s`` later)."""
    if not isinstance(error, Exception) or _network_error(error) or not links:
        return error
    deadline = time.monotonic() + grace_s
    while not links_lost(links):
        if time.monotonic() >= deadline:
            return error
        time.sleep(0.01)
    lost = PeerLost(f"a connection to a peer of this generation was lost while fn ran ({type(error).__name__}: {error})")
    lost.__cause__ = error
    return lost
