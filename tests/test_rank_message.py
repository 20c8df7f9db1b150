"""The rank message (format/rank_message.py): what each rank sends to rank 0 at commit,
round trip, damage, and the checks rank 0 makes on the fragments it lists."""

from __future__ import annotations

import json
import struct
from math import prod

import pytest
import torch

import unickpt
from unickpt.engine.assemble import manifest_document
from unickpt.engine.commit import rank_message, read_message
from unickpt.engine.state import Sharded
from unickpt.format import rank_message as rm
from unickpt.format.rank_message import FragmentRecord
from unickpt.plan.piece import whole_piece

from rules_cases import save_ranks


def _record(name, shape, k=0):
    text = json.dumps({"rank": k, "file": f"rank_{k:05d}.safetensors", "offset": 8 * k, "shape": shape}).encode()
    return FragmentRecord(f"{name}{k}", list(shape), "F32", "rule x" if shape else "", text, prod(shape),
                          (1 << 64) - 1 - k, 12345 + k, ([k] * len(shape), [1] * len(shape)))


def _payload(k):
    return {"rank": k, "files": {f"rank_{k:05d}.safetensors": 100 + k}, "replicated": ["w.é0", "scalar0"] if k == 0 else [],
            "digests": {"step": "x"}, "values": {"step": {"int": 3}},
            "fragments": [_record("w.é", (4, 6), k), _record("scalar", (), k), _record("line\nbreak", (2, 3, 5), k)]}


def test_a_message_reads_back_as_its_payload():
    p = dict(_payload(0), error=None, declared={})
    got = read_message(rank_message(p))
    # members left empty are left out
    assert {k: v for k, v in got.items() if k != "fragments"} == {k: v for k, v in p.items() if (v or k == "rank") and k != "fragments"}
    assert list(got["fragments"]) == [r.name for r in p["fragments"]]
    for r in p["fragments"]:
        d = got["fragments"][r.name]
        assert (d["shape"], d["dtype"], d["layout"], d["fragment"], d["volume"], d["boxes"], d["crcs"]) == (
            r.shape, r.dtype, r.layout, r.text, r.volume, r.boxes, r.crcs)
        assert d["bbox"] == [list(r.bbox[0]), list(r.bbox[1])]
    empty = read_message(rank_message({"rank": 2, "error": "boom"}))
    assert empty == {"rank": 2, "error": "boom", "fragments": {}}


def test_an_entry_line_is_what_json_writes_whatever_the_name():
    """Each fragment's entry line is written without ``json.dumps`` (its cost per call, 1,600
    times a snapshot of 1,600 tensors): byte for byte what it writes, one line each."""
    for name in ["w", "w.é", "line\nbreak", 'quote"back\\slash', "tab\tnul\x00", "emoji \U0001f600", ""]:
        for shape in [[], [0], [4, 6], [2**40, 3]]:
            r = _record(name, shape)
            want = json.dumps([r.name, r.shape, r.dtype, r.layout], separators=(",", ":")) + "\n"
            assert rm._entry_line(r) == want


def test_rank_zero_reads_each_head_back_as_a_typed_report():
    from unickpt.engine.rank_report import RankReport

    heads = rm.decode_all(_messages()).heads
    reports = [RankReport.from_head(h, k) for k, h in enumerate(heads)]
    assert [r.rank for r in reports] == [0, 1, 2]
    assert reports[1].files == {"rank_00001.safetensors": 101} and reports[0].replicated == ["w.é0", "scalar0"]
    assert reports[2].error is None and reports[2].fragments == []  # the fragments stay in the batch's arrays
    # a failed rank's report names it; a head with a member no report has, or of the wrong kind, names its sender
    failed = [rank_message({"rank": 0}), rank_message({"rank": 1, "error": "disk full"})]
    with pytest.raises(unickpt.SaveError, match="rank 1: disk full") as e:
        manifest_document(failed, 2, {})
    assert e.value.failures == {1: "disk full"}
    for bad, why in (({"rank": 1, "colour": "red"}, r"members \['colour'\] are not a report's"),
                     ({"rank": 1, "files": [1]}, "its files is a list, not a dict")):
        with pytest.raises(unickpt.SaveError, match=f"rank 1 sent a malformed commit message: {why}"):
            manifest_document([rank_message({"rank": 0}), rank_message(bad)], 2, {})


def _messages():
    return [rank_message(_payload(k)) for k in range(3)]


def _reseal(message: bytes, body: bytes) -> bytes:
    """``message``'s prefix over ``body`` with its checksum made to match (damage a checksum cannot see)."""
    fields = list(rm.PREFIX.unpack_from(message))
    fields[3] = rm.crc32c(body)
    return rm.PREFIX.pack(*fields) + body


def _cut(body: bytes, lengths: list[int]) -> list[bytes]:
    out, at = [], 0
    for n in lengths:
        out.append(body[at : at + n])
        at += n
    return out


def _sections(message: bytes, sections: list[bytes]) -> bytes:
    """A well-formed message of these sections (prefix, lengths and checksum made to match)."""
    body = b"".join(sections)
    fields = list(rm.PREFIX.unpack_from(message))
    fields[3], fields[5:] = rm.crc32c(body), [len(x) for x in sections]
    return rm.PREFIX.pack(*fields) + body


