"""The GLUE encoders' test inputs, shared by tests/dsq_cli/models/test_encoders.py and
tests/dsq/integrations/test_hf.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import types

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


def write_roberta_release(folder, seed: int = 0, without: str | None = None) -> dict:
    """A small random RoBERTa in the layout of fairseq's roberta.base release (2019 key names,
    ``args`` Namespace, a fine-tuned head as roberta.large.mnli's), with dict.txt and a
    byte-level GPT-2 BPE without merges; returns the state dict under today's names."""
    from fairseq.data import Dictionary
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode
    from fairseq.models.roberta import RobertaModel, roberta_base_architecture

    folder.mkdir(parents=True)
    (folder / "encoder.json").write_text(
        json.dumps({char: byte for byte, char in bytes_to_unicode().items()})
    )
    (folder / "vocab.bpe").write_text("#version: 0.2\n")
    # reversed, so that no BPE id equals its dictionary index by accident
    (folder / "dict.txt").write_text("".join(f"{i} {1000 + i}\n" for i in reversed(range(256))))
    dictionary = Dictionary.load(str(folder / "dict.txt"))
    dictionary.add_symbol("<mask>")
    args = argparse.Namespace(
        arch="roberta_base",
        task="masked_lm",
        criterion="masked_lm",
        encoder_layers=2,
        encoder_embed_dim=64,
        encoder_ffn_embed_dim=128,
        encoder_attention_heads=4,
        max_positions=512,
        tokens_per_sample=512,
    )
    roberta_base_architecture(args)
    torch.manual_seed(seed)
    model = RobertaModel.build_model(args, types.SimpleNamespace(source_dictionary=dictionary))
    model.register_classification_head("mnli", num_classes=3)
    state = {key: value for key, value in model.state_dict().items() if key != without}
    # the release's names: the encoder was "decoder", its embedding LayerNorm "emb_layer_norm"
    released = {
        key.replace("encoder.", "decoder.", 1).replace("layernorm_embedding", "emb_layer_norm"): v
        for key, v in state.items()
    }
    torch.save(
        {"args": args, "model": released, "optimizer_history": [], "extra_state": {}},
        folder / "model.pt",
    )
    return state
