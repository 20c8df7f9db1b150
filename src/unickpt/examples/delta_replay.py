"""The example trainer's per-step delta log (``--log-deltas``): what a step logs, and how
a relaunched run replays the log onto the last full checkpoint (docs/DELTAS.md).

Each step logs, right before ``optimizer.step()``, exactly what the optimizer consumes:
every parameter's gradient (after the data-parallel all-reduce or FSDP's reduce-scatter,
and after any clipping), sharded as the parameter is, plus the data loader's position
and this rank's RNG state after the step. Replaying step ``s`` sets those gradients, the
learning rate of step ``s``, and runs the same ``optimizer.step()``: on the same layout
the result is bitwise the run that never stopped; on another layout the gradients are
resharded by the ordinary load, like any checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import unickpt

from ..api.delta_log import DELTAS_DIR, DeltaLog, Replay, replayable, step_of
from ..dist import all_true, broadcast_bytes, gather_bytes, resolve_group
from ..format.dtypes import dtype_from_name


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of a gradient, with the same placements when it is a DTensor."""
    from ..engine.items import is_dtensor

    if not is_dtensor(t):
        return t.detach().to("cpu", copy=True)
    if t.device.type == "cpu":
        return t.detach().clone()  # a local copy of the shard; no communication
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.to_local().detach().to("cpu", copy=True), t.device_mesh, t.placements,
                              run_check=False, shape=t.shape, stride=t.stride())


Job = Any  # examples.train.Job: not imported, the trainer imports this module


