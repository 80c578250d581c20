"""dsq: Dynamic Stashing Quantization (Yang, Lo, Mullins, Zhao, EMNLP Findings 2023) for any
PyTorch model. It depends on torch only (Triton optional, ``dsq[hf]`` adds transformers).

    >>> import dsq
    >>> cfg = dsq.QuantConfig(q0="bfp8", q1=dsq.Schedule(["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"]),
    ...                       q2="bfp8", q3="fixed16")
    >>> model = dsq.quantize_model(model, cfg)       # in place; model.dsq_report says what
    >>> cfg.step(valid_loss, update=n)                # after each validation

Layers, each importing only those below it: ``integrations`` (fairseq, Hugging Face) ->
``engine`` (the quantized GEMMs, the stash, precision policies, GEMM units) -> ``formats`` (the
number formats and their paths) -> ``kernels`` (C and Triton). The names below load on first
use, so ``import dsq`` itself loads nothing but this file.
"""

from __future__ import annotations

import importlib

_API = {
    "QuantConfig": "dsq.engine",
    "Schedule": "dsq.engine",
    "dsq_linear": "dsq.engine",
    "dsq_matmul": "dsq.engine",
    "record_gemms": "dsq.engine",
    "patch_model": "dsq.engine",
    "POINTS": "dsq.engine",
    "parse_format": "dsq.formats",
    "quantize_model": "dsq.integrations",
    "register_patcher": "dsq.integrations",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'dsq' has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
