"""Single-process behaviour (no process group): round trips, errors users act on, safety."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import unickpt
from unickpt.format.manifest import seal


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)},
        "big": torch.randn(300_000, generator=g),  # > one 1 MiB checksum block below
        "step": 7,
        "extra": {"name": "run-1", "ratio": 0.1, "inf": math.inf, "t": (1, [2, 3]), "ids": {3: "x"}, "raw": b"\x00\x01"},
    }


def _zeros_like(sd):
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "big": torch.zeros_like(sd["big"]),
        "step": 0,
        "extra": {},
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ck"
    sd = _state()
    unickpt.save(sd, str(path), block_bytes=1 << 20)
    return path, sd


def test_round_trip_without_process_group(ckpt):
    path, sd = ckpt
    out = unickpt.load(_zeros_like(sd), str(path))
    for k in sd["model"]:
        assert torch.equal(out["model"][k], sd["model"][k]) and out["model"][k].dtype == sd["model"][k].dtype
    assert torch.equal(out["big"], sd["big"])
    assert out["step"] == 7
    assert out["extra"]["name"] == "run-1" and out["extra"]["t"] == (1, [2, 3]) and out["extra"]["inf"] == math.inf
    assert out["extra"]["raw"] == b"\x00\x01"


def test_non_tensor_dict_with_int_keys_round_trips(tmp_path):
    sd = {"x": torch.ones(2), "ids": {3: "x", (1, 2): None}}
    unickpt.save(sd, str(tmp_path / "c"))
    out = unickpt.load({"x": torch.zeros(2), "ids": None}, str(tmp_path / "c"))
    assert out["ids"] == {"3": "x", "(1, 2)": None} or out["ids"] == {3: "x", (1, 2): None}


def _flip_byte(path, name, sd_name, byte_in_tensor=1000):
    m = unickpt.read_manifest(str(path))
    frag = m.tensors[sd_name].fragments[0]
    f = path / frag.file
    data = bytearray(f.read_bytes())
    data[frag.offset + byte_in_tensor] ^= 0x40
    f.write_bytes(bytes(data))
    return frag.file


def test_corruption_is_detected_and_named(ckpt):
    path, sd = ckpt
    fname = _flip_byte(path, "big", "big", 900_000)
    with pytest.raises(unickpt.CorruptionError) as e:
        unickpt.load(_zeros_like(sd), str(path))
    assert fname in str(e.value) and "'big'" in str(e.value) and "checksum" in str(e.value)
    # the other tensors are still readable on their own, because blocks are verified separately
    out = unickpt.load({"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}, str(path), strict=False)
    assert torch.equal(out["model"]["w"], sd["model"]["w"])


def test_corruption_passes_silently_only_when_verify_is_off(ckpt):
    path, sd = ckpt
    _flip_byte(path, "big", "big", 10)
    out = unickpt.load(_zeros_like(sd), str(path), verify=False)
    assert not torch.equal(out["big"], sd["big"])


def test_truncated_file_is_detected(ckpt):
    path, sd = ckpt
    f = path / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(unickpt.CorruptionError, match="truncated"):
        unickpt.load(_zeros_like(sd), str(path))


def test_missing_data_file_is_detected(ckpt):
    path, sd = ckpt
    os.remove(path / "rank_00000.safetensors")
    with pytest.raises(unickpt.CorruptionError, match="missing"):
        unickpt.load(_zeros_like(sd), str(path))


def test_uncommitted_checkpoint_is_refused(ckpt):
    path, sd = ckpt
    os.remove(path / "manifest.json")  # what a crash before the commit leaves behind
    with pytest.raises(unickpt.NotACheckpointError, match="not a committed checkpoint"):
        unickpt.load(_zeros_like(sd), str(path))
    with pytest.raises(unickpt.NotACheckpointError):
        unickpt.load({}, str(path / "does-not-exist"))


def _edit_manifest(path, fn):
    """Edit the manifest and seal it with a fresh digest, as a (buggy or hostile) writer would."""
    doc = json.loads((path / "manifest.json").read_text())
    del doc["digest"]
    fn(doc)
    (path / "manifest.json").write_text(seal(json.dumps(doc)))


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ""])
def test_paths_cannot_escape_the_checkpoint(ckpt, bad):
    path, sd = ckpt

    def escape(doc):
        doc["files"][bad] = doc["files"].pop("rank_00000.safetensors")
        for t in doc["tensors"].values():
            for f in t["fragments"]:
                f["file"] = bad

    _edit_manifest(path, escape)
    with pytest.raises(unickpt.ManifestError, match="unsafe file name"):
        unickpt.load(_zeros_like(sd), str(path))


def test_newer_major_version_is_refused_newer_minor_is_read(ckpt):
    path, sd = ckpt
    _edit_manifest(path, lambda d: d.update(version="1.7"))
    unickpt.load(_zeros_like(sd), str(path))
    _edit_manifest(path, lambda d: d.update(version="3.0"))
    with pytest.raises(unickpt.FormatVersionError, match="newer"):
        unickpt.load(_zeros_like(sd), str(path))


def test_shape_mismatch_names_tensor_and_both_shapes(ckpt):
    path, sd = ckpt
    target = _zeros_like(sd)
    target["model"]["w"] = torch.zeros(64, 32)
    with pytest.raises(unickpt.MismatchError) as e:
        unickpt.load(target, str(path))
    assert "'model.w'" in str(e.value) and "[64, 33]" in str(e.value) and "[64, 32]" in str(e.value)


def test_dtype_mismatch_is_an_error_unless_an_exact_widening(ckpt):
    path, sd = ckpt
    target = _zeros_like(sd)
    target["model"]["b"] = torch.zeros(33, dtype=torch.float16)  # bf16 -> fp16 can lose values: refused
    with pytest.raises(unickpt.MismatchError, match="'model.b': saved dtype torch.bfloat16, target dtype torch.float16"):
        unickpt.load(target, str(path))
    target["model"]["b"] = torch.zeros(33)  # bf16 -> fp32 keeps every value: loaded (tests/test_casts.py)
    unickpt.load(target, str(path))
    assert torch.equal(target["model"]["b"], sd["model"]["b"].float())


def test_missing_key_strict_and_relaxed(ckpt):
    path, sd = ckpt
    target = _zeros_like(sd)
    target["model"]["new"] = torch.full((3,), 5.0)
    with pytest.raises(unickpt.MismatchError, match="'model.new' is not in the checkpoint"):
        unickpt.load(target, str(path))
    out = unickpt.load(target, str(path), strict=False)
    assert torch.equal(out["model"]["new"], torch.full((3,), 5.0))
    assert torch.equal(out["model"]["w"], sd["model"]["w"])


def test_existing_checkpoint_is_not_overwritten_by_default(ckpt):
    path, sd = ckpt
    with pytest.raises(unickpt.CheckpointExistsError, match="already holds") as e:  # a SaveError, by its type
        unickpt.save({"x": torch.ones(1)}, str(path))
    assert isinstance(e.value, unickpt.SaveError) and e.value.location == str(path)
    unickpt.save({"x": torch.ones(1)}, str(path), overwrite=True)
    assert list(unickpt.read_manifest(str(path)).tensors) == ["x"]


def test_unstorable_value_is_refused_with_its_key(tmp_path):
    with pytest.raises(unickpt.SaveError, match="'cfg.fn'"):
        unickpt.save({"cfg": {"fn": print}}, str(tmp_path / "c"))
    assert not (tmp_path / "c" / "manifest.json").exists()


class _App:
    """A Stateful object, as torchtitan wraps model and optimizer."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.loaded = None

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.loaded = sd
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])


