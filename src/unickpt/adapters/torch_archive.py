"""Reading ``torch.save`` archives and plain pickles of other tools without running their code.

Foreign checkpoints (DCP's ``.metadata`` and ``.distcp`` items, DeepSpeed's ``*.pt``) are
pickles. They are read by an allow-listing unpickler: plain containers and scalars,
``torch.Size``, dtypes, ``OrderedDict`` and tensors are rebuilt; any other global is refused
with :class:`UnsafePickleError` naming it, unless the caller allows it explicitly
(``allowed={(module, name): factory}``; adapters pass a format's own metadata classes).
A class whose objects are wanted as data but whose code must not run (DCP's planner
records in Megatron-Core metadata) is allowed as an :func:`inert_record_type`: the pickle's
arguments and state are kept on an :class:`InertRecord`, the named class is never imported.
With ``unknown_as_records=True`` every other global becomes such a record too, so one
foreign object does not make a whole file unreadable; the caller then reports the values
holding records as skipped.

torch need not be imported: when it is not (the command line converting a DeepSpeed
checkpoint), torch's globals become plain stand-ins: a dtype, layout or memory format is
a :class:`TorchName` (a ``str``, ``"torch.float32"``, as ``str()`` of the real one), ``torch.Size``
a tuple, ``torch.device`` its :class:`TorchName`; storages are ``(dtype name, key, numel)``
records either way. When torch is already imported (library callers) the real objects are
built, as before. The allow-list is the same in both cases.

A tensor carrying Python attributes (Megatron's fp32 main params after
``copy_tensor_model_parallel_attributes``: ``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``shared``) is pickled by ``torch.save`` through
``torch._tensor._rebuild_from_type_v2(func, torch.Tensor, args, state)`` (an
``nn.Parameter`` through ``_rebuild_parameter_with_state``). Both are read: ``torch.Tensor``
and ``torch.nn.Parameter`` are allowed only as that type argument (a :class:`TensorType`,
never called), ``func`` must be one of the tensor records above, and the attributes
(dropped: nothing needs them) must be plain data - bool, int, float, str, None, and dicts,
lists and tuples of them; anything else there is refused like any other global.

Tensors are not materialised: each becomes a :class:`StoredTensor` saying where its bytes
lie in the file (the archive's data records are stored uncompressed), so a reader can
read exactly the bytes it needs, in place, with the same planner as unickpt's own format.

What a pickle may build is bounded by its size, so a tiny hostile file cannot exhaust
memory. Opcodes build at most one object each (memory linear in the pickle's length); the
allowed callables that could build more than their arguments spell out (``set``,
``frozenset``, ``bytearray``, ``OrderedDict``, ``torch.Size``: ``bytearray(10**9)``,
``set(range(10**8))``) share one budget of ``BUILD_BUDGET_PER_BYTE`` elements or bytes per
byte of pickle (at least ``BUILD_BUDGET_MIN``), charged before they run; a tensor record
has at most 64 dimensions; a compressed ``data.pkl`` may not expand past its archive's size.
Going over raises :class:`UnsafePickleError` at once.
"""

from __future__ import annotations

import collections
import functools
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Callable

from ..engine.reads import Segment, SpanRead, execute
from ..errors import CorruptionError, LayoutError, UnickptError, UnsafePickleError
from ..format.dtypes import DTYPE_ATTRS, dtype_name, itemsize
from ..plan.box import row_major_strides
from ..storage.local import LocalStorage

