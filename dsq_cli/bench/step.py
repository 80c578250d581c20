"""``dsq bench step``: one training step of a small fairseq transformer on CPU, per quant preset
and stash scope.

For each (preset, scope): the time of the first step (the compile warm-up: every quantizer the
step needs is compiled there), the median time of a full step (forward, backward, Adam update)
afterwards, the activation bytes held after the forward pass, less the output, and the memory of
one whole step (`StepMemory`): what was live before it (parameters and Adam state; the step frees
the gradients first) and the most the step held above that at once. Memory is measured by the
allocator (`allocated_during`).
Setups are timed round-robin within each repetition, so they share the machine's conditions.
``stash_scope=all`` packs every activation autograd saves (docs/dsq.md); ``gemm`` only the GEMM
inputs.

The model, batch, step and memory measurement here are shared with ``dsq bench memory``
(`memory.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from dsq.engine import POINTS, QuantConfig, units
from dsq.engine.checkpointing import checkpoint_layers
from dsq.engine.chunked_output import DEFAULT_CHUNK_TOKENS, chunked_output_loss
from dsq.engine.spec import SAVED_KINDS
from dsq.integrations import quantize_model
from dsq_cli.cpu_allocator import apply_malloc_setting
from dsq_cli.presets import at_first_level, load_quant_preset

from .breakdown import format_breakdown, profile_step, unit_peaks
from .quant import machine_description  # one description of the machine for both benches

MIB = 2**20


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


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- what a step trains on, and with what -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    """``sentences`` random sentences of ``src_len`` token ids: the source, the previous output
    tokens the decoder reads and the target, all of the same length."""

    src: torch.Tensor
    lengths: torch.Tensor
    prev: torch.Tensor
    target: torch.Tensor

    @classmethod
    def random(cls, sentences: int, src_len: int, vocab: int, dev: torch.device) -> Batch:
        g = torch.Generator().manual_seed(0)
        src, prev, target = (
            torch.randint(4, vocab, (sentences, src_len), generator=g).to(dev) for _ in range(3)
        )
        return cls(src, torch.full((sentences,), src_len, device=dev), prev, target)

    @property
    def tokens(self) -> int:
        """Source tokens."""
        return self.src.numel()


# The decoder's output projection (decoder width x vocabulary): the step's largest GEMMs.
HEAD = "decoder.output_projection"


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a row trains, beside its preset: the stash scope, where the quantized GEMMs run, the
    output projection quantized (as `dsq train` runs it) or fp32, whole layers checkpointed, and
    the output layer's loss in chunks of ``loss_chunk`` tokens (0: whole)."""

    scope: str = "gemm"
    gemm_unit: str = "auto"
    fp32_head: bool = False
    checkpointing: bool = False
    loss_chunk: int = DEFAULT_CHUNK_TOKENS


