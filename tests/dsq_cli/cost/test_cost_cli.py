"""`dsq cost`: exact ratios for uniform configs, both baselines for dsq, explicit points, bad
input, the JSON layout, and the derived GEMMs against what a real fairseq step records."""

from __future__ import annotations

import argparse
import collections
import json
import types

import pytest
import yaml
from typer.testing import CliRunner

from dsq.engine.config import POINTS
from dsq_cli.cli import app
from dsq_cli.cost import derive_gemms, derive_records, ratios, step_cost
from dsq_cli.presets import CONF_DIR

runner = CliRunner()
IWSLT = yaml.safe_load((CONF_DIR / "model" / "transformer_iwslt.yaml").read_text())


def cost(*args: str):
    return runner.invoke(app, ["cost", *args])


def cost_json(*args: str) -> dict:
    result = cost(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def uniform_overrides(spec: str) -> list[str]:
    return [f"quant.{p}={spec}" for p in POINTS]


def test_fixed32_against_the_default_baseline_is_one_and_one():
    result = cost("model=transformer_iwslt", "quant=fixed32")
    assert result.exit_code == 0, result.output
    assert "against fixed32: arith 1.0000 (1.00x fewer), dram 1.0000 (1.00x fewer)" in result.stdout
    total_row = next(line for line in result.stdout.splitlines() if line.startswith("total"))
    assert total_row.split()[-2:] == ["1.0000", "1.0000"]
    report = cost_json("model=transformer_iwslt", "quant=fixed32")
    assert (report["total"]["arith_ratio"], report["total"]["dram_ratio"]) == (1.0, 1.0)
    assert all(row["arith_ratio"] == row["dram_ratio"] == 1.0 for row in report["gemms"])


def test_fixed16_is_exactly_a_quarter_and_a_half():
    total = cost_json("model=transformer_iwslt", "quant=fixed16")["total"]
    assert total["arith_ratio"] == 0.25
    assert total["dram_ratio"] == 0.5
    assert (total["arith_fewer"], total["dram_fewer"]) == (4.0, 2.0)


@pytest.mark.parametrize("width", [2, 4, 8, 12, 24, 31])
def test_explicit_uniform_fixed_points_are_exact(width):
    report = cost_json("model=transformer_tiny", *uniform_overrides(f"fixed{width}"))
    assert report["quant"]["points"] == dict.fromkeys(POINTS, f"fixed{width}")
    assert report["quant"]["name"].startswith("dsq (quant.q0=")  # the preset it started from
    assert report["total"]["arith_ratio"] == (width / 32) ** 2
    assert report["total"]["dram_ratio"] == width / 32
    # against fixed16 as well: (w/16)^2 and w/16
    against = report["against"]["fixed16"]
    assert (against["arith_ratio"], against["dram_ratio"]) == ((width / 16) ** 2, width / 16)


def test_dsq_prints_its_ratios_against_fixed32_and_fixed16_and_at_the_last_level():
    result = cost("model=transformer_iwslt", "quant=dsq")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "q1: bfp2 -> bfp3 -> bfp4 -> bfp6 -> bfp8, priced at the first" in out
    assert "against fixed32: arith " in out and "against fixed16: arith " in out
    assert "at the last levels (q1 bfp8)" in out
    report = cost_json("model=transformer_iwslt", "quant=dsq")
    first = {"q0": "bfp8e8b16", "q1": "bfp2e8b16", "q2": "bfp8e8b16", "q3": "fixed16"}
    assert report["quant"]["points"] == first
    assert report["last_level"]["points"] == {**first, "q1": "bfp8e8b16"}
    # the same numbers as the library gives on the derived step
    records = derive_records(IWSLT, 4096, 32, vocab=report["batch"]["vocab"])
    for baseline, numbers in (
        ("fixed32", report["total"]),
        ("fixed16", report["against"]["fixed16"]),
    ):
        assert (numbers["arith_ratio"], numbers["dram_ratio"]) == ratios(records, first, baseline)
    last = report["last_level"]["points"]
    assert (
        report["last_level"]["fixed16"]["arith_ratio"],
        report["last_level"]["fixed16"]["dram_ratio"],
    ) == ratios(records, last, "fixed16")
    # bfp8 operands forward cost (8/32)^2 of fixed32, the bfp2 stash makes grad_w cheaper still
    rows = {(r["kind"], r["gemm"]): r for r in report["gemms"]}
    assert rows[("linear", "forward")]["arith_ratio"] == 1 / 16
    assert rows[("linear", "grad_w")]["arith_ratio"] == 16 * 2 / 1024
    assert rows[("linear", "grad_w")]["operands"] == ["fixed16 x bfp2e8b16"]


def test_last_level_of_a_schedule_with_more_than_one_point():
    report = cost_json(
        "model=transformer_small",
        "quant=fixed16",
        "quant.q1={levels: [fixed4, fixed8]}",
        "quant.q3={levels: [fixed8, fixed12, fixed16]}",
    )
    assert report["quant"]["scheduled"] == {
        "q1": ["fixed4", "fixed8"],
        "q3": ["fixed8", "fixed12", "fixed16"],
    }
    assert report["quant"]["points"] == {
        **dict.fromkeys(POINTS, "fixed16"),
        "q1": "fixed4",
        "q3": "fixed8",
    }
    assert report["last_level"]["points"] == {**dict.fromkeys(POINTS, "fixed16"), "q1": "fixed8"}


def test_a_plain_preset_has_no_last_level_and_baseline_fixed16_has_no_second_line():
    report = cost_json("model=transformer_tiny", "quant=stash_bfp", "--baseline", "fixed16")
    assert report["last_level"] is None and report["against"] == {}
    assert report["baseline"] == {"name": "fixed16", "points": dict.fromkeys(POINTS, "fixed16")}
    again = cost_json("model=transformer_tiny", "quant=stash_bfp")["against"]["fixed16"]
    assert report["total"]["arith_ratio"] == again["arith_ratio"]
    assert report["total"]["dram_ratio"] == again["dram_ratio"]
    out = cost("model=transformer_tiny", "quant=stash_bfp", "--baseline", "fixed16").stdout
    assert "against fixed16:" in out and "against fixed32" not in out and "last levels" not in out


def test_json_layout_and_rows_add_up_to_the_total():
    report = cost_json("model=transformer_iwslt", "quant=stash_bfp", "--vocab", "1000")
    assert set(report) >= {"model", "batch", "quant", "baseline", "cost_model", "total", "gemms"}
    assert set(report["total"]) >= {"arith_ratio", "dram_ratio", "macs", "dram_bits", "arith"}
    assert report["batch"] == {
        "tokens": 4096,
        "sentences": 128,
        "src_len": 32,
        "tgt_len": 32,
        "src_tokens": 4096,
        "tgt_tokens": 4096,
        "vocab": 1000,
        "vocab_from": "--vocab",
    }
    names = [(r["kind"], r["gemm"]) for r in report["gemms"]]
    assert names == [
        ("linear", "forward"),
        ("linear", "grad_x"),
        ("linear", "grad_w"),
        ("matmul", "forward"),
        ("matmul", "grad_a"),
        ("matmul", "grad_b"),
    ]
    # 6 encoder layers x 6 Linears, 6 decoder layers x 10, the output projection; 2 products
    # per attention module: 6 + 12 modules
    counts = {name: r["count"] for name, r in zip(names, report["gemms"])}
    assert counts[("linear", "forward")] == 6 * 6 + 6 * 10 + 1 == 97
    assert counts[("matmul", "forward")] == 2 * (6 + 12) == 36
    for key in ("macs", "count"):
        assert sum(r[key] for r in report["gemms"]) == report["total"][key]
    for key in ("arith", "dram_bits"):
        assert sum(r[key] for r in report["gemms"]) == pytest.approx(report["total"][key])
    # every linear GEMM: 4096 tokens through the Linears, and the output projection 512 -> 1000
    linear_macs = 4096 * (6 * (4 * 512 * 512 + 2 * 512 * 1024))
    linear_macs += 4096 * (6 * (8 * 512 * 512 + 2 * 512 * 1024) + 512 * 1000)
    assert report["gemms"][0]["macs"] == linear_macs


def test_vocab_defaults_to_the_tasks_and_options_shape_the_batch():
    report = cost_json("task=iwslt17", "quant=fp32", "--tokens", "1000", "--src-len", "30")
    assert report["model"]["name"] == "transformer_iwslt"  # the task's model
    assert report["batch"]["vocab"] == 10000
    assert "iwslt17" in report["batch"]["vocab_from"]
    assert (report["batch"]["sentences"], report["batch"]["src_tokens"]) == (33, 990)
    assert (report["total"]["arith_ratio"], report["total"]["dram_ratio"]) == (1.0, 1.0)
    longer = cost_json("task=iwslt17", "quant=fp32", "--tgt-len", "40")["batch"]
    assert (longer["tgt_len"], longer["tgt_tokens"]) == (40, 128 * 40)


def test_cost_model_option():
    additive = cost_json(
        "model=transformer_small", *uniform_overrides("fixed8"), "--cost-model", "additive"
    )
    assert additive["cost_model"] == "additive"
    assert (additive["total"]["arith_ratio"], additive["total"]["dram_ratio"]) == (0.25, 0.25)
    fp32_acts = cost_json(
        "model=transformer_small", *uniform_overrides("fixed8"), "--cost-model", "elementwise_fp32"
    )
    assert fp32_acts["total"]["arith_ratio"] == 1 / 16
    assert 0.25 < fp32_acts["total"]["dram_ratio"] < 1  # activations no longer shrink


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--baseline", "fixed99"],
            ["--baseline", "unknown quant preset 'fixed99'", "'fixed32'", "'dsq'"],
        ),
        (["--cost-model", "cheap"], ["--cost-model", "'additive'", "'default'"]),
        (["quant=dsq9"], ["unknown quant 'dsq9'", "stash_bfp"]),
        (["model=gpt"], ["unknown model 'gpt'", "transformer_iwslt"]),
        (["quant.q1=bfp1"], ["invalid format spec 'bfp1'"]),
        (["quant.q5=bfp4"], ["q5"]),
        (["--tokens", "8"], ["at least one sentence"]),
        (["--src-len", "0"], ["src_len must be a positive integer"]),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, needles):
    result = cost(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsq: error:"), result.output
    for needle in needles:
        assert needle in lines[0]


# ------------------------------------------------ derived GEMMs against a real fairseq step
def build_fairseq_model(model_cfg: dict, vocab: int):
    """A fairseq TransformerModel from conf/model keys, as dsq_cli/bench/step.py builds one."""
    import torch
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, transformer_iwslt_de_en

    torch.manual_seed(0)
    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    keys = {k: v for k, v in model_cfg.items() if k not in ("name", "arch")}
    args = argparse.Namespace(arch="transformer_iwslt_de_en", **keys)
    transformer_iwslt_de_en(args)  # fills in the keys conf/model leaves to the architecture
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    model = TransformerModel.build_model(args, task)
    assert len(dictionary) == vocab
    return model


def recorded_step(model, sentences: int, src_len: int, tgt_len: int, vocab: int):
    import torch

    from dsq.engine import record_gemms

    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (sentences, src_len), generator=g)
    prev = torch.randint(4, vocab, (sentences, tgt_len), generator=g)
    model.train()
    with record_gemms() as recorder:
        logits, _ = model(src, torch.full((sentences,), src_len), prev)
        logits.float().pow(2).mean().backward()
    return recorder.gemms


