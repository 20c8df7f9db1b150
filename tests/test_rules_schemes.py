"""The rules layer without processes or files: schemes as piece constructors, names,
strictness, serialisation, ZeRO flat partitions, replica reconciliation."""

from __future__ import annotations

import json
import random

import pytest
import torch

import unickpt
from unickpt.errors import InconsistentStateError, LayoutError
from unickpt.plan.box import Box
from unickpt.rules import (
    Coords,
    Renumber,
    Rule,
    Rules,
    apply_rules,
    averaged,
    column,
    compose_flat,
    experts,
    fused,
    group_partition,
    optimizer_state,
    param_partition,
    partitioned,
    presets,
    reconcile_ranks,
    replicated,
    row,
    scheme_from_json,
    split_sizes,
    vocab,
)
from unickpt.rules.replicas import piece_region


def test_split_sizes() -> None:
    assert split_sizes(10, 4, "chunk") == [3, 3, 3, 1]
    assert split_sizes(42, 4, "chunk") == [11, 11, 11, 9]
    assert split_sizes(2, 4, "chunk") == [1, 1, 0, 0]
    assert split_sizes(10, 4, "balanced") == [3, 3, 2, 2]
    assert split_sizes(10, 3, [1, 4, 5]) == [1, 4, 5]
    with pytest.raises(LayoutError):
        split_sizes(10, 3, [1, 4, 4])
    with pytest.raises(LayoutError):
        split_sizes(10, 3, "weird")


def test_coords() -> None:
    for r in range(24):
        c = Coords.from_rank(r, tp=2, pp=3, dp=2, ep=2)
        assert c.rank() == r and c.world_size == 24
    c = Coords.from_rank(5, tp=2, pp=2, dp=2)
    assert (c.tp_rank, c.dp_rank, c.pp_rank) == (1, 0, 1)
    with pytest.raises(LayoutError):
        Coords(tp=2, tp_rank=2)
    with pytest.raises(LayoutError):
        Coords.from_rank(8, tp=2, dp=4)


# ---------------------------------------------------------------- schemes tile the tensor


def _check_tiling(scheme, global_shape, local_shape_of, n, axis="tp", name="w") -> list:
    """Every element of the global tensor is owned by exactly one rank and held by >= 1;
    every target's boxes fit; returns the layouts."""
    owned = torch.zeros(global_shape, dtype=torch.int64)
    held = torch.zeros(global_shape, dtype=torch.int64)
    layouts = []
    for r in range(n):
        c = Coords(tp=n, tp_rank=r) if axis == "tp" else Coords(ep=n, ep_rank=r)
        lay = scheme.layout(name, global_shape, local_shape_of(r), c)
        layouts.append(lay)
        local_cover = torch.zeros(local_shape_of(r), dtype=torch.int64)
        for t in lay.targets:
            assert t.local_box.lengths == t.global_box.lengths
            assert Box.whole(local_shape_of(r)).contains(t.local_box) and Box.whole(global_shape).contains(t.global_box)
            g = held
            o = owned
            lc = local_cover
            for d, (go, gn, lo) in enumerate(zip(t.global_box.offsets, t.global_box.lengths, t.local_box.offsets)):
                g, o, lc = g.narrow(d, go, gn), o.narrow(d, go, gn), lc.narrow(d, lo, gn)
            g += 1
            lc += 1
            if t.owner:
                o += 1
        assert local_cover.numel() == 0 or int(local_cover.max()) <= 1
        assert lay.covers_local == bool((local_cover == 1).all())
    assert bool((owned == 1).all()), owned
    assert bool((held >= 1).all())
    return layouts


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_column_row_even_and_uneven(n: int) -> None:
    for shape, scheme, d in [((8, 3), column(), 0), ((10, 3), column(), 0), ((3, 10), row(), 1), ((10, 3), column(split="balanced"), 0)]:
        sizes = split_sizes(shape[d], n, scheme.split)
        _check_tiling(scheme, shape, lambda r: tuple(sizes[r] if k == d else s for k, s in enumerate(shape)), n)
    with pytest.raises(LayoutError, match="local tensor has shape"):
        column().layout("w", (10, 3), (2, 3), Coords(tp=4, tp_rank=0))