@dataclasses.dataclass
class Setup:
    """One row's model and its Adam optimizer. A preset of the dsq engine patches the model
    (`quantize_model`; the output projection `HEAD` too unless ``fp32_head``); fp32 and a preset
    of the autocast engine (amp_bf16) train the model as it is, the latter under
    ``torch.autocast``. ``points`` are the preset's formats at their first level, with the stash
    scope and where the GEMMs run (``gemm_unit``)."""

    preset: str
    points: dict[str, Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    variant: Variant
    autocast: torch.dtype | None = None

    @classmethod
    def build(
        cls, preset: str, variant: Variant, layers: int, width: int, vocab: int, dev: torch.device
    ) -> Setup:
        points = at_first_level(load_quant_preset(preset)) | scope_points(variant.scope)
        points["gemm_unit"] = variant.gemm_unit
        cfg = QuantConfig.from_dict(points)
        model = build_model(layers, width, vocab).to(dev)
        patched = preset != "fp32" and cfg.engine == "dsq"
        if patched:
            quantize_model(model, cfg, exclude=[HEAD] if variant.fp32_head else [])
        if variant.checkpointing:
            checkpoint_layers([*model.encoder.layers, *model.decoder.layers],
                              cfg if patched else None)  # fmt: skip
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        return cls(preset, points, model, optimizer, variant, cfg.autocast_dtype)

    def loss(self, batch: Batch) -> torch.Tensor:
        """The mean cross-entropy of ``batch``: the output layer and its loss in chunks of
        ``variant.loss_chunk`` tokens (`chunked_output_loss`), or whole."""
        model = self.model
        features, _ = model(batch.src, batch.lengths, batch.prev, features_only=True)
        features = features.reshape(-1, features.shape[-1])
        target = batch.target.reshape(-1)
        summed = functools.partial(torch.nn.functional.cross_entropy, reduction="sum")
        if self.variant.loss_chunk:
            head = model.decoder.output_projection
            (loss,) = chunked_output_loss(
                features, model.decoder.output_layer, summed, target, list(head.parameters()),
                self.variant.loss_chunk,
            )  # fmt: skip
        else:
            loss = summed(model.decoder.output_layer(features), target)
        return loss / target.numel()

    def step(self, batch: Batch) -> None:
        """One training step as a trainer takes it: free the gradients (``zero_grad``), forward,
        cross-entropy loss, backward, Adam update; under ``torch.autocast`` for amp_bf16."""
        self.optimizer.zero_grad(set_to_none=True)
        dev = batch.src.device
        with torch.autocast(dev.type, self.autocast or torch.float32, self.autocast is not None):
            loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()

    def state_bytes(self) -> int:
        """Bytes live now in the model and optimizer, summed from the tensors' sizes (each
        storage once): parameters, buffers, gradients if kept, and the optimizer's state (Adam's
        two moments and step counts)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def memory(self, batch: Batch) -> StepMemory:
        """The memory of one step on ``batch``. Take it after a first step, which compiles and
        creates Adam's state. The step's own ``zero_grad`` runs first, outside the measurement:
        the profiler records no free of a block allocated before it started, so gradients freed
        inside would be counted twice (as state and as held by the step)."""
        self.optimizer.zero_grad(set_to_none=True)
        state = self.state_bytes()
        peak = allocated_during(lambda: self.step(batch), batch.src.device).peak
        return StepMemory(state, peak)


# The stash scopes a bench row can take: the engine's two, and `all` with every kind of saved
# tensor in q1 (docs/dsq.md, "What stash_scope=all holds"), which is what `all` held before its
# rules, the figures it was measured by
SCOPES = {
    "gemm": {"stash_scope": "gemm"},
    "all": {"stash_scope": "all"},
    # every kind of saved tensor in q1; a checkpointed layer's input stays float32, as the rows
    # measured before that rule existed held it
    "all-q1": {
        "stash_scope": "all",
        "saved": dict.fromkeys(SAVED_KINDS, "q1") | {"checkpoint": "keep"},
    },
    # all, and a checkpointed layer's input held in eight-bit blocks
    "all-held": {"stash_scope": "all", "saved": {"checkpoint": "bfp8e8b16"}},
    # all, SiLU's and GELU's modules holding 3-bit codes of their derivatives
    "all-derivative3": {"stash_scope": "all", "saved": {"activation": "derivative3"}},
    # gemm, Llama-style MLPs run a slice of tokens at a time
    "sliced": {"stash_scope": "gemm", "mlp": "sliced"},
    # all-held, Llama-style MLPs run a slice of tokens at a time
    "all-held-sliced": {
        "stash_scope": "all",
        "saved": {"checkpoint": "bfp8e8b16"},
        "mlp": "sliced",
    },
    # all-held-sliced, the attention in torch's fused kernel in bf16 on q0's Q, K and V
    "all-held-sdpa": {
        "stash_scope": "all",
        "saved": {"checkpoint": "bfp8e8b16"},
        "mlp": "sliced",
        "attention": "sdpa_bf16",
    },
}


def scope_points(scope: str) -> dict:
    """The quant keys of a bench scope (`SCOPES`), merged over a preset's points."""
    return SCOPES[scope]


def row_label(preset: str, variant: Variant) -> str:
    """``dsq all ckpt``: the preset and what sets its row apart (a stash scope other than gemm,
    GEMMs in float32, a float32 head, checkpointing, the loss unchunked)."""
    parts = [preset]
    if variant.scope != "gemm":
        parts.append(variant.scope)
    if variant.gemm_unit != "auto":
        parts.append(f"unit={variant.gemm_unit}")
    if variant.fp32_head:
        parts.append("fp32-head")
    if variant.checkpointing:
        parts.append("ckpt")
    if not variant.loss_chunk:
        parts.append("whole-loss")
    return " ".join(parts)


def variants_of(preset: str, scopes, units, checkpointing, fp32_head: bool, loss_chunk: int):
    """The rows of one preset: every scope, unit and checkpointing setting asked for, except that
    a preset the engine does not patch (fp32, amp_bf16) has no stash to scope and no quantized
    GEMM: one scope and unit."""
    patched = preset != "fp32" and load_quant_preset(preset).get("engine", "dsq") == "dsq"
    for scope in scopes if patched else ("gemm",):
        for unit in units if patched else ("auto",):
            for ckpt in checkpointing:
                yield Variant(scope, unit, fp32_head and patched, ckpt, loss_chunk)


BASELINES = ("fp32", "amp_bf16")  # every row is reported as a multiple of these where measured


def baseline_ratios(rows: list[dict], key: str) -> None:
    """Add ``x_fp32`` and ``x_amp_bf16`` to each row: its ``key`` over that of the baseline's
    plain row (no checkpointing), where that row was measured (else None)."""
    for name in BASELINES:
        base = next((r for r in rows if r["preset"] == name and not r["checkpointing"]), None)
        for row in rows:
            value = base and base[key] and row[key] is not None
            row[f"x_{name}"] = row[key] / base[key] if value else None


# -- memory, as the allocator saw it ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Allocation:
    """What ``fn`` allocated, relative to what was live when it started: ``peak``, the most it
    held at once (0 if it never held more than at the start), and ``held``, what it left alive
    (negative if it freed more than it allocated). ``out`` is what ``fn`` returned."""

    peak: int
    held: int
    out: Any


def allocated_during(fn: Callable[[], Any], dev: torch.device) -> Allocation:
    """Run ``fn`` and measure its allocations.

    On a GPU: the CUDA caching allocator's counters (``memory_allocated`` before and after,
    ``max_memory_allocated`` after ``reset_peak_memory_stats``): bytes in tensors, not the cache.
    On the CPU: torch.profiler's memory records (``profile_memory=True``), one per allocation
    (+bytes) or free (-bytes) through PyTorch's allocator, replayed in time order
    (`replay_peak`). The raw records come from the profiler's results, because the events
    ``prof.events()`` lists fold the records made inside an operator into one net number, which
    hides a peak inside it. The profiler records no free of a block allocated before it started
    (torch warns once): free such tensors before calling this, or the peak counts them as held.
    """
    if dev.type == "cuda":
        _sync(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        _sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        return Allocation(max(0, peak), torch.cuda.memory_allocated(dev) - before, out)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    with native_stderr_muted(), profile(activities=activities, profile_memory=True) as prof:
        out = fn()
    events = prof.profiler.kineto_results.events()
    records = [
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    records.sort(key=lambda record: record[0])  # stable: records of one instant keep their order
    deltas = [nbytes for _, nbytes in records]
    return Allocation(replay_peak(deltas), sum(deltas), out)


@contextlib.contextmanager
def native_stderr_muted():
    """The process's stderr (file descriptor 2) sent to /dev/null: Kineto, the profiler's C++
    backend, writes two lines there at every start and stop, hundreds in one benchmark, and no
    setting turns them off. What the measured step itself prints to stderr is lost with them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def replay_peak(deltas: list[int]) -> int:
    """The most bytes held at once by a sequence of allocations (+) and frees (-) in time order,
    above what was held before the first: the maximum of the running sum, or 0."""
    peak = running = 0
    for delta in deltas:
        running += delta
        peak = max(peak, running)
    return peak


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The memory of one training step (forward, backward, Adam update), in bytes.

    ``state``: what was live before the step (`Setup.state_bytes`: parameters, buffers and Adam
    state; the gradients were freed as the step begins), summed from the tensors' sizes.
    ``step_peak``: the most the step held at once above that, measured by the allocator
    (`allocated_during`): the activations stashed for the backward pass, the gradients built by
    it, the temporaries of the kernels and of Adam. ``total``: the step's peak, state included:
    what a device must hold to train on this batch (the inputs, the allocator's cache and the
    CUDA context aside).
    """

    state: int
    step_peak: int

    @property
    def total(self) -> int:
        return self.state + self.step_peak

    def as_dict(self) -> dict[str, float]:
        """MiB, for a report."""
        return {
            "state_mb": self.state / MIB,
            "step_peak_mb": self.step_peak / MIB,
            "peak_mb": self.total / MIB,
        }


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
    gemm_units: tuple[str, ...] = ("auto",),
    checkpointing: tuple[bool, ...] = (False,),
    fp32_head: bool = False,
    loss_chunk: int = DEFAULT_CHUNK_TOKENS,
    breakdown: bool = False,
) -> dict:
    dev = torch.device(device)
    if dev.type == "cpu":
        apply_malloc_setting()  # as `dsq train` runs on CPU (DSQ_CPU_ALLOCATOR)
    batch = Batch.random(max(1, tokens // src_len), src_len, vocab, dev)
    setups: dict[tuple[str, Variant], Setup] = {}
    for name in presets:
        for variant in variants_of(name, scopes, gemm_units, checkpointing, fp32_head, loss_chunk):
            setups[(name, variant)] = Setup.build(name, variant, layers, width, vocab, dev)

    warmup = {}
    for key, setup in setups.items():  # warm up: compile every shape once
        _sync(dev)
        start = time.perf_counter()
        setup.step(batch)
        _sync(dev)
        warmup[key] = time.perf_counter() - start
        setup.step(batch)
    times = {key: [] for key in setups}
    for _ in range(repeats):
        for key, setup in setups.items():
            _sync(dev)
            start = time.perf_counter()
            setup.step(batch)
            _sync(dev)
            times[key].append(time.perf_counter() - start)
    rows = []
    base = statistics.median(next(iter(times.values())))
    for (name, variant), setup in setups.items():
        before = units.tally()
        memory = setup.memory(batch)  # one step: the units its quantized GEMMs ran on
        ran = units.merge_tallies(units.tally(), units.negated(before))
        with torch.autocast(dev.type, setup.autocast or torch.float32, setup.autocast is not None):
            forward = allocated_during(
                lambda m=setup.model: m(batch.src, batch.lengths, batch.prev)[0], dev
            )
        held = forward.held - forward.out.numel() * forward.out.element_size()
        median = statistics.median(times[(name, variant)])
        rows.append(
            {
                "preset": name,
                "row": row_label(name, variant),
                "scope": variant.scope,
                "gemm_unit": variant.gemm_unit,
                "checkpointing": variant.checkpointing,
                "fp32_head": variant.fp32_head,
                "units": {kind: sorted(counts) for kind, counts in ran.items()},
                "points": setup.points,
                "first_step_s": warmup[(name, variant)],
                "step_ms": median * 1e3,
                "x_first": median / base,
                "activation_mb": held / MIB,
                **memory.as_dict(),
            }
        )
    baseline_ratios(rows, "step_ms")
    extra = {}
    if breakdown:
        for row, setup in zip(rows, setups.values()):
            row["breakdown"] = profile_step(setup.step, batch)
        extra["unit_peaks"] = unit_peaks(dev)
    return {
        **extra,
        "layers": layers,
        "width": width,
        "tokens": batch.tokens,
        "vocab": vocab,
        "head": "fp32" if fp32_head else "quantized",
        "loss_chunk": loss_chunk,
        "threads": torch.get_num_threads(),
        "machine": machine_description(dev),
        "torch": torch.__version__,
        "repeats": repeats,
        "rows": rows,
    }


def units_cell(used: dict[str, list[str]]) -> str:
    """``bf16 bf16 fp32 | bf16 bf16 bf16``: the units of the six GEMM kinds, linear then
    attention (several joined by '+' where one step used more than one)."""
    cells = ["+".join(used.get(kind, [])) or "-" for kind in units.GEMM_KINDS]
    return f"{' '.join(cells[:3])} | {' '.join(cells[3:])}"


HEAD_WORDS = {
    "fp32": "fp32 in every row",
    "quantized": "quantized as each preset says, as dsq train runs it",
}


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def loss_words(loss_chunk: int) -> str:
    if not loss_chunk:
        return "the loss over the whole batch"
    return f"the output layer and loss in chunks of {loss_chunk} tokens"


def format_table(result: dict) -> str:
    lines = [
        f"dsq bench step: fairseq transformer, {result['layers']}+{result['layers']} layers, "
        f"width {result['width']}, {result['tokens']} tokens per batch, vocab {result['vocab']} "
        f"(output projection {HEAD_WORDS[result['head']]}; {loss_words(result['loss_chunk'])}), "
        f"{result['machine']}, torch {result['torch']}, median of {result['repeats']}",
        "",
        f"{'row':<22} {'q0 / q1 / q2 / q3':<40} {'GEMM units':<34} {'1st step s':>10} "
        f"{'step ms':>9} {'x fp32':>7} {'x amp':>7} {'act. MiB':>9} {'state MiB':>10} "
        f"{'step pk MiB':>11} {'peak MiB':>9}",
        "-" * 188,
    ]
    for r in result["rows"]:
        pts = " / ".join(str(r["points"][p]) for p in POINTS)
        lines.append(
            f"{r['row']:<22} {pts:<40} {units_cell(r['units']):<34} "
            f"{r['first_step_s']:>10.1f} {r['step_ms']:>9.1f} {ratio_text(r['x_fp32']):>7} "
            f"{ratio_text(r['x_amp_bf16']):>7} {r['activation_mb']:>9.1f} "
            f"{r['state_mb']:>10.1f} {r['step_peak_mb']:>11.1f} {r['peak_mb']:>9.1f}"
        )
    lines.append(
        "row: the preset, then what sets the row apart (all: stash_scope=all; ckpt: every layer "
        "checkpointed; fp32-head: the output projection left fp32). GEMM units: where the "
        "quantized GEMMs ran (quant.gemm_unit; docs/dsq.md), linear forward/dx/dw | attention "
        "products forward/da/db, '-' for none (fp32, amp_bf16: not patched). x fp32, x amp: the "
        "step's time over fp32's and amp_bf16's (torch.autocast bf16), measured in the same run. "
        "1st step s: the first step, compile warm-up included (kernels shared with an earlier row "
        "are compiled there); act. MiB: bytes held after the forward pass (allocator), less the "
        "output; state MiB: parameters and Adam state, live before a step (its zero_grad frees "
        "the gradients); step pk MiB: the most one step (forward, backward, Adam) held at once "
        "above that (allocator); peak MiB: state + step peak."
    )
    if "unit_peaks" in result:
        lines.append(format_breakdown(result))
    return "\n".join(lines)
