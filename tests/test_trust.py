"""What a new user tripped on (issue 37), each with the real thing:

* a corrupt newest checkpoint (one flipped byte that only rank 1 reads, 2 ranks, gloo):
  ``CheckpointManager.restore`` resumes the step before it on every rank, bitwise, and
  the one line names the checkpoint passed over, the rank and the checksum that failed;
  ``latest()`` and ``load()`` pass it over too;
* a state entry no save can store (a plain DataLoader, an open file) is one error at
  ``restore``, naming the key and what to use instead; a StatefulDataLoader is saved.
"""

from __future__ import annotations

import os

from unickpt.testing import run_ranks

from trust_cases import corrupt_newest_is_passed_over


def test_a_corrupt_newest_checkpoint_is_passed_over_by_every_rank(tmp_path):
    run_ranks(corrupt_newest_is_passed_over, 2, str(tmp_path / "ckpt"))


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
    # a Stateful loader, plain data and per-rank values are taken, and saved
    state = {"model": model, "loader": StatefulDataLoader(data, batch_size=2), "extra": {"step": 1},
             "rng": unickpt.RNGState()}
    assert manager.restore(state) == 0
    manager.maybe_save(state, 1)
    manager.close()
    assert manager.stats()["saves"] == 1 and manager.stats()["saves_failed"] == 0


def test_async_save_without_save_every_is_one_clear_error(tmp_path):
    import pytest

    import unickpt

    with pytest.raises(unickpt.UnickptError, match="async_save=True .* set save_every"):
        unickpt.CheckpointManager(str(tmp_path / "ckpt"), async_save=True, snapshot_every=1)
