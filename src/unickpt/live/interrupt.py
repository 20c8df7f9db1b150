"""Raising an exception into the main thread from another (the watcher ends ``fn`` when
the job re-forms) without ever hitting a thread the main thread is starting.

CPython 3.11 gives a thread being started its creator's id until the new thread runs,
and ``PyThreadState_SetAsyncExc`` sets the first thread state with the id it is given,
newest first: an exception aimed at the main thread while it is inside
``Thread.start()`` lands in the new thread alone, which dies of it ("Exception ignored in
thread started by ...") before telling ``start()`` it started, and the main thread waits
for it forever, in a lock no exception reaches (a live job that hung for good, 2 tries in
9, when a rank was stopped and continued while a peer was killed; every snapshot starts a
thread). So the guarded thread starts its threads holding ``_STARTING``, and the exception
is set holding it too: never inside that window."""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

STARTING_WAIT_S = 5.0  # a thread's start takes microseconds; past this, raise all the same

_STARTING = threading.Lock()  # held while the guarded thread starts a thread, and while raising into it
_guarded: int | None = None  # the thread whose starts are guarded (None: none)
_original_start = threading.Thread.start


@functools.wraps(_original_start)
def _start(self: threading.Thread) -> None:
    if threading.get_ident() != _guarded:
        return _original_start(self)
    with _STARTING:
        return _original_start(self)


def guard_thread_starts(ident: int) -> None:
    """From now on thread ``ident`` (the main thread of a worker under ``unickpt.run``)
    starts its threads under the lock :func:`raise_in_thread` takes."""
    global _guarded
    _guarded = ident
    threading.Thread.start = _start  # type: ignore[method-assign]


def _set(ident: int, exc: Any) -> int:
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None))


def raise_in_thread(ident: int, exc: type[BaseException]) -> bool:
    """Have thread ``ident`` raise ``exc`` at its next Python instruction (never while it is
    starting a thread, when its starts are guarded); True when the thread was found."""
    got = _STARTING.acquire(timeout=STARTING_WAIT_S)
    try:
        return _set(ident, exc) == 1
    finally:
        if got:
            _STARTING.release()


def clear_pending(ident: int) -> None:
    """Drop an exception set on thread ``ident`` and not raised yet."""
    _set(ident, None)
