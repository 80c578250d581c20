"""The command line: help, format, bench quant, and one-line usage errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dsq.engine.spec import SPEC_VERSION
from dsq.formats import parse_format
from dsq_cli.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("format", "bench", "version"):
        assert command in result.output


def test_format_quantizes_the_spec_example():
    result = runner.invoke(app, ["format", "bfp4", "--values", "0.3,-1.7,0.05,2.9"])
    assert result.exit_code == 0, result.output
    assert "bfp4e8b16" in result.output and "4.5" in result.output
    assert "[0.5, -1.5, 0.0, 3.0]" in result.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["format", "bfp99"], "invalid format spec 'bfp99'"),
        (["format", "bfp4", "--values", "1,x"], "--values must be numbers"),
        (["bench", "quant", "--formats", "bfp1", "--numel", "64"], "invalid format spec 'bfp1'"),
        (["bench", "quant", "--backends", "gpu", "--numel", "64"], "unknown backend"),
        (["bench", "attention", "--preset", "amp_bf16"], "runs no DSQ attention"),
        (["bench", "attention", "--heads", "6", "--kv-heads", "4"], "cannot share --kv-heads"),
        (["bench", "attention", "--seq-lens", "1k"], "--seq-lens: expected lengths"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("dsq: error:")


@pytest.mark.slow  # spawns the dsq process
def test_console_script_exit_code_for_a_bad_spec():
    """The installed entry point, in a real process: stderr one line, exit code 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "dsq_cli.cli", "format", "fixed40"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "fixed40" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("error", [TypeError, AttributeError, KeyError, IndexError])
def test_a_programming_error_is_no_usage_error(monkeypatch, error):
    """A bug inside a command keeps its exception (a traceback, exit code 1), not one line and
    exit code 2 that would blame the user's input."""

    def broken(spec):
        raise error("a bug, not bad input")

    monkeypatch.setattr("dsq.formats.parse_format", broken)
    result = runner.invoke(app, ["format", "bfp4"])
    assert result.exit_code == 1
    assert isinstance(result.exception, error)
    assert "dsq: error:" not in result.output


