"""Official sources of the translation tasks, pinned by SHA-256, and their conversion to plain
parallel text.

``prepare_raw(task, cache_dir)`` downloads a task's archives into ``cache_dir/downloads`` (each
verified by ``download.fetch``) and writes ``{train,valid,test}.{SRC,TGT}`` into
``cache_dir/raw/<task>``: UTF-8, one sentence per line, the same number of lines on both sides,
markup removed. SRC and TGT are the language suffixes (``Source.src_lang``/``tgt_lang``), the
layout ``data.raw_dir`` takes, so the directory can be used exactly like a hand-made one. The
directory appears complete or not at all (built under a temporary name, then renamed), and an
existing one is returned without touching the network.

Tasks and splits:

- ``iwslt17`` (de->en): the IWSLT 2017 TED bilingual archive ``2017-01-trnted/texts/de/en/
  de-en.tgz``. train = ``train.tags.de-en.{de,en}`` without the talk-metadata tag lines;
  valid = dev2010 (888 pairs); test = tst2010..tst2015 concatenated in year order (8079 pairs).
  These are the splits of the Hugging Face ``iwslt2017`` (``iwslt2017-de-en``) dataset.
  fairseq's ``prepare-iwslt17-multilingual.sh`` has no test split (it validates on dev2010 plus
  the tst sets), so it is not followed.
- ``wmt14`` (en->de): the official WMT14 En-De training data from statmt.org (Europarl v7,
  Common Crawl, News Commentary v9; ~4.5M pairs), newstest2013 as valid (3000) and the full
  newstest2014 as test (3003, the set of fairseq's ``prepare-wmt14en2de.sh`` and ``sacrebleu -t
  wmt14 -l en-de``), both taken from the WMT19 ``dev.tgz`` as tensorflow_datasets'
  ``wmt14_translate`` does. The raw statmt archives are used rather than the Stanford
  preprocessed copy because their SHA-256 values are published (by tensorflow_datasets) and
  their text is untokenized, which the sentencepiece pipeline expects; the Stanford files are
  Moses-tokenized and only MD5 sums are published for them.

No length filtering or deduplication happens here; pairs with an empty side are dropped from
the training data only (valid and test keep every segment so that BLEU stays comparable).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .download import ArchiveError, DownloadError, built_in_place, extract, fetch

log = logging.getLogger("dsq.data")

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Download:
    """One file of a task: where it comes from and the pinned checksum it must have."""

    filename: str  # name under cache_dir/downloads
    url: str
    sha256: str | None  # None would mean: not downloadable (fetch refuses it)
    size: int | None = None  # bytes, when published
    mirrors: tuple[str, ...] = ()  # other URLs serving the same bytes, tried in order
    checksum_from: str = ""  # where the checksum was published


# convert(archives by filename, scratch dir, output dir) -> line count per split
Converter = Callable[[Mapping[str, Path], Path, Path], dict[str, int]]


@dataclass(frozen=True)
class Source:
    """A task's official data: the files to download and the conversion to plain text."""

    name: str
    src_lang: str
    tgt_lang: str
    description: str
    downloads: tuple[Download, ...]
    convert: Converter


# --------------------------------------------------------------------------- text helpers

# A tag line of the IWSLT train.tags files (<url>, <talkid>, <title>...</title>, <doc ...>):
# it opens with a tag, which ordinary sentences ("<3", "< 5 percent") do not.
_TAG_LINE = re.compile(r"</?[A-Za-z][^>]*>")
_SEGMENT = re.compile(r"<seg\b[^>]*>(.*?)</seg\s*>", re.DOTALL | re.IGNORECASE)
_XML_ENTITY = re.compile(r"&(amp|lt|gt|quot|apos|#[0-9]+|#x[0-9A-Fa-f]+);")
_XML_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


def _clean(text: str) -> str:
    # Any whitespace run (tabs, \r, U+2028 and other line separators) becomes one space, so
    # that every reader sees exactly one sentence per line.
    return " ".join(text.split())


