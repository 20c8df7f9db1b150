"""What a training step changes, as a delta log entry, and its exact replay (any loop).

:class:`StepDeltas` is the :class:`unickpt.CheckpointManager`'s ``log_deltas=True``. For
step ``s`` it writes one entry of the :class:`~unickpt.api.deltas.log.DeltaLog` holding:

* the gradients every optimizer of the state consumed (captured by ``before_update()``,
  right before ``optimizer.step()``: after the data-parallel reduction and any clipping),
  sharded as the parameters are, keyed ``<optimizer key>.<parameter name>``;
* each optimizer's hyperparameters at its step (every ``param_groups`` entry but the
  parameters: the learning rate, whatever set it) and after the step (what an LR
  scheduler set for the next one);
* everything else of the state that is not the optimizers' own (their parameters and
  moments move only through ``optimizer.step()``): plain values, per-rank values, every
  Stateful's small state (LR schedulers, data loaders, :class:`unickpt.RNGState`), and
  every module buffer (batch norm updates its statistics without bumping their version
  counter), and every other tensor the step changed in place (an EMA copy kept in the
  state), told apart from untouched ones (frozen weights) by torch's version counter, so
  an entry holds only what moved since the full checkpoint it replays onto.

Replaying step ``s`` sets the logged gradients and hyperparameters and runs the same
``optimizer.step()``; after the last entry its other state is loaded as it was. On the
same layout the result is bitwise the run that never stopped; on another layout the
gradients reshard like any checkpoint. What cannot be replayed exactly is refused when
the state is first seen (:func:`replay_refusal`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from ...dist import all_true, gather_bytes, resolve_group
from ...engine.items import is_dtensor
from ...engine.optim_state import named_parameters
from ...engine.outcome import decided_by_rank0
from ...engine.state import PerRank, Sharded, find_modules, flatten, optimizers_of, without_optimizers, write_back
from ...errors import UnickptError, one_line
from ...format.dtypes import dtype_from_name
from .log import DELTAS_DIR, DeltaLog, Replay, replayable
from ..load import load_into, read_manifest

# The entry's own part; the rest of an entry is named as the state flattens.
KEY = "unickpt_delta"


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of a tensor, with the same placements when it is a DTensor."""
    if not is_dtensor(t):
        return t.detach().to("cpu", copy=True)
    if t.device.type == "cpu":
        return t.detach().clone()  # a local copy of the shard; no communication
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.to_local().detach().to("cpu", copy=True), t.device_mesh, t.placements,
                              run_check=False, shape=t.shape, stride=t.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _version(t: torch.Tensor) -> int:
    """torch's count of in-place changes of ``t`` (a DTensor's and its shard's)."""
    return t._version + (_local(t)._version if is_dtensor(t) else 0)


def _where(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Where a tensor's bytes are (a parameter and its ``state_dict()`` view share it)."""
    local = _local(t)
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)


def replay_refusal(state: dict[str, Any]) -> str | None:
    """Why the steps of this state cannot be replayed exactly from logged gradients, or None."""
    for key, opt in optimizers_of(state):
        if isinstance(opt, torch.optim.LBFGS):
            return f"{key!r} is an LBFGS optimizer: its step re-evaluates the loss through a closure"
    scalers = []

    def visit(name: str, value: Any) -> None:
        if type(value).__name__ in ("GradScaler", "ShardedGradScaler"):
            scalers.append(name)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}.{k}" if name else str(k), v)

    visit("", state)
    if scalers:
        return (f"{scalers[0]!r} is a GradScaler: it unscales the gradients and skips the steps that overflow "
                "inside scaler.step(), after before_update() has captured them")
    if not optimizers_of(state):
        return "the state holds no torch optimizer: there is no step to replay"
    return None


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g in opt.param_groups:
        d = {}
        for k, v in g.items():
            if k in ("params", "param_names"):
                continue
            d[k] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        out.append(d)
    return out


