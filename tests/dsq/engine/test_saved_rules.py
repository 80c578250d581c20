"""What ``stash_scope="all"`` holds of each kind of saved tensor (quant.saved; docs/dsq.md, "What
stash_scope=all holds"): the kind of each tensor from the module saving it, each held in its
kind's format against the float reference, a tensor saved twice packed once, the rules in the
spec's records and the report, and refused where they would not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsq.engine import QuantConfig
from dsq.engine import patch as patch_module
from dsq.engine.patch import saved_kind
from dsq.engine.spec import SAVED_DEFAULT, QuantSpec
from dsq.formats import parse_format
from dsq.integrations import quantize_model


def activation(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, activation): the activation computed from a leaf, as a layer's input is computed
    from what came before it; the hooks pack it by its kind."""
    leaf = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return leaf, leaf * 1.0


class RMSNorm(nn.Module):  # as transformers writes it: its input read by two operations
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class GatedMLP(nn.Module):  # SwiGLU: silu(gate(x)) * up(x), then down
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down, self.act = nn.Linear(hidden, width), nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 64):
        super().__init__()
        self.norm, self.mlp = RMSNorm(width), GatedMLP(width, hidden)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def test_each_saved_tensor_gets_the_kind_of_the_module_saving_it():
    t, constant = activation(8, 64)[1], torch.randn(8, 64)
    assert saved_kind(nn.LayerNorm(64), t) == "norm"
    assert saved_kind(RMSNorm(64), t) == "norm"
    assert saved_kind(nn.SiLU(), t) == "activation" and saved_kind(nn.GELU(), t) == "activation"
    assert saved_kind(GatedMLP(4, 8), t) == "elementwise"
    assert saved_kind(None, t) == "elementwise"
    assert saved_kind(nn.SiLU(), constant) == "constant"
    # a layer left unquantized (excluded, a GLUE run's fp32 head): not held in the 2-bit stash
    assert saved_kind(nn.Linear(4, 4), t) == "elementwise"
    # torch.nn.modules.activation also holds attention and the softmaxes: not activations
    assert saved_kind(nn.MultiheadAttention(8, 2), t) == "elementwise"
    assert saved_kind(nn.Softmax(-1), t) == "elementwise"


def spy_packs(monkeypatch) -> list[tuple[str, tuple]]:
    """(format, shape) of each tensor the hooks pack."""
    packs = []
    original = patch_module._PackedSave

    class Counted(original):
        __slots__ = ()

        def __init__(self, packed, requires_grad):
            packs.append((packed.fmt.spec, tuple(packed.shape)))
            super().__init__(packed, requires_grad)

    monkeypatch.setattr(patch_module, "_PackedSave", Counted)
    return packs


def test_a_block_holds_each_kind_in_its_format_and_a_tensor_saved_twice_once(monkeypatch):
    """The norm's input (read by pow and by the product with rsqrt) is packed once, and the
    normalized input (read by the weight's product) once, in the norm's format; SiLU's input in
    the activation's; the gated product's two operands in the elementwise format; the GEMM
    layers' inputs by their own stashes (q1), the statistics and the weights kept."""
    saved = {"norm": "bfp6", "activation": "bfp4", "elementwise": "bfp3"}
    cfg = QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", stash_scope="all",
                      saved=saved)  # fmt: skip
    block = quantize_model(Block(), cfg)
    packs = spy_packs(monkeypatch)
    leaf, x = activation(4, 8, 32)
    block(x).sum().backward()
    assert (
        sorted(spec for spec, _ in packs) == ["bfp3e8b16"] * 2 + ["bfp4e8b16"] + ["bfp6e8b16"] * 2
    )
    assert leaf.grad is not None


def test_the_norm_input_held_in_its_format_gives_the_gradient_of_that_input(monkeypatch):
    """A layer norm's backward pass reads its input packed in the norm's format; its mean and
    reciprocal deviation (one value a row, shorter than a block) are kept, so the gradient is
    ATen's layer-norm backward on that input quantized, with the exact statistics."""
    cfg = QuantConfig(q1="bfp2", stash_scope="all", saved={"norm": "bfp5"})
    norm = nn.LayerNorm(64)
    (leaf, x), dy = activation(8, 64), torch.randn(8, 64)
    with patch_module.stash_all_hooks(cfg, innermost=lambda: norm):
        y = norm(x)
    y.backward(dy)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x.detach(), [64], norm.weight, norm.bias,
                                                     norm.eps)  # fmt: skip
    held = parse_format("bfp5").quantize(x.detach(), -1)
    want = torch.ops.aten.native_layer_norm_backward(
        dy, held, [64], mean, rstd, norm.weight, norm.bias, [True, False, False]
    )[0]
    assert torch.equal(leaf.grad, want)


