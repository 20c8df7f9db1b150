"""The launcher of the tests' DeepSpeed jobs: one process per pytest process that imports
torch and DeepSpeed once, then forks each job's ranks from itself.

A DeepSpeed rank started by torchrun spends about 8 s of CPU importing torch, DeepSpeed and
what ``deepspeed.initialize`` pulls in (torch._dynamo, and torch._inductor through
DeepSpeed's Muon optimizer, imported to check the optimizer is supported); its training and
saving take well under a second. On 2 cores a 4-rank job cost ~20 s of imports and the
DeepSpeed test modules ran 25 such jobs. Forked from this process, each rank is a real
DeepSpeed process as under torchrun (its own interpreter state from the fork on, its own
gloo connections, the environment torchrun gives a rank: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), running the same script as ``__main__``;
what it imports is imported once, before any process group exists.

Protocol (this file run as a script, ``tests/ds_cases.py`` its only client): one JSON
request a line on stdin, ``{"nproc": N, "argv": [script or "-m", module, args...],
"timeout": s}``; one JSON answer a line on stdout, ``{"codes": [exit code of each rank],
"logs": [file of each rank's stdout and stderr], "timed_out": bool}``. A rank that fails
makes the others killed (as torchrun does); a job past its timeout is killed whole (its
codes say -9). EOF on stdin ends the launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time

from forked_child import exit_after, run_main

HERE = os.path.dirname(os.path.abspath(__file__))

# imported once here, before any fork: what the DeepSpeed jobs of the tests import
PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch.nn.functional", "torch._dynamo", "torch._inductor.compile_fx",
    "deepspeed", "deepspeed.comm.torch", "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.pipe", "deepspeed.moe.layer", "deepspeed.checkpoint.ds_to_universal", "deepspeed.utils.zero_to_fp32",
    "megatron.core.enums", "megatron.core.transformer.enums",
    "unickpt", "unickpt.examples.model", "unickpt.examples.data", "unickpt.examples.train",
    "ds_job", "ds_train", "ds_moe_train", "ds_parallel_train",
]


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a module of another DeepSpeed version: the rank imports what it needs
            pass


def _rank(rank: int, nproc: int, port: int, argv: list[str], log: str) -> None:
    """The forked rank: torchrun's environment, its output to ``log``, ``argv`` run as
    ``__main__``; never returns."""

    def body() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        run_main(argv)

    exit_after(log, body)


def _job(nproc: int, argv: list[str], timeout: float, logdir: str) -> dict:
    from unickpt.testing import free_port

    port = free_port()
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(nproc)]
    pids = {}
    for r in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(r, nproc, port, argv, logs[r])
        pids[pid] = r
    codes: list[int | None] = [None] * nproc
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(c is None for c in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            timed_out = timed_out or time.monotonic() > deadline
            if timed_out or any(c not in (None, 0) for c in codes):
                for p, r in pids.items():  # a failed rank ends the job, as torchrun ends it
                    if codes[r] is None:
                        try:
                            os.kill(p, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            time.sleep(0.01)
            continue
        if pid in pids:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
    return {"codes": codes, "logs": logs, "timed_out": timed_out}


def main() -> None:
    sys.path.insert(0, HERE)
    _preload()
    threads = os.listdir("/proc/self/task")
    if len(threads) > 1:  # a fork copies no thread but every lock a thread may hold
        raise SystemExit(f"ds_fork: preloading started {len(threads) - 1} thread(s): its ranks cannot be forked safely")
    logroot = tempfile.mkdtemp(prefix="ds_fork_")
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an import prints goes to stderr, never into the answers
    try:
        for n, line in enumerate(sys.stdin):
            req = json.loads(line)
            logdir = os.path.join(logroot, str(n))
            os.makedirs(logdir)
            out.write(json.dumps(_job(int(req["nproc"]), list(req["argv"]), float(req.get("timeout", 300)), logdir)) + "\n")
            out.flush()
    finally:  # the client read every answer's logs before it closed our stdin
        shutil.rmtree(logroot, ignore_errors=True)


if __name__ == "__main__":
    main()
