"""Live recovery of a framework's job under ``unickpt launch``, for the integrations'
tests (tests/test_lightning.py, tests/test_hf_trainer.py, tests/test_torchtitan.py): one launch with a rank
SIGKILLed, and what every framework's run must then show."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

from collections.abc import Callable
from typing import Any

import unickpt

SHORT_SLEEP = 0.5  # s a step at least, while the job runs short a rank (see pace)
GROWN_SLEEP = 0.02  # s a step at most, once the replacement joined (see pace)


def pace(generation: int, sleep: float) -> None:
    """The pause after each step of the live scripts (tests/hf_trainer_live.py,
    tests/lightning_live.py, tests/titan_live.py): ``sleep`` before the kill (generation 0:
    the kill lands mid-run), at least SHORT_SLEEP while the job runs short a rank
    (generation 1: after the kill, before the replacement joined), at most GROWN_SLEEP
    once it joined (nothing is left to wait for: the run's last steps go at their own
    speed). The replacement is forked from the launcher's fork server, which imported torch
    and the framework (``--preload``); it waits for generation 1's first step (see
    :func:`live_args`) and must join before the run ends: the bound it is given is the steps
    left after the kill x SHORT_SLEEP (about 10 s)."""
    time.sleep(sleep if generation == 0 else max(sleep, SHORT_SLEEP) if generation == 1 else min(sleep, GROWN_SLEEP))


def live_args(extra: Callable[[argparse.ArgumentParser], Any] | None = None) -> argparse.Namespace:
    """The live scripts' command line, as :func:`live_job` gives it: ``--steps``,
    ``--ckpt-dir``, ``--log``, ``--sleep``, and the script's own flags (``extra`` adds them)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    _replacement_waits(args.log)
    return args


def _replacement_waits(log: str) -> None:
    """A replacement (a worker started after generation 0's: ``unickpt launch`` names
    workers ``node.n`` in the order it starts them) waits until generation 1 logged a step,
    so that every run shows the job trained short a rank before the replacement joins
    (forked from the fork server it would be ready at once, and join in the loss's own
    generation)."""
    worker = os.environ.get("UNICKPT_LIVE_WORKER", "")
    if not worker or int(worker.split(".")[1]) < int(os.environ["WORLD_SIZE"]):
        return
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(log) and any(json.loads(x)["generation"] >= 1 for x in open(log) if x.endswith("\n")):
            return  # (whole lines only: a rank may be midway through writing the last one)
        time.sleep(0.02)
    raise SystemExit(f"worker {worker}: generation 1 logged no step within 120 s")


def log_step(path: str, world: unickpt.World, step: int, loss: float, xsum: float, sleep: float) -> None:
    """What every live script's rank logs after each step (the row check_live_run reads:
    the step, the global batch's loss and the sum of its inputs, where and in which process
    it ran), then the step's pause (:func:`pace`)."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": loss, "xsum": xsum, "size": world.size, "generation": world.generation,
                            "rank": world.rank, "pid": os.getpid(), "t": time.time()}) + "\n")
    pace(world.generation, sleep)


def live_job(tmp_path, script: str, nproc: int, steps: int, flags: list[str], sleep: float,
             kill_after: int, timeout: float = 240, preload: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """``unickpt launch --max-restarts 1 --start-method forkserver`` (``--preload`` the
    framework's modules) of ``script`` on ``nproc`` ranks; SIGKILL the
    last rank once step ``kill_after`` is logged; wait for the job. Returns every rank's
    log lines and what happened: the exit code, the pids of generation 0, the kill's time,
    the output and the re-formings' phases (rank 0's $UNICKPT_LIVE_TIMINGS)."""
    log, timings = tmp_path / "log.jsonl", tmp_path / "timings.jsonl"
    preload = ["--preload", ",".join(preload)] if preload else []
    env = dict(os.environ, OMP_NUM_THREADS="1", UNICKPT_SHM_ROOT=str(tmp_path / "shm"),
               UNICKPT_LIVE_TIMINGS=str(timings),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(unickpt.__file__)),
                                           os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "unickpt", "launch", "--standalone", "--nproc-per-node", str(nproc),
                             "--max-restarts", "1", "--start-method", "forkserver", *preload, script, "--steps", str(steps),
                             "--ckpt-dir", str(tmp_path / "ck"), "--log", str(log), "--sleep", str(sleep), *flags],
                            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)

    def rows() -> list[dict]:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []

    try:
        deadline = time.monotonic() + timeout
        while not any(r["step"] >= kill_after for r in rows()):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[-4000:]
            time.sleep(0.05)
        pids = {r["rank"]: r["pid"] for r in rows() if r["generation"] == 0}
        killed_at = time.time()
        os.kill(pids[nproc - 1], signal.SIGKILL)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
    phases = [json.loads(x) for x in timings.read_text().splitlines()] if timings.exists() else []
    return rows(), {"code": code, "pids": pids, "killed_at": killed_at, "output": (tmp_path / "out.txt").read_text(),
                    "phases": phases}


def check_live_run(rows: list[dict], job: dict, nproc: int, steps: int, want: dict[int, dict],
                   what: str) -> float:
    """What live recovery must give, whatever the framework: the job ends 0; the survivors
    log later generations with the pids they had in generation 0 (the same processes),
    first on nproc-1 ranks, then on nproc once the replacement joined (a new pid); every
    step of the run is logged, each on the unbroken run's curve (loss within 1e-4, the
    same samples: the sum of the global batch's inputs); rank 0 logs each step once per
    generation and a generation goes on at the step after the one restored (the steps
    logged after the newest whole snapshot, at most two, are logged again). Returns kill -> next step logged (s)."""
    assert job["code"] == 0, job["output"][-4000:]
    pids, survivors = job["pids"], {job["pids"][r] for r in range(nproc - 1)}
    gens = sorted({r["generation"] for r in rows})
    assert gens[0] == 0 and len(gens) >= 3, (gens, job["output"][-3000:])
    lost = [r for r in rows if r["generation"] == 1]
    assert {r["size"] for r in lost} == {nproc - 1} and {r["pid"] for r in lost} == survivors
    grown = [r for r in rows if r["generation"] == gens[-1]]
    assert {r["size"] for r in grown} == {nproc}
    assert survivors < {r["pid"] for r in grown} and not {r["pid"] for r in grown} & {pids[nproc - 1]}
    assert {r["step"] for r in rows} == set(range(1, steps + 1))
    for r in rows:
        assert abs(r["loss"] - want[r["step"]]["loss"]) <= 1e-4 * abs(want[r["step"]]["loss"]), (r, want[r["step"]])
        assert abs(r["xsum"] - want[r["step"]]["xsum"]) <= 1e-4 * max(1.0, abs(want[r["step"]]["xsum"])), r
    zero = [r for r in rows if r["rank"] == 0]
    for g in gens:
        mine = [r["step"] for r in zero if r["generation"] == g]
        assert mine == list(range(mine[0], mine[0] + len(mine))), (g, mine)
    for prev, nxt in zip(gens, gens[1:]):
        last = max(r["step"] for r in zero if r["generation"] == prev)
        first = min(r["step"] for r in zero if r["generation"] == nxt)
        # the newest whole snapshot: the last step logged, or one or two before it (each
        # snapshot is made whole in the background while the next step runs)
        assert last - 2 <= first - 1 <= last, (prev, last, nxt, first)
    out = job["output"]
    assert re.search(rf"rank {nproc - 1} lost \(exit -9\); continuing on {nproc - 1} ranks at step \d+ \(generation 1\)",
                     out), out[-3000:]
    assert re.search(rf"1 replacement joined; continuing on {nproc} ranks at step \d+", out), out[-3000:]
    assert "resumed step" in out and "from memory" in out
    first_after = min(r["t"] for r in rows if r["generation"] == 1)
    took = first_after - job["killed_at"]
    lost_phase = next(p for p in job["phases"] if p["generation"] == 1)
    phases = {k: round(lost_phase[k] - lost_phase["died"], 3) for k in ("formed", "restored", "first_step")
              if k in lost_phase}
    print(f"{what}: kill -> next step logged {took:.2f} s; rank 0's phases after the death {phases}")
    return took
