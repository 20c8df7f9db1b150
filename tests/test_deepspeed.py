"""DeepSpeed ZeRO and universal checkpoints, against real DeepSpeed runs (CPU, gloo).

Each DeepSpeed checkpoint is produced once per module (tests/ds_train.py, its ranks forked from
the preloaded launcher tests/ds_fork.py with the environment torchrun gives them):
ZeRO-1 on 2 ranks, ZeRO-2 on 4 ranks (8 steps, saved after 4: also the uninterrupted
reference), ZeRO-3 on 2 and 4 ranks. What is checked:

* ``read_deepspeed`` + ``unickpt.load_tensor`` give every parameter and Adam moment (and
  the step) bitwise equal to DeepSpeed's own ``ds_to_universal`` of the same checkpoint;
  so does reading ``ds_to_universal``'s output directory;
* ``write_universal`` writes, tensor by tensor, the bytes ``ds_to_universal`` writes;
* a DeepSpeed job on 2 ranks resumes (``load_universal``) from unickpt's universal output
  of the 4-rank ZeRO-2 checkpoint and its losses for steps 5-8 equal those of the
  uninterrupted 4-rank run;
* a checkpoint of the torch-native example trainer (one process) becomes a universal
  checkpoint that a 2-rank ZeRO-1 DeepSpeed job resumes from, its losses following the
  trainer's own;
* ``unickpt convert --to deepspeed`` of each ZeRO checkpoint never imports torch (nor do
  ``inspect`` and ``verify``), and what it writes loads with
  ``torch.load(weights_only=True, mmap=True)`` bitwise equal to ``ds_to_universal``'s output;
* the bf16 ZeRO-2 and the 2-rank ZeRO-3 runs save with Megatron-DeepSpeed's ``client_state``
  (``args`` with megatron-core enums and torch dtypes, ``rng_state``, ``iteration``...): it is
  read as values, its RNG state reported skipped, every byte still accounted for.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (see docs/FORMATS.md, 'DeepSpeed', for the recipe)")

import unickpt  # noqa: E402
from unickpt.adapters.deepspeed import is_deepspeed, read_deepspeed  # noqa: E402
from unickpt.adapters.deepspeed_writer import write_universal  # noqa: E402
from unickpt.adapters.detect import checkpoint_format  # noqa: E402
from unickpt.format.values import decode_value  # noqa: E402

from ds_cases import (STATES, assert_every_byte, bitwise_equal, ds_to_universal, ds_train, losses,  # noqa: E402
                      universal_params, universal_tensor)

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CASES = {"z1_2": (1, 2), "z2_4": (2, 4), "z3_2": (3, 2), "z3_4": (3, 4), "z2_2_bf16": (2, 2)}
BF16 = {"z2_2_bf16"}  # bf16 module, fp32 master weights (bf16_zero_pp_rank_* files)
# saved with Megatron-DeepSpeed's client_state (args, iteration, tokens, rng_state...): one
# model-states file (ZeRO-2) and one per rank (ZeRO-3)
MEGATRON_DS = {"z2_2_bf16": ("mp_rank_00_model_states.pt",),
               "z3_2": ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt")}
TAG = "global_step4"


def _rng_skipped(case: str) -> tuple[str, ...]:
    """What the reader reports skipped in ``case``: each model-states file's per-rank RNG state."""
    return tuple(f"{f}:rng_state" for f in MEGATRON_DS.get(case, ()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """case -> run directory holding ckpt/global_step4 (+ ckpt/global_step4_universal from
    ds_to_universal) and losses.json."""
    root = tmp_path_factory.mktemp("ds")
    out = {}
    for case, (stage, world) in CASES.items():
        d = root / case
        d.mkdir()
        steps = ["--steps", "8", "--save-at", "4"] if case == "z2_4" else ["--steps", "4"]
        steps += ["--bf16"] if case in BF16 else []
        steps += ["--megatron-client-state"] if case in MEGATRON_DS else []
        ds_train(world, "--stage", str(stage), *steps, "--save-dir", str(d / "ckpt"), "--loss-log", str(d / "losses.json"))
        ds_to_universal(str(d / "ckpt" / TAG), str(d / "ckpt" / f"{TAG}_universal"))
        out[case] = str(d)
    return out


def _ckpt(runs: dict[str, str], case: str) -> str:
    return os.path.join(runs[case], "ckpt")


def _ds_universal(runs: dict[str, str], case: str) -> str:
    return os.path.join(runs[case], "ckpt", f"{TAG}_universal")


def _compare_reads(src: str, uni: str) -> int:
    n = 0
    manifest = unickpt.read_manifest(src)
    for param in universal_params(uni):
        for key, pattern in STATES.items():
            ref = universal_tensor(uni, param, key)
            if ref is None:
                continue
            name = pattern.format(param)
            assert name in manifest.tensors, f"{name} missing from the manifest of {src}"
            got = unickpt.load_tensor(src, name)
            assert bitwise_equal(got, ref), f"{name}: unickpt's read differs from ds_to_universal"
            n += 1
    return n


@pytest.mark.parametrize("case", list(CASES))
def test_read_equals_ds_to_universal(runs: dict[str, str], case: str) -> None:
    ckpt = _ckpt(runs, case)
    uni = _ds_universal(runs, case)
    stage, world = CASES[case]
    # the parent (with DeepSpeed's `latest` file), the tag directory and the universal directory
    for path in (ckpt, os.path.join(ckpt, TAG), uni):
        assert is_deepspeed(path) and checkpoint_format(path) == "deepspeed"
    m = read_deepspeed(ckpt)
    assert m.world_size == world and m.provenance["zero_stage"] == stage
    assert unickpt.read_manifest(ckpt).values["train.step"] == 4
    params = universal_params(uni)
    assert len(params) == 21
    # every fragment points into DeepSpeed's own files (no copy)
    files = {f.file for e in m.tensors.values() for f in e.fragments}
    assert files and all(f.startswith(f"{TAG}/") and f.endswith(".pt") for f in files)
    assert _compare_reads(ckpt, uni) >= 3 * len(params)
    assert _compare_reads(uni, uni) >= 3 * len(params)  # the universal directory read in place
    # every byte of DeepSpeed's *.pt files accounted for (ds_to_universal copies the model-states files)
    assert_every_byte(ckpt, _rng_skipped(case))
    assert_every_byte(uni, _rng_skipped(case)[:1])  # the universal reader opens one model-states file
    if case in BF16:
        assert all(f.startswith(f"{TAG}/bf16_zero_pp_rank_") for e in m.tensors.values() if e.name.startswith("optim.")
                   for f in (g.file for g in e.fragments))
        for p in params:
            assert m.tensors[f"model.{p}"].dtype == "F32" and m.tensors[f"module.{p}"].dtype == "BF16"


@pytest.mark.parametrize("case", list(CASES))
def test_write_universal_equals_ds_to_universal(runs: dict[str, str], case: str, tmp_path) -> None:
    uni = _ds_universal(runs, case)
    out = tmp_path / "out" / TAG
    report = write_universal(_ckpt(runs, case), str(out))
    assert report.params == 21 and report.step == 4
    assert (tmp_path / "out" / "latest_universal").read_text() == TAG
    assert is_deepspeed(str(tmp_path / "out"))
    for param in universal_params(uni):
        for key in STATES:
            ref = universal_tensor(uni, param, key)
            got = universal_tensor(str(out), param, key)
            if ref is None:  # ds_to_universal writes no step.pt for ZeRO-3
                assert key == "step" and CASES[case][0] == 3
                continue
            assert got is not None and bitwise_equal(got, ref), f"{param}/{key}.pt differs from ds_to_universal's"
            if CASES[case][0] < 3:  # same containers as ds_to_universal's ZeRO-1/2 output
                ref_obj = torch.load(os.path.join(uni, "zero", param, key + ".pt"), weights_only=False)
                got_obj = torch.load(os.path.join(out, "zero", param, key + ".pt"), weights_only=False)
                assert type(ref_obj) is type(got_obj)
                if isinstance(ref_obj, dict):
                    assert list(ref_obj) == list(got_obj) and ref_obj["param"].shape == got_obj["param"].shape
    ref_osd = torch.load(os.path.join(uni, "zero", "optimizer_state.pt"), weights_only=False)
    got_osd = torch.load(os.path.join(out, "zero", "optimizer_state.pt"), weights_only=False)
    ref_groups = ref_osd.get("param_groups") or ref_osd["optimizer_state_dict"]["param_groups"]
    assert got_osd["param_groups"] == ref_groups
    # write_universal reads unickpt's own format too: a round trip through it is exact
    converted = tmp_path / "consolidated"
    unickpt.convert(str(out), str(converted))
    assert _compare_reads(str(converted), uni) >= 3 * 21


# runs the command line as `python -m unickpt` does, then says whether torch was imported
_CLI_NO_TORCH = "import sys; from unickpt.cli import main; sys.argv[0] = 'unickpt'\n" \
                "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n" \
                "print('torch imported:', 'torch' in sys.modules)"


@pytest.mark.parametrize("case", ["z2_4", "z3_2", "z2_2_bf16"])
def test_cli_conversion_never_imports_torch(runs: dict[str, str], case: str, tmp_path) -> None:
    uni = _ds_universal(runs, case)
    out = tmp_path / "cli" / TAG
    # the bf16 module copies have no universal equivalent; Megatron-DeepSpeed's RNG state is skipped
    allow = ["--allow-skip"] if case in BF16 or case in MEGATRON_DS else []
    r = subprocess.run([sys.executable, "-c", _CLI_NO_TORCH, "convert", os.path.join(_ckpt(runs, case), TAG), str(out),
                        "--to", "deepspeed", *allow], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "21 parameters (deepspeed -> deepspeed)" in r.stdout
    assert r.stdout.strip().endswith("torch imported: False"), r.stdout[-2000:]
    n = 0
    for param in universal_params(uni):
        for key in STATES:
            ref = universal_tensor(uni, param, key)
            if ref is None:
                continue
            got = torch.load(os.path.join(out, "zero", param, key + ".pt"), weights_only=True, mmap=True)
            got = got["param"] if isinstance(got, dict) else got
            assert bitwise_equal(got, ref), f"{param}/{key}.pt differs from ds_to_universal's"
            n += 1
    assert n >= 3 * 21
    model = torch.load(os.path.join(out, "mp_rank_00_model_states.pt"), weights_only=True)
    assert model["global_steps"] == 4 and len(model["param_shapes"][0]) == 21
    if case in ("z2_4", "z2_2_bf16"):  # inspect and verify of a DeepSpeed checkpoint go without torch too
        for command in ("inspect", "verify"):  # (z2_2_bf16: Megatron-DeepSpeed's args hold torch dtypes)
            extra = ["--allow-skip"] if command == "verify" and case in MEGATRON_DS else []
            r = subprocess.run([sys.executable, "-c", _CLI_NO_TORCH, command, os.path.join(_ckpt(runs, case), TAG), *extra],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert r.returncode == 0 and r.stdout.strip().endswith("torch imported: False"), r.stdout[-2000:] + r.stderr


def _pickled_globals(path: str) -> set[str]:
    """The globals the pickle of the ``torch.save`` archive at ``path`` names."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


@pytest.mark.parametrize("case", list(MEGATRON_DS))
def test_megatron_deepspeed_client_state(runs: dict[str, str], case: str) -> None:
    """A checkpoint the real engine saved with Megatron-DeepSpeed's client_state (``args``: a
    Namespace holding megatron-core enums and torch dtypes; ``rng_state``: NumPy's state,
    torch's and the accelerator's ByteTensors, ``rng_tracker_states``; ``iteration``,
    ``tokens``, ``checkpoint_info``, ``universal_checkpoint_info``) reads whole: its values as
    ``deepspeed.client_state.<key>``, each model-states file's RNG state skipped with its
    reason (ZeRO-3: every rank's file), nothing unaccounted (test_read_equals_ds_to_universal
    checks every byte), and ``inspect --json`` lists it."""
    import json

    from test_cli import invoke

    ckpt = _ckpt(runs, case)
    dtype = "torch bfloat16" if case in BF16 else "torch float32"
    for f in MEGATRON_DS[case]:  # what Megatron-DeepSpeed's client_state pickles, really written
        assert {"argparse Namespace", "megatron.core.enums ModelType", "megatron.core.transformer.enums AttnBackend",
                dtype, "numpy ndarray", "_codecs encode", "torch ByteStorage"} <= _pickled_globals(os.path.join(ckpt, TAG, f))
    m = unickpt.read_manifest(ckpt)
    values = {k[len("deepspeed.client_state."):]: decode_value(v) for k, v in m.values.items()
              if k.startswith("deepspeed.client_state.")}
    assert sorted(values) == ["args", "checkpoint_info", "checkpoint_version", "iteration", "tokens"]
    args = values["args"]
    assert args["model_type"] == "ModelType(1)" and args["attention_backend"] == "AttnBackend(5)"
    assert args["params_dtype"] == dtype.replace(" ", ".") and args["num_layers"] == 2 and args["zero_stage"] == CASES[case][0]
    assert values["iteration"] == 4 and values["tokens"] == 4 * 8 * 16 and values["checkpoint_version"] == 3.0
    assert values["checkpoint_info"] == {"padded_vocab_size": 64, "original_vocab_size": 64}
    assert not any(n.startswith("deepspeed.client_state") for n in m.tensors)
    assert sorted(m.provenance["skipped"]) == sorted(_rng_skipped(case))
    assert all("per-rank RNG state" in why for why in m.provenance["skipped"].values())
    r = invoke("inspect", ckpt, "--json")
    assert r.exit_code == 0, r.output
    ledger = json.loads(r.output)["ledger"]
    assert ledger["unaccounted"] == [] and sorted(ledger["skipped"]) == sorted(_rng_skipped(case))


def test_other_ranks_client_state_differing_is_reported(runs: dict[str, str], tmp_path) -> None:
    """ZeRO-3: every rank saves its own client state; rank 0's is read, another rank's equal
    values are copies, but one that differs, or holds tensors, is reported skipped (its
    bytes owned), never dropped silently."""
    import shutil

    from unickpt.adapters.regions import source_ledger

    ckpt = tmp_path / "ckpt"
    shutil.copytree(_ckpt(runs, "z3_2"), ckpt)
    f = ckpt / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["iteration"], sd["ema"] = 5, {"w": torch.ones(3)}
    torch.save(sd, f)
    ledger = source_ledger(str(ckpt))
    assert ledger.unaccounted == [] and sorted(ledger.skipped) == sorted(
        (*_rng_skipped("z3_2"), "zero_pp_rank_1_mp_rank_00_model_states.pt:iteration",
         "zero_pp_rank_1_mp_rank_00_model_states.pt:ema"))
    assert decode_value(unickpt.read_manifest(str(ckpt)).values["deepspeed.client_state.iteration"]) == 4


def _damaged(runs: dict[str, str], case: str, tmp_path, fname: str, edit, universal: bool = False) -> str:
    """A copy of ``case``'s checkpoint (or of unickpt's universal output of it) whose file
    ``fname`` (under the tag directory) ``edit`` changed, as a buggy or hostile writer would."""
    import shutil

    ckpt = tmp_path / f"{case}_{len(list(tmp_path.iterdir()))}"
    if universal:
        write_universal(_ckpt(runs, case), str(ckpt / TAG))
    else:
        shutil.copytree(_ckpt(runs, case), ckpt)
    f = ckpt / TAG / fname
    sd = torch.load(f, weights_only=False)  # the test's own file
    sd = edit(sd) or sd
    torch.save(sd, f)
    return str(ckpt)


def test_damaged_slice_addresses_shapes_and_fields_are_refused(runs: dict[str, str], tmp_path) -> None:
    """What would load another parameter's values, or drop one, without a word: a ZeRO-2
    slice moved onto its neighbour, two slices of one size swapped (nothing left over for
    the byte ledger to see), a ZeRO-3 shape one row short (every later parameter read
    shifted), a universal master weight that is no tensor. And a field of another kind
    than DeepSpeed writes is named, not a TypeError from deep inside."""
    optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def mapping(sd):
        return sd["optimizer_state_dict"]["param_slice_mappings"][0]

    def moved(sd):  # the second parameter's slice one element back, onto the first's
        mapping(sd)[list(mapping(sd))[1]].start -= 1

    def swapped(sd):  # two whole slices of one size trade places
        m = mapping(sd)
        a, b = next((a, b) for a in m for b in m if a < b and m[a].numel == m[b].numel)
        m[a].start, m[b].start = m[b].start, m[a].start

    def short(sd):
        shapes = sd["param_shapes"][0]
        name = next(iter(shapes))
        shapes[name] = torch.Size([shapes[name][0] - 1, *shapes[name][1:]])

    def no_tensor(sd):
        sd["param"] = None

    def stage_as_text(sd):
        sd["optimizer_state_dict"]["zero_stage"] = "two"

    cases = [
        (_damaged(runs, "z2_4", tmp_path, optim, moved), r"group 0: the slices of '.+' and '.+' overlap in the partition"),
        (_damaged(runs, "z2_4", tmp_path, optim, swapped), r"a flat group holds its parameters one after another in param_shapes order"),
        (_damaged(runs, "z3_2", tmp_path, "zero_pp_rank_0_mp_rank_00_model_states.pt", short),
         r"fp32_flat_groups\[0\] holds \d+ elements, where the partitions of its parameters .* take \d+"),
        (_damaged(runs, "z2_4", tmp_path, "zero/output.weight/fp32.pt", no_tensor, universal=True),
         r"zero/output.weight/fp32.pt: its 'param' is NoneType, not the parameter's fp32 tensor"),
        (_damaged(runs, "z2_4", tmp_path, optim, stage_as_text),
         r"a field of its state is not what DeepSpeed writes \(ValueError: invalid literal"),
    ]
    for path, message in cases:
        with pytest.raises(unickpt.CorruptionError, match=message):
            unickpt.read_manifest(path)

    def two_steps(sd):  # group 0's step as two numbers: reported skipped, not dropped
        sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"] = torch.tensor([4.0, 4.0])

    from unickpt.adapters.regions import source_ledger

    ledger = source_ledger(_damaged(runs, "z2_4", tmp_path, optim, two_steps))
    assert ledger.skipped == {f"{optim}:base_optimizer_state.state.0.step": "an optimizer step that is not one number "
                              "(StoredTensor of shape [2])"}, ledger.skipped


def test_resume_on_other_dp_degree(runs: dict[str, str], tmp_path) -> None:
    """ZeRO-2 on 4 ranks saved after step 4 -> unickpt write_universal -> ZeRO-2 on 2 ranks
    resumes with load_universal: steps 5-8 match the uninterrupted 4-rank run.

    Tolerance: relative 1e-5. The state handed over is bitwise DeepSpeed's (tests above) and
    a resume from ds_to_universal's own output gives the same losses bit for bit; what
    differs is the data-parallel degree: gradients are averaged over 2 instead of 4 ranks,
    a different floating-point summation order, which moves the loss by ~1 ulp per step
    (seen: steps 5-6 equal, 7-8 within 1.3e-7 relative)."""
    ref = losses(os.path.join(runs["z2_4"], "losses.json"))
    out = tmp_path / "resume" / "from_unickpt"
    write_universal(_ckpt(runs, "z2_4"), str(out))
    log = tmp_path / "resumed.json"
    ds_train(2, "--stage", "2", "--steps", "8", "--load-dir", str(out.parent), "--load-universal", "--loss-log", str(log))
    got = losses(str(log))
    assert sorted(got) == [5, 6, 7, 8]
    assert got[5] == ref[5]  # the first step after the resume: same state, same batch -> same loss
    for step in (6, 7, 8):
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0)


def test_torch_native_checkpoint_resumes_in_deepspeed(tmp_path) -> None:
    """The example trainer (torch-native, one process) saves after step 4 of 8; its checkpoint
    becomes a universal one that ZeRO-1 on 2 ranks resumes; steps 5-8 follow the trainer's.

    Tolerance: relative 1e-4: same model, data, schedule and AdamW hyperparameters, but
    DeepSpeed averages the gradient over 2 half-batches and steps AdamW over one flat
    partition instead of per tensor (different rounding), for 4 steps."""
    model_args = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "64", "--seq", "16",
                  "--global-batch", "8", "--dataset-size", "200"]
    log = tmp_path / "native.jsonl"
    r = subprocess.run([sys.executable, "-m", "unickpt.examples.train", *model_args, "--steps", "8", "--save-every", "4",
                        "--ckpt-dir", str(tmp_path / "native"), "--loss-log", str(log)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    ref = {rec["step"]: rec["loss"] for rec in map(json.loads, log.read_text().splitlines())}
    src = unickpt.CheckpointManager(str(tmp_path / "native")).path_for(4)
    out = tmp_path / "ds" / "from_native"
    report = write_universal(src, str(out))
    assert report.step == 4 and report.params == 21
    ds_log = tmp_path / "ds.json"
    ds_train(2, "--stage", "1", "--steps", "8", *model_args, "--load-dir", str(out.parent), "--load-universal",
             "--loss-log", str(ds_log))
    got = losses(str(ds_log))
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-4, abs=0)
