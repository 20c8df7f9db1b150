"""Sizes and counts for people to read."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; below 1 KiB, whole bytes (``"1000 B"``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover


def counted(n: int, noun: str) -> str:
    """``counted(1, "file")`` -> ``"1 file"``, ``counted(3, "file")`` -> ``"3 files"``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
