"""The per-step delta log (--log-deltas) with real processes and a real SIGKILL.

One run of the example trainer on 2 ranks (FSDP2) is SIGKILLed between full checkpoints
(every 5 steps) after step 8 is logged; the newest logged entry is then truncated, as a
write cut short would leave it. Relaunched with the same flags, the trainer loads the
full checkpoint of step 5, replays the intact entries, names the torn one in its line,
and from there on matches an unbroken run without the log bitwise (losses, weights,
moments); relaunched on other layouts (1 rank; TP 2) the log reshards and the losses
agree within 1e-4 relative.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch

import unickpt
from unickpt.testing import kill_session, run_ranks

from snapshot_helpers import TINY, launch_nodes, losses, resumed_lines
from train_cases import train_many_printing

K = 5
FLAGS = [*TINY, "--save-every", str(K), "--ckpt-dir", "ck", "--log-deltas", "--print-every", "0"]


def _committed(log_root: str) -> list[int]:
    return unickpt.CheckpointManager(log_root).steps()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The crashed run (its newest entry then truncated), relaunched on its own layout and
    on TP 2 (copies of its directory), and the unbroken reference, all run here; returns
    the directory and the newest entry's step."""
    tmp = tmp_path_factory.mktemp("deltas")
    log = str(tmp / "run.jsonl")
    procs = launch_nodes(tmp, [str(tmp / "shm")], [*FLAGS, "--fsdp", "--loss-log", log, "--compute-sleep", "0.25"], nproc=2)
    deltas = str(tmp / "ck" / "deltas")
    try:
        deadline = time.monotonic() + 180
        while not (os.path.isdir(deltas) and max(_committed(deltas), default=0) >= 8):
            assert procs[0].poll() is None, "the run ended before step 8 was logged"
            assert time.monotonic() < deadline, "timed out waiting for step 8's entry"
            time.sleep(0.02)
    finally:
        kill_session(procs[0])
    assert procs[0].returncode != 0
    full = unickpt.CheckpointManager(tmp / "ck").steps()
    logged = _committed(deltas)
    assert full == [K] and logged[0] == K + 1, (full, logged)  # entries up to step 5 were folded away
    newest = logged[-1]
    data = os.path.join(deltas, f"step_{newest:08d}", "rank_00001.safetensors")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)
    for layout in ("1", "tp2"):
        shutil.copytree(tmp / "ck", tmp / f"ck_{layout}")
    # for TP 2, also one flipped byte in the middle of the entry before: sizes and manifest
    # intact, only the checksums of the rank(s) that read it can tell
    flipped = os.path.join(tmp / "ck_tp2" / "deltas", f"step_{newest - 1:08d}", "rank_00000.safetensors")
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    shutil.copy(log, tmp / "fsdp.jsonl")
    jobs = [
        ([*TINY, "--fsdp", "--save-every", str(K), "--ckpt-dir", str(tmp / "ref")], str(tmp / "ref.json")),
        ([*FLAGS, "--fsdp", "--ckpt-dir", str(tmp / "ck"), "--loss-log", str(tmp / "fsdp.jsonl")], str(tmp / "fsdp.json")),
        ([*FLAGS, "--tp", "2", "--ckpt-dir", str(tmp / "ck_tp2")], str(tmp / "tp2.json")),
    ]
    run_ranks(train_many_printing, 2, jobs, preload=["unickpt.examples.train"])
    return tmp, newest


def _records(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in json.load(open(path))}


@pytest.mark.multiprocess
def test_relaunch_replays_the_log_bitwise_and_skips_the_torn_entry(runs):
    tmp, newest = runs
    want = _records(tmp / "ref.json")
    lines = resumed_lines([open(tmp / "fsdp.json.stdout").read()])
    s = newest - 1
    assert len(lines) == 1 and re.fullmatch(
        rf"resumed step {s} from disk \+ {s - K} logged steps \(.*step_0000000{K}; replayed steps {K + 1}\.\.{s}; "
        rf"step {newest}: torn entry \(rank_00001\.safetensors: \d+ of \d+ bytes\), not replayed; .* s\)", lines[0]), lines
    got = losses(str(tmp / "fsdp.jsonl"))
    assert sorted(got) == list(range(1, 11)) and all(got[k] == want[k] for k in got), (got, want)
    a, b = str(tmp / "ck" / "step_00000010"), str(tmp / "ref" / "step_00000010")
    names = set(unickpt.read_manifest(a).tensors)
    assert names == set(unickpt.read_manifest(b).tensors) and any(n.endswith("exp_avg_sq") for n in names)
    for name in names:
        assert torch.equal(unickpt.load_tensor(a, name), unickpt.load_tensor(b, name)), name
    # the full checkpoint of step 10 covers every entry: the log is empty, nothing torn is left
    assert os.listdir(tmp / "ck" / "deltas") == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1", "tp2"])
