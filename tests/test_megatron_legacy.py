"""Legacy Megatron-LM checkpoints (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``) read in
place: tensor- and pipeline-parallel slices merged by the rules, the optimizer's state and
fp32 masters, loaded onto other layouts, exported to Hugging Face; pickles allow-listed.

The checkpoints are built as Megatron-LM's ``checkpointing.py`` writes them
(tests/megatron_legacy_cases.py says what was followed); one is kept in the repository
(tests/data/megatron_legacy_tp2_pp2, written by tests/data/make_megatron_legacy.py). The
ground truth is the global model and a live global AdamW step on it, never unickpt.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.adapters.checkpoint import open_checkpoint
from unickpt.adapters.detect import open_manifest
from unickpt.adapters.regions import source_ledger
from unickpt.engine.tensor_reads import read_entry
from unickpt.errors import LayoutError, UnsafePickleError
from unickpt.format.values import decode_value
from unickpt.rules import Coords, apply_rules, optimizer_state, presets

import megatron_legacy_cases as cases

FIXTURE = Path(__file__).parent / "data" / "megatron_legacy_tp2_pp2"
KEYS = ("exp_avg", "exp_avg_sq")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(FIXTURE / "expected.pt")


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory) -> tuple[str, dict[str, dict[str, torch.Tensor]]]:
    """A TP 2 x PP 2 checkpoint of an fp32 run (FP32Optimizer: no main params), and its truth."""
    cfg = cases.Cfg(precision="fp32")
    path = str(tmp_path_factory.mktemp("fp32") / "ckpt")
    cases.write(cfg, path)
    return path, cases.truth(cfg)


# Every global the pickles of a Megatron-LM bf16 checkpoint name (the fixture's, read by
# pickletools): each is allow-listed as data, or lies inside rng_state (skipped in the ledger)
MEGATRON_GLOBALS = {
    "argparse Namespace", "megatron.core.enums ModelType", "megatron.core.transformer.enums AttnBackend",
    "torch bfloat16", "torch float32",  # args: enums, params_dtype, main_grads_dtype...
    "torch._tensor _rebuild_from_type_v2", "torch Tensor",  # fp32 main params carrying TP attributes
    "torch._utils _rebuild_tensor_v2", "torch BFloat16Storage", "torch FloatStorage", "collections OrderedDict",
    "numpy._core.multiarray _reconstruct", "numpy ndarray", "numpy dtype", "_codecs encode",  # rng_state: NumPy's
    "torch ByteStorage",  # rng_state: torch's and the CUDA generators' ByteTensors
}


def _globals(path: Path) -> set[str]:
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", dst)
    return dst


def test_reads_tp_and_pp_merged_bitwise(expected) -> None:
    """Every global weight, Adam moment, fp32 master and step of a TP 2 x PP 2 checkpoint,
    merged by the rules (interleaved GQA QKV, fused SwiGLU fc1, padded vocabulary, row- and
    column-parallel dims, stage-local layer numbers), equals the live global state; the
    ledger accounts for every byte (only the per-rank RNG states are skipped)."""
    path = str(FIXTURE / "ckpt")
    ckpt = open_checkpoint(path)
    m = ckpt.manifest
    assert m.provenance["format"] == "megatron-legacy" and m.provenance["tensor_parallel"] == 2
    assert decode_value(m.values["train.step"]) == 7
    args = decode_value(m.values["megatron.args"])
    assert args["attention_backend"].startswith("AttnBackend(") and args["model_type"] == "ModelType(1)"
    assert args["bf16"] is True and args["params_dtype"] == "torch.bfloat16" and args["main_grads_dtype"] == "torch.float32"
    assert decode_value(m.values["megatron.opt_param_scheduler"])["num_steps"] == 7
    assert decode_value(m.values["megatron.num_floating_point_operations_so_far"]) == 1.25e12
    for f in (FIXTURE / "ckpt" / "iter_0000007").glob("*/model_optim_rng.pt"):  # as Megatron's bf16 runs write it
        assert _globals(f) == MEGATRON_GLOBALS, f
    assert not any(n.startswith("megatron.grad_scaler") for n in m.tensors)  # bf16: no loss scaler saved
    with ckpt:
        def read(name: str) -> torch.Tensor:
            return read_entry(ckpt.storage, m.tensors[name], 1)

        for name, t in expected["model"].items():
            assert torch.equal(_bits(read(f"model.{name}")), _bits(t)), name
            assert torch.equal(read(f"optim.state.{name}.fp32_param"), expected["masters"][name]), name
            for key in KEYS:
                assert torch.equal(read(f"optim.state.{name}.{key}"), expected[key][name]), (name, key)
            assert torch.equal(read(f"optim.state.{name}.step"), expected["step"][name])
    assert torch.equal(unickpt.load_tensor(path, "model.language_model.embedding.word_embeddings.weight").view(torch.int16),
                       expected["model"]["language_model.embedding.word_embeddings.weight"].view(torch.int16))
    assert len(m.tensors) == 5 * len(expected["model"])
    ledger = source_ledger(path)
    assert ledger.unaccounted == [] and ledger.files_unchecked == []
    assert sorted(ledger.skipped) == sorted(f"iter_0000007/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt:rng_state"
                                            for t in range(2) for p in range(2))


def _target(cfg: cases.Cfg, t: int, p: int, dtype: torch.dtype | None = None) -> tuple[dict, dict, dict]:
    """Zeroed local model (in ``dtype``, else the run's) and optimizer tensors of rank (t, p)
    at ``cfg``'s layout, and the unickpt state filling them."""
    rules = presets.megatron_gpt(cfg.padded, cfg.layers, cfg.heads, cfg.groups, cfg.head_dim, cfg.ffn,
                                 qkv="interleaved", naming=cfg.naming)
    coords = Coords(tp=cfg.tp, tp_rank=t, pp=cfg.pp, pp_rank=p)
    shapes = {k: v.shape for k, v in cases.rank_params(cfg, cases.global_masters(cfg), t, p).items()}
    dtype = dtype or (torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    model = {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    keys = (*KEYS, "fp32_param") if cfg.precision == "bf16" else KEYS
    optim = {k: {key: torch.zeros(s) for key in keys} for k, s in shapes.items()}
    state = {"model": apply_rules(model, rules, coords, "load"),
             "optim": {"state": optimizer_state(optim, rules, coords, "load")}}
    return model, optim, state


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 4), (2, 1)])
def test_loads_onto_other_layouts(expected, tp: int, pp: int) -> None:
    """Each rank of another TP/PP layout gets, from the TP 2 x PP 2 checkpoint, exactly
    Megatron's cut of the global state at that layout."""
    cfg = cases.Cfg().at(tp, pp)
    for p in range(pp):
        for t in range(tp):
            model, optim, state = _target(cfg, t, p)
            unickpt.load(state, str(FIXTURE / "ckpt"))
            want = cases.rank_params(cfg, expected["model"], t, p)
            for local, got in model.items():
                assert torch.equal(_bits(got), _bits(want[local])), (tp, pp, t, p, local)
            for key, src in (("fp32_param", "masters"), *((k, k) for k in KEYS)):
                want = cases.rank_params(cfg, expected[src], t, p)
                for local, entries in optim.items():
                    assert torch.equal(entries[key], want[local]), (tp, pp, t, p, local, key)


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 4), (2, 1)])
def test_fp32_run_loads_onto_other_layouts(fp32_run, tp: int, pp: int) -> None:
    """An fp32 run's checkpoint (FP32Optimizer's plain torch state, fp32 weights, no main
    params) reads whole and loads onto other layouts bitwise, as the bf16 one does."""
    path, truth = fp32_run
    m = open_manifest(path)
    assert len(m.tensors) == 4 * len(truth["model"]) and not any(n.endswith(".fp32_param") for n in m.tensors)
    assert all(e.dtype == "F32" for e in m.tensors.values()) and source_ledger(path).unaccounted == []
    cfg = cases.Cfg(precision="fp32").at(tp, pp)
    for p in range(pp):
        for t in range(tp):
            model, optim, state = _target(cfg, t, p)
            unickpt.load(state, path)
            want = cases.rank_params(cfg, truth["model"], t, p)
            for local, got in model.items():
                assert torch.equal(got, want[local]), (tp, pp, t, p, local)
            for key in KEYS:
                want = cases.rank_params(cfg, truth[key], t, p)
                for local, entries in optim.items():
                    assert torch.equal(entries[key], want[local]), (tp, pp, t, p, local, key)


