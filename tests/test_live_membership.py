"""The members' side of a generation (unickpt.live.membership) on an in-memory store,
ranks as threads: they gather before the group forms, and a newer generation published
while they gather sends them on to it; a worker left out, or a job that ended, stops. And a
worker's first beat to its launcher (on a real TCPStore on localhost), and a member lost
while the group forms (a real ``unickpt.run`` in a process of its own, tests/live_form_case.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

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


def test_events_travel_typed_and_a_bad_one_is_named_not_followed():
    """The launchers' and trainers' reports go through the store as typed events and come
    back equal; what is not one (not JSON, an unknown kind, a field of the wrong type) is a
    ValueError that says what is wrong (the coordinator skips it with that line)."""
    from unickpt.live.control import Exited, Raised, Ready, Stopped, Suspect, key, parse_event, post_event

    store = dist.HashStore()
    sent = [Exited("0.1", -9, 1.5, "SIGKILL"), Ready("1.2.1", 1), Suspect("0.0", 2.0), Stopped(0, 15),
            Raised("0.1", "RuntimeError: user bug", "train.py:3 in fn", False)]
    for ev in sent:
        post_event(store, ev)
    assert [parse_event(store.get(key("event", i))) for i in range(len(sent))] == sent
    for raw, says in ((b"{not json", "not JSON"), (b'{"kind": "vanish", "worker": "0.0"}', "no known kind"),
                      (b'[1, 2]', "no known kind"),
                      (b'{"kind": "exit", "worker": "0.1", "code": "9", "at": 1.0, "why": ""}', "code is '9'"),
                      (b'{"kind": "exit", "worker": "0.1", "code": true, "at": 1.0, "why": ""}', "code is True"),
                      (b'{"kind": "raised", "worker": "0.1", "error": "e", "where": "w"}', "recoverable is None")):
        with pytest.raises(ValueError, match=says):
            parse_event(raw)


def test_a_generation_cause_is_one_of_the_causes():
    """``cause`` is a :class:`Cause` (equal to its string, written as it on the store); an
    unknown one is refused when the generation is made or read."""
    from unickpt.live.control import Cause

    gen = Generation(3, ["0.0"], cause="lost")
    assert gen.cause is Cause.LOST and gen.cause == "lost"
    assert Generation.from_json(gen.to_json().encode()) == gen
    with pytest.raises(ValueError):
        Generation(1, [], cause="vanished")
    with pytest.raises(ValueError):
        Generation.from_json(gen.to_json().replace('"cause": "lost"', '"cause": "vanished"').encode())


def test_replacements_taken_in_at_the_last_step_end_with_the_job():
    """The coordinator's side, on an in-memory store: rank 2 is lost, a replacement gets
    ready and rank 0 fixes the step it joins at, which is the training's last; the
    survivors finish fn instead of re-forming. The job ends 0 at once (the replacement
    used to wait for them until the launcher was killed), counting neither the
    replacement as a rank that ran nor it in the final world size."""
    from unickpt.live.control import Cause, Exited, Ready, key, post_event
    from unickpt.live.launch import Coordinator
    from unickpt.live.launch_args import LaunchArgs
    from unickpt.live.output import Output

    store = dist.HashStore()
    coordinator = Coordinator(store, LaunchArgs(nproc_per_node=3, max_restarts=1), Output())
    coordinator.start()
    coordinator.step()  # generation 0: the three ranks
    for w in ("0.0", "0.1", "0.2"):
        store.set(key("run", w), "1")  # inside unickpt.run: their loss is recovered
    post_event(store, Exited("0.2", -9, 1.0, "SIGKILL"))
    coordinator.step()
    assert control.read(store, control.newest(store)).cause == Cause.LOST
    post_event(store, Ready("0.r1.2", 0))
    coordinator.step()
    store.set(key("g", 1, "grow_at"), "31")  # rank 0, at step 30's boundary
    coordinator.step()
    grown = control.read(store, control.newest(store))
    assert grown.cause == Cause.GROW and grown.joined == ["0.r1.2"]
    membership.say_arrived(store, grown)  # the replacement gathers; the survivors never come
    for w in ("0.0", "0.1"):
        post_event(store, Exited(w, 0, 2.0, "exit 0"))
    coordinator.step()
    end = control.read(store, control.newest(store))
    assert end.cause == Cause.END and end.code == 0, end
    assert "3 ranks ran, 1 lost and recovered (rank 2: SIGKILL), final world size 2 (exit 0)" in end.reason, end.reason
    assert not membership.all_arrived(store, grown)  # the replacement goes on to the end: it exits 0
    with pytest.raises(SystemExit) as ended:
        membership.newer(store, "0.r1.2")
    assert ended.value.code == 0


def test_a_worker_has_beaten_once_start_beats_returns():
    """The launcher's hang check takes a worker for hung only once it has beaten (``alive``
    above 0: before, it may still be importing). The first beat went out ALIVE_S after
    start_beats, so a worker that stopped in that half second (its restore done, before its
    first step: tests/test_live.py) was never killed and its peers waited out their
    collective timeout. Now it has beaten before start_beats returns."""
    from unickpt.live.watcher import Watcher

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    address = f"127.0.0.1:{store.port}"
    watcher = Watcher("0.1", address, address, store, lambda gen: None)
    try:
        watcher.start_beats()
        assert int(store.add(control.key("alive", "0.1"), 0)) >= 1
    finally:
        watcher.stop()


def test_a_member_lost_while_the_group_forms_costs_no_timeout(tmp_path):
    """Generation 0's other member arrived, then died before its group's rendezvous: gloo's
    rendezvous waits for its address. One second later the coordinator publishes generation
    1 without it; the watcher cuts the rendezvous and ``fn`` runs in generation 1 at once.
    Before, the survivor waited out the generation's timeout (60 s here; CI saw a job hang in
    tests/test_live.py) and then died of it."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": str(here.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(here / "live_form_case.py"), "--publish-after", "1.0"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    world = json.loads(done.stdout.strip().splitlines()[-1])
    assert (world["generation"], world["size"], world["rank"]) == (1, 1, 0), world
    assert world["after_s"] < 1.0 + 4, world  # published after 1 s; the rendezvous' timeout is 60 s


def test_a_generation_seen_while_the_group_forms_or_before_fn_is_never_dropped(monkeypatch):
    """The watcher's hand-over outside ``fn`` (a real TCPStore, no group): while a
    generation's group forms, a newer one that loses an active member abandons the
    rendezvous (its store connection shut: a request blocked there fails at once), one that
    loses only a spare does not; a generation seen between the forming and ``fn`` is taken
    as ``fn`` is entered: adopted when it lost only a spare, else ``fn`` is interrupted at
    once. Before, the watcher dropped both (``fn`` ran on in a generation already over)."""
    from unickpt.live import interrupt
    from unickpt.live.control import Cause
    from unickpt.live.regroup import Rendezvous
    from unickpt.live.run import Interrupted, _Live

    monkeypatch.setattr(threading.Thread, "start", threading.Thread.start)  # _Live guards this thread's starts
    monkeypatch.setattr(interrupt, "_guarded", None)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    address = f"127.0.0.1:{store.port}"
    live = _Live(address, "0.0", None, multiple_of=2)  # 3 members: 2 train, 0.2 is a spare
    gen = Generation(1, ["0.0", "0.1", "0.2"], Cause.LOST)
    spare_lost = Generation(2, ["0.0", "0.1"], Cause.LOST, [{"rank": 2, "worker": "0.2", "why": "exit -9"}])
    member_lost = Generation(3, ["0.0", "0.2"], Cause.LOST, [{"rank": 1, "worker": "0.1", "why": "exit -9"}])

    live.forming, live.rendezvous = gen, Rendezvous(address)
    live._on_generation(spare_lost)
    assert not live.rendezvous.abandoned and live.pending is spare_lost
    live.rendezvous.store.set("still", "up")
    live._on_generation(member_lost)
    assert live.rendezvous.abandoned
    with pytest.raises(RuntimeError):  # torch's DistNetworkError: the connection was shut down
        live.rendezvous.store.get("still")

    live.forming, live.rendezvous, live.pending = None, None, None
    live.gen, live.prev_active = gen, gen.active(2)
    live._on_generation(spare_lost)  # between the forming and fn
    with live.interruptible():
        assert live.gen is spare_lost  # adopted: the active world trains on
    live._on_generation(member_lost)
    with pytest.raises(Interrupted):
        with live.interruptible():
            raise AssertionError("fn ran in a generation already over")
    assert not live.in_fn
