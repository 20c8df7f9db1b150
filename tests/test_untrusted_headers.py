"""Untrusted safetensors headers and paths (fuzzing audit A, findings 2, 3, 4, 9, 10): a
damaged Hugging Face shard or unickpt data file, or a directory where a file belongs, is
a unickpt error naming the file (and the tensor), or a problem in verify's report; never
an exception from deep inside, never a tensor loaded from the wrong bytes.

Every case builds real files (``unickpt.save``, ``safetensors``) and damages them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import unickpt
from unickpt.adapters.hf import HfError
from unickpt.adapters.hf_export import export_hf
from unickpt.cli import app
from unickpt.errors import CorruptionError, NotACheckpointError

W1 = torch.arange(12, dtype=torch.float32).view(3, 4)
W2 = torch.arange(12, 24, dtype=torch.int32).view(3, 4)


def _edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the safetensors file ``path`` with ``edit`` applied to its parsed header
    (the data section unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _replace_in_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` in the JSON header of ``path`` (for numbers JSON allows
    but ``json.dumps`` would not write, like ``1e999``)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n]
    assert old in text, text
    text = text.replace(old, new)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w1": W1, "w2": W2}, str(folder / "model.safetensors"))
    return folder


def test_hf_tensors_with_overlapping_bytes_are_refused(tmp_path: Path) -> None:
    """w1's data_offsets moved onto w2's bytes: the safetensors library refuses the file;
    unickpt did load w2's bytes as w1 without a word."""
    folder = _hf_folder(tmp_path)
    shard = folder / "model.safetensors"
    _edit_header(shard, lambda h: h["w1"].update(data_offsets=list(h["w2"]["data_offsets"])))
    for read in (lambda: unickpt.read_manifest(str(folder)), lambda: unickpt.load_tensor(str(folder), "w1"),
                 lambda: unickpt.load({"w1": torch.zeros(3, 4), "w2": torch.zeros(3, 4, dtype=torch.int32)}, str(folder))):
        with pytest.raises(HfError, match=r"model\.safetensors: tensors 'w1' and 'w2' overlap") as e:
            read()
        assert str(shard) in str(e.value)


def test_files_unickpt_and_the_safetensors_library_write_pass_the_overlap_check(tmp_path: Path) -> None:
    """What unickpt writes (its data files, exported Hugging Face shards) and what the
    safetensors library writes (empty tensors among them) reads back unchanged."""
    folder = tmp_path / "hf"
    folder.mkdir()
    empty = torch.zeros(0, 4)
    save_file({"w1": W1, "e": empty, "w2": W2, "z": torch.zeros(0)}, str(folder / "model.safetensors"))
    assert torch.equal(unickpt.load_tensor(str(folder), "w2"), W2)
    assert unickpt.load_tensor(str(folder), "e").shape == (0, 4)
    unickpt.save({"w1": W1, "e": empty, "w2": W2}, str(tmp_path / "ck"))
    assert unickpt.verify(str(tmp_path / "ck")).ok
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_size="50B", prefix="")
    for key, want in (("w1", W1), ("e", empty), ("w2", W2)):
        assert torch.equal(unickpt.load_tensor(str(tmp_path / "out"), key), want)


@pytest.mark.parametrize("old, new", [
    (b'"shape": [3, 4]', b'"shape": [1e999]'),
    (b'"data_offsets": [0, 48]', b'"data_offsets": [0, 1e999]'),
    (b'"shape": [3, 4]', b'"shape": [-3, -4]'),  # 12 elements, as many bytes as the range
    (b'"shape": [3, 4]', b'"shape": [true, 12]'),  # int(true) == 1: 12 elements
    (b'"shape": [3, 4]', b'"shape": [3.5, 4]'),  # int(3.5) == 3
    (b'"shape": [3, 4]', b'"shape": [' + b"1, " * 64 + b"12]"),  # 65 dimensions
    (b'"data_offsets": [0, 48]', b'"data_offsets": [-48, 0]'),
], ids=["shape-1e999", "offsets-1e999", "negative-shape", "bool", "float", "65-dims", "negative-offset"])
def test_hf_header_numbers_must_be_json_integers_in_bounds(tmp_path: Path, old: bytes, new: bytes) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    shard = folder / "model.safetensors"
    save_file({"w1": W1}, str(shard))
    _edit_header(shard, lambda h: None)  # json.dumps spacing, which `old` is written in
    _replace_in_header(shard, old, new)
    with pytest.raises(HfError, match=r"malformed safetensors entry for 'w1'") as e:
        unickpt.read_manifest(str(folder))
    assert str(shard) in str(e.value)