if TYPE_CHECKING:
    import torch

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
# torch.save's typed storage classes -> the dtype names of their elements (the writer,
# adapters/torch_save.py, writes the same names)
STORAGE_DTYPES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL", "ComplexFloatStorage": "C64", "ComplexDoubleStorage": "C128",
}
# torch attributes a pickle may name as plain values without torch imported: torch 2.13's
# dtypes (and their aliases), layouts and memory formats (with torch imported: whichever
# attributes of torch are such objects)
_TORCH_NAMES = frozenset({
    "_mkldnn", "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat",
    "chalf", "channels_last", "channels_last_3d", "complex128", "complex32", "complex64", "contiguous_format",
    "double", "float", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32",
    "int4", "int5", "int6", "int64", "int7", "int8", "jagged", "legacy_contiguous_format", "long", "preserve_format",
    "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short", "sparse_bsc", "sparse_bsr", "sparse_coo",
    "sparse_csc", "sparse_csr", "strided", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6",
    "uint64", "uint7", "uint8",
})
_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex, "bytearray": bytearray, "range": range}
# allowed callables whose result can be larger than what the pickle spells out (and torch.Size, see _is_growing)
_GROWING = (set, frozenset, bytearray, collections.OrderedDict)
_SIZED = (range, list, tuple, set, frozenset, dict, bytes, bytearray, str)
BUILD_BUDGET_PER_BYTE = 8
BUILD_BUDGET_MIN = 1 << 16
MAX_TENSOR_NDIM = 64


class Elements:
    """``numel`` and ``nbytes`` of a tensor record with a ``shape`` and a unickpt
    ``dtype`` name (its own elements: a view's, not its storage's)."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return prod(self.shape)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements."""
        return self.numel * itemsize(self.dtype)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StoredTensor(Elements):
    """A tensor inside a pickle archive: where its storage lies in ``file`` and how the
    tensor views it (``storage_offset`` and ``stride`` in elements)."""

    file: str
    storage_at: int
    storage_bytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0

    @property
    def offset(self) -> int:
        """Absolute byte offset in ``file`` of the tensor's first element."""
        return self.storage_at + self.storage_offset * itemsize(self.dtype)

    def is_contiguous(self) -> bool:
        """True when the elements are one row-major run (so the tensor is a plain byte range)."""
        want = row_major_strides(self.shape)
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.stride, want))


class InertRecord:
    """A pickled object of a class that unickpt does not build: its global's name and the
    arguments and state the pickle gave it, as plain data. Pickle's object protocol (a call,
    ``__new__``, ``__setstate__``, list and dict items) lands here; no code of the named
    class runs and its module is not imported."""

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "InertRecord":
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        """List items pickled for the object (``APPENDS``)."""
        self.items.append(item)

    def extend(self, items: Any) -> None:
        """List items pickled for the object (``APPENDS``)."""
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def field(self, name: str, default: Any = None) -> Any:
        """A field of the recorded object's state (a dataclass's or plain object's ``__dict__``)."""
        state = self.state[1] if isinstance(self.state, tuple) and len(self.state) == 2 else self.state
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<{self.global_name}, not built>"


@functools.cache
def inert_record_type(module: str, name: str) -> type[InertRecord]:
    """The :class:`InertRecord` subclass standing for the global ``module.name``."""
    return type(name, (InertRecord,), {"global_name": f"{module}.{name}", "__module__": __name__})


def inert_records(module: str, names: tuple[str, ...]) -> dict[tuple[str, str], Any]:
    """Allow-list entries reading the objects of ``module.names`` as :class:`InertRecord`."""
    return {(module, n): inert_record_type(module, n) for n in names}


def records_in(obj: Any) -> list[InertRecord]:
    """Every :class:`InertRecord` inside a nested structure (records included)."""
    out: list[InertRecord] = []
    stack, seen = [obj], set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, InertRecord):
            out.append(o)
            stack.extend((o.args, o.kwargs, o.state, o.items))
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
    return out


class TorchName(str):
    """Stands for a torch dtype, layout, memory format or device in a pickle read without
    torch imported: the ``str()`` of the real object (``"torch.float32"``, ``"cpu"``)."""


def _size(dims: Any = ()) -> tuple:
    """Stands for ``torch.Size`` without torch: the tuple of its dimensions."""
    return tuple(dims)


def _device(*args: Any) -> TorchName:
    """Stands for ``torch.device`` without torch: its name (``"cpu"``, ``"cuda:0"``)."""
    if not args or not isinstance(args[0], str) or len(args) > 2 or (len(args) == 2 and not isinstance(args[1], int)):
        raise UnsafePickleError(f"a torch.device record with arguments {args!r:.80}")
    return TorchName(args[0] if len(args) == 1 or ":" in args[0] else f"{args[0]}:{args[1]}")


def _torch() -> Any:
    """The torch module when something already imported it, else None (it is not imported here)."""
    return sys.modules.get("torch")


@dataclass(frozen=True)
class _StorageRef:
    dtype: str  # unickpt's dtype name
    key: str
    numel: int


def _torch_global(name: str) -> Any:
    if name in STORAGE_DTYPES:
        return ("storage-type", STORAGE_DTYPES[name])
    torch = _torch()
    if name == "Size":
        return torch.Size if torch is not None else _size
    if name == "device":
        return torch.device if torch is not None else _device
    if torch is None:
        return TorchName(f"torch.{name}") if name in _TORCH_NAMES else None
    value = vars(torch).get(name)  # no getattr: torch's module __getattr__ would import submodules
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


def _is_growing(factory: Any) -> bool:
    """Allowed callables whose result can be larger than what the pickle spells out."""
    torch = _torch()
    return any(factory is g for g in _GROWING) or factory is _size or (torch is not None and factory is torch.Size)


