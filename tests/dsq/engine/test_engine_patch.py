"""quantize_model on real models: what it patches (counted from the GEMMs that really run), the
memory it saves (measured by the allocator, through the profiler), and that fairseq's
transformer still trains on real text."""

from __future__ import annotations

import argparse
import gzip
import re
import types

import pytest
import torch
from helpers.paths import SHARED_DATA
from torch import nn

from dsq.engine import QuantConfig, record_gemms
from dsq.integrations import quantize_model

fairseq = pytest.importorskip("fairseq")


def iwslt_transformer(vocab: int = 200, seed: int = 0):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, transformer_iwslt_de_en

    torch.manual_seed(seed)
    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    args = argparse.Namespace(arch="transformer_iwslt_de_en", dropout=0.0)
    transformer_iwslt_de_en(args)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return TransformerModel.build_model(args, task), dictionary


def held_after_forward(fn) -> tuple[int, object]:
    """Bytes allocated and still alive after ``fn()``, from the CPU allocator's own records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    return held, out


@pytest.mark.slow  # a real transformer_iwslt step
def test_transformer_iwslt_every_linear_and_both_attention_products_run_quantized():
    model, _ = iwslt_transformer()
    quantize_model(model, QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16"))
    report = model.dsq_report
    # 6 encoder layers x (q, k, v, out, fc1, fc2) + 6 decoder layers x (2 attentions x 4 + fc1,
    # fc2) + the output projection
    assert len(report.linears) == 6 * 6 + 6 * 10 + 1 == 97
    assert len(report.attention) == 18 and report.attention_products == 36
    assert report.left == {"Embedding": 2, "LayerNorm": 30}
    src = torch.randint(4, 200, (4, 9))
    with record_gemms() as record:
        out, _ = model(src, torch.full((4,), 9), torch.randint(4, 200, (4, 7)))
    # the GEMMs that really executed: fairseq's fused attention fast path would skip them
    assert record.count("linear") == 97 and record.count("matmul") == 36
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unpatch_gives_back_the_fairseq_transformer_as_it_was():
    """Classes (DSQLinear, the attention mixin, the dropout masks), the attention hooks, the
    slow-path switch and ReLU are put back: the outputs are the original model's, bit for bit."""
    import copy

    from dsq.integrations import unpatch

    model, _ = iwslt_transformer()
    original = copy.deepcopy(model)
    src, lengths, prev = (
        torch.randint(4, 200, (2, 7)),
        torch.full((2,), 7),
        torch.randint(4, 200, (2, 5)),
    )
    quantize_model(model, QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16"))
    unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    assert not [k for m in model.modules() for k in vars(m) if k.startswith("dsq_")]
    assert [m._forward_hooks for m in model.modules()] == [
        m._forward_hooks for m in original.modules()
    ]
    model.eval(), original.eval()
    torch.testing.assert_close(model(src, lengths, prev)[0], original(src, lengths, prev)[0],
                               rtol=0, atol=0)  # fmt: skip


def test_exclude_patterns_and_nothing_to_patch():
    model, _ = iwslt_transformer()
    quantize_model(model, QuantConfig(), exclude=["decoder.output_projection", "*.fc2"])
    assert "decoder.output_projection" in model.dsq_report.excluded
    assert len(model.dsq_report.excluded) == 13 and len(model.dsq_report.linears) == 84
    with pytest.raises(ValueError, match="nothing to patch"):
        quantize_model(nn.Sequential(nn.LayerNorm(4), nn.ReLU()), QuantConfig())
    with pytest.raises(ValueError, match="nothing to patch"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), QuantConfig(), exclude=["*"])


class _Stack(nn.Module):
    """Linear layers; the input is copied first, so every activation is allocated inside."""

    def __init__(self, width=512, depth=6):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x * 1.0)


@pytest.mark.slow  # compiles the quantizers
def test_bfp4_stash_holds_at_most_a_sixth_of_fp32_activation_memory():
    x = torch.randn(2048, 512)
    held = {}
    for name, cfg in (("fp32", None), ("dsq", QuantConfig(q1="bfp4"))):
        torch.manual_seed(0)
        model = _Stack()
        if cfg is not None:
            quantize_model(model, cfg)
        model(x).sum().backward()  # warm up (compiles the quantizers)
        bytes_held, y = held_after_forward(lambda m=model: m(x))
        held[name] = bytes_held - y.numel() * y.element_size()  # the output is the caller's
    assert held["fp32"] >= 6 * 2048 * 512 * 4  # six fp32 activations kept for backward
    assert held["dsq"] * 6 <= held["fp32"], held


