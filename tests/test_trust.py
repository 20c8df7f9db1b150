"""What a new user tripped on (issue 37), each with the real thing:

* a corrupt newest checkpoint (one flipped byte that only rank 1 reads, 2 ranks, gloo):
  ``CheckpointManager.restore`` resumes the step before it on every rank, bitwise, and
  the one line names the checkpoint passed over, the rank and the checksum that failed;
  ``latest()`` and ``load()`` pass it over too; with every checkpoint corrupt, restore is
  one error naming each (never a silent fresh start);
* a state entry no save can store (a plain DataLoader, an open file) is one error at
  ``restore``, naming the key and what to use instead; a StatefulDataLoader is saved;
* ``async_save=True`` without ``save_every`` is one error at construction;
* ``unickpt inspect`` on a manager's root lists its ``step_*`` checkpoints, committed or
  not, whole or not;
* a keeper left holding snapshots (a job that is not relaunched) is listed by
  ``unickpt snapshots`` and stopped, its shared memory freed, by ``--free``.
"""

from __future__ import annotations

import os
import re

import pytest

from forked import run_forked
from trust_cases import corrupt_newest_is_passed_over, every_checkpoint_corrupt_is_an_error


@pytest.mark.multiprocess
def test_a_corrupt_newest_checkpoint_is_passed_over_by_every_rank(tmp_path):
    run_forked(corrupt_newest_is_passed_over, 2, str(tmp_path / "ckpt"))


@pytest.mark.multiprocess
def test_no_whole_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    run_forked(every_checkpoint_corrupt_is_an_error, 2, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("damage", ["data file deleted", "base deleted"])
def test_checkpoints_of_which_none_is_whole_are_an_error_not_a_fresh_start(tmp_path, damage):
    """The only checkpoints have a file missing (the newest's own, or the full checkpoint an
    incremental one references): restore names them; it used to start fresh at step 0
    (latest() found nothing whole) and the run's progress was lost without a word."""
    import shutil

    import torch

    import unickpt

    root = tmp_path / "ckpt"
    state = {"w": torch.arange(8.0), "frozen": torch.ones(8)}  # an incremental save references the frozen bytes
    manager = unickpt.CheckpointManager(str(root), save_every=1, incremental=damage == "base deleted", full_every=2)
    manager.restore(state)
    for step in (1, 2):
        state["w"][0] = step
        manager.maybe_save(state, step)
    manager.close()
    if damage == "data file deleted":
        shutil.rmtree(root / "step_00000001")
        (root / "step_00000002" / "rank_00000.safetensors").unlink()
    else:
        shutil.rmtree(root / "step_00000001")  # the full checkpoint step 2 references
    with pytest.raises(unickpt.CorruptionError, match=r"no checkpoint under .* could be loaded: .*step_00000002"):
        unickpt.CheckpointManager(str(root), save_every=1).restore({"w": torch.zeros(8), "frozen": torch.zeros(8)})


def test_a_state_entry_that_can_never_be_saved_is_refused_at_restore(tmp_path):
    import pytest
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import unickpt

    data = list(range(10))
    model = torch.nn.Linear(2, 2)
    manager = unickpt.CheckpointManager(str(tmp_path / "ckpt"), save_every=1)
    with pytest.raises(unickpt.UnickptError, match=r"'loader' \(DataLoader\) can never be saved.*StatefulDataLoader"):
        manager.restore({"model": model, "loader": torch.utils.data.DataLoader(data, batch_size=2)})
    with pytest.raises(unickpt.UnickptError, match=r"'extra.log' \(TextIOWrapper\) can never be saved.*Stateful"):
        with open(tmp_path / "log.txt", "w") as f:
            manager.restore({"model": model, "extra": {"step": 1, "log": f}})
    assert not (tmp_path / "ckpt").exists() or not os.listdir(tmp_path / "ckpt")
    # a Stateful loader, plain data and per-rank values are taken, and saved; the check
    # calls no state_dict() (DCP's optimizer state dict, torchtitan's, makes the state with a step)
    class Counted:
        calls = 0

        def state_dict(self):
            Counted.calls += 1
            return {"n": 1}

        def load_state_dict(self, sd):
            pass

    state = {"model": model, "loader": StatefulDataLoader(data, batch_size=2), "extra": {"step": 1},
             "rng": unickpt.RNGState(), "counted": Counted()}
    assert manager.restore(state) == 0 and Counted.calls == 0
    manager.maybe_save(state, 1)
    manager.close()
    assert manager.stats()["saves"] == 1 and manager.stats()["saves_failed"] == 0


def test_async_save_without_save_every_is_one_clear_error(tmp_path):
    import pytest

    import unickpt

    with pytest.raises(unickpt.UnickptError, match="async_save=True .* set save_every"):
        unickpt.CheckpointManager(str(tmp_path / "ckpt"), async_save=True, snapshot_every=1)


@pytest.mark.multiprocess
def test_inspect_on_a_manager_root_lists_its_checkpoints(tmp_path):
    import json

    import torch
    from typer.testing import CliRunner

    import unickpt
    from unickpt.cli import app

    root = tmp_path / "ckpt"
    manager = unickpt.CheckpointManager(str(root), save_every=5)
    state = {"w": torch.arange(64, dtype=torch.float32)}
    for step in (5, 10, 15):
        manager.maybe_save(state, step)
    manager.close()
    with open(root / "step_00000010" / "rank_00000.safetensors", "r+b") as f:
        f.truncate(100)  # cut short
    (root / "step_00000020").mkdir()  # a save killed before its commit
    r = CliRunner().invoke(app, ["inspect", str(root)], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert "4, 2 committed and whole" in r.output and "newest whole: step_00000015" in r.output
    assert "rank_00000.safetensors: 100 of" in r.output and "not committed" in r.output
    r = CliRunner().invoke(app, ["inspect", "--json", str(root)])
    rows = {c["name"]: c for c in json.loads(r.output)["checkpoints"]}
    assert [(rows[n]["committed"], rows[n]["whole"]) for n in sorted(rows)] == [
        (True, True), (True, False), (True, True), (False, None)]
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "empty")])
    assert r.exit_code == 2


