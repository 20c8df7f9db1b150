"""``unickpt.integrations.lightning.UnickptCallback`` on the real Lightning: a tiny job
(tests/lightning_train.py: DDP over gloo under real torchrun agents, AdamW, a per-step LR
schedule, a resumable data iterable) with snapshots every step and async durable
checkpoints; one rank SIGKILLed mid-epoch; the relaunch on 1 rank resumes from memory at
the right step, the losses within 1e-4 of the unbroken run's; the durable checkpoint
resumed on 2 ranks gives the unbroken run bitwise. In one process: a stopped fit resumed
by a new one bitwise (dropout: the RNG comes back), the fit loop's state, refusals."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

import unickpt  # noqa: E402
from unickpt.integrations.lightning import FitLoopState, UnickptCallback  # noqa: E402


from lightning_train import Batches, Recorded, Regression  # noqa: E402
from live_helpers import check_live_run, live_job  # noqa: E402
from snapshot_helpers import launch_nodes, losses, resumed_lines, steps_whole, wait_all, worker_pids  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_train.py")
STEPS = 14


def _flags(log: str, ckpt_dir: str, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--ckpt-dir", ckpt_dir, "--loss-log", log, "--dropout", "0",
            "--snapshot-every", "1", "--save-every", "4", *extra]


def _run(cwd, shm: str, flags: list[str], nproc: int) -> list[str]:
    return wait_all(launch_nodes(cwd, [shm], flags, nproc, script=SCRIPT), cwd)


def _killed_run(tmp_path, shm: str, flags: list[str], at: int) -> int:
    """2 ranks; SIGKILL rank 1 once the snapshot of step ``at`` is whole in memory and
    the durable checkpoint of step 4 committed; returns the last step logged before the
    kill."""
    log = flags[flags.index("--loss-log") + 1]
    procs = launch_nodes(tmp_path, [shm], [*flags, "--sleep", "0.3"], 2, script=SCRIPT)
    try:
        deadline = time.monotonic() + 120
        durable = os.path.join(tmp_path, "ck", "step_00000004", "manifest.json")
        while max(steps_whole(shm), default=0) < at or not os.path.exists(durable):
            assert procs[0].poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline, f"step {at} never came"
            time.sleep(0.05)
        trainers = [pid for _, pid in sorted(worker_pids(procs[0]).items())]
        assert len(trainers) == 2, trainers
        os.kill(trainers[-1], signal.SIGKILL)
        return max(losses(log))
    finally:
        wait_all(procs, tmp_path, check=False)


def _final(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    return torch.load(path), json.load(open(path + ".json"))


@pytest.mark.multiprocess
def test_sigkill_then_resume_on_one_rank_and_on_two(tmp_path, shm_roots):
    """2 ranks, snapshots every step, async durable checkpoints every 4; SIGKILL one rank
    mid-epoch. The relaunch on 1 rank (the same global batches; no dropout: a rank's random
    stream has no meaning on another layout, the in-process test checks the RNG) resumes
    from memory at the newest snapshot's step and every loss is within 1e-4 of the unbroken
    2-rank run's. The durable checkpoint the killed run left, resumed on 2 ranks, gives
    that run's losses, weights and AdamW moments bitwise."""
    ref = tmp_path / "ref"
    ref.mkdir()
    _run(ref, str(ref / "shm"), _flags(str(ref / "loss.jsonl"), "ck", "--final", str(ref / "final.pt")), 2)
    want_losses, (want, want_info) = losses(str(ref / "loss.jsonl")), _final(str(ref / "final.pt"))
    assert sorted(want_losses) == list(range(1, STEPS + 1)) and want_info["restored_step"] == 0

    shm = str(tmp_path / "shm")
    shm_roots.append(shm)
    log = str(tmp_path / "loss.jsonl")
    last = _killed_run(tmp_path, shm, _flags(log, "ck"), 5)
    assert last < STEPS
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")  # the killed run's durable checkpoints, for the 2-rank resume
    durable = max(int(d[5:]) for d in os.listdir(tmp_path / "ck2") if (tmp_path / "ck2" / d / "manifest.json").exists())

    outs = _run(tmp_path, shm, _flags(log, "ck", "--final", str(tmp_path / "final1.pt")), 1)
    lines = resumed_lines(outs)
    m = re.fullmatch(r"resumed step (\d+) from memory \(.+\)", lines[0]) if len(lines) == 1 else None
    assert m, outs[0][-3000:]
    step = int(m.group(1))
    info = _final(str(tmp_path / "final1.pt"))[1]
    assert step % 10 and info["restored_step"] == step >= 5 and info["global_step"] == STEPS  # mid-epoch: 10 batches an epoch
    assert info["stats"]["saves_failed"] == 0 and info["stats"]["snapshots"] >= 1
    got = losses(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert abs(got[s] - want_losses[s]) <= 1e-4 * abs(want_losses[s]), (s, got[s], want_losses[s])
    gone = os.path.join(shm, "unickpt")
    assert not os.path.exists(gone) or not os.listdir(gone)  # close() at teardown cleaned the memory

    log2, final2 = str(tmp_path / "loss2.jsonl"), str(tmp_path / "final2.pt")
    outs = _run(tmp_path, shm, _flags(log2, "ck2", "--final", final2), 2)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith(f"resumed step {durable} from disk (ck2/step_{durable:08d}"), outs
    got, info = _final(final2)
    assert info["restored_step"] == durable
    got_losses = losses(log2)
    assert sorted(got_losses) == list(range(durable + 1, STEPS + 1))
    assert all(got_losses[s] == want_losses[s] for s in got_losses), (got_losses, want_losses)
    assert set(got) == set(want) and any("exp_avg_sq" in k for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.multiprocess
def test_fsdp2_through_model_parallel_strategy_resumes_on_one_rank(tmp_path, shm_roots):
    """FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard`` in ``configure_model``):
    a 2-rank fit of 8 steps saves sharded weights and AdamW moments (DTensors) through the
    callback; a 1-rank fit resumes at step 8 (mid-epoch), resharded, and its losses and
    final weights and moments are within 1e-4 of an unbroken single-device run's (the same
    global batches)."""
    (tmp_path / "ref").mkdir()
    want = _fit(tmp_path / "ref", 12, None, dropout=0.0)
    want_losses = losses(str(tmp_path / "ref" / "loss.jsonl"))
    log, final = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt")
    shm = str(tmp_path / "shm")
    shm_roots.append(shm)
    _run(tmp_path, shm, [*_flags(log, "ck", "--strategy", "fsdp2"), "--steps", "8"], 2)
    outs = _run(tmp_path, shm, [*_flags(log, "ck", "--strategy", "fsdp2", "--final", final), "--steps", "12"], 1)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 8 from disk (ck/step_00000008"), outs[0][-3000:]
    got = losses(log)
    assert sorted(got) == list(range(1, 13))
    for s in got:
        assert abs(got[s] - want_losses[s]) <= 1e-4 * abs(want_losses[s]), (s, got[s], want_losses[s])
    tensors, info = _final(final)
    assert info["restored_step"] == 8 and info["global_step"] == 12
    for k, v in want.state_dict().items():
        assert torch.allclose(tensors[f"model.{k}"], v, rtol=1e-4, atol=1e-6), k
    opt = want.trainer.optimizers[0]
    for name, param in want.named_parameters():
        for k, v in opt.state[param].items():
            assert torch.allclose(tensors[f"optim.{name}.{k}"], v, rtol=1e-4, atol=1e-7), (name, k)
    assert any("exp_avg_sq" in k for k in tensors)


# -- in one process (no process group): the hooks, the fit loop's state, refusals ---------
def _fit(tmp_path, steps: int, callback: UnickptCallback | None, dropout: float = 0.1, ckpt_path: str | None = None,
         **trainer_options) -> Regression:
    L.seed_everything(0, verbose=False)
    model = Regression(dropout, str(tmp_path / "loss.jsonl"), 0.0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[callback] if callback else [],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **trainer_options)
    trainer.fit(model, train_dataloaders=Batches(0, 1), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("accumulate", [1, 2])
def test_stop_and_resume_in_one_process_bitwise(tmp_path, accumulate):
    """A fit of 9 steps saving every 3; a new process-like fit (fresh module, seeds, data)
    with max_steps=14 resumes at step 9 (mid-epoch: the data position comes back through
    the fit loop's state; dropout: the RNG comes back) and ends bitwise equal to an
    unbroken 14-step fit. With gradient accumulation a save comes once per optimizer step."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = _fit(tmp_path / "a", 14, None, accumulate_grad_batches=accumulate)
    first = UnickptCallback(str(tmp_path / "ck"), save_every=3)
    _fit(tmp_path / "b", 9, first, accumulate_grad_batches=accumulate)
    assert first.manager.stats()["saves"] == 3 and first.manager.stats()["saves_failed"] == 0
    callback = UnickptCallback(str(tmp_path / "ck"), save_every=3)
    got = _fit(tmp_path / "b", 14, callback, accumulate_grad_batches=accumulate)
    assert callback.restored_step == 9 and callback.manager.restored_line.startswith("resumed step 9 from disk")
    for k, v in want.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    a, b = losses(str(tmp_path / "a" / "loss.jsonl")), losses(str(tmp_path / "b" / "loss.jsonl"))
    assert a == b and set(range(1, 15)) <= set(b)


class _Logging(Regression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss


class _FailAt(L.pytorch.Callback):
    """Raises at the end of step ``step``'s batch, before Lightning hands its metrics to the loggers."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"failure at step {self.step}")


def _logged_fit(tmp_path, steps: int, logger, callbacks: list, model: L.LightningModule | None = None) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    model = model if model is not None else _Logging(0.0, str(tmp_path / "loss.jsonl"), 0.0)
    trainer.fit(model, train_dataloaders=Batches(0, 1))


def _fail_then_resume(tmp_path, fail_at: int) -> tuple[Recorded, Recorded, list[int], UnickptCallback]:
    """An unbroken 10-step fit's logger; then, with one logger kept across both, a fit with
    durable checkpoints every 3 that fails at the end of step ``fail_at``'s batch and a new
    Trainer in the same process that resumes (as after a re-forming under unickpt.run).
    Returns the unbroken logger, the kept one, the steps it had before the resume and the
    resuming callback."""
    unbroken = Recorded()
    (tmp_path / "a").mkdir()
    _logged_fit(tmp_path / "a", 10, unbroken, [])
    logger = Recorded()
    with pytest.raises(RuntimeError, match=f"failure at step {fail_at}"):
        _logged_fit(tmp_path, 10, logger, [UnickptCallback(str(tmp_path / "ck"), save_every=3), _FailAt(fail_at)])
    before = [s for s, _ in logger.calls]
    callback = UnickptCallback(str(tmp_path / "ck"), save_every=3)
    _logged_fit(tmp_path, 10, logger, [callback])
    return unbroken, logger, before, callback


def test_a_logger_gets_each_step_once_when_the_fit_resumes_in_the_same_process(tmp_path):
    """A fit fails at step 8, and the new Trainer resumes from step 6 and re-does steps 7
    and 8. The logger is given every step once, 1 to 10, with the values of an unbroken fit
    (the re-done step 7 is not given again; without the callback's filter it would be,
    twice)."""
    unbroken, logger, before, callback = _fail_then_resume(tmp_path, 8)
    # Lightning logs global step k as step k - 1: steps 1..7 were given, 8 failed before its turn
    assert callback.restored_step == 6 and before == list(range(7)), before
    assert [s for s, _ in logger.calls] == [s for s, _ in unbroken.calls] and len(unbroken.calls) == 10
    assert logger.calls == unbroken.calls


def test_a_step_snapshotted_before_its_log_is_given_after_the_restore(tmp_path):
    """The callback saves step 6 in on_train_batch_end, before Lightning gives the step's
    metrics to its loggers; the fit fails right after that save (as when a peer is lost
    there). The new Trainer restores step 6 and goes on at 7, so only the callback can give
    step 6: the logger gets every step once, 1 to 10, with the unbroken values (without the
    held entry it never gets step 6)."""
    unbroken, logger, before, callback = _fail_then_resume(tmp_path, 6)
    assert before == list(range(5))  # Lightning logs global step k as step k - 1
    assert callback.restored_step == 6
    assert logger.calls == unbroken.calls and len(unbroken.calls) == 10


def test_the_stop_line_says_what_a_relaunch_resumes_from(tmp_path, caplog, monkeypatch, shm_roots):
    """The line rank 0 says when the fit stops by an error tells what is there: without
    snapshots, the durable checkpoint a relaunch resumes from (or a fresh start); with a
    snapshot taken, the snapshots in memory; a restore that failed (a checkpoint of another
    model), that nothing was trained or saved. Never 'the snapshots stay in memory' where
    there is none."""
    def stop_line(steps: int, callbacks: list, model=None) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="unickpt"), pytest.raises(Exception):
            _logged_fit(tmp_path, steps, False, callbacks, model)
        lines = [r.getMessage() for r in caplog.records if r.name == "unickpt" and r.levelno == logging.WARNING]
        assert len(lines) == 1, lines
        return lines[0]

    root = str(tmp_path / "ck")
    line = stop_line(10, [UnickptCallback(root, save_every=3), _FailAt(2)])
    assert line == (f"unickpt: training stopped by RuntimeError at step 2; no snapshot in memory (snapshots are off "
                    f"(snapshot_every=0)): a relaunch starts fresh (no checkpoint committed in {root})")
    line = stop_line(10, [UnickptCallback(root, save_every=3), _FailAt(4)])
    assert line == (f"unickpt: training stopped by RuntimeError at step 4; no snapshot in memory (snapshots are off "
                    f"(snapshot_every=0)): a relaunch resumes from {root}/step_00000003")
    wider = _Logging(0.0, str(tmp_path / "loss.jsonl"), 0.0)
    wider.net[0] = torch.nn.Linear(16, 48)
    line = stop_line(10, [UnickptCallback(root, save_every=3)], wider)
    assert line == (f"unickpt: the restore stopped by MismatchError before any step trained; nothing was saved, the "
                    f"checkpoints in {root} (and any snapshot in memory) are as they were")
    monkeypatch.setenv("UNICKPT_SHM_ROOT", str(tmp_path / "shm"))
    shm_roots.append(str(tmp_path / "shm"))
    line = stop_line(10, [UnickptCallback(str(tmp_path / "ck2"), snapshot_every=1), _FailAt(2)])
    assert line == "unickpt: training stopped by RuntimeError at step 2; the snapshots stay in memory for the relaunch"


def test_options_are_checked(tmp_path):
    """A bool option given a truthy string, a root that is no path, a manager that is none,
    extra_state that is no dict of names: one clear UnickptError each, naming the value."""
    with pytest.raises(unickpt.UnickptError, match="per_rank_data must be True or False, not 'no'"):
        UnickptCallback(str(tmp_path / "ck"), per_rank_data="no")
    with pytest.raises(unickpt.UnickptError, match="root must be a path .*, not 5"):
        UnickptCallback(5)
    with pytest.raises(unickpt.UnickptError, match="manager must be a unickpt.CheckpointManager, not 'ck'"):
        UnickptCallback(manager="ck")
    with pytest.raises(unickpt.UnickptError, match=r"extra_state must be a dict .*, not \[1\]"):
        UnickptCallback(str(tmp_path / "ck"), extra_state=[1])
    assert UnickptCallback(str(tmp_path / "ck"), per_rank_data=False).per_rank_data is False


def test_live_recovery_warns_once_of_a_logger_or_model_checkpoint_made_per_generation(tmp_path, monkeypatch, caplog):
    """Under live recovery ``fn`` builds a Trainer per generation in the same process: one
    with Lightning's default logger and ModelCheckpoint (new ones each time: a new
    ``version_N`` folder for the rows and the .ckpt files) is warned of once, at the second
    generation; a logger built once and passed in, with enable_checkpointing=False, is not."""
    import unickpt.integrations.lightning as integration
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.setattr(integration, "under_launch", lambda: True)

    def warnings(root: str, **trainer_options) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="unickpt"):
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, default_root_dir=str(tmp_path),
                                callbacks=[UnickptCallback(str(tmp_path / root), save_every=2)],
                                enable_progress_bar=False, enable_model_summary=False, **trainer_options)
            trainer.fit(Regression(0.0, str(tmp_path / "loss.jsonl"), 0.0), train_dataloaders=Batches(0, 1))
        return [r.getMessage() for r in caplog.records if r.name == "unickpt" and r.levelno == logging.WARNING]

    assert warnings("a") == []
    got = warnings("a")
    assert len(got) == 2, got
    assert got[0].startswith("unickpt: this generation's Trainer has a new logger (")
    assert got[0].endswith("build the logger once, outside fn, and pass it to each generation's Trainer (or logger=False)")
    assert got[1].startswith("unickpt: this generation's ModelCheckpoint saves into ")
    assert "version_1" in got[1] and got[1].endswith("give it a fixed dirpath, or enable_checkpointing=False "
                                                      "(the UnickptCallback checkpoints)")
    assert warnings("a") == []  # once
    logger = CSVLogger(str(tmp_path / "logs"))
    assert warnings("b", logger=logger, enable_checkpointing=False) == []
    assert warnings("b", logger=logger, enable_checkpointing=False) == []


def test_fit_loop_state_round_trip(tmp_path):
    """FitLoopState saved through unickpt and loaded into a fresh Trainer's fit loop gives
    Lightning the same progress; the loaders' state is per rank unless told otherwise."""
    (tmp_path / "r").mkdir()
    callback = UnickptCallback(str(tmp_path / "ck"), save_every=4)
    _fit(tmp_path / "r", 4, callback)
    sd = callback.state["loops"].state_dict()
    assert isinstance(sd["data"], unickpt.PerRank) and sd["data"].value == [{"epoch": 0, "position": 4}]
    fresh = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False)
    target = {"loops": FitLoopState(fresh.fit_loop)}
    unickpt.load(target, str(tmp_path / "ck" / "step_00000004"))
    assert fresh.global_step == 4 and fresh.fit_loop._combined_loader_states_to_load == [{"epoch": 0, "position": 4}]
    assert fresh.fit_loop.epoch_loop._batches_that_stepped == 3  # as Lightning saves it: its reset adds the 1


