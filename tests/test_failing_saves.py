"""Failing and concurrent saves (issue 12, items 8-11, and a failed convert).

Real failures only: a real full disk (a 2 MiB tmpfs mounted here, root needed), real
SIGKILLs in the middle of an overwrite, two real processes racing to save to one path,
real symbolic links planted in the target directory, a real corrupted source for convert.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import unickpt
from unickpt.testing import run_ranks

FILLER = 1 << 20  # bytes taken on the 2 MiB disk before the saves


def _mount_small_disk(where) -> None:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full disk needs a small tmpfs, and mounting one was refused (root needed): {r.stderr.strip()}")


@pytest.fixture
def disk(tmp_path):
    """A 2 MiB file system, half taken by a filler file."""
    mnt = tmp_path / "disk"
    _mount_small_disk(mnt)
    (mnt / "filler").write_bytes(b"\1" * FILLER)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def _state(seed: int, n: int = 3, numel: int = 16_384, names: tuple[str, ...] = ("a", "b", "c")) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {k: torch.randn(numel, generator=g) for k in names[:n]}, "step": seed}


def _loaded_equals(path, sd) -> bool:
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    unickpt.load(target, str(path))
    return target["step"] == sd["step"] and all(torch.equal(target["model"][k], v) for k, v in sd["model"].items())


# ------------------------------------------------------------------ item 8: a full disk


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["save", "async_save", "manager"])
def test_full_disk_save_removes_what_it_wrote_and_a_smaller_save_succeeds(disk, how):
    big = {"w": torch.ones(3 << 17)}  # 1.5 MiB: does not fit beside the filler
    small = {"w": torch.full((1 << 16,), 2.0)}  # 256 KiB
    manager = unickpt.CheckpointManager(str(disk / "run"))

    def save(sd, step):
        if how == "save":
            unickpt.save(sd, str(disk / f"ckpt{step}"))
            return str(disk / f"ckpt{step}")
        if how == "async_save":
            unickpt.async_save(sd, str(disk / f"ckpt{step}")).result(timeout=60)
            return str(disk / f"ckpt{step}")
        return manager.save(sd, step)

    if how == "manager":
        (disk / "run").mkdir()
    before, free = sorted(os.listdir(disk)), _free(disk)
    with pytest.raises(unickpt.SaveError, match="ENOSPC") as info:
        save(big, 1)
    assert "No space left on device" in str(info.value)
    assert sorted(os.listdir(disk)) == before, "the failed save left files behind"
    if how == "manager":
        assert os.listdir(disk / "run") == []
    assert _free(disk) == free, "the failed save still holds disk space"
    path = save(small, 2)
    assert unickpt.verify(path).ok
    out = {"w": torch.zeros(1 << 16)}
    unickpt.load(out, path)
    assert torch.equal(out["w"], small["w"])
    if how == "manager":
        assert manager.latest(verify=True) == path


def _save_over_a_file_size_limit(root: str, results) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, resource.RLIM_INFINITY))
    try:
        unickpt.save({"w": torch.ones(1 << 18)}, os.path.join(root, "ckpt"))  # 1 MiB
        results.put("the save over the limit succeeded")
    except unickpt.SaveError as e:
        left = sorted(os.listdir(root))
        unickpt.save({"w": torch.ones(1 << 16)}, os.path.join(root, "ckpt"))  # 256 KiB
        results.put(f"{'EFBIG' in str(e)} {left}")


@pytest.mark.multiprocess
def test_save_over_a_file_size_limit_removes_what_it_wrote(tmp_path):
    """The same without root: the kernel refuses to grow a file past RLIMIT_FSIZE."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    p = ctx.Process(target=_save_over_a_file_size_limit, args=(str(tmp_path), results))
    p.start()
    assert results.get(timeout=60) == "True []"
    p.join(timeout=60)
    assert p.exitcode == 0 and unickpt.verify(str(tmp_path / "ckpt")).ok


