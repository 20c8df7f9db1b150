"""Pure tests of unickpt.format: manifest, values, safetensors header."""

from __future__ import annotations

import json
import math
import struct
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unickpt.errors import CorruptionError, FormatVersionError, ManifestError, UnickptError
from unickpt.format.checksum import block_count
from unickpt.format.dtypes import dtype_from_name, itemsize
from unickpt.format.index import INDEXED_VERSION
from unickpt.format.manifest import FORMAT_VERSION, Fragment, Manifest, TensorEntry, check_file_name, seal
from unickpt.format.safetensors_header import Entry, build_header, parse_header
from unickpt.format.values import decode_value, encode_value
from unickpt.plan.box import Box
from unickpt.plan.piece import box_piece, flat_pieces, whole_piece

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- manifest fixtures


def _frag(file: str, offset: int, shape, pieces, dtype="F32", block=16, rank=0) -> Fragment:
    nbytes = prod(shape) * itemsize(dtype)
    return Fragment(file, offset, tuple(shape), list(pieces), list(range(block_count(nbytes, block))), block, rank)


def sample_manifest() -> Manifest:
    shape = (6, 4)
    box = Box.whole(shape)
    t = TensorEntry(
        "model.w",
        shape,
        "F32",
        [
            # rank 0: a padded column shard: local (6, 3), global columns [0, 2) in local cols [1, 3)
            _frag("rank_00000.safetensors", 0, (6, 3), [box_piece((6, 3), Box((0, 1), (6, 2)), Box((0, 0), (6, 2)))]),
            # rank 1: a flat ZeRO partition with 2 leading pad elements
            _frag("rank_00001.safetensors", 8, (2 + 12,), flat_pieces(box, 0, 12, 2), rank=1),
            _frag("rank_00001.safetensors", 64, (12,), flat_pieces(Box((0, 2), (6, 2)), 0, 12), rank=1),
        ],
        layout="column",
    )
    # the first fragment holds global [:, 0:2]; the flat ones overlap it (this is only a format test)
    scalar = TensorEntry("step_t", (), "I64", [_frag("rank_00000.safetensors", 72, (), [whole_piece(())], "I64")])
    per_rank = TensorEntry("rng", (5,), "U8", [_frag("rank_00000.safetensors", 80, (5,), [whole_piece((5,))], "U8")])
    return Manifest(
        tensors={t.name: t, scalar.name: scalar},
        values={"step": 100, "sched": encode_value({"lr": 1e-3, "betas": (0.9, 0.95), 3: float("nan")})},
        rank_values={"loader": [encode_value({"pos": 1}), encode_value({"pos": 2})]},
        rank_tensors={"rng": [per_rank, None]},
        files={"rank_00000.safetensors": 200, "rank_00001.safetensors": 200},
        world_size=2,
        provenance={"framework": "test", "torch": torch.__version__},
        metadata={"note": "ünïcödé"},
    )


def doc_of(m: Manifest) -> dict:
    doc = json.loads(m.to_json())
    del doc["digest"]
    return doc


def parse(doc: dict) -> Manifest:
    """Parse an edited manifest document, sealed with a fresh digest as a writer would."""
    return Manifest.from_json(seal(json.dumps(doc)))


# --------------------------------------------------------------------------- manifest


def test_manifest_roundtrip():
    m = sample_manifest()
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    assert back.to_json() == text
    assert Manifest.from_json(text.encode()) == m  # bytes accepted too
    p = back.tensors["model.w"].fragments[1].pieces[0]
    assert p.flat_offset == 2 and p.view == (3, 4)  # flat piece: elements [0, 12) are rows 0..2


def test_manifest_roundtrip_omits_defaults():
    d = doc_of(sample_manifest())
    p0 = d["tensors"]["model.w"]["fragments"][0]["pieces"][0]
    assert p0 == {"global": [0, 0], "lengths": [6, 2], "local": [0, 1]}  # view = fragment shape: omitted
    assert d["version"] == f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"
    assert d["format"] == "unickpt"


