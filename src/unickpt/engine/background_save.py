"""The machinery of ``unickpt.async_save``: capture the state into host memory, write and
commit in the background (the protocol of :mod:`unickpt.engine.commit`, from a thread).

:func:`start_save` returns once this rank's state is staged (copied into a reusable host
buffer, pinned for CUDA tensors); a background thread then writes the rank's file and
takes part in the commit. All of the save's communication runs on a dedicated gloo
process group over the same ranks, created once and cached, never on the training group:
training collectives (NCCL or gloo) can run at the same time without interleaving with
the checkpoint's (DCP's thread mode on the default group hangs exactly there).

Saves on different *channels* are independent: each channel has its own saver (one
staging buffer, at most one save in flight) and its own gloo group, so a save on one
never waits for, nor interleaves collectives with, a save on another. The in-memory
snapshot tier saves on channel ``snapshot`` while a slow durable save of the default
channel is still writing; host memory for staging is then one copy of the rank's shard
per channel in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import crc32c as _crc
import torch
import torch.distributed as dist

from ..dist import Group, all_gather_fixed, group_cache, new_group, on_teardown, resolve_group
from ..errors import SaveError, UnickptError
from ..format.dtypes import dtype_name
from ..format.manifest import Fragment
from ..storage.base import Storage
from .collect import FlatState, LocalState, collect, tensor_digest
from .commit import (CommitTarget, Written, check_not_committed, commit, data_file_name, describe, prepare_collective,
                     write_rank)
from .exit_wait import finish_before_exit, forget
from .gc_pause import gc_paused
from .save_options import SaveOptions
from .staged_save import StagedSave
from .items import TensorItem
from .ring import MappedRing, Slot
from .ring_write import fragments, link_into, stage_into_slot, whole_crc
from .staging import StagingPool, Unit, copy_batch, flat_bytes, plan_batches, record_streams
from .unchanged import BaseIndex, split_unchanged
from .writer import DataFileWriter, as_bytes, data_file_layout

__all__ = ["AsyncSaveHandle", "DEFAULT_CHANNEL", "abandon_in_flight", "checkpoint_group", "prepare_staging", "staging_bytes",
           "start_save"]

DEFAULT_CHANNEL = "default"
_GROUPS: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = group_cache()  # emptied at exit (release_groups)


def checkpoint_group(group: Group, channel: str = DEFAULT_CHANNEL) -> Group:
    """The gloo group that carries ``channel``'s checkpoint traffic for ``group``'s ranks:
    created on first use (collectively, by every member) and cached for the life of the
    default group; each channel has its own."""
    if not group.active:
        return group
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group.pg))
    cached = _GROUPS.get((ranks, channel))
    if cached is None or cached[0] is not world:
        if len(ranks) == dist.get_world_size():
            pg = new_group(backend="gloo", parent=world)
        else:
            pg = new_group(list(ranks), "gloo", local=True, parent=group.pg)
        cached = _GROUPS[(ranks, channel)] = (world, pg)
    pg = cached[1]
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


class _Progress:
    """What the saver tells a handle: the state is staged (an event), the save is over
    (a future: its result, or its error)."""

    def __init__(self) -> None:
        self.staged = threading.Event()
        self.future: Future[int] = Future()
        self.future.set_running_or_notify_cancel()

    def fail(self, error: BaseException) -> None:
        self.staged.set()
        self.future.set_exception(error)

    def succeed(self, written: int) -> None:
        self.staged.set()
        self.future.set_result(written)


class AsyncSaveHandle:
    """A save in flight, returned by :func:`unickpt.async_save`; future-like.

    ``result()`` waits for the save and raises its error, if any, on every rank alike
    (the message names the failing ranks and files); ``done()`` polls; ``exception()``
    returns the error instead of raising it; ``add_done_callback(fn)`` calls ``fn(handle)``
    once the save is over (in the saver's thread, or at once when it already is).
    ``wait_staged()`` waits for the copy into host memory (``lazy=True`` saves).

    Attributes:
        path: Where the checkpoint is written.
        rank: This process's rank in the save's group.
    """

    def __init__(self, path: str, rank: int, progress: _Progress) -> None:
        self.path, self.rank = path, rank
        self._progress = progress

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied to host memory; after this the tensors
        may change. Needed only with ``lazy=True`` (else the call already waited).

        Args:
            timeout: Seconds to wait at most (None: as long as it takes).

        Raises:
            TimeoutError: The state is not staged after ``timeout`` seconds.
        """
        if not self._progress.staged.wait(timeout):
            raise TimeoutError(f"async save to {self.path}: state not staged after {timeout} s")

    def staged(self) -> bool:
        """Returns:
            True once the state has been copied to host memory."""
        return self._progress.staged.is_set()

    def done(self) -> bool:
        """Returns:
            True once the save has committed or failed."""
        return self._progress.future.done()

    def result(self, timeout: float | None = None) -> int:
        """Wait for the save to finish.

        Args:
            timeout: Seconds to wait at most (None: as long as it takes).

        Returns:
            The bytes this rank wrote (its data file; less for an incremental save).

        Raises:
            SaveError: The save failed (or another :class:`~unickpt.UnickptError`).
            TimeoutError: The save is still running after ``timeout`` seconds.
        """
        try:
            return self._progress.future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save to finish and return its error instead of raising it.

        Args:
            timeout: Seconds to wait at most (None: as long as it takes).

        Returns:
            The save's error, or None when it committed.

        Raises:
            TimeoutError: The save is still running after ``timeout`` seconds.
        """
        try:
            return self._progress.future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s") from None

    def add_done_callback(self, fn: Callable[[AsyncSaveHandle], Any]) -> None:
        """Call ``fn(handle)`` once the save is over (committed or failed).

        Args:
            fn: Called with this handle, in the saver's thread (at once when the save is
                already over).
        """
        self._progress.future.add_done_callback(lambda _: fn(self))


@dataclass
class _Job:
    """One async save on its way: the save itself (where, its options, this rank's captured
    state) and how this saver stages it (the items and sources, their batches through the
    buffer, or a ring slot)."""

    staged: StagedSave
    items: list[TensorItem]
    sources: list[torch.Tensor]
    digests: dict[int, str]
    batches: list[list[Unit]]
    capacity: int
    events: list
    lazy: bool
    target: CommitTarget | None = None  # None: a SharedDirectory
    base: BaseIndex | None = None  # an incremental save's base, opened
    refs: list[tuple[TensorItem, Fragment]] = field(default_factory=list)  # found unchanged in the call
    undecided: set[int] = field(default_factory=set)  # items to hash in the background (CUDA, lazy)
    ring: MappedRing | None = None  # write straight into a mapped slot of this ring (snapshots)
    slot: Slot | None = None  # the slot staged into
    slot_crcs: list[list[int]] = field(default_factory=list)  # each item's block CRC-32Cs in the slot
    layout: tuple[bytes, list[int], int] | None = None  # the slot's data file layout (data_file_layout), once made
    on_copied: Callable[[], None] | None = None  # called once no source is read any more (the staged event)


class _Saver:
    """One channel's async saver: one staging buffer, at most one save in flight."""

    def __init__(self) -> None:
        self.pool = StagingPool()
        self.current: _Progress | None = None
        # the save in flight's thread and its group's stop event (not the job: a finished
        # save must not keep its group alive into the next generation)
        self.thread: threading.Thread | None = None
        self.stop: threading.Event | None = None
        self.target: CommitTarget | None = None  # where the save in flight writes, once claimed
        self.streams: dict[torch.device, Any] = {}

    def wait(self) -> None:
        """Wait for the save in flight, if any (its error stays with its handle)."""
        if self.current is not None:
            wait([self.current.future])

    def start(self, job: _Job, progress: _Progress) -> None:
        """Stage (here unless lazy or the shard needs several batches) and start the
        background writer; return once staged unless lazy."""
        self.current, self.stop = progress, job.staged.group.stop
        if job.ring is not None:  # CUDA sources: staged once copied, while the checksums still run on the slot
            job.on_copied = progress.staged.set
        pin = torch.cuda.is_available() and any(s.is_cuda for s in job.sources)
        limit = job.staged.options.max_staging_bytes
        buf = None
        if job.staged.local is not None and job.ring is None:
            try:
                buf = self.pool.buffer(job.capacity, pin, limit)
            except Exception as e:  # no host memory for it on this rank: reported by the commit, on every rank
                job.staged.error = describe(e)
        crcs: dict[int, int] = {}
        here = not job.lazy and len(job.batches) == 1 and job.staged.error is None
        if here:
            try:
                self._stage(job, 0, buf, crcs)
            except Exception as e:
                job.staged.error = describe(e)
            progress.staged.set()
        # a daemon: an abandoned save stuck in gloo must not keep the process from exiting;
        # one that is not abandoned is waited for at exit all the same (exit_wait)
        thread = threading.Thread(
            target=self._run, args=(job, progress, buf, crcs, here), name="unickpt-async-save", daemon=True
        )
        self.thread = thread
        thread.start()
        finish_before_exit(thread, lambda path=job.staged.path: f"the async save to {path}")
        if not job.lazy:
            progress.staged.wait()

    def _stage(self, job: _Job, k: int, buf: torch.Tensor, crcs: dict[int, int]) -> None:
        """Copy batch ``k`` into the buffer; digest sources that are read in place."""
        if job.ring is not None:
            self._stage_ring(job, crcs)
            return
        batch = job.batches[k]
        copy_batch(batch, job.sources, buf, job.events, self.streams)
        for u in batch:
            if u.slot < 0 and u.index in job.digests:
                crcs[u.index] = _crc.crc32c(memoryview(flat_bytes(job.sources[u.index]).numpy()[u.lo : u.hi]), crcs.get(u.index, 0))

    def _stage_ring(self, job: _Job, crcs: dict[int, int]) -> None:
        """Copy the items straight into a free slot of the job's ring, checksumming as
        they land; digest the replicated tensors the agreement check compares."""
        ring, items, rank, opts = job.ring, job.items, job.staged.group.rank, job.staged.options
        assert ring is not None
        for i in job.digests:  # the replicated tensors not written here first: sources are not read after on_copied
            if i < len(items):
                continue
            src = job.sources[i]
            if src.is_cuda:  # on a side stream after the training stream's point of the call
                stream = self.streams.get(src.device) or self.streams.setdefault(src.device, torch.cuda.Stream(src.device))
                for dev, ev in job.events:
                    if dev == src.device:
                        stream.wait_event(ev)
                with torch.cuda.stream(stream):
                    src = src.to("cpu")
                stream.synchronize()
            crcs[i] = _crc.crc32c(memoryview(flat_bytes(src).numpy()))
        if items:
            pin = torch.cuda.is_available() and any(i.local.is_cuda for i in items)
            job.layout = data_file_layout(rank, items)  # once: the copy and the fragments take it too
            job.slot = ring.acquire(job.layout[2], pin)
            job.slot_crcs = stage_into_slot(items, job.layout, job.slot, opts.block_bytes, opts.threads, job.events,
                                            self.streams, job.on_copied)
        for i in job.digests:
            if i < len(items):
                n = items[i].local.numel() * items[i].local.element_size()
                crcs[i] = whole_crc(job.slot_crcs[i], n, opts.block_bytes)

    def _write_ring(self, job: _Job, crcs: dict[int, int], storage: Storage) -> Written:
        """The rank's file is the staged slot: link it into the step directory."""
        local, rank = job.staged.local, job.staged.group.rank
        assert local is not None and job.base is None
        files: dict[str, int] = {}
        written = list(job.refs)
        if job.items:
            assert job.slot is not None
            name = data_file_name(rank)
            link_into(job.slot, str(storage.path(name)))  # type: ignore[attr-defined]
            files[name] = job.slot.size
            assert job.layout is not None
            written += list(zip(job.items, fragments(job.items, job.layout[1], rank, name, job.slot_crcs,
                                                     job.staged.options.block_bytes)))
        for i, name in job.digests.items():
            t = job.sources[i]
            local.digests[name] = tensor_digest(dtype_name(t.dtype), tuple(t.shape), crcs.get(i, 0))
        return Written(written, files, None)

    def _run(self, job: _Job, progress: _Progress, buf: torch.Tensor, crcs: dict[int, int], staged_batch0: bool) -> None:
        try:
            # a snapshot (into a ring in memory) is over in milliseconds, most of them Python
            # per tensor: its collections cost more than its work (55 of ~90 ms at 1,600
            # tensors). A durable save, which may wait minutes on the disk, leaves the
            # collector alone.
            with gc_paused() if job.ring is not None else nullcontext():
                written = self._write_and_commit(job, progress, buf, crcs, staged_batch0)
        except BaseException as e:
            progress.fail(e if isinstance(e, UnickptError) else SaveError(
                f"async save to {job.staged.path} failed on rank {job.staged.group.rank}: {type(e).__name__}: {e}"
            ))
        else:
            progress.succeed(written)

    def _write_and_commit(self, job: _Job, progress: _Progress, buf: torch.Tensor, crcs: dict[int, int], staged_batch0: bool) -> int:
        last = len(job.batches) - 1
        if job.staged.error is None and not staged_batch0:
            try:
                self._stage(job, 0, buf, crcs)
            except Exception as e:
                job.staged.error = describe(e)
        if last == 0 or job.staged.error is not None:
            progress.staged.set()
        # Start writing only once every rank has staged: a rank that writes while others
        # still copy takes CPU and memory bandwidth from their (blocking) staging. A target
        # whose prepare is itself an all-reduce (the snapshots') is that barrier.
        staged = job.staged
        if job.target is None or not job.target.prepare_waits_for_all:
            all_gather_fixed(staged.group, b"\x01")
        target = prepare_collective(staged.group, staged.path, staged.overwrite, job.target, staged.storage_options)
        self.target = target  # abandoned (live recovery): given up at once, not at this thread's next collective
        try:
            with target.given_up_on_failure():
                write = self._write_ring if job.ring is not None else lambda j, c, s: self._write(j, progress, buf, c, s)
                report = write_rank(staged.group.rank, staged.local, lambda: write(job, crcs, target.storage), staged.error)
                progress.staged.set()
                commit(staged.group, report, target, staged.metadata)
        finally:
            self.target = None
        return sum(report.files.values())

    @staticmethod
    def _staged_bytes(job: _Job, buf: torch.Tensor):
        """Where an incremental save hashes item ``k``: its staged copy when everything is
        staged at once; else the source itself, which stays unchanged until the last batch
        is staged (None for a CUDA source: the item is written)."""
        if len(job.batches) == 1:
            where = {u.index: u for u in job.batches[0] if u.slot >= 0}

            def staged(k: int):
                u = where.get(k) if k in job.undecided else None
                return memoryview(buf[u.slot : u.slot + (u.hi - u.lo)].numpy()) if u is not None else None

            return staged

        def source(k: int):
            t = job.sources[k]
            return None if t.device.type != "cpu" or k not in job.undecided else memoryview(flat_bytes(t).numpy())

        return source

    def _write(self, job: _Job, progress: _Progress, buf: torch.Tensor, crcs: dict[int, int], storage: Storage) -> Written:
        """Write this rank's file from the staging buffer, batch by batch (staging the
        next batch once the previous one is written)."""
        group, local, base, opts = job.staged.group, job.staged.local, job.base, job.staged.options
        assert local is not None
        files: dict[str, int] = {}
        slots = {k: k for k in range(len(job.items))}  # item index -> index among the items written
        written = list(job.refs)
        if base is not None and job.undecided:
            changed, refs = split_unchanged(base, job.items, group.rank, opts.block_bytes, opts.threads, self._staged_bytes(job, buf))
            written += [(job.items[k], f) for k, f in refs]
            slots = {k: n for n, k in enumerate(changed)}
        to_write = [job.items[k] for k in slots]
        writer = DataFileWriter(storage, data_file_name(group.rank), group.rank, to_write, opts.block_bytes, opts.threads) if to_write else None
        try:
            for k, batch in enumerate(job.batches):
                if k > 0:
                    self._stage(job, k, buf, crcs)
                    if k == len(job.batches) - 1:
                        progress.staged.set()
                parts = []
                for u in batch:
                    if u.slot < 0:
                        continue
                    data = memoryview(buf[u.slot : u.slot + (u.hi - u.lo)].numpy())
                    if u.index in job.digests:
                        crcs[u.index] = _crc.crc32c(data, crcs.get(u.index, 0))
                    if u.index in slots:
                        parts.append((slots[u.index], u.lo, data))
                if writer is not None and parts:
                    writer.write(parts)
            if writer is not None:
                size, fragments = writer.finish()
                files[data_file_name(group.rank)] = size
                written += list(zip(to_write, fragments))
        except BaseException:
            if writer is not None and not files:
                writer.abort()
            raise
        for i, name in job.digests.items():
            t = job.sources[i]
            local.digests[name] = tensor_digest(dtype_name(t.dtype), tuple(t.shape), crcs.get(i, 0))
        return Written(written, files, base)


