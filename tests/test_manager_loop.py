"""``unickpt.CheckpointManager`` in a user's own loop (tests/user_loop.py: FSDP2, AdamW,
an LR scheduler, clipping, dropout, a buffer no optimizer owns, a Stateful data loader),
run under real torchrun agents, killed with real SIGKILL, relaunched: every tier resumes
the run bitwise (same layout) or within 1e-4 (another number of nodes)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

import unickpt
from unickpt.testing import kill_session

from snapshot_helpers import (
    kill_keeper, launch_nodes, lose_node, losses, resumed_lines, steps_whole, wait_all, wait_for, worker_pids,
)

LOOP = os.path.join(os.path.dirname(__file__), "user_loop.py")


def _run(tmp_path, roots, flags, nproc=1, agent=(), check=True, timeout=240):
    return wait_all(launch_nodes(tmp_path, roots, flags, nproc, script=LOOP, agent=list(agent)), tmp_path,
                    timeout=timeout, check=check)


def _wait(cond, procs, what, timeout=120):
    wait_for(cond, timeout, what, procs)


def _trainers(agent) -> list[int]:
    """The pids of a node's live workers, by rank."""
    return [pid for _, pid in sorted(worker_pids(agent).items())]


def _last(log: str) -> int:
    return max(losses(log), default=0) if os.path.exists(log) else 0


def _reference(tmp_path, nproc: int, steps: int, extra=()) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """An unbroken run: its losses and final tensors."""
    ref = tmp_path / "ref"
    ref.mkdir()
    log, final = str(ref / "loss.jsonl"), str(ref / "final.pt")
    _run(ref, [str(ref / "shm")], ["--steps", str(steps), "--ckpt-dir", "ck", "--loss-log", log, "--final", final, *extra],
         nproc)
    return losses(log), torch.load(final)


# the lengths of the 2-rank runs below: one unbroken run of the longest is the reference of
# them all (a step's loss and state do not depend on how many steps the run has)
LENGTHS = (10, 14, 18, 24)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> str:
    """One unbroken 2-rank run of the user's loop (default flags) for the module: its loss
    log, and its tensors after each step of LENGTHS in final.pt_<step> (+ .json)."""
    ref = tmp_path_factory.mktemp("unbroken")
    _run(ref, [str(ref / "shm")], ["--steps", str(LENGTHS[-1]), "--ckpt-dir", "ck", "--loss-log", str(ref / "loss.jsonl"),
                                   "--final", str(ref / "final.pt"), *(f"--final-at={n}" for n in LENGTHS)], 2)
    return str(ref)


def _unbroken(ref: str, steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The unbroken 2-rank run of ``steps`` steps: its losses and tensors after the last."""
    assert steps in LENGTHS
    got = losses(os.path.join(ref, "loss.jsonl"))
    assert sorted(got) == list(range(1, LENGTHS[-1] + 1))
    return {s: v for s, v in got.items() if s <= steps}, torch.load(os.path.join(ref, f"final.pt_{steps}"))


def _same_final(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and any("exp_avg_sq" in k for k in a) and "model.1.calls" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _kill_one(procs, log: str, at: int, shm: str | None = None) -> int:
    """SIGKILL one trainer once step ``at`` is logged (and, with snapshots, whole in memory);
    returns the last step logged before the kill."""
    _wait(lambda: _last(log) >= at and (shm is None or bool(steps_whole(shm))) and len(_trainers(procs[0])) == 2,
          procs, f"step {at}")
    os.kill(_trainers(procs[0])[-1], signal.SIGKILL)
    return _last(log)


@pytest.mark.multiprocess
def test_crash_resumes_from_memory_bitwise(unbroken, tmp_path, shm_roots):
    """2 ranks, snapshots every step, no durable checkpoint yet: a SIGKILLed trainer's
    relaunch resumes from memory, and the run ends bitwise equal to an unbroken one
    (weights, moments, the buffer, scheduler, data position, dropout's RNG)."""
    steps = 14
    want_losses, want = _unbroken(unbroken, steps)
    shm = str(tmp_path / "shm")
    shm_roots.append(shm)
    log, final = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt")
    flags = ["--steps", str(steps), "--ckpt-dir", "ck", "--loss-log", log, "--snapshot-every", "1", "--save-every", "20"]
    procs = launch_nodes(tmp_path, [shm], [*flags, "--compute-sleep", "0.3"], 2, script=LOOP)
    try:
        _kill_one(procs, log, 5, shm)
    finally:
        wait_all(procs, tmp_path, check=False)
    outs = _run(tmp_path, [shm], [*flags, "--final", final], 2)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and re.fullmatch(r"resumed step \d+ from memory \(.+\)", lines[0]), outs[0][-2000:]
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1))
    assert all(got[s] == want_losses[s] for s in got), (got, want_losses)
    _same_final(torch.load(final), want)
    assert not os.path.exists(shm), os.listdir(shm)  # a clean end leaves no keeper, no shared memory, no directory


