"""The GLUE encoders' test inputs, shared by tests/dsq_cli/models/test_encoders.py and
tests/dsq/integrations/test_hf.py."""

from __future__ import annotations

import importlib.util

import torch
from omegaconf import OmegaConf

from dsq_cli.models import encoders
from helpers.paths import REPO

MODEL_CONF = REPO / "dsq_cli" / "conf" / "model"
HAS_MINILM = importlib.util.find_spec(encoders.MINILM_PACKAGE) is not None

# single sentences and pairs, with casing, accents and punctuation the tokenizers must agree on
SENTENCES = [
    ("Hello world!", None),
    (
        "The quick brown fox jumps over the lazy dog.",
        "Crème Brûlée is a DESSERT; naïve cafés serve it.",
    ),
    ("x", None),
    ("GPU-accelerated training runs at 3.5x the speed, isn't it?", "Yes."),
]


def model_cfg(name: str, cache_dir="/nonexistent", **overrides):
    """conf/model/NAME.yaml as the `model` node of a root config holding data.cache_dir."""
    root = OmegaConf.create(
        {
            "data": {"cache_dir": str(cache_dir)},
            "model": OmegaConf.load(MODEL_CONF / f"{name}.yaml"),
        }
    )
    for key, value in overrides.items():
        root.model[key] = value
    return root.model


def right_padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    tokens = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens
