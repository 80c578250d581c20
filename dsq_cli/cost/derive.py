"""The GEMMs of one training step of a fairseq transformer, derived from its config alone.

``derive_records`` returns what ``record_gemms()`` records when a ``quantize_model``-patched
fairseq ``TransformerModel`` runs forward and backward on a batch of equal-length sentences, so
``dsq cost`` can price a model without building or running it:

* every ``nn.Linear`` is a ``linear`` record ``(batch 1, N tokens, K in, M out)``: the q, k, v
  and out projections of each attention module, ``fc1`` and ``fc2`` of each layer, and the
  decoder's ``output_projection`` (an ``nn.Linear`` of ``vocab`` outputs whether or not it
  shares the embedding matrix);
* every attention module contributes two ``matmul`` records, ``Q K^T`` and ``P V``, with batch
  ``sentences * heads`` (fairseq folds heads into the ``bmm`` batch).

The encoder-decoder attention reads its keys and values from the encoder output: its ``k_proj``
and ``v_proj`` run over the source tokens, and its products are ``tgt_len x src_len``.
Padding is not modelled (every sentence has the given length), so a real batch of ragged
sentences records somewhat larger shapes than its real token count suggests.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from dsq.engine.accounting import GemmRecord
from dsq.engine.config import QuantConfig

# conf/config.yaml's data.vocab_size: the joint sentencepiece vocabulary when no task says else
DEFAULT_VOCAB = 8000
MODEL_KEYS = (
    "encoder_layers",
    "decoder_layers",
    "encoder_embed_dim",
    "decoder_embed_dim",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "encoder_attention_heads",
    "decoder_attention_heads",
)


@dataclasses.dataclass(frozen=True)
class DerivedGemm:
    """One derived record and the module it comes from (``quantize_model``'s names: a Linear's
    own name, or the attention module's name for its two products)."""

    site: str
    record: GemmRecord


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The batch a step is derived for: ``sentences`` of ``src_len`` and ``tgt_len`` tokens."""

    sentences: int
    src_len: int
    tgt_len: int
    vocab: int

    @property
    def src_tokens(self) -> int:
        return self.sentences * self.src_len

    @property
    def tgt_tokens(self) -> int:
        return self.sentences * self.tgt_len


def step_shape(
    src_tokens: int, src_len: int, tgt_len: int | None = None, vocab: int = DEFAULT_VOCAB
) -> StepShape:
    """The batch of at most ``src_tokens`` source tokens in whole sentences of ``src_len`` (as
    fairseq's ``--max-tokens`` batching fills it); the target length defaults to ``src_len``."""
    tgt_len = src_len if tgt_len is None else tgt_len
    for name, value in (("src_len", src_len), ("tgt_len", tgt_len), ("vocab", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(src_tokens, int) or isinstance(src_tokens, bool) or src_tokens < src_len:
        raise ValueError(
            f"tokens per batch must be an integer of at least one sentence (src_len {src_len}), "
            f"got {src_tokens!r}"
        )
    return StepShape(src_tokens // src_len, src_len, tgt_len, vocab)


def _model_dims(model_cfg: Mapping) -> dict[str, int]:
    missing = [k for k in MODEL_KEYS if k not in model_cfg]
    if missing:
        raise ValueError(
            f"the model config lacks {missing}; a fairseq transformer config (conf/model/*.yaml) "
            f"gives {list(MODEL_KEYS)}"
        )
    dims = {}
    for key in MODEL_KEYS:
        value = model_cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        dims[key] = value
    for side in ("encoder", "decoder"):
        width, heads = dims[f"{side}_embed_dim"], dims[f"{side}_attention_heads"]
        if width % heads:
            raise ValueError(
                f"model.{side}_embed_dim {width} is not divisible by "
                f"model.{side}_attention_heads {heads}"
            )
    return dims


def as_quant_config(quant: QuantConfig | Mapping | None) -> QuantConfig:
    """A QuantConfig from a QuantConfig, a preset mapping, or None (fp32 everywhere)."""
    if quant is None:
        return QuantConfig()
    return quant if isinstance(quant, QuantConfig) else QuantConfig.from_dict(quant)


def _formats(quant: QuantConfig | Mapping | None) -> tuple[tuple[str, str], ...]:
    """The formats in force at a fresh config: every schedule at its first level."""
    return tuple(sorted(as_quant_config(quant).current().items()))


def derive_gemms(
    model_cfg: Mapping,
    src_tokens: int,
    src_len: int,
    tgt_len: int | None = None,
    vocab: int = DEFAULT_VOCAB,
    *,
    quant: QuantConfig | Mapping | None = None,
    exclude: Iterable[str] = (),
) -> list[DerivedGemm]:
    """The GEMMs of one training step of a fairseq transformer encoder-decoder, each with the
    module (site) it comes from.

    ``model_cfg`` holds the keys of conf/model/*.yaml (``MODEL_KEYS``); the batch is
    ``src_tokens // src_len`` sentences of ``src_len`` source and ``tgt_len`` (default
    ``src_len``) target tokens; ``vocab`` is the output projection's size (the dictionary's
    length). Formats are ``quant``'s at its first levels (a ``QuantConfig``, a preset mapping,
    or None for fp32). ``stash_bytes`` is 0: nothing was packed. Records are in no
    particular order; compare them as a multiset. ``exclude`` holds the glob patterns
    ``quantize_model`` was given (``decoder.output_projection``, ``*.self_attn``).
    """
    dims = _model_dims(model_cfg)
    shape = step_shape(src_tokens, src_len, tgt_len, vocab)
    formats = _formats(quant)
    exclude = list(exclude)
    gemms: list[DerivedGemm] = []

    def linear(site: str, tokens: int, k: int, m: int) -> None:
        gemms.append(DerivedGemm(site, GemmRecord("linear", 1, tokens, k, m, formats, 0)))

    def attention(site: str, width: int, heads: int, kv_width: int, q_len: int, kv_len: int):
        head_dim, batch = width // heads, shape.sentences * heads
        q_tokens, kv_tokens = shape.sentences * q_len, shape.sentences * kv_len
        linear(f"{site}.q_proj", q_tokens, width, width)
        linear(f"{site}.k_proj", kv_tokens, kv_width, width)
        linear(f"{site}.v_proj", kv_tokens, kv_width, width)
        # Q K^T: [batch, q_len, head_dim] @ [batch, head_dim, kv_len]; then P V
        for n, k, m in ((q_len, head_dim, kv_len), (q_len, kv_len, head_dim)):
            gemms.append(DerivedGemm(site, GemmRecord("matmul", batch, n, k, m, formats, 0)))
        linear(f"{site}.out_proj", q_tokens, width, width)

    def ffn(site: str, tokens: int, width: int, hidden: int) -> None:
        linear(f"{site}.fc1", tokens, width, hidden)
        linear(f"{site}.fc2", tokens, hidden, width)

    enc, dec = dims["encoder_embed_dim"], dims["decoder_embed_dim"]
    for layer in range(dims["encoder_layers"]):
        site = f"encoder.layers.{layer}"
        heads = dims["encoder_attention_heads"]
        attention(f"{site}.self_attn", enc, heads, enc, shape.src_len, shape.src_len)
        ffn(site, shape.src_tokens, enc, dims["encoder_ffn_embed_dim"])
    for layer in range(dims["decoder_layers"]):
        site = f"decoder.layers.{layer}"
        heads = dims["decoder_attention_heads"]
        attention(f"{site}.self_attn", dec, heads, dec, shape.tgt_len, shape.tgt_len)
        # keys and values come from the encoder output (fairseq: kdim = vdim = encoder width)
        attention(f"{site}.encoder_attn", dec, heads, enc, shape.tgt_len, shape.src_len)
        ffn(site, shape.tgt_tokens, dec, dims["decoder_ffn_embed_dim"])
    linear("decoder.output_projection", shape.tgt_tokens, dec, shape.vocab)
    return [g for g in gemms if not any(fnmatch.fnmatchcase(g.site, p) for p in exclude)]


def derive_records(*args, **kwargs) -> list[GemmRecord]:
    """The ``GemmRecord``s of ``derive_gemms(*args, **kwargs)``, without their sites."""
    return [g.record for g in derive_gemms(*args, **kwargs)]
