"""What users run instead of dsq, as dsq runs it: the autocast engine (the amp_bf16 preset:
the unpatched model under torch.autocast, its GEMMs noted for the cost model), activation
checkpointing, and translation's loss with the output layer in chunks; as `dsq train` takes
them."""

from __future__ import annotations

import json

import pytest
import torch

from dsq.engine import QuantConfig, accounting
from dsq.engine.accounting import record_gemms
from dsq_cli.presets import load_quant_preset

CPU = torch.device("cpu")


def test_the_autocast_engine_takes_one_static_16_bit_float():
    amp = QuantConfig.from_dict(load_quant_preset("amp_bf16"))
    assert amp.engine == "autocast" and amp.autocast_dtype == torch.bfloat16
    assert QuantConfig().autocast_dtype is None
    with pytest.raises(ValueError, match="every point must be one of"):
        QuantConfig(q0="bf16", q1="bfp2", q2="bf16", q3="bf16", engine="autocast")
    with pytest.raises(ValueError, match="the same and static"):
        QuantConfig(*["bf16"] * 3, {"levels": ["bf16", "fp32"]}, engine="autocast")
    with pytest.raises(ValueError, match="stash_scope must be gemm"):
        QuantConfig(*["bf16"] * 4, stash_scope="all", engine="autocast")
    with pytest.raises(ValueError, match="is not an engine"):
        QuantConfig(engine="amp")


def test_an_unpatched_model_is_noted_with_the_gemms_a_patched_one_runs():
    """fairseq's attention runs its fast path unpatched (the projections inside one fused call):
    the observer notes the same GEMMs, shape for shape, as the engine records when patched."""
    pytest.importorskip("fairseq")
    from dsq.integrations import observe_model, quantize_model
    from dsq_cli.bench.step import Batch, build_model

    def shapes(records):
        return sorted((g.kind, g.batch, g.n, g.k, g.m) for g in records)

    batch = Batch.random(4, 8, 500, CPU)
    amp = QuantConfig.from_dict(load_quant_preset("amp_bf16"))
    unpatched = build_model(2, 64, 500).train()
    handles = observe_model(unpatched, amp)
    with record_gemms() as observed, torch.autocast("cpu", torch.bfloat16):
        unpatched(batch.src, batch.lengths, batch.prev)
    patched = quantize_model(build_model(2, 64, 500), QuantConfig(*["bf16"] * 4))
    with record_gemms() as recorded:
        patched(batch.src, batch.lengths, batch.prev)
    assert shapes(observed.gemms) == shapes(recorded.gemms)
    assert len(observed.gemms) == 2 * (6 + 10) + 1 + 2 * 2 * 3  # linears, head, products
    for handle in handles:
        handle.remove()
    with record_gemms() as after:
        unpatched(batch.src, batch.lengths, batch.prev)
    assert after.gemms == []


def test_the_chunked_criterion_gives_fairseqs_loss_and_gradients():
    """Label-smoothed cross-entropy with padding, through fairseq's criterion and through the
    chunked one, on one model and batch: the same loss, NLL and gradients up to summation
    order."""
    pytest.importorskip("fairseq")
    from fairseq.criterions.label_smoothed_cross_entropy import (
        LabelSmoothedCrossEntropyCriterion,
    )

    from dsq_cli.bench.step import build_model
    from dsq_cli.train.criterion import ChunkedLabelSmoothedCrossEntropy

    torch.manual_seed(0)
    model = build_model(1, 64, 300).eval()  # no dropout: the two passes see one model
    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    tokens = torch.randint(4, 300, (3, 7))
    target = tokens.clone()
    target[0, 5:] = model.decoder.dictionary.pad()  # padding: left out of the loss
    sample = {
        "net_input": {"src_tokens": tokens, "src_lengths": torch.full((3,), 7),
                      "prev_output_tokens": tokens},
        "target": target,
        "ntokens": int(target.ne(model.decoder.dictionary.pad()).sum()),
    }  # fmt: skip

    def run(criterion):
        model.zero_grad()
        with torch.enable_grad():
            model.training = True  # the chunked path is the training path; dropout stays off
            loss, size, logged = criterion(model, sample)
            model.training = False
        loss.backward()
        return loss.detach(), logged["nll_loss"], [p.grad.clone() for p in model.parameters()]

    plain = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    chunked = ChunkedLabelSmoothedCrossEntropy(task, False, 0.1)
    chunked.chunk_tokens = 4  # 21 tokens: chunks of 4, the last of 1
    loss, nll, grads = run(plain)
    chunked_loss, chunked_nll, chunked_grads = run(chunked)
    assert torch.allclose(chunked_loss, loss, rtol=1e-6) and torch.allclose(chunked_nll, nll)
    scale = max(g.abs().max() for g in grads)
    assert all((a - b).abs().max() <= 1e-5 * scale for a, b in zip(chunked_grads, grads))


