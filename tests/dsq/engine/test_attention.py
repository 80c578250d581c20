"""The tiled attention kernel against its definition, the explicit path (docs/dsq.md, "Attention in
tiles").

Tolerance: every quantized value of the two paths is the same (the tiles start on block
boundaries, and a whole-tensor scale is given the whole tensor's largest magnitude), so what may
differ is the order of float32 sums: a GEMM over a tile's rows, dK and dV summed tile by tile
and over a group's query heads. That is a few units in the last place of the largest value of a
result; ``CLOSE`` allows 1e-5 relative to the largest magnitude, and the output and dQ, whose sums
are the same GEMM rows, are seen here bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.attention import MASKS, cfg_of, inputs, mask_keywords

from dsq.engine import QuantConfig, attention
from dsq.engine.attention import (
    DSQAttentionFunction,
    dropout_index,
    dropout_noise,
    dsq_attention,
    explicit_attention,
    points_text,
)
from dsq.engine.patch import stash_all_hooks
from dsq.presets import get_preset

# a preset of each family: BFP with fixed16 gradients (a whole-tensor scale at q3), MX, NVFP4
# (a whole-tensor scale at q0 and in the stash), fixed16 everywhere, and fp32
PRESETS = ("dsq", "mx_dsq", "nvfp4_dsq", "fixed16", "fp32")


def close(actual, expected):
    scale = expected.abs().max().clamp_min(1e-30)
    assert ((actual - expected).abs().max() / scale).item() <= 1e-5


def both(preset, kind, n=75, m=75, heads=4, kv_heads=2, tile_rows=32, scaling=0.25):
    cfg = cfg_of(preset)
    q, k, v, d_out = inputs(heads=heads, kv_heads=kv_heads, n=n, m=m)
    keywords = mask_keywords(kind, q.shape[0], n, m) | {"scaling": scaling}
    want, _ = explicit_attention(q, k, v, cfg, **keywords)
    want_grads = torch.autograd.grad(want, (q, k, v), d_out)
    got = dsq_attention(q, k, v, cfg, tile_rows=tile_rows, **keywords)
    got_grads = torch.autograd.grad(got, (q, k, v), d_out)
    return (got, *got_grads), (want, *want_grads)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_tiled_kernel_is_the_explicit_path_to_summation_order(preset, kind):
    got, want = both(preset, kind)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(("n", "m", "heads", "kv_heads", "tile_rows"), [
    (37, 53, 4, 4, 16),   # cross-attention lengths, no grouping, tiles of one BFP block
    (100, 100, 6, 2, 64),  # three query heads a group
    (130, 130, 2, 1, 2048),  # one tile
])  # fmt: skip
def test_odd_lengths_groups_and_tilings(preset, n, m, heads, kv_heads, tile_rows):
    kind = "none" if n != m else "causal"
    got, want = both(preset, kind, n, m, heads, kv_heads, tile_rows)
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.parametrize("preset", ["dsq", "nvfp4_dsq"])
def test_a_scaling_that_is_not_a_power_of_two_scales_every_tile(preset):
    # a power of two (heads of 16: 1/4) is folded into the query operand, exactly; 0.3 is not
    got, want = both(preset, "causal", scaling=0.3)
    for a, b in zip(got, want):
        close(a, b)


def test_the_output_and_dq_are_the_explicit_paths_bit_for_bit_here():
    got, want = both("dsq", "causal")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("width", [48, 40])  # the fused q3-then-q2 pass, and two calls
@pytest.mark.parametrize("first", [0.0, -0.75, 3.0, float("nan")])
def test_a_part_quantized_at_the_whole_tensors_scale_is_that_tensors_quantized_part(first, width):
    """fixed16 (q3, one scale for the tensor), then bfp8 along the rows (q2): a part's values
    equal the whole tensor's quantized, bit for bit, whether the part lends its first value to
    the largest magnitude (finite) or is quantized beside it (NaN), and the part keeps its
    values."""
    from dsq.engine.functions import _points
    from dsq.engine.parts import quantize_chain_part, quantize_part

    points = _points(cfg_of("dsq"), torch.device("cpu"))
    q3, q2 = points[3], points[2]
    whole = torch.randn(6, width, generator=torch.Generator().manual_seed(0)) * 5
    whole[2, 7] = -40.0  # the largest magnitude lies outside the part
    part = whole[3:].clone()
    part[0, 0] = first
    if first == 3.0:  # a NaN elsewhere than first: every value NaN, the lent one's too
        part[1, 5] = float("nan")
    whole[3:] = part
    before = part.clone()
    amax = whole.abs().nan_to_num(0.0).amax()
    g, g2 = q3.quantize_chain(whole, -2, q2, -1)
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)
    assert same(quantize_part(q3, part, -2, amax), g[3:])
    got, got2 = quantize_chain_part(q3, q2, part, amax, None)
    assert same(got, g[3:]) and same(got2, g2[3:])
    assert same(part, before)


@pytest.mark.parametrize("q3_q2", [
    ("fixed16", "bfp8"), ("bfp8", "fixed16"), ("nvfp4", "bfp8"), ("mxfp8_e4m3", "nvfp4"),
    ("fixed16", "fixed12"),
])  # fmt: skip
@pytest.mark.parametrize("spoil", [None, float("nan"), float("inf")])
def test_the_incoming_gradient_a_tiles_rows_at_a_time_is_the_whole_tensors(q3_q2, spoil):
    """The backward pass's g_O = q3(dO) and q2(g_O) taken a tile's rows at a time equal the
    whole tensors' rows, bit for bit, for a scale spanning the tensor at either point and
    blocks along the queries, the largest magnitude in one tile only, a last tile shorter than
    the others, a transposed dO; and where dO holds a NaN or an infinity, which a whole-tensor
    scale spreads everywhere."""
    from dsq.engine.attention import _Call, _incoming_gradient
    from dsq.engine.functions import _points

    q3, q2 = q3_q2
    cfg = QuantConfig("bfp8", "bfp2", q2, q3)
    batch, heads, kv_heads, n, e = 3, 4, 2, 100, 64
    q = torch.zeros(batch, heads, n, e)
    kv = torch.zeros(batch, kv_heads, n, e)
    call = _Call(q, kv, kv, _points(cfg, q.device), cfg.gemm_unit, e**-0.5, None, True, None,
                 0.0, 0, 32)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    d_out = torch.randn(batch, n, heads, e, generator=gen).transpose(1, 2)  # as o_proj gives it
    d_out[1, 3, 70, 5] = 900.0  # the largest magnitude, in one tile
    if spoil is not None:
        d_out[2, 0, 10, 1] = spoil
    before = d_out.clone()
    f2, f3 = call.points[2], call.points[3]
    g_whole, g2_whole = f3.quantize_chain(d_out.contiguous(), -2, f2, -1)
    g2_whole = g2_whole * e**-0.5  # the folded scaling
    g_of, _ = _incoming_gradient(call, d_out, ())
    same = functools.partial(torch.allclose, rtol=0, atol=0, equal_nan=True)
    tiles = list(call.tiles)
    assert len({rows.stop - rows.start for _, rows, _ in tiles}) == 2  # a shorter last tile
    for bs, rows, _ in tiles:
        g, g2 = g_of(bs, rows)
        assert same(g, call.rows_of(g_whole, bs, rows))
        assert same(g2, call.rows_of(g2_whole, bs, rows))
    assert same(d_out, before)


def test_without_grad_it_computes_the_same_output_and_keeps_nothing():
    cfg = cfg_of("dsq")
    q, k, v, _ = inputs()
    with_grad = dsq_attention(q, k, v, cfg, causal=True, tile_rows=32)
    with torch.no_grad():
        without = dsq_attention(q, k, v, cfg, causal=True, tile_rows=32)
    assert without.grad_fn is None
    assert torch.equal(with_grad.detach(), without)


@pytest.mark.parametrize("preset", ["fp32", "dsq"])
def test_the_folded_scaling_leaves_the_inputs_and_the_stash_as_they_were(preset):
    """A power-of-two scaling is folded into the query operand in place where that operand is a
    tensor of the kernel's own; fp32's operands are the inputs and the stash themselves (a cast
    to the same dtype), which keep their values: the input after the call, the stash through a
    second backward pass."""
    cfg = cfg_of(preset)
    q, k, v, d_out = inputs()
    before = q.detach().clone()
    with torch.no_grad():
        once = dsq_attention(q, k, v, cfg, causal=True, scaling=0.25, tile_rows=32)
    out = dsq_attention(q, k, v, cfg, causal=True, scaling=0.25, tile_rows=32)
    assert torch.equal(q.detach(), before) and torch.equal(out.detach(), once)
    first = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), d_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert torch.equal(q.detach(), before)


def saved_bytes(n: int) -> int:
    """Bytes autograd holds for one call at sequence length ``n``."""
    held = []

    def pack(t):
        held.append(t.numel() * t.element_size())
        return t

    q, k, v, _ = inputs(b=1, heads=2, kv_heads=2, n=n, m=n, d=32, e=32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dsq_attention(q, k, v, cfg_of("dsq"), causal=True)
    return sum(held)


def test_what_the_backward_pass_holds_grows_linearly_with_the_sequence():
    # q and k in q0 (bfp8: 8.5 bits) and q1 (bfp2: 2.5 bits), v in q1: docs/dsq.md's count
    assert saved_bytes(512) == 2 * saved_bytes(256)
    bits_per_token = saved_bytes(256) * 8 / 256
    heads = kv_heads = 2
    d = e = 32  # (H + Hkv) d (b0 + b1) + Hkv e b1
    assert bits_per_token == (heads + kv_heads) * d * (8.5 + 2.5) + kv_heads * e * 2.5


def test_a_stash_all_hook_leaves_the_kernels_stashes_as_they_are():
    # q0 in bf16 packs to a floating tensor, which the hook would otherwise pack again in q1
    cfg = QuantConfig(q0="bf16", q1="bfp2", q2="bf16", q3="bf16", stash_scope="all")
    q, k, v, d_out = inputs()
    plain = torch.autograd.grad(dsq_attention(q, k, v, cfg, causal=True), (q, k, v), d_out)
    with stash_all_hooks(cfg):
        out = dsq_attention(q, k, v, cfg, causal=True)
    hooked = torch.autograd.grad(out, (q, k, v), d_out)
    for a, b in zip(hooked, plain):
        assert torch.equal(a, b)


def test_dropout_does_not_depend_on_the_tiling_and_is_the_definitions_with_its_mask():
    cfg = cfg_of("dsq")
    q, k, v, d_out = inputs()
    runs = []
    for tile_rows in (16, 48, 4096):
        torch.manual_seed(3)  # the kernel draws its seed from torch's generator
        out = dsq_attention(q, k, v, cfg, causal=True, dropout=0.25, tile_rows=tile_rows)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), d_out)))
    for run in runs[1:]:
        assert torch.equal(run[0], runs[0][0])
        for a, b in zip(run[1:], runs[0][1:]):
            close(a, b)
    # the definition with the same keep mask, drawn over the whole [B, H, N, M] at once
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    b, heads, n, _ = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    index = dropout_index((b, kv_heads, heads // kv_heads, n, m), heads, n, m, 0, 0, "cpu")
    noise = dropout_noise(seed, 0.25, index).view(b, heads, n, m)
    want, _ = explicit_attention(q, k, v, cfg, scaling=16**-0.5, causal=True,
                                 dropout_fn=lambda p: p * noise)  # fmt: skip
    close(runs[0][0], want)
    kept = (noise > 0).float().mean().item()
    assert abs(kept - 0.75) < 0.01


def test_stochastic_rounding_runs_tiled_with_noise_the_configs_generator_seeds():
    # the kernels' noise is seeded by draws from the config's generator: a config of the same
    # seed (a resumed run's, its noise state restored) draws the same, another seed other noise
    def run(seed):
        cfg = QuantConfig.from_dict(get_preset("dsq").to_dict()
                                    | {"rounding": {"q1": "stochastic", "q2": "stochastic"}},
                                    seed=seed)  # fmt: skip
        q, k, v, d_out = inputs()
        out = dsq_attention(q, k, v, cfg, causal=True, tile_rows=32)
        return (out, *torch.autograd.grad(out, (q, k, v), d_out))

    first, again, other = run(1), run(1), run(2)
    assert all(torch.isfinite(t).all() for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], other[1])  # dQ: through q2's noise


@pytest.mark.parametrize(("preset", "kind"), [
    ("dsq", "causal"), ("mx_dsq", "boolean"), ("nvfp4_dsq", "padding"), ("fp32", "additive"),
])  # fmt: skip
def test_the_two_passes_are_custom_ops_whose_fakes_agree(preset, kind):
    """torch.library.opcheck on dsq::attention_forward and dsq::attention_backward: schema
    (``q0`` the one input they may write), fake kernels, and a run traced by torch.compile's
    ahead-of-time dispatch with dynamic shapes against the eager one. dsq's q2 rounds
    stochastically: the passes are functions of their seeds."""
    cfg = cfg_of(preset, rounding={"q2": "stochastic"}) if preset == "dsq" else cfg_of(preset)
    q, k, v, d_out = (t.detach() for t in inputs(n=37, m=37))
    keywords = mask_keywords(kind, q.shape[0], 37, 37)
    rest = (keywords.get("mask"), keywords.get("key_padding"), points_text(cfg), cfg.gemm_unit,
            0.25, keywords.get("causal", False), 0.1, 7, 11, 16)  # fmt: skip
    torch.library.opcheck(torch.ops.dsq.attention_forward.default, (q.clone(), k, v, *rest))
    out, amax = torch.ops.dsq.attention_forward(q.clone(), k, v, *rest)
    assert out.shape == d_out.shape and amax.dtype == torch.float32
    backward = (d_out, q.clone(), k, q, k, v, amax, *rest)
    torch.library.opcheck(torch.ops.dsq.attention_backward.default, backward)


@pytest.mark.slow
def test_torch_compile_traces_quantized_attention_as_one_graph():
    """Without a gradient, `dsq_attention` (its operands' quantizers, found through the format
    backends' lookups, and the forward op) traces as one graph with eager's output bit for bit:
    neither the backend lookups nor the in-place scaling's aliasing check breaks it."""
    cfg = cfg_of("dsq")
    q, k, v, _ = (t.detach() for t in inputs())

    def attend(q, k, v):
        return dsq_attention(q, k, v, cfg, causal=True, tile_rows=32)

    eager = attend(q, k, v)  # the backends a first call imports are then looked up only
    explained = torch._dynamo.explain(attend)(q, k, v)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert "torch.ops.dsq.attention_forward" in explained.graphs[0].code
    compiled = torch.compile(attend, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(compiled(q, k, v), eager)


# -- the backward pass a group of sequences at a time ----------------------------------------------
def one_group(q, k, points, tile_rows=None):
    return [slice(0, q.shape[0])]


def grads_of(preset, kind, dropout=0.0, d_out_change=None, **changes):
    cfg = cfg_of(preset, **changes)
    q, k, v, d_out = inputs(b=3)
    if d_out_change is not None:
        d_out_change(d_out)
    keywords = mask_keywords(kind, 3, 75, 75) | {"scaling": 0.25}
    torch.manual_seed(0)  # the dropout seed
    out = dsq_attention(q, k, v, cfg, tile_rows=32, dropout=dropout, **keywords)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


@pytest.fixture
def a_sequence_a_tile(monkeypatch):
    """Tiles of one sequence each for `grads_of`'s inputs (4 heads, 32 rows, 75 keys), so the
    backward pass runs one sequence at a time, as it does from about a thousand tokens a
    sequence."""
    monkeypatch.setattr(attention, "TILE_ELEMENTS", 4 * 32 * 75)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize(("preset", "dropout"), [
    ("dsq", 0.0), ("dsq", 0.2), ("mx_dsq", 0.0), ("fp32", 0.2), ("bf16", 0.0),
])  # fmt: skip
def test_a_backward_pass_a_sequence_at_a_time_is_the_whole_batchs_bit_for_bit(
    preset, dropout, kind, a_sequence_a_tile, monkeypatch
):
    """Each group's stashes are the whole batch's values; dsq's q3 (fixed16) is given the whole
    batch's largest magnitudes of dO and dZ; dropout counts from the group's first sequence."""
    q, k, *_ = inputs(b=3)
    assert len(attention.stash_groups(q, k, attention._points(cfg_of(preset), q.device))) == 3
    grouped = grads_of(preset, kind, dropout)
    monkeypatch.setattr(attention, "stash_groups", one_group)
    whole = grads_of(preset, kind, dropout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), grouped, whole):
        assert torch.equal(a, b), name


def test_a_nan_in_the_incoming_gradient_runs_the_whole_batch(a_sequence_a_tile, monkeypatch):
    """A scale that spans the tensor spreads a NaN to every value: the groups are joined and run
    as one, as the whole batch would."""

    def poison(d_out):
        d_out[2, 1, 5, 3] = torch.nan

    grouped = grads_of("dsq", "causal", d_out_change=poison)
    assert grouped[1].isnan().any()
    monkeypatch.setattr(attention, "stash_groups", one_group)
    whole = grads_of("dsq", "causal", d_out_change=poison)
    for a, b in zip(grouped, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("preset", "changes", "why"), [
    ("nvfp4_dsq", {}, "q0 and q1 scale the whole tensor"),
    ("fixed16", {}, "every point scales the whole tensor"),
    ("dsq", {"q2": "fixed16"}, "q2 scales the whole tensor"),
    ("dsq", {"rounding": {"q1": "stochastic"}}, "noise drawn for the whole tensor"),
])  # fmt: skip
def test_the_batch_is_one_group_where_a_group_could_differ(preset, changes, why,
                                                           a_sequence_a_tile):  # fmt: skip
    q, k, *_ = inputs(b=3)
    cfg = cfg_of(preset, **changes)
    assert attention.stash_groups(q, k, attention._points(cfg, q.device)) == [slice(0, 3)], why


def test_groups_follow_the_tiles_sequences():
    """A sequence a group from 368 tokens at 8 heads (heads x N x M past 2^20), the whole batch
    where many fit a tile; tile_rows 0 lets the kernels choose, as None does."""
    points = attention._points(cfg_of("dsq"), "cpu")
    for n, tile_rows in ((1024, None), (368, None), (1024, 0)):
        q, k = torch.empty(3, 8, n, 64), torch.empty(3, 4, n, 64)
        groups = attention.stash_groups(q, k, points, tile_rows)
        assert groups == [slice(i, i + 1) for i in range(3)], (n, tile_rows)
    q, k = torch.empty(3, 8, 352, 64), torch.empty(3, 4, 352, 64)
    assert attention.stash_groups(q, k, points) == [slice(0, 2), slice(2, 3)]
    short_q, short_k = torch.empty(40, 8, 32, 64), torch.empty(40, 4, 32, 64)
    assert attention.stash_groups(short_q, short_k, points) == [slice(0, 40)]


@pytest.mark.parametrize("preset", ["dsq", "mx_dsq", "nvfp4_dsq"])
def test_an_empty_batch_has_empty_gradients(preset):
    q, k, v, d_out = inputs(b=0)
    out = dsq_attention(q, k, v, cfg_of(preset), causal=True)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert out.shape == d_out.shape
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("preset", ["fp32", "dsq"])
def test_a_second_backward_pass_by_groups_gives_the_same_gradients(preset, a_sequence_a_tile):
    """The groups' stashes keep their values through the in-place scaling of ``q0``."""
    cfg = cfg_of(preset)
    q, k, v, d_out = inputs(b=3)
    before = q.detach().clone()
    out = dsq_attention(q, k, v, cfg, causal=True, scaling=0.25, tile_rows=32)
    first = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), d_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert torch.equal(q.detach(), before)


