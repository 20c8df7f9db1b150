"""Rank functions of tests/test_trust.py (importable by spawned ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import unickpt


def _state(rank: int) -> dict:
    return {"w": torch.zeros(6), "mine": unickpt.PerRank(torch.zeros(3)), "step": 0}


def _flip_rank1(rank: int, path: str) -> None:
    """Flip one bit of rank 1's per-rank tensor in the checkpoint at ``path`` (a byte only
    rank 1 reads); collective: no rank reads it meanwhile."""
    dist.barrier()
    if rank == 1:
        frag = unickpt.read_manifest(path).rank_tensors["mine"][1].fragments[0]
        with open(os.path.join(path, frag.file), "r+b") as f:
            f.seek(frag.offset + 2)
            b = f.read(1)
            f.seek(frag.offset + 2)
            f.write(bytes([b[0] ^ 0x04]))
    dist.barrier()


def corrupt_newest_is_passed_over(rank: int, world: int, root: str) -> None:
    """Steps 25 and 30 saved by 2 ranks; one flipped byte in step 30's data that only rank 1
    reads (its per-rank tensor): every rank resumes step 25, and rank 0's line says why."""
    manager = unickpt.CheckpointManager(root, save_every=5)
    state = _state(rank)
    for step in (25, 30):
        state["w"].fill_(step)
        state["mine"].value.fill_(step * 10 + rank)
        state["step"] = step
        manager.maybe_save(state, step)
    manager.close()
    dist.barrier()
    path = os.path.join(root, "step_00000030")
    _flip_rank1(rank, path)
    again = unickpt.CheckpointManager(root, save_every=5)
    got = _state(rank)
    assert again.restore(got) == 25
    assert torch.equal(got["w"], torch.full((6,), 25.0)) and got["step"] == 25
    assert torch.equal(got["mine"].value, torch.full((3,), 250.0 + rank))
    assert again.latest() == os.path.join(root, "step_00000025")  # the one that failed is passed over
    if rank == 0:
        line = again.restored_line
        assert line.startswith(f"resumed step 25 from disk ({os.path.join(root, 'step_00000025')}; passed over {path} "
                               "failed its checks on rank 1 (checksum mismatch in rank_00001.safetensors"), line
    # manager.load() without a path: the same choice
    got = _state(rank)
    assert again.load(got, process_group=None) == os.path.join(root, "step_00000025")
    assert torch.equal(got["mine"].value, torch.full((3,), 250.0 + rank))
    assert again.passed_over and again.passed_over[0].startswith(f"{path} failed its checks on rank 1")
    # the run goes on from step 25: its checkpoint of step 30 replaces the one passed over
    got["w"].fill_(30)
    again.maybe_save(got, 30)
    again.close()
    assert again.stats()["saves"] == 1 and again.stats()["saves_failed"] == 0, again.stats()
    assert unickpt.verify(path).ok and torch.equal(unickpt.load_tensor(path, "w"), torch.full((6,), 30.0))


def leave_snapshots(rank: int, world: int, shm: str, ckpt: str) -> None:
    """A job that ends as a killed one does for its keeper: snapshots taken, the keeper
    left holding them (``close(keep_snapshots=True)``), no relaunch."""
    os.environ["UNICKPT_SHM_ROOT"] = shm
    manager = unickpt.CheckpointManager(ckpt, snapshot_every=1, parity=0)
    state = {"w": torch.ones(1000)}
    manager.restore(state)
    for step in (1, 2):
        manager.before_update()
        manager.maybe_save(state, step)
    manager.close(keep_snapshots=True)


def every_checkpoint_corrupt_is_an_error(rank: int, world: int, root: str) -> None:
    """Both checkpoints fail their checks (on rank 1 only): restore is one error on every
    rank naming both, never a silent fresh start."""
    import pytest

    corrupt_newest_is_passed_over(rank, world, root)
    _flip_rank1(rank, os.path.join(root, "step_00000030"))
    path = os.path.join(root, "step_00000025")
    _flip_rank1(rank, path)
    with pytest.raises(unickpt.CorruptionError, match="step_00000030 failed its checks on rank 1.*step_00000025 failed"):
        unickpt.CheckpointManager(root, save_every=5).restore(_state(rank))
