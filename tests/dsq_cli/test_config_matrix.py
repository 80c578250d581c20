"""The configuration matrix: every quant preset of conf/quant/ (globbed, so a new file is covered)
x quant.stash_scope in {gemm, all} x both model families (the demo translation task and a GLUE
task with roberta_tiny), each trained for real through the CLI in this process.

A cell trains 2 updates: a real SIGTERM after update 1 stops it with a checkpoint (the way a user
stops a run), `dsq train resume=RUN_DIR` finishes it with one validation, which steps the DSQ
schedule, and the run is priced: by `dsq cost` with the same overrides for translation, by the
GEMMs its first update recorded (result.json) for GLUE, which `dsq cost` refuses by design.
Usage errors met along the matrix's axes exit 2 with one line and leave nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from helpers.preset_cells import PRESETS, accepted_cells, refused_cells, scope_refusal
from helpers.runs import read_jsonl
from typer.testing import CliRunner

from dsq.engine import QuantConfig
from dsq.engine.config import STASH_SCOPES
from dsq_cli import runs
from dsq_cli.cli import app
from dsq_cli.presets import TABLE1_ORDER, at_first_level, load_quant_preset
from dsq_cli.run_result import RunResult
from dsq_cli.train import recorder, stop
from dsq_cli.train.recorder import load_checkpoint

pytestmark = pytest.mark.slow  # trains, compiles or spawns processes (not in make test-fast)

RUNNER = CliRunner()
FAMILIES = ("translation", "glue")

# SST-2's layout (header, sentence TAB label); the words are in MiniLM's WordPiece vocabulary.
_WORDS = ("good", "bad", "fine", "awful", "great", "poor", "nice", "dull")
GLUE_ROWS = [f"a {_WORDS[i % 8]} film about {i} people\t{1 - i % 2}" for i in range(16)]


def test_matrix_covers_every_table1_preset_and_scope():
    assert set(TABLE1_ORDER) <= set(PRESETS)
    assert set(STASH_SCOPES) == {"gemm", "all"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Data shared by every cell: the demo's prepared cache and a tiny SST-2 folder."""
    root = tmp_path_factory.mktemp("matrix")
    glue = root / "SST-2"
    glue.mkdir()
    header = "sentence\tlabel\n"
    (glue / "train.tsv").write_text(header + "".join(row + "\n" for row in GLUE_ROWS))
    (glue / "dev.tsv").write_text(header + "".join(row + "\n" for row in GLUE_ROWS[:8]))
    # Every tensor here is tiny: on a 2-core machine shared with other jobs, a second intra-op
    # thread only adds synchronisation (a cell ran about ten times slower with two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"cache": root / "cache", "glue": glue}
    torch.set_num_threads(threads)


def overrides(family: str, shared: dict, *extra: str) -> list[str]:
    """The smallest run of a family: 1 layer, 32 wide, a handful of examples; 2 updates,
    validated (and the schedule stepped) at update 2 only, a train line at every update.
    ``extra`` adds keys or replaces these."""
    budget = ["train.max_updates=2", "train.validate_every=2", "train.log_every=1",
              "train.warmup_updates=1", "train.device=cpu", "logger=none"]  # fmt: skip
    if family == "translation":
        base = [
            "task=demo",
            "task.sizes.train=200",
            "task.sizes.valid=8",
            "task.sizes.test=4",
            "data.vocab_size=120",
            f"data.cache_dir={shared['cache']}",
            "model=transformer_small",
            "model.encoder_layers=1",
            "model.decoder_layers=1",
            "model.encoder_embed_dim=32",
            "model.decoder_embed_dim=32",
            "model.encoder_ffn_embed_dim=64",
            "model.decoder_ffn_embed_dim=64",
            "model.encoder_attention_heads=2",
            "model.decoder_attention_heads=2",
            "train.max_tokens=256",  # the 8 valid pairs in one batch
            "eval.beam=1",
            "eval.max_len_a=0",
            "eval.max_len_b=8",
        ]
    else:
        base = [
            "task=sst2",
            f"data.raw_dir={shared['glue']}",
            "model=roberta_tiny",
            "model.encoder_layers=1",
            "model.encoder_embed_dim=32",
            "model.encoder_ffn_embed_dim=64",
            "model.encoder_attention_heads=2",
            "model.max_length=16",
            # 8 examples of 8 tokens: LayerNorm's [T, B, 1] statistics hold 64 values, the size
            # from which stash_scope=all packs a saved tensor
            "train.batch_size=8",
        ]
    replaced = {o.split("=", 1)[0] for o in extra}
    return [o for o in base + budget if o.split("=", 1)[0] not in replaced] + list(extra)


