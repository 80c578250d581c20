"""``dsq bench memory|step --model llama|gpt2|bert``: a training step of a ``transformers`` model
built from a config (random init, no download), per row, at several sequence lengths.

Rows, as users would train instead of dsq or with it: fp32; amp_bf16 (the unpatched model under
``torch.autocast`` in bf16); either of them with the model's own gradient checkpointing
(``gradient_checkpointing_enable``, non-reentrant); each preset of the dsq engine at each stash
scope, with and without that checkpointing. A step is Adam on the model's own loss (causal LM:
next-token; BERT: masked LM on every token), on random token ids.

Each (row, sequence length, batch size) runs in a fresh process, so that the process's peak
resident memory (``ru_maxrss``) is that step's alone; it runs one step to warm up, ``repeats``
timed steps, and one more measured by the allocator (`step.allocated_during`: what was live
before it, parameters and Adam's state, plus the most its forward and backward passes held at
once; the optimizer step's own peak, which does not grow with the batch, beside it). Memory
per token is the difference of two batch sizes' peaks over the difference of their tokens, so
that what does not grow with the batch (the model, the optimizer, the libraries) cancels; tokens
at a budget extrapolate that line. Both peaks are reported: they differ where the allocator's
tensors are not all the process holds (the C library's heap, freed memory kept for reuse), so
the process's figure depends on the malloc setting (``DSQ_CPU_ALLOCATOR``; the result names
the one each row's process had in force): ``release`` gives each large block back when freed,
and there the two agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from dsq_cli.cpu_allocator import apply_malloc_setting
from dsq_cli.models.causal_lm import KINDS, build_causal_lm

from .peak_holders import per_token

MODELS = ("llama", "gpt2", "bert")
CAUSAL = KINDS  # the models whose output layer and loss `--loss-chunk` may take in chunks
KIB = 2**10


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model built from a config: layers, width, heads, key/value heads (Llama's grouped
    query attention; GPT-2 and BERT have as many as heads) and vocabulary."""

    kind: str = "llama"
    layers: int = 6
    width: int = 512
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 8000

    def build(self, seq_len: int) -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        if self.kind in KINDS:
            return build_causal_lm(self.kind, vocab=self.vocab, layers=self.layers,
                                   width=self.width, heads=self.heads, kv_heads=self.kv_heads,
                                   seq_len=seq_len)  # fmt: skip
        if self.kind == "bert":
            config = transformers.BertConfig(
                vocab_size=self.vocab, hidden_size=self.width, num_hidden_layers=self.layers,
                num_attention_heads=self.heads, intermediate_size=4 * self.width,
                max_position_embeddings=seq_len,
            )  # fmt: skip
            return transformers.BertForMaskedLM._from_config(config, attn_implementation="sdpa")
        raise ValueError(f"--model {self.kind!r}: choose fairseq or one of {MODELS}")


@dataclasses.dataclass(frozen=True)
class Row:
    """A row: its preset, stash scope (patched presets) and whether the model checkpoints."""

    preset: str
    scope: str = "gemm"
    checkpointing: bool = False

    @property
    def label(self) -> str:
        parts = [self.preset] + ([self.scope] if self.scope != "gemm" else [])
        return " ".join(parts + (["ckpt"] if self.checkpointing else []))


def rows_of(presets, scopes, checkpointing) -> list[Row]:
    """Every preset at every scope (a preset the engine does not patch: one) and checkpointing
    setting asked for, in that order."""
    from dsq_cli.presets import load_quant_preset

    rows = []
    for preset in presets:
        patched = preset != "fp32" and load_quant_preset(preset).get("engine", "dsq") == "dsq"
        for scope in scopes if patched else ("gemm",):
            rows += [Row(preset, scope, ckpt) for ckpt in checkpointing]
    return rows


