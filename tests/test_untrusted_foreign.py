"""Untrusted bytes read back from a foreign checkpoint or from an incremental save's base:
a clear unickpt error naming the file and what is wrong, never a traceback from inside,
unbounded memory, silently renamed tensors or a committed checkpoint that cannot load.

The legacy Megatron-LM cases rewrite one rank file of the TP 2 x PP 2 fixture
(``tests/data/megatron_legacy_tp2_pp2``, built by ``megatron_legacy_cases.write``); the
incremental cases damage the base of a save on one process, and on one rank of two.
"""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.adapters.detect import open_manifest
from unickpt.errors import CorruptionError, SaveError
from unickpt.testing import run_ranks

FIXTURE = Path(__file__).parent / "data" / "megatron_legacy_tp2_pp2" / "ckpt"
R00 = "iter_0000007/mp_rank_00_000/model_optim_rng.pt"
R01 = "iter_0000007/mp_rank_00_001/model_optim_rng.pt"  # tp rank 0, pipeline stage 1


def _legacy(tmp_path: Path, change, rel: str = R00) -> Path:
    """A copy of the legacy Megatron fixture with ``change(state dict)`` applied to ``rel``
    (our own fixture, so torch.load may unpickle it)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    sd = torch.load(ckpt / rel, weights_only=False)
    change(sd)
    torch.save(sd, ckpt / rel)
    return ckpt


def _arg(name: str, value):
    return lambda sd: setattr(sd["args"], name, value)


def _opt(sd: dict) -> dict:
    """The inner torch optimizer's state dict of Float16OptimizerWithFloat16Params."""
    return sd["optimizer"]["optimizer"]


# ----------------------------------------------------------------------------- legacy Megatron-LM


