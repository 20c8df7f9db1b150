"""torchtitan: unickpt's tiers behind torchtitan's checkpointer contract.

torchtitan's trainer builds its checkpointer from ``config.checkpoint`` (any
``BaseCheckpointManager.Config``); choosing this one is the only change::

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    checkpoint=UnickptCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=50, keep_latest_k=3, async_mode="async",
        snapshot_every=1, parity=1, log_deltas=True)

The trainer's four calls map onto :class:`unickpt.CheckpointManager`'s:
``load(step=-1)`` -> ``restore`` (memory first, then disk plus the delta log, onto any
layout), ``maybe_wait_for_staging()`` (right before ``optimizers.step()``) ->
``before_update``, ``save(step, last_step)`` -> ``maybe_save`` (a full checkpoint at the
last step too), ``close()`` -> ``close``. The state is torchtitan's ``states``: the model
parts (through torchtitan's ``ModelWrapper``), the ``OptimizersContainer`` (its own
FQN-keyed flat state dict, so it reshards), the LR schedulers, the data loader (per
rank: :class:`unickpt.PerRank`), ``train_state``, plus :class:`unickpt.RNGState`.
What is and is not supported: docs/INTEGRATIONS.md, "torchtitan".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    AsyncMode,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from ..api.load import load
from ..api.manager import CheckpointManager
from ..api.options import DeltaLogOptions, DurableOptions, SaveSchedule, SnapshotOptions
from ..engine.rng import RNGState
from ..engine.state import PerRank
from ..errors import MismatchError, UnickptError
from ..logs import say

__all__ = ["UnickptCheckpointManager"]

RNG = "rng"


class _Optimizers(torch.optim.Optimizer):
    """torchtitan's ``OptimizersContainer`` as unickpt sees it: saved and loaded through
    the container's own flat, FQN-keyed state dict, stepped through the container (its
    hooks run), and with the parameter groups of the torch optimizers inside it (where
    the learning rate and the parameter names are) for the delta log. The container's
    own ``param_groups`` hold no hyperparameters."""

    def __init__(self, container: Any) -> None:  # no Optimizer.__init__: a view, nothing of its own
        self.container = container

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' groups (the same dicts: setting a learning rate sets it)."""
        return [g for opt in self.container.optimizers for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The container's flat state dict (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``)."""
        return self.container.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give the container its flat state dict back."""
        self.container.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One step of every inner optimizer, through the container (the delta log's replay)."""
        self.container.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every inner optimizer."""
        self.container.zero_grad(set_to_none=set_to_none)


class _PerRankState:
    """A Stateful whose state is this rank's own (torchtitan's data loader keeps its
    position under ``dp_rank_<r>``): stored per rank, kept as it is on another number of
    ranks (torchtitan's loader cannot reshard its position)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        """The object's state, marked per rank."""
        return {"state": PerRank(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give the object this rank's saved state (a dict, as its ``state_dict`` made)."""
        value = state_dict["state"].value
        if not isinstance(value, dict):
            raise MismatchError(f"the saved state of a {type(self.obj).__name__} is a "
                                        f"{type(value).__name__}, not the dict its state_dict() returns")
        self.obj.load_state_dict(value)


class UnickptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer on :class:`unickpt.CheckpointManager`: durable checkpoints
    every ``interval`` steps in ``<dump_folder>/<folder>/step_XXXXXXXX`` (the newest
    ``keep_latest_k``), in-memory snapshots with parity, the per-step delta log, resume on
    another layout. Built by torchtitan's trainer from ``config.checkpoint.build(...)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint options (``interval``: the durable checkpoints' period,
        ``keep_latest_k``: how many to keep, 0: all) plus unickpt's tiers (see
        :class:`unickpt.CheckpointManager` for each)."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Durable checkpoints in the background: "async" or "async_with_pinned_mem" (both
        the same here: unickpt stages into pinned host memory when the state is on CUDA);
        "disabled": in the loop. Any case, as torchtitan's own ``CheckpointManager.Config``
        takes it (kept lower-cased); anything else is a :class:`UnickptError`."""

        snapshot_every: int = 0
        """In-memory snapshot every N steps (0: none), held by a keeper process per node."""

        parity: int | None = None
        """Parity blocks per group of nodes protecting the snapshots (default 1: XOR)."""

        snapshot_replicas: int = 1
        """Full copies of each node's snapshot on neighbour nodes (instead of parity)."""

        flush_every: int = 0
        """The keepers write every Nth snapshot as an ordinary checkpoint."""

        snapshot_max_bytes: int | None = None
        """Host memory the snapshots may use per node."""

        log_deltas: bool = False
        """Log every step's gradients so that a restore replays the steps after the last
        durable checkpoint (no step lost)."""

        delta_dtype: Literal["exact", "bf16"] = "exact"
        """The delta log's gradient dtype ("bf16": half the bytes, replay close, not bitwise)."""

        durable: str | None = None
        """A second tier (directory or URL) receiving every ``durable_every``-th checkpoint."""

        durable_every: int = 1
        """Which checkpoints the durable tier receives."""

        durable_keep: int | None = None
        """How many checkpoints the durable tier keeps (None: all)."""

        incremental: bool = False
        """Save only what changed since the previous checkpoint."""

        full_every: int | None = None
        """With ``incremental``: a full checkpoint every N saves."""

        keep_snapshots_on_close: bool = False
        """Leave the snapshots and keepers at ``close()`` (a planned stop resuming from memory)."""

        def __post_init__(self) -> None:
            _check_config(self)  # the types first: torchtitan's checks compare the values
            BaseCheckpointManager.Config.__post_init__(self)
            refused = {
                "initial_load_in_hf": "unickpt loads the initial checkpoint by torchtitan's own names; a Hugging "
                                      "Face checkpoint needs the model's state-dict adapter",
                "last_save_in_hf": "the last checkpoint is a full, resumable one; `unickpt export` writes Hugging "
                                   "Face weights from any checkpoint",
                "create_seed_checkpoint": "write the seed checkpoint with torchtitan's own CheckpointManager and "
                                          "give it as initial_load_path",
            }
            for name, why in refused.items():
                if getattr(self, name):
                    raise UnickptError(f"UnickptCheckpointManager: {name}=True is not supported: {why}")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        if config.log_deltas:
            hooks = [h for h in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks") if getattr(optimizers, h, None)]
            if hooks:
                raise UnickptError(
                    "log_deltas=True cannot replay these steps exactly: the OptimizersContainer has step hooks "
                    "(MoE load balancing updates expert biases from the step's routing statistics, which the log "
                    "does not hold); turn log_deltas off (snapshots and checkpoints still protect the run)")
        # unickpt's view of torchtitan's states (the same objects)
        self.state: dict[str, Any] = {
            k: _Optimizers(v) if k == OPTIMIZER else _PerRankState(v) if k == DATALOADER else v
            for k, v in self.states.items()
        }
        self.state[RNG] = RNGState()
        self.manager = CheckpointManager(
            self.folder, keep=config.keep_latest_k or None, save_every=config.interval,
            async_save=config.async_mode != "disabled", snapshot_every=config.snapshot_every,
            parity=config.parity, snapshot_replicas=config.snapshot_replicas, flush_every=config.flush_every,
            snapshot_max_bytes=config.snapshot_max_bytes, log_deltas=config.log_deltas,
            delta_dtype=config.delta_dtype, durable=config.durable, durable_every=config.durable_every,
            durable_keep=config.durable_keep, incremental=config.incremental, full_every=config.full_every)

    def _to_load(self) -> dict[str, Any]:
        for key in self.config.exclude_from_loading:
            if key not in self.state:
                raise UnickptError(f"exclude_from_loading: {key!r} is not in the state ({', '.join(self.state)})")
        return {k: v for k, v in self.state.items() if k not in self.config.exclude_from_loading}

    def _load(self, step: int = -1) -> bool:
        """``step=-1``: the newest state of any tier (memory, disk plus the delta log; the
        ``initial_load_path`` when there is none); else the durable checkpoint of ``step``.
        Collective. True when something was loaded."""
        state = self._to_load()
        if step != -1:
            path = self.manager.path_for(step)
            if not self.manager.is_valid(path):
                raise UnickptError(f"checkpoint.load_step={step}: {path} is missing or incomplete")
            self.manager.load(state, path, per_rank="keep")
            return True
        initial = self.config.initial_load_path is not None and self.manager.latest() is None
        if initial:
            # before restore: the run's initial state, which memory snapshots and the delta
            # log (whose first steps replay onto it) then build on
            self._initial_load(self.config.initial_load_path)
        restored = self.manager.restore(state)
        if restored:
            self._keep_restored_end(restored)
        return restored > 0 or initial

    def _keep_restored_end(self, step: int) -> None:
        """torchtitan's ``Trainer`` trains nothing after a restored step at or past its
        ``training.steps``: its loop ends before any save, and ``close`` then frees the
        snapshots. Such a step that the folder holds no durable checkpoint of (restored from
        memory, or from disk plus the delta log: the run that trained it ended while its last
        checkpoint was written) is written now, as that run's last step would have been.
        Collective: rank 0's listing decides."""
        end = _training_steps(self.states.get("train_state"))
        if end is None or step < end or self.config.load_only:
            return
        self.manager.save_last(self.state, step)

    def _initial_load(self, path: str) -> None:
        """Load a checkpoint saved by torchtitan's DCP checkpointer (its names: the model's
        at the top level): the model only with ``initial_load_model_only``, else also the
        optimizers, LR schedulers and train state. The data loader's position stays: DCP
        holds it as a pickle, which unickpt does not unpickle."""
        wrapper = self.states[MODEL]
        model = wrapper.state_dict()
        flat = dict(model)
        if not self.config.initial_load_model_only:
            flat.update((k, v) for k, v in self.states.items()
                        if k not in (MODEL, DATALOADER) and k not in self.config.exclude_from_loading)
        load(flat, path)
        wrapper.load_state_dict({k: flat[k] for k in model})
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            what = "the model" if self.config.initial_load_model_only else "the model, optimizers, LR schedulers, train state"
            say(f"initial state: {what} from {path}")

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """The step's snapshot, delta log entry and, every ``interval`` steps, at the first
        step with ``enable_first_step_checkpoint`` and at the last step, a durable
        checkpoint (collective). True when a durable checkpoint was started."""
        if self.config.load_only:
            return False
        force = last_step or (curr_step == 1 and self.config.enable_first_step_checkpoint)
        self.manager.maybe_save(self.state, curr_step, force=force)
        return force or curr_step % self.interval == 0

    def _maybe_wait_for_staging(self) -> None:
        """Right before ``optimizers.step()``: the lazy snapshot's copy, the step's gradients."""
        self.manager.before_update()

    def _wait_for_saving(self) -> None:
        """Nothing to wait for here: ``save_future`` is never set (the manager waits for its
        own async save before the next one and at ``close``)."""
        self.save_future = None

    def _close(self) -> None:
        """Wait for what is in flight; stop the keepers unless ``keep_snapshots_on_close``."""
        self.manager.close(keep_snapshots=self.config.keep_snapshots_on_close)


def _training_steps(trainer: Any) -> int | None:
    """``config.training.steps`` of torchtitan's ``Trainer`` (the checkpointer's
    ``train_state``), or None for a train state that has none."""
    steps = getattr(getattr(getattr(trainer, "config", None), "training", None), "steps", None)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


# The values of torchtitan's own checkpoint config's async_mode (its CheckpointManager.Config
# takes them in any case and lower-cases them).
_ASYNC_MODES = tuple(m.value for m in AsyncMode)

_FLAGS = ("enable", "load_only", "enable_first_step_checkpoint", "create_seed_checkpoint", "initial_load_model_only",
          "initial_load_in_hf", "initial_load_in_hf_quantized", "last_save_model_only", "last_save_in_hf",
          "log_deltas", "incremental", "keep_snapshots_on_close")
_EXPORT_DTYPES = ("float16", "bfloat16", "float32")


def _check_config(c: Any) -> None:
    """Check the values of an :class:`UnickptCheckpointManager.Config` that torchtitan's own
    checks and the manager's (run only when the checkpointer is built) do not: each a
    :class:`UnickptError` naming the option, the value and what is allowed. The unickpt
    tiers' options go through the manager's own option groups now, so a bad one fails
    here and not at ``build``. Sets ``async_mode`` lower-cased."""

    def fail(name: str, allowed: str) -> None:
        raise UnickptError(f"UnickptCheckpointManager: {name} must be {allowed}, not {getattr(c, name)!r}")

    def whole(name: str, least: int, optional: bool = False) -> None:
        value = getattr(c, name)
        if optional and value is None:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            fail(name, f"a whole number >= {least}{' or None' if optional else ''}")

    mode = c.async_mode
    if not isinstance(mode, str) or mode.lower() not in _ASYNC_MODES:
        fail("async_mode", f"one of {', '.join(map(repr, _ASYNC_MODES))} (any case, as torchtitan takes it)")
    c.async_mode = mode.lower()
    for name in _FLAGS:
        if not isinstance(getattr(c, name), bool):
            fail(name, "True or False")
    if not isinstance(c.folder, str):
        fail("folder", "a path (str) under the trainer's dump_folder")
    whole("interval", 1)
    whole("keep_latest_k", 0)
    if not isinstance(c.load_step, int) or isinstance(c.load_step, bool) or c.load_step < -1:
        fail("load_step", "-1 (the newest state) or a step >= 0")
    if c.initial_load_path is not None and not isinstance(c.initial_load_path, str):
        fail("initial_load_path", "a path (str) or None")
    if not isinstance(c.exclude_from_loading, (list, tuple)) or not all(isinstance(k, str) for k in c.exclude_from_loading):
        fail("exclude_from_loading", "a list of state keys (str)")
    if c.export_dtype not in _EXPORT_DTYPES:
        fail("export_dtype", f"one of {', '.join(map(repr, _EXPORT_DTYPES))}")
    if c.durable is not None and not isinstance(c.durable, (str, os.PathLike)):
        fail("durable", "a directory or URL (str) or None")
    for name, least, optional in (("snapshot_every", 0, False), ("flush_every", 0, False), ("parity", 0, True),
                                  ("snapshot_replicas", 1, False), ("snapshot_max_bytes", 1, True),
                                  ("full_every", 1, True), ("durable_every", 1, False), ("durable_keep", 1, True)):
        whole(name, least, optional)
    try:  # the manager's own checks of its keywords, named as here
        SaveSchedule.from_keywords(every=c.interval, mode="async" if c.async_mode != "disabled" else "sync",
                                   incremental=c.incremental, full_every=c.full_every)
        SnapshotOptions.from_keywords(every=c.snapshot_every, parity=c.parity, replicas=c.snapshot_replicas,
                                      flush_every=c.flush_every, max_bytes=c.snapshot_max_bytes)
        DeltaLogOptions.from_keywords(enabled=c.log_deltas, dtype=c.delta_dtype)
        if c.durable is not None:
            DurableOptions.from_keywords(url=c.durable, every=c.durable_every, keep=c.durable_keep)
    except UnickptError as e:
        raise type(e)(f"UnickptCheckpointManager: {e}") from None
