"""A keeper's reset (a recovery resumed from an older step: the newer snapshots belong to an
abandoned timeline) against its poll for committed steps, in this process: a poll that ran
while the reset was deleting the abandoned steps took them for seen again, and the new
timeline's steps up to the newest abandoned one were never sent to their parity's holders
(never whole: no memory protection, and a planned stop waited out its 2 s)."""

from __future__ import annotations

import os
import threading

import pytest

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


def test_a_keeper_whose_root_is_being_deleted_leaves_it_without_writing_into_it(tmp_path, monkeypatch):
    """The keeper's check that the shm root is still its own, against the root's deletion
    racing it: a pid file deleted between its look and its read, or its directory gone
    before a garbled one is written again, is a root no longer this keeper's (False), never
    an exception out of the keeper's loop (it exited with 1) nor a pid file written back
    into a directory being deleted. A garbled pid file in a root that stays is written again."""
    keeper = keeper_server.Keeper(str(tmp_path / "shm"), "job", "127.0.0.1")
    pid_file = paths.pid_file(keeper.root)
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    with open(pid_file, "w") as f:  # as the keeper's start writes it
        f.write(f"{os.getpid()}\n")
    assert keeper.owns_root()
    real_read = paths.read_regular

    def deleted_meanwhile(path, *a, **k):
        os.unlink(pid_file)
        return real_read(path, *a, **k)

    monkeypatch.setattr(paths, "read_regular", deleted_meanwhile)
    assert not keeper.owns_root() and not os.path.exists(pid_file)

    with open(pid_file, "w") as f:
        f.write("not a pid")

    def garbled_then_gone(path, *a, **k):
        data = real_read(path, *a, **k)
        for name in os.listdir(os.path.dirname(pid_file)):
            os.unlink(os.path.join(os.path.dirname(pid_file), name))
        os.rmdir(os.path.dirname(pid_file))
        return data

    monkeypatch.setattr(paths, "read_regular", garbled_then_gone)
    assert not keeper.owns_root() and not os.path.exists(os.path.dirname(pid_file))

    monkeypatch.setattr(paths, "read_regular", real_read)
    os.makedirs(os.path.dirname(pid_file))
    with open(pid_file, "w") as f:
        f.write("not a pid")
    assert keeper.owns_root() and open(pid_file).read() == f"{os.getpid()}\n"


@pytest.mark.multiprocess
def test_the_keeper_a_rank_watches_is_seen_ending_with_more_than_1024_files_open(tmp_path):
    """A snapshot asks every step whether the node's keeper still runs: through a pidfd
    (KeeperSeen), so the address file and /proc are read again only once it ended. A
    training process may hold more than 1,024 files (select() refuses such a descriptor):
    the watch still sees the keeper alive, then its SIGKILL."""
    import resource
    import signal
    import time

    from unickpt.snapshot import keeper_admin

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [open(os.devnull) for _ in range(1100)]
    root = str(tmp_path / "shm")
    seen = None
    try:
        doc = keeper_admin.ensure_keeper(root, "job")
        seen = keeper_admin.KeeperSeen(int(doc["pid"]))
        assert seen.fd is not None and seen.fd > 1024 and seen.running()
        os.kill(int(doc["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while seen.running():
            assert time.monotonic() < deadline, "the keeper's end was not seen"
            time.sleep(0.01)
    finally:
        if seen is not None:
            seen.close()
        for f in held:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        keeper_admin.stop_keeper(root)


def test_a_committed_step_wakes_the_keeper_at_once_and_so_does_stop(tmp_path, monkeypatch):
    """The rank that writes a step's manifest into its node's directory wakes the node's
    keeper (keeper_admin.wake_keeper): the step is taken up at once, not at the keeper's next
    look. Its looks every 20 ms let two steps of 10 ms commit unseen, and the next
    snapshot was skipped (bench.snapshot_step: 82 of 200). Here the look is every 30 s: a
    step is only taken up in time when the wake-up arrives, and a stop likewise."""
    import time

    from unickpt.snapshot import keeper_admin

    monkeypatch.setattr(keeper_server, "POLL_S", 30.0)
    keeper = keeper_server.Keeper(str(tmp_path / "shm"), "job", "127.0.0.1")
    looked, processed = threading.Event(), threading.Event()
    poll = keeper.poll

    def first_look() -> None:  # the wake-up socket is bound before the first look
        poll()
        looked.set()

    monkeypatch.setattr(keeper, "poll", first_look)
    monkeypatch.setattr(keeper, "process", lambda step, sdir: processed.set())
    watch = threading.Thread(target=keeper.run)
    watch.start()
    try:
        assert looked.wait(10)
        _commit(keeper, 1)
        t0 = time.monotonic()
        keeper_admin.wake_keeper(os.getpid())
        assert processed.wait(10) and time.monotonic() - t0 < 5, "the committed step waited for the next look"
        keeper.stopping.set()
        t0 = time.monotonic()
        keeper_admin.wake_keeper(os.getpid())
        watch.join(10)
        assert not watch.is_alive() and time.monotonic() - t0 < 5, "the stop waited for the next look"
    finally:
        keeper.stopping.set()
        keeper_admin.wake_keeper(os.getpid())
        watch.join(40)
