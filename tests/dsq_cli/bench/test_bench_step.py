"""``dsq bench step``'s setups: which GEMMs of the fairseq model each preset quantizes, the
baselines users run (amp_bf16 under torch.autocast, checkpointed layers), the output layer's
loss in chunks, and the rows' ratios."""

from __future__ import annotations

import pytest
import torch

from dsq.engine.accounting import record_gemms
from dsq_cli.bench.step import Batch, Setup, Variant, baseline_ratios, row_label, variants_of

CPU = torch.device("cpu")
VOCAB, WIDTH = 96, 64


@pytest.mark.parametrize("fp32_head", [False, True])
def test_the_output_projection_is_quantized_as_dsq_train_runs_it_unless_fp32_head(fp32_head):
    """The output projection (width x vocabulary) is quantized as the preset says, as `dsq
    train` runs it, unless ``fp32_head``; every layer's Linear is quantized either way."""
    pytest.importorskip("fairseq")
    setup = Setup.build("bfp8", Variant(fp32_head=fp32_head), 1, WIDTH, VOCAB, CPU)
    batch = Batch.random(sentences=2, src_len=8, vocab=VOCAB, dev=CPU)
    with record_gemms() as recorder:
        setup.step(batch)
    linear = [g for g in recorder.gemms if g.kind == "linear"]
    head = [g for g in linear if (g.k, g.m) == (WIDTH, VOCAB)]
    assert len(head) == (0 if fp32_head else 1)
    # the encoder's 6 Linears (q, k, v, out, fc1, fc2) and the decoder's 10 (two attentions)
    assert len(linear) - len(head) == 16


def test_amp_bf16_trains_the_unpatched_model_under_autocast():
    pytest.importorskip("fairseq")
    setup = Setup.build("amp_bf16", Variant(), 1, WIDTH, VOCAB, CPU)
    assert setup.autocast == torch.bfloat16
    assert not hasattr(setup.model, "dsq_report")  # not patched
    batch = Batch.random(sentences=2, src_len=8, vocab=VOCAB, dev=CPU)
    seen = []
    handle = setup.model.decoder.output_projection.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype)
    )
    with record_gemms() as recorder:
        setup.step(batch)
    handle.remove()
    assert recorder.gemms == [] and seen == [torch.bfloat16]


def _head_loss(preset: str, chunk: int, q3: str | None = None):
    """The output layer of the bench model alone (features [33, WIDTH] -> VOCAB logits, with
    its loss), as `Setup` trains it: patched by the preset, or under autocast for amp_bf16."""
    from dsq.engine import QuantConfig
    from dsq.engine.chunked_output import chunked_output_loss
    from dsq.integrations import quantize_model
    from dsq_cli.presets import at_first_level, load_quant_preset

    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(WIDTH, VOCAB))
    points = at_first_level(load_quant_preset(preset)) | ({"q3": q3} if q3 else {})
    cfg = QuantConfig.from_dict(points)
    if preset != "fp32" and cfg.engine == "dsq":
        quantize_model(head, cfg)
    features = torch.randn(33, WIDTH).requires_grad_()  # 33 tokens: chunks of 16, 16 and 1
    target = torch.randint(0, VOCAB, (33,))
    summed = lambda logits, t: torch.nn.functional.cross_entropy(logits, t, reduction="sum")  # noqa: E731
    with torch.autocast("cpu", cfg.autocast_dtype or torch.float32, cfg.autocast_dtype is not None):
        if chunk:
            (loss,) = chunked_output_loss(features, head, summed, target, list(head.parameters()),
                                          chunk)  # fmt: skip
        else:
            loss = summed(head(features), target)
    loss.backward()
    return loss.detach(), [features.grad, *(p.grad for p in head.parameters())]


