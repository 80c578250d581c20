"""Preparing a translation task once: raw text -> sentencepiece -> fairseq binary, cached.

The prepared directory (``<cache>/prepared/<task>-<key>``) holds the plain text of every split
(``{split}.raw.{lang}``: the test references BLEU is scored against), the joint sentencepiece
model (``spm.model``), fairseq's dictionaries and binarized splits, and ``manifest.json``.
``key`` digests every input (the raw files' contents, subset, vocabulary settings), so a changed
input never reuses a stale cache.

Atomic preparation (docs/spec.md §7): everything is built in a temporary sibling directory and
renamed into place as the last step, so an interrupted `dsq data` leaves the finished result or
nothing. Two processes preparing the same key at once both succeed; one rename wins, the other copy
is dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dsq_cli.run_config import RunConfig

from .download import built_in_place
from .raw import SPLITS, ParallelSplit, write_lines
from .tasks import get_task

log = logging.getLogger(__name__)
PREPARE_VERSION = 1  # bump when the prepared layout changes, so old caches are not trusted


@dataclass(frozen=True)
class PreparedData:
    """A prepared task: the fairseq data directory plus what evaluation needs."""

    path: Path
    src: str
    tgt: str
    manifest: dict

    @property
    def source(self) -> str:
        """Where the data lives (GlueData has the same field), for result.json and messages."""
        return str(self.path)

    @property
    def spm_model(self) -> Path:
        return self.path / "spm.model"

    def raw(self, split: str, side: str) -> Path:
        return self.path / f"{split}.raw.{self.src if side == 'src' else self.tgt}"


def cache_key(cfg: RunConfig, task_fingerprint: str) -> str:
    settings = {
        "version": PREPARE_VERSION,
        "task": task_fingerprint,
        "subset": cfg.data.subset,
        "vocab_size": cfg.data.vocab_size,
        "spm_model": cfg.data.spm_model,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare(cfg: RunConfig, *, quiet: bool = False) -> PreparedData:
    """The prepared data of ``cfg.task``, built now if the cache does not hold it yet."""
    task = get_task(cfg.task.name, cfg)
    key = cache_key(cfg, task.fingerprint())
    root = Path(cfg.data.cache_dir).expanduser() / "prepared"
    final = root / f"{task.name}-{key}"
    manifest_path = final / "manifest.json"
    if manifest_path.is_file():
        return PreparedData(final, task.src, task.tgt, json.loads(manifest_path.read_text()))

    splits = task.load()  # reads and checks the raw text before anything is written
    if cfg.data.subset is not None:
        train = splits["train"]
        n = cfg.data.subset
        splits["train"] = ParallelSplit(train.src[:n], train.tgt[:n], train.dropped_blank)
    # the rename into place is the commit point; a copy that lost the race is dropped
    with built_in_place(final, manifest_path.name) as (building, _scratch):
        manifest = _build(building, splits, task.src, task.tgt, cfg)
        manifest.update(task=task.name, key=key, subset=cfg.data.subset)
        (building / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if not quiet:
        log.info("prepared %s in %s", task.name, final)
    return PreparedData(final, task.src, task.tgt, json.loads(manifest_path.read_text()))


def _build(out: Path, splits: dict[str, ParallelSplit], src: str, tgt: str, cfg: RunConfig) -> dict:
    import sentencepiece as spm

    for split, data in splits.items():
        write_lines(out / f"{split}.raw.{src}", data.src)
        write_lines(out / f"{split}.raw.{tgt}", data.tgt)

    # One joint model over both sides of train (shared embeddings need one vocabulary).
    joint = out / "spm.train.txt"
    write_lines(joint, splits["train"].src + splits["train"].tgt)
    spm.SentencePieceTrainer.train(
        input=str(joint),
        model_prefix=str(out / "spm"),
        vocab_size=cfg.data.vocab_size,
        model_type=cfg.data.spm_model,
        character_coverage=1.0,
        hard_vocab_limit=False,  # a small subset may not support the full vocabulary size
        num_threads=1,  # deterministic pieces
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        minloglevel=2,
    )
    joint.unlink()
    processor = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))

    pieces = {
        (split, lang): [" ".join(p) for p in processor.encode(lines, out_type=str)]
        for split, data in splits.items()
        for lang, lines in ((src, data.src), (tgt, data.tgt))
    }
    dictionary = _joint_dictionary(pieces[("train", src)] + pieces[("train", tgt)])
    for lang in (src, tgt):
        dictionary.save(str(out / f"dict.{lang}.txt"))
    for (split, lang), lines in pieces.items():
        _binarize(lines, dictionary, out / f"{split}.{src}-{tgt}.{lang}")
    return {
        "src": src,
        "tgt": tgt,
        "sizes": {split: len(splits[split]) for split in SPLITS},
        "dropped_blank_train_pairs": splits["train"].dropped_blank,
        "vocab_size": len(dictionary),
        "spm_pieces": processor.get_piece_size(),
    }


def _joint_dictionary(lines: list[str]):
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for line in lines:
        for piece in line.split():
            dictionary.add_symbol(piece)
    dictionary.finalize(threshold=0, nwords=-1, padding_factor=8)
    return dictionary


def _binarize(lines: list[str], dictionary, prefix: Path) -> None:
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=len(dictionary))
    for line in lines:
        ids = dictionary.encode_line(line, add_if_not_exist=False, append_eos=True)
        builder.add_item(ids)
    builder.finalize(f"{prefix}.idx")