def test_bench_quant_json_on_a_small_tensor():
    result = runner.invoke(
        app,
        [
            "bench",
            "quant",
            "--numel",
            "4096",
            "--repeats",
            "1",
            "--formats",
            "bfp4,fixed16",
            "--backends",
            "reference,eager",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    ops = {(r["format"], r["backend"], r["op"]) for r in data["rows"]}
    assert ("-", "torch", "x.clone()") in ops
    for op in ("quantize", "pack", "unpack"):
        assert ("bfp4e8b16", "reference", op) in ops
    assert ("fixed16", "eager", "quantize") in ops
    assert all(r["ms"] > 0 and r["x_clone"] > 0 for r in data["rows"])


@pytest.mark.parametrize("preset", sorted((REPO / "dsq_cli" / "conf" / "quant").glob("*.yaml")))
def test_quant_presets_name_valid_formats(preset):
    cfg = yaml.safe_load(preset.read_text())
    assert set(cfg) - {"engine"} == {"version", "q0", "q1", "q2", "q3", "stash_scope", "rounding"}
    assert cfg["version"] == SPEC_VERSION
    assert cfg.get("engine", "dsq") in ("dsq", "autocast")
    assert cfg["stash_scope"] in ("gemm", "all")
    assert cfg["rounding"] == {p: "nearest" for p in ("q0", "q1", "q2", "q3")}  # the paper's
    for point in ("q0", "q1", "q2", "q3"):
        value = cfg[point]
        levels = value["levels"] if isinstance(value, dict) else [value]
        for spec in levels:
            parse_format(spec)
        bits = [parse_format(s).bits_per_value for s in levels]
        assert bits == sorted(bits)  # a schedule only rises


def test_table1_presets_are_all_there():
    from dsq_cli.presets import BEYOND_TABLE1, TABLE1_ORDER

    names = {p.stem for p in (REPO / "dsq_cli" / "conf" / "quant").glob("*.yaml")}
    assert len(TABLE1_ORDER) == 9  # docs/spec.md §6's rows
    assert names == set(TABLE1_ORDER) | set(BEYOND_TABLE1)  # every other preset is named


def test_bench_step_unknown_preset_is_one_line_exit_2():
    result = runner.invoke(app, ["bench", "step", "--presets", "fp32,dsq9"])
    assert result.exit_code == 2
    choices = sorted(p.stem for p in (REPO / "dsq_cli" / "conf" / "quant").glob("*.yaml"))
    assert result.output.strip().splitlines() == [
        f"dsq: error: unknown quant preset 'dsq9'; choose one of {choices}"
    ]  # exactly one line, and it is the error (not an empty output, not a traceback)


@pytest.mark.slow
def test_bench_step_json_on_a_tiny_transformer():
    pytest.importorskip("fairseq")
    result = runner.invoke(
        app,
        [
            "bench",
            "step",
            "--presets",
            "fp32,stash_bfp",
            "--layers",
            "1",
            "--width",
            "64",
            "--tokens",
            "64",
            "--src-len",
            "8",
            "--repeats",
            "1",
            "--fp32-head",  # the rows differ in their layers only
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert data["head"] == "fp32"
    rows = {(r["preset"], r["scope"]): r for r in data["rows"]}
    # fp32 has no stash to scope; every other preset is timed with both scopes
    assert set(rows) == {("fp32", "gemm"), ("stash_bfp", "gemm"), ("stash_bfp", "all")}
    assert rows[("stash_bfp", "all")]["points"]["q1"] == "bfp4"
    assert rows[("stash_bfp", "all")]["points"]["stash_scope"] == "all"
    assert all(r["step_ms"] > 0 and r["first_step_s"] > 0 for r in rows.values())
    held = {key: row["activation_mb"] for key, row in rows.items()}
    # packing every saved activation holds the least
    assert held[("stash_bfp", "all")] < held[("stash_bfp", "gemm")] < held[("fp32", "gemm")]
    # a whole step's peak: the same state (parameters, Adam) for all, the step's peak above it
    assert len({row["state_mb"] for row in rows.values()}) == 1
    for row in rows.values():
        assert row["peak_mb"] == pytest.approx(row["state_mb"] + row["step_peak_mb"])
        assert row["step_peak_mb"] > row["activation_mb"] > 0
    # (at 64 tokens the step's peak is the optimizer's or the output layer's, the same for all)
    peaks = {key: row["step_peak_mb"] for key, row in rows.items()}
    assert peaks[("stash_bfp", "all")] <= peaks[("fp32", "gemm")]


def test_bench_step_unknown_scope_is_one_line_exit_2():
    result = runner.invoke(app, ["bench", "step", "--scopes", "gemm,some"])
    assert result.exit_code == 2
    assert "--scopes: unknown value(s) ['some']" in result.output
    assert result.output.count("\n") == 1


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--budget", "2XB"], "--budget: expected a size like 2GiB, 512MiB or 1.5GB, got '2XB'"),
        (["--budget", "1GiB", "--presets", "fp32,dsq9"], "unknown quant preset 'dsq9'"),
        (["--budget", "1GiB", "--scopes", "some"], "--scopes: unknown value(s) ['some']"),
        (["--budget", "1GiB", "--checkpointing", "yes"], "--checkpointing: unknown value(s)"),
    ],
)
def test_bench_memory_bad_input_is_one_line_exit_2(args, needle):
    result = runner.invoke(app, ["bench", "memory", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.output


@pytest.mark.slow
def test_bench_memory_finds_the_largest_batch_that_fits():
    pytest.importorskip("fairseq")
    shape = ["--layers", "1", "--width", "64", "--src-len", "8", "--vocab", "1000"]
    args = ["--budget", "24MiB", "--presets", "fp32,stash_bfp", "--scopes", "all", *shape]
    result = runner.invoke(app, ["bench", "memory", *args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert data["budget_mb"] == 24 and data["loss_chunk"] == 1024
    fp32, bfp = data["rows"]
    assert (fp32["row"], bfp["row"]) == ("fp32", "stash_bfp all")
    for row in (fp32, bfp):
        assert row["tokens"] % 8 == 0 and row["tokens"] > 0
        assert row["peak_mb"] <= 24  # it fits, and one sentence more does not
        probes = {p["tokens"]: p["peak_mb"] for p in row["probes"]}
        assert probes[row["tokens"]] == row["peak_mb"] and probes[row["tokens"] + 8] > 24
    assert fp32["x_fp32"] == 1 and bfp["tokens"] > fp32["tokens"]
    assert bfp["x_fp32"] == pytest.approx(bfp["tokens"] / fp32["tokens"])
    assert bfp["x_amp_bf16"] is None  # amp_bf16 was not measured


@pytest.mark.slow
def test_bench_step_prints_its_table():
    pytest.importorskip("fairseq")
    args = ["--presets", "fp32,dsq", "--layers", "1", "--width", "64", "--tokens", "64"]
    result = runner.invoke(app, ["bench", "step", *args, "--src-len", "8", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "fp32" in result.output and "dsq" in result.output
    assert "torch" in result.output  # the machine line above the table
    assert "(output projection quantized as each preset says, as dsq train runs it;" in (
        result.output
    )


def test_bench_attention_times_each_row_beside_sdpa():
    result = runner.invoke(app, ["bench", "attention", "--seq-lens", "32,48", "--heads", "4",
                                 "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                                 "--explicit-up-to", "32", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["shape"] == {"batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 16}
    rows = {(r["seq_len"], r["row"]): r for r in data["rows"]}
    assert set(rows) == {(32, "sdpa, bf16 autocast"), (32, "dsq tiled"), (32, "dsq explicit"),
                         (48, "sdpa, bf16 autocast"), (48, "dsq tiled")}  # fmt: skip
    assert all(r["ms"] > 0 and r["x_sdpa"] > 0 for r in rows.values())
    assert rows[(32, "sdpa, bf16 autocast")]["x_sdpa"] == 1.0


def test_paths_is_the_deprecated_name_of_backends():
    result = runner.invoke(app, ["bench", "quant", "--formats", "bfp4", "--numel", "256",
                                 "--repeats", "1", "--paths", "reference", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--paths is deprecated; use --backends" in result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert {r["backend"] for r in rows if r["format"] != "-"} == {"reference"}


def _commands(group, path=()):
    """(path, click command) of every command under ``group``, the group itself first."""
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from _commands(command, (*path, name))


def test_every_commands_help_prints_whole_sentences_and_cites_headings():
    """Each command's summary, as its parent lists it and as its own help prints it, is the
    whole first paragraph of its docstring, ending a sentence; no help cites a section number
    (docs are cited by their headings)."""
    import re

    import typer

    def words(text):
        return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())

    root = typer.main.get_command(app)
    for path, command in _commands(root):
        result = runner.invoke(app, [*path, "--help"], terminal_width=400)
        assert result.exit_code == 0, path
        shown = words(result.output)
        assert "§" not in shown, f"dsq {' '.join(path)} --help cites a section number"
        summary = words((command.help or "").split("\n\n")[0])
        assert summary.endswith("."), f"dsq {' '.join(path)}: summary {summary!r}"
        assert summary in shown, f"dsq {' '.join(path)} --help cuts its summary"
        for name, sub in getattr(command, "commands", {}).items():
            listed = words((sub.help or "").split("\n\n")[0])
            assert f"{name} {listed}" in shown, f"dsq {' '.join(path)} lists {name} cut short"
