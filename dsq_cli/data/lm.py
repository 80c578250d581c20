"""A language-modelling corpus for ``task=lm``: one UTF-8 text, tokenized by character.

``data.raw_dir`` names the text: a file, or a folder holding ``input.txt`` (the layout of
``../shared/data/tinyshakespeare``). The text is split by characters, the first
``train_fraction`` (90%) for training and the rest for validation, the split char-rnn and
nanoGPT use on Tiny Shakespeare. The vocabulary is every distinct character of the whole text,
in code-point order, each character one token: nothing is trained or downloaded, so the same
text gives the same ids on every machine. ``data.subset=N`` keeps the first N training
characters. Nothing is written: the run records the text's path, size and sha256.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from dsq_cli.run_config import RunConfig

from .raw import DataError

if TYPE_CHECKING:
    import torch

# the language-model tasks (conf/task/<name>.yaml with task.family lm): one, on any text
LM_TASKS = ("lm",)

TRAIN_FRACTION = 0.9  # the first 90% of the characters train, the last 10% validate
CORPUS_FILE = "input.txt"  # the text's name inside a data.raw_dir folder


@dataclass
class LMData:
    """The corpus as token ids, its vocabulary and what was read."""

    train: torch.Tensor  # int64 ids of the training characters
    valid: torch.Tensor  # int64 ids of the validation characters
    vocabulary: str  # the characters, id i being vocabulary[i]
    source: str  # the file read
    manifest: dict = field(default_factory=dict)


def corpus_path(raw_dir) -> Path:
    """The text ``data.raw_dir`` names: the file itself, or a folder's ``input.txt``."""
    if raw_dir is None:
        raise DataError(
            "task=lm needs a text: set data.raw_dir=PATH, a UTF-8 file or a folder holding "
            f"{CORPUS_FILE} (e.g. data.raw_dir=../shared/data/tinyshakespeare)"
        )
    path = Path(str(raw_dir)).expanduser()
    if path.is_dir():
        path = path / CORPUS_FILE
    if not path.is_file():
        raise DataError(
            f"data.raw_dir={raw_dir}: no text at {path}; point it at a UTF-8 file or a folder "
            f"holding {CORPUS_FILE}"
        )
    return path


def encode(text: str, vocabulary: str) -> torch.Tensor:
    """The ids of ``text``'s characters in ``vocabulary``."""
    import torch  # here, not above: the config check reads LM_TASKS without loading torch

    index = {ch: i for i, ch in enumerate(vocabulary)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.int64)


def load_lm(cfg: RunConfig) -> LMData:
    """The corpus of ``cfg.data.raw_dir``, split and tokenized (module docstring)."""
    path = corpus_path(OmegaConf.select(cfg, "data.raw_dir", default=None))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    cut = int(len(text) * TRAIN_FRACTION)
    subset = OmegaConf.select(cfg, "data.subset", default=None)
    if subset is not None and (isinstance(subset, bool) or subset < 1):
        raise DataError(
            f"data.subset={subset!r}: expected a positive number of characters, or null"
        )
    train_text = text[:cut][:subset] if subset is not None else text[:cut]
    seq_len = int(cfg.model.get("seq_len", 0) or 0)
    for name, part in (("training", train_text), ("validation", text[cut:])):
        if len(part) < seq_len + 1:
            raise DataError(
                f"{path}: its {name} part holds {len(part)} characters, fewer than one sequence "
                f"of model.seq_len={seq_len} plus its next character; use a longer text or a "
                "shorter model.seq_len"
            )
    vocabulary = "".join(sorted(set(text)))
    manifest = {
        "task": cfg.task.name,
        "file": str(path),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "tokenizer": "characters",
        "vocab_size": len(vocabulary),
        "sizes": {"train": len(train_text), "valid": len(text) - cut},
        "train_in_file": cut,
        "subset": subset,
    }
    return LMData(encode(train_text, vocabulary), encode(text[cut:], vocabulary), vocabulary,
                  str(path), manifest)  # fmt: skip
