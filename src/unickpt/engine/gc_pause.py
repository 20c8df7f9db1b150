"""Pausing Python's cyclic garbage collector during a save, load, convert or verify.

Parsing a manifest and planning the reads or writes of thousands of tensors allocates
hundreds of thousands of small objects (boxes, pieces, fragments, JSON values). Each
allocation burst triggers collections, and with torch imported every full collection
walks millions of live objects: a 2000-tensor save took 0.78 s with the collector on and
0.52 s with it paused, the load 0.35-0.43 s against 0.24 s. None of these objects form
cycles that need collecting, so the collector is paused for the call and restored after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the ``with`` block, then restore it (left
    disabled only if it was disabled before; reference counting frees memory as usual)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
