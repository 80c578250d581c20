"""`dsq bench memory --where` (dsq_cli/bench/peak_holders.py): what a step holds at its allocator
peak, by the operators that allocated it, and where that peak is."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dsq_cli.bench import transformers_models as tm
from dsq_cli.bench.peak_holders import holder, holders_at_peak, per_token
from dsq_cli.bench.step import allocated_during
from dsq_cli.cli import app

MIB = 2**20


class _Doubled(torch.autograd.Function):
    """Holds a float32 copy of its input for the backward pass, and makes a temporary of twice
    its size there: the backward pass's peak is that temporary beside the copy."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.clone())
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        (kept,) = ctx.saved_tensors
        wide = torch.cat([kept, kept])  # 2 MiB, alive with the 1 MiB copy and dy
        return dy * 2 + wide[: dy.numel()] * 0


def _step():
    x = torch.ones(MIB // 4, requires_grad=True)  # 1 MiB
    _Doubled.apply(x).sum().backward()


def test_the_peak_is_the_one_allocated_during_measures_and_its_holders_add_up_to_it():
    measured = allocated_during(_step, torch.device("cpu"))
    found = holders_at_peak(_step)
    assert found.peak == measured.peak and found.held == measured.held
    assert sum(n for _, n in found.holders) == found.peak
    assert found.holders == sorted(found.holders, key=lambda h: -h[1])


def test_the_holders_are_named_by_the_functions_that_allocated_them_and_the_peak_by_its_place():
    found = holders_at_peak(_step)
    names = dict(found.holders)
    assert names["backward: _DoubledBackward (aten::cat)"] == 2 * MIB
    assert names["forward: _Doubled (aten::clone)"] == MIB
    # the peak's instant is inside the backward node, where the 2 MiB temporary is made
    assert "_DoubledBackward" in found.at
    assert not any(name.startswith("autograd::engine::evaluate_function") for name in found.at)


@pytest.mark.parametrize(("path", "named"), [
    (("autograd::engine::evaluate_function: AttnBackward", "AttnBackward", "dsq::bfp_decode",
      "aten::empty"), "backward: AttnBackward > dsq::bfp_decode (aten::empty)"),
    (("Outer", "Mid", "Inner", "aten::linear", "aten::matmul", "aten::mm"),
     "forward: Mid > Inner (aten::linear)"),
    (("aten::add",), "forward: the step (aten::add)"),
    (("Fn",), "forward: Fn"),
])  # fmt: skip
def test_a_holder_is_its_pass_its_two_innermost_named_operators_and_the_aten_call_below(
    path, named
):
    assert holder(path) == named


def test_each_holder_grows_by_its_bytes_a_token_between_the_two_batches():
    """The largest by bytes and by growth either way are shown, most growth first, the rest as
    one; the growths add up to the whole peak's."""
    small = [("a", 4 * MIB), ("b", MIB), ("c", MIB), ("e", 9 * MIB), ("f", 3 * MIB)]
    large = [("e", 9 * MIB), ("a", 8 * MIB), ("b", 3 * MIB), ("c", MIB), ("d", MIB)]
    rows = per_token(small, large, tokens=1024, top=2)
    assert [r["held"] for r in rows] == [
        "a", "b", "e", "the other 2 holders (1 only at the smaller batch)"]  # fmt: skip
    assert [r["mib"] for r in rows] == [8, 3, 9, 2]
    # the rest: c 0, d 1 MiB new, f 3 MiB gone
    assert [r["kib_per_token"] for r in rows] == [4, 2, 0, -2]
    growth = (sum(n for _, n in large) - sum(n for _, n in small)) / 1024 / 2**10
    assert sum(r["kib_per_token"] for r in rows) == growth


def test_a_holder_gone_at_the_larger_batch_still_counts_in_the_growth():
    rows = per_token([("x", MIB)], [("y", MIB)], tokens=1024)
    assert [(r["held"], r["kib_per_token"]) for r in rows] == [
        ("y", 1), ("the other 0 holders (1 only at the smaller batch)", -1)]  # fmt: skip


def test_where_reaches_the_table_with_each_rows_holders(monkeypatch):
    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        assert where
        held = [["before the step", 10 * MIB], ["backward: X", batch * MIB]]
        return {
            "step_s": 1.0,
            "allocator_bytes": (10 + batch) * MIB,
            "first_loss": 1.0,
            "rss_bytes": (10 + batch) * MIB,
            "held_at_peak": held,
            "peak_at": ["X"],
        }

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16")], [512], budget=2**30, where=True)
    (entry,) = result["rows"]
    assert entry["peak_at"] == ["X"]
    assert entry["held_at_peak"][0] == {"held": "backward: X", "mib": 3, "kib_per_token": 2}
    text = tm.format_memory(result)
    assert "amp_bf16 at 512 tokens a sequence: the peak of 3 sequences is in X" in text
    assert "| backward: X | 3.0 | 2.00 |" in text
    assert "elsewhere" not in text


@pytest.mark.slow  # spawns a process a row and batch
def test_a_tiny_llama_says_where_each_rows_peak_is():
    result = CliRunner().invoke(app, [
        "bench", "memory", "--budget", "1GiB", "--model", "llama", "--layers", "1",
        "--width", "64", "--heads", "2", "--kv-heads", "1", "--vocab", "64", "--seq-lens", "32",
        "--presets", "amp_bf16,dsq", "--scopes", "gemm", "--checkpointing", "on",
        "--threads", "1", "--repeats", "1", "--where", "--json",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    import json

    rows = json.loads(result.output)["rows"]
    assert [r["row"] for r in rows] == ["amp_bf16 ckpt", "dsq ckpt"]
    for row in rows:
        assert row["peak_at"]
        assert any(h["held"].startswith("before the step") for h in row["held_at_peak"])
    assert any("DSQ" in h["held"] for h in rows[1]["held_at_peak"])


def test_a_peak_at_another_place_in_the_smaller_batch_is_said(monkeypatch):
    def fake(shape, row, seq_len, batch, repeats, threads, loss_chunk=0, where=False, **_):
        return {"step_s": 1.0, "allocator_bytes": batch * MIB, "first_loss": 1.0,
                "rss_bytes": batch * MIB, "held_at_peak": [["backward: X", batch * MIB]],
                "peak_at": ["Y"] if batch == 3 else ["X", "x"]}  # fmt: skip

    monkeypatch.setattr(tm, "measure_in_fresh_process", fake)
    result = tm.run(tm.ModelShape(), [tm.Row("amp_bf16")], [512], budget=2**30, where=True)
    assert result["rows"][0]["peak_at_smaller_batch"] == ["X", "x"]
    assert "The peak of 2 sequences is elsewhere, in X > x" in tm.format_memory(result)
