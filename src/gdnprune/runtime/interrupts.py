"""Signals: stopping a run cleanly, and the short stretches that must not be stopped halfway.

* :class:`Interrupted` is the ``KeyboardInterrupt`` that :func:`handle_signals` raises for SIGINT,
  SIGTERM and SIGHUP (what Ctrl-C, ``kill``, ``timeout``, docker, Slurm and a closed terminal send), so
  that one ``except BaseException`` cleanup path serves all of them. The command line installs it; a
  library user keeps whatever handlers their program has.
* :func:`deferred_signals` holds those signals back while a few file operations run (creating a
  temporary folder and registering it for cleanup, deleting it, swapping an output into place), then
  delivers them as they would have been delivered. Signal handlers can only be changed from the main
  thread; elsewhere the block runs unprotected.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["SIGNALS", "Interrupted", "handle_signals", "deferred_signals"]

#: the signals that stop a run
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal. ``signum`` is the signal; ``exit_code`` is ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_signals(*, deliver: bool = True) -> Iterator[list[int]]:
    """Hold SIGINT, SIGTERM and SIGHUP back during the block; yields the list of signals received.

    On leaving, the previous handlers come back and, with ``deliver``, the first signal received is
    delivered to its previous handler (a Python handler is called, so it may raise; the default action
    of SIGTERM and SIGHUP ends the process as it would have). ``deliver=False`` drops them: for cleanup
    that runs because the run is already stopping.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if deliver and received:
            signum = received[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
