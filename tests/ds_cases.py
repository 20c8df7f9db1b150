"""Helpers of tests/test_deepspeed.py: run DeepSpeed (torchrun, CPU, gloo) and its
``ds_to_universal``, and compare universal checkpoints tensor by tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import unickpt
from unickpt.testing import free_port

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


def _run(cmd: list[str], timeout: int = 300) -> None:
    r = subprocess.run(cmd, env=ds_env(), capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")


def ds_train(nproc: int, *args: str) -> None:
    """Run tests/ds_train.py on ``nproc`` ranks."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
          DS_TRAIN, *args])


def run_torchrun(nproc: int, script: str, *args: str) -> None:
    """Run ``script`` on ``nproc`` ranks (torchrun, CPU, gloo through DeepSpeed's environment)."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
          script, *args])


def ds_parallel_train(nproc: int, mode: str, out: str) -> None:
    """Run tests/ds_parallel_train.py (``pp`` or ``tp``) on ``nproc`` ranks."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
          os.path.join(HERE, "ds_parallel_train.py"), mode, out])


def ds_to_universal(tag_dir: str, out: str) -> None:
    """DeepSpeed's own converter."""
    _run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir, "--output_folder", out,
          "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"])


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
