"""Memory measurement behind ``dsq bench step`` and ``dsq bench memory``: the allocator replay
checked against tensors of known size, a step's state and peak on a tiny model, the search for
the largest fitting batch, and budget sizes."""

from __future__ import annotations

import math

import pytest
import torch

from dsq_cli.bench.memory import largest_fitting, parse_size
from dsq_cli.bench.step import Batch, Setup, Variant, allocated_during, replay_peak

CPU = torch.device("cpu")
MIB = 2**20


def test_replay_peak_is_the_maximum_of_the_running_sum():
    assert replay_peak([4, 8, -4, 4, -12]) == 12
    assert replay_peak([-5, 3, 4]) == 2  # a free of something held before counts below zero
    assert replay_peak([-1]) == 0 and replay_peak([]) == 0


def test_cpu_replay_of_tensors_of_known_size():
    def fn():
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(2**21)  # 8 MiB: 12 held
        del a  # 8
        c = torch.empty(2**20)  # 12 again
        del b, c  # 0
        return torch.empty(2**19)  # 2 MiB left alive

    measured = allocated_during(fn, CPU)
    assert measured.peak == 12 * MIB
    assert measured.held == 2 * MIB
    assert measured.out.numel() == 2**19


def test_cpu_replay_sees_a_peak_inside_one_profiled_region():
    """The profiler's events fold what happens inside one region (an operator, or here a
    user annotation) into a net number; the raw records still show the peak inside it."""

    def fn():
        with torch.profiler.record_function("inside"):
            a = torch.empty(2**20)
            b = torch.empty(2**20)
            del a, b

    measured = allocated_during(fn, CPU)
    assert measured.peak == 8 * MIB and measured.held == 0


class TinyTranslator(torch.nn.Module):
    """The call signature of bench step's fairseq model, on an embedding and a projection."""

    def __init__(self, vocab: int = 100, width: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.out = torch.nn.Linear(width, vocab)

        self.decoder = self  # fairseq's shape: model.decoder.output_layer, .output_projection
        self.output_projection = self.out

    def output_layer(self, features):
        return self.out(features)

    def forward(self, src, lengths, prev, features_only=False):
        features = torch.relu(self.embed(prev))
        return (features if features_only else self.out(features)), None


def test_step_memory_counts_the_state_once_and_the_step_above_it():
    torch.manual_seed(0)
    model = TinyTranslator()
    whole = Variant(loss_chunk=0)  # the logits of the whole batch at once
    setup = Setup("fp32", {}, model, torch.optim.Adam(model.parameters()), whole)
    batch = Batch.random(sentences=8, src_len=16, vocab=100, dev=CPU)
    setup.step(batch)  # Adam's state exists from here on
    memory = setup.memory(batch)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = len(list(model.parameters()))
    # parameters, Adam's two moments and a float32 step count per parameter; no gradients
    assert memory.state == 3 * params + 4 * n_params
    assert memory.total == memory.state + memory.step_peak
    logits = batch.tokens * 100 * 4
    assert params + 2 * logits <= memory.step_peak < params + 10 * logits
    # nothing freed inside the step went unseen: what it leaves is the new gradients
    setup.optimizer.zero_grad(set_to_none=True)
    assert allocated_during(lambda: setup.step(batch), CPU).held == params
    assert setup.state_bytes() == memory.state + params


def _search(peak_of, budget):
    calls = []

    def measured(n):
        calls.append(n)
        return peak_of(n)

    return largest_fitting(measured, budget), calls


@pytest.mark.parametrize("budget", [50, 104, 110, 1000, 12345, 10**6])
def test_an_affine_peak_is_found_after_doubling_and_two_probes(budget):
    peak_of = lambda n: 100 + 7 * n  # noqa: E731
    search, calls = _search(peak_of, budget)
    truth = max(0, (budget - 100) // 7)
    assert search.sentences == truth
    assert search.peak == (peak_of(truth) if truth else None)
    # 4 and 8 sentences, doubling while the line through them goes further, then the edge
    assert len(calls) == len(set(calls)) <= math.ceil(math.log2(max(truth, 8) / 8)) + 4
    assert max(calls) <= max(8, truth + 1)


@pytest.mark.parametrize(
    "peak_of",
    [
        lambda n: 100 + 7 * n + (n * 37 % 11),  # noisy
        lambda n: 100 + n * n,  # convex
        lambda n: 100 + int(300 * math.sqrt(n)),  # concave
        lambda n: 100 + 50 * (n // 10),  # steps: the two small probes see no slope
        lambda n: max(200, 130 + 6 * n),  # flat first (the optimizer's peak), then affine
        lambda n: 100 + 7 * n if n < 500 else math.inf,  # out of memory from 500 on
    ],
)
@pytest.mark.parametrize(
    "budget",
    [104, 1000, 12345, pytest.param(10**6, marks=pytest.mark.slow)],  # 10**6: seconds
)
def test_the_search_is_exact_for_any_rising_peak(peak_of, budget):
    search, calls = _search(peak_of, budget)
    n = 0
    while peak_of(n + 1) <= budget:
        n += 1
    assert search.sentences == n
    assert n + 1 in search.peaks  # the edge was measured
    assert len(calls) == len(set(calls)) <= 35
    # a line through small batches may point far beyond the answer; no probe goes there
    assert max(calls) <= max(8, 2 * (n + 1))


@pytest.mark.parametrize(
    "text, size",
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64kib", 64 * 1024),
        (" 3 MB ", 3_000_000),
        ("1000", 1000),
        ("7B", 7),
    ],
)
def test_budget_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1GiB", "2 GiB extra", "0.1B", "1e9"])
def test_bad_budget_sizes_are_value_errors(text):
    with pytest.raises(ValueError, match="--budget"):
        parse_size(text)
