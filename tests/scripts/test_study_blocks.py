"""scripts/study_blocks.py: a protocol's block of comparisons, Holm-adjusted over the block, is
what docs/results.md's answer tables show; its verdicts follow the protocol's rule; and a block
with a run missing is not compared."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("study_blocks", REPO / "scripts" / "study_blocks.py")
study_blocks = importlib.util.module_from_spec(_spec)
sys.modules["study_blocks"] = study_blocks  # its dataclasses look their module up there
_spec.loader.exec_module(study_blocks)


def docs_table(heading: str) -> str:
    """The table of docs/results.md that starts at the line ``heading``."""
    lines = (REPO / "docs" / "results.md").read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "verdicts"), [
    ("clean-control", {"equivalent": 2, "not resolved": 2}),
    ("lm", {"better": 2, "not resolved": 5, "worse": 2}),
])  # fmt: skip
def test_a_blocks_answer_in_the_docs_is_what_the_script_prints(name, verdicts, monkeypatch):
    monkeypatch.chdir(REPO)
    printed = study_blocks.markdown(study_blocks.BLOCKS[name]())
    assert printed == docs_table(printed.splitlines()[0])
    assert {v: printed.count(f"| {v} |") for v in verdicts} == verdicts


@pytest.mark.parametrize(("mean", "p_held", "tost_held", "says"), [
    (-0.01, 0.01, 0.01, "better"),  # a lower loss is better; a difference beats equivalence
    (+0.01, 0.04, 0.01, "worse"),
    (-0.01, 0.06, 0.049, "equivalent"),
    (-0.01, 0.06, 0.05, "not resolved"),  # 5% exactly does not reject
])  # fmt: skip
def test_a_verdict_reads_the_adjusted_p_values(mean, p_held, tost_held, says):
    assert study_blocks.verdict(mean, p_held, tost_held) == says


def test_a_block_with_a_run_missing_is_not_compared(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    record = tmp_path / "results" / "lm" / "seed1" / "quant-dsq" / "result.json"
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    with pytest.raises(FileNotFoundError, match="a block is compared only once all its runs"):
        study_blocks.rows(study_blocks.lm())
    assert study_blocks.main(["lm"]) == 2
    said = capsys.readouterr().err
    assert "no record in results/lm/seed1/quant-amp_bf16" in said
    assert "results/lm/seed1/quant-dsq," not in said  # the run that is in is not named
    assert study_blocks.main(["nine"]) == 2
    assert "one of clean-control, lm" in capsys.readouterr().err


def _scipy_numbers(comparison) -> tuple[float, float, float, float]:
    """mean, p and TOST p (margin 0.02) of a comparison, from its records with scipy."""
    stats = pytest.importorskip("scipy.stats")

    def result(run):
        return json.loads((run / "result.json").read_text())

    def valid_losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        entries = [json.loads(x) for x in lines if x.strip()]
        return {e["update"]: e["valid_loss"] for e in entries if e.get("kind") == "valid"}

    differences = []
    for mine, theirs in comparison.pairs:
        if comparison.endpoint == "last-loss":
            last = [result(run)["checkpoints"]["last"]["valid_loss"] for run in (mine, theirs)]
            differences.append(last[0] - last[1])
            continue
        segments = result(mine)["precision_segments"]
        if len(segments) < 2:
            continue  # never moved: no post-move pair
        moved = segments[0]["updates"]
        a, b = valid_losses(mine), valid_losses(theirs)
        after = [u for u in a if u > moved and u in b]
        differences.append(min(a[u] for u in after) - min(b[u] for u in after))
    n = len(differences)
    mean, se = sum(differences) / n, stats.sem(differences)
    p = stats.ttest_1samp(differences, 0.0).pvalue
    tost = max(stats.t.sf((mean + 0.02) / se, n - 1), stats.t.cdf((mean - 0.02) / se, n - 1))
    return mean, n, p, tost


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clean-control", "lm"])
def test_each_comparison_of_a_block_is_its_records_recomputed_with_scipy(name, monkeypatch):
    monkeypatch.chdir(REPO)
    block = study_blocks.BLOCKS[name]()
    for comparison, found in zip(block.comparisons, study_blocks.rows(block)):
        mean, n, p, tost = _scipy_numbers(comparison)
        assert (found["mean"], found["n"]) == (pytest.approx(mean, abs=1e-12), n), comparison
        assert found["p"] == pytest.approx(p, rel=1e-6), comparison
        assert found["equivalence_p"] == pytest.approx(tost, rel=1e-6), comparison
