"""The keepers' per-step commit on the job's store (snapshot/store_commit.py): real keeper
processes send the store the requests bench/scale_snapshot.py counts, none of the direct
``have`` round, and leave no step's keys behind."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from unickpt.snapshot import paths
from unickpt.snapshot.store_commit import check_control, control_doc

from snapshot_helpers import commit_manifest, wait_for

JOB = "sc"
NODES = 3


def test_a_control_entry_from_the_manifest_is_checked():
    good = control_doc("127.0.0.1:29500", "job/../x y", b"\x01" * 8)
    assert check_control(good) == ("127.0.0.1:29500", "unickpt/snap/job_.._x_y/0101010101010101")
    assert "not {store, prefix}" in check_control({"store": 1})
    assert "not host:port" in check_control(dict(good, store="x; rm -rf /:1"))
    assert "not unickpt/snap/" in check_control(dict(good, prefix="unickpt/live/g/7"))


def _requests(log: str, step: int) -> tuple[Counter, Counter]:
    """(requests to other keepers, requests to the store) a keeper logged at ``step`` whole."""
    m = re.search(rf"step {step} whole \(requests to other keepers so far: (\{{.*?\}}); to the store: (\{{.*?\}})\)", log)
    assert m, log[-2000:]
    return Counter(json.loads(m[1].replace("'", '"'))), Counter(json.loads(m[2].replace("'", '"')))


@pytest.mark.multiprocess
def test_real_keepers_commit_on_the_store_as_the_simulation_counts(tmp_path, shm_roots):
    """3 real keepers, XOR parity, 2 steps whose manifests name a TCPStore: both steps
    become whole on every node with no ``have`` between keepers (only the stripes), the
    store requests the keepers logged are the ones bench/scale_snapshot.simulate_commit
    counts for 3 keepers and 2 steps, and after the second step only its own keys and
    the job's sequence are left in the store. Step 2 is flushed to disk, coordinated on the
    store: no request between keepers, every file in the checkpoint."""
    from torch.distributed import TCPStore

    from bench.scale_snapshot import simulate_commit
    from unickpt.snapshot.keeper_admin import ensure_keeper

    store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    roots = [str(tmp_path / f"shm{i}") for i in range(NODES)]
    shm_roots.extend(roots)
    docs = [ensure_keeper(r, JOB) for r in roots]
    secret = os.urandom(paths.SECRET_BYTES)
    for r in roots:
        paths.write_secret(r, JOB, secret)
    nodes = [{"host": d["host"], "port": d["port"], "pid": d["pid"]} for d in docs]
    control = control_doc(address, JOB, os.urandom(8))
    target = str(tmp_path / "ck" / "step_00000002")  # step 2 is flushed there, coordinated on the store
    os.makedirs(os.path.dirname(target))
    files = {f"rank_{i:05d}.safetensors": 3000 + 100 * i for i in range(NODES)}
    for step in (1, 2):
        for i, r in enumerate(roots):
            sdir = paths.step_dir(r, JOB, step)
            os.makedirs(sdir)
            with open(os.path.join(sdir, f"rank_{i:05d}.safetensors"), "wb") as f:
                f.write(os.urandom(3000 + 100 * i))
            meta = {"step": step, "job": JOB, "parity": 1, "k": NODES - 1, "nodes": nodes, "control": control,
                    **({"flush": target} if step == 2 else {})}
            commit_manifest(sdir, {"files": files, "metadata": {"snapshot": meta}})
        for r in roots:
            wait_for(lambda r=r, s=step: os.path.exists(os.path.join(paths.step_dir(r, JOB, s), paths.WHOLE)), 60,
                     f"step {step} whole on {r}")
    wait_for(lambda: all("step 2 whole" in open(os.path.join(r, "unickpt", "keeper.log")).read() for r in roots), 10,
              "the keepers' logs")
    logs = [open(os.path.join(r, "unickpt", "keeper.log")).read() for r in roots]
    calls = sum((_requests(log, 2)[0] for log in logs), Counter())
    # each keeper sends its k = 2 stripes a step to their holders, on connections kept open
    assert calls == {"stripe": 2 * NODES * (NODES - 1), "connect": NODES * (NODES - 1)}, calls
    real = sum((_requests(log, 2)[1] for log in logs), Counter())
    sim = simulate_commit(address, NODES, 2, waiters=NODES, job="sim")
    assert real == sim["ops"], (real, sim["ops"])
    step1 = [k for k in ("s1/count", "s1/n0", "s1/n1", "s1/n2") if store.check([f"{control['prefix']}/{k}"])]
    assert step1 == [], step1  # step 1's records deleted once step 2 was whole

    # the flush of step 2: every keeper's files in the checkpoint, byte for byte, with no
    # flush/flushed request between keepers, and the flush's keys gone from the store
    wait_for(lambda: "step 2 flushed to" in open(os.path.join(roots[0], "unickpt", "keeper.log")).read(), 30, "the flush")
    for i, r in enumerate(roots):
        name = f"rank_{i:05d}.safetensors"
        with open(os.path.join(paths.step_dir(r, JOB, 2), name), "rb") as a, open(os.path.join(target, name), "rb") as b:
            assert a.read() == b.read()
    assert json.load(open(os.path.join(target, "manifest.json")))["files"] == files
    log = open(os.path.join(roots[0], "unickpt", "keeper.log")).read()
    m = re.search(r"step 2 flushed to .* \(requests to other keepers so far: (\{.*?\}); to the store for flushes: (\{.*?\})\)", log)
    assert m and "flush" not in m[1] and json.loads(m[2].replace("'", '"'))["append"] == 1, log[-2000:]
    left = [k for k in ("staging", "reports", "count", "done") if store.check([f"{control['prefix']}/f2/{k}"])]
    assert left == [], left


@pytest.mark.parametrize("case", ["nothing lost", "node 2 lost", "node 2's files gone, its record kept",
                                  "nodes 2 and 3 lost", "a reply malformed"])
def test_the_two_round_plan_is_the_one_round_plan(case):
    """Rank 0's plan from every node's summary and only the records of the lost nodes'
    groups is the plan from every node's whole inventory: the same steps, sources,
    rebuilds and reasons; no record is fetched when nothing is lost; a malformed reply
    skips the step with its reason, never raises."""
    from bench.scale_snapshot import inventories, two_rounds
    from unickpt.snapshot.recovery_plan import plan_candidates

    docs = inventories(6, ranks_per_node=2)
    if case.startswith("node 2 lost") or case == "a reply malformed":
        docs = docs[:2] + docs[3:]
    elif case.startswith("nodes"):
        docs = docs[:2] + docs[4:]
    elif case.startswith("node 2's files"):
        docs[2]["steps"]["7"]["files"] = {}
    one = plan_candidates(json.loads(json.dumps(docs)))
    tamper = (lambda raw: b'[{"members": 3}]') if case == "a reply malformed" else None
    plans, reasons, size, _ = two_rounds(json.loads(json.dumps(docs)), tamper)
    if case == "a reply malformed":
        assert plans == [] and "no surviving parity describes 2 of the missing files" in reasons[0][1], reasons
        return
    assert [plans, reasons] == list(one)
    if case == "nothing lost":
        assert plans[0]["rebuild"] is None and size < sum(len(json.dumps(d)) for d in docs) / 3
    elif case.startswith("nodes"):
        assert plans == [] and "nodes 2, 3 of 6 were lost" in reasons[0][1]
    else:
        assert plans[0]["rebuild"]["lost"] == [2]


def test_the_plan_after_a_node_loss_grows_with_the_nodes_not_their_square():
    """With parity over every node a lost node's stripes lie in N - 1 groups of N - 1
    members; the plan describes each member once, so what rank 0 receives and what it
    broadcasts grow about 4x from 32 to 128 nodes (16x if every group repeated them)."""
    from bench.scale_snapshot import plan_cpu

    small, big = plan_cpu(32, 0), plan_cpu(128, 0)
    for what in ("gathered_bytes", "plan_bytes"):
        assert 3 < big[what] / small[what] < 5, (what, small[what], big[what])