@pytest.fixture
def sigterm_after_update_1(monkeypatch):
    """While armed, the train line of update 1 sends this process a real SIGTERM: the run's own
    handler turns it into a checkpoint and exit 143, as for a user's `kill`."""
    armed = {"on": True}
    metrics = recorder.RunRecorder.metrics

    def metrics_then_stop(self, record):
        metrics(self, record)
        if armed["on"] and record["kind"] == "train" and record["update"] == 1:
            handler = signal.getsignal(signal.SIGTERM)
            # without the run's handler a SIGTERM would end pytest itself
            assert threading.current_thread() is threading.main_thread()
            assert isinstance(getattr(handler, "__self__", None), stop.StopRequest), handler
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(recorder.RunRecorder, "metrics", metrics_then_stop)
    return armed


def invoke(*args: str):
    return RUNNER.invoke(app, list(args))


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def assert_usage_error(result, says: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.startswith("dsq: error: ") and says in result.output, result.output
    assert result.output.count("\n") == 1, result.output  # one line, no traceback


@pytest.mark.parametrize(("preset", "scope"), refused_cells())
def test_a_scope_a_preset_refuses_is_a_usage_error(preset, scope, shared, tmp_path):
    run_dir = tmp_path / "run"
    args = overrides("translation", shared, f"quant={preset}", f"quant.stash_scope={scope}")
    assert_usage_error(invoke("train", *args, f"run.dir={run_dir}"), scope_refusal(preset, scope))
    assert not run_dir.exists()


# The translation family runs every preset at every scope it accepts. The GLUE family, whose
# trainer shares the engine and differs only in the model and its data, runs one preset of each
# kind of engine and format family: fp32 (nothing quantized), amp_bf16 (autocast), bf16 and dsq
# (BFP and fixed point, a rising stash), mx_dsq and nvfp4_dsq (the MX and NVFP4 families). The
# other presets are the same code at other widths.
GLUE_PRESETS = ("fp32", "amp_bf16", "bf16", "dsq", "mx_dsq", "nvfp4_dsq")
CELLS = [("translation", preset, scope) for preset, scope in accepted_cells()] + [
    ("glue", preset, scope) for preset, scope in accepted_cells(GLUE_PRESETS)
]


def test_the_glue_cells_cover_every_engine_and_format_family():
    from dsq.formats import parse_format

    def families(preset):
        quant = load_quant_preset(preset)
        points = at_first_level(quant)
        return {type(parse_format(points[p])).__name__ for p in ("q0", "q1", "q2", "q3")} | {
            quant.get("engine", "dsq")
        }

    covered = set().union(*(families(p) for p in GLUE_PRESETS))
    assert set().union(*(families(p) for p in PRESETS)) <= covered


@pytest.mark.parametrize(("family", "preset", "scope"), CELLS)
def test_cell_trains_resumes_and_is_priced(family, preset, scope, shared, tmp_path,
                                           sigterm_after_update_1):  # fmt: skip
    run_dir = tmp_path / "run"
    args = overrides(family, shared, f"quant={preset}", f"quant.stash_scope={scope}")
    first = QuantConfig.from_dict(load_quant_preset(preset)).current()  # no level change in 2

    stopped = invoke("train", *args, f"run.dir={run_dir}")
    assert stopped.exit_code == 128 + signal.SIGTERM, stopped.output
    assert f"continue with: dsq train resume={run_dir}" in stopped.output
    interrupted = json.loads((run_dir / "result.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["updates"] == 1
    # held while it trained (tests/dsq_cli/test_run_lock.py)
    assert (run_dir / runs.LOCK_NAME).is_file()
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == 1 and state["progress"]["validations"] == 0
    assert all(s["level"] == 0 and s["best"] == math.inf for s in state["dsq_schedule"].values())
    # resume continues the stored run: another preset is refused and the run stays as it was
    before = files_of(run_dir)
    other = "dsq" if preset == "fp32" else "fp32"
    assert_usage_error(invoke("train", f"resume={run_dir}", f"quant={other}"), "cannot change")
    assert files_of(run_dir) == before

    sigterm_after_update_1["on"] = False
    resumed = invoke("train", f"resume={run_dir}")
    assert resumed.exit_code == 0, resumed.output
    res = json.loads((run_dir / "result.json").read_text())
    assert RunResult.problems(res) == []
    assert res["status"] == "completed" and res["resumed"] is True and res["updates"] == 2
    assert res["quant"]["preset"] == preset and res["quant"]["stash_scope"] == scope
    assert res["quant"]["modified"] is (scope != load_quant_preset(preset)["stash_scope"])
    assert res["patch"]["stash_scope"] == scope
    # the autocast engine patches nothing: hooks observe its GEMMs, which price the run
    autocast = load_quant_preset(preset).get("engine") == "autocast"
    assert bool(res["patch"]["linears"]) is not autocast
    assert res["bits_final"] == first

    # the GEMMs of both processes are counted, by kind: one update each ran as many dx GEMMs
    # (validation runs forward GEMMs only), so the resumed run's count is twice the first's
    def count(result, kind):
        return sum(result["gemm_units"][kind].values())

    if autocast:  # torch ran every GEMM, no unit of dsq's (the hooks' count prices the run)
        assert interrupted["gemm_units"] == res["gemm_units"] == {}
    else:
        assert count(interrupted, "linear.dx") > 0
        assert count(res, "linear.dx") == 2 * count(interrupted, "linear.dx")
        assert count(res, "linear.forward") > count(res, "linear.dx")  # the validation's

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [m for m in metrics if m["kind"] == "train"]
    (valid,) = [m for m in metrics if m["kind"] == "valid"]
    assert [m["update"] for m in train_lines] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["bits"] == first for m in train_lines)
    assert valid["update"] == 2 and valid["bits"] == first
    assert math.isfinite(valid["valid_loss"]) and valid["valid_loss"] == res["valid_loss"]
    assert res["best_valid_loss"] == res["valid_loss"]

    # The one validation stepped every point's schedule: its loss is each point's best so far,
    # no level change (a first loss always improves), and the checkpoint carries that state.
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == 2 and state["progress"]["validations"] == 1
    for point, schedule in state["dsq_schedule"].items():
        assert (schedule["level"], schedule["bad"]) == (0, 0), point
        assert schedule["best"] == res["valid_loss"], point
        assert schedule["levels"][0] == first[point], point
    assert (run_dir / "schedule.jsonl").read_text() == ""

    # Priced over the update-weighted levels: both updates ran the first levels.
    assert res["stash_bits_mean"] == pytest.approx(bits(first["q1"]))
    cost = res["cost"]
    assert cost["baseline"] == "fixed32" and cost["gemms_per_step"] > 0
    assert 0 < cost["arith_ratio"] <= 1 and 0 < cost["dram_ratio"] <= 1
    if preset in ("fp32", "fixed32"):  # the baseline's own widths
        assert (cost["arith_ratio"], cost["dram_ratio"]) == (1.0, 1.0)

    if family == "translation":
        (test_line,) = [m for m in metrics if m["kind"] == "test"]
        assert test_line["update"] == 2 and test_line["bleu"] == res["bleu"]
        assert 0 <= res["bleu"] <= 100 and res["eval_sentences"] == 4
        check_dsq_cost(args, first, cost)
    else:
        assert res["metric"] == "accuracy" and res["eval_examples"] == 8
        assert 0 <= res["value"] <= 1 and res["best_update"] == 2
        assert valid["dev_accuracy"] == res["accuracy"]
        # dsq cost derives translation transformers only; an encoder is refused, not mispriced
        assert_usage_error(invoke("cost", *args), "dsq cost derives the translation")

    # A finished run cannot be resumed; the refusal changes nothing in it.
    before = files_of(run_dir)
    assert_usage_error(invoke("train", f"resume={run_dir}"), "already completed")
    assert files_of(run_dir) == before


def bits(spec: str) -> float:
    from dsq.formats import parse_format

    return parse_format(spec).bits_per_value


def check_dsq_cost(args: list[str], first: dict, trained: dict) -> None:
    """`dsq cost` for the overrides of the run: priced at the same first levels; with one format
    at every point the ratios do not depend on the GEMM shapes, so they equal the run's."""
    result = invoke("cost", *args, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["quant"]["points"] == first
    total = report["total"]
    assert 0 < total["arith_ratio"] <= 1 and 0 < total["dram_ratio"] <= 1
    if len(set(first.values())) == 1:
        assert total["arith_ratio"] == pytest.approx(trained["arith_ratio"], rel=1e-12)
        assert total["dram_ratio"] == pytest.approx(trained["dram_ratio"], rel=1e-12)


# -- usage errors along the matrix's axes: exit 2, one line, nothing written --------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "extra, says",
    [
        (["quant.stash_scope=none"], "stash_scope must be one of ('gemm', 'all')"),
        (["quant=int4"], "unknown quant 'int4'; choose one of"),
        (["quant.q1={levels: [bfp4, bfp2]}"], "schedule levels must rise in bits per value"),
        (["quant.gemm_unit=bf16"], "quant.gemm_unit='bf16' is not a setting; choose one of"),
    ],
)
def test_bad_quant_exits_2_with_one_line_and_leaves_nothing(family, extra, says, shared, tmp_path):
    root = tmp_path / "runs"
    result = invoke("train", *overrides(family, shared, *extra), f"run.root={root}")
    assert_usage_error(result, says)
    assert not root.exists()
    if family == "translation":
        assert_usage_error(invoke("cost", *overrides(family, shared, *extra)), says)


def test_a_valid_split_under_8_pairs_is_validated(shared, tmp_path):
    """fairseq's default batch multiple of 8 would drop the pairs of a last partial batch (a
    valid split of 4 pairs would have no batch at all); dsq asks for a multiple of 1."""
    run_dir = tmp_path / "run"
    args = overrides("translation", shared, "quant=fp32", "task.sizes.valid=4",
                     "train.max_updates=1", "train.validate_every=1")  # fmt: skip
    result = invoke("train", *args, f"run.dir={run_dir}")
    assert result.exit_code == 0, result.output
    (valid,) = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "valid"]
    assert math.isfinite(valid["valid_loss"])