def _set_hyperparameters(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    for g, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if isinstance(g.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v


class StepDeltas:
    """The delta log of one run (collective construction: the log's writer has its own gloo
    group). ``covered()`` returns the step of the newest valid full checkpoint."""

    def __init__(self, ckpt_root: str, covered: Callable[[], int | None], dtype: str = "exact",
                 process_group: Any = None) -> None:
        if dtype not in ("exact", "bf16"):
            raise UnickptError(f"delta_dtype must be 'exact' or 'bf16', not {dtype!r}")
        self.ckpt_root, self.dtype, self.process_group = ckpt_root, dtype, process_group
        self.log = DeltaLog(os.path.join(ckpt_root, DELTAS_DIR), process_group, covered=covered)
        self._captured: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._baseline: dict[str, int] = {}  # name of a watched tensor -> its version at the full checkpoint
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._buffers: set[str] = set()  # names of the watched tensors that are module buffers
        self._failure: str | None = None  # why an entry's write failed, until the manager takes it

    # -- the state's parts -------------------------------------------------------------
    def watch(self, state: dict[str, Any]) -> None:
        """Find the state's tensors that no optimizer owns (module buffers, frozen weights,
        other tensors), whose in-place changes the entries carry; their versions now are
        the baseline until :meth:`rebase`."""
        owned = {_where(p) for _, opt in optimizers_of(state) for g in opt.param_groups for p in g["params"]}
        buffers = {_where(b) for _, m in find_modules(state) for _, b in m.named_buffers()}
        self._tensors, self._buffers = [], set()
        for leaf in flatten(without_optimizers(state)):
            v = leaf.value.local if isinstance(leaf.value, Sharded) else leaf.value
            if isinstance(v, torch.Tensor) and _where(v) not in owned:
                self._tensors.append((leaf.name, v))
                if _where(v) in buffers:
                    self._buffers.add(leaf.name)
        self.rebase(self.versions())

    def versions(self) -> dict[str, int]:
        """The versions of the watched tensors now (for :meth:`rebase` once the full
        checkpoint taken now is committed)."""
        return {name: _version(t) for name, t in self._tensors}

    def rebase(self, versions: dict[str, int]) -> None:
        """A full checkpoint holding the tensors at ``versions`` is committed: entries
        from now on carry what changed since."""
        self._baseline = versions

    def capture(self, state: dict[str, Any]) -> None:
        """Stage the gradients and hyperparameters every optimizer is about to apply
        (call right before ``optimizer.step()``)."""
        modules = find_modules(state)
        grads: dict[str, Any] = {}
        hparams: dict[str, Any] = {}
        for key, opt in optimizers_of(state):
            mine = {}
            for name, p in named_parameters(opt, modules, key):
                if p.grad is not None:
                    g = host_copy(p.grad)
                    mine[name] = g.to(torch.bfloat16) if self.dtype == "bf16" and g.is_floating_point() else g
            grads[key] = mine
            hparams[key] = _hyperparameters(opt)
        self._captured = (grads, hparams)

    def commit(self, state: dict[str, Any], step: int) -> bool:
        """Queue the entry of ``step`` (after the optimizer and scheduler steps). False
        when nothing was captured for it (``before_update()`` was not called)."""
        if self._captured is None:
            return False
        grads, hparams = self._captured
        self._captured = None
        after = {key: _hyperparameters(opt) for key, opt in optimizers_of(state)}
        entry: dict[str, Any] = {KEY: {"step": step, "grad": grads, "hparams": hparams, "after": after}}
        # module buffers in every entry: batch norm updates its running statistics in its
        # kernel, without bumping their version counter (num_batches_tracked's it bumps)
        changed = {name for name, t in self._tensors if _version(t) != self._baseline.get(name)} | self._buffers
        for leaf in flatten(without_optimizers(state)):
            v = leaf.value
            if isinstance(v, PerRank):
                entry[leaf.name] = PerRank(host_copy(v.value) if isinstance(v.value, torch.Tensor) else copy.deepcopy(v.value))
            elif isinstance(v, (torch.Tensor, Sharded)):
                t = v.local if isinstance(v, Sharded) else v
                if leaf.name in changed:
                    entry[leaf.name] = Sharded(host_copy(t), v.global_shape, v.pieces, v.replica_index, v.replicas,
                                               v.layout) if isinstance(v, Sharded) else host_copy(t)
            else:
                entry[leaf.name] = copy.deepcopy(v)
        failed = self.log.take_error()
        if failed is not None:  # counted, said by the manager; the log goes on (a replay stops at the gap)
            self._failure = one_line(failed)
        self.log.append(step, entry)
        return True

    def take_failure(self) -> str | None:
        """Why an earlier entry's write failed (on one line), once; None when none did."""
        why, self._failure = self._failure, None
        return why

    def started(self, step: int) -> None:
        """The run continues after ``step``: drop the entries it will rewrite."""
        self.log.discard_after(step)

    def close(self) -> None:
        """Write what is queued and stop the writer (raises the first write failure)."""
        self.log.close()

    # -- recovery ----------------------------------------------------------------------
    def plan(self) -> Replay:
        """The recovery plan, made on rank 0 and shared with every rank (collective)."""
        group = resolve_group(self.process_group)

        def made_on_rank0() -> bytes:
            # structure only (commit marker, sizes, step): each rank's load checks the
            # checksums of the bytes it reads, so no entry is read twice, nor all on rank 0
            p = replayable(self.ckpt_root, self.log.root, verify_entries=False)
            return json.dumps([p.base, p.base_step, p.entries, p.notes]).encode()

        base, base_step, entries, notes = json.loads(decided_by_rank0(group, made_on_rank0))
        return Replay(base, base_step, entries, notes)

    def replay(self, state: dict[str, Any], plan: Replay, load_base: Callable[[str], None]) -> int:
        """Load the plan's full checkpoint (``load_base(path)``) and replay its entries into
        ``state``; returns the step reached. An entry whose bytes fail their checks on any
        rank ends the replay before its step is applied (the ranks agree): ``plan`` is cut
        there and says why."""
        if plan.base is not None:
            load_base(plan.base)
        step = plan.base_step
        group = resolve_group(self.process_group)
        opts = optimizers_of(state)
        modules = find_modules(state)
        for k, path in enumerate(plan.entries):
            try:
                part, problem = self._read_step(path, opts, modules), ""
            except Exception as e:  # agreed on below: no rank leaves the replay alone
                part, problem = {}, (str(e).splitlines() or [type(e).__name__])[0]
            if not all_true(group, not problem):
                reasons = gather_bytes(group, problem.encode(), 0)
                why = next((r.decode() for r in reasons or [] if r), "on another rank")
                later = len(plan.entries) - k - 1
                plan.notes.insert(0, f"step {step + 1}: entry fails its checks ({why}), not replayed"
                                  + (f"; {later} later entries not replayed: they follow it" if later else ""))
                del plan.entries[k:]
                break
            for key, opt in opts:
                grads, hparams = part["grad"].get(key, {}), part["hparams"][key]
                for name, p in named_parameters(opt, modules, key):
                    g = grads.get(name)
                    p.grad = g if g is None or g.dtype == p.dtype else g.to(p.dtype)
                _set_hyperparameters(opt, hparams)
                opt.step()
                opt.zero_grad(set_to_none=True)
            step += 1
        if plan.entries:
            self._load_rest(state, plan.entries[-1], opts)
        return step

    def _read_step(self, path: str, opts: list[tuple[str, torch.optim.Optimizer]],
                   modules: list[tuple[str, torch.nn.Module]]) -> dict[str, Any]:
        """The gradients and hyperparameters of the entry at ``path``, laid out as the
        optimizers' parameters (every byte's checksum checked)."""
        manifest = read_manifest(path)
        grads: dict[str, Any] = {}
        for key, opt in opts:
            mine = {}
            for name, p in named_parameters(opt, modules, key):
                entry = manifest.tensors.get(f"{KEY}.grad.{key}.{name}")
                if entry is not None:
                    mine[name] = torch.zeros_like(p.detach(), dtype=dtype_from_name(entry.dtype))
            grads[key] = mine
        target = {KEY: {"grad": grads, "hparams": {key: _hyperparameters(opt) for key, opt in opts}}}
        load_into(target, path, process_group=self.process_group, manifest=manifest)
        return target[KEY]

    def _load_rest(self, state: dict[str, Any], path: str, opts: list[tuple[str, torch.optim.Optimizer]]) -> None:
        """The last replayed entry's other state: what an LR scheduler set, the data
        loader's position, per-rank values, the tensors the steps changed."""
        manifest = read_manifest(path)
        after = {KEY: {"after": {key: _hyperparameters(opt) for key, opt in opts}}}
        load_into(after, path, process_group=self.process_group, manifest=manifest)
        for key, opt in opts:
            _set_hyperparameters(opt, after[KEY]["after"][key])
        rest = without_optimizers(state)
        load_into(rest, path, strict=False, process_group=self.process_group, manifest=manifest, per_rank="keep")
        write_back(state, rest)


def replay_line(plan: Replay, seconds: float | None = None) -> str:
    """What the recovery line says in parentheses about a replay."""
    parts = [plan.base or "no full checkpoint yet: the initial state"]
    if plan.entries:
        parts.append(f"replayed steps {plan.base_step + 1}..{plan.step}")
    parts += plan.notes
    return "; ".join(parts + ([f"{seconds:.2f} s"] if seconds is not None else []))