def test_explicit_widths() -> None:
    s = column(split=[1, 4, 5])
    assert s.global_shape((4, 2), Coords(tp=3, tp_rank=1)) == (10, 2)
    _check_tiling(s, (10, 2), lambda r: ([1, 4, 5][r], 2), 3)


def test_heads_replicated_when_fewer_than_ranks() -> None:
    # 2 kv heads of head_dim 4 over tp=4: each head on 2 ranks, stored by one
    lays = _check_tiling(column(unit=4, size=8), (8, 6), lambda r: (4, 6), 4)
    assert [lay.targets[0].global_box.offsets[0] for lay in lays] == [0, 0, 4, 4]
    assert [lay.targets[0].owner for lay in lays] == [True, False, True, False]
    with pytest.raises(LayoutError, match="replicated evenly"):
        column(unit=4, size=8).layout("w", (8, 6), (4, 6), Coords(tp=3, tp_rank=0))


def test_vocab_padding() -> None:
    # vocab 50 padded to 64 over 4 ranks: rank 3 holds rows 48..49 and 14 rows of padding
    lays = _check_tiling(vocab(50), (50, 8), lambda r: (16, 8), 4)
    assert lays[3].targets[0].global_box == Box((48, 0), (2, 8)) and not lays[3].covers_local
    assert vocab(50).global_shape((16, 8), Coords(tp=4)) == (50, 8)
    _check_tiling(vocab(50), (50, 8), lambda r: (17, 8), 3)
    with pytest.raises(LayoutError, match="fewer than"):
        vocab(50).layout("e", (50, 8), (12, 8), Coords(tp=4, tp_rank=0))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fused_qkv_gqa_and_swiglu(n: int) -> None:
    qkv = fused([16, 8, 8], units=4)  # 4 q heads, 2 kv heads, head_dim 4
    rows = 16 // n + 2 * (4 if n == 4 else 8 // n)
    lays = _check_tiling(qkv, (32, 5), lambda r: (rows, 5), n)
    if n == 4:  # q head r, kv head r // 2 (replicated over 2 ranks)
        t = lays[1].targets
        assert [x.global_box.offsets[0] for x in t] == [4, 16, 24] and [x.owner for x in t] == [True, False, False]
    sizes = split_sizes(42, n)
    _check_tiling(fused([42, 42]), (84, 5), lambda r: (2 * sizes[r], 5), n)
    assert qkv.global_shape((rows, 5), Coords(tp=n)) == (32, 5)


def test_experts_and_replicated() -> None:
    _check_tiling(experts(), (8, 3, 5), lambda r: (2, 3, 5), 4, axis="ep")
    lays = _check_tiling(replicated(), (6,), lambda r: (6,), 4)
    assert sum(t.owner for lay in lays for t in lay.targets) == 1
    assert averaged().layout("n", (6,), (6,), Coords()).reduce == "mean"


def test_schemes_serialise() -> None:
    for s in [replicated(), averaged(), column(), row(split=[1, 2]), partitioned(2, "ep"), vocab(7), experts(1),
              fused([4, 2, 2], units=2, split="balanced", names=[r"\1.q", r"\1.k", r"\1.v"]), column(unit=3, size=9)]:
        assert scheme_from_json(json.loads(json.dumps(s.to_json()))) == s


# ---------------------------------------------------------------- names