def _damaged(message: bytes) -> dict[str, bytes]:
    p = rm.PREFIX.size
    _, _, _, _, n, head, entries, records, boxes, texts = rm.PREFIX.unpack_from(message)
    body = message[p:]
    flip = {f"byte {at} flipped": message[:at] + bytes([message[at] ^ 0x10]) + message[at + 1 :]
            for at in (p + 2, p + head + 3, p + head + entries + 9, p + head + entries + records + 1, len(message) - 2)}
    cut = {f"cut to {k}": message[:k] for k in (0, 7, p, len(message) // 2, len(message) - 1)}
    r0 = head + entries
    head_s, entries_s, records_s, boxes_s, texts_s = _cut(body, [head, entries, records, boxes, texts])
    one_dim = bytearray(records_s)
    struct.pack_into("<Q", one_dim, 0, 1)  # the first record (of a 2-d tensor) says its box has 1 dimension
    many_dims = bytearray(records_s)
    struct.pack_into("<Q", many_dims, 0, 1 << 60)
    fixed = bytearray(body[r0 : r0 + records])
    struct.pack_into("<Q", fixed, 32, 10**6)  # the first record announces more text than there is
    return {
        **flip, **cut,
        "magic": b"XXXX" + message[4:],
        "version": message[:4] + struct.pack("<H", 9) + message[6:],
        "head not an object": _reseal(message, b"[1,2]".ljust(head) + body[head:]),
        "head not JSON": _reseal(message, b"{" * head + body[head:]),
        "an entry not an entry": _reseal(message, body[:head] + _first_line(body[head : head + entries], b'{"a":1}') + body[head + entries :]),
        "texts disagree": _reseal(message, body[:r0] + bytes(fixed) + body[r0 + records :]),
        "a box of another rank": _sections(message, [head_s, entries_s, bytes(one_dim), boxes_s[16:], texts_s]),
        "a box of 2**60 dimensions": _sections(message, [head_s, entries_s, bytes(many_dims), boxes_s, texts_s]),
        "fewer entries": _reseal(message, body[:head] + body[head : head + entries].replace(b"\n", b" ", 1) + body[head + entries :]),
    }


def _first_line(lines: bytes, text: bytes) -> bytes:
    first, _, rest = lines.partition(b"\n")
    return text.ljust(len(first)) + b"\n" + rest


def test_a_damaged_or_truncated_message_fails_the_commit_naming_its_rank():
    good = _messages()
    for indexed in (False, True):
        docs = manifest_document(good, 3, {}, indexed=indexed)
        assert len(json.loads(docs["manifest.json"])["tensors"]) == 9
    for what, bad in _damaged(good[1]).items():
        with pytest.raises(unickpt.SaveError, match="rank 1 sent a malformed commit message"):
            manifest_document([good[0], bad, good[2]], 3, {})
            pytest.fail(what)


def _whole(t):
    return {"w": Sharded(t.clone(), (4, 4), [whole_piece((4, 4))], 0, 1)}


def test_rank_0_keeps_one_copy_of_a_shard_written_twice_and_refuses_two_different_ones(tmp_path):
    a = torch.arange(16.0).reshape(4, 4)
    save_ranks([_whole(a), _whole(a)], str(tmp_path / "same"))
    assert torch.equal(unickpt.load({"w": torch.zeros(4, 4)}, str(tmp_path / "same"))["w"], a)
    doc = json.loads((tmp_path / "same" / "manifest.json").read_text())
    assert [f["rank"] for f in doc["tensors"]["w"]["fragments"]] == [0]
    with pytest.raises(unickpt.InconsistentStateError, match="'w': replicas on ranks 0 and 1 hold different data"):
        save_ranks([_whole(a), _whole(a + 1)], str(tmp_path / "differ"))


def test_rank_0_refuses_fragments_that_do_not_tile_their_tensor(tmp_path):
    from unickpt.plan.box import Box
    from unickpt.plan.piece import Piece

    top = Piece(Box((0, 0), (2, 4)), (0, 0), (2, 4), 0)
    # both ranks write the top half (one copy is kept), nobody the bottom half
    states = [{"w": Sharded(torch.ones(2, 4), (4, 4), [top], 0, 1)} for _ in range(2)]
    with pytest.raises(unickpt.SaveError, match="'w': the saved shards hold 8 elements of 16"):
        save_ranks(states, str(tmp_path / "gap"))


def test_the_index_lists_each_tensors_fragments_by_box_four_a_line_whatever_order_they_came_in():
    from unickpt.format.index import INDEX_NAME

    block = [5, 2, 7, 0, 3, 6, 1, 4]  # rank r holds rows 2 * block[r] .. + 2 of w, and row block[r] of v
    messages = []
    for r, b in enumerate(block):
        w = FragmentRecord("w", [16, 4], "F32", "", json.dumps({"r": r}).encode(), 8, r, r, ([2 * b, 0], [2, 4]))
        v = FragmentRecord("v", [8], "F32", "", json.dumps({"v": r}).encode(), 1, r, r, ([b], [1]))
        messages.append(rank_message({"rank": r, "fragments": [w, v] if r % 2 else [v, w]}))
    docs = manifest_document(messages, 8, {}, indexed=True)
    root = json.loads(docs["manifest.json"])
    lines = docs[INDEX_NAME].splitlines(keepends=True)
    for name, key, box in (("w", "r", [[[0, 0], [8, 4]], [[8, 0], [8, 4]]]), ("v", "v", [[[0], [4]], [[4], [4]]])):
        at = root["tensors"][name]["fragments_at"]
        assert [c[3:] for c in at] == box
        got = [[f[key] for f in json.loads(docs[INDEX_NAME][a : a + n])] for a, n, *_ in at]
        assert got == [[block.index(b) for b in range(4)], [block.index(b) for b in range(4, 8)]]
        for a, n, crc, *_ in at:
            assert docs[INDEX_NAME][a + n : a + n + 1] == b"\n" and rm.crc32c(docs[INDEX_NAME][a : a + n]) == crc
    assert len(lines) == 4 and root["index"]["size"] == len(docs[INDEX_NAME])
