"""Grouped options (issue 33, item 4): each group checks its own values once, an error names
what the user wrote (the flat keyword or the group's field), the flat keywords and the
groups configure the same manager, and one group given both ways is refused."""

from __future__ import annotations

import pytest
import torch

import unickpt
from unickpt import DeltaLogOptions, DurableOptions, SaveOptions, SaveSchedule, SnapshotOptions


def test_flat_keywords_and_groups_configure_the_same_manager(tmp_path):
    flat = unickpt.CheckpointManager(str(tmp_path / "a"), 2, save_every=5, async_save=True, snapshot_every=1, parity=0,
                                     log_deltas=True, delta_dtype="bf16", durable=str(tmp_path / "d"), durable_every=2)
    grouped = unickpt.CheckpointManager(str(tmp_path / "a"), 2, saves=SaveSchedule(every=5, mode="async"),
                                        snapshot=SnapshotOptions(every=1, parity=0),
                                        deltas=DeltaLogOptions(dtype="bf16"),
                                        durable=DurableOptions(str(tmp_path / "d"), every=2))
    assert flat.options == grouped.options
    assert grouped.options.saves == SaveSchedule(every=5, mode="async")
    assert (grouped.save_every, grouped.async_save, grouped.snapshot_every, grouped.delta_dtype) == (5, True, 1, "bf16")
    assert grouped.durable is not None and grouped.durable_every == 2
    plain = unickpt.CheckpointManager(str(tmp_path / "b"))
    assert plain.options.snapshot is None and plain.options.deltas is None


@pytest.mark.parametrize("make, says", [
    (lambda: SnapshotOptions(every=-1), r"^SnapshotOptions\.every must be a whole number >= 0 \(0: never\), not -1$"),
    (lambda: SnapshotOptions(every=1, parity=1, replicas=2),
     r"^SnapshotOptions\.replicas=2 and SnapshotOptions\.parity=1 exclude each other"),
    (lambda: SnapshotOptions(every=0, parity=1), r"^SnapshotOptions\.parity=1 configures the memory snapshots: "
                                                 r"set SnapshotOptions\.every too$"),
    (lambda: SaveSchedule(mode="background"), r"^SaveSchedule\.mode must be 'sync' or 'async', not 'background'$"),
    (lambda: SaveSchedule(mode="async"), r"^SaveSchedule\.mode='async' writes .* set SaveSchedule\.every too"),
    (lambda: SaveSchedule(full_every=0), r"^SaveSchedule\.full_every must be at least 1, not 0$"),
    (lambda: DeltaLogOptions(dtype="fp8"), r"^DeltaLogOptions\.dtype must be 'exact' or 'bf16', not 'fp8'$"),
    (lambda: DurableOptions("d", every=0), r"^DurableOptions\.every must be at least 1, not 0$"),
    (lambda: SaveOptions(block_bytes=12), r"^SaveOptions\.block_bytes must be a positive multiple of 8, not 12$"),
    (lambda: SaveOptions(threads=0), r"^SaveOptions\.threads must be a whole number >= 1, not 0$"),
])
def test_a_group_checks_itself_and_names_its_field(make, says):
    with pytest.raises(unickpt.UnickptError, match=says):
        make()


@pytest.mark.parametrize("kwargs, says", [
    ({"durable_every": 0, "durable": "d"}, r"^durable_every must be at least 1, not 0$"),
    ({"full_every": 0}, r"^full_every must be at least 1, not 0$"),
    ({"snapshot_every": 1, "snapshot_max_bytes": 0}, r"^snapshot_max_bytes must be positive, not 0$"),
    ({"snapshot_every": 2, "snapshot": SnapshotOptions()}, r"^snapshot_every and a SnapshotOptions were both given"),
    ({"save_every": 3, "saves": SaveSchedule(every=3)}, r"^save_every and a SaveSchedule were both given"),
    ({"durable": DurableOptions("d"), "durable_keep": 2}, r"^durable_keep and a DurableOptions were both given"),
    ({"snapshot": {"every": 1}}, r"^expected a SnapshotOptions, not dict"),
    ({"deltas": DeltaLogOptions()}, r"^DeltaLogOptions\.enabled=True needs save_every"),
])
def test_the_manager_names_the_keyword_the_user_wrote(tmp_path, kwargs, says):
    with pytest.raises(unickpt.UnickptError, match=says):
        unickpt.CheckpointManager(str(tmp_path / "ck"), **kwargs)


def test_save_takes_save_options_or_the_flat_keywords(tmp_path):
    state = {"w": torch.arange(64, dtype=torch.float32)}
    unickpt.save(state, str(tmp_path / "a"), options=SaveOptions(threads=1, block_bytes=64))
    unickpt.async_save(state, str(tmp_path / "b"), options=SaveOptions(block_bytes=64, max_staging_bytes=128)).result()
    for name in ("a", "b"):
        got = {"w": torch.zeros(64)}
        unickpt.load(got, str(tmp_path / name))
        assert torch.equal(got["w"], state["w"])
    with pytest.raises(unickpt.SaveError, match=r"^block_bytes must be a positive multiple of 8, not 12$"):
        unickpt.save(state, str(tmp_path / "c"), block_bytes=12)
    with pytest.raises(unickpt.SaveError, match=r"^threads and a SaveOptions were both given"):
        unickpt.save(state, str(tmp_path / "c"), threads=2, options=SaveOptions())


def test_the_async_handle_is_future_like(tmp_path):
    state = {"w": torch.ones(8)}
    seen: list = []
    ok = unickpt.async_save(state, str(tmp_path / "ok"))
    ok.add_done_callback(seen.append)
    assert ok.exception(30) is None and ok.done() and ok.staged()
    bad = unickpt.async_save({"w": torch.ones(8), "x": object()}, str(tmp_path / "bad"))
    bad.add_done_callback(seen.append)
    error = bad.exception(30)
    assert isinstance(error, unickpt.SaveError) and "'x'" in str(error), error
    with pytest.raises(unickpt.SaveError):
        bad.result(0)
    assert seen == [ok, bad]
    assert not (tmp_path / "bad" / "manifest.json").exists()