def _tensor_dtype(dtype: Any) -> str | None:
    """unickpt's name of a dtype given to ``_rebuild_tensor_v3`` (real or :class:`TorchName`)."""
    if isinstance(dtype, TorchName):
        return DTYPE_ATTRS.get(dtype[len("torch."):])
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, allowed: dict[tuple[str, str], Any], storages: dict[str, int] | None,
                 file: str, unknown_as_records: bool = False) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.where, self.allowed, self.storages, self.file = where, allowed, storages, file
        self.unknown_as_records = unknown_as_records
        self.budget = max(BUILD_BUDGET_MIN, BUILD_BUDGET_PER_BYTE * len(data))

    def find_class(self, module: str, name: str) -> Any:
        found = self._find(module, name)
        return self._bounded(found) if _is_growing(found) else found

    def _find(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if module == "torch" and (found := _torch_global(name)) is not None:
            return found
        if module == "torch.storage" and name == "UntypedStorage":  # storages of _rebuild_tensor_v3 (float8, uint16...)
            return ("storage-type", "U8")
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_tensor_v3",
                                                   "_rebuild_parameter", "_rebuild_parameter_with_state"):
            return getattr(self, name)
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return self._rebuild_from_type_v2
        if (module, name) in _TENSOR_TYPES:  # only as the type argument of _rebuild_from_type_v2
            return TensorType(f"{module}.{name}", self.where)
        if self.unknown_as_records:
            return inert_record_type(module, name)
        raise UnsafePickleError(
            f"{self.where}: refused to unpickle {module}.{name} (not on unickpt's allow-list of data types; "
            "the file was not executed)"
        )

    def _bounded(self, factory: Callable[..., Any]) -> Callable[..., Any]:
        """``factory`` charging the size of what it is about to build to the budget first."""

        @functools.wraps(factory, updated=())  # errors name the factory (builtins.set), not this wrapper
        def build(*args: Any) -> Any:
            for a in args:
                self._charge(factory, a)
            return factory(*args)

        return build

    def _charge(self, factory: Callable[..., Any], arg: Any) -> None:
        what = getattr(factory, "__name__", "a container")
        if isinstance(arg, int) and not isinstance(arg, bool):
            n = arg if factory is bytearray else 0  # bytearray(n): n zero bytes
        elif isinstance(arg, _SIZED):
            try:
                n = len(arg)
            except OverflowError:  # range(10**30)
                n = self.budget + 1
        elif arg is None or isinstance(arg, float):
            n = 0
        else:
            raise UnsafePickleError(f"{self.where}: refused to build {what} from a {type(arg).__name__}")
        self.budget -= n
        if self.budget < 0:
            raise UnsafePickleError(
                f"{self.where}: refused to unpickle: it builds a {what} of {n} elements or bytes, more than a pickle "
                f"of its size may build (a hostile or damaged file; nothing was run)"
            )

    def persistent_load(self, pid: Any) -> Any:
        if self.storages is None or not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise UnsafePickleError(f"{self.where}: unexpected persistent reference {pid!r:.80}")
        kind = pid[1]
        if not (isinstance(kind, tuple) and kind[0] == "storage-type"):
            raise UnsafePickleError(f"{self.where}: unsupported storage type {kind!r:.80}")
        return _StorageRef(kind[1], str(pid[2]), int(pid[4]))

    def _rebuild_tensor_v2(self, storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *_: Any) -> StoredTensor:
        if not isinstance(storage, _StorageRef):
            raise UnsafePickleError(f"{self.where}: a tensor without a storage record")
        for dims in (size, stride):
            if not isinstance(dims, (tuple, list)) or len(dims) > MAX_TENSOR_NDIM:
                raise CorruptionError(f"{self.where}: a tensor record whose shape or stride is not a list of at most "
                                      f"{MAX_TENSOR_NDIM} integers")
        at = self.storages.get(storage.key) if self.storages is not None else None
        if at is None:
            raise CorruptionError(f"{self.where}: tensor storage record {storage.key!r} is missing from the archive")
        if storage.dtype not in DTYPE_ATTRS.values():
            raise LayoutError(f"{self.where}: a tensor of dtype {storage.dtype} cannot be stored in safetensors")
        return StoredTensor(self.file, at, storage.numel * itemsize(storage.dtype), storage.dtype,
                            tuple(int(x) for x in size), tuple(int(x) for x in stride), int(storage_offset))

    def _rebuild_tensor_v3(self, storage: _StorageRef, storage_offset: int, size: Any, stride: Any, _requires_grad: Any = False,
                           _hooks: Any = None, dtype: Any = None, *_: Any) -> StoredTensor:
        # torch.save's form for dtypes without a typed storage: a byte storage plus the dtype
        name = _tensor_dtype(dtype)
        if name is None:
            raise UnsafePickleError(f"{self.where}: a tensor record without a dtype unickpt reads")
        t = self._rebuild_tensor_v2(storage, storage_offset, size, stride)
        return StoredTensor(t.file, t.storage_at, t.storage_bytes, name, t.shape, t.stride, t.storage_offset)

    def _rebuild_tensor(self, storage: _StorageRef, storage_offset: int, size: Any, stride: Any) -> StoredTensor:
        return self._rebuild_tensor_v2(storage, storage_offset, size, stride)

    @staticmethod
    def _rebuild_parameter(data: Any, *_: Any) -> Any:
        return data

    def _rebuild_parameter_with_state(self, data: Any, _requires_grad: Any = False, _hooks: Any = None,
                                      state: Any = None, *_: Any) -> Any:
        # torch.save's form of an nn.Parameter carrying Python attributes (Megatron's
        # tensor_model_parallel, partition_dim...): the attributes are dropped, and must be data
        self._check_state("torch.nn.Parameter", state)
        return data

    def _rebuild_from_type_v2(self, func: Any, new_type: Any, args: Any, state: Any = None) -> StoredTensor:
        # torch.save's form of a tensor carrying Python attributes (Megatron's fp32 main params
        # after copy_tensor_model_parallel_attributes): ``func(*args)`` rebuilds the tensor, then
        # torch would set ``state`` as its attributes. Only unickpt's own tensor records run
        # here, for torch's own tensor types, and the attributes (dropped) must be plain data.
        rebuilders = (self._rebuild_tensor_v2, self._rebuild_tensor_v3, self._rebuild_tensor)
        if not isinstance(new_type, TensorType):
            raise UnsafePickleError(f"{self.where}: refused to rebuild a tensor of type {_named(new_type)} (not on "
                                    "unickpt's allow-list of data types; the file was not executed)")
        if not any(func == r for r in rebuilders) or not isinstance(args, tuple):
            raise UnsafePickleError(f"{self.where}: refused to rebuild {new_type.name} with {_named(func)} (not on "
                                    "unickpt's allow-list of data types; the file was not executed)")
        self._check_state(new_type.name, state)
        return func(*args)

    def _check_state(self, what: str, state: Any) -> None:
        """Refuse the Python attributes ``state`` of a rebuilt tensor unless they are plain data."""
        bad = _not_plain(state)
        if bad is not None:
            raise UnsafePickleError(
                f"{self.where}: refused to unpickle {what} with an attribute holding {_named(bad)} (not on unickpt's "
                "allow-list of data types: a tensor's attributes may hold bool, int, float, str, None and dicts, "
                "lists and tuples of them; the file was not executed)"
            )


