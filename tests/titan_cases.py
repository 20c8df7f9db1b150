"""torchtitan's training loop on CPU, checkpointed by ``unickpt.integrations.torchtitan``;
run as real processes by tests/test_torchtitan.py (``unickpt.testing.run_ranks``).

torchtitan's own components: a tiny Llama 3 (its model configs, the scaled-dot-product
inner attention, as torchtitan's flex/varlen backends need a GPU), FSDP2 over the ranks
as torchtitan applies it (each block, then the root), its ``OptimizersContainer`` (AdamW)
and ``LRSchedulersContainer`` (warmup, linear decay), its ``ParallelAwareDataloader``
over a synthetic token dataset, and a train state (``step``, ``ntokens_seen``) as
torchtitan's ``Trainer`` saves it. The checkpointer is built from its config by
``config.build(...)`` with the trainer's arguments and called as ``Trainer.train`` calls
it: ``load(step=-1)``; per step ``maybe_wait_for_staging()`` before
``optimizers.step()``, ``save(step, last_step=...)``; ``close()``. Rank 0 appends
``{"step", "loss"}`` to ``loss_log`` and the restore line to ``<loss_log>.restored``, and writes every parameter, optimizer state, the
LR and train state to ``final`` at the end (or at ``dump_at``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (ComplexRoPE, Embedding, Linear, Llama3Model, Llama3TransformerBlock, RMSNorm,
                                      make_ffn_config, make_gqa_config)

from unickpt.integrations.torchtitan import UnickptCheckpointManager

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 2, 2, 16


def tiny_llama() -> Llama3Model:
    """A two-block Llama 3 built as torchtitan builds one: on the meta device, then
    materialised and initialised by its ``init_weights``."""
    normal = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02), "bias": torch.nn.init.zeros_}
    ones = {"weight": torch.nn.init.ones_}
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000)
    block = partial(Llama3TransformerBlock.Config,
                    attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
                    ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
                    attention=make_gqa_config(dim=DIM, n_heads=HEADS, wqkv_param_init=normal, wo_param_init=normal,
                                              inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True,
                                              rope=rope),
                    feed_forward=make_ffn_config(dim=DIM, hidden_dim=2 * DIM, w1_param_init=normal,
                                                 w2w3_param_init=normal))
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": partial(torch.nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=normal),
        layers=[block() for _ in range(LAYERS)])
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


class Tokens(IterableDataset):
    """Synthetic token sequences, a different stream per data-parallel rank; Stateful
    (its position), as torchtitan's datasets are."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.sample = dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(10_000 * self.dp_rank + self.sample)
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.sample += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict:
        return {"sample": self.sample}

    def load_state_dict(self, sd: dict) -> None:
        self.sample = int(sd["sample"])


class TrainState:
    """What torchtitan's ``Trainer`` saves of itself (``states={"train_state": self}``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def dump(path: str, model, optimizers, lr_schedulers, train: TrainState) -> None:
    """Every parameter and optimizer state (whole tensors) and the plain state, on rank 0."""
    tensors = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    values = {}
    for k, v in optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            tensors[f"optim.{k}"] = full(v)
        else:
            values[f"optim.{k}"] = v
    if dist.get_rank() == 0:
        torch.save(tensors, path)
        with open(path + ".json", "w") as f:
            json.dump({"optim": values, "train": train.state_dict(), "sched": lr_schedulers.state_dict(),
                       "lr": [s.get_last_lr() for s in lr_schedulers]}, f)


def sharded_parts(world: int, steps: int, total_steps: int):
    """The model (seeded; FSDP2 over the ``world`` ranks as torchtitan applies it: each
    block, then the root), its ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``
    (3 warmup steps, linear decay over ``total_steps``) for a run of ``steps``."""
    torch.manual_seed(0)
    model = tiny_llama()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8,
                                                         "weight_decay": 0.1})],
        implementation="foreach").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3, total_steps=total_steps).build(
        optimizers=optimizers, training_steps=steps)
    return model, optimizers, lr_schedulers


def train_step(model, batches, optimizers, lr_schedulers, checkpointer, state: TrainState, steps: int):
    """One step as torchtitan's ``Trainer.train`` runs it, with its checkpointer's calls
    (``maybe_wait_for_staging()`` right before ``optimizers.step()``, then ``save``).
    Returns the loss and the inputs."""
    state.step += 1
    inputs, labels = next(batches)
    loss = F.cross_entropy(model(inputs["input"]).flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    checkpointer.maybe_wait_for_staging()
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()
    state.ntokens_seen += labels.numel()
    checkpointer.save(state.step, last_step=state.step == steps)
    return loss, inputs


def train(rank: int, world: int, o: dict) -> None:
    """One rank of the loop (under ``unickpt.testing.run_ranks``). ``o``: ``steps``,
    ``folder``, ``disabled`` (checkpointing off), ``interval``, ``async_mode``,
    ``snapshot_every``, ``log_deltas``, ``shm_root``, ``crash_after`` (SIGKILL this process
    after that step's save, once the files ``crash_waits_for`` lists are in ``folder`` and
    the step's snapshot is whole in memory when snapshots are on),
    ``dump_at``, ``loss_log``, ``final``."""
    # one node, as torchrun would describe it (run_ranks sets no launcher variables)
    os.environ.update(UNICKPT_SHM_ROOT=o["shm_root"], GROUP_RANK="0", LOCAL_RANK=str(rank))
    steps = o.get("steps", 8)
    model, optimizers, lr_schedulers = sharded_parts(world, steps, total_steps=20)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    state = TrainState()
    checkpointer = UnickptCheckpointManager.Config(
        enable=not o.get("disabled", False), folder=o.get("folder", "ckpt"), interval=o.get("interval", 100),
        keep_latest_k=3, async_mode=o.get("async_mode", "disabled"), snapshot_every=o.get("snapshot_every", 0),
        log_deltas=o.get("log_deltas", False),
    ).build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": state}, sd_adapter=None, base_folder="")

    checkpointer.load(step=-1)
    if rank == 0 and checkpointer.enable:
        with open(o["loss_log"] + ".restored", "a") as f:
            f.write(checkpointer.manager.restored_line + "\n")
    batches = iter(dataloader)
    while state.step < steps:
        loss, _ = train_step(model, batches, optimizers, lr_schedulers, checkpointer, state, steps)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            with open(o["loss_log"], "a") as f:
                f.write(json.dumps({"step": state.step, "loss": float(total) / world}) + "\n")
        if o.get("dump_at") == state.step:
            dump(o["final"], model, optimizers, lr_schedulers, state)
        if o.get("crash_after") == state.step:
            _wait(lambda: all(os.path.exists(os.path.join(o["folder"], p)) for p in o.get("crash_waits_for", [])),
                  f"{o.get('crash_waits_for')} in {o['folder']}")
            if o.get("snapshot_every"):
                from snapshot_helpers import steps_whole

                _wait(lambda: state.step in steps_whole(o["shm_root"]), f"the snapshot of step {state.step}")
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    if o.get("final") and o.get("dump_at") is None:
        dump(o["final"], model, optimizers, lr_schedulers, state)


def _wait(cond, what: str, timeout: float = 60) -> None:
    """Until ``cond()`` (an outside observer's read of what the checkpointer wrote)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _components(world: int, rank: int, seed: int):
    """A fresh model, optimizer and scheduler containers, loader and train state."""
    torch.manual_seed(seed)
    model = tiny_llama()
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="foreach").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, total_steps=20).build(optimizers=optimizers,
                                                                                         training_steps=20)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    return model, optimizers, lr_schedulers, dataloader, TrainState()


