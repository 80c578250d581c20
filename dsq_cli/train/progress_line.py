"""`ProgressLine`: the one status line ``dsq train`` keeps on stderr while it trains."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping


class ProgressLine:
    """One status line on stderr: update, loss, bits in force, ETA. On a terminal it redraws in
    place; otherwise (logs, CI) it prints a line at most every ``interval`` seconds."""

    def __init__(
        self,
        total_updates: int | None,
        start_update: int = 0,
        interval: float = 30.0,
        quiet: bool = False,
    ):
        self.quiet = quiet  # ranks other than 0 of a distributed run
        self.total = total_updates or None
        self.start_update = start_update
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = interval
        self.last_print = 0.0

    def update(self, update: int, loss: float | None, bits: Mapping[str, str], lr: float) -> None:
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self.last_print < self.interval):
            return
        self.last_print = now
        done = update - self.start_update
        rate = done / max(now - self.started, 1e-9)
        eta = ""
        if self.total and rate > 0:
            eta = f" | ETA {_duration((self.total - update) / rate)}"
        total = f"/{self.total}" if self.total else ""
        loss_text = f"{loss:.3f}" if loss is not None else "-"
        line = (
            f"update {update}{total} | loss {loss_text} | lr {lr:.2e} | "
            f"q0 {bits['q0']} q1 {bits['q1']} q2 {bits['q2']} q3 {bits['q3']} | "
            f"{rate:.2f} upd/s{eta}"
        )
        if self.tty:
            sys.stderr.write("\r" + line[:160].ljust(120))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )
