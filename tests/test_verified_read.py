"""The one verified read (unickpt.engine.reads.execute) on real files: bytes land in caller
buffers, every checksum block is checked, a flipped byte and a truncated or missing file
are caught and named (raised for load, recorded for verify), and the same primitive serves
load, load_tensor, convert and verify."""

from __future__ import annotations

import os

import pytest
import torch

import unickpt
from unickpt.engine.reads import Segment, SpanRead, block_checks, execute
from unickpt.errors import CorruptionError
from unickpt.format.checksum import block_crcs
from unickpt.storage.local import FileReader, LocalStorage, MappedReader
from unickpt.storage.open import open_storage

BLOCK = 256


class _PiecesStorage(LocalStorage):
    """Files read with ``preadv`` (``kind``) in pieces of 100 bytes: pieces that cut
    checksum blocks and caller buffers anywhere (a large read's path, which these small
    files would not take at the usual 1 MiB)."""

    kind = FileReader

    def reader(self, name):
        with self._lock:
            r = self._readers.get(name)
            if r is None:
                r = self._readers[name] = self.kind(self.root / name)
                r.piece_bytes = 100
            return r


class _MappedStorage(_PiecesStorage):
    """Files read through MappedReader, copied and checked in pieces of 100 bytes."""

    kind = MappedReader


@pytest.fixture(params=["preadv", "preadv-pieces", "mapped"])
def opened(request):
    """How the tests open their directory: ordinary ``preadv`` reads (one a group at these
    sizes), ``preadv`` in pieces, or a map read in pieces."""
    return {"preadv": lambda p: open_storage(str(p)), "preadv-pieces": lambda p: _PiecesStorage(str(p)),
            "mapped": lambda p: _MappedStorage(str(p))}[request.param]


def _file(tmp_path, nbytes: int = 4096) -> tuple[bytes, list[int]]:
    data = bytes((i * 7 + 3) % 251 for i in range(nbytes))
    (tmp_path / "f.bin").write_bytes(data)
    return data, block_crcs(memoryview(data), BLOCK)


def _reads(data: bytes, crcs: list[int], spans: list[tuple[int, int]], target: bytearray | None = None) -> list[SpanRead]:
    """Span reads of blocks [b0, b1) of f.bin, into ``target`` (at the same offsets) or scratch."""
    out = []
    for b0, b1 in spans:
        start, stop = b0 * BLOCK, min(len(data), b1 * BLOCK)
        seg = Segment(0, stop - start, memoryview(target)[start:stop] if target is not None else None)
        out.append(SpanRead("f.bin", start, stop - start, [seg], tensor="t",
                            checks=block_checks(crcs, BLOCK, len(data), start, b0, b1)))
    return out


def test_reads_land_in_caller_buffers_and_are_checked(tmp_path, opened):
    data, crcs = _file(tmp_path)
    storage = opened(tmp_path)
    target = bytearray(len(data))
    reads = _reads(data, crcs, [(0, 3), (3, 7), (9, 16)], target)
    seen = []
    execute(storage, reads, threads=2, progress=seen.append)
    assert target[: 7 * BLOCK] == data[: 7 * BLOCK] and target[9 * BLOCK :] == data[9 * BLOCK :]
    assert target[7 * BLOCK : 9 * BLOCK] == bytes(2 * BLOCK)  # not planned: not read
    assert sum(seen) == len(data) - 2 * BLOCK  # touching spans were read as one group
    assert all(r.bytes_checked == r.nbytes for r in reads)


def test_segments_of_caller_memory_and_scratch_in_one_span(tmp_path, opened):
    """A span tiled by caller memory and scratch, read in pieces that cut both anywhere:
    every byte lands where planned and each block is checked once."""
    data, crcs = _file(tmp_path)
    storage = opened(tmp_path)
    a, b = bytearray(300), bytearray(len(data) - 700)
    got = {}
    segments = [Segment(0, 300, memoryview(a)), Segment(300, 700), Segment(700, len(data), memoryview(b))]
    read = SpanRead("f.bin", 0, len(data), segments, tensor="t", checks=block_checks(crcs, BLOCK, len(data), 0, 0, 16),
                    finish=lambda r: got.update(mid=bytes(r.segments[1].buffer)))
    execute(storage, [read])
    assert bytes(a) == data[:300] and got["mid"] == data[300:700] and bytes(b) == data[700:]
    assert read.bytes_checked == len(data)


