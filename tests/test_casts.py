"""Loading into a target of another dtype than the saved one (issue 29, item 4).

* every exact widening of ``unickpt.format.dtypes.WIDENINGS`` loads, bitwise in value: the
  loaded tensor equals torch's own cast of the saved one, and casting it back gives the
  saved bits (every bit pattern of the 8- and 16-bit dtypes, NaNs and infinities included;
  a sample plus the extremes of the 32-bit ones);
* every other pair of different dtypes is refused by default with a MismatchError naming
  both dtypes, and loads with ``cast="any"`` as torch's ``copy_`` casts;
* ``cast="none"`` refuses even a widening; an unknown ``cast`` is an UnickptError;
* the cast happens on every target layout: a whole tensor, a strided view, a flat shard
  (``Sharded``), a per-rank tensor filled in place, and span by span (spans much smaller
  than the tensor).
"""

from __future__ import annotations

import pytest
import torch

import unickpt
from unickpt.api.load import load
from unickpt.engine.state import PerRank
from unickpt.format.dtypes import WIDENINGS, dtype_from_name
from unickpt.plan.box import Box
from unickpt.plan.piece import box_piece

NAMES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL"]


def _every_value(name: str) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit dtype; for wider ones random bits plus the
    extremes (and, for floats, the specials) of the dtype."""
    dtype = dtype_from_name(name)
    if dtype == torch.bool:
        return torch.tensor([False, True, True, False])
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 1:
        return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype)
    if size == 2:
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.Generator().manual_seed(size)
    bits = torch.randint(-(1 << 31), 1 << 31, (4096 * size // 4,), dtype=torch.int32, generator=g).view(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        extra = torch.tensor([info.max, info.min, info.tiny, info.smallest_normal / 2, 0.0, -0.0, float("inf"),
                              float("-inf"), float("nan")], dtype=torch.float64).to(dtype)
    else:  # the signed extremes, 0, 1 and -1 as bits: the unsigned extremes too
        signed = {4: torch.int32, 8: torch.int64}[size]
        info = torch.iinfo(signed)
        extra = torch.tensor([info.max, info.min, 0, 1, -1], dtype=signed).view(dtype)
    return torch.cat([bits, extra])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (a cast need not keep a NaN's payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        nan_a, nan_b = a.float().isnan(), b.float().isnan()  # float(): fp8 has no isnan of its own
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = a[~nan_a], b[~nan_b]
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """One checkpoint holding a tensor of every dtype (``t.<name>``)."""
    values = {name: _every_value(name) for name in NAMES}
    path = str(tmp_path_factory.mktemp("casts") / "ckpt")
    unickpt.save({"t": dict(values)}, path)
    return path, values


@pytest.mark.parametrize("pair", [(s, t) for s, ts in WIDENINGS.items() for t in ts], ids="-".join)
def test_widening_is_exact(saved: tuple[str, dict[str, torch.Tensor]], pair: tuple[str, str]) -> None:
    path, values = saved
    src, dst = pair
    want = values[src]
    target = torch.zeros(want.shape, dtype=dtype_from_name(dst))
    load({"t": {src: target}}, path)
    assert _same_bits(target, want.to(target.dtype)), "the widened values differ from torch's own cast"
    assert _same_bits(target.to(want.dtype), want), "a widening lost bits: cast back, the saved values differ"


def test_every_other_cast_needs_cast_any(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    path, values = saved
    refused = 0
    for src in NAMES:
        for dst in NAMES:
            if dst == src or dst in WIDENINGS.get(src, ()):
                continue
            want = values[src]
            dtype = dtype_from_name(dst)
            target = torch.zeros(want.shape, dtype=dtype)
            with pytest.raises(unickpt.MismatchError) as e:
                load({"t": {src: target}}, path)
            assert f"saved dtype {want.dtype}, target dtype {dtype}" in str(e.value) and "cast='any'" in str(e.value)
            assert not target.any(), "a refused load wrote into the target"
            load({"t": {src: target}}, path, cast="any")
            assert _same_bits(target, want.to(dtype)), f"{src} -> {dst}: cast='any' differs from torch's cast"
            refused += 1
    assert refused == 15 * 14 - sum(map(len, WIDENINGS.values()))


def test_cast_none_refuses_widening_and_bad_cast(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    path, values = saved
    target = torch.zeros(values["BF16"].shape, dtype=torch.float32)
    with pytest.raises(unickpt.MismatchError, match=r"saved dtype torch.bfloat16, target dtype torch.float32: a different dtype"):
        load({"t": {"BF16": target}}, path, cast="none")
    with pytest.raises(unickpt.UnickptError, match="cast='widest'"):
        load({"t": {"BF16": target}}, path, cast="widest")


def test_cast_on_every_layout(tmp_path) -> None:
    """Strided target, flat shard, per-rank tensor, and spans far smaller than the tensor."""
    full = torch.randn(64, 48).to(torch.bfloat16)
    rng = torch.arange(10, dtype=torch.int32)
    path = str(tmp_path / "c")
    unickpt.save({"w": full, "rng": PerRank(rng)}, path)
    # a strided (transposed) fp32 view as the target
    store = torch.zeros(48, 64, dtype=torch.float32)
    rank_target = torch.zeros(10, dtype=torch.int64)
    out = load({"w": store.t(), "rng": PerRank(rank_target)}, path)
    assert torch.equal(store.t(), full.float()) and out["rng"].value is rank_target
    assert torch.equal(rank_target, rng.long())
    # rows 10-29 of the global tensor, as a flat fp64 shard
    local = torch.zeros(20, 48, dtype=torch.float64)
    load({"w": unickpt.Sharded(local, (64, 48), [box_piece((20, 48), Box((0, 0), (20, 48)), Box((10, 0), (20, 48)))])}, path)
    assert torch.equal(local, full[10:30].double())
    # a per-rank tensor filled in place is held to the same rule
    with pytest.raises(unickpt.MismatchError, match="saved dtype torch.int32, target dtype torch.int16"):
        load({"rng": PerRank(torch.zeros(10, dtype=torch.int16))}, path)
    # span by span: the read cut into spans of 4 KiB (checksum blocks) is cast piece by piece
    from unickpt.engine.tensor_reads import read_tensors
    from unickpt.storage.open import open_storage

    big = torch.randn(300, 1000).to(torch.float16)
    unickpt.save({"big": big}, str(tmp_path / "big"))
    entry = unickpt.read_manifest(str(tmp_path / "big")).tensors["big"]
    into = torch.zeros(300, 1000, dtype=torch.float32)
    storage = open_storage(str(tmp_path / "big"))
    try:
        read_tensors(storage, [(entry, into)], span_bytes=4096)
    finally:
        storage.close()
    assert torch.equal(into, big.float())


def test_cast_reads_through_bounded_scratch(tmp_path) -> None:
    """A tensor cast on load goes through scratch memory of at most CAST_SPAN bytes, not
    a copy of its whole saved bytes (32 MiB of bf16 here)."""
    from unickpt.engine.tensor_reads import CAST_SPAN, TensorReads
    from unickpt.plan.piece import whole_piece
    from unickpt.storage.open import open_storage

    saved = torch.randn(2048, 8192).to(torch.bfloat16)
    unickpt.save({"w": saved}, str(tmp_path / "c"))
    entry = unickpt.read_manifest(str(tmp_path / "c")).tensors["w"]
    into = torch.empty(2048, 8192, dtype=torch.float32)
    reads = TensorReads(open_storage(str(tmp_path / "c")), threads=1)  # one thread: the scratch is this one's
    try:
        reads.add(entry, into, [whole_piece(entry.shape)])
        reads.run()
    finally:
        reads.storage.close()
    assert torch.equal(into, saved.float())
    assert 0 < len(reads.scratch.buf) <= CAST_SPAN < saved.numel() * 2
