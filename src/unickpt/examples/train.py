"""Train a small Llama-style model with PyTorch's own parallelism, checkpointed by unickpt.

    torchrun --nproc-per-node 4 -m unickpt.examples.train --tp 2 --dp 2 --fsdp \\
        --steps 20 --save-every 10 --ckpt-dir ckpt --loss-log run.jsonl
    torchrun --nproc-per-node 3 -m unickpt.examples.train --dp 3 --fsdp \\
        --steps 20 --resume latest --ckpt-dir ckpt --loss-log run.jsonl

Tensor parallel (column/row-wise plans), pipeline parallel (1F1B or GPipe), data parallel
with FSDP2 or plain replication; world size = tp * pp * dp. A checkpoint written on any
layout resumes on any other: the loss curve continues as if nothing happened.

Under ``unickpt launch`` the same command keeps training through failures: a rank that
dies costs the survivors a second, in their own processes, and a replacement joins later
(leave ``--dp`` out: it follows the world size)::

    unickpt launch --standalone --nproc-per-node 4 --max-restarts 1 -m unickpt.examples.train \\
        --fsdp --steps 200 --snapshot-every 1 --ckpt-dir ckpt --loss-log run.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unickpt

from .data import MarkovTokens, ReshardableLoader
from .model import ModelArgs, Transformer, keep_stage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags of the example trainer."""
    p = argparse.ArgumentParser(prog="unickpt.examples.train", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / (tp * pp))")
    p.add_argument("--fsdp", action="store_true", help="shard data-parallel state with FSDP2 (default: replicate)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    p.add_argument("--steps", type=int, default=20, help="total steps (horizon of the learning-rate schedule)")
    p.add_argument("--stop-after", type=int, default=None, help="end the process after this step, as a failure would")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--ckpt-dir", default=None,
                   help="directory (or URL: s3://bucket/run, options from the environment) of numbered checkpoints")
    p.add_argument("--keep", type=int, default=None, help="keep only the newest N checkpoints")
    p.add_argument("--durable-dir", default=None,
                   help="second tier (a URL such as s3://bucket/run): every --durable-every-th checkpoint of --ckpt-dir is "
                   "copied there in the background; resuming falls back to it when the local copy is missing or corrupt")
    p.add_argument("--durable-every", type=int, default=1, help="copy every Mth checkpoint to --durable-dir")
    p.add_argument("--durable-keep", type=int, default=None, help="keep only the newest N checkpoints in --durable-dir")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint path")
    p.add_argument("--async-save", action="store_true",
                   help="save in the background (unickpt.async_save); snapshots (--snapshot-every) never wait for "
                   "a save in flight: they have their own staging buffer (one more host copy of the rank's shard) "
                   "and process group")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="snapshot the state into host memory every N steps (0: never); the run then "
                   "recovers by itself at start from memory, else from --ckpt-dir (docs/SNAPSHOT.md)")
    p.add_argument("--parity", type=int, default=None,
                   help="parity shards across nodes for the snapshots (default 1: XOR, survives one lost node; "
                   "M >= 2: Reed-Solomon, survives M lost nodes; 0: local only)")
    p.add_argument("--snapshot-replicas", type=int, default=1,
                   help="instead of parity, keep a full copy of each node's snapshot on the next R-1 nodes "
                   "(2: one neighbour, 2x memory); excludes --parity M > 0")
    p.add_argument("--snapshot-stripes", type=int, default=8,
                   help="the most nodes one parity block covers (memory: parity/k more; a lost byte is rebuilt "
                   "from k bytes on k nodes)")
    p.add_argument("--flush-every", type=int, default=0,
                   help="the snapshot keepers write every Mth snapshot as an ordinary checkpoint into --ckpt-dir, "
                   "in the background (0: never; docs/SNAPSHOT.md)")
    p.add_argument("--log-deltas", action="store_true",
                   help="log every step's applied gradients (with --save-every K --ckpt-dir DIR): a relaunch with the "
                   "same flags replays them onto the last full checkpoint, losing no step (docs/DELTAS.md)")
    p.add_argument("--delta-dtype", choices=("exact", "bf16"), default="exact",
                   help="with --log-deltas: 'bf16' logs the gradients in bfloat16 (half the bytes; the replay is then "
                   "close, not bitwise: drift in docs/DELTAS.md)")
    p.add_argument("--compute-sleep", type=float, default=0.0,
                   help="sleep this many seconds per step, standing in for accelerator compute (benchmarks, tests)")
    p.add_argument("--snapshot-max-bytes", type=int, default=None,
                   help="cap on the host memory the snapshots hold per node (default: half the shm file system)")
    p.add_argument("--log", "--loss-log", dest="log", default=None,
                   help="append one JSON line per step {step, loss} to this file (under torchrun write --loss-log: "
                   "torchrun takes --log for its own --log-dir)")
    p.add_argument("--print-every", type=int, default=10, help="print step, loss and step time every N steps (0: quiet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step, over all data-parallel ranks")
    p.add_argument("--dataset-size", type=int, default=600)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    return p.parse_args(argv)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first tenth of ``--steps``, then cosine decay to 10%."""
    warmup = max(1, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Job:
    """Everything a rank trains with."""

    args: argparse.Namespace
    rank: int
    world: int
    model: Transformer
    optimizer: torch.optim.Optimizer
    loader: ReshardableLoader
    dp_group: Any = None
    pp_group: Any = None
    schedule: Any = None
    pp_rank: int = 0
    dp: int = 1  # the data-parallel degree of this world (under unickpt launch: of this generation)


TP_PLAN_NAMES = {
    "attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
    "feed_forward.w1": "col", "feed_forward.w3": "col", "feed_forward.w2": "row",
}


def build(args: argparse.Namespace) -> Job:
    """The mesh, model and optimizer for the current world (the process group: initialised
    here when torchrun started us and no one did)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp = args.tp, args.pp
    dp = args.dp or world // (tp * pp)  # leave --dp unset under unickpt launch: the world changes
    if tp * pp * dp != world:
        raise SystemExit(f"tp {tp} x pp {pp} x dp {dp} != world size {world}")
    margs = ModelArgs(args.dim, args.layers, args.heads, args.kv_heads, args.vocab, args.seq)
    torch.manual_seed(args.seed)
    model = Transformer(margs)
    dp_rank, pp_rank, mesh = 0, 0, None
    if world > 1:
        from torch.distributed.tensor import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, _ = mesh.get_coordinate()
    if pp > 1:
        keep_stage(model, pp_rank, pp)
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN_NAMES.items()}
        for layer in model.layers.values():
            parallelize_module(layer, mesh["tp"], plan)
    if args.fsdp and dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = MarkovTokens(args.dataset_size, args.seq, args.vocab, args.seed)
    loader = ReshardableLoader(data, args.global_batch, dp_rank, dp, args.seed)
    job = Job(args, rank, world, model, optimizer, loader, pp_rank=pp_rank, dp=dp)
    if mesh is not None:
        job.dp_group = mesh["dp"].get_group()
        job.pp_group = mesh["pp"].get_group()
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if (args.global_batch // dp) % pp:
            raise SystemExit(f"local batch {args.global_batch // dp} does not split into {pp} microbatches")
        stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=job.pp_group)
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        job.schedule = kind(stage, n_microbatches=pp, loss_fn=_loss)
    return job


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def train_step(job: Job, step: int, before_update: Any = None) -> float:
    """One optimizer step; returns the loss over the whole global batch (same on every rank).
    ``before_update()``, when given, runs right before the optimizer changes the weights
    (a lazy snapshot waits there for its copy of the state)."""
    args = job.args
    x, y = job.loader.next_batch()
    for group in job.optimizer.param_groups:
        group["lr"] = learning_rate(step, args)
    loss = torch.zeros(())
    if args.pp == 1:
        loss = _loss(job.model(x), y)
        loss.backward()
        loss = loss.detach()
    else:
        if job.pp_rank == 0:
            job.schedule.step(x)
        elif job.pp_rank == args.pp - 1:
            losses: list[torch.Tensor] = []
            job.schedule.step(target=y, losses=losses)
            loss = torch.stack([v.detach() for v in losses]).mean()
        else:
            job.schedule.step()
        dist.broadcast(loss, src=dist.get_global_rank(job.pp_group, args.pp - 1), group=job.pp_group)
    if job.dp > 1 and not args.fsdp:
        for p in job.model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=job.dp_group)
                g.div_(job.dp)
    if before_update is not None:
        before_update()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    if job.dp > 1:
        dist.all_reduce(loss, group=job.dp_group)
        loss /= job.dp
    return float(loss)


