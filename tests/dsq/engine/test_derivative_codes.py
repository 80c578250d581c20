"""Few-bit codes of an activation's derivative (``quant.saved.activation=derivative<k>``;
docs/dsq.md, "Derivative codes"): the packing, each code's stated error bound against the float
derivative (and that it is tight), the coded activation against the exact one (outputs bit for
bit, the gradient the level nearest the derivative by an independent oracle, within the bound),
what the backward pass holds, the rule in the spec and its refusals, the modules a patched model
codes and names, and a checkpointed model equal to one without checkpointing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsq.engine import QuantConfig
from dsq.engine.derivative_codes import (
    BITS,
    FUNCTIONS,
    coded_activation,
    derivative_code,
    pack_codes,
    unpack_codes,
)
from dsq.engine.spec import QuantSpec
from dsq.formats import exact
from dsq.integrations import quantize_model, unpatch

EXACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def exact_derivative(function: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) by autograd through the exact function, in float64 (independent of the kernels the
    codes call)."""
    x = x.double().detach().requires_grad_()
    (grad,) = torch.autograd.grad(EXACT[function](x).sum(), x)
    return grad


def config(activation: str = "derivative3", **saved) -> QuantConfig:
    return QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", stash_scope="all",
                       saved={"activation": activation, **saved})  # fmt: skip


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_codes_pack_into_bits_bytes_per_eight_and_back(bits, numel):
    gen = torch.Generator().manual_seed(numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=gen)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-numel // 8) * bits
    # the stream of the formats' exact packing (code i at stream bits [i * bits, (i+1) * bits)),
    # padded with zeros to a whole group of eight codes
    stream = exact.pack_bits(codes, bits)
    assert torch.equal(packed.reshape(-1)[: stream.numel()], stream)
    assert not packed.reshape(-1)[stream.numel() :].any()
    assert torch.equal(unpack_codes(packed, bits, codes.shape).long(), codes)
    # bits of one code never spill into another's: the largest code next to zeros
    lone = torch.zeros(16, dtype=torch.int64)
    lone[3] = 2**bits - 1
    assert torch.equal(unpack_codes(pack_codes(lone, bits), bits, lone.shape).long(), lone)


# fitting a code takes about a second or more (4 bits, GELU's forms): those cases are slow
CODES = [
    (function, bits) if function == "silu" and bits < 4
    else pytest.param(function, bits, marks=pytest.mark.slow)
    for function in sorted(FUNCTIONS) for bits in BITS
]  # fmt: skip


@pytest.mark.parametrize("function, bits", CODES)
def test_every_coded_derivative_is_within_the_stated_bound_and_the_bound_is_reached(function, bits):
    code = derivative_code(function, bits)
    levels = torch.tensor(code.levels, dtype=torch.float64)
    assert len(levels) == 2**bits and bool((levels[1:] > levels[:-1]).all())
    x = torch.linspace(-30, 30, 600_001)
    error = exact_derivative(function, x) - code.decode(code.encode(x), x.shape, torch.float64)
    worst = float(error.abs().max())
    assert worst <= code.error_bound + 1e-6
    assert worst >= 0.99 * code.error_bound  # the bound is the largest error, not a loose one
    # more bits, a smaller bound
    if bits > 1:
        assert code.error_bound < derivative_code(function, bits - 1).error_bound


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_the_coded_activation_is_exact_forward_and_the_nearest_level_backward(function):
    code = derivative_code(function, 3)
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 48, generator=gen)).requires_grad_()
    dy = torch.randn(64, 48, generator=gen)
    y = coded_activation(x, code)
    assert torch.equal(y, EXACT[function](x.detach()))
    y.backward(dy)
    # the oracle: the level nearest the float64 derivative, by a search over all levels
    derivative = exact_derivative(function, x)
    levels = torch.tensor(code.levels, dtype=torch.float64)
    nearest = levels[(derivative.unsqueeze(-1) - levels).abs().argmin(-1)]
    ties = (derivative.unsqueeze(-1) - torch.tensor(code.bounds, dtype=torch.float64)).abs()
    clear = ties.min(-1).values > 1e-6  # values within rounding of a bound may take either level
    expected = (dy.double() * nearest).float()
    torch.testing.assert_close(x.grad[clear], expected[clear], rtol=0, atol=0)
    assert bool(clear.float().mean() > 0.99)
    exact = dy.double() * derivative
    assert bool(((x.grad.double() - exact).abs() <= dy.abs() * code.error_bound + 1e-6).all())


