"""DeepSpeed checkpoints built by hand (no DeepSpeed needed): the ZeRO-1/2 layout with 11
ranks (numeric, not alphabetical, rank order), low-precision module copies, refusal of
unknown pickled classes, and write_universal's layout. Real DeepSpeed runs are in
tests/test_deepspeed.py."""

from __future__ import annotations

import collections
import os
import pickle
import types
from math import prod

import pytest
import torch

import unickpt
from unickpt.adapters.deepspeed import is_deepspeed, read_deepspeed
from unickpt.adapters.deepspeed_writer import write_universal
from unickpt.errors import CorruptionError, UnsafePickleError

from ds_cases import assert_every_byte


class FragmentAddress:
    """Pickled as DeepSpeed's deepspeed.utils.tensor_fragment.fragment_address."""

    def __init__(self, numel: int, start: int) -> None:
        self.numel, self.start = numel, start


class LossScaler:
    """Pickled as DeepSpeed's static loss scaler."""

    def __init__(self) -> None:
        self.cur_scale, self.dynamic = 1.0, False


class Evil:
    """Pickled as os.system: must be refused, never called."""


GLOBALS = {
    FragmentAddress: b"deepspeed.utils.tensor_fragment\nfragment_address\n",
    LossScaler: b"deepspeed.runtime.fp16.loss_scaler\nLossScaler\n",
    Evil: b"os\nsystem\n",
}


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes the stand-in classes above under DeepSpeed's (or a forbidden) global name."""

    def save_global(self, obj, name=None):  # noqa: ANN001
        if obj in GLOBALS:
            self.write(pickle.GLOBAL + GLOBALS[obj])
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[type] = save_global


PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def _save(obj, path) -> None:
    torch.save(obj, path, pickle_module=PICKLE, pickle_protocol=2)


SHAPES = collections.OrderedDict([("layer.weight", (37, 5)), ("layer.bias", (64,)), ("norm.weight", (13,))])


def _with_attributes(t: torch.Tensor) -> torch.Tensor:
    """``t`` carrying Megatron's tensor-parallel attributes (Megatron-DeepSpeed's parameters
    and fp32 copies do): torch.save then pickles it through ``_rebuild_from_type_v2``."""
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, 0, 1
    return t


def _zero2(root, world: int = 11, module_dtype=torch.float32, evil: bool = False, attributes: bool = False,
           client_state: dict | None = None):
    """A ZeRO-2 checkpoint of SHAPES on ``world`` ranks (its flat fp32 groups, moments and
    module tensors carrying Python attributes with ``attributes``; ``client_state`` added to
    the model-states file as the engine adds it); returns the true tensors."""
    mark = _with_attributes if attributes else (lambda t: t)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    flat = torch.cat([full[n].reshape(-1) for n in SHAPES])
    total = flat.numel()
    part = -(-total // world)
    padded = torch.cat([flat, torch.zeros(part * world - total)])
    tag = root / "global_step7"
    tag.mkdir(parents=True)
    starts, at = {}, 0
    for n, s in SHAPES.items():
        starts[n] = at
        at += prod(s)
    for r in range(world):
        lo, hi = r * part, (r + 1) * part
        mapping = collections.OrderedDict()
        for n, s in SHAPES.items():
            a, b = max(lo, starts[n]), min(hi, starts[n] + prod(s))
            if a < b:
                mapping[n] = FragmentAddress(b - a, a - lo)
        mine = mark(padded[lo:hi].clone())
        osd = {
            "loss_scaler": LossScaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.0,
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": mark(mine * 2),
                                                   "exp_avg_sq": mark(mine * 3)}},
                                     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
            "single_partition_of_fp32_groups": [mine],
            "zero_stage": 2, "group_paddings": [part * world - total if r == world - 1 else 0],
            "partition_count": [world], "ds_version": "0.19.8", "param_slice_mappings": [mapping],
        }
        if evil and r == 3:
            osd["hook"] = Evil
        _save({"optimizer_state_dict": osd, "ds_version": "0.19.8"}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    module = collections.OrderedDict((n, mark(t.to(module_dtype))) for n, t in full.items())
    module["rope.cos"] = torch.arange(6.0)  # a buffer: not in the optimizer
    _save({"module": module, "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in SHAPES.items())],
           "global_steps": 7, "global_samples": 56, "skipped_steps": 0, "dp_world_size": world, "mp_world_size": 1,
           "lr_scheduler": None, "ds_version": "0.19.8", "buffer_names": ["rope.cos"], **(client_state or {})},
          tag / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step7")
    return full


def test_eleven_ranks_numeric_order(tmp_path) -> None:
    full = _zero2(tmp_path)
    assert is_deepspeed(str(tmp_path)) and is_deepspeed(str(tmp_path / "global_step7"))
    assert not is_deepspeed(str(tmp_path / "nowhere"))
    m = read_deepspeed(str(tmp_path))
    assert m.world_size == 11 and m.provenance["zero_stage"] == 2
    for n, t in full.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path), f"model.{n}"), t)
        assert torch.equal(unickpt.load_tensor(str(tmp_path), f"optim.state.{n}.exp_avg"), t * 2)
        assert torch.equal(unickpt.load_tensor(str(tmp_path), f"optim.state.{n}.exp_avg_sq"), t * 3)
        assert unickpt.load_tensor(str(tmp_path), f"optim.state.{n}.step").item() == 7.0
        assert f"module.{n}" not in m.tensors  # same dtype as the master: not listed twice
    # layer.weight spans ranks 0-7: its fragments in numeric rank order 0, 1, ..., 10
    ranks = [f.rank for f in m.tensors["model.layer.weight"].fragments]
    assert ranks == sorted(ranks) and len(ranks) > 1
    assert torch.equal(unickpt.load_tensor(str(tmp_path), "model.rope.cos"), torch.arange(6.0))
    assert m.values["train.step"] == 7 and m.values["deepspeed.global_samples"] == 56
    assert m.values["optim.param_groups"][0]["lr"] == 0.1
    assert_every_byte(str(tmp_path))  # the last rank's padded partition and the module copies included