@pytest.mark.slow
def test_under_torch_compile_the_batch_is_one_group_and_the_graph_unbroken(a_sequence_a_tile):
    """The backward pass's test of dO for a NaN would break the graph, so a compiled step runs
    the batch as one group: one graph (fullgraph), eager's gradients bit for bit."""
    cfg = cfg_of("dsq")

    def step(q, k, v, d_out):
        return (dsq_attention(q, k, v, cfg, causal=True, tile_rows=32) * d_out).sum()

    grads = []
    for run in (step, torch.compile(step, fullgraph=True, dynamic=False, backend="eager")):
        q, k, v, d_out = inputs(b=3)
        run(q, k, v, d_out).backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_score_gradient_magnitude_is_a_custom_op_whose_fake_agrees():
    cfg = cfg_of("dsq")
    q, k, v, d_out = (t.detach() for t in inputs(n=37, m=37))
    rest = (None, None, points_text(cfg), cfg.gemm_unit, 0.25, True, 0.1, 7, 16, 1)
    args = (d_out, q.clone(), k, v, d_out.abs().amax(), *rest)
    torch.library.opcheck(torch.ops.dsq.attention_score_gradient_magnitude.default, args)


def test_the_kernel_is_a_quant_setting_that_says_what_it_accepts():
    assert cfg_of("dsq").attention == "tiled"
    assert "attention" not in cfg_of("dsq").to_dict()  # a record keeps the preset's keys
    assert cfg_of("dsq", attention="explicit").to_dict()["attention"] == "explicit"
    with pytest.raises(ValueError, match="quant.attention='flash'.*tiled"):
        cfg_of("dsq", attention="flash")


def test_heads_must_group():
    q, k, v, _ = inputs(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="4 query heads cannot share 3"):
        dsq_attention(q, k, v, cfg_of("dsq"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dsq", "nvfp4_dsq"])
def test_fairseqs_attention_runs_tiled_and_trains_the_same_model(preset, monkeypatch):
    pytest.importorskip("fairseq")
    import copy

    from dsq.integrations import quantize_model
    from dsq_cli.bench.step import build_model

    calls = []
    original = DSQAttentionFunction.apply
    monkeypatch.setattr(DSQAttentionFunction, "apply",
                        lambda *a: calls.append(1) or original(*a))  # fmt: skip
    torch.manual_seed(0)
    base = build_model(2, 64, 100).train()
    src, prev = torch.randint(4, 100, (3, 11)), torch.randint(4, 100, (3, 9))
    src[0, -3:] = prev[1, -2:] = 1  # padding (fairseq's pad index)
    results = []
    for kernel in ("explicit", "tiled"):
        model = quantize_model(copy.deepcopy(base), cfg_of(preset, attention=kernel))
        torch.manual_seed(1)  # the same dropout draws outside attention
        out, _ = model(src, torch.full((3,), 11), prev)
        out.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    # the tiled run: every attention module but the last decoder layer's cross-attention, whose
    # weights fairseq asks for (its alignment layer) and which runs explicitly
    assert len(calls) == 2 + 2 + 1
    (out_e, grads_e), (out_t, grads_t) = results
    close(out_t, out_e)
    for name, grad in grads_e.items():
        close(grads_t[name], grad)


def test_bfloat16_inputs_run_as_the_explicit_path_does():
    # the softmax in float32, then in the inputs' dtype: the same output; the gradients round
    # in bf16 along their own summation order
    cfg = cfg_of("dsq")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).bfloat16().requires_grad_() for _ in "qkv")
    got = dsq_attention(q, k, v, cfg, causal=True, scaling=0.25)
    want, _ = explicit_attention(q, k, v, cfg, causal=True, scaling=0.25)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    assert all(grad.dtype == torch.bfloat16 and torch.isfinite(grad).all() for grad in grads)


def test_bfloat16_inputs_with_dropout_run_as_the_explicit_path_with_its_mask():
    # the float32 keep mask times bf16 probabilities, rounded once to bf16: the explicit path's
    # output with the same mask; the gradients near its in bf16
    cfg = cfg_of("dsq")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).bfloat16().requires_grad_() for _ in "qkv")
    torch.manual_seed(3)  # the kernel draws its seed from torch's generator
    got = dsq_attention(q, k, v, cfg, causal=True, scaling=0.25, dropout=0.25)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    index = dropout_index((1, 2, 1, 40, 40), 2, 40, 40, 0, 0, "cpu")
    noise = dropout_noise(seed, 0.25, index).view(1, 2, 40, 40)
    want, _ = explicit_attention(q, k, v, cfg, causal=True, scaling=0.25,
                                 dropout_fn=lambda p: (p * noise).to(p.dtype))  # fmt: skip
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    wants = torch.autograd.grad(want.float().sum(), (q, k, v))
    for grad, wanted in zip(grads, wants):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), wanted.float(), rtol=0.02, atol=0.02)
