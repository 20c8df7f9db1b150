"""Checkpoints of real torch-parallel jobs (TP plans, FSDP2, TP x FSDP2) reshard exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import unickpt

from forked import run_forked
from torch_parallel_cases import Net, _check, _full, _train, fsdp_load, tp_fsdp_save, tp_load

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_fsdp")
    run_forked(tp_fsdp_save, 4, str(root))
    return root


def test_tp_x_fsdp2_uses_strided_sharding(root):
    assert "_StridedShard" in (root / "placements.txt").read_text() or "StridedShard" in (root / "placements.txt").read_text()


def test_tp_x_fsdp2_to_single_process(root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(3)
    model = Net()
    opt = _train(model, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    unickpt.load(state, str(root / "tp_fsdp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    _check(_full({"model": msd, "optim": osd}), load_file(str(root / "reference.safetensors")), "single process")


def test_tp_x_fsdp2_to_fsdp2_on_2_ranks(root):
    run_forked(fsdp_load, 2, str(root))


def test_tp_x_fsdp2_to_tp_on_2_ranks(root):
    run_forked(tp_load, 2, str(root))


def test_tp_submesh_inside_data_parallel_writes_each_shard_once(tmp_path):
    from torch_parallel_cases import tp_in_ddp_save

    run_forked(tp_in_ddp_save, 4, str(tmp_path))
    m = unickpt.read_manifest(str(tmp_path / "tp_in_ddp"))
    for name, entry in m.tensors.items():
        boxes = [(p.global_box.offsets, p.global_box.lengths) for f in entry.fragments for p in f.pieces]
        assert len(boxes) == len(set(boxes)), f"{name} written by several dp replicas"
    writers = {f.rank for e in m.tensors.values() for f in e.fragments}
    assert len(writers) == 4, f"dp replicas should share the writing, got ranks {writers}"
    from safetensors import safe_open

    written = 0
    for fname in m.files:
        with safe_open(str(tmp_path / "tp_in_ddp" / fname), "pt") as st:
            written += len(list(st.keys()))
    assert written == sum(len(e.fragments) for e in m.tensors.values()), "replicas wrote duplicate shards"
    ref = load_file(str(tmp_path / "reference_tp_in_ddp.safetensors"))
    for k, v in ref.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "tp_in_ddp"), k), v), k