def initial_load(rank: int, world: int, folder: str, model_only: bool) -> None:
    """torchtitan's own (DCP) CheckpointManager saves step 3 of a run; a fresh job whose
    unickpt checkpointer has that step as ``initial_load_path`` (and no checkpoint of its
    own) starts from it: the model bitwise (and, without ``initial_load_model_only``, the
    optimizer, scheduler and train state; the loader's position is a pickle, left alone)."""
    from torchtitan.components.checkpointer import CheckpointManager

    model, optimizers, lr_schedulers, dataloader, state = _components(world, rank, 0)
    dcp_manager = CheckpointManager.Config(enable=True, folder=os.path.join(folder, "dcp"), interval=3,
                                           keep_latest_k=0).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": state}, sd_adapter=None)
    batches = iter(dataloader)
    for _ in range(3):
        state.step += 1
        inputs, labels = next(batches)
        F.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten()).backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        dcp_manager.save(state.step)
    dcp_manager.close()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optim = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizers.state_dict().items()}

    model2, optimizers2, lr_schedulers2, dataloader2, state2 = _components(world, rank, 1)
    assert not torch.equal(model2.tok_embeddings.weight, saved_model["tok_embeddings.weight"])
    checkpointer = UnickptCheckpointManager.Config(
        enable=True, folder=os.path.join(folder, "unickpt"), initial_load_path=os.path.join(folder, "dcp", "step-3"),
        initial_load_model_only=model_only,
    ).build(dataloader=dataloader2, model_parts=[model2], optimizers=optimizers2, lr_schedulers=lr_schedulers2,
            states={"train_state": state2}, sd_adapter=None)
    assert checkpointer.load(step=-1) is True
    assert checkpointer.manager.restored_line.startswith("starting fresh")
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_model[k]), k
    got = optimizers2.state_dict()
    if model_only:
        assert state2.step == 0 and lr_schedulers2.state_dict()["last_epoch"] == 0
        assert all(not v.any() for k, v in got.items() if k.endswith("exp_avg"))
    else:
        assert state2.step == 3 and lr_schedulers2.state_dict()["last_epoch"] == 3
        assert dataloader2.state_dict() != dataloader.state_dict()  # a pickle in DCP: not read
        for k, v in saved_optim.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    checkpointer.close()


def refusals(rank: int, world: int, folder: str) -> None:
    """What the checkpointer refuses, with the reason."""
    import pytest

    from unickpt import UnickptError

    for option, match in (({"initial_load_in_hf": True, "initial_load_path": folder}, "state-dict adapter"),
                          ({"last_save_in_hf": True}, "unickpt export"),
                          ({"create_seed_checkpoint": True}, "seed checkpoint")):
        with pytest.raises(UnickptError, match=rf"{next(iter(option))}=True is not supported: .*{match}"):
            UnickptCheckpointManager.Config(enable=True, **option)
    model, optimizers, lr_schedulers, dataloader, state = _components(world, rank, 0)
    optimizers.register_step_pre_hook(lambda *args, **kwargs: None)  # as torchtitan's MoE load balancing does
    config = UnickptCheckpointManager.Config(enable=True, folder=folder, interval=2, log_deltas=True)
    with pytest.raises(UnickptError, match="log_deltas=True cannot replay these steps exactly: the "
                                           "OptimizersContainer has step hooks"):
        config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                     states={"train_state": state}, sd_adapter=None)
