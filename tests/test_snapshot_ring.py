"""The snapshot ring (engine/ring.py, docs/SNAPSHOT.md "The ring"): a rank's snapshots are
written into a few mapped shm files reused from step to step; a slot held by a step is
never written; a trainer SIGKILLed while it writes the next snapshot leaves the newest
whole one intact (restored bitwise); the memory the ring and parity take is stated up
front (``unickpt snapshots``) and a cap the node cannot give is an error when the
manager is made."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import unickpt
from unickpt.engine.ring import MappedRing, slot_name
from unickpt.engine.ring_write import whole_crc
from unickpt.errors import SnapshotError
from unickpt.snapshot.keeper_admin import stop_keeper
from unickpt.testing import run_ranks
from unickpt.units import human_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ring_kill_script import state_of  # noqa: E402


def test_a_slot_held_by_a_step_is_never_handed_out(tmp_path):
    """Real files: a slot linked into a step directory is not free until the step is
    deleted; with every slot held the ring says so and refuses; sizes change by remaking."""
    ring = MappedRing(str(tmp_path / "ring"), 3, 2)
    a = ring.acquire(4096, False)
    a.buf.fill_(7)
    os.makedirs(tmp_path / "step_1")
    os.link(a.path, tmp_path / "step_1" / "rank_00003.safetensors")  # the step holds slot a
    b = ring.acquire(4096, False)
    assert b.path != a.path and os.path.basename(b.path) == slot_name(3, 1)
    os.makedirs(tmp_path / "step_2")
    os.link(b.path, tmp_path / "step_2" / "rank_00003.safetensors")
    assert not ring.available()
    with pytest.raises(SnapshotError, match="all 2 slots of the snapshot ring of rank 3 are held"):
        ring.acquire(4096, False)
    assert (tmp_path / "step_1" / "rank_00003.safetensors").read_bytes() == b"\x07" * 4096
    os.unlink(tmp_path / "step_1" / "rank_00003.safetensors")  # the keeper deleted step 1
    again = ring.acquire(4096, False)
    assert again is a and again.buf.data_ptr() == a.buf.data_ptr()  # the same mapping, no new pages
    os.unlink(tmp_path / "step_2" / "rank_00003.safetensors")
    bigger = ring.acquire(8192, False)  # a state of another size: a free slot is remade at it
    assert bigger.size == 8192 and os.path.getsize(bigger.path) == 8192
    ring.close()
    with pytest.raises(SnapshotError, match="at least 2 slots"):
        MappedRing(str(tmp_path / "r2"), 0, 1)


def test_whole_crc_combines_block_checksums():
    import crc32c

    data = os.urandom(3 * 65536 + 123)
    blocks = [crc32c.crc32c(data[i : i + 65536]) for i in range(0, len(data), 65536)]
    assert whole_crc(blocks, len(data), 65536) == crc32c.crc32c(data)
    assert whole_crc(blocks[:1], 65536, 65536) == crc32c.crc32c(data[:65536])


def test_a_cap_the_node_cannot_give_fails_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("UNICKPT_SHM_ROOT", str(tmp_path / "shm"))
    with pytest.raises(SnapshotError, match=r"^snapshot_max_bytes=1152921504606846976 \(1048576\.0 TiB\) is more host memory than "
                       r"this node can give the snapshots: .* free in the shm root .*shm, .* available \(MemAvailable\); "
                       r"lower snapshot_max_bytes, or free memory"):
        unickpt.CheckpointManager(str(tmp_path / "ck"), snapshot_every=1, snapshot_max_bytes=1 << 60)
    with pytest.raises(SnapshotError, match=r"^SnapshotOptions\.max_bytes=1152921504606846976 .*lower SnapshotOptions\.max_bytes"):
        unickpt.CheckpointManager(str(tmp_path / "ck"), snapshot=unickpt.SnapshotOptions(every=1, max_bytes=1 << 60))
    unickpt.CheckpointManager(str(tmp_path / "ck"), snapshot_every=1, snapshot_max_bytes=1 << 20)  # what it can give


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The trainer of ring_kill_script.py, SIGKILLed while it writes step 4 (once per module)."""
    base = tmp_path_factory.mktemp("ring")
    shm, ckpt, report = str(base / "shm"), str(base / "ckpt"), str(base / "report.json")
    env = dict(os.environ, UNICKPT_SHM_ROOT=shm, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "ring_kill_script.py"), "--ckpt", ckpt, "--report", report],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == -9, proc.stdout + proc.stderr
        yield shm, ckpt, json.load(open(report))
    finally:
        stop_keeper(shm)


@pytest.mark.multiprocess
def test_slots_are_reused_across_steps(killed):
    """Steps 1-3 were written into at most 3 files that stayed mapped: a step reuses the
    inode (and the mapping) of a step the keeper deleted."""
    _, _, report = killed
    inodes = report["steps"]
    assert set(inodes.values()) <= set(report["slots"].values())
    assert inodes["3"] == inodes["1"]  # step 1 deleted once step 2 was whole: its slot took step 3
    assert inodes["2"] != inodes["1"]
    first = report["maps"][0]
    assert all(m[k] == first[k] for m in report["maps"] for k in first)  # no slot mapped twice


def _relaunch(rank: int, world: int, ckpt: str, shm: str, out: str) -> None:
    os.environ["UNICKPT_SHM_ROOT"] = shm
    state = state_of(0)
    mgr = unickpt.CheckpointManager(ckpt, snapshot_every=1, parity=0)
    step = mgr.restore(state)
    want = state_of(3)
    same = all(torch.equal(state[k], want[k]) for k in want)
    before = sorted(os.listdir(os.path.join(mgr._snap.jdir, "ring")))
    for s in (4, 5, 6):
        for k, v in state_of(s).items():
            state[k].copy_(v)
        mgr.maybe_save(state, s)
        mgr.before_update()
    mgr._snap.settle()
    after = sorted(os.listdir(os.path.join(mgr._snap.jdir, "ring")))
    cli = subprocess.run([sys.executable, "-m", "unickpt", "snapshots", shm], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    with open(out, "w") as f:
        json.dump({"step": step, "line": mgr.restored_line, "same": same, "before": before, "after": after,
                   "memory": mgr._snap.memory, "cli": cli.stdout + cli.stderr}, f)
    mgr.close()


@pytest.mark.multiprocess
def test_killed_mid_snapshot_restores_the_newest_whole_step_bitwise(killed, tmp_path):
    """The trainer died while writing step 4 into a free slot: the relaunch resumes step 3
    from memory, bitwise; its snapshots go on in the same slot files; ``unickpt snapshots``
    states the ring's and the parity's memory; a clean close leaves nothing."""
    shm, ckpt, report = killed
    out = str(tmp_path / "out.json")
    run_ranks(_relaunch, 1, ckpt, shm, out, timeout=300)
    got = json.load(open(out))
    assert got["step"] == 3 and got["line"].startswith("resumed step 3 from memory"), got["line"]
    assert got["same"]
    assert report["killed_while_copying"]  # the kill landed while step 4 was copied into its slot
    assert got["before"] == got["after"] == [slot_name(0, i) for i in range(3)], got  # adopted, none made
    mem = got["memory"]
    state_bytes = sum(v.numel() * v.element_size() for v in state_of(0).values())
    assert mem["state"] == state_bytes and mem["ring"] == 3 * state_bytes and mem["parity"] == 0
    assert f"node 0 holds at most {human_bytes(mem['total'])} of tensors: ring 3 x " in got["cli"], got["cli"]
    assert not os.path.exists(os.path.join(shm, "unickpt"))
