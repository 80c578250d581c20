"""What every trainer shares: the run directory's files, stop signals, checkpoints, progress.

A trainer (translation, GLUE) owns the model and the data; it reports to a `RunRecorder`, which
writes the SPEC 5 files (metrics.jsonl, schedule.jsonl, result.json, run.log) and forwards the
same numbers to the experiment logger (wandb or none), so the two never disagree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from dsq_cli import runs

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "dsq-checkpoint-1"
EXIT_CODES = {"completed": 0, "failed": 1, "diverged": 3, "interrupted": 130}


def quiet_library_warnings() -> None:
    """fairseq 0.12 on torch 2.x warns at every update about APIs it uses (autocast, jit,
    pin_memory without a GPU); they say nothing about the run and drown the progress line."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairseq\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true.*")


class Diverged(RuntimeError):
    """A NaN or Inf loss: training stops, the last good checkpoint stays."""


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


def save_checkpoint(path: Path, state: Mapping) -> None:
    """Write a checkpoint atomically. It holds only tensors and plain Python values, so it loads
    with ``torch.load(weights_only=True)``: resuming needs no unsafe unpickling."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    """A dsq checkpoint, loaded with torch's safe unpickler (``weights_only=True``)."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a dsq checkpoint ({CHECKPOINT_FORMAT})")
    return state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


class Progress:
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


class RunRecorder:
    """The run directory (SPEC 5) and the experiment logger, fed the same records."""

    def __init__(self, run_dir: Path, experiment_logger):
        self.dir = run_dir
        self.logger = experiment_logger
        self.metrics_path = run_dir / "metrics.jsonl"
        self.schedule_path = run_dir / "schedule.jsonl"
        self.result_path = run_dir / "result.json"
        self.checkpoint_dir = run_dir / "checkpoints"
        self.checkpoint_dir.mkdir(exist_ok=True)
        for path in (self.metrics_path, self.schedule_path):  # SPEC 5: both exist, maybe empty
            path.touch()

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoint_dir / "checkpoint_last.pt"

    def metrics(self, record: Mapping) -> None:
        runs.append_jsonl(self.metrics_path, record)
        self.logger.log(record)

    def schedule_change(self, record: Mapping) -> None:
        runs.append_jsonl(self.schedule_path, record)
        self.logger.event(record)

    def result(self, result: Mapping) -> None:
        runs.write_json(self.result_path, result)

    def truncate_after(self, update: int) -> None:
        """On resume: drop lines logged after the checkpoint (a hard kill can leave some)."""
        import json

        for path in (self.metrics_path, self.schedule_path):
            if not path.is_file():
                continue
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("update", 0) <= update
            ]
            runs.write_atomic(path, "".join(line + "\n" for line in kept))


class QuietRecorder(RunRecorder):
    """A RunRecorder that writes nothing: ranks other than 0 of a distributed run, whose numbers
    (all-reduced) are rank 0's."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir
        self.checkpoint_dir = run_dir / "checkpoints"

    def metrics(self, record: Mapping) -> None:
        pass

    def schedule_change(self, record: Mapping) -> None:
        pass

    def result(self, result: Mapping) -> None:
        pass

    def truncate_after(self, update: int) -> None:
        pass


@contextlib.contextmanager
def run_log(path: Path):
    """Send every log record (dsq's and fairseq's) to the run's log file while training."""
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%H:%M:%S")
    )
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        # Console handlers keep their own (WARNING) level; the file gets INFO.
        for console in root.handlers:
            if console is not handler and console.level == logging.NOTSET:
                console.setLevel(previous_level or logging.WARNING)
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)
        handler.close()
