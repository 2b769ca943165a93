"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (what SLURM sends
before it kills a job).

``stop_on_signals()`` turns the first SIGINT or SIGTERM into a request the training loop
reads at its next step boundary (``StopRequest.agreed``); the loop then saves that step,
waits for the save, and raises ``Stopped``, which ``jaxpar-train`` prints as one line
and exits 130 (SIGINT) or 143 (SIGTERM) on. The first signal puts the previous handlers
back, so a second one acts as it would have without us: a second Ctrl-C raises
``KeyboardInterrupt`` in Python (``jaxpar-train``'s own handler exits at once, status
130), a second SIGTERM kills.

Several processes (``jax.distributed``) must all stop at the same step, or the ones
still stepping wait forever in the next step's collectives: SLURM signals every task,
but not at the same instant. So with more than one process every step all-gathers the
processes' stop flags (one int each) and all stop when any was signalled.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import jax
import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped at a step boundary on a signal; ``signum`` is the signal."""

    def __init__(self, signum: int, step: int, saved: int):
        super().__init__(f"stopped at step {step}; last checkpoint at step {saved}; "
                         "rerun the same command to resume")
        self.signum, self.step, self.saved = signum, step, saved


class StopRequest:
    """The signal that asked this process to stop (``signum``), if any."""

    def __init__(self):
        self.signum: int | None = None

    def agreed(self) -> int | None:
        """The signal every process stops on now, or None to go on. With several
        processes it is a collective: every process calls it at every step."""
        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        signums = multihost_utils.process_allgather(np.int32(self.signum or 0))
        return int(np.max(signums)) or None


@contextlib.contextmanager
def stop_on_signals():
    """Yields a ``StopRequest`` that the first SIGINT or SIGTERM sets; the handlers in
    place before are back on the first signal and on leaving. Python installs handlers
    only in the main thread: elsewhere (a training thread) nothing is installed and the
    request is never set."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    # None: a handler installed outside Python, which Python cannot put back.
    previous = {s: signal.getsignal(s) or signal.SIG_DFL for s in SIGNALS}

    def restore():
        for s, handler in previous.items():
            signal.signal(s, handler)

    def handler(signum, frame):
        request.signum = signum
        restore()

    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield request
    finally:
        restore()