_SAVER = _Saver()
_SAVERS: dict[str, _Saver] = {DEFAULT_CHANNEL: _SAVER}  # channel -> its saver


def _saver(channel: str) -> _Saver:
    saver = _SAVERS.get(channel)
    if saver is None:
        saver = _SAVERS[channel] = _Saver()
    return saver


def _unchanged_in_call(
    index: BaseIndex, local: LocalState, rank: int, world: int, options: SaveOptions, lazy: bool
) -> list[tuple[TensorItem, Fragment]]:
    """An incremental save's CPU tensors that equal the base's, found by hashing them in
    the call (xxh3-128 runs faster than the copy into the staging buffer that it spares)
    and taken out of what is staged and written. Lazy saves and CUDA tensors are hashed
    in the background, from the staged copy."""
    if lazy:
        return []
    items = local.to_write + local.rank_tensors

    def data(k: int):
        t = items[k].local
        return as_bytes(flat_bytes(t)) if t.device.type == "cpu" else None

    # a replicated tensor that is not staged gets its agreement digest from the pass that
    # hashes it (other ranks compute theirs from the same bytes) when this rank writes it
    # whole (a share of it would give a share's CRC); alone, no rank compares it
    sources = local.digest_sources
    crcs = {k: 0 for k, i in enumerate(items) if i.name in sources and tuple(i.local.shape) == tuple(sources[i.name].shape)}
    crcs = crcs if world > 1 else {}
    _, refs = split_unchanged(index, items, rank, options.block_bytes, options.threads, data, crcs)
    for k, f in refs:
        name = items[k].name
        if name in local.digest_sources and (world == 1 or k in crcs):
            t = local.digest_sources.pop(name)
            local.digests[name] = tensor_digest(dtype_name(t.dtype), tuple(t.shape), crcs[k]) if world > 1 else f"xxh3={f.xxh3}"
    unchanged = {k for k, _ in refs}
    n = len(local.to_write)
    local.to_write = [i for k, i in enumerate(local.to_write) if k not in unchanged]
    local.rank_tensors = [i for k, i in enumerate(local.rank_tensors, n) if k not in unchanged]
    return [(items[k], f) for k, f in refs]