def test_bf16_module_copy(tmp_path) -> None:
    full = _zero2(tmp_path, world=3, module_dtype=torch.bfloat16)
    m = read_deepspeed(str(tmp_path / "global_step7"))
    for n, t in full.items():
        assert m.tensors[f"module.{n}"].dtype == "BF16"
        assert torch.equal(unickpt.load_tensor(str(tmp_path), f"module.{n}"), t.bfloat16())
        assert torch.equal(unickpt.load_tensor(str(tmp_path), f"model.{n}"), t)
    assert_every_byte(str(tmp_path))


def test_tensors_carrying_attributes(tmp_path) -> None:
    """Flat fp32 groups, moments, module copies and a universal checkpoint's ``fp32.pt``
    tensors carrying Python attributes (pickled through ``_rebuild_from_type_v2`` with
    ``torch.Tensor``) read bitwise through the DeepSpeed reader, every byte accounted for."""
    full = _zero2(tmp_path / "src", world=3, module_dtype=torch.bfloat16, attributes=True)
    data = (tmp_path / "src" / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes()
    assert b"_rebuild_from_type_v2" in data and b"torch\nTensor" in data  # the form in question, really written
    for n, t in full.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "src"), f"model.{n}"), t)
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "src"), f"module.{n}"), t.bfloat16())
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "src"), f"optim.state.{n}.exp_avg_sq"), t * 3)
    assert_every_byte(str(tmp_path / "src"))
    out = tmp_path / "uni" / "global_step7_universal"
    write_universal(str(tmp_path / "src"), str(out))
    for n in full:  # ds_to_universal's fp32.pt, its tensor carrying the attributes
        fp32 = torch.load(out / "zero" / n / "fp32.pt", weights_only=True)
        fp32["param"] = _with_attributes(fp32["param"])
        torch.save(fp32, out / "zero" / n / "fp32.pt")
        assert b"_rebuild_from_type_v2" in (out / "zero" / n / "fp32.pt").read_bytes()
    for n, t in full.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "uni"), f"model.{n}"), t)
    assert_every_byte(str(tmp_path / "uni"))


def test_client_state_read_or_reported(tmp_path) -> None:
    """A job's client_state in the model-states file: plain values and Megatron's args read
    as ``deepspeed.client_state.<key>`` values, its tensors read bitwise as tensors, a value
    holding NumPy arrays (objects unickpt does not build) and the RNG state reported skipped
    with their bytes; a forbidden class in it refuses the file."""
    import argparse

    import numpy as np

    ema = torch.arange(10.0).reshape(2, 5) / 3
    client = {"args": argparse.Namespace(params_dtype=torch.bfloat16, hidden=5), "iteration": 7,
              "ema": {"layer.weight": ema, "decay": 0.99}, "sampler": {"order": np.arange(4)},
              "rng_state": [{"torch_rng_state": torch.get_rng_state(), "np_rng_state": np.random.get_state()}]}
    _zero2(tmp_path, world=3, client_state=client)
    m = read_deepspeed(str(tmp_path))
    values = {k: v for k, v in m.values.items() if k.startswith("deepspeed.client_state.")}
    assert values == {"deepspeed.client_state.args": {"params_dtype": "torch.bfloat16", "hidden": 5},
                      "deepspeed.client_state.iteration": 7,
                      "deepspeed.client_state.ema": {"layer.weight": None, "decay": 0.99}}
    assert torch.equal(unickpt.load_tensor(str(tmp_path), "deepspeed.client_state.ema.layer.weight"), ema)
    assert "numpy" in m.provenance["skipped"]["deepspeed.client_state.sampler"]
    assert_every_byte(str(tmp_path), ("mp_rank_00_model_states.pt:rng_state", "deepspeed.client_state.sampler"))
    _zero2(tmp_path / "evil", world=3, client_state={"hook": Evil})
    with pytest.raises(UnsafePickleError, match="os.system"):
        read_deepspeed(str(tmp_path / "evil"))


