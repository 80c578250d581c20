"""Sentence tokenizers of the GLUE encoders: text to fairseq dictionary indices in a model's
special-token layout.

``SentenceTokenizer`` owns the layout and the truncation; ``wordpiece_tokenizer`` (BERT's
uncased WordPiece, MiniLM and roberta_tiny) and ``gpt2_bpe_tokenizer`` (RoBERTa's byte-level BPE)
supply the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import EncoderError

if TYPE_CHECKING:
    from fairseq.data import Dictionary


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
