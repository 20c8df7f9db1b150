"""Indexed manifests (format 2.0): root manifest.json + fragments.jsonl, read tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch

import unickpt
from unickpt.engine import assemble as assemble_api

from unickpt.format.index import INDEX_NAME
from unickpt.format.manifest import FORMAT_VERSION, Manifest, seal


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {f"l{i}.w": torch.randn(8, 4, generator=g) for i in range(5)}, "step": 7,
            "bf": torch.randn(3, 5, generator=g).to(torch.bfloat16)}


def _zeros(sd):
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0, "bf": torch.zeros_like(sd["bf"])}


@pytest.fixture
def indexed(tmp_path, monkeypatch):
    monkeypatch.setattr(assemble_api, "INDEX_FRAGMENTS", 0)  # index every save
    sd = _state()
    unickpt.save(sd, str(tmp_path / "ck"))
    return tmp_path / "ck", sd


def test_indexed_checkpoint_loads_verifies_and_converts(indexed, tmp_path):
    path, sd = indexed
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["version"] == "2.0" and doc["index"]["file"] == INDEX_NAME
    assert all("fragments" not in t and [len(c) for c in t["fragments_at"]] == [5] for t in doc["tensors"].values())
    lines = (path / INDEX_NAME).read_bytes().splitlines()
    assert len(lines) == len(doc["tensors"]) and all(isinstance(json.loads(x), list) for x in lines)
    out = unickpt.load(_zeros(sd), str(path))
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
    assert torch.equal(out["bf"], sd["bf"]) and out["step"] == 7
    assert unickpt.verify(str(path)).ok
    unickpt.convert(str(path), str(tmp_path / "one"), consolidate=True)  # written back as one 1.x document
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["version"].startswith("1.")
    assert torch.equal(unickpt.load(_zeros(sd), str(tmp_path / "one"))["bf"], sd["bf"])


def test_a_reader_parses_only_the_lines_of_the_tensors_it_uses(indexed):
    path, _ = indexed
    index = (path / INDEX_NAME).read_bytes()
    reads = []

    def read_range(at, n):
        reads.append((at, n))
        return index[at : at + n]

    m = Manifest.from_json((path / "manifest.json").read_bytes(), index=read_range)
    assert reads == []
    assert len(m.tensors["model.l3.w"].fragments) == 1 and len(reads) == 1
    m.tensors["model.l3.w"].fragments
    assert len(reads) == 1  # parsed once


def test_a_reader_of_some_rows_parses_only_the_lines_near_them(tmp_path, monkeypatch):
    from rules_cases import save_ranks

    from unickpt.engine.state import Sharded
    from unickpt.plan.box import Box
    from unickpt.plan.piece import box_piece

    monkeypatch.setattr(assemble_api, "INDEX_FRAGMENTS", 0)
    full = torch.arange(64.0).view(16, 4)
    states = [{"w": Sharded(full[2 * r : 2 * r + 2].clone(), (16, 4), [box_piece((2, 4), Box((0, 0), (2, 4)), Box((2 * r, 0), (2, 4)))])}
              for r in range(8)]
    save_ranks(states, str(tmp_path / "ck"))
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [c[3:] for c in doc["tensors"]["w"]["fragments_at"]] == [[[0, 0], [8, 4]], [[8, 0], [8, 4]]]  # 4 a line
    index = (tmp_path / "ck" / INDEX_NAME).read_bytes()
    reads = []
    m = Manifest.from_json((tmp_path / "ck" / "manifest.json").read_bytes(),
                           index=lambda at, n: reads.append(at) or index[at : at + n])
    near = m.tensors["w"].fragments_touching([Box((9, 1), (2, 2))])
    assert len(reads) == 1 and sorted(f.rank for f in near) == [4, 5, 6, 7]
    out = unickpt.load({"w": Sharded(torch.zeros(3, 4), (16, 4), [box_piece((3, 4), Box((0, 0), (3, 4)), Box((7, 0), (3, 4)))])},
                       str(tmp_path / "ck"))
    assert torch.equal(out["w"].local, full[7:10])
    assert len(m.tensors["w"].fragments) == 8 and len(reads) == 2


def test_a_changed_index_line_is_corruption(indexed):
    path, sd = indexed
    index = bytearray((path / INDEX_NAME).read_bytes())
    at = index.index(b'"offset":') + len(b'"offset":')
    index[at] = ord("9") if index[at] != ord("9") else ord("8")
    (path / INDEX_NAME).write_bytes(bytes(index))
    with pytest.raises(unickpt.CorruptionError, match=f"checksum mismatch in {INDEX_NAME}"):
        unickpt.load(_zeros(sd), str(path))


def test_a_missing_index_or_a_range_outside_it_is_refused(indexed):
    path, sd = indexed
    doc = json.loads((path / "manifest.json").read_text())
    del doc["digest"]
    first = doc["tensors"]["model.l0.w"]["fragments_at"][0]
    at = first[0]
    first[0] = doc["index"]["size"]
    (path / "manifest.json").write_text(seal(json.dumps(doc, separators=(",", ":"))))
    with pytest.raises(unickpt.ManifestError, match="fragments_at"):
        unickpt.load(_zeros(sd), str(path))
    first[0] = at
    (path / "manifest.json").write_text(seal(json.dumps(doc, separators=(",", ":"))))
    (path / INDEX_NAME).unlink()
    with pytest.raises(unickpt.CorruptionError, match=f"{INDEX_NAME} is missing"):
        unickpt.load(_zeros(sd), str(path))


def test_an_edited_root_is_caught_by_its_digest(indexed):
    path, sd = indexed
    raw = (path / "manifest.json").read_bytes()
    (path / "manifest.json").write_bytes(raw.replace(b'"world_size":1', b'"world_size":2', 1))
    with pytest.raises(unickpt.CorruptionError, match="manifest digest mismatch"):
        unickpt.load(_zeros(sd), str(path))


def test_small_saves_stay_single_documents(tmp_path):
    unickpt.save(_state(), str(tmp_path / "ck"))
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["version"] == "{}.{}".format(*FORMAT_VERSION)
    assert not (tmp_path / "ck" / INDEX_NAME).exists()
