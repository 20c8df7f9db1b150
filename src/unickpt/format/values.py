"""Exact JSON encoding of plain Python values (no pickle, nothing is ever executed).

Plain JSON keeps ``None``, ``bool``, ``int``, finite ``float``, ``str``, lists and dicts
with string keys. The rest is tagged with a one-key object whose key starts with ``$``:
tuples, dicts whose keys are not all strings (or start with ``$``), non-finite floats and
bytes. Anything else is refused with an error that names the key.

Decoding is strict, since a manifest may be damaged or hostile: a tag it does not know, a
malformed payload (base64 that is not valid, a ``$dict`` entry that is not a pair or whose
key cannot be a dict key), a string that is not valid Unicode or nesting deeper than
``MAX_DEPTH`` raise :class:`~unickpt.ManifestError`; nothing is guessed.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from ..errors import ManifestError, UnickptError

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_DEPTH = 100  # nesting of lists, tuples and dicts in one stored value


def loads_json(raw: str | bytes) -> Any:
    """``json.loads`` for text from outside (a foreign checkpoint's config or index): every
    way it can be invalid, nesting too deep for the parser included, is a ``ValueError``."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def encode_value(value: Any, key: str = "", _depth: int = 0) -> Any:
    """Turn a plain Python value into a JSON-compatible structure that decodes to an equal value."""
    if _depth > MAX_DEPTH:
        raise UnickptError(f"cannot store the value under key {key!r}: it is nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    d = _depth + 1
    if isinstance(value, list):
        return [encode_value(v, f"{key}[{i}]", d) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v, f"{key}[{i}]", d) for i, v in enumerate(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_value(v, f"{key}.{k}", d) for k, v in value.items()}
        return {"$dict": [[encode_value(k, key, d), encode_value(v, f"{key}.{k}", d)] for k, v in value.items()]}
    raise UnickptError(
        f"cannot store value of type {type(value).__name__} under key {key!r}: "
        "store tensors, or JSON-like values (None, bool, int, float, str, bytes, lists, tuples, dicts)"
    )


def decode_value(data: Any, key: str = "") -> Any:
    """Inverse of :func:`encode_value`; :class:`~unickpt.ManifestError` (naming ``key``)
    when ``data`` is not something :func:`encode_value` writes."""
    return _decode(data, key, 0)


def _decode(data: Any, key: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(key, f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(data, list):
        return [_decode(v, key, depth + 1) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, payload), = data.items()
            if tag.startswith("$"):
                return _decode_tagged(tag, payload, key, depth + 1)
        for k in data:
            if k.startswith("$"):
                raise _bad(key, f"a dict key {k!r} starts with '$' (such dicts are stored as $dict)")
            check_text(k, key)
        return {k: _decode(v, key, depth + 1) for k, v in data.items()}
    if isinstance(data, str):
        return check_text(data, key)
    if data is None or isinstance(data, (bool, int)):
        return data
    if isinstance(data, float) and math.isfinite(data):
        return data
    raise _bad(key, f"{type(data).__name__} {data!r:.40} is not an encoded value")


def _decode_tagged(tag: str, payload: Any, key: str, depth: int) -> Any:
    if tag == "$tuple" and isinstance(payload, list):
        return tuple(_decode(v, key, depth + 1) for v in payload)
    if tag == "$dict" and isinstance(payload, list):
        out = {}
        for pair in payload:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise _bad(key, "a $dict entry is not a [key, value] pair")
            k = _hashable(_decode(pair[0], key, depth + 1), key)
            out[k] = _decode(pair[1], key, depth + 1)
        return out
    if tag == "$float" and isinstance(payload, str) and payload in _NON_FINITE:
        return _NON_FINITE[payload]
    if tag == "$bytes" and isinstance(payload, str):
        try:
            return base64.b64decode(payload.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise _bad(key, "a $bytes payload is not valid base64") from None
    if tag in ("$tuple", "$dict", "$float", "$bytes"):
        raise _bad(key, f"malformed {tag} payload {payload!r:.60}")
    raise _bad(key, f"unknown tag {tag!r}")


def _hashable(k: Any, key: str) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x, key) for x in k)
    if isinstance(k, tuple):
        return tuple(_hashable(x, key) for x in k)
    if isinstance(k, dict):
        raise _bad(key, "a $dict key is a dict (not hashable)")
    return k


def check_text(s: str, key: str = "") -> str:
    """``s`` when it is valid Unicode (encodable as UTF-8); ManifestError for a lone surrogate."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(key, f"the string {s!r:.60} is not valid Unicode (a lone surrogate)") from None
    return s


def _bad(key: str, why: str) -> ManifestError:
    return ManifestError(f"malformed value {key!r} in the manifest: {why}")
