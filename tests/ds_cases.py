"""Helpers of the DeepSpeed test modules: run DeepSpeed jobs (CPU, gloo; their ranks forked
from one preloaded launcher, tests/ds_fork.py) and DeepSpeed's ``ds_to_universal``, and
compare universal checkpoints tensor by tensor."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

import unickpt

HERE = os.path.dirname(os.path.abspath(__file__))
DS_TRAIN = os.path.join(HERE, "ds_train.py")
STATES = {"fp32": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq",
          "step": "optim.state.{}.step"}


def ds_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    src = os.path.join(os.path.dirname(HERE), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class _Launcher:
    """The client of tests/ds_fork.py: one launcher process for this pytest process (started
    at its first job, ended when this process exits), which forks each job's ranks from its
    preloaded interpreter."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.errors = tempfile.NamedTemporaryFile(prefix="ds_fork_", suffix=".log")  # what the launcher itself says
        atexit.register(self.close)

    def run(self, nproc: int, argv: list[str], timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            # its own session: the launcher and the ranks it forked are killed together (kill())
            self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "ds_fork.py")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.errors, text=True, env=ds_env(),
                                         start_new_session=True)
        try:
            self.proc.stdin.write(json.dumps({"nproc": nproc, "argv": argv, "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C): its answer would answer the next job
            self.kill()
            raise
        if not line:
            said = open(self.errors.name, errors="replace").read()[-6000:]
            code = self.kill()
            raise AssertionError(f"the DeepSpeed launcher (tests/ds_fork.py) ended ({code}) running {argv}:\n{said}")
        answer = json.loads(line)
        if any(answer["codes"]):
            tails = "".join(f"\n--- rank {r} (exit {c}) ---\n{open(log, errors='replace').read()[-6000:]}"
                            for r, (c, log) in enumerate(zip(answer["codes"], answer["logs"])) if c)
            how = f"timed out after {timeout} s" if answer["timed_out"] else "failed"
            raise AssertionError(f"{' '.join(argv)} on {nproc} ranks {how}:{tails}")

    def kill(self) -> int | None:
        """SIGKILL the launcher and every rank it forked (its session, killed before the
        launcher is reaped: its id cannot be another's yet); the next job starts another.
        Returns the launcher's exit status."""
        if self.proc is None:
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code, self.proc = self.proc.wait(), None
        return code

    def close(self) -> None:
        """End the launcher: EOF on its input, then SIGKILL if it has not ended in 30 s."""
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
            self.proc = None
        except subprocess.TimeoutExpired:
            self.kill()


_LAUNCHER = _Launcher()


def run_ds_job(nproc: int, script: str, *args: str, timeout: float = 300) -> None:
    """Run ``script`` on ``nproc`` DeepSpeed ranks (CPU, gloo), forked with torchrun's
    environment from the preloaded launcher (tests/ds_fork.py); raises with the output of
    every failed rank."""
    _LAUNCHER.run(nproc, [script, *args], timeout)


def ds_train(nproc: int, *args: str) -> None:
    """Run tests/ds_train.py on ``nproc`` ranks."""
    run_ds_job(nproc, DS_TRAIN, *args)


def ds_parallel_train(nproc: int, mode: str, out: str) -> None:
    """Run tests/ds_parallel_train.py (``pp`` or ``tp``) on ``nproc`` ranks."""
    run_ds_job(nproc, os.path.join(HERE, "ds_parallel_train.py"), mode, out)


def ds_to_universal(tag_dir: str, out: str) -> None:
    """DeepSpeed's own converter (``python -m deepspeed.checkpoint.ds_to_universal``, in one
    process forked from the launcher)."""
    _LAUNCHER.run(1, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir, "--output_folder", out,
                      "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"], 300)


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in json.load(f)}


def universal_params(uni: str) -> list[str]:
    zero = os.path.join(uni, "zero")
    return sorted(p for p in os.listdir(zero) if os.path.isdir(os.path.join(zero, p)))


def universal_tensor(uni: str, param: str, key: str) -> torch.Tensor | None:
    """The tensor of ``zero/<param>/<key>.pt`` (None when DeepSpeed wrote no such file)."""
    f = os.path.join(uni, "zero", param, key + ".pt")
    if not os.path.exists(f):
        return None
    obj = torch.load(f, weights_only=False)
    return obj["param"] if isinstance(obj, dict) else obj


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same number of elements, same bytes (shapes may differ: ds_to_universal
    stores ZeRO-3 states flat)."""
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def assert_every_byte(path: str, skipped: tuple[str, ...] = ()) -> None:
    """Every byte of every ``*.pt`` file the reader opens is accounted for (read, structure,
    alignment padding, or owned by a reported replica or skipped tensor), and exactly
    ``skipped`` is reported skipped."""
    from unickpt.adapters.regions import source_ledger

    ledger = source_ledger(path)
    pt = [f for f in unickpt.read_manifest(path).files if f.endswith(".pt")]
    assert pt and ledger.unaccounted == [] and ledger.files_unchecked == [], ledger.line()
    assert sorted(ledger.skipped) == sorted(skipped), ledger.skipped
    sizes = sum(os.path.getsize(os.path.join(path, f)) for f in pt)
    assert ledger.bytes_checked == sizes, (ledger.bytes_checked, sizes)