def full_disk_ranks(rank: int, world: int, disk: str) -> None:
    path = os.path.join(disk, "ckpt")
    big = {"w": unickpt.PerRank(torch.full((200_000,), float(rank)))}  # 800 KB per rank: 1.6 MB, 1 MB free
    with pytest.raises(unickpt.SaveError, match="ENOSPC"):
        unickpt.save(big, path)
    dist.barrier()
    assert sorted(os.listdir(disk)) == ["filler"], os.listdir(disk)  # every rank's partial file is gone
    small = {"w": unickpt.PerRank(torch.full((50_000,), float(rank)))}
    unickpt.save(small, path)
    out = {"w": unickpt.PerRank(torch.zeros(50_000))}
    unickpt.load(out, path)
    assert torch.equal(out["w"].value, small["w"].value)


@pytest.mark.multiprocess
def test_full_disk_on_two_ranks(disk):
    run_ranks(full_disk_ranks, 2, str(disk), preload=["torch", "torch.distributed", "unickpt", "unickpt.testing"])
    assert unickpt.verify(str(disk / "ckpt")).ok


# ------------------------------------------------------------------ item 9: overwrite


def test_overwrite_with_a_bad_state_keeps_the_good_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    good = _state(1)
    unickpt.save(good, path)
    with pytest.raises(unickpt.SaveError, match="'cfg.fn'"):
        unickpt.save({"cfg": {"fn": print}}, path, overwrite=True)
    assert unickpt.verify(path).ok and _loaded_equals(path, good)
    assert sorted(os.listdir(path)) == ["manifest.json", "rank_00000.safetensors"]


def _overwrite_forever(path: str, states: list[dict]) -> None:
    k = 0
    while True:
        unickpt.save(states[k % 2], path, overwrite=True, threads=1)
        k += 1


@pytest.mark.multiprocess
def test_sigkill_at_any_point_of_an_overwrite_leaves_the_old_or_the_new_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    states = [_state(1, numel=1 << 18), _state(2, numel=1 << 18)]  # 3 MiB each
    unickpt.save(states[1], path)
    rng = random.Random(0)
    ctx = multiprocessing.get_context("fork")
    for _ in range(6):
        p = ctx.Process(target=_overwrite_forever, args=(path, states))
        p.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert unickpt.verify(path).ok
        assert _loaded_equals(path, states[0]) or _loaded_equals(path, states[1])
    unickpt.save(states[0], path, overwrite=True)  # the leftovers of the killed saves are cleaned
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # a CheckpointManager cleans what a save killed midway left, on its next save
    manager = unickpt.CheckpointManager(str(tmp_path / "run"))
    p = ctx.Process(target=_manager_saves_forever, args=(manager, states))
    p.start()
    time.sleep(0.4)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    last = manager.steps()[-1]
    assert manager.latest(verify=True) == manager.path_for(last)
    manager.save(states[0], last + 1)
    assert sorted(os.listdir(manager.root)) == [os.path.basename(manager.path_for(s)) for s in manager.steps()]


def _manager_saves_forever(manager, states: list[dict]) -> None:
    for step in range(10**6):
        manager.save(states[step % 2], step, threads=1)


# ------------------------------------------------------------------ item 10: concurrent saves


def _racer(me: int, root: str, rounds: int, overwrite: bool, barrier, results) -> None:
    sd = _state(10 + me, n=2 + me, numel=1 << 15)  # racer 0 saves a, b; racer 1 a, b, c
    manager = unickpt.CheckpointManager(root)
    for k in range(rounds):
        barrier.wait(timeout=60)
        try:
            if k % 2 and not overwrite:
                manager.save(sd, k)
            else:
                unickpt.save(sd, manager.path_for(k), overwrite=overwrite)
            results.put((k, me, "ok"))
        except unickpt.UnickptError as e:
            results.put((k, me, f"{type(e).__name__}: {e}"))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results.put((k, me, f"CRASH {type(e).__name__}: {e}"))