def _plan(local: LocalState | None, options: SaveOptions):
    if local is None:
        return [], [], {}, [[]], 0
    items = local.to_write + local.rank_tensors
    sources = [i.local for i in items]
    staged = [True] * len(items)
    digests: dict[int, str] = {}
    # a replicated tensor this rank writes whole (not a row share of it)
    index = {i.name: k for k, i in enumerate(items) if i.name in local.digest_sources and i.local.shape == local.digest_sources[i.name].shape}
    for name, t in local.digest_sources.items():
        if name in index:  # this rank writes it: digest the staged copy, in the background
            digests[index[name]] = name
        else:
            digests[len(sources)] = name
            sources.append(t)
            staged.append(t.is_cuda)
    sizes = [t.numel() * t.element_size() for t in sources]
    batches, capacity = plan_batches(sizes, staged, options.max_staging_bytes, options.block_bytes)
    return items, sources, digests, batches, capacity


def start_save(
    state_dict: dict[str, Any] | FlatState,
    path: str,
    options: SaveOptions,
    *,
    process_group: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    lazy: bool = False,
    target: CommitTarget | None = None,
    storage_options: dict[str, Any] | None = None,
    base: Callable[[], BaseIndex] | None = None,
    channel: str = DEFAULT_CHANNEL,
    ring: MappedRing | None = None,
) -> AsyncSaveHandle:
    """:func:`unickpt.async_save` (which see) with its write options as one
    :class:`~unickpt.SaveOptions` (checked when it was built), and the keywords of the
    library's own callers: ``base`` opens the base of an incremental save (its failure is
    this rank's, reported at the commit); ``channel`` picks the saver and gloo group (one
    save in flight per channel; the snapshot tier uses ``"snapshot"``, so that a snapshot
    never waits for a durable save); ``target`` where the files go and how the manifest is
    committed there (:mod:`unickpt.engine.targets`; every rank passes the same kind): None
    is one shared directory rank 0 claims, a
    :class:`~unickpt.engine.targets.NodeCopies` a directory on each rank's own machine
    (the in-memory snapshots); ``ring`` (with ``NodeCopies``, a directory on a local file
    system) writes the rank's file straight into a free slot of that ring of mapped files
    and hard-links it into ``path`` (:mod:`unickpt.engine.ring`). ``state_dict`` may be
    one flattened already (:func:`~unickpt.engine.collect.flatten_state`)."""
    saver = _saver(channel)
    saver.wait()
    # the background thread's collectives go through a group of its own stop event: set
    # when live recovery abandons the save (abandon_in_flight)
    group = replace(checkpoint_group(resolve_group(process_group), channel), stop=threading.Event())
    staged = StagedSave(group, str(path), options, overwrite, dict(metadata or {}), storage_options, base)
    group = staged.group
    check_not_committed(staged.path, overwrite, storage_options, group)
    index, refs, undecided = None, [], set()
    try:
        with gc_paused():
            staged.local = collect(state_dict, group, defer=True)
            if base is not None:
                index = base()
                refs = _unchanged_in_call(index, staged.local, group.rank, group.size, options, lazy)
            items, sources, digests, batches, capacity = _plan(staged.local, options)
            if index is not None:
                undecided = {k for k, i in enumerate(items) if lazy or i.local.device.type != "cpu"}
    except Exception as e:  # reported to rank 0 by the background commit, like save()
        staged.local, staged.error = None, describe(e)
        items, sources, digests, batches, capacity = _plan(None, options)
    events = record_streams(sources)
    job = _Job(staged, items, sources, digests, batches, capacity, events, lazy, target, index, refs, undecided,
               ring if base is None else None)
    progress = _Progress()
    saver.start(job, progress)
    return AsyncSaveHandle(staged.path, group.rank, progress)


