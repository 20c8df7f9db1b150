"""A Hugging Face Trainer job made fault tolerant by ``unickpt.integrations.hf``; run
under torchrun by tests/test_hf_trainer.py.

The real ``transformers.Trainer`` (DDP over gloo on CPU) trains a tiny random Llama on a
synthetic token set: AdamW, a cosine schedule with warm-up, gradient clipping, attention
dropout (so the generators matter), a shuffled sampler over several epochs. Rank 0
appends the Trainer's logged ``{"step", "loss"}`` per step to ``--loss-log`` and, at the
end, writes the parameters, the optimizer moments, the scheduler and ``trainer.state``
to ``--final``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments, set_seed

import unickpt
from unickpt.integrations.hf import UnickptTrainer


class Tokens(torch.utils.data.Dataset):
    """Fixed-length sequences of a learnable pattern (each token follows from the one
    before), so that the loss falls; no padding, every sample the same number of tokens."""

    def __init__(self, size: int = 48, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(7)
        start = torch.randint(0, vocab, (size, 1), generator=g)
        step = torch.randint(1, 4, (size, 1), generator=g)
        self.ids = (start + step * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossLog(TrainerCallback):
    """Rank 0 appends each logged training loss; ``sleep`` slows each step (so that a
    test can kill the job mid-run)."""

    def __init__(self, path: str, sleep: float) -> None:
        self.path, self.sleep = path, sleep

    def on_step_begin(self, args, state, control, **kwargs):
        if self.sleep:
            time.sleep(self.sleep)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


def tiny_llama(dropout: float) -> LlamaForCausalLM:
    """A random 2-layer Llama of width 32 (the same weights on every rank)."""
    set_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        attention_dropout=dropout))


def training_args(output_dir: str, steps: int, batch: int) -> TrainingArguments:
    """The Trainer's arguments: CPU, a loss logged every step, no checkpoints of its own."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        ddp_backend="gloo" if world > 1 else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4, help="per device")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--log-deltas", action="store_true")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--loss-log", required=True)
    p.add_argument("--final", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    model = tiny_llama(args.dropout)
    targs = training_args("hf_out", args.steps, args.batch)
    manager = unickpt.CheckpointManager(args.ckpt_dir, save_every=args.save_every, async_save=args.async_save,
                                        snapshot_every=args.snapshot_every, log_deltas=args.log_deltas)
    trainer = UnickptTrainer(model=model, args=targs, train_dataset=Tokens(), manager=manager,
                             callbacks=[LossLog(args.loss_log, args.sleep)])
    trainer.train()
    if args.final and trainer.args.process_index == 0:
        tensors = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
        for name, param in trainer.model.named_parameters():
            for k, v in trainer.optimizer.state[param].items():
                tensors[f"optim.{name}.{k}"] = v
        torch.save(tensors, args.final)
        sched = {k: v for k, v in trainer.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
        history = [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate", "epoch", "step")}
                   for e in trainer.state.log_history if "loss" in e]
        with open(args.final + ".json", "w") as f:
            json.dump({"sched": sched, "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
                       "log_history": history, "stats": manager.stats()}, f)
    if torch.distributed.is_initialized():
        # PyTorch's shutdown: the Trainer leaves its group open, and a gloo group left to
        # the interpreter's exit can abort it ("terminate called without an active exception")
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
