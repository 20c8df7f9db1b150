"""What a survivor actually gets when a peer dies or its connection is cut, on this torch
(gloo on CPU): each case runs 3 fresh processes (rank 2 the victim unless said), and every
exception a survivor sees is printed as one JSON line: the case, the rank, the exception's
``type(e).__mro__`` (and its ``__cause__``'s), the message, and what ``unickpt.run``
makes of it: ``typed`` (the type its ``_typed`` gives it, with the default group's
connections recorded as ``regroup.form`` records them; ``typed_s``, the seconds that
took) and whether ``_network_error`` then takes it for a lost peer.

``python tests/peer_loss_probe.py [CASE ...]`` (all cases without one; about 50 s on 2
busy cores); tests/test_live_errors.py runs a few of them. Cases:

* ``kill_in_all_reduce`` / ``kill_in_all_gather`` / ``kill_in_broadcast``: the victim is
  SIGKILLed while the survivors wait for it in the collective;
* ``killed_before_all_reduce``: the victim is dead before the survivors start it;
* ``stopped_in_all_reduce``: the victim is SIGSTOPped (the group's 3 s timeout ends it);
* ``peer_cuts_in_all_reduce``: the victim shuts its group sockets down (as a re-forming's
  ``regroup.cut`` does in a peer) while the survivors wait for it;
* ``cut_here_in_all_reduce``: rank 0's own sockets are shut down from another thread (as
  the watcher does) while it waits in the collective (the victim is alive, elsewhere);
* ``ddp_backward``: the victim is SIGKILLed while DDP's backward all-reduces its gradients;
* ``new_group_after_kill``: ``dist.new_group`` of the whole world after the victim died;
* ``destroyed_group``: a collective on a group after ``destroy_process_group`` (a group
  an earlier generation left behind);
* ``abandoned_group``: a collective through unickpt's ``Group`` whose generation was torn
  down (``Group.handle`` refuses it);
* ``store_host_gone``: rank 0 hosts a TCPStore and is SIGKILLed; the others call ``get``,
  ``add``, ``set``, ``check``, ``wait``, ``compare_set``, ``multi_get`` on it (and one is
  blocked in ``wait`` when it dies);
* ``store_timeout``: ``wait`` and ``get`` of a key nobody sets, 1 s timeout;
* ``user_error``: rank 0 raises ``RuntimeError("connection string bad")``, its peers
  alive (for contrast: fn's own error, whatever its message).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

CASES = ["kill_in_all_reduce", "kill_in_all_gather", "kill_in_broadcast", "killed_before_all_reduce",
         "stopped_in_all_reduce", "peer_cuts_in_all_reduce", "cut_here_in_all_reduce", "ddp_backward",
         "new_group_after_kill", "destroyed_group", "abandoned_group", "store_host_gone", "store_timeout", "user_error"]
WORLD = 3
VICTIM = WORLD - 1
PG_TIMEOUT_S = 3.0


LINKS: dict[int, str] = {}  # the default group's connections, as unickpt.run's regroup.form records them


def record(case: str, rank: int, what: str, error: BaseException) -> None:
    from unickpt.live.run import _network_error, _typed

    t0 = time.monotonic()
    typed = _typed(error, LINKS)
    took = time.monotonic() - t0
    cause = error.__cause__
    print(json.dumps({"case": case, "rank": rank, "call": what, "mro": [c.__name__ for c in type(error).__mro__],
                      "cause": [c.__name__ for c in type(cause).__mro__] if cause is not None else None,
                      "typed": type(typed).__name__, "typed_s": round(took, 3), "network_error": _network_error(typed),
                      "message": str(error).splitlines()[0][:200] if str(error) else ""}), flush=True)


def no_error(case: str, rank: int, what: str) -> None:
    print(json.dumps({"case": case, "rank": rank, "call": what, "mro": None, "message": "no error"}), flush=True)


def _suicide(after_s: float, sig: int = signal.SIGKILL) -> None:
    threading.Timer(after_s, lambda: os.kill(os.getpid(), sig)).start()


def worker(case: str, rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from unickpt import dist as udist

    if case.startswith("store_"):
        return store_worker(case, rank, port)
    udist.track_group_sockets()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    before = udist.open_sockets()
    dist.init_process_group("gloo", store=dist.PrefixStore(case, store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    LINKS.update(udist.links(udist.opened_since(before)))
    dist.barrier()
    victim = rank == VICTIM
    op = case.rsplit("_in_", 1)[-1]
    t = torch.ones(4)

    def collective() -> None:
        if op == "all_gather":
            dist.all_gather([torch.zeros(4) for _ in range(WORLD)], t)
        elif op == "broadcast":
            dist.broadcast(t, src=VICTIM)
        else:
            dist.all_reduce(t)

    try:
        if case.startswith("kill_in_"):
            if victim:
                _suicide(1.0)
                time.sleep(60)
            collective()
        elif case == "killed_before_all_reduce":
            if victim:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1.5)
            collective()
        elif case == "stopped_in_all_reduce":
            if victim:
                os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills it at the end
            collective()
        elif case == "peer_cuts_in_all_reduce":
            if victim:
                time.sleep(1.0)
                udist.shut_group_sockets()
                time.sleep(3)
                return
            collective()
        elif case == "cut_here_in_all_reduce":
            if victim:
                time.sleep(6)
                return
            if rank == 0:
                threading.Timer(1.0, udist.shut_group_sockets).start()
            collective()
        elif case == "ddp_backward":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(torch.nn.Linear(256, 256))
            if victim:
                _suicide(1.0)
            for _ in range(100000):
                model(torch.randn(8, 256)).sum().backward()
        elif case == "new_group_after_kill":
            if victim:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1.0)
            dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=PG_TIMEOUT_S))
        elif case == "destroyed_group":
            sub = dist.new_group(list(range(WORLD)))
            dist.barrier()
            dist.destroy_process_group(sub)
            try:
                dist.all_reduce(t, group=sub)
                no_error(case, rank, "all_reduce(destroyed subgroup)")
            except BaseException as e:  # noqa: BLE001 — recorded, and the default one next
                record(case, rank, "all_reduce(destroyed subgroup)", e)
            world = dist.group.WORLD
            dist.destroy_process_group()
            dist.all_reduce(t, group=world)
            no_error(case, rank, "all_reduce(destroyed default group)")
        elif case == "user_error":
            if rank == 0:
                raise RuntimeError("connection string bad")
            time.sleep(2)  # alive (a peer that exits closes its connections: rank 0's error would follow a loss)
        elif case == "abandoned_group":
            stop = threading.Event()
            group = udist.Group(dist.group.WORLD, rank, WORLD, stop)
            stop.set()
            udist.broadcast_bytes(group, b"x")
        else:
            raise SystemExit(f"unknown case {case}")
    except BaseException as e:  # noqa: BLE001 — what the survivor sees is the point
        record(case, rank, case.rsplit("_in_", 1)[-1] if "_in_" in case else case, e)


def store_worker(case: str, rank: int, port: int) -> None:
    import torch.distributed as dist

    if case == "store_timeout":
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
        for name, call in (("wait", lambda: store.wait(["never"])), ("get", lambda: store.get("never"))):
            try:
                call()
            except BaseException as e:  # noqa: BLE001
                record(case, rank, name, e)
        return
    if rank == 0:  # the store's host: dies once every client is connected
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False,
                              use_libuv=True)
        store.wait(["ready1", "ready2"])
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), use_libuv=True)
    store.set("k", "v")
    store.set(f"ready{rank}", "1")
    if rank == 1:  # blocked in a wait when the host dies
        try:
            store.wait(["never"], timedelta(seconds=10))
        except BaseException as e:  # noqa: BLE001
            record(case, rank, "wait (blocked when the host died)", e)
        return
    time.sleep(1.5)
    calls = {"get": lambda: store.get("k"), "add": lambda: store.add("n", 1), "set": lambda: store.set("k", "w"),
             "check": lambda: store.check(["k"]), "wait": lambda: store.wait(["k"]),
             "compare_set": lambda: store.compare_set("k", "v", "w"), "multi_get": lambda: store.multi_get(["k"])}
    for name, call in calls.items():
        try:
            call()
            no_error(case, rank, name)
        except BaseException as e:  # noqa: BLE001
            record(case, rank, name, e)


def run_case(case: str, env: dict[str, str]) -> list[dict]:
    """Start the case's 3 processes (the collective cases' store hosted here, so that no
    victim takes it down); their JSON lines, parsed."""
    from torch.distributed import TCPStore

    host = None
    if case.startswith("store_") and case != "store_timeout":
        from unickpt.testing import free_port

        port = free_port()
    else:
        host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        port = host.port
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", case, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    if case.startswith("store_") and case != "store_timeout":
        time.sleep(0.5)  # rank 0 hosts: the clients connect once it listens (they retry within their timeout)
    out = []
    deadline = time.monotonic() + 60
    victim = procs[0 if case == "store_host_gone" else VICTIM]
    for p in [p for p in procs if p is not victim] + [victim]:  # the survivors first; the victim killed if still there
        try:
            stdout, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()) if p is not victim else 0.5)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        out += [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    del host
    return out


def main(cases: list[str]) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    for case in cases:
        got = run_case(case, env)
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        os._exit(0)  # no destroy, no atexit: a survivor of a broken group ends here
    main(sys.argv[1:] or CASES)
