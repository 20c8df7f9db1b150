"""Lightning: unickpt's tiers for a ``lightning.Trainer`` through one callback.

    from unickpt.integrations.lightning import UnickptCallback

    trainer = L.Trainer(..., callbacks=[UnickptCallback("ckpt", save_every=50, async_save=True,
                                                        snapshot_every=1)])
    trainer.fit(model, data)            # resumes by itself from the newest state in memory or on disk

The callback is a thin map of Lightning's hooks onto :class:`unickpt.CheckpointManager`:
``on_fit_start`` (after the strategy has wrapped the model and built the optimizers, before
the fit loop runs) builds the state — the LightningModule, every optimizer and LR scheduler
of the strategy, a GradScaler when the precision plugin has one, the fit loop's progress
(:class:`FitLoopState`) and the RNG (:class:`unickpt.RNGState`) — and calls
``restore``; ``on_before_optimizer_step`` calls ``before_update``; ``on_train_batch_end``
calls ``maybe_save`` with ``trainer.global_step`` once per optimizer step;
``on_train_end`` takes the durable checkpoint of the last step; ``teardown`` of the fit
calls ``close``. docs/INTEGRATIONS.md ("Lightning") says what works and what
does not.

Live recovery (under ``unickpt launch``): :func:`run` calls ``fn(world)`` once per
generation of the job in the same process; ``fn`` builds the Trainer (``devices=
world.local_size, num_nodes=world.nodes``), the LightningModule and the callback, and
fits. Lightning finds the generation's process group formed (its strategies skip
``init_process_group`` then, and leave the group to its owner); ``Interrupted`` leaves
``fit`` as Lightning re-raises every exception after its ``on_exception`` hooks.

    run(lambda world: L.Trainer(devices=world.local_size, num_nodes=world.nodes, strategy="ddp",
                                logger=False, enable_checkpointing=False,  # or a logger built once, outside fn
                                callbacks=[UnickptCallback("ckpt", snapshot_every=1)]).fit(Model(), data))
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.strategies import FSDPStrategy

from ..api.manager import CheckpointManager
from ..engine.rng import RNGState
from ..engine.state import PerRank
from ..errors import UnickptError
from ..live.control import under_launch
from ..live.run import Interrupted, World
from ..live.run import run as _live_run
from .logged_steps import agreed_floor, hold, passes, take

log = logging.getLogger("unickpt")

__all__ = ["UnickptCallback", "FitLoopState", "run"]

def run(fn: Callable[[World], Any], backend: str | None = None) -> Any:
    """``unickpt.run`` for a Lightning job: under ``unickpt launch`` ``fn(world)`` is
    called once per generation of the job, in this process (after a lost rank, on the
    survivors; after a replacement joined, on the larger world); under torchrun or plain
    ``python`` once.

    ``fn`` builds the ``Trainer`` for ``world`` (``devices=world.local_size,
    num_nodes=world.nodes``: Lightning reads the generation's torchrun variables and
    checks them against these), a fresh LightningModule (a strategy wraps or shards it in
    place) and a :class:`UnickptCallback`, and calls ``fit``: the callback restores the
    newest snapshot (from memory after a re-forming) onto the new world and the fit
    continues at the step after it. A logger is built once, outside ``fn``, and passed to
    each generation's Trainer (or ``logger=False``; Lightning's default one, and its default
    ``ModelCheckpoint``, would be new each generation: the callback warns once). The
    process group is formed before ``fn`` runs, so
    Lightning's strategies skip ``init_process_group`` and leave the group alone;
    ``unickpt.run`` tears it down between generations and at the end.

    Args:
        fn: Builds the Trainer, module and callback for ``world`` and fits; what it
            returns (in the last generation) is returned.
        backend: The process group's backend (None: torch's default for the device;
            ``"gloo"`` on CPU).

    Returns:
        What ``fn`` returned in its last generation.

    Raises:
        UnickptError: The process group was initialised before ``run`` (by another
            ``init_process_group`` or an earlier Trainer's fit in this process).
    """
    return _live_run(fn, backend)


class FitLoopState:
    """Lightning's fit loop as a Stateful object: its progress counters (epoch, batch,
    optimizer and scheduler steps, ``trainer.global_step``) and the state of the training
    data loaders that implement ``state_dict``/``load_state_dict`` (Lightning's
    ``combined_loader`` entry, which exists only once the fit loop has set up its data).

    ``per_rank_data=True`` stores the loaders' state per rank (:class:`unickpt.PerRank`:
    restored onto the same number of ranks, left as it is on another); ``False`` stores it
    as one value that every rank must agree on (a position in the global stream of
    batches), restored onto any number of ranks."""

    def __init__(self, fit_loop: Any, per_rank_data: bool = True) -> None:
        self.fit_loop = fit_loop
        self.per_rank_data = per_rank_data
        self.restored_data: list[Any] | None = None  # the loaders' states last loaded
        self._batch_end: dict[str, Any] | None = None  # the progress at the last training batch's end
        self._ended = False

    def at_batch_end(self) -> None:
        """Record the fit loop's progress as it is at this training batch's end (the callback
        calls it in ``on_train_batch_end``), for :meth:`at_fit_end`."""
        self._batch_end = _progress(self.fit_loop)

    def at_fit_end(self) -> None:
        """The fit ran to its end: from now on :meth:`state_dict` gives the progress recorded
        at the last training batch's end (:meth:`at_batch_end`), the state Lightning resumes
        from exactly, as from a checkpoint of that batch's end. After that batch Lightning
        closes the epoch it stops in (its processed and completed counts go up, also when
        ``max_steps`` stops it mid-epoch), and a fit resumed from that state would start the
        next epoch: at the stopped epoch's position, but in another epoch's order, the rest of
        the stopped epoch never trained. The loaders' states are taken as they are: nothing
        is fetched after the last batch."""
        self._ended = True

    def state_dict(self) -> dict[str, Any]:
        """``{"progress": <the fit loop's state without the loaders'>, "data": <the loaders'
        states or None>}``."""
        progress = self.fit_loop.state_dict()
        if self._ended and self._batch_end is not None:
            progress.update(self._batch_end)
        own = dict(progress.get("state_dict") or {})
        data = own.pop("combined_loader", None)
        progress["state_dict"] = own
        return {"progress": progress, "data": PerRank(data) if self.per_rank_data else data}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Hand the progress (and the loaders' states, when there are) to the fit loop's
        ``load_state_dict``: Lightning then continues mid-epoch as after its own resume."""
        progress = dict(sd["progress"])
        data = sd.get("data")
        data = data.value if isinstance(data, PerRank) else data
        if data and (progress.get("epoch_loop.batch_progress") or {}).get("is_last_batch"):
            data = [_epoch_ended(state) for state in data]
        if data:
            progress["state_dict"] = {**(progress.get("state_dict") or {}), "combined_loader": list(data)}
        self.restored_data = list(data) if data else None
        self.fit_loop.load_state_dict(progress)


