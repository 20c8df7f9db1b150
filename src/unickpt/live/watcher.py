"""The two threads a live worker runs beside ``fn`` (:mod:`.run`): the watcher, which waits
for each next generation of the job and hands it over, and the beats, which tell the
node's launcher that the process runs (from the start of ``unickpt.run``, before the
first generation is joined: a worker stopped while its generation gathers is found too).

The watcher blocks in the store's ``wait`` (a wake-up per generation, no polling, no
timeout): under ``unickpt launch`` on this worker's own key in its node's store, where the
launcher relays each generation; without a node store (a test's own), on the job's store,
a second at a time. Each thread has its own connection (one blocked in ``wait`` cannot
carry the beats); both end with :meth:`Watcher.stop`, never left blocked in a store whose
server goes away at exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from .. import store_client
from . import control
from .control import Generation, key

WATCH_WAIT_S = 3600.0  # the watcher's wait in its node's store: stop() wakes it with its own key (no timeout logged)
ALIVE_S = 0.5  # how often the beats tell the launcher that this process runs
CONNECT_WAIT_S = 30.0  # how long start() waits for the watcher's connections (a store that does not answer: it goes on)


class Watcher:
    """Waits for the generations after :attr:`seen` of the job at ``address`` (relayed on
    ``node_address``) and calls ``on_generation(gen)`` for each, in the watcher thread;
    beats ``alive`` for ``worker`` on the node's store. ``waker`` is a connection of the
    caller's to the node's store, used by :meth:`stop` to wake the watcher."""

    def __init__(self, worker: str, address: str, node_address: str, waker: Any,
                 on_generation: Callable[[Generation], None]) -> None:
        self.worker, self.address, self.node_address = worker, address, node_address
        self.waker, self.on_generation = waker, on_generation
        self.seen = -1  # the newest generation this worker has seen (the caller moves it too)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watching = False  # the watcher thread started (the beats may run before it)
        self._connected = threading.Event()  # the watcher's connections are made (or failed)
        self._beating = threading.Event()  # the beats' connection is made (or failed)

    @property
    def started(self) -> bool:
        return self._watching

    def start_beats(self) -> None:
        """Start the beats (once; before the watcher, which needs a generation to watch).
        The first is sent before this returns, on the caller's connection: the launcher
        takes a worker for hung only once it has beaten, and one stopped within its first
        ALIVE_S (before the beat thread's first beat) was never killed, its peers waiting
        out their collective timeout."""
        if not self._threads:
            with contextlib.suppress(RuntimeError):  # the store is gone: the beat thread ends as well
                self.waker.add(key("alive", self.worker), 1)
            self._spawn(self._beat, "unickpt-live-beat")

    def start(self) -> None:
        """Start the watcher (and the beats, if not started yet); returns once it is
        connected (no connection of its opens while a generation's group forms, which
        tells its own by the sockets that appear meanwhile: :class:`.regroup.Rendezvous`)."""
        self.start_beats()
        self._watching = True
        self._spawn(self._watch, "unickpt-live-watch")
        self._beating.wait(CONNECT_WAIT_S)
        self._connected.wait(CONNECT_WAIT_S)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _watch(self) -> None:
        try:
            store = store_client.connect(self.address)
            relayed = self.node_address != self.address
            watched = store_client.connect(self.node_address) if relayed else store
        except RuntimeError:
            return  # the store is gone: the control plane was lost
        finally:
            self._connected.set()
        while not self._stop.is_set():
            nxt = self.seen + 1
            try:
                if relayed:
                    woke = store_client.wait_key(watched, control.watch_key(self.worker, nxt), WATCH_WAIT_S)
                else:
                    woke = store_client.wait_key(watched, key("g", nxt), 1.0)
                if not woke or self._stop.is_set():
                    continue
                gen = control.read(store, nxt)
            except RuntimeError:
                return  # the store is gone: the control plane was lost
            self.seen = nxt
            self.on_generation(gen)

    def _beat(self) -> None:
        """``alive`` every ALIVE_S on the node's store (its own connection)."""
        try:
            try:
                store = store_client.connect(self.node_address)
            finally:
                self._beating.set()
            while not self._stop.wait(ALIVE_S):
                store.add(key("alive", self.worker), 1)
        except RuntimeError:
            return  # the store is gone

    def stop(self) -> None:
        """End both threads (the watcher woken by its own key, set here)."""
        self._stop.set()
        if self._watching and self.node_address != self.address:
            try:
                self.waker.set(control.watch_key(self.worker, self.seen + 1), "stop")
            except RuntimeError:
                pass  # the launcher is gone: the watcher's wait has failed already
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(2.0)
