"""The in-memory snapshot tier with real processes: torchrun agents as simulated nodes
(each with its own shm root), real SIGKILL, keepers killed, shm roots deleted, bits flipped.

Reference runs are unbroken runs of the example trainer without snapshots: the same
layout must match bitwise, another layout within 1e-4 relative (as in test_resume)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import unickpt
from unickpt.errors import SnapshotError
from unickpt.testing import run_ranks

from snapshot_helpers import (
    TINY, commit_manifest, env_for, flip_bit, keeper_pid, kill_keeper, launch_nodes, lose_node, losses, resumed_lines,
    step_dir, steps_whole, wait_all, wait_for, worker_pids,
)
from train_cases import train


_wait_for = wait_for


def _last_step(log: str) -> int:
    return max(losses(log), default=0) if os.path.exists(log) else 0


def _committed(root: str) -> list[int]:
    """Steps whose snapshot is committed (manifest written) in a one-job shm root."""
    base = os.path.join(root, "unickpt")
    job = next(j for j in os.listdir(base) if os.path.isdir(os.path.join(base, j)))
    return [int(d[5:]) for d in os.listdir(os.path.join(base, job))
            if d.startswith("step_") and os.path.exists(os.path.join(base, job, d, "manifest.json"))]


def _no_leftovers(root: str) -> None:
    assert not os.path.exists(os.path.join(root, "unickpt")), os.listdir(os.path.join(root, "unickpt"))
    assert keeper_pid(root) is None


def _same_checkpoints(a: str, b: str) -> None:
    names = set(unickpt.read_manifest(a).tensors)
    assert names == set(unickpt.read_manifest(b).tensors)
    assert any(n.endswith("exp_avg_sq") for n in names)
    for name in names:
        assert torch.equal(unickpt.load_tensor(a, name), unickpt.load_tensor(b, name)), name


@pytest.fixture
def keepers_down(shm_roots):
    """Kill the keepers a test leaves behind under the roots it registers (conftest)."""
    return shm_roots


@pytest.mark.multiprocess
def test_killed_rank_resumes_from_memory_bitwise(tmp_path, keepers_down):
    """SIGKILL one of two trainer ranks mid-run, relaunch the same layout: it resumes by
    itself from the snapshot in memory (the durable tier holds nothing yet), the keeper
    having outlived the trainers; losses and final weights and moments are bitwise those
    of an unbroken run, and a clean end leaves no shared memory behind."""
    root = str(tmp_path / "shm")
    keepers_down.append(root)
    log = str(tmp_path / "run.jsonl")
    flags = [*TINY, "--snapshot-every", "2", "--save-every", "10", "--ckpt-dir", "ck", "--loss-log", log]
    procs = launch_nodes(tmp_path, [root], [*flags, "--compute-sleep", "0.4"], nproc=2)
    try:
        _wait_for(lambda: _last_step(log) >= 5 and steps_whole(root), what="step 5", procs=procs)
        keeper = keeper_pid(root)
        os.kill(worker_pids(procs[0])[1], signal.SIGKILL)
    finally:
        wait_all(procs, tmp_path, timeout=60, check=False)
    assert procs[0].returncode != 0
    assert keeper is not None and os.path.exists(f"/proc/{keeper}")
    snap_step = max(_committed(root))
    assert snap_step >= 4 and not os.path.exists(tmp_path / "ck" / "step_00000004")

    outs = wait_all(launch_nodes(tmp_path, [root], flags, nproc=2), tmp_path)
    assert resumed_lines(outs) == [resumed_lines(outs)[0]]
    assert re.fullmatch(rf"resumed step {snap_step} from memory \(.+\)", resumed_lines(outs)[0]), outs[0][-2000:]
    _no_leftovers(root)

    ref = str(tmp_path / "ref.json")
    run_ranks(train, 2, [*TINY, "--save-every", "10", "--ckpt-dir", str(tmp_path / "ref")], ref,
              preload=["unickpt.examples.train"])
    want = {r["step"]: r["loss"] for r in __import__("json").load(open(ref))}
    got = losses(log)
    assert sorted(got) == list(range(1, 11))
    assert all(got[s] == want[s] for s in got), (got, want)
    _same_checkpoints(str(tmp_path / "ck" / "step_00000010"), str(tmp_path / "ref" / "step_00000010"))


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory):
    """4 simulated nodes (one rank each, FSDP) stopped after step 6, its snapshot whole on
    every node; then node 2 is lost (keeper killed, shm root deleted). The survivors' roots
    and the durable tier (step 4) are copied so each test starts from this state."""
    tmp = tmp_path_factory.mktemp("nodes")
    roots = [str(tmp / f"shm{i}") for i in range(4)]
    os.environ["UNICKPT_JOB_ID"] = "ft"
    # groups of k = 2 stripes on 4 nodes (not n - 1 = 3): node 2's stripes lie in groups 3 and 0 only
    flags = [*TINY, "--fsdp", "--snapshot-every", "2", "--snapshot-stripes", "2", "--save-every", "4",
             "--loss-log", str(tmp / "run.jsonl")]
    try:
        wait_all(launch_nodes(tmp, roots, [*flags, "--ckpt-dir", "ck", "--stop-after", "6"]), tmp)
        _wait_for(lambda: all(6 in steps_whole(r) for r in roots), 60, "step 6 whole on every node")
        with open(os.path.join(step_dir(roots[0], 6), "manifest.json")) as f:
            assert json.load(f)["metadata"]["snapshot"]["k"] == 2
        lose_node(roots[2])
        for i in (0, 1, 3):
            shutil.copytree(roots[i], tmp / f"backup{i}", symlinks=True)
        yield tmp, roots, flags
    finally:
        os.environ.pop("UNICKPT_JOB_ID", None)
        for r in roots:
            kill_keeper(r)


def _restore(tmp, roots, nodes: list[int], ckpt: str) -> list[str]:
    for i in nodes:
        kill_keeper(roots[i])
        shutil.rmtree(roots[i], ignore_errors=True)
        shutil.copytree(tmp / f"backup{i}", roots[i], symlinks=True)
    shutil.rmtree(tmp / ckpt, ignore_errors=True)
    shutil.copytree(tmp / "ck", tmp / ckpt)
    return [roots[i] for i in nodes]


@pytest.fixture(scope="module")
def reference_losses():
    """step -> loss of an unbroken run of the example trainer (one process, no snapshots)."""
    from unickpt.examples.train import run

    return {r["step"]: r["loss"] for r in run([*TINY])}


def _close_to(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    assert sorted(got) == steps, got
    for s, loss in got.items():
        assert abs(loss - want[s]) <= 1e-4 * abs(want[s]), (s, loss, want[s])


@pytest.mark.multiprocess
def test_lost_node_rebuilt_from_parity_onto_three_nodes(four_nodes, reference_losses):
    """Relaunch on the 3 survivors: step 6 is rebuilt from XOR parity (every chunk checked)
    and resharded from 4 ranks onto 3; the loss curve continues within 1e-4 of an unbroken run."""
    tmp, roots, flags = four_nodes
    survivors = [roots[0], roots[1], roots[3]]
    shutil.copytree(tmp / "ck", tmp / "ck_rebuilt")
    outs = wait_all(launch_nodes(tmp, survivors, [*flags, "--ckpt-dir", "ck_rebuilt", "--loss-log", str(tmp / "resumed.jsonl")]), tmp)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 6 from memory (node 2 of 4 lost"), outs[0][-3000:]
    for r in survivors:
        _no_leftovers(r)
    _close_to(losses(str(tmp / "resumed.jsonl")), reference_losses, [7, 8, 9, 10])


@pytest.mark.multiprocess
def test_replacement_node_gets_its_shards_from_the_survivors(four_nodes, reference_losses):
    """Node 2 lost, relaunch on 4 nodes where node 2 is a fresh machine (empty shm root):
    its files are rebuilt from the survivors' parity and read over the network from
    their keepers, not from disk (the durable tier holds step 4 only); the run resumes
    at step 6 on the same layout and goes on within 1e-4 of an unbroken run."""
    tmp, roots, flags = four_nodes
    nodes = _restore(tmp, roots, [0, 1, 3], "ck_fresh")
    fresh = str(tmp / "shm2_fresh")
    nodes.insert(2, fresh)
    log = str(tmp / "fresh.jsonl")
    outs = wait_all(launch_nodes(tmp, nodes, [*flags, "--ckpt-dir", "ck_fresh", "--loss-log", log]), tmp)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith(
        "resumed step 6 from memory (node 2 of 4 lost: its files decoded from XOR parity during the load on 3 nodes"), outs[0][-3000:]
    _close_to(losses(log), reference_losses, [7, 8, 9, 10])
    for r in nodes:
        _no_leftovers(r)


@pytest.mark.multiprocess
def test_flipped_parity_bit_is_detected_and_disk_used(four_nodes):
    """One flipped bit in a survivor's parity chunk that rebuilds node 2 (group 0, on node
    0): the rebuild refuses it (crc32c), the run resumes from the durable tier and the
    line says why."""
    tmp, roots, flags = four_nodes
    survivors = _restore(tmp, roots, [0, 1, 3], "ck_parity")
    flip_bit(os.path.join(step_dir(roots[0], 6), "parity_g0_r0.bin"))
    outs = wait_all(launch_nodes(tmp, survivors, [*flags, "--ckpt-dir", "ck_parity", "--stop-after", "5"]), tmp)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 4 from disk ("), outs[0][-3000:]
    assert "parity of step 6 held by node 0 (group 0, block 0) fails its crc32c" in lines[0]


@pytest.mark.multiprocess
def test_two_lost_nodes_fall_back_to_disk(four_nodes):
    """Nodes 2 and 3 lost with parity 1: not rebuildable; resumed from disk on 2 nodes."""
    tmp, roots, flags = four_nodes
    survivors = _restore(tmp, roots, [0, 1], "ck_two")
    kill_keeper(roots[3])
    outs = wait_all(launch_nodes(tmp, survivors, [*flags, "--ckpt-dir", "ck_two", "--stop-after", "5"]), tmp)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 4 from disk ("), outs[0][-3000:]
    assert "step 6: nodes 2, 3 of 4 were lost; parity 1 rebuilds one node" in lines[0]


@pytest.mark.multiprocess
def test_killed_keeper_is_recreated_and_a_corrupt_snapshot_never_used(tmp_path, keepers_down):
    """The keeper SIGKILLed while the trainer runs: training goes on, the next snapshot
    starts a new keeper (which reaps a dead job's leftovers) and later steps become whole.
    Then a flipped bit in the snapshot's data: recovery refuses it and uses the disk."""
    root = str(tmp_path / "shm")
    keepers_down.append(root)
    stale = os.path.join(root, "unickpt", "dead-job", "step_00000002")
    os.makedirs(stale)
    open(os.path.join(stale, "rank_00000.safetensors"), "wb").write(b"\0" * 100)
    log = str(tmp_path / "run.jsonl")
    flags = [*TINY, "--snapshot-every", "2", "--save-every", "4", "--ckpt-dir", str(tmp_path / "ck"), "--loss-log", log]
    cmd = [sys.executable, "-m", "unickpt.examples.train", *flags]
    p = subprocess.Popen([*cmd, "--compute-sleep", "0.3", "--stop-after", "8"], env=env_for(root), cwd=tmp_path)
    try:
        _wait_for(lambda: 2 in steps_whole(root), what="step 2 whole", procs=[p])
        first = keeper_pid(root)
        assert not os.path.exists(stale)
        kill_keeper(root)
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert sorted(losses(log)) == list(range(1, 9))
    second = keeper_pid(root)
    assert second is not None and second != first and os.path.exists(f"/proc/{second}")
    _wait_for(lambda: steps_whole(root) == [8], 30, "step 8 whole")

    flip_bit(os.path.join(step_dir(root, 8), "rank_00000.safetensors"))
    out = subprocess.run([*cmd, "--stop-after", "9"], env=env_for(root), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = resumed_lines([out.stdout])
    assert len(lines) == 1 and lines[0].startswith("resumed step 8 from disk ("), out.stdout
    assert "step 8: checksum mismatch in rank_00000.safetensors" in lines[0]


@pytest.mark.multiprocess
def test_memory_cap_and_bad_protection_are_clear_errors(tmp_path, keepers_down, caplog):
    """A snapshot above max_bytes is refused before anything is written; copies and parity
    together, or more parity than nodes, are refused; parity asked of a single node is
    said to protect nothing against a lost node."""
    from unickpt import SnapshotOptions
    from unickpt.snapshot import Snapshotter

    root = str(tmp_path / "shm")
    keepers_down.append(root)
    with pytest.raises(SnapshotError, match="exclude each other"):
        Snapshotter("cap", SnapshotOptions(every=1, parity=1, replicas=2), root=root)
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad, why in ((afile, "not a directory"), (afile / "sub", "Not a directory")):
        with pytest.raises(SnapshotError, match=rf"the shm root {bad} \(\$UNICKPT_SHM_ROOT\) cannot hold snapshots: {why}$"):
            Snapshotter("cap", SnapshotOptions(every=1, parity=0), root=str(bad))
    from unickpt.snapshot.keeper_admin import ensure_keeper

    with pytest.raises(SnapshotError, match=r"the snapshot keeper exited at start \(code 1: OSError: .*Cannot assign requested "
                       r"address\); see .*keeper\.log$"):
        ensure_keeper(str(tmp_path / "shm_elsewhere"), "cap", host="192.0.2.1")  # an address of no interface here
    from unickpt.snapshot.parity import layout

    with pytest.raises(SnapshotError, match="parity must be 0 or more"):
        layout(3, -1)
    assert layout(3, 3) == (1, 2) and layout(4, 2) == (2, 2) and layout(4, 1) == (3, 1) and layout(4, 0, 2) == (1, 1) and layout(1, 2) == (1, 0)
    snap = Snapshotter("cap", SnapshotOptions(every=1, parity=0, max_bytes=1000), root=root)
    with pytest.raises(SnapshotError, match=r"above the cap of 1000 B; raise max_bytes"):
        snap.snapshot({"w": torch.zeros(1000)}, 1)
    assert not os.path.exists(os.path.join(root, "unickpt", "cap", "step_00000001"))
    snap.close()
    said = lambda: [r.getMessage() for r in caplog.records if r.name == "unickpt"]  # noqa: E731  (the unickpt logger)
    assert said() == []  # --parity 0: nothing asked, nothing to say
    Snapshotter("cap", SnapshotOptions(every=1), root=root).close()  # the default on one node: the user asked for nothing, nothing said
    assert said() == []
    one_node = ["unickpt: one node: snapshots survive a crashed process, not the loss of the node "
                "(protection against lost nodes needs 2 nodes or more)"]
    first = Snapshotter("cap", SnapshotOptions(every=1, parity=1), root=root)  # parity 1 asked of one node: said
    again = Snapshotter("cap", SnapshotOptions(every=1, parity=1), root=root)  # the same job's next start (a re-forming): said once per job
    assert said() == one_node
    again.close()
    first.close()
    _no_leftovers(root)


@pytest.mark.multiprocess
def test_flushed_snapshots_are_checkpoints_and_resume_when_memory_is_lost(tmp_path, keepers_down):
    """--flush-every 2 without --save-every: the keepers write snapshot steps 4 and 8 as
    ordinary checkpoints in --ckpt-dir (the trainers gone after step 8, the keepers finish
    by themselves); each verifies and holds bitwise the tensors of a checkpoint the trainer
    saves at that step. Both nodes lost: the relaunch resumes from the flushed step 8 from
    disk and continues bitwise like the unbroken run."""
    roots = [str(tmp_path / "shm0"), str(tmp_path / "shm1")]
    keepers_down.extend(roots)
    ck = tmp_path / "ck"
    flags = [*TINY, "--snapshot-every", "2", "--flush-every", "2", "--ckpt-dir", "ck"]
    wait_all(launch_nodes(tmp_path, roots, [*flags, "--stop-after", "8"]), tmp_path)
    flushed = ["step_00000004", "step_00000008"]  # steps 2 and 6 are not flushed; no staging directory is left
    _wait_for(lambda: os.path.exists(ck / flushed[1] / "manifest.json") and sorted(os.listdir(ck)) == flushed, 60,
              f"steps 4 and 8 flushed, only they in {ck}")

    ref = str(tmp_path / "ref.json")
    run_ranks(train, 2, [*TINY, "--save-every", "4", "--ckpt-dir", str(tmp_path / "ref")], ref,
              preload=["unickpt.examples.train"])
    for step in ("step_00000004", "step_00000008"):
        report = unickpt.verify(str(ck / step))
        assert report.ok, report
        _same_checkpoints(str(ck / step), str(tmp_path / "ref" / step))

    for r in roots:
        lose_node(r)
    log = str(tmp_path / "resumed.jsonl")
    outs = wait_all(launch_nodes(tmp_path, roots, [*flags, "--loss-log", log]), tmp_path)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 8 from disk (ck/step_00000008; "), outs[0][-3000:]
    want = {r["step"]: r["loss"] for r in __import__("json").load(open(ref))}
    got = losses(log)
    assert sorted(got) == [9, 10] and all(got[s] == want[s] for s in got), (got, want)
    for r in roots:
        _no_leftovers(r)


def test_flush_commits_only_when_every_keeper_wrote_exactly_the_manifests_files():
    """The coordinator's check before it writes the manifest: every node reported, none
    failed, and together they wrote exactly the manifest's files (names and sizes)."""
    from unickpt.snapshot.flush import check_reports

    manifest = b'{"files": {"rank_00000.safetensors": 10, "rank_00001.safetensors": 20}}'
    ok = {0: {"files": [["rank_00000.safetensors", 10]]}, 1: {"files": [["rank_00001.safetensors", 20]]}}
    check_reports(manifest, ok, 2)
    with pytest.raises(SnapshotError, match=r"node\(s\) 1 did not report"):
        check_reports(manifest, {0: ok[0]}, 2)
    with pytest.raises(SnapshotError, match="node 1: OSError: disk full"):
        check_reports(manifest, {0: ok[0], 1: {"files": [], "error": "OSError: disk full"}}, 2)
    with pytest.raises(SnapshotError, match="the manifest names"):
        check_reports(manifest, {0: ok[0], 1: {"files": [["rank_00001.safetensors", 19]]}}, 2)


@pytest.mark.multiprocess
def test_flush_with_a_dead_keeper_commits_nothing(tmp_path, keepers_down):
    """Two real keepers; the step's manifest names both and a flush target, node 1's keeper
    is SIGKILLed before node 0's step is committed: node 0's flush cannot reach it, and
    nothing is left in the checkpoint directory (no committed step, no staging directory)."""

    from unickpt.snapshot import ensure_keeper

    roots = [str(tmp_path / "shm0"), str(tmp_path / "shm1")]
    keepers_down.extend(roots)
    docs = [ensure_keeper(r, "fl") for r in roots]
    kill_keeper(roots[1])
    target = tmp_path / "ck" / "step_00000002"
    sdir = os.path.join(roots[0], "unickpt", "fl", "step_00000002")
    os.makedirs(sdir)
    open(os.path.join(sdir, "rank_00000.safetensors"), "wb").write(b"x" * 1000)
    nodes = [{"host": d["host"], "port": d["port"], "pid": d["pid"]} for d in docs]
    doc = {"files": {"rank_00000.safetensors": 1000, "rank_00001.safetensors": 1000},
           "metadata": {"snapshot": {"step": 2, "job": "fl", "parity": 0, "nodes": nodes, "flush": str(target)}}}
    commit_manifest(sdir, doc)
    log = os.path.join(roots[0], "unickpt", "keeper.log")
    _wait_for(lambda: "flush to" in open(log).read(), 30, "the flush to end")
    assert "failed, nothing committed" in open(log).read()
    assert not os.path.exists(target) and os.listdir(tmp_path / "ck") == []


@pytest.mark.multiprocess
def test_reed_solomon_parity_2_rebuilds_two_lost_nodes_not_three(tmp_path, keepers_down, reference_losses):
    """4 nodes with --parity 2 (Reed-Solomon, k = 2 data + m = 2 parity per group, memory
    2x): nodes 2 and 3 lost, the relaunch on the 2 survivors rebuilds both nodes' files
    (every block crc32c-checked) and resumes from memory within 1e-4 of an unbroken run.
    Three nodes lost: resumed from disk, with the reason."""
    roots = [str(tmp_path / f"shm{i}") for i in range(4)]
    keepers_down.extend(roots)
    flags = [*TINY, "--fsdp", "--snapshot-every", "2", "--parity", "2", "--save-every", "4"]
    os.environ["UNICKPT_JOB_ID"] = "rs"
    try:
        wait_all(launch_nodes(tmp_path, roots, [*flags, "--ckpt-dir", "ck", "--stop-after", "6"]), tmp_path)
        _wait_for(lambda: all(6 in steps_whole(r) for r in roots), 60, "step 6 whole on every node")
        held = [sorted(f for f in os.listdir(step_dir(r, 6)) if f.endswith(".bin")) for r in roots]
        assert held[0] == ["parity_g0_r0.bin", "parity_g3_r1.bin"], held  # node j holds blocks of groups j, j-1
        lose_node(roots[2])
        lose_node(roots[3])
        shutil.copytree(roots[0], tmp_path / "backup0", symlinks=True)
        shutil.copytree(tmp_path / "ck", tmp_path / "ck_three")
        log = str(tmp_path / "resumed.jsonl")
        outs = wait_all(launch_nodes(tmp_path, roots[:2], [*flags, "--ckpt-dir", "ck", "--loss-log", log]), tmp_path)
        lines = resumed_lines(outs)
        assert len(lines) == 1 and lines[0].startswith(
            "resumed step 6 from memory (nodes 2, 3 of 4 lost: their files decoded from Reed-Solomon parity (2+2) "
            "during the load on 2 nodes, every chunk's crc32c verified"), outs[0][-3000:]
        _close_to(losses(log), reference_losses, [7, 8, 9, 10])

        shutil.rmtree(roots[0], ignore_errors=True)  # a clean end removed the root a manager made
        shutil.copytree(tmp_path / "backup0", roots[0], symlinks=True)
        outs = wait_all(launch_nodes(tmp_path, roots[:1], [*flags, "--ckpt-dir", "ck_three", "--stop-after", "5"]),
                        tmp_path)
        lines = resumed_lines(outs)
        assert len(lines) == 1 and lines[0].startswith("resumed step 4 from disk ("), outs[0][-3000:]
        assert "step 6: nodes 1, 2, 3 of 4 were lost; parity 2 rebuilds 2 nodes" in lines[0]
    finally:
        os.environ.pop("UNICKPT_JOB_ID", None)


@pytest.mark.multiprocess
def test_a_keeper_whose_root_is_deleted_exits_and_another_jobs_keeper_is_named(tmp_path, keepers_down):
    """A keeper of a job that crashed lingers to serve its recovery; it exits by itself
    once its shm root is deleted (no orphan blocking the root). Another job meeting a live
    keeper of a different job gets one error naming it and how to stop it."""
    from unickpt.snapshot import keeper_admin as keepers

    root = str(tmp_path / "shm")
    keepers_down.append(root)
    doc = keepers.ensure_keeper(root, "job-a")
    with pytest.raises(SnapshotError, match=rf"serves job 'job-a', not 'job-b'; it holds no snapshot \(its job may have "
                                            rf"failed before its first\): stop it \(kill {doc['pid']}\)"):
        keepers.ensure_keeper(root, "job-b")
    os.makedirs(os.path.join(root, "unickpt", "job-a", "step_00000007"))  # as a snapshot of step 7 leaves it
    with pytest.raises(SnapshotError, match=rf"serves job 'job-a', not 'job-b'; it holds the snapshots of steps 7..7\. "
                                            rf"Give each job its own UNICKPT_SHM_ROOT, or stop that keeper \(kill {doc['pid']}"):
        keepers.ensure_keeper(root, "job-b")
    proc = next(p for p in keepers._CHILDREN if p.pid == int(doc["pid"]))
    shutil.rmtree(root)
    assert proc.wait(10) == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags, message", [
    (["--snapshot-every", "-2"], "snapshot_every must be a whole number >= 0 (0: never), not -2"),
    (["--snapshot-every", "1", "--parity", "-1"], "parity must be a whole number >= 0 or None, not -1"),
    (["--snapshot-every", "1", "--parity", "1", "--snapshot-replicas", "2"],
     "snapshot_replicas=2 and parity=1 exclude each other: a node's snapshot is protected by copies on neighbours or "
     "by parity, not both"),
])
def test_a_bad_snapshot_flag_is_one_error_line(tmp_path, capsys, flags, message):
    """The trainer's entry point turns unickpt's errors into one line and exit status 2."""
    from unickpt.examples.train import main

    with pytest.raises(SystemExit) as exit_:
        main([*TINY, *flags, "--ckpt-dir", str(tmp_path / "ck")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.multiprocess
def test_replica_on_the_neighbour_node_resumes_a_lost_node(tmp_path, keepers_down, reference_losses):
    """--snapshot-replicas 2 on 2 nodes: each keeper holds a full copy of the other node's
    snapshot (memory 2x); node 1 lost, the relaunch on node 0 resumes from memory through
    the copy (checked against its crc32c, then every block's) within 1e-4 of an unbroken
    run (--parity 1 with replicas is refused: test_a_bad_snapshot_flag_is_one_error_line)."""
    roots = [str(tmp_path / "shm0"), str(tmp_path / "shm1")]
    keepers_down.extend(roots)
    flags = [*TINY, "--snapshot-every", "2", "--snapshot-replicas", "2", "--save-every", "4", "--ckpt-dir", "ck"]
    wait_all(launch_nodes(tmp_path, roots, [*flags, "--stop-after", "6"]), tmp_path)
    _wait_for(lambda: all(6 in steps_whole(r) for r in roots), 60, "step 6 whole on every node")
    data = [sum(os.path.getsize(os.path.join(step_dir(r, 6), f)) for f in os.listdir(step_dir(r, 6)) if f.startswith("rank_"))
            for r in roots]
    assert os.path.getsize(os.path.join(step_dir(roots[0], 6), "parity_g0_r0.bin")) == data[1]  # node 1's copy
    assert os.path.getsize(os.path.join(step_dir(roots[1], 6), "parity_g1_r0.bin")) == data[0]
    lose_node(roots[1])
    log = str(tmp_path / "resumed.jsonl")
    outs = wait_all(launch_nodes(tmp_path, roots[:1], [*flags, "--loss-log", log]), tmp_path)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith(
        "resumed step 6 from memory (node 1 of 2 lost: its files fetched from copies on neighbour nodes during the load on 1 node"), \
        outs[0][-3000:]
    _close_to(losses(log), reference_losses, [7, 8, 9, 10])
    _no_leftovers(roots[0])


@pytest.mark.multiprocess
def test_a_step_is_held_in_memory_until_its_flush_ends(tmp_path, keepers_down):
    """A real keeper; step 2 is due for a flush, and its rank file is a named pipe, so the
    flush's copy blocks until the test opens the pipe: deterministic. Step 4 becomes whole
    meanwhile, and retention (which deletes what is older than the newest whole step)
    keeps step 2 because its flush has not ended; once the pipe is opened and closed the
    flush commits step 2 to disk and only then is it deleted from memory."""

    from unickpt.snapshot import ensure_keeper

    root = str(tmp_path / "shm")
    keepers_down.append(root)
    doc = ensure_keeper(root, "pin")
    nodes = [{"host": doc["host"], "port": doc["port"], "pid": doc["pid"]}]
    jdir = os.path.join(root, "unickpt", "pin")
    target = tmp_path / "ck" / "step_00000002"
    log = os.path.join(root, "unickpt", "keeper.log")
    for step, flush in ((2, str(target)), (4, None)):
        sdir = os.path.join(jdir, f"step_{step:08d}")
        os.makedirs(sdir)
        rank_file = os.path.join(sdir, "rank_00000.safetensors")
        if flush:
            os.mkfifo(rank_file)
        else:
            open(rank_file, "wb").close()
        snap = {"step": step, "job": "pin", "parity": 0, "nodes": nodes, **({"flush": flush} if flush else {})}
        commit_manifest(sdir, {"files": {"rank_00000.safetensors": 0}, "metadata": {"snapshot": snap}})
        _wait_for(lambda: f"step {step} whole" in open(log).read(), 30, f"step {step} whole")
    assert os.path.isdir(os.path.join(jdir, "step_00000002")), "a step being flushed was deleted from memory"
    assert not os.path.exists(target / "manifest.json")
    with open(os.path.join(jdir, "step_00000002", "rank_00000.safetensors"), "wb"):
        pass  # the flush's copy reads the pipe to its end: 0 bytes, as the manifest says
    _wait_for(lambda: not os.path.exists(os.path.join(jdir, "step_00000002")), 30, "step 2 released after its flush")
    assert os.path.exists(target / "manifest.json") and "step 2 flushed to" in open(log).read()
    assert sorted(os.listdir(jdir)) == ["step_00000004"]


@pytest.mark.multiprocess
def test_snapshots_go_on_while_a_slow_durable_async_save_writes(tmp_path, keepers_down):
    """A durable ``async_save`` to an object store throttled on the network (a real S3
    server behind a TCP forwarder held to 1 MB/s: the 4 MiB take seconds) is still in
    flight while two ranks take and commit three snapshots (their own staging buffer and
    gloo group: no wait for it); the newest snapshot is recovered from memory bitwise, and
    the durable save commits intact afterwards."""
    from objstore_cases import BUCKET, S3Server, ThrottledProxy
    from snapshot_helpers import snapshots_during_slow_save

    root = str(tmp_path / "shm")
    keepers_down.append(root)
    server = S3Server()
    proxy = ThrottledProxy(server.port, 1e6)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        out = str(tmp_path / "seen.json")
        run_ranks(snapshots_during_slow_save, 2, proxy.env(), f"s3://{BUCKET}/durable", root, out,
                  preload=["torch", "unickpt", "unickpt.snapshot.client", "s3fs"])
    finally:
        proxy.close()
        server.kill()
    seen = __import__("json").load(open(out))
    assert [s["durable_done"] for s in seen["snapshots"]] == [False, False, False], seen
    assert seen["snapshots"][-1]["at"] < seen["durable_s"], seen
    assert seen["source"] == "memory" and seen["step"] == 3 and seen["bitwise"], seen
    assert seen["durable_bitwise"], seen
    _no_leftovers(root)
