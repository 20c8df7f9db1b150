"""``unickpt.CheckpointManager``: fault tolerance for any training loop in a few lines.

    manager = unickpt.CheckpointManager("ckpt", keep=3, save_every=50, async_save=True,
                                        snapshot_every=1, parity=1, log_deltas=True)
    start = manager.restore(state)          # collective; 0 when there is nothing to restore
    for step in range(start + 1, total + 1):
        loss = forward_backward(batch)
        manager.before_update()             # right before optimizer.step()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        manager.maybe_save(state, step)     # whatever is due at this step
    manager.close()

It owns every tier and the order of recovery: the in-memory snapshots held by the
node's keeper (:mod:`unickpt.snapshot`), the durable checkpoints of :class:`Checkpoints`
(fast tier, optional ``durable=`` tier, retention, incremental saves) and the per-step
delta log (:mod:`.deltas`). Training never stops for a failed snapshot or save: a
warning, a counter in :meth:`CheckpointManager.stats`, and the next one tries again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

from ..dist import all_true, first_said, resolve_group
from ..engine.gc_pause import gc_paused
from ..engine.outcome import decided_by_rank0
from ..engine.restored import Restored
from ..errors import UnickptError, one_line
from ..logs import say
from ..live.run import Interrupted, position, restored, step_boundary
from .async_save import AsyncSaveHandle, async_save
from .checkpoints import Checkpoints, TierFallbackWarning, durable_options
from .deltas.log import Replay, step_of
from .load import load_into
from .stats import RunStats, SaveRecord
from .options import (DeltaDtype, DeltaLogOptions, DurableOptions, ManagerOptions, SaveMode, SaveSchedule, SnapshotOptions,
                      check_loop)
from .saveable import check_saveable
from .state_copy import StateCopy
from .deltas.replay import StepDeltas, replay_line, replay_refusal

__all__ = ["CheckpointManager", "TierFallbackWarning"]


class CheckpointManager(Checkpoints):
    """Numbered checkpoints ``root/step_00000100`` (a directory or a URL, ``storage_options``
    for its file system) keeping the newest ``keep`` (all when None), and, for a training
    loop, every tier of fault tolerance behind four calls: :meth:`restore`,
    :meth:`before_update`, :meth:`maybe_save`, :meth:`close`.

    Durable checkpoints: ``save_every`` N saves the state every N steps (``async_save``:
    in the background, the loop stalls only for the copy into host memory). ``durable``
    (a URL or directory) gets a copy of every ``durable_every``-th checkpoint, keeping
    ``durable_keep``; ``incremental`` saves only what changed since the latest checkpoint
    (a full one every ``full_every``).

    Memory: ``snapshot_every`` N snapshots the state into host shared memory every N steps,
    held by a keeper process per node that outlives a crashed trainer; ``parity`` M parity
    blocks per group across nodes (default 1: XOR; 0: local only) or
    ``snapshot_replicas`` R full copies on neighbour nodes; ``flush_every`` F: the keepers
    write every Fth snapshot as an ordinary checkpoint under ``root``;
    ``snapshot_max_bytes`` caps the host memory per node (default half the shm file system).

    Delta log: ``log_deltas`` logs every step's applied gradients (and what else the step
    changed) so that a restore replays the steps after the last full checkpoint (needs
    ``save_every``); ``delta_dtype="bf16"`` halves the bytes, the replay is then close, not
    bitwise.

    ``metadata`` (plain values) is stored in every durable checkpoint's manifest (the
    Hugging Face integration puts the model's config there as ``hf_config``, which
    ``unickpt export`` writes as config.json).

    ``process_group``: the job's group (default: the default group). Construction is
    local (no collective); the tiers start at the first :meth:`restore` or
    :meth:`maybe_save`, which are collective. ``save``, ``load``, ``latest``,
    ``path_for``, ``prune``, ``steps`` and ``wait`` work as on a plain manager (see
    :class:`Checkpoints`): ``save``/``load`` are collective, ``latest``, ``path_for`` and
    ``steps`` local, ``prune`` and the durable copy rank 0's.

    Options come in groups, each one object checked when built:
    ``saves=SaveSchedule(every=50, mode="async")``, ``snapshot=SnapshotOptions(every=1,
    parity=1)``, ``deltas=DeltaLogOptions(dtype="bf16")``, ``durable=DurableOptions("s3://bucket/run",
    every=4)``. Each group may instead be written with its flat keywords (the
    signature's second part, after ``metadata``: ``save_every=50, async_save=True``), one
    way per group, never both; they are turned into the same groups here, once, and an
    error names what was written (the keyword, or ``Group.field``). :attr:`options` holds
    the groups in effect (a :class:`~unickpt.api.options.ManagerOptions`); nothing else
    keeps a copy of them. What the run did is :meth:`stats` (each durable save's
    :class:`~unickpt.api.stats.SaveRecord` in ``last_save``); what it tells goes through the
    ``unickpt`` logger (:mod:`unickpt.logs`).

    Args:
        root: The fast tier: a directory or a URL.
        keep: Keep the newest ``keep`` checkpoints (None: all).
        saves: The save schedule: every N steps, sync or async, incremental
            (:class:`~unickpt.SaveSchedule`; flat: ``save_every``, ``async_save``,
            ``incremental``, ``full_every``).
        snapshot: The memory snapshots (:class:`~unickpt.SnapshotOptions`; flat:
            ``snapshot_every``, ``parity``, ``snapshot_replicas``, ``flush_every``,
            ``snapshot_max_bytes``, ``snapshot_stripes``).
        deltas: The delta log (:class:`~unickpt.DeltaLogOptions`; flat: ``log_deltas``,
            ``delta_dtype``).
        durable: The durable tier: a :class:`~unickpt.DurableOptions`, or its URL or
            directory (flat, with ``durable_every``, ``durable_keep``,
            ``durable_storage_options``).
        storage_options: Options of the root's file system (fsspec).
        process_group: The job's group (default: the default group).
        metadata: Plain values stored in every durable checkpoint's manifest.
        save_every: Flat ``saves``: a durable checkpoint every N steps (0: only forced ones).
        async_save: Flat ``saves``: write them in the background.
        incremental: Flat ``saves``: incremental saves (a local root, no durable tier).
        full_every: Flat ``saves``: with ``incremental``, a full save every N saves.
        snapshot_every: Flat ``snapshot``: a memory snapshot every N steps (0: none).
        parity: Flat ``snapshot``: parity blocks per group across nodes (None: 1, XOR;
            0: local only).
        snapshot_replicas: Flat ``snapshot``: full copies per node's snapshot instead of parity.
        flush_every: Flat ``snapshot``: the keepers write every Nth snapshot as a
            checkpoint under ``root``.
        snapshot_max_bytes: Flat ``snapshot``: a cap on the snapshots' host memory per node.
        snapshot_stripes: Flat ``snapshot``: the most nodes one parity block covers (default 8).
        log_deltas: Flat ``deltas``: log every step for replay after the last full checkpoint.
        delta_dtype: Flat ``deltas``: ``"exact"`` or ``"bf16"``.
        durable_every: Flat ``durable``: copy every Nth checkpoint to the durable tier.
        durable_keep: Flat ``durable``: keep the newest N there (None: all).
        durable_storage_options: Flat ``durable``: options of the durable tier's file system.

    Raises:
        UnickptError: A bad value or combination, naming the keyword (or ``Group.field``),
            the value and what is allowed; nothing has started then.
    """

    options: ManagerOptions  # the groups in effect: the only copy of the configuration

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int | None = None,
        *,
        saves: SaveSchedule | None = None,
        snapshot: SnapshotOptions | None = None,
        deltas: DeltaLogOptions | None = None,
        durable: str | os.PathLike | DurableOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        metadata: dict[str, Any] | None = None,
        # -- the flat spellings of the groups above: one way per group, turned into it here --
        save_every: int = 0,
        async_save: bool = False,
        incremental: bool = False,
        full_every: int | None = None,
        snapshot_every: int = 0,
        parity: int | None = None,
        snapshot_replicas: int = 1,
        flush_every: int = 0,
        snapshot_max_bytes: int | None = None,
        snapshot_stripes: int = 8,
        log_deltas: bool = False,
        delta_dtype: DeltaDtype = "exact",
        durable_every: int = 1,
        durable_keep: int | None = None,
        durable_storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(async_save, bool):
            raise UnickptError(f"async_save must be True or False, not {async_save!r}")
        given = SaveSchedule.merged(saves, {"every": save_every, "mode": "async" if async_save else "sync",
                                            "incremental": incremental, "full_every": full_every})
        snap = SnapshotOptions.merged(snapshot, {"every": snapshot_every, "parity": parity, "replicas": snapshot_replicas,
                                                 "flush_every": flush_every, "max_bytes": snapshot_max_bytes,
                                                 "stripes": snapshot_stripes},
                                      {"every": 0})
        logged = DeltaLogOptions.merged(deltas, {"enabled": log_deltas, "dtype": delta_dtype}, {"enabled": False})
        self._configure(root, keep, storage_options, given,
                        durable_options(durable, durable_every, durable_keep, durable_storage_options))
        check_loop(self.root, given, snap, logged)
        if snap.group.every:  # a node without the memory fails here, not at a later step
            from ..snapshot.client import check_host_memory, job_id
            from ..snapshot.paths import shm_root

            check_host_memory(shm_root(), job_id(self.root), snap.group.max_bytes, snap.name("max_bytes"))
        self.options = ManagerOptions(given.group, self.options.durable, snap.group if snap.group.every else None,
                                      logged.group if logged.group.enabled else None)
        self.process_group = process_group
        self.metadata = metadata  # stored in every durable checkpoint's manifest (plain values)
        self.restored_line: str | None = None
        self._started = False
        self._closed = False
        self._reform_after: int | None = None  # a re-forming is due after this step (live recovery)
        self._prepared = False  # the snapshot ring and pinned staging made (see _prepare_buffers)
        self._snap: Any = None
        self._deltas: StepDeltas | None = None
        self._state: dict[str, Any] | None = None
        self._early_update = False  # before_update() was called before the delta log started
        self._pending: _Pending | None = None
        self._housekept: int | None = None  # the step of the last async save whose retention ran
        self._stepped: int | None = None  # the last step restored or passed to maybe_save, and the last saved
        self._saved_step: int | None = None
        self._newest_seen: int | None = None  # the newest checkpoint seen, and the step the valid ones cover
        self._covers: int | None = None
        self.run_stats = RunStats()  # every count and failure of this run, told once

    # -- the training loop's calls -----------------------------------------------------
    @gc_paused()  # a recovery's plans and manifests: thousands of small objects (engine/gc_pause.py)
    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest whole, verified state into ``state`` and return its step (0 when
        there is nothing to restore); collective.

        Memory first (after a crash; after a lost node, decoded from parity or copies, onto
        whatever ranks run now), else the durable checkpoints (the fast tier's copy, else
        the ``durable`` tier's) plus the delta log's steps after them. Rank 0 says one
        line, from where and why the newer sources were passed over, on the ``unickpt``
        logger (by default on stdout: :mod:`unickpt.logs`), kept in :attr:`restored_line`: ``resumed step S from
        memory (...)``, ``resumed step S from disk (...)`` (``from disk + D logged steps``)
        or ``starting fresh (...)``. On the same layout ``state`` is then bitwise what it
        was after step S of the broken run; on another number of ranks per-rank entries
        (:class:`unickpt.RNGState`) keep their values, as the line says. An entry of
        ``state`` that no save could store (not a tensor, a Stateful object or plain data,
        e.g. a plain ``DataLoader``) is a :class:`~unickpt.UnickptError` naming it, before
        anything is loaded, on every rank (the others name the rank that holds it).

        Args:
            state: The training state, filled in place (as for :func:`unickpt.load`).

        Returns:
            The step restored (0: nothing to restore, a fresh start).

        Raises:
            UnickptError: An entry no save could store, or a state whose steps the delta
                log cannot replay exactly.
            CorruptionError: Checkpoints are there but none is whole (never a silent
                fresh start).
        """
        t0 = time.perf_counter()
        self._state = state
        group = resolve_group(self.process_group)
        self._check_restorable(state, group)
        self._start()
        kept: list[str] = []
        plan = self._deltas.plan() if self._deltas is not None else None
        # the newest whole checkpoint; else the newest committed one, so that checkpoints there
        # of which none loads are an error naming each (never a silent fresh start)
        latest = decided_by_rank0(group, lambda: (self.latest() or self._newest_committed() or "").encode()).decode() or None
        disk_step = plan.step if plan is not None and plan.usable else (step_of(latest) if latest else None)
        if self._snap is None:
            got = self._durable(state, plan, latest, kept)
            seconds = time.perf_counter() - t0
            if got is None:
                outcome = Restored(0, "fresh", seconds, nothing=self._nothing_on_disk(plan))
            else:
                outcome = Restored(got[0], "disk", seconds, got[1], logged=_logged(plan))
        else:
            outcome = self._recover(state, plan, latest, disk_step, kept)
        if outcome.step:  # a fresh start prepares them after its first update (see _prepare_buffers)
            self._prepare_buffers(state)
        step, line = outcome.step, replace(outcome, kept=tuple(kept)).line()
        if self._deltas is not None:
            self._deltas.started(step)
            self._deltas.watch(state)
        self._stepped = step
        self.restored_line = line
        if group.rank == 0:
            say(line)
        restored(step)  # under `unickpt launch`, after a re-forming: its line
        return step

    def _check_restorable(self, state: dict[str, Any], group: Any) -> None:
        """Refuse a state with an entry no save can store, or whose steps the delta log
        cannot replay, on every rank: a refusal on one rank only (its state holds what the
        others' do not) would leave the others waiting in the restore's collectives."""
        why = ""
        try:
            check_saveable(state)
            if self.options.deltas is not None and (refusal := replay_refusal(state)):
                raise UnickptError(f"log_deltas=True cannot replay this state's steps exactly: {refusal}; "
                                   "turn log_deltas off (snapshots and checkpoints still protect the run)")
        except UnickptError as e:
            why = str(e)
        first = first_said(group, why)
        if first is not None:
            rank, text = first
            raise UnickptError(text if rank == group.rank else f"rank {rank}: {text}")

    def before_update(self, state: dict[str, Any] | None = None) -> None:
        """Right before ``optimizer.step()``: wait until a lazy snapshot has copied the
        state, and capture the step's gradients for the delta log (of ``state``, by default
        the one given to :meth:`restore` or the last :meth:`maybe_save`). Costs nothing
        when neither is on.

        Args:
            state: The training state (None: the last one given).
        """
        self._reform_if_due()
        if state is not None:
            self._state = state
        if self._deltas is None and not self._started and self.options.deltas is not None:
            self._early_update = True  # told at maybe_save: the delta log starts with restore() or the first save
        if self._snap is None and self._deltas is None:
            return
        t0 = time.perf_counter()
        if self._snap is not None:
            self._snap.before_update()
        if self._deltas is not None and self._state is not None:
            self._deltas.capture(self._state)
        self.run_stats.stall_s += time.perf_counter() - t0

    def maybe_save(self, state: dict[str, Any], step: int, force: bool = False) -> None:
        """After the optimizer (and scheduler) step of ``step``: whatever is due — a durable
        checkpoint every ``save_every`` steps (async: started here, written in the
        background), the step's delta log entry, a snapshot every ``snapshot_every`` steps.
        ``force=True`` takes the durable checkpoint of ``step`` whether due or not (a
        framework's last step); called again for the step just passed (or restored), it
        takes only that checkpoint, if not taken yet. Collective. A failure is a warning
        and a count in :meth:`stats`, never an exception: the next save or snapshot tries
        again.

        Args:
            state: The training state after the step.
            step: The step just taken.
            force: Take the durable checkpoint of ``step`` whether due or not.

        Raises:
            unickpt.live.run.Interrupted: Under ``unickpt launch``, the job re-forms after
                the previous step, where a replacement joins (caught by :func:`unickpt.run`;
                raised at the first call into the manager after that step: ``before_update``,
                ``maybe_save`` or ``close``).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UnickptError(f"maybe_save(state, step): step must be a whole number >= 0, not {step!r}")
        if step != self._reform_after:
            self._reform_if_due()
        t0 = time.perf_counter()
        self._state = state
        if not self._started:  # restore() was not called (the state was loaded otherwise)
            if self.last_load is None:  # nor load(): nothing says this run chose where it starts
                self._check_not_behind(step)
            self._start()
            if self._deltas is not None:
                self._deltas.started(step - 1)
                self._deltas.watch(state)
        if not self._prepared and (self._snap is not None or self.options.saves.mode == "async"):
            self._prepare_buffers(state)  # a fresh run, after its first update: its first save takes the first slot
        if step == self._stepped:  # the same step again (a framework's end of fit): its durable checkpoint only
            if force and self._saved_step != step:
                self._save_step(state, step)
            self.run_stats.stall_s += time.perf_counter() - t0
            return
        self._stepped = step
        every = self.options.saves.every
        saved = force or (bool(every) and step % every == 0)
        if saved:
            self._save_step(state, step)
        elif self._pending is not None and resolve_group(self.process_group).rank == 0 and self._pending.handle.done():
            self._housekeep()
        if self._deltas is not None:
            if not self._deltas.commit(state, step):
                why = ("before_update() came before the log started (call restore(state) before the loop)"
                       if self._early_update else "before_update() was not called before optimizer.step()")
                self._count_failure("delta_steps_missed", f"step {step} is not in the delta log: {why}")
            self._early_update = False
            why = self._deltas.take_failure()
            if why is not None:
                self._delta_failed(why)
        if self._snap is not None and self._snap.due(step):
            try:
                self._snap.snapshot(state, step, flush=not saved)
            except UnickptError as e:
                self._count_failure("snapshots_failed", f"snapshot of step {step} failed, training goes on: {e}")
        self.run_stats.stall_s += time.perf_counter() - t0
        if step_boundary(step):  # under `unickpt launch`: a replacement joins after this step
            # the step's snapshot now, whole; the step itself runs to its end (the loop's
            # logging after this call included): the next call into the manager raises
            self._last_snapshot(state, step, saved)
            self._reform_after = step

    def save_last(self, state: dict[str, Any], step: int) -> None:
        """The durable checkpoint of a run's last ``step`` (trained, or restored with nothing
        left to train) unless the root holds one already: the same command run again then
        restores it and trains nothing, and :meth:`close` may free the snapshots. Collective:
        rank 0's listing decides, so every rank takes the same branch.

        Args:
            state: The training state after the step.
            step: The run's last step.
        """
        group = resolve_group(self.process_group)
        if not decided_by_rank0(group, lambda: b"1" if step in self.steps() else b""):
            self.maybe_save(state, step, force=True)

    def _reform_if_due(self) -> None:
        """Under ``unickpt launch``, at the first call into the manager after the step whose
        boundary a replacement joins at: raise :class:`Interrupted` (``unickpt.run`` re-forms
        the job and resumes from that step's snapshot; at most this step's forward and
        backward are computed again)."""
        if self._reform_after is not None:
            step, self._reform_after = self._reform_after, None
            raise Interrupted(f"the job re-forms after step {step}")

    def close(self, keep_snapshots: bool = False) -> None:
        """Wait for what is in flight (a durable save, the delta log's writes, the durable
        copy, a snapshot) and clean up: the keepers stop and delete the job's snapshots,
        leaving no process and no shared memory behind; collective. ``keep_snapshots=True``
        leaves the snapshots and keepers for a relaunch (a planned stop that is to resume
        from memory), once the keepers hold the newest snapshot whole (waiting up to 2 s plus a
        second per 256 MiB of the node's snapshot). A second call does nothing.

        Args:
            keep_snapshots: Leave the snapshots and keepers for a relaunch.
        """
        if self._closed:
            return
        self._reform_if_due()  # the loop ended at a replacement's boundary: the job finishes on the grown world
        self._closed = True
        self._finish_pending()
        if self._deltas is not None:
            try:
                self._deltas.close()
            except UnickptError as e:  # the entries still queued: the replay stops before the failed one
                self._delta_failed(one_line(e))
        self.wait()
        if self._snap is not None:
            self._snap.close(clean=not keep_snapshots)

    def stats(self) -> dict[str, Any]:
        """Counters of this run.

        Returns:
            ``saves`` committed and ``saves_failed``, ``snapshots`` taken,
            ``snapshots_skipped`` (the keepers still encoding earlier ones) and
            ``snapshots_failed``, ``delta_entries`` written, ``delta_entries_failed`` and
            ``delta_steps_missed``, ``durable_copies_failed`` and ``durable_copies_skipped``
            (superseded by a newer one while the copy before ran), ``stall_s`` (seconds the loop
            spent in ``before_update`` and ``maybe_save``), ``snapshot_stall_s`` (of which
            the snapshots'), ``last_error`` and ``last_save`` (the last durable save's
            :class:`~unickpt.api.stats.SaveRecord` as a dict: step, path, mode, seconds,
            stall_s, bytes, error). Plain values (JSON-ready); the manager keeps them in
            :attr:`run_stats`.
        """
        snap = self._snap
        out = self.run_stats.as_dict()
        out.update(snapshots=snap.taken if snap else 0, snapshots_skipped=snap.skipped if snap else 0,
                   delta_entries=self._deltas.log.stats["entries"] if self._deltas else 0,
                   durable_copies_failed=len(self.durable_errors), durable_copies_skipped=len(self.durable_skipped))
        out["snapshot_stall_s"] = snap.stall_s if snap else 0.0
        if snap is not None:
            out["snapshots_failed"] += len(snap.failures)
        return out

    # -- inside ------------------------------------------------------------------------
    def _prepare_buffers(self, state: dict[str, Any]) -> None:
        """Now that the state's size is known: take the snapshot ring's memory and the
        async saves' pinned staging buffer in the background, so that neither the
        allocation nor the pinning lands on a training step. Not before the first update
        of a fresh run: sizing the state reads every ``state_dict()``, and torch's
        ``get_optimizer_state_dict`` (torchtitan's optimizers container, say) initialises a
        never-stepped optimizer's state with a step of its own, which changes every update
        after it (test_torchtitan's runs then left the unbroken curve at step 2)."""
        self._prepared = True
        if self._snap is not None:
            self._snap.prepare(state)
        if self.options.saves.mode == "async":
            from ..engine.background_save import prepare_staging
            from ..snapshot.client import estimated_file_bytes

            nbytes, cuda = estimated_file_bytes(state, 0)
            if cuda:  # pinning is what costs; pageable memory is allocated by the first save as before
                prepare_staging(nbytes, True)

    def _check_not_behind(self, step: int) -> None:
        """Collective, at the first ``maybe_save`` of a run that called neither
        :meth:`restore` nor :meth:`load`: a UnickptError on every rank when the root already
        holds a checkpoint of ``step`` or later. This run's checkpoints would be older than
        it: a resume would pick it over them, and ``keep`` would delete them first (a
        relaunch that forgot ``restore()``)."""
        newest = int(decided_by_rank0(resolve_group(self.process_group),
                                      lambda: str(max(self.steps(), default=-1)).encode()))
        if newest >= step:
            raise UnickptError(f"{self.root} already holds the checkpoint of step {newest}, and this run saves step "
                               f"{step} without having called restore(): a resume would pick step {newest} over this "
                               f"run's checkpoints{' and keep=' + str(self.keep) + ' would delete them' if self.keep else ''}"
                               f". Call manager.restore(state) first to continue from it (manager.load(state, path) to go back to "
                               "an earlier one on purpose), or use another root")

    def _start(self) -> None:
        """Collective, once: the snapshot tier (the node's keeper) and the delta log."""
        if self._started:
            return
        self._started = True
        snapshot, deltas = self.options.snapshot, self.options.deltas
        if snapshot is not None:
            from ..snapshot.client import Snapshotter, job_id

            self._snap = Snapshotter(job_id(self.root), snapshot, process_group=self.process_group,
                                     flush_dir=self.root if snapshot.flush_every else None, position=position())
        if deltas is not None:
            self._deltas = StepDeltas(self.root, self._covered, deltas.dtype, self.process_group)

    def _covered(self) -> int | None:
        """The step of the newest valid full checkpoint (the delta log folds entries up to
        it after each of its writes)."""
        steps = self.steps()
        newest = steps[-1] if steps else None
        if newest != self._newest_seen:
            latest = self.latest()
            self._newest_seen, self._covers = newest, None if latest is None else step_of(latest)
        return self._covers

    def _load_disk(self, state: dict[str, Any], path: str | None, kept: list[str]) -> str | None:
        """Collective: load the checkpoint of ``path``'s step (the durable tier's copy when
        the fast one is missing or fails its checks on any rank), or with None the newest
        whole one (:meth:`Checkpoints.load`); returns the copy loaded."""
        loaded = self.load(state, path, process_group=self.process_group, per_rank="keep")
        kept[:] = self.last_load.per_rank_kept if self.last_load is not None else []
        return loaded or path

    def _durable(self, state: dict[str, Any], plan: Replay | None, latest: str | None,
                 kept: list[str]) -> tuple[int, str] | None:
        """Collective: resume from the durable tiers (plus the delta log); (step, what the
        line says) or None when they hold nothing."""
        if plan is not None and plan.usable:
            where: list[str] = []
            step = self._deltas.replay(state, plan, lambda p: where.append(self._load_disk(state, p, kept)))
            if where:
                plan.base = where[0]  # the durable tier's copy when the fast one failed
            return step, replay_line(plan)
        if latest is None:
            return None
        path = self._load_disk(state, None, kept)  # the newest whole one, each failing one passed over; none: an error
        if path is None:  # gone since latest() listed it
            return None
        return step_of(path), path + "".join(f"; passed over {why}" for why in self.passed_over)

    def _newest_committed(self) -> str | None:
        """The newest committed checkpoint of either tier, whole or not (None: none)."""
        candidates = self._candidates()
        return candidates[0][1][0][1] if candidates else None

    def _nothing_on_disk(self, plan: Replay | None) -> str:
        notes = "; ".join(plan.notes) if plan is not None and plan.notes else ""
        return f"no checkpoint in {self.root}" + (f"; {notes}" if notes else "")

    def _recover(self, state: dict[str, Any], plan: Replay | None, latest: str | None, disk_step: int | None,
                 kept: list[str]) -> Restored:
        """Collective: memory first, then the durable tiers; what it restored."""
        from ..snapshot import paths
        from ..snapshot.recover import recover

        snap = self._snap
        group = resolve_group(self.process_group)
        # A rejected snapshot may have been partly loaded: where nothing on disk can
        # overwrite it (no checkpoint, or a replay from the initial state), the initial
        # state is kept aside first.
        initial = None
        holds = snap.local_rank == 0 and bool(paths.steps(snap.jdir))
        needs_initial = disk_step is None or (plan is not None and plan.usable and plan.base is None)
        if needs_initial and not all_true(group, not holds):
            initial = StateCopy(state)

        def from_memory(path: str, storage: Any) -> int:
            record = load_into(state, path, storage=storage, manifest=storage.manifest, process_group=self.process_group,
                               per_rank="keep")
            kept[:] = record.per_rank_kept
            return int(storage.manifest.metadata["snapshot"]["step"])

        def from_disk() -> tuple[int, str] | None:
            if initial is not None:
                initial.put_back()
            return self._durable(state, plan, latest, kept)

        outcome = recover(snap, from_memory, from_disk, disk_step)
        if outcome.source == "fresh":
            kept.clear()
            if initial is not None:
                initial.put_back()
            return replace(outcome.restored, nothing=self._nothing_on_disk(plan))
        return replace(outcome.restored, logged=_logged(plan))

    def _last_snapshot(self, state: dict[str, Any], step: int, saved: bool) -> None:
        """Before the job re-forms at a step boundary: the step's snapshot (or checkpoint),
        whole, so that the new world resumes from it."""
        if self._snap is not None:
            if not self._snap.due(step):
                self._snap.snapshot(state, step, flush=not saved)
            self._snap.settle()
        elif self.options.saves.every and not saved:
            self._save_step(state, step)
        self._finish_pending()

    def _save_step(self, state: dict[str, Any], step: int) -> None:
        """The durable checkpoint of ``step`` (collective); its record counted and told."""
        group = resolve_group(self.process_group)
        self._saved_step = step
        replace = self.failed_checks(self.path_for(step))  # a checkpoint restore passed over is replaced
        versions = self._deltas.versions() if self._deltas is not None else {}
        t0 = time.perf_counter()
        if self.options.saves.mode == "sync":
            try:
                _, written = self._save(state, step, process_group=self.process_group, metadata=self.metadata,
                                        overwrite=replace)
            except UnickptError as e:
                self._saved(step, "sync", t0, time.perf_counter(), error=e)
                return
            self._saved(step, "sync", t0, time.perf_counter(), written)
            if self._deltas is not None:
                self._deltas.rebase(versions)
            return
        self._finish_pending()
        t0 = time.perf_counter()
        base = self.shared_base(step, group) if self.options.saves.incremental else None
        try:
            handle = async_save(state, self.path_for(step), process_group=self.process_group, base=base,
                                storage_options=self.fast.storage_options, metadata=self.metadata, overwrite=replace)
        except UnickptError as e:
            self._saved(step, "async", t0, time.perf_counter(), error=e)
            return
        self._pending = _Pending(handle, step, versions, t0, time.perf_counter())
        handle.add_done_callback(self._pending.over)

    def _finish_pending(self) -> None:
        """Wait for the async save in flight (collective: every rank waits at the same
        call); on success its retention and durable copy, and the delta log's new base."""
        pending = self._pending
        if pending is None:
            return
        try:
            written = pending.handle.result()
        except UnickptError as e:
            self._pending = None
            self._saved(pending.step, "async", pending.started, pending.end(), error=e, stall=pending.stall)
            return
        self._housekeep()
        self._pending = None
        self._saved(pending.step, "async", pending.started, pending.end(), written, stall=pending.stall)
        if self._deltas is not None:
            self._deltas.rebase(pending.versions)

    def _housekeep(self) -> None:
        """Rank 0, once the async save in flight has committed: its retention and durable
        copy (once per save)."""
        if self._pending is None or resolve_group(self.process_group).rank != 0:
            return
        handle, step = self._pending.handle, self._pending.step
        if self._housekept == step or not handle.done() or handle.exception() is not None:
            return  # a failure is counted and told by _finish_pending
        self._housekept = step
        self.committed(step)

    def _saved(self, step: int, mode: SaveMode, started: float, ended: float, written: int | None = None,
               error: UnickptError | None = None, stall: float | None = None) -> None:
        """Count and tell the durable save of ``step`` (its :class:`SaveRecord`)."""
        record = SaveRecord(step, self.path_for(step), mode, ended - started, ended - started if stall is None else stall,
                            written, None if error is None else str(error))
        self.run_stats.saved(record, resolve_group(self.process_group).rank == 0)

    def _delta_failed(self, why: str) -> None:
        """Count and tell a delta log entry that could not be written."""
        self._count_failure("delta_entries_failed", "a delta log entry failed, training goes on (no replay past it "
                                                    f"until the next checkpoint): {why}")

    def _count_failure(self, counter: str | None, message: str) -> None:
        """Count and tell a failure (training goes on)."""
        self.run_stats.failed(counter, message, resolve_group(self.process_group).rank == 0)


@dataclass
class _Pending:
    """The async save in flight: its handle, step and the delta log's versions at its call;
    when it started, how long the call stalled the loop, and when it was over."""

    handle: AsyncSaveHandle
    step: int
    versions: dict[str, int]
    started: float
    staged: float
    ended: float = 0.0

    @property
    def stall(self) -> float:
        return self.staged - self.started

    def over(self, _: AsyncSaveHandle) -> None:
        self.ended = time.perf_counter()

    def end(self) -> float:
        """When the save was over (now, if its callback has not run yet)."""
        return self.ended or time.perf_counter()


def _logged(plan: Replay | None) -> int | None:
    """How many logged steps a restore from disk replays on top of it (None: no replay)."""
    return len(plan.entries) if plan is not None and plan.usable else None
