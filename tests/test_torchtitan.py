"""``unickpt.integrations.torchtitan`` with the real torchtitan package: its trainer's calls
(tests/titan_cases.py: torchtitan's Llama 3, FSDP2, OptimizersContainer, LR schedulers,
ParallelAwareDataloader, train state) on 2 real processes, SIGKILLed and resumed from
memory and from disk plus the delta log, bitwise equal to a run with checkpointing off;
the final checkpoint resumed on 1 rank; a torchtitan DCP checkpoint as the initial state;
in this process, runs extended from their last step's checkpoint on the unbroken run's batches;
live recovery under ``unickpt launch`` (tests/titan_live.py): a rank SIGKILLed, the
survivors go on in their own processes on the unbroken run's curve."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

from unickpt.testing import RankFailure, run_ranks  # noqa: E402

from snapshot_helpers import kill_keeper, losses  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes

PRELOAD = ["torch", "torch.distributed.fsdp", "unickpt", "unickpt.testing", "titan_cases"]
STEPS = 8


def _run(world: int, case: str, *args) -> None:
    """``titan_cases.<case>`` on ``world`` real processes (forked from a server that
    imported torch and torchtitan once)."""
    import titan_cases

    run_ranks(getattr(titan_cases, case), world, *args, preload=PRELOAD)


def _opts(tmp, name: str, **kw) -> dict:
    d = tmp / name
    d.mkdir(exist_ok=True)
    return {"steps": STEPS, "folder": str(tmp / "ckpt"), "shm_root": str(tmp / "shm"),
            "loss_log": str(d / "loss.jsonl"), "final": str(d / "final.pt"), **kw}


def _final(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    return torch.load(path), json.load(open(path + ".json"))


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ta, va), (tb, vb) = a, b
    assert set(ta) == set(tb) and any(k.endswith("exp_avg_sq") for k in ta) and "model.tok_embeddings.weight" in ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert va == vb


def _line(o: dict, pattern: str) -> re.Match:
    """The last restore line rank 0 printed (titan_cases writes it beside the loss log)."""
    lines = open(o["loss_log"] + ".restored").read().splitlines()
    m = re.fullmatch(pattern, lines[-1])
    assert m, lines
    return m


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2 ranks, checkpointing off (``enable=False``): the losses and the final state."""
    o = _opts(tmp_path_factory.mktemp("ref"), "ref", disabled=True)
    _run(2, "train", o)
    return losses(o["loss_log"]), _final(o["final"])


@pytest.fixture
def shm(tmp_path):
    yield str(tmp_path / "shm")
    kill_keeper(str(tmp_path / "shm"))


def test_sigkill_resumes_from_memory_bitwise(tmp_path, shm, reference):
    """Snapshots every step, no durable checkpoint: both ranks SIGKILLed after step 5
    (its snapshot whole); the relaunch resumes step 5 from memory and ends bitwise equal
    to the run without checkpointing (weights, AdamW moments, LR, train state)."""
    o = _opts(tmp_path, "run", snapshot_every=1)
    with pytest.raises(RankFailure):
        _run(2, "train", {**o, "crash_after": 5})
    assert max(losses(o["loss_log"])) == 5
    _run(2, "train", o)
    _line(o, r"resumed step 5 from memory \(.+\)")
    assert losses(o["loss_log"]) == reference[0]
    _same(_final(o["final"]), reference[1])
    jobs = os.path.join(shm, "unickpt")
    assert not os.path.exists(jobs) or not os.listdir(jobs), "close() leaves no snapshot behind"


