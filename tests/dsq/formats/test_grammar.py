"""The format grammar (docs/formats.md): what parses, what it means, what is rejected and how."""

import pytest
import torch

from dsq.formats import GRAMMAR, parse_format
from dsq.warn_once import warn_once


@pytest.mark.parametrize(
    "spec, canonical, bits",
    [
        ("fp32", "fp32", 32),
        ("FP16", "fp16", 16),
        ("bf16", "bf16", 16),
        ("e4m3", "e4m3", 8),
        ("E5M2", "e5m2", 8),
        ("bfp4", "bfp4e8b16", 4.5),
        ("bfp8", "bfp8e8b16", 8.5),
        ("bfp2e8b16", "bfp2e8b16", 2.5),
        ("bfp3b32", "bfp3e8b32", 3.25),
        ("bfp6e5", "bfp6e5b16", 6 + 5 / 16),
        ("BFP24E10B4096", "bfp24e10b4096", 24 + 10 / 4096),
        ("bfp2e2b1", "bfp2e2b1", 4),
        ("fixed16", "fixed16", 16),
        ("fixed32", "fixed32", 32),
        ("fixed2", "fixed2", 2),
        ("fixed8f4", "fixed8f4", 8),
        ("fixed32f31", "fixed32f31", 32),
        ("fixed2f0", "fixed2f0", 2),
        (" bfp4 ", "bfp4e8b16", 4.5),
    ],
)
def test_valid_specs(spec, canonical, bits):
    fmt = parse_format(spec)
    assert fmt.spec == canonical
    assert fmt.bits_per_value == pytest.approx(bits, abs=0)
    assert parse_format(fmt.spec) == fmt  # canonical specs parse back to the same format


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "fp8",
        "fp64",
        "int8",
        "bfp",
        "bfp1",
        "bfp25",
        "bfp4e1",
        "bfp4e11",
        "bfp4b0",
        "bfp4b4097",
        "bfp4b16e8",
        "fixed1",
        "fixed33",
        "fixed8f8",
        "fixed8f-1",
        "fixed",
        "bfp4 e8",
        "bfp4x",
        "e4m3fn",
    ],
)
def test_invalid_specs_name_the_spec_and_show_the_grammar(spec):
    with pytest.raises(ValueError) as err:
        parse_format(spec)
    assert repr(spec) in str(err.value)
    assert GRAMMAR in str(err.value)


def test_non_string_spec_is_rejected():
    with pytest.raises(ValueError, match="grammar"):
        parse_format(4)


@pytest.mark.parametrize("spec", ["bfp4", "fixed8", "fixed8f4", "fp16", "e4m3"])
def test_non_floating_tensor_is_a_type_error(spec):
    fmt = parse_format(spec)
    with pytest.raises(TypeError, match="floating"):
        fmt.quantize(torch.arange(16), backend="reference")
    with pytest.raises(TypeError, match="floating"):
        fmt.pack(torch.arange(16, dtype=torch.int32), backend="reference")


@pytest.mark.parametrize("spec", ["bfp4", "fixed8", "fixed8f4", "fp16"])
@pytest.mark.parametrize("axis", [2, -3, 7])
def test_bad_axis_is_an_index_error(spec, axis):
    with pytest.raises(IndexError, match="axis"):
        parse_format(spec).quantize(torch.zeros(3, 4), axis=axis, backend="reference")


def test_bad_rounding_and_generator():
    fmt = parse_format("bfp4")
    with pytest.raises(ValueError, match="rounding"):
        fmt.quantize(torch.zeros(4), rounding="up")
    with pytest.raises(TypeError, match="Generator"):
        fmt.quantize(torch.zeros(4), rounding="stochastic", generator=1)
    with pytest.raises(ValueError, match="nearest"):
        parse_format("fp16").quantize(torch.zeros(4), rounding="stochastic")


def test_unknown_backend_and_unavailable_backend_are_errors():
    fmt = parse_format("bfp4")
    with pytest.raises(ValueError, match="backend"):
        fmt.quantize(torch.zeros(16), backend="cuda-magic")
    if not torch.cuda.is_available():
        for backend in ("c", "compile"):
            with pytest.raises(RuntimeError, match="for CPU tensors"):
                # a named backend refuses a device it does not serve, rather than falling back
                fmt.quantize(torch.zeros(16, device="meta"), backend=backend)


def test_auto_falls_back_with_one_logged_reason(caplog, monkeypatch):
    import logging

    from dsq.formats import backends, reference, select_backend

    monkeypatch.delenv("DSQ_BACKEND", raising=False)
    monkeypatch.setattr(backends, "AUTO_ORDER", {"meta": ("compile", "reference")})
    backends.auto_backend.cache_clear()
    warn_once.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="dsq.formats"):
            for _ in range(3):
                assert select_backend(torch.empty(4, device="meta")) is reference
    finally:
        backends.auto_backend.cache_clear()
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        "dsq: quantizers on the reference backend (compile: its kernels are for CPU "
        "tensors (got meta))"
    ], logged


def test_a_family_without_its_reference_operations_is_refused():
    from dsq.formats import backends

    backends.register_kernel("reference", "half_family", "quantize", lambda *args: None)
    try:
        with pytest.raises(TypeError, match="'half_family' has no reference pack, unpack"):
            backends.declare_family("half_family")
    finally:
        del backends._KERNELS[("reference", "half_family", "quantize")]


def test_the_docs_grammar_is_the_registrys():
    """The grammar docs/formats.md and docs/spec.md print is the registered classes' lines without
    their ranges, in parse order, and the README's example names every spelling: a new format
    registered and not documented fails here."""
    import re
    from pathlib import Path

    from dsq.formats import registered_formats

    repo = Path(__file__).resolve().parents[3]
    lines = [re.sub(r" \([^)]*\)", "", cls.grammar) for cls in registered_formats()]
    expected = " | ".join(lines).split()
    for doc in ("docs/formats.md", "docs/spec.md"):
        text = (repo / doc).read_text()
        block = re.search(r"```\n(fp32 \|.*?)\n```", text, re.S)
        assert block, f"{doc} holds no grammar block"
        assert block[1].split() == expected, doc
    readme = (repo / "README.md").read_text()
    example = re.search(r'parse_format\("bfp4"\)  # (.*?)\ny = ', readme, re.S)[1]
    spellings = [w.rstrip(",") for w in expected if w not in ("|", "each", "[b<B>]")]
    assert example.replace("#", " ").split() == spellings