@pytest.mark.slow
def test_stash_scope_all_cuts_held_activations_on_the_transformer():
    """Every saved tensor in q1 (bfp4 here) holds at most a quarter of fp32's activations; by
    the default rules (norms and the rest in bfp8) at most a third."""
    src = torch.randint(4, 200, (16, 20))
    tgt = torch.randint(4, 200, (16, 18))
    lengths = torch.full((16,), 20)
    held = {}
    points = {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16", "stash_scope": "all"}
    every_kind_q1 = {"norm": "q1", "activation": "q1", "elementwise": "q1", "constant": "q1"}
    for name, cfg in (
        ("fp32", None),
        ("all-q1", QuantConfig(**points, saved=every_kind_q1)),
        ("all", QuantConfig(**points)),
    ):
        model, _ = iwslt_transformer(seed=1)
        model.train()
        if cfg is not None:
            quantize_model(model, cfg)
        model(src, lengths, tgt)[0].sum().backward()  # warm up
        bytes_held, out = held_after_forward(lambda m=model: m(src, lengths, tgt)[0])
        held[name] = bytes_held - out.numel() * out.element_size()
    assert held["all-q1"] * 4 <= held["fp32"], held
    assert held["all"] * 3 <= held["fp32"], held


def _multi30k_pairs(count: int):
    data = SHARED_DATA / "multi30k"
    if not (data / "train.de.gz").exists():
        pytest.skip(f"real data not found at {data} (see ../shared/data/README.md)")
    with gzip.open(data / "train.de.gz", "rt") as de, gzip.open(data / "train.en.gz", "rt") as en:
        pairs = [(s.split()[:14], t.split()[:14]) for s, t, _ in zip(de, en, range(count))]
    return pairs


@pytest.mark.slow
def test_dsq_transformer_trains_on_multi30k():
    from fairseq.data import Dictionary

    pairs = _multi30k_pairs(64)
    dictionary = Dictionary()
    for src, tgt in pairs:
        for word in src + tgt:
            dictionary.add_symbol(word.lower())
    model, _ = iwslt_transformer(vocab=len(dictionary))
    model.encoder.dictionary = model.decoder.dictionary = dictionary
    cfg = QuantConfig(q0="bfp8", q1={"levels": ["bfp2", "bfp3", "bfp4"]}, q2="bfp8", q3="fixed16")
    quantize_model(model, cfg, exclude=["decoder.output_projection"])

    def encode(words):
        ids = [dictionary.index(w.lower()) for w in words] + [dictionary.eos()]
        return torch.tensor(ids)

    def collate(batch):
        pad = dictionary.pad()
        src = nn.utils.rnn.pad_sequence([encode(s) for s, _ in batch], True, pad)
        tgt = nn.utils.rnn.pad_sequence([encode(t) for _, t in batch], True, pad)
        prev = torch.cat([torch.full((len(batch), 1), dictionary.eos()), tgt[:, :-1]], 1)
        return src, (src != pad).sum(1), prev, tgt

    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    batches = [collate(pairs[i : i + 16]) for i in range(0, 64, 16)]
    losses = []
    for step in range(32):
        src, lengths, prev, tgt = batches[step % len(batches)]
        logits, _ = model(src, lengths, prev)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=dictionary.pad()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 8 == 7:
            cfg.step(sum(losses[-4:]) / 4, update=step)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first, losses


@pytest.mark.parametrize(("call", "says"), [
    (lambda m: quantize_model(quantize_model(m, QuantConfig()), QuantConfig()),
     "Sequential is quantized already"),
    (lambda m: quantize_model(m, QuantConfig.from_preset("amp_bf16")),
     "engine='autocast' trains the model unpatched under torch.autocast"),
    (lambda m: quantize_model(m, QuantConfig(), exclude=["0", "decoder.*"]),
     "exclude pattern 'decoder.*' matches no module of Sequential"),
])  # fmt: skip
def test_a_setting_that_would_not_apply_is_refused(call, says):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=re.escape(says)):
        call(model)
