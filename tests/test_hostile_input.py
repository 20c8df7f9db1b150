"""Broken and hostile input (issue 12, items 3, 5, 6, 7): every case raises a UnickptError
subclass with a message that says what is wrong, and the CLI prints one ``error:`` line.

Manifest edits are re-sealed with a fresh digest (``seal``) where a test is about the
structural checks, so that the digest is not what catches them; the digest's own tests
edit the text without re-sealing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import unickpt
from rules_cases import save_ranks
from unickpt.errors import CorruptionError, ManifestError, UnickptError, UnsafePickleError
from unickpt.format.manifest import Manifest, seal
from unickpt.plan.box import Box
from unickpt.plan.piece import box_piece

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
TENSORS = {"a": torch.arange(64, dtype=torch.float32), "b": torch.arange(48, dtype=torch.int64).view(6, 8)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank checkpoint (saved from one process as its two ranks would): replicated
    tensors, plain values (bytes among them) and per-rank values."""
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    states = []
    for r in range(2):
        st = {k: _half(t, r) for k, t in TENSORS.items()}
        states.append({**st, "step": 7, "blob": b"\x00\x01", "loader": unickpt.PerRank({"pos": r})})
    save_ranks(states, str(path))
    return path


def _half(t: torch.Tensor, rank: int) -> unickpt.Sharded:
    """Rank ``rank``'s half of ``t`` (split on dim 0)."""
    n = t.shape[0] // 2
    local = t[rank * n : (rank + 1) * n].clone()
    shape = tuple(local.shape)
    box = Box((rank * n,) + (0,) * (t.dim() - 1), shape)
    return unickpt.Sharded(local, tuple(t.shape), [box_piece(shape, Box.whole(shape), box)])


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the saved checkpoint, free to damage."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in saved.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


E999 = "<1e999>"  # written as the JSON number 1e999 (which parses as inf)


def manifest_doc(path: Path) -> dict:
    doc = json.loads((path / "manifest.json").read_text())
    del doc["digest"]
    return doc


def write_sealed(path: Path, doc_or_text: dict | str) -> None:
    """Write an edited manifest sealed with a fresh digest, as a buggy or hostile writer would."""
    text = doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text, separators=(",", ":"))
    (path / "manifest.json").write_text(seal(text.replace(f'"{E999}"', "1e999")))


