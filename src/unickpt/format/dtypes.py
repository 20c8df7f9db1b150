"""Mapping between torch dtypes and the dtype names safetensors uses.

The names and their sizes are known without torch (``itemsize``: what parsing a manifest,
``inspect`` and ``verify`` need); torch is imported only to map a name to a torch dtype or
back, which only code holding tensors asks for."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from ..errors import LayoutError

if TYPE_CHECKING:
    import torch

# safetensors name -> (torch attribute, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
}

# torch attribute -> safetensors name (what a pickled dtype is called without torch)
DTYPE_ATTRS: dict[str, str] = {attr: name for name, (attr, _) in DTYPES.items()}


@cache
def _tables() -> tuple[dict[Any, str], dict[str, Any]]:
    import torch

    to_name = {getattr(torch, attr): name for name, (attr, _) in DTYPES.items() if hasattr(torch, attr)}
    return to_name, {v: k for k, v in to_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    try:
        return _tables()[0][dtype]
    except KeyError:
        raise LayoutError(f"dtype {dtype} cannot be stored in safetensors") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _tables()[1][name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r} in checkpoint") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype name (no torch needed)."""
    try:
        return DTYPES[name][1]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r} in checkpoint") from None


# saved dtype -> the dtypes it widens to exactly: every value of the saved dtype (NaN, the
# infinities and -0.0 included) is a value of the wider one, so a cast there and back gives
# the same bits. Only within one kind (floating, signed or unsigned integer into an integer
# that holds its range): a bool, or an integer, is not silently turned into a number of
# another kind, even where the values would survive, since the meaning does not.
_F8 = ("F16", "BF16", "F32", "F64")
WIDENINGS: dict[str, tuple[str, ...]] = {
    "F8_E4M3": _F8,
    "F8_E5M2": _F8,
    "F16": ("F32", "F64"),
    "BF16": ("F32", "F64"),
    "F32": ("F64",),
    "I8": ("I16", "I32", "I64"),
    "I16": ("I32", "I64"),
    "I32": ("I64",),
    "U8": ("U16", "U32", "U64", "I16", "I32", "I64"),
    "U16": ("U32", "U64", "I32", "I64"),
    "U32": ("U64", "I64"),
}

CASTS = ("none", "widen", "any")


def cast_allowed(saved: str, target: str, cast: str) -> bool:
    """Whether a tensor saved as dtype ``saved`` may be loaded into one of dtype ``target``
    (safetensors names) under the ``cast`` policy of ``unickpt.load``: ``"none"`` the same
    dtype only, ``"widen"`` also an exact widening (:data:`WIDENINGS`), ``"any"`` any cast
    (``cast`` is one of :data:`CASTS`, checked by the caller)."""
    return saved == target or cast == "any" or (cast == "widen" and target in WIDENINGS.get(saved, ()))
