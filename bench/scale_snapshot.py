"""The memory tier's control plane at scale, by simulation against one real TCPStore.

* **Per-step commit** (:mod:`unickpt.snapshot.store_commit`, the code the keepers run):
  N simulated keepers, each a real :class:`StoreCommit` (announce, wait for the whole
  step, delete its records), against a real libuv TCPStore in its own process. The
  keepers share a pool of client connections (a client serves one request at a time), so
  the store does every request the N keepers would send, over fewer sockets. Reported:
  requests and connections per step (against the direct ``have`` round it replaces),
  the store's requests per step, the commit time from the slowest keeper's
  announcement to the step marked whole on every keeper, and the keys left in the store.
* **Calibration**: the same commit with >= 128 real processes (forked after importing
  torch: one keeper each, two connections each, as the keepers run), timed the same way.
* **Re-forming** (:mod:`unickpt.live.run`): R simulated ranks run the real
  ``_Live.arrive`` of a new generation on the store; its requests and time.

Run: ``python -m bench.scale_snapshot [--nodes 256,1024,2048] [--procs 128] [--ranks 16384]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from unickpt.snapshot.store_commit import StoreCommit, connect, control_doc

# the store's process answers each line on its stdin with the CPU seconds it has used
STORE_BOOT = ("import resource, sys; from torch.distributed import TCPStore; "
              "s = TCPStore('127.0.0.1', 0, is_master=True, use_libuv=True, wait_for_workers=False); "
              "print(s.port, flush=True)\n"
              "for _ in sys.stdin:\n"
              "    u = resource.getrusage(resource.RUSAGE_SELF); print(u.ru_utime + u.ru_stime, flush=True)")


_STORES: dict[int, subprocess.Popen] = {}


def cpu_s(pid: int) -> float:
    """CPU seconds the store's process ``pid`` has used (its own getrusage, in
    microseconds: /proc's figures here are 10 ms ticks): the store's own work."""
    proc = _STORES[pid]
    proc.stdin.write("\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def start_store() -> tuple[subprocess.Popen, str]:
    """A libuv TCPStore in its own process (as node 0's launcher hosts it); (process, address)."""
    proc = subprocess.Popen([sys.executable, "-c", STORE_BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    _STORES[proc.pid] = proc
    return proc, f"127.0.0.1:{port}"


class Pool:
    """``size`` real client connections handed out in turn (the simulation's sockets)."""

    def __init__(self, address: str, size: int) -> None:
        self.clients = [connect(address) for _ in range(size)]
        self._next = itertools.cycle(self.clients)
        self._lock = threading.Lock()

    def __call__(self, address: str) -> Any:
        with self._lock:
            return next(self._next)


def _noop(_msg: str) -> None:
    pass


def simulate_commit(address: str, nodes: int, steps: int, pool: Pool | None = None, waiters: int = 32,
                    job: str = "sim", store_pid: int | None = None) -> dict[str, Any]:
    """N keepers' commit of ``steps`` steps on the store at ``address``: every keeper but
    the last announces, then the last one (the slowest keeper) does, timed until every
    keeper marked the step whole, as keeper_server does it (announce, wait, mark, forget).
    Returns the requests by name (at the last step marked whole everywhere, before its
    records are deleted), the commit times and the keys left."""
    prefix = control_doc(address, job, secrets.token_bytes(8))["prefix"]
    pool = pool or Pool(address, 4)
    waiting = Pool(address, min(waiters, nodes))
    keepers = [StoreCommit(address, prefix, j, f"sim-{j}", pool) for j in range(nodes)]
    for j, kp in enumerate(keepers):  # one waiting connection per group of keepers (below)
        kp.waiter = waiting.clients[j % len(waiting.clients)]
    times: list[float] = []
    c0 = cpu_s(store_pid) if store_pid else 0.0
    for step in range(1, steps + 1):
        for kp in keepers[:-1]:
            kp.announce(step, nodes)
        marked: list[float] = []
        lock = threading.Lock()

        def wait_group(group: list[StoreCommit], s: int = step) -> None:
            for kp in group:
                got = None
                while got != s:
                    got = kp.next_whole(_noop)
                with lock:
                    marked.append(time.perf_counter())

        groups = [keepers[i::waiters] for i in range(min(waiters, nodes))]
        threads = [threading.Thread(target=wait_group, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        keepers[-1].announce(step, nodes)
        for t in threads:
            t.join()
        times.append(max(marked) - t0)
        ops = sum((kp.ops for kp in keepers), Counter())
        for kp in keepers:
            kp.forget(lambda s, w=step: s > w, kp.next - 1)
    cpu = (cpu_s(store_pid) - c0) / steps if store_pid else 0.0
    every = sum((kp.ops for kp in keepers), Counter())
    return {"nodes": nodes, "steps": steps, "ops": ops, "ops_all": every, "commit_s": times, "store_cpu_s": cpu}


def _keeper_proc(address: str, prefix: str, node: int, nodes: int, steps: int, barrier, barrier_go, out) -> None:
    """One calibration keeper process: its own two connections, the keeper's sequence."""
    kp = StoreCommit(address, prefix, node, f"proc-{node}")
    out.put(("connected", node, 0.0, 0.0))
    barrier_go.wait()
    for step in range(1, steps + 1):
        barrier.wait()
        if node != nodes - 1:
            kp.announce(step, nodes)
        barrier.wait()  # every other keeper announced: the last one's announcement is timed
        t0 = time.time()
        if node == nodes - 1:
            kp.announce(step, nodes)
        while kp.next_whole(_noop) != step:
            pass
        out.put((step, node, t0, time.time()))
        kp.forget(lambda s, w=step: s > w, kp.next - 1)
        barrier.wait()
    out.put(("ops", node, dict(kp.ops), 0.0))


def calibrate(address: str, procs: int, steps: int, store_pid: int | None = None) -> dict[str, Any]:
    """The commit with ``procs`` real keeper processes (forked after torch is imported)."""
    import torch.distributed  # noqa: F401  (imported once, shared by the forked processes)

    ctx = multiprocessing.get_context("fork")
    prefix = control_doc(address, "cal", secrets.token_bytes(8))["prefix"]
    barrier, barrier_go, out = ctx.Barrier(procs), ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=_keeper_proc, args=(address, prefix, j, procs, steps, barrier, barrier_go, out))
          for j in range(procs)]
    for p in ps:
        p.start()
    rows = [out.get(timeout=600) for _ in range(procs)]  # connected
    c0 = cpu_s(store_pid) if store_pid else 0.0
    barrier_go.wait()
    rows = [out.get(timeout=600) for _ in range(procs * (steps + 1))]
    cpu = (cpu_s(store_pid) - c0) / steps if store_pid else 0.0
    for p in ps:
        p.join()
    times = []
    for step in range(1, steps + 1):
        r = [x for x in rows if x[0] == step]
        start = next(x[2] for x in r if x[1] == procs - 1)
        times.append(max(x[3] for x in r) - start)
    ops = sum((Counter(x[2]) for x in rows if x[0] == "ops"), Counter())
    return {"nodes": procs, "steps": steps, "ops": ops, "commit_s": times, "store_cpu_s": cpu}


def simulate_reform(address: str, ranks: int, waiters: int = 64, store_pid: int | None = None) -> dict[str, Any]:
    """R ranks arriving at a new generation with the real ``membership.arrive`` in its two
    halves (pooled connections: every rank says it arrived, then every rank waits for the
    generation's ``go``); its requests and time."""
    from unickpt.live import control, membership

    pool = Pool(address, waiters)
    counted: Counter[str] = Counter()

    class Counting:
        def __init__(self, client: Any) -> None:
            self.client = client

        def __getattr__(self, name: str) -> Any:
            counted[name] += 1
            return getattr(self.client, name)

    gen_no = int(pool.clients[0].add(control.key("simgen"), 1)) + 1000
    gen = control.Generation(gen_no, [f"{i // 8}.{i % 8}" for i in range(ranks)])
    pool.clients[0].set(control.key("gen"), str(gen_no))
    stores = [Counting(pool(address)) for _ in range(ranks)]  # each rank's connection (from the pool)
    groups = [stores[i::waiters] for i in range(waiters)]
    ok: list[bool] = []
    c0 = cpu_s(store_pid) if store_pid else 0.0
    t0 = time.perf_counter()

    def run(group: list[Any]) -> None:
        for store in group:
            membership.say_arrived(store, gen)
        ok.extend(membership.all_arrived(store, gen) for store in group)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ranks": ranks, "ops": counted, "s": time.perf_counter() - t0, "all_arrived": all(ok) and len(ok) == ranks,
            "store_cpu_s": cpu_s(store_pid) - c0 if store_pid else 0.0}


class Members(Mapping):
    """A parity record's ``members`` computed on access: what a node's record holds, without
    keeping N records of N members in this one process (the nodes' side of the plan)."""

    def __init__(self, g: int, k: int, nodes: int, files: dict[int, list[list[Any]]], blob: int) -> None:
        from unickpt.snapshot.parity import members

        self.stripes = {str(i): s for i, s in members(g, k, nodes)}
        self.k, self.files, self.blob = k, files, blob

    def __getitem__(self, x: str) -> dict[str, Any]:
        s = self.stripes[x]
        return {"stripe": s, "len": self.blob // self.k, "crc": 0, "files": self.files[int(x)], "blob": self.blob}

    def __iter__(self):
        return iter(self.stripes)

    def __len__(self) -> int:
        return len(self.stripes)


def inventories(nodes: int, ranks_per_node: int = 8, step: int = 7, lazy: bool = False,
                stripes: int = 8) -> list[dict[str, Any]]:
    """What every node's local rank 0 sends rank 0 for recovery planning (recover.inventory)
    for one snapshot of ``nodes`` nodes with XOR parity, as the keepers record it: each
    node's files, its copy of the manifest (files and keeper table only: no tensors), and
    the parity record of the group it holds (every member's stripe, crc and files; with
    ``lazy`` a :class:`Members` that makes them when read); ``stripes`` bounds ``k``
    (``snapshot.parity.layout``; 0: parity over every node)."""
    from unickpt.snapshot.parity import layout

    k, m = layout(nodes, 1, stripes=stripes or nodes)
    files = {j: [[f"rank_{j * ranks_per_node + r:05d}.safetensors", 1 << 20] for r in range(ranks_per_node)]
             for j in range(nodes)}
    table = [{"host": "10.0.0.1", "port": 40000 + j, "pid": 1000 + j} for j in range(nodes)]
    manifest = json.dumps({"files": {n: sz for j in range(nodes) for n, sz in files[j]},
                           "metadata": {"snapshot": {"step": step, "parity": m, "k": k, "nodes": table}}})
    blob = ranks_per_node << 20
    out = []
    for j in range(nodes):
        g = j  # node j holds block 0 of group j (parity.held_groups)
        mem = Members(g, k, nodes, files, blob)
        record = {"step": step, "group": g, "r": 0, "k": k, "m": m, "holder": j, "nodes": nodes, "nbytes": blob // k,
                  "crc": 0, "members": mem if lazy else dict(mem.items()), "peers": table}
        # as recover.inventory adds it: the record's length (by one member's, with lazy)
        record["size"] = len(json.dumps(dict(record, members={}))) + len(mem) * (len(json.dumps(mem[next(iter(mem))])) + 8)
        out.append({"node": j, "steps": {str(step): {"files": dict(files[j]), "manifest": manifest, "bad": None,
                                                     "parity": [record], "notes": []}}})
    return out


def two_rounds(docs: list[dict[str, Any]], tamper: Any = None) -> tuple[list[Any], list[Any], int, float]:
    """recover._gather_plans' rounds over the inventories ``docs`` in one process: every
    node's summary, one manifest copy a step, the parity records of the lost nodes'
    groups; (plans, reasons, bytes rank 0 receives, rank 0's CPU seconds), the nodes'
    side of each round (summary, reply) off the clock. ``tamper(bytes) -> bytes`` alters
    every node's reply of the second round (a test's malformed reply)."""
    from unickpt.snapshot.recovery_plan import (MAX_ROUNDS, manifest_sources, merge_reply, plan_candidates, records_reply,
                                                records_wanted, summary, with_records)

    wire = [json.dumps(summary(d)).encode() for d in docs]
    t0 = time.process_time()
    parsed = [json.loads(w) for w in wire]
    sources = manifest_sources(parsed)
    cpu, size = time.process_time() - t0, sum(map(len, wire))
    for key, i in sources.items():  # broadcast from the node holding the copy
        parsed[i]["steps"][key]["manifest"] = docs[i]["steps"][key]["manifest"]
        size += len(docs[i]["steps"][key]["manifest"])
    records: dict[Any, Any] = {}
    for _ in range(MAX_ROUNDS):
        t0 = time.process_time()
        want = records_wanted(parsed, records)
        cpu += time.process_time() - t0
        if not want:
            break
        asked: dict[int, list[list[Any]]] = {}
        for (i, key, j), who in sorted(want.items()):
            asked.setdefault(i, []).append([key, j, who])
        replies = {i: json.dumps(records_reply(docs[i], a)).encode() for i, a in asked.items()}
        replies = {i: tamper(r) if tamper else r for i, r in replies.items()}
        size += sum(map(len, replies.values()))
        t0 = time.process_time()
        for i, a in asked.items():
            reply = json.loads(replies[i])
            for n, (key, j, who) in enumerate(a):  # as _gather_plans reads a reply
                rec = reply[n] if isinstance(reply, list) and n < len(reply) else None
                merge_reply(records, (i, key, j), who, rec)
        cpu += time.process_time() - t0
    t0 = time.process_time()
    plans, reasons = plan_candidates(with_records(parsed, records))
    return plans, reasons, size, cpu + time.process_time() - t0


def plan_cpu(nodes: int, lost: int | None = 0, before: bool = False, stripes: int = 8) -> dict[str, Any]:
    """CPU seconds of rank 0's recovery plan over ``nodes`` inventories, with node ``lost``
    gone (None: none), and the bytes rank 0 receives for it: :func:`two_rounds`, or with
    ``before`` the one round it replaces (every node's whole inventory into
    recover.plan_candidates); ``stripes`` as :func:`inventories`."""
    from unickpt.snapshot.recovery_plan import plan_candidates

    docs = [d for d in inventories(nodes, lazy=not before, stripes=stripes) if lost is None or d["node"] != lost]
    if before:
        wire = [json.dumps(d).encode() for d in docs]
        t0 = time.process_time()
        plans, reasons = plan_candidates([json.loads(w) for w in wire])
        cpu, size = time.process_time() - t0, sum(map(len, wire))
    else:
        plans, reasons, size, cpu = two_rounds(docs)
    assert plans and (lost is None or plans[0]["rebuild"]["lost"] == [lost]), reasons
    return {"nodes": nodes, "cpu_s": cpu, "gathered_bytes": size, "lost": lost, "plan_bytes": len(json.dumps(plans[0]))}


def round_trip(address: str, n: int = 2000) -> float:
    """Median seconds of one request to the store from one client."""
    client = connect(address)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.add("unickpt/bench/rtt", 1)
        times.append(time.perf_counter() - t0)
    client.delete_key("unickpt/bench/rtt")
    return statistics.median(times)


def direct_round(nodes: int) -> dict[str, int]:
    """The direct ``have`` round the store replaces: every keeper calls every other."""
    return {"requests": nodes * (nodes - 1), "connections": nodes * (nodes - 1)}


def main(argv: list[str] | None = None) -> None:
    """Run the simulation and the calibration; print docs/SCALE.md's tables."""
    ap = argparse.ArgumentParser(prog="bench.scale_snapshot")
    ap.add_argument("--nodes", default="128,256,1024,2048")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--procs", type=int, default=128, help="real keeper processes of the calibration (0: none)")
    ap.add_argument("--ranks", type=int, default=16384, help="ranks of the re-forming (0: none)")
    ap.add_argument("--plan-nodes", default="64,256,1024,2048", help="nodes of the recovery plans timed")
    ap.add_argument("--plan-before", type=int, default=256, help="time the one-round plan it replaces up to this many nodes")
    ap.add_argument("--plan-lost", type=int, default=2048, help="plan with node 0 lost up to this many nodes")
    ap.add_argument("--plan-only", action="store_true", help="only the recovery plan's table")
    args = ap.parse_args(argv)
    if args.plan_only:
        plan_table(args.plan_nodes, args.plan_before, args.plan_lost)
        return
    proc, address = start_store()
    try:
        pool = Pool(address, 64)
        rows = []
        for n in [int(x) for x in args.nodes.split(",")]:
            r = simulate_commit(address, n, args.steps, pool, store_pid=proc.pid)
            rows.append(r)
        cal = calibrate(address, args.procs, args.steps, proc.pid) if args.procs else None
        reform = simulate_reform(address, args.ranks, store_pid=proc.pid) if args.ranks else None
        left = connect(address).num_keys()
        rtt = round_trip(address)
    finally:
        proc.stdin.close()
        proc.wait()
    print("| nodes | direct round: requests/step (connections held) | store: requests/step (by name) | keeper requests/step "
          "| commit, slowest keeper -> whole everywhere, measured (median of steps) | the store's CPU a step (mean) | "
          "commit by the model: 5 round trips + the store's CPU for 2N+4 requests | the same at the real processes' "
          "CPU a request | target 0.1 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cal_req = cal["store_cpu_s"] / sum(cal["ops"].values()) * cal["steps"] if cal else None
    for r in ([cal] if cal else []) + rows:
        per = {k: round(v / r["steps"]) for k, v in r.get("ops_all", r["ops"]).items()}
        total = sum(per.values())
        d = direct_round(r["nodes"])
        kind = " (real processes)" if r is cal else ""
        med = statistics.median(r["commit_s"])
        cpu = r["store_cpu_s"]
        per_req = cpu / total
        model = 5 * rtt + per_req * (2 * r["nodes"] + 4)
        worst = 5 * rtt + max(per_req, cal_req or 0.0) * (2 * r["nodes"] + 4)
        more = (f"{cpu * 1e3:.0f} ms ({per_req * 1e6:.1f} us a request) | {model * 1e3:.1f} ms | {worst * 1e3:.1f} ms | "
                f"{worst / 0.1:.2f}x")
        print(f"| {r['nodes']}{kind} | {d['requests']:,} ({d['connections']:,}) | {total:,} ({per}) | "
              f"{total / r['nodes']:.1f} | {med * 1e3:.1f} ms | {more} |")
    print(f"\nround trip to the store (one client, median of 2000 adds): {rtt * 1e6:.0f} us")
    sim128 = next((r for r in rows if r["nodes"] == 128), None)
    factor = 1.0
    if cal and sim128:
        factor = max(1.0, cal_req / (sim128["store_cpu_s"] / sum(sim128["ops_all"].values()) * sim128["steps"]))
        print(f"calibration: the store's CPU a request with {cal['nodes']} real processes / in the simulation at "
              f"{sim128['nodes']} nodes: {factor:.2f}x")
    if reform:
        per = dict(reform["ops"])
        print(f"\nre-forming, {reform['ranks']} ranks arrive: {sum(per.values()):,} store requests ({per}); the "
              f"store's CPU {reform['store_cpu_s']:.3f} s, calibrated x{factor:.2f}: {reform['store_cpu_s'] * factor:.3f} s "
              f"(target 1 s: {reform['store_cpu_s'] * factor:.2f}x); wall time with every "
              f"rank's requests sent from this one process: {reform['s']:.3f} s; all arrived: {reform['all_arrived']}")
    print(f"keys in the store after every run: {left}")
    plan_table(args.plan_nodes, args.plan_before, args.plan_lost)


def plan_table(plan_nodes: str, before_upto: int, lost_upto: int) -> None:
    """Print the recovery plan's table: bytes rank 0 receives, its CPU and the plan it
    broadcasts, no node lost and (up to ``lost_upto`` nodes) node 0 lost, two rounds, with
    the default groups (k <= 8) and with parity over every node (k = n - 1); one round of
    every node's whole inventory in the same run up to ``before_upto`` nodes (k = n - 1)."""
    print("\n| nodes | no node lost: rank 0 receives, CPU | node 0 lost, k <= 8: receives, CPU, plan broadcast "
          "| node 0 lost, k = n - 1: receives, CPU, plan broadcast | one round of whole inventories, k = n - 1 "
          "(receives, CPU no loss / node 0 lost) |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in plan_nodes.split(",") if x]:
        whole = plan_cpu(n, None)
        cells = []
        for stripes in (8, 0):
            one = plan_cpu(n, 0, stripes=stripes) if n <= lost_upto else None
            cells.append(f"{one['gathered_bytes'] / 1e6:,.2f} MB, {one['cpu_s']:.3f} s, {one['plan_bytes'] / 1e6:,.2f} MB"
                         if one else "-")
        old = "-"
        if n <= before_upto:
            bw, bo = plan_cpu(n, None, True, 0), plan_cpu(n, 0, True, 0)
            old = f"{bw['gathered_bytes'] / 1e6:,.1f} MB, {bw['cpu_s']:.3f} s / {bo['cpu_s']:.3f} s"
        print(f"| {n} | {whole['gathered_bytes'] / 1e6:,.2f} MB, {whole['cpu_s']:.3f} s | {cells[0]} | {cells[1]} | {old} |",
              flush=True)


if __name__ == "__main__":
    main()
