"""Whole tensors assembled as bytes without torch (engine/byte_reads.py), against the
torch reader of the same entries (engine/tensor_reads.read_entry).

The fragments are real bytes in a real file: ZeRO-style flat partitions of a whole
tensor (straight into the target's memory) and flat partitions of tensor-parallel column
shards (copied through scratch), with CRC-32C blocks small enough to cut spans, and a
flipped byte that must be named."""

from __future__ import annotations

import pytest
import torch

from unickpt.engine.byte_reads import read_whole
from unickpt.engine.tensor_reads import read_entry
from unickpt.errors import CorruptionError
from unickpt.format.checksum import block_crcs
from unickpt.format.dtypes import dtype_name
from unickpt.format.manifest import Fragment, TensorEntry
from unickpt.plan.box import Box
from unickpt.plan.piece import flat_pieces
from unickpt.storage.local import LocalStorage

BLOCK = 64


def _write(path, parts: list[tuple[Box, torch.Tensor, list[tuple[int, int]]]], dtype: torch.dtype,
           shape: tuple[int, ...]) -> TensorEntry:
    """Store each box's elements (row-major within the box) as flat slices ``[start, stop)``,
    one fragment per slice, 40 bytes of junk between fragments."""
    fragments, blob = [], bytearray()
    for box, data, cuts in parts:
        flat = data.contiguous().reshape(-1)
        for rank, (start, stop) in enumerate(cuts):
            blob += b"\xee" * 40
            raw = flat[start:stop].view(torch.uint8).numpy().tobytes()
            fragments.append(Fragment("data.bin", len(blob), (stop - start,), flat_pieces(box, start, stop),
                                      block_crcs(memoryview(raw), BLOCK), BLOCK, rank))
            blob += raw
    path.write_bytes(bytes(blob))
    return TensorEntry("w", shape, dtype_name(dtype), fragments, "test")


def _cases(g: torch.Tensor) -> dict[str, list]:
    rows, cols = g.shape
    left, right = g[:, :4], g[:, 4:]
    return {
        "zero_flat": [(Box.whole(g.shape), g, [(0, 17), (17, 41), (41, rows * cols)])],
        "tp_columns": [(Box((0, 0), (rows, 4)), left, [(0, 9), (9, rows * 4)]),
                       (Box((0, 4), (rows, cols - 4)), right, [(0, 30), (30, rows * (cols - 4))])],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("case", ["zero_flat", "tp_columns"])
def test_whole_tensor_as_bytes_equals_torch_read(tmp_path, dtype: torch.dtype, case: str) -> None:
    g = (torch.randn(6, 10, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    entry = _write(tmp_path / "data.bin", _cases(g)[case], dtype, tuple(g.shape))
    storage = LocalStorage(str(tmp_path))
    want = g.contiguous().view(torch.uint8).numpy().tobytes()
    for span in (BLOCK, 1 << 20):  # spans cut at every block, and one span per fragment
        out = bytearray(entry.nbytes)
        n = read_whole(storage, [(entry, out)], span)
        assert bytes(out) == want and n >= entry.nbytes
    assert torch.equal(read_entry(storage, entry), g)


def test_flipped_byte_is_named(tmp_path) -> None:
    g = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    entry = _write(tmp_path / "data.bin", _cases(g)["tp_columns"], torch.float32, (6, 10))
    raw = bytearray((tmp_path / "data.bin").read_bytes())
    at = entry.fragments[2].offset + 5
    raw[at] ^= 1
    (tmp_path / "data.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum mismatch in data.bin"):
        read_whole(LocalStorage(str(tmp_path)), [(entry, bytearray(entry.nbytes))], 1 << 20)
    out = bytearray(entry.nbytes)
    read_whole(LocalStorage(str(tmp_path)), [(entry, out)], 1 << 20, verify=False)  # read as stored, unchecked
    assert bytes(out) != g.numpy().tobytes()
