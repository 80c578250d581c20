"""Causal language models from ``transformers``, built from a config (random init, no download):
Llama-style (RMSNorm, SwiGLU, RoPE, grouped-query attention) and GPT-2.

`build_causal_lm` serves ``task=lm`` (conf/model/llama_lm.yaml, gpt2_lm.yaml) and
``dsq bench memory|step --model llama|gpt2``. ``transformers`` is the ``hf`` extra's; a model
of this file without it is refused with the install line (`check_transformers`).
"""

from __future__ import annotations

import importlib.util

import torch

from .errors import EncoderError

KINDS = ("llama", "gpt2")


def check_transformers(what: str) -> None:
    """Refuse ``what`` (a model, a task) at once when ``transformers`` is not installed."""
    if importlib.util.find_spec("transformers") is None:
        raise EncoderError(
            f"{what} needs the transformers package: pip install 'transformers>=5.0' (the hf "
            "extra of this project: pip install -e '.[hf]')"
        )


def _multiple(n: int, of: int) -> int:
    return max(of, (n + of - 1) // of * of)


def build_causal_lm(kind: str, *, vocab: int, layers: int, width: int, heads: int,
                    kv_heads: int | None, seq_len: int, dropout: float | None = None,
                    intermediate: int | None = None) -> torch.nn.Module:  # fmt: skip
    """A ``transformers`` causal LM of ``kind`` (`KINDS`) with SDPA attention, initialised from
    the current torch seed. Llama: ``kv_heads`` key/value heads (None: as many as heads) and a
    SwiGLU of ``intermediate`` (None: 8/3 of the width, rounded up to 64); GPT-2: 4x the width.
    ``dropout``: GPT-2's on its residual, embedding and attention paths, Llama's on attention
    (None: the config's default, 0.1 for GPT-2, 0 for Llama)."""
    check_transformers(f"model kind {kind}")
    import transformers

    rates = {} if dropout is None else {"attention_dropout": dropout}
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
            intermediate_size=intermediate or _multiple(8 * width // 3, 64),
            max_position_embeddings=seq_len, **rates,
        )  # fmt: skip
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if kind == "gpt2":
        if dropout is not None:
            rates = {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
        # GPT-2's special token 50256 lies outside a small vocabulary; training needs none
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=seq_len,
            n_inner=intermediate, bos_token_id=None, eos_token_id=None, **rates,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    raise ValueError(f"causal LM kind {kind!r}: choose one of {', '.join(KINDS)}")


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model without its output layer (hidden states out) and the output layer."""
    return model.get_decoder(), model.get_output_embeddings()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM of `build_causal_lm`."""
    body = model.get_decoder()
    layers = getattr(body, "layers", None) or getattr(body, "h", None)
    return list(layers or [])