class UnickptCallback(pl.Callback):
    """Fault tolerance for a Lightning ``Trainer``: in-memory snapshots, durable (async,
    incremental, two-tier) checkpoints and the delta log of a
    :class:`unickpt.CheckpointManager` at ``root``; ``manager_options`` are its keywords
    (``keep``, ``save_every``, ``async_save``, ``snapshot_every``, ``parity``,
    ``log_deltas``, ``durable``, ...), or pass a ready ``manager``.

    At fit start the newest whole state (memory first, then disk) is loaded into the
    module, optimizers, LR schedulers, the fit loop's progress (the run continues at the
    step after it) and the RNG; rank 0 prints unickpt's one line. ``per_rank_data``: see
    :class:`FitLoopState`. ``extra_state``: more Stateful objects or values to save and
    restore with the rest (the keys ``model``, ``optimizer_N``, ``lr_scheduler_N``,
    ``grad_scaler``, ``loops``, ``rng`` are the callback's). After the fit,
    :attr:`restored_step` holds the step restored (0: fresh) and :attr:`manager` the
    manager (``stats()``). One callback serves one ``fit``.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, manager: CheckpointManager | None = None,
                 per_rank_data: bool = True, extra_state: dict[str, Any] | None = None,
                 **manager_options: Any) -> None:
        if (root is None) == (manager is None):
            raise UnickptError("UnickptCallback needs a checkpoint root or a CheckpointManager (one of them)")
        if manager is not None and manager_options:
            raise UnickptError(f"pass the options {sorted(manager_options)} to the CheckpointManager given, not here")
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise UnickptError(f"UnickptCallback's root must be a path (str or os.PathLike), not {root!r}")
        if manager is not None and not isinstance(manager, CheckpointManager):
            raise UnickptError(f"UnickptCallback's manager must be a unickpt.CheckpointManager, not {manager!r}")
        if not isinstance(per_rank_data, bool):
            raise UnickptError(f"UnickptCallback's per_rank_data must be True or False, not {per_rank_data!r}")
        if extra_state is not None and not (isinstance(extra_state, dict) and all(isinstance(k, str) for k in extra_state)):
            raise UnickptError("UnickptCallback's extra_state must be a dict of Stateful objects or values by str "
                               f"key (or None), not {extra_state!r}")
        self.manager = manager if manager is not None else CheckpointManager(root, **manager_options)
        self.per_rank_data = per_rank_data
        self.extra_state = dict(extra_state or {})
        self.state: dict[str, Any] | None = None
        self.restored_step: int | None = None
        self._last_step: int | None = None

    def build_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The state saved and restored: the module, the strategy's optimizers and LR
        schedulers, the precision plugin's GradScaler (if any), the fit loop, the RNG and
        ``extra_state``."""
        state: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state[f"optimizer_{i}"] = opt
        for i, config in enumerate(trainer.lr_scheduler_configs):
            state[f"lr_scheduler_{i}"] = config.scheduler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        state["loops"] = FitLoopState(trainer.fit_loop, self.per_rank_data)
        state["rng"] = RNGState()
        clash = sorted(set(state) & set(self.extra_state))
        if clash:
            raise UnickptError(f"extra_state uses the callback's own keys {clash}: rename them")
        state.update(self.extra_state)
        return state

    # -- Lightning's hooks ---------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the state and restore the newest one (collective, on every rank)."""
        _check_strategy(trainer.strategy)
        _check_ranks(trainer)
        if self.manager.options.deltas is not None:
            _check_replayable(trainer, pl_module)
        if under_launch():
            _warn_per_generation(trainer, str(self.manager.root))
        self.state = self.build_state(trainer, pl_module)
        self.restored_step = self.manager.restore(self.state)
        if self.restored_step:
            if trainer.ckpt_path is not None:
                raise UnickptError(f"unickpt restored step {self.restored_step} from {self.manager.root} and "
                                   f"fit(ckpt_path={trainer.ckpt_path!r}) would overwrite part of it: "
                                   "drop ckpt_path when relaunching")
            if trainer.global_step != self.restored_step:
                raise UnickptError(f"the fit loop restored from step {self.restored_step} says global step "
                                   f"{trainer.global_step}: the checkpoint's progress does not match its step")
        floor = self._log_each_step_once(trainer)
        if self.restored_step:
            self._give_the_restored_step(trainer, floor)
        self._last_step = trainer.global_step

    def _log_each_step_once(self, trainer: pl.Trainer) -> int:
        """The trainer's loggers get each step once: after a restore, the steps a logger of
        this process was given before (the steps re-done after the snapshot resumed from,
        when the job re-formed in the same processes) are not given again; their first
        values stand. The newest step given is agreed on by every rank (the new rank 0 may
        be a process that logged nothing: Lightning's loggers write on rank 0 only).
        Returns that step (-1: none)."""
        if not trainer.loggers:
            return -1
        root = str(self.manager.root)
        given = agreed_floor(root, bool(self.restored_step))
        for logger in trainer.loggers:
            current = logger.log_metrics
            if isinstance(current, _OncePerStep):
                current.floor = given
            else:
                logger.log_metrics = _OncePerStep(current, root, given)  # type: ignore[method-assign]
        return given

    def _give_the_restored_step(self, trainer: pl.Trainer, floor: int) -> None:
        """The restored step's log entry, held by this process when it snapshotted the step,
        to the loggers if none of any rank was given it: the snapshot is taken in
        ``on_train_batch_end``, before Lightning logs the step, and a re-forming in between
        goes on at the next step, so nothing else would give it."""
        entry = take(str(self.manager.root), self.restored_step)
        if entry is None or entry[1] <= floor:
            return
        metrics, step = entry
        trainer._logger_connector.log_metrics(dict(metrics), step=step)  # Lightning's own: every logger, then save

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a restore mid-epoch: Lightning made the loaders' iterators (and fast-forwarded
        them to the restored position) before telling the samplers the epoch, so a
        ``DistributedSampler`` (DDP) would go on in another epoch's order. Set the restored
        epoch on the samplers and make the iterators again from the restored position.

        After a restore of an epoch's last batch's end: Lightning closes that epoch in its
        ``reset`` and goes on in the next one, but as a restart in the middle of it: the next
        epoch's start is not counted (its ``ready``/``started`` progress) and its
        ``on_train_epoch_start`` hooks are not called, so a checkpoint taken in that epoch
        says the epoch before it, and a fit resumed from it goes on in the wrong epoch. The
        callback clears the fit loop's restart stage: the next epoch starts as in the unbroken
        run."""
        loops = self.state.get("loops") if self.state is not None else None
        data = loops.restored_data if isinstance(loops, FitLoopState) else None
        fit_loop = trainer.fit_loop
        if self.restored_step and _restored_after_the_epochs_last_batch(fit_loop):
            fit_loop.reset_restart_stage()  # the next epoch starts as in the unbroken run (below)
        combined = getattr(fit_loop, "_combined_loader", None)
        if not data or combined is None or getattr(fit_loop, "_data_fetcher", None) is None:
            return
        epoch = fit_loop.epoch_progress.current.processed
        stale = [dl for dl in combined.flattened if any(getattr(s, "epoch", epoch) != epoch for s in _samplers(dl))]
        if not stale:
            return
        for dl in stale:
            _set_sampler_epoch(dl, epoch)
        combined._load_state_dicts(data)
        iter(fit_loop._data_fetcher)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Right before the optimizer's update: the manager's ``before_update``."""
        self.manager.before_update()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After a batch whose optimizer step ran (not inside gradient accumulation): the
        manager's ``maybe_save`` with ``trainer.global_step``."""
        step = trainer.global_step
        if self.state is None:
            return
        loops = self.state.get("loops")
        if isinstance(loops, FitLoopState):
            loops.at_batch_end()
        if step == self._last_step:
            return
        self._last_step = step
        hold(str(self.manager.root), step, _log_entry(trainer))
        self.manager.maybe_save(self.state, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At the end of a fit that ran to its end: the durable checkpoint of the last step
        (unless one is committed already), so that running the finished command again
        restores it and trains nothing (the clean close frees the snapshots). Its fit loop
        state is the one of the last batch's end (:meth:`FitLoopState.at_fit_end`): a fit
        extended from it (a larger ``max_steps``) goes on with the next batch of the same epoch,
        as the unbroken run does."""
        step = trainer.global_step
        if self.state is None or not step:
            return
        loops = self.state.get("loops")
        if isinstance(loops, FitLoopState):
            loops.at_fit_end()
        self.manager.save_last(self.state, step)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Nothing collective (the other ranks may be elsewhere): the snapshots stay in
        memory for the relaunch, an unfinished save is never committed. Rank 0 says one
        line (:meth:`_stopped_line`) of what a relaunch resumes from. Under ``unickpt
        launch`` nothing is said here: ``unickpt.run`` either re-forms the job (a peer was
        lost: ``Interrupted``, or a collective cut short by its loss) and says so, or
        ends it with the error."""
        if isinstance(exception, Interrupted) or under_launch():
            return
        if self.state is not None and trainer.is_global_zero:
            log.warning("%s", self._stopped_line(type(exception).__name__, trainer.global_step))

    def _stopped_line(self, error: str, step: int) -> str:
        """The line said when the fit stopped by ``error`` at ``step``: in the restore (nothing
        trained or saved), with a snapshot in memory (one taken in this fit, or the one it
        restored from memory), or else what a relaunch resumes from on disk."""
        if self.restored_step is None:
            return (f"unickpt: the restore stopped by {error} before any step trained; nothing was saved, the "
                    f"checkpoints in {self.manager.root} (and any snapshot in memory) are as they were")
        snapshots = self.manager.options.snapshot is not None
        restored_line = self.manager.restored_line or ""
        if snapshots and (self.manager.stats()["snapshots"] or restored_line.startswith(
                f"resumed step {self.restored_step} from memory")):
            return f"unickpt: training stopped by {error} at step {step}; the snapshots stay in memory for the relaunch"
        why = "snapshots are off (snapshot_every=0)" if not snapshots else "no snapshot was taken yet"
        try:
            latest = self.manager.latest()
        except Exception:  # noqa: BLE001  (the line must not hide the error that stopped the fit)
            latest = None
        logged = " and the delta log's steps after it" if latest and self.manager.options.deltas is not None else ""
        then = f"a relaunch resumes from {latest}{logged}" if latest else \
            f"a relaunch starts fresh (no checkpoint committed in {self.manager.root})"
        return f"unickpt: training stopped by {error} at step {step}; no snapshot in memory ({why}): {then}"

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """At the end of the fit: the manager's ``close`` (waits for what is in flight,
        stops the keepers; collective)."""
        if stage == "fit" and self.state is not None:
            self.manager.close()


class _OncePerStep:
    """A logger's ``log_metrics`` that passes on no step up to ``floor`` (given before a
    re-forming) and records the newest step it passes on for ``root``."""

    def __init__(self, log_metrics: Callable[..., Any], root: str, floor: int) -> None:
        self.log_metrics, self.root, self.floor = log_metrics, root, floor

    def __call__(self, metrics: dict[str, Any], step: int | None = None) -> Any:
        if not passes(self.root, self.floor, step):
            return None
        return self.log_metrics(metrics, step)


def _log_entry(trainer: pl.Trainer) -> tuple[dict[str, Any], int] | None:
    """What Lightning gives its loggers for this step once ``on_train_batch_end`` is done
    (``update_train_step_metrics``): the step's logged values as scalars and its logger step
    (``_batches_that_stepped``, or a logged ``step``); None when it logs nothing for it."""
    connector = trainer._logger_connector
    if not trainer.loggers or not (connector.should_update_logs or trainer.fast_dev_run):
        return None
    metrics = convert_tensors_to_scalars(connector.metrics["log"])
    if not metrics:
        return None
    step = metrics.pop("step", None)
    if step is not None:
        return metrics, int(step)
    metrics.setdefault("epoch", trainer.current_epoch)
    return metrics, trainer.fit_loop.epoch_loop._batches_that_stepped


# per checkpoint root, in this process: the loggers of the last fit and its ModelCheckpoint's folder
_GENERATIONS: dict[str, tuple[list[Callable[[], Any]], str | None]] = {}
_WARNED: set[tuple[str, str]] = set()  # (root, "logger" | "checkpoint"): said once per process


def _warn_per_generation(trainer: pl.Trainer, root: str) -> None:
    """Under live recovery (``fn`` called once per generation in the same process): warn
    once, on rank 0, when this fit's Trainer has a logger that is not the previous fit's
    (Lightning's default logger, or one built in ``fn``: a new run to Lightning, the rows
    of one job split across ``version_N`` folders, or a fixed ``version`` that deletes the
    ``metrics.csv`` before it), or a ``ModelCheckpoint`` saving into another folder than
    the previous fit's (the default one follows the logger's new version)."""
    loggers = list(trainer.loggers)
    checkpoint = trainer.checkpoint_callback
    folder = getattr(checkpoint, "dirpath", None)
    before = _GENERATIONS.get(root)
    _GENERATIONS[root] = ([_ref(x) for x in loggers], folder)
    if before is None or not trainer.is_global_zero:
        return
    known = [ref() for ref in before[0]]
    new = [x for x in loggers if not any(x is k for k in known)]
    if new and (root, "logger") not in _WARNED:
        _WARNED.add((root, "logger"))
        log.warning("unickpt: this generation's Trainer has a new logger (%s, %s), not the previous generation's: "
                    "its rows go to a new run; build the logger once, outside fn, and pass it to each generation's "
                    "Trainer (or logger=False)", type(new[0]).__name__, getattr(new[0], "log_dir", None))
    if checkpoint is not None and folder != before[1] and (root, "checkpoint") not in _WARNED:
        _WARNED.add((root, "checkpoint"))
        log.warning("unickpt: this generation's ModelCheckpoint saves into %s, the previous generation's into %s: "
                    "give it a fixed dirpath, or enable_checkpointing=False (the UnickptCallback checkpoints)",
                    folder, before[1])


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` (a strong one when it takes none)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _check_strategy(strategy: Any) -> None:
    """Lightning's ``FSDPStrategy`` (FSDP1) is refused: its module holds FSDP1 flat
    parameters, each rank a 1-D slice of several, and its optimizer state is keyed by them,
    which no checkpoint of named tensors reshards; FSDP2 (``ModelParallelStrategy``) is the
    route."""
    if isinstance(strategy, FSDPStrategy):
        raise UnickptError("UnickptCallback does not support Lightning's FSDPStrategy (FSDP1: its parameters are "
                           "flat slices of several tensors): use ModelParallelStrategy with fully_shard (FSDP2) in "
                           "configure_model")


def _check_ranks(trainer: pl.Trainer) -> None:
    """Lightning numbers ranks ``node_rank * devices + local_rank``: on nodes that run
    different numbers of processes (a live job after a node lost a rank) that is not the
    process group's rank, and every collective would pair the wrong peers."""
    if dist.is_initialized() and trainer.global_rank != dist.get_rank():
        raise UnickptError(f"Lightning numbers this process rank {trainer.global_rank} (node {trainer.node_rank} x "
                           f"{trainer.num_devices} devices + local rank {trainer.local_rank}), the process group rank "
                           f"{dist.get_rank()}: Lightning needs the same number of processes on every node")


def _progress(fit_loop: Any) -> dict[str, Any]:
    """The fit loop's ``state_dict`` without its own entry (the loaders' states): the
    progress of its epochs and of its child loops (batches, optimizer and scheduler steps,
    ``_batches_that_stepped``), as Lightning's ``_Loop.state_dict`` makes them."""
    progress: dict[str, Any] = {}
    for key, value in vars(fit_loop).items():
        if isinstance(value, _BaseProgress):
            progress[key] = value.state_dict()
        elif isinstance(value, _Loop):
            value.state_dict(progress, key + ".")
    return progress


def _restored_after_the_epochs_last_batch(fit_loop: Any) -> bool:
    """Whether the fit loop restarted from the end of an epoch's last batch (Lightning's
    ``reset`` has closed that epoch then, and the next one starts)."""
    epoch_loop = fit_loop.epoch_loop
    return bool(fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                and epoch_loop.batch_progress.is_last_batch)


def _epoch_ended(state: Any) -> Any:
    """A loader's state taken at the end of its epoch's last batch, for the restore that goes
    on in the next epoch (Lightning does, from the last batch's end): a torchdata
    ``StatefulDataLoader``'s state is marked finished, so that its next iterator starts the
    next epoch (from the sampler's state), as in the unbroken run, where the fit loop makes a
    new iterator at each epoch. As it was taken (not finished: the last batch was yielded,
    the end not yet reached) the iterator made from it would yield nothing, Lightning would
    count that empty epoch, and the run would go on in the epoch after the next, in its order.
    Other states are left to their loader (a resumable iterable that rolls over to its next
    epoch by itself, as tests/lightning_train.py's ``Batches``, needs nothing). A
    ``StatefulDataLoader``'s state is told by its keys: ``_num_yielded`` (no workers) or
    ``_snapshot`` (workers), with ``_iterator_finished``."""
    if isinstance(state, dict) and state.get("_iterator_finished") is False and ("_num_yielded" in state
                                                                                 or "_snapshot" in state):
        return {**state, "_iterator_finished": True}
    return state


def _samplers(dataloader: Any) -> list[Any]:
    """The samplers Lightning sets the epoch of (``sampler``, ``batch_sampler.sampler``)."""
    found = [getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)]
    return [s for s in found if s is not None and callable(getattr(s, "set_epoch", None))]


def _check_replayable(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """``log_deltas`` captures the gradients in ``on_before_optimizer_step``: refuse what
    changes them after that hook or steps several optimizers in one step."""
    if trainer.gradient_clip_val:
        raise UnickptError("log_deltas=True cannot replay Lightning's gradient clipping (it runs after "
                           "on_before_optimizer_step, where the gradients are captured): drop gradient_clip_val "
                           "or log_deltas")
    if not pl_module.automatic_optimization:
        raise UnickptError("log_deltas=True needs Lightning's automatic optimization (one optimizer step per "
                           "on_before_optimizer_step)")
