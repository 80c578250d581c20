"""Intervals in `dsq table` (docs/table.md, "Intervals"): the Student t quantile against scipy
and textbook values, each cell's interval and the paired differences of ``--against`` checked
by hand from the records, the frontier's dominances that hold and those unresolved, and
``--moves`` on a periodic schedule."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsq.presets import record_quant
from dsq_cli import table
from dsq_cli.cli import app
from dsq_cli.table.intervals import mean_interval, paired_interval, t_cdf, t_quantile

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
CONVERGENCE = REPO / "results" / "convergence"


def invoke(*args):
    return runner.invoke(app, ["table", *map(str, args)])


# -- the t quantile -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "df, quantile",  # two-sided 95% critical values, from any t table
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)],
)
def test_t_quantile_matches_the_textbook_table(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=5e-4)


def test_t_quantile_matches_scipy_across_levels_and_degrees_of_freedom():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 7, 12, 30, 120, 1000):
        for p in (0.55, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.05, 0.025):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-9)
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degree of freedom"):
        t_quantile(0.9, 0)


def test_mean_and_paired_intervals():
    one = mean_interval([27.5])
    assert (one.mean, one.n, one.low, one.high) == (27.5, 1, None, None)
    values = [28.22, 27.52, 27.9]
    interval = mean_interval(values, 0.9)
    half = t_quantile(0.95, 2) * statistics.stdev(values) / math.sqrt(3)
    assert interval.low == pytest.approx(statistics.fmean(values) - half)
    assert interval.high == pytest.approx(statistics.fmean(values) + half)
    # paired: only the shared keys, row minus the other
    diff = paired_interval({1: 5.0, 2: 6.0, 3: 7.5, 4: 1.0}, {1: 4.0, 2: 4.5, 3: 6.5})
    assert diff.n == 3 and diff.mean == pytest.approx((1.0 + 1.5 + 1.0) / 3)
    assert diff.excludes_zero
    assert paired_interval({1: 1.0}, {2: 1.0}) is None


# -- one interval by hand, from the committed records --------------------------------------------


def _records(row_dir: str) -> dict[int, dict]:
    out = {}
    for path in sorted(CONVERGENCE.glob(f"seed*/{row_dir}/result.json")):
        result = json.loads(path.read_text())
        if result["status"] == "completed":
            out[result["seed"]] = result
    return out


def test_against_json_gives_mean_n_interval_and_paired_difference_by_hand():
    """`dsq table results/convergence --against fp32 --format json`: dsq's BLEU interval and its
    paired difference from fp32 in BLEU and best validation loss, recomputed here from the
    result.json files with the t quantile and the sample standard deviation."""
    stats = pytest.importorskip("scipy.stats")
    fp32, dsq = _records("quant-fp32"), _records("quant-dsq")
    assert len(fp32) >= 2 and len(dsq) >= 2
    result = invoke(CONVERGENCE, "--against", "fp32", "--format", "json")
    assert result.exit_code == 0, result.output
    cell = json.loads(result.stdout)["cells"]["dsq"]["multi30k"]

    bleu = [r["value"] for r in dsq.values()]
    n = len(bleu)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(bleu) / math.sqrt(n)
    measure = cell["measures"]["bleu"]
    assert measure["n"] == n and measure["level"] == 0.95
    assert measure["mean"] == pytest.approx(statistics.fmean(bleu))
    assert measure["low"] == pytest.approx(statistics.fmean(bleu) - half)
    assert measure["high"] == pytest.approx(statistics.fmean(bleu) + half)

    for key, name in (("value", "bleu"), ("best_valid_loss", "best_valid_loss")):
        seeds = sorted(set(fp32) & set(dsq))
        diffs = [dsq[s][key] - fp32[s][key] for s in seeds]
        half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        difference = cell["measures"][name]["difference"]
        assert difference["against"] == "fp32" and difference["n"] == len(seeds)
        assert difference["mean"] == pytest.approx(statistics.fmean(diffs))
        assert difference["low"] == pytest.approx(statistics.fmean(diffs) - half)
        assert difference["high"] == pytest.approx(statistics.fmean(diffs) + half)
    # the against row has no difference from itself; the CSV carries the same numbers
    itself = json.loads(result.stdout)["cells"]["fp32"]["multi30k"]["measures"]["bleu"]
    assert itself["difference"]["n"] == 0
    csv_text = invoke(CONVERGENCE, "--against", "fp32", "--format", "csv").stdout
    import csv
    import io

    row = next(r for r in csv.DictReader(io.StringIO(csv_text)) if r["row"] == "dsq")
    assert float(row["diff_mean"]) == pytest.approx(cell["diff_mean"])
    assert float(row["loss_diff_low"]) == pytest.approx(cell["loss_diff_low"])
    assert row["against"] == "fp32" and float(row["level"]) == 0.95


# -- synthetic rows: resolved and unresolved dominance --------------------------------------------


def _run(root: Path, preset: str, points: dict, seed: int, bleu: float, loss: float, arith, dram):
    run_dir = root / f"{preset}-seed{seed}"
    run_dir.mkdir(parents=True)
    result = {
        "status": "completed",
        "task": "multi30k",
        "model": "transformer_tiny",
        "seed": seed,
        "quant": {"preset": preset, **points, "stash_scope": "gemm", "modified": False},
        "metric": "bleu",
        "value": bleu,
        "bleu": bleu,
        "valid_loss": loss,
        "best_valid_loss": loss,
        "updates": 640,
        "cost": {"arith_ratio": arith, "dram_ratio": dram, "baseline": "fixed32"},
        "stash_bits_mean": 4.5,
        "wall_seconds": 100.0,
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"},
    }
    (run_dir / "result.json").write_text(json.dumps(result))


@pytest.fixture
def paired_root(tmp_path):
    """fp32 and two cheaper rows over 4 seeds: ``cheap_better`` beats fp32 by 1 BLEU on every
    seed, give or take 0.1 (the dominance holds); ``cheap_noisy`` by 0.2 on average with a spread
    of a point (unresolved)."""
    root = tmp_path / "runs"
    fp32 = {p: "fp32" for p in ("q0", "q1", "q2", "q3")}
    bfp = {p: "bfp8" for p in ("q0", "q1", "q2", "q3")}
    base = {1: 27.0, 2: 28.0, 3: 27.5, 4: 26.5}
    for seed, value in base.items():
        _run(root, "fp32", fp32, seed, value, 5.2, 1.0, 1.0)
        _run(root, "bfp8", bfp, seed, value + 1.0 + 0.1 * (-1) ** seed, 5.1, 0.06, 0.27)
        _run(root, "bfp6", {p: "bfp6" for p in bfp}, seed, value + [1.2, -0.8, 1.1, -0.7][seed - 1],
             5.2, 0.035, 0.2)  # fmt: skip
    return root


def test_frontier_says_which_dominances_hold_and_which_are_unresolved(paired_root):
    found = table.collect([paired_root])
    records = {r["cost"]: r for r in table.frontier_records(found)}
    arithmetic = records["arithmetic"]
    assert arithmetic["on_frontier"] == ["bfp8", "bfp6"]
    (fp32,) = arithmetic["dominated"]
    verdicts = {by["row"]: by["holds"] for by in fp32["by"]}
    assert verdicts == {"bfp8": True, "bfp6": False}
    by_bfp8 = next(by for by in fp32["by"] if by["row"] == "bfp8")
    assert by_bfp8["difference"]["n"] == 4 and by_bfp8["difference"]["low"] > 0
    line = table.frontier_lines(found)[0]
    assert "fp32 by bfp8 (+1.00 [" in line and "holds at n=4" in line
    assert "bfp6 (+0.20 [" in line and "unresolved at n=4" in line
    as_json = json.loads(invoke(paired_root, "--frontier", "--format", "json").stdout)
    assert as_json["frontier"] == table.frontier_records(found)


def test_frontier_compares_two_rows_over_the_seeds_both_completed(tmp_path):
    # fp32 scores 27, 28 and 24 on seeds 1-3; bfp6, cheaper, ran seeds 1 and 2 only and scores
    # 0.5 below fp32 on each. By its own mean (27.0) bfp6 would beat fp32's (26.33) at lower
    # cost, though it scores lower on every seed the two share.
    fp32 = {p: "fp32" for p in ("q0", "q1", "q2", "q3")}
    bfp6 = {p: "bfp6" for p in fp32}
    for seed, bleu in {1: 27.0, 2: 28.0, 3: 24.0}.items():
        _run(tmp_path, "fp32", fp32, seed, bleu, 5.2, 1.0, 1.0)
        if seed < 3:
            _run(tmp_path, "bfp6", bfp6, seed, bleu - 0.5, 5.2, 0.035, 0.2)
    found = table.collect([tmp_path])
    mine, theirs = found.cell("fp32", found.columns[0]), found.cell("bfp6", found.columns[0])
    assert theirs.metric_mean > mine.metric_mean
    better, cheaper = table.shared_seed_gains(mine, theirs, "arith_ratio")
    assert better == pytest.approx(-0.5) and cheaper == pytest.approx(0.965)
    for record in table.frontier_records(found):
        assert record["on_frontier"] == ["fp32", "bfp6"] and record["dominated"] == []
    # with no seed in common the rows' own means are compared
    for run_dir in tmp_path.glob("fp32-seed[12]"):
        shutil.rmtree(run_dir)
    alone = table.collect([tmp_path])
    (arithmetic, _dram) = table.frontier_records(alone)
    assert arithmetic["on_frontier"] == ["bfp6"]
    assert arithmetic["dominated"] == [
        {"row": "fp32", "by": [{"row": "bfp6", "difference": None, "holds": False}]}
    ]


def test_a_dominance_is_judged_by_the_paired_difference_it_prints(tmp_path):
    fp32 = {p: "fp32" for p in ("q0", "q1", "q2", "q3")}

    def frontier(scores: dict[int, tuple[float, float]], root: Path) -> dict:
        for seed, (a, b) in scores.items():
            _run(root, "fp32", fp32, seed, a, 5.2, 1.0, 1.0)
            _run(root, "bfp6", {p: "bfp6" for p in fp32}, seed, b, 5.2, 0.035, 0.2)
        found = table.collect([root])
        return table.frontier_records(found)[0], table.frontier_lines(found)[0]

    # bfp6 - fp32: +0.25 and -0.25, a tie in binary floating point; bfp6 is cheaper, so it
    # dominates by a difference of +0.00
    record, line = frontier({1: (24.0, 24.25), 2: (22.5, 22.25)}, tmp_path / "tie")
    ((by,),) = [d["by"] for d in record["dominated"] if d["row"] == "fp32"]
    assert by["row"] == "bfp6" and by["difference"]["mean"] == 0.0 and not by["holds"]
    assert "fp32 by bfp6 (+0.00 [" in line
    # +0.01 and -0.01 in decimal are -3.6e-15 in binary: the difference printed is negative, so
    # bfp6 is no dominator, although the two rows' means over the seeds are equal to print
    record, line = frontier({1: (24.05, 24.06), 2: (22.53, 22.52)}, tmp_path / "near")
    assert record["on_frontier"] == ["fp32", "bfp6"] and "-0.00" not in line


def test_pairwise_dominance_over_unequal_seeds_can_leave_no_row_undominated(tmp_path):
    # three rows at one cost, each pair sharing one seed: fp32 beats bf16 on seed 1, bf16 beats
    # bfp6 on seed 3, bfp6 beats fp32 on seed 2. Each is dominated, and the frontier is empty.
    scores = {"fp32": {1: 28.0, 2: 27.0}, "bfp6": {2: 28.0, 3: 27.0}, "bf16": {1: 27.0, 3: 28.0}}
    for preset, by_seed in scores.items():
        for seed, bleu in by_seed.items():
            _run(tmp_path, preset, {p: preset for p in ("q0", "q1", "q2", "q3")}, seed, bleu,
                 5.2, 0.5, 0.5)  # fmt: skip
    found = table.collect([tmp_path])
    for record in table.frontier_records(found):
        assert record["on_frontier"] == []
        assert {d["row"]: [by["row"] for by in d["by"]] for d in record["dominated"]} == {
            "fp32": ["bfp6"],
            "bfp6": ["bf16"],
            "bf16": ["fp32"],
        }
    assert "on the frontier -;" in table.frontier_lines(found)[0]


def test_against_markdown_and_level(paired_root):
    result = invoke(paired_root, "--against", "fp32", "--level", "0.9")
    assert result.exit_code == 0, result.output
    assert "90% interval" in result.stdout
    grid = result.stdout.split("Paired differences from fp32")[1]
    line = next(x for x in grid.splitlines() if x.startswith("| bfp8 |"))
    diff = paired_interval(
        {s: v + 1.0 + 0.1 * (-1) ** s for s, v in {1: 27.0, 2: 28.0, 3: 27.5, 4: 26.5}.items()},
        {1: 27.0, 2: 28.0, 3: 27.5, 4: 26.5},
        0.9,
    )
    assert f"+1.00 [{diff.low:+.2f}, {diff.high:+.2f}] (n=4)" in line
    assert "-0.100 [-0.100, -0.100] (n=4)" in line  # loss: 5.1 against 5.2 on every seed
    latex = invoke(paired_root, "--against", "fp32", "--format", "latex").stdout
    assert latex.count(r"\begin{tabular}") == 2


def test_bad_against_or_level_is_a_one_line_usage_error(paired_root):
    unknown = invoke(paired_root, "--against", "fp16")
    assert unknown.exit_code == 2
    assert "--against 'fp16' is no row of this table; its rows: fp32, bfp8, bfp6" in unknown.output
    bad = invoke(paired_root, "--level", "95")
    assert bad.exit_code == 2 and "--level is a confidence level between 0 and 1" in bad.output


def test_margin_says_which_rows_are_shown_equivalent(paired_root):
    # bfp8 - fp32: +1.1, +0.9, +1.1, +0.9 in BLEU and -0.1 in loss on every seed
    diffs = [1.1, 0.9, 1.1, 0.9]
    half = t_quantile(0.95, 3) * statistics.stdev(diffs) / math.sqrt(4)
    assert 1.1 < 1.0 + half < 1.2  # inside a margin of 1.2, past one of 1.1
    found = table.collect([paired_root], level=0.9, against="fp32", margins=(1.2, 0.2))
    column = found.columns[0]
    assert found.equivalent("bfp8", column, table.METRIC) is True
    assert found.equivalent("bfp8", column, table.LOSS) is True
    assert found.equivalent("bfp6", column, table.METRIC) is False  # +0.20 [-1.09, +1.49]
    assert found.equivalent("fp32", column, table.METRIC) is None
    tighter = table.collect([paired_root], level=0.9, against="fp32", margins=(1.1, 0.2))
    assert tighter.equivalent("bfp8", column, table.METRIC) is False
    result = invoke(paired_root, "--against", "fp32", "--level", "0.9", "--margin", "1.2,0.2")
    assert result.exit_code == 0, result.output
    assert "two one-sided tests at 5% each" in result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("| bfp8 |") and "±" not in x
                and x.count("|") > 6)  # fmt: skip
    # each verdict carries its TOST p, the larger one-sided p: (1.0 - 1.2) / (sd / 2) on 3 df
    tost = t_cdf((1.0 - 1.2) / (statistics.stdev(diffs) / 2), 3)
    assert 0.01 < tost < 0.05  # equivalent at 90% (each side at 5%), as the interval says
    assert line.endswith(f"| equivalent, TOST p={tost:.3f} | equivalent, TOST p=0.000 |")
    records = json.loads(
        invoke(paired_root, "--against", "fp32", "--margin", "1.2,0.2", "--format", "json").stdout
    )
    bfp8 = records["cells"]["bfp8"]["multi30k"]["measures"]["bleu"]["difference"]
    assert (bfp8["margin"], bfp8["equivalent"]) == (1.2, True)  # at 95% too: +1.00 [0.82, 1.18]
    assert bfp8["equivalence_p"] == pytest.approx(tost)
    assert records["margins"] == {"metric": 1.2, "best_valid_loss": 0.2}
    csv_text = invoke(paired_root, "--against", "fp32", "--margin", "1.2,0.2", "--format", "csv")
    header, *lines = csv_text.stdout.splitlines()
    fields = dict(zip(header.split(","), next(x for x in lines if ",bfp8," in x).split(",")))
    assert (fields["margin"], fields["diff_equivalent"], fields["loss_diff_equivalent"]) == (
        "1.2",
        "True",
        "True",
    )
    assert float(fields["diff_equivalence_p"]) == pytest.approx(tost)
    alone = invoke(paired_root, "--margin", "0.5,0.02")
    assert alone.exit_code == 2 and "give --against ROW with it" in alone.output
    for bad_margin in ("0.5", "a,b", "inf,0.02", "0.5,-1"):
        bad = invoke(paired_root, "--against", "fp32", "--margin", bad_margin)
        assert bad.exit_code == 2, bad_margin
        assert "--margin is two finite positive numbers" in bad.output, bad.output
    latex = invoke(paired_root, "--against", "fp32", "--margin", "1.2,0.2", "--format", "latex")
    assert r"BLEU within $\pm$1.2 & loss within $\pm$0.2 \\" in latex.stdout


def test_rows_keeps_the_named_rows_and_the_against_row(paired_root):
    # a second bfp8 run of seed 1: the full table warns of it, a table without bfp8 does not
    _run(paired_root / "again", "bfp8", {p: "bfp8" for p in ("q0", "q1", "q2", "q3")}, 1, 30.0,
         5.0, 0.06, 0.27)  # fmt: skip
    full = table.collect([paired_root], against="fp32")
    assert any(w.startswith("bfp8,") for w in full.warnings)
    (everything,) = [r for r in table.frontier_records(full) if r["cost"] == "arithmetic"]
    (fp32,) = everything["dominated"]
    assert {by["row"] for by in fp32["by"]} == {"bfp8", "bfp6"}

    found = table.collect([paired_root], against="fp32", rows=["bfp6"])
    assert found.rows == ["fp32", "bfp6"]  # the table's order, with the row compared against
    assert {row for row, _ in found.cells} == {"fp32", "bfp6"}
    assert not any(w.startswith("bfp8,") for w in found.warnings)
    # the frontier is the one among the rows kept: fp32 is dominated by bfp6 alone
    (arithmetic,) = [r for r in table.frontier_records(found) if r["cost"] == "arithmetic"]
    assert arithmetic["on_frontier"] == ["bfp6"]
    (fp32,) = arithmetic["dominated"]
    assert [by["row"] for by in fp32["by"]] == ["bfp6"]
    alone = table.collect([paired_root], rows=["fp32"])
    (arithmetic,) = [r for r in table.frontier_records(alone) if r["cost"] == "arithmetic"]
    assert arithmetic["on_frontier"] == ["fp32"]
    # naming the row compared against in --rows as well changes nothing
    both = table.collect([paired_root], against="fp32", rows=["fp32", "bfp6"])
    assert both.rows == found.rows

    result = invoke(paired_root, "--against", "fp32", "--rows", "bfp6", "--format", "json")
    assert result.exit_code == 0, result.output
    assert [row["name"] for row in json.loads(result.stdout)["rows"]] == ["fp32", "bfp6"]
    unknown = invoke(paired_root, "--rows", "bfp6,fp16,fp16")
    assert unknown.exit_code == 2
    assert "--rows 'fp16' is no row of this table; its rows: fp32, bfp8, bfp6" in unknown.output
    spaced = invoke(paired_root, "--rows", "bfp6, fp32")
    assert spaced.exit_code == 2
    assert "'bfp6, fp32' is no row of this table (a comma followed by a space" in spaced.output
    empty = invoke(paired_root, "--rows", ",")
    assert empty.exit_code == 2 and "--rows names no row" in empty.output


def test_split_rows_keeps_a_comma_and_space_inside_a_name():
    assert table.split_rows("fp32,dsq* (q1=bfp3, q3=bfp8),bfp6") == [
        "fp32",
        "dsq* (q1=bfp3, q3=bfp8)",
        "bfp6",
    ]
    assert table.split_rows("dsq (updates=640, validate_every=40)") == [
        "dsq (updates=640, validate_every=40)"
    ]
    assert table.split_rows(",,") == []


def test_rows_drops_the_tasks_the_kept_rows_did_not_run(tmp_path):
    root = tmp_path / "runs"
    for preset, task in (("fp32", "multi30k"), ("bfp8", "multi30k"), ("bf16", "sst2")):
        points = {p: preset for p in ("q0", "q1", "q2", "q3")}
        _run(root / task, preset, points, 1, 27.0, 5.0, 1.0, 1.0)
        if task == "sst2":
            path = root / task / f"{preset}-seed1" / "result.json"
            record = json.loads(path.read_text())
            record.update(task="sst2", metric="accuracy", value=0.9, accuracy=0.9)
            path.write_text(json.dumps(record))
    assert [c.task for c in table.collect([root]).columns] == ["multi30k", "sst2"]
    assert [c.task for c in table.collect([root], rows=["fp32", "bfp8"]).columns] == ["multi30k"]
    several = invoke(root, "--against", "fp32", "--margin", "0.5,0.02")
    assert several.exit_code == 2
    assert "--margin is in one metric's units, and this table has several" in several.output
    one = invoke(root, "--against", "fp32", "--rows", "bfp8", "--margin", "0.5,0.02")
    assert one.exit_code == 0, one.output
    # one seed: no interval, so no verdict
    assert one.stdout.splitlines()[-1].endswith("| - | - |")


def test_two_runs_of_one_seed_are_not_paired_and_are_named(paired_root):
    extra = paired_root / "again"
    _run(extra, "bfp8", {p: "bfp8" for p in ("q0", "q1", "q2", "q3")}, 1, 30.0, 5.0, 0.06, 0.27)
    found = table.collect([paired_root], against="fp32")
    assert any("several completed runs share a seed" in w for w in found.warnings)
    assert found.difference("bfp8", "fp32", found.columns[0], table.METRIC) is None


# -- --moves on a periodic schedule -------------------------------------------------------------


def test_periodic_span_finds_the_cycle_between_aperiodic_stretches():
    lengths, levels = [7, 5, 8, 9, 6], ["b2", "b3", "b4", "b6", "b8"]
    stretches, update = [("b8", 1, 3)], 3  # a stretch before the cycles start
    for _ in range(4):
        for fmt, length in zip(levels, lengths):
            stretches.append((fmt, update + 1, update + length))
            update += length
    stretches.append(("b2", update + 1, update + 100))  # and one after: longer than a period's
    assert table.periodic_span(stretches) == (1, 21, 5)
    assert table.periodic_span([("a", 1, 5), ("b", 6, 9), ("a", 10, 20)]) is None
    segments = [
        {"points": {"q1": fmt}, "updates": last - first + 1} for fmt, first, last in stretches
    ]
    from dsq_cli.table.moves import _point_stretches

    text = _point_stretches(segments, "q1")
    assert text == (
        "q1 b8 1-3, cycles b2 .. b8 (5 levels) every 35 updates, 4 periods (updates 4-143), "
        "b2 144-243"
    )


def test_moves_prints_one_short_line_per_cyclic_run():
    result = invoke(CONVERGENCE, "--moves")
    assert result.exit_code == 0, result.output
    cyclic = [x for x in result.stdout.splitlines() if "q1.policy=cyclic" in x and "seed" in x]
    assert len(cyclic) >= 2
    for line in cyclic:
        assert len(line) < 200, line
        assert "cycles bfp2e8b16 .. bfp8e8b16 (5 levels) every 35 updates, 32 periods" in line


# -- --runs: one line per run -------------------------------------------------------------------


def test_runs_lists_every_run_from_its_result_json():
    result = invoke(CONVERGENCE, "--runs")
    assert result.exit_code == 0, result.output
    grid = result.stdout.split(table.RUNS_HEADING)[1].strip().splitlines()
    lines = {tuple(x.strip() for x in line.strip("|").split("|")[:3]): line for line in grid[2:]}
    assert len(lines) == len(list(CONVERGENCE.glob("seed*/*/result.json")))
    for path in CONVERGENCE.glob("seed*/*/result.json"):
        record = json.loads(path.read_text())
        row = table.row_name(record_quant(record["quant"]))
        cells = [x.strip() for x in lines[(row, "multi30k", str(record["seed"]))].split("|")[1:-1]]
        best, last = record["checkpoints"]["best"], record["checkpoints"]["last"]
        assert cells[4] == f"{best['valid_loss']:.3f} ({best['update']})"
        assert cells[5:8] == [f"{best['bleu']:.2f}", f"{last['valid_loss']:.3f}",
                              f"{last['bleu']:.2f}"]  # fmt: skip
        assert cells[8].startswith(f"{record['cost']['arith_ratio']:.3g} (")
    # the stash column: a static stash, a rising one with its moves, a cyclic one
    dsq_seed1 = json.loads((CONVERGENCE / "seed1" / "quant-dsq" / "result.json").read_text())
    expected, current, done = [], None, 0  # the moves, read from the segments by hand
    for segment in dsq_seed1["precision_segments"]:
        fmt = segment["points"]["q1"]
        if segment["updates"] and fmt != current:
            expected.append(fmt if current is None else f"{done}: {fmt}")
            current = fmt
        done += segment["updates"]
    assert ", ".join(expected) == "bfp2e8b16, 800: bfp3e8b16, 960: bfp4e8b16, 1040: bfp6e8b16"
    assert lines[("dsq", "multi30k", "1")].split(" | ")[3] == ", ".join(expected)
    assert lines[("stash_bfp", "multi30k", "1")].split(" | ")[3] == "bfp4e8b16"
    cyclic = lines[("dsq* (q1.policy=cyclic)", "multi30k", "1")].split(" | ")[3]
    assert cyclic == "cycles bfp2e8b16 .. bfp8e8b16 every 35 updates"


def test_runs_shows_the_status_of_a_run_that_did_not_complete(paired_root):
    run_dir = paired_root / "bfp8-seed9"
    _run(paired_root, "bfp8", {p: "bfp8" for p in ("q0", "q1", "q2", "q3")}, 9, 0.0, 9.9, 0.06,
         0.27)  # fmt: skip
    record = json.loads((run_dir / "result.json").read_text())
    record.update(status="diverged", value=None, bleu=None)
    (run_dir / "result.json").write_text(json.dumps(record))
    result = invoke(paired_root, "--runs")
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("| bfp8 | multi30k | 9 |")]
    assert line == "| bfp8 | multi30k | 9 | bfp8 | diverged | - | - | - | - | - |"
    refused = invoke(paired_root, "--runs", "--format", "csv")
    assert refused.exit_code == 2 and "--runs adds a list to markdown" in refused.output


def test_an_interval_crossing_only_the_lower_margin_is_not_shown_equivalent():
    """Equivalence needs both ends inside: an interval inside the upper margin that crosses the
    lower one reads `not shown`, and its TOST p (the lower test's) is above the level's."""
    from dsq_cli.table.intervals import equivalence_p, inside

    crossing = mean_interval([-0.9, -0.2, -1.1, -0.3], level=0.90)  # about [-1.16, +0.06]
    assert crossing.low < -1.0 < crossing.high < 1.0
    assert inside(crossing, 1.0) is False
    assert equivalence_p(crossing, 1.0) > 0.05
    within = mean_interval([-0.5, -0.4, -0.6, -0.5], level=0.90)
    assert inside(within, 1.0) is True and equivalence_p(within, 1.0) < 0.05
