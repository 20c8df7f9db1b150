"""Mapping between torch dtypes and the dtype names safetensors uses."""

from __future__ import annotations

import torch

from ..errors import LayoutError

_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _TO_NAME[getattr(torch, _name)] = _st
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise LayoutError(f"dtype {dtype} cannot be stored in safetensors") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise LayoutError(f"unknown dtype {name!r} in checkpoint") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    return dtype_from_name(name).itemsize