def test_bf16_weights_into_an_fp32_model(expected) -> None:
    """Loading the bf16 checkpoint into an fp32 model gives ``model.*``: the bf16 weights the
    checkpoint's ``model`` holds, widened (as Megatron loads them); the fp32 masters are
    ``optim.state.<name>.fp32_param``, loaded by name where full precision is wanted."""
    cfg = cases.Cfg().at(1, 1)
    model, optim, state = _target(cfg, 0, 0, torch.float32)
    unickpt.load(state, str(FIXTURE / "ckpt"))
    for local, got in model.items():
        assert torch.equal(got, expected["model"][local].float()), local
        assert torch.equal(optim[local]["fp32_param"], expected["masters"][local]), local
        assert not torch.equal(got, expected["masters"][local]), local  # the master is not what the model gets


def test_inspect_lists_every_tensor() -> None:
    """``inspect --json`` lists every tensor the reader finds (model, Adam moments, steps,
    fp32 main params: 5 per weight) and a ledger where every byte is read or reported."""
    import json

    from test_cli import invoke

    path = str(FIXTURE / "ckpt")
    r = invoke("inspect", path, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    names = {t["name"] for t in report["tensors"]}
    assert names == set(open_manifest(path).tensors) and len(names) == 5 * 27
    assert {n for n in names if n.endswith(".fp32_param")} == {f"optim.state.{g}.fp32_param" for g in
                                                             cases.global_masters(cases.Cfg())}
    assert report["ledger"]["unaccounted"] == [] and sorted(report["ledger"]["skipped"]) == sorted(
        f"iter_0000007/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt:rng_state" for t in range(2) for p in range(2))


def test_megatron_core_names_release_onto_tp2_pp2(tmp_path: Path) -> None:
    """A one-rank checkpoint with Megatron-Core names (``decoder.layers.N...``) under a
    ``release`` tracker loads onto TP 2 x PP 2 ranks as Megatron cuts them, and exports to
    Hugging Face names (the last query group's v rows are ``v_proj``'s last rows)."""
    one = cases.Cfg(tp=1, pp=1, naming="mcore", release=True)
    cases.write(one, str(tmp_path / "ckpt"))
    truth = cases.truth(one)
    m = open_manifest(str(tmp_path / "ckpt"))
    assert "model.decoder.layers.3.self_attention.linear_qkv.weight" in m.tensors
    assert "TransformerEngine" in m.provenance["skipped"]["release/mp_rank_00/model_optim_rng.pt:model.decoder.layers.3."
                                                          "self_attention.linear_qkv._extra_state"]
    cfg = one.at(2, 2)
    for p in range(2):
        for t in range(2):
            model, optim, state = _target(cfg, t, p)
            unickpt.load(state, str(tmp_path / "ckpt"))
            want = cases.rank_params(cfg, truth["model"], t, p)
            for local, got in model.items():
                assert torch.equal(_bits(got), _bits(want[local])), (t, p, local)
            want = cases.rank_params(cfg, truth["exp_avg_sq"], t, p)
            for local, entries in optim.items():
                assert torch.equal(entries["exp_avg_sq"], want[local]), (t, p, local)
    from safetensors.torch import load_file

    from unickpt.adapters.hf_export import export_hf

    report = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert report.names == "megatron-llama" and report.config_written
    hf = load_file(str(tmp_path / "hf" / report.shards[0]))
    qkv = truth["model"]["decoder.layers.3.self_attention.linear_qkv.weight"].reshape(one.groups, -1, one.head_dim, one.hidden)
    assert torch.equal(_bits(hf["model.layers.3.self_attn.v_proj.weight"]), _bits(qkv[:, -1].reshape(-1, one.hidden)))
    assert torch.equal(_bits(hf["model.layers.3.post_attention_layernorm.weight"]),
                       _bits(truth["model"]["decoder.layers.3.pre_mlp_layernorm.weight"]))


def test_tied_embeddings_last_stage_copy_is_a_replica(tmp_path: Path) -> None:
    """Tied embeddings at PP 2: the last stage's ``word_embeddings_for_head`` (and its Adam
    state) is a replica of the first stage's embedding; everything reads bitwise, the
    ledger accounts for every byte, and the HF config ties the output to the embeddings."""
    cfg = cases.Cfg(tied=True)
    cases.write(cfg, str(tmp_path / "ckpt"))
    truth = cases.truth(cfg)
    path = str(tmp_path / "ckpt")
    m = open_manifest(path)
    assert not any("output_layer" in n for n in m.tensors)
    assert any("word_embeddings_for_head" in n for n in m.provenance["replicas"])
    embed = "language_model.embedding.word_embeddings.weight"
    assert torch.equal(_bits(unickpt.load_tensor(path, f"model.{embed}")), _bits(truth["model"][embed]))
    assert torch.equal(unickpt.load_tensor(path, f"optim.state.{embed}.exp_avg"), truth["exp_avg"][embed])
    assert source_ledger(path).unaccounted == []
    assert decode_value(m.metadata["hf_config"])["tie_word_embeddings"] is True


def test_export_to_hugging_face_llama(expected, tmp_path: Path) -> None:
    """``export --format hf`` writes a Llama model that transformers loads: QKV split per
    query group into q/k/v, fc1 into gate/up, every tensor bitwise the global one."""
    transformers = pytest.importorskip("transformers")
    from test_cli import invoke

    dst = tmp_path / "hf"
    r = invoke("export", str(FIXTURE / "ckpt"), str(dst), "--allow-skip")
    assert r.exit_code == 0, r.output
    model = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.bfloat16)
    sd = model.state_dict()
    cfg = cases.Cfg()
    per = cfg.heads // cfg.groups
    for L in range(cfg.layers):
        e = f"language_model.encoder.layers.{L}."
        qkv = expected["model"][e + "self_attention.query_key_value.weight"]
        rows = [qkv[(g * (per + 2) + j) * cfg.head_dim:(g * (per + 2) + j + 1) * cfg.head_dim] for g in range(cfg.groups)
                for j in range(per + 2)]
        q = torch.cat([rows[g * (per + 2) + j] for g in range(cfg.groups) for j in range(per)])
        k = torch.cat([rows[g * (per + 2) + per] for g in range(cfg.groups)])
        v = torch.cat([rows[g * (per + 2) + per + 1] for g in range(cfg.groups)])
        fc1 = expected["model"][e + "mlp.dense_h_to_4h.weight"]
        h = f"model.layers.{L}."
        for name, want in ((h + "self_attn.q_proj.weight", q), (h + "self_attn.k_proj.weight", k),
                           (h + "self_attn.v_proj.weight", v), (h + "mlp.gate_proj.weight", fc1[:cfg.ffn]),
                           (h + "mlp.up_proj.weight", fc1[cfg.ffn:]),
                           (h + "self_attn.o_proj.weight", expected["model"][e + "self_attention.dense.weight"]),
                           (h + "mlp.down_proj.weight", expected["model"][e + "mlp.dense_4h_to_h.weight"]),
                           (h + "post_attention_layernorm.weight", expected["model"][e + "post_attention_layernorm.weight"])):
            assert torch.equal(_bits(sd[name]), _bits(want)), name
    assert torch.equal(_bits(sd["lm_head.weight"]), _bits(expected["model"]["language_model.output_layer.weight"]))
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 32
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite(path: Path, change) -> None:
    """Rewrite one rank's file (our own fixture, so torch.load may run it)."""
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def test_a_class_off_the_allow_list_is_refused_and_never_run(tmp_path: Path) -> None:
    ckpt = _copy(tmp_path)
    marker = tmp_path / "ran"
    _rewrite(ckpt / "iter_0000007/mp_rank_01_001/model_optim_rng.pt",
             lambda sd: setattr(sd["args"], "hook", _Payload(str(marker))))
    with pytest.raises(UnsafePickleError, match="system"):
        open_manifest(str(ckpt))
    assert not marker.exists()