def test_refusals(tmp_path):
    """log_deltas with Lightning's gradient clipping (it runs after the hook that captures
    the gradients) is one clear error; a restored run given ckpt_path too is one clear
    error; so are a callback without a root, extra_state using the callback's keys and
    Lightning's FSDPStrategy (FSDP1)."""
    with pytest.raises(unickpt.UnickptError, match="gradient clipping"):
        _fit(tmp_path, 2, UnickptCallback(str(tmp_path / "d"), save_every=2, log_deltas=True), gradient_clip_val=1.0)
    model = _fit(tmp_path, 2, UnickptCallback(str(tmp_path / "f"), save_every=2))
    model.trainer.save_checkpoint(str(tmp_path / "lightning.ckpt"))
    with pytest.raises(unickpt.UnickptError, match="drop ckpt_path"):
        _fit(tmp_path, 4, UnickptCallback(str(tmp_path / "f"), save_every=2), ckpt_path=str(tmp_path / "lightning.ckpt"))
    with pytest.raises(unickpt.UnickptError, match="needs a checkpoint root"):
        UnickptCallback()
    with pytest.raises(unickpt.UnickptError, match="own keys"):
        _fit(tmp_path, 2, UnickptCallback(str(tmp_path / "e"), extra_state={"rng": 1}))
    # Lightning's FSDPStrategy needs a GPU to fit; the callback's check refuses the strategy itself
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from unickpt.integrations.lightning import _check_strategy

    with pytest.raises(unickpt.UnickptError, match="FSDPStrategy .*use ModelParallelStrategy"):
        _check_strategy(FSDPStrategy())
    _check_strategy(DDPStrategy())


