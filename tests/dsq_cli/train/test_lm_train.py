"""`dsq train task=lm`: the character corpus (split, vocabulary, errors), the next-token loss with
its output layer in chunks, the engine's hooks on the trainer's model, a few updates of a tiny
Llama-style and GPT-2 model on a generated text with their run files, a resume that repeats the
uninterrupted run, and usage errors. Budgets are tiny: these check the machinery (docs/lm.md has
the real runs)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from helpers.paths import SHARED_DATA
from helpers.runs import read_jsonl
from typer.testing import CliRunner

from dsq.engine import QuantConfig
from dsq.integrations import quantize_model
from dsq_cli.cli import app
from dsq_cli.config import compose, typed
from dsq_cli.data.lm import load_lm
from dsq_cli.data.raw import DataError
from dsq_cli.train import load_resume, train
from dsq_cli.train.lm import LMTrainer, NextTokenLoss

pytest.importorskip("transformers")
from dsq_cli.models.causal_lm import build_causal_lm  # noqa: E402

RUNNER = CliRunner()
TINY = ["model.layers=1", "model.width=32", "model.heads=2", "model.seq_len=16"]


@pytest.fixture
def corpus(tmp_path):
    """A 4,000-character text of a few words: the vocabulary is its 14 characters."""
    words = ["to be", "or not", "that is", "the question"]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (800,), generator=generator).tolist()
    text = ("\n".join(words[i] for i in picks))[:4000]
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def losses(run_dir):
    """Every training and validation loss a run logged, with its kind and update."""
    return [(m["kind"], m["update"], m.get("loss", m.get("valid_loss")))
            for m in read_jsonl(run_dir / "metrics.jsonl")]  # fmt: skip


def config(corpus, root, *extra):
    return [
        "task=lm",
        f"data.raw_dir={corpus}",
        *TINY,
        "train.batch_size=4",
        "train.max_updates=6",
        "train.warmup_updates=2",
        "train.validate_every=3",
        "train.log_every=1",
        "logger=none",
        f"run.root={root}",
        *extra,
    ]


def test_the_corpus_is_split_90_10_by_character_with_a_sorted_character_vocabulary(corpus):
    text = corpus.read_text()
    data = load_lm(typed(compose(config(corpus, "runs"))))
    assert data.vocabulary == "".join(sorted(set(text)))
    cut = int(len(text) * 0.9)
    assert "".join(data.vocabulary[i] for i in data.train.tolist()) == text[:cut]
    assert "".join(data.vocabulary[i] for i in data.valid.tolist()) == text[cut:]
    assert data.manifest["sizes"] == {"train": cut, "valid": len(text) - cut}
    assert data.manifest["vocab_size"] == len(data.vocabulary)
    # a folder is read through its input.txt; data.subset keeps the first training characters
    (corpus.parent / "input.txt").write_text(text)
    folder = load_lm(typed(compose(config(corpus.parent, "runs", "data.subset=100"))))
    assert folder.source.endswith("input.txt") and len(folder.train) == 100


@pytest.mark.parametrize(
    "write, message",
    [
        (None, "no text at"),
        (b"\xff\xfe not utf-8", "not UTF-8 text"),
        (b"short", "fewer than one sequence of model.seq_len=16"),
    ],
)
def test_a_bad_corpus_is_a_data_error(tmp_path, write, message):
    path = tmp_path / "text.txt"
    if write is not None:
        path.write_bytes(write)
    with pytest.raises(DataError, match=message):
        load_lm(typed(compose(config(path, "runs"))))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_chunked_loss_is_the_mean_next_token_cross_entropy(kind):
    torch.manual_seed(0)
    lm = build_causal_lm(
        kind, vocab=12, layers=1, width=32, heads=2, kv_heads=1, seq_len=16, dropout=0.0
    )
    windows = torch.randint(0, 12, (3, 17))
    logits = lm(input_ids=windows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 12), windows[:, 1:].reshape(-1))
    grads = {}
    for chunk in (0, 7):
        lm.zero_grad()
        loss = NextTokenLoss(lm, chunk)(windows)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        grads[chunk] = [p.grad.clone() for p in lm.parameters()]
    for whole, chunked in zip(grads[0], grads[7]):
        torch.testing.assert_close(whole, chunked, rtol=1e-5, atol=1e-6)


def test_the_engine_patches_the_models_attention_and_its_stash_all_hook_holds():
    """The trainer quantizes the loss module around the model: the model's attention is routed
    through DSQ, and stash_scope=all (a hook on the module called) packs what the body saves,
    so its gradients differ from stash_scope=gemm's."""
    windows = torch.randint(0, 12, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = {}
    for scope in ("gemm", "all"):
        torch.manual_seed(0)
        lm = build_causal_lm("llama", vocab=12, layers=1, width=32, heads=2, kv_heads=1, seq_len=16)
        model = NextTokenLoss(lm, 0)
        cfg = QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", stash_scope=scope)
        quantize_model(model, cfg, strict=True)
        assert model.dsq_report.attention == ["lm.model.layers.0.self_attn"]
        model(windows).backward()
        grads[scope] = lm.model.norm.weight.grad.clone()
    assert not torch.equal(grads["gemm"], grads["all"])


def result_of(run_dir):
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.parametrize("model", ["llama_lm", "gpt2_lm"])
def test_a_tiny_run_writes_its_records_with_perplexity(corpus, tmp_path, model):
    # min_delta=100: no validation counts as an improvement, so the stash rises at the second
    result = RUNNER.invoke(
        app, ["train", *config(corpus, tmp_path, f"model={model}", "quant.q1.min_delta=100")]
    )
    assert result.exit_code == 0, result.output
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    record = result_of(run_dir)
    assert record["status"] == "completed" and record["updates"] == 6
    assert record["metric"] == "perplexity" and record["task"] == "lm"
    best = record["checkpoints"]["best"]
    assert record["value"] == pytest.approx(math.exp(best["valid_loss"]))
    assert record["best_valid_loss"] == best["valid_loss"]
    assert record["data"]["vocab_size"] == len(set(corpus.read_text()))
    assert record["data"]["tokenizer"] == "characters"
    assert record["cost"]["arith_ratio"] > 0  # priced from the GEMMs its first update recorded
    valid = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "valid"]
    assert [m["update"] for m in valid] == [3, 6]
    assert all(m["valid_perplexity"] == pytest.approx(math.exp(m["valid_loss"])) for m in valid)
    (change,) = read_jsonl(run_dir / "schedule.jsonl")
    assert change["point"] == "q1" and change["update"] == 6
    assert "perplexity" in result.output


