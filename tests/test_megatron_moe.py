"""Megatron-Core MoE experts through ``torch_dist``: checkpoints the real Megatron-Core
``dist_checkpointing.save`` writes on 2 gloo ranks at expert parallel 2, from its own expert
modules built on the CPU (``SequentialMLP``, also with ``singleton_local_shards``: one key
per global expert, SwiGLU's fc1 as ``_w``/``_v``; the grouped-GEMM ``GroupedMLP``, whose
``weight1``/``weight2`` are stored transposed per expert), read by unickpt onto expert
parallel 1 (one process, every expert) and 4, every expert at its global id; the ground
truth is each rank's live weights (and Megatron-Core's own EP=1 load agrees with it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core is not installed (see README)")

import unickpt  # noqa: E402
from unickpt.adapters.regions import source_ledger  # noqa: E402
from unickpt.engine.state import Sharded  # noqa: E402
from unickpt.plan.box import Box  # noqa: E402
from unickpt.plan.piece import box_piece  # noqa: E402
from unickpt.testing import run_ranks  # noqa: E402

import megatron_moe_cases as cases  # noqa: E402

pytestmark = pytest.mark.multiprocess

FC1 = f"{cases.PREFIX}experts.linear_fc1.weight"
FC2 = f"{cases.PREFIX}experts.linear_fc2.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind saved at EP=2, then loaded by Megatron-Core at EP=1 (one start of 2 ranks)."""
    root = tmp_path_factory.mktemp("moe")
    for kind, singleton in cases.KINDS:
        Path(cases.checkpoint_dir(str(root), kind, singleton)).mkdir()
    run_ranks(cases.save_and_load_all, 2, str(root), preload=cases.PRELOAD)
    return root


def _live(path: Path, moments: bool = False) -> dict[str, torch.Tensor]:
    """``{"L.E.fc1"|"L.E.fc2": live weight}`` of both ranks (their ``exp_avg`` with ``moments``)."""
    both = {**torch.load(f"{path}.live.0"), **torch.load(f"{path}.live.1")}
    if moments:
        return {k[:-len(".exp_avg")]: v for k, v in both.items() if k.endswith(".exp_avg")}
    return {k: v for k, v in both.items() if not k.endswith(".exp_avg")}


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
def test_every_global_expert_onto_one_process(root: Path, kind: str) -> None:
    """EP 2 -> 1: the stacked ``[layer, expert, out, in]`` tensors hold each rank's live
    experts, and their Adam moments, at their global ids (local expert j of EP rank r is
    expert 2r + j), as Megatron-Core's own EP=1 load also finds them; the ledger accounts
    for every byte."""
    path = root / kind
    live = _live(path)
    assert len(live) == 2 * cases.LAYERS * cases.EXPERTS
    megatron = torch.load(f"{path}.megatron_ep1")
    for state, prefix in ((live, ""), (_live(path, moments=True), "optimizer.state.exp_avg.")):
        fc1, fc2 = unickpt.load_tensor(str(path), prefix + FC1), unickpt.load_tensor(str(path), prefix + FC2)
        assert fc1.shape == (cases.LAYERS, cases.EXPERTS, 2 * cases.FFN, cases.HIDDEN)
        for key, want in state.items():
            layer, expert, which = key.split(".")
            got = (fc1 if which == "fc1" else fc2)[int(layer), int(expert)]
            assert torch.equal(got, want), prefix + key
    for key, want in live.items():
        assert torch.equal(megatron[key], want), f"{key}: Megatron-Core's own load differs from the live weights"
    ledger = source_ledger(str(path))
    assert ledger.unaccounted == [] and ledger.skipped == {}


def test_expert_parallel_2_to_4(root: Path) -> None:
    """EP 2 -> 4: each of 4 expert-parallel ranks asks for its one expert (a box on the
    expert axis, both layers) and gets that global expert's live weights."""
    path = root / "sequential"
    live = _live(path)
    L, E, F, H = cases.LAYERS, cases.EXPERTS, cases.FFN, cases.HIDDEN
    for r in range(4):
        fc1 = torch.full((L, 1, 2 * F, H), 7.0)
        fc2 = torch.full((L, 1, H, F), 7.0)
        unickpt.load({
            FC1: Sharded(fc1, (L, E, 2 * F, H), [box_piece(fc1.shape, Box.whole(fc1.shape), Box((0, r, 0, 0), fc1.shape))]),
            FC2: Sharded(fc2, (L, E, H, F), [box_piece(fc2.shape, Box.whole(fc2.shape), Box((0, r, 0, 0), fc2.shape))]),
        }, str(path))
        for layer in range(L):
            assert torch.equal(fc1[layer, 0], live[f"{layer}.{r}.fc1"]), (r, layer)
            assert torch.equal(fc2[layer, 0], live[f"{layer}.{r}.fc2"]), (r, layer)


def test_singleton_local_shards_one_key_per_global_expert(root: Path) -> None:
    """``singleton_local_shards``: each global expert is its own key (``experts.G.``), fc1
    split into SwiGLU's gate (``_w``) and up (``_v``) halves."""
    path = root / "sequential_singleton"
    live = _live(path)
    m = unickpt.read_manifest(str(path))
    assert sorted(m.tensors) == sorted(n for p in ("", "optimizer.state.exp_avg.") for g in range(cases.EXPERTS)
                                       for n in (f"{p}{cases.PREFIX}experts.{g}.linear_fc1.weight_w",
                                                 f"{p}{cases.PREFIX}experts.{g}.linear_fc1.weight_v",
                                                 f"{p}{cases.PREFIX}experts.{g}.linear_fc2.weight"))
    moments = _live(path, moments=True)
    up = unickpt.load_tensor(str(path), f"optimizer.state.exp_avg.{cases.PREFIX}experts.2.linear_fc1.weight_v")
    assert torch.equal(up[1], moments["1.2.fc1"][cases.FFN:])
    for g in range(cases.EXPERTS):
        w = unickpt.load_tensor(str(path), f"{cases.PREFIX}experts.{g}.linear_fc1.weight_w")
        v = unickpt.load_tensor(str(path), f"{cases.PREFIX}experts.{g}.linear_fc1.weight_v")
        fc2 = unickpt.load_tensor(str(path), f"{cases.PREFIX}experts.{g}.linear_fc2.weight")
        for layer in range(cases.LAYERS):
            assert torch.equal(torch.cat([w[layer], v[layer]]), live[f"{layer}.{g}.fc1"]), (g, layer)
            assert torch.equal(fc2[layer], live[f"{layer}.{g}.fc2"]), (g, layer)
    assert torch.equal(torch.load(f"{path}.megatron_ep1")["1.3.fc1"], live["1.3.fc1"])
