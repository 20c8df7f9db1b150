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
    assert grouped.options.snapshot == SnapshotOptions(every=1, parity=0)
    assert grouped.options.deltas == DeltaLogOptions(dtype="bf16")
    assert grouped.options.durable == DurableOptions(str(tmp_path / "d"), every=2) and grouped.durable is not None
    plain = unickpt.CheckpointManager(str(tmp_path / "b"))
    assert plain.options.snapshot is None and plain.options.deltas is None and plain.options.durable is None


def test_the_groups_are_the_manager_s_only_copy_of_its_options(tmp_path):
    """No flat attribute mirrors a group (``manager.async_save`` was a bool shadowing the
    function); a plain Checkpoints keeps its groups the same way."""
    manager = unickpt.CheckpointManager(str(tmp_path / "a"), save_every=5, async_save=True, snapshot_every=1, parity=0)
    flat = {"save_every", "async_save", "snapshot_every", "parity", "snapshot_replicas", "flush_every",
            "snapshot_max_bytes", "snapshot_stripes", "log_deltas", "delta_dtype", "incremental", "full_every",
            "durable_every", "durable_keep"}
    assert not flat & set(vars(manager))
    tiers = unickpt.Checkpoints(str(tmp_path / "b"), incremental=True, full_every=3)
    assert tiers.options.saves == SaveSchedule(incremental=True, full_every=3) and tiers.options.durable is None
    assert not flat & set(vars(tiers))


def test_the_signature_reads_grouped():
    """The groups come first, then the flat spellings of the same options."""
    import inspect

    names = list(inspect.signature(unickpt.CheckpointManager).parameters)
    assert names[:9] == ["root", "keep", "saves", "snapshot", "deltas", "durable", "storage_options", "process_group",
                         "metadata"]
    assert set(names[9:]) == {"save_every", "async_save", "incremental", "full_every", "snapshot_every", "parity",
                              "snapshot_replicas", "flush_every", "snapshot_max_bytes", "snapshot_stripes", "log_deltas",
                              "delta_dtype", "durable_every", "durable_keep", "durable_storage_options"}


@pytest.mark.parametrize("make, says", [
    (lambda: SnapshotOptions(every=-1), r"^SnapshotOptions\.every must be a whole number >= 0 \(0: never\), not -1$"),
    (lambda: SnapshotOptions(every=1, parity=1, replicas=2),
     r"^SnapshotOptions\.replicas=2 and SnapshotOptions\.parity=1 exclude each other"),
    (lambda: SnapshotOptions(every=0, parity=1), r"^SnapshotOptions\.parity=1 configures the memory snapshots: "
                                                 r"set SnapshotOptions\.every too$"),
    (lambda: SaveSchedule(mode="background"), r"^SaveSchedule\.mode must be 'sync' or 'async', not 'background'$"),
    (lambda: SaveSchedule(mode="async"), r"^SaveSchedule\.mode='async' writes .* set SaveSchedule\.every too"),
    (lambda: SaveSchedule(full_every=0), r"^SaveSchedule\.full_every must be a whole number >= 1 or None, not 0$"),
    (lambda: SaveSchedule(incremental="yes"), r"^SaveSchedule\.incremental must be True or False, not 'yes'$"),
    (lambda: DeltaLogOptions(enabled=1), r"^DeltaLogOptions\.enabled must be True or False, not 1$"),
    (lambda: DurableOptions("d", keep=2.5), r"^DurableOptions\.keep must be a whole number >= 1 or None, not 2\.5$"),
    (lambda: DeltaLogOptions(dtype="fp8"), r"^DeltaLogOptions\.dtype must be 'exact' or 'bf16', not 'fp8'$"),
    (lambda: DurableOptions("d", every=0), r"^DurableOptions\.every must be a whole number >= 1, not 0$"),
    (lambda: SaveOptions(block_bytes=12), r"^SaveOptions\.block_bytes must be a positive multiple of 8, not 12$"),
    (lambda: SaveOptions(threads=0), r"^SaveOptions\.threads must be a whole number >= 1, not 0$"),
])
def test_a_group_checks_itself_and_names_its_field(make, says):
    with pytest.raises(unickpt.UnickptError, match=says):
        make()