def test_relaunch_on_another_layout_reshards_the_log(runs, layout):
    tmp, newest = runs
    want = _records(tmp / "ref.json")
    out = tmp / f"{layout}.json"
    first = newest
    if layout == "1":
        import contextlib
        import io

        from unickpt.examples.train import run

        # and the entry before the truncated one uncommitted, as a write killed before its
        # manifest leaves it: the replay stops one step earlier and says why
        first = newest - 1
        os.remove(tmp / "ck_1" / "deltas" / f"step_{first:08d}" / "manifest.json")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            json.dump(run([*FLAGS, "--ckpt-dir", str(tmp / "ck_1")]), open(out, "w"))
        assert re.search(rf"^resumed step {first - 1} from disk \+ {first - 1 - K} logged steps \(.*; "
                         rf"step {first}: torn entry \(no commit marker\), not replayed; 1 later entries", printed.getvalue(),
                         re.M), printed.getvalue()
    else:  # the flipped entry ends the replay before its step is applied, on both ranks
        first = newest - 1
        lines = resumed_lines([open(f"{out}.stdout").read()])
        assert len(lines) == 1 and re.fullmatch(
            rf"resumed step {first - 1} from disk \+ {first - 1 - K} logged steps \(.*; replayed steps {K + 1}\.\.{first - 1}; "
            rf"step {first}: entry fails its checks \(.*checksum.*\), not replayed; "
            rf"step {newest}: torn entry .*", lines[0]), lines
    got = _records(out)
    assert sorted(got) == list(range(first, 11))
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-4 * abs(want[step]), (step, loss, want[step])


@pytest.mark.multiprocess
def test_with_snapshots_the_newer_of_memory_and_disk_plus_log_wins(tmp_path, monkeypatch):
    """--snapshot-every and --log-deltas together (one process): a snapshot older than the
    log's last step loses to disk + log; one as new wins; the run stays bitwise."""
    from snapshot_helpers import kill_keeper, steps_whole
    from unickpt.examples.train import run

    root = str(tmp_path / "shm")
    monkeypatch.setenv("UNICKPT_SHM_ROOT", root)
    log = str(tmp_path / "run.jsonl")
    flags = [*TINY, "--save-every", str(K), "--ckpt-dir", str(tmp_path / "ck"), "--log-deltas", "--print-every", "0",
             "--snapshot-every", "3", "--loss-log", log]
    lines = []
    try:
        for stop in ("7", "9", "10"):  # snapshots of steps 3, 6 and 9; full checkpoints of 5 and 10
            printed = __import__("io").StringIO()
            with __import__("contextlib").redirect_stdout(printed):
                run([*flags, "--stop-after", stop])
            deadline = time.monotonic() + 60
            while stop == "9" and 9 not in steps_whole(root):  # the keeper makes a snapshot whole in the background
                assert time.monotonic() < deadline, "step 9's snapshot never became whole"
                time.sleep(0.02)
            lines += [line for line in resumed_lines([printed.getvalue()]) if line.startswith("resumed")]
    finally:
        kill_keeper(root)
    assert re.fullmatch(r"resumed step 7 from disk \+ 2 logged steps \(.*step_00000005; replayed steps 6\.\.7; "
                        r"memory: step 6: older than step 7 on disk; .*\)", lines[0]), lines
    assert re.fullmatch(r"resumed step 9 from memory \(.*\)", lines[1]), lines
    ref = run([*TINY, "--print-every", "0"])
    got = losses(log)
    assert sorted(got) == list(range(1, 11)) and all(got[r["step"]] == r["loss"] for r in ref), (got, ref)


def test_bf16_entries_replay_close_to_the_exact_run(tmp_path):
    """--delta-dtype bf16 (opt-in, lossy): entries hold bfloat16 gradients, half the
    bytes, and the replayed run stays within 1e-4 of the exact one."""
    from unickpt.examples.train import run

    common = [*TINY, "--save-every", str(K), "--print-every", "0"]
    ref = {r["step"]: r["loss"] for r in run([*common, "--ckpt-dir", str(tmp_path / "ref")])}
    flags = [*common, "--ckpt-dir", str(tmp_path / "ck"), "--log-deltas", "--delta-dtype", "bf16"]
    run([*flags, "--stop-after", "8"])
    entry = unickpt.read_manifest(str(tmp_path / "ck" / "deltas" / "step_00000008"))
    grads = [e for n, e in entry.tensors.items() if n.startswith("unickpt_delta.grad.")]
    assert grads and all(e.dtype == "BF16" for e in grads)
    after = run(flags)
    assert [r["step"] for r in after] == [9, 10]
    for r in after:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-4 * abs(ref[r["step"]])
    a, b = str(tmp_path / "ck" / "step_00000010"), str(tmp_path / "ref" / "step_00000010")
    diff = max((unickpt.load_tensor(a, n) - unickpt.load_tensor(b, n)).abs().max().item()
               for n in unickpt.read_manifest(a).tensors if n.startswith("model."))
    assert 0 < diff < 1e-3, diff  # lossy, but close


def test_batch_norm_statistics_are_replayed_bitwise(tmp_path):
    """Batch norm updates its running statistics in its kernel without bumping their
    version counter: entries carry every module buffer, so a resume from the checkpoint of
    step 5 plus the logged step 6 has them bitwise (they were left at step 5's values, the
    weights right: a silently different model)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, {"model": model, "optim": opt}

    model, state = build()
    manager = unickpt.CheckpointManager(tmp_path, save_every=5, log_deltas=True)
    manager.restore(state)
    data = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        model(torch.randn(8, 4, generator=data)).pow(2).mean().backward()
        manager.before_update()
        state["optim"].step()
        state["optim"].zero_grad()
        manager.maybe_save(state, step)
    manager.close()
    again, resumed = build()
    manager = unickpt.CheckpointManager(tmp_path, save_every=5, log_deltas=True)
    assert manager.restore(resumed) == 6
    manager.close()
    for (name, want), got in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(got, want), name
