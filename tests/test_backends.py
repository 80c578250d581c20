"""The one switch over the quantizer backends (docs/formats.md, "Implementations: the backends"):
every backend module holds every operation, DSQ_BACKEND names one or is refused in one line."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dsq.formats import backends, parse_format


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_defines_every_operation(name):
    """Loading checks the module against the protocol (the triton one loads without CUDA too)."""
    module = backends.load_backend(name)
    assert backends.OPERATIONS == (
        "unavailable_reason",
        "bfp_quantize",
        "bfp_pack",
        "bfp_unpack",
        "fixed_static_quantize",
        "fixed_static_pack",
        "fixed_static_unpack",
        "fusable_quantize_and_pack",
        "bfp_quantize_and_pack",
        "fusable_quantize_chain",
        "bfp_quantize_chain",
    )
    assert all(callable(getattr(module, op)) for op in backends.OPERATIONS)


def test_the_environment_variable_chooses_and_auto_is_the_default(monkeypatch):
    x = torch.randn(4, 32)
    monkeypatch.delenv("DSQ_BACKEND", raising=False)
    automatic = backends.select_backend(x)
    monkeypatch.setenv("DSQ_BACKEND", "auto")
    assert backends.select_backend(x) is automatic
    monkeypatch.setenv("DSQ_BACKEND", "reference")
    assert backends.select_backend(x) is backends.load_backend("reference")
    assert backends.default_backend() == "reference"
    # a call's own backend= wins over the variable
    assert backends.select_backend(x, "compile") is backends.load_backend("compile")


def test_the_reference_pairs_are_the_two_calls():
    """The reference's fused-pair functions are the definition every fused kernel is held to."""
    from dsq.formats import reference

    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    bfp8, bfp2 = (parse_format(s)._args() for s in ("bfp8", "bfp2"))
    values, mantissas, exponents = reference.bfp_quantize_and_pack(x, bfp8, 1, bfp2, 0)
    assert torch.equal(values, reference.bfp_quantize(x, *bfp8, 1))
    want = reference.bfp_pack(x, *bfp2, 0)
    assert torch.equal(mantissas, want[0]) and torch.equal(exponents, want[1])
    first, second = reference.bfp_quantize_chain(x, (16, 8, None), 0, bfp8, 1)
    assert torch.equal(second, reference.bfp_quantize(first, *bfp8, 1))


@pytest.mark.parametrize("command", [["version"], ["format", "bfp4", "--values", "1,2"]])
def test_dsq_refuses_an_unknown_backend_in_one_line(command, monkeypatch):
    from dsq_cli.cli import app

    monkeypatch.setenv("DSQ_BACKEND", "fast")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "dsq: error: unknown DSQ_BACKEND 'fast'; choose one of auto, reference, compile, c, triton"
    ]
    monkeypatch.setenv("DSQ_BACKEND", "reference")
    assert CliRunner().invoke(app, command).exit_code == 0