def test_inspect_on_a_manager_root_checks_the_files_an_incremental_checkpoint_references(tmp_path):
    """``inspect ROOT`` used to report every incremental checkpoint as not whole (each
    ``../step_X/file`` it references "missing") and name an older one as the newest whole,
    while the manager resumed the incremental one: the referenced files are looked up in
    their holder; a holder's file gone makes the incremental checkpoint not whole."""
    import json

    import torch
    from typer.testing import CliRunner

    import unickpt
    from unickpt.cli import app

    root = tmp_path / "ckpt"
    state = {"w": torch.arange(8.0), "frozen": torch.ones(1024)}  # the frozen bytes are referenced, not written
    manager = unickpt.CheckpointManager(str(root), save_every=1, incremental=True, full_every=2)
    for step in (1, 2):
        state["w"][0] = step
        manager.maybe_save(state, step)
    manager.close()
    assert unickpt.read_manifest(str(root / "step_00000002")).bases  # incremental indeed
    assert manager.latest() == str(root / "step_00000002")

    def rows() -> dict:
        r = CliRunner().invoke(app, ["inspect", "--json", str(root)])
        assert r.exit_code == 0, r.output
        return {c["name"]: c for c in json.loads(r.output)["checkpoints"]}

    assert [(c["whole"], c["problem"]) for c in rows().values()] == [(True, None), (True, None)]
    r = CliRunner().invoke(app, ["inspect", str(root)], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert "2, 2 committed and whole" in r.output and "newest whole: step_00000002" in r.output, r.output
    (root / "step_00000001" / "rank_00000.safetensors").unlink()  # the file step 2 references
    got = rows()
    assert [c["whole"] for c in got.values()] == [False, False]
    assert re.search(r"data file .*step_00000001/rank_00000\.safetensors is missing", got["step_00000002"]["problem"])


@pytest.mark.multiprocess
def test_snapshots_a_job_left_behind_are_listed_and_freed(tmp_path):
    import json
    import time

    from typer.testing import CliRunner

    from trust_cases import leave_snapshots
    from unickpt.cli import app
    from unickpt.snapshot.keeper_admin import running_keeper
    from unickpt.snapshot.leftovers import free_snapshots
    from unickpt.testing import run_ranks

    shm = str(tmp_path / "shm")
    run_ranks(leave_snapshots, 1, shm, str(tmp_path / "ckpt"))
    keeper = running_keeper(shm)
    try:
        assert keeper is not None
        r = CliRunner().invoke(app, ["snapshots", shm, "--json"])
        held = json.loads(r.output)
        assert held["keeper"]["pid"] == keeper["pid"] and held["jobs"][0]["whole"] == [2]
        assert held["jobs"][0]["bytes"] > 4000
        r = CliRunner().invoke(app, ["snapshots", shm], env={"COLUMNS": "250", "NO_COLOR": "1"})
        assert f"keeper pid {keeper['pid']}" in r.output and "--free" in r.output
        r = CliRunner().invoke(app, ["snapshots", shm, "--free"], env={"COLUMNS": "250", "NO_COLOR": "1"})
        assert r.exit_code == 0 and f"keeper {keeper['pid']} stopped" in r.output, r.output
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{keeper['pid']}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{keeper['pid']}")
        assert not os.path.exists(shm) or not os.listdir(shm)  # no shared memory left
    finally:
        free_snapshots(shm)


@pytest.mark.multiprocess
def test_export_of_a_hf_trainer_checkpoint_writes_its_config(tmp_path):
    """The Hugging Face integration keeps the model's config in the checkpoint's metadata:
    ``unickpt export`` without --config writes config.json, and from_pretrained loads the
    export bitwise; a checkpoint that does not know its config is not exported (exit 1,
    nothing written) unless --no-config."""
    import pytest
    import torch

    pytest.importorskip("transformers")
    from typer.testing import CliRunner
    from transformers import LlamaForCausalLM

    import unickpt
    from unickpt.cli import app
    from unickpt.integrations.hf import UnickptTrainer

    from hf_trainer_job import Tokens, tiny_llama, training_args

    manager = unickpt.CheckpointManager(str(tmp_path / "ck"), save_every=2)
    trainer = UnickptTrainer(model=tiny_llama(0.0), args=training_args(str(tmp_path / "out"), 2, 4),
                             manager=manager, train_dataset=Tokens())
    trainer.train()
    ckpt = str(tmp_path / "ck" / "step_00000002")
    r = CliRunner().invoke(app, ["export", ckpt, str(tmp_path / "hf")])
    assert r.exit_code == 0 and "config.json" in r.output and "no config.json" not in r.output, r.output
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    want = trainer.model.state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    # the same weights saved without their config: refused, unless the user adds it
    bare = str(tmp_path / "bare")
    unickpt.save({"model": {k: v.clone() for k, v in want.items()}}, bare)
    r = CliRunner().invoke(app, ["export", bare, str(tmp_path / "x"), "--names", "keep"])
    assert r.exit_code == 1 and "OK" not in r.output and "--no-config" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(app, ["export", bare, str(tmp_path / "x"), "--names", "keep", "--no-config"])
    assert r.exit_code == 0 and "no config.json" in r.output and not (tmp_path / "x" / "config.json").exists()