def _race(root: str, rounds: int, overwrite: bool) -> dict[int, dict[int, str]]:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(me, root, rounds, overwrite, barrier, results)) for me in (0, 1)]
    for p in procs:
        p.start()
    out: dict[int, dict[int, str]] = {}
    for _ in range(2 * rounds):
        k, me, text = results.get(timeout=120)
        out.setdefault(k, {})[me] = text
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_saving_to_one_path(tmp_path, overwrite):
    root, rounds = str(tmp_path), 20 if not overwrite else 10
    manager = unickpt.CheckpointManager(root)
    states = [_state(10 + me, n=2 + me, numel=1 << 15) for me in (0, 1)]
    if overwrite:
        for k in range(rounds):
            unickpt.save(_state(99, numel=1 << 15), manager.path_for(k))
    results = _race(root, rounds, overwrite)
    for k in range(rounds):
        path, by = manager.path_for(k), results[k]
        winners = [me for me, text in by.items() if text == "ok"]
        for text in by.values():  # the loser: the other's save in progress, or already committed
            assert (text == "ok" or (text.startswith("SaveError: ") and "in progress" in text)
                    or (text.startswith("CheckpointExistsError: ") and "already holds a committed checkpoint" in text)), text
        if not overwrite:
            assert len(winners) <= 1, f"round {k}: both saves returned OK: {by}"
        assert winners, f"round {k}: no save succeeded: {by}"
        assert unickpt.verify(path).ok and manager.is_valid(path, verify=True)
        assert any(_loaded_equals(path, states[me]) for me in winners)
    assert manager.latest(verify=True) == manager.path_for(rounds - 1)
    assert not [n for n in os.listdir(root) if n.startswith(".")]
    for k in range(rounds):
        assert sorted(os.listdir(manager.path_for(k)))[0] == "manifest.json"


