"""The torch-free ``torch.save`` writer (adapters/torch_save.py) and the torch-free archive
reader (adapters/torch_archive.py), against real torch.

* ``dumps`` writes the same ``data.pkl`` bytes as ``torch.save`` for the same objects
  (every dtype DeepSpeed uses and the others with a typed storage, 0-d and empty tensors,
  nested dicts, ``OrderedDict``, ``torch.Size``, sets, objects met twice, large and
  negative integers, more than 1000 items in a container);
* ``write_archive``'s files load with ``torch.load`` (plain, ``weights_only=True``,
  ``mmap=True``) into what ``torch.save``'s files load into, with and without CRCs and
  zip64 records; every record's data is 64-byte aligned; ``zipfile`` finds the CRCs right;
  unickpt's own reader finds every tensor;
* without torch imported, the reader turns torch's globals into stand-ins, still refuses
  globals off its allow-list, and never imports torch.
"""

from __future__ import annotations

import collections
import io
import math
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from unickpt.adapters.torch_archive import read_archive, stored_tensors
from unickpt.adapters.torch_save import Size, TensorData, dumps, write_archive
from unickpt.errors import LayoutError
from unickpt.format.dtypes import dtype_name
from unickpt.storage.local import LocalStorage

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        t = torch.randint(0, 2 if dt == torch.bool else 100, (3, 5), generator=g).to(dt)
        if dt.is_floating_point:
            t = torch.randn(3, 5, generator=g).to(dt)
        out[str(dt).removeprefix("torch.")] = t
    out["scalar"] = torch.tensor(4.0)  # 0-d, as DeepSpeed's step
    out["empty"] = torch.empty(0)
    out["empty_2d"] = torch.empty(2, 0, dtype=torch.bfloat16)
    out["one"] = torch.ones(1, 1, 1, dtype=torch.int64)
    out["special"] = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45])
    return out


_TENSORS = _tensors()


def _state(tensor, size) -> dict:
    """A nested state like DeepSpeed's, built with ``tensor(t)`` and ``size(dims)``."""
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "name": "grüppe"}]
    tensors = _TENSORS
    return {
        "cat_dim": 0,
        "param": tensor(tensors["float32"]),
        "by_dtype": {k: tensor(v) for k, v in tensors.items()},
        "param_groups": groups,
        "optimizer_state_dict": {"state": {0: {"step": tensor(tensors["scalar"])}}, "param_groups": groups},
        "param_shapes": [collections.OrderedDict((f"layers.{i}.w", size((i + 1, 7))) for i in range(3))],
        "scalar_size": size(()),
        "empty": collections.OrderedDict(),
        "sets": (set(), {3, 1, 2}),
        "ints": [0, 255, 256, 65535, 65536, -1, -(1 << 31), (1 << 31) - 1, 1 << 31, 1 << 64, -(1 << 64), -129, 2 ** 63 - 1],
        "floats": [0.0, -0.0, 1.5, 1e300],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4, 5)],
        "many": {i: [i, str(i)] for i in range(1203)},
        "none": None, "flags": [True, False],
        "unicode_Ω": "väl",
    }


_DATA: dict[int, tuple[torch.Tensor, TensorData]] = {}


def _data(t: torch.Tensor) -> TensorData:
    """The TensorData of ``t``: the same object for the same tensor (a tensor held twice is
    pickled once and referenced, by torch.save and by dumps)."""
    if id(t) not in _DATA:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        _DATA[id(t)] = (t, TensorData(dtype_name(t.dtype), tuple(t.shape), raw))
    return _DATA[id(t)][1]


def _same(a, b, path: str = "") -> None:
    """Deep equality as torch.load returns things: types, keys in order, tensors bitwise
    with dtype, shape, stride and storage offset."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset()), path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def test_pickle_is_byte_for_byte_torch_saves() -> None:
    ref = io.BytesIO()
    torch.save(_state(lambda t: t, torch.Size), ref)
    with zipfile.ZipFile(ref) as z:
        theirs = z.read("archive/data.pkl")
    ours, storages = dumps(_state(_data, Size))
    assert ours == theirs
    assert len(storages) == len(_TENSORS)  # param and step are tensors of by_dtype, written once


def _record_offsets(path: str) -> dict[str, int]:
    """Where each record's data starts, from its local header."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset)
            head = struct.unpack("<4s2B4HL2L2H", f.read(30))
            out[i.filename] = i.header_offset + 30 + head[-2] + head[-1]
    return out


