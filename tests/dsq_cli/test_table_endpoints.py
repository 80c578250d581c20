"""`dsq table`'s endpoints (docs/table.md, "Endpoints"): the last model's validation loss, the
post-move loss of a rising row against its static controls, and p-values with Holm's
adjustment, each recomputed here from the committed records with scipy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsq_cli import table
from dsq_cli.cli import app
from dsq_cli.table.intervals import holm

stats = pytest.importorskip("scipy.stats")
REPO = Path(__file__).resolve().parents[2]
CONVERGENCE = REPO / "results" / "convergence"
SEEDS = (1, 2, 3, 4, 5)


def record(seed: int, row: str) -> dict:
    return json.loads((CONVERGENCE / f"seed{seed}" / f"quant-{row}" / "result.json").read_text())


def valid_losses(seed: int, row: str) -> dict[int, float]:
    lines = (CONVERGENCE / f"seed{seed}" / f"quant-{row}" / "metrics.jsonl").read_text()
    entries = [json.loads(line) for line in lines.splitlines() if line.strip()]
    return {e["update"]: e["valid_loss"] for e in entries if e.get("kind") == "valid"}


def scipy_paired(differences):
    interval = stats.t.interval(0.95, len(differences) - 1, loc=sum(differences) / len(differences),
                                scale=stats.sem(differences))  # fmt: skip
    return interval, stats.ttest_1samp(differences, 0.0).pvalue


def json_table(*args):
    result = CliRunner().invoke(app, ["table", str(CONVERGENCE), "--format", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_last_loss_differences_are_the_last_models_recomputed_with_scipy():
    found = json_table("--against", "fp32", "--endpoint", "last-loss", "--adjust", "holm")
    assert found["endpoint"] == "last_valid_loss"
    differences = [
        record(s, "dsq")["checkpoints"]["last"]["valid_loss"]
        - record(s, "fp32")["checkpoints"]["last"]["valid_loss"]
        for s in SEEDS
    ]
    (low, high), p = scipy_paired(differences)
    diff = found["cells"]["dsq"]["multi30k"]["measures"]["last_valid_loss"]["difference"]
    assert diff["n"] == 5
    assert diff["low"] == pytest.approx(low) and diff["high"] == pytest.approx(high)
    assert diff["p"] == pytest.approx(p, rel=1e-6)
    # Holm within the block: every row's last-loss difference from fp32 in this column
    block = {row: cell["multi30k"]["measures"]["last_valid_loss"]["difference"]["p"]
             for row, cell in found["cells"].items() if row != "fp32"}  # fmt: skip
    rows = list(block)
    adjusted = dict(zip(rows, holm([block[r] for r in rows])))
    assert diff["p_adjusted"] == pytest.approx(adjusted["dsq"])
    ranked = sorted(p for p in block.values() if p is not None)
    smallest = min(rows, key=lambda r: block[r] if block[r] is not None else 2)
    assert adjusted[smallest] == pytest.approx(min(1.0, len(ranked) * ranked[0]))


def test_holm_steps_down_and_never_decreases():
    assert holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert holm([0.5, 0.6]) == [1.0, 1.0]


def test_post_move_loss_of_the_rising_stash_against_its_control_recomputed_by_hand():
    found = table.collect([CONVERGENCE], endpoint="post-move")
    records = {(r["row"], r["control"]): r for r in table.post_move_records(found)}
    mine_pair = ("bfp6_rising_stash", "bfp6_stash_bfp3")
    mine = records[mine_pair]
    differences = []
    for seed in SEEDS:
        moved = record(seed, "bfp6_rising_stash")["precision_segments"][0]["updates"]
        rising, control = (
            valid_losses(seed, "bfp6_rising_stash"),
            valid_losses(seed, "bfp6_stash_bfp3"),
        )
        after = [u for u in rising if u > moved and u in control]
        differences.append(min(rising[u] for u in after) - min(control[u] for u in after))
    (low, high), p = scipy_paired(differences)
    assert mine["interval"].n == 5 and mine["unmoved"] == []
    assert mine["interval"].low == pytest.approx(low) and mine["interval"].high == pytest.approx(
        high
    )
    assert mine["p"] == pytest.approx(p, rel=1e-6)
    # JSON carries the block as markdown prints it, with the adjusted p beside the raw one
    block = json_table("--endpoint", "post-move", "--adjust", "holm")["post_move"]
    (as_json,) = [r for r in block if (r["row"], r["control"]) == mine_pair]
    assert (as_json["low"], as_json["high"], as_json["n"]) == pytest.approx((low, high, 5))
    assert as_json["p"] == pytest.approx(p, rel=1e-6) and as_json["p_adjusted"] >= as_json["p"]
    assert json_table("--against", "fp32")["post_move"] is None  # not asked for
    # the static controls of a rising row are the rows of its points with the stash at a level
    assert set(table.static_controls(found, "bfp6_rising_stash")) == {
        "bfp6", "bfp6_stash_bfp3", "bfp6_stash_bfp4",
    }  # fmt: skip


def test_post_move_prints_a_block_and_bad_endpoints_are_usage_errors():
    result = CliRunner().invoke(app, ["table", str(CONVERGENCE), "--endpoint", "post-move"])
    assert result.exit_code == 0 and "bfp6_rising_stash - bfp6_stash_bfp3, multi30k: +0.003" in (
        result.output
    )
    for args, says in ((["--endpoint", "auc"], "--endpoint 'auc': choose one of"),
                       (["--adjust", "holm"], "give --against ROW or --endpoint post-move"),
                       (["--against", "fp32", "--adjust", "bonf"], "--adjust 'bonf'")):  # fmt: skip
        result = CliRunner().invoke(app, ["table", str(CONVERGENCE), *args])
        assert result.exit_code == 2 and says in result.output


# The clean control of dsq (docs/results.md, "Protocol"): dsq trained again at the control's
# commit against dsq_stash_bfp2, in two settings, by two endpoints: one block of four.
CLEAN_CONTROL = {
    "de->en": ("convergence-dsq-rerun", "convergence", SEEDS),
    "en->de": ("convergence-en-de-dsq-rerun", "convergence-en-de", (1, 2, 3)),
}


def _clean_control_pairs(setting: str):
    rising_root, control_root, seeds = CLEAN_CONTROL[setting]
    return [
        (REPO / "results" / rising_root / f"seed{s}" / "quant-dsq",
         REPO / "results" / control_root / f"seed{s}" / "quant-dsq_stash_bfp2")
        for s in seeds
    ]  # fmt: skip


def _valid_losses_at(run: Path) -> dict[int, float]:
    entries = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return {e["update"]: e["valid_loss"] for e in entries if e.get("kind") == "valid"}


def _scipy_tost(differences, margin):
    n = len(differences)
    mean, se = sum(differences) / n, stats.sem(differences)
    return max(stats.t.sf((mean + margin) / se, n - 1), stats.t.cdf((mean - margin) / se, n - 1))


def test_the_clean_controls_block_of_four_is_the_records_recomputed_with_scipy():
    """Each of the four comparisons from the records with scipy, against `dsq table`'s own numbers
    and against docs/results.md's table of the block, Holm-adjusted over the four."""
    found = {}
    for setting in CLEAN_CONTROL:
        pairs = _clean_control_pairs(setting)
        last = [
            json.loads((a / "result.json").read_text())["checkpoints"]["last"]["valid_loss"]
            - json.loads((b / "result.json").read_text())["checkpoints"]["last"]["valid_loss"]
            for a, b in pairs
        ]
        post = []
        for a, b in pairs:
            moved = json.loads((a / "result.json").read_text())["precision_segments"][0]["updates"]
            mine, theirs = _valid_losses_at(a), _valid_losses_at(b)
            after = [u for u in mine if u > moved and u in theirs]
            post.append(min(mine[u] for u in after) - min(theirs[u] for u in after))
        for endpoint, differences in (("last-model", last), ("post-move", post)):
            p = stats.ttest_1samp(differences, 0.0).pvalue
            found[f"{setting}, {endpoint} loss (n={len(differences)})"] = (
                p,
                _scipy_tost(differences, 0.02),
                differences,
            )
        # dsq table's numbers for the same comparison
        paths = [str(pairs[0][0].parents[1])] + [str(b) for _, b in pairs]
        table_last = json.loads(
            CliRunner()
            .invoke(
                app,
                [
                    "table",
                    *paths,
                    "--format",
                    "json",
                    "--rows",
                    "dsq",
                    "--against",
                    "dsq_stash_bfp2",
                    "--margin",
                    "0.5,0.02",
                    "--endpoint",
                    "last-loss",
                ],
            )
            .output  # fmt: skip
        )["cells"]["dsq"]["multi30k"]["measures"]["last_valid_loss"]["difference"]
        p, tost, _ = found[f"{setting}, last-model loss (n={len(pairs)})"]
        assert table_last["p"] == pytest.approx(p, rel=1e-6)
        assert table_last["equivalence_p"] == pytest.approx(tost, rel=1e-6)
        collected = table.collect(paths, against="dsq_stash_bfp2", margins=(0.5, 0.02),
                                  rows=["dsq"], endpoint="post-move")  # fmt: skip
        (record,) = table.post_move_records(collected)
        p, tost, _ = found[f"{setting}, post-move loss (n={len(pairs)})"]
        assert record["p"] == pytest.approx(p, rel=1e-6)
        assert record["equivalence_p"] == pytest.approx(tost, rel=1e-6)
    labels = list(found)
    held = dict(zip(labels, holm([found[k][0] for k in labels])))
    held_tost = dict(zip(labels, holm([found[k][1] for k in labels])))
    docs = (REPO / "docs" / "results.md").read_text()
    for label in labels:
        p, tost, _ = found[label]
        line = next(x for x in docs.splitlines() if x.startswith(f"| {label} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2:6] == [
            f"{p:.3f}",
            f"{held[label]:.3f}",
            f"{tost:.4f}",
            f"{held_tost[label]:.4f}",
        ]
        assert cells[6] == ("equivalent" if held_tost[label] < 0.05 else "not resolved")
        assert held[label] > 0.05  # neither better nor worse, as the page says
