"""DeepSpeed checkpoints beyond the plain ZeRO data-parallel case, written by the real
DeepSpeed (CPU, gloo, 2 ranks; tests/ds_train.py and tests/ds_parallel_train.py), once per
module:

* ZeRO-1 (fp32) and ZeRO-2 (bf16) whose parameter group is not divisible by the alignment
  (``group_paddings``: the last rank's flat moments are longer than its fp32 partition):
  every state bitwise equal to ``ds_to_universal``'s;
* frozen parameters (``requires_grad=False``, bf16) under ZeRO-2 and ZeRO-3 (ZeRO-3 keeps
  them only in ``frozen_param_fragments`` of each rank's model-states file): every tensor
  bitwise equal to DeepSpeed's ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``);
  the ZeRO-3 one loads into the same model in fp32 (the bf16-only frozen parameters widened);
* pipeline parallel (PipelineModule, 2 stages: ``mp_rank_01``, ``layer_XX-model_states.pt``):
  read in place, bitwise equal to ``ds_to_universal``;
* tensor parallel (AutoTP, tp=2, ``universal_checkpoint_info``): read in place, bitwise equal
  to ``ds_to_universal``;
* the tensor-parallel checkpoint without its ``universal_checkpoint_info``: refused with a
  LayoutError naming what is not supported, by the API and the CLI (exit 2). (MoE
  checkpoints are read: tests/test_deepspeed_moe.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (see docs/FORMATS.md, 'DeepSpeed', for the recipe)")

import unickpt  # noqa: E402
from unickpt.adapters.deepspeed import read_deepspeed  # noqa: E402
from unickpt.adapters.regions import source_ledger  # noqa: E402
from unickpt.errors import LayoutError  # noqa: E402

from ds_cases import (STATES, assert_every_byte, bitwise_equal, ds_env, ds_parallel_train, ds_to_universal, ds_train,  # noqa: E402
                      universal_params, universal_tensor)

# the module's fixture runs DeepSpeed 5 times and ds_to_universal 5 times (forked from the preloaded
# launcher: seconds after its start; 80 s under torchrun), minutes on a loaded machine: a bound
# above the default per-test limit, for the launcher's imports on a loaded machine
pytestmark = pytest.mark.timeout(900)

SMALL = ["--dim", "18", "--heads", "3", "--kv-heads", "1"]  # 11898 parameters: not a multiple of 2 * 2 ranks
FREEZE = ["layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"]  # 2 * 18: 11862 trainable, still not a multiple
FROZEN = ["--bf16", "--freeze", *FREEZE, "--frozen-extra"]
FROZEN_NAMES = (*FREEZE, "frozen_table")  # frozen_table: 7x3, an odd size that ZeRO-3 pads
TRAINED = {  # case -> (ZeRO stage, ds_train arguments, ds_to_universal applies)
    "z1_pad": (1, SMALL, True),
    "z2_pad_frozen": (2, SMALL + FROZEN, True),
    "z3_frozen": (3, FROZEN, True),
}
PARALLEL = ("pp", "tp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """case -> DeepSpeed checkpoint directory (its `latest` names the tag); a `universal`
    directory beside it holds ds_to_universal's output where it applies."""
    root = tmp_path_factory.mktemp("dsl")
    out = {}
    for case, (stage, args, _) in TRAINED.items():
        ckpt = root / case / "ckpt"
        ds_train(2, "--stage", str(stage), "--steps", "4", *args, "--save-dir", str(ckpt))
        ds_to_universal(str(ckpt / "global_step4"), str(root / case / "universal"))
        out[case] = str(ckpt)
    for case in PARALLEL:
        ds_parallel_train(2, case, str(root / case / "ckpt"))
        out[case] = str(root / case / "ckpt")
    for case in ("pp", "tp"):
        ds_to_universal(str(root / case / "ckpt" / "global_step2"), str(root / case / "universal"))
    return out


def _universal(runs: dict[str, str], case: str) -> str:
    return os.path.join(os.path.dirname(runs[case]), "universal")