# torch's tensor classes, as the type argument of _rebuild_from_type_v2 (torch.save names
# torch.Tensor "torch.Tensor", a Parameter "torch.nn.parameter.Parameter")
_TENSOR_TYPES = frozenset({("torch", "Tensor"), ("torch._tensor", "Tensor"), ("torch.nn.parameter", "Parameter"),
                           ("torch.nn", "Parameter")})
_PLAIN_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class TensorType:
    """Stands for ``torch.Tensor`` or ``torch.nn.Parameter`` named in a pickle: accepted only
    as the type of a tensor rebuilt by ``_rebuild_from_type_v2``; the class is never called."""

    name: str
    where: str

    def __call__(self, *_: Any, **__: Any) -> Any:
        raise UnsafePickleError(f"{self.where}: refused to call {self.name} (allowed only as the type of a stored "
                                "tensor; the file was not executed)")


def _named(obj: Any) -> str:
    """How an error names an unpickled object: a record's global, a TensorType's name, or its type."""
    if isinstance(obj, InertRecord) or (isinstance(obj, type) and issubclass(obj, InertRecord)):
        return obj.global_name  # a record, or the global itself (a class or function named in the pickle)
    if isinstance(obj, TensorType):
        return obj.name
    if isinstance(obj, StoredTensor):
        return "a tensor"
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{name}"


def _not_plain(obj: Any) -> Any:
    """The first value inside ``obj`` that is not plain data (bool, int, float, str, None,
    and dicts, lists and tuples of them), or None when all of it is."""
    stack, seen = [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, _PLAIN_SCALARS):
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        else:
            return o
    return None


def _check_bounds(storage_bytes: int, t: StoredTensor, where: str) -> None:
    if t.numel and (t.storage_offset < 0 or any(s < 0 for s in t.stride)):
        raise CorruptionError(f"{where}: a tensor with a negative offset or stride")
    last = t.storage_offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) if t.numel else -1
    if (last + 1) * itemsize(t.dtype) > storage_bytes:
        raise CorruptionError(f"{where}: a tensor reaches past the end of its storage")