@pytest.mark.multiprocess
def test_corrupt_memory_and_no_disk_starts_fresh_from_the_initial_state(unbroken, tmp_path, shm_roots):
    """Snapshots only (no durable checkpoint): every rank file in memory has flipped bytes,
    so the memory load fails midway, after part of the state was overwritten; restore says
    why and starts fresh from the state the loop built, and the run ends bitwise equal to
    an unbroken one (nothing of the rejected snapshot leaked into it)."""
    steps = 10
    want_losses, want = _unbroken(unbroken, steps)
    shm = str(tmp_path / "shm")
    shm_roots.append(shm)
    log, final = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt")
    flags = ["--steps", str(steps), "--ckpt-dir", "ck", "--snapshot-every", "1", "--parity", "0"]
    procs = launch_nodes(tmp_path, [shm], [*flags, "--loss-log", str(tmp_path / "first.jsonl"), "--compute-sleep", "0.3"],
                         2, script=LOOP)
    try:
        _kill_one(procs, str(tmp_path / "first.jsonl"), 4, shm)
    finally:
        wait_all(procs, tmp_path, check=False)
    kill_keeper(shm)
    for dirpath, _, names in os.walk(os.path.join(shm, "unickpt")):
        for n in names:
            if n.startswith("rank_"):
                path = os.path.join(dirpath, n)
                size = os.path.getsize(path)
                with open(path, "r+b") as f:  # the model's bytes: read after the plain values are set
                    f.seek(size // 3)
                    f.write(bytes(64))
    outs = _run(tmp_path, [shm], [*flags, "--loss-log", log, "--final", final], 2)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("starting fresh (memory: step ") and "checksum" in lines[0], lines
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1)) and all(got[s] == want_losses[s] for s in got)
    _same_final(torch.load(final), want)
    assert json.load(open(final + ".json"))["samples"] == json.load(open(os.path.join(unbroken, f"final.pt_{steps}.json")))["samples"]


def _committed(ck: str) -> list[int]:
    """Steps whose delta log entry is committed (its manifest, the commit marker, in
    place): the steps the log promises to replay."""
    d = os.path.join(ck, "deltas")
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()
                  and os.path.exists(os.path.join(d, n, "manifest.json")))


# DeltaLog's back-pressure: maybe_save(s) returns once at most this many entries (s's
# included) are unwritten, so when the loop logs the loss of s, every entry up to s - 2
# is committed; s - 1 and s may still be in flight (docs/DELTAS.md, "Limits").
IN_FLIGHT = 2


@pytest.mark.multiprocess
def test_delta_log_loses_no_step_bitwise(unbroken, tmp_path):
    """Durable checkpoints every 10 steps, the delta log on, no snapshots: SIGKILL once the
    entry of step 13 is committed; the relaunch replays every committed entry (no step
    the log holds is lost; only the entries in flight when the kill came, at most
    IN_FLIGHT steps behind the last loss logged) and ends bitwise.

    A step counts as logged when its entry's commit marker is on disk, not when the loop
    has written its loss: maybe_save only queues the entry, written in the background."""
    steps = 18
    want_losses, want = _unbroken(unbroken, steps)
    log, final, ck = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt"), str(tmp_path / "ck")
    flags = ["--steps", str(steps), "--ckpt-dir", "ck", "--loss-log", log, "--save-every", "10", "--log-deltas",
             "--async-save"]
    procs = launch_nodes(tmp_path, [str(tmp_path / "shm")], [*flags, "--compute-sleep", "0.3"], 2, script=LOOP)
    try:
        _wait(lambda: 13 in _committed(ck) and len(_trainers(procs[0])) == 2, procs, "the entry of step 13")
        committed = _committed(ck)[-1]
        os.kill(_trainers(procs[0])[-1], signal.SIGKILL)
    finally:
        wait_all(procs, tmp_path, check=False)
    # every trainer is gone: these entries are what the relaunch finds (those up to 10 the
    # checkpoint of step 10 covers, folded away unless the kill came first)
    logged, on_disk = _last(log), [s for s in _committed(ck) if s > 10]
    print(f"kill: entry {committed} committed, loss of step {logged} logged, entries {on_disk} on disk")
    assert on_disk == list(range(11, on_disk[-1] + 1)) and on_disk[-1] >= committed >= 13, on_disk
    outs = _run(tmp_path, [str(tmp_path / "shm")], [*flags, "--final", final], 2)
    lines = resumed_lines(outs)
    m = re.fullmatch(r"resumed step (\d+) from disk \+ (\d+) logged steps \(.*step_00000010; replayed steps 11\.\.\d+.*\)",
                     lines[0]) if len(lines) == 1 else None
    assert m, outs[0][-2000:]
    assert int(m.group(1)) == on_disk[-1] and int(m.group(2)) == int(m.group(1)) - 10, (lines[0], on_disk)
    assert int(m.group(1)) >= logged - IN_FLIGHT, (lines[0], logged)
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1)) and all(got[s] == want_losses[s] for s in got)
    _same_final(torch.load(final), want)