@pytest.mark.parametrize("point", ["q0", "q1", "q2", "q3"])
def test_checkpointing_replays_stochastic_rounding_at_each_point(point):
    """fairseq's ``train.activation_checkpointing`` (`checkpoint_layers`) under stochastic
    rounding at ``point``: each layer run again draws its first run's noise, so every gradient
    is the same bits as without checkpointing, and another seed's differ (the noise is used)."""
    from dsq.engine.checkpointing import checkpoint_layers
    from dsq.integrations import quantize_model

    def grads(checkpointed: bool, seed: int = 1) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = (torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(3))
        layers = torch.nn.Sequential(*blocks)
        cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16",
                          rounding={point: "stochastic"}, seed=seed)  # fmt: skip
        model = quantize_model(layers, cfg)
        if checkpointed:
            assert checkpoint_layers(list(model), cfg) == 3
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
        (model(x) ** 2).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    checkpointed = grads(True)
    for a, b in zip(checkpointed, grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(checkpointed, grads(False, seed=2)))


@pytest.mark.parametrize("preset", ["dsq", "amp_bf16"])
def test_checkpointing_records_each_gemm_once(preset):
    """A checkpointed layer runs its forward again in the backward pass; the step's records
    (the cost model's GEMMs, the stash bytes) are those of the uncheckpointed step."""
    pytest.importorskip("fairseq")
    from dsq.engine.checkpointing import checkpoint_layers
    from dsq.integrations import observe_model, quantize_model
    from dsq_cli.bench.step import Batch, build_model

    cfg = QuantConfig.from_dict(load_quant_preset(preset))
    batch = Batch.random(4, 8, 500, CPU)

    def step_records(checkpointed: bool):
        torch.manual_seed(0)
        model = build_model(2, 64, 500).train()
        if preset == "amp_bf16":
            observe_model(model, cfg)
        else:
            model = quantize_model(model, cfg)
        layers = [*model.encoder.layers, *model.decoder.layers]
        if checkpointed:
            assert checkpoint_layers(layers, cfg) == len(layers) == 4
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=preset == "amp_bf16")
        with record_gemms() as record, autocast:
            out = model(batch.src, batch.lengths, batch.prev)[0]
            out.float().sum().backward()
        return record.gemms

    plain, checkpointed = step_records(False), step_records(True)
    assert len(plain) == 2 * (6 + 10) + 1 + 2 * 2 * 3
    assert checkpointed == plain
    assert not accounting.recomputing()  # the recomputations are over, and nothing leaked


@pytest.mark.parametrize(
    "override, says",
    [
        ("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens must be a non-negative integer"),
        ("train.activation_checkpointing=maybe", "train.activation_checkpointing"),
    ],
)
def test_bad_memory_keys_are_one_line_errors(override, says):
    from dsq_cli.config import ConfigError, compose

    with pytest.raises(ConfigError, match=says):
        compose(["task=demo", override])
    with pytest.raises(ConfigError, match="saved tensors' noise would be drawn in its run again"):
        compose(["task=demo", "train.activation_checkpointing=true", "quant.stash_scope=all",
                 "quant.rounding.q1=stochastic"])  # fmt: skip
    # replayed, so allowed: stochastic rounding under checkpointing at the paper's scope
    compose(["task=demo", "train.activation_checkpointing=true", "quant.rounding.q1=stochastic"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["quant=amp_bf16"],
        ["quant=dsq", "train.activation_checkpointing=true", "train.loss_chunk_tokens=64"],
    ],
    ids=["amp_bf16", "dsq-checkpointed-chunked"],
)
def test_dsq_train_runs_the_baselines_to_a_result(tmp_path, overrides):
    pytest.importorskip("fairseq")
    from typer.testing import CliRunner

    from dsq_cli.cli import app

    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "task=demo",
            *overrides,
            "train.max_updates=8",
            "logger=none",
            f"run.dir={run_dir}",
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "completed"
    if overrides == ["quant=amp_bf16"]:
        assert record["quant"]["engine"] == "autocast"
        # priced as 16-bit GEMM inputs with a 16-bit stash, the bf16 preset's cost
        assert (record["cost"]["arith_ratio"], record["cost"]["dram_ratio"]) == (0.25, 0.5)
        assert "not patched" in record["patch"]["summary"]
    else:
        assert "layers checkpointed" in record["patch"]["summary"]


def test_the_autocast_engine_sees_each_updates_weights(tmp_path):
    """Autocast keeps its bf16 copies of the weights until its outermost context exits: the
    trainer enters it around each update (and validation), so every forward runs on the weights
    the last update left. One context around the whole loop would train on the first weights
    forever, the loss of a fixed batch never moving."""
    from helpers.scripted import Scripted

    class Regression(Scripted):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
            self.seen: list[tuple[bool, float]] = []

        def train_step(self, batch):
            self.optimizer.zero_grad()
            x = torch.linspace(-1, 1, 64).reshape(4, 16)
            loss = (self.model(x) - 1).pow(2).mean()
            loss.backward()
            self.optimizer.step()
            self.seen.append((torch.is_autocast_enabled("cpu"), loss.item()))
            self._updates += 1
            return loss.item(), {}

    trainer = Regression.standalone(tmp_path, [5.0] * 10, quant=load_quant_preset("amp_bf16"),
                                    max_updates=6, validate_every=3)  # fmt: skip
    trainer.run()
    assert [autocast for autocast, _ in trainer.seen] == [True] * 6
    losses = [loss for _, loss in trainer.seen]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