@pytest.mark.parametrize(
    "preset, q3, tolerance",
    [
        ("fp32", None, 1e-6),  # float32 summation order
        # dsq's points with a BFP gradient: every block along the tokens is the same in chunks
        # of 16, so only the sums' order differs
        ("dsq", "bfp8", 1e-6),
        # dsq itself: q3 (fixed16) takes one scale per tensor, hence one per chunk, a finer
        # scale for the head's incoming gradient; q2's bfp8 roundings downstream of it can then
        # fall the other way (an ulp of bfp8 is 2^-7 of its block)
        ("dsq", None, 2e-2),
        # each chunk's bf16 GEMM output is rounded to bf16 before the chunks' float32 sum,
        # where the whole batch's is rounded once
        ("amp_bf16", None, 1e-2),
    ],
)
def test_the_chunked_output_layer_gives_the_unchunked_loss_and_gradients(preset, q3, tolerance):
    loss, grads = _head_loss(preset, 0, q3)
    chunked_loss, chunked_grads = _head_loss(preset, 16, q3)
    assert torch.allclose(chunked_loss, loss, rtol=1e-6, atol=0)
    for grad, chunked in zip(grads, chunked_grads):
        assert (chunked - grad).abs().max() <= tolerance * grad.abs().max()


def test_a_whole_model_step_with_the_loss_in_chunks_matches_the_unchunked_one():
    """fp32, through the whole bench model: the chunked loss changes only summation order."""
    pytest.importorskip("fairseq")
    batch = Batch.random(sentences=3, src_len=11, vocab=VOCAB, dev=CPU)

    def step(chunk):
        torch.manual_seed(0)
        setup = Setup.build("fp32", Variant(loss_chunk=chunk), 1, WIDTH, VOCAB, CPU)
        setup.model.eval()  # no dropout
        loss = setup.loss(batch)
        loss.backward()
        return loss.detach(), [p.grad for p in setup.model.parameters()]

    loss, grads = step(0)
    chunked_loss, chunked_grads = step(16)
    assert torch.allclose(chunked_loss, loss, rtol=1e-6, atol=0)
    scale = max(g.abs().max() for g in grads)  # the key biases' gradients are zero but rounding
    assert all((a - b).abs().max() <= 1e-5 * scale for a, b in zip(chunked_grads, grads))