def test_a_value_with_no_plain_form_is_in_the_ledger_with_its_reason(tmp_path: Path) -> None:
    """A value of the state dict holding an object unickpt does not build (a NumPy array
    beside Megatron's own keys) is not kept, nor kept as its repr: the ledger says it was
    skipped and why (the rule the DeepSpeed reader shares, adapters/manifest_builder.py)."""
    import numpy as np

    ckpt = _copy(tmp_path)
    _rewrite(ckpt / "iter_0000007/mp_rank_00_000/model_optim_rng.pt", lambda sd: sd.update(sampler={"order": np.arange(4)}))
    m = open_manifest(str(ckpt))
    assert "megatron.sampler" not in m.values and decode_value(m.values["train.step"]) == 7
    why = m.provenance["skipped"]["megatron.sampler"]
    assert why.startswith("a value with no plain form, not kept") and "numpy" in why and "does not build" in why, why
    ledger = source_ledger(str(ckpt))
    assert ledger.unaccounted == [] and ledger.skipped["megatron.sampler"] == why


def test_old_versions_refused_distributed_optimizer_accounted(tmp_path: Path) -> None:
    """A checkpoint_version before 3.0 (another QKV order) is refused with the remedy; a
    distributed optimizer's ``distrib_optim.pt`` is reported as skipped, its bytes owned; an
    fp16 loss scaler is read once (rank 0's)."""
    ckpt = _copy(tmp_path)
    dist = ckpt / "iter_0000007/mp_rank_00_000/distrib_optim.pt"
    torch.save({"param": torch.ones(5)}, dist)
    m = open_manifest(str(ckpt))
    assert "not read" in m.provenance["skipped"]["iter_0000007/mp_rank_00_000/distrib_optim.pt"]
    ledger = source_ledger(str(ckpt))
    assert ledger.unaccounted == [] and "iter_0000007/mp_rank_00_000/distrib_optim.pt" in ledger.skipped
    scaler = {"scale": torch.tensor(4096.0), "growth_tracker": torch.tensor(3, dtype=torch.int32), "hysteresis": 2}
    for r in ("00_000", "01_000", "00_001", "01_001"):  # an fp16 run's loss scaler, on every rank
        _rewrite(ckpt / f"iter_0000007/mp_rank_{r}/model_optim_rng.pt", lambda sd: sd["optimizer"].update(grad_scaler=scaler))
    assert unickpt.load_tensor(str(ckpt), "megatron.grad_scaler.scale").item() == 4096.0
    assert unickpt.load_tensor(str(ckpt), "megatron.grad_scaler.growth_tracker").item() == 3
    assert source_ledger(str(ckpt)).unaccounted == []
    for r in ("00_000", "01_000", "00_001", "01_001"):
        _rewrite(ckpt / f"iter_0000007/mp_rank_{r}/model_optim_rng.pt", lambda sd: sd.update(checkpoint_version=2.0))
    with pytest.raises(LayoutError, match="checkpoint_version 2.0"):
        open_manifest(str(ckpt))


