"""Small scripts for tests/test_launch.py, run by real ``unickpt launch`` processes:
``python launch_cases.py MODE``.

* ``ok``: under ``unickpt.run``, 3 all-reduce steps; each rank prints its world and 40
  long lines at once (lines of several ranks must never cut each other).
* ``bug``: rank 1 raises ``RuntimeError("user bug")`` at step 2.
* ``recover``: the same, under ``unickpt.run(fn, recover=(RuntimeError,))``.
* ``early``: rank 1 returns from fn at step 10 while rank 0 trains on.
* ``destroy``: fn destroys the default group itself after its steps (a misuse).
* ``deadlock``: a plain script whose two ranks both wait in ``dist.recv`` (C++).
* ``flaky``: a plain script whose rank 1 exits 3 in the group's first attempt only.
* ``long``: under ``unickpt.run``, 300 all-reduce steps (a job to kill a rank of, then stop).
* ``stuck``: rank 1 sleeps before ``unickpt.run`` (alive, never there); rank 0 gathers.
* ``facts``: a plain script whose ranks print, as one JSON line, what a worker finds when
  its script starts (``__name__``, argv, ``sys.path[0]``, torchrun's variables, its
  session, stdin, its signal handlers, whether torch was imported before its first line), then an atexit
  handler's line; rank 1 exits 3 once rank 0 printed everything (``--start-method
  forkserver`` must run it as spawn does).
"""

from __future__ import annotations

import os
import sys
import time

PRELOADED = "torch" in sys.modules  # before this script imported it: the fork server did

import torch  # noqa: E402 (after the look above)
import torch.distributed as dist  # noqa: E402

MODE = sys.argv[1]
LINE = 3000  # characters in each long line


def steps(world, last: int = 3) -> None:
    for step in range(1, last + 1):
        if MODE in ("bug", "recover") and world.rank == 1 and step == 2 and world.generation == 0:
            raise RuntimeError("user bug")
        if MODE == "early" and world.rank == 1 and step == 10:  # once the jobs started beside it run
            with open("early_returned", "w") as f:  # when fn returned (the test's clock)
                f.write(repr(time.time()))
            return
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.2)
    print(f"done rank {world.rank} size {world.size} generation {world.generation}", flush=True)


def fn(world) -> None:
    print(f"start rank {world.rank} size {world.size} generation {world.generation}", flush=True)
    if MODE == "ok":
        print(f"role {os.environ['ROLE_NAME']}", flush=True)
        for _ in range(40):
            sys.stdout.write(str(world.rank) * LINE + "\n")  # no flush: large writes, cut by the pipe
    steps(world, {"early": 30, "long": 300}.get(MODE, 3))
    if MODE == "destroy":
        dist.destroy_process_group()


if MODE == "facts":
    import atexit
    import json

    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID",
                                          "PYTHONUNBUFFERED")}
    import signal

    handlers = {s: str(signal.getsignal(getattr(signal, s))) for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                                                      "SIGUSR2", "SIGPIPE", "SIGCHLD")}
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "env": env, "handlers": handlers,
                      "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(), "preloaded": PRELOADED,
                      "file": __file__}), flush=True)
    atexit.register(lambda: print(f"atexit rank {os.environ['RANK']}", flush=True))
    print(f"to stderr rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    if os.environ["RANK"] == "0":
        open("facts_printed", "w").close()
        sys.exit(0)
    deadline = time.monotonic() + 60  # rank 1 ends the job: only once rank 0 said everything
    while not os.path.exists("facts_printed") and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
elif MODE in ("deadlock", "flaky"):
    dist.init_process_group("gloo")
    if MODE == "flaky" and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(3)
    if MODE == "deadlock":
        print(f"blocked rank {dist.get_rank()}", flush=True)
        dist.recv(torch.zeros(1), src=1 - dist.get_rank())  # both wait: a deadlock in C++
    dist.barrier()
    print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {dist.get_rank()} done", flush=True)
    dist.destroy_process_group()
elif MODE == "record":  # a plain script whose main torchrun's @record wraps: rank 1 raises
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise RuntimeError("a plain script's bug")
        time.sleep(120)  # rank 0: stopped by the launcher once rank 1 ended the job

    main()
else:
    import unickpt

    if MODE == "stuck" and os.environ["RANK"] == "1":
        time.sleep(3600)  # never reaches unickpt.run: stuck in its set-up (a read, a lock), alive
    unickpt.run(fn, recover=(RuntimeError,) if MODE == "recover" else False)