def test_disk_and_delta_log_then_one_rank(tmp_path, shm, reference):
    """Async durable checkpoints every 3 steps and the delta log: SIGKILL after step 5;
    the relaunch resumes from step 3's checkpoint plus the 2 logged steps and ends bitwise;
    the last step's checkpoint (a full one) then loads on 1 rank bitwise, the data
    loader's per-rank position left as it is."""
    o = _opts(tmp_path, "run", interval=3, async_mode="async", log_deltas=True)
    with pytest.raises(RankFailure):
        _run(2, "train", {**o, "crash_after": 5, "crash_waits_for": [  # the log caught up: its entries committed
            "step_00000003/manifest.json", "deltas/step_00000005/manifest.json"]})
    _run(2, "train", o)
    _line(o, r"resumed step 5 from disk \+ 2 logged steps \(.*/step_00000003; replayed steps 4\.\.5; [\d.]+ s\)")
    assert losses(o["loss_log"]) == reference[0]
    _same(_final(o["final"]), reference[1])
    assert sorted(os.listdir(o["folder"]))[-1] == "step_00000008"  # the last step, though not an interval's

    one = _opts(tmp_path, "one")
    _run(1, "train", one)
    _line(one, r"resumed step 8 from disk \(.*step_00000008.*; per-rank state left as it is: "
                                  r"saved by another number of ranks \(.*dataloader.*\)\)")
    _same(_final(one["final"]), reference[1])
    assert not os.path.exists(one["loss_log"])  # no step left to train


@pytest.mark.parametrize("model_only", [True, False])
def test_initial_load_from_torchtitan_dcp(tmp_path, model_only):
    """A checkpoint of torchtitan's own DCP checkpointer as ``initial_load_path``."""
    _run(1, "initial_load", str(tmp_path), model_only)


def test_refusals(tmp_path):
    """Options unickpt cannot honour, and a delta log that could not replay exactly,
    are clear errors."""
    _run(1, "refusals", str(tmp_path))


def test_config_values_are_checked(tmp_path):
    """In this process, no ranks: ``async_mode`` takes exactly what torchtitan's own
    checkpoint config takes (any case, kept lower-cased; "yes" was taken as async), and
    every other option of the Config that nothing checked (or checked only when the
    checkpointer is built) is a one-line UnickptError naming the option, the value and
    what is allowed, when the Config is made."""
    from torchtitan.components.checkpointer import CheckpointManager as TorchtitanDCP

    from unickpt import UnickptError
    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    Config = UnickptCheckpointManager.Config
    for mode in ("yes", "true", "sync", "enabled", "", "disabled", "async", "async_with_pinned_mem", "ASYNC",
                 "Async_With_Pinned_Mem"):
        try:
            want = TorchtitanDCP.Config(async_mode=mode).async_mode
        except ValueError:
            want = None
        if want is not None:
            assert Config(async_mode=mode).async_mode == want, mode
            continue
        with pytest.raises(UnickptError) as e:
            Config(async_mode=mode)
        assert str(e.value) == ("UnickptCheckpointManager: async_mode must be one of 'disabled', 'async', "
                                f"'async_with_pinned_mem' (any case, as torchtitan takes it), not {mode!r}")
    model = torch.nn.Linear(2, 2)
    for mode, want in (("ASYNC", "async"), ("Disabled", "sync")):  # the checkpointer built from it, in this process
        built = Config(enable=True, folder=str(tmp_path / "ck"), async_mode=mode).build(
            dataloader=None, model_parts=[model], optimizers=torch.optim.SGD(model.parameters()),
            lr_schedulers=None, states={}, sd_adapter=None)
        assert built.manager.options.saves.mode == want, mode
        built.close()
    for option, match in (({"async_mode": True}, r"async_mode must be one of .*, not True"),
                          ({"log_deltas": "yes"}, "log_deltas must be True or False, not 'yes'"),
                          ({"keep_snapshots_on_close": "no"}, "keep_snapshots_on_close must be True or False"),
                          ({"enable": 1}, "enable must be True or False, not 1"),
                          ({"interval": "5"}, "interval must be a whole number >= 1, not '5'"),
                          ({"load_step": -2}, r"load_step must be -1 \(the newest state\) or a step >= 0, not -2"),
                          ({"snapshot_every": "1"}, "snapshot_every must be a whole number >= 0, not '1'"),
                          ({"parity": "1", "snapshot_every": 1}, "parity must be a whole number >= 0 or None, not '1'"),
                          ({"snapshot_replicas": 0}, "snapshot_replicas must be a whole number >= 1, not 0"),
                          ({"parity": 1}, "parity=1 configures the memory snapshots: set snapshot_every too"),
                          ({"delta_dtype": "fp16", "log_deltas": True}, "delta_dtype must be 'exact' or 'bf16'"),
                          ({"durable_every": 0}, "durable_every must be a whole number >= 1, not 0"),
                          ({"durable_keep": 0, "durable": "/d"}, "durable_keep must be a whole number >= 1 or None"),
                          ({"full_every": 0, "incremental": True}, "full_every must be a whole number >= 1 or None"),
                          ({"export_dtype": "fp8"}, "export_dtype must be one of 'float16', 'bfloat16', 'float32'"),
                          ({"exclude_from_loading": "dataloader"}, "exclude_from_loading must be a list of state keys")):
        with pytest.raises(UnickptError, match=rf"^UnickptCheckpointManager: {match}") as e:
            Config(**{"enable": True, **option})
        assert "\n" not in str(e.value)