def test_huge_parallel_sizes_are_refused_before_any_allocation(tmp_path: Path) -> None:
    """Parallel sizes far beyond the rank directories present are compared with their count
    first: nothing of size tp * pp is built (2**40 would take terabytes)."""
    ckpt = _legacy(tmp_path, _arg("pipeline_model_parallel_size", 1 << 21))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptionError, match=r"pipeline size 2097152 \(from iter_0000007/mp_rank_00_000/"
                                                  r"model_optim_rng\.pt; missing: \[\(0, 2\), \(0, 3\)"):
            open_manifest(str(ckpt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes traced: a set of every rank coordinate was built"
    for name, size in (("tensor_model_parallel_size", 1 << 40), ("pipeline_model_parallel_size", 10**9)):
        ckpt = _legacy(tmp_path / name, _arg(name, size))
        with pytest.raises(CorruptionError, match=f"size {size} .*missing"):
            open_manifest(str(ckpt))


BAD_FIELDS = [
    ("tp 'x'", _arg("tensor_model_parallel_size", "x"), "args.tensor_model_parallel_size is 'x', not a positive integer"),
    ("pp None", _arg("pipeline_model_parallel_size", None), "args.pipeline_model_parallel_size is None"),
    ("tp True", _arg("tensor_model_parallel_size", True), "args.tensor_model_parallel_size is True"),
    ("pp 0", _arg("pipeline_model_parallel_size", 0), "args.pipeline_model_parallel_size is 0"),
    ("group an int", lambda sd: _opt(sd)["param_groups"].insert(0, 5),
     "optimizer.optimizer.param_groups[0] is of type int, not a dict"),
    ("groups a dict", lambda sd: _opt(sd).update(param_groups={}), "optimizer.optimizer.param_groups is of type dict"),
    ("unhashable index", lambda sd: _opt(sd)["param_groups"][0]["params"].__setitem__(0, [0]),
     r"optimizer.optimizer.param_groups[0].params is not a list of integer parameter indices"),
    ("weight decay text", lambda sd: _opt(sd)["param_groups"][1].update(weight_decay="x"),
     "optimizer.optimizer.param_groups[1].weight_decay is 'x', not a number"),
    ("state a list", lambda sd: _opt(sd).update(state=[1]), "optimizer.optimizer.state is of type list"),
    ("state[0] a list", lambda sd: _opt(sd)["state"].__setitem__(0, [1, 2]), "optimizer.optimizer.state[0] is of type list"),
    ("state[0] an int", lambda sd: _opt(sd)["state"].__setitem__(0, 7), "optimizer.optimizer.state[0] is of type int"),
]


@pytest.mark.parametrize("change,message", [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_a_field_of_the_wrong_type_is_named_with_its_file(tmp_path: Path, change, message: str) -> None:
    ckpt = _legacy(tmp_path, change)
    with pytest.raises(CorruptionError) as e:
        open_manifest(str(ckpt))
    assert str(e.value).startswith(f"{R00}: ") and message in str(e.value), str(e.value)


@pytest.mark.parametrize("num_layers,rel,held,wanted", [
    (8, R00, 2, "gives it 4 (global layers 0 to 3)"),  # stage 1's layers would be read as layers 4 and 5
    (3, R01, 2, "gives it 1 (global layers 2 to 2)"),  # balanced split: 2 + 1
    (0, R00, 2, "gives it 0:"),
])
def test_args_num_layers_must_match_each_stages_layers(tmp_path: Path, num_layers: int, rel: str, held: int,
                                                       wanted: str) -> None:
    """Layer numbers are made global from ``num_layers`` split over the stages: args that do
    not describe the stages' layers are refused, naming the stage's file, instead of
    renumbering layers wrongly and losing the others."""
    ckpt = _legacy(tmp_path, _arg("num_layers", num_layers))
    with pytest.raises(CorruptionError) as e:
        open_manifest(str(ckpt))
    msg = str(e.value)
    assert msg.startswith(f"{rel}: pipeline stage") and f"holds {held} layers" in msg and wanted in msg, msg


@pytest.mark.parametrize("padded", [31, 16, 64])
def test_args_padded_vocab_size_must_match_the_embeddings_rows(tmp_path: Path, padded: int) -> None:
    """The vocabulary-parallel embedding holds padded_vocab_size / tp rows on each rank: args
    that give fewer rows would have the rest taken for padding and dropped (31 and 16 were
    read so), more would leave them unfilled."""
    ckpt = _legacy(tmp_path, _arg("padded_vocab_size", padded))
    with pytest.raises(CorruptionError, match=rf"^{R00}: .*word_embeddings.weight holds 16 rows on each of 2 "
                                              rf"tensor-parallel rank\(s\), 32 in all, but args.padded_vocab_size = {padded}"):
        open_manifest(str(ckpt))


def test_a_stage_with_an_extra_layer_is_refused(tmp_path: Path) -> None:
    """A stage holding a layer past its share (``layers.5`` on stage 1 of a 4-layer model)."""
    qkv = "self_attention.query_key_value.weight"

    def extra(sd: dict) -> None:
        enc = sd["model"]["language_model"]["encoder"]
        enc[f"layers.5.{qkv}"] = enc[f"layers.0.{qkv}"].clone()

    ckpt = _legacy(tmp_path, extra, R01)
    with pytest.raises(CorruptionError, match=r"mp_rank_00_001/model_optim_rng\.pt: pipeline stage 1 of 2 holds 3 "
                                              r"layers \(stage-local \[0, 1, 5\]\), but args\.num_layers = 4 gives it 2"):
        open_manifest(str(ckpt))


@pytest.mark.parametrize("naming", ["mcore", "legacy"])
def test_a_tied_copy_that_is_not_the_embedding_is_refused(tmp_path: Path, naming: str) -> None:
    """Args that say the output layer is tied make the last stage's ``output_layer.weight``
    (Megatron-Core's names) or ``word_embeddings_for_head.weight`` a replica of the first
    stage's embedding: an untied output layer read under a flipped
    ``untie_embeddings_and_output_weights`` was listed as a replica and dropped; now the
    copy is compared with the embedding (sampled rows) and refused, naming the file."""
    import megatron_legacy_cases as cases

    tied = str(cases.write(cases.Cfg(tied=True, naming=naming), str(tmp_path / "tied")))
    m = open_manifest(tied)  # the genuine copy reads, as a replica
    assert not any("output_layer" in n for n in m.tensors) and any(r.endswith("r_head.weight") or "output_layer" in r
                                                                   for r in m.provenance["replicas"])
    last = "iter_0000007/mp_rank_01_001/model_optim_rng.pt"
    if naming == "mcore":  # an untied model: its output layer is no copy of the embedding
        ckpt = str(cases.write(cases.Cfg(tied=False, naming=naming), str(tmp_path / "untied")))
        for rel in (R00, R01, "iter_0000007/mp_rank_01_000/model_optim_rng.pt", last):
            sd = torch.load(os.path.join(ckpt, rel), weights_only=False)
            sd["args"].untie_embeddings_and_output_weights = False
            torch.save(sd, os.path.join(ckpt, rel))
        local, rel = "output_layer.weight", R01
    else:  # one element of tp rank 1's copy changed
        ckpt, local, rel = tied, "word_embeddings_for_head.weight", last
        sd = torch.load(os.path.join(ckpt, rel), weights_only=False)
        sd["model"]["word_embeddings_for_head"]["weight"][15, 7] += 1
        torch.save(sd, os.path.join(ckpt, rel))
    with pytest.raises(CorruptionError, match=rf"^{rel}: {local} differs from the first stage's word embeddings "
                                              r"\(row \d+ of tensor-parallel rank \d\), but args\.untie_embeddings"):
        open_manifest(ckpt)


def test_the_pristine_fixture_still_reads(tmp_path: Path) -> None:
    m = open_manifest(str(FIXTURE))
    assert m.provenance["tensor_parallel"] == 2 and m.provenance["pipeline_parallel"] == 2
    assert {n for n in m.tensors if ".layers." in n and n.startswith("model.")} == {
        f"model.language_model.encoder.layers.{i}.{k}" for i in range(4)
        for k in ("input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.dense.weight",
                  "post_attention_layernorm.weight", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")}


# ----------------------------------------------------------------------------- incremental saves


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"a": torch.randn(64, 32, generator=g), "b": torch.randn(16, generator=g)}, "step": step}


def _zeros(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": -1}


def _damage(path: str, how: str) -> None:
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    else:  # "grow": bytes appended
        with open(path, "ab") as f:
            f.write(b"\0" * 8)


@pytest.mark.parametrize("saver", ["save", "async_save"])
@pytest.mark.parametrize("how", ["delete", "truncate", "grow"])
def test_a_base_missing_bytes_fails_the_save(tmp_path: Path, how: str, saver: str) -> None:
    """Every fragment is unchanged since the base, so the save would write no data at all
    and reference the base's file: a file missing or not its recorded size fails the save
    (SaveError naming it), nothing is committed, and the state can still be saved in full."""
    base, new = str(tmp_path / "s1"), str(tmp_path / "s2")
    unickpt.save(_state(1), base)
    data = os.path.join(base, "rank_00000.safetensors")
    _damage(data, how)
    with pytest.raises(SaveError) as e:
        if saver == "save":
            unickpt.save(_state(2), new, base=base)
        else:
            unickpt.async_save(_state(2), new, base=base).result()
    msg = str(e.value)
    assert f"base {base} cannot serve for an incremental save: data file {data}" in msg, msg
    assert {"delete": "is missing", "truncate": "(truncated)", "grow": "bytes, its manifest records"}[how] in msg, msg
    assert e.value.ranks == [0] and not os.path.exists(os.path.join(new, "manifest.json"))
    unickpt.save(_state(2), new)
    out = _zeros(_state(2))
    unickpt.load(out, new)
    assert out["step"] == 2 and torch.equal(out["model"]["a"], _state(2)["model"]["a"])


def test_a_missing_file_of_the_bases_own_base_fails_the_save(tmp_path: Path) -> None:
    """The files the base references in turn (flattened references) are checked too."""
    s1, s2, s3 = (str(tmp_path / f"s{k}") for k in (1, 2, 3))
    unickpt.save(_state(1), s1)
    unickpt.save(_state(2), s2, base=s1)  # references s1's file
    os.truncate(os.path.join(s1, "rank_00000.safetensors"), 10)
    with pytest.raises(SaveError, match=f"base {s2} cannot serve .*: data file .*s1/rank_00000.safetensors has 10 bytes"):
        unickpt.save(_state(3), s3, base=s2)


def test_a_byte_flipped_in_the_base_is_caught_when_the_new_checkpoint_loads(tmp_path: Path) -> None:
    """A same-size change is not looked for at save time (that would read the base's bytes
    back); the CRC-32C blocks the new manifest copies from the base's catch it on load."""
    base, new = str(tmp_path / "s1"), str(tmp_path / "s2")
    unickpt.save(_state(1), base)
    data = os.path.join(base, "rank_00000.safetensors")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 20)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    unickpt.save(_state(2), new, base=base)
    with pytest.raises(CorruptionError, match="rank_00000.safetensors"):
        unickpt.load(_zeros(_state(2)), new)


def one_rank_sees_a_damaged_base(rank: int, world: int, root: str) -> None:
    """Rank function: rank 0 saves against an intact base, rank 1 against a copy of it
    whose data file is truncated (as if its view of the base's storage were stale): both
    must fail the save with the same SaveError, naming rank 1, and nothing commits."""
    sd = {"w": unickpt.PerRank(torch.arange(8.0) + rank), "step": 2}
    base = f"{root}/s1" if rank == 0 else f"{root}/s1_copy"
    try:
        unickpt.save(sd, f"{root}/s2", base=base)
    except SaveError as e:
        assert e.ranks == [1] and "s1_copy/rank_00001.safetensors" in str(e) and "(truncated)" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: the save against a damaged base succeeded")
    assert not os.path.exists(f"{root}/s2/manifest.json")


def _save_base(rank: int, world: int, root: str) -> None:
    unickpt.save({"w": unickpt.PerRank(torch.arange(8.0) + rank), "step": 1}, f"{root}/s1")


def test_only_one_rank_sees_the_damaged_base_and_every_rank_fails(tmp_path: Path) -> None:
    preload = ["torch", "torch.distributed", "unickpt"]
    run_ranks(_save_base, 2, str(tmp_path), preload=preload, timeout=120)
    shutil.copytree(tmp_path / "s1", tmp_path / "s1_copy")
    os.truncate(tmp_path / "s1_copy" / "rank_00001.safetensors", 50)
    run_ranks(one_rank_sees_a_damaged_base, 2, str(tmp_path), preload=preload, timeout=120)
