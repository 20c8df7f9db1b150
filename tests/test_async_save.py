"""async_save: staged at the call, written in the background on its own gloo group.

Multi-rank checks run on real gloo ranks (``run_forked``: forked from the preloaded server);
the rank functions live here (module level, so the ranks can import them). Nothing here asserts on timing.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import unickpt
from unickpt.engine.background_save import staging_bytes

from forked import run_forked


# --------------------------------------------------------------------------- rank functions


def _state(rank: int, world: int, rows: int = 37) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "w": distribute_tensor(torch.randn(rows, 8, generator=g), mesh, [Shard(0)]),  # uneven shards
            "b": torch.randn(5, generator=g).to(torch.bfloat16),  # plain: replicated on every rank
        },
        "opt": {"m": distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Shard(1)])},
        "rng": unickpt.PerRank(torch.full((3,), float(rank))),
        "step": 0,
    }


def _snapshot(sd: dict) -> dict:
    return {
        "w": sd["model"]["w"].to_local().clone(), "b": sd["model"]["b"].clone(),
        "m": sd["opt"]["m"].to_local().clone(), "rng": sd["rng"].value.clone(), "step": sd["step"],
    }


def _mutate(sd: dict) -> None:
    """What an optimizer step does: change every saved tensor in place."""
    sd["model"]["w"].to_local().add_(1)
    sd["model"]["b"].add_(1)
    sd["opt"]["m"].to_local().mul_(2)
    sd["rng"].value.add_(1)
    sd["step"] += 1


def _train_until_done(handle, min_iters: int = 20) -> int:
    """Training collectives on the default group while the save runs in the background."""
    x = torch.ones(1024)
    n = 0
    while True:
        dist.all_reduce(x)
        x.div_(dist.get_world_size())
        n += 1
        # every rank must issue the same number of collectives: decide together
        finished = torch.tensor([1 if handle.done() else 0])
        dist.all_reduce(finished, op=dist.ReduceOp.MIN)
        if n >= min_iters and finished.item() == 1:
            return n


def _check(rank: int, world: int, path: str, want: dict) -> None:
    sd = _state(rank, world)
    for t in (sd["model"]["w"].to_local(), sd["model"]["b"], sd["opt"]["m"].to_local(), sd["rng"].value):
        t.zero_()
    unickpt.load(sd, path)
    got = _snapshot(sd)
    for k in want:
        same = torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
        assert same, f"rank {rank}: {k} differs from the state at the time of the call"


def concurrent_saves(rank: int, world: int, root: str) -> None:
    sd = _state(rank, world)
    for i, kw in enumerate([{}, {"lazy": True}, {"max_staging_bytes": 1}, {}]):
        path = os.path.join(root, f"s{i}")
        want = _snapshot(sd)
        handle = unickpt.async_save(sd, path, block_bytes=64, **kw)
        if kw.get("lazy"):
            dist.all_reduce(torch.ones(8))  # "forward/backward" while the copy runs
            handle.wait_staged()
        _mutate(sd)  # the state moves on right after the call
        _train_until_done(handle)
        handle.result(timeout=120)
        _check(rank, world, path, want)
    # a second save started while one runs waits for it; both commit
    first = unickpt.async_save(sd, os.path.join(root, "q1"))
    second = unickpt.async_save(sd, os.path.join(root, "q2"))
    assert first.done()
    second.result(timeout=120)
    dist.barrier()
    for q in ("q1", "q2"):
        _check(rank, world, os.path.join(root, q), _snapshot(sd))


def failing_save(rank: int, world: int, root: str) -> None:
    import resource
    import signal

    sd = _state(rank, world)
    bad = os.path.join(root, "bad")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # rank 1 cannot write its data file: the kernel refuses files over 256 KiB (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, limits[1]))
    dist.barrier()
    handle = unickpt.async_save(dict(sd, big=unickpt.PerRank(torch.zeros(1 << 18))), bad)
    _train_until_done(handle)
    with pytest.raises(unickpt.SaveError) as info:
        handle.result(timeout=120)
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    text = str(info.value)
    assert "rank 1" in text and "rank_00001.safetensors" in text, text
    assert not os.path.exists(os.path.join(bad, "manifest.json"))
    # a replicated tensor that differs between ranks is caught as in save(), through result()
    original = sd["model"]["b"].clone()
    if rank == 1:
        sd["model"]["b"][0] += 1
    handle = unickpt.async_save(sd, os.path.join(root, "differs"))
    with pytest.raises(unickpt.InconsistentStateError, match="model.b"):
        handle.result(timeout=120)
    sd["model"]["b"].copy_(original)
    # the checkpoint group still works after a failure
    good = os.path.join(root, "good")
    unickpt.async_save(sd, good).result(timeout=120)
    _check(rank, world, good, _snapshot(sd))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bounded_memory(rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shard_bytes = 8 << 20
    sd = {f"t{k}": distribute_tensor(torch.zeros(world * shard_bytes // 16), mesh, [Shard(0)]) for k in range(4)}
    rss = []
    for i in range(20):
        path = os.path.join(root, f"m{i}")
        unickpt.async_save(sd, path).result(timeout=120)
        if rank == 0 and i >= 2:
            import shutil

            shutil.rmtree(os.path.join(root, f"m{i - 2}"))
        for t in sd.values():
            t.to_local().add_(1)
        rss.append(_rss())
    with open(os.path.join(out, f"rss{rank}.txt"), "w") as f:
        f.write(f"{staging_bytes()} {shard_bytes * 4 // 4} " + " ".join(map(str, rss)))


# --------------------------------------------------------------------------- tests


@pytest.mark.multiprocess
def test_async_save_while_training_collectives_run(tmp_path):
    run_forked(concurrent_saves, 2, str(tmp_path))


@pytest.mark.multiprocess
def test_failure_reaches_every_rank_with_rank_and_file(tmp_path):
    run_forked(failing_save, 2, str(tmp_path))


@pytest.mark.multiprocess
def test_host_memory_stays_at_one_copy_over_20_saves(tmp_path):
    run_forked(bounded_memory, 2, str(tmp_path / "ckpt"), str(tmp_path))
    for rank in range(2):
        held, shard, *rss = map(int, (tmp_path / f"rss{rank}.txt").read_text().split())
        assert shard <= held <= shard + 4096, f"rank {rank}: staging buffer of {held} bytes for a shard of {shard}"
        growth = max(rss[4:]) - rss[4]
        assert growth < shard // 4, f"rank {rank}: RSS grew by {growth} bytes over saves 5..20 ({rss})"


def test_single_process_batches_lazy_and_errors(tmp_path):
    sd = {"a": torch.randn(300, 7), "t": torch.randn(9, 11).t(), "e": torch.zeros(0, 2), "k": 5}
    want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    for i, kw in enumerate([{}, {"max_staging_bytes": 1}, {"max_staging_bytes": 200}, {"lazy": True}]):
        h = unickpt.async_save(sd, str(tmp_path / f"c{i}"), block_bytes=64, **kw)
        h.wait_staged()
        for t in sd.values():
            if isinstance(t, torch.Tensor):
                t.add_(1)
        h.result()
        if kw.get("max_staging_bytes"):
            assert staging_bytes() <= max(kw["max_staging_bytes"], 64 + 64)  # the cap holds
        out = {"a": torch.zeros(300, 7), "t": torch.zeros(11, 9), "e": torch.zeros(0, 2), "k": 0}
        unickpt.load(out, str(tmp_path / f"c{i}"))
        for k, v in want.items():
            assert torch.equal(out[k], v), (kw, k)
        assert out["k"] == 5
        assert unickpt.verify(str(tmp_path / f"c{i}")).ok
        want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(unickpt.SaveError, match="already holds"):
        unickpt.async_save(sd, str(tmp_path / "c0"))
    with pytest.raises(unickpt.SaveError, match="block_bytes"):
        unickpt.async_save(sd, str(tmp_path / "x"), block_bytes=3)
    bad = {"obj": object()}  # not storable: the error comes back through result()
    with pytest.raises(unickpt.UnickptError):
        unickpt.async_save(bad, str(tmp_path / "y")).result()
    assert not (tmp_path / "y" / "manifest.json").exists()



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_is_pinned_and_sees_the_state_at_the_call(tmp_path):
    from unickpt.engine.background_save import _SAVER

    dev = torch.device("cuda")
    sd = {"w": torch.randn(1024, 1024, device=dev), "b": torch.randn(7, device=dev).to(torch.bfloat16)}
    for i, kw in enumerate([{}, {"lazy": True}, {"max_staging_bytes": 1 << 20}]):
        torch.cuda._sleep(10_000_000)  # pending work on the current stream: the copy must wait for it
        sd["w"].add_(1)
        want = {k: v.cpu() for k, v in sd.items()}
        h = unickpt.async_save(sd, str(tmp_path / f"g{i}"), **kw)
        h.wait_staged()
        for v in sd.values():
            v.mul_(3)  # after staging: must not reach the checkpoint
        h.result()
        assert _SAVER.pool.pinned
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        unickpt.load(out, str(tmp_path / f"g{i}"))
        for k in want:
            assert torch.equal(out[k], want[k]), (kw, k)


@pytest.mark.multiprocess
def test_a_script_that_exits_with_a_save_in_flight_commits_it(tmp_path):
    """The save threads are daemons (an abandoned one must not keep a process alive), yet a
    script that returns right after ``async_save`` still commits its checkpoint: the save
    in flight is waited for at exit, as a thread that is not a daemon would be."""
    import subprocess
    import sys

    path = tmp_path / "ck"
    script = (
        "import torch, unickpt\n"
        "state = {f't{i}': torch.full((4 << 20,), float(i)) for i in range(16)}\n"  # 256 MiB
        f"handle = unickpt.async_save(state, {str(path)!r})\n"
        "print('in flight at exit:', not handle.done(), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "in flight at exit: True" in out.stdout, out.stdout  # else the test proves nothing
    loaded = {f"t{i}": torch.empty(4 << 20) for i in range(16)}
    unickpt.load(loaded, str(path))
    assert all(torch.equal(t, torch.full((4 << 20,), float(i))) for i, t in enumerate(loaded.values()))


def test_an_abandoned_save_gives_its_directory_up_for_the_same_step_saved_again(tmp_path):
    """Live recovery abandons a save in flight when a peer dies (its group cut); the
    survivors then save the same step again. The abandoned save kept rank 0's claim (the
    directory's lock, its staging directory) until the process ended: the redo was refused
    ("another save to .../step_00000006 is in progress"), the step never saved, and a kill
    during the last step's save ended the job with its last checkpoint missing. Now the
    claim is given up when the save is abandoned, and the redo commits."""
    from unickpt.engine.background_save import abandon_in_flight, join_abandoned

    path = tmp_path / "step_00000006"
    state = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 128 MiB: still writing when abandoned
    handle = unickpt.async_save(state, str(path))
    deadline = time.monotonic() + 30
    while not any(n.startswith(".step_00000006.unickpt-") for n in os.listdir(tmp_path)):  # rank 0's claim made
        assert time.monotonic() < deadline and not handle.done(), "the save ended before it was abandoned"
        time.sleep(0.001)
    assert abandon_in_flight() == 1
    join_abandoned()
    out = {k: torch.empty_like(v) for k, v in state.items()}
    if (path / "manifest.json").exists():
        # its commit ran before the abandon (its writes ended between the poll above and the
        # call: seen in 1 run in ~10 on a loaded machine): that checkpoint stays, whole, and
        # the step saved again finds it there, as abandon_in_flight says
        unickpt.load(out, str(path))
        assert all(torch.equal(out[k], v) for k, v in state.items())
        with pytest.raises(unickpt.CheckpointExistsError):
            unickpt.save({k: v + 1 for k, v in state.items()}, str(path))
    else:
        unickpt.save({k: v + 1 for k, v in state.items()}, str(path))  # the survivors' save of the step
        unickpt.load(out, str(path))
        assert all(torch.equal(out[k], v + 1) for k, v in state.items())
    assert sorted(os.listdir(tmp_path)) == ["step_00000006"]  # no staging directory left behind
