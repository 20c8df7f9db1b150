"""DeepSpeed MoE (expert-parallel) checkpoints, written by the real DeepSpeed (CPU, gloo;
tests/ds_moe_train.py: a Mixtral-shaped decoder, 2 MoE layers of 4 SwiGLU experts,
``ep_size=2``), read in place:

* 2 ranks, ZeRO-1, bf16 module with fp32 master weights (each rank holds 2 experts,
  expert-data-parallel degree 1); 4 ranks,
  ZeRO-2 (expert-data-parallel degree 2: each expert's ZeRO partitions span 2 ranks); 4 ranks,
  ZeRO-1, with DeepSpeed's ``use_data_before_expert_parallelism`` (ranks 0 and 1 hold experts
  0-1, ranks 2 and 3 experts 2-3, where the default puts them on ranks 0, 2 and 1, 3);
* every global expert's weights, fp32 master and Adam moments (and every dense parameter's)
  bitwise equal to the ground truth each rank took from its live optimizer after saving
  (global expert = ep_rank * num_local_experts + local, DeepSpeed's own numbering), loaded
  into one process holding all experts, and onto expert-parallel degrees 1 and 4 (each target
  rank's local experts through ``presets.deepspeed_moe``), and onto the ZeRO-1 flat
  partitions of a 2-rank job at ep=1 (``ZeroPlan``);
* ``inspect`` and ``verify`` list every expert; the source ledger accounts for every byte of
  every file with nothing skipped;
* the Hugging Face export (``--names mixtral``) loads into ``transformers``'
  ``MixtralForCausalLM`` with every expert in place.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (see docs/FORMATS.md, 'DeepSpeed', for the recipe)")

import unickpt  # noqa: E402
from unickpt.rules import Coords, apply_rules, optimizer_state, presets  # noqa: E402

from ds_cases import HERE, assert_every_byte, bitwise_equal, ds_env, run_ds_job  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

EXPERTS, LAYERS = 4, 2
# case -> (ranks, ZeRO stage, DeepSpeed's use_data_before_expert_parallelism, bf16 module)
CASES = {"ep2_dp1_zero1_bf16": (2, 1, False, True), "ep2_dp2_zero2": (4, 2, False, False),
         "ep2_dp2_zero1_data_first": (4, 1, True, False)}
EXPERT = re.compile(r"\.deepspeed_experts\.(\d+)\.")
KEYS = {"fp32": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    """case -> (DeepSpeed checkpoint directory, ground truth: {"params": {global name: {key:
    full tensor}}, "module": {global name: tensor}, "step": tensor})."""
    root = tmp_path_factory.mktemp("dsmoe")
    out = {}
    for case, (ranks, stage, data_first, bf16) in CASES.items():
        ckpt, truth = root / case / "ckpt", root / case / "truth"
        run_ds_job(ranks, os.path.join(HERE, "ds_moe_train.py"), "--ep", "2", "--experts", str(EXPERTS), "--layers",
                     str(LAYERS), "--stage", str(stage), "--save-dir", str(ckpt), "--truth", str(truth),
                     *(["--data-first"] if data_first else []), *(["--bf16"] if bf16 else []))
        out[case] = (str(ckpt), _assemble([torch.load(truth / f"rank_{r}.pt") for r in range(ranks)]))
    return out


def _assemble(per_rank: list[dict]) -> dict:
    """Whole tensors from the ranks' slices of their ZeRO partitions (each element exactly once)."""
    params: dict[str, dict[str, torch.Tensor]] = {}
    module: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        for name, t in rank["module"].items():
            if name in module:
                assert bitwise_equal(module[name], t), f"the module copies of {name} differ between ranks"
            module[name] = t
    for name, shape_of in module.items():
        for key in KEYS:
            flat = torch.full((shape_of.numel(),), float("nan"))
            covered = 0
            for rank in per_rank:
                if key in rank["fragments"].get(name, {}):
                    start, frag = rank["fragments"][name][key]
                    flat[start:start + frag.numel()] = frag
                    covered += frag.numel()
            assert covered == flat.numel(), (name, key, covered)
            params.setdefault(name, {})[key] = flat.view(shape_of.shape)
    steps = {float(r["step"]) for r in per_rank}
    assert len(steps) == 1
    return {"params": params, "module": module, "step": per_rank[0]["step"]}