@pytest.mark.multiprocess
def test_node_lost_resumes_on_fewer_nodes(tmp_path, shm_roots):
    """4 simulated nodes (one rank each), XOR parity: one node lost (keeper killed, memory
    gone) -> the job resumes on the 3 others from memory, its files decoded from parity,
    and the losses continue those of the unbroken 4-node run within 1e-4."""
    steps = 16
    flags0 = ["--steps", str(steps), "--dropout", "0"]
    want_losses, _ = _reference(tmp_path, 4, steps, flags0)
    roots = [str(tmp_path / f"shm{i}") for i in range(4)]
    shm_roots.extend(roots)
    log = str(tmp_path / "loss.jsonl")
    flags = [*flags0, "--ckpt-dir", "ck", "--loss-log", log, "--snapshot-every", "1", "--parity", "1"]
    procs = launch_nodes(tmp_path, roots, [*flags, "--compute-sleep", "0.3"], 1, script=LOOP)
    try:
        _wait(lambda: _last(log) >= 4 and bool(steps_whole(roots[3])), procs, "step 4")
    finally:
        for p in procs:  # every node's agent and trainers die at once (the keepers live on)
            kill_session(p)
        wait_all(procs, tmp_path, check=False)
    lose_node(roots[2])
    outs = _run(tmp_path, [roots[0], roots[1], roots[3]], flags, 1)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and re.fullmatch(r"resumed step \d+ from memory \(node 2 of 4 lost: its files decoded from "
                                            r"XOR parity during the load on 3 nodes.*\)", lines[0]), outs[0][-2000:]
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1))
    for s in got:
        assert abs(got[s] - want_losses[s]) <= 1e-4 * abs(want_losses[s]), (s, got[s], want_losses[s])


@pytest.mark.multiprocess
def test_torchrun_restarts_recover_by_themselves(unbroken, tmp_path, shm_roots):
    """torchrun --max-restarts: three SIGKILLs in one run; torchrun restarts the workers,
    each round resumes from memory, the job ends with exit 0, bitwise equal.

    Under torchrun the agent's store (and every key in it) lives for the whole job, and
    process-group names repeat from round to round: before unickpt deleted its groups'
    rendezvous keys (and the default group's) once joined, the relaunched workers read the
    dead workers' addresses and died in gloo's connectFullMesh ("Connection refused")."""
    steps = 24
    want_losses, want = _unbroken(unbroken, steps)
    shm = str(tmp_path / "shm")
    shm_roots.append(shm)
    log, final = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt")
    flags = ["--steps", str(steps), "--ckpt-dir", "ck", "--loss-log", log, "--snapshot-every", "1", "--save-every", "20",
             "--final", final, "--compute-sleep", "0.3"]
    procs = launch_nodes(tmp_path, [shm], flags, 2, script=LOOP, agent=["--max-restarts=3", "--monitor-interval=0.2"])
    for at in (3, 7, 11):
        _kill_one(procs, log, at, shm)
        _wait(lambda: len(_trainers(procs[0])) == 2 and _last(log) > at + 1, procs, f"the restart after {at}")
    outs = wait_all(procs, tmp_path)
    assert procs[0].returncode == 0
    assert not any("connectFullMesh" in out for out in outs), outs[0][-3000:]
    lines = resumed_lines(outs)
    assert len(lines) == 4 and lines[0].startswith("starting fresh"), lines
    assert all(re.fullmatch(r"resumed step \d+ from memory \(.+\)", line) for line in lines[1:]), lines
    got = losses(log)
    assert all(got[s] == want_losses[s] for s in got)
    _same_final(torch.load(final), want)


