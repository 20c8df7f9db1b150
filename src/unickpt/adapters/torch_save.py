"""Writing ``torch.save`` archives without importing torch.

DeepSpeed's universal checkpoint is one ``torch.save`` archive per parameter state, which
its loader opens with ``torch.load``; ``unickpt convert --to deepspeed`` writes them
without importing torch (whose import alone costs more than the whole conversion of a
1 GiB checkpoint should). No library writes this format without torch: Python's
``pickle.Pickler`` imports the module of every global it writes (``torch._utils``,
``torch``), and ``zipfile`` cannot align a record's data. So this module holds the two
small pieces by hand, as ``torch.save`` (protocol 2, torch 2.x) lays them out:

* :func:`dumps`: a pickle of plain data, ``collections.OrderedDict``, :class:`Size`
  (``torch.Size``) and :class:`TensorData` (a CPU tensor rebuilt by
  ``torch._utils._rebuild_tensor_v2`` from a typed storage named by a persistent id),
  opcode for opcode and memo entry for memo entry what Python's pickler writes under
  ``torch.save`` (the test compares the bytes): objects met twice are written once and
  referenced, so ``torch.load`` gives back the same sharing;
* :func:`archive` / :func:`write_archive`: the zip (``ZIP_STORED``) of ``torch.save``: ``data.pkl``,
  ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/<key>`` per storage,
  ``version``, ``.data/serialization_id``, every record's data aligned to 64 bytes (what
  ``torch.load(mmap=True)`` maps), zip64 records where sizes or offsets need them.

What ``torch.load`` (also ``weights_only=True`` and ``mmap=True``) returns from these files is
what it returns from ``torch.save`` of the same objects: tests/test_torch_save.py checks it.
"""

from __future__ import annotations

import collections
import secrets
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import LayoutError
from ..format.dtypes import DTYPE_ATTRS
from .torch_archive import STORAGE_DTYPES, Elements

try:  # ISA-L's CRC-32 (the zip one, as zlib's): about 5x zlib's speed here, the GIL released
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32

ALIGNMENT = 64  # torch.save's record alignment (kFieldAlignment)
# dtype name -> the typed storage class torch.save names (those the reader knows, for
# the dtypes unickpt stores)
_STORAGE_TYPES = {dtype: storage for storage, dtype in STORAGE_DTYPES.items() if dtype in DTYPE_ATTRS.values()}
_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_U32 = 0xFFFFFFFF


class Size(tuple):
    """Written as ``torch.Size`` (a tuple of ints)."""


@dataclass(frozen=True)
class TensorData(Elements):
    """A contiguous CPU tensor to write: its unickpt dtype name (``"F32"``, ``"BF16"``...),
    shape, and its bytes in row-major order (any buffer of exactly ``nbytes`` bytes)."""

    dtype: str
    shape: tuple[int, ...]
    data: Any


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a dimension of length 0
    counts as 1, as in ``torch.empty(2, 0).stride() == (1, 1)``)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return tuple(strides)