@st.composite
def manifests(draw):
    files: dict[str, int] = {}
    tensors = {}
    for i in range(draw(st.integers(0, 3))):
        shape = tuple(draw(st.integers(1, 5)) for _ in range(draw(st.integers(0, 3))))
        dtype = draw(st.sampled_from(["F32", "BF16", "I64", "BOOL", "U8"]))
        frags = []
        for j in range(draw(st.integers(0, 3))):
            box = Box.whole(shape)
            kind = draw(st.sampled_from(["whole", "flat", "padded"]))
            if kind == "whole":
                fshape, pieces = shape, [whole_piece(shape)]
            elif kind == "flat":
                a = draw(st.integers(0, box.volume - 1))
                b = draw(st.integers(a + 1, box.volume))
                pad = draw(st.integers(0, 3))
                fshape, pieces = (pad + b - a,), flat_pieces(box, a, b, pad)
            else:
                pad = tuple(draw(st.integers(0, 2)) for _ in shape)
                fshape = tuple(n + q for n, q in zip(shape, pad))
                pieces = [box_piece(fshape, Box(pad, shape), box)]
            name = f"rank_{j:05d}.safetensors"
            offset = draw(st.integers(0, 64))
            block = draw(st.sampled_from([8, 16, 1024, 4 << 20]))
            frag = _frag(name, offset, fshape, pieces, dtype, block, rank=j)
            files[name] = max(files.get(name, 0), offset + frag.nbytes(dtype) + draw(st.integers(0, 8)))
            frags.append(frag)
        tensors[f"t{i}"] = TensorEntry(f"t{i}", shape, dtype, frags, draw(st.sampled_from(["", "zero", "tp"])))
    # a tensor's bytes must fit in the checkpoint's files (a parse-time bound): these
    # tensors may be partly covered, so a spare file makes room
    need = max((t.nbytes for t in tensors.values()), default=0)
    if need > sum(files.values()):
        files["spare.safetensors"] = need
    values = {f"v{i}": encode_value(v) for i, v in enumerate(draw(st.lists(plain_values, max_size=3)))}
    return Manifest(
        tensors=tensors, values=values, files=files, world_size=draw(st.integers(3, 64)),  # fragments are of ranks 0-2
        provenance={"framework": draw(st.text(max_size=5))}, metadata={"k": draw(st.integers())},
    )


# --------------------------------------------------------------------------- versions


def test_refuses_newer_major_version():
    d = doc_of(sample_manifest())
    d["version"] = f"{INDEXED_VERSION[0] + 1}.0"
    with pytest.raises(FormatVersionError, match=r"newer.*upgrade unickpt") as e:
        parse(d)
    assert f"{INDEXED_VERSION[0] + 1}.0" in str(e.value)
    assert isinstance(e.value, UnickptError)


def test_accepts_newer_minor_version():
    d = doc_of(sample_manifest())
    d["version"] = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1] + 7}"
    d["some_future_field"] = {"ignored": True}
    m = parse(d)
    assert m.version == (FORMAT_VERSION[0], FORMAT_VERSION[1] + 7)
    assert m.tensors == sample_manifest().tensors


@pytest.mark.parametrize("version", [None, "", "1", "1.0.0", "one.zero", "1.x", [1, 0]])
def test_invalid_version(version):
    d = doc_of(sample_manifest())
    d["version"] = version
    with pytest.raises(ManifestError, match="version"):
        parse(d)


def test_not_a_unickpt_manifest():
    for text in ["", "{", "not json", "[1, 2]", "null", '{"format": "dcp", "version": "1.0"}', b"\xff\xfe"]:
        with pytest.raises(ManifestError):
            Manifest.from_json(text)
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{]")


# --------------------------------------------------------------------------- safety


