"""Every byte under a shm root is untrusted input (issue 29): a damaged file (bytes
flipped, truncated, emptied, deleted, replaced by a directory) of any kind a node's shm
root holds makes that copy, step or tier skipped with the reason in the one recovery
line, and the next candidate tried: never a traceback, never a silent use.

One real 2-node job (torchrun agents as simulated nodes, one rank each, ``--parity 1``,
which on 2 nodes is a copy of each node's snapshot held by the other's keeper) is frozen
with three steps in memory: its keepers are stopped (SIGSTOP, as a hung keeper would be)
once step 5 is whole on both nodes, so steps 6 and 7 are committed without parity and
step 8's snapshot is skipped (two steps still in progress); the job stops after step 9,
the keepers are killed, and the durable tier keeps step 4. Each fuzz case relaunches the
example trainer on fresh copies of both shm roots, one of them damaged: its recovery
picks the step the damage leaves (memory, else disk) and the losses of the two steps it
then trains (the weights restored, then the optimizer's state) are bitwise those of the
unbroken job. Two real torchrun relaunches replay the issue's exact
scenario: a 2-rank job SIGKILLed, every file under its node's shm root damaged."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import pytest

from unickpt.testing import run_ranks

from shm_fuzz_cases import CORRUPTIONS, corrupt, relaunch_cases
from snapshot_helpers import TINY, keeper_pid, kill_keeper, launch_nodes, losses, resumed_lines, steps_whole, wait_all, worker_pids

JOB = "fuzz"
FLAGS = [*TINY, "--snapshot-every", "1", "--parity", "1", "--save-every", "4", "--stop-after", "9"]


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _committed(root: str) -> list[int]:
    jdir = os.path.join(root, "unickpt", JOB)
    return sorted(int(d[5:]) for d in os.listdir(jdir) if d.startswith("step_") and os.path.exists(os.path.join(jdir, d, "manifest.json")))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """The frozen 2-node job (see the module docstring): ``<tmp>/frozen{0,1}`` (the shm
    roots, keepers dead), ``<tmp>/ck`` (the durable tier: step 4) and the unbroken job's
    losses of steps 1..9."""
    tmp = tmp_path_factory.mktemp("fuzz")
    roots = [str(tmp / f"shm{i}") for i in range(2)]
    os.environ["UNICKPT_JOB_ID"] = JOB
    try:
        procs = launch_nodes(tmp, roots, [*FLAGS, "--ckpt-dir", "ck", "--loss-log", str(tmp / "run.jsonl"),
                                          "--compute-sleep", "0.4"])
        try:
            _wait_for(lambda: all(5 in steps_whole(r) for r in roots), 120, "step 5 whole on both nodes")
            for r in roots:
                os.kill(keeper_pid(r), signal.SIGSTOP)
        finally:
            wait_all(procs, tmp)
        for r in roots:
            kill_keeper(r)
            jdir = os.path.join(r, "unickpt", JOB)
            for old in [d for d in os.listdir(jdir) if d.startswith("step_") and int(d[5:]) < 5]:
                shutil.rmtree(os.path.join(jdir, old))  # a keeper under load may be midway through dropping it
            assert steps_whole(r) == [5] and _committed(r) == [5, 6, 7], (steps_whole(r), _committed(r))
            # the manifest in the index form: the root everywhere, node 0 the whole index, node 1 its part and a copy of node 0's
            held = sorted(n for n in os.listdir(os.path.join(jdir, "step_00000007")) if n.startswith("fragments"))
            assert held == (["fragments.jsonl"] if roots.index(r) == 0 else ["fragments_00000.jsonl", "fragments_00001.jsonl"])
            shutil.copytree(r, tmp / f"frozen{roots.index(r)}", symlinks=True)
        assert sorted(os.listdir(tmp / "ck")) == ["step_00000004", "step_00000008"]
        shutil.rmtree(tmp / "ck" / "step_00000008")  # the durable tier older than every snapshot in memory
        want = losses(str(tmp / "run.jsonl"))
        assert sorted(want) == list(range(1, 10))
        yield tmp, want
    finally:
        os.environ.pop("UNICKPT_JOB_ID", None)
        for r in roots:
            kill_keeper(r)


def _step(s: int) -> str:
    return f"unickpt/{JOB}/step_{s:08d}"


MANIFEST0 = [(0, f"{_step(s)}/manifest.json") for s in (5, 6, 7)]
RANKS0 = [(0, f"{_step(s)}/rank_00000.safetensors") for s in (5, 6, 7)]
NODE0_LOST = [(n, p, "deleted") for n, p in RANKS0]  # node 0's data gone from every step: step 5 needs node 1's copy
COPY_OF_NODE0 = f"{_step(5)}/parity_g1_r0"  # on node 1: the copy of node 0's blob of step 5, and its record
KEEPER_FILES0 = [(0, "keeper.pid"), (0, "unickpt/keeper.json"), (0, "unickpt/keeper.log"), (0, f"unickpt/{JOB}/secret"),
                 (0, f"{_step(5)}/whole")]
NO_PARITY = "no surviving parity describes 1 of the missing files"


def _kinds():
    """(kind, damaged files, {corruption: (source, step, reason or None)}) of each case."""
    everywhere = {c: None for c in CORRUPTIONS}
    yield "node 0's copies of the manifest", MANIFEST0, {
        c: ("memory", 7, "step 7: node 0's copy of its manifest: ") for c in CORRUPTIONS}
    yield "every copy of step 7's manifest", [(0, f"{_step(7)}/manifest.json"), (1, f"{_step(7)}/manifest.json")], {
        **{c: ("memory", 6, "step 7: no node holds a valid copy of its manifest") for c in CORRUPTIONS},
        "deleted": ("memory", 6, None)}  # no copy anywhere: a step never committed, nothing to say
    yield "node 0's rank file of step 7", [RANKS0[2]], {
        **{c: ("memory", 6, f"step 7: {NO_PARITY}") for c in CORRUPTIONS},
        **{c: ("memory", 6, "step 7: checksum mismatch in rank_00000.safetensors") for c in ("flipped", "digit")}}
    yield "node 0's rank files of every step", RANKS0, {
        **{c: ("memory", 5, f"step 7: {NO_PARITY}; step 6: {NO_PARITY}") for c in CORRUPTIONS},
        **{c: ("disk", 4, "step 5: checksum mismatch in rank_00000.safetensors") for c in ("flipped", "digit")}}
    yield "node 1's copy of node 0's blob (node 0's data lost)", [(1, f"{COPY_OF_NODE0}.bin")], {
        **{c: ("disk", 4, "step 5: node 1's parity record parity_g1_r0.json: its block is missing, or not of its")
           for c in CORRUPTIONS},
        **{c: ("disk", 4, "parity of step 5 held by node 1 (group 1, block 0) fails its crc32c") for c in ("flipped", "digit")}}
    yield "node 1's record of that copy (node 0's data lost)", [(1, f"{COPY_OF_NODE0}.json")], {
        **{c: ("disk", 4, "step 5: node 1's parity record parity_g1_r0.json: ") for c in CORRUPTIONS},
        **{c: ("disk", 4, f"step 5: {NO_PARITY}") for c in ("deleted", "directory")},  # a directory is no record
        "digit": ("disk", 4, "parity_g1_r0.json: its digest does not match its content")}
    yield "node 0's keeper files, secret and whole marker", KEEPER_FILES0, {c: ("memory", 7, None) for c in everywhere}
    yield "node 1's parts of step 7's index", INDEX1, {  # node 0's whole index serves
        c: ("memory", 7, None) for c in ("flipped", "digit", "truncated", "deleted")}
    yield "every copy of step 7's index", [(0, f"{_step(7)}/fragments.jsonl"), *INDEX1], {
        c: ("memory", 6, "step 7: no node holds a valid copy of part") for c in ("truncated", "emptied", "deleted")}


INDEX1 = [(1, f"{_step(7)}/fragments_0000{j}.jsonl") for j in (0, 1)]
TRAINED = 2  # steps each relaunch trains after the one it resumes
CASES = [(f"{kind}: {how}", [(n, p, how) for n, p in files] + (NODE0_LOST if "node 0's data lost" in kind else []), want[how])
         for kind, files, want in _kinds() for how in want]


@pytest.mark.multiprocess
def test_every_damaged_file_kind_resumes_from_the_next_valid_source(frozen):
    """Each (file kind x corruption) relaunch resumes from the step its damage leaves: the
    source and step exact, the reason in the one line, then bitwise the unbroken job's losses."""
    tmp, want = frozen
    out = str(tmp / "cases.json")
    t0 = time.monotonic()
    # each relaunch trains the two steps after the one it resumes (the first checks the
    # weights it restored, the second also the optimizer's state)
    run_ranks(relaunch_cases, 2, str(tmp), JOB, FLAGS, [(name, damage, step + TRAINED) for name, damage, (_, step, _) in CASES],
              out, preload=["unickpt.examples.train"])
    took = time.monotonic() - t0
    got = json.load(open(out))
    wrong = []
    for name, _, (source, step, reason) in CASES:
        lines, trained = got[name]["lines"], {int(s): v for s, v in got[name]["losses"].items()}
        line = lines[0] if len(lines) == 1 else repr(lines)
        exact = trained == {s: want[s] for s in range(step + 1, step + TRAINED + 1)}
        ok = re.match(rf"resumed step {step} from {source} \(", line) is not None and exact
        if reason:
            ok = ok and reason in line
        elif source == "memory":
            ok = ok and "skipped" not in line
        if not ok:
            wrong.append(f"{name}: want {source} {step} {reason!r}; got {line}; losses exact: {exact}")
    assert not wrong, "\n".join(wrong)
    print(f"{len(CASES)} relaunches in {took:.1f} s")


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_every_file_of_a_killed_jobs_shm_root_damaged_resumes_from_disk(tmp_path, frozen, how):
    """The issue's scenario: a 2-rank job (one node) with ``--snapshot-every 1 --parity 0``
    SIGKILLed (its keeper alive), then every file under the node's shm root damaged: the
    torchrun relaunch resumes from the durable checkpoint with the reasons in its line,
    exits 0, and its losses are bitwise those of the unbroken job."""
    _, want = frozen
    root = str(tmp_path / "shm")
    flags = [*TINY, "--snapshot-every", "1", "--parity", "0", "--save-every", "4", "--ckpt-dir", "ck"]
    log = str(tmp_path / "run.jsonl")
    procs = launch_nodes(tmp_path, [root], [*flags, "--loss-log", log, "--compute-sleep", "0.3"], nproc=2)
    try:
        _wait_for(lambda: max(losses(log), default=0) >= 6 if os.path.exists(log) else False, 120, "step 6")
        os.kill(worker_pids(procs[0])[1], signal.SIGKILL)
    finally:
        wait_all(procs, tmp_path, timeout=60, check=False)
    keeper = keeper_pid(root)
    try:
        assert keeper is not None and os.path.exists(f"/proc/{keeper}")
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        assert {"keeper.pid", "keeper.json", "keeper.log", "secret", "manifest.json", "whole"} <= {os.path.basename(f) for f in files}
        for f in files:
            corrupt(f, how)
        relaunched = str(tmp_path / "relaunched.jsonl")
        outs = wait_all(launch_nodes(tmp_path, [root], [*flags, "--loss-log", relaunched, "--stop-after", "9"], nproc=2),
                        tmp_path)
        lines = resumed_lines(outs)
        assert len(lines) == 1 and lines[0].startswith("resumed step 4 from disk (ck/step_00000004; memory: step "), outs[0][-3000:]
        assert "copy of its manifest: " in lines[0] and "Traceback" not in outs[0]
        got = losses(relaunched)
        assert got == {s: want[s] for s in range(5, 10)}, (got, want)
    finally:
        kill_keeper(root)
        if keeper is not None:
            try:
                os.kill(keeper, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fake_keeper(messages: list[bytes]):
    """A server that answers one connection with raw ``messages`` (then reads what it is
    sent, and closes): a keeper whose bytes are damaged or hostile. Returns its port."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                for m in messages:
                    conn.sendall(m)
                    conn.settimeout(2)
                    try:
                        conn.recv(1 << 16)
                    except OSError:
                        return

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def _frame(doc: bytes) -> bytes:
    return len(doc).to_bytes(4, "big") + doc


@pytest.mark.parametrize("messages", [
    [_frame(b"not json")],
    [_frame(b"[1, 2]")],
    [_frame(b"\xff\xfe")],
    [_frame(b'{"nonce": "zz"}')],
    [(1 << 31).to_bytes(4, "big")],  # a 2 GiB challenge: refused, nothing allocated
    [_frame(b'{"nonce": "00"}'), _frame(b'{"ok": true}'), _frame(b'{"ok": true, "nbytes": -5}')],
    [_frame(b'{"nonce": "00"}'), _frame(b'{"ok": true}'), _frame(b'"ok"')],
], ids=["not-json", "a-list", "not-utf8", "bad-nonce", "huge", "negative-payload", "reply-not-an-object"])
def test_damaged_keeper_messages_are_one_snapshot_error(messages):
    """The trainers' side of the keepers' protocol: whatever a keeper sends (not JSON, not
    an object, a nonce that is not hex, a header larger than any, a negative payload size)
    is a SnapshotError, which recovery turns into a skipped step: never another exception."""
    from unickpt.errors import SnapshotError
    from unickpt.snapshot import wire

    port = _fake_keeper(messages)
    with pytest.raises(SnapshotError):
        conn = wire.Connection("127.0.0.1", port, b"s" * 32, timeout=10)
        try:
            conn.request({"op": "ping"})
        finally:
            conn.close()


def test_damaged_delta_log_entries_end_the_replay_with_a_reason(tmp_path):
    """The delta log's entries on disk are untrusted too: an entry whose manifest or data
    file is flipped, truncated, emptied, deleted or a directory ends the replay before it,
    with the reason (never a traceback); a damaged full checkpoint is no base."""
    import torch

    import unickpt
    from unickpt.api.deltas.log import DeltaLog, replayable

    ck = tmp_path / "orig" / "ck"
    unickpt.CheckpointManager(str(ck)).save({"w": torch.ones(10)}, 2)
    log = DeltaLog(str(ck / "deltas"))
    for s in (3, 4, 5):
        log.append(s, {"g": torch.arange(1000.0) + s})
    log.close()
    assert len(replayable(str(ck), str(ck / "deltas")).entries) == 3
    entry = ck / "deltas" / "step_00000004"
    for rel in ["deltas/step_00000004/manifest.json", *(f"deltas/step_00000004/{n}" for n in os.listdir(entry) if n.startswith("rank_")),
                "step_00000002/manifest.json"]:
        for how in CORRUPTIONS:
            work = tmp_path / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(tmp_path / "orig", work)
            corrupt(str(work / "ck" / rel), how)
            plan = replayable(str(work / "ck"), str(work / "ck" / "deltas"))
            if rel.startswith("step_"):  # no valid full checkpoint: no base, nothing replayed
                assert (plan.base, plan.entries) == (None, []), (rel, how, plan)
                assert plan.notes == ["3 later entries (steps 3..5) not replayed: no full checkpoint or entry of step 1 "
                                      "comes before them"], (rel, how, plan.notes)
            else:
                assert [os.path.basename(e) for e in plan.entries] == ["step_00000003"], (rel, how, plan)
                assert plan.notes[0].startswith("step 4: torn entry (") and len(plan.notes) == 2, (rel, how, plan.notes)
