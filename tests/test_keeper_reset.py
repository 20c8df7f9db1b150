"""A keeper's reset (a recovery resumed from an older step: the newer snapshots belong to an
abandoned timeline) against its poll for committed steps, in this process: a poll that ran
while the reset was deleting the abandoned steps took them for seen again, and the new
timeline's steps up to the newest abandoned one were never sent to their parity's holders
(never whole: no memory protection, and a planned stop waited out its 2 s)."""

from __future__ import annotations

import os
import threading

from unickpt.snapshot import keeper_server, paths


def _commit(keeper: keeper_server.Keeper, step: int) -> None:
    sdir = paths.step_dir(keeper.root, keeper.job, step)
    os.makedirs(sdir, exist_ok=True)
    with open(os.path.join(sdir, "manifest.json"), "w") as f:
        f.write("{}")


def test_a_poll_during_a_reset_leaves_the_new_timelines_steps_to_be_processed(tmp_path, monkeypatch):
    keeper = keeper_server.Keeper(str(tmp_path / "shm"), "job", "127.0.0.1")
    processed: list[int] = []
    monkeypatch.setattr(keeper, "process", lambda step, sdir: processed.append(step))
    for step in (5, 6, 7):  # the abandoned timeline, still in the shm root at the relaunch
        _commit(keeper, step)
    keeper.poll()
    assert processed == [7]

    deleting, go_on = threading.Event(), threading.Event()
    remove_tree = paths.remove_tree

    def slow_remove(path: str) -> None:  # the reset pauses once it has forgotten what it saw
        deleting.set()
        assert go_on.wait(10)
        remove_tree(path)

    monkeypatch.setattr(keeper_server.paths, "remove_tree", slow_remove)
    reset = threading.Thread(target=keeper.reset, args=(4,))
    reset.start()
    assert deleting.wait(10)
    poll = threading.Thread(target=keeper.poll)  # the keeper's next poll, while the reset deletes
    poll.start()
    poll.join(0.3)
    go_on.set()
    reset.join(10)
    poll.join(10)
    monkeypatch.setattr(keeper_server.paths, "remove_tree", remove_tree)
    assert paths.steps(keeper.jdir) == []

    for step in (5, 6):  # the new timeline commits its steps again
        _commit(keeper, step)
        keeper.poll()
    assert processed == [7, 5, 6]