def test_a_value_with_no_plain_form_is_in_the_ledger_with_its_reason(tmp_path) -> None:
    """An engine value holding an object unickpt does not build (a NumPy array in the LR
    scheduler's state) is not kept, nor kept as its repr: the ledger says it was skipped
    and why (the rule the legacy Megatron reader shares, adapters/manifest_builder.py)."""
    import numpy as np

    _zero2(tmp_path, world=3, client_state={"lr_scheduler": {"last_epoch": 7, "base_lrs": np.array([0.1, 0.2])}})
    m = read_deepspeed(str(tmp_path))
    assert "deepspeed.lr_scheduler" not in m.values and m.values["deepspeed.global_samples"] == 56
    why = m.provenance["skipped"]["deepspeed.lr_scheduler"]
    assert why.startswith("a value with no plain form, not kept") and "numpy" in why and "does not build" in why, why
    assert_every_byte(str(tmp_path), ("deepspeed.lr_scheduler",))


def test_unknown_class_refused(tmp_path) -> None:
    _zero2(tmp_path, world=4, evil=True)
    with pytest.raises(UnsafePickleError, match="os.system"):
        read_deepspeed(str(tmp_path))


def test_missing_rank_file(tmp_path) -> None:
    _zero2(tmp_path, world=4)
    os.remove(tmp_path / "global_step7" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(CorruptionError):
        read_deepspeed(str(tmp_path))


def test_write_universal_layout(tmp_path) -> None:
    full = _zero2(tmp_path / "src")
    out = tmp_path / "uni" / "global_step7_universal"
    report = write_universal(str(tmp_path / "src"), str(out))
    assert report.step == 7 and report.params == 4  # three parameters and the buffer
    assert (tmp_path / "uni" / "latest_universal").read_text() == "global_step7_universal"
    for n, t in full.items():
        fp32 = torch.load(out / "zero" / n / "fp32.pt", weights_only=True)
        assert list(fp32) == ["cat_dim", "param"] and fp32["cat_dim"] == 0 and torch.equal(fp32["param"], t)
        assert torch.equal(torch.load(out / "zero" / n / "exp_avg.pt", weights_only=True)["param"], t * 2)
        assert torch.equal(torch.load(out / "zero" / n / "exp_avg_sq.pt", weights_only=True)["param"], t * 3)
        assert torch.load(out / "zero" / n / "step.pt", weights_only=True).item() == 7.0
    osd = torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)
    assert osd["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}] and osd["ds_version"] == "0.19.8"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        ms = torch.load(out / name, weights_only=True)
        assert ms["global_steps"] == 7 and ms["dp_world_size"] == 11 and ms["mp_world_size"] == 1
        assert dict(ms["param_shapes"][0])["layer.weight"] == torch.Size((37, 5))
    # and it reads back, in place, as a DeepSpeed universal checkpoint
    for n, t in full.items():
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "uni"), f"model.{n}"), t)
    assert_every_byte(str(tmp_path / "uni"))
    # no temporary files are left behind
    assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")]


def test_write_universal_from_unickpt_save(tmp_path) -> None:
    """A plain unickpt.save of model/optimizer state with the torch-native names."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": {"state": {n: opt.state[p] for n, p in model.named_parameters()}},
             "train": {"step": 1}}
    unickpt.save(state, str(tmp_path / "ck"))
    out = tmp_path / "uni" / "step1"
    report = write_universal(str(tmp_path / "ck"), str(out))
    assert report.step == 1 and report.params == 2
    for n, p in model.named_parameters():
        assert torch.equal(torch.load(out / "zero" / n / "fp32.pt", weights_only=True)["param"], p.detach())
        assert torch.equal(torch.load(out / "zero" / n / "exp_avg.pt", weights_only=True)["param"], opt.state[p]["exp_avg"])
        assert torch.load(out / "zero" / n / "step.pt", weights_only=True).item() == 1.0
    # no hyperparameters in the source: one group without any, so DeepSpeed keeps its own
    assert torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)["param_groups"] == [{"params": [0]}]