BAD_NAMES = ["../x", "/etc/passwd", "a/b", "", "..", ".", "a\\b", "x/../y", ".hidden", "a\x00b", "C:evil", "a" * 300]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_path_escape_in_files(name):
    d = doc_of(sample_manifest())
    d["files"][name] = 10
    with pytest.raises(ManifestError, match="unsafe file name"):
        parse(d)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_path_escape_in_fragment(name):
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["fragments"][0]["file"] = name
    with pytest.raises(ManifestError, match="unsafe file name"):
        parse(d)
    d = doc_of(sample_manifest())
    d["rank_tensors"]["rng"][0]["fragments"][0]["file"] = name
    with pytest.raises(ManifestError, match="unsafe file name"):
        parse(d)


@pytest.mark.parametrize("name", ["rank_00000.safetensors\n", "a\n"])
def test_file_name_with_trailing_newline_is_refused(name):
    """``_SAFE_FILE`` is anchored with ``$``, which also matches before a final newline:
    only ``[A-Za-z0-9_.-]`` names are meant to pass."""
    with pytest.raises(ManifestError):
        check_file_name(name)


def test_safe_names_pass():
    for name in ["rank_00000.safetensors", "a", "_x-1.bin", "model-00001-of-00002.safetensors"]:
        assert check_file_name(name) == name
    with pytest.raises(ManifestError):
        check_file_name(3)  # type: ignore[arg-type]


def test_fragment_file_not_listed():
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["fragments"][0]["file"] = "other.safetensors"
    with pytest.raises(ManifestError, match="not listed"):
        parse(d)


@pytest.mark.parametrize("offset,size_delta", [(0, -1), (190, 0), (-1, 0)])
def test_fragment_outside_file(offset, size_delta):
    d = doc_of(sample_manifest())
    f = d["tensors"]["model.w"]["fragments"][0]  # 6*3 F32 = 72 bytes
    f["offset"] = offset
    if size_delta:
        d["files"][f["file"]] = offset + 72 + size_delta
    with pytest.raises(ManifestError, match="outside file"):
        parse(d)


def test_fragment_exactly_fills_file():
    d = doc_of(sample_manifest())
    f = d["tensors"]["model.w"]["fragments"][0]
    f["offset"] = 128
    d["files"][f["file"]] = 200
    parse(d)


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_crc_count(delta):
    d = doc_of(sample_manifest())
    f = d["tensors"]["model.w"]["fragments"][0]
    n = len(f["crc32c"])
    f["crc32c"] = list(range(n + delta))
    with pytest.raises(ManifestError, match="checksums"):
        parse(d)


@pytest.mark.parametrize("block", [0, -16])
def test_bad_block_bytes(block):
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["fragments"][0]["block_bytes"] = block
    with pytest.raises(ManifestError):
        parse(d)


@pytest.mark.parametrize(
    "piece",
    [
        {"global": [1, 0], "lengths": [6, 2], "local": [0, 0]},  # past dim 0 of the tensor
        {"global": [0, 3], "lengths": [6, 2], "local": [0, 0]},  # past dim 1
        {"global": [0], "lengths": [6], "view": [6]},  # wrong rank
        {"global": [0, 0, 0], "lengths": [1, 1, 1], "view": [1, 1, 1]},  # wrong rank
    ],
)
def test_piece_outside_tensor(piece):
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["fragments"][0]["pieces"] = [piece]
    with pytest.raises(ManifestError, match="outside shape"):
        parse(d)


