"""The library's one voice: everything unickpt tells goes through the ``unickpt`` logger.

Two kinds of record:

* warnings (a failed save, snapshot or delta entry; training goes on) and information
  (a copy to the durable tier, each save's :class:`~unickpt.api.stats.SaveRecord`), like
  any library's;
* console lines (:func:`say`): what rank 0 tells the user's console about the run itself,
  ``resumed step S from memory (...)``, ``starting fresh (...)`` and live recovery's
  ``continuing on N ranks ...``. Tools grep for them; their text is a contract.

With no configuration the library's own :class:`ConsoleHandler` (on the ``unickpt``
logger, added when this module is imported) writes the console lines to stdout and the
warnings to stderr. A handler of your own on the ``unickpt`` logger takes over: the
library's then writes nothing (``logging.getLogger("unickpt").addHandler(...)``; a
``logging.NullHandler()`` silences it; so does a level above INFO on that logger). A
handler on the root logger gets every warning (the library's stays quiet about them) and
the console lines too, which still reach stdout. Information (level INFO) reaches your
handlers once the ``unickpt`` logger's level is INFO, never the console.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["ConsoleHandler", "log", "say"]

log = logging.getLogger("unickpt")

_CONSOLE = "unickpt_console"  # the record attribute that marks a console line


class ConsoleHandler(logging.Handler):
    """The library's default output: console lines to stdout, warnings to stderr, only
    while nobody has put a handler on the ``unickpt`` logger (and, for warnings, on the
    root logger)."""

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` where it belongs, or nothing when a configured handler has it."""
        if any(h is not self for h in log.handlers):
            return
        if getattr(record, _CONSOLE, False):
            stream = sys.stdout  # looked up now: a redirected stdout gets it
        elif record.levelno >= logging.WARNING and not logging.getLogger().handlers:
            stream = sys.stderr
        else:
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's rule: a handler never raises)
            self.handleError(record)


def say(line: str) -> None:
    """Tell the user's console ``line`` (the caller decides which rank speaks: rank 0).

    Args:
        line: One line of text, written as it is.
    """
    if log.level > logging.INFO or log.disabled:
        return
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, None, None, extra={_CONSOLE: True}))


def _install() -> None:
    """Add the library's :class:`ConsoleHandler` to the ``unickpt`` logger, once."""
    if not any(type(h).__name__ == "ConsoleHandler" for h in log.handlers):  # once, even if reloaded
        log.addHandler(ConsoleHandler())


_install()