@pytest.mark.parametrize("bits", BITS)
def test_the_nearest_level_is_bucketizes_answer_bounds_nan_and_infinities_included(bits):
    code = derivative_code("silu", bits)
    bounds = torch.tensor(code.bounds)
    edges = [float("nan"), float("inf"), -float("inf"), *code.bounds]
    edges += [torch.nextafter(b, torch.tensor(v)).item() for b in bounds for v in (-2.0, 2.0)]
    values = torch.cat([torch.tensor(edges), torch.randn(10_000) * 0.6 + 0.5])
    expected = torch.bucketize(values, bounds)
    assert torch.equal(code.nearest_levels(values).long(), expected)


def test_the_backward_pass_holds_the_packed_codes_only():
    held = []

    def pack(t):
        held.append((t.dtype, t.numel()))
        return t

    x = torch.randn(4, 1000, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        coded_activation(x, derivative_code("silu", 3)).sum().backward()
    assert held == [(torch.uint8, 4000 // 8 * 3)]


def test_no_gradient_no_code():
    x = torch.randn(8, 16)
    assert torch.equal(coded_activation(x, derivative_code("gelu", 2)), F.gelu(x))


def test_a_function_of_its_own_keeps_its_outputs_and_takes_the_code():
    """transformers' NewGELUActivation writes GELU's tanh form out: its own outputs, bit for bit,
    and the gradient coded as GELU's tanh form's derivative."""
    from transformers.activations import NewGELUActivation

    module = NewGELUActivation()
    code = derivative_code("gelu_tanh", 3)
    x = torch.randn(32, 64, requires_grad=True)
    y = coded_activation(x, code, module.forward)
    assert torch.equal(y, module(x.detach()))
    y.sum().backward()
    assert torch.equal(x.grad, code.decode(code.encode(x), x.shape, torch.float32))


def test_the_rule_is_in_the_spec_and_refused_where_it_cannot_hold():
    spec = config().spec
    assert spec.saved["activation"] == "derivative3" and config().derivative_code_bits == 3
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert config("bfp8").derivative_code_bits is None
    # an activation module without a code holds the activation default
    assert config().saved_format("activation").spec == "bfp8e8b16"
    with pytest.raises(ValueError, match="activation modules only; set quant.saved.activation"):
        config("bfp8", norm="derivative3")
    with pytest.raises(ValueError, match="derivative1, derivative2, derivative3, derivative4"):
        config("derivative5")
    with pytest.raises(ValueError, match="set quant.stash_scope=all"):
        QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16",
                    saved={"activation": "derivative3"})  # fmt: skip


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.silu, self.gelu = nn.SiLU(), nn.GELU(approximate="tanh")
        self.inplace, self.tanh, self.relu = nn.SiLU(inplace=True), nn.Tanh(), nn.ReLU()

    def forward(self, x):
        h = self.tanh(self.inplace(self.gelu(self.silu(self.fc1(x))) + 0))
        return self.fc2(self.relu(h))


def test_bf16_inputs_and_gradients_stay_within_the_bound_and_the_products_rounding():
    code = derivative_code("silu", 3)
    x = (3 * torch.randn(64, 64)).bfloat16().requires_grad_()
    dy = torch.randn(64, 64).bfloat16()
    y = coded_activation(x, code)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.silu(x.detach()))
    y.backward(dy)
    assert x.grad.dtype == torch.bfloat16
    exact = dy.double() * exact_derivative("silu", x)
    slack = dy.double().abs() * code.error_bound + exact.abs() * 2**-8 + 1e-6
    assert bool(((x.grad.double() - exact).abs() <= slack).all())


def test_a_patched_model_copies_saves_and_loads_with_its_codes(tmp_path):
    import copy

    torch.manual_seed(0)
    model = quantize_model(Net(), config())
    x = torch.randn(4, 32)

    def gradients(m):
        m.zero_grad()
        m(x).sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    expected = gradients(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for other in (copy.deepcopy(model), loaded):
        assert other.silu.dsq_derivative_code == model.silu.dsq_derivative_code
        for a, b in zip(gradients(other), expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_patched_model_codes_its_silu_and_gelu_and_names_the_rest():
    torch.manual_seed(0)
    model = quantize_model(Net(), config(), exclude=["gelu"])
    note = next(n for n in model.dsq_report.notes if "derivative codes" in n)
    assert note == (
        "activations holding 3-bit derivative codes: silu x1; activation modules holding "
        "bfp8e8b16 instead: gelu (GELU: excluded); inplace (SiLU: no code for its function); "
        "tanh (Tanh: no code for its function)"
    )
    assert model.silu.dsq_derivative_code == derivative_code("silu", 3)
    unpatch(model)
    assert type(model.silu) is nn.SiLU and "dsq_derivative_code" not in model.silu.__dict__


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, counted", [("llama", "silu x2"), ("gpt2", "gelu_tanh x2"), ("bert", "gelu x3")]
)
def test_transformers_activations_are_coded_and_their_codes_are_what_the_step_holds(
    monkeypatch, kind, counted
):
    """Each model's SiLU or GELU modules (BERT: two layers' and the masked-LM head's) hold the
    codes: the report counts them, each codes its input once in the step, and the gradients
    are not those of the same activations held in bfp8."""
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", module="transformers")
    from dsq.engine.derivative_codes import DerivativeCode
    from dsq_cli.models.causal_lm import build_causal_lm

    def step(activation: str):
        torch.manual_seed(0)
        if kind == "bert":
            bert = transformers.BertConfig(
                vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128,
            )  # fmt: skip
            model = transformers.BertForMaskedLM._from_config(bert)
        else:
            model = build_causal_lm(kind, vocab=100, layers=2, width=64, heads=4, kv_heads=2,
                                    seq_len=32)  # fmt: skip
        quantize_model(model, config(activation))
        ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return model, torch.cat([p.grad.flatten() for p in model.parameters()])

    encoded = []
    encode = DerivativeCode.encode
    monkeypatch.setattr(DerivativeCode, "encode", lambda c, x: encoded.append(c) or encode(c, x))
    model, coded = step("derivative3")
    note = next(n for n in model.dsq_report.notes if "derivative codes" in n)
    assert f"{counted}; activation modules holding bfp8e8b16 instead: none" in note
    assert len(encoded) == int(counted.rsplit("x", 1)[1])
    _, held_in_bfp8 = step("bfp8")
    assert not torch.equal(coded, held_in_bfp8)


@pytest.mark.slow
def test_with_checkpointing_the_gradients_are_those_without():
    transformers = pytest.importorskip("transformers")
    warnings.filterwarnings("ignore", module="transformers")

    def gradients(checkpointing: bool, activation: str = "derivative3") -> list[torch.Tensor]:
        torch.manual_seed(0)
        llama = transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, attn_implementation="sdpa",
        )  # fmt: skip
        model = quantize_model(transformers.LlamaForCausalLM(llama), config(activation))
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    without = gradients(False)
    for a, b in zip(gradients(True), without, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the codes were used: the same activations held in bfp8 give other gradients
    assert any(not torch.equal(a, b) for a, b in zip(gradients(False, "bfp8"), without))


@pytest.mark.slow
def test_fairseq_layers_gelu_is_coded_and_other_activations_named():
    """fairseq's layers call their activation as a function (``activation_fn``): its gelu holds
    the codes, a ReLU its bit mask as always, and any other function is named in the report;
    the outputs are those of fairseq's own gelu."""
    pytest.importorskip("fairseq")
    from fairseq.modules.gelu import gelu
    from fairseq.utils import get_activation_fn

    from dsq.integrations.fairseq import CodedFairseqGelu
    from dsq_cli.bench.step import Batch, build_model

    def run(activation: str):
        torch.manual_seed(0)
        model = build_model(2, 64, 100)
        layers = [m for m in model.modules() if hasattr(m, "activation_fn")]
        layers[0].activation_fn = layers[1].activation_fn = gelu
        layers[2].activation_fn = get_activation_fn("tanh")
        quantize_model(model, config(activation))
        model.train()
        batch = Batch.random(4, 16, 100, torch.device("cpu"))
        logits, _ = model(batch.src, batch.lengths, batch.prev)
        logits.sum().backward()
        return model, logits, layers

    def gradient(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    model, logits, layers = run("derivative3")
    note = next(n for n in model.dsq_report.notes if "fairseq layers" in n)
    assert note == (
        "fairseq layers whose gelu holds 3-bit derivative codes: 2; layers whose activation_fn "
        "is held as elementwise (bfp8e8b16): decoder.layers.0"
    )
    assert all(isinstance(layer.activation_fn, CodedFairseqGelu) for layer in layers[:2])
    held_in_bfp8, reference, _ = run("bfp8")
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    assert not torch.equal(gradient(model), gradient(held_in_bfp8))
    unpatch(model)
    assert layers[0].activation_fn is gelu


def test_coding_a_slice_at_a_time_gives_the_codes_and_gradients_of_the_whole(monkeypatch):
    from dsq.engine import derivative_codes

    code = derivative_code("silu", 3)
    x = torch.randn(7, 301, requires_grad=True)
    dy = torch.randn(7, 301)
    whole = code.encode(x), coded_activation(x, code)
    whole[1].backward(dy)
    expected = x.grad.clone()
    x.grad = None
    monkeypatch.setattr(derivative_codes, "SLICE", 64)
    assert torch.equal(code.encode(x), whole[0])
    coded_activation(x, code).backward(dy)
    assert torch.equal(x.grad, expected)
    assert torch.equal(expected, dy * code.decode(whole[0], x.shape, torch.float32))
