"""The CLI on foreign formats: inspect, verify and convert accept a PyTorch DCP checkpoint
and a DeepSpeed ZeRO checkpoint, and convert writes DCP and DeepSpeed universal output
that the other tools' own readers load bitwise."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from test_cli import invoke
from test_deepspeed_format import _zero2

STATE = {
    "model": {"w": torch.randn(6, 5), "b": torch.arange(7, dtype=torch.bfloat16), "n": torch.tensor(3, dtype=torch.int64)},
    "step": 12,
}


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(STATE, checkpoint_id=str(d))
    return d


def _dcp_load(path: Path) -> dict:
    got = {"model": {k: torch.empty_like(v) for k, v in STATE["model"].items()}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(path))
    return got


def test_inspect_and_verify_a_dcp_checkpoint(dcp_dir: Path) -> None:
    r = invoke("inspect", str(dcp_dir))
    assert r.exit_code == 0, r.output
    assert "dcp (read in place; no checksums)" in r.output and "model.w" in r.output
    r = invoke("verify", str(dcp_dir))
    assert r.exit_code == 0, r.output
    assert "OK (dcp)" in r.output and "not verifiable" in r.output


def test_dcp_imports_then_round_trips_to_dcp(dcp_dir: Path, tmp_path: Path) -> None:
    imported = tmp_path / "imported"
    r = invoke("convert", str(dcp_dir), str(imported))
    assert r.exit_code == 0, r.output
    assert "tensors imported (dcp -> unickpt)" in r.output
    assert unickpt.verify(str(imported)).bytes_checked == sum(v.nbytes for v in STATE["model"].values())
    for k, v in STATE["model"].items():
        assert torch.equal(unickpt.load_tensor(str(imported), f"model.{k}"), v)
    back = tmp_path / "back"
    r = invoke("convert", str(imported), str(back), "--to", "dcp")
    assert r.exit_code == 0, r.output
    got = _dcp_load(back)
    assert got["step"] == 12
    r = invoke("convert", str(imported), str(back), "--to", "dcp")
    assert r.exit_code == 2 and "overwrite" in r.output
    r = invoke("convert", str(imported), str(back), "--to", "dcp", "--overwrite")
    assert r.exit_code == 0, r.output
    for k, v in STATE["model"].items():
        assert torch.equal(got["model"][k], v), k


def test_deepspeed_checkpoint_converts_to_unickpt_and_universal(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    _zero2(src, world=3)
    r = invoke("inspect", str(src))
    assert r.exit_code == 0, r.output
    assert "deepspeed (read in place; no checksums)" in r.output
    out = tmp_path / "u"
    r = invoke("convert", str(src), str(out))
    assert r.exit_code == 0, r.output
    universal = tmp_path / "universal"
    r = invoke("convert", str(out), str(universal), "--to", "deepspeed")
    assert r.exit_code == 0, r.output
    assert "parameters (unickpt -> deepspeed)" in r.output
    r = invoke("convert", str(out), str(universal), "--to", "deepspeed")
    assert r.exit_code == 2 and "overwrite" in r.output
    assert invoke("convert", str(out), str(universal), "--to", "deepspeed", "--overwrite").exit_code == 0
    a, b = unickpt.read_manifest(str(src)), unickpt.read_manifest(str(universal))
    params = [n for n in a.tensors if n.startswith("model.")]
    assert params and all(n in b.tensors for n in params)
    for n in params:
        assert torch.equal(unickpt.load_tensor(str(src), n), unickpt.load_tensor(str(universal), n)), n


def test_bad_conversions_are_one_line_errors(dcp_dir: Path, tmp_path: Path) -> None:
    r = invoke("convert", str(dcp_dir), str(tmp_path / "x"), "--to", "onnx")
    assert r.exit_code == 2 and "unknown output format 'onnx'" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = invoke("inspect", str(empty))
    assert r.exit_code == 2 and "not a checkpoint" in r.output


def test_convert_to_deepspeed_lists_what_the_universal_format_cannot_hold(tmp_path: Path) -> None:
    """The universal format holds parameters and their optimizer state: per-rank state, other
    tensors and values are listed and nothing is written, unless --allow-skip."""
    src = tmp_path / "ckpt"
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"model": {"w": w}, "optim": {"state": {"w": {"exp_avg": w * 2}}}, "loader": {"epoch": 3},
             "ema": {"w": w + 1}}
    unickpt.save(state, str(src))
    out = tmp_path / "universal"
    r = invoke("convert", str(src), str(out), "--to", "deepspeed")
    assert r.exit_code == 1, r.output
    assert "NOT CONVERTED" in r.output and "ema.w" in r.output and "loader.epoch" in r.output
    assert not out.exists()
    r = invoke("convert", str(src), str(out), "--to", "deepspeed", "--allow-skip")
    assert r.exit_code == 0, r.output
    assert "OK with 2 warnings" in r.output and "ema.w" in r.output
    assert torch.equal(unickpt.load_tensor(str(out), "model.w"), w)
