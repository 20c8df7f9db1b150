"""A re-forming leaves nothing of the old generation behind (unickpt.live.regroup): after
the tear-down no process group of the old generation is alive, whatever made it (the
default group, a DeviceMesh's, FSDP2's, unickpt's async-save channel, its replica groups,
a cache someone adds later). Two forked ranks with real gloo groups; three generations
in one process, as live recovery runs them."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from forked import run_forked

pytestmark = pytest.mark.multiprocess


def _generation(rank: int, world: int, tmp: str, number: int) -> list[weakref.ref]:
    """What a generation of a training loop makes; returns a weak reference to every
    process group alive at its end (the loop's objects gone, as ``fn``'s frames are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import unickpt

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    manager = unickpt.CheckpointManager(os.path.join(tmp, "ck"), save_every=1, async_save=True)
    start = manager.restore(state)
    assert start == number, (start, number)  # each generation resumes from the one before
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    manager.maybe_save(state, start + 1)  # an async save on unickpt's checkpoint channel
    manager.wait()
    replica = {"w": torch.zeros(64)}  # the same on every rank: read once, broadcast (unickpt's replica groups)
    alone = dist.new_group([0])  # made by every rank (collective), used by rank 0 alone
    if rank == 0:
        unickpt.save({"w": torch.arange(64.0)}, os.path.join(tmp, f"rep{number}"), process_group=alone)
    dist.barrier()
    unickpt.load(replica, os.path.join(tmp, f"rep{number}"), broadcast_replicated=True, strict=False)
    assert torch.equal(replica["w"], torch.arange(64.0))
    user_group = dist.new_group([0, 1])  # a user's own group
    dist.all_reduce(torch.ones(1), group=user_group)
    manager.close()
    return [weakref.ref(pg) for pg in list(dist.distributed_c10d._world.pg_map)]


def _holders(refs: list[weakref.ref]) -> dict[str, list[str]]:
    """What still holds each group (the garbage collector's view: C++ holders are not seen)."""
    out = {}
    for ref in refs:
        pg = ref()
        if pg is not None:
            out[f"{pg.group_name} (size {pg.size()})"] = [type(x).__name__ + ": " + repr(x)[:160]
                                                      for x in gc.get_referrers(pg) if x is not refs]
        del pg
    return out


def _three_generations(rank: int, world: int, tmp: str) -> None:
    from unickpt.dist import track_group_sockets
    from unickpt.live import regroup

    track_group_sockets()
    regroup.import_before_forming()  # as unickpt.run does, whatever the fork server preloaded
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()  # the generations form their own, each on a fresh prefix
    for number in range(3):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{number}/", store), rank=rank, world_size=world)
        old = _generation(rank, world, tmp, number)
        assert len(old) >= 3, len(old)  # the default group (the 1-D mesh uses it), the checkpoint channel, the user's
        regroup.teardown(crashed=number < 2)  # two re-formings after a failure, then fn's return
        deadline = time.monotonic() + 5  # a save thread of the old generation ends once its group is cut
        while any(r() is not None for r in old) and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        alive = [r for r in old if r() is not None]
        assert not alive, f"generation {number}: old process group(s) still alive: {_holders(alive)}"
        assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.PrefixStore("end/", store), rank=rank, world_size=world)  # run_ranks' own end


def test_a_re_forming_leaves_no_process_group_of_the_old_generation_alive(tmp_path):
    run_forked(_three_generations, 2, str(tmp_path), timeout=120)


def _abandoned_save(rank: int, world: int, tmp: str) -> None:
    import unickpt
    from unickpt.dist import resolve_group, track_group_sockets
    from unickpt.engine.background_save import checkpoint_group
    from unickpt.live import regroup

    track_group_sockets()
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=rank, world_size=world)
    checkpoint_group(resolve_group())  # made by both ranks (collective)
    dist.barrier()
    # both ranks save; then rank 1 stops answering, its connections open (SIGSTOP; rank 0
    # continues it): rank 0's save thread waits in a collective for it
    handle = unickpt.async_save({"w": torch.arange(1024.0)}, os.path.join(tmp, "ck"))
    if rank == 1:
        store.set("stopped", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(0.5)
        if handle.done():
            os.kill(int(store.get("stopped")), signal.SIGCONT)
        assert not handle.done(), handle.exception(0)
    t0 = time.monotonic()
    try:
        regroup.teardown(crashed=True)
    finally:
        if rank == 0:
            os.kill(int(store.get("stopped")), signal.SIGCONT)
    took = time.monotonic() - t0
    if rank == 0:
        # the tear-down returned only once the abandoned save's thread had ended: no thread is
        # left to start a collective on a group the tear-down shut down (that one would wait
        # forever, and the process would never exit)
        assert handle.done() and took < 5, took
        assert handle.exception(0) is not None
        assert not any(t.name == "unickpt-async-save" and t.is_alive() for t in __import__("threading").enumerate())
    # rank 1, continued after its peer gave up, tears down too; its save thread may stay
    # blocked in gloo (1 run in ~10 here: a send in flight when the peer's connection closed,
    # never failed until the group's 30-min timeout). The thread is a daemon: the process
    # still exits (before, this test hung in 1 run in ~10)
    dist.init_process_group("gloo", store=dist.PrefixStore("end/", store), rank=rank, world_size=world)


def test_a_save_abandoned_at_a_re_forming_ends_before_its_groups_are_destroyed(tmp_path):
    run_forked(_abandoned_save, 2, str(tmp_path), timeout=120)


def test_no_collective_starts_on_an_abandoned_group():
    """A group whose ``stop`` is set refuses every collective of unickpt's helpers before
    torch is called (torch's fake backend: the same calls would return)."""
    import threading

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unickpt.dist import Group, GroupAbandoned, all_gather_fixed, broadcast_bytes, gather_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        stop = threading.Event()
        group = Group(dist.group.WORLD, 0, 4, stop=stop)
        assert broadcast_bytes(group, b"abc") == b"abc" and gather_bytes(group, b"x") is not None
        stop.set()
        for call in (lambda: broadcast_bytes(group, b"abc"), lambda: gather_bytes(group, b"x"),
                     lambda: all_gather_fixed(group, b"\x01")):
            with pytest.raises(GroupAbandoned):
                call()
    finally:
        dist.destroy_process_group()