def loads_restricted(data: bytes, where: str, allowed: dict[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle ``data`` (a plain pickle, no tensors) allowing only safe data types and
    ``allowed``; anything else raises :class:`UnsafePickleError`."""
    try:
        obj = _Unpickler(data, where, dict(allowed or {}), None, "").load()
    except (UnsafePickleError, CorruptionError):
        raise
    except Exception as e:
        raise CorruptionError(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None
    _check_expanded(obj, len(data), where)
    return obj


def _children(o: Any) -> list[Any]:
    """What a walk of an unpickled structure visits inside ``o`` (none for a leaf)."""
    if isinstance(o, StoredTensor):
        return []
    if isinstance(o, dict):
        return list(o.values())
    if isinstance(o, (list, tuple, set, frozenset)):
        return list(o)
    if hasattr(o, "__dict__") and not isinstance(o, type):
        return list(vars(o).values())
    return []


def _check_expanded(obj: Any, pickle_bytes: int, where: str) -> None:
    """A CorruptionError when the tree a walk of ``obj`` visits (each shared part once per
    reference to it) is far larger than its pickle: a 1.5 KB pickle can hold a list that
    holds the one before it twice, 40 deep, which every walk would expand to 2**40 nodes.
    Counted once per object (a cycle's way back counts once)."""
    limit = 1_000_000 + 16 * pickle_bytes
    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        o, after = stack.pop()
        kids = _children(o)
        if after:
            size[id(o)] = n = 1 + sum(size.get(id(k), 1) for k in kids)
            if n > limit:
                raise CorruptionError(f"{where}: its pickle refers to its own parts over and over (more than {limit} "
                                      "objects once each reference is followed); refused")
        elif kids and id(o) not in size:
            size[id(o)] = 1  # in progress: a cycle back to it counts once
            stack.append((o, True))
            stack.extend((k, False) for k in kids if id(k) not in size)


def read_archive(storage: LocalStorage, file: str, start: int = 0, length: int | None = None,
                 allowed: dict[tuple[str, str], Any] | None = None, unknown_as_records: bool = False) -> Any:
    """The object of the ``torch.save`` archive at bytes ``[start, start + length)`` of
    ``file``, tensors replaced by :class:`StoredTensor` records pointing into ``file``
    (other globals become :class:`InertRecord` objects with ``unknown_as_records``)."""
    where = f"{file}" if not start and length is None else f"{file} (bytes {start}-{start + (length or 0)})"
    try:
        with zipfile.ZipFile(storage.open_range(file, start, length)) as z:
            infos = z.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1:
                raise CorruptionError(f"{where}: not a torch.save archive (no data.pkl record)")
            if pkl[0].file_size > (storage.reader(file).size if length is None else length):
                raise CorruptionError(f"{where}: its data.pkl record claims {pkl[0].file_size} bytes, more than the file holds")
            prefix = pkl[0].filename[: -len("data.pkl")]
            storages: dict[str, int] = {}
            sizes: dict[str, int] = {}
            fh = storage.open_range(file, start, length)
            for i in infos:
                if not i.filename.startswith(prefix + "data/"):
                    continue
                if i.compress_type != zipfile.ZIP_STORED:
                    raise CorruptionError(f"{where}: compressed tensor records are not supported")
                fh.seek(i.header_offset)
                head = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
                if head[0] != b"PK\x03\x04":
                    raise CorruptionError(f"{where}: bad zip record header for {i.filename}")
                key = i.filename[len(prefix) + 5:]
                storages[key] = start + i.header_offset + _LOCAL_HEADER.size + head[-2] + head[-1]
                sizes[key] = i.file_size
            data = z.read(pkl[0])
    except (UnickptError, OSError):  # ours, and the storage's own (a missing or unreadable file)
        raise
    except Exception as e:  # zipfile's many ways to fail on damaged records: BadZipFile, struct.error, EOFError, ...
        raise CorruptionError(f"{where}: not a torch.save archive, or a damaged one ({type(e).__name__}: {e})") from None
    try:
        obj = _Unpickler(data, where, dict(allowed or {}), storages, file, unknown_as_records).load()
    except (UnsafePickleError, CorruptionError):
        raise
    except Exception as e:
        raise CorruptionError(f"{where}: unreadable pickle ({type(e).__name__}: {e})") from None
    _check_expanded(obj, len(data), where)
    by_at = {at: sizes[k] for k, at in storages.items()}
    for t in stored_tensors(obj):
        _check_bounds(by_at[t.storage_at], t, where)
    return obj


@dataclass(frozen=True)
class ArchiveLayout:
    """Which bytes of a ``torch.save`` archive are what: ``structure`` (local record
    headers, the pickle and the small records, data descriptors, the central directory and
    its end records) and ``storages`` (each tensor storage record's bytes, keyed by where
    they start, as :attr:`StoredTensor.storage_at`). Bytes in neither (between records, past
    the end of the archive) belong to nothing in the archive."""

    structure: list[tuple[int, int]]
    storages: dict[int, tuple[int, int]]


def archive_layout(storage: LocalStorage, file: str) -> ArchiveLayout:
    """The :class:`ArchiveLayout` of the ``torch.save`` archive ``file`` (a whole file), from
    ``zipfile``'s records and each record's local header."""
    structure: list[tuple[int, int]] = []
    storages: dict[int, tuple[int, int]] = {}
    try:
        with zipfile.ZipFile(storage.open_range(file, 0, None)) as z:
            fh = storage.open_range(file, 0, None)
            for i in z.infolist():
                fh.seek(i.header_offset)
                head = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
                if head[0] != b"PK\x03\x04":
                    raise CorruptionError(f"{file}: bad zip record header for {i.filename}")
                at = i.header_offset + _LOCAL_HEADER.size + head[-2] + head[-1]
                end = at + i.compress_size
                if i.flag_bits & 0x08:  # a data descriptor follows the data (its signature is optional)
                    fh.seek(end)
                    size = 24 if i.compress_size >= 0xFFFFFFFF or i.file_size >= 0xFFFFFFFF else 16
                    end += size if fh.read(4) == b"PK\x07\x08" else size - 4
                is_storage = "/data/" in f"/{i.filename}" and i.compress_type == zipfile.ZIP_STORED
                if is_storage:
                    structure.append((i.header_offset, at))
                    storages[at] = (at, at + i.compress_size)
                    structure.append((at + i.compress_size, end))
                else:
                    structure.append((i.header_offset, end))
            structure.append((z.start_dir, storage.size(file)))
    except (UnickptError, OSError):  # as in read_archive
        raise
    except Exception as e:
        raise CorruptionError(f"{file}: not a torch.save archive, or a damaged one ({type(e).__name__}: {e})") from None
    return ArchiveLayout([s for s in structure if s[1] > s[0]], storages)


def stored_tensors(obj: Any) -> list[StoredTensor]:
    """Every :class:`StoredTensor` inside a nested structure of dicts, lists and tuples, each
    container walked once however often it is referred to (a pickle of 1.5 KB can nest one
    list twice in itself 40 times over: 2**40 paths)."""
    out: list[StoredTensor] = []
    stack = [obj]
    seen: set[int] = set()
    while stack:
        o = stack.pop()
        if isinstance(o, StoredTensor):
            out.append(o)
            continue
        if id(o) not in seen:
            seen.add(id(o))
            stack.extend(_children(o))
    return out


def materialize(storage: LocalStorage, t: StoredTensor) -> torch.Tensor:
    """Read a stored tensor into a new CPU tensor (for small state: steps, scalars)."""
    import torch

    from ..format.dtypes import dtype_from_name

    size = itemsize(t.dtype)
    span = (t.storage_offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) + 1) if t.numel else 0
    raw = torch.empty(span * size, dtype=torch.uint8)
    if span:  # through the one verified read (no checksums here: a short file is named with the tensor)
        execute(storage, [SpanRead(t.file, t.storage_at, span * size, [Segment(0, span * size, raw)],
                                  tensor=f"stored tensor at byte {t.storage_at}")])
    flat = raw.view(dtype_from_name(t.dtype)) if span else torch.empty(0, dtype=dtype_from_name(t.dtype))
    return torch.as_strided(flat, t.shape, t.stride, t.storage_offset).clone() if t.numel else torch.empty(t.shape, dtype=flat.dtype)
