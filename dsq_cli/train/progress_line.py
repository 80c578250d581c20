"""`ProgressLine`: the one status line ``dsq train`` keeps on stderr while it trains."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping

# The first updates of a process carry the warm-up (torch.compile's kernels, the C kernels'
# build, oneDNN's primitives): a rate that counted them would promise hours for minutes of work.
WARMUP_UPDATES = 2


class ProgressLine:
    """One status line on stderr: update, loss, bits in force, speed and ETA. On a terminal it
    redraws in place; otherwise (logs, CI) it prints a line at most every ``interval`` seconds.
    Speed and ETA come from warm updates only, those after the process's first
    ``WARMUP_UPDATES``; until one is done the line says ``warming up``."""

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
        self.warm: tuple[int, float] | None = None  # (update, time) when warm-up ended

    def update(self, update: int, loss: float | None, bits: Mapping[str, str], lr: float) -> None:
        now = time.monotonic()
        if self.warm is None and update - self.start_update >= WARMUP_UPDATES:
            self.warm = (update, now)
        if self.quiet or (not self.tty and now - self.last_print < self.interval):
            return
        self.last_print = now
        speed = "warming up"
        if self.warm is not None and update > self.warm[0]:
            rate = (update - self.warm[0]) / max(now - self.warm[1], 1e-9)
            speed = f"{rate:.2f} upd/s"
            if self.total:
                speed += f" | ETA {_duration((self.total - update) / rate)}"
        total = f"/{self.total}" if self.total else ""
        loss_text = f"{loss:.3f}" if loss is not None else "-"
        line = (
            f"update {update}{total} | loss {loss_text} | lr {lr:.2e} | "
            f"q0 {bits['q0']} q1 {bits['q1']} q2 {bits['q2']} q3 {bits['q3']} | {speed}"
        )
        if self.tty:
            sys.stderr.write("\r" + line[:160].ljust(120))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        """One line of its own (the run's budget, when it starts)."""
        if not self.quiet:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    @contextlib.contextmanager
    def phase(self, label: str):
        """A stretch without updates (a validation, the final scoring): a line when it starts
        and one with its duration when it ends, so that a run is never silent for minutes."""
        if self.quiet:
            yield
            return
        started = self._phase_started = time.monotonic()
        sys.stderr.write(("\n" if self.tty else "") + f"{label} ...\n")
        sys.stderr.flush()
        yield
        sys.stderr.write(f"{label}: done in {_duration(time.monotonic() - started)}\n")
        sys.stderr.flush()

    def tick(self, label: str, done: int, total: int) -> None:
        """Progress inside a phase (the batches of a scoring pass): ``done`` of ``total`` and an
        ETA from the phase's time so far; redrawn on a terminal, else at most every
        ``interval`` seconds."""
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self.last_print < self.interval):
            return
        self.last_print = now
        elapsed = now - getattr(self, "_phase_started", now)
        eta = _duration(elapsed / done * (total - done)) if done else "-"
        line = f"{label}: {done}/{total} | ETA {eta}"
        sys.stderr.write(("\r" + line.ljust(60)) if self.tty else line + "\n")
        if self.tty and done == total:
            sys.stderr.write("\n")
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
