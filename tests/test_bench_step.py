"""``dsq bench step``'s setups: which GEMMs of the fairseq model each preset quantizes."""

from __future__ import annotations

import pytest
import torch

from dsq.engine.accounting import record_gemms
from dsq_cli.bench.step import Batch, Setup

CPU = torch.device("cpu")
VOCAB, WIDTH = 96, 64


@pytest.mark.parametrize("quantize_head", [False, True])
def test_the_output_projection_is_quantized_only_when_asked(quantize_head):
    """The output projection (width x vocabulary) stays fp32 unless ``quantize_head``, as `dsq
    train` runs it; every layer's Linear is quantized either way."""
    pytest.importorskip("fairseq")
    setup = Setup.build("bfp8", "gemm", 1, WIDTH, VOCAB, CPU, quantize_head=quantize_head)
    batch = Batch.random(sentences=2, src_len=8, vocab=VOCAB, dev=CPU)
    with record_gemms() as recorder:
        setup.step(batch)
    linear = [g for g in recorder.gemms if g.kind == "linear"]
    head = [g for g in linear if (g.k, g.m) == (WIDTH, VOCAB)]
    assert len(head) == (1 if quantize_head else 0)
    # the encoder's 6 Linears (q, k, v, out, fc1, fc2) and the decoder's 10 (two attentions)
    assert len(linear) - len(head) == 16