def test_a_flipped_byte_is_raised_or_reported_with_file_tensor_and_bytes(tmp_path, opened):
    data, crcs = _file(tmp_path)
    with open(tmp_path / "f.bin", "r+b") as f:
        f.seek(5 * BLOCK + 17)
        f.write(bytes([data[5 * BLOCK + 17] ^ 0x10]))
    storage = opened(tmp_path)
    with pytest.raises(CorruptionError, match=rf"checksum mismatch in f\.bin \(tensor 't', bytes {5 * BLOCK}-{6 * BLOCK} "):
        execute(storage, _reads(data, crcs, [(0, 16)]))
    reads = _reads(data, crcs, [(0, 4), (4, 16)])
    execute(storage, reads, report=True)
    assert reads[0].problems == [] and reads[1].problems == [("checksum", 5 * BLOCK, 6 * BLOCK, "")]
    assert reads[1].bytes_checked == 11 * BLOCK


def test_a_truncated_or_missing_file_names_the_tensor(tmp_path, opened):
    data, crcs = _file(tmp_path)
    os.truncate(tmp_path / "f.bin", 10 * BLOCK + 5)
    storage = opened(tmp_path)
    with pytest.raises(CorruptionError, match=r"f\.bin is truncated \(tensor 't', bytes 2565-4096 .* has 2565 bytes"):
        execute(storage, _reads(data, crcs, [(8, 16)]))
    reads = _reads(data, crcs, [(8, 16)])
    execute(storage, reads, report=True)  # the blocks still inside are checked, the rest reported
    assert reads[0].bytes_checked == 2 * BLOCK
    assert [p[:3] for p in reads[0].problems] == [("truncated", b * BLOCK, (b + 1) * BLOCK) for b in range(10, 16)]
    os.unlink(tmp_path / "f.bin")
    storage.close()
    with pytest.raises(CorruptionError, match=r"f\.bin is missing.*tensor 't' needs bytes 0-"):
        execute(storage, _reads(data, crcs, [(0, 1)]))


def test_every_command_reads_through_it(tmp_path, monkeypatch):
    """load, load_tensor, convert and verify all reach the one primitive (and a truncated
    data file is named with its tensor by each)."""
    from unickpt.engine import reads as reads_module

    path = tmp_path / "c"
    unickpt.save({"w": torch.arange(4000, dtype=torch.float32), "b": torch.ones(3)}, str(path), block_bytes=BLOCK)
    calls = []
    real = reads_module.execute
    monkeypatch.setattr(reads_module, "execute", lambda *a, **k: calls.append(1) or real(*a, **k))
    import unickpt.engine.tensor_reads as tensor_reads
    import unickpt.api.verify as verify_module

    monkeypatch.setattr(tensor_reads, "execute", reads_module.execute)
    monkeypatch.setattr(verify_module, "execute", reads_module.execute)
    out = {"w": torch.zeros(4000), "b": torch.zeros(3)}
    unickpt.load(out, str(path))
    assert torch.equal(out["w"], torch.arange(4000, dtype=torch.float32)) and len(calls) == 1
    assert torch.equal(unickpt.load_tensor(str(path), "w"), out["w"]) and len(calls) == 2
    unickpt.convert(str(path), str(tmp_path / "u"))
    assert len(calls) >= 3
    n = len(calls)
    assert unickpt.verify(str(path)).ok and len(calls) == n + 1
    frag = unickpt.read_manifest(str(path)).tensors["w"].fragments[0]
    os.truncate(path / frag.file, frag.offset + 1000)
    with pytest.raises(CorruptionError, match=r"truncated \(tensor 'w'"):
        unickpt.load({"w": torch.zeros(4000)}, str(path))
    report = unickpt.verify(str(path))
    assert {(p.kind, p.tensor) for p in report.problems} >= {("truncated", "w")}