def test_renumber_pipeline_stages() -> None:
    r = Renumber(r"^layers\.(\d+)\.", "pp", total=10)  # balanced: 3, 3, 2, 2
    c = Coords(pp=4, pp_rank=1)
    assert r.to_global("layers.2.attention.wq.weight", c) == "layers.5.attention.wq.weight"
    assert r.to_local("layers.5.attention.wq.weight", c) == "layers.2.attention.wq.weight"
    assert r.to_local("layers.6.x", c) is None and r.to_global("norm.weight", c) == "norm.weight"
    with pytest.raises(LayoutError, match="holds 3 items"):
        r.to_global("layers.3.x", c)
    explicit = Renumber(r"^layers\.(\d+)\.", "pp", split=[1, 5, 4])
    assert explicit.to_global("layers.0.x", Coords(pp=3, pp_rank=2)) == "layers.6.x"
    rules = presets.llama(250, 10, 4, 2, 16)
    for stage in range(4):
        c = Coords(pp=4, pp_rank=stage)
        for i in range([3, 3, 2, 2][stage]):
            g = rules.global_name(f"layers.{i}.ffn_norm.weight", c)
            assert rules.local_name(g, c) == f"layers.{i}.ffn_norm.weight"
            assert g == f"layers.{[0, 3, 6, 8][stage] + i}.ffn_norm.weight"


def test_first_match_wins_and_whole_names() -> None:
    rules = Rules([Rule(r"norm\.weight", replicated(), stages="last"), Rule(r".*\.weight", column()), Rule(r".*", replicated())])
    assert rules.find("norm.weight")[0] == 0
    assert rules.find("layers.0.attention_norm.weight")[0] == 1  # fullmatch: "norm\.weight" is not a suffix match
    assert rules.find("bias")[0] == 2


def test_strictness() -> None:
    rules = Rules([Rule(r"a", replicated()), Rule(r"b", column()), Rule(r"c", replicated(), stages="last")])
    c = Coords()
    with pytest.raises(LayoutError, match=r"1 tensors match no rule: x.*rule\(s\) match no tensors.*'b'"):
        apply_rules({"a": torch.zeros(2), "x": torch.zeros(2), "c": torch.zeros(1)}, rules, c, "load")
    out = apply_rules({"a": torch.zeros(2), "x": torch.ones(2)}, rules, c, "load", strict=False)
    assert isinstance(out["a"], unickpt.Sharded) and torch.equal(out["x"], torch.ones(2))
    # a "last"-stage rule matching on the first of two stages is a layout error
    with pytest.raises(LayoutError, match="stages are 'last'"):
        apply_rules({"c": torch.zeros(1)}, rules, Coords(pp=2, pp_rank=0), "load", strict=False)
    # on stage 0 of 2 the "last" rule is not expected to match
    apply_rules({"a": torch.zeros(2), "b": torch.zeros(2, 2)}, rules, Coords(pp=2, pp_rank=0), "load")
    with pytest.raises(LayoutError, match="mode"):
        apply_rules({}, rules, c, "write")
    with pytest.raises(LayoutError, match="not a valid regex"):
        Rule("(", replicated())


def test_rules_round_trip_through_manifest_metadata(tmp_path) -> None:
    rules_list = [
        presets.megatron_gpt(32000, 8, 32, 8, 128, 11008, num_experts=8),
        presets.megatron_gpt(50, 4, 4, 2, 4, 42, naming="legacy", qkv="interleaved", tied=True),
        presets.megatron_gpt(50, 4, 4, 2, 4, 42, store="llama", layers_per_stage=[1, 3]),
        presets.llama(250, 2, 4, 2, 16, 172, tied=True),
    ]
    for i, rules in enumerate(rules_list):
        meta = {"layout": rules.metadata(Coords(tp=2, pp=2), zero={"stage": 1})}
        unickpt.save({"x": torch.zeros(1)}, str(tmp_path / str(i)), metadata=meta)
        from unickpt.format.values import decode_value

        back = decode_value(unickpt.read_manifest(str(tmp_path / str(i))).metadata["layout"])
        again = Rules.from_json(back["rules"])
        assert again.to_json() == rules.to_json() and back["degrees"]["tp"] == 2
        assert "/" in again.describe()


# ---------------------------------------------------------------- apply_rules