def test_the_end_of_fit_is_saved_durably_and_a_rerun_trains_nothing(tmp_path):
    """A fit of 6 steps saving every 4 ends with a durable checkpoint of step 6 (as the
    torchtitan integration does), so running the finished command again restores step 6
    and trains no step."""
    (tmp_path / "r").mkdir()
    first = UnickptCallback(str(tmp_path / "ck"), save_every=4, async_save=True)
    _fit(tmp_path / "r", 6, first)
    assert first.manager.steps() == [4, 6] and first.manager.stats()["saves_failed"] == 0
    logged = open(tmp_path / "r" / "loss.jsonl").read()
    again = UnickptCallback(str(tmp_path / "ck"), save_every=4, async_save=True)
    _fit(tmp_path / "r", 6, again)
    assert again.restored_step == 6 and again.manager.restored_line.startswith("resumed step 6 from disk")
    assert open(tmp_path / "r" / "loss.jsonl").read() == logged  # no step trained again
    assert again.manager.steps() == [4, 6] and again.manager.stats()["saves"] == 0


class _Ids(L.LightningModule):
    """Appends each step's batch (sample ids), epoch, loss and logger step to ``log``."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.log_path = log

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch.float().unsqueeze(1)).sum()
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"step": self.global_step + 1, "ids": batch.tolist(), "epoch": self.current_epoch,
                                "loss": float(loss), "logged_as": self.trainer.fit_loop.epoch_loop._batches_that_stepped})
                    + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _ids_fit(log: str, steps: int, callback: UnickptCallback | None) -> None:
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    L.seed_everything(0, verbose=False)
    data = torch.arange(16)
    loader = StatefulDataLoader(data, batch_size=2,
                                sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", max_steps=steps, logger=False,
                        callbacks=[callback] if callback else [], use_distributed_sampler=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Ids(log), train_dataloaders=loader)


def _seen_fit(log: str, steps: int, callback: UnickptCallback | None) -> None:
    """One process, no process group: a torchdata StatefulDataLoader over a shuffling
    sampler (16 samples, 8 batches an epoch, each epoch another order)."""
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    L.seed_everything(0, verbose=False)
    data = torch.arange(16)
    loader = StatefulDataLoader(data, batch_size=2,
                                sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        callbacks=[callback] if callback else [], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Ids(log), train_dataloaders=loader)


@pytest.mark.parametrize("ends,save_every", [((5, 13, 20), 100), ((8, 16, 20), 100), ((8, 12, 20), 4)])
def test_a_finished_fit_extended_from_its_end_checkpoint_goes_on_with_the_next_batch(tmp_path, ends, save_every):
    """A fit that ends at max_steps between two saves (save_every=100) ends with a durable
    checkpoint taken in on_train_end, after Lightning closed the epoch it stopped in. A new
    Trainer with a larger max_steps resumes from it and, fit after fit, sees the unbroken
    run's batches (epoch, sample ids), losses and logger steps, bitwise: mid-epoch (5, 13:
    the stopped epoch goes on, not the next one) and at an epoch's end (8, 16: the next
    epoch, in its own order; a StatefulDataLoader's state taken after its last batch starts
    no empty epoch). With save_every=4 the checkpoints are the batch-end ones: at an
    epoch's end (8), then mid-epoch in the epoch the resume started (12)."""
    ref, run = str(tmp_path / "ref.jsonl"), str(tmp_path / "run.jsonl")
    _seen_fit(ref, ends[-1], None)
    for i, steps in enumerate(ends):
        callback = UnickptCallback(str(tmp_path / "ck"), save_every=save_every)
        _seen_fit(run, steps, callback)
        assert callback.restored_step == (ends[i - 1] if i else 0)
        assert set(ends[:i + 1]) <= set(callback.manager.steps()) and callback.manager.stats()["saves_failed"] == 0
    want = [json.loads(line) for line in open(ref)]
    got = [json.loads(line) for line in open(run)]
    assert [r["step"] for r in got] == list(range(1, ends[-1] + 1))
    for r, w in zip(got, want):
        assert r == w, (r, w)


