"""``dsq bench memory|step --model llama|gpt2|bert``: the rows, the arithmetic of bytes per token
and tokens at a budget, and the usage errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsq_cli.bench import transformers_models as tm
from dsq_cli.cli import app

pytest.importorskip("transformers")


def test_rows_are_every_preset_scope_and_checkpointing_but_one_scope_for_baselines():
    rows = tm.rows_of(["amp_bf16", "dsq"], ["gemm", "all"], [False, True])
    assert [r.label for r in rows] == [
        "amp_bf16", "amp_bf16 ckpt", "dsq", "dsq ckpt", "dsq all", "dsq all ckpt",
    ]  # fmt: skip


def test_bytes_per_token_and_tokens_at_a_budget_come_from_the_line_through_two_batches(
    monkeypatch,
):
    # a row holding 1,000 fixed bytes plus 100 a token (the allocator) or 150 (the process)
    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        tokens = seq_len * batch
        return {"step_s": tokens * 1e-3, "allocator_bytes": 1000 + 100 * tokens,
                "rss_bytes": 1000 + 150 * tokens, "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16")], [64], budget=101_000, repeats=1)
    (row,) = result["rows"]
    assert row["batches"] == [4, 8]
    assert row["allocator_kib_per_token"] == pytest.approx(100 / 1024)
    assert row["rss_kib_per_token"] == pytest.approx(150 / 1024)
    assert row["allocator_tokens_at_budget"] == 960  # (101,000 - 1,000) / 100: 15 sequences
    assert row["rss_tokens_at_budget"] == 640  # 666 tokens, 10 whole sequences of 64
    assert row["ms_per_token"] == pytest.approx(1.0)
    assert row["allocator_tokens_at_budget_x_amp_bf16"] == 1.0
    # from 512 tokens a sequence, 2 and 3 sequences: one sequence's passes may peak at the end
    # of the backward pass, not at the loss, and a slope across the two is no bytes a token
    (long,) = tm.run(tm.ModelShape(), [tm.Row("amp_bf16")], [512], budget=10**7)["rows"]
    assert long["batches"] == [2, 3]


def test_batches_given_are_the_two_the_slope_is_taken_between(monkeypatch):
    seen = []

    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        seen.append(batch)
        return {"step_s": 1.0, "allocator_bytes": 1000 + 100 * batch * seq_len,
                "rss_bytes": 1000 + 100 * batch * seq_len, "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = CliRunner().invoke(app, [
        "bench", "memory", "--budget", "1GiB", "--model", "llama", "--seq-lens", "1024",
        "--presets", "amp_bf16", "--batches", "3,5", "--repeats", "1",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen == [3, 5]
    assert "batches of 3 and 5 sequences" in result.output
    assert "| 0.1 |" in result.output  # 100 bytes a token


def test_a_step_is_timed_at_the_larger_of_the_batches_given(monkeypatch):
    seen = []

    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        seen.append(batch)
        return {"step_s": 0.001 * batch * seq_len, "allocator_bytes": 100 * batch * seq_len,
                "rss_bytes": 100 * batch * seq_len, "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = CliRunner().invoke(app, [
        "bench", "step", "--model", "llama", "--seq-lens", "1024", "--presets", "amp_bf16",
        "--batches", "8,12", "--repeats", "1", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen == [8, 12]
    (row,) = json.loads(result.output)["rows"]
    assert row["batches"] == [8, 12] and row["ms_per_token"] == pytest.approx(1.0)


def test_rounds_take_turns_and_time_is_the_median_of_each_rounds_ratio(monkeypatch):
    """The host's speed moves between rows: the rounds' ratios are 2, 2 and 5, their median 2,
    where the ratio of the median times would say 5; bytes come from the first round."""
    order, speed = [], iter([1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 2.5, 2.5])

    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        order.append(row.label)
        per_token = (2.0 if row.preset == "dsq" else 1.0) * next(speed) * 1e-3
        return {"step_s": per_token * seq_len * batch, "allocator_bytes": 100 * batch,
                "rss_bytes": 200 * batch, "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    rows = [tm.Row("amp_bf16"), tm.Row("dsq")]
    result = tm.run(tm.ModelShape(), rows, [64], budget=10**6, repeats=1, rounds=3)
    assert order == ["amp_bf16", "amp_bf16", "dsq", "dsq"] * 3
    amp, dsq = result["rows"]
    assert amp["ms_per_token_rounds"] == pytest.approx([1.0, 3.0, 1.0])
    assert dsq["ms_per_token_rounds"] == pytest.approx([2.0, 6.0, 5.0])
    assert dsq["ms_per_token"] == pytest.approx(5.0)
    assert dsq["ms_per_token_x_amp_bf16"] == pytest.approx(2.0)
    assert dsq["allocator_kib_per_token"] == pytest.approx(100 / 64 / 1024)  # 100 B a sequence
    assert "3 rounds, the rows taking turns" in tm.format_step(result)


@pytest.mark.parametrize(("command", "args", "named"), [
    (["step"], ["--rounds", "2"], "--rounds"),
    (["step"], ["--threads", "2", "--seq-lens", "512"], "--seq-lens, --threads"),
    (["step"], ["--heads", "4", "--kv-heads", "2"], "--heads, --kv-heads"),
    (["step"], ["--batches", "8,12"], "--batches"),
    # the default value given on the command line is refused too: given is given
    (["memory", "--budget", "1GiB"], ["--seq-lens", "256,1024"], "--seq-lens"),
    (["memory", "--budget", "1GiB"], ["--repeats", "3"], "--repeats"),
    (["memory", "--budget", "1GiB"], ["--where"], "--where"),
    (["memory", "--budget", "1GiB"], ["--batches", "3,5"], "--batches"),
])  # fmt: skip
def test_fairseq_refuses_the_transformers_options_it_would_not_read(command, args, named):
    result = CliRunner().invoke(app, ["bench", *command, *args])
    assert result.exit_code == 2
    assert f"{named}: for the transformers models only" in result.output
    assert "leave it out for fairseq" in result.output


@pytest.mark.parametrize(("command", "args", "model"), [
    (["step"], ["--scopes", "gemm,sliced"], "fairseq"),
    (["memory", "--budget", "1GiB"], ["--scopes", "sliced"], "fairseq"),
    (["step", "--model", "gpt2", "--seq-lens", "64"], ["--scopes", "gemm,sliced"], "gpt2"),
    (["memory", "--budget", "1GiB", "--model", "bert"], ["--scopes", "all-held-sliced"], "bert"),
])  # fmt: skip
def test_a_scope_of_mlps_in_slices_is_refused_for_a_model_without_llama_mlps(command, args, model):
    result = CliRunner().invoke(app, ["bench", *command, *args])
    assert result.exit_code == 2, result.output
    assert "Llama-style MLPs only (--model llama)" in result.output
    assert f"out for {model}" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_tiny_llama_runs_every_row_in_its_own_process():
    result = CliRunner().invoke(app, [
        "bench", "memory", "--budget", "1GiB", "--model", "llama", "--layers", "1",
        "--width", "64", "--heads", "2", "--kv-heads", "1", "--vocab", "64", "--seq-lens", "32",
        "--presets", "amp_bf16,dsq", "--scopes", "gemm", "--checkpointing", "off,on",
        "--threads", "1", "--repeats", "1",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0][2:] for line in table] == [
        "amp_bf16", "amp_bf16 ckpt", "dsq", "dsq ckpt",
    ]  # fmt: skip
    assert "error" not in result.output


@pytest.mark.slow
def test_the_breakdown_profiles_each_rows_larger_batch_by_kind_of_operator():
    result = CliRunner().invoke(app, [
        "bench", "step", "--model", "llama", "--layers", "1", "--width", "64", "--heads", "2",
        "--kv-heads", "1", "--vocab", "64", "--seq-lens", "32", "--presets", "amp_bf16,dsq",
        "--scopes", "all", "--threads", "1", "--repeats", "1", "--breakdown", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output)
    assert set(measured["unit_peaks"]) == {"bf16", "fp32"}
    by_row = {row["row"]: row["breakdown"]["ms"] for row in measured["rows"]}
    assert set(by_row) == {"amp_bf16", "dsq all"}
    # autocast runs torch's fused attention; dsq its tiled kernel (softmax apart) and quantizers
    assert (
        by_row["amp_bf16"]["attention (fused)"] > 0
        and "attention (unfused)" not in by_row["amp_bf16"]
    )
    assert by_row["dsq all"]["attention (unfused)"] > 0 and by_row["dsq all"]["quantizers"] > 0
    assert "attention (fused)" not in by_row["dsq all"]
    table = tm.format_step(measured)  # as printed without --json
    assert "Where one profiled step's time goes" in table
    assert any(line.startswith("dsq all, 32 a sequence ") for line in table.splitlines())


@pytest.mark.parametrize(("args", "says"), [
    (["--model", "gpt3"], "--model 'gpt3': choose one of"),
    (["--model", "llama", "--fp32-head"], "--fp32-head: for --model fairseq only"),
    (["--model", "gpt2", "--src-len", "8"], "--src-len: for --model fairseq only"),
    (["--model", "gpt2", "--heads", "4", "--kv-heads", "2"], "equal them but for llama"),
    (["--model", "llama", "--seq-lens", "1k"], "--seq-lens: expected lengths"),
    (["--model", "bert", "--loss-chunk", "64"], "--loss-chunk takes a causal LM's output layer"),
    (["--model", "llama", "--batches", "5,3"], "--batches: expected two batch sizes"),
    (["--model", "llama", "--batches", "3"], "--batches: expected two batch sizes"),
    (["--model", "llama", "--batches", "0,2"], "--batches: expected two batch sizes"),
])  # fmt: skip
def test_bad_options_are_one_line_usage_errors(args, says):
    result = CliRunner().invoke(app, ["bench", "memory", "--budget", "1GiB", *args])
    assert result.exit_code == 2
    assert says in result.output


def test_step_of_a_transformers_model_refuses_the_fairseq_options_it_would_not_read():
    result = CliRunner().invoke(app, ["bench", "step", "--model", "llama", "--tokens", "4096",
                                      "--gemm-units", "auto", "--fp32-head"])  # fmt: skip
    assert result.exit_code == 2
    assert "--tokens, --gemm-units, --fp32-head: for --model fairseq only" in result.output
    assert "leave it out for llama" in result.output


def test_a_peak_that_does_not_grow_with_the_batch_gives_no_tokens_at_the_budget(monkeypatch):
    def flat(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        return {"step_s": 1.0, "allocator_bytes": 1000 + 100 * seq_len * batch,
                "rss_bytes": 5000, "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", flat)
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16")], [64], budget=10**6, repeats=1)
    (row,) = result["rows"]
    assert row["rss_kib_per_token"] == 0 and row["rss_tokens_at_budget"] is None
    assert "| - |" in tm.format_memory(result)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_loss_in_chunks_is_the_models_own_loss_and_reaches_the_runs_footer(kind, monkeypatch):
    """``--loss-chunk``: the output layer and its next-token loss a chunk at a time give the
    model's own loss and gradients, up to float32 summation order."""
    import torch

    shape = tm.ModelShape(kind, layers=1, width=64, heads=2, kv_heads=1 if kind == "llama" else 2,
                          vocab=64)  # fmt: skip
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for chunked in (False, True):
        model = shape.build(24)
        loss = tm._chunked_loss(model, ids, 16) if chunked else model(ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    for own, chunked in zip(*grads):
        torch.testing.assert_close(chunked, own, rtol=1e-5, atol=1e-7)

    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        assert loss_chunk == 16
        return {"step_s": 1.0, "allocator_bytes": 100 * batch, "rss_bytes": 100 * batch,
                "first_loss": 1.0}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = tm.run(shape, [tm.Row("amp_bf16")], [24], budget=10**6, loss_chunk=16)
    assert "the loss in chunks of 16 tokens" in tm.format_memory(result)


# a fresh process, as the bench measures one: the process's peak is a high-water mark. The spy
# grows the process to 256 MiB above its peak so far (whatever the steps' peak was), so the
# profiled passes after the steps always raise the mark
GROWING_PROFILER = """
import json, resource, numpy as np
from dsq_cli.bench import step, transformers_models as tm
grown, marks, measured = [], [], step.allocated_during
def growing(fn, dev):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * tm.KIB
    now = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    marks.append(peak)
    grown.append(np.ones((peak - now + 2**28) // 8))  # written, so resident
    return measured(fn, dev)
step.allocated_during = growing
shape = tm.ModelShape("llama", layers=1, width=64, heads=2, kv_heads=1, vocab=64)
out = tm.measure(shape, tm.Row("amp_bf16"), seq_len=16, batch=1, repeats=1)
print(json.dumps([marks, out["rss_bytes"], resource.getrusage(0).ru_maxrss * tm.KIB,
                  out["cpu_allocator"]]))
"""


@pytest.mark.slow  # spawns a process
def test_the_process_peak_is_the_steps_not_the_profilers():
    """The allocator's measurement (torch.profiler's records of every allocation) comes after the
    timed steps and grows the process too: the process's peak is read before it. A spy in its
    place raises the process's peak by 256 MiB; the reported peak is the one before."""
    import json
    import os
    import subprocess
    import sys

    env = os.environ | {"DSQ_CPU_ALLOCATOR": "default"}
    done = subprocess.run([sys.executable, "-c", GROWING_PROFILER], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    marks, reported, peak, malloc = json.loads(done.stdout.splitlines()[-1])
    assert len(marks) == 2  # the passes, then the optimizer step
    assert reported <= marks[0]  # the steps' peak, before the spy grew the process
    assert peak >= marks[0] + 2**28 * 0.9  # and the spy did raise it
    assert malloc == "default"  # the setting the process had in force, as it reports it


def test_the_footer_names_the_malloc_setting_the_rows_processes_had_in_force(monkeypatch):
    """What each row's process applied, as it reports it (not what the parent asked for): one
    setting, or each that occurred; a result from before it was recorded names none."""

    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        return {"step_s": 1.0, "allocator_bytes": 100 * batch, "rss_bytes": 100 * batch,
                "first_loss": 1.0, "cpu_allocator": applied[row.preset]}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    applied = {"amp_bf16": "release", "fp32": "release"}
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16"), tm.Row("fp32")], [24], budget=10**6)
    assert result["cpu_allocator"] == "release"
    assert "malloc setting release" in tm.format_memory(result)
    applied["fp32"] = "none applied"
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16"), tm.Row("fp32")], [24], budget=10**6)
    assert "malloc setting none applied, release" in tm.format_step(result)
    del result["cpu_allocator"]
    assert "malloc setting" not in tm.format_memory(result)