def test_a_finished_run_extended_from_its_last_checkpoint_goes_on_with_the_next_batch(tmp_path):
    """In this process, one rank: torchtitan's loop (titan_cases.train_step: its Llama 3,
    OptimizersContainer, LRSchedulersContainer) over its ``ParallelAwareDataloader`` of a
    data set that loops over 16 samples in a new order each epoch, keeping its position
    (epoch, sample) as torchtitan's ``HuggingFaceTextDataset(infinite=True)`` does (2 a step:
    8 steps an epoch). Runs of 5, 13, 20 steps, of 8, 16, 20 (ending at epoch ends) and of
    8, 12, 20 checkpointing every 4, each from the one before, train the unbroken 20-step
    run's samples, in the same epochs and steps, with bitwise its losses: the last step's
    checkpoint (``save(step, last_step=True)``, called where every other save is) holds the
    state of that step's end, as a periodic one would; at an epoch's end the loader's
    position says the epoch's samples are all taken, and the next run goes on with the next
    epoch's first batch. (The learning-rate schedule is built for 20 steps in every run:
    torchtitan's depends on ``training.steps``.)"""
    from titan_cases import SEQ, VOCAB, TrainState, sharded_parts, train_step
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    class Epochs(IterableDataset):
        def __init__(self) -> None:
            self.epoch, self.sample = 0, 0
            self.data = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(3))

        def __iter__(self):
            while True:
                order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(100 + self.epoch))
                while self.sample < len(self.data):
                    i, self.sample = int(order[self.sample]), self.sample + 1
                    yield {"input": self.data[i][:-1], "id": torch.tensor(i), "epoch": torch.tensor(self.epoch)}, \
                        self.data[i][1:]
                self.epoch, self.sample = self.epoch + 1, 0

        def state_dict(self) -> dict:
            return {"epoch": self.epoch, "sample": self.sample}

        def load_state_dict(self, sd: dict) -> None:
            self.epoch, self.sample = sd["epoch"], sd["sample"]

    def train(folder, steps: int, interval: int = 100) -> tuple[list, str]:
        model, optimizers, lr_schedulers = sharded_parts(1, 20, total_steps=20)
        dataloader = ParallelAwareDataloader(Epochs(), dp_rank=0, dp_world_size=1, batch_size=2)
        state = TrainState()
        checkpointer = UnickptCheckpointManager.Config(enable=True, folder=str(folder), interval=interval,
                                                       keep_latest_k=0).build(
            dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": state}, sd_adapter=None)
        checkpointer.load(step=-1)
        line, rows, batches = checkpointer.manager.restored_line, [], iter(dataloader)
        while state.step < steps:
            loss, inputs = train_step(model, batches, optimizers, lr_schedulers, checkpointer, state, steps)
            rows.append((state.step, int(inputs["epoch"][0]), inputs["id"].tolist(), loss.item()))
        checkpointer.close()
        return rows, line

    unbroken, _ = train(tmp_path / "ref", 20)
    assert [(r[0], r[1]) for r in unbroken] == [(s, (s - 1) // 8) for s in range(1, 21)]
    assert sorted(i for r in unbroken[8:16] for i in r[2]) == list(range(16)) and unbroken[8][2] != unbroken[0][2]
    for runs, interval in (((5, 13, 20), 100), ((8, 16, 20), 100), ((8, 12, 20), 4)):
        folder = tmp_path / f"ck{'_'.join(map(str, runs))}"
        got, before = [], 0
        for steps in runs:
            trained, line = train(folder, steps, interval)
            assert line.startswith(f"resumed step {before} from disk" if before else "starting fresh"), (runs, line)
            got += trained
            before = steps
        assert got == unbroken, runs


def test_a_restored_last_step_held_only_in_memory_is_written_before_close(tmp_path, shm, monkeypatch):
    """torchtitan's ``Trainer`` trains nothing after a restored step at its ``training.steps``
    (its loop ends before any save; ``close`` then frees the snapshots). In this process, one
    rank: a run of 8 steps, snapshots every step, ends while step 8's durable checkpoint is
    written (here: the checkpoint deleted, its snapshot kept whole in memory); the relaunch
    restores step 8 from memory and writes it durably before ``close``: a run without
    snapshots then resumes step 8 from disk, bitwise."""
    from types import SimpleNamespace

    from titan_cases import Tokens, TrainState, sharded_parts, train_step
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    monkeypatch.setenv("UNICKPT_SHM_ROOT", shm)
    folder = tmp_path / "ckpt"

    class Trainer(TrainState):  # what the checkpointer reads of torchtitan's Trainer: config.training.steps
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(training=SimpleNamespace(steps=STEPS))

    def run(**options) -> tuple[dict, str, Trainer]:
        model, optimizers, lr_schedulers = sharded_parts(1, STEPS, total_steps=20)
        dataloader = ParallelAwareDataloader(Tokens(0), dp_rank=0, dp_world_size=1, batch_size=2)
        trainer = Trainer()
        checkpointer = UnickptCheckpointManager.Config(enable=True, folder=str(folder), interval=100, **options).build(
            dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": trainer}, sd_adapter=None)
        checkpointer.load(step=-1)
        batches = iter(dataloader)
        while trainer.step < STEPS:
            train_step(model, batches, optimizers, lr_schedulers, checkpointer, trainer, STEPS)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checkpointer.close()
        return weights, checkpointer.manager.restored_line, trainer

    trained, _, _ = run(snapshot_every=1, keep_snapshots_on_close=True)
    shutil.rmtree(folder / "step_00000008")  # the last step's checkpoint, cut short by the end of the run
    restored, line, _ = run(snapshot_every=1)
    assert line.startswith("resumed step 8 from memory"), line
    assert sorted(os.listdir(folder)) == ["step_00000008"] and all(torch.equal(trained[k], restored[k]) for k in trained)
    again, line, trainer = run()
    assert line.startswith("resumed step 8 from disk"), line
    assert trainer.step == STEPS and all(torch.equal(trained[k], again[k]) for k in trained)


# -- live recovery: unickpt launch, a rank SIGKILLed, the survivors go on in their processes
def test_live_recovery_in_the_same_processes(tmp_path, shm_roots):
    """torchtitan's loop (tests/titan_live.py: its Llama 3 under FSDP2, its optimizer and
    scheduler containers and data loader, the integration's checkpointer with
    ``snapshot_every=1``) on 3 ranks under ``unickpt launch --max-restarts 1`` through
    ``unickpt.run``, everything built per generation; the last rank SIGKILLed: the two
    survivors go on in their own processes from memory, resharded onto FSDP2 over 2 ranks,
    on the unbroken run's curve with the same global batches; the replacement joins, the job
    ends 0 (live_helpers.check_live_run)."""
    import titan_live

    import unickpt
    from live_helpers import check_live_run, live_job

    steps = 30
    (tmp_path / "ref").mkdir()
    ref = str(tmp_path / "ref" / "log.jsonl")
    titan_live.train(unickpt.World(0, 1, 0, 0), steps, None, ref, 0.0)  # the unbroken run, in this process
    want = {r["step"]: r for r in map(json.loads, open(ref))}
    shm_roots.append(str(tmp_path / "shm"))
    rows, job = live_job(tmp_path, titan_live.__file__, 3, steps, [], sleep=0.3, kill_after=4,
                         preload=("torchtitan.components.dataloader", "unickpt.integrations.torchtitan"))
    took = check_live_run(rows, job, 3, steps, want, "torchtitan")
    assert took < 10, took  # the target is 2 s; a loaded shared machine may stretch it
