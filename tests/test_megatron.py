"""Megatron-Core ``dist_checkpointing`` (torch_dist backend) read in place: a checkpoint that
the real Megatron-Core wrote on 2 gloo ranks (TP=2 column/row-parallel stacked layers,
replicated, bf16, the distributed optimizer's uneven flat buffers, ShardedObjects,
``common.pt``) loads onto other splits bitwise as Megatron-Core's own
``dist_checkpointing.load`` does; inspect, verify, convert and export work on it; its
pickles (the DCP planner's ``all_local_plans``, ``common.pt``) are read as data only."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core is not installed (see README)")

import unickpt  # noqa: E402
from unickpt.adapters.dcp import read_metadata  # noqa: E402
from unickpt.adapters.detect import checkpoint_format, open_manifest  # noqa: E402
from unickpt.adapters.megatron import read_megatron  # noqa: E402
from unickpt.adapters.torch_archive import InertRecord  # noqa: E402
from unickpt.errors import UnickptError, UnsafePickleError  # noqa: E402
from megatron_cases import COMMON, FLAT_KEY, compare_loads, full_tensors, run_preloaded, save, targets  # noqa: E402
from test_cli import invoke  # noqa: E402

FC1 = "decoder.layers.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dist_checkpointing.save`` on 2 ranks, then both loaders on 1 process."""
    path = tmp_path_factory.mktemp("megatron") / "iter_0000007"
    path.mkdir()
    run_preloaded(save, 2, str(path))
    run_preloaded(compare_loads, 1, str(path), str(path.parent / "loads.pt"))
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.multiprocess
def test_loads_onto_other_splits_as_megatron_does(ckpt: Path) -> None:
    loads = torch.load(ckpt.parent / "loads.pt")
    assert len(loads["megatron"]) == len(targets()) == 10
    for (key, _, offsets, lengths, dtype), ref, got in zip(targets(), loads["megatron"], loads["unickpt"]):
        assert ref.dtype == got.dtype == dtype and tuple(got.shape) == lengths
        assert torch.equal(_bits(ref), _bits(got)), f"{key} {offsets}+{lengths} differs from dist_checkpointing.load"
        want = full_tensors()[key][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        assert torch.equal(_bits(got), _bits(want)), f"{key} {offsets}+{lengths} is not what was saved"


@pytest.mark.multiprocess
def test_manifest_of_a_real_megatron_checkpoint(ckpt: Path) -> None:
    assert checkpoint_format(str(ckpt)) == "megatron"
    m = read_megatron(str(ckpt))
    assert m.provenance["format"] == "megatron" and m.provenance["sharded_backend"] == "torch_dist"
    assert m.world_size == 2 and m.provenance["dcp_version"]
    full = full_tensors()
    assert sorted(m.tensors) == sorted(full)
    for name, t in full.items():
        assert m.tensors[name].shape == tuple(t.shape), name
    assert m.tensors[FC1].dtype == "F32" and m.tensors["decoder.layers.mlp.linear_fc2.weight"].dtype == "BF16"
    assert len(m.tensors[FC1].fragments) == 6  # 3 stacked layers x 2 TP ranks
    assert len(m.tensors["decoder.final_layernorm.weight"].fragments) == 1  # replicated: stored and read once
    flat = m.tensors[f"{FLAT_KEY}.exp_avg"]
    assert sorted(f.pieces[0].global_box.lengths[0] for f in flat.fragments) == [23, 37]  # the uneven DP slices
    scale = m.tensors["grad_scaler.scale"]  # a tensor of common.pt, read in place
    assert scale.shape == () and [f.file for f in scale.fragments] == ["common.pt"]
    assert float(unickpt.load_tensor(str(ckpt), "grad_scaler.scale")) == 65536.0
    assert {k: v for k, v in unickpt.load({k: None for k in COMMON}, str(ckpt)).items()} == COMMON
    assert m.values["rng_state/shard_1_2"] == [[{"seed": 1235, "counts": [1, 2]}]]  # a ShardedObject
    skipped = m.provenance["skipped"]
    assert sorted(skipped) == ["args", "numpy_state/shard_0_2", "numpy_state/shard_1_2"]
    assert "argparse.Namespace" in skipped["args"] and "numpy" in skipped["numpy_state/shard_0_2"]


@pytest.mark.multiprocess
def test_planner_records_are_read_as_data(ckpt: Path) -> None:
    """Item 3 of issue 13: ``.metadata`` holds every rank's SavePlan; it is read, not built."""
    from torch.distributed.checkpoint.planner import SavePlan

    plans = read_metadata(str(ckpt)).all_local_plans
    assert len(plans) == 2 and all(isinstance(p, InertRecord) and not isinstance(p, SavePlan) for p in plans)
    assert plans[0].global_name == "torch.distributed.checkpoint.planner.SavePlan"
    items = plans[1].field("items")
    assert items and all(i.global_name.endswith("WriteItem") for i in items)
    assert {i.field("index").fqn for i in items} >= {FC1, f"{FLAT_KEY}.exp_avg"}


@pytest.mark.multiprocess
def test_cli_inspect_verify_convert_export(ckpt: Path, tmp_path: Path) -> None:
    r = invoke("inspect", str(ckpt))
    assert r.exit_code == 0, r.output
    assert "megatron (read in place; no checksums)" in r.output and FC1 in r.output
    # the ShardedObjects (pickled numpy state) and common.pt's argparse args are skipped by
    # name: the ledger lists them and the commands go on only with --allow-skip
    r = invoke("verify", str(ckpt))
    assert r.exit_code == 1 and "INCOMPLETE" in r.output and "skipped args" in r.output, r.output
    r = invoke("verify", str(ckpt), "--allow-skip")
    assert r.exit_code == 0, r.output
    out = tmp_path / "converted"
    r = invoke("convert", str(ckpt), str(out))
    assert r.exit_code == 1 and not out.exists(), r.output
    r = invoke("convert", str(ckpt), str(out), "--allow-skip")
    assert r.exit_code == 0, r.output
    unickpt.verify(str(out))
    for name, t in full_tensors().items():
        assert torch.equal(_bits(unickpt.load_tensor(str(out), name)), _bits(t)), name
    assert unickpt.read_manifest(str(out)).values["iteration"] == 7
    hf = tmp_path / "hf"
    r = invoke("export", str(ckpt), str(hf), "--prefix", "decoder.", "--names", "keep", "--allow-skip", "--no-config")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    got = {}
    for f in hf.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == ["final_layernorm.weight", "layers.mlp.linear_fc1.weight", "layers.mlp.linear_fc2.weight"]
    assert torch.equal(_bits(got["layers.mlp.linear_fc2.weight"]), _bits(full_tensors()["decoder.layers.mlp.linear_fc2.weight"]))


class _Payload:
    """An object whose unpickling would run a command."""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.multiprocess
def test_common_state_runs_no_code(ckpt: Path, tmp_path: Path) -> None:
    """Anything in common.pt beyond data becomes an inert record, reported skipped; its
    class is never called."""
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    payload = _Payload()
    payload.marker = str(tmp_path / "ran")
    torch.save({"iteration": 9, "hook": payload, "nested": {"ok": [1, 2], "bad": {1, payload}}}, copy / "common.pt")
    m = open_manifest(str(copy))
    assert not (tmp_path / "ran").exists()
    assert m.values["iteration"] == 9 and m.values["nested.ok"] == [1, 2]
    assert "system" in m.provenance["skipped"]["hook"] and "system" in m.provenance["skipped"]["nested.bad"]
    # the DCP metadata stays strictly allow-listed: an unknown class there is refused
    md = (copy / ".metadata").read_bytes()
    evil = pickle.dumps(payload)
    (copy / ".metadata").write_bytes(evil + md)
    with pytest.raises(UnsafePickleError, match="system"):
        open_manifest(str(copy))
    assert not (tmp_path / "ran").exists()


@pytest.mark.multiprocess
def test_other_backends_are_refused(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "zarr"
    shutil.copytree(ckpt, copy)
    (copy / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(UnickptError, match="backend 'zarr' is not supported"):
        open_manifest(str(copy))
    r = invoke("inspect", str(copy))
    assert r.exit_code == 2 and "zarr" in r.output



FLAT_015 = Path(__file__).parent / "data" / "megatron_0_15_flat"


def test_flattened_range_of_megatron_core_0_15() -> None:
    """megatron-core <= 0.15 saved the distributed optimizer's flat slices of TP chunks
    (``flattened_range``) as reformulated grids; they read back as the original tensors, and
    load onto flat ranges bitwise as megatron-core 0.15's own load (recorded by
    tests/data/make_megatron_0_15_flat.py, since 0.16 cannot write or read them)."""
    from unickpt.engine.state import Sharded
    from unickpt.plan.box import Box
    from unickpt.plan.piece import flat_pieces

    path = str(FLAT_015 / "ckpt")
    expected = torch.load(FLAT_015 / "expected.pt")
    m = unickpt.read_manifest(path)
    assert m.provenance["format"] == "megatron" and m.values["iteration"] == 5
    w = m.tensors["optimizer.state.exp_avg.w"]
    assert w.shape == (2, 6, 4) and sorted(f.shape for f in w.fragments) == [(10,), (10,), (14,), (14,)]
    for name, t in expected["full"].items():
        assert torch.equal(_bits(unickpt.load_tensor(path, name)), _bits(t)), name
    loads = [x for rank in expected["megatron_load"] for x in rank]
    loads.append(("optimizer.state.exp_avg.w", (2, 3, 4), 1, 0, 5, 20, None))  # another DP split than saved
    for key, local, axis, tp, a, b, ref in loads:
        shape = expected["full"][key].shape
        offsets = tuple(tp * local[d] if d == axis else 0 for d in range(len(local)))
        got = torch.full((b - a,), 7, dtype=expected["full"][key].dtype)
        unickpt.load({key: Sharded(got, tuple(shape), flat_pieces(Box(offsets, local), a, b))}, path)
        chunk = expected["full"][key][tuple(slice(o, o + n) for o, n in zip(offsets, local))].reshape(-1)[a:b]
        assert torch.equal(_bits(got), _bits(chunk)), (key, tp, a, b)
        if ref is not None:
            assert torch.equal(_bits(got), _bits(ref)), f"{key} TP {tp} [{a}, {b}) differs from megatron-core 0.15's load"
