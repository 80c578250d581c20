"""The ``dsq`` command line (Typer). Usage errors print one line and exit with code 2."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import sys
from pathlib import Path

import typer

from dsq.formats import GRAMMAR
from dsq.formats.backends import requested_backend, requested_backend_refusal
from dsq.presets import COST_BASELINE
from dsq_cli import __version__, cpu_allocator

app = typer.Typer(
    help="dsq: Dynamic Stashing Quantization experiments (Yang et al., EMNLP Findings 2023).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks (record results in docs/benchmarks.md).", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

# dsq's checks of user input raise ValueError or a subclass (ConfigError, DataError, EncoderError)
# with a message meant for the user. TypeError, IndexError, KeyError and AttributeError come from
# programming errors (the argument checks of the library API included), so they keep their
# traceback and exit code 1.
USAGE_ERRORS = (ValueError,)


def usage_errors(fn):
    """Turn bad input into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USAGE_ERRORS as err:
            typer.echo(f"dsq: error: {err}", err=True)
            raise typer.Exit(2) from None

    return wrapper


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level.")):
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:  # before any command runs: a mistyped setting fails here, not mid-run
        cpu_allocator.chosen_setting()
        requested_backend()  # DSQ_BACKEND
    except ValueError as err:
        typer.echo(f"dsq: error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command()
def version():
    """Print the dsq version."""
    typer.echo(__version__)


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--values must be numbers separated by commas, got {text!r}") from None


# the grammar's optional parts in brackets, escaped from rich's markup in --help
_GRAMMAR_HELP = GRAMMAR.replace("[", "\\[")


@app.command("format")
@usage_errors
def format_cmd(
    spec: str = typer.Argument(..., help=f"A format spec (case-insensitive): {_GRAMMAR_HELP}."),
    values: str = typer.Option(None, "--values", help="Numbers to quantize, e.g. 0.3,-1.7,2.9."),
    rounding: str = typer.Option("nearest", help="nearest | stochastic"),
    seed: int = typer.Option(0, help="Seed of the generator for stochastic rounding."),
):
    """Describe a number format and optionally quantize and pack a few numbers with it."""
    import torch

    from dsq.formats import parse_format

    fmt = parse_format(spec)
    numbers = None if values is None else _floats(values)  # validate before printing anything
    typer.echo(f"format          {fmt.spec}")
    typer.echo(f"bits per value  {fmt.bits_per_value:g}")
    doc = (type(fmt).__doc__ or "").strip().splitlines()
    typer.echo(f"definition      {doc[0] if doc else ''}")
    if numbers is None:
        return
    x = torch.tensor(numbers, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    q = fmt.quantize(x, rounding=rounding, generator=g, backend="reference")
    packed = fmt.pack(
        x, rounding=rounding, generator=torch.Generator().manual_seed(seed), backend="reference"
    )
    typer.echo(f"input           {x.tolist()}")
    typer.echo(f"quantized       {q.tolist()}")
    typer.echo(f"packed bytes    {packed.nbytes} (float32: {x.numel() * 4})")


DEFAULT_BENCH_FORMATS = "bfp2,bfp4,bfp8,fixed16"


def _preset_names(presets: str) -> list[str]:
    """``--presets`` as names of quant presets (dsq.presets); an unknown or missing one is a
    usage error (one line, exit 2) before any work."""
    from dsq_cli.presets import load_quant_preset

    names = [p.strip() for p in presets.split(",") if p.strip()]
    if not names:
        raise ValueError("--presets: name at least one quant preset")
    for name in names:
        load_quant_preset(name)
    return names


def _print_bench(result: dict, as_json: bool, format_table) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        typer.echo(format_table(result))


def _check_device(device: str) -> None:
    """--device names a device here, and DSQ_BACKEND (if it names a backend) runs on it."""
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA GPU; none is visible here")
    refusal = requested_backend_refusal(device.split(":")[0])
    if refusal is not None:
        raise ValueError(refusal)


@bench_app.command("quant")
@usage_errors
def bench_quant(
    numel: int = typer.Option(2**24, help="Number of fp32 values."),
    formats: str = typer.Option(DEFAULT_BENCH_FORMATS, help="Comma-separated format specs."),
    backends: str = typer.Option(
        "c,compile,triton,eager,reference",
        help="Comma-separated backends: c (the C kernels where they hold the format, "
        "torch.compile kernels elsewhere), compile (the torch.compile kernels alone), triton, "
        "reference; and eager (plain PyTorch float32, quantize only). Those that cannot run "
        "here are listed as skipped.",
    ),
    paths: str | None = typer.Option(
        None, hidden=True, help="The former name of --backends (deprecated; to be removed)."
    ),
    repeats: int = typer.Option(7, min=1, help="Timed repetitions (median reported)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    peers: bool = typer.Option(False, "--peers", help="Also time QPyTorch if installed."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Time quantize / pack / unpack beside x.clone(), side by side in one run."""
    from dsq_cli.bench import quant

    if numel < 1:
        raise ValueError(f"--numel must be positive, got {numel}")
    if paths is not None:
        typer.echo("dsq: warning: --paths is deprecated; use --backends", err=True)
        backends = paths
    backend_list = [b.strip() for b in backends.split(",") if b.strip()]
    known = (*quant.BACKENDS, "eager")
    bad = [b for b in backend_list if b not in known]
    if bad:
        raise ValueError(f"--backends: unknown backend(s) {bad}; choose from {', '.join(known)}")
    _check_device(device)
    result = quant.run(
        numel,
        [f.strip() for f in formats.split(",") if f.strip()],
        backend_list,
        repeats,
        device,
        peers,
    )
    _print_bench(result, as_json, quant.format_table)


def _choices(option: str, text: str, allowed) -> tuple[str, ...]:
    """A comma-separated option's values, each one of ``allowed`` (a usage error otherwise)."""
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in chosen if s not in allowed]
    if bad or not chosen:
        raise ValueError(f"{option}: unknown value(s) {bad}; choose from {list(allowed)}")
    return chosen


CHECKPOINTING = {"off": False, "on": True}


def _variant_options(checkpointing: str) -> tuple[bool, ...]:
    chosen = _choices("--checkpointing", checkpointing, CHECKPOINTING)
    return tuple(CHECKPOINTING[c] for c in chosen)


MODEL_HELP = (
    "fairseq (the project's own translation transformer, sentences of --src-len) or a "
    "transformers model built from a config, random init, no download: llama (RMSNorm, SwiGLU, "
    "RoPE, grouped-query attention), gpt2 or bert, at each of --seq-lens, each row in a fresh "
    'process (docs/benchmarks.md, "Memory and time on transformers models").'
)

# the options of `dsq bench step` and `dsq bench memory` that choose and shape a transformers model
MODEL_OPTION = typer.Option("fairseq", help=MODEL_HELP)
SEQ_LENS_OPTION = typer.Option(
    "256,1024", help="transformers models: comma-separated tokens a sequence."
)
HEADS_OPTION = typer.Option(0, min=0, help="transformers models: attention heads (0: width/64).")
KV_HEADS_OPTION = typer.Option(
    0, min=0, help="llama: key/value heads, grouped-query attention (0: as many as heads)."
)
THREADS_OPTION = typer.Option(0, min=0, help="transformers models: threads a row (0: torch's).")
ROUNDS_OPTION = typer.Option(
    1, min=1,
    help="transformers models: measure every row this many times, the rows taking turns; time "
    "a token and its ratios are the medians over the rounds (a row's processes run after "
    "another's, so one round's ratio moves with the host's speed).",
)  # fmt: skip


def _comma_ints(text: str) -> tuple[int, ...]:
    """``text``'s comma-separated integers; () where one is not an integer."""
    try:
        return tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        return ()


def _seq_lens(text: str) -> tuple[int, ...]:
    lengths = _comma_ints(text)
    if not lengths or min(lengths) < 2:
        raise ValueError(f"--seq-lens: expected lengths like 256,1024, got {text!r}")
    return lengths


def _batches(text: str | None) -> tuple[int, int] | None:
    """``--batches SMALL,LARGE``: the two batch sizes a row's bytes a token are the slope
    between, its time a token taken at the larger; None (not given): the bench's own."""
    if text is None:
        return None
    pair = _comma_ints(text)
    if len(pair) != 2 or not 1 <= pair[0] < pair[1]:
        raise ValueError(f"--batches: expected two batch sizes, the smaller first, like 3,5; "
                         f"got {text!r}")  # fmt: skip
    return pair


def _given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among ``names`` (parameter names) given on the command line, as spelled there:
    an option one model kind does not read is refused when given, whatever its value, never
    ignored."""
    # by the source's name: typer's own copy of click may not be the click on the path
    unset = ("DEFAULT", "DEFAULT_MAP")
    return [
        param.opts[0]
        for param in ctx.command.params
        if param.name in names and ctx.get_parameter_source(param.name).name not in unset
    ]


# the options of `dsq bench step|memory` that only a transformers model reads
TRANSFORMERS_ONLY = ("seq_lens", "heads", "kv_heads", "threads", "rounds")


def _transformers_only(given: list[str]) -> None:
    if given:
        raise ValueError(f"{', '.join(given)}: for the transformers models only (--model llama, "
                         "gpt2 or bert); leave it out for fairseq")  # fmt: skip


def _scopes_for(scopes: str, model: str) -> list[str]:
    """The ``--scopes`` given, each a bench scope; one running MLPs in slices (quant.mlp=sliced)
    needs a model with Llama-style MLPs."""
    from dsq_cli.bench.step import SCOPES

    chosen = _choices("--scopes", scopes, tuple(SCOPES))
    sliced = [scope for scope in chosen if SCOPES[scope].get("mlp") == "sliced"]
    if sliced and model != "llama":
        which = "it" if len(sliced) == 1 else "them"
        raise ValueError(f"--scopes {','.join(sliced)}: Llama-style MLPs only (--model llama); "
                         f"leave {which} out for {model}")  # fmt: skip
    return chosen


def _transformers_bench(model, presets, layers, width, heads, kv_heads, vocab, seq_lens,
                        scopes, checkpointing, repeats, budget, threads, refused,
                        loss_chunk=None, rounds=1, where=False, batches=None,
                        breakdown=False):  # fmt: skip
    """The rows of ``dsq bench memory|step --model llama|gpt2|bert``; ``refused`` lists the
    fairseq-only options given, a usage error; ``loss_chunk`` None: the model's own loss;
    ``where``: what each row holds at its peak; ``batches``: the two batch sizes, or None
    (`transformers_models.run`); ``breakdown``: where each row's step spends its time."""
    from dsq_cli.bench import memory, transformers_models

    if model not in transformers_models.MODELS:
        choices = ["fairseq", *transformers_models.MODELS]
        raise ValueError(f"--model {model!r}: choose one of {choices}")
    if refused:
        raise ValueError(f"{', '.join(refused)}: for --model fairseq only; leave it out for "
                         f"{model}")  # fmt: skip
    heads = heads or max(1, width // 64)
    kv_heads = kv_heads or heads
    if width % heads or heads % kv_heads or (model != "llama" and kv_heads != heads):
        raise ValueError(
            f"--heads {heads} / --kv-heads {kv_heads} do not fit width {width}: the heads must "
            "divide the width, the key/value heads the heads (and equal them but for llama)"
        )
    lengths = _seq_lens(seq_lens)
    shape = transformers_models.ModelShape(model, layers, width, heads, kv_heads, vocab)
    scope_list = _scopes_for(scopes, model)
    rows = transformers_models.rows_of(
        _preset_names(presets), scope_list, _variant_options(checkpointing)
    )
    if loss_chunk and model not in transformers_models.CAUSAL:
        raise ValueError(
            f"--loss-chunk takes a causal LM's output layer in chunks "
            f"({list(transformers_models.CAUSAL)}); leave it out for {model}"
        )
    return transformers_models.run(shape, rows, lengths, memory.parse_size(budget), repeats,
                                   threads=threads, loss_chunk=loss_chunk or 0,
                                   rounds=rounds, where=where,
                                   batches=_batches(batches), breakdown=breakdown)  # fmt: skip


BATCHES_OPTION = typer.Option(
    None,
    help="transformers models: the two batch sizes, in sequences, whose peaks' slope is a row's "
    "bytes a token and at the larger of which its time a token is taken, the smaller first "
    "(default 2,3; 4,8 below 512 tokens a sequence). Larger ones check that both peaks lie "
    "where a large batch's does, and time the batches a budget holds (docs/benchmarks.md, "
    '"The held row: what it fits against autocast + checkpointing").',
)


LOSS_CHUNK_OPTION = typer.Option(
    None,
    min=0,
    help="Tokens per chunk of the output layer and its loss (0: the whole batch at once); dsq "
    "train's train.loss_chunk_tokens. Default: 1024 for fairseq; for a causal LM from "
    "transformers (llama, gpt2), its own loss.",
)


SCOPES_OPTION = typer.Option(
    "gemm,all",
    help="Comma-separated stash scopes of every patched preset: gemm (GEMM inputs only, the "
    "paper's), all (every saved activation, each kind by quant.saved's defaults), all-q1 "
    "(every saved activation in the stash, q1), all-held (all, and under checkpointing each "
    "checkpointed layer's input held in bfp8: quant.saved.checkpoint=bfp8), all-derivative3 "
    "(all, SiLU and GELU modules holding 3-bit derivative codes: "
    "quant.saved.activation=derivative3), sliced (gemm, Llama-style MLPs a slice of tokens at a "
    "time: quant.mlp=sliced), all-held-sliced (all-held and quant.mlp=sliced) and all-held-sdpa "
    "(all-held-sliced, the attention in torch's fused kernel in bf16: "
    "quant.attention=sdpa_bf16).",
)


@bench_app.command("step")
@usage_errors
def bench_step(
    ctx: typer.Context,
    presets: str = typer.Option(
        "fp32,amp_bf16,bfp8,dsq",
        help="Comma-separated quant presets (conf/quant/). Every row is reported as a multiple "
        "of fp32's and amp_bf16's (torch.autocast bf16) where those are among them.",
    ),
    layers: int = typer.Option(3, min=1, help="Encoder and decoder layers."),
    width: int = typer.Option(256, min=64, help="Model width (heads of 64)."),
    tokens: int = typer.Option(2048, min=16, help="Source tokens per batch."),
    src_len: int = typer.Option(32, min=2, help="Sentence length."),
    vocab: int = typer.Option(8000, min=16, help="Vocabulary size (source and target)."),
    repeats: int = typer.Option(5, min=1, help="Timed steps per row (median reported)."),
    scopes: str = SCOPES_OPTION,
    gemm_units: str = typer.Option(
        "auto",
        help="Comma-separated quant.gemm_unit settings timed for every patched preset: auto "
        "(each GEMM on the fastest unit exact for its operands, e.g. bf16) and fp32 (every GEMM "
        "in float32).",
    ),
    checkpointing: str = typer.Option(
        "off",
        help="Comma-separated: off, on (every encoder and decoder layer checkpointed, as "
        "train.activation_checkpointing=true), for every preset.",
    ),
    fp32_head: bool = typer.Option(
        False,
        "--fp32-head",
        help="Leave the output projection (width x vocab, the step's largest GEMMs) fp32 in every "
        "row. By default it is quantized as each preset says, as dsq train runs it.",
    ),
    loss_chunk: int | None = LOSS_CHUNK_OPTION,
    model: str = MODEL_OPTION,
    seq_lens: str = SEQ_LENS_OPTION,
    heads: int = HEADS_OPTION,
    kv_heads: int = KV_HEADS_OPTION,
    threads: int = THREADS_OPTION,
    rounds: int = ROUNDS_OPTION,
    batches: str | None = BATCHES_OPTION,
    breakdown: bool = typer.Option(
        False,
        "--breakdown",
        help="Also profile one step per row (a transformers model's: of its larger batch): ms "
        "in GEMMs (per dtype, with their rate against the unit's peak), fused and unfused "
        "attention, quantizers, casts, other operators, the optimizer and Python.",
    ),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Time a training step of a small fairseq transformer per quant preset, stash scope, GEMM
    unit setting and checkpointing, side by side."""
    from dsq.engine.units import SETTINGS
    from dsq_cli.bench import step

    if model != "fairseq":
        from dsq_cli.bench import transformers_models

        refused = _given(ctx, "tokens", "src_len", "gemm_units", "fp32_head")
        refused += ["--device"] * (device != "cpu")
        result = _transformers_bench(model, presets, layers, width, heads, kv_heads, vocab,
                                     seq_lens, scopes, checkpointing, repeats, "4GiB", threads,
                                     refused, loss_chunk, rounds, batches=batches,
                                     breakdown=breakdown)  # fmt: skip
        _print_bench(result, as_json, transformers_models.format_step)
        return
    _transformers_only(_given(ctx, *TRANSFORMERS_ONLY, "batches"))
    names = _preset_names(presets)
    scope_list = _scopes_for(scopes, "fairseq")
    unit_list = _choices("--gemm-units", gemm_units, SETTINGS)
    ckpt = _variant_options(checkpointing)
    _check_device(device)
    result = step.run(
        names, layers, width, tokens, src_len, repeats, vocab, device=device, scopes=scope_list,
        gemm_units=unit_list, checkpointing=ckpt, fp32_head=fp32_head,
        loss_chunk=step.DEFAULT_CHUNK_TOKENS if loss_chunk is None else loss_chunk,
        breakdown=breakdown,
    )  # fmt: skip
    _print_bench(result, as_json, step.format_table)


@bench_app.command("gemm")
@usage_errors
def bench_gemm(
    repeats: int = typer.Option(11, min=1, help="Timed repetitions per GEMM (median reported)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Time quantized GEMMs on the unit their formats allow (bf16 on a CPU with AVX512-BF16)
    beside float32, at the benchmark model's shapes and across sizes."""
    from dsq_cli.bench import gemm

    _check_device(device)
    _print_bench(gemm.run(repeats, device), as_json, gemm.format_table)


@bench_app.command("attention")
@usage_errors
def bench_attention(
    seq_lens: str = typer.Option("1024,2048", help="Comma-separated tokens a sequence."),
    batch: int = typer.Option(1, min=1, help="Sequences."),
    heads: int = typer.Option(8, min=1, help="Query heads."),
    kv_heads: int = typer.Option(4, min=1, help="Key/value heads (grouped-query attention)."),
    head_dim: int = typer.Option(64, min=1, help="Values a head."),
    preset: str = typer.Option("dsq", help="The quant preset whose formats DSQ's attention runs."),
    repeats: int = typer.Option(5, min=1, help="Timed passes a row (median reported)."),
    explicit_up_to: int = typer.Option(
        2048, min=0, help="Time the explicit path (N x N probabilities) up to this length."
    ),
    threads: int = typer.Option(0, min=0, help="Threads (0: torch's)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """Time DSQ's attention, forward and backward, tiled and explicit, beside SDPA under bf16
    autocast, side by side in one run."""
    import torch

    from dsq_cli.bench import attention

    lengths = _seq_lens(seq_lens)
    names = _preset_names(preset)
    if len(names) != 1:
        raise ValueError(f"--preset: name one quant preset, got {preset!r}")
    _check_device(device)
    if threads:
        torch.set_num_threads(threads)
    result = attention.run(lengths, batch, heads, kv_heads, head_dim, names[0], repeats, device,
                           explicit_up_to)  # fmt: skip
    _print_bench(result, as_json, attention.format_table)


@bench_app.command("memory")
@usage_errors
def bench_memory(
    ctx: typer.Context,
    budget: str = typer.Option(
        ..., help="Memory for one training step: 2GiB, 512MiB, 1.5GB (KiB/MiB/GiB: 1024)."
    ),
    presets: str = typer.Option(
        "fp32,amp_bf16,dsq",
        help="Comma-separated quant presets (conf/quant/). Every row is reported as a multiple "
        "of fp32's and amp_bf16's (torch.autocast bf16) where those are among them.",
    ),
    layers: int = typer.Option(3, min=1, help="Encoder and decoder layers."),
    width: int = typer.Option(256, min=64, help="Model width (heads of 64)."),
    src_len: int = typer.Option(32, min=2, help="Sentence length."),
    vocab: int = typer.Option(8000, min=16, help="Vocabulary size (source and target)."),
    scopes: str = SCOPES_OPTION,
    checkpointing: str = typer.Option(
        "off", help="Comma-separated: off, on (every layer checkpointed), for every preset."
    ),
    fp32_head: bool = typer.Option(
        False, "--fp32-head", help="Leave the output projection fp32 in every row."
    ),
    loss_chunk: int | None = LOSS_CHUNK_OPTION,
    model: str = MODEL_OPTION,
    seq_lens: str = SEQ_LENS_OPTION,
    heads: int = HEADS_OPTION,
    kv_heads: int = KV_HEADS_OPTION,
    threads: int = THREADS_OPTION,
    rounds: int = ROUNDS_OPTION,
    repeats: int = typer.Option(2, min=1, help="transformers models: timed steps a row."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    where: bool = typer.Option(
        False,
        "--where",
        help="transformers models: also what each row's larger batch holds at its allocator "
        "peak, by the operators that allocated it, each holder's KiB a token, and the "
        'operators running at the peak (docs/benchmarks.md, "What the checkpointed rows hold '
        'at their peak").',
    ),
    batches: str | None = BATCHES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
):
    """The largest batch (whole sentences) whose training step's peak memory fits the budget,
    per quant preset, stash scope and checkpointing, side by side."""
    from dsq_cli.bench import memory, step

    if model != "fairseq":
        from dsq_cli.bench import transformers_models

        refused = _given(ctx, "src_len", "fp32_head") + ["--device"] * (device != "cpu")
        result = _transformers_bench(model, presets, layers, width, heads, kv_heads, vocab,
                                     seq_lens, scopes, checkpointing, repeats, budget, threads,
                                     refused, loss_chunk, rounds, where, batches)  # fmt: skip
        _print_bench(result, as_json, transformers_models.format_memory)
        return
    _transformers_only(_given(ctx, *TRANSFORMERS_ONLY, "repeats", "where", "batches"))
    size = memory.parse_size(budget)
    names = _preset_names(presets)
    scope_list = _scopes_for(scopes, "fairseq")
    ckpt = _variant_options(checkpointing)
    _check_device(device)
    result = memory.run(
        names, size, layers, width, src_len, vocab, device=device, scopes=scope_list,
        checkpointing=ckpt, fp32_head=fp32_head,
        loss_chunk=step.DEFAULT_CHUNK_TOKENS if loss_chunk is None else loss_chunk,
    )  # fmt: skip
    _print_bench(result, as_json, memory.format_table)


OVERRIDES_HELP = (
    "Hydra overrides: group choices (task=multi30k model=transformer_tiny quant=dsq logger=none) "
    "and keys (train.max_updates=100 quant.q1=bfp3 data.raw_dir=DIR seed=2 resume=RUN_DIR). "
    "resume=RUN_DIR continues a stopped run from its checkpoint_last.pt, or with "
    "resume_from=best from its checkpoint_best.pt (the best validation's; what it logged after "
    "is dropped and trained again). "
    "A scheduled point's ladder moves by its precision policy: plateau (default, DSQ's: "
    "patience, min_delta), cyclic (CPT: periods), shape (Wolfe & Kyrillidis: shape, direction, "
    "periods, exponent, flip_vertically) or pfq (FracTrain: threshold, decay, keep, "
    "scale_windows, turning_points); e.g. quant.q1.policy=cyclic quant.q1.periods=32 "
    "(docs/dsq.md, Precision policies). "
    "Each quantization point q0..q3 rounds to nearest unless told "
    "quant.rounding.q1=stochastic (noise seeded by seed, continued on resume). "
    "quant.gemm_unit=auto (default) runs each quantized GEMM on the fastest unit exact for its "
    "two operands' formats: bf16 (CPUs with AVX512-BF16, GPUs) where both are exact in bf16 "
    "(bfp2..bfp9, bf16, e4m3, e5m2, fixed<=9, the MX formats; NVFP4's scale product is not), "
    "TF32 on GPUs (up to bfp12, fp16), bf16x2 (an "
    "exact split of a fixed16 operand into two bf16 GEMMs, beside a bf16 one) on GPUs and on "
    "CPUs where it pays (AMD EPYC Zen 5), float32 otherwise (fp32, fixed32, and two operands "
    "both wider than bf16, such as fixed16 by fixed16); quant.gemm_unit=fp32 runs "
    "every GEMM in float32. result.json's gemm_units counts the GEMMs per kind and unit. "
    "train.stop_patience=K (default 0: off) ends a run once K validations in a row did not "
    "lower the validation loss; the budget stays the cap. eval.checkpoint=best (default) or "
    "last: the model result.json's value scores (checkpoint_best.pt, the best validation "
    "loss's, or the final model; GLUE: the best or the last dev metric); both are recorded."
)


def _by_family(group: str) -> str:
    """The files of conf/<group>/ by the family they declare: ``translation: demo, ...; glue:
    ...``, read from the files themselves."""
    import yaml

    from dsq_cli.presets import CONF_DIR

    families: dict[str, list[str]] = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        family = (data.get("task") or {}).get("family") if group == "task" else data.get("family")
        families.setdefault(str(family), []).append(path.stem)
    return "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())


def _names(group: str) -> list[str]:
    from dsq_cli.presets import CONF_DIR

    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def _train_help() -> str:
    from dsq_cli.presets import PRESET_ORDER

    return (
        "Train one run with DSQ (fairseq translation, GLUE fine-tuning or a causal language "
        "model) into a new run directory under run.root.\n\n"
        f"Groups: task ({_by_family('task')}); model ({_by_family('model')}); quant "
        f"({', '.join(PRESET_ORDER)}); logger ({', '.join(_names('logger'))}).\n\n"
        "Exit codes: 0 completed, 2 bad config or data or a refused resume, 3 diverged, "
        "130/143 interrupted (continue with resume=RUN_DIR), 1 failed."
    )


@app.command(
    "train",
    help=_train_help(),
    context_settings={"allow_extra_args": False, "ignore_unknown_options": True},
)
@usage_errors
def train_cmd(
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    show_cfg: bool = typer.Option(
        False, "--cfg", help="Print the resolved config and exit without training."
    ),
):
    """Train one run with DSQ into a new run directory under run.root (the groups and exit
    codes below)."""
    from dsq_cli.config import compose, to_yaml
    from dsq_cli.train import family_of, load_resume, quiet_library_warnings, train

    quiet_library_warnings()
    overrides = list(overrides or [])
    resume_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)
    if resume_dir and resume_dir != "null":
        cfg, resume = load_resume(resume_dir, overrides)
    else:
        cfg, resume = compose(overrides), None
    if show_cfg:
        typer.echo(to_yaml(cfg), nl=False)
        return
    outcome = train(cfg, resume=resume)
    if not outcome.main:  # a rank other than 0 under torchrun: rank 0 reports
        raise typer.Exit(outcome.exit_code)
    result = outcome.result
    typer.echo(f"run: {outcome.run_dir}")
    if outcome.status == "completed" and result.stopped_early:
        stop = result.stopped_early
        typer.echo(
            f"stopped early at update {stop['update']}: {stop['reason']}; "
            f"cap {result.budget['total_updates']}"
        )
    if outcome.status == "completed":
        typer.echo(family_of(cfg).completed_line(result))
    else:
        typer.echo(f"{outcome.status}: {result.error or ''}", err=True)
        if outcome.status == "interrupted":
            typer.echo(f"continue with: dsq train resume={outcome.run_dir}", err=True)
    raise typer.Exit(outcome.exit_code)


@app.command("data")
@usage_errors
def data_cmd(
    task: str = typer.Argument(..., help=f"A task (conf/task/): {', '.join(_names('task'))}."),
    overrides: list[str] = typer.Argument(None, help="More overrides, e.g. data.raw_dir=DIR."),
):
    """Prepare a task once into the cache: translation (download or read raw text,
    sentencepiece, binarize); GLUE (download or read and check the TSV files); lm (read and check
    the text; nothing is cached)."""
    from dsq_cli.config import compose
    from dsq_cli.train import family_of, prepare_data

    if task == "roberta_base":
        _roberta_base_data(overrides or [])
        return
    cfg = compose([f"task={task}", *(overrides or [])])
    data = prepare_data(cfg)
    typer.echo(family_of(cfg).data_line(task, data))


def _roberta_base_data(overrides: list[str]) -> None:
    """`dsq data roberta_base`: check a local copy, or say how to fetch one. fairseq publishes no
    SHA-256 for roberta.base or its GPT-2 BPE files, and dsq downloads only pinned files
    (docs/spec.md §7), so it prints the commands instead of running them."""
    from dsq_cli.config import compose
    from dsq_cli.models.encoders import check_available, roberta_base_download_hint

    cfg = compose(["task=sst2", "model=roberta_base", *overrides])
    folder = cfg.model.checkpoint
    if folder is not None and Path(folder).is_dir():
        typer.echo(f"roberta_base: {check_available(cfg.model)} (model.pt, dict.txt, BPE files)")
        return
    raise ValueError(
        "fairseq publishes no SHA-256 for roberta.base and dsq downloads only verified files "
        '(docs/spec.md, "Files, downloads and secrets"); fetch it yourself: '
        f"{roberta_base_download_hint(folder)}; then run "
        f"with model.checkpoint={folder}"
    )


# dsq table's option help, kept apart so that the command reads as its options and one call
_TABLE_HELP = {
    "paths": "Run directories or roots searched recursively for result.json (default: runs).",
    "format": "markdown | csv | latex | json",
    "out": "Write the table to FILE instead of stdout.",
    "plot": "Also draw metric against arithmetic and DRAM ratio to FILE.png.",
    "wandb": "Also log the table (and --plot) as a wandb run, job_type table.",
    "moves": "After the table, list each scheduled run's formats over its updates and its mean "
    "stash bits (markdown; json: under moves).",
    "frontier": "After the table, list per task and cost ratio the rows on the Pareto frontier, "
    "what dominates each other row, and whether that holds within the seeds' intervals "
    "(markdown; json: under frontier).",
    "runs": "After the table, one line per run: its stash moves, best validation loss and "
    "update, the metric of its best checkpoint and last model, its cost (markdown; json carries "
    "each run under cells).",
    "checkpoint": "best | last: every run's metric from that model (result.json's checkpoints) "
    "instead of its own headline value (its eval.checkpoint).",
    "against": "A row (e.g. fp32) every other row is compared with seed by seed: the paired "
    "difference in the metric and in best validation loss, with its interval.",
    "level": "Confidence level of every interval (Student t over seeds); 0.90 gives the "
    "intervals of two one-sided equivalence tests at 5%.",
    "margin": "With --against: equivalence margins stated in advance, the metric's and the best "
    "validation loss's (e.g. 0.5,0.02); each paired interval inside ± its margin reads "
    "'equivalent' (two one-sided tests; --level 0.90 for 5% each), else 'not shown'.",
    "endpoint": "The loss rows are compared by: best-loss (the best validation loss of the run) "
    'or last-loss (the last model\'s, whose paired spread is smaller; docs/table.md, "Endpoints").',
    "adjust": "With --against: none, or holm (each p-value adjusted by Holm's method within its "
    "block, one column's comparisons in one measure).",
    "rows": "Only these rows, comma-separated without spaces (e.g. dsq,dsq_stash_bfp3), and "
    "--against's; --frontier is then the frontier among them.",
}


def _table_option(default, *flags, name: str, **kwargs):
    return typer.Option(default, *flags, help=_TABLE_HELP[name], **kwargs)


@app.command("table")
@usage_errors
def table_cmd(
    paths: list[str] = typer.Argument(None, help=_TABLE_HELP["paths"]),
    fmt: str = _table_option("markdown", "--format", name="format"),
    out: str = _table_option(None, "--out", name="out"),
    plot: str = _table_option(None, "--plot", name="plot"),
    use_wandb: bool = _table_option(False, "--wandb", name="wandb"),
    wandb_project: str = typer.Option("dsq", help="wandb project for --wandb."),
    wandb_dir: str = typer.Option(".", help="Where --wandb writes its files (DIR/wandb)."),
    moves: bool = _table_option(False, "--moves", name="moves"),
    frontier: bool = _table_option(False, "--frontier", name="frontier"),
    every_run: bool = _table_option(False, "--runs", name="runs"),
    checkpoint: str = _table_option(None, "--checkpoint", name="checkpoint", show_default=False),
    against: str = _table_option(None, "--against", name="against", show_default=False),
    level: float = _table_option(0.95, "--level", name="level"),
    margin: str = _table_option(None, "--margin", name="margin", show_default=False),
    endpoint: str = _table_option("best-loss", "--endpoint", name="endpoint"),
    adjust: str = _table_option("none", "--adjust", name="adjust"),
    rows: str = _table_option(None, "--rows", name="rows", show_default=False),
):
    """The paper's Table 1 from runs' result.json: presets as rows, tasks as columns
    (docs/table.md).

    Runs that diverged, were interrupted or are running show as such; an unreadable result.json
    is named on stderr and skipped. No runs found: exit 2.
    """
    from dsq.atomic_files import write_atomic
    from dsq_cli import table

    if plot is not None and not plot.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG; {plot!r} does not end in .png")
    request = table.TableRequest(
        paths=paths or ["runs"], checkpoint=checkpoint, fmt=fmt, level=level, against=against,
        rows=None if rows is None else table.split_rows(rows), endpoint=endpoint, adjust=adjust,
        margins=None if margin is None else table.split_margins(margin), moves=moves,
        frontier=frontier, every_run=every_run,
    )  # fmt: skip
    made = table.make_table(request)
    for warning in made.table.warnings:
        typer.echo(f"dsq: warning: {warning}", err=True)
    if out is None:
        typer.echo(made.text, nl=False)
    else:
        write_atomic(out, made.text)
        typer.echo(f"table: {out}")
    if plot is not None:
        from dsq_cli.plots import plot_frontier

        typer.echo(f"plot: {plot_frontier(made.table, plot)}", err=out is None)
    if use_wandb:
        wandb_run = table.log_to_wandb(made.table, wandb_project, wandb_dir, plot)
        typer.echo(f"wandb: {wandb_run.dir}", err=out is None)


@app.command("plot")
@usage_errors
def plot_cmd(
    run_dir: str = typer.Argument(..., help="A run directory (with metrics.jsonl)."),
    out: str = typer.Option(None, "--out", help="The PNG to write (default RUN_DIR/plot.png)."),
):
    """Plot a run: bits per value in force at q0..q3 and the loss over updates."""
    from dsq_cli.plots import plot_run

    typer.echo(f"plot: {plot_run(run_dir, out)}")


@app.command(
    "cost",
    context_settings={"allow_extra_args": False, "ignore_unknown_options": True},
)
@usage_errors
def cost_cmd(
    overrides: list[str] = typer.Argument(
        None,
        help="Hydra overrides choosing the model and the quant points: model=transformer_iwslt "
        "quant=dsq quant.q1=bfp3 task=iwslt17 (the task gives the default --vocab).",
        show_default=False,
    ),
    baseline: str = typer.Option(
        COST_BASELINE, "--baseline", help="The quant preset (conf/quant/) the ratios are against."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    cost_model: str = typer.Option(
        "default",
        "--cost-model",
        help="Coefficients from conf/cost/NAME.yaml: default, additive, elementwise_fp32.",
    ),
    tokens: int = typer.Option(4096, "--tokens", help="Source tokens per batch."),
    src_len: int = typer.Option(32, "--src-len", help="Source sentence length."),
    tgt_len: int = typer.Option(None, "--tgt-len", help="Target sentence length [--src-len]."),
    vocab: int = typer.Option(
        None, "--vocab", help="Output vocabulary (the task's data.vocab_size by default)."
    ),
):
    """Arithmetic and DRAM cost of one training step as ratios to a baseline, derived from the
    model config and batch shape: no data, no training (docs/cost-model.md).

    Scheduled points are priced at their first level; the ratios at the last levels follow.
    The coefficients and rules are derived in docs/cost-model.md.
    """
    from omegaconf import OmegaConf

    from dsq_cli.config import compose
    from dsq_cli.cost import baseline_points, load_cost_model
    from dsq_cli.cost.report import cost_report, format_report
    from dsq_cli.train import family_of

    # unknown names: one line listing the choices, before any work
    for option, check, name in (
        ("--cost-model", load_cost_model, cost_model),
        ("--baseline", baseline_points, baseline),
    ):
        try:
            check(name)
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    cfg = compose(list(overrides or []))
    family_of(cfg).check_priceable(cfg)  # a family whose models dsq cost cannot derive says so
    tweaked = [o for o in overrides or [] if o.lstrip("+~").startswith("quant.")]
    quant_name = cfg.choices.quant + (f" ({' '.join(tweaked)})" if tweaked else "")
    report = cost_report(
        OmegaConf.to_container(cfg.model, resolve=True),
        OmegaConf.to_container(cfg.quant, resolve=True),
        quant_name=quant_name,
        baseline=baseline,
        cost_model=cost_model,
        tokens=tokens,
        src_len=src_len,
        tgt_len=tgt_len,
        vocab=cfg.data.vocab_size if vocab is None else vocab,
        vocab_from=(
            f"task {cfg.choices.task}'s data.vocab_size; --vocab N to change"
            if vocab is None
            else "--vocab"
        ),
    )
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        typer.echo(format_report(report))


@app.command("sweep", context_settings={"ignore_unknown_options": True})
@usage_errors
def sweep_cmd(
    overrides: list[str] = typer.Argument(
        None,
        help="dsq train overrides with Hydra sweep syntax (quant=fp32,dsq seed=1,2), "
        "run.root=ROOT (the sweep root), launcher=local|joblib|slurm, launcher.n_jobs=N, "
        "launcher.partition=P launcher.gpus_per_node=G launcher.timeout_min=T (Slurm).",
        show_default=False,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the jobs without running them."),
    force: bool = typer.Option(
        False, "--force", help="Run jobs that completed earlier again (the old runs are kept)."
    ),
    resume_unfinished: bool = typer.Option(
        False,
        "--resume-unfinished",
        help="Continue each job whose run stopped unfinished (interrupted, or left 'running' by "
        "a killed process) from its checkpoint instead of running it again. Only when no other "
        "process still runs it. A run whose checkpoint a resume found unreadable is reported "
        "failed and left for you (dsq train resume=RUN_DIR resume_from=best, or --force).",
    ),
):
    """Run a grid of dsq train jobs under one root, then print the dsq table of that root.

    A failed job does not stop the others; rerunning the same sweep skips completed jobs.
    """
    from dsq_cli import sweep

    overrides = list(overrides or [])
    if dry_run:
        root, launcher, options, jobs = sweep.plan(overrides)
        sbatch = ""
        if launcher == "slurm":  # rendered without a cluster: an invalid config fails here
            sbatch = sweep.slurm_sbatch(sweep.slurm_config(root, options), "dsq train ...")
        typer.echo(f"{len(jobs)} job{'s' * (len(jobs) != 1)} under {root} (launcher={launcher}):")
        if sbatch:
            typer.echo("  " + "\n  ".join(ln for ln in sbatch.splitlines() if "#SBATCH" in ln))
        for job in jobs:
            typer.echo(f"  {job.name}: dsq train {' '.join(job.overrides)} run.dir={job.run_dir}")
        return
    root, jobs = sweep.run(overrides, force=force, resume_unfinished=resume_unfinished)
    typer.echo(sweep.summary(jobs))
    from dsq_cli import table

    try:
        typer.echo("\n" + table.render(table.collect([str(root)]), "markdown"))
    except ValueError as err:  # no job produced a run
        typer.echo(f"no table: {err}", err=True)
    if any(j.status not in sweep.NOT_FAILED for j in jobs):
        raise typer.Exit(1)


def _reflowed(doc: str) -> str:
    """A docstring as help: each paragraph's source lines joined into one, so that the help's
    sentences wrap at the terminal's width, not where the source lines end."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


for _app in (app, bench_app):
    for _command in _app.registered_commands:
        if _command.help is None and _command.callback is not None and _command.callback.__doc__:
            _command.help = _reflowed(_command.callback.__doc__)


if __name__ == "__main__":  # pragma: no cover
    app()