def multiset(records) -> collections.Counter:
    return collections.Counter((r.kind, r.batch, r.n, r.k, r.m, r.formats) for r in records)


SMALL_UNEQUAL = {  # encoder and decoder of different widths: cross-attention keys are 32 wide
    "encoder_layers": 2,
    "decoder_layers": 1,
    "encoder_embed_dim": 32,
    "decoder_embed_dim": 48,
    "encoder_ffn_embed_dim": 40,
    "decoder_ffn_embed_dim": 24,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 3,
    "share_all_embeddings": False,
    "dropout": 0.1,
}


# a different format at every point, and a schedule, so that the records' formats are checked
BFP_POINTS = {"q0": "bfp8", "q1": {"levels": ["bfp2", "bfp4"]}, "q2": "bfp6", "q3": "fixed16"}
# float casts: the reference BFP unpack of 6+6 layers' stashes would take half a minute
FLOAT_POINTS = {"q0": "bf16", "q1": {"levels": ["e4m3", "fp16"]}, "q2": "fp16", "q3": "e5m2"}


@pytest.mark.parametrize(
    "model_cfg, points, sentences, src_len, tgt_len, exclude",
    [
        (IWSLT, FLOAT_POINTS, 2, 6, 5, ()),
        (SMALL_UNEQUAL, BFP_POINTS, 3, 7, 4, ()),
        (
            SMALL_UNEQUAL,
            BFP_POINTS,
            3,
            5,
            5,
            ("decoder.output_projection", "decoder.layers.0.encoder_attn"),
        ),
    ],
    ids=["transformer_iwslt", "unequal-widths", "excluded"],
)
@pytest.mark.slow  # a real fairseq step per case
def test_derived_records_equal_what_a_real_step_records(
    model_cfg, points, sentences, src_len, tgt_len, exclude, monkeypatch
):
    pytest.importorskip("fairseq")
    from dsq.engine import QuantConfig
    from dsq.integrations import quantize_model

    monkeypatch.setenv("DSQ_BACKEND", "reference")  # no compilation for a handful of tiny GEMMs
    vocab = 64
    quant = QuantConfig.from_dict(points)
    model = quantize_model(build_fairseq_model(model_cfg, vocab), quant, exclude=exclude)
    recorded = recorded_step(model, sentences, src_len, tgt_len, vocab)
    # a batch of src_tokens that is not a whole number of sentences keeps the whole ones
    src_tokens = sentences * src_len + src_len - 1
    derived = derive_gemms(
        model_cfg, src_tokens, src_len, tgt_len, vocab, quant=quant, exclude=exclude
    )
    assert multiset(g.record for g in derived) == multiset(recorded)
    # the sites are quantize_model's: every patched Linear, every patched attention module
    report = model.dsq_report
    assert sorted(g.site for g in derived if g.record.kind == "linear") == sorted(report.linears)
    assert sorted({g.site for g in derived if g.record.kind == "matmul"}) == sorted(
        report.attention
    )
    # and so they price alike, at the formats in force (the schedule's first level)
    assert step_cost(recorded).as_dict() == step_cost([g.record for g in derived]).as_dict()
    first_q1 = QuantConfig.from_dict(points).format("q1").spec
    assert {dict(r.formats)["q1"] for r in recorded} == {first_q1}