def test_a_resumed_run_repeats_the_uninterrupted_one(corpus, tmp_path, monkeypatch):
    """SIGTERM during update 4 checkpoints and stops; the resume continues from the checkpoint
    and ends with the same records as a run never stopped."""
    straight = tmp_path / "straight"
    assert train(typed(compose(config(corpus, tmp_path, f"run.dir={straight}")))).status == (
        "completed"
    )
    step = LMTrainer.train_step

    def stopped_at_4(self, batch):
        if self.updates == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's StopRequest takes it
        return step(self, batch)

    monkeypatch.setattr(LMTrainer, "train_step", stopped_at_4)
    stopped = tmp_path / "stopped"
    outcome = train(typed(compose(config(corpus, tmp_path, f"run.dir={stopped}"))))
    assert outcome.status == "interrupted"
    monkeypatch.setattr(LMTrainer, "train_step", step)
    cfg, resumed = load_resume(str(stopped), [f"resume={stopped}"])
    assert train(cfg, resume=resumed).status == "completed"

    assert losses(straight) == losses(stopped)
    assert result_of(straight)["value"] == result_of(stopped)["value"]


def test_checkpointing_runs_the_decoder_layers_again_and_trains_as_without_it(corpus, tmp_path):
    """dsq (the default preset) with the layers run again in the backward pass: the layer run
    again quantizes as the first forward did, so every loss is the one without checkpointing,
    bit for bit (the memory it saves costs no quality)."""
    runs = {}
    for checkpointing in ("false", "true"):
        root = tmp_path / checkpointing
        args = config(corpus, root, f"train.activation_checkpointing={checkpointing}")
        result = RUNNER.invoke(app, ["train", *args])
        assert result.exit_code == 0, result.output
        (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
        said = (run_dir / "train.log").read_text()
        assert ("1 layers checkpointed" in said) == (checkpointing == "true")
        runs[checkpointing] = losses(run_dir)
    assert len(runs["true"]) > 6 and runs["true"] == runs["false"]


def test_the_mlp_in_slices_trains_as_the_whole_mlp_and_says_so_in_its_record(corpus, tmp_path):
    """quant.mlp=sliced: 64 tokens a batch are one slice, so every loss is the whole MLP's bit
    for bit; the record's quant names the setting, which sets the run apart from its preset."""
    runs, quants = {}, {}
    for mlp in ("whole", "sliced"):
        root = tmp_path / mlp
        result = RUNNER.invoke(app, ["train", *config(corpus, root, f"quant.mlp={mlp}")])
        assert result.exit_code == 0, result.output
        (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
        runs[mlp], quants[mlp] = losses(run_dir), result_of(run_dir)["quant"]
    assert len(runs["sliced"]) > 6 and runs["sliced"] == runs["whole"]
    assert (quants["sliced"]["mlp"], quants["whole"]["mlp"]) == ("sliced", "whole")
    # a row of its own (under stash_scope=all its values are not the whole MLP's)
    assert (quants["sliced"]["modified"], quants["whole"]["modified"]) == (True, False)
    same = {"mlp": "whole", "modified": False}
    assert quants["sliced"] | same == quants["whole"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["model=transformer_tiny"], "translation model (model.family) but task lm is a lm"),
        (["data.raw_dir=null"], "task=lm needs a text: set data.raw_dir=PATH"),
        (["task.metric=bleu"], "task.metric must be perplexity"),
        (
            ["model=gpt2_lm", "quant.mlp=sliced"],
            "quant.mlp=sliced runs Llama-style MLPs a slice of tokens at a time, and model=gpt2_lm "
            "has none",
        ),
        (
            ["quant.mlp=sliced", "quant.rounding.q1=stochastic"],
            "quant.mlp=sliced quantizes a slice of tokens at a time, and stochastic rounding",
        ),
    ],
)
def test_usage_errors_exit_2_and_leave_no_run(corpus, tmp_path, extra, message):
    args = config(corpus, tmp_path / "runs", *extra)
    if "model=transformer_tiny" in extra:  # a translation model has none of these keys
        args = [a for a in args if a not in TINY]
    result = RUNNER.invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(
    not (SHARED_DATA / "tinyshakespeare" / "input.txt").is_file(),
    reason=f"tinyshakespeare not found under {SHARED_DATA}",
)
def test_tinyshakespeare_reads_as_its_65_characters():
    cfg = typed(compose(["task=lm", f"data.raw_dir={SHARED_DATA / 'tinyshakespeare'}"]))
    data = load_lm(cfg)
    assert data.manifest["vocab_size"] == 65
    assert data.manifest["sizes"] == {"train": 1_003_854, "valid": 111_540}