@pytest.mark.parametrize("preset", ["fp32", "dsq"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(preset):
    """Every layer run again in the backward pass, with the random numbers of its first run
    (dropout): fp32 and dsq's gradients are those of the plain step."""
    pytest.importorskip("fairseq")
    batch = Batch.random(sentences=3, src_len=11, vocab=VOCAB, dev=CPU)

    def step(checkpointing):
        torch.manual_seed(0)
        setup = Setup.build(preset, Variant(checkpointing=checkpointing), 2, WIDTH, VOCAB, CPU)
        torch.manual_seed(1)
        loss = setup.loss(batch)
        loss.backward()
        return loss.detach(), [p.grad for p in setup.model.parameters()]

    loss, grads = step(False)
    loss_ckpt, grads_ckpt = step(True)
    assert torch.equal(loss, loss_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))


def test_rows_and_their_ratios_to_both_baselines():
    rows = list(variants_of("amp_bf16", ("gemm", "all"), ("auto", "fp32"), (False, True), True, 0))
    # amp_bf16 is not patched: one scope and unit, its head never quantized
    assert rows == [Variant("gemm", "auto", False, c, 0) for c in (False, True)]
    assert row_label("dsq", Variant("all", "auto", True, True, 1024)) == "dsq all fp32-head ckpt"
    measured = [
        {"preset": "fp32", "checkpointing": False, "step_ms": 100.0},
        {"preset": "amp_bf16", "checkpointing": False, "step_ms": 80.0},
        {"preset": "amp_bf16", "checkpointing": True, "step_ms": 120.0},
        {"preset": "dsq", "checkpointing": False, "step_ms": 96.0},
    ]
    baseline_ratios(measured, "step_ms")
    assert [(r["x_fp32"], r["x_amp_bf16"]) for r in measured] == [
        (1.0, 1.25), (0.8, 1.0), (1.2, 1.5), (0.96, 1.2)
    ]  # fmt: skip
    alone = [{"preset": "dsq", "checkpointing": False, "step_ms": 96.0}]
    baseline_ratios(alone, "step_ms")
    assert alone[0]["x_fp32"] is None and alone[0]["x_amp_bf16"] is None


def test_the_breakdown_sorts_operators_and_counts_gemm_work():
    from types import SimpleNamespace

    from dsq_cli.bench.breakdown import category, gemm_flops

    def event(name, shapes=(), dtypes=()):
        return SimpleNamespace(name=name, input_shapes=list(shapes), input_dtypes=list(dtypes))

    mm = event("aten::mm", [[8, 4], [4, 2]], ["c10::BFloat16", "c10::BFloat16"])
    assert category(mm, False) == ("gemm bf16", 2 * 8 * 4 * 2)
    addmm = event("aten::addmm", [[2], [8, 4], [4, 2]], ["float", "float", "float"])
    assert category(addmm, False) == ("gemm fp32", 2 * 8 * 4 * 2)
    assert gemm_flops([[3, 8, 4], [3, 4, 2]], (0, 1)) == 3 * 2 * 8 * 4 * 2
    assert category(event("dsq::gemm_bf16", [[8, 4], [4, 2]]), False)[0] == "gemm bf16"
    assert category(event("dsq::bfp_quantize_and_pack"), False)[0] == "quantizers"
    assert category(event("dsq::to_bf16"), False)[0] == "casts"
    assert category(event("aten::_scaled_dot_product_flash_attention_for_cpu"), False)[0] == (
        "attention (fused)"
    )
    for unfused in ("aten::_softmax", "aten::_softmax_backward_data", "dsq::attention_forward"):
        assert category(event(unfused), False)[0] == "attention (unfused)"
    assert category(mm, True) == ("optimizer", 0.0)  # inside Optimizer.step
    assert category(event("aten::native_layer_norm"), False)[0] == "other"


def test_a_bench_scope_sets_the_stash_scope_and_all_q1_holds_every_kind_in_q1():
    """``--scopes all-q1`` measures what stash_scope=all held before its rules: every kind of
    saved tensor in the stash; ``all`` takes quant.saved's defaults."""
    from dsq.engine import QuantConfig
    from dsq.engine.spec import SAVED_DEFAULT, SAVED_KINDS
    from dsq_cli.bench.step import SCOPES, scope_points
    from dsq_cli.presets import at_first_level, load_quant_preset

    def saved(scope):
        points = at_first_level(load_quant_preset("dsq")) | scope_points(scope)
        return dict(QuantConfig.from_dict(points).spec.saved)

    assert set(SCOPES) == {
        "gemm", "all", "all-q1", "all-held", "all-derivative3", "sliced", "all-held-sliced",
        "all-held-sdpa",
    }  # fmt: skip
    assert saved("gemm") == {}
    assert saved("all") == dict(SAVED_DEFAULT)
    assert saved("all-q1") == dict.fromkeys(SAVED_KINDS, "q1") | {"checkpoint": "keep"}
    assert saved("all-held") == dict(SAVED_DEFAULT) | {"checkpoint": "bfp8e8b16"}
    assert saved("all-derivative3") == dict(SAVED_DEFAULT) | {"activation": "derivative3"}
    # all-held-sliced with the attention rule, and nothing else
    sdpa = QuantConfig.from_dict(at_first_level(load_quant_preset("dsq")) | SCOPES["all-held-sdpa"])
    sliced = QuantConfig.from_dict(at_first_level(load_quant_preset("dsq"))
                                   | SCOPES["all-held-sliced"])  # fmt: skip
    assert sdpa.attention == "sdpa_bf16" and sliced.attention == "tiled"
    assert dict(sdpa.spec.saved) == dict(sliced.spec.saved) and sdpa.mlp == sliced.mlp == "sliced"


def test_the_bench_runs_a_ladder_preset_at_its_first_level_written_out():
    """dsq's ladder starts its stash at bfp2: the bench trains the formats written here, read off
    the patched model, not recomputed through the helper that chose them."""
    from dsq_cli.bench.step import Setup, Variant

    setup = Setup.build("dsq", Variant(), layers=1, width=32, vocab=40, dev=torch.device("cpu"))
    configs = {id(m.dsq_cfg): m.dsq_cfg for m in setup.model.modules() if hasattr(m, "dsq_cfg")}
    assert len(configs) == 1
    (cfg,) = configs.values()
    assert cfg.current() == {"q0": "bfp8e8b16", "q1": "bfp2e8b16", "q2": "bfp8e8b16",
                             "q3": "fixed16"}  # fmt: skip