@pytest.mark.multiprocess
def test_durable_tier_fallback(unbroken, tmp_path):
    """The fast tier's newest checkpoint corrupt: restore loads the durable tier's copy of
    the same step (the line names it) and the run ends bitwise."""
    steps = 14
    want_losses, want = _unbroken(unbroken, steps)
    log, final = str(tmp_path / "loss.jsonl"), str(tmp_path / "final.pt")
    durable = str(tmp_path / "durable")
    flags = ["--ckpt-dir", "ck", "--loss-log", log, "--save-every", "5", "--durable", durable]
    _run(tmp_path, [str(tmp_path / "shm")], ["--steps", str(steps), "--stop-after", "11", *flags], 2)
    data = tmp_path / "ck" / "step_00000010" / "rank_00001.safetensors"
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 9)
        f.write(b"\xff")
    outs = _run(tmp_path, [str(tmp_path / "shm")], ["--steps", str(steps), *flags, "--final", final], 2)
    lines = resumed_lines(outs)
    assert len(lines) == 1 and lines[0].startswith("resumed step 10 from disk (") and "durable" in lines[0], outs[0][-2000:]
    got = losses(log)
    assert all(got[s] == want_losses[s] for s in got)
    _same_final(torch.load(final), want)


# -- construction and refusals (one process, no process group) -------------------------
@pytest.mark.parametrize("kwargs, says", [
    ({"parity": 1}, "set snapshot_every"),
    ({"snapshot_every": 1, "parity": 1, "snapshot_replicas": 2}, "exclude each other"),
    ({"log_deltas": True}, "needs save_every"),
    ({"delta_dtype": "bf16"}, "set log_deltas"),
    ({"save_every": -1}, "save_every must be"),
    ({"snapshot_every": 1, "flush_every": 2, "save_every": 1, "root": "s3://bucket/run"}, "needs a local root"),
    ({"log_deltas": True, "save_every": 5, "delta_dtype": "fp8"}, "delta_dtype must be"),
])
def test_bad_options_are_one_clear_error(tmp_path, kwargs, says):
    root = kwargs.pop("root", str(tmp_path / "ck"))
    with pytest.raises(unickpt.UnickptError, match=says):
        unickpt.CheckpointManager(root, **kwargs)


def test_steps_that_cannot_be_replayed_are_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = unickpt.CheckpointManager(str(tmp_path / "ck"), save_every=5, log_deltas=True)
    with pytest.raises(unickpt.UnickptError, match="LBFGS"):
        manager.restore({"model": model, "optim": torch.optim.LBFGS(model.parameters())})
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(unickpt.UnickptError, match="GradScaler"):
        manager.restore({"model": model, "optim": torch.optim.SGD(model.parameters()), "scaler": scaler})


def test_single_process_loop_replays_deltas_bitwise(tmp_path, capsys):
    """No process group at all: a loop checkpointing every 4 steps with the delta log; the
    state after 'losing' everything since step 4 comes back bitwise by replay."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return model, opt, sched, {"model": model, "optim": opt, "sched": sched, "rng": unickpt.RNGState(), "epoch": 0}

    def train(state, manager, first, last):
        model, opt, sched = state["model"], state["optim"], state["sched"]
        for step in range(first, last + 1):
            x = torch.randn(5, 4)
            loss = model(torch.nn.functional.dropout(x, 0.2)).pow(2).mean()
            loss.backward()
            manager.before_update()
            opt.step()
            sched.step()
            opt.zero_grad()
            state["epoch"] = step // 3
            manager.maybe_save(state, step)

    root = str(tmp_path / "ck")
    _, _, _, state = make()
    manager = unickpt.CheckpointManager(root, save_every=4, log_deltas=True)
    assert manager.restore(state) == 0
    train(state, manager, 1, 7)
    manager._deltas.log.flush()
    want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    want_opt = state["optim"].state_dict()
    want_rng = torch.get_rng_state()
    # the job dies here (no close); a new process builds everything afresh
    _, _, sched, again = make()
    torch.manual_seed(99)
    back = unickpt.CheckpointManager(root, save_every=4, log_deltas=True)
    assert back.restore(again) == 7
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("resumed step 7 from disk + 3 logged steps (") and "replayed steps 5..7" in line, line
    for k, v in again["model"].state_dict().items():
        assert torch.equal(v, want[k]), k
    got_opt = again["optim"].state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    for k, st in want_opt["state"].items():
        for name, v in st.items():
            assert torch.equal(got_opt["state"][k][name], v), (k, name)
    assert sched.state_dict() == state["sched"].state_dict() and again["epoch"] == 2
    assert torch.equal(torch.get_rng_state(), want_rng)
    back.close()
    manager.close()


def test_example_trainer_uses_only_public_names():
    """The example trainer reads like what a user copies: it imports unickpt and its own
    model and data modules, and uses only names unickpt exports."""
    import ast

    import unickpt.examples.train as train

    tree = ast.parse(open(train.__file__).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1 and node.module in ("data", "model") or (node.level == 0 and not (
                node.module or "").startswith("unickpt")), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert all(a.name == "unickpt" or not a.name.startswith("unickpt") for a in node.names), ast.dump(node)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "unickpt":
            assert node.attr in unickpt.__all__, node.attr
    assert not os.path.exists(os.path.join(os.path.dirname(train.__file__), "delta_replay.py"))


FULL_DISK_LOOP = """
import resource, signal, sys, torch, unickpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk fails
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
manager = unickpt.CheckpointManager(sys.argv[1], save_every=4, log_deltas=True)
manager.restore({"model": model, "optim": opt})
for step in range(1, 4):
    model(torch.randn(4, 64)).sum().backward()
    manager.before_update()
    opt.step()
    opt.zero_grad()
    manager.maybe_save({"model": model, "optim": opt}, step)
