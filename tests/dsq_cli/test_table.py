"""`dsq table` and `dsq plot` on synthetic run directories (docs/spec.md §5 result.json files,
shaped like the full multi30k runs'): every format holds the runs' numbers, statuses show as words,
bad input is named and skipped or ends with exit 2, plots are PNGs, and --wandb writes an offline
run."""

from __future__ import annotations

import csv
import glob
import io
import json
import statistics
from pathlib import Path

import pytest
from helpers.table_runs import POINTS, result_json, write_run
from typer.testing import CliRunner

from dsq_cli import table
from dsq_cli.cli import app

runner = CliRunner()


def mean_ci(values, digits, notes=""):
    """The cell text of ``values``' mean and its 95% Student t interval, from scipy's t quantile
    (an oracle independent of dsq_cli.intervals)."""
    from scipy import stats

    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.975, len(values) - 1) * sd / len(values) ** 0.5
    return (f"{mean:.{digits}f} [{mean - half:.{digits}f}, {mean + half:.{digits}f}] "
            f"(n={len(values)}{notes})")  # fmt: skip


# (preset, task, seed, status, BLEU, arith ratio, DRAM ratio, stash bits); dsq's seeds follow
# different schedules, so their costs differ.
RUNS = [
    ("fp32", "multi30k", 1, "completed", 27.384, 1.0, 1.0, 32.0),
    ("fp32", "iwslt17", 1, "completed", 33.12, 1.0, 1.0, 32.0),
    ("fixed16", "multi30k", 1, "completed", 27.301, 0.25, 0.5, 16.0),
    ("fixed16", "iwslt17", 1, "completed", 33.05, 0.25, 0.5, 16.0),
    ("fixed16", "iwslt17", 2, "interrupted", None, 0.25, 0.5, 16.0),
    ("stash_bfp", "multi30k", 1, "completed", 26.93, 0.0705, 0.3893, 4.5),
    ("stash_bfp", "iwslt17", 1, "diverged", None, 0.0705, 0.3893, 4.5),
    ("dsq", "multi30k", 1, "completed", 26.4149, 0.0518704543461384, 0.36614714968006845, 2.5),
    ("dsq", "multi30k", 2, "completed", 26.0312, 0.0534, 0.3702, 2.875),
    ("dsq", "multi30k", 3, "diverged", None, 0.0518, 0.366, 2.5),
    ("dsq", "iwslt17", 1, "running", None, None, None, None),
]


MODIFIED = ("dsq", "multi30k", 1, "completed", 26.2, 0.06, 0.38, 3.5)
MODIFIED_POINTS = {**POINTS["dsq"], "q1": "bfp3"}


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    for spec in RUNS:
        write_run(root, result_json(*spec))
    write_run(root, result_json(*MODIFIED, points=MODIFIED_POINTS))
    corrupt = root / "multi30k" / "multi30k-bfp8-seed1"
    corrupt.mkdir(parents=True)
    (corrupt / "result.json").write_text('{"status": "completed", "task": ')  # torn copy
    incomplete = root / "iwslt17" / "iwslt17-bfp6-seed1"
    incomplete.mkdir(parents=True)
    (incomplete / "result.json").write_text(json.dumps({"status": "completed", "task": "x"}))
    return root


def completed(preset, task):
    return [r for r in RUNS if r[0] == preset and r[1] == task and r[3] == "completed"]