class _Pickler:
    """Protocol-2 opcodes for the types :func:`dumps` accepts, in the order and with the
    memo entries Python's ``pickle`` writes for them (so ``data.pkl`` is byte for byte
    what ``torch.save`` writes for the same objects)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[Any, int] = {}  # id(obj) or (module, name) of a global -> memo index
        self.size = 0  # memo entries written (some are never referenced again)
        self.keep: list[Any] = []  # objects memoized by id stay alive until the end
        self.storages: list[TensorData] = []

    def dump(self, obj: Any) -> None:
        if obj is None:
            self.out += b"N"
        elif obj is True or obj is False:
            self.out += b"\x88" if obj else b"\x89"
        elif isinstance(obj, int):
            self._int(obj)
        elif isinstance(obj, float):
            self.out += b"G" + struct.pack(">d", obj)
        elif id(obj) in self.memo:
            self._get(self.memo[id(obj)])
        elif isinstance(obj, str):
            raw = obj.encode("utf-8", "surrogatepass")
            self.out += b"X" + struct.pack("<L", len(raw)) + raw
            self._put(obj)
        elif isinstance(obj, TensorData):
            self._tensor(obj)
        elif isinstance(obj, Size):  # torch.Size.__reduce__: (torch.Size, (tuple(self),))
            self._global("torch", "Size")
            self._tuple(tuple(obj))
            self.out += b"\x85"
            self._put()
            self.out += b"R"
            self._put(obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, list):
            self.out += b"]"
            self._put(obj)
            self._batched(obj, pairs=False)
        elif isinstance(obj, collections.OrderedDict):
            self._global("collections", "OrderedDict")
            self.out += b")R"
            self._put(obj)
            self._batched(list(obj.items()), pairs=True)
        elif type(obj) is dict:
            self.out += b"}"
            self._put(obj)
            self._batched(list(obj.items()), pairs=True)
        elif type(obj) in (set, frozenset):  # protocol 2: (set, (list(obj),))
            self._global("__builtin__", type(obj).__name__)
            self.out += b"]"
            self._put()
            self._batched(list(obj), pairs=False)
            self.out += b"\x85"
            self._put()
            self.out += b"R"
            self._put(obj)
        else:
            raise LayoutError(f"cannot write a {type(obj).__name__} into a torch.save archive")

    def _int(self, n: int) -> None:
        if 0 <= n < 256:
            self.out += b"K" + bytes((n,))
        elif 0 <= n < 65536:
            self.out += b"M" + struct.pack("<H", n)
        elif -(1 << 31) <= n < (1 << 31):
            self.out += b"J" + struct.pack("<i", n)
        else:  # LONG1: little-endian two's complement, shortest form
            raw = n.to_bytes((n.bit_length() >> 3) + 1, "little", signed=True)
            if n < 0 and len(raw) > 1 and raw[-1] == 0xFF and raw[-2] & 0x80:
                raw = raw[:-1]
            if len(raw) > 255:
                raise LayoutError("an integer too large for a torch.save archive")
            self.out += b"\x8a" + bytes((len(raw),)) + raw

    def _global(self, module: str, name: str) -> None:
        key = (module, name)
        if key in self.memo:
            self._get(self.memo[key])
            return
        self.out += f"c{module}\n{name}\n".encode()
        self.memo[key] = self.size
        self._put()

    def _put(self, obj: Any = None) -> None:
        """Memoize the object just written (``obj`` None: one never referenced again)."""
        if obj is not None:
            self.memo[id(obj)] = self.size
            self.keep.append(obj)
        index, self.size = self.size, self.size + 1
        self.out += b"q" + bytes((index,)) if index < 256 else b"r" + struct.pack("<L", index)

    def _get(self, index: int) -> None:
        self.out += b"h" + bytes((index,)) if index < 256 else b"j" + struct.pack("<L", index)

    def _tuple(self, t: tuple) -> None:
        if not t:
            self.out += b")"
            return
        if len(t) <= 3:
            for x in t:
                self.dump(x)
            self.out += (b"\x85", b"\x86", b"\x87")[len(t) - 1]
        else:
            self.out += b"("
            for x in t:
                self.dump(x)
            self.out += b"t"
        self._put(t)

    def _batched(self, items: list, pairs: bool) -> None:
        for i in range(0, len(items), 1000):  # as pickle: MARK ... APPENDS/SETITEMS per 1000 items
            chunk = items[i : i + 1000]
            if len(chunk) > 1:
                self.out += b"("
            for x in chunk:
                if pairs:
                    self.dump(x[0])
                    self.dump(x[1])
                else:
                    self.dump(x)
            if pairs:
                self.out += b"u" if len(chunk) > 1 else b"s"
            else:
                self.out += b"e" if len(chunk) > 1 else b"a"

    def _tensor(self, t: TensorData) -> None:
        """``(torch._utils._rebuild_tensor_v2, (storage, 0, size, stride, False, OrderedDict()))``
        with the storage as the persistent id ``("storage", <type>Storage, key, "cpu", numel)``."""
        if t.dtype not in _STORAGE_TYPES:
            raise LayoutError(f"cannot write a {t.dtype} tensor into a torch.save archive without torch")
        if memoryview(t.data).nbytes != t.nbytes:
            raise LayoutError(f"tensor data of {memoryview(t.data).nbytes} bytes for shape {t.shape} of {t.dtype}")
        key = str(len(self.storages))
        self.storages.append(t)
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"(("
        self.dump("storage")
        self._global("torch", _STORAGE_TYPES[t.dtype])
        self.dump(key)
        self.dump("cpu")
        self.dump(t.numel)
        self.out += b"t"
        self._put()
        self.out += b"Q"
        self.dump(0)
        self._tuple(tuple(t.shape))
        self._tuple(contiguous_strides(t.shape))
        self.out += b"\x89"
        self._global("collections", "OrderedDict")
        self.out += b")R"
        self._put()
        self.out += b"t"
        self._put()
        self.out += b"R"
        self._put(t)


def dumps(obj: Any) -> tuple[bytes, list[TensorData]]:
    """The ``data.pkl`` of ``obj`` as ``torch.save`` writes it, and the tensors whose
    storages it names, in key order (``"0"``, ``"1"``, ...)."""
    p = _Pickler()
    p.dump(obj)
    p.out += b"."
    return bytes(p.out), p.storages


def _local_header(name: bytes, crc: int, size: int, offset: int, zip64: bool, alignment: int) -> bytes:
    extra = struct.pack("<2HQQ", 1, 16, size, size) if zip64 else b""
    at = offset + _LOCAL.size + len(name) + len(extra)
    if at % alignment:
        fill = -(at + 4) % alignment
        extra += b"FB" + struct.pack("<H", fill) + b"Z" * fill
    fixed = _U32 if zip64 else size
    return _LOCAL.pack(b"PK\x03\x04", 45 if zip64 else 20, 0, 0, 0, 0, crc, fixed, fixed, len(name), len(extra)) + name + extra


def _central_header(name: bytes, crc: int, size: int, offset: int, zip64: bool) -> bytes:
    extra = struct.pack("<2H3Q", 1, 24, size, size, offset) if zip64 else b""
    fixed, at = (_U32, _U32) if zip64 else (size, offset)
    return _CENTRAL.pack(b"PK\x01\x02", 45 if zip64 else 20, 45 if zip64 else 20, 0, 0, 0, 0, crc, fixed, fixed,
                         len(name), len(extra), 0, 0, 0, 0, at) + name + extra


@dataclass
class Archive:
    """A ``torch.save`` archive as the pieces of its bytes, in order: ``chunks`` (headers
    and small records as ``bytes``, each tensor's data as a view of its own memory, not
    copied); ``storages`` are the indices of the tensor data chunks; ``size`` the total."""

    chunks: list[Any]
    storages: list[int]
    size: int


class _ZipWriter:
    """Stored (uncompressed) zip records, each one's data aligned (64 bytes, or
    ``data_alignment`` for tensor data)."""

    def __init__(self, crc: bool, force_zip64: bool) -> None:
        self.crc, self.force_zip64 = crc, force_zip64
        self.at = 0
        self.chunks: list[Any] = []
        self.storages: list[int] = []
        self.central: list[bytes] = []

    def record(self, name: str, data: Any, alignment: int = ALIGNMENT, storage: bool = False) -> None:
        view = memoryview(data).cast("B")
        raw = name.encode("utf-8")
        crc = crc32(view) if self.crc or len(view) < (1 << 20) else 0
        zip64 = self.force_zip64 or len(view) >= _U32 or self.at >= _U32
        head = _local_header(raw, crc, len(view), self.at, zip64, alignment)
        self.central.append(_central_header(raw, crc, len(view), self.at, zip64))
        self.chunks.append(head)
        if storage:
            self.storages.append(len(self.chunks))
        if len(view) or storage:
            self.chunks.append(view if storage else bytes(view))
        self.at += len(head) + len(view)

    def close(self) -> None:
        start = self.at
        directory = b"".join(self.central)
        n = len(self.central)
        tail = b""
        zip64 = self.force_zip64 or start + len(directory) >= _U32 or n >= 0xFFFF
        if zip64:
            end64_at = start + len(directory)
            tail += _END64.pack(b"PK\x06\x06", _END64.size - 12, 45, 45, 0, 0, n, n, len(directory), start)
            tail += _LOCATOR64.pack(b"PK\x06\x07", 0, end64_at, 1)
        tail += _END.pack(b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(directory), _U32),
                          _U32 if zip64 else start, 0)
        self.chunks.append(directory + tail)
        self.at += len(directory) + len(tail)


def archive(obj: Any, name: str = "archive", *, crc: bool = True, force_zip64: bool = False,
            data_alignment: int = ALIGNMENT) -> Archive:
    """The bytes of ``torch.save(obj, f)`` for ``obj`` (see :func:`dumps`), as an
    :class:`Archive`: each tensor's data is referenced, not copied, and starts at a file
    offset that is a multiple of ``data_alignment`` (a multiple of 64; 4096 lets the file
    be written with ``O_DIRECT`` straight from the tensor's memory). ``crc=False`` leaves
    the CRC-32 of records of 1 MiB and more at 0, as torch does with
    ``torch.serialization.set_crc32_options(False)`` (``torch.load`` does not check them).
    ``force_zip64`` writes zip64 records even when nothing needs them (tests)."""
    if data_alignment % ALIGNMENT:
        raise ValueError(f"data_alignment must be a multiple of {ALIGNMENT}")
    pkl, storages = dumps(obj)
    z = _ZipWriter(crc, force_zip64)
    z.record(f"{name}/data.pkl", pkl)
    z.record(f"{name}/.format_version", b"1")
    z.record(f"{name}/.storage_alignment", str(ALIGNMENT).encode())
    z.record(f"{name}/byteorder", b"little")
    for key, t in enumerate(storages):
        z.record(f"{name}/data/{key}", t.data, data_alignment, storage=True)
    z.record(f"{name}/version", b"3\n")
    z.record(f"{name}/.data/serialization_id", "".join(str(secrets.randbelow(10)) for _ in range(40)).encode())
    z.close()
    return Archive(z.chunks, z.storages, z.at)


def write_archive(f: BinaryIO, obj: Any, name: str = "archive", *, crc: bool = True, force_zip64: bool = False) -> int:
    """Write ``obj`` (see :func:`dumps`) to the binary file ``f`` as ``torch.save(obj, f)``
    does; returns the bytes written (``crc``, ``force_zip64``: see :func:`archive`)."""
    a = archive(obj, name, crc=crc, force_zip64=force_zip64)
    for chunk in a.chunks:
        f.write(chunk)
    return a.size