manager.close()
print(manager.stats()["delta_entries_failed"])
"""


@pytest.mark.multiprocess
def test_a_failed_delta_entry_is_told_with_its_cause(tmp_path):
    """A delta entry whose write fails (a full disk; here a file-size limit) is told with
    its cause: the SaveError's first line alone ("save failed, nothing was committed:")
    used to be all the warning said."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FULL_DISK_LOOP, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    failed = int(r.stdout.split()[-1])  # 1 to 3: the entries queued before the first failure is seen fail too
    told = [line for line in r.stderr.splitlines() if "a delta log entry failed" in line]
    assert failed >= 1 and len(told) == failed and all(re.search(r"committed: rank 0: cannot write \S+/deltas/\.step_0000000\d\.unickpt-\w+/"
                                            r"rank_00000\.safetensors: File too large \(EFBIG\)$", t) for t in told), told


@pytest.mark.parametrize("restored", [True, False])
def test_a_step_missing_from_the_delta_log_says_why(tmp_path, caplog, restored):
    """A step without an entry is counted and told with its cause: ``before_update()`` not
    called, or called before the log started (no ``restore()``: it starts at the first save,
    after step 1's update), which it used to call "not called" too."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    manager = unickpt.CheckpointManager(tmp_path / "ck", save_every=4, log_deltas=True)
    if restored:
        manager.restore(state)
    for step in (1, 2, 3):
        model(torch.randn(4, 3)).sum().backward()
        if step != 2:
            manager.before_update()
        opt.step()
        opt.zero_grad()
        manager.maybe_save(state, step)
    manager.close()
    missed = [r.getMessage() for r in caplog.records if "is not in the delta log" in r.getMessage()]
    want = ([] if restored else ["unickpt: step 1 is not in the delta log: before_update() came before the log started "
                                 "(call restore(state) before the loop)"])
    want.append("unickpt: step 2 is not in the delta log: before_update() was not called before optimizer.step()")
    assert missed == want and manager.stats()["delta_steps_missed"] == len(want), missed


def test_a_failed_delta_entry_warns_counts_and_training_goes_on(tmp_path):
    """One delta entry cannot be written (a file stands where its directory goes): the
    loop goes on, the manager warns and counts it, and a restore replays exactly the steps
    before the gap."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    root = str(tmp_path / "ck")
    manager = unickpt.CheckpointManager(root, save_every=4, log_deltas=True)
    manager.restore(state)
    os.makedirs(os.path.join(root, "deltas"), exist_ok=True)
    open(os.path.join(root, "deltas", "step_00000006"), "w").close()
    for step in range(1, 8):
        model(torch.randn(4, 3)).sum().backward()
        manager.before_update()
        opt.step()
        opt.zero_grad()
        manager.maybe_save(state, step)
        if step == 5:
            want = {k: v.clone() for k, v in model.state_dict().items()}
    manager.close()
    stats = manager.stats()  # the failure shows at the next entry or, for the last ones, at close()
    assert stats["delta_entries_failed"] == 1 and "delta log entry failed" in stats["last_error"], stats
    os.unlink(os.path.join(root, "deltas", "step_00000006"))
    again = {"model": torch.nn.Linear(3, 2), "optim": None}
    again["optim"] = torch.optim.SGD(again["model"].parameters(), lr=0.1)
    back = unickpt.CheckpointManager(root, save_every=4, log_deltas=True)
    assert back.restore(again) == 5  # step 4's checkpoint + step 5; nothing after the failed entry
    assert "+ 1 logged steps" in back.restored_line and "replayed steps 5..5" in back.restored_line, back.restored_line
    for k, v in again["model"].state_dict().items():
        assert torch.equal(v, want[k]), k
    back.close()