@pytest.mark.parametrize("crc,zip64", [(True, False), (False, False), (True, True)])
def test_archive_loads_in_torch_as_torch_saves(tmp_path, crc: bool, zip64: bool) -> None:
    ref_path, path = str(tmp_path / "ref.pt"), str(tmp_path / "ours.pt")
    torch.save(_state(lambda t: t, torch.Size), ref_path)
    with open(path, "wb") as f:
        n = write_archive(f, _state(_data, Size), crc=crc, force_zip64=zip64)
    assert n == os.path.getsize(path)
    for kwargs in ({"weights_only": True}, {"weights_only": True, "mmap": True}, {"weights_only": False}):
        got, want = torch.load(path, **kwargs), torch.load(ref_path, **kwargs)
        _same(got, want)
        assert got["param_groups"] is got["optimizer_state_dict"]["param_groups"]  # shared, as saved
    offsets = _record_offsets(path)
    assert len(offsets) == 6 + len(_TENSORS) and all(at % 64 == 0 for at in offsets.values())
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None or not crc  # every CRC right (without crc, records of 1 MiB+ have none)
    # unickpt's own reader finds each tensor's bytes where torch does
    obj = read_archive(LocalStorage(str(tmp_path)), "ours.pt")
    stored = {(t.shape, t.dtype) for t in stored_tensors(obj)}
    assert ((3, 5), "BF16") in stored and ((), "F32") in stored and ((2, 0), "BF16") in stored


def test_large_records_skip_crc_only_when_asked(tmp_path) -> None:
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    for crc in (True, False):
        path = tmp_path / f"big_{crc}.pt"
        with open(path, "wb") as f:
            write_archive(f, {"param": _data(big)}, crc=crc)
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("archive/data/0")
            assert (info.CRC != 0) == crc
        assert torch.equal(torch.load(path, weights_only=True, mmap=True)["param"], big)


def test_refuses_what_it_cannot_write() -> None:
    with pytest.raises(LayoutError, match="F8_E4M3"):
        dumps({"x": TensorData("F8_E4M3", (2,), b"\0\0")})
    with pytest.raises(LayoutError, match="bytes for shape"):
        dumps({"x": TensorData("F32", (2,), b"\0" * 4)})
    with pytest.raises(LayoutError, match="bytes"):
        dumps({"x": b"raw"})  # protocol 2 has no bytes opcode torch.load accepts with weights_only


_NO_TORCH = r"""
import sys
from unickpt.adapters.torch_archive import TorchName, read_archive
from unickpt.errors import UnsafePickleError
from unickpt.storage.local import LocalStorage
s = LocalStorage(sys.argv[1])
obj = read_archive(s, "values.pt")
assert obj["dtype"] == "torch.bfloat16" and isinstance(obj["dtype"], TorchName), obj
assert obj["size"] == (2, 3) and type(obj["size"]) is tuple, obj
assert obj["device"] == "cpu", obj
t8 = obj["t8"]  # _rebuild_tensor_v3: a byte storage and the dtype as a global
assert (t8.dtype, t8.shape) == ("F8_E4M3", (4,)), t8
t = obj["t"]
assert (t.dtype, t.shape, t.stride) == ("BF16", (2, 3), (3, 1)), t
for name, refused in (("hostile.pt", "os.system"), ("hostile_torch.pt", "torch.save")):
    try:
        read_archive(s, name)
    except UnsafePickleError as e:
        assert refused in str(e), e
    else:
        raise AssertionError(f"{refused} was unpickled")
print("torch" in sys.modules)
"""


@pytest.mark.multiprocess
def test_archive_reader_without_torch(tmp_path) -> None:
    torch.save({"dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu"),
                "t8": torch.zeros(4, dtype=torch.float8_e4m3fn), "t": torch.zeros(2, 3, dtype=torch.bfloat16)}, tmp_path / "values.pt")
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    with zipfile.ZipFile(buf) as z:
        pkl = z.read("archive/data.pkl").replace(b"}q\x00X\x01", b"cos\nsystem\nq\x00X\x01", 1)
    with zipfile.ZipFile(tmp_path / "hostile.pt", "w") as z:
        z.writestr("archive/data.pkl", pkl)
    with zipfile.ZipFile(tmp_path / "hostile_torch.pt", "w") as z:  # torch's globals: only data types
        z.writestr("archive/data.pkl", pkl.replace(b"cos\nsystem\n", b"ctorch\nsave\n"))
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": SRC}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"  # torch was never imported