def _trained(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_stateful_objects_model_and_optimizer(tmp_path):
    model, opt = _trained(0)
    unickpt.save({"app": _App(model, opt)}, str(tmp_path / "c"))
    model2, opt2 = _trained(1)  # different weights and optimizer moments, same structure
    app2 = _App(model2, opt2)
    unickpt.load({"app": app2}, str(tmp_path / "c"))
    assert app2.loaded is not None
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name])
    assert s1["param_groups"] == s2["param_groups"]


def test_per_rank_single_process(tmp_path):
    unickpt.save({"loader": unickpt.PerRank({"epoch": 2, "offset": 77})}, str(tmp_path / "c"))
    t = {"loader": unickpt.PerRank(None)}
    unickpt.load(t, str(tmp_path / "c"))
    assert t["loader"].value == {"epoch": 2, "offset": 77}
    assert unickpt.load_rank_values(str(tmp_path / "c"), "loader") == [{"epoch": 2, "offset": 77}]


def test_non_contiguous_and_zero_size_tensors(tmp_path):
    x = torch.arange(24.0).view(4, 6).t()  # non-contiguous
    sd = {"x": x, "z": torch.zeros(0, 5), "s": torch.tensor(True)}
    unickpt.save(sd, str(tmp_path / "c"))
    out = unickpt.load({"x": torch.zeros(6, 4), "z": torch.zeros(0, 5), "s": torch.tensor(False)}, str(tmp_path / "c"))
    assert torch.equal(out["x"], x) and out["z"].shape == (0, 5) and out["s"].item() is True


