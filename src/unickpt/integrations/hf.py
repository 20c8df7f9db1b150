"""The Hugging Face ``transformers.Trainer`` with unickpt's fault tolerance.

    manager = unickpt.CheckpointManager("ckpt", save_every=50, async_save=True, snapshot_every=1, parity=1)
    trainer = UnickptTrainer(model=model, args=args, train_dataset=ds, manager=manager)
    trainer.train()          # resumes from the newest state unickpt holds, or starts fresh

The Trainer's own checkpoints (``_save_checkpoint`` / ``_load_from_checkpoint``) are
private and write files per object; unickpt takes their place through the public
:class:`CheckpointManager` calls, at the Trainer's points:

* ``restore`` once the Trainer has built and wrapped the model, optimizer and scheduler
  (after its ``_prepare_for_training``): the model, the optimizer, the scheduler, the
  gradient scaler when there is one, every rank's random generators (torch, CUDA,
  Python's ``random``, numpy) and the progress of ``trainer.state``;
* the data position through the Trainer's own resume path: the restored ``global_step``
  gives the epochs and batches it skips (``skip_first_batches``) as a Trainer resuming
  from its own checkpoint does, and the generators are set back after the skip, so the
  continued run sees the batches an unbroken run sees next;
* ``before_update`` from :class:`UnickptCallback`'s ``on_pre_optimizer_step`` (after
  gradient clipping, right before ``optimizer.step()``);
* ``maybe_save`` after each optimizer step once the Trainer has logged it (so that the
  step's log entry is in the state saved with it, as in the Trainer's own checkpoints),
  with ``force=True`` at the step training stops at (``max_steps``, or a callback's
  ``should_training_stop``): the last step's durable checkpoint, whatever ``save_every``,
  the state of that step's end, as any other step's (a run extended from it with a larger
  ``max_steps`` goes on with the next batch of the unbroken run);
* ``close`` from ``on_train_end``.

Accelerate's ``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` are
not used: they run inside ``Accelerator.save_state`` / ``load_state``, which the Trainer
never calls (it writes its checkpoints itself). See docs/INTEGRATIONS.md.

Live recovery (under ``unickpt launch``): :func:`run` calls ``fn(world)`` once per
generation of the job in the same process, with accelerate's cached state
(``PartialState``, ``AcceleratorState``, ``GradientState``) cleared before each call, so
that the Trainer ``fn`` builds sees the generation's process group and ranks:

    run(lambda world: UnickptTrainer(model=build_model(), args=TrainingArguments(
        per_device_train_batch_size=GLOBAL // world.size, ...), train_dataset=ds,
        manager=unickpt.CheckpointManager("ckpt", snapshot_every=1)).train())
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..api.manager import CheckpointManager
from ..engine.rng import RNGState
from ..engine.state import PerRank
from ..errors import UnickptError
from ..live.run import World
from ..live.run import run as _live_run
from .logged_steps import agreed_floor, passes

log = logging.getLogger("unickpt")

__all__ = ["UnickptCallback", "UnickptTrainer", "UnickptTrainerMixin", "run"]

# What ``trainer.state`` keeps of a run's progress; every rank holds the same values.
_PROGRESS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "best_metric", "best_global_step",
             "best_model_checkpoint")

# The Trainer's methods this module extends (transformers 5.x: tested with 5.24).
_EXTENDED = ("_prepare_for_training", "_run_epoch", "_load_rng_state", "_maybe_log_save_evaluate",
             "_load_callback_state")

# Given to the Trainer's epoch loop as ``resume_from_checkpoint`` after a restore: its batch
# skipping runs, and its ``_load_rng_state`` sets the generators restored by unickpt.
_RESUMED = "<restored by unickpt>"

# A UnickptCallback given to a Trainer by hand does nothing: the trainer class does the work.
_BY_HAND = ("UnickptCallback was given to a Trainer by hand (callbacks=[...] or add_callback), where it saves nothing: "
            "build UnickptTrainer(..., manager=manager) in place of Trainer(..., callbacks=[UnickptCallback(manager)]) "
            "(a Trainer subclass: class MyTrainer(UnickptTrainerMixin, SFTTrainer)); it adds its own callback")

# The managers closed at the end of a train(): they serve no other.
_CLOSED: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def run(fn: Callable[[World], Any], backend: str | None = None) -> Any:
    """``unickpt.run`` for a Hugging Face Trainer job: under ``unickpt launch``
    ``fn(world)`` is called once per generation of the job, in this process (after a
    lost rank, on the survivors; after a replacement joined, on the larger world); under
    torchrun or plain ``python`` once.

    Before each call accelerate's process-wide state (``PartialState``,
    ``AcceleratorState``, ``GradientState``: the ranks, the world size and the
    accumulation state of the Accelerator the last Trainer made) is cleared, so the
    ``TrainingArguments`` and Trainer ``fn`` builds take the generation's process group
    (formed before ``fn`` runs: accelerate does not initialise another) and its ranks.
    ``fn`` builds a fresh ``TrainingArguments`` (inside ``fn``: built before ``run`` they
    initialise the process group through accelerate, and ``run`` refuses to start;
    ``per_device_train_batch_size`` from ``world.size`` to keep the global batch), model,
    ``CheckpointManager`` and :class:`UnickptTrainer`, and calls ``train()``: the trainer restores the newest
    snapshot (from memory after a re-forming) and goes on at the step after it, skipping
    the batches done as after its own resume.

    Args:
        fn: Builds the trainer for ``world`` and trains; what it returns (in the last
            generation) is returned.
        backend: The process group's backend (None: torch's default for the device;
            ``"gloo"`` on CPU).

    Returns:
        What ``fn`` returned in its last generation.

    Raises:
        UnickptError: The process group was initialised before ``run``.
    """

    def generation(world: World) -> Any:
        _reset_accelerate()
        return fn(world)

    try:
        return _live_run(generation, backend)
    finally:
        _reset_accelerate()  # its state names the process group run() has destroyed


def _reset_accelerate() -> None:
    """Forget accelerate's singletons: they keep the ranks and the device of the process
    group they first saw (and the last Accelerator's gradient state)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class UnickptCallback(TrainerCallback):
    """The Trainer's hooks that map onto ``manager``: ``before_update`` on
    ``on_pre_optimizer_step``, ``close`` on ``on_train_end``. :class:`UnickptTrainer`
    adds it; it acts only once that trainer has restored its state (``started``).

    Not to be given to a Trainer by hand: the restore, the data position and
    ``maybe_save`` are :class:`UnickptTrainerMixin`'s, which a callback cannot do. One in
    ``Trainer(callbacks=[...])`` or ``add_callback`` is a :class:`UnickptError` when the
    Trainer is built (``on_init_end``) or, at the latest, when training begins
    (``on_train_begin``), never a run that silently saves nothing."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self.started = False
        self.closed = False

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The end of ``Trainer.__init__``: only a callback given by hand sees it (the
        trainer's own is added after), so it is refused."""
        raise UnickptError(_BY_HAND)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The start of ``train()``, after the restore: a callback no trainer started (one
        added by hand with ``add_callback``) is refused."""
        if not self.started:
            raise UnickptError(_BY_HAND)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Right before ``optimizer.step()``: the manager's ``before_update``."""
        if self.started and not self.closed:
            self.manager.before_update()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The end of ``train()``: close the manager (waits for what is in flight)."""
        if self.started and not self.closed:
            self.closed = True
            _CLOSED.add(self.manager)
            self.manager.close()


class TrainerProgress:
    """``trainer.state``'s progress as Stateful state: the step, epoch, FLOs, tokens seen
    and best metric (the same on every rank), the global batch size (the data position is
    ``global_step`` global batches) and, per rank, the log history and the states of
    the ``ExportableState`` callbacks. The log history is per rank because its entries
    carry each rank's own timings (``eval_runtime``, ``train_samples_per_second``): on
    another number of ranks it is left as it is, as the manager's line says."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        args = self.trainer.args
        return int(self.trainer._train_batch_size) * args.gradient_accumulation_steps * args.world_size

    def callbacks(self) -> str:
        """The states of the ``ExportableState`` callbacks (and ``TrainerControl``), as
        the Trainer's own checkpoints keep them, in JSON."""
        trainer = self.trainer
        out: dict[str, list[Any]] = {}
        for cb in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(cb, ExportableState):
                out.setdefault(type(cb).__name__, []).append(cb.state())
        return json.dumps(out)

    def state_dict(self) -> dict[str, Any]:
        """The progress now."""
        sd: dict[str, Any] = {k: getattr(self.trainer.state, k) for k in _PROGRESS}
        sd["global_batch"] = self.global_batch()
        sd["log_history"] = PerRank(json.dumps(self.trainer.state.log_history))
        sd["callbacks"] = PerRank(self.callbacks())
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Put the restored progress into ``trainer.state`` (the log history and callback
        states only when they came back: same number of ranks)."""
        trainer = self.trainer
        for k in ("global_step", "global_batch"):
            if type(sd[k]) is not int or sd[k] < 0:
                raise UnickptError(f"trainer.{k} is {sd[k]!r}, not a whole number >= 0")
        for k in _PROGRESS:
            setattr(trainer.state, k, sd[k])
        if sd["global_batch"] != self.global_batch():
            log.warning("unickpt: the checkpoint was trained with %d samples per step, this run takes %d: the data "
                        "position restored is global_step=%d steps of this run's batches, not the samples seen",
                        sd["global_batch"], self.global_batch(), trainer.state.global_step)
        trainer.state.log_history = _json(sd["log_history"], "trainer.log_history", list)
        callbacks = _value(sd["callbacks"])
        if callbacks != self.callbacks():  # not left as it is (another number of ranks)
            trainer.state.stateful_callbacks = _json(callbacks, "trainer.callbacks", dict)
            trainer._load_callback_state()  # the Trainer's own (with args.restore_callback_states_from_checkpoint)


class TrainerRNG(RNGState):
    """:class:`unickpt.RNGState` plus numpy's global generator (the Trainer's own
    checkpoints keep it too: data collators may draw from it)."""

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now."""
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return {**super().state_dict(), "numpy": PerRank([name, keys.tolist(), pos, has_gauss, cached])}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Set the generators from ``sd``."""
        super().load_state_dict(sd)
        if "numpy" in sd:
            try:
                name, keys, pos, has_gauss, cached = _value(sd["numpy"])
                np.random.set_state((name, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
            except (TypeError, ValueError, OverflowError, IndexError) as e:
                raise UnickptError(f"rng.numpy does not hold a numpy generator state: {e}") from None


class UnickptTrainerMixin:
    """Put before a ``transformers.Trainer`` class (``class MyTrainer(UnickptTrainerMixin,
    SFTTrainer)``) to give it unickpt's fault tolerance through ``manager`` (a
    :class:`unickpt.CheckpointManager`, keyword-only); :class:`UnickptTrainer` is the
    plain Trainer's. ``train()`` restores the newest state unickpt holds (collective;
    rank 0 prints the manager's one line) and continues from its step; one ``train()``
    per manager. The state saved is :attr:`unickpt_state`."""

    def __init__(self, *args: Any, manager: CheckpointManager, **kwargs: Any) -> None:
        if not isinstance(manager, CheckpointManager):
            raise UnickptError(f"manager must be a unickpt.CheckpointManager, not {type(manager).__name__}")
        missing = [m for m in _EXTENDED if not callable(getattr(Trainer, m, None))]
        if missing:
            import transformers

            raise UnickptError(f"transformers {transformers.__version__}'s Trainer lacks {', '.join(missing)}: "
                               "unickpt.integrations.hf needs transformers >= 5.24 (pip install 'unickpt[hf]')")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise UnickptError("UnickptTrainer does not run DeepSpeed: its engine owns the model and optimizer "
                               "states (load DeepSpeed checkpoints with unickpt.load or unickpt.dcp instead)")
        self.manager = manager
        self.unickpt_callback = UnickptCallback(manager)
        self.add_callback(self.unickpt_callback)
        self.unickpt_state: dict[str, Any] | None = None
        self._unickpt_resumed: int | None = None
        self._unickpt_rng: dict[str, Any] | None = None
        self._unickpt_saved = 0  # the last step given to maybe_save (or restored)
        self._unickpt_restored = 0
        self._unickpt_ended = False  # the last step's durable checkpoint was asked for

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's preparation, then unickpt's restore into what it built."""
        if self.unickpt_callback.started or self.manager in _CLOSED:
            raise UnickptError("a CheckpointManager serves one train() call: make a new one (same root) for the next")
        out = super()._prepare_for_training(*args, **kwargs)
        optimizer = self.optimizer.optimizer if isinstance(self.optimizer, AcceleratedOptimizer) else self.optimizer
        state: dict[str, Any] = {"model": self.model, "optim": optimizer, "sched": self.lr_scheduler,
                                 "rng": TrainerRNG(), "trainer": TrainerProgress(self)}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        self.unickpt_state = state
        self.unickpt_callback.started = True
        config = _model_config(self.model)
        if config is not None:  # `unickpt export` writes it as config.json
            self.manager.metadata = {**(self.manager.metadata or {}), "hf_config": config}
        step = self.manager.restore(state)
        self._unickpt_saved = self._unickpt_restored = step
        if step:
            self._unickpt_resumed = step
            self._unickpt_rng = state["rng"].state_dict()
        self._report_each_step_once(bool(step))
        return out

    def _report_each_step_once(self, restored: bool) -> None:
        """The callbacks' ``on_log`` (the reporters ``report_to`` builds: TensorBoard, W&B,
        ...) gets each step once: after a restore in a process whose trainer of the same
        root already reported steps (a re-forming of live recovery), the steps re-done up
        to the newest one any rank reported are not reported again; their first values
        stand. ``state.log_history`` still gets every step, as saved with the state."""
        root = str(self.manager.root)
        floor = agreed_floor(root, restored)  # collective: every rank restored just before
        handler = self.callback_handler
        on_log = handler.on_log

        def once(args: Any, state: Any, control: Any, logs: Any, **kwargs: Any) -> Any:
            if not passes(root, floor, state.global_step):
                return control
            return on_log(args, state, control, logs, **kwargs)

        handler.on_log = once  # type: ignore[method-assign]

    def _run_epoch(self, **kwargs: Any) -> Any:
        """The Trainer's epoch, told after a restore which epochs and batches are done
        (as when it resumes from its own checkpoint)."""
        step = self._unickpt_resumed
        if step is not None:
            done_epochs, done_steps = divmod(step, kwargs["num_update_steps_per_epoch"])
            if step >= self.state.max_steps:
                self.control.should_training_stop = True
                self._keep_restored_end(step)
                return None
            if kwargs["epoch"] < done_epochs:
                return None
            self._unickpt_resumed = None
            kwargs.update(epochs_trained=done_epochs, resume_from_checkpoint=_RESUMED,
                          steps_trained_in_current_epoch=done_steps * self.args.gradient_accumulation_steps)
        return super()._run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint: Any) -> None:
        """After a restore: the generators as restored (the Trainer calls this after
        skipping the batches done, whose iteration may have drawn from them)."""
        if checkpoint == _RESUMED:
            if self._unickpt_rng is not None:
                self.unickpt_state["rng"].load_state_dict(self._unickpt_rng)
            return
        super()._load_rng_state(checkpoint)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log / evaluation / save of a step, then the manager's
        ``maybe_save`` for it (once per optimizer step); at the step training stops at
        (``max_steps`` reached, or ``should_training_stop`` set by a callback, e.g. early
        stopping in its ``on_evaluate``) with ``force=True``: that step's durable checkpoint
        whether ``save_every`` divides it or not, so that the finished command run again
        restores it and trains nothing, and a larger ``max_steps`` goes on from it (the
        Trainer's own ``save_strategy`` saves that step too). The Trainer also calls this at
        each epoch's end, for the step just passed: then only the last step's checkpoint,
        when training stopped there and it was not asked for yet (a data set that ran out)."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        step = self.state.global_step
        if self.unickpt_state is None or self.unickpt_callback.closed:
            return
        last = bool(self.control.should_training_stop) or step >= self.state.max_steps
        if step > self._unickpt_saved or (last and step > self._unickpt_restored and not self._unickpt_ended):
            self._unickpt_saved = step
            self._unickpt_ended = last
            self.manager.maybe_save(self.unickpt_state, step, force=last)

    def _keep_restored_end(self, step: int) -> None:
        """A restored step at or past ``max_steps`` (nothing left to train) that the root
        holds no durable checkpoint of (restored from memory, or from disk plus the delta
        log): its checkpoint now, as at the end of the run that trained it, before
        ``close`` frees the snapshots. Collective: rank 0's listing decides."""
        if self._unickpt_ended or self.unickpt_state is None:
            return
        self._unickpt_ended = True
        self.manager.save_last(self.unickpt_state, step)


class UnickptTrainer(UnickptTrainerMixin, Trainer):
    """``transformers.Trainer`` with unickpt's fault tolerance: ``UnickptTrainer(...,
    manager=unickpt.CheckpointManager(...))`` takes every argument of ``Trainer``;
    see :class:`UnickptTrainerMixin`."""


def _model_config(model: Any) -> dict[str, Any] | None:
    """The Hugging Face config of ``model`` (unwrapped from DDP/FSDP) as plain JSON data, or
    None when it has none."""
    model = getattr(model, "module", model)
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    return json.loads(config.to_json_string(use_diff=False))


def _value(v: Any) -> Any:
    return v.value if isinstance(v, PerRank) else v


def _json(v: Any, name: str, kind: type) -> Any:
    """The ``kind`` (list or dict) held by the JSON text of entry ``name``, checked."""
    try:
        out = json.loads(_value(v))
    except (TypeError, ValueError) as e:
        raise UnickptError(f"{name} does not hold JSON text: {e}") from None
    if not isinstance(out, kind):
        raise UnickptError(f"{name} holds a JSON {type(out).__name__}, not a {kind.__name__}")
    return out