def test_ddp_stateful_loader_resumes_mid_epoch_in_the_right_epoch_order(tmp_path, monkeypatch):
    """DDP (a process group, here of one rank) and a torchdata StatefulDataLoader over a
    shuffling DistributedSampler: stopped at step 10, mid-way through the second epoch,
    and resumed, steps 11 and 12 get the same batches as an unbroken run (Lightning makes
    the loader's iterator before it sets the sampler's epoch; the callback sets it and
    makes the iterator again from the restored position)."""
    import torch.distributed as dist

    from unickpt.testing import free_port

    saved = dict(os.environ)  # Lightning's DDP sets RANK, WORLD_SIZE, LOCAL_RANK, ... in this process
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        _ids_fit(str(tmp_path / "ref.jsonl"), 12, None)
        _ids_fit(str(tmp_path / "run.jsonl"), 10, UnickptCallback(str(tmp_path / "ck"), save_every=5))
        again = UnickptCallback(str(tmp_path / "ck"), save_every=5)
        _ids_fit(str(tmp_path / "run.jsonl"), 12, again)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()  # later tests of this process must not see a distributed launch
        os.environ.update(saved)
    assert again.restored_step == 10
    ref = [json.loads(line) for line in open(tmp_path / "ref.jsonl")]
    run = [json.loads(line) for line in open(tmp_path / "run.jsonl")]
    assert [r["step"] for r in run] == list(range(1, 13)) and run == ref


