"""How a run stops before its budget is spent, and the exit code each ending gets.

`StopRequest` turns SIGINT/SIGTERM into a flag the loop checks between updates; the loop raises
`Interrupted` (after a checkpoint) or `Diverged` (a NaN/Inf loss); `rank_run` turns them into the
run's status and exit code (docs/training.md).
"""

from __future__ import annotations

import logging
import math
import signal

log = logging.getLogger(__name__)

EXIT_CODES = {"completed": 0, "failed": 1, "diverged": 3, "interrupted": 130}


class Diverged(RuntimeError):
    """A NaN or Inf loss: training stops, the last good checkpoint stays."""


def check_finite(what: str, value: float | None, update: int) -> None:
    """`Diverged` when ``value`` (``what``: the training or validation loss of ``update``) is NaN,
    Inf or missing: every family ends such a run alike, its message naming the loss and update."""
    if value is None or not math.isfinite(value):
        raise Diverged(f"{what} is {value} at update {update}")


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM: training stops after the current update and saves a checkpoint."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequest:
    """Turns SIGINT and SIGTERM into a flag the training loop checks between updates, so that
    a checkpoint is written from a consistent state. A second signal stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # asked twice: the user means it
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: stopping after this update", signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals stay with their owner
                pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)