def test_cli_verify_and_convert(expected, tmp_path: Path) -> None:
    """``verify`` names the skipped RNG states (exit 1, 0 with --allow-skip); ``convert
    --consolidate`` writes a unickpt checkpoint holding the merged global tensors."""
    from test_cli import invoke

    src = str(FIXTURE / "ckpt")
    r = invoke("verify", src)
    assert r.exit_code == 1 and "rng_state" in r.output
    assert invoke("verify", src, "--allow-skip").exit_code == 0
    dst = str(tmp_path / "universal")
    r = invoke("convert", src, dst, "--consolidate", "--allow-skip")
    assert r.exit_code == 0, r.output
    qkv = "language_model.encoder.layers.2.self_attention.query_key_value.weight"
    assert torch.equal(_bits(unickpt.load_tensor(dst, f"model.{qkv}")), _bits(expected["model"][qkv]))
    assert torch.equal(unickpt.load_tensor(dst, f"optim.state.{qkv}.exp_avg_sq"), expected["exp_avg_sq"][qkv])
    assert decode_value(unickpt.read_manifest(dst).values["train.step"]) == 7


def test_onto_a_differently_padded_vocabulary(expected) -> None:
    """A target padding the vocabulary further (``make_vocab_size_divisible_by`` 64: 64 rows,
    not 32) gets the checkpoint's 32 rows and zeros past them, with the rules the checkpoint
    records (``provenance["rules"]``)."""
    from unickpt.rules import Rules

    path = str(FIXTURE / "ckpt")
    rules = Rules.from_json(unickpt.read_manifest(path).provenance["rules"])
    embed = "language_model.embedding.word_embeddings.weight"
    local = torch.full((64, 8), 3.0, dtype=torch.bfloat16)
    unickpt.load({"model": apply_rules({embed: local}, rules, Coords(), "load", strict=False)}, path)
    assert torch.equal(_bits(local[:32]), _bits(expected["model"][embed])) and not local[32:].any()