def parse_markdown(text: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return header, rows


def ratio_text(ratio: float) -> str:
    return f"{ratio:.3g} ({1 / ratio:.3g}x)"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# -- markdown (default) -----------------------------------------------------------------------


def test_markdown_rows_in_table1_order_with_the_runs_numbers(root):
    result = invoke("table", root)
    assert result.exit_code == 0, result.output
    header, rows = parse_markdown(result.stdout)
    assert header == ["quant"] + [
        h
        for task in ("iwslt17", "multi30k")
        for h in (f"{task} BLEU", "arith", "DRAM", "stash bits")
    ]
    assert list(rows) == ["fp32", "fixed16", "stash_bfp", "dsq", "dsq* (q1=bfp3)"]
    for preset in ("fp32", "fixed16", "stash_bfp"):
        (_, _, _, _, value, arith, dram, bits) = completed(preset, "multi30k")[0]
        assert rows[preset][4:] == [
            f"{value:.2f}",
            ratio_text(arith),
            ratio_text(dram),
            f"{bits:g}",
        ]
    (_, _, _, _, value, arith, dram, bits) = completed("fp32", "iwslt17")[0]
    assert rows["fp32"][:4] == [f"{value:.2f}", "1 (1x)", "1 (1x)", "32"]
    assert rows["dsq* (q1=bfp3)"][4:] == ["26.20", ratio_text(0.06), ratio_text(0.38), "3.5"]


def test_glue_fractions_show_three_decimals_and_bleu_two(tmp_path):
    """Two SST-2 presets 0.3 points of accuracy apart print apart (0.862, 0.865), as do a
    seed spread below 0.005; BLEU keeps two decimals."""
    root = tmp_path / "runs"
    for preset, seed, accuracy in (("fp32", 1, 0.86238), ("dsq", 1, 0.86468), ("dsq", 2, 0.86812)):
        result = result_json(preset, "multi30k", seed, "completed", accuracy, 1.0, 1.0, 32.0)
        result.update(task="sst2", model="minilm", metric="accuracy", bleu=None)
        write_run(root, result)
    write_run(root, result_json("fp32", "multi30k", 1, "completed", 27.384, 1.0, 1.0, 32.0))
    header, rows = parse_markdown(invoke("table", root).stdout)
    assert header[1] == "multi30k BLEU" and header[5] == "sst2 Acc"
    assert rows["fp32"][0] == "27.38" and rows["fp32"][4] == "0.862"
    assert rows["dsq"][4] == mean_ci([0.86468, 0.86812], 3) == "0.866 [0.845, 0.888] (n=2)"


def test_markdown_seeds_give_mean_and_spread_and_count_what_did_not_complete(root):
    _, rows = parse_markdown(invoke("table", root).stdout)
    seeds = completed("dsq", "multi30k")
    values = [r[4] for r in seeds]
    arith = statistics.fmean(r[5] for r in seeds)
    bits = statistics.fmean(r[7] for r in seeds)
    assert rows["dsq"][4] == mean_ci(values, 2, "; +1 diverged")
    assert rows["dsq"][5] == ratio_text(arith)
    assert rows["dsq"][7] == f"{bits:.3g}"
    assert rows["fixed16"][0] == "33.05 (+1 interrupted)"


def test_runs_without_a_completed_seed_show_their_status_never_numbers(root):
    _, rows = parse_markdown(invoke("table", root).stdout)
    assert rows["stash_bfp"][:4] == ["diverged", "-", "-", "-"]
    assert rows["dsq"][:4] == ["running", "-", "-", "-"]
    assert rows["dsq* (q1=bfp3)"][:4] == ["-", "-", "-", "-"]  # never run on iwslt17


def test_corrupt_result_json_is_named_and_skipped(root):
    result = invoke("table", root)
    assert result.exit_code == 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("dsq: warning:")]
    assert len(warnings) == 2, result.stderr
    torn = str((root / "multi30k" / "multi30k-bfp8-seed1" / "result.json").resolve())
    incomplete = str((root / "iwslt17" / "iwslt17-bfp6-seed1" / "result.json").resolve())
    assert any(torn in w and "unreadable" in w for w in warnings)
    assert any(incomplete in w and "missing key 'quant'" in w for w in warnings)
    assert "bfp8" not in parse_markdown(result.stdout)[1]


def test_reference_line_and_our_dsq_against_fixed16(root):
    stdout = invoke("table", root).stdout
    assert "- reference, paper (IWSLT17, DSQ vs fixed16): 20.95x arithmetic, 2.55x DRAM." in stdout
    arith = 0.25 / statistics.fmean(r[5] for r in completed("dsq", "multi30k"))
    assert f"- ours (multi30k, dsq vs fixed16): {arith:.3g}x arithmetic" in stdout
    assert "ours (iwslt17" not in stdout  # dsq has no completed iwslt17 run


# -- csv, json, latex -------------------------------------------------------------------------


