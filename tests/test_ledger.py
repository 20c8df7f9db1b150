"""The ledger (issue 13): every tensor and byte of a checkpoint's source is read, or
reported as skipped with a reason; ``inspect``, ``verify``, ``convert`` and ``export`` print
it, and no command prints OK while data is dropped (``--allow-skip`` accepts it).

Sources are written by the real tools: ``torch.distributed.checkpoint.save`` (a value its
reader refuses), ``transformers``' ``save_pretrained`` (an export that must keep
``lm_head.weight``, compared with transformers' own load), and a safetensors shard written
by the ``safetensors`` library with bytes no tensor owns.
"""

from __future__ import annotations

import datetime
import json
import os
import struct
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import unickpt  # noqa: E402
from unickpt.format.manifest import Fragment, Manifest, TensorEntry  # noqa: E402
from unickpt.plan.piece import whole_piece  # noqa: E402

from test_cli import invoke  # noqa: E402

WHEN = datetime.date(2024, 5, 1)  # a value DCP pickles and unickpt's allow-listing unpickler refuses


def test_ledger_accounts_bytes_by_owner() -> None:
    """Pure: fragments cover bytes, structure is known, an item's other bytes are accounted
    for when the item is read or reported, everything else is unaccounted."""
    from unickpt.format.ledger import Region, build_ledger

    m = Manifest(files={"f": 100})
    m.tensors["a"] = TensorEntry("a", (4,), "F32", [Fragment("f", 10, (4,), [whole_piece((4,))], [])])
    m.values["v"] = 1
    m.provenance["skipped"] = {"s": "refused"}
    declared = [Region("f", 0, 10), Region("f", 8, 30, "a"), Region("f", 30, 50, "v.0.lr"),
                Region("f", 50, 60, "s"), Region("f", 60, 70, "ghost")]
    led = build_ledger(m, {"f": declared})
    assert led.tensors == 1 and led.bytes_read == 16 and led.skipped == {"s": "refused"}
    assert led.unaccounted == [Region("f", 60, 70, "ghost"), Region("f", 70, 100)]
    assert not led.accounted and not led.complete and led.unaccounted_bytes == 40
    assert "ghost" in led.line() and "1 skipped: s because refused" in led.line()
    assert build_ledger(m, {"f": declared + [Region("f", 70, 100)]}).unaccounted == [Region("f", 60, 70, "ghost")]
    # a file without declared regions is checked by tensor only
    assert build_ledger(m).files_unchecked == ["f"] and build_ledger(m).accounted


@pytest.fixture
def dcp_skip(tmp_path: Path) -> Path:
    """A DCP checkpoint (dcp.save) holding a value unickpt's reader refuses."""
    state = {"model": {"w": torch.randn(6, 5), "b": torch.arange(7, dtype=torch.bfloat16)}, "step": 12, "when": WHEN}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    return tmp_path / "dcp"


def test_dcp_item_skipped_is_reported_and_refused_without_allow_skip(dcp_skip: Path, tmp_path: Path) -> None:
    r = invoke("inspect", str(dcp_skip))
    assert r.exit_code == 0, r.output  # inspect reports; the item is accounted for (named, with its reason)
    line = next(x for x in r.stdout.splitlines() if x.startswith("source: "))
    assert line.startswith("source: 2 tensors, 134 B read; 1 skipped: when because refused by the allow-listing unpickler"), line
    assert "datetime" in line and "  skipped when: refused" in r.stdout
    # a data file no item of .metadata points into (left by an earlier save on more ranks) is not the checkpoint's
    (dcp_skip / "__1_0.distcp").write_bytes((dcp_skip / "__0_0.distcp").read_bytes())
    r = invoke("inspect", str(dcp_skip))
    assert r.exit_code == 0 and "1 file ignored: __1_0.distcp because no item of the DCP metadata" in r.stdout, r.output
    js = json.loads(invoke("inspect", str(dcp_skip), "--json").stdout)
    assert list(js["ledger"]["skipped"]) == ["when"] and js["ledger"]["unaccounted"] == [] and js["ledger"]["bytes_checked"] > 0

    r = invoke("verify", str(dcp_skip))
    assert r.exit_code == 1 and "INCOMPLETE: 1 item" in r.stdout and "skipped when:" in r.stdout, r.output
    assert "OK" not in r.stdout
    r = invoke("verify", str(dcp_skip), "--allow-skip")
    assert r.exit_code == 0 and "OK (dcp)" in r.stdout and "1 skipped: when" in r.stdout, r.output
    report = unickpt.verify(str(dcp_skip))
    assert report.ok and not report.complete and report.ledger.skipped.keys() == {"when"}

    out = tmp_path / "u"
    for args in ([], ["--to", "dcp"], ["--to", "deepspeed"]):
        r = invoke("convert", str(dcp_skip), str(out), *args)
        assert r.exit_code == 1 and "nothing written" in r.output and "skipped when:" in r.stdout, (args, r.output)
        assert not out.exists()
    r = invoke("convert", str(dcp_skip), str(out), "--allow-skip")
    assert r.exit_code == 0 and "1 skipped: when" in r.stdout, r.output
    m = unickpt.read_manifest(str(out))
    assert list(m.provenance["consolidated_from"]["skipped"]) == ["when"]
    assert torch.equal(unickpt.load_tensor(str(out), "model.w"), unickpt.load_tensor(str(dcp_skip), "model.w"))
    report = unickpt.convert(str(dcp_skip), str(tmp_path / "u2"))
    assert report.ledger is not None and report.ledger.skipped.keys() == {"when"} and report.ledger.tensors == 2


