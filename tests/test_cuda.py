"""unickpt's CUDA paths: loads straight into CUDA tensors, snapshots and async saves of
CUDA state, the DCP plugin's stager, NCCL as the training backend beside unickpt's gloo
groups. They need a GPU: on a CPU machine every one is skipped (``python -m bench.gpu``
runs them where a GPU is lent, ``-m cuda``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _state(dev: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(257, 129, generator=g).to(dev), "b": torch.randn(7, generator=g).to(torch.bfloat16).to(dev),
            "i": torch.arange(11, dtype=torch.int64).to(dev)}


def test_load_straight_into_cuda_tensors_bitwise_and_widened(tmp_path):
    ref = _state("cpu")
    unickpt.save(ref, str(tmp_path / "c"))
    out = {k: torch.empty_like(v, device="cuda") for k, v in ref.items()}
    unickpt.load(out, str(tmp_path / "c"))
    for k in ref:
        assert out[k].is_cuda and torch.equal(out[k].cpu(), ref[k]), k
    wide = {"b": torch.empty(7, dtype=torch.float32, device="cuda")}
    unickpt.load(wide, str(tmp_path / "c"), strict=False)
    assert torch.equal(wide["b"].cpu(), ref["b"].float())
    part = {"w": torch.empty(100, 129, device="cuda")}  # a row slice, as one rank of a resharded load would hold
    from unickpt.plan.box import Box
    from unickpt.plan.piece import box_piece

    sharded = {"w": unickpt.Sharded(part["w"], (257, 129), [box_piece((100, 129), Box((0, 0), (100, 129)),
                                                                       Box((50, 0), (100, 129)))])}
    unickpt.load(sharded, str(tmp_path / "c"), strict=False)
    assert torch.equal(part["w"].cpu(), ref["w"][50:150])


def test_async_save_of_cuda_state_lazy_and_batched_sees_the_call(tmp_path):
    sd = _state("cuda")
    for i, kw in enumerate([{}, {"lazy": True}, {"max_staging_bytes": 64 << 10}]):
        torch.cuda._sleep(20_000_000)  # pending work on the stream: the copy must wait for it
        sd["w"].add_(1)
        want = {k: v.cpu() for k, v in sd.items()}
        h = unickpt.async_save(sd, str(tmp_path / f"s{i}"), **kw)
        h.wait_staged()
        for v in sd.values():
            v.mul_(3)
        h.result()
        got = {k: torch.empty_like(v) for k, v in want.items()}
        unickpt.load(got, str(tmp_path / f"s{i}"))
        for k in want:
            assert torch.equal(got[k], want[k]), (kw, k)


def _snapshot_loop(rank: int, world: int, root: str, out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    mgr = unickpt.CheckpointManager(root, snapshot_every=1, parity=0)
    assert mgr.restore(state) == 0
    want, moments = {}, {}
    for step in range(1, 4):
        model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        mgr.before_update()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(state, step)
        want[step] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        moments[step] = {k: v.cpu() for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
    mgr._snap.settle()
    slots = list(mgr._snap.ring.slots.values())  # the ring made at restore: the pinned staging buffers themselves
    assert slots and all(s.pinned and s.buf.is_pinned() for s in slots), [(s.path, s.pinned) for s in slots]
    mgr.close(keep_snapshots=True)
    model2 = torch.nn.Linear(64, 64).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    state2 = {"model": model2, "optim": opt2}
    mgr2 = unickpt.CheckpointManager(root, snapshot_every=1, parity=0)
    step = mgr2.restore(state2)  # the newest snapshot taken: a fast GPU loop outruns the keeper, which skips some
    assert step >= 2 and "from memory" in (mgr2.restored_line or ""), mgr2.restored_line
    for k, v in model2.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), want[step][k]), k
    for k, v in opt2.state[model2.weight].items():
        if torch.is_tensor(v):
            assert torch.equal(v.cpu(), moments[step][k]), k
    mgr2.close()
    open(out, "w").write("ok")


@pytest.fixture
def shm_root(monkeypatch):
    """$UNICKPT_SHM_ROOT in a folder of its own on /dev/shm, the default (a tmpfs: CUDA
    page-locks its files; a test's tmp_path may be on a disk, whose pages it cannot)."""
    root = tempfile.mkdtemp(prefix="unickpt-test-", dir="/dev/shm")
    monkeypatch.setenv("UNICKPT_SHM_ROOT", root)
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def test_snapshot_of_cuda_state_restores_from_memory_bitwise(tmp_path, shm_root):
    run_ranks(_snapshot_loop, 1, str(tmp_path / "ckpt"), str(tmp_path / "ok"))
    assert (tmp_path / "ok").read_text() == "ok"
    assert not any(shm_root.glob("*/step_*"))


def test_a_ring_cuda_cannot_page_lock_is_used_pageable_and_said_once(tmp_path, caplog):
    """A shm root on a disk's file system (not a tmpfs): Linux lends CUDA no long-term pin
    of its pages, so ``cudaHostRegister`` fails. The slot is used pageable, the reason kept
    and said once, and CUDA's next launch check does not take the failure for its own."""
    from bench.snapshot import mount_of
    from unickpt.engine.ring import MappedRing, _map

    mount = mount_of(str(tmp_path))
    if mount.split()[0] in ("tmpfs", "ramfs", "hugetlbfs"):
        pytest.skip(f"{tmp_path} is on {mount}: no disk folder to try")
    ring = MappedRing(str(tmp_path / "ring"), 0, 2)
    with caplog.at_level("WARNING", logger="unickpt"):
        ring.prepare(1 << 20, pin=True)  # both slots, in the background
        first = ring.acquire(1 << 20, pin=True)
        ring._settle()  # (waits for the preparing thread)
        slots = list(ring.slots.values())
    assert len(slots) == 2 and first in slots
    assert all(not s.pinned and s.pin_error for s in slots), [(s.pinned, s.pin_error) for s in slots]
    said = [r.getMessage() for r in caplog.records if "cannot page-lock" in r.getMessage()]
    assert len(said) == 1 and "UNICKPT_SHM_ROOT" in said[0], said
    failed = _map(str(tmp_path / "ring" / "here"), 1 << 20, pin=True)  # in this thread: its error cleared
    assert not failed.pinned and failed.pin_error
    x = torch.arange(1 << 20, device="cuda", dtype=torch.uint8)  # (before, the stale error was raised here)
    slots[0].buf.copy_(x)
    torch.cuda.synchronize()
    assert torch.equal(slots[0].buf, x.cpu())
    failed.close()
    ring.close()


def _dcp_plugin(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from unickpt.dcp import StorageReader, StorageWriter

    sd = _state("cuda")
    want = {k: v.cpu() for k, v in sd.items()}
    writer = StorageWriter(path)
    fut = dcp.async_save(sd, storage_writer=writer)
    for v in sd.values():
        v.mul_(5)  # after the call: DCP's staging (unickpt's stager) already holds the values
    getattr(fut, "upload_completion", fut).result()
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=StorageReader(path))
    for k in want:
        assert got[k].is_cuda and torch.equal(got[k].cpu(), want[k]), k


def test_dcp_plugin_stages_cuda_state_and_loads_into_cuda(tmp_path):
    run_ranks(_dcp_plugin, 1, str(tmp_path / "d"))


NCCL_JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import unickpt
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    root = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    mgr = unickpt.CheckpointManager(root, save_every=2, async_save=True, snapshot_every=1, parity=0)
    start = mgr.restore(state)
    for step in range(start + 1, 5):
        model(torch.randn(4, 32, device="cuda")).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # on NCCL, while unickpt's own traffic is on its gloo groups
        mgr.before_update()
        opt.step(); opt.zero_grad()
        mgr.maybe_save(state, step)
    mgr.close()
    ref = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    unickpt.load({"model": out}, mgr.path_for(4), strict=False)
    assert all(torch.equal(out[k].cpu(), ref[k]) for k in ref), "the step-4 checkpoint differs from the model"
    dist.destroy_process_group()
    print("NCCL-OK")
""")


def test_nccl_training_backend_beside_unickpt_gloo_groups(tmp_path):
    from unickpt.testing import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), UNICKPT_SHM_ROOT=str(tmp_path / "shm"),
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-c", NCCL_JOB, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0 and "NCCL-OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]


def test_reads_for_cuda_targets_go_through_pinned_scratch(tmp_path):
    from unickpt.engine.tensor_reads import TensorReads
    from unickpt.plan.piece import whole_piece
    from unickpt.adapters.checkpoint import open_checkpoint

    ref = {"w": torch.randn(300, 200), "b": torch.randn(5000).to(torch.bfloat16)}
    unickpt.save(ref, str(tmp_path / "c"))
    ckpt = open_checkpoint(str(tmp_path / "c"))
    out = {k: torch.empty_like(v, device="cuda") for k, v in ref.items()}
    reads = TensorReads(ckpt.storage)
    for k, t in out.items():
        reads.add(ckpt.manifest.tensors[k], t, [whole_piece(t.shape)])
    reads.run()
    assert reads.scratch.pin
    for k in ref:
        assert torch.equal(out[k].cpu(), ref[k]), k


REFORM_JOB = textwrap.dedent("""
    import gc, os, sys
    import torch, torch.distributed as dist
    from unickpt.live import control, membership, regroup
    from unickpt.store_client import connect

    torch.cuda.set_device(0)
    host = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store, worker, after = connect(f"127.0.0.1:{host.port}"), "0.0", []
    for number in range(5):  # a generation: its group, a model, a step; then torn down as after a failure
        # published on the connection that reads it (a TCPStore's set is not answered: a read
        # on another connection could pass it)
        control.publish(store, control.Generation(number, [worker], cause="start" if number == 0 else "lost"))
        gen = membership.newer(store, worker)
        membership.arrive(store, gen)
        regroup.form(store, gen.number, 0, 1, "cpu:gloo,cuda:nccl")
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        del model, opt, x
        regroup.teardown(crashed=True)
        gc.collect()
        after.append(torch.cuda.memory_allocated())
    print("ALLOCATED", after)
    spread = max(after[1:]) - min(after[1:])
    assert spread <= 1 << 20, after  # flat after each re-forming: nothing of a generation kept on the GPU
    print("REFORM-OK")
""")


def test_cuda_memory_stays_flat_across_re_formings():
    """Torch's users report in-process restarts that leak GPU memory into an OOM loop
    (Megatron-LM#2774): five generations (an NCCL group, a model, an optimizer step),
    each torn down as after a failure; ``torch.cuda.memory_allocated()`` after each is flat."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-c", REFORM_JOB], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "REFORM-OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
