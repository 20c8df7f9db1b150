"""Incremental saves and retention that follows their references (issue 17, first half).

Real processes throughout: two ranks over gloo for the resharding, forked processes killed
with a real SIGKILL during incremental saves and at every file removal of retention.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import time

import pytest
import torch

import unickpt
from unickpt import CheckpointManager
from unickpt.api.incremental import KILL_AFTER_UNLINK_ENV, stored_bytes
from unickpt.testing import run_ranks

from incremental_cases import PRELOAD, check, full_state, two_ranks, zeros_like_state

FORK = multiprocessing.get_context("fork")


def _fine_tune_state(k: int) -> dict:
    """20 frozen tensors of 16 KiB and one trainable one that changes at every save;
    ``late`` changes once, at save 3."""
    g = torch.Generator().manual_seed(1)
    sd = {f"frozen.{i}": torch.randn(64, 64, generator=g) for i in range(20)}
    sd["trainable"] = torch.randn(64, 64, generator=g) + k
    sd["late"] = torch.randn(64, 64, generator=g) + (k >= 3)
    sd["step"] = k
    return sd


def _loads_as(path: str, sd: dict) -> bool:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    unickpt.load(out, path)
    return all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in sd.items())


def _holders(path: str) -> set[str]:
    return set(unickpt.read_manifest(path).bases)


def test_chain_of_five_with_retention_keep_2(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, incremental=True)
    full = None
    for k in range(1, 6):
        sd = _fine_tune_state(k)
        path = mgr.save(sd, k)
        m = unickpt.read_manifest(path)
        written, referenced = stored_bytes(m)
        if k == 1:
            full = written
            assert not m.bases and m.incremental is None
        else:
            # one (or, at save 3, two) of 22 tensors written: well under a tenth of a full save
            assert written < full * (0.15 if k == 3 else 0.08), (k, written, full)
            assert m.incremental["base"] == f"../step_{k - 1:08d}" and m.incremental["depth"] == k - 1
        assert mgr.latest() == path and _loads_as(path, sd) and unickpt.verify(path).ok
        # flat references: every holder holds the bytes itself (references nothing in turn for them)
        for b in m.bases:
            holder = os.path.normpath(os.path.join(path, b))
            own = {f for f in unickpt.read_manifest(holder).files if "/" not in f}
            assert m.bases[b].files.keys() <= own
    # kept: steps 4 and 5; step 1 holds the frozen tensors, step 3 the `late` one: both stay
    # (referenced); step 2 is gone
    assert mgr.steps() == [1, 3, 4, 5]
    assert _holders(mgr.path_for(5)) == {"../step_00000001", "../step_00000003"}
    # every kept checkpoint loads on its own, and its bases too
    assert _loads_as(mgr.path_for(4), _fine_tune_state(4))
    # `--consolidate` makes a self-contained copy that survives its bases
    cons = str(tmp_path / "consolidated")
    unickpt.convert(mgr.path_for(5), cons)
    assert not unickpt.read_manifest(cons).bases
    for s in mgr.steps():
        shutil.rmtree(mgr.path_for(s))
    assert _loads_as(cons, _fine_tune_state(5)) and unickpt.verify(cons).ok


def test_full_every_starts_a_new_chain_and_frees_the_old_one(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1, incremental=True, full_every=3)
    for k in range(1, 6):
        mgr.save(_fine_tune_state(k), k)
    # saves 1 and 4 are full, 2, 3 and 5 incremental; keep=1 leaves step 5 and its base 4
    assert unickpt.read_manifest(mgr.path_for(4)).incremental is None
    assert unickpt.read_manifest(mgr.path_for(5)).incremental["depth"] == 1
    assert mgr.steps() == [4, 5]


@pytest.mark.multiprocess
def test_two_ranks_to_one_and_one_to_two(tmp_path):
    single = tmp_path / "single"
    unickpt.save(full_state(1), str(single / "s1"))
    unickpt.save(full_state(2), str(single / "s2"), base=str(single / "s1"))
    unickpt.save(full_state(3), str(single / "s3"), base=str(single / "s2"))
    run_ranks(two_ranks, 2, str(tmp_path), preload=PRELOAD)
    s3 = str(tmp_path / "two" / "s3")
    target = zeros_like_state(full_state(1))
    unickpt.load(target, s3)
    check(target, 3, "two/s3 loaded onto one process")
    m = unickpt.read_manifest(s3)
    files = {(f.rank, f.file) for f in m.tensors["model.w"].fragments}
    # w's first half never changed: rank 0's shard is in s1; its second half changed at s2
    assert files == {(0, "../s1/rank_00000.safetensors"), (1, "../s2/rank_00001.safetensors")}
    assert {f.file for f in m.tensors["model.v"].fragments} == {"rank_00000.safetensors", "rank_00001.safetensors"}
    assert unickpt.verify(s3).ok


def test_missing_or_replaced_base_is_named(tmp_path):
    from test_cli import invoke

    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    unickpt.save(_fine_tune_state(1), s1)
    unickpt.save(_fine_tune_state(2), s2, base=s1)
    shutil.move(s1, str(tmp_path / "elsewhere"))
    with pytest.raises(unickpt.CorruptionError, match=r"base checkpoint \.\./s1 .* is missing"):
        unickpt.load(_fine_tune_state(0), s2)
    with pytest.raises(unickpt.CorruptionError, match=r"\.\./s1"):
        unickpt.load_tensor(s2, "frozen.0")
    report = unickpt.verify(s2)
    assert not report.ok and report.problems[0].kind == "base" and "../s1" in report.problems[0].message
    r = invoke("verify", s2)
    assert r.exit_code == 1 and "base checkpoint ../s1" in r.output, r.output
    r = invoke("inspect", s2)
    assert "base ../s1: missing" in r.output and "chain of bases (depth 1): ../s1 (missing)" in r.output, r.output
    assert not CheckpointManager(tmp_path).is_valid(s2)
    # a different checkpoint where the base was: the references do not hold any more
    unickpt.save(_fine_tune_state(1), s1, metadata={"other": True})
    with pytest.raises(unickpt.CorruptionError, match=r"base checkpoint \.\./s1 .* was replaced"):
        unickpt.load(_fine_tune_state(0), s2)
    shutil.rmtree(s1)
    shutil.move(str(tmp_path / "elsewhere"), s1)
    assert _loads_as(s2, _fine_tune_state(2))
    r = invoke("inspect", s2)
    assert r.exit_code == 0 and "% written)" in r.output and "chain of bases (depth 1): ../s1" in r.output, r.output


def test_corrupt_referenced_chunk_is_detected(tmp_path):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    unickpt.save(_fine_tune_state(1), s1)
    unickpt.save(_fine_tune_state(2), s2, base=s1)
    frag = unickpt.read_manifest(s2).tensors["frozen.7"].fragments[0]
    assert frag.file == "../s1/rank_00000.safetensors"
    with open(os.path.join(s1, "rank_00000.safetensors"), "r+b") as f:
        f.seek(frag.offset + 100)
        byte = f.read(1)
        f.seek(frag.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(unickpt.CorruptionError, match=r"checksum mismatch in \.\./s1/rank_00000\.safetensors \(tensor 'frozen\.7'"):
        unickpt.load(_fine_tune_state(0), s2)
    report = unickpt.verify(s2)
    assert [(p.kind, p.file, p.tensor) for p in report.problems] == [("checksum", "../s1/rank_00000.safetensors", "frozen.7")]


def test_references_are_covered_by_the_digest_and_checked(tmp_path):
    s1, s2 = str(tmp_path / "s1"), str(tmp_path / "s2")
    unickpt.save(_fine_tune_state(1), s1)
    unickpt.save(_fine_tune_state(2), s2, base=s1)
    text = open(os.path.join(s2, "manifest.json")).read()
    edited = text.replace('"../s1/rank_00000.safetensors","offset":', '"../s1/rank_00000.safetensors","offset":1', 1)
    assert edited != text
    open(os.path.join(s2, "manifest.json"), "w").write(edited)
    with pytest.raises(unickpt.CorruptionError, match="manifest digest mismatch"):
        unickpt.read_manifest(s2)
    open(os.path.join(s2, "manifest.json"), "w").write(text)
    # a hostile base path is refused before anything is opened
    from unickpt.format.manifest import Manifest, seal

    doc = json.loads(text)
    del doc["digest"]
    doc["bases"] = {"/etc": doc["bases"]["../s1"]}
    with pytest.raises(unickpt.ManifestError, match="base path '/etc'"):
        Manifest.from_json(seal(json.dumps(doc, separators=(",", ":"))))
    # the base of an incremental save cannot be the checkpoint it replaces
    with pytest.raises(unickpt.SaveError, match="cannot"):
        unickpt.save(_fine_tune_state(3), s1, base=s2, overwrite=True)
    with pytest.raises(unickpt.SaveError):
        unickpt.save(_fine_tune_state(3), s2, base=s2, overwrite=True)
    assert _loads_as(s2, _fine_tune_state(2))
    # the rest of a base's file (tensors this checkpoint does not have) is the base's to account for
    sd = _fine_tune_state(2)
    del sd["frozen.19"]
    unickpt.save(sd, str(tmp_path / "s3"), base=s1)
    report = unickpt.verify(str(tmp_path / "s3"))
    assert report.ok and report.complete, report


def test_async_incremental_in_batches(tmp_path):
    s1 = str(tmp_path / "s1")
    unickpt.async_save(_fine_tune_state(1), s1, block_bytes=4096).result()
    # hashed in the call; lazy: hashed in the background from the staged copy; a staging
    # buffer of 40 KiB: the shard is staged and written in batches
    for k, kwargs in enumerate([{}, {"lazy": True}, {"max_staging_bytes": 40_000}, {"lazy": True, "max_staging_bytes": 40_000}]):
        path, sd = str(tmp_path / f"i{k}"), _fine_tune_state(2)
        h = unickpt.async_save(sd, path, base=s1, block_bytes=4096, **kwargs)
        h.wait_staged()
        sd["frozen.3"].add_(1)  # after staging: not in the checkpoint
        h.result()
        m = unickpt.read_manifest(path)
        assert {n for n, t in m.tensors.items() if t.fragments[0].base is None} == {"trainable"}, kwargs
        assert _loads_as(path, _fine_tune_state(2)) and unickpt.verify(path).ok


# ------------------------------------------------------------------ kills


def _prune(root: str) -> None:
    CheckpointManager(root, keep=1, incremental=True).prune()
    os._exit(0)


@pytest.mark.multiprocess
def test_sigkill_after_every_unlink_of_retention_keeps_the_newest_whole(tmp_path):
    # saves 1 (full), 2-5 (incremental, each referencing 1 and some of 2-4), 6 (full), 7
    # (incremental on 6); retention with keep=1 keeps 7 and the 6 it references, and
    # deletes 1-5 and what an earlier killed deletion left
    template = tmp_path / "template"
    mgr = CheckpointManager(template, incremental=True, full_every=5)  # keep everything: retention is run below
    for k in range(1, 8):
        mgr.save(_fine_tune_state(k), k)
    assert _holders(mgr.path_for(7)) == {"../step_00000006"}
    os.makedirs(template / "step_00000000")
    (template / "step_00000000" / "rank_00000.safetensors").write_bytes(b"x" * 100)
    expected_left = ["step_00000006", "step_00000007"]
    doomed = ["step_00000000", *(f"step_{k:08d}" for k in range(1, 6))]
    removals = sum(len(os.listdir(template / d)) for d in doomed)
    kill_at = 1
    while True:
        root = tmp_path / f"run{kill_at}"
        shutil.copytree(template, root)
        os.environ[KILL_AFTER_UNLINK_ENV] = str(kill_at)
        try:
            p = FORK.Process(target=_prune, args=(str(root),))
            p.start()
            p.join()
        finally:
            del os.environ[KILL_AFTER_UNLINK_ENV]
        mgr = CheckpointManager(root, keep=1, incremental=True)
        # whatever was deleted, every committed checkpoint is whole and the newest loads
        for s in mgr.steps():
            assert unickpt.verify(mgr.path_for(s)).ok, (kill_at, s)
        latest = mgr.latest()
        assert latest == mgr.path_for(7) and _loads_as(latest, _fine_tune_state(7)), kill_at
        if p.exitcode == 0:
            break
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        mgr.prune()  # the next retention finishes what the killed one began
        assert sorted(os.listdir(root)) == expected_left, kill_at
        shutil.rmtree(root)
        kill_at += 1
    assert sorted(os.listdir(root)) == expected_left
    assert kill_at == removals + 1 and removals >= 10  # killed after each of its removals, then left to finish


def _incremental_saves_forever(root: str) -> None:
    mgr = CheckpointManager(root, keep=2, incremental=True, full_every=4)
    k = 0
    while True:
        k += 1
        mgr.save(_fine_tune_state(k % 5 + 1), k, threads=1)


@pytest.mark.multiprocess
def test_sigkill_during_incremental_saves_and_retention(tmp_path):
    rng = random.Random(0)
    root = str(tmp_path / "run")
    for attempt in range(4):
        shutil.rmtree(root, ignore_errors=True)
        p = FORK.Process(target=_incremental_saves_forever, args=(root,))
        p.start()
        time.sleep(rng.uniform(0.3, 1.0))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        mgr = CheckpointManager(root, keep=2, incremental=True)
        latest = mgr.latest(verify=True)
        if latest is None:
            continue
        step = int(latest.rsplit("_", 1)[1])
        assert _loads_as(latest, _fine_tune_state(step % 5 + 1)), (attempt, step)
        for s in mgr.steps():
            assert unickpt.verify(mgr.path_for(s)).ok, (attempt, s)
        mgr.prune()
        assert mgr.latest() == latest
