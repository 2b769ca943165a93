"""Compiling a list of programs on a thread of its own (``Engine.warm_up``): the
caller waits until a condition holds (the first of each kind compiled) or until all
are, and may stop it after the program compiling; what the thread raised is raised
again to whoever waits."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class Warming:
    """Runs ``compile_one(item)`` for each of ``items`` in order on a thread named
    ``jaxpar-warm-up``; ``ready()`` is asked after each, and ``finished()`` called once
    all are compiled (not when stopped)."""

    def __init__(self, items: Sequence, compile_one: Callable, ready: Callable[[], bool],
                 finished: Callable[[], None]):
        self._stop, self._ready, self.error = threading.Event(), threading.Event(), None

        def run():
            try:
                for item in items:
                    if self._stop.is_set():
                        return
                    compile_one(item)
                    if ready():
                        self._ready.set()
                finished()
            except BaseException as e:  # noqa: BLE001 (raised again by wait_ready and join)
                self.error = e
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="jaxpar-warm-up")
        self._thread.start()

    def wait_ready(self) -> None:
        """Until ``ready()`` held once (or all are compiled); a Ctrl-C while waiting stops it."""
        try:
            self._ready.wait()
        except BaseException:
            self.stop()
            raise
        self._raise()

    def join(self, timeout: float | None = None) -> None:
        """Until every program is compiled (or ``timeout``); a Ctrl-C while waiting stops it."""
        try:
            self._thread.join(timeout)
        except BaseException:
            self._stop.set()
            raise
        self._raise()

    def stop(self) -> None:
        """Stops after the program compiling, and waits for it."""
        self._stop.set()
        self._thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