def test_fused_split_names_are_views_of_the_local_tensor() -> None:
    rules = presets.megatron_gpt(50, 2, 4, 2, 4, 42, store="llama")
    local = torch.arange(16 * 16, dtype=torch.float32).view(16, 16)  # tp=2: q 8 rows, k 4, v 4
    out = apply_rules({"decoder.layers.1.self_attention.linear_qkv.weight": local}, rules, Coords(tp=2, tp_rank=1), "load", strict=False)
    q, k, v = (out[f"layers.1.attention.w{x}.weight"] for x in "qkv")
    assert q.global_shape == (16, 16) and k.global_shape == (8, 16)
    assert q.local.data_ptr() == local.data_ptr() and k.local.data_ptr() == local[8:].data_ptr()
    assert q.pieces[0].global_box == Box((8, 0), (8, 16)) and k.pieces[0].global_box == Box((4, 0), (4, 16))


def test_vocab_padding_dropped_on_save_zeroed_on_load() -> None:
    rules = Rules([Rule("emb", vocab(50))])
    t = torch.full((16, 4), 5.0)
    saved = apply_rules({"emb": t}, rules, Coords(tp=4, tp_rank=3), "save")
    assert saved["emb"].pieces[0].global_box == Box((48, 0), (2, 4)) and torch.equal(t, torch.full((16, 4), 5.0))
    apply_rules({"emb": t}, rules, Coords(tp=4, tp_rank=3), "load")
    assert torch.equal(t[:2], torch.full((2, 4), 5.0)) and not t[2:].any()


def test_optimizer_state_any_keys() -> None:
    rules = Rules([Rule(r"w", column()), Rule(r"n", replicated())])
    st = {"w": {"exp_avg": torch.ones(2, 3), "momentum_buffer": torch.ones(2, 3), "step": torch.tensor(3.0), "lr_scale": 0.5},
          "n": {"exp_avg": torch.ones(3)}}
    out = optimizer_state(st, rules, Coords(tp=2, tp_rank=1), "save")
    assert out["w"]["momentum_buffer"].pieces[0].global_box == Box((2, 0), (2, 3))
    assert out["w"]["step"].pieces == [] and out["w"]["lr_scale"] == 0.5  # the step is stored by tp rank 0
    with pytest.raises(LayoutError, match="give it a rule of its own"):
        optimizer_state({"w": {"exp_avg": torch.ones(2, 3), "row": torch.ones(2)}}, rules, Coords(tp=2), "save", strict=False)


# ---------------------------------------------------------------- ZeRO


def test_group_and_param_partitions() -> None:
    # three params of 5, 3, 6 elements aligned to 4: starts 0, 8, 12; end 18 -> padded to 24 over dp=3 (pad_to=4)
    parts = [group_partition(["a", "b", "c"], [5, 3, 6], 3, r, align=4, pad_to=4) for r in range(3)]
    assert [p.numel for p in parts] == [8, 8, 8]
    assert [(s.param, s.start, s.stop, s.at) for s in parts[0].segments] == [("a", 0, 5, 0)]
    assert [(s.param, s.start, s.stop, s.at) for s in parts[1].segments] == [("b", 0, 3, 0), ("c", 0, 4, 4)]
    assert [(s.param, s.start, s.stop, s.at) for s in parts[2].segments] == [("c", 4, 6, 0)]
    p3 = [param_partition("w", 10, 4, r) for r in range(4)]
    assert [p.numel for p in p3] == [3, 3, 3, 3] and [(s.start, s.stop) for p in p3 for s in p.segments] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert param_partition("w", 2, 4, 3).segments == ()