def measure(shape: ModelShape, row: Row, seq_len: int, batch: int, repeats: int,
            loss_chunk: int = 0, where: bool = False, breakdown: bool = False) -> dict:  # fmt: skip
    """In this process: the step's median time, allocator peak and the process's peak resident
    memory (see the module docstring). ``loss_chunk`` tokens (a causal LM): the output layer and
    its next-token loss in chunks (`chunked_output_loss`), as ``dsq train task=lm`` takes them;
    0: the model's own loss. ``where``: also what the passes hold at their peak, by holder, and
    the operators running then (`peak_holders`). ``breakdown``: also one more step profiled
    (`breakdown.profile_step`), after every figure above was taken."""
    from dsq.engine import QuantConfig
    from dsq.integrations import quantize_model
    from dsq_cli.presets import at_first_level, load_quant_preset

    from .peak_holders import holders_at_peak
    from .step import allocated_during, scope_points

    malloc = apply_malloc_setting() or "none applied"  # as `dsq train` runs (DSQ_CPU_ALLOCATOR)
    points = at_first_level(load_quant_preset(row.preset)) | scope_points(row.scope)
    cfg = QuantConfig.from_dict(points)
    model = shape.build(seq_len)
    if row.preset != "fp32" and cfg.engine == "dsq":
        quantize_model(model, cfg)
    if row.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, shape.vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)
    )
    losses = []

    def forward_backward():
        optimizer.zero_grad(set_to_none=True)
        dtype = cfg.autocast_dtype
        with torch.autocast("cpu", dtype or torch.float32, enabled=dtype is not None):
            loss = (_chunked_loss(model, ids, loss_chunk) if loss_chunk
                    else model(input_ids=ids, labels=ids).loss)  # fmt: skip
        loss.backward()
        losses.append(float(loss))

    def step():
        forward_backward()
        optimizer.step()

    step()  # warm-up: Adam's state, first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    state = sum(t.numel() * t.element_size() for t in model.parameters())
    state += sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    # the process's peak of the steps, read before the profiler runs: its records of every
    # allocation are the process's memory too, and dsq's many small operations made them tens
    # of KiB a token of the figure
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    # the forward and backward passes, whose peak grows with the tokens, and the optimizer step
    # after them, whose peak (the gradients, Adam's temporaries) does not: a slope through whole
    # steps' peaks would mix the two where a small batch peaks in the optimizer step
    cpu = torch.device("cpu")
    passes = (holders_at_peak(forward_backward) if where
              else allocated_during(forward_backward, cpu))  # fmt: skip
    update = allocated_during(optimizer.step, cpu)
    before = [("before the step: the parameters and Adam's state", state)]
    found = {"held_at_peak": before + passes.holders, "peak_at": passes.at} if where else {}
    if breakdown:
        from .breakdown import profile_step

        found["breakdown"] = profile_step(lambda _: step(), None)
    return found | {
        "step_s": statistics.median(times),
        "allocator_bytes": state + passes.peak,
        "optimizer_step_bytes": state + passes.held + update.peak,
        "rss_bytes": rss_bytes,
        "cpu_allocator": malloc,
        "first_loss": losses[0],
    }


def _chunked_loss(model, ids, chunk_tokens: int) -> torch.Tensor:
    """The mean next-token cross-entropy of ``ids``, the output layer and its loss a chunk of
    tokens at a time (the model's own loss's values, up to float32 summation order)."""
    from dsq.engine.chunked_output import chunked_output_loss
    from dsq_cli.models.causal_lm import body_and_head

    body, head = body_and_head(model)
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = ids[:, 1:].reshape(-1)
    (total,) = chunked_output_loss(
        hidden.reshape(-1, hidden.shape[-1]), head,
        lambda logits, target: torch.nn.functional.cross_entropy(logits.float(), target,
                                                                 reduction="sum"),
        targets, list(head.parameters()), chunk_tokens,
    )  # fmt: skip
    return total / targets.numel()


