"""The progress line's speed and ETA come from warm updates only (`ProgressLine`)."""

from __future__ import annotations

import pytest

from dsq_cli.train import progress_line
from dsq_cli.train.progress_line import WARMUP_UPDATES, ProgressLine

BITS = {"q0": "bfp8", "q1": "bfp2", "q2": "bfp8", "q3": "fixed16"}


@pytest.fixture
def clock(monkeypatch):
    """A settable monotonic clock for the progress line."""
    now = [0.0]
    monkeypatch.setattr(progress_line.time, "monotonic", lambda: now[0])
    return now


def lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_the_eta_ignores_a_slow_first_update(clock, capsys):
    """A 60 s warm-up update, then 1 s per update: 200 updates take minutes, and the line must
    not promise an hour (make demo once printed ETA 1h17m for a 3-minute run)."""
    line = ProgressLine(200, interval=0.0)
    clock[0] = 60.0
    line.update(1, 5.0, BITS, 1e-3)
    for update in range(2, 12):
        clock[0] = 60.0 + (update - 1)
        line.update(update, 5.0, BITS, 1e-3)
    out = lines(capsys)
    assert out[0].endswith("| warming up") and "ETA" not in out[0]
    warm = [line for line in out if "ETA" in line]
    assert warm, out
    # from update WARMUP_UPDATES on, 1 update per second: 189 updates left at update 11
    assert warm[-1].endswith("| 1.00 upd/s | ETA 3m09s"), warm[-1]
    assert len(out) - len(warm) == WARMUP_UPDATES  # the warm-up updates, then a first warm mark


def test_a_resumed_run_warms_up_again(clock, capsys):
    """A resumed process compiles again: its first updates are warm-up too."""
    line = ProgressLine(100, start_update=50, interval=0.0)
    clock[0] = 30.0
    line.update(51, 4.0, BITS, 1e-3)
    assert lines(capsys)[-1].endswith("| warming up")
    for update in range(52, 56):
        clock[0] += 2.0
        line.update(update, 4.0, BITS, 1e-3)
    assert lines(capsys)[-1].endswith("| 0.50 upd/s | ETA 1m30s")


def test_a_phase_says_when_it_starts_and_how_long_it_took(clock, capsys):
    line = ProgressLine(100, interval=0.0)
    with line.phase("validation at update 10"):
        clock[0] += 75
    err = capsys.readouterr().err.splitlines()
    assert err == ["validation at update 10 ...", "validation at update 10: done in 1m15s"]
    quiet = ProgressLine(100, quiet=True)
    with quiet.phase("validation at update 10"):
        pass
    assert capsys.readouterr().err == ""


def test_a_scoring_pass_shows_its_batches_and_an_eta(clock, capsys):
    line = ProgressLine(100, interval=0.0)
    with line.phase("final evaluation"):
        clock[0] += 10
        line.tick("beam search on test, batches", 2, 8)
        clock[0] += 10
        line.tick("beam search on test, batches", 4, 8)
    err = capsys.readouterr().err.splitlines()
    assert err[1:3] == [
        "beam search on test, batches: 2/8 | ETA 0m30s",
        "beam search on test, batches: 4/8 | ETA 0m20s",
    ]
