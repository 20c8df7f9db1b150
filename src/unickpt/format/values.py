"""Exact JSON encoding of plain Python values (no pickle, nothing is ever executed).

Plain JSON keeps ``None``, ``bool``, ``int``, finite ``float``, ``str``, lists and dicts
with string keys. The rest is tagged with a one-key object whose key starts with ``$``:
tuples, dicts whose keys are not all strings (or start with ``$``), non-finite floats and
bytes. Anything else is refused with an error that names the key.
"""

from __future__ import annotations

import base64
import math
from typing import Any

from ..errors import UnickptError

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_value(value: Any, key: str = "") -> Any:
    """Turn a plain Python value into a JSON-compatible structure that decodes to an equal value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode_value(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_value(v, f"{key}.{k}") for k, v in value.items()}
        return {"$dict": [[encode_value(k, key), encode_value(v, f"{key}.{k}")] for k, v in value.items()]}
    raise UnickptError(
        f"cannot store value of type {type(value).__name__} under key {key!r}: "
        "store tensors, or JSON-like values (None, bool, int, float, str, bytes, lists, tuples, dicts)"
    )


def decode_value(data: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, payload), = data.items()
            if tag == "$tuple":
                return tuple(decode_value(v) for v in payload)
            if tag == "$dict":
                return {_hashable(decode_value(k)): decode_value(v) for k, v in payload}
            if tag == "$float":
                return _NON_FINITE[payload]
            if tag == "$bytes":
                return base64.b64decode(payload)
        return {k: decode_value(v) for k, v in data.items()}
    return data


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