def test_csv_holds_the_exact_numbers(root):
    result = invoke("table", root, "--format", "csv")
    assert result.exit_code == 0, result.output
    records = list(csv.DictReader(io.StringIO(result.stdout)))
    cells = {(r["row"], r["task"]): r for r in records if r["kind"] == "result"}
    for preset, task, *_ in RUNS:
        runs = completed(preset, task)
        record = cells[(preset, task)]
        if not runs:
            assert record["metric_mean"] == record["arith_ratio"] == ""
            continue
        assert int(record["n"]) == len(runs)
        assert float(record["metric_mean"]) == statistics.fmean(r[4] for r in runs)
        assert float(record["arith_ratio"]) == statistics.fmean(r[5] for r in runs)
        assert float(record["dram_ratio"]) == statistics.fmean(r[6] for r in runs)
        assert float(record["stash_bits_mean"]) == statistics.fmean(r[7] for r in runs)
    assert cells[("stash_bfp", "iwslt17")]["status"] == "diverged"
    assert cells[("dsq", "iwslt17")]["status"] == "running"
    assert cells[("dsq", "multi30k")]["note"] == "+1 diverged"
    assert cells[("dsq* (q1=bfp3)", "multi30k")]["modified"] == "True"
    (paper,) = [r for r in records if r["row"] == "paper: dsq vs fixed16"]
    assert (paper["kind"], paper["task"], paper["arith_reduction"]) == (
        "reference",
        "iwslt17",
        "20.95",
    )
    assert paper["dram_reduction"] == "2.55"


