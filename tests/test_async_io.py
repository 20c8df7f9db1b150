"""The I/O path of issue 5 (async save and fast I/O): scatter reads straight into target
tensors, checksums over scattered bytes, coalesced reads, batched writes, and the
optional read-once-and-broadcast of replicated tensors. No timing assertions here."""

from __future__ import annotations

import os

import pytest
import torch

import unickpt
from unickpt.api.load import load_into
from unickpt.engine.tensor_reads import TensorReads
from unickpt.engine.reads import Segment, SpanRead, coalesce, crc_blocks, fill_gaps
from unickpt.engine.staging import plan_batches
from unickpt.format.checksum import crc32c

from forked import run_forked


def test_fill_gaps_and_crc_over_segments():
    data = torch.arange(100, dtype=torch.uint8)
    direct = [Segment(30, 50, data[30:50].clone()), Segment(10, 20, data[10:20].clone())]
    segs = fill_gaps(100, direct)
    assert [(s.start, s.stop) for s in segs] == [(0, 10), (10, 20), (20, 30), (30, 50), (50, 100)]
    for s in segs:
        if s.target is None:
            s.view()[:] = data[s.start : s.stop].numpy().tobytes()
    bounds = [(0, 16), (16, 48), (48, 100)]
    assert crc_blocks(segs, bounds) == [crc32c(data[a:b].numpy().tobytes()) for a, b in bounds]
    assert fill_gaps(100, [Segment(0, 20, data[:20]), Segment(10, 30, data[10:30])]) is None


def test_coalesce_merges_only_touching_reads_of_a_file():
    def r(f, off, n):
        return SpanRead(f, off, n, [], lambda _: None)

    groups = coalesce([r("b", 0, 10), r("a", 10, 5), r("a", 0, 10), r("a", 16, 4), r("b", 10, 1)])
    assert [[(x.file, x.offset) for x in g] for g in groups] == [[("a", 0), ("a", 10)], [("a", 16)], [("b", 0), ("b", 10)]]


def test_plan_batches_respects_the_cap_and_block_boundaries():
    sizes, staged = [1000, 0, 300, 64], [True, True, False, True]
    batches, cap = plan_batches(sizes, staged, None, 64)
    assert len(batches) == 1 and cap >= 1000 + 64
    batches, cap = plan_batches(sizes, staged, 256, 64)
    assert cap == 256
    for b in batches:
        assert sum(-(-(u.hi - u.lo) // 64) * 64 for u in b if u.slot >= 0) <= cap
        assert all(u.lo % 64 == 0 for u in b)
    covered = {}
    for b in batches:
        for u in b:
            covered.setdefault(u.index, []).append((u.lo, u.hi))
    assert covered[0][0][0] == 0 and covered[0][-1][1] == 1000 and covered[2] == [(0, 300)]


def _state():
    g = torch.Generator().manual_seed(3)
    sd = {f"small{k}": torch.randn(k + 1, generator=g) for k in range(40)}  # many tiny fragments
    sd["big"] = torch.randn(300, 50, generator=g)
    sd["half"] = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    return sd


def test_direct_reads_into_targets_and_buffered_fallback(tmp_path):
    sd = _state()
    unickpt.save(sd, str(tmp_path / "c"), block_bytes=256)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    out["big"] = torch.zeros(50, 300).t()  # non-contiguous target: read through a buffer
    stats = {}
    unickpt.load(out, str(tmp_path / "c"), stats=stats)
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    # the public edge's dict: this rank's LoadRecord, converted once
    assert stats == {"bytes_read": sum(v.nbytes for v in sd.values()), "files_read": ["rank_00000.safetensors"]}
    # the contiguous targets are read in place: no scratch buffer in their spans
    m = unickpt.read_manifest(str(tmp_path / "c"))
    from unickpt.plan.piece import whole_piece
    from unickpt.storage.local import LocalStorage

    reader = TensorReads(LocalStorage(str(tmp_path / "c")), 2, True)
    target = torch.zeros(300, 50)
    reader.add(m.tensors["big"], target, [whole_piece((300, 50))])
    reads = [reader.span_read(e, sp, t) for e, sp, t in reader.jobs]
    assert all(s.target is not None for r in reads for s in r.segments)


def test_corruption_is_caught_in_direct_reads(tmp_path):
    sd = _state()
    path = tmp_path / "c"
    unickpt.save(sd, str(path), block_bytes=256)
    frag = unickpt.read_manifest(str(path)).tensors["big"].fragments[0]
    with open(path / frag.file, "r+b") as f:
        f.seek(frag.offset + 1000)
        b = f.read(1)
        f.seek(frag.offset + 1000)
        f.write(bytes([b[0] ^ 1]))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(unickpt.CorruptionError, match=r"rank_00000\.safetensors.*'big'"):
        unickpt.load(out, str(path))


def test_resharded_partial_reads_verify_and_match(tmp_path):
    from unickpt import Sharded
    from unickpt.plan.box import Box
    from unickpt.plan.piece import box_piece

    full = torch.randn(40, 12)
    unickpt.save({"w": full}, str(tmp_path / "c"), block_bytes=64)
    for rows, cols in [((5, 17), (0, 12)), ((3, 9), (4, 7)), ((0, 40), (0, 12))]:
        box = Box((rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0]))
        local = torch.zeros(box.lengths)
        piece = box_piece(box.lengths, Box((0, 0), box.lengths), box)
        unickpt.load({"w": Sharded(local, (40, 12), [piece])}, str(tmp_path / "c"))
        assert torch.equal(local, full[rows[0] : rows[1], cols[0] : cols[1]])


def broadcast_load(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    sd = {f"p{k}": torch.full((1000 + k,), float(k)) for k in range(8)}
    if rank == 0:
        unickpt.save(sd, os.path.join(root, "c"), process_group=dist.new_group([0]))
    else:
        dist.new_group([0])
    dist.barrier()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    record = load_into(out, os.path.join(root, "c"), broadcast_replicated=True)
    for k in sd:
        assert torch.equal(out[k], sd[k]), (rank, k)
    total = sum(v.nbytes for v in sd.values())
    assert 0 < record.bytes_read < total, (rank, record)  # each rank reads only its share
    # a rank that fails to read makes every rank raise (nobody waits in a broadcast)
    if rank == 0:
        c = os.path.join(root, "c")
        m = unickpt.read_manifest(c)
        for name, e in m.tensors.items():
            f = e.fragments[0]
            with open(os.path.join(c, f.file), "r+b") as fh:
                fh.seek(f.offset)
                fh.write(b"\xff\xff\xff\xff")
    dist.barrier()
    with pytest.raises(unickpt.UnickptError):
        unickpt.load(out, os.path.join(root, "c"), broadcast_replicated=True)


@pytest.mark.multiprocess
def test_broadcast_replicated_reads_once_per_group(tmp_path):
    run_forked(broadcast_load, 2, str(tmp_path))