def _expert_names(truth: dict) -> list[str]:
    return sorted(n for n in truth["module"] if EXPERT.search(n))


def test_ground_truth_tells_experts_apart(runs) -> None:
    """Every global expert of every layer is there and no two are alike (so a wrong expert
    mapping cannot pass the tests below)."""
    for _, truth in runs.values():
        names = _expert_names(truth)
        assert len(names) == LAYERS * EXPERTS * 3
        w1 = [truth["module"][n] for n in names if n.endswith(".w1.weight")]
        assert all(not torch.equal(a, b) for i, a in enumerate(w1) for b in w1[i + 1:])


@pytest.mark.parametrize("case", CASES)
def test_every_expert_in_one_process(runs, case: str) -> None:
    """One process loads every global expert's (and every dense parameter's) fp32 master
    weights, Adam moments and step: bitwise equal to the live training state."""
    ckpt, truth = runs[case]
    m = unickpt.read_manifest(ckpt)
    state = {name.format(p): torch.empty_like(t) for p, keys in truth["params"].items() for k, t in keys.items()
             for name in [KEYS[k]]}
    state.update({f"optim.state.{p}.step": torch.empty_like(truth["step"]) for p in truth["params"]})
    bf16 = CASES[case][3]
    if bf16:  # the module's bf16 copy (the expert files' for experts) beside the fp32 master
        state.update({f"module.{p}": torch.empty_like(t) for p, t in truth["module"].items()})
    assert set(state) == set(m.tensors)  # nothing more, nothing less
    unickpt.load(state, ckpt)
    for p, keys in truth["params"].items():
        for k, t in keys.items():
            assert bitwise_equal(state[KEYS[k].format(p)], t), (case, p, k)
        assert bitwise_equal(state[f"optim.state.{p}.step"], truth["step"])
        if bf16:
            assert truth["module"][p].dtype == torch.bfloat16
            assert bitwise_equal(state[f"module.{p}"], truth["module"][p]), (case, p)
        else:  # fp32 training: the module copy is the master
            assert bitwise_equal(truth["module"][p], keys["fp32"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ep", [1, 4])
def test_onto_another_expert_parallel_degree(runs, case: str, ep: int) -> None:
    """Each rank of a job at expert-parallel degree ``ep`` (1: one rank holds all 4 experts;
    4: one expert per rank) loads its local experts (DeepSpeed's local names) and their
    optimizer state through ``presets.deepspeed_moe``: bitwise equal to the live state of
    the global expert ``ep_rank * 4 / ep + local``."""
    ckpt, truth = runs[case]
    rules = presets.deepspeed_moe(EXPERTS)
    local_names = sorted({EXPERT.sub(lambda m: f".deepspeed_experts.{int(m.group(1)) % (EXPERTS // ep)}.", n)
                          for n in truth["module"]})
    seen = set()
    for r in range(ep):
        coords = Coords(ep=ep, ep_rank=r)
        model = {n: torch.empty_like(truth["params"][rules.global_name(n, coords)]["fp32"]) for n in local_names}
        optim = {n: {"exp_avg": torch.empty_like(t), "exp_avg_sq": torch.empty_like(t), "step": torch.tensor(0.0)}
                 for n, t in model.items()}
        unickpt.load({"model": apply_rules(model, rules, coords, "load"),
                      "optim": {"state": optimizer_state(optim, rules, coords, "load")}}, ckpt)
        for n, t in model.items():
            g = rules.global_name(n, coords)
            if EXPERT.search(n):
                assert int(EXPERT.search(g).group(1)) == r * (EXPERTS // ep) + int(EXPERT.search(n).group(1))
            seen.add(g)
            assert bitwise_equal(t, truth["params"][g]["fp32"]), (case, ep, r, n)
            for k in ("exp_avg", "exp_avg_sq"):
                assert bitwise_equal(optim[n][k], truth["params"][g][k]), (case, ep, r, n, k)
            assert bitwise_equal(optim[n]["step"], truth["step"])
    assert seen == set(truth["module"])  # every global expert landed on some rank


@pytest.mark.parametrize("case", ["ep2_dp2_zero2", "ep2_dp2_zero1_data_first"])
def test_onto_zero_partitions_of_another_layout(runs, case: str) -> None:
    """Saved on 4 ranks (ep=2, each expert's partitions over 2 ranks), loaded onto 2 ranks at
    ep=1 under ZeRO-1 (``ZeroPlan``): the dense group flat over dp=2, the expert group (all 4
    experts local, DeepSpeed's local names) flat over its expert-data-parallel degree 2.
    Each rank's flat fp32, exp_avg and exp_avg_sq partitions are bitwise the live state's
    parameters laid end to end and cut in two."""
    from unickpt.rules import ZeroPlan

    ckpt, truth = runs[case]
    rules = presets.deepspeed_moe(EXPERTS)
    names = list(truth["module"])  # model order; at ep=1 local names are global names
    groups = [[n for n in names if not EXPERT.search(n)], [n for n in names if EXPERT.search(n)]]
    for r in range(2):
        coords = [Coords(dp=2, dp_rank=r), Coords(ep=1, dp=2, dp_rank=r)]  # dense, experts
        plans = [ZeroPlan(rules, c, {n: truth["module"][n].shape for n in g}, 1, groups=[g]) for c, g in zip(coords, groups)]
        flats = [{k: torch.full((p.numels[0],), float("nan")) for k in KEYS} for p in plans]
        model, optim = {}, {}
        for plan, flat in zip(plans, flats):
            for name, leaves in plan.state({k: [t] for k, t in flat.items()}, "load").items():
                model[name] = leaves.pop("fp32")
                optim[name] = leaves
        unickpt.load({"model": model, "optim": {"state": optim}}, ckpt)
        for g, flat in zip(groups, flats):
            for k, buf in flat.items():
                whole = torch.cat([truth["params"][n][k].reshape(-1) for n in g])
                whole = torch.cat([whole, whole.new_zeros(-whole.numel() % 2)])
                assert bitwise_equal(buf, whole.chunk(2)[r]), (case, r, k)


@pytest.mark.parametrize("case", CASES)
def test_inspect_verify_and_ledger_list_every_expert(runs, case: str) -> None:
    """``unickpt inspect`` and ``verify`` name every global expert; every byte of every file is
    read or accounted for (the expert files' module copies as replicas), nothing skipped."""
    ckpt, truth = runs[case]
    assert_every_byte(ckpt)
    m = unickpt.read_manifest(ckpt)
    assert m.provenance["experts"]["expert_parallel"] == [2]
    assert {p: v["num_experts"] for p, v in m.provenance["experts"]["layers"].items()} == {
        f"layers.{i}.feed_forward": EXPERTS for i in range(LAYERS)}
    replicas = m.provenance["replicas"]
    for name in _expert_names(truth):
        assert f"model.{name}" in m.tensors
        if CASES[case][3]:  # bf16: the expert files hold the module's own copy, read
            assert m.tensors[f"module.{name}"].dtype == "BF16"
        else:
            assert replicas[f"module.{name}"].startswith("the module's copy")
    listed = {}
    for cmd in (["inspect", ckpt, "--json"], ["verify", ckpt]):
        r = subprocess.run([sys.executable, "-m", "unickpt", *cmd], capture_output=True, text=True, env=ds_env(),
                           timeout=120)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        listed[cmd[0]] = r.stdout
    inspected = {t["name"] for t in json.loads(listed["inspect"])["tensors"]}
    assert inspected == set(m.tensors)
    assert {f"model.{n}" for n in _expert_names(truth)} <= inspected
    assert f"OK (deepspeed): {len(m.tensors)} tensors" in listed["verify"], listed["verify"]
    assert "skipped" not in m.provenance


def _copy_tag(runs, case: str, dst) -> str:
    import shutil

    shutil.copytree(os.path.join(runs[case][0], "global_step3"), dst)
    return str(dst)


def test_refused_without_zero_files(runs, tmp_path) -> None:
    """An MoE checkpoint whose expert optimizer state is outside ZeRO (no zero_pp_rank files,
    as DeepSpeed writes without ZeRO) is refused naming the expert files, nothing read."""
    from unickpt.errors import LayoutError

    tag = _copy_tag(runs, "ep2_dp2_zero2", tmp_path / "global_step3")
    for f in os.listdir(tag):
        if f.startswith("zero_pp_rank_"):
            os.remove(os.path.join(tag, f))
    torch.save({"optimizer": None}, os.path.join(tag, "expp_rank_0_mp_rank_00_optim_states.pt"))
    with pytest.raises(LayoutError, match="layer_0_expert_0_mp_rank_00.*without ZeRO.*not supported.*nothing was read"):
        unickpt.read_manifest(tag)


def test_missing_expert_file_or_expp_file(runs, tmp_path) -> None:
    """A missing expert file is a CorruptionError naming the layer; an ``expp_rank`` file as
    older DeepSpeed wrote it beside ZeRO files (``{"optimizer": None}``) is structure, and a
    tensor planted in one is reported skipped (never silently dropped)."""
    from unickpt.adapters.regions import source_ledger
    from unickpt.errors import CorruptionError

    tag = _copy_tag(runs, "ep2_dp2_zero2", tmp_path / "missing")
    os.remove(os.path.join(tag, "layer_1_expert_3_mp_rank_00_model_states.pt"))
    with pytest.raises(CorruptionError, match="MoE layer 1 has 3 expert files"):
        unickpt.read_manifest(tag)
    tag = _copy_tag(runs, "ep2_dp2_zero2", tmp_path / "expp")
    torch.save({"optimizer": None}, os.path.join(tag, "expp_rank_0_mp_rank_00_optim_states.pt"))
    assert_every_byte(tag)
    torch.save({"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}},
               os.path.join(tag, "expp_rank_1_mp_rank_00_optim_states.pt"))
    ledger = source_ledger(tag)
    assert ledger.unaccounted == [] and list(ledger.skipped) == [
        "expp_rank_1_mp_rank_00_optim_states.pt:optimizer.state.0.exp_avg"], ledger.skipped


def test_hf_export_loads_as_mixtral(runs, tmp_path) -> None:
    """``unickpt export --names mixtral`` writes the DeepSpeed MoE model in the per-expert
    layout of Mixtral's published checkpoints; ``transformers``' ``MixtralForCausalLM`` loads
    it with every global expert in its place (bitwise equal to the live fp32 master weights;
    q/k rows in HF's rotary order)."""
    transformers = pytest.importorskip("transformers")
    from unickpt.rules.hf import rotary_to_hf

    ckpt, truth = runs["ep2_dp2_zero2"]
    w = truth["params"]
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 4, "vocab_size": 32, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
              "max_position_embeddings": 8, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "unickpt", "export", ckpt, str(out), "--names", "mixtral", "--config",
                        str(tmp_path / "config.json")], capture_output=True, text=True, env=ds_env(), timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    model = transformers.MixtralForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    sd = model.state_dict()
    assert bitwise_equal(sd["model.embed_tokens.weight"], w["tok_embeddings.weight"]["fp32"])
    assert bitwise_equal(sd["lm_head.weight"], w["output.weight"]["fp32"])
    for i in range(LAYERS):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        assert bitwise_equal(sd[hf + "self_attn.q_proj.weight"], rotary_to_hf(w[ours + "attention.wq.weight"]["fp32"], 4))
        assert bitwise_equal(sd[hf + "self_attn.k_proj.weight"], rotary_to_hf(w[ours + "attention.wk.weight"]["fp32"], 2))
        assert bitwise_equal(sd[hf + "mlp.gate.weight"], w[ours + "feed_forward.deepspeed_moe.gate.wg.weight"]["fp32"])
        for e in range(EXPERTS):
            expert = ours + f"feed_forward.deepspeed_moe.experts.deepspeed_experts.{e}."
            gate_up = torch.cat([w[expert + "w1.weight"]["fp32"], w[expert + "w3.weight"]["fp32"]])
            assert bitwise_equal(sd[hf + "mlp.experts.gate_up_proj"][e], gate_up), (i, e)
            assert bitwise_equal(sd[hf + "mlp.experts.down_proj"][e], w[expert + "w2.weight"]["fp32"]), (i, e)
