"""The one map from ``quant.attention`` to its kernel, and the torch release checks the kernels
read."""

from __future__ import annotations

import pytest
import torch

from dsq.engine import units
from dsq.engine.attention import dsq_attention
from dsq.engine.attention_kernels import ATTENTION_FUNCTIONS, attention_function
from dsq.engine.config import QuantConfig
from dsq.engine.sdpa_attention import sdpa_attention
from dsq.engine.spec import ATTENTION_KERNELS


def test_every_setting_has_a_function_or_is_the_definition():
    assert set(ATTENTION_FUNCTIONS) | {"explicit"} == set(ATTENTION_KERNELS)
    assert "explicit" not in ATTENTION_FUNCTIONS


@pytest.mark.parametrize(
    "setting, function",
    [("tiled", dsq_attention), ("sdpa_bf16", sdpa_attention), ("explicit", None)],
)
def test_attention_function_of_a_config(setting, function):
    cfg = QuantConfig(q0="bfp8", q1="bfp2", q2="bfp8", q3="fixed16", attention=setting)
    assert attention_function(cfg) is function


@pytest.mark.parametrize(
    "version, parsed", [("2.13.0+cpu", (2, 13)), ("2.5.0a0+git1234", (2, 5)), ("3.0.1", (3, 0))]
)
def test_torch_version_and_releases_at_least(monkeypatch, version, parsed):
    monkeypatch.setattr(torch, "__version__", version)
    assert units.torch_version() == parsed
    assert units.torch_at_least(*parsed)
    assert not units.torch_at_least(parsed[0], parsed[1] + 1)
    assert units.torch_at_least(2, 4)
    assert units.torch_mm_takes_out_dtype() == (parsed >= (2, 8))
