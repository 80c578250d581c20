"""What a run writes while it trains: the run directory's files and its checkpoints.

A trainer reports to a `RunRecorder`, which writes metrics.jsonl, schedule.jsonl and result.json
(docs/spec.md §5) and forwards the same records to the experiment logger (wandb or none), so the
two never disagree. Ranks other than 0 of a distributed run get a `QuietRecorder`: their numbers
are rank 0's. Checkpoints hold only tensors and plain values, so that resuming needs no unsafe
unpickling.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from dsq.atomic_files import atomic_path, write_atomic
from dsq_cli import runs
from dsq_cli.run_result import RunResult

CHECKPOINT_FORMAT = "dsq-checkpoint-1"
log = logging.getLogger(__name__)


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that is there but cannot be loaded: empty, cut short (a copy or a disk
    that failed; never dsq's own atomic write) or not a dsq checkpoint at all."""


class CheckpointNotSaved(RuntimeError):
    """Writing a checkpoint failed (a full disk, a file system gone read-only); the checkpoint
    written before it is untouched."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def save_checkpoint(path: Path, state: Mapping) -> None:
    """Write a checkpoint atomically. It holds only tensors and plain Python values, so it loads
    with ``torch.load(weights_only=True)``: resuming needs no unsafe unpickling. A failure is a
    `CheckpointNotSaved` naming the file (torch reports a full disk as a RuntimeError of its zip
    writer)."""
    try:
        with atomic_path(path) as tmp:
            torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    except Exception as err:
        raise CheckpointNotSaved(f"could not save {path}: {_first_line(err)}") from err


def load_checkpoint(path: Path) -> dict:
    """A dsq checkpoint, loaded with torch's safe unpickler (``weights_only=True``);
    `UnreadableCheckpoint`, naming the file and why, when it cannot be loaded."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise UnreadableCheckpoint(f"{path} is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a zip cut short: RuntimeError; other bytes: UnpicklingError
        # torch's first sentence says what failed; the rest is advice this message replaces
        reason = _first_line(err).split(". ")[0]
        raise UnreadableCheckpoint(
            f"{path} cannot be read, it is cut short or not a checkpoint "
            f"({type(err).__name__}: {reason})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UnreadableCheckpoint(f"{path} is not a dsq checkpoint ({CHECKPOINT_FORMAT})")
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


class RunRecorder:
    """The run directory (docs/spec.md §5) and the experiment logger, fed the same records."""

    def __init__(self, run_dir: Path, experiment_logger):
        self.dir = run_dir
        self.logger = experiment_logger
        self.metrics_path = run_dir / "metrics.jsonl"
        self.schedule_path = run_dir / "schedule.jsonl"
        self.checkpoint_dir = run_dir / "checkpoints"
        self.checkpoint_dir.mkdir(exist_ok=True)
        for path in (self.metrics_path, self.schedule_path):  # both exist, maybe empty
            path.touch()

    @property
    def last_checkpoint(self) -> Path:
        return runs.last_checkpoint(self.dir)

    @property
    def best_checkpoint(self) -> Path:
        return runs.best_checkpoint(self.dir)

    def metrics(self, record: Mapping) -> None:
        runs.append_jsonl(self.metrics_path, record)
        self.logger.log(record)

    def schedule_change(self, record: Mapping) -> None:
        runs.append_jsonl(self.schedule_path, record)
        self.logger.event(record)

    def result(self, result: RunResult, *, in_place: bool = False) -> None:
        result.write(self.dir, in_place=in_place)

    def truncate_after(self, update: int) -> None:
        """On resume: drop lines logged after the checkpoint (a hard kill can leave some), and a
        last line a kill cut short mid-write, with a warning."""
        for path in (self.metrics_path, self.schedule_path):
            if not path.is_file():
                continue
            kept = [line for line, record in _records(path) if record.get("update", 0) <= update]
            write_atomic(path, "".join(line + "\n" for line in kept))


def _records(path: Path) -> list[tuple[str, dict]]:
    """The lines of a JSON-lines file (metrics.jsonl, schedule.jsonl) with their records. A last
    line that is not a JSON object is one a kill cut short: it is left out, with a warning. Any
    other such line is damage no kill makes: a ValueError naming it."""
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1)
             if line.strip()]  # fmt: skip
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append((line, record))
        elif position == len(lines) - 1:
            log.warning("%s: dropped its last line, cut short by a kill mid-write: %.60s",
                        path, line)  # fmt: skip
        else:
            raise ValueError(
                f"{path}:{number}: not a JSON object, and not the last line (which a kill can "
                "cut short); mend or remove that line, then resume again"
            )
    return records


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

    def result(self, result: RunResult, *, in_place: bool = False) -> None:
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