def test_json_cells_and_runs_equal_result_json(root, tmp_path):
    out = tmp_path / "table.json"
    result = invoke("table", root, "--format", "json", "--out", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == [
        "fp32",
        "fixed16",
        "stash_bfp",
        "dsq",
        "dsq* (q1=bfp3)",
    ]
    assert [t["task"] for t in data["tasks"]] == ["iwslt17", "multi30k"]
    assert data["reference"]["paper"]["arith_reduction"] == 20.95
    assert len(data["warnings"]) == 2
    single = data["cells"]["stash_bfp"]["multi30k"]
    assert (single["metric_mean"], single["arith_ratio"], single["dram_ratio"]) == (
        26.93,
        0.0705,
        0.3893,
    )
    assert single["metric_std"] is None
    dsq = data["cells"]["dsq"]["multi30k"]
    by_seed = {run["seed"]: run for run in dsq["runs"]}
    for preset, task, seed, status, value, arith, dram, bits in RUNS:
        if (preset, task) == ("dsq", "multi30k"):
            run = by_seed[seed]
            assert (run["status"], run["value"], run["arith_ratio"]) == (status, value, arith)
            assert (run["dram_ratio"], run["stash_bits_mean"]) == (dram, bits)
            assert run["wall_seconds"] == 845.876 + seed  # what a study's hours are summed from
    assert dsq["metric_std"] == statistics.stdev([26.4149, 26.0312])
    assert data["cells"]["dsq"]["iwslt17"]["status"] == "running"


def test_latex_is_a_booktabs_tabular_with_the_reference_as_footnote(root):
    result = invoke("table", root, "--format", "latex")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith(r"\begin{tabular}{l" + "rrrr" * 2 + "}")
    assert text.rstrip().endswith(r"\end{tabular}")
    assert r"stash\_bfp & diverged & - & - & - & 26.93 & " in text
    assert mean_ci([26.4149, 26.0312], 2, "; +1 diverged") in text
    assert r"\multicolumn{9}{l}{\footnotesize reference, paper (IWSLT17" in text


# -- bad input --------------------------------------------------------------------------------


def test_a_root_without_runs_says_so_and_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke("table", tmp_path / "empty")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"dsq: error: no runs (result.json) under {tmp_path / 'empty'}"


def test_missing_path_bad_format_and_only_corrupt_files_exit_2(tmp_path, root):
    result = invoke("table", tmp_path / "nowhere")
    assert result.exit_code == 2 and "no such file or directory" in result.stderr
    result = invoke("table", root, "--format", "html")
    assert result.exit_code == 2 and "--format must be one of" in result.stderr
    only_corrupt = tmp_path / "corrupt"
    (only_corrupt / "run").mkdir(parents=True)
    (only_corrupt / "run" / "result.json").write_text("not json")
    result = invoke("table", only_corrupt)
    assert result.exit_code == 2
    assert "no readable result.json among the 1 found" in result.stderr


def test_rows_of_unknown_presets_follow_the_known_ones(tmp_path):
    root = tmp_path / "runs"
    extra = result_json("fp32", "multi30k", 1, "completed", 20.0, 0.5, 0.5, 8.0)
    extra["quant"] = {"preset": "aaa_custom", **POINTS["fixed16"], "modified": True}
    write_run(root, extra)
    write_run(root, result_json("dsq", "multi30k", 1, "completed", 26.0, 0.05, 0.37, 2.5))
    found = table.collect([root])
    assert found.rows == ["dsq", "aaa_custom*"]


# -- plots and wandb --------------------------------------------------------------------------


def write_metrics(run_dir: Path) -> None:
    """A dsq run whose stash rose bfp2 -> bfp3 at the validation of update 40."""
    bits = {"q0": "bfp8e8b16", "q1": "bfp2e8b16", "q2": "bfp8e8b16", "q3": "fixed16"}
    later = {**bits, "q1": "bfp3e8b16"}
    lines = []
    for update in range(10, 81, 10):
        lines.append({"kind": "train", "update": update, "loss": 12 - update / 10, "bits": bits})
        if update % 20 == 0:
            lines.append(
                {"kind": "valid", "update": update, "valid_loss": 9 - update / 20, "bits": bits}
            )
        if update == 40:
            bits = later
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    change = {"update": 40, "point": "q1", "from": "bfp2e8b16", "to": "bfp3e8b16",
              "from_level": 0, "to_level": 1, "valid_loss": 7.0}  # fmt: skip
    (run_dir / "schedule.jsonl").write_text(json.dumps(change) + "\n")


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # axes, lines and text, not an empty canvas


@pytest.mark.slow  # renders with matplotlib
def test_plot_run_writes_bits_and_loss_png(tmp_path):
    run_dir = write_run(tmp_path, result_json(*RUNS[7]))
    write_metrics(run_dir)
    result = invoke("plot", run_dir)
    assert result.exit_code == 0, result.output
    assert_png(run_dir / "plot.png")
    out = tmp_path / "elsewhere" / "run.png"
    assert invoke("plot", run_dir, "--out", out).exit_code == 0
    assert_png(out)


def test_bits_series_steps_at_the_schedule_change(tmp_path):
    from dsq_cli.plots import _read_jsonl, bits_series

    run_dir = write_run(tmp_path, result_json(*RUNS[7]))
    write_metrics(run_dir)
    series = bits_series(
        _read_jsonl(run_dir / "metrics.jsonl"), _read_jsonl(run_dir / "schedule.jsonl")
    )
    q1 = dict(series["q1"])
    assert q1[0] == q1[40] == "bfp2e8b16" and q1[50] == "bfp3e8b16"
    assert set(dict(series["q0"]).values()) == {"bfp8e8b16"}


def test_plot_refuses_a_directory_without_metrics(tmp_path):
    result = invoke("plot", tmp_path)
    assert result.exit_code == 2 and "has no metrics.jsonl" in result.stderr


@pytest.mark.slow  # renders with matplotlib
def test_table_plot_writes_the_frontier_png(root, tmp_path):
    out = tmp_path / "frontier.png"
    result = invoke("table", root, "--plot", out)
    assert result.exit_code == 0, result.output
    assert_png(out)
    assert invoke("table", root, "--plot", tmp_path / "frontier.svg").exit_code == 2


def test_the_papers_dsq_line_is_fixed16s_cost_under_the_cost_model_over_its_reductions():
    """The paper gives DSQ's reductions against fixed16; the line sits at fixed16's ratio to the
    table's baseline as the cost model prices it: (16/32)^2 arithmetic under bit_product,
    (16+16)/(32+32) under additive, 16/32 DRAM under both."""
    from dsq_cli.cost import load_cost_model
    from dsq_cli.plots import paper_dsq_ratios

    paper = table.PAPER_REFERENCE
    default = paper_dsq_ratios()
    assert default["arith_ratio"] == pytest.approx((16 / 32) ** 2 / paper["arith_reduction"])
    assert default["dram_ratio"] == pytest.approx((16 / 32) / paper["dram_reduction"])
    additive = paper_dsq_ratios("fixed32", load_cost_model("additive"))
    assert additive["arith_ratio"] == pytest.approx(
        (16 + 16) / (32 + 32) / paper["arith_reduction"]
    )
    assert additive["dram_ratio"] == default["dram_ratio"]
    assert paper_dsq_ratios("fixed16")["arith_ratio"] == pytest.approx(1 / paper["arith_reduction"])


def test_frontier_rows_keep_their_own_colour_and_variants_are_diamonds():
    """Twelve rows (nine presets and three ablations) get twelve colours; a preset's own row is
    a dot, a variant of one (points or budget changed) a diamond."""
    from dsq_cli.plots import row_styles
    from dsq_cli.presets import TABLE1_ORDER

    rows = [*TABLE1_ORDER, "dsq (validate_every=40)", "dsq* (q1.patience=2)", "dsq_bfp3"]
    styles = row_styles(rows)
    assert len({colour for colour, _ in styles.values()}) == len(rows)
    assert {row for row, (_, marker) in styles.items() if marker == "D"} == set(rows[9:11])


def test_frontier_labels_give_n_only_where_a_columns_points_differ_in_runs():
    """A point is its row's mean over its own seeds: where one column's points do not all have
    the same n, each label carries its n, so a reader does not compare means over unequal seed
    sets unawares; where they do, the labels are the rows alone."""
    from dsq_cli.plots import point_labels

    equal = [{"row": "fp32", "n": 5}, {"row": "dsq", "n": 5}]
    assert point_labels(equal) == ["fp32", "dsq"]
    unequal = [*equal, {"row": "dsq_bfp3", "n": 2}]
    assert point_labels(unequal) == ["fp32 (n=5)", "dsq (n=5)", "dsq_bfp3 (n=2)"]
    assert point_labels([]) == []


@pytest.mark.slow  # starts wandb's service process
def test_wandb_logs_the_table_offline(root, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "frontier.png"
    result = invoke("table", root, "--plot", out, "--wandb", "--wandb-dir", tmp_path / "wb")
    assert result.exit_code == 0, result.output
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    tables = glob.glob(f"{run_dir}/files/media/table/table1_*.table.json")
    assert len(tables) == 1
    logged = json.loads(Path(tables[0]).read_text())
    assert logged["columns"] == list(table.CSV_COLUMNS)
    rows = {(r[1], r[4]): dict(zip(logged["columns"], r)) for r in logged["data"]}
    assert rows[("stash_bfp", "multi30k")]["arith_ratio"] == 0.0705
    assert rows[("stash_bfp", "iwslt17")]["status"] == "diverged"
    assert glob.glob(f"{run_dir}/files/media/images/frontier_*.png")


BUDGET = {"total_updates": 640, "updates_per_epoch": 256, "validate_every": 80,
          "warmup_updates": 100}  # fmt: skip


def budgeted(preset, seed, value, **budget):
    run = result_json(preset, "multi30k", seed, "completed", value, 0.05, 0.37, 2.5)
    run["budget"] = {**BUDGET, **budget}
    return run


def test_a_run_on_another_budget_gets_its_own_row(tmp_path):
    """The ablation of the validation interval: same quant, its own row after its preset's, never
    averaged in, and not marked modified (its quant points are the preset's)."""
    root = tmp_path / "runs"
    for seed, value, every in [(1, 26.0, 80), (2, 27.0, 80), (6, 28.0, 80), (3, 20.0, 40),
                               (4, 22.0, 40)]:  # fmt: skip
        write_run(root, budgeted("dsq", seed, value, validate_every=every))
    write_run(root, budgeted("fp32", 1, 29.0))
    write_run(root, budgeted("fp32", 2, 28.0, validate_every=40))
    running = result_json("dsq", "multi30k", 5, "running", None, None, None, None)
    write_run(root, running)  # no budget yet: stays in the quant's row
    found = table.collect([root])
    assert found.rows == ["fp32", "fp32 (validate_every=40)", "dsq", "dsq (validate_every=40)"]
    multi30k = found.columns[0]
    assert found.cell("dsq", multi30k).metric_values == [26.0, 27.0, 28.0]
    assert found.cell("dsq", multi30k).other_statuses == {"running": 1}
    assert found.cell("dsq (validate_every=40)", multi30k).metric_values == [20.0, 22.0]
    _, rows = parse_markdown(invoke("table", root).output)
    assert rows["dsq (validate_every=40)"][0] == mean_ci([20.0, 22.0], 2)
    records = list(csv.DictReader(io.StringIO(invoke("table", root, "--format", "csv").output)))
    modified = {r["row"]: r["modified"] for r in records if r["kind"] == "result"}
    assert modified["dsq (validate_every=40)"] == "False"


def test_budgets_without_a_majority_each_name_what_varies(tmp_path):
    """One run on each of two budgets: neither is the usual one, so both rows say theirs (values
    compared as values, not as text: 1340 and 370 updates)."""
    root = tmp_path / "runs"
    write_run(root, budgeted("fp32", 1, 29.6, total_updates=1340, validate_every=67))
    write_run(root, budgeted("fp32", 2, 3.1, total_updates=370, validate_every=0))
    assert table.collect([root]).rows == [
        "fp32 (total_updates=1340, validate_every=67)",
        "fp32 (total_updates=370, validate_every=0)",
    ]


def test_moves_lists_each_scheduled_runs_formats_over_its_updates(tmp_path):
    root = tmp_path / "runs"
    fixed = {"q0": "bfp8e8b16", "q2": "bfp8e8b16", "q3": "fixed16"}

    def segments(*stretches):
        return [{"points": {**fixed, "q1": f"bfp{m}e8b16"}, "updates": n} for m, n in stretches]

    # stash bits: (240 * 2.5 + 160 * 3.5 + 240 * 4.5) / 640 = 3.5
    moved = result_json("dsq", "multi30k", 2, "completed", 26.0, 0.053, 0.37, 3.5)
    moved["precision_segments"] = segments((2, 240), (3, 0), (3, 160), (4, 240))
    still = result_json("dsq", "multi30k", 1, "completed", 26.4, 0.052, 0.366, 2.5)
    still["precision_segments"] = segments((2, 640))
    diverged = result_json("dsq", "multi30k", 4, "diverged", None, 0.052, 0.366, 2.75)
    diverged["precision_segments"] = segments((2, 120), (3, 40))
    seedless = result_json("dsq", "multi30k", None, "failed", None, 0.052, 0.366, None)
    seedless["precision_segments"] = segments((2, 0))  # failed before its first update
    static = result_json("stash_bfp", "multi30k", 1, "completed", 26.9, 0.07, 0.39, 4.5)
    static["precision_segments"] = segments((4, 640))
    for run in (moved, still, diverged, seedless, static):
        write_run(root, run)
    write_run(root, result_json("dsq", "multi30k", 3, "running", None, None, None, None))
    result = invoke("table", root, "--moves")
    assert result.exit_code == 0, result.output
    listed = result.output.split("Stash moves (scheduled points, per run):\n\n")[1]
    assert listed.splitlines() == [
        "- dsq, multi30k, seed 1: q1 bfp2e8b16 for all 640 updates; 2.5 stash bits",
        "- dsq, multi30k, seed 2: q1 bfp2e8b16 1-240, bfp3e8b16 241-400, bfp4e8b16 401-640 "
        "(moved after update 240, 400); 3.5 stash bits",
        "- dsq, multi30k, seed 3: running; no update recorded",
        "- dsq, multi30k, seed 4: diverged; q1 bfp2e8b16 1-120, bfp3e8b16 121-160 "
        "(moved after update 120); 2.75 stash bits",
        "- dsq, multi30k, multi30k-dsq-seedNone: failed; no update recorded",
    ]  # stash_bfp's stash is static: not listed
    refused = invoke("table", root, "--moves", "--format", "csv")
    assert refused.exit_code == 2
    assert "--moves adds a list to markdown or json" in refused.output


def test_dominators_need_one_strictly_better_side_and_equal_points_tie():
    points = {
        "a": (28.0, 1.0),
        "b": (28.0, 0.5),
        "c": (27.0, 0.5),
        "d": (27.0, 0.5),
        "e": (29.0, 2.0),
    }
    assert table.dominators(
        points, lambda mine, theirs: (theirs[0] - mine[0], mine[1] - theirs[1])
    ) == {
        "a": ["b"],  # as good, cheaper
        "b": [],
        "c": ["b"],  # b is better at the same cost; d, its equal, does not dominate it
        "d": ["b"],
        "e": [],  # the best, however dear
    }


def test_frontier_lists_each_tasks_undominated_rows_per_cost(root):
    result = invoke("table", root, "--frontier")
    assert result.exit_code == 0, result.output
    listed = result.output.split(table.FRONTIER_HEADING + "\n\n")[1]
    # multi30k: dsq's two seeds average to 26.22 BLEU at 0.0526 / 0.368; its modified variant
    # (26.2, 0.06 / 0.38) is behind it on both. iwslt17: stash_bfp diverged and dsq is still
    # running, so only fp32 and fixed16 have a point there.
    assert listed.splitlines() == [
        "- iwslt17 BLEU against arithmetic: on the frontier fp32, fixed16",
        "- iwslt17 BLEU against DRAM: on the frontier fp32, fixed16",
        "- multi30k BLEU against arithmetic: on the frontier fp32, fixed16, stash_bfp, dsq; "
        "dominated: dsq* (q1=bfp3) by dsq (+0.21, unresolved at n=1)",
        "- multi30k BLEU against DRAM: on the frontier fp32, fixed16, stash_bfp, dsq; "
        "dominated: dsq* (q1=bfp3) by dsq (+0.21, unresolved at n=1)",
    ]
    refused = invoke("table", root, "--frontier", "--format", "csv")
    assert refused.exit_code == 2 and "--frontier adds a list to markdown or json" in refused.output


# -- stopping early and the scored checkpoint -------------------------------------------------


def scored(seed, best, last, stop_patience=None, stopped_at=None):
    """A completed dsq run whose headline is its best model's BLEU; ``stop_patience`` set: a run
    that may stop early, and did at ``stopped_at`` (None: it trained the whole cap)."""
    run = budgeted("dsq", seed, best)
    run["eval_checkpoint"] = "best"
    run["checkpoints"] = {
        "last": {"update": 640, "valid_loss": 4.9, "bleu": last},
        "best": {"update": 560, "valid_loss": 4.8, "bleu": best},
    }
    if stop_patience is not None:
        stop = None if stopped_at is None else {"update": stopped_at, "reason": "stalled"}
        run["budget"] = {**run["budget"], "stop_patience": stop_patience, "stopped_early": stop}
    return run


def test_early_stopping_runs_get_their_own_row_and_pool_wherever_they_stopped(tmp_path):
    """stop_patience is part of the recipe (row ``dsq (stop_patience=4)``); where a run stopped
    is not: seeds of one recipe pool whether they stopped early or not, and the cell counts the
    early stops. stop_patience 0 is a budget without the key: old and new runs pool."""
    root = tmp_path / "runs"
    write_run(root, scored(1, 26.0, 25.0))  # written before the keys existed
    write_run(root, scored(2, 27.0, 26.0, stop_patience=0))
    write_run(root, scored(6, 28.0, 27.0, stop_patience=0))
    write_run(root, scored(3, 20.0, 19.0, stop_patience=4, stopped_at=400))
    write_run(root, scored(4, 22.0, 21.0, stop_patience=4))
    found = table.collect([root])
    assert found.rows == ["dsq", "dsq (stop_patience=4)"]
    column = found.columns[0]
    assert found.cell("dsq", column).metric_values == [26.0, 27.0, 28.0]
    assert found.cell("dsq (stop_patience=4)", column).metric_values == [20.0, 22.0]
    _, rows = parse_markdown(invoke("table", root).output)
    assert rows["dsq (stop_patience=4)"][0] == mean_ci([20.0, 22.0], 2, "; 1 stopped early")
    assert rows["dsq"][0] == mean_ci([26.0, 27.0, 28.0], 2) == "27.00 [24.52, 29.48] (n=3)"


def test_checkpoint_option_shows_that_models_metric(tmp_path):
    root = tmp_path / "runs"
    write_run(root, scored(1, 26.0, 25.0))
    write_run(root, scored(2, 28.0, 27.0))
    assert table.collect([root]).cell("dsq", table.collect([root]).columns[0]).metric_mean == 27
    _, rows = parse_markdown(invoke("table", root, "--checkpoint", "last").output)
    assert rows["dsq"][0] == mean_ci([25.0, 27.0], 2)
    _, rows = parse_markdown(invoke("table", root, "--checkpoint", "best").output)
    assert rows["dsq"][0] == mean_ci([26.0, 28.0], 2)
    refused = invoke("table", root, "--checkpoint", "middle")
    assert refused.exit_code == 2 and "--checkpoint must be best or last" in refused.output


def test_checkpoint_option_on_runs_written_before_checkpoints(tmp_path):
    """A translation run of old scored its last model only: ``--checkpoint best`` skips it with
    a warning, ``last`` is its value. An old GLUE run's value is its best dev, final_dev its
    last."""
    root = tmp_path / "runs"
    write_run(root, budgeted("dsq", 1, 26.0))
    write_run(root, scored(2, 28.0, 27.0))
    result = invoke("table", root, "--checkpoint", "best")
    assert result.exit_code == 0, result.output
    assert "records no score of its best model" in result.stderr
    assert parse_markdown(result.stdout)[1]["dsq"][0] == "28.00"
    assert parse_markdown(invoke("table", root, "--checkpoint", "last").stdout)[1]["dsq"][0] == (
        mean_ci([26.0, 27.0], 2)
    )
    from dsq_cli.run_result import RunResult

    glue = {**budgeted("dsq", 3, 0.86), "metric": "accuracy", "best_update": 400,
            "final_dev": {"accuracy": 0.85, "value": 0.85}}  # fmt: skip
    old = RunResult.from_dict(glue)
    assert (old.value_of("best"), old.value_of("last"), old.value_of(None)) == (0.86, 0.85, 0.86)


def test_checkpointed_runs_get_a_row_of_their_own(tmp_path):
    """train.activation_checkpointing recomputes the same numbers at other memory and time: a
    checkpointed run of a preset is never averaged with the preset's own runs."""
    root = tmp_path / "runs"
    write_run(root, result_json("dsq", "multi30k", 1, "completed", 28.71, 0.05, 0.37, 2.5))
    run = write_run(root, result_json("dsq", "multi30k", 2, "completed", 28.31, 0.05, 0.37, 2.5))
    (run / "config.yaml").write_text("seed: 2\ntrain:\n  activation_checkpointing: true\n")
    _, rows = parse_markdown(invoke("table", root).stdout)
    assert list(rows) == ["dsq", "dsq (checkpointed)"]
    assert rows["dsq"][0] == "28.71" and rows["dsq (checkpointed)"][0] == "28.31"


def test_saved_rules_compare_as_one_rule_however_spelled_and_with_defaults_filled_in():
    """A record of quant.saved with short spellings, or written before a kind existed, matches
    one with the full specs and every kind."""
    from dsq.engine.spec import SAVED_DEFAULT
    from dsq_cli.table.post_move import _saved_rules

    rules = {"norm": "bfp8", "activation": "bfp8", "elementwise": "bfp8", "constant": "keep"}
    short = {"stash_scope": "all", "saved": rules}
    assert _saved_rules(short) == _saved_rules({"stash_scope": "all"}) == dict(SAVED_DEFAULT)
    assert _saved_rules({"stash_scope": "gemm"}) == {}


def test_a_row_names_the_saved_rules_that_differ_one_by_one_in_one_order():
    """Two records of one setting whose rules are listed in different orders are one row, named
    by the rules that differ from the defaults (docs/dsq.md, "What stash_scope=all holds")."""
    from dsq.engine.spec import SAVED_DEFAULT
    from dsq.presets import get_preset, record_quant
    from dsq_cli.table.collect import row_name

    base = {"preset": "dsq", **get_preset("dsq").to_dict(), "stash_scope": "all"}
    listed = dict(SAVED_DEFAULT) | {"checkpoint": "bfp8"}
    names = {row_name(record_quant(base | {"saved": rules}))
             for rules in (listed, dict(reversed(listed.items())))}  # fmt: skip
    assert names == {"dsq* (stash_scope=all, saved.checkpoint=bfp8e8b16)"}
    assert row_name(record_quant(base | {"saved": dict(SAVED_DEFAULT)})) == "dsq* (stash_scope=all)"


def test_one_request_makes_the_table_the_command_prints(root):
    """`make_table` is the command's one call: a request in, the text the command prints out,
    the lists after the table included; a request no format can show is refused before any run
    is read."""
    request = table.TableRequest(paths=(str(root),), against="fp32", moves=True, frontier=True)
    made = table.make_table(request)
    printed = CliRunner().invoke(app, ["table", str(root), "--against", "fp32", "--moves",
                                       "--frontier"])  # fmt: skip
    assert printed.exit_code == 0, printed.output
    assert made.text == printed.stdout and "Pareto frontier" in made.text
    assert made.table.against == "fp32" and "dsq" in made.table.rows
    as_json = json.loads(table.make_table(table.TableRequest(paths=(str(root),), fmt="json",
                                                             frontier=True)).text)  # fmt: skip
    assert "frontier" in as_json and "cells" in as_json
    for wrong, says in (({"fmt": "csv", "moves": True}, "--moves adds a list"),
                        ({"fmt": "latex", "every_run": True}, "--runs adds a list"),
                        ({"fmt": "html"}, "--format must be one of"),
                        ({"rows": ()}, "--rows names no row")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            table.TableRequest(paths=("no-such-folder",), **wrong)
