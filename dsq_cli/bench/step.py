"""``dsq bench step``: one training step of a small fairseq transformer on CPU, per quant preset
and stash scope.

For each (preset, scope): the time of the first step (the compile warm-up: every quantizer the
step needs is compiled there), the median time of a full step (forward, backward, Adam update)
afterwards, and the activation bytes held after the forward pass, measured by the allocator
(torch.profiler's memory records), less the output. Setups are timed round-robin within each
repetition, so they share the machine's conditions. ``stash_scope=all`` packs every activation
autograd saves (docs/dsq.md); ``gemm`` only the GEMM inputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from dsq_cli.engine import QuantConfig, quantize_model
from dsq_cli.presets import load_quant_preset


def build_model(layers: int, width: int, vocab: int, seed: int = 0):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, transformer_iwslt_de_en

    torch.manual_seed(seed)
    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    args = argparse.Namespace(
        arch="transformer_iwslt_de_en",
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_embed_dim=width,
        decoder_embed_dim=width,
        encoder_ffn_embed_dim=4 * width,
        decoder_ffn_embed_dim=4 * width,
        encoder_attention_heads=max(1, width // 64),
        decoder_attention_heads=max(1, width // 64),
        dropout=0.1,
    )
    transformer_iwslt_de_en(args)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return TransformerModel.build_model(args, task)


def first_level(preset: dict) -> dict:
    """The preset with every schedule at its first level (what a run starts with)."""
    return {k: (v["levels"][0] if isinstance(v, dict) else v) for k, v in preset.items()}


from .quant import machine_description  # noqa: E402  (one description for both benches)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _held_after_forward(fn, dev: torch.device) -> tuple[int, torch.Tensor]:
    """Bytes allocated by ``fn`` and still alive after it: the CUDA caching allocator's counter on
    a GPU, torch.profiler's CPU memory records on the CPU."""
    if dev.type == "cuda":
        _sync(dev)
        before = torch.cuda.memory_allocated(dev)
        out = fn()
        _sync(dev)
        return torch.cuda.memory_allocated(dev) - before, out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None), out


def run(
    presets: list[str],
    layers: int,
    width: int,
    tokens: int,
    src_len: int,
    repeats: int,
    vocab: int = 8000,
    device: str = "cpu",
    scopes: tuple[str, ...] = ("gemm",),
) -> dict:
    dev = torch.device(device)
    sentences = max(1, tokens // src_len)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (sentences, src_len), generator=g).to(dev)
    prev = torch.randint(4, vocab, (sentences, src_len), generator=g).to(dev)
    target = torch.randint(4, vocab, (sentences, src_len), generator=g).to(dev)
    lengths = torch.full((sentences,), src_len, device=dev)
    setups = {}
    for name in presets:
        for scope in scopes if name != "fp32" else ("gemm",):  # fp32 has no stash to scope
            points = first_level(load_quant_preset(name)) | {"stash_scope": scope}
            model = build_model(layers, width, vocab).to(dev)
            if name != "fp32":
                quantize_model(
                    model, QuantConfig.from_dict(points), exclude=["decoder.output_projection"]
                )
            model.train()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
            setups[(name, scope)] = (model, optimizer, points)

    def step(model, optimizer):
        logits, _ = model(src, lengths, prev)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    warmup = {}
    for key, (model, optimizer, _) in setups.items():  # warm up: compile every shape once
        _sync(dev)
        start = time.perf_counter()
        step(model, optimizer)
        _sync(dev)
        warmup[key] = time.perf_counter() - start
        step(model, optimizer)
    times = {key: [] for key in setups}
    for _ in range(repeats):
        for key, (model, optimizer, _) in setups.items():
            _sync(dev)
            start = time.perf_counter()
            step(model, optimizer)
            _sync(dev)
            times[key].append(time.perf_counter() - start)
    rows = []
    base = statistics.median(next(iter(times.values())))
    for (name, scope), (model, _, points) in setups.items():
        held, out = _held_after_forward(lambda m=model: m(src, lengths, prev)[0], dev)
        held -= out.numel() * out.element_size()
        median = statistics.median(times[(name, scope)])
        rows.append(
            {
                "preset": name,
                "scope": scope,
                "points": points,
                "first_step_s": warmup[(name, scope)],
                "step_ms": median * 1e3,
                "x_first": median / base,
                "activation_mb": held / 2**20,
            }
        )
    return {
        "layers": layers,
        "width": width,
        "tokens": sentences * src_len,
        "vocab": vocab,
        "threads": torch.get_num_threads(),
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "repeats": repeats,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    baseline = "x " + result["rows"][0]["preset"]
    lines = [
        f"dsq bench step: fairseq transformer, {result['layers']}+{result['layers']} layers, "
        f"width {result['width']}, {result['tokens']} tokens per batch, vocab {result['vocab']}, "
        f"{result['machine']}, torch {result['torch']}, median of "
        f"{result['repeats']}",
        "",
        f"{'preset':<12} {'scope':<6} {'q0 / q1 / q2 / q3':<40} {'1st step s':>10} "
        f"{'step ms':>9} {baseline:>9} {'act. MiB':>9}",
        "-" * 101,
    ]
    for r in result["rows"]:
        pts = " / ".join(str(r["points"][p]) for p in ("q0", "q1", "q2", "q3"))
        lines.append(
            f"{r['preset']:<12} {r['scope']:<6} {pts:<40} {r['first_step_s']:>10.1f} "
            f"{r['step_ms']:>9.1f} {r['x_first']:>9.2f} {r['activation_mb']:>9.1f}"
        )
    lines.append(
        "1st step s: the first step, compile warm-up included (kernels shared with an earlier row "
        "are compiled there); act. MiB: bytes held after the forward pass (allocator), less the "
        "output."
    )
    return "\n".join(lines)
