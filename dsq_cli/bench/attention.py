"""``dsq bench attention``: DSQ's attention, forward plus backward, beside SDPA under bf16
autocast, side by side in one run (docs/dsq.md, "Attention in tiles").

The attention of a Llama-style layer: ``heads`` query heads sharing ``kv_heads`` key/value heads
of ``head_dim`` values, causal, ``batch`` sequences at each length, DSQ's products in a preset's
formats. Rows, run one after the other within each repetition: SDPA under
``torch.autocast(bf16)`` (what a user runs instead: the fused kernel), the tiled kernel, and the
explicit path up to ``explicit_up_to`` tokens (its probabilities are ``batch x heads x N x N``).
A row's time is the median over repetitions of one forward and backward pass; its ratio to
SDPA is the median of the ratios within each repetition. On the CPU the process applies the
malloc setting ``dsq train`` runs with (``DSQ_CPU_ALLOCATOR``, ``dsq_cli/cpu_allocator.py``);
on CUDA each row also reports the allocator's peak above the inputs.
"""

from __future__ import annotations

import statistics
import time

import torch

from dsq.engine import QuantConfig
from dsq.engine.attention import dsq_attention, explicit_attention
from dsq.presets import get_preset
from dsq_cli.cpu_allocator import apply_malloc_setting

from .quant import machine_description

SDPA = "sdpa, bf16 autocast"


def _inputs(batch, heads, kv_heads, n, head_dim, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = ((batch, heads, n, head_dim), (batch, kv_heads, n, head_dim),
              (batch, kv_heads, n, head_dim), (batch, heads, n, head_dim))  # fmt: skip
    q, k, v, d_out = (torch.randn(s, device=dev, generator=g) for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), d_out


def _runs(q, k, v, cfg, n: int, explicit_up_to: int) -> dict:
    """Each row's forward pass (its output) by name."""
    scaling = q.shape[-1] ** -0.5

    def sdpa():
        with torch.autocast(q.device.type, torch.bfloat16):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )

    runs = {SDPA: sdpa, "dsq tiled": lambda: dsq_attention(q, k, v, cfg, causal=True)}
    if n <= explicit_up_to:
        runs["dsq explicit"] = lambda: explicit_attention(q, k, v, cfg, scaling=scaling,
                                                          causal=True)[0]  # fmt: skip
    return runs


def _timed(fn, q, k, v, d_out) -> float:
    dev = q.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    torch.autograd.grad(fn().float(), (q, k, v), d_out)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def _cuda_peak_mib(fn, q, k, v, d_out) -> float:
    torch.cuda.synchronize(q.device)
    base = torch.cuda.memory_allocated(q.device)
    torch.cuda.reset_peak_memory_stats(q.device)
    torch.autograd.grad(fn().float(), (q, k, v), d_out)
    torch.cuda.synchronize(q.device)
    return (torch.cuda.max_memory_allocated(q.device) - base) / 2**20


def run(seq_lens=(1024, 2048), batch: int = 1, heads: int = 8, kv_heads: int = 4,
        head_dim: int = 64, preset: str = "dsq", repeats: int = 5, device: str = "cpu",
        explicit_up_to: int = 2048) -> dict:  # fmt: skip
    dev = torch.device(device)
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} cannot share --kv-heads {kv_heads}: use a divisor")
    cfg = QuantConfig.from_dict(get_preset(preset).to_dict())
    if cfg.engine != "dsq":
        raise ValueError(f"--preset {preset} runs no DSQ attention; choose a DSQ preset (dsq)")
    if dev.type == "cpu":
        apply_malloc_setting()  # as `dsq train` runs on CPU (DSQ_CPU_ALLOCATOR)
    rows = []
    for n in seq_lens:
        q, k, v, d_out = _inputs(batch, heads, kv_heads, n, head_dim, dev)
        runs = _runs(q, k, v, cfg, n, explicit_up_to)
        for fn in runs.values():  # warm up: kernels, pages, the allocator's blocks
            _timed(fn, q, k, v, d_out)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name].append(_timed(fn, q, k, v, d_out))
        for name, fn in runs.items():
            ratios = [t / s for t, s in zip(times[name], times[SDPA])]
            row = {"seq_len": n, "row": name, "ms": statistics.median(times[name]) * 1e3,
                   "x_sdpa": statistics.median(ratios)}  # fmt: skip
            if dev.type == "cuda":
                row["peak_mib"] = _cuda_peak_mib(fn, q, k, v, d_out)
            rows.append(row)
    return {
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "repeats": repeats,
        "shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim},
        "preset": preset,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"dsq bench attention: {result['machine']}, torch {result['torch']}, forward + backward, "
        f"causal, {s['batch']} sequence(s), {s['heads']} heads ({s['kv_heads']} key/value) of "
        f"{s['head_dim']}, {result['preset']}'s formats, median of {result['repeats']}, the rows "
        "side by side in every repetition",
        "",
        f"{'tokens':>7}  {'row':<22} {'ms':>10} {'x sdpa':>8}"
        + (f" {'peak MiB':>9}" if any("peak_mib" in r for r in result["rows"]) else ""),
    ]
    for r in result["rows"]:
        line = f"{r['seq_len']:>7}  {r['row']:<22} {r['ms']:>10.1f} {r['x_sdpa']:>7.2f}x"
        if "peak_mib" in r:
            line += f" {r['peak_mib']:>9.0f}"
        lines.append(line)
    return "\n".join(lines)