@pytest.mark.parametrize("kwargs, says", [
    ({"durable_every": 0, "durable": "d"}, r"^durable_every must be a whole number >= 1, not 0$"),
    ({"durable_every": 0}, r"^durable_every=0 configures the durable tier: set durable too$"),
    ({"durable_keep": 3}, r"^durable_keep=3 configures the durable tier: set durable too$"),
    ({"full_every": 0}, r"^full_every must be a whole number >= 1 or None, not 0$"),
    ({"keep": "3"}, r"^keep must be a whole number >= 1 or None \(keep all\), not '3'$"),
    ({"keep": True}, r"^keep must be a whole number >= 1 or None \(keep all\), not True$"),
    ({"save_every": 2, "async_save": "yes"}, r"^async_save must be True or False, not 'yes'$"),
    ({"save_every": 2, "log_deltas": "no"}, r"^log_deltas must be True or False, not 'no'$"),
    ({"root": None}, r"^the checkpoints' root must be a directory or a URL \(a str or a path\), not None$"),
    ({"root": 5}, r"^the checkpoints' root must be a directory or a URL \(a str or a path\), not 5$"),
    ({"snapshot_every": 1, "snapshot_max_bytes": 0}, r"^snapshot_max_bytes must be a whole number >= 1 or None, not 0$"),
    ({"snapshot_every": 1, "snapshot_max_bytes": "x"}, r"^snapshot_max_bytes must be a whole number >= 1 or None, not 'x'$"),
    ({"snapshot_every": 1, "parity": "1"}, r"^parity must be a whole number >= 0 or None, not '1'$"),
    ({"snapshot_every": 1, "snapshot_replicas": "2"}, r"^snapshot_replicas must be a whole number >= 1, not '2'$"),
    ({"snapshot_every": 2, "snapshot": SnapshotOptions()}, r"^snapshot_every and a SnapshotOptions were both given"),
    ({"save_every": 3, "saves": SaveSchedule(every=3)}, r"^save_every and a SaveSchedule were both given"),
    ({"durable": DurableOptions("d"), "durable_keep": 2}, r"^durable_keep and a DurableOptions were both given"),
    ({"snapshot": {"every": 1}}, r"^expected a SnapshotOptions, not dict"),
    ({"deltas": DeltaLogOptions()}, r"^DeltaLogOptions\.enabled=True needs save_every"),
    ({"log_deltas": True}, r"^log_deltas=True needs save_every"),
    ({"saves": SaveSchedule(every=2), "log_deltas": True, "delta_dtype": "fp8"},
     r"^delta_dtype must be 'exact' or 'bf16', not 'fp8'$"),
    ({"async_save": True}, r"^async_save=True writes the checkpoints of save_every in the background: set save_every too"),
    ({"snapshot_replicas": 2}, r"^snapshot_replicas=2 configures the memory snapshots: set snapshot_every too$"),
    ({"snapshot_every": 1, "parity": 1, "snapshot_replicas": 2}, r"^snapshot_replicas=2 and parity=1 exclude each other"),
    ({"incremental": True, "durable": "d"}, r"^incremental=True needs a local root and no durable tier"),
    ({"saves": SaveSchedule(incremental=True), "durable": "d"},
     r"^SaveSchedule\.incremental=True needs a local root and no durable tier"),
    ({"snapshot": SnapshotOptions(flush_every=2), "storage_options": {}, "root": "memory://r"},
     r"^SnapshotOptions\.flush_every needs a local root"),
])
def test_the_manager_names_the_keyword_the_user_wrote(tmp_path, kwargs, says):
    kwargs = dict(kwargs)
    root = kwargs.pop("root", str(tmp_path / "ck"))
    with pytest.raises(unickpt.UnickptError, match=says):
        unickpt.CheckpointManager(root, **kwargs)