def checkpoint_state(job: Job, step: int) -> dict[str, Any]:
    """What unickpt saves and restores: the model and optimizer (live objects: unickpt
    stores the optimizer's state by parameter name), the step and data position, this
    rank's random generators, the model's ModelArgs (for exports: config.json)."""
    return {
        "model": job.model,
        "optim": job.optimizer,
        "train": {"step": step, "loader": job.loader, "seed": job.args.seed},
        "rng": unickpt.RNGState(),
        "model_args": asdict(job.model.args),
    }


def _say(job: Job, line: str) -> None:
    if job.rank == 0:
        print(line, flush=True)


def check_flags(args: argparse.Namespace) -> None:
    """Combinations of flags that make no sense, as one line (before anything starts)."""
    if args.resume == "latest" and not args.ckpt_dir:
        raise SystemExit("--resume latest needs --ckpt-dir (the directory of numbered checkpoints)")
    if args.flush_every and not (args.snapshot_every and args.ckpt_dir):
        raise SystemExit("--flush-every needs --snapshot-every and --ckpt-dir (where the keepers write the checkpoints)")
    if args.log_deltas and not (args.ckpt_dir and args.save_every):
        raise SystemExit("--log-deltas needs --save-every K and --ckpt-dir (the full checkpoints the log replays onto)")
    if args.durable_dir and not args.ckpt_dir:
        raise SystemExit("--durable-dir needs --ckpt-dir (the fast tier its copies are made from)")
    if args.snapshot_every and not args.ckpt_dir:
        raise SystemExit("--snapshot-every needs --ckpt-dir (the disk tier a recovery falls back to)")


