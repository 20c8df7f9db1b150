"""Writers of many whole files (the DeepSpeed universal writer): files made durable
together, bounded memory with several writer threads, checksums verified on the direct
read path, nothing committed after a failure."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
import zipfile

import pytest
import torch

import unickpt
from unickpt.adapters.deepspeed_writer import _ByteBudget, write_universal
from unickpt.errors import SaveError
from unickpt.storage.files import DurableBatch


def _adam_state(tmp_path):
    """A unickpt checkpoint with torch-native model/optimizer names: tensors below and
    above a 1 MiB checksum block, one of them bf16 (cast to fp32 by the writer)."""
    g = torch.Generator().manual_seed(3)
    model = {"big": torch.randn(700, 1000, generator=g), "small": torch.randn(17, generator=g),
             "half": torch.randn(300, 301, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 4)}
    optim = {n: {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g), "step": 5}
             for n, t in model.items()}
    unickpt.save({"model": model, "optim": {"state": optim}, "train": {"step": 5}}, str(tmp_path / "ck"), block_bytes=1 << 20)
    return model, optim


@pytest.mark.parametrize("threads,budget", [(1, 256 << 20), (3, 1 << 20)])
def test_write_universal_is_exact_with_any_threads_and_budget(tmp_path, threads, budget) -> None:
    model, optim = _adam_state(tmp_path)
    out = tmp_path / "uni" / "tag"
    report = write_universal(str(tmp_path / "ck"), str(out), threads=threads, max_bytes_in_flight=budget)
    assert report.params == 4 and report.step == 5
    for n, t in model.items():
        fp32 = torch.load(out / "zero" / n / "fp32.pt", weights_only=True)["param"]
        assert fp32.dtype == torch.float32 and torch.equal(fp32, t.float())
        for key in ("exp_avg", "exp_avg_sq"):
            saved = torch.load(out / "zero" / n / f"{key}.pt", weights_only=True)["param"]
            # a tensor whose memory was reused for the next file would be saved whole: the
            # file must hold exactly this tensor's bytes
            assert torch.equal(saved, optim[n][key]) and saved.untyped_storage().nbytes() == t.numel() * 4
        assert torch.load(out / "zero" / n / "step.pt", weights_only=True).item() == 5.0
        # files of 1 MiB and more are written whole from one image (O_DIRECT): their tensor starts
        # on a 4 KiB boundary; the others on torch.save's 64 bytes; torch.load maps both
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = out / "zero" / n / f"{key}.pt"
            at = _data_offset(path)
            assert at % (4096 if t.numel() * 4 >= 1 << 20 else 64) == 0, (path, at)
            assert torch.equal(torch.load(path, weights_only=True, mmap=True)["param"],
                               t.float() if key == "fp32" else optim[n][key])
    assert (tmp_path / "uni" / "latest_universal").read_text() == "tag"
    assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")]


def _data_offset(path) -> int:
    """Where the tensor data record's bytes start in a torch.save archive."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        info = z.getinfo("archive/data/0")
        f.seek(info.header_offset)
        head = struct.unpack("<4s2B4HL2L2H", f.read(30))
        return info.header_offset + 30 + head[-2] + head[-1]


@pytest.mark.parametrize("aligned", [True, False])
def test_write_whole_direct_or_not(tmp_path, aligned: bool) -> None:
    """A file written whole from page-aligned memory (O_DIRECT, its rounding to 4 KiB
    truncated away) or from unaligned memory (the direct write refused with EINVAL on this
    file system, written through the page cache instead): the same bytes either way."""
    size = (3 << 20) + 123
    image = mmap.mmap(-1, size + 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    payload = os.urandom(size + 4096)
    image[: len(payload)] = payload
    view = memoryview(image)[: size + 4096 - size % 4096] if aligned else memoryview(bytearray(payload))[1:]
    want = bytes(view[:size])
    batch = DurableBatch(tmp_path / "out")
    batch.write_whole("d/file.bin", view, size)
    batch.commit()
    assert (tmp_path / "out" / "d" / "file.bin").read_bytes() == want
    assert not [f for _, _, fs in os.walk(tmp_path / "out") for f in fs if f.endswith(".tmp")]


def test_corrupt_source_fails_and_commits_nothing(tmp_path) -> None:
    _adam_state(tmp_path)
    m = unickpt.read_manifest(str(tmp_path / "ck"))
    frag = m.tensors["optim.state.big.exp_avg"].fragments[0]
    f = tmp_path / "ck" / frag.file
    data = bytearray(f.read_bytes())
    data[frag.offset + 2_000_000] ^= 0x10  # in the second checksum block, read straight into the tensor
    f.write_bytes(bytes(data))
    with pytest.raises(unickpt.CorruptionError, match="checksum mismatch.*optim.state.big.exp_avg"):
        write_universal(str(tmp_path / "ck"), str(tmp_path / "uni" / "tag"), threads=3)
    assert not (tmp_path / "uni" / "latest_universal").exists()
    assert not [p for p, _, fs in os.walk(tmp_path / "uni") for f in fs if f.endswith(".tmp")]


def test_durable_batch_files_appear_whole_or_not_at_all(tmp_path) -> None:
    batch = DurableBatch(tmp_path / "root", threads=2)
    with batch.file("a/b/one.bin") as f:
        f.write(b"x" * 5000)
    with pytest.raises(RuntimeError):
        with batch.file("a/two.bin") as f:
            f.write(b"partial")
            raise RuntimeError("writer failed")
    with pytest.raises(SaveError, match="inside"):
        with batch.file("../escape.bin"):
            pass
    batch.commit()
    assert (tmp_path / "root" / "a" / "b" / "one.bin").read_bytes() == b"x" * 5000
    assert sorted(os.listdir(tmp_path / "root" / "a")) == ["b"]  # no two.bin, no temporary file
    assert not (tmp_path / "escape.bin").exists()


def test_byte_budget_bounds_what_is_held_and_lets_a_large_item_run_alone() -> None:
    budget = _ByteBudget(100)
    held = 0
    seen: list[int] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        nonlocal held
        with budget.hold(n):
            with lock:
                held += n
                seen.append(held)
            time.sleep(0.01)
            with lock:
                held -= n

    threads = [threading.Thread(target=work, args=(n,)) for n in [40, 40, 40, 250, 40, 60, 30]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # within the budget at every moment, except the item larger than it, which ran alone
    assert len(seen) == 7 and all(v <= 100 or v == 250 for v in seen) and 250 in seen
    assert budget.used == 0