@pytest.mark.parametrize(
    "piece",
    [
        {"global": [0, 0], "lengths": [6, 2], "local": [0, 2]},  # local box past its view
        {"global": [-1, 0], "lengths": [2, 2]},  # negative offset
        {"global": [0, 0], "lengths": [2, 2], "local": [0]},  # rank mismatch
        {"global": [0, 0], "lengths": [2, 2], "view": [2, 2], "flat": 17},  # reaches past the data
        {"lengths": [2, 2]},  # missing key
        {"global": ["a", 0], "lengths": [2, 2]},  # not a number
    ],
)
def test_malformed_piece(piece):
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["fragments"][0]["pieces"] = [piece]
    with pytest.raises(ManifestError):
        parse(d)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["tensors"]["model.w"].update(shape=[-6, 4]),
        lambda d: d["tensors"]["model.w"].pop("fragments"),
        lambda d: d["tensors"]["model.w"]["fragments"][0].pop("shape"),
        lambda d: d["files"].update({"rank_00000.safetensors": "big"}),
        lambda d: d.update(values=[1, 2]),
        lambda d: d.update(tensors=[]),
        lambda d: d.update(files=[]),
        lambda d: d.update(rank_tensors=[]),
        lambda d: d["tensors"].update(bad=[1, 2]),
        lambda d: d.update(world_size="two"),
    ],
    ids=[
        "negative-shape", "no-fragments", "fragment-without-shape", "file-size-not-int", "values-list",
        "tensors-list", "files-list", "rank_tensors-list", "tensor-entry-list", "world_size-not-int",
    ],
)
def test_malformed_structure(mutate):
    d = doc_of(sample_manifest())
    mutate(d)
    with pytest.raises(ManifestError):
        parse(d)


def test_unknown_dtype_is_an_error():
    d = doc_of(sample_manifest())
    d["tensors"]["model.w"]["dtype"] = "F4_FUTURE"
    with pytest.raises(UnickptError, match="F4_FUTURE"):
        parse(d)


@SETTINGS
@given(manifests())
def test_manifest_roundtrip_property(m):
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    assert back.to_json() == text


# --------------------------------------------------------------------------- values