def measure_in_fresh_process(shape, row, seq_len, batch, repeats, threads, *,
                             loss_chunk: int = 0, where: bool = False,
                             breakdown: bool = False) -> dict:  # fmt: skip
    spec = {"shape": dataclasses.asdict(shape), "row": dataclasses.asdict(row),
            "seq_len": seq_len, "batch": batch, "repeats": repeats,
            "loss_chunk": loss_chunk, "where": where, "breakdown": breakdown}  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-m", "dsq_cli.bench.transformers_models", json.dumps(spec)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"{row.label} at {seq_len} x {batch}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(shape: ModelShape, rows: list[Row], seq_lens, budget: int, repeats: int = 2,
        batches=None, threads: int | None = None, loss_chunk: int = 0,
        rounds: int = 1, where: bool = False, breakdown: bool = False) -> dict:  # fmt: skip
    """Every row at every sequence length, each at two batch sizes (``batches``, default 2 and
    3 sequences, 4 and 8 below 512 tokens): per token, the allocator's and the process's bytes
    (the slope between the two), time (the larger batch's step over its tokens), and tokens at
    ``budget`` (the line through the two peaks, whole sequences). Not 1 and 2 sequences: with
    checkpointing, one sequence's passes peak at the end of the backward pass (the parameters'
    gradients), more sequences' at the loss, and a slope across the two phases is no bytes a
    token (measured: 56 KiB a token from 1 to 2 sequences of 1,024, 110 from 2 to 3).

    ``rounds`` > 1 measures every row that many times, the rows taking turns, because one row's
    processes run after another's and a row's time moves with the host's speed between them:
    the time a token is the median over the rounds, each ratio to a baseline the median of the
    rounds' ratios; the bytes are the first round's.

    ``where``: each row also says what its larger batch holds at the peak, by holder, each
    holder's growth a token from the smaller batch, and the operators running at the peak (the
    first round's; `peak_holders`).

    ``breakdown``: where one step of each row's larger batch spends its time, by kind of
    operator (`breakdown`; the first round's), beside the bf16 and float32 units' peaks here on
    as many threads."""
    threads = threads or torch.get_num_threads()
    results, settings = [], set()
    for seq_len in seq_lens:
        small, large = batches or ((4, 8) if seq_len < 512 else (2, 3))
        measured: dict[Row, list] = {row: [] for row in rows}
        for round_index in range(rounds):
            for row in rows:  # the peak's holders from the first round, whose bytes are used
                first = not round_index
                measured[row].append(tuple(
                    measure_in_fresh_process(shape, row, seq_len, batch, repeats, threads,
                                             loss_chunk=loss_chunk, where=where and first,
                                             breakdown=breakdown and first and batch == large)
                    for batch in (small, large)
                ))  # fmt: skip
        settings |= {m.get("cpu_allocator", "?") for pairs in measured.values()
                     for pair in pairs for m in pair if "error" not in m}  # fmt: skip
        for row in rows:
            entry = {"row": row.label, "seq_len": seq_len, "batches": [small, large]}
            errors = [m["error"] for pair in measured[row] for m in pair if "error" in m]
            if errors:
                results.append(entry | {"error": errors[0]})
                continue
            a, b = measured[row][0]
            tokens = (large - small) * seq_len
            for key, name in (("allocator_bytes", "allocator"), ("rss_bytes", "rss")):
                slope = (b[key] - a[key]) / tokens
                fixed = a[key] - slope * small * seq_len
                entry[f"{name}_kib_per_token"] = slope / KIB
                # no line to extrapolate where the peak did not grow with the batch (a process
                # peak below a page's resolution on a tiny model): no figure, not infinity
                fits = (budget - fixed) / slope if slope > 0 else None
                entry[f"{name}_tokens_at_budget"] = (
                    None if fits is None else max(0, int(fits // seq_len) * seq_len)
                )
            # the optimizer step's peak (it does not grow with the batch; the tokens at a budget
            # above assume the passes' peak is the step's)
            entry["optimizer_step_mib"] = b.get("optimizer_step_bytes", 0) / 2**20
            per_round = [pair[1]["step_s"] * 1e3 / (large * seq_len) for pair in measured[row]]
            entry["ms_per_token"] = statistics.median(per_round)
            entry["ms_per_token_rounds"] = per_round
            entry["first_loss"] = b["first_loss"]
            if "breakdown" in b:
                entry["breakdown"] = b["breakdown"]
            if where:
                entry["peak_at"] = list(b["peak_at"])
                entry["peak_at_smaller_batch"] = list(a["peak_at"])
                entry["held_at_peak"] = per_token(
                    [tuple(h) for h in a["held_at_peak"]],
                    [tuple(h) for h in b["held_at_peak"]],
                    tokens,
                )
            results.append(entry)
    _ratios(results)
    from .quant import machine_description

    extra = {"unit_peaks": _unit_peaks(threads)} if breakdown else {}
    return extra | {
        "model": dataclasses.asdict(shape),
        "budget_bytes": budget,
        "repeats": repeats,
        "rounds": rounds,
        "threads": threads,
        "loss_chunk": loss_chunk,
        # the malloc setting the rows' processes had in force (one, or each that occurred)
        "cpu_allocator": ", ".join(sorted(settings)),
        "machine": machine_description(torch.device("cpu")).rsplit(",", 1)[0],
        "torch": torch.__version__,
        "rows": results,
    }


def _unit_peaks(threads: int) -> dict[str, float]:
    """The bf16 and float32 units' peaks (`breakdown.unit_peaks`) on the rows' threads."""
    from .breakdown import unit_peaks

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return unit_peaks(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)


BASELINES = ("amp_bf16", "amp_bf16 ckpt")


def _ratios(results: list[dict]) -> None:
    """Each row's bytes per token, tokens at the budget and time per token over amp_bf16's and
    amp_bf16 ckpt's at the same sequence length, where those rows ran."""
    for entry in results:
        for base_name in BASELINES:
            same = [r for r in results if r["seq_len"] == entry["seq_len"] and "error" not in r]
            base = next((r for r in same if r["row"] == base_name), None)
            if base is None or "error" in entry:
                continue
            tag = base_name.replace(" ", "_")
            for key in ("allocator_kib_per_token", "rss_kib_per_token",
                        "allocator_tokens_at_budget", "rss_tokens_at_budget"):  # fmt: skip
                known = entry[key] is not None and base[key]
                entry[f"{key}_x_{tag}"] = entry[key] / base[key] if known else None
            # each round's time over the baseline's in the same round, their median
            pairs = zip(entry["ms_per_token_rounds"], base["ms_per_token_rounds"], strict=True)
            entry["ms_per_token_x_" + tag] = statistics.median(m / t for m, t in pairs)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tokens(value) -> str:
    return "-" if value is None else f"{value:,}"


def _grid(result: dict, header: list[str], cells) -> str:
    """A markdown table of ``result``'s rows: the row, its sequence length, then ``cells(row)``
    (or the row's error), and the footer."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for r in result["rows"]:
        texts = [f"error: {r['error']}"] if "error" in r else cells(r)
        lines.append("| " + " | ".join([r["row"], str(r["seq_len"]), *texts]) + " |")
    return "\n".join(lines + ["", _footer(result)])


def format_memory(result: dict) -> str:
    gib = result["budget_bytes"] / 2**30
    header = ["row", "seq", "KiB/token (allocator)", "KiB/token (process)",
              f"tokens in {gib:g} GiB (allocator)", "x amp_bf16", "x amp_bf16 ckpt",
              "tokens (process)", "x amp_bf16", "x amp_bf16 ckpt"]  # fmt: skip
    table = _grid(result, header, lambda r: [
        f"{r['allocator_kib_per_token']:.1f}", f"{r['rss_kib_per_token']:.1f}",
        _tokens(r["allocator_tokens_at_budget"]),
        _x(r.get("allocator_tokens_at_budget_x_amp_bf16")),
        _x(r.get("allocator_tokens_at_budget_x_amp_bf16_ckpt")),
        _tokens(r["rss_tokens_at_budget"]), _x(r.get("rss_tokens_at_budget_x_amp_bf16")),
        _x(r.get("rss_tokens_at_budget_x_amp_bf16_ckpt")),
    ])  # fmt: skip
    return "\n\n".join([table, *(_where(r) for r in result["rows"] if "held_at_peak" in r)])


def _where(row: dict) -> str:
    """A row's peak (`peak_holders`): where it is, and what its larger batch holds there."""
    small, large = row["batches"]
    lines = [f"{row['row']} at {row['seq_len']:,} tokens a sequence: the peak of {large} "
             f"sequences is in {' > '.join(row['peak_at']) or 'the step'}",
             "",
             f"| held at the peak, by the operators that allocated it | MiB | KiB a token, "
             f"{small} to {large} sequences |",
             "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {h['held']} | {h['mib']:.1f} | {round(h['kib_per_token'], 2) + 0.0:.2f} |"
              for h in row["held_at_peak"]]  # fmt: skip
    elsewhere = row.get("peak_at_smaller_batch", row["peak_at"])
    if elsewhere != row["peak_at"]:
        lines += ["", f"The peak of {small} sequences is elsewhere, in {' > '.join(elsewhere)}: "
                      "a holder's KiB a token compares two instants of the step."]  # fmt: skip
    return "\n".join(lines)


def format_step(result: dict) -> str:
    header = ["row", "seq", "ms/token", "x amp_bf16", "x amp_bf16 ckpt", "loss, first step"]
    table = _grid(result, header, lambda r: [
        f"{r['ms_per_token']:.3f}", _x(r.get("ms_per_token_x_amp_bf16")),
        _x(r.get("ms_per_token_x_amp_bf16_ckpt")), f"{r['first_loss']:.4f}",
    ])  # fmt: skip
    if "unit_peaks" not in result:
        return table
    from .breakdown import format_breakdown

    return table + "\n" + format_breakdown(result)


def _footer(result: dict) -> str:
    m = result["model"]
    return (
        f"{m['kind']}: {m['layers']} layers, width {m['width']}, {m['heads']} heads "
        f"({m['kv_heads']} key/value), vocabulary {m['vocab']}; Adam, {_loss_words(result)}; "
        f"{_batches_words(result['rows'])}"
        f"each row and batch a fresh process; {result['machine']}, {result['threads']} threads, "
        f"torch {result['torch']}; median of {result['repeats']} steps"
        + (f"; malloc setting {result['cpu_allocator']}" if result.get("cpu_allocator") else "")
        + _rounds_words(result.get("rounds", 1))
    )


def _batches_words(rows: list[dict]) -> str:
    """The batch sizes whose peaks each row's bytes a token are the slope between."""
    pairs = sorted({tuple(r["batches"]) for r in rows if "batches" in r})
    if not pairs:
        return ""
    return "batches of " + "; ".join(f"{a} and {b}" for a, b in pairs) + " sequences, "


def _rounds_words(rounds: int) -> str:
    if rounds == 1:
        return ""
    return (f"; {rounds} rounds, the rows taking turns: median time and median ratio over the "
            "rounds, bytes from the first")  # fmt: skip


def _loss_words(result: dict) -> str:
    chunk = result.get("loss_chunk", 0)
    return f"the loss in chunks of {chunk:,} tokens" if chunk else "the model's own loss"


if __name__ == "__main__":  # one measurement, as `measure_in_fresh_process` asks for it
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    measured = measure(ModelShape(**spec["shape"]), Row(**spec["row"]), spec["seq_len"],
                       spec["batch"], spec["repeats"], spec.get("loss_chunk", 0),
                       spec.get("where", False), spec.get("breakdown", False))  # fmt: skip
    print(json.dumps(measured))