def _assert_equals_universal(src: str, uni: str, frozen: tuple[str, ...] = ()) -> int:
    """Every state of ds_to_universal's output equals unickpt's read of ``src``; frozen
    parameters, which ds_to_universal (ZeRO-1/2) upcasts to fp32, equal it after the same
    lossless upcast."""
    n = 0
    for param in universal_params(uni):
        for key, pattern in STATES.items():
            ref = universal_tensor(uni, param, key)
            if ref is None:
                continue
            got = unickpt.load_tensor(src, pattern.format(param))
            if param in frozen:
                assert got.dtype == torch.bfloat16 and key == "fp32"
                got = got.float()
            assert bitwise_equal(got, ref), f"{param}/{key}: unickpt's read of {src} differs from ds_to_universal"
            n += 1
    return n


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["z1_pad", "z2_pad_frozen"])
def test_padded_group_equals_ds_to_universal(runs: dict[str, str], case: str, tmp_path) -> None:
    ckpt = runs[case]
    tag = os.path.join(ckpt, "global_step4")
    prefix = "bf16_" if "frozen" in case else ""
    last = torch.load(os.path.join(tag, f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt"), weights_only=False)
    osd = last["optimizer_state_dict"]
    # the case this test is about: the last rank's moments carry the alignment padding
    pad = osd["group_paddings"][0]
    assert pad > 0
    assert osd["base_optimizer_state"]["state"][0]["exp_avg"].numel() == osd["single_partition_of_fp32_groups"][0].numel() + pad
    report = unickpt.verify(ckpt)
    assert report.ok, report.problems
    assert_every_byte(ckpt)  # the padding tails of the partitions and the module's flat buffer included
    assert_every_byte(_universal(runs, case))
    frozen = FROZEN_NAMES if "frozen" in case else ()
    n = _assert_equals_universal(ckpt, _universal(runs, case), frozen)
    assert n == 4 * (21 - len(frozen) + bool(frozen)) + len(frozen)  # fp32, exp_avg, exp_avg_sq, step; fp32 if frozen
    # the consolidated copy holds the same bytes
    unickpt.convert(ckpt, str(tmp_path / "converted"))
    assert _assert_equals_universal(str(tmp_path / "converted"), _universal(runs, case), frozen) == n
    if frozen:  # unickpt's universal output: the bf16 frozen parameters widened to fp32 as torch's .float() does
        from unickpt.adapters.deepspeed_writer import write_universal

        out = tmp_path / "universal" / "tag"
        write_universal(ckpt, str(out))
        for name in FROZEN_NAMES:
            got = torch.load(out / "zero" / name / "fp32.pt", weights_only=True, mmap=True)["param"]
            want = unickpt.load_tensor(ckpt, f"model.{name}")
            assert want.dtype == torch.bfloat16 and got.dtype == torch.float32
            assert bitwise_equal(got, want.float()), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["z2_pad_frozen", "z3_frozen"])
def test_frozen_parameters_equal_zero_to_fp32(runs: dict[str, str], case: str, tmp_path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = runs[case]
    ref = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert set(FROZEN_NAMES) <= set(ref) and len(ref) == 22
    m = read_deepspeed(ckpt)
    for name in FROZEN_NAMES:
        e = m.tensors[f"model.{name}"]
        assert e.shape == tuple(ref[name].shape) and e.dtype == "BF16"
        assert f"model.{name}" not in m.provenance.get("skipped", {})
    assert unickpt.verify(ckpt).ok
    converted = str(tmp_path / "converted")
    unickpt.convert(ckpt, converted)
    for src in (ckpt, converted):
        for name, want in ref.items():
            got = unickpt.load_tensor(src, f"model.{name}")
            assert got.shape == want.shape and bitwise_equal(got, want), f"{name}: differs from zero_to_fp32 in {src}"
    if case == "z3_frozen":
        # ds_to_universal leaves ZeRO-3's frozen parameters out; everything it writes matches
        assert not set(FROZEN_NAMES) & set(universal_params(_universal(runs, case)))
        assert _assert_equals_universal(ckpt, _universal(runs, case)) == 3 * 19
        # ZeRO-3's module entries are empty placeholders: nothing is a duplicate, nothing skipped
        assert "skipped" not in m.provenance
        # read in place, ds_to_universal's output says what it lacks instead of holding `[0]` tensors
        um = unickpt.read_manifest(_universal(runs, case))
        assert sorted(um.provenance["skipped"]) == sorted(f"model.{n}" for n in FROZEN_NAMES)
        assert not any(f"model.{n}" in um.tensors for n in FROZEN_NAMES)
        assert_every_byte(_universal(runs, case), tuple(f"model.{n}" for n in FROZEN_NAMES))
    assert_every_byte(ckpt)  # each rank's frozen fragments, partition tails and group steps accounted for


@pytest.mark.multiprocess
def test_zero3_bf16_frozen_loads_into_fp32_model(runs: dict[str, str]) -> None:
    """Issue 29: a ZeRO-3 bf16 checkpoint whose frozen parameters exist only in bf16 loads
    into the same model in fp32: the trained parameters are the fp32 master weights, the
    frozen ones widened exactly (bf16 -> fp32), both bitwise equal to zero_to_fp32's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from unickpt.examples.model import ModelArgs, Transformer

    ckpt = runs["z3_frozen"]
    model = Transformer(ModelArgs(32, 2, 4, 2, 64, 16))  # ds_train.py's defaults
    model.frozen_table = torch.nn.Parameter(torch.zeros(7, 3), requires_grad=False)
    for name in FREEZE:
        model.get_parameter(name).requires_grad_(False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(unickpt.MismatchError, match="saved dtype torch.bfloat16, target dtype torch.float32"):
        unickpt.load({"model": model.state_dict()}, ckpt, cast="none")  # what every load did before
    unickpt.load({"model": model.state_dict()}, ckpt)
    ref = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    for name, got in model.state_dict().items():
        want = ref[name]
        assert (want.dtype == torch.bfloat16) == (name in FROZEN_NAMES), name
        assert bitwise_equal(got, want.float()), f"{name}: differs from zero_to_fp32 (widened)"
        if name in FROZEN_NAMES:  # widened exactly: back to bf16 gives the saved bits
            assert bitwise_equal(got.bfloat16(), want), name
    with pytest.raises(unickpt.MismatchError, match="saved dtype torch.float32, target dtype torch.bfloat16"):
        unickpt.load({"model": model.bfloat16().state_dict()}, ckpt)  # the master weights are not narrowed unasked


@pytest.mark.multiprocess
def test_pipeline_parallel_equals_ds_to_universal(runs: dict[str, str]) -> None:
    ckpt = runs["pp"]
    names = os.listdir(os.path.join(ckpt, "global_step2"))
    assert "mp_rank_01_model_states.pt" in names and "layer_03-model_states.pt" in names
    m = read_deepspeed(ckpt)
    assert m.world_size == 2 and m.provenance["pipeline_parallel"] == 2 and m.provenance["data_parallel"] == 1
    params = universal_params(_universal(runs, "pp"))
    assert params == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight"]
    assert _assert_equals_universal(ckpt, _universal(runs, "pp")) == 4 * len(params)
    # the stages' fp32 module copies (layer files) are duplicates of the master weights: accounted for
    assert sorted(m.provenance["replicas"]) == sorted(f"module.{p}" for p in params) and "skipped" not in m.provenance
    assert source_ledger(ckpt).complete  # replicas leave the source complete: verify and convert go on
    assert_every_byte(ckpt)
    assert_every_byte(_universal(runs, "pp"))
    assert {f.file.split("/")[-1] for e in m.tensors.values() for f in e.fragments} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"}
    assert unickpt.verify(ckpt).ok


@pytest.mark.multiprocess
def test_tensor_parallel_equals_ds_to_universal(runs: dict[str, str], tmp_path) -> None:
    """AutoTP, tp=2: column-parallel up_proj (weight and bias), row-parallel down_proj weight,
    replicated down_proj bias and norm, placed by the checkpoint's universal_checkpoint_info."""
    ckpt = runs["tp"]
    assert "mp_rank_01_model_states.pt" in os.listdir(os.path.join(ckpt, "global_step2"))
    m = read_deepspeed(ckpt)
    assert m.provenance["tensor_parallel"] == 2 and m.world_size == 2
    assert m.tensors["model.up_proj.weight"].shape == (16, 8) and m.tensors["model.down_proj.weight"].shape == (8, 16)
    params = universal_params(_universal(runs, "tp"))
    assert len(params) == 6
    assert _assert_equals_universal(ckpt, _universal(runs, "tp")) == 4 * len(params)
    # the replicated parameters are read from tensor-parallel rank 0; rank 1's copies are accounted for
    replicas = {k for k in m.provenance["replicas"] if k.startswith("zero_pp_rank_0_mp_rank_01")}
    assert replicas == {f"zero_pp_rank_0_mp_rank_01_optim_states.pt:{p}.{k}" for p in ("down_proj.bias", "norm.weight",
                        "norm.bias") for k in ("fp32", "exp_avg", "exp_avg_sq")} | {
                        "zero_pp_rank_0_mp_rank_01_optim_states.pt:base_optimizer_state.state.0.step"}  # the group's step
    assert unickpt.verify(ckpt).ok
    assert_every_byte(ckpt)  # the replicas' slices of the flat partitions and the module's shards included
    assert_every_byte(_universal(runs, "tp"))
    # unickpt's universal output assembles the shards (column blocks copied through scratch) as DeepSpeed does
    from unickpt.adapters.deepspeed_writer import write_universal

    write_universal(ckpt, str(tmp_path / "universal" / "tag"))
    assert _assert_equals_universal(str(tmp_path / "universal" / "tag"), _universal(runs, "tp")) == 4 * len(params)
    # the same checkpoint described by the name patterns alone (no affine map: DeepSpeed's older form)
    patterns_only = _edit_rules(ckpt, tmp_path / "patterns_only", lambda sd: sd["universal_checkpoint_info"].pop("affine_map"))
    assert _assert_equals_universal(patterns_only, _universal(runs, "tp")) == 4 * len(params)


@pytest.mark.multiprocess
def test_planted_tensor_is_neither_read_nor_reported(runs: dict[str, str], tmp_path) -> None:
    """A tensor storage the reader does not know, planted in a copy of a real checkpoint's
    model-states file (re-saved by torch.save) inside an entry of DeepSpeed's own whose
    tensors it does not read (the scheduler's state; a top-level key of a job's own is its
    client_state, read: tests/test_deepspeed_format.py): its bytes, exactly, are
    unaccounted and verify fails."""
    from test_cli import invoke

    ckpt = tmp_path / "planted"
    shutil.copytree(runs["z1_pad"], ckpt)
    f = ckpt / "global_step4" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    planted = torch.arange(1000, dtype=torch.float32) + 0.5
    sd["lr_scheduler"] = {"planted": planted}
    torch.save(sd, f)
    ledger = source_ledger(str(ckpt))
    assert not ledger.complete and ledger.files_unchecked == [] and ledger.unaccounted_bytes == planted.numel() * 4
    (region,) = ledger.unaccounted
    assert region.file == "global_step4/mp_rank_00_model_states.pt"
    with open(f, "rb") as fh:
        fh.seek(region.start)
        assert fh.read(region.stop - region.start) == planted.numpy().tobytes()
    r = invoke("verify", str(ckpt))
    assert r.exit_code == 1 and "CORRUPT" in r.stdout and f"bytes {region.start}-{region.stop}" in r.stdout, r.output


def _edit_rules(ckpt: str, dst, edit) -> str:
    """A copy of a real tensor-parallel checkpoint whose model-states files' universal
    checkpoint info was changed by ``edit(state_dict)``: the forms written by other DeepSpeed
    versions and trainers (the rules without an affine map, or no rules at all)."""
    shutil.copytree(ckpt, dst)
    for name in os.listdir(os.path.join(dst, "global_step2")):
        if name.startswith("mp_rank_"):
            f = os.path.join(dst, "global_step2", name)
            sd = torch.load(f, weights_only=False)
            edit(sd)
            torch.save(sd, f)
    return str(dst)


def _without_rules(ckpt: str, dst) -> str:
    return _edit_rules(ckpt, dst, lambda sd: sd.pop("universal_checkpoint_info"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, files, words", [
    ("tp", "mp_rank_01_model_states.pt", "needs DeepSpeed's universal_checkpoint_info"),
])
def test_refused_with_the_reason(runs: dict[str, str], case: str, files: str, words: str, tmp_path) -> None:
    ckpt = _without_rules(runs[case], tmp_path / "tp_without_rules")
    assert files in os.listdir(os.path.join(ckpt, "global_step2"))
    with pytest.raises(LayoutError) as err:
        read_deepspeed(ckpt)
    assert words in str(err.value) and "not supported" in str(err.value) and "nothing was read" in str(err.value)
    for call in (unickpt.read_manifest, unickpt.verify):  # what inspect and verify do
        with pytest.raises(LayoutError, match="not supported"):
            call(ckpt)
    r = subprocess.run([sys.executable, "-m", "unickpt", "convert", ckpt, str(tmp_path / "out")], capture_output=True,
                       text=True, env=ds_env(), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, (r.stdout, r.stderr)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