@pytest.mark.parametrize("field,old,new", [("shape", b'"shape":[6,8]', b'"shape":[1e999]'),
                                            ("data_offsets", b'"data_offsets":[0,384]', b'"data_offsets":[0,1e999]')])
def test_verify_reports_a_non_integer_in_a_data_file_header(tmp_path: Path, field: str, old: bytes, new: bytes) -> None:
    """A shape or byte offset of 1e999 in a unickpt data file's header (JSON allows it, Python
    reads it as inf) is a header problem of verify's report, and the CLI's exit 1, not a
    crash (of the header's check, or of the ledger's map of the file's bytes)."""
    ck = tmp_path / "ck"
    unickpt.save({"b": torch.arange(48, dtype=torch.int64).view(6, 8)}, str(ck))
    data = ck / "rank_00000.safetensors"
    _replace_in_header(data, old, new)
    report = unickpt.verify(str(ck))
    headers = [p for p in report.problems if p.kind == "header"]
    assert [(p.file, p.tensor) for p in headers] == [(data.name, "b")], report
    assert f"safetensors header entry is malformed: {field} " in headers[0].message, headers[0].message
    r = CliRunner().invoke(app, ["verify", str(ck)], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 1 and "safetensors header entry is malformed" in r.stdout, r.output


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def test_a_directory_where_a_file_belongs(tmp_path: Path) -> None:
    """manifest.json, a data file, an HF config.json or shard that is a directory: a unickpt
    error naming it (it was a bare IsADirectoryError); verify reports the data file."""
    state = {"b": torch.arange(4)}
    a, b = tmp_path / "a", tmp_path / "b"
    unickpt.save(state, str(a))
    unickpt.save(state, str(b))
    _replace_with_directory(a / "manifest.json")
    with pytest.raises(NotACheckpointError, match="manifest.json is a directory") as e:
        unickpt.read_manifest(str(a))
    assert str(a) in str(e.value)
    _replace_with_directory(b / "rank_00000.safetensors")
    with pytest.raises(CorruptionError, match=f"data file rank_00000.safetensors of {b} is a directory"):
        unickpt.load_tensor(str(b), "b")
    with pytest.raises(CorruptionError, match="is a directory"):
        unickpt.load({"b": torch.zeros(4, dtype=torch.int64)}, str(b))
    report = unickpt.verify(str(b))
    assert not report.ok and all(p.file == "rank_00000.safetensors" for p in report.problems), report
    assert any("is a directory" in p.message for p in report.problems), report

    folder = _hf_folder(tmp_path)
    (folder / "config.json").mkdir()
    with pytest.raises(HfError, match="config.json cannot be read: not a regular file"):
        unickpt.read_manifest(str(folder))
    (folder / "config.json").rmdir()
    _replace_with_directory(folder / "model.safetensors")
    with pytest.raises(CorruptionError, match=f"data file model.safetensors of {folder} is a directory"):
        unickpt.read_manifest(str(folder))


@pytest.mark.timeout(60)
def test_a_pipe_where_a_data_file_belongs_is_refused_without_waiting(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: it is refused before that."""
    ck = tmp_path / "ck"
    unickpt.save({"b": torch.arange(4)}, str(ck))
    (ck / "rank_00000.safetensors").unlink()
    os.mkfifo(ck / "rank_00000.safetensors")
    with pytest.raises(CorruptionError, match="is a pipe, socket or device, not a regular file"):
        unickpt.load_tensor(str(ck), "b")


@pytest.mark.parametrize("damage, error, what", [
    (lambda b: b[:8] + b"\xff" + b[9:], CorruptionError, "safetensors header is not JSON"),
    (lambda b: b"abcd", CorruptionError, "file too short to be safetensors"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], CorruptionError, "safetensors header of 1099511627776 bytes is implausible"),
    (lambda b: b.replace(b'"F32"', b'"X32"'), HfError, "malformed safetensors entry for 'w': unknown dtype 'X32'"),
], ids=["not-json", "too-short", "implausible", "unknown-dtype"])
def test_hf_shard_errors_name_the_shard(tmp_path: Path, damage: Callable[[bytes], bytes], error: type, what: str) -> None:
    """With several shards, the error says which one is damaged."""
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors"))
    shard = folder / "model-00002-of-00002.safetensors"
    save_file({"w": torch.ones(2)}, str(shard))
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(error) as e:
        unickpt.read_manifest(str(folder))
    assert str(e.value).startswith(f"{shard}: {what}"), e.value
