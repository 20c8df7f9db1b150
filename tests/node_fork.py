"""The simulated nodes' launcher: one process per pytest process (and preload list) that
imports torch, torchrun and the training code once, then forks each node's torchrun agent
from itself.

A simulated node is a real torchrun agent (``torch.distributed.run.main``: its c10d
rendezvous, its monitoring, its ``--max-restarts``) in a session of its own, whose workers
are real processes that a test SIGKILLs. Started as ``torchrun script``, every agent and
every worker spent 1.5-3 s of CPU importing torch, the trainer and its framework: on 2
cores a 4-node relaunch cost ~20 s of imports before its first step, and the snapshot tests
relaunch dozens of times. Here the agent is forked from this preloaded process and runs
torchrun's own ``--run-path --start-method fork`` mode: its workers are forked from it and
run the script as ``__main__`` (through tests/node_rank.py, which records each rank's pid
for the tests that kill one).

Protocol (tests/snapshot_helpers.py is the only client): one JSON request a line on stdin,
one JSON answer a line on stdout.
- ``{"start": [torchrun args], "cwd": dir, "env": {...}, "log": file}`` -> ``{"pid": agent}``:
  the agent's stdout and stderr go to ``log``.
- ``{"poll": pid}`` -> ``{"code": exit code or null while it runs}`` (a signal: minus its number).
EOF on stdin ends the launcher (the agents it forked run on: a test waits for its own).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from forked_child import exit_after

# torchrun's agent, its rendezvous and its workers' code paths: imported before any fork
# (not a module a worker runs as __main__: runpy would run it a second time)
BASE = [
    "torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.multiprocessing", "torch.nn.functional", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.checkpoint", "unickpt", "unickpt.examples.model", "unickpt.examples.data",
]


def _agent(argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """The forked child: a torchrun agent in its own session, its output to ``log``; never returns."""

    def body() -> None:
        os.setsid()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["torchrun", *argv]
        from torch.distributed.run import main

        main(argv)

    exit_after(log, body)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for name in [*BASE, *sys.argv[1:]]:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) > 1:  # a fork copies no thread but every lock a thread may hold
        raise SystemExit(f"node_fork: preloading started {len(threads) - 1} thread(s): agents cannot be forked safely")
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an import prints goes to stderr, never into the answers
    ended: dict[int, int] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if "start" in req:
            pid = os.fork()
            if pid == 0:
                out.close()
                _agent(list(req["start"]), req["cwd"], dict(req["env"]), req["log"])
            answer: dict[str, int | None] = {"pid": pid}
        else:
            pid = int(req["poll"])
            if pid not in ended:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    ended[pid] = os.waitstatus_to_exitcode(status)
            answer = {"code": ended.get(pid)}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