def _xml_unescape(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        entity = match.group(1)
        if entity.startswith("#x"):
            return chr(int(entity[2:], 16))
        if entity.startswith("#"):
            return chr(int(entity[1:]))
        return _XML_NAMED[entity]

    return _XML_ENTITY.sub(replace, text)


def _lines(path: Path) -> Iterator[str]:
    # newline="\n": only \n ends a line, so a stray \r inside a sentence cannot split it and
    # shift one side against the other. Undecodable bytes become U+FFFD rather than aborting
    # a multi-million-line corpus.
    with open(path, encoding="utf-8", errors="replace", newline="\n") as file:
        yield from file


def _lockstep(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Lines of two line-aligned files, pairwise; unequal lengths are an error."""
    missing = object()
    for src_line, tgt_line in itertools.zip_longest(
        _lines(src_path), _lines(tgt_path), fillvalue=missing
    ):
        if src_line is missing or tgt_line is missing:
            raise ArchiveError(
                f"{src_path.name} and {tgt_path.name} have different line counts, so they "
                "are not parallel; pass data.raw_dir= with aligned plain text instead."
            )
        yield src_line, tgt_line


def _parallel_pairs(
    src_path: Path, tgt_path: Path, *, drop_tags: bool
) -> Iterator[tuple[str, str]]:
    """Training pairs of two aligned files, skipping pairs with an empty side (and tag lines).

    Pairs are dropped as a whole, never one side alone, so alignment is kept."""
    for src_line, tgt_line in _lockstep(src_path, tgt_path):
        src_text, tgt_text = _clean(src_line), _clean(tgt_line)
        if not src_text or not tgt_text:
            continue
        if drop_tags and (_TAG_LINE.match(src_text) or _TAG_LINE.match(tgt_text)):
            continue
        yield src_text, tgt_text


def _segments(path: Path, *, xml_escaped: bool) -> list[str]:
    """The ``<seg ...>text</seg>`` contents of an IWSLT .xml or WMT .sgm file, in order."""
    text = path.read_text(encoding="utf-8", errors="replace")
    segments = [match.group(1) for match in _SEGMENT.finditer(text)]
    if xml_escaped:
        segments = [_xml_unescape(segment) for segment in segments]
    # Cleaned last: an entity such as &#10; must not bring a line break back.
    return [_clean(segment) for segment in segments]


def _segment_pairs(src_path: Path, tgt_path: Path, *, xml_escaped: bool) -> list[tuple[str, str]]:
    src_segments = _segments(src_path, xml_escaped=xml_escaped)
    tgt_segments = _segments(tgt_path, xml_escaped=xml_escaped)
    if len(src_segments) != len(tgt_segments) or not src_segments:
        raise ArchiveError(
            f"{src_path.name} has {len(src_segments)} segments and {tgt_path.name} "
            f"{len(tgt_segments)}; expected the same, non-zero number."
        )
    return list(zip(src_segments, tgt_segments))


def _plain_pairs(src_path: Path, tgt_path: Path) -> list[tuple[str, str]]:
    """An evaluation set already in plain text: every line kept, empty or not."""
    return [(_clean(a), _clean(b)) for a, b in _lockstep(src_path, tgt_path)]


def _write_split(
    out_dir: Path, split: str, src_lang: str, tgt_lang: str, pairs: Iterable[tuple[str, str]]
) -> int:
    """Write ``split.src_lang`` and ``split.tgt_lang``; return the number of lines."""
    n_lines = 0
    with (
        open(out_dir / f"{split}.{src_lang}", "w", encoding="utf-8", newline="\n") as src_file,
        open(out_dir / f"{split}.{tgt_lang}", "w", encoding="utf-8", newline="\n") as tgt_file,
    ):
        for src_text, tgt_text in pairs:
            src_file.write(src_text + "\n")
            tgt_file.write(tgt_text + "\n")
            n_lines += 1
    if n_lines == 0:
        raise ArchiveError(f"The {split} split came out empty; the archive is not as expected.")
    return n_lines


def _find(root: Path, name: str) -> Path:
    """The one file called ``name`` anywhere under ``root`` (archives differ in their top
    directory: ``de-en/``, ``training/``, ``dev/`` or none)."""
    matches = sorted(path for path in root.rglob(name) if path.is_file())
    if len(matches) != 1:
        found = "not found" if not matches else f"found {len(matches)} times"
        raise ArchiveError(f"{name} {found} in the unpacked archive {root.name}.")
    return matches[0]


def _find_first(root: Path, names: Iterable[str]) -> Path:
    names = list(names)
    for name in names:
        if any(path.is_file() for path in root.rglob(name)):
            return _find(root, name)
    raise ArchiveError(f"None of {', '.join(names)} is in the unpacked archive {root.name}.")


def _basename_in(names: set[str]) -> Callable[[str], bool]:
    return lambda member: PurePosixPath(member).name in names


# --------------------------------------------------------------------------- IWSLT 2017

IWSLT17_ARCHIVE = "iwslt17-de-en.tgz"
_IWSLT17_REVISION = "ebd7c60d9800c2a1be010a227e5f0a2363730f7a"
_IWSLT17_PATH = "data/2017-01-trnted/texts/de/en/de-en.tgz"


def _convert_iwslt17(archives: Mapping[str, Path], scratch: Path, out_dir: Path) -> dict[str, int]:
    src, tgt, pair = "de", "en", "de-en"
    root = extract(archives[IWSLT17_ARCHIVE], scratch / "iwslt17")
    counts = {
        "train": _write_split(
            out_dir,
            "train",
            src,
            tgt,
            _parallel_pairs(
                _find(root, f"train.tags.{pair}.{src}"),
                _find(root, f"train.tags.{pair}.{tgt}"),
                drop_tags=True,
            ),
        ),
        "valid": _write_split(
            out_dir,
            "valid",
            src,
            tgt,
            _segment_pairs(
                _find(root, f"IWSLT17.TED.dev2010.{pair}.{src}.xml"),
                _find(root, f"IWSLT17.TED.dev2010.{pair}.{tgt}.xml"),
                xml_escaped=True,
            ),
        ),
    }
    # The names differ only in the year, so sorting puts tst2010 first and tst2015 last.
    test_sources = sorted(root.rglob(f"IWSLT17.TED.tst*.{pair}.{src}.xml"))
    if not test_sources:
        raise ArchiveError(f"No IWSLT17.TED.tst*.{pair}.{src}.xml in the unpacked archive.")
    test_pairs: list[tuple[str, str]] = []
    for src_path in test_sources:
        tgt_name = src_path.name[: -len(f".{src}.xml")] + f".{tgt}.xml"
        test_pairs += _segment_pairs(src_path, _find(root, tgt_name), xml_escaped=True)
    counts["test"] = _write_split(out_dir, "test", src, tgt, test_pairs)
    return counts


IWSLT17 = Source(
    name="iwslt17",
    src_lang="de",
    tgt_lang="en",
    description="IWSLT 2017 TED de->en: train.tags, dev2010 valid, tst2010-2015 test",
    downloads=(
        Download(
            filename=IWSLT17_ARCHIVE,
            # The Hugging Face copy of the WIT3 archive (wit3.fbk.eu no longer serves it), at a
            # fixed revision of the dataset repository so that the bytes cannot change. The repo
            # moved from `iwslt2017` to `IWSLT/iwslt2017`; the old name is kept as a mirror.
            url=f"https://huggingface.co/datasets/IWSLT/iwslt2017/resolve/{_IWSLT17_REVISION}/"
            f"{_IWSLT17_PATH}",
            mirrors=(
                f"https://huggingface.co/datasets/iwslt2017/resolve/{_IWSLT17_REVISION}/"
                f"{_IWSLT17_PATH}",
            ),
            sha256="ebcd53c53c8df742437e3a0fb964772e78764c3f6d4e38df0b6a2f71abc3a8b4",
            size=16751373,
            checksum_from=(
                "huggingface/datasets datasets/iwslt2017/dataset_infos.json, config "
                "iwslt2017-de-en, download_checksums of the URL above (old repo name)"
            ),
        ),
    ),
    convert=_convert_iwslt17,
)


# --------------------------------------------------------------------------- WMT 2014

# (archive filename, file stem inside it): Europarl v7, Common Crawl, News Commentary v9,
# the WMT14 En-De constrained training data, concatenated in this order.
_WMT14_TRAIN = (
    ("training-parallel-europarl-v7.tgz", "europarl-v7.de-en"),
    ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
    ("training-parallel-nc-v9.tgz", "news-commentary-v9.de-en"),
)
WMT14_DEV_ARCHIVE = "wmt19-dev.tgz"
_TFDS_WMT14 = "tensorflow/datasets tensorflow_datasets/url_checksums/wmt14_translate.txt"


def _convert_wmt14(archives: Mapping[str, Path], scratch: Path, out_dir: Path) -> dict[str, int]:
    src, tgt = "en", "de"
    train_parts: list[Iterable[tuple[str, str]]] = []
    for filename, stem in _WMT14_TRAIN:
        # Only the de-en files are written (Europarl alone holds five language pairs).
        names = {f"{stem}.{src}", f"{stem}.{tgt}"}
        root = extract(archives[filename], scratch / stem, keep=_basename_in(names))
        train_parts.append(
            _parallel_pairs(
                _find(root, f"{stem}.{src}"), _find(root, f"{stem}.{tgt}"), drop_tags=False
            )
        )
    counts = {"train": _write_split(out_dir, "train", src, tgt, itertools.chain(*train_parts))}

    # newstest2013 is in dev.tgz as plain text (and as .sgm, the fallback). For newstest2014
    # the English-original direction files (-src.en, -ref.de) are the en->de references of
    # sacrebleu; the de->en pair (-ref.en, -src.de) holds the same sentences, the fallback.
    valid_plain = [f"newstest2013.{src}", f"newstest2013.{tgt}"]
    valid_sgm = [
        [f"newstest2013-src.{src}.sgm", f"newstest2013-ref.{src}.sgm"],
        [f"newstest2013-ref.{tgt}.sgm", f"newstest2013-src.{tgt}.sgm"],
    ]
    test_sgm = [
        [f"newstest2014-deen-src.{src}.sgm", f"newstest2014-deen-ref.{src}.sgm"],
        [f"newstest2014-deen-ref.{tgt}.sgm", f"newstest2014-deen-src.{tgt}.sgm"],
    ]
    dev_names = {*valid_plain, *itertools.chain(*valid_sgm), *itertools.chain(*test_sgm)}
    dev_root = extract(archives[WMT14_DEV_ARCHIVE], scratch / "dev", keep=_basename_in(dev_names))
    if all(any(dev_root.rglob(name)) for name in valid_plain):
        valid_pairs = _plain_pairs(*(_find(dev_root, name) for name in valid_plain))
    else:
        valid_pairs = _segment_pairs(
            *(_find_first(dev_root, names) for names in valid_sgm), xml_escaped=False
        )
    counts["valid"] = _write_split(out_dir, "valid", src, tgt, valid_pairs)
    # WMT .sgm files are read as-is (no entity decoding), as Moses' input-from-sgm.perl and
    # sacrebleu do, so that the references match the published ones.
    test_pairs = _segment_pairs(
        *(_find_first(dev_root, names) for names in test_sgm), xml_escaped=False
    )
    counts["test"] = _write_split(out_dir, "test", src, tgt, test_pairs)
    return counts


def _statmt(path: str, sha256: str, size: int, checksum_from: str, host: str = "www") -> Download:
    """A statmt.org archive: https, with the same path over http as the mirror."""
    url = f"{host}.statmt.org/{path}"
    return Download(
        filename=WMT14_DEV_ARCHIVE if path.endswith("/dev.tgz") else PurePosixPath(path).name,
        url=f"https://{url}",
        mirrors=(f"http://{url}",),
        sha256=sha256,
        size=size,
        checksum_from=checksum_from,
    )


_ALSO_STAGEDML = f"{_TFDS_WMT14} (the same value is pinned by stagedml's fetchurl)"
WMT14 = Source(
    name="wmt14",
    src_lang="en",
    tgt_lang="de",
    description="WMT14 en->de: Europarl v7 + Common Crawl + News Commentary v9, "
    "newstest2013 valid, newstest2014 (full) test",
    downloads=(
        _statmt(
            "wmt13/training-parallel-europarl-v7.tgz",
            "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
            657632379,
            _ALSO_STAGEDML,
        ),
        _statmt(
            "wmt13/training-parallel-commoncrawl.tgz",
            "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
            918311367,
            _ALSO_STAGEDML,
        ),
        _statmt(
            "wmt14/training-parallel-nc-v9.tgz",
            "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
            80418416,
            _TFDS_WMT14,
        ),
        _statmt(
            "wmt19/translation-task/dev.tgz",
            "7a7deccf82ebb05ba508dba5eb21356492224e8f630ec4f992132b029b4b25e7",
            38654961,
            _TFDS_WMT14,
            host="data",
        ),
    ),
    convert=_convert_wmt14,
)


SOURCES: dict[str, Source] = {source.name: source for source in (IWSLT17, WMT14)}


# --------------------------------------------------------------------------- preparing


def _fetch_any(download: Download, dest: Path, timeout: float) -> Path:
    """Fetch from the first of the URL and its mirrors that delivers the pinned bytes."""
    failures: list[DownloadError] = []
    for url in (download.url, *download.mirrors):
        try:
            return fetch(url, download.sha256, dest, timeout=timeout, size=download.size)
        except DownloadError as err:
            if not download.sha256:
                raise  # no checksum: no URL will do, say so once
            log.info("%s", err)
            failures.append(err)
    if len(failures) == 1:
        raise failures[0]
    # One line: the first URL's failure stands for all; the mirrors are counted, not repeated.
    raise failures[0].with_fields(mirrors_failed=len(failures) - 1) from failures[-1]


def raw_dir_of(task: str, cache_dir: Path) -> Path:
    """Where ``prepare_raw`` puts a task's plain text."""
    return Path(cache_dir) / "raw" / task


def prepare_raw(task: str, cache_dir: Path, *, timeout: float = 60) -> Path:
    """Plain parallel text of ``task`` in ``cache_dir/raw/<task>``, downloading and converting
    it first unless it is already there. Returns the directory, which holds
    ``{train,valid,test}.{src_lang,tgt_lang}`` and ``manifest.json`` (sources, checksums,
    line counts)."""
    if task not in SOURCES:
        raise ValueError(f"Unknown task {task!r}; downloadable tasks: {', '.join(SOURCES)}.")
    source = SOURCES[task]
    out_dir = raw_dir_of(task, cache_dir)
    if (out_dir / MANIFEST).is_file():
        return out_dir  # renamed into place only when complete
    if out_dir.exists():
        raise DownloadError(
            f"{out_dir} exists but was not made by dsq (no {MANIFEST}); remove it, or pass "
            f"data.raw_dir={out_dir} if it holds plain parallel text."
        )

    downloads_dir = Path(cache_dir) / "downloads"
    archives = {
        download.filename: _fetch_any(download, downloads_dir / download.filename, timeout)
        for download in source.downloads
    }

    with built_in_place(out_dir, MANIFEST) as (text_dir, scratch):
        log.info("converting %s into plain text", task)
        counts = source.convert(archives, scratch, text_dir)
        manifest = {
            "task": source.name,
            "description": source.description,
            "src_lang": source.src_lang,
            "tgt_lang": source.tgt_lang,
            "lines": counts,
            "downloads": [
                {"filename": d.filename, "url": d.url, "sha256": d.sha256} for d in source.downloads
            ],
        }
        (text_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log.info("%s ready in %s (%s)", task, out_dir, counts)
    return out_dir