def cli(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Run ``python -m unickpt`` once per command, all at once (each pays torch's import)."""
    env = {**os.environ, **ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "unickpt", *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for c in commands]
    out = []
    for c, p in zip(commands, procs):
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def assert_one_error_line(r: subprocess.CompletedProcess, pattern: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert re.search(pattern, lines[0]), lines[0]


# ------------------------------------------------------------------ item 3: truncated data file


def test_truncated_file_names_tensor_file_and_bytes_on_every_read_path(ckpt: Path, tmp_path: Path) -> None:
    m = unickpt.read_manifest(str(ckpt))
    frag = next(f for f in m.tensors["b"].fragments if f.rank == 1)
    nbytes = frag.nbytes(m.tensors["b"].dtype)
    cut = frag.offset + nbytes // 2  # half of 'b' is gone
    data = ckpt / frag.file
    os.truncate(data, cut)
    want = rf"{frag.file} is truncated \(tensor 'b', bytes {cut}-{frag.offset + nbytes} of the file"

    with pytest.raises(CorruptionError, match=want):
        unickpt.load({k: torch.zeros_like(v) for k, v in TENSORS.items()}, str(ckpt), strict=False)
    with pytest.raises(CorruptionError, match=want):
        unickpt.load_tensor(str(ckpt), "b")
    with pytest.raises(CorruptionError, match=want):
        unickpt.load_tensor(str(ckpt), "b", mmap=True)
    with pytest.raises(CorruptionError, match=want):
        unickpt.convert(str(ckpt), str(tmp_path / "out"))
    assert torch.equal(unickpt.load_tensor(str(ckpt), "a"), TENSORS["a"])  # what is whole still loads
    data.unlink()
    with pytest.raises(CorruptionError, match=rf"data file {frag.file} is missing .*\(tensor '[ab]' needs bytes \d+-\d+ of it\)"):
        unickpt.load_tensor(str(ckpt), "b")


def test_data_file_header_nested_too_deeply_is_a_problem_not_a_crash(ckpt: Path) -> None:
    """verify parses every data file's own safetensors header: 5000 levels of JSON there
    are reported as a corrupt header, not a RecursionError."""
    data = ckpt / "rank_00000.safetensors"
    deep = b"[" * 5000 + b"]" * 5000
    data.write_bytes(len(deep).to_bytes(8, "little") + deep)
    report = unickpt.verify(str(ckpt))
    headers = [p for p in report.problems if p.kind == "header"]
    assert [(p.file, p.message) for p in headers] == [
        (data.name, "safetensors header does not parse: safetensors header is not valid: JSON nested too deeply")
    ], report


@pytest.mark.multiprocess
def test_foreign_json_nested_too_deeply_is_one_error_line(tmp_path: Path) -> None:
    """A Hugging Face folder whose config.json nests 100,000 levels: the reader says the file
    is not valid JSON (one error line, exit 2), not a RecursionError from inside json."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    r = subprocess.run([sys.executable, "-m", "unickpt", "inspect", str(folder)], capture_output=True, text=True,
                       env={**os.environ, **ENV}, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"error: {folder / 'config.json'} is not valid JSON: JSON nested too deeply\n")


# ------------------------------------------------------------------ item 5: malformed manifests


def _set(doc: dict, keys: tuple, value) -> dict:
    node = doc
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return doc


MALFORMED = {
    "shape 1e999": (lambda d: _set(d, ("tensors", "a", "shape"), [E999]), r"shape is inf, not an integer"),
    "shape of 4000 digits": (lambda d: _set(d, ("tensors", "a", "shape"), [10**3999]), r"shape is an integer of \d+ bits"),
    "huge shape": (lambda d: _set(d, ("tensors", "a", "shape"), [1 << 40, 1 << 40]), r"more than all the checkpoint's files hold"),
    "negative shape": (lambda d: _set(d, ("tensors", "b", "shape"), [-6, -8]), r"shape is -6"),
    "float offset": (lambda d: _set(d, ("tensors", "a", "fragments", 0, "offset"), 8.5), r"fragment offset is 8.5"),
    "$float bogus": (lambda d: _set(d, ("values", "step"), {"$float": "bogus"}), r"malformed \$float payload"),
    "$dict with a dict key": (lambda d: _set(d, ("values", "step"), {"$dict": [[{"k": 1}, 2]]}), r"\$dict key is a dict"),
    "$dict entry not a pair": (lambda d: _set(d, ("values", "step"), {"$dict": [[1, 2, 3]]}), r"not a \[key, value\] pair"),
    "unknown tag": (lambda d: _set(d, ("values", "step"), {"$set": [1]}), r"unknown tag '\$set'"),
    "$bytes not base64": (lambda d: _set(d, ("values", "blob"), {"$bytes": "!!!"}), r"not valid base64"),
    "world_size above the rows": (lambda d: _set(d, ("world_size",), 3), r"rank_values 'loader' holds 2 entries, world_size is 3"),
    "world_size 2 -> 1": (lambda d: _set(d, ("world_size",), 1), r"world_size is 1"),
    "world_size 0": (lambda d: _set(d, ("world_size",), 0), r"world_size is 0"),
    "fragment of a rank past world_size": (
        lambda d: _set(d, ("tensors", "a", "fragments", 0, "rank"), 2), r"a fragment of rank 2, world_size is 2"),
    "tensors not an object": (lambda d: _set(d, ("tensors",), [1]), r"tensors is \[1\], not an object"),
    "unknown dtype": (lambda d: _set(d, ("tensors", "a", "dtype"), ["F32"]), r"unknown dtype"),
    "checksum out of range": (lambda d: _set(d, ("tensors", "a", "fragments", 0, "crc32c"), [1 << 40]), r"checksum is"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_a_manifest_error(ckpt: Path, case: str) -> None:
    edit, message = MALFORMED[case]
    write_sealed(ckpt, edit(manifest_doc(ckpt)))
    for read in (
        lambda: unickpt.read_manifest(str(ckpt)),
        lambda: unickpt.load({"a": torch.zeros(64)}, str(ckpt), strict=False),
        lambda: unickpt.load_tensor(str(ckpt), "a"),
        lambda: unickpt.load_rank_values(str(ckpt), "loader"),
        lambda: unickpt.verify(str(ckpt)),
    ):
        with pytest.raises(ManifestError, match=message):
            read()


@pytest.mark.parametrize("case,message", [
    ("deep", r"nested too deeply"),
    ("deep value", r"nested more than 100 levels deep"),
    ("surrogate", r"not valid Unicode \(a lone surrogate\)"),
    ("surrogate bytes", r"not valid UTF-8"),
])
def test_malformed_manifest_text_is_a_manifest_error(ckpt: Path, case: str, message: str) -> None:
    text = json.dumps(manifest_doc(ckpt), separators=(",", ":"))
    if case == "deep":  # 5000 levels: json's parser itself would overflow the stack
        text = text.replace('"metadata":{}', '"metadata":{"x":' + "[" * 5000 + "]" * 5000 + "}")
    elif case == "deep value":  # parses, but decoding it would recurse 500 deep
        text = text.replace('"step":7', '"step":' + "[" * 500 + "]" * 500)
    elif case == "surrogate":
        text = text.replace('"metadata":{}', '"metadata":{"note":"\\ud800"}')
    write_sealed(ckpt, text)
    if case == "surrogate bytes":  # a surrogate encoded as UTF-8 bytes (which UTF-8 forbids)
        (ckpt / "manifest.json").write_bytes(seal(text).encode().replace(b'"rank_values"', b'"r\xed\xa0\x80"'))
    with pytest.raises(ManifestError, match=message):
        unickpt.read_manifest(str(ckpt))


@pytest.mark.multiprocess
def test_cli_prints_one_error_line_for_a_malformed_manifest(saved: Path, tmp_path: Path) -> None:
    text = json.dumps(manifest_doc(saved), separators=(",", ":"))
    surrogate, infinite = tmp_path / "surrogate", tmp_path / "infinite"
    for d in (surrogate, infinite):
        d.mkdir()
    write_sealed(surrogate, text.replace('"metadata":{}', '"metadata":{"note":"\\udcff"}'))
    write_sealed(infinite, _set(json.loads(text), ("tensors", "a", "shape"), [E999]))
    inspected, verified = cli(["inspect", str(surrogate)], ["verify", str(infinite)])
    assert_one_error_line(inspected, r"^error: malformed value 'metadata'.*lone surrogate")
    assert_one_error_line(verified, r"^error: malformed manifest: tensor 'a': shape is inf")


def test_cli_turns_an_unexpected_exception_into_one_line(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last resort, for a bug no test has found yet: one line, exit 2, no traceback."""
    from unickpt.adapters import checkpoint as checkpoint_module
    from unickpt.cli import app

    def broken(path: str, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(checkpoint_module, "open_checkpoint", broken)
    r = CliRunner().invoke(app, ["inspect", str(ckpt)], env=ENV)
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: unexpected IndexError (list index out of range); this is a bug in unickpt, please report it"
    ]


# ------------------------------------------------------------------ item 6: the manifest's digest


def test_pieces_that_overlap_and_leave_a_gap_are_corrupt_on_every_path(ckpt: Path, tmp_path: Path) -> None:
    """Rows 0-2 of 'b' listed twice and rows 3-5 never: as many elements as the tensor, so a
    count of them cannot see it. Each reader refuses it (it used to load the gap's old
    values, and verify said OK)."""
    doc = manifest_doc(ckpt)
    frags = doc["tensors"]["b"]["fragments"]
    frags[1]["pieces"] = frags[0]["pieces"]  # rank 1's half claims rank 0's rows
    write_sealed(ckpt, doc)
    overlap = r"pieces \[0:3, 0:8\] and \[0:3, 0:8\] overlap"
    with pytest.raises(CorruptionError, match=overlap):
        unickpt.load({"b": torch.zeros(6, 8, dtype=torch.int64)}, str(ckpt))
    with pytest.raises(CorruptionError, match=overlap):
        unickpt.load_tensor(str(ckpt), "b")
    with pytest.raises(CorruptionError, match=overlap):
        unickpt.convert(str(ckpt), str(tmp_path / "out"))
    report = unickpt.verify(str(ckpt))
    assert [(p.kind, p.tensor) for p in report.problems] == [("coverage", "b")], report.problems
    assert re.search(overlap, report.problems[0].message), report.problems


def test_dcp_chunks_that_overlap_or_a_shape_they_do_not_fill_are_corrupt(tmp_path: Path) -> None:
    """A real DCP checkpoint (no checksums, no digest) whose metadata is edited: two chunks
    of 't' overlapping (row 5 then held by none), or a size of 2**62 x 2**62 for its 48
    elements (it used to reach the allocator: torch's RuntimeError, a TypeError in convert)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def edited(name: str, edit) -> str:
        path = tmp_path / name
        t = torch.arange(48.0).view(6, 8)
        dcp.save({"t": t, "rows_0_3": t[0:3].clone(), "rows_2_5": t[2:5].clone()}, checkpoint_id=str(path))
        md = dcp.FileSystemReader(str(path)).read_metadata()
        edit(md)
        (path / ".metadata").write_bytes(pickle.dumps(md))  # as a buggy writer would
        return str(path)

    def overlap(md) -> None:  # 't' as two chunks, the stored rows 0-2 and rows 2-4
        md.state_dict_metadata["t"].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 8])),
                                              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([3, 8]))]
        at = {k.fqn: k for k in md.storage_data}
        del md.storage_data[at["t"]]  # the key of its one chunk, at [0, 0]
        md.storage_data[MetadataIndex("t", torch.Size([0, 0]), 0)] = md.storage_data[at["rows_0_3"]]
        md.storage_data[MetadataIndex("t", torch.Size([2, 0]), 1)] = md.storage_data[at["rows_2_5"]]

    def huge(md) -> None:
        md.state_dict_metadata["t"].size = torch.Size([1 << 62, 1 << 62])

    path = edited("overlap", overlap)
    with pytest.raises(CorruptionError, match=r"pieces \[0:3, 0:8\] and \[2:5, 0:8\] overlap"):
        unickpt.load({"t": torch.full((6, 8), -1.0)}, path, strict=False)
    assert "coverage" in [p.kind for p in unickpt.verify(path).problems]
    path = edited("huge", huge)
    for read in (lambda: unickpt.load_tensor(path, "t"), lambda: unickpt.convert(path, str(tmp_path / "out"))):
        with pytest.raises(CorruptionError, match="its pieces hold 48 of its 21267647932558653966460912964485513216 elements"):
            read()


def test_world_size_2_to_1_is_detected(ckpt: Path) -> None:
    assert unickpt.load_rank_values(str(ckpt), "loader") == [{"pos": 0}, {"pos": 1}]
    text = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(text.replace('"world_size":2,', '"world_size":1,', 1))
    with pytest.raises(ManifestError, match="a fragment of rank 1, world_size is 1"):
        unickpt.load_rank_values(str(ckpt), "loader")
    with pytest.raises(ManifestError):
        unickpt.verify(str(ckpt))


def test_self_consistent_edit_is_caught_by_the_digest(ckpt: Path) -> None:
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["rank_values"]["loader"].reverse()
    doc["values"]["step"] = 8
    (ckpt / "manifest.json").write_text(json.dumps(doc, separators=(",", ":")))  # digest kept, now stale
    for read in (lambda: unickpt.read_manifest(str(ckpt)), lambda: unickpt.verify(str(ckpt)),
                 lambda: unickpt.load({"step": 0}, str(ckpt)), lambda: unickpt.load_rank_values(str(ckpt), "loader")):
        with pytest.raises(CorruptionError, match="manifest digest mismatch: manifest.json was changed after it was written"):
            read()
    from unickpt.cli import app

    r = CliRunner().invoke(app, ["verify", str(ckpt)], env=ENV)
    assert r.exit_code == 2 and r.output.startswith("error: manifest digest mismatch"), r.output


def test_digest_removed_or_moved_is_refused(ckpt: Path) -> None:
    doc = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1))  # same content, reformatted
    with pytest.raises(ManifestError, match="digest .* is not in its place"):
        unickpt.read_manifest(str(ckpt))
    del doc["digest"]
    (ckpt / "manifest.json").write_text(json.dumps(doc, separators=(",", ":")))
    with pytest.raises(ManifestError, match=r"manifest of format 1\.\d+ has no digest"):
        unickpt.read_manifest(str(ckpt))


def test_older_manifest_without_digest_is_read_and_verify_says_so(ckpt: Path) -> None:
    assert unickpt.read_manifest(str(ckpt)).digest.startswith("sha256:")
    report = unickpt.verify(str(ckpt))
    assert report.ok and str(report).splitlines()[-1].startswith("manifest digest: sha256 ")
    doc = manifest_doc(ckpt)
    doc["version"] = "1.0"
    (ckpt / "manifest.json").write_text(json.dumps(doc, separators=(",", ":")))  # as format 1.0 wrote it
    m = unickpt.read_manifest(str(ckpt))
    assert m.digest is None and m.version == (1, 0)
    assert torch.equal(unickpt.load_tensor(str(ckpt), "b"), TENSORS["b"])
    report = unickpt.verify(str(ckpt))
    assert report.ok and str(report).splitlines()[-1] == "manifest digest: absent (older format)"


# ------------------------------------------------------------------ fuzz: mutated manifests

_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70), st.floats(allow_nan=False),
    st.text(max_size=4), st.sampled_from(["\ud800", "F32", "rank_00000.safetensors", "../x", "$bytes", "1.1"]),
    st.lists(st.integers(-3, 1 << 62), max_size=3),
    st.dictionaries(st.sampled_from(["$bytes", "$float", "$dict", "$tuple", "lengths", "x"]),
                    st.one_of(st.text(max_size=3), st.lists(st.integers(), max_size=2)), max_size=2),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifest_raises_only_unickpt_errors(saved: Path, tmp_path_factory, data) -> None:
    """Any one replaced node of a real manifest: reading, verifying and loading either work
    or raise a UnickptError, never another exception."""
    doc = manifest_doc(saved)
    paths = list(_paths(doc))[1:]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            _set(doc, path, data.draw(_JUNK))
        except (TypeError, IndexError, KeyError):
            pass  # the path went away with an earlier replacement
    try:
        Manifest.from_json(seal(json.dumps(doc)))
    except UnickptError:
        return
    work = tmp_path_factory.mktemp("fuzz")
    for f in saved.iterdir():
        os.link(f, work / f.name) if f.name != "manifest.json" else None
    write_sealed(work, doc)
    for run in (lambda: unickpt.verify(str(work)), lambda: unickpt.load_tensor(str(work), "b"),
                lambda: unickpt.load_rank_values(str(work), "loader"),
                lambda: unickpt.load({"a": torch.zeros(64), "step": 0, "blob": None}, str(work), strict=False)):
        try:
            run()
        except UnickptError:
            pass


# ------------------------------------------------------------------ item 7: tiny hostile pickles

_RSS_PROBE = r"""
import json, resource, sys
import unickpt
from unickpt.errors import UnsafePickleError
out = {}
for name, blob in [("set", bytes.fromhex(sys.argv[2])), ("bytearray", bytes.fromhex(sys.argv[3]))]:
    d = f"{sys.argv[1]}/{name}"
    import os; os.makedirs(d)
    open(f"{d}/.metadata", "wb").write(blob)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        unickpt.read_manifest(d)
        err = None
    except Exception as e:
        err = [type(e).__name__, str(e)]
    out[name] = {"error": err, "extra_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "bytes": len(blob)}
print(json.dumps(out))
"""

# set(range(3 * 10**7)) and bytearray(1_500_000_000), spelled with the allowed globals and
# a few opcodes (protocol 2): 42 and 30 bytes
SET_PICKLE = b"\x80\x02cbuiltins\nset\ncbuiltins\nrange\nJ\x80\xc3\xc9\x01\x85R\x85R."
BYTEARRAY_PICKLE = b"\x80\x02cbuiltins\nbytearray\nJ\x00/hY\x85R."


@pytest.mark.multiprocess
def test_tiny_hostile_pickles_are_refused_cheaply(tmp_path: Path) -> None:
    """Measured in a fresh process: peak RSS may grow by less than 100 MB while refusing."""
    r = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path), SET_PICKLE.hex(), BYTEARRAY_PICKLE.hex()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name, what in [("set", "set of 30000000"), ("bytearray", "bytearray of 1500000000")]:
        got = out[name]
        assert got["bytes"] <= 44
        assert got["error"] is not None and got["error"][0] == UnsafePickleError.__name__, got
        assert f"builds a {what} elements or bytes" in got["error"][1] and ".metadata" in got["error"][1], got
        assert got["extra_kib"] < 100 * 1024, got


def test_pickle_budget_still_reads_real_sets_and_bytearrays() -> None:
    """The bound is on size, not on kind: ordinary sets and bytearrays still unpickle."""
    import pickle

    from unickpt.adapters.torch_archive import loads_restricted

    obj = {"s": set(range(1000)), "f": frozenset("ab"), "b": bytearray(b"xyz" * 100)}
    for protocol in (3, 4, 5):
        assert loads_restricted(pickle.dumps(obj, protocol=protocol), "x") == obj
    with pytest.raises(UnsafePickleError, match="builds a bytearray of 1500000000"):
        loads_restricted(BYTEARRAY_PICKLE, "x")