def prepare_staging(nbytes: int, pin: bool, channel: str = DEFAULT_CHANNEL) -> None:
    """Allocate ``channel``'s staging buffer of ``nbytes`` (pinned when ``pin`` and CUDA
    is available) in the background, once the caller knows the state's size, so that the
    first save's stall is its copy, not the allocation and pinning."""
    _saver(channel).pool.prepare(nbytes, pin and torch.cuda.is_available())


def staging_bytes(channel: str | None = None) -> int:
    """Bytes of host memory the async savers' staging buffers hold now (of one channel,
    or of all)."""
    if channel is not None:
        return _SAVERS[channel].pool.nbytes if channel in _SAVERS else 0
    return sum(s.pool.nbytes for s in _SAVERS.values())


def release_staging(channel: str = DEFAULT_CHANNEL) -> None:
    """Free ``channel``'s staging buffer (the next save allocates it again)."""
    if channel in _SAVERS:
        _SAVERS[channel].pool.release()


_ABANDONED: list[threading.Thread] = []  # threads of saves abandoned at a tear-down, until they end
ABANDONED_JOIN_S = 5.0  # how long a tear-down waits for them (a thread still writing ends at its next collective)


@on_teardown
def abandon_in_flight() -> int:
    """Forget every channel's save still in flight, so that the next save on the channel
    does not wait for it: live recovery calls it when a peer died, where such a save is
    stuck on the dead generation's process group. No collective starts on its group from
    now on (its group's ``stop``): its thread ends in the collective it is in once the
    group's sockets are cut, or at its next one (:func:`join_abandoned` waits for it);
    its files are never committed, unless its commit already ran (rank 0 published the
    manifest before this call: that checkpoint stays, and the step saved again finds it
    there). Returns how many were abandoned."""
    stuck = [name for name, saver in _SAVERS.items() if saver.current is not None and not saver.current.future.done()]
    for name in stuck:
        saver = _SAVERS[name]
        if saver.stop is not None:
            saver.stop.set()
        if saver.thread is not None:
            # not waited for at exit: gloo can leave it blocked for the group's whole timeout (a send
            # in flight on a connection its peer closed is not always failed, seen in torch 2.13
            # after a rank was stopped and continued), and the process must still exit
            forget(saver.thread)
            _ABANDONED.append(saver.thread)
        target = saver.target
        if target is not None:  # rank 0's claim: released now, so the survivors' save of the step is not refused
            target.give_up()
        _SAVERS[name] = _Saver()
    return len(stuck)


@on_teardown(after_cut=True)
def join_abandoned(timeout: float = ABANDONED_JOIN_S) -> int:
    """Wait (up to ``timeout`` s in all) for the threads of the abandoned saves, before
    the tear-down shuts their groups down; returns how many still run (a save still
    writing its file: it ends at its next collective, which its group refuses)."""
    deadline = time.monotonic() + timeout
    for thread in list(_ABANDONED):
        thread.join(max(0.0, deadline - time.monotonic()))
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
    return len(_ABANDONED)