def _shard_with_hole(path: Path, tensors: dict[str, torch.Tensor], hole: int) -> tuple[int, int]:
    """Rewrite the safetensors file ``path`` (written by the safetensors library) with
    ``hole`` bytes between its first and second tensor that no header entry owns; returns
    the hole's absolute byte range."""
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    cut = header[keys[0]]["data_offsets"][1]
    for k in keys[1:]:
        header[k]["data_offsets"] = [x + hole for x in header[k]["data_offsets"]]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[:cut] + b"\x7f" * hole + data[cut:])
    start = 8 + len(text) + cut
    return start, start + hole


def test_hf_bytes_no_tensor_owns_and_unindexed_tensors(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    a = {"model.embed.weight": torch.randn(4, 3), "model.norm.weight": torch.randn(3)}
    start, stop = _shard_with_hole(hf / "model-00001-of-00002.safetensors", a, 24)
    save_file({"lm_head.weight": torch.randn(4, 3), "extra.bias": torch.randn(2)}, str(hf / "model-00002-of-00002.safetensors"))
    weight_map = {"model.embed.weight": "model-00001-of-00002.safetensors", "model.norm.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(Exception, match="invalid offset"):  # the safetensors library refuses the hole too
        load_file(str(hf / "model-00001-of-00002.safetensors"))

    r = invoke("inspect", str(hf))
    assert r.exit_code == 1, r.output
    hole = f"model-00001-of-00002.safetensors bytes {start}-{stop}"
    assert f"  neither read nor reported: {hole}" in r.stdout and "24 B neither read nor reported" in r.stdout
    assert "1 skipped: extra.bias because model.safetensors.index.json does not map it" in r.stdout, r.stdout
    r = invoke("verify", str(hf))
    assert r.exit_code == 1 and "CORRUPT: 1 problem" in r.stdout and f"bytes {start}-{stop}" in r.stdout, r.output
    r = invoke("convert", str(hf), str(tmp_path / "u"))
    assert r.exit_code == 1 and not (tmp_path / "u").exists(), r.output
    r = invoke("export", str(hf), str(tmp_path / "x"))
    assert r.exit_code == 1 and not (tmp_path / "x").exists(), r.output
    # once the index maps extra.bias and the hole is gone, every byte is accounted for
    save_file(a, str(hf / "model-00001-of-00002.safetensors"))
    weight_map["extra.bias"] = "model-00002-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    r = invoke("inspect", str(hf))
    assert r.exit_code == 0 and "source: 4 tensors, 116 B read\n" in r.stdout, r.output


def test_export_of_converted_hf_model_keeps_lm_head(tmp_path: Path) -> None:
    """A real transformers model -> unickpt convert -> unickpt export (default options):
    transformers loads the export with every tensor bitwise equal to the original."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(tmp_path / "hf"))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in original and not torch.equal(original["lm_head.weight"], original["model.embed_tokens.weight"])

    assert invoke("convert", str(tmp_path / "hf"), str(tmp_path / "ck")).exit_code == 0
    r = invoke("export", str(tmp_path / "ck"), str(tmp_path / "out"))
    assert r.exit_code == 0 and f"{len(original)} tensors exported" in r.stdout, r.output
    assert f"source: {len(original)} tensors" in r.stdout and "skipped" not in r.stdout
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert back.keys() == original.keys()
    for k, v in original.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_file(str(tmp_path / "hf" / "model.safetensors")))

    # an explicit --prefix that leaves lm_head out is refused (named), or accepted with --allow-skip
    r = invoke("export", str(tmp_path / "ck"), str(tmp_path / "part"), "--prefix", "model.")
    assert r.exit_code == 1 and "skipped lm_head.weight:" in r.stdout and not (tmp_path / "part").exists(), r.output
    r = invoke("export", str(tmp_path / "ck"), str(tmp_path / "part"), "--prefix", "model.", "--allow-skip")
    assert r.exit_code == 0 and "1 skipped: lm_head.weight" in r.stdout, r.output
