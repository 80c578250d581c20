"""The demo task's corpus: a small artificial language pair, generated deterministically offline.

Source sentences follow ``DET [ADJ] NOUN VERB DET [ADJ] NOUN [PREP DET [ADJ] NOUN] [NUM]``.
The target language has its own word for every source word (no shared spelling, so copying the
source scores about zero BLEU), puts adjectives after their noun and the verb at the end of the
main clause. A model must learn a lexicon and two reorderings: real translation in miniature,
learnable in a few hundred CPU updates.
"""

from __future__ import annotations

import random

# Fixed seeds: the corpus is part of the project, the same on every machine and for every run.
_LEXICON_SEED = 20231
_SPLIT_SEEDS = {"train": 1, "valid": 2, "test": 3}
_CLASS_SIZES = {"det": 4, "adj": 24, "noun": 60, "verb": 30, "prep": 8, "num": 12}
_SYLLABLES_SRC = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
_SYLLABLES_TGT = [c + v for c in "chjqwxy" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _words(rng: random.Random, syllables: list[str], count: int, taken: set[str]) -> list[str]:
    words = []
    while len(words) < count:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3)))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def lexicon() -> dict[str, list[tuple[str, str]]]:
    """Word class -> (source word, target word) pairs."""
    rng = random.Random(_LEXICON_SEED)
    taken_src: set[str] = set()
    taken_tgt: set[str] = set()
    return {
        cls: list(
            zip(
                _words(rng, _SYLLABLES_SRC, n, taken_src),
                _words(rng, _SYLLABLES_TGT, n, taken_tgt),
            )
        )
        for cls, n in _CLASS_SIZES.items()
    }


def _noun_phrase(rng: random.Random, lex) -> tuple[list[str], list[str]]:
    det, noun = rng.choice(lex["det"]), rng.choice(lex["noun"])
    if rng.random() < 0.5:
        adj = rng.choice(lex["adj"])
        return [det[0], adj[0], noun[0]], [det[1], noun[1], adj[1]]  # adjective follows in tgt
    return [det[0], noun[0]], [det[1], noun[1]]


def sentence_pair(rng: random.Random, lex) -> tuple[str, str]:
    subj_s, subj_t = _noun_phrase(rng, lex)
    verb = rng.choice(lex["verb"])
    obj_s, obj_t = _noun_phrase(rng, lex)
    src = subj_s + [verb[0]] + obj_s
    tgt = subj_t + obj_t + [verb[1]]  # verb-final main clause
    if rng.random() < 0.4:
        prep = rng.choice(lex["prep"])
        np_s, np_t = _noun_phrase(rng, lex)
        src += [prep[0]] + np_s
        tgt += np_t + [prep[1]]  # postpositions
    if rng.random() < 0.3:
        num = rng.choice(lex["num"])
        src.append(num[0])
        tgt.insert(0, num[1])  # counts come first
    return " ".join(src) + ".", " ".join(tgt) + "."


def generate(split: str, size: int) -> tuple[list[str], list[str]]:
    """``size`` sentence pairs of ``split`` (train, valid or test), the same on every call."""
    lex = lexicon()
    rng = random.Random(_SPLIT_SEEDS[split])
    pairs = [sentence_pair(rng, lex) for _ in range(size)]
    return [s for s, _ in pairs], [t for _, t in pairs]