class TrainerDeltas:
    """The delta log of one run of the example trainer (collective construction)."""

    def __init__(self, args: argparse.Namespace, manager: unickpt.CheckpointManager,
                 resume: Callable[..., int], learning_rate: Callable[[int, argparse.Namespace], float]) -> None:
        """``resume`` and ``learning_rate`` are the trainer's own (passed in, so that this
        module does not import the trainer that imports it)."""
        self.resume, self.learning_rate = resume, learning_rate
        if not (args.ckpt_dir and args.save_every):
            raise SystemExit("--log-deltas needs --save-every K and --ckpt-dir (the full checkpoints the log replays onto)")
        self.args, self.manager = args, manager
        self._newest: int | None = None  # the newest full checkpoint seen, and the step the valid ones cover
        self._covers: int | None = None
        self.log = DeltaLog(os.path.join(args.ckpt_dir, DELTAS_DIR), covered=self._covered)

    def _covered(self) -> int | None:
        """The step of the newest valid full checkpoint (its manifest is re-read only when
        a newer checkpoint appears: this runs after every entry)."""
        steps = self.manager.steps()
        newest = steps[-1] if steps else None
        if newest != self._newest:
            latest = self.manager.latest()
            self._newest, self._covers = newest, None if latest is None else step_of(latest)
        return self._covers

    # -- logging ---------------------------------------------------------------------
    def capture(self, job: Job, step: int) -> None:
        """Stage this step's applied gradients and step state to host memory and queue
        them (call right before ``optimizer.step()``)."""
        grads = {name: host_copy(p.grad) for name, p in job.model.named_parameters() if p.grad is not None}
        if self.args.delta_dtype == "bf16":  # lossy, opt-in: half the bytes, replay no longer bitwise
            grads = {name: g.to(torch.bfloat16) for name, g in grads.items()}
        state = {"grad": grads, "train": {"step": step, "loader": job.loader.state_dict()},
                 "rng": unickpt.PerRank(torch.get_rng_state())}
        self.log.append(step, state)

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self.log.close()

    # -- recovery --------------------------------------------------------------------
    def plan(self) -> Replay:
        """The recovery plan, made on rank 0 and shared with every rank (collective)."""
        group = resolve_group()
        doc = b""
        if group.rank == 0:
            # structure only (commit marker, sizes, step): each rank's load checks the
            # checksums of the bytes it reads, so no entry is read twice, nor all on rank 0
            p = replayable(self.args.ckpt_dir, self.log.root, verify_entries=False)
            doc = json.dumps([p.base, p.base_step, p.entries, p.notes]).encode()
        base, base_step, entries, notes = json.loads(broadcast_bytes(group, doc, 0))
        return Replay(base, base_step, entries, notes)

    def restore(self, job: Job, plan: Replay) -> int:
        """Load the plan's full checkpoint and replay its entries; returns the step reached.
        An entry whose bytes fail their checksums on any rank ends the replay before its
        step is applied (the ranks agree on it): ``plan`` is cut there and says why."""
        step = self.resume(job, self.manager, plan.base, say=False) if plan.base is not None else 0
        params = dict(job.model.named_parameters())
        group = resolve_group()
        for k, path in enumerate(plan.entries):
            try:
                grads, problem = load_grads(params, path), ""
            except unickpt.UnickptError as e:
                grads, problem = {}, str(e).splitlines()[0]
            if not all_true(group, not problem):
                reasons = gather_bytes(group, problem.encode(), 0)
                why = next((r.decode() for r in reasons or [] if r), "on another rank")
                later = len(plan.entries) - k - 1
                plan.notes.insert(0, f"step {step + 1}: entry fails its checks ({why}), not replayed"
                                  + (f"; {later} later entries not replayed: they follow it" if later else ""))
                del plan.entries[k:]
                break
            step = apply_step(job, params, grads, step + 1, self.learning_rate)
        if plan.entries:
            last = plan.entries[-1]
            state: dict[str, Any] = {"train": {"step": 0, "loader": job.loader.state_dict()},
                                     "rng": unickpt.PerRank(torch.get_rng_state())}
            if unickpt.read_manifest(last).world_size != job.world:
                del state["rng"]  # per-rank RNG carries over to the same world size only
            unickpt.load(state, last)
            job.loader.load_state_dict(state["train"]["loader"])
            if "rng" in state:
                torch.set_rng_state(state["rng"].value)
        return step

    def reason(self, plan: Replay, seconds: float | None = None) -> str:
        """What the recovery line says in parentheses."""
        parts = [plan.base or "no full checkpoint yet: the initial state"]
        if plan.entries:
            parts.append(f"replayed steps {plan.base_step + 1}..{plan.step}")
        parts += plan.notes
        return "; ".join(parts + ([f"{seconds:.2f} s"] if seconds is not None else []))

    def recover(self, job: Job) -> int:
        """Resume from the last full checkpoint plus the logged steps after it; print the
        one line saying so. Returns the step reached (0 when there is nothing)."""
        t0 = time.perf_counter()
        plan = self.plan()
        if not plan.usable:
            notes = "; ".join([f"no full checkpoint or logged step in {self.args.ckpt_dir}", *plan.notes])
            step, line = 0, f"starting fresh ({notes})"
        else:
            step = self.restore(job, plan)
            line = f"resumed step {step} from disk + {len(plan.entries)} logged steps ({self.reason(plan, time.perf_counter() - t0)})"
        if job.rank == 0:
            print(line, flush=True)
        return step

    def started(self, step: int) -> None:
        """The run continues after ``step``: drop the entries it will rewrite."""
        self.log.discard_after(step)


def load_grads(params: dict[str, torch.nn.Parameter], path: str) -> dict[str, torch.Tensor]:
    """The logged gradients of the entry at ``path``, laid out as ``params`` (every byte's
    checksum checked: a damaged entry raises a :class:`unickpt.UnickptError`)."""
    entries = unickpt.read_manifest(path).tensors
    grads = {n: torch.zeros_like(p.detach(), dtype=dtype_from_name(entries[f"grad.{n}"].dtype))
             for n, p in params.items() if f"grad.{n}" in entries}
    unickpt.load({"grad": grads}, path)
    return grads


def apply_step(job: Job, params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor], step: int,
               learning_rate: Callable[[int, argparse.Namespace], float]) -> int:
    """Apply the logged gradients of ``step`` with that step's learning rate."""
    for n, p in params.items():
        g = grads.get(n)
        p.grad = g if g is None or g.dtype == p.dtype else g.to(p.dtype)
    for group in job.optimizer.param_groups:
        group["lr"] = learning_rate(step, job.args)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    return step