def make_manager(args: argparse.Namespace) -> unickpt.CheckpointManager:
    """The run's CheckpointManager, one keyword per flag."""
    return unickpt.CheckpointManager(
        args.ckpt_dir, keep=args.keep, save_every=args.save_every, async_save=args.async_save,
        snapshot_every=args.snapshot_every, parity=args.parity if args.snapshot_every else None,
        snapshot_replicas=args.snapshot_replicas, flush_every=args.flush_every,
        snapshot_max_bytes=args.snapshot_max_bytes, snapshot_stripes=args.snapshot_stripes, log_deltas=args.log_deltas,
        delta_dtype=args.delta_dtype if args.log_deltas else "exact",
        durable=args.durable_dir, durable_every=args.durable_every, durable_keep=args.durable_keep,
    )


def resume_from(job: Job, manager: unickpt.CheckpointManager, where: str) -> int:
    """``--resume latest|PATH``: load that checkpoint onto this job's layout; returns its
    step (0 when ``latest`` finds none)."""
    path = manager.latest() if where == "latest" else where
    if path is None:
        _say(job, f"no checkpoint in {manager.root}: starting fresh")
        return 0
    state = checkpoint_state(job, 0)
    path = manager.load(state, path, per_rank="keep") or path  # the durable copy when the local one is missing or corrupt
    _say(job, f"resumed from {path} at step {state['train']['step']}")
    return int(state["train"]["step"])


def run(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train as the flags say, in the process group already initialised (or none: one
    process); returns this run's log records ({step, loss})."""
    args = parse_args(argv)
    check_flags(args)
    return train(args)


def train(args: argparse.Namespace) -> list[dict[str, float]]:
    """The training function: build the job for the current world, restore, train; returns
    this call's log records. ``unickpt.run`` calls it again after a failure, on the
    survivors: everything is built anew for the new world size (``args`` stays untouched)."""
    args = argparse.Namespace(**vars(args))  # build() fills in --dp for this world
    job = build(args)
    manager = make_manager(args) if args.ckpt_dir else None
    state = checkpoint_state(job, 0)
    start = 0
    if args.resume and manager is None:
        start = resume_from(job, unickpt.CheckpointManager(os.path.dirname(args.resume)), args.resume)
    elif args.resume and not (args.log_deltas and args.resume == "latest" and not args.snapshot_every):
        start = resume_from(job, manager, args.resume)
    elif manager is not None and (args.snapshot_every or args.log_deltas):
        start = manager.restore(state)  # memory, else disk (+ the delta log); prints the one line
    records = []
    last = min(args.steps, args.stop_after or args.steps)
    before_update = manager.before_update if manager is not None else None
    tick, since = time.perf_counter(), start  # the last progress line: its time and step
    for step in range(start + 1, last + 1):
        if args.compute_sleep:
            time.sleep(args.compute_sleep)
        loss = train_step(job, step, before_update)
        records.append({"step": step, "loss": loss})
        if args.print_every and (step % args.print_every == 0 or step == last):
            now = time.perf_counter()
            _say(job, f"step {step}/{args.steps}  loss {loss:.4f}  {(now - tick) / (step - since):.3f} s/step")
            tick, since = now, step
        if job.rank == 0 and args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "ranks": job.world}) + "\n")
        if manager is not None:
            state["train"]["step"] = step
            manager.maybe_save(state, step)
    if manager is not None:
        stats = manager.stats()
        if args.snapshot_every and args.print_every and stats["snapshots"]:
            _say(job, f"snapshots: {stats['snapshots']} taken, {stats['snapshots_skipped']} skipped, training loop "
                      f"stalled {stats['snapshot_stall_s']:.3f} s "
                      f"({stats['snapshot_stall_s'] / stats['snapshots'] * 1000:.1f} ms per snapshot, rank 0)")
        manager.close(keep_snapshots=last != args.steps)  # a run stopped early resumes from memory
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    return records


def main(argv: list[str] | None = None) -> None:
    """Entry point (``python -m unickpt.examples.train``, under torchrun, ``unickpt launch``
    or plain python): ``unickpt.run`` forms the process group and calls :func:`train`,
    again on the survivors after a failure under ``unickpt launch``. An error of
    unickpt's (a bad flag value, a corrupt checkpoint) is one ``error: ...`` line on
    stderr and exit status 2, not a traceback."""
    args = parse_args(argv)
    check_flags(args)
    try:
        # called again on the survivors after a failure; under unickpt launch the world is
        # always a multiple of tp x pp (the others wait as hot spares)
        unickpt.run(lambda world: train(args), backend="gloo", multiple_of=args.tp * args.pp)
    except unickpt.UnickptError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
