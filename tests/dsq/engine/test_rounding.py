"""Per-point rounding (``quant.rounding.q1=stochastic``): unbiased, deterministic under the seed,
and continued across a checkpoint; the configuration rejects what is not a rounding."""

from __future__ import annotations

import pytest
import torch

from dsq.engine import QuantConfig, dsq_linear
from dsq.presets import preset_differences
from dsq_cli.presets import load_quant_preset


def _stash_seen_by_gemm3(cfg: QuantConfig, x: torch.Tensor) -> torch.Tensor:
    """The stash as GEMM3 reads it: with dy = I (and q3 fp32), dW = dy^T stash = stash."""
    weight = torch.zeros(x.shape[0], x.shape[1], requires_grad=True)
    y = dsq_linear(x, weight, None, cfg)
    y.backward(torch.eye(x.shape[0]))
    return weight.grad


def _stash_only(rounding: str, seed: int = 0, stash: str = "bfp2") -> QuantConfig:
    return QuantConfig(q1=stash, rounding={"q1": rounding}, seed=seed)


@pytest.mark.parametrize("man_bits", [2, 4])
@pytest.mark.slow  # a thousand quantized GEMM steps per case
def test_the_stochastic_stash_is_unbiased(man_bits):
    """The mean of R stochastic stashes converges to x (within 5 standard errors), wherever x
    lies inside the format's range; nearest rounding misses by more than that bound.

    The range: each block (16 tokens) has a grid of step s = 2^(e - (m-2)), e = floor(log2 max),
    up to (2^(m-1) - 1) s. Values above it (in the top binade, from 2^(m-1) - 1 steps to the
    block max) clamp to it under any rounding: for bfp2 that is every value above 2^e."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g)
    cfg, draws = _stash_only("stochastic", stash=f"bfp{man_bits}"), 1000
    mean = sum(_stash_seen_by_gemm3(cfg, x) for _ in range(draws)) / draws
    block_max = x.abs().reshape(2, 16, 16).amax(1, keepdim=True).expand(2, 16, 16).reshape(32, 16)
    step = 2.0 ** (torch.floor(torch.log2(block_max)) - (man_bits - 2))
    inside = x.abs() <= (2 ** (man_bits - 1) - 1) * step
    assert inside.float().mean() > 0.5  # most of the tensor is tested
    bound = 5 * (step / 2) / draws**0.5  # a draw's standard deviation is at most step / 2
    assert ((mean - x).abs() <= bound)[inside].all()
    nearest = _stash_seen_by_gemm3(_stash_only("nearest", stash=f"bfp{man_bits}"), x)
    assert ((nearest - x).abs() > bound)[inside].float().mean() > 0.5


def test_stochastic_rounding_is_fixed_by_the_seed():
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
    cfg, cfg_again = _stash_only("stochastic", seed=7), _stash_only("stochastic", seed=7)
    first = [_stash_seen_by_gemm3(cfg, x) for _ in range(2)]
    again = [_stash_seen_by_gemm3(cfg_again, x) for _ in range(2)]
    other = _stash_seen_by_gemm3(_stash_only("stochastic", seed=8), x)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # one stream: the next call draws anew
    assert not torch.equal(first[0], other)


def test_a_restored_config_continues_the_same_stream():
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(2))

    def config():
        every = {p: "stochastic" for p in ("q0", "q1", "q2", "q3")}
        return QuantConfig(q0="bfp4", q1="bfp2", q2="bfp4", q3="fixed8", seed=3, rounding=every)

    cfg = config()
    _stash_seen_by_gemm3(cfg, x)
    noise = cfg.noise_state()
    expected = _stash_seen_by_gemm3(cfg, x)
    restored = config()
    restored.load_noise_state(noise)
    assert torch.equal(_stash_seen_by_gemm3(restored, x), expected)
    fresh = config()  # not restored (another rank): the stream starts again from the seed
    assert not torch.equal(_stash_seen_by_gemm3(fresh, x), expected)


@pytest.mark.parametrize(
    "rounding, message",
    [
        ({"q1": "stochastc"}, "quant.rounding.q1='stochastc' is not a rounding"),
        ({"q5": "nearest"}, "rounding: unknown point(s) ['q5']"),
    ],
)
def test_what_is_not_a_rounding_is_refused(rounding, message):
    with pytest.raises(ValueError) as err:
        QuantConfig.from_dict({"q1": "bfp2", "rounding": rounding})
    assert message in str(err.value)


def test_nearest_everywhere_is_the_preset_and_a_stochastic_point_is_not():
    dsq = load_quant_preset("dsq")
    assert preset_differences({"preset": "dsq", **dsq}) == []
    old = {k: v for k, v in dsq.items() if k != "rounding"}  # a run from before rounding
    assert preset_differences({"preset": "dsq", **old}) == []
    stochastic = {**dsq, "rounding": {**dsq["rounding"], "q1": "stochastic"}}
    assert preset_differences({"preset": "dsq", **stochastic}) == ["rounding.q1=stochastic"]
