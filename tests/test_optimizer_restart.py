"""The everyday restart: save ``{"model": model, "optim": optimizer}``, then load into a
freshly built model and a never-stepped optimizer (issue 12, item 1). Optimizer state is
stored by parameter name, so it also meets torch's get_state_dict/set_state_dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unickpt
from unickpt.testing import run_ranks

from optim_restart_cases import KINDS, MORE, PRELOAD, SAVED_AT, Net, fsdp_save, optimizer, resume_fsdp_and_tp, snapshot, train

HERE = os.path.dirname(__file__)


def _trained(kind: str, steps: int = SAVED_AT, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    opt = optimizer(kind, model)
    train(model, opt, 0, steps)
    return model, opt


def _fresh(kind: str):
    torch.manual_seed(99)
    model = Net()
    return model, optimizer(kind, model)


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert set(a) == set(b), f"{where}: {set(a) ^ set(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


@pytest.mark.multiprocess
def test_resume_into_fresh_optimizers_in_a_new_process_is_bitwise(tmp_path):
    expected = {}
    for kind in KINDS:
        model, opt = _trained(kind)
        unickpt.save({"model": model, "optim": opt}, str(tmp_path / kind / "ckpt"))
        at_save, groups = snapshot(model, opt), opt.state_dict()["param_groups"]
        expected[kind] = (at_save, groups, train(model, opt, SAVED_AT, MORE), snapshot(model, opt))
    m = unickpt.read_manifest(str(tmp_path / "adamw" / "ckpt"))
    assert "optim.state.up.weight.exp_avg" in m.tensors and "optim.state.norm.bias.step" in m.tensors
    assert [g["params"] for g in m.values["optim.param_groups"]] == [["up.weight", "down.weight"], ["up.bias", "down.bias", "norm.weight", "norm.bias"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(unickpt.__path__[0]), HERE]))
    subprocess.run([sys.executable, os.path.join(HERE, "optim_restart_cases.py"), str(tmp_path)], check=True, env=env, timeout=120)
    for kind in KINDS:
        at_save, groups, losses, final = expected[kind]
        _assert_same(load_file(str(tmp_path / kind / "loaded.safetensors")), at_save, f"{kind} after load")
        resumed = json.loads((tmp_path / kind / "resumed.json").read_text())
        assert resumed["losses"] == losses, kind
        assert resumed["param_groups"] == json.loads(json.dumps(groups)), kind
        _assert_same(load_file(str(tmp_path / kind / "final.safetensors")), final, f"{kind} after {MORE} more steps")


@pytest.mark.multiprocess
def test_plain_objects_and_torch_get_state_dict_meet_both_ways(tmp_path):
    model, opt = _trained("adamw")
    reference = snapshot(model, opt)
    # saved from the plain objects, loaded through get_state_dict/set_state_dict
    unickpt.save({"model": model, "optim": opt}, str(tmp_path / "plain"))
    m2, o2 = _fresh("adamw")
    msd, osd = get_state_dict(m2, o2)
    unickpt.load({"model": msd, "optim": osd}, str(tmp_path / "plain"))
    set_state_dict(m2, o2, model_state_dict=msd, optim_state_dict=osd)
    _assert_same(snapshot(m2, o2), reference, "plain -> get_state_dict")
    assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    # saved through get_state_dict, loaded into the plain fresh objects
    msd, osd = get_state_dict(model, opt)
    unickpt.save({"model": msd, "optim": osd}, str(tmp_path / "torch"))
    m3, o3 = _fresh("adamw")
    unickpt.load({"model": m3, "optim": o3}, str(tmp_path / "torch"))
    _assert_same(snapshot(m3, o3), reference, "get_state_dict -> plain")
    assert o3.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert train(m3, o3, SAVED_AT, 1) == train(model, opt, SAVED_AT, 1)


@pytest.mark.multiprocess
def test_checkpoint_keyed_by_parameter_ids_still_loads_into_a_fresh_optimizer(tmp_path):
    model, opt = _trained("sgd")
    # what unickpt stored for an optimizer before names: torch's own state_dict, integer ids
    unickpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, str(tmp_path / "c"))
    assert "optim.state.0.momentum_buffer" in unickpt.read_manifest(str(tmp_path / "c")).tensors
    m2, o2 = _fresh("sgd")
    unickpt.load({"model": m2, "optim": o2}, str(tmp_path / "c"))
    _assert_same(snapshot(m2, o2), snapshot(model, opt), "ids -> fresh")
    assert train(m2, o2, SAVED_AT, 2) == train(model, opt, SAVED_AT, 2)


@pytest.mark.multiprocess
def test_strict_false_never_hides_an_optimizer(tmp_path):
    model, opt = _trained("adamw")
    unickpt.save({"model": model}, str(tmp_path / "no_optim"))
    m2, o2 = _fresh("adamw")
    with pytest.raises(unickpt.MismatchError, match="'optim'.*no state for this optimizer"):
        unickpt.load({"model": m2, "optim": o2}, str(tmp_path / "no_optim"))
    with pytest.warns(UserWarning, match="'optim'.*no state for this optimizer"):
        unickpt.load({"model": m2, "optim": o2}, str(tmp_path / "no_optim"), strict=False)
    assert not o2.state
    _assert_same(snapshot(m2, o2), {k: v for k, v in snapshot(model, opt).items() if k.startswith("param.")}, "model")

    # the checkpoint holds the optimizer's state, but for parameters of another name
    unickpt.save({"model": model, "optim": opt}, str(tmp_path / "with_optim"))
    torch.manual_seed(99)
    other = torch.nn.Sequential(Net())  # same parameters, named 0.up.weight ...
    fresh = optimizer("adamw", other)
    for strict in (True, False):
        with pytest.raises(unickpt.MismatchError, match="'optim'.*parameters this optimizer does not hold"):
            unickpt.load({"model": other, "optim": fresh}, str(tmp_path / "with_optim"), strict=strict)
        assert not fresh.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m4, o4 = _fresh("adamw")
        unickpt.load({"model": m4, "optim": o4}, str(tmp_path / "with_optim"), strict=False)
    assert len(o4.state) == 6


@pytest.mark.multiprocess
def test_fsdp2_checkpoint_resumes_into_fresh_optimizers_on_fsdp2_tp_and_one_process(tmp_path):
    run_ranks(fsdp_save, 2, str(tmp_path), preload=PRELOAD)
    run_ranks(resume_fsdp_and_tp, 2, str(tmp_path), preload=PRELOAD)
    saved = load_file(str(tmp_path / "saved.safetensors"))
    m, o = _fresh("adamw")
    unickpt.load({"model": m, "optim": o}, str(tmp_path / "fsdp"))
    msd, osd = get_state_dict(m, o)
    got = {f"model.{k}": v for k, v in msd.items()}
    got.update({f"optim.{fqn}.{k}": v for fqn, st in osd["state"].items() for k, v in st.items()})
    _assert_same(got, saved, "FSDP2 -> one process")
    expected = json.loads((tmp_path / "losses.json").read_text())
    torch.testing.assert_close(torch.tensor(train(m, o, SAVED_AT, MORE)), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_naming_rule_several_modules_built_with_names_or_partly_covered(tmp_path):
    torch.manual_seed(0)
    enc, dec = Net(), Net()
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1, momentum=0.9)
    train(torch.nn.Sequential(enc, dec), opt, 0, 2)
    unickpt.save({"enc": enc, "dec": dec, "optim": opt}, str(tmp_path / "two"))
    assert "optim.state.dec.up.weight.momentum_buffer" in unickpt.read_manifest(str(tmp_path / "two")).tensors
    e2, d2 = Net(), Net()
    o2 = torch.optim.SGD([*e2.parameters(), *d2.parameters()], lr=0.1, momentum=0.9)
    unickpt.load({"enc": e2, "dec": d2, "optim": o2}, str(tmp_path / "two"))
    _assert_same(snapshot(torch.nn.Sequential(e2, d2), o2), snapshot(torch.nn.Sequential(enc, dec), opt), "two modules")
    with pytest.raises(unickpt.SaveError, match="'optim'.*no module in the state dict holds"):
        unickpt.save({"enc": enc, "optim": opt}, str(tmp_path / "partial"))
    # no module beside it: the names the optimizer was built with
    named = torch.optim.AdamW(enc.named_parameters(), lr=1e-2)
    train(enc, named, 0, 1)
    unickpt.save({"optim": named}, str(tmp_path / "named"))
    assert "optim.state.norm.weight.exp_avg" in unickpt.read_manifest(str(tmp_path / "named")).tensors
    fresh = torch.optim.AdamW(Net().named_parameters(), lr=1e-3)
    unickpt.load({"optim": fresh}, str(tmp_path / "named"))
    assert torch.equal(fresh.state_dict()["state"][5]["exp_avg"], named.state_dict()["state"][5]["exp_avg"])


def test_deepspeed_checkpoint_loads_into_a_fresh_torch_optimizer(tmp_path):
    from test_deepspeed_format import SHAPES, _zero2

    full = _zero2(tmp_path)  # a ZeRO-2 checkpoint: state by parameter name, flat groups by integer ids
    model = torch.nn.Module()
    for name, shape in SHAPES.items():
        owner, attr = name.split(".")
        if not hasattr(model, owner):
            model.add_module(owner, torch.nn.Module())
        getattr(model, owner).register_parameter(attr, torch.nn.Parameter(torch.zeros(shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    unickpt.load({"model": model, "optim": opt}, str(tmp_path))
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.9, 0.95)  # the saved group's
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), full[name])
        assert torch.equal(opt.state[p]["exp_avg"], full[name] * 2) and opt.state[p]["step"].item() == 7.0