def test_load_tensor_reads_whole_tensor(ckpt):
    path, sd = ckpt
    assert torch.equal(unickpt.load_tensor(str(path), "big"), sd["big"])


def test_sharded_flat_partitions_round_trip(tmp_path):
    """A ZeRO-style flat buffer (two parameters, alignment padding) saved with explicit
    pieces, loaded into another flat partition of the same parameters."""
    from unickpt.plan.box import Box
    from unickpt.plan.piece import flat_pieces

    a, b = torch.randn(3, 5), torch.randn(4)
    flat = torch.cat([a.reshape(-1), b, torch.zeros(5)])  # 15 + 4 + 5 padding
    sd = {
        "a": unickpt.Sharded(flat, (3, 5), flat_pieces(Box.whole((3, 5)), 0, 15, 0)),
    }
    unickpt.save(sd, str(tmp_path / "c"))
    # target: elements 4..13 of a, stored from element 2 of a fresh buffer
    target = torch.full((12,), -1.0)
    out = {"a": unickpt.Sharded(target, (3, 5), flat_pieces(Box.whole((3, 5)), 4, 14, 2))}
    unickpt.load(out, str(tmp_path / "c"))
    assert torch.equal(target[2:12], a.reshape(-1)[4:14])
    assert torch.equal(target[:2], torch.full((2,), -1.0))  # not covered: untouched
    assert torch.equal(unickpt.load_tensor(str(tmp_path / "c"), "a"), a)


def test_load_tensor_mmap_maps_whole_tensors_and_still_verifies(ckpt):
    from unickpt.engine.tensor_reads import mapped_entry
    from unickpt.storage.local import LocalStorage

    path, sd = ckpt
    t = unickpt.load_tensor(str(path), "big", mmap=True)
    assert torch.equal(t, sd["big"]) and t.dtype == sd["big"].dtype
    m = unickpt.read_manifest(str(path))
    storage = LocalStorage(str(path))
    try:
        assert mapped_entry(storage, m.tensors["big"]) is not None  # the mapped path, not a read
    finally:
        storage.close()
    # private pages: writing to the tensor changes neither the file nor a later load
    t.mul_(0)
    assert torch.equal(unickpt.load_tensor(str(path), "big", mmap=True), sd["big"])
    assert torch.equal(unickpt.load_tensor(str(path), "model.b", mmap=True), sd["model"]["b"])
    fname = _flip_byte(path, "big", "big", 1_100_000)  # in the second checksum block
    with pytest.raises(unickpt.CorruptionError, match="checksum mismatch.*'big'") as e:
        unickpt.load_tensor(str(path), "big", mmap=True)
    assert fname in str(e.value)
    assert not torch.equal(unickpt.load_tensor(str(path), "big", mmap=True, verify=False), sd["big"])


def test_load_tensor_mmap_reads_a_tensor_stored_in_pieces(tmp_path):
    from unickpt.plan.piece import Piece
    from unickpt.plan.box import Box

    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    # one rank holding rows 0-3 and 4-7 as two pieces of one local tensor, stored swapped
    local = torch.cat([full[4:], full[:4]])
    pieces = [Piece(Box((4, 0), (4, 6)), (0, 0), (8, 6)), Piece(Box((0, 0), (4, 6)), (4, 0), (8, 6))]
    unickpt.save({"w": unickpt.Sharded(local, (8, 6), pieces)}, str(tmp_path / "ck"))
    assert torch.equal(unickpt.load_tensor(str(tmp_path / "ck"), "w", mmap=True), full)


def test_save_and_load_restore_the_garbage_collector(ckpt, tmp_path):
    import gc

    path, sd = ckpt
    assert gc.isenabled()
    unickpt.save(sd, str(tmp_path / "again"))
    unickpt.load(_zeros_like(sd), str(path))
    assert gc.isenabled()
    with pytest.raises(unickpt.MismatchError):
        unickpt.load({"nope": torch.zeros(1)}, str(path))
    assert gc.isenabled()  # restored on errors too
    gc.disable()
    try:
        unickpt.load(_zeros_like(sd), str(path))
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()
    assert unickpt.save.__doc__ and unickpt.load.__doc__.startswith("Fill")


def test_load_tensor_mmap_of_a_truncated_file_is_an_error(ckpt):
    path, sd = ckpt
    f = path / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(unickpt.CorruptionError, match="truncated"):
        unickpt.load_tensor(str(path), "big", mmap=True)
