"""``unickpt store``: the job's control plane on a host of its own.

By default node 0's launcher hosts the job's c10d ``TCPStore`` and coordinates the
generations: losing node 0 then ends the job. ``unickpt store --port P`` runs both on
another host (a CPU head node, as torchft's lighthouse), and every node's launcher is
started with ``--store HOST:P``: node 0 is then a node like any other, its loss a node
loss the survivors recover from. One job per store process: it exits when the job ends.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

from ..logs import say
from .control import CONFIG_KEY, Cause
from .launch import Coordinator
from .launch_args import LaunchArgs

TURN_S = 0.01  # how often the coordinator looks at the launchers' reports


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Host the job's store on ``host:port`` and coordinate its generations until the job
    ends; returns the job's exit status (0: every rank finished or was recovered)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                     timeout=timedelta(days=365))
    say(f"unickpt store: serving on {host}:{store.port}; the launchers join with --store <this host>:{store.port}")
    store.wait([CONFIG_KEY])  # the first launcher's (no timeout logged: the store's own, a year)
    cfg = json.loads(store.get(CONFIG_KEY))
    # the coordinator's part of a launch (the job's shape, from the first launcher's command line)
    args = LaunchArgs(nnodes=int(cfg["nnodes"]), nproc_per_node=int(cfg["nproc_per_node"]),
                      min_ranks=int(cfg["min_ranks"]), max_restarts=int(cfg["max_restarts"]),
                      join_timeout=float(cfg["join_timeout"]), node_rank=-1, master_addr=host,
                      store=f"{host}:{store.port}")
    coordinator = Coordinator(store, args)
    coordinator.start()
    while True:
        coordinator.step()  # opens generation 0 once every node joined, then the others; ends the job
        gen = coordinator.gen
        if gen is not None and gen.cause == Cause.END:
            coordinator.wait_nodes_done()
            say(f"unickpt store: {gen.reason}")
            return gen.code if gen.code >= 0 else 1
        time.sleep(TURN_S)