def same(a, b) -> bool:
    """Equality that also demands equal types (tuple stays tuple, bool stays bool),
    treats NaN as equal to NaN, tells -0.0 from 0.0 and respects dict order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    return a == b


hashable_keys = st.recursive(
    st.one_of(
        st.text(max_size=6),
        st.sampled_from(["$tuple", "$dict", "$float", "$bytes", "$", "$x"]),
        st.integers(),
        st.booleans(),
        st.none(),
        st.binary(max_size=4),
        st.floats(allow_nan=False),
    ),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=4,
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63, max_value=2**200) | st.integers(min_value=-(2**200), max_value=-(2**63)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.binary(max_size=16),
)

plain_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
        st.dictionaries(hashable_keys, inner, max_size=4),
        # single-key dicts that look like tags
        st.builds(lambda k, v: {k: v}, st.sampled_from(["$tuple", "$dict", "$float", "$bytes"]), inner),
    ),
    max_leaves=12,
)


@SETTINGS
@given(plain_values)
def test_values_roundtrip(v):
    enc = encode_value(v, "k")
    text = json.dumps(enc, allow_nan=False)  # what the manifest writes: strict JSON
    back = decode_value(json.loads(text))
    assert same(back, v), (v, enc, back)


@SETTINGS
@given(plain_values)
def test_values_roundtrip_through_manifest(v):
    m = Manifest(values={"x": encode_value(v, "x")}, rank_values={"r": [encode_value(v, "r")]})
    back = Manifest.from_json(m.to_json())
    assert same(decode_value(back.values["x"]), v)
    assert same(decode_value(back.rank_values["r"][0]), v)


def test_values_examples():
    v = {"a": (1, [2, (3,)]), 5: b"\x00\xff", (1, "x"): float("-inf"), "$t": "dollar key", "n": float("nan")}
    back = decode_value(json.loads(json.dumps(encode_value(v))))
    assert same(back, v)
    assert isinstance(back["a"], tuple) and isinstance(back["a"][1][1], tuple)
    big = 2**200 + 1
    assert decode_value(json.loads(json.dumps(encode_value(big)))) == big
    assert encode_value("ünï ☃ 𝄞") == "ünï ☃ 𝄞"
    assert decode_value(encode_value(bytearray(b"ab"))) == b"ab"


@pytest.mark.parametrize(
    "value,where",
    [
        (object(), "state"),
        ({"a": {"b": {1, 2}}}, "state.a.b"),
        ({"a": [1, torch.zeros(1)]}, "state.a[1]"),
        ((1, 2, print), "state[2]"),
        ({"opt": {"x": complex(1, 2)}}, "state.opt.x"),
    ],
)
def test_encode_refuses_unsupported(value, where):
    with pytest.raises(UnickptError, match="cannot store value") as e:
        encode_value(value, "state")
    assert repr(where) in str(e.value), str(e.value)


# --------------------------------------------------------------------------- safetensors header


ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]


@st.composite
def header_entries(draw):
    keys = draw(st.lists(st.text(min_size=1, max_size=12).filter(lambda k: k != "__metadata__"), max_size=5, unique=True))
    out = []
    for k in keys:
        dtype = draw(st.sampled_from(ST_DTYPES))
        shape = tuple(draw(st.integers(0, 4)) for _ in range(draw(st.integers(0, 3))))
        out.append(Entry(k, dtype, shape, prod(shape) * itemsize(dtype)))
    meta = draw(st.none() | st.dictionaries(st.text(max_size=5).filter(lambda k: k), st.text(max_size=8), max_size=3))
    return out, meta


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(header_entries())
def test_header_readable_by_safetensors(tmp_path, case):
    from safetensors import safe_open

    entries, meta = case
    prefix, offsets = build_header(entries, meta)
    assert len(prefix) % 8 == 0
    total = sum(e.nbytes for e in entries)
    # offsets are absolute, back to back, in order
    at = len(prefix)
    for e, off in zip(entries, offsets):
        assert off == at
        at += e.nbytes
    path = tmp_path / "x.safetensors"
    data = bytearray(total)
    for i, (e, off) in enumerate(zip(entries, offsets)):  # a recognisable byte per tensor
        data[off - len(prefix) : off - len(prefix) + e.nbytes] = bytes([1 if e.dtype == "BOOL" else (i + 1)]) * e.nbytes
    path.write_bytes(prefix + bytes(data))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(e.key for e in entries)
        if meta:
            assert f.metadata() == meta
        for i, e in enumerate(entries):
            assert tuple(f.get_slice(e.key).get_shape()) == e.shape
            t = f.get_tensor(e.key)
            assert t.dtype == dtype_from_name(e.dtype) and tuple(t.shape) == e.shape
            want = bytes([1 if e.dtype == "BOOL" else (i + 1)]) * e.nbytes
            assert t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == want

    raw = path.read_bytes()
    pos = 8
    def read_more(n):
        nonlocal pos
        out = raw[pos : pos + n]
        pos += n
        return out
    header, data_start = parse_header(raw[:8], read_more)
    assert data_start == len(prefix)
    if meta:
        assert header.pop("__metadata__") == meta
    assert header == {
        e.key: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off - len(prefix), off - len(prefix) + e.nbytes]}
        for e, off in zip(entries, offsets)
    }


def test_header_matches_safetensors_library(tmp_path):
    """A header unickpt builds describes the same layout as one the library writes."""
    from safetensors.torch import save_file

    tensors = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.int64), "c": torch.ones((), dtype=torch.bfloat16)}
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    ref = json.loads(raw[8 : 8 + n])
    from unickpt.format.dtypes import dtype_name

    entries = []
    for k, _ in sorted(ref.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if k == "__metadata__":
            continue
        t = tensors[k]
        entries.append(Entry(k, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()))
    prefix, offsets = build_header(entries)
    ours = json.loads(prefix[8:])
    ref.pop("__metadata__", None)
    assert ours == ref


def test_parse_header_errors():
    with pytest.raises(CorruptionError, match="too short"):
        parse_header(b"\x01\x00", lambda n: b"")
    with pytest.raises(CorruptionError, match="implausible"):
        parse_header(struct.pack("<Q", 1 << 40), lambda n: b"")
    with pytest.raises(CorruptionError, match="truncated"):
        parse_header(struct.pack("<Q", 10), lambda n: b"{}")
    with pytest.raises(CorruptionError, match="not JSON"):
        parse_header(struct.pack("<Q", 4), lambda n: b"{{{{")