def test_the_table_reads_a_lower_perplexity_as_better(tmp_path):
    """Perplexity is lower-is-better: a row with lower perplexity and lower cost dominates, the
    dominance holds where the paired interval lies below 0, and the heading says so."""
    from dsq_cli import table
    from dsq_cli.table.comparisons import against_heading

    runs = {"fp32": (5.0, 1.0), "dsq": (5.5, 0.05), "stash_bfp": (6.0, 0.06)}
    for preset, (perplexity, cost) in runs.items():
        for seed, noise in enumerate((0.0, 0.01, -0.01), start=1):
            record = {
                "status": "completed", "task": "lm", "model": "llama_lm", "seed": seed,
                "quant": {**QuantConfig.from_preset(preset).to_dict(), "preset": preset,
                          "modified": False},
                "metric": "perplexity",
                "value": perplexity + noise, "valid_loss": 1.7, "updates": 6, "wall_seconds": 1.0,
                "cost": {"arith_ratio": cost, "dram_ratio": cost, "baseline": "fixed32"},
                "stash_bits_mean": 4.0, "versions": {"torch": torch.__version__},
            }  # fmt: skip
            run_dir = tmp_path / f"{preset}-seed{seed}"
            run_dir.mkdir()
            (run_dir / "result.json").write_text(json.dumps(record))
    found = table.collect([tmp_path], against="fp32")
    records = {r["cost"]: r for r in table.frontier_records(found)}
    arith = records["arithmetic"]
    assert set(arith["on_frontier"]) == {"fp32", "dsq"}
    (dominated,) = arith["dominated"]
    assert dominated["row"] == "stash_bfp"
    (by,) = dominated["by"]
    assert by["row"] == "dsq" and by["holds"] and by["difference"]["mean"] == pytest.approx(-0.5)
    assert "a lower perplexity is better" in against_heading(found)


def test_stash_scope_all_leaves_the_chunked_heads_gradients_exact(monkeypatch):
    """The output layer's chunks run inside the patched model's call, under stash_scope=all's
    hooks: the gradients the chunked loss keeps for the backward pass are not packed (a 2-bit
    stash of them was 40-50% off)."""
    from dsq.engine import patch as patch_module

    torch.manual_seed(0)
    lm = build_causal_lm("llama", vocab=12, layers=1, width=32, heads=2, kv_heads=1, seq_len=16)
    model = NextTokenLoss(lm, 8)
    cfg = QuantConfig(q0="fp32", q1="bfp2", q2="fp32", q3="fp32", stash_scope="all")
    quantize_model(model, cfg)
    packed = []
    original = patch_module._PackedSave

    class Spy(original):
        __slots__ = ()

        def __init__(self, packed_tensor, requires_grad):
            packed.append(tuple(packed_tensor.unpack().shape))
            super().__init__(packed_tensor, requires_grad)

    monkeypatch.setattr(patch_module, "_PackedSave", Spy)
    model(torch.randint(0, 12, (2, 17))).backward()
    assert (12, 32) not in packed and (32, 32) not in packed  # the head's, the features' grads