# -- live recovery: unickpt launch, a rank SIGKILLed, the survivors go on in their processes
LIVE = os.path.join(os.path.dirname(__file__), "lightning_live.py")


def _live_reference(tmp_path, steps: int) -> dict[int, dict]:
    """The unbroken run in this process (one rank, the same global batches): each step's
    loss and the sum of its batch's inputs."""
    import lightning_live

    (tmp_path / "ref").mkdir()
    log = str(tmp_path / "ref" / "log.jsonl")
    world = unickpt.World(0, 1, 0, 0)
    L.seed_everything(0, verbose=False)

    class Unbroken(lightning_live.Logged):
        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            with open(log, "a") as f:
                f.write(json.dumps({"step": self.global_step, "loss": float(self._loss),
                                    "xsum": float(self._xsum)}) + "\n")

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Unbroken(log, world, 0.0),
                train_dataloaders=Batches(0, 1, lightning_live.GLOBAL_BATCH, lightning_live.SAMPLES))
    return {r["step"]: r for r in map(json.loads, open(log))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_live_recovery_in_the_same_processes(tmp_path, shm_roots, strategy):
    """3 ranks of a fit under ``unickpt launch --max-restarts 1`` through
    ``unickpt.integrations.lightning.run`` (the Trainer, module and callback built per
    generation), DDP or FSDP2 (ModelParallelStrategy: the mesh and the shards made again
    on each world); the last rank SIGKILLed mid-epoch: the two survivors go on in their
    own processes from memory (resharded) on the unbroken run's curve with the same
    global batches, the replacement joins at a step boundary, the job ends 0
    (live_helpers.check_live_run)."""
    steps = 30
    want = _live_reference(tmp_path, steps)
    shm_roots.append(str(tmp_path / "shm"))
    rows, job = live_job(tmp_path, LIVE, 3, steps, ["--strategy", strategy], sleep=0.3, kill_after=4,
                         preload=("lightning", "unickpt.integrations.lightning"))
    took = check_live_run(rows, job, 3, steps, want, f"Lightning {strategy}")
    assert took < 10, took  # the target is 2 s; a loaded shared machine may stretch it
    # the logger built once per process: every step given once across the re-formings (Lightning's
    # step k - 1 for step k), also the step whose snapshot was taken (in on_train_batch_end) when
    # the kill came, before Lightning handed its metrics to the loggers
    given = [json.loads(x)["step"] for x in open(tmp_path / "log.jsonl.given")]
    assert given == list(range(steps)), given


@pytest.mark.multiprocess
def test_the_live_example_trains_under_unickpt_launch(tmp_path, shm_roots):
    """examples/lightning_live.py, as its docstring runs it (2 ranks, a few steps): the job
    ends 0 and the last step's durable checkpoint is committed in its folder."""
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lightning_live.py")
    shm_roots.append(str(tmp_path / "shm"))
    env = dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=str(tmp_path / "shm"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(unickpt.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "unickpt", "launch", "--standalone", "--nproc-per-node", "2",
                          "--start-method", "forkserver", "--preload", "lightning", example, "--steps", "4"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "the job finished: 2 ranks ran" in out.stderr.splitlines()[-1], out.stderr[-2000:]
    assert unickpt.read_manifest(str(tmp_path / "ckpt" / "step_00000004")) is not None
