"""Work in background threads that the interpreter's exit waits for: an async save's writer,
a checkpoint's copy to the durable tier. Their threads are daemons (one abandoned in a
collective of a dead process group must never keep the process alive), so exit would cut
them short silently; instead it waits for each one still registered here, in the order
they started and for those they start meanwhile (an async save's commit queues its copy
to the durable tier), as it waits for threads that are not daemons. A wait of more than
``NOTICE_S`` seconds (a store that stopped answering) says what it waits for on stderr;
Ctrl-C then gives up on what is left, which is never committed, and says so."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

NOTICE_S = 5.0  # a wait at exit longer than this is said on stderr
WAIT_SLICE_S = 0.1  # the longest single wait: a Ctrl-C is acted on within it

_PENDING: dict[threading.Thread, Callable[[], str]] = {}  # insertion order: the order they started
_LOCK = threading.Lock()


def finish_before_exit(thread: threading.Thread, what: Callable[[], str]) -> None:
    """Have the interpreter's exit wait for ``thread`` (a daemon); ``what()`` names its
    work in the notice (``"the async save to /ckpt/step_00000100"``)."""
    with _LOCK:
        for done in [t for t in _PENDING if not t.is_alive() and t.ident is not None]:
            del _PENDING[done]
        _PENDING[thread] = what


def forget(thread: threading.Thread) -> None:
    """Exit no longer waits for ``thread`` (an abandoned save: it is never committed)."""
    with _LOCK:
        _PENDING.pop(thread, None)


def _next_alive() -> tuple[threading.Thread, Callable[[], str]] | None:
    with _LOCK:
        return next(((t, w) for t, w in _PENDING.items() if t.is_alive()), None)


def _join(thread: threading.Thread, seconds: float | None) -> None:
    """Wait up to ``seconds`` (None: as long as it runs) for ``thread``, in waits of at most
    ``WAIT_SLICE_S``: a Ctrl-C that another thread of the process takes (the kernel's choice
    when the main thread blocks SIGINT) runs its handler in the main thread only between
    waits; a single wait on the thread's lock would never end."""
    end = None if seconds is None else time.monotonic() + seconds
    while thread.is_alive():
        left = WAIT_SLICE_S if end is None else min(WAIT_SLICE_S, end - time.monotonic())
        if left <= 0:
            return
        thread.join(left)


def _wait_noting(thread: threading.Thread, what: Callable[[], str], notice_s: float, until: str) -> None:
    """Wait for ``thread``; after ``notice_s`` seconds, name it on stderr and wait on."""
    _join(thread, notice_s)
    if thread.is_alive():
        print(f"unickpt: waiting for {what()} to finish{until} (Ctrl-C gives it up: it is then not committed)",
              file=sys.stderr, flush=True)
        _join(thread, None)


def wait_for(thread: threading.Thread, what: Callable[[], str], notice_s: float | None = None) -> None:
    """Wait in the caller (a ``close()``) for ``thread``, registered with
    :func:`finish_before_exit`, as exit would: after ``notice_s`` seconds (default
    ``NOTICE_S``) it is named on stderr; a Ctrl-C gives it up (exit does not wait for it
    again), says so, and goes on as the ``KeyboardInterrupt`` it is."""
    try:
        _wait_noting(thread, what, NOTICE_S if notice_s is None else notice_s, "")
    except KeyboardInterrupt:
        print(f"unickpt: gave up waiting for {what()}: not committed", file=sys.stderr, flush=True)
        raise
    finally:
        forget(thread)


def finish_pending(notice_s: float | None = None) -> None:
    """Wait for every registered thread still running (the exit hook); after ``notice_s``
    seconds on one (default ``NOTICE_S``), name it on stderr. Ctrl-C gives up on the rest,
    naming it."""
    notice_s = NOTICE_S if notice_s is None else notice_s
    while (item := _next_alive()) is not None:
        thread, what = item
        try:
            _wait_noting(thread, what, notice_s, " before exiting")
        except KeyboardInterrupt:  # (is_alive() of a thread whose join was interrupted may say False)
            left = [what()] + [w() for t, w in list(_PENDING.items()) if t is not thread and t.is_alive()]
            print(f"unickpt: exiting without waiting for {'; '.join(left)}: not committed", file=sys.stderr, flush=True)
            return
        forget(thread)


threading._register_atexit(finish_pending)  # type: ignore[attr-defined]  # as concurrent.futures: before threads are joined