def test_a_location_is_opened_once(tmp_path, monkeypatch):
    """load, load_tensor, verify and convert turn the source path into storage once (and
    its manifest is parsed once), through open_storage."""
    import unickpt.adapters.checkpoint as checkpoint_module
    import unickpt.storage.open as open_module
    from unickpt.format.manifest import Manifest

    path = str(tmp_path / "c")
    unickpt.save({"w": torch.arange(100, dtype=torch.float32)}, path)
    opened, parsed = [], []
    real_open, real_parse = open_module.open_storage, Manifest.from_json
    monkeypatch.setattr(checkpoint_module, "open_storage", lambda loc, *a: opened.append(str(loc)) or real_open(loc, *a))
    monkeypatch.setattr(Manifest, "from_json", staticmethod(lambda *a, **k: parsed.append(1) or real_parse(*a, **k)))
    for call in (lambda: unickpt.load({"w": torch.zeros(100)}, path), lambda: unickpt.load_tensor(path, "w"),
                 lambda: unickpt.verify(path), lambda: unickpt.convert(path, str(tmp_path / "u"), overwrite=True)):
        opened.clear(), parsed.clear()
        call()
        assert opened == [path] and len(parsed) == 1


def test_a_memory_file_is_mapped_only_on_huge_pages(tmp_path):
    """memory_file_reader maps a file only where its file system reports a huge page as
    its block size (tmpfs with huge pages); elsewhere preadv, which is faster there."""
    from unickpt.storage.local import FileReader, memory_file_reader

    (tmp_path / "f.bin").write_bytes(b"x" * (4 << 20))
    reader = memory_file_reader(tmp_path / "f.bin")
    huge = os.stat(tmp_path / "f.bin").st_blksize >= 2 << 20
    assert isinstance(reader, MappedReader if huge else FileReader)
    out = bytearray(10)
    reader.pread_into(5, memoryview(out))
    assert bytes(out) == b"x" * 10
    reader.close()
    with pytest.raises(CorruptionError, match=r"g\.bin is missing"):
        memory_file_reader(tmp_path / "g.bin")


def test_a_large_tensor_is_read_in_pieces_bitwise_and_a_flipped_byte_is_named(tmp_path, monkeypatch):
    """A file read of two pieces or more (``FileReader.piece_bytes``, 1 MiB) into the
    target and into scratch (a cast): bitwise, and a byte flipped in its third MiB names
    the tensor and the block's bytes (checked while each piece was in the cache)."""
    w = torch.randn(3 << 18, generator=torch.Generator().manual_seed(0))  # 3 MiB of float32
    path = str(tmp_path / "c")
    unickpt.save({"w": w}, path)
    from unickpt.engine import reads as reads_module

    pieces = []
    real = reads_module.read_in_pieces
    monkeypatch.setattr(reads_module, "read_in_pieces", lambda *a: pieces.append(a[2]) or real(*a))
    out = {"w": torch.empty_like(w)}
    unickpt.load(out, path)
    assert torch.equal(out["w"], w)
    wide = {"w": torch.empty(w.shape, dtype=torch.float64)}  # through scratch: cast as read
    unickpt.load(wide, path)
    assert torch.equal(wide["w"], w.double())
    assert pieces and set(pieces) == {1 << 20}, pieces  # both loads took the path in pieces
    frag = unickpt.read_manifest(path).tensors["w"].fragments[0]
    at = frag.offset + (5 << 19) + 3  # 2.5 MiB in
    with open(os.path.join(path, frag.file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    for target in ({"w": torch.empty_like(w)}, {"w": torch.empty(w.shape, dtype=torch.float64)}):
        with pytest.raises(CorruptionError, match=r"checksum mismatch .*'w'"):
            unickpt.load(target, path)
    assert [p.kind for p in unickpt.verify(path).problems] == ["checksum"]