def test_a_leaf_input_needing_no_gradient_is_packed_by_its_rule_and_a_parameter_never(monkeypatch):
    """The model's input (a leaf that needs no gradient, saved by a product for the other
    operand's gradient) is a ``constant``, packed in that kind's format; a parameter saved the
    same way (for the input's gradient) stays as it is, whatever the rules say."""
    cfg = QuantConfig(q1="bfp2", stash_scope="all",
                      saved={"constant": "bfp5", "elementwise": "bfp6"})  # fmt: skip
    packs = spy_packs(monkeypatch)
    weight = nn.Parameter(torch.randn(8, 64))
    data = torch.randn(8, 64)  # a leaf, no gradient
    leaf, x = activation(8, 64)
    with patch_module.stash_all_hooks(cfg):
        y = data * weight  # saves data, for the weight's gradient (data needs none)
        z = weight * x  # saves x (for the weight's gradient) and the weight (for x's)
    (y.sum() + z.sum()).backward()
    assert sorted(packs) == [("bfp5e8b16", (8, 64)), ("bfp6e8b16", (8, 64))]
    held_data = parse_format("bfp5").quantize(data, -1)
    held_x = parse_format("bfp6").quantize(x.detach(), -1)
    assert torch.equal(weight.grad, held_data + held_x)
    assert torch.equal(leaf.grad, weight.detach())  # read from the parameter itself


def test_a_view_of_a_parameter_stays_as_it_is_and_a_leaf_activation_is_packed(monkeypatch):
    """An unpatched Linear saves ``weight.t()``, a view of a parameter: kept (it is alive
    anyway). A leaf that needs a gradient but is no parameter (the input the reentrant
    checkpoint detaches for a layer's run again) is packed by its kind, as the activation it
    stands for was in the forward pass."""
    cfg = QuantConfig(q1="bfp2", stash_scope="all", saved={"elementwise": "bfp6"})
    packs = spy_packs(monkeypatch)
    weight = nn.Parameter(torch.randn(8, 64))
    leaf = torch.randn(4, 64).requires_grad_()
    with patch_module.stash_all_hooks(cfg):
        y = leaf @ weight.t()  # saves the leaf (for the weight's gradient) and weight.t()
    y.sum().backward()
    assert packs == [("bfp6e8b16", (4, 64))]
    held = parse_format("bfp6").quantize(leaf.detach(), -1)
    assert torch.equal(weight.grad, torch.ones(4, 8).t() @ held)
    assert torch.equal(leaf.grad, torch.ones(4, 8) @ weight.detach())


def test_keep_holds_a_kind_as_autograd_saved_it_and_q1_follows_the_stash(monkeypatch):
    saved = {"norm": "keep", "activation": "q1", "elementwise": "keep"}
    cfg = QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", stash_scope="all",
                      saved=saved)  # fmt: skip
    block = quantize_model(Block(), cfg)
    packs = spy_packs(monkeypatch)
    block(activation(4, 8, 32)[1]).sum().backward()
    assert [spec for spec, _ in packs] == ["bfp2e8b16"]  # SiLU's input, in q1


def test_the_rules_are_in_the_spec_record_and_the_report_and_refused_under_gemm():
    spec = QuantSpec(q1="bfp2", stash_scope="all", saved={"norm": "bf16"})
    same = QuantSpec(q1="bfp2", stash_scope="all", saved={"norm": "bf16", "activation": "bfp8"})
    assert same == spec and same.saved["activation"] == "bfp8e8b16"  # one rule, one spelling
    assert spec.to_dict()["saved"] == dict(SAVED_DEFAULT) | {"norm": "bf16"}
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert "saved" not in QuantSpec(q1="bfp2").to_dict()  # the paper's scope: as before
    model = quantize_model(Block(), QuantConfig.from_spec(spec))
    assert "saved tensors held: GEMM inputs q1, norm bf16, activation bfp8e8b16" in (
        model.dsq_report.summary()
    )
    with pytest.raises(ValueError, match="set quant.stash_scope=all or drop quant.saved"):
        QuantSpec(q1="bfp2", saved={"norm": "bf16"})
    with pytest.raises(ValueError, match="unknown kind"):
        QuantSpec(q1="bfp2", stash_scope="all", saved={"softmax": "bf16"})
    with pytest.raises(ValueError, match="quant.saved.norm='bfp99'"):
        QuantSpec(q1="bfp2", stash_scope="all", saved={"norm": "bfp99"})


def test_a_packed_copy_is_shared_only_while_a_graph_holds_it():
    """The packed-once table holds its copies weakly: a graph freed during the forward (a chunk
    of the output layer run forward and backward at once) frees its packed copy."""
    import gc

    cfg = QuantConfig(q1="bfp2", stash_scope="all", saved={"elementwise": "bfp4"})
    packed_once: dict = {}
    leaf, x = activation(8, 64)
    with patch_module.stash_all_hooks(cfg, packed_once=packed_once):
        y = x * x  # saves x twice: packed once
        assert len(packed_once) == 1
        del y
        gc.collect()
        assert all(kept() is None for _, kept in packed_once.values())
        z = x * x  # packed again, not a freed copy
    z.sum().backward()
    assert torch.equal(leaf.grad, 2 * parse_format("bfp4").quantize(x.detach(), -1))


def test_a_model_around_a_patched_module_is_refused_and_the_module_stays_patched():
    inner = quantize_model(Block(), QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16"))
    outer = nn.Sequential(inner, nn.Linear(32, 32))
    with pytest.raises(ValueError, match="holds 0, patched already"):
        quantize_model(outer, QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16"))
    assert type(inner.mlp.gate).__name__ == "DSQLinear" and inner.dsq_cfg is not None
