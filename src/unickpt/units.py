"""Sizes for people to read."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; below 1 KiB, whole bytes (``"1000 B"``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover
