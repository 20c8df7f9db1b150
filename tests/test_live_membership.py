"""The members' side of a generation (unickpt.live.membership) on an in-memory store,
ranks as threads: they gather before the group forms, and a newer generation published
while they gather sends them on to it; a worker left out, or a job that ended, stops."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from unickpt.live import control, membership
from unickpt.live.control import Generation


def _gather(store, gen: Generation, workers: list[str]) -> dict[str, bool]:
    """Each worker, in a thread of its own, arrives at ``gen``; what each one's wait said."""
    said: dict[str, bool] = {}

    def one(worker: str) -> None:
        said[worker] = membership.arrive(store, gen)

    threads = [threading.Thread(target=one, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return said


def test_the_members_gather_then_go():
    store = dist.HashStore()
    gen = Generation(0, ["0.0", "0.1", "1.0", "1.1"])
    control.publish(store, gen)
    assert _gather(store, gen, gen.members) == dict.fromkeys(gen.members, True)
    assert membership.newer(store, "1.1") == control.read(store, 0)


def test_a_newer_generation_sends_the_gathering_members_on():
    store = dist.HashStore()
    gen = Generation(0, ["0.0", "0.1", "0.2"])
    control.publish(store, gen)
    membership.say_arrived(store, gen)  # one arrived; then a member was lost before the others came
    control.publish(store, Generation(1, ["0.0", "0.1"], cause="lost", lost=[{"rank": 2, "worker": "0.2", "exit": -9}]))
    assert _gather(store, gen, ["0.0", "0.1"]) == {"0.0": False, "0.1": False}  # the go key is closed
    nxt = membership.newer(store, "0.0")
    assert nxt.number == 1 and _gather(store, nxt, nxt.members) == {"0.0": True, "0.1": True}


def test_left_out_or_ended_stops_the_worker():
    store = dist.HashStore()
    control.publish(store, Generation(0, ["0.0", "0.1"]))
    control.publish(store, Generation(1, ["0.0"], cause="lost"))
    with pytest.raises(SystemExit, match=r"0\.1\) was left out of generation 1"):
        membership.newer(store, "0.1")
    control.publish(store, Generation(2, ["0.0"], cause="end", code=3, reason="the job's last rank finished"))
    with pytest.raises(SystemExit) as ended:
        membership.newer(store, "0.0")
    assert ended.value.code == 3
