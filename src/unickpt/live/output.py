"""The workers' output under ``unickpt launch``: each worker's stdout and stderr come
through a pipe, are read line by line and written whole, with torchrun's ``--tee``
prefix (``[rank3]: ...``), so that no line is ever cut by another rank's; torchrun's
``--tee``, ``--redirects``, ``--log-dir`` and ``--local-ranks-filter`` choose what also
goes to per-rank files, what goes only there, and whose lines reach the console;
``--duplicate-stdout-filters`` / ``--duplicate-stderr-filters`` copy the lines that hold
one of their texts, every rank's, into ``filtered_stdout.log`` / ``filtered_stderr.log``
of the attempt's folder (torchrun's files).
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import threading
from typing import IO, Any

STREAMS = ("stdout", "stderr")
# torchrun's Std values: 0 none, 1 stdout, 2 stderr, 3 both
_STD = {"0": frozenset(), "1": frozenset({"stdout"}), "2": frozenset({"stderr"}), "3": frozenset(STREAMS)}
# a --tee/--redirects value: the streams of every local rank, or per local rank
Std = dict[int, frozenset[str]] | frozenset[str]


def parse_std(text: str, flag: str) -> Std:
    """torchrun's ``--tee``/``--redirects`` value: ``0``-``3`` for every local rank, or
    ``LOCAL:VALUE,...`` per local rank (the others: none). ValueError names the flag."""
    text = text.strip()
    if text in _STD:
        return _STD[text]
    out: dict[int, frozenset[str]] = {}
    for part in text.split(","):
        local, sep, value = part.partition(":")
        if not sep or not local.strip().isdigit() or value.strip() not in _STD:
            raise ValueError(f"{flag} {text!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                             "or LOCAL_RANK:VALUE pairs like 0:3,1:2")
        out[int(local)] = _STD[value.strip()]
    return out


def parse_filter(text: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,2``: the local ranks whose lines reach the console (None: all)."""
    if text is None or not text.strip():
        return None
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r}: expected local ranks separated by commas, like 0,1") from None


def parse_needles(text: str) -> tuple[str, ...]:
    """torchrun's ``--duplicate-stdout-filters`` value: texts separated by commas, ``,,`` for
    a comma in one; empty ones dropped (no text: no line duplicated)."""
    parts = text.replace(",,", "\0").split(",")
    return tuple(p.replace("\0", ",") for p in parts if p)


def _for(spec: Std, local: int) -> frozenset[str]:
    return spec.get(local, frozenset()) if isinstance(spec, dict) else spec


class Output:
    """Relays every worker's output: ``[rankN]: `` + the line, written whole under one
    lock (the launcher's own lines take it too)."""

    def __init__(self, tee: Std = frozenset(), redirects: Std = frozenset(), log_dir: str | None = None,
                 local_filter: frozenset[int] | None = None, run_id: str = "none",
                 duplicate: dict[str, tuple[str, ...]] | None = None) -> None:
        self.tee, self.redirects, self.filter = tee, redirects, local_filter
        self.log_dir = log_dir
        # this launcher's own folder under the log dir, as torchrun's <run_id>_<random>: a second
        # run with the same --log-dir and --rdzv-id never appends to the first one's files
        self.run_id = f"{run_id}_{secrets.token_hex(4)}"
        self.duplicate = duplicate or {}  # stream: its texts (none given: the stream is not there)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._filtered: dict[str, IO[bytes]] = {}  # "attempt/stream": the open filtered_<stream>.log

    def prepare(self) -> None:
        """Make this launcher's log folder when --log-dir is given (before any worker starts:
        OSError when it cannot be made)."""
        if self.log_dir is not None:
            os.makedirs(os.path.join(self.log_dir, self.run_id), exist_ok=True)

    def files_dir(self) -> str:
        """Where per-rank files go (a temporary directory, said once, when --log-dir is not given)."""
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="unickpt_launch_")
            self.say(f"unickpt launch: the workers' log files (--tee/--redirects/--duplicate-*-filters) are under "
                     f"{self.log_dir}")
        return self.log_dir

    def attach(self, proc: Any, rank: int, local: int, attempt: int) -> None:
        """Start relaying ``proc``'s stdout and stderr (both pipes)."""
        for name, pipe, console in (("stdout", proc.stdout, sys.stdout), ("stderr", proc.stderr, sys.stderr)):
            filed = name in _for(self.tee, local) | _for(self.redirects, local)
            shown = name not in _for(self.redirects, local) and (self.filter is None or local in self.filter)
            path = None
            if filed:
                folder = os.path.join(self.files_dir(), self.run_id, f"attempt_{attempt}", str(local))
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, f"{name}.log")
            dup = None
            if name in self.duplicate:
                dup = (self._filtered_file(name, attempt), tuple(n.encode() for n in self.duplicate[name]))
            t = threading.Thread(target=self._pump, args=(pipe, f"[rank{rank}]: ".encode(), console if shown else None, path, dup),
                                 name=f"unickpt-launch-{name}-{rank}", daemon=True)
            t.start()
            self.threads.append(t)

    def _filtered_file(self, name: str, attempt: int) -> IO[bytes]:
        """The attempt's ``filtered_<name>.log``, one file for every rank of this node
        (opened by the launcher's thread, which attaches every worker; written under the lock)."""
        where = f"{attempt}/{name}"
        if where not in self._filtered:
            folder = os.path.join(self.files_dir(), self.run_id, f"attempt_{attempt}")
            os.makedirs(folder, exist_ok=True)
            self._filtered[where] = open(os.path.join(folder, f"filtered_{name}.log"), "ab")  # noqa: SIM115
        return self._filtered[where]

    def _pump(self, pipe: IO[bytes], prefix: bytes, console: Any, path: str | None,
              dup: tuple[IO[bytes], tuple[bytes, ...]] | None = None) -> None:
        out = getattr(console, "buffer", None) if console is not None else None
        f = open(path, "ab") if path else None
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the last line of a worker that died mid-line: still whole here
                if line.startswith(prefix):  # torch's excepthook (a plain script's init_process_group) says it already
                    line = line[len(prefix):]
                if f is not None:
                    f.write(line)
                    f.flush()
                if dup is not None and any(n in line for n in dup[1]):
                    with self.lock:
                        dup[0].write(prefix + line)
                        dup[0].flush()
                if out is not None:
                    with self.lock:
                        out.write(prefix + line)
                        out.flush()
        except (OSError, ValueError):
            pass  # the console went away (a closed terminal): the worker goes on
        finally:
            pipe.close()
            if f is not None:
                f.close()

    def say(self, line: str) -> None:
        """One of the launcher's own lines, on stderr, never inside a worker's."""
        with self.lock:
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def drain(self, timeout: float = 2.0) -> None:
        """Wait (briefly) for the relays of workers that ended to write their last lines (a
        worker's child holding its pipe may keep one open: it is left behind)."""
        import time

        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.threads = [t for t in self.threads if t.is_alive()]