def test_a_root_that_is_a_file_and_a_step_that_is_not_a_number_are_named(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(unickpt.UnickptError, match=r"root .*/f is a file, not a directory$"):
        unickpt.CheckpointManager(str(tmp_path / "f"))
    manager = unickpt.CheckpointManager(str(tmp_path / "ck"), save_every=1)
    with pytest.raises(unickpt.UnickptError, match=r"step must be a whole number >= 0, not '1'$"):
        manager.maybe_save({"w": torch.ones(2)}, "1")


def test_a_run_that_forgot_restore_cannot_save_behind_the_root_s_newest(tmp_path):
    """A relaunch that forgot ``restore()`` used to save steps 2, 4, ... beside the broken
    run's 8 and 10, which ``keep=2`` then kept instead of them (and a resume would pick):
    its first maybe_save now says so. Going back on purpose (``load`` of step 8) saves."""
    state = {"w": torch.ones(2)}
    first = unickpt.CheckpointManager(str(tmp_path / "ck"), keep=2, save_every=2)
    first.restore(state)
    for step in range(1, 11):
        first.maybe_save(state, step)
    first.close()
    forgot = unickpt.CheckpointManager(str(tmp_path / "ck"), keep=2, save_every=2)
    with pytest.raises(unickpt.UnickptError, match=r"already holds the checkpoint of step 10, and this run saves step 2 "
                                                    r"without having called restore\(\).* keep=2 would delete them"):
        forgot.maybe_save(state, 2)
    assert forgot.steps() == [8, 10]
    back = unickpt.CheckpointManager(str(tmp_path / "ck"), keep=2, save_every=2)
    back.load(state, back.path_for(8))
    back.maybe_save(state, 9)
    back.close()


def test_the_snapshot_tier_takes_its_group_whole(tmp_path):
    """Snapshotter(job, SnapshotOptions): the group checked once when built; what only the
    Snapshotter can refuse (no interval, a flush without a directory) names the field."""
    from unickpt.snapshot import Snapshotter

    with pytest.raises(unickpt.SnapshotError, match=r"^a Snapshotter needs SnapshotOptions\.every of at least 1 step"):
        Snapshotter("opts", SnapshotOptions(every=0), root=str(tmp_path / "shm"))
    with pytest.raises(unickpt.SnapshotError, match=r"^SnapshotOptions\.flush_every needs a checkpoint directory"):
        Snapshotter("opts", SnapshotOptions(every=1, flush_every=2), root=str(tmp_path / "shm"))
    with pytest.raises(unickpt.SnapshotError, match=r"^Snapshotter takes a SnapshotOptions, not int"):
        Snapshotter("opts", 1, root=str(tmp_path / "shm"))  # type: ignore[arg-type]
    assert not (tmp_path / "shm").exists()  # refused before any keeper or shm folder


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
    with pytest.raises(unickpt.SaveError, match=r"^max_staging_bytes must be positive, not 0$"):
        unickpt.async_save(state, str(tmp_path / "c"), max_staging_bytes=0)
    with pytest.raises(unickpt.SaveError, match=r"^SaveOptions\.max_staging_bytes must be positive, not 0$"):
        unickpt.async_save(state, str(tmp_path / "c"), options=SaveOptions(max_staging_bytes=0))
    assert not (tmp_path / "c").exists()


def test_a_group_remembers_nothing_of_how_it_was_spelled():
    """The same values make the same group, whichever way they were written; building
    it from the flat keywords leaves nothing on it (the spelling stays at the entry point)."""
    from unickpt.engine.save_options import Spelling

    given = SaveSchedule.merged(None, {"every": 3, "mode": "async"})
    assert given.group == SaveSchedule(every=3, mode="async") and vars(given.group) == vars(SaveSchedule(every=3, mode="async"))
    assert given.spelling == Spelling(SaveSchedule, flat=True) and given.said("mode", "async") == "async_save=True"
    assert SaveSchedule.merged(SaveSchedule(every=3), {"every": 0}).said("mode", "async") == "SaveSchedule.mode='async'"


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


def test_load_threads_default_to_this_rank_s_share_of_the_cpus(tmp_path, monkeypatch):
    """``threads=None`` (the default): the CPUs this process may use, divided among the
    node's ranks, within 4..16 (a warm load into an H200 doubled with 16 threads on its
    16 cores); anything else than a whole number >= 1 is named."""
    import os

    from unickpt.engine.load import MAX_THREADS, MIN_THREADS, LoadOptions, default_threads

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_threads() == max(MIN_THREADS, min(MAX_THREADS, cpus)) == LoadOptions().threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus * 2))
    assert default_threads() == MIN_THREADS
    assert LoadOptions(threads=3).threads == 3
    unickpt.save({"w": torch.arange(10)}, str(tmp_path / "c"))
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(unickpt.UnickptError, match="threads must be a whole number"):
            unickpt.load({"w": torch.zeros(10, dtype=torch.int64)}, str(tmp_path / "c"), threads=bad)
