"""Proof of the rules: a Megatron-style tensor-parallel GPT (fused GQA QKV, fused SwiGLU,
vocabulary-parallel padded embedding, row/column linears, replicated norms, pipeline
stages) with ZeRO-1/2/3 flat optimizer partitions, saved at layout A, loaded at layout B,
and compared bitwise — every local tensor of every B rank against the layout cut
independently from the single-process reference, and the consolidated checkpoints
against the reference itself.

Layouts are ``(tp, pp, dp, zero)``. Four A layouts are saved by real gloo ranks (one spawn
of 4 processes that also checks replica mismatches, averaging, and a torch-native
DTensor job resuming from a Megatron-style checkpoint); the others are saved by
simulated ranks in this process (each rank's file written as that rank would, the
manifest assembled from every rank's report). Loading needs no process group, so every
B layout is loaded rank by rank here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.format.values import decode_value
from unickpt.rules import Coords, Rules

from forked import run_forked
from rules_cases import (
    CFG,
    PAD_SAVE,
    REAL_LAYOUTS,
    GPTStage,
    Layout,
    RankJob,
    consolidated_mismatches,
    forward_tp,
    load_layout,
    reference,
    save_layout,
    save_ranks,
    world4,
)
from unickpt.rules import reconcile_ranks

ADAM = ("exp_avg", "exp_avg_sq")
MUON = ("momentum_buffer",)

# (A, B, optimizer state keys); A in REAL_LAYOUTS is saved by real ranks
PAIRS = [
    (Layout(4, 1, 1, 0), Layout(2, 1, 1, 0), ADAM),  # tp 4 -> 2 with GQA (2 kv heads < tp 4: replicated kv heads)
    (Layout(2, 2, 1, 1), Layout(2, 1, 2, 1), ADAM),  # pp 2 -> 1 (stage-local layer names), dp 1 -> 2
    (Layout(1, 1, 2, 1), Layout(1, 1, 2, 3), ADAM),  # ZeRO-1 -> ZeRO-3
    (Layout(1, 1, 3, 2), Layout(1, 1, 2, 2), ADAM),  # dp 3 -> 2, uneven alignment and tail padding
    (Layout(2, 1, 2, 3), Layout(4, 2, 1, 0), ADAM),  # ZeRO-3 -> no ZeRO, tp 2 -> 4, pp 1 -> 2
    (Layout(1, 2, 2, 2), Layout(2, 4, 1, 1), ADAM),  # pp 2 -> 4, ZeRO-2 -> ZeRO-1
    (Layout(4, 2, 1, 2), Layout(1, 1, 1, 0), ADAM),  # everything -> one process
    (Layout(1, 1, 12, 1), Layout(2, 1, 3, 3), ADAM),  # dp 12 (ranks 9, 10, 11: numeric, not alphabetical order)
    (Layout(2, 1, 2, 2), Layout(1, 2, 3, 3), MUON),  # any optimizer's per-parameter state (Muon momentum)
    (Layout(1, 1, 1, 0), Layout(4, 1, 3, 1), ADAM),  # one process -> tp 4 x dp 3 with ZeRO-1
]


def _name(lay: Layout, keys: tuple[str, ...]) -> str:
    real = "real_" if lay in REAL_LAYOUTS and keys == ADAM else "sim_"
    return f"{real}{lay.tp}{lay.pp}{lay.dp}{lay.zero}" + ("_muon" if keys == MUON else "")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rules")
    for a, _, keys in PAIRS:
        if _name(a, keys).startswith("sim_") and not (root / _name(a, keys)).exists():
            save_layout(a, str(root / _name(a, keys)), keys)
    # the Megatron-style job stores under the example model's names, for the torch-native job
    save_layout(Layout(2, 2, 1, 1), str(root / "megatron_llama"), ADAM, store="llama")
    run_forked(world4, 4, str(root))
    return root


def test_tp_model_computes_like_one_process() -> None:
    """The test's tensor-parallel model is the real thing: its shards, combined the Megatron
    way, give the single-process logits (so the layouts the rules are checked against are right)."""
    ref = reference(CFG, ())
    tokens = torch.tensor([3, 49, 0, 17, 25, 48, 11])

    def stages(tp: int) -> list[GPTStage]:
        out = []
        for t in range(tp):
            m = GPTStage(CFG, Coords(tp=tp, tp_rank=t))
            m.load_local(m.fill(ref, pad=1e4))  # padding rows must not leak into the logits
            out.append(m)
        return out

    with torch.no_grad():
        want = forward_tp(stages(1), tokens)
        for tp in (2, 4):
            assert torch.allclose(forward_tp(stages(tp), tokens), want, atol=1e-5), tp


@pytest.mark.multiprocess
@pytest.mark.parametrize("a,b,keys", PAIRS, ids=[f"{a}->{b}" for a, b, _ in PAIRS])
def test_save_at_a_load_at_b(root: Path, tmp_path: Path, a: Layout, b: Layout, keys: tuple[str, ...]) -> None:
    src = root / _name(a, keys)
    m = unickpt.read_manifest(str(src))
    assert m.world_size == a.world
    layout = decode_value(m.metadata["layout"])
    assert layout["degrees"]["tp"] == a.tp and Rules.from_json(layout["rules"]).find("decoder.layers.3.mlp.linear_fc1.weight")

    # the consolidated checkpoint equals the single-process reference, bitwise
    unickpt.convert(str(src), str(tmp_path / "a_consolidated"))
    assert consolidated_mismatches(str(tmp_path / "a_consolidated"), keys) == []

    # every rank of B fills its tensors (TP slices, padded vocab, fused QKV/gate-up, its
    # stage's layers, its ZeRO flat partitions) bitwise equal to the independent cut
    assert load_layout(b, str(src), keys) == []

    # and what B then saves consolidates to the reference again
    ref = reference(CFG, keys)
    states = []
    for r in range(b.world):
        job = RankJob(b, r, None, keys)
        for st in job.states("load"):
            unickpt.load(st, str(src))
        states.append(job.states("save")[0])
    reconcile_ranks(states)
    save_ranks(states, str(tmp_path / "b"))
    unickpt.convert(str(tmp_path / "b"), str(tmp_path / "b_consolidated"))
    assert consolidated_mismatches(str(tmp_path / "b_consolidated"), keys, ref) == []


@pytest.mark.multiprocess
def test_real_ranks_write_what_simulated_ranks_write(root: Path, tmp_path: Path) -> None:
    """The spawned 4-rank saves hold the same fragments (boxes and bytes) as the same
    layouts saved by simulated ranks, and padding never reaches the checkpoint."""
    for lay in REAL_LAYOUTS:
        save_layout(lay, str(tmp_path / "sim"), ADAM)
        real, sim = unickpt.read_manifest(str(root / _name(lay, ADAM))), unickpt.read_manifest(str(tmp_path / "sim"))
        assert set(real.tensors) == set(sim.tensors)
        for n, e in real.tensors.items():
            key = lambda f: (f.rank, tuple((p.global_box, p.flat_offset) for p in f.pieces), tuple(f.crc32c))  # noqa: E731
            assert sorted(map(key, e.fragments)) == sorted(map(key, sim.tensors[n].fragments)), (lay, n)
        for n, e in real.tensors.items():
            if n.endswith("word_embeddings.weight") or n.endswith("output_layer.weight"):
                assert e.shape[0] == CFG.vocab
        # padding (vocabulary rows past 50, ZeRO alignment and tail) held PAD_SAVE on the
        # saving ranks: not one of those values was written, and stored bytes = reference bytes
        pad = torch.tensor([PAD_SAVE], dtype=torch.float32).numpy().tobytes()
        stored = 0
        for f in (root / _name(lay, ADAM)).glob("rank_*.safetensors"):
            data = f.read_bytes()
            assert pad not in data, (lay, f.name)
            stored += len(data)
        assert sum(e.nbytes for e in real.tensors.values()) <= stored < sum(e.nbytes for e in real.tensors.values()) + 64 << 10


@pytest.mark.multiprocess
def test_replicated_kv_heads_are_stored_once(root: Path) -> None:
    m = unickpt.read_manifest(str(root / "real_4110"))
    e = m.tensors["model.decoder.layers.0.self_attention.linear_qkv.weight"]
    boxes = [(p.global_box.offsets[0], p.global_box.lengths[0]) for f in e.fragments for p in f.pieces]
    assert sorted(boxes) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4)]  # q heads, 2 k, 2 v


@pytest.mark.multiprocess
def test_torch_native_job_and_megatron_job_share_checkpoints(root: Path) -> None:
    """The spawn loaded the Megatron-style checkpoint into a DTensor (dp=2 x tp=2) job under
    the example model's names and checked it; here Megatron-style jobs resume from the
    checkpoint that torch-native job saved."""
    m = unickpt.read_manifest(str(root / "native"))
    assert "model.layers.0.attention.wk.weight" in m.tensors and "Shard(0)" in m.tensors["model.layers.0.attention.wk.weight"].layout
    for b in (Layout(4, 1, 1, 3), Layout(2, 2, 1, 0), Layout(1, 1, 3, 2)):
        assert load_layout(b, str(root / "native"), ADAM, store="llama") == [], b


@pytest.mark.multiprocess
def test_averaged_replicas_are_stored_as_their_mean(root: Path) -> None:
    ref = reference(CFG, ())
    for name in ("decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight"):
        base = ref["model." + name]
        copies = [(base + 0.125 * (r % 2)).double() for r in range(4)]  # ranks hold base + 0.125 * tp_rank
        want = (copies[0] + copies[1] + copies[2] + copies[3]) / 4
        assert torch.equal(unickpt.load_tensor(str(root / "averaged"), "model." + name), want.float())
    # a tensor-parallel weight is unaffected
    w = "decoder.layers.1.mlp.linear_fc2.weight"
    assert torch.equal(unickpt.load_tensor(str(root / "averaged"), "model." + w), ref["model." + w])


def _moe_rank(tp: int, t: int, ep: int, e: int, glob: dict[str, torch.Tensor] | None, shapes: dict) -> dict[str, torch.Tensor]:
    """Rank (tp t, ep e) of a 2-layer MoE block: 4 experts with per-expert names
    (``local_experts.j``: fused gate/up fc1, row-parallel fc2), one stacked expert tensor
    cut on the expert dim, a replicated router."""
    out = {}
    experts = list(range(4))[e * (4 // ep) : (e + 1) * (4 // ep)]
    for layer in range(2):
        p = f"decoder.layers.{layer}.mlp."
        out[p + "router.weight"] = glob[p + "router.weight"].clone() if glob else torch.zeros(shapes[p + "router.weight"])
        stacked = p + "experts.weight1"
        out[stacked] = glob[stacked][experts[0] : experts[-1] + 1].clone() if glob else torch.zeros(len(experts), 6, 8)
        for j, g in enumerate(experts):
            fc1, fc2 = f"{p}experts.local_experts.{g}.linear_fc1.weight", f"{p}experts.local_experts.{g}.linear_fc2.weight"
            loc = f"{p}experts.local_experts.{j}."
            if glob:
                gate, up = glob[fc1].chunk(2)
                out[loc + "linear_fc1.weight"] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
                out[loc + "linear_fc2.weight"] = glob[fc2].chunk(tp, dim=1)[t].clone()
            else:
                out[loc + "linear_fc1.weight"] = torch.zeros(2 * len(torch.arange(10).chunk(tp)[t]), 8)
                out[loc + "linear_fc2.weight"] = torch.zeros(8, len(torch.arange(10).chunk(tp)[t]))
    return out


def test_expert_parallel_reshards(tmp_path: Path) -> None:
    from unickpt.rules import Rule, apply_rules, experts, presets

    preset = presets.megatron_gpt(50, 2, 4, 2, 4, 42, num_experts=4, expert_ffn_hidden=10)
    rules = Rules([Rule(r"decoder\.layers\.\d+\.mlp\.experts\.weight1", experts(), stages="any")] + preset.rules, preset.renumber)
    shapes = {}
    for layer in range(2):
        p = f"decoder.layers.{layer}.mlp."
        shapes[p + "router.weight"] = (4, 8)
        shapes[p + "experts.weight1"] = (4, 6, 8)
        for g in range(4):
            shapes[f"{p}experts.local_experts.{g}.linear_fc1.weight"] = (20, 8)
            shapes[f"{p}experts.local_experts.{g}.linear_fc2.weight"] = (8, 10)
    glob = {n: torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, (n, s) in enumerate(shapes.items())}

    def states(tp: int, ep: int, fill: bool, mode: str):
        out = []
        for rank in range(tp * ep):
            c = Coords.from_rank(rank, tp=tp, ep=ep)
            local = _moe_rank(tp, c.tp_rank, ep, c.ep_rank, glob if fill else None, shapes)
            out.append((local, {"model": apply_rules(local, rules, c, mode, strict=False)}))
        return out

    saved = states(1, 4, True, "save")
    reconcile_ranks([s for _, s in saved])
    save_ranks([s for _, s in saved], str(tmp_path / "ep4"))
    m = unickpt.read_manifest(str(tmp_path / "ep4"))
    e = m.tensors["model.decoder.layers.0.mlp.router.weight"]  # replicated: every element stored once (the replicas share the rows)
    assert sum(p.global_box.volume for f in e.fragments for p in f.pieces) == e.shape[0] * e.shape[1]
    assert len(m.tensors["model.decoder.layers.0.mlp.experts.weight1"].fragments) == 4
    unickpt.convert(str(tmp_path / "ep4"), str(tmp_path / "c"))
    for n, t in glob.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "c"), "model." + n), t), n
    for tp, ep in ((2, 2), (1, 1), (2, 4)):
        for rank, (local, st) in enumerate(states(tp, ep, False, "load")):
            unickpt.load(st, str(tmp_path / "ep4"))
            c = Coords.from_rank(rank, tp=tp, ep=ep)
            want = _moe_rank(tp, c.tp_rank, ep, c.ep_rank, glob, shapes)
            assert all(torch.equal(local[n], want[n]) for n in want), (tp, ep, rank)
