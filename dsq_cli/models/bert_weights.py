"""BERT weights (``transformers.BertModel`` names) on fairseq's post-LN RoBERTa encoder, so that
the last hidden states equal ``transformers.BertModel``'s
(tests/dsq_cli/models/test_encoders.py measures it).

* Dictionary (``minilm_dictionary``): fairseq's four specials are BERT's (bos ``[CLS]``, pad
  ``[PAD]``, eos ``[SEP]``, unk ``[UNK]``: indices 0-3), then the rest of vocab.txt in order.
  Word-embedding row ``i`` is BERT's row of ``dictionary[i]``. No ``<mask>`` is added: BERT's
  ``[MASK]`` is in the vocabulary and no masked-LM task runs here.
* Positions: fairseq's learned positions index from ``padding_idx + 1`` (``make_positions``),
  so row ``padding_idx + 1 + p`` holds BERT's position ``p``. BERT adds a token-type embedding;
  sentence-transformers always used type 0, so type 0 is folded into every position row and
  type 1 is dropped: sentence pairs also get type 0 (the model was never trained with type 1).
* embeddings.LayerNorm -> layernorm_embedding; per layer query/key/value -> q/k/v_proj,
  attention.output.dense -> out_proj, attention.output.LayerNorm -> self_attn_layer_norm,
  intermediate.dense -> fc1, output.dense -> fc2, output.LayerNorm -> final_layer_norm. Every
  LayerNorm gets BERT's eps (1e-12; fairseq's default is 1e-5): the minilm builder sets it.
* fairseq's ``gelu`` is the exact erf GELU (BERT's ``gelu``), RoBERTa's defaults already match
  BERT otherwise (no embedding scale, post-LN, no final encoder LayerNorm). BERT's pooler (dense
  + tanh on ``[CLS]``) becomes the glue head's ``dense`` (fairseq's head is dense + tanh + out
  projection on the first token, as BERT's fine-tuning); ``out_proj`` starts random. The head's
  dropout also applies before ``dense``, where BERT has none.
* Every tensor of the file is used, except the ``position_ids`` buffer (``make_positions``
  replaces it) and token type 1; a missing or left-over tensor fails naming it.

``load_exactly`` copies a mapped (or upgraded) state dict into a model, every key checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import EncoderError
from .heads import HEAD_NAME

if TYPE_CHECKING:
    import torch
    from fairseq.data import Dictionary


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


def load_exactly(model, state: Mapping[str, torch.Tensor], source: str) -> None:
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