# ------------------------------------------------------------------ item 11: planted links


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["directory", "mount point"])
def test_links_planted_in_the_target_are_replaced_never_written_through(tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = {n: outside / n for n in ("data", "manifest_tmp", "manifest_tmp2")}
    for n, p in victims.items():
        p.write_bytes(f"precious {n}".encode())
    path = tmp_path / "ckpt"
    if where == "mount point":
        _mount_small_disk(path)
    else:
        path.mkdir()
    try:
        os.symlink(victims["data"], path / "rank_00000.safetensors")
        os.symlink(victims["manifest_tmp"], path / ".manifest.json.tmp")
        first, second = _state(1), _state(2)
        unickpt.save(first, str(path))
        assert unickpt.verify(str(path)).ok and _loaded_equals(path, first)
        os.symlink(victims["manifest_tmp2"], path / "rank_00000.safetensors.tmp")
        unickpt.save(second, str(path), overwrite=True)
        assert unickpt.verify(str(path)).ok and _loaded_equals(path, second)
        for n, p in victims.items():
            assert p.read_bytes() == f"precious {n}".encode(), f"{n} was written through a link"
        assert not (path / "rank_00000.safetensors").is_symlink()
    finally:
        if where == "mount point":
            subprocess.run(["umount", "-l", str(path)], check=False)


# ------------------------------------------------------------------ a failed convert


@pytest.fixture
def corrupt_source(tmp_path):
    """A checkpoint whose last tensor is corrupted: a conversion fails after writing the others."""
    src = str(tmp_path / "src")
    sd = {"model": {f"layer{i}.weight": torch.randn(64, 256) for i in range(4)}}
    unickpt.save(sd, src)
    data = os.path.join(src, "rank_00000.safetensors")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return src


@pytest.mark.parametrize("to", ["unickpt", "dcp", "hf"])
def test_failed_conversion_leaves_no_partial_output(tmp_path, corrupt_source, to):
    from unickpt.adapters.dcp_writer import write_dcp
    from unickpt.adapters.hf_export import export_hf

    def run(dst):
        if to == "unickpt":
            unickpt.convert(corrupt_source, dst, buffer_bytes=64 << 10, threads=1)
        elif to == "dcp":
            write_dcp(corrupt_source, dst, threads=1, buffer_bytes=64 << 10)
        else:
            export_hf(corrupt_source, dst, max_shard_size="100KB", threads=1)

    fresh = tmp_path / "fresh"
    with pytest.raises(unickpt.CorruptionError):
        run(str(fresh))
    assert not fresh.exists()
    kept = tmp_path / "kept"  # a directory the user made: it stays, with what it held
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(unickpt.CorruptionError):
        run(str(kept))
    assert os.listdir(kept) == ["notes.txt"] and (kept / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------ exports replace their folder whole


def _files(folder) -> dict[str, bytes]:
    """Every entry of ``folder``: a file's bytes, None for a directory."""
    return {n: (folder / n).read_bytes() if (folder / n).is_file() else None for n in sorted(os.listdir(folder))}


def _exports(seed: int, tmp_path) -> tuple[str, str]:
    """Two checkpoints whose HF exports differ in every shard and in the shard count."""
    big = str(tmp_path / f"src{seed}")
    unickpt.save(_state(seed, numel=1 << 16), big)  # 3 tensors of 256 KiB
    return big, str(tmp_path / f"bad{seed}")


def _corrupt_last_tensor(src: str, dst: str) -> None:
    """A copy of checkpoint ``src`` whose last tensor's bytes are damaged (found by the
    checksums when the export reaches it, after the first shards are written)."""
    import shutil

    shutil.copytree(src, dst)
    data = os.path.join(dst, "rank_00000.safetensors")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.seek(size - 100)
        f.write(b"\xff" * 8)


def test_a_failed_hf_export_over_an_old_one_leaves_the_old_one_whole(tmp_path):
    from unickpt.adapters.hf_export import export_hf

    first, _ = _exports(1, tmp_path)
    second, bad = _exports(2, tmp_path)
    _corrupt_last_tensor(second, bad)
    out = tmp_path / "hf"
    export_hf(first, str(out), max_shard_size="300KB", names="keep")
    (out / "tokenizer.json").write_text("{}")  # a file of the user's, kept by every export
    before = _files(out)
    assert len([n for n in before if n.endswith(".safetensors")]) == 3
    with pytest.raises(unickpt.CorruptionError):
        export_hf(bad, str(out), max_shard_size="600KB", names="keep", overwrite=True)
    assert _files(out) == before  # old shards, index and the user's file; no staging, no lock left
    report = export_hf(second, str(out), max_shard_size="600KB", names="keep", overwrite=True)
    assert sorted(os.listdir(out)) == sorted(report.shards + ["model.safetensors.index.json", "tokenizer.json"])
    assert len(report.shards) == 2  # the third old shard is gone with the old export
    from safetensors.torch import load_file

    got = {k: v for s in report.shards for k, v in load_file(str(out / s)).items()}
    assert got.keys() == {"a", "b", "c"} and all(torch.equal(got[k], _state(2, numel=1 << 16)["model"][k]) for k in got)


def _export_then_hang(src: str, dst: str) -> None:
    from unickpt.adapters.hf_export import export_hf

    def stall(_n: int) -> None:
        time.sleep(3600)  # killed here, after the first tensor of the new export is written

    export_hf(src, dst, max_shard_size="300KB", names="keep", overwrite=True, progress=stall)


def _kill_once_staging(target, source, out) -> None:
    """Run ``target(source, out)`` in a forked process and SIGKILL it once its hidden
    staging directory appeared in ``out`` (and it had a moment to write into it)."""
    p = multiprocessing.get_context("fork").Process(target=target, args=(source, str(out)))
    p.start()
    deadline = time.monotonic() + 60
    while not any(n.startswith(".unickpt-") for n in os.listdir(out)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.join()


@pytest.mark.multiprocess
def test_sigkill_during_an_hf_export_over_an_old_one_leaves_the_old_one_whole(tmp_path):
    from unickpt.adapters.hf_export import export_hf

    first, _ = _exports(1, tmp_path)
    second, _ = _exports(2, tmp_path)
    out = tmp_path / "hf"
    export_hf(first, str(out), max_shard_size="600KB", names="keep")
    before = _files(out)
    _kill_once_staging(_export_then_hang, second, out)
    left = {n: d for n, d in _files(out).items() if not n.startswith(".unickpt")}  # the killed write's staging stays
    assert left == before
    export_hf(second, str(out), max_shard_size="300KB", names="keep", overwrite=True)  # and is removed by the next
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_a_failed_dcp_write_over_an_old_one_leaves_it_loadable(tmp_path):
    import torch.distributed.checkpoint as dcp

    from unickpt.adapters.dcp_writer import write_dcp

    first, _ = _exports(1, tmp_path)
    second, bad = _exports(2, tmp_path)
    _corrupt_last_tensor(second, bad)
    out = tmp_path / "dcp"
    write_dcp(first, str(out))
    before = _files(out)
    with pytest.raises(unickpt.CorruptionError):
        write_dcp(bad, str(out), overwrite=True)
    assert _files(out) == before
    target = {"model": {k: torch.zeros(1 << 16) for k in "abc"}}
    dcp.load(target, checkpoint_id=str(out))
    assert all(torch.equal(target["model"][k], _state(1, numel=1 << 16)["model"][k]) for k in "abc")
    write_dcp(second, str(out), overwrite=True)
    dcp.load(target, checkpoint_id=str(out))
    assert all(torch.equal(target["model"][k], _state(2, numel=1 << 16)["model"][k]) for k in "abc")
    assert not [n for n in os.listdir(out) if n.startswith(".unickpt")]


# ------------------------------------------------------------------ convert --to deepspeed --overwrite


def _universal_source(seed: int, tmp_path) -> str:
    """A checkpoint with parameters of 1 MiB (written by direct whole-file writes) and their Adam state."""
    g = torch.Generator().manual_seed(seed)
    model = {k: torch.randn(1 << 18, generator=g) for k in "abc"}
    state = {"model": model, "optim": {"state": {k: {"exp_avg": v * 2, "step": torch.tensor(3.0)} for k, v in model.items()}},
             "train": {"step": 3}}
    path = str(tmp_path / f"usrc{seed}")
    unickpt.save(state, path)
    return path


def _tree(folder) -> dict[str, bytes]:
    """Every file below ``folder`` (not the hidden leftovers of a killed write) and its bytes."""
    out = {}
    for d, dirs, files in os.walk(folder):
        dirs[:] = [n for n in dirs if not n.startswith(".unickpt")]
        for n in files:
            if not n.startswith(".unickpt"):
                out[os.path.relpath(os.path.join(d, n), folder)] = open(os.path.join(d, n), "rb").read()
    return out


def _universal_is(out, seed: int, tmp_path) -> None:
    """``out`` loads (torch.load and our reader) as the universal checkpoint of source ``seed``."""
    from unickpt.adapters.checkpoint import open_checkpoint

    g = torch.Generator().manual_seed(seed)
    for k in "abc":
        assert torch.equal(torch.load(out / "zero" / k / "fp32.pt", weights_only=True)["param"],
                           torch.randn(1 << 18, generator=g))
    assert sorted(open_checkpoint(str(out)).manifest.tensors) == sorted(
        [f"model.{k}" for k in "abc"] + [f"optim.state.{k}.exp_avg" for k in "abc"] + [f"optim.state.{k}.step" for k in "abc"])


@pytest.mark.parametrize("exchange", ["renameat2", "aside"])
def test_a_failed_universal_write_over_an_old_one_leaves_it_loadable(tmp_path, monkeypatch, exchange):
    from unickpt.adapters.deepspeed_writer import write_universal

    if exchange == "aside":
        monkeypatch.setenv("UNICKPT_NO_RENAME_EXCHANGE", "1")
    first, second = _universal_source(1, tmp_path), _universal_source(2, tmp_path)
    bad = str(tmp_path / "bad")
    _corrupt_last_tensor(second, bad)
    out = tmp_path / "uni" / "step3"
    write_universal(first, str(out))
    (out / "notes.txt").write_text("mine")  # a file of the user's: never touched
    before = _tree(out)
    with pytest.raises(unickpt.CorruptionError):
        write_universal(bad, str(out), overwrite=True)
    assert _tree(out) == before and not [n for n in os.listdir(out) if n.startswith(".unickpt")]
    assert (tmp_path / "uni" / "latest_universal").read_text() == "step3"
    _universal_is(out, 1, tmp_path)
    write_universal(second, str(out), overwrite=True)
    _universal_is(out, 2, tmp_path)
    assert (out / "notes.txt").read_text() == "mine" and not [n for n in os.listdir(out) if n.startswith(".")]


def _universal_then_hang(src: str, dst: str) -> None:
    from unickpt.adapters.deepspeed_writer import write_universal

    def stall(_n: int) -> None:
        time.sleep(3600)  # killed here, after the first file of the new checkpoint is written

    write_universal(src, dst, overwrite=True, progress=stall)


@pytest.mark.multiprocess
def test_sigkill_during_a_universal_overwrite_leaves_the_old_one_whole(tmp_path):
    from unickpt.adapters.deepspeed_writer import write_universal

    first, second = _universal_source(1, tmp_path), _universal_source(2, tmp_path)
    out = tmp_path / "uni" / "step3"
    write_universal(first, str(out))
    before = _tree(out)
    _kill_once_staging(_universal_then_hang, second, out)
    assert _tree(out) == before  # the killed write's staging directory stays, hidden
    assert (tmp_path / "uni" / "latest_universal").read_text() == "step3"
    _universal_is(out, 1, tmp_path)
    write_universal(second, str(out), overwrite=True)  # removes it
    _universal_is(out, 2, tmp_path)
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_the_next_universal_write_restores_a_tree_a_crashed_fallback_commit_moved_aside(tmp_path):
    from unickpt.adapters.deepspeed_writer import write_universal

    first = _universal_source(1, tmp_path)
    out = tmp_path / "uni" / "step3"
    write_universal(first, str(out))
    before = _tree(out)
    # the state a crash leaves between renaming the old zero/ aside and the new one in
    aside = out / ".unickpt-0123456789abcdef" / ".aside"
    aside.mkdir(parents=True)
    os.rename(out / "zero", aside / "zero")
    with pytest.raises(unickpt.SaveError, match="already holds"):
        write_universal(first, str(out))  # without overwrite: it finds the old checkpoint back in place
    assert _tree(out) == before and not [n for n in os.listdir(out) if n.startswith(".")]
    _universal_is(out, 1, tmp_path)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_save_cut_off_in_its_commit_gives_its_directory_up(tmp_path, monkeypatch, how):
    """The commit's collective fails (a peer lost, live recovery cutting the group: here
    the gather of the ranks' reports raises as gloo does): rank 0's claim on the directory
    (its lock, its staging directory) is given up before the error goes on, so the same
    step saved again (the survivors redo it) commits instead of being refused as "another
    save in progress", and nothing of the failed save is left behind."""
    from unickpt.engine import commit as commit_mod

    def lost(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")  # what gloo raises when a peer vanished

    path = tmp_path / "step_00000006"
    state = {"w": torch.arange(1000.0), "b": torch.ones(7)}
    monkeypatch.setattr(commit_mod, "gather_bytes", lost)
    with pytest.raises(Exception, match="Connection closed by peer"):
        if how == "save":
            unickpt.save(state, str(path))
        else:
            unickpt.async_save(state, str(path)).result()
    assert os.listdir(tmp_path) == []  # no lock, no staging directory
    monkeypatch.undo()
    unickpt.save({k: v + 1 for k, v in state.items()}, str(path))  # the redo of the step
    out = {k: torch.empty_like(v) for k, v in state.items()}
    unickpt.load(out, str(path))
    assert all(torch.equal(out[k], v + 1) for k, v in state.items())