def test_chained_optimizer_state_is_reported_not_lost(tmp_path: Path) -> None:
    """A ChainedOptimizer's list of states is reported as skipped (its bytes owned), the
    model still read."""
    ckpt = _copy(tmp_path)
    for r in ("00_000", "01_000", "00_001", "01_001"):
        _rewrite(ckpt / f"iter_0000007/mp_rank_{r}/model_optim_rng.pt", lambda sd: sd.update(optimizer=[sd["optimizer"]]))
    m = open_manifest(str(ckpt))
    assert "ChainedOptimizer" in m.provenance["skipped"]["iter_0000007/mp_rank_01_001/model_optim_rng.pt:optimizer"]
    assert not any(n.startswith("optim.state.") for n in m.tensors) and len(m.tensors) == 27
    assert source_ledger(str(ckpt)).unaccounted == []


def test_missing_rank_and_misshapen_tensor_are_named(tmp_path: Path) -> None:
    """A rank directory missing, or a tensor whose shape does not fit the args, is an error
    naming it: never a half-read checkpoint."""
    from unickpt.errors import CorruptionError

    ckpt = _copy(tmp_path)
    qkv = "self_attention.query_key_value.weight"
    _rewrite(ckpt / "iter_0000007/mp_rank_01_000/model_optim_rng.pt",
             lambda sd: sd["model"]["language_model"]["encoder"].update({f"layers.1.{qkv}": torch.zeros(6, 8)}))
    with pytest.raises(LayoutError, match=r"mp_rank_01_000/model_optim_rng\.pt: model\.language_model\.encoder\.layers\.1\."
                                          r"self_attention\.query_key_value\.weight does not fit"):
        open_manifest(str(ckpt))
    shutil.rmtree(ckpt / "iter_0000007/mp_rank_01_001")
    with pytest.raises(CorruptionError, match=r"missing: \[\(1, 1\)\]"):
        open_manifest(str(ckpt))