def test_compose_flat_maps_every_element() -> None:
    """Random flat ranges of a fused tp-local tensor: every piece's region of the flat buffer
    equals the global box it claims, and they cover exactly the range."""
    rnd = random.Random(0)
    g = torch.arange(32 * 3 * 2, dtype=torch.float32).view(32, 3, 2)
    scheme = fused([16, 8, 8], units=4)
    for tp in (1, 2, 4):
        for t in range(tp):
            rows = 16 // tp + 2 * (4 if tp == 4 else 8 // tp)
            lay = scheme.layout("w", (32, 3, 2), (rows, 3, 2), Coords(tp=tp, tp_rank=t))
            local = torch.empty(rows, 3, 2)
            for x in lay.targets:
                local[x.local_box.offsets[0] : x.local_box.ends[0]] = g[x.global_box.offsets[0] : x.global_box.ends[0]]
            n = local.numel()
            for _ in range(20):
                a = rnd.randrange(0, n)
                b = rnd.randrange(a, n + 1)
                at = rnd.randrange(0, 4)
                flat = torch.full((at + (b - a) + 2,), -1.0)
                flat[at : at + b - a] = local.reshape(-1)[a:b]
                pieces = [p for _, p in compose_flat(lay.targets, (rows, 3, 2), a, b, at)]
                assert sum(p.global_box.volume for p in pieces) == b - a
                for p in pieces:
                    want = g
                    for d, (o, k) in enumerate(zip(p.global_box.offsets, p.global_box.lengths)):
                        want = want.narrow(d, o, k)
                    assert torch.equal(piece_region(flat, p), want)


# ---------------------------------------------------------------- replicas


def test_reconcile_reports_mismatch_and_averages() -> None:
    rules = Rules([Rule("n", replicated()), Rule("m", averaged()), Rule("w", column())])
    locals_ = [{"n": torch.ones(3), "m": torch.full((3,), float(r)), "w": torch.full((1, 3), float(r % 2))} for r in range(4)]

    def states_of(rules):
        return [apply_rules(dict(sd), rules, Coords(tp=2, tp_rank=r % 2, dp=2, dp_rank=r // 2), "save", strict=False)
                for r, sd in enumerate(locals_)]

    states = states_of(rules)
    reconcile_ranks(states)
    assert all(torch.equal(s["m"].local, torch.full((3,), 1.5)) for s in states)
    assert torch.equal(locals_[0]["m"], torch.zeros(3))  # the user's tensors are left alone
    locals_[2]["w"] += 1
    with pytest.raises(InconsistentStateError, match=r"'w' box at \[0, 0\].*rank 0: crc32c=.*rank 2: crc32c="):
        reconcile_ranks(states_of(rules))  # w differs between dp replicas 0 and 2
    locals_[3]["n"][1] = 2.0
    with pytest.raises(InconsistentStateError, match=r"'n' box.*rank 3"):
        reconcile_ranks(states_of(Rules([Rule("n", replicated())])))


def test_tied_embeddings_on_first_and_last_stage_are_stored_once(tmp_path) -> None:
    from rules_cases import save_ranks

    rules = presets.llama(10, 2, 2, 1, 2, 6, tied=True)
    emb = torch.arange(40.0).view(10, 4)
    states = []
    for stage in range(2):
        c = Coords(pp=2, pp_rank=stage)
        local = {"tok_embeddings.weight": emb.clone(), "layers.0.attention_norm.weight": torch.full((4,), float(stage))}
        if stage == 1:
            local["norm.weight"] = torch.ones(4)
        states.append({"model": apply_rules(local, rules, c, "save", strict=False)})
    assert [s["model"]["tok_embeddings.weight"].replica_index for s in states] == [0, 1]
    reconcile_ranks(states)
    save_ranks(states, str(tmp_path / "c"))
    m = unickpt.read_manifest(str(tmp_path / "c"))
    e = m.tensors["model.tok_embeddings.weight"]  # replicated: every element stored once (the replicas share the rows)
    assert sum(p.global_box.volume for f in e.fragments for p in f.pieces) == e.shape[0] * e.shape[1]
    assert torch.equal(unickpt.load_tensor(str(tmp_path / "c"), "model.layers.1.attention_norm.weight"), torch.ones(4))
    states[1]["model"]["tok_embeddings.weight"].local[0, 0] = -1.0  # the last stage's copy drifted
    with pytest.raises(InconsistentStateError, match="tok_embeddings"):
        reconcile_ranks(states)
    with pytest.raises(LayoutError, match="stages are 'first\\+last'"):
        apply_rules({"tok_embeddings.weight": emb}, rules, Coords(pp=3, pp_rank=1), "load", strict=False)
