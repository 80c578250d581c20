"""Verified downloads, safe unpacking and the IWSLT17/WMT14 converters, all offline.

Downloads use file:// URLs (urllib serves them like http); the converters run on small
synthetic archives laid out like the real ones (tag lines, <seg> lines, top directories)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from dsq_cli.data import sources
from dsq_cli.data.download import ArchiveError, DownloadError, extract, fetch, sha256_of

# --------------------------------------------------------------------------- helpers


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_tgz(path: Path, members: dict[str, str | bytes]) -> Path:
    """A .tgz holding ``members`` (name -> text), directories implied by the names."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            data = content.encode("utf-8") if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def listing(directory: Path) -> list[str]:
    """Everything under ``directory`` (hidden temporary files included)."""
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


def fail_network(*args, **kwargs):
    raise AssertionError("the network was used")


# --------------------------------------------------------------------------- fetch


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, bytes]:
    data = b"pinned bytes\n" * 1000
    origin = tmp_path / "origin" / "file.bin"
    origin.parent.mkdir()
    origin.write_bytes(data)
    return origin, data


def test_matching_checksum_puts_the_file_in_place(tmp_path, payload):
    origin, data = payload
    cache = tmp_path / "cache"
    dest = fetch(origin.as_uri(), sha256_hex(data), cache / "file.bin", size=len(data))
    assert dest == cache / "file.bin"
    assert dest.read_bytes() == data
    assert sha256_of(dest) == sha256_hex(data)
    assert listing(cache) == ["file.bin"]  # no temporary file left over


def test_mismatch_names_url_and_both_checksums_and_leaves_nothing(tmp_path, payload):
    origin, data = payload
    cache = tmp_path / "cache"
    wrong = "0" * 64
    with pytest.raises(DownloadError) as caught:
        fetch(origin.as_uri(), wrong, cache / "file.bin")
    message = str(caught.value)
    assert origin.as_uri() in message
    assert wrong in message and sha256_hex(data) in message
    error = caught.value  # the fields a caller's advice is built from
    assert (error.url, error.dest) == (origin.as_uri(), cache / "file.bin")
    assert (error.expected_sha256, error.actual_sha256) == (wrong, sha256_hex(data))
    assert "data.raw_dir=" not in message  # the advice is the caller's, not fetch's
    assert "\n" not in message
    assert listing(cache) == []


def test_missing_source_is_a_download_error_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    url = (tmp_path / "does-not-exist.tgz").as_uri()
    with pytest.raises(DownloadError) as caught:
        fetch(url, "a" * 64, cache / "x.tgz")
    assert url in str(caught.value) and caught.value.expected_sha256 == "a" * 64
    assert listing(cache) == []


class _BreaksMidStream:
    """A response that delivers one chunk and then loses the connection."""

    headers: dict[str, str] = {}

    def __init__(self, error: BaseException):
        self.error = error
        self.chunks = [b"first chunk"]

    def read(self, n: int) -> bytes:
        if self.chunks:
            return self.chunks.pop()
        raise self.error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_interrupted_transfer_leaves_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(
        urllib.request, "urlopen", lambda *a, **k: _BreaksMidStream(ConnectionResetError("reset"))
    )
    with pytest.raises(DownloadError) as caught:
        fetch("https://example.org/big.tgz", "b" * 64, cache / "big.tgz")
    assert "https://example.org/big.tgz" in str(caught.value)
    assert "reset" in str(caught.value) and "11 bytes" in str(caught.value)
    assert listing(cache) == []


def test_keyboard_interrupt_mid_transfer_leaves_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(
        urllib.request, "urlopen", lambda *a, **k: _BreaksMidStream(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        fetch("https://example.org/big.tgz", "b" * 64, cache / "big.tgz")
    assert listing(cache) == []


def test_http_error_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def not_found(request, timeout):
        raise urllib.error.HTTPError(request.full_url, 404, "Not\nFound", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", not_found)
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError) as caught:
        fetch("https://example.org/gone.tgz", "c" * 64, cache / "gone.tgz")
    assert "HTTP 404" in str(caught.value) and "\n" not in str(caught.value)
    assert listing(cache) == []


def test_wrong_announced_size_is_refused_before_reading(tmp_path, payload):
    origin, data = payload
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match="announces"):
        fetch(origin.as_uri(), sha256_hex(data), cache / "file.bin", size=len(data) + 1)
    assert listing(cache) == []


def test_existing_good_file_is_reused_without_network(tmp_path, monkeypatch):
    data = b"already here"
    dest = tmp_path / "cache" / "file.bin"
    dest.parent.mkdir()
    dest.write_bytes(data)
    monkeypatch.setattr(urllib.request, "urlopen", fail_network)
    assert fetch("https://example.org/file.bin", sha256_hex(data), dest) == dest
    assert dest.read_bytes() == data


def test_existing_bad_file_is_replaced_by_a_verified_download(tmp_path, payload):
    origin, data = payload
    dest = tmp_path / "cache" / "file.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"truncated")
    fetch(origin.as_uri(), sha256_hex(data), dest)
    assert dest.read_bytes() == data
    assert listing(dest.parent) == ["file.bin"]


def test_existing_bad_file_is_kept_when_the_download_fails(tmp_path):
    dest = tmp_path / "cache" / "file.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"hand-placed")
    missing = (tmp_path / "missing.bin").as_uri()
    with pytest.raises(DownloadError, match="left unchanged"):
        fetch(missing, "d" * 64, dest)
    assert dest.read_bytes() == b"hand-placed"
    assert listing(dest.parent) == ["file.bin"]


def test_no_pinned_checksum_is_refused_without_network(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", fail_network)
    with pytest.raises(DownloadError, match="No pinned SHA-256"):
        fetch("https://example.org/unpinned.tgz", None, tmp_path / "unpinned.tgz")
    assert not (tmp_path / "unpinned.tgz").exists()


# --------------------------------------------------------------------------- extract


def test_extract_tgz_and_zip(tmp_path):
    members = {"top/a.txt": "alpha\n", "top/sub/b.txt": "beta\n"}
    make_tgz(tmp_path / "x.tgz", members)
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zipped:
        for name, text in members.items():
            zipped.writestr(name, text)
    for archive in ("x.tgz", "x.zip"):
        into = extract(tmp_path / archive, tmp_path / f"out-{archive}")
        assert (into / "top" / "a.txt").read_text() == "alpha\n"
        assert (into / "top" / "sub" / "b.txt").read_text() == "beta\n"
    kept = extract(
        tmp_path / "x.tgz", tmp_path / "only-b", keep=lambda name: name.endswith("b.txt")
    )
    assert listing(kept) == ["top", "top/sub", "top/sub/b.txt"]
    with pytest.raises(FileExistsError):
        extract(tmp_path / "x.tgz", tmp_path / "only-b")


@pytest.mark.parametrize("evil_name", ["../evil.txt", "top/../../evil.txt", "/tmp/evil.txt"])
def test_path_traversal_tar_is_refused(tmp_path, evil_name):
    archive = make_tgz(tmp_path / "evil.tgz", {"top/ok.txt": "fine\n", evil_name: "gotcha\n"})
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ArchiveError, match="evil.txt"):
        extract(archive, work / "out")
    assert listing(work) == []  # neither the target nor its temporary directory
    assert not (tmp_path / "evil.txt").exists()


def test_path_traversal_zip_is_refused(tmp_path):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("ok.txt", "fine")
        zipped.writestr("../evil.txt", "gotcha")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ArchiveError, match="leaves the target"):
        extract(archive, work / "out")
    assert listing(work) == []
    assert not (tmp_path / "evil.txt").exists()


def test_links_in_tar_are_refused(tmp_path):
    archive = tmp_path / "link.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        link = tarfile.TarInfo("top/passwd")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ArchiveError, match="link"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_archive_is_an_archive_error(tmp_path):
    archive = tmp_path / "broken.tgz"
    archive.write_bytes(b"not gzip at all")
    with pytest.raises(ArchiveError, match="broken.tgz"):
        extract(archive, tmp_path / "out")
    assert listing(tmp_path) == ["broken.tgz"]


# --------------------------------------------------------------------------- IWSLT17


def iwslt_train(lang: str, sentences: list[str]) -> str:
    return (
        "\n".join(
            [
                '<doc docid="1" genre="lectures">',
                "<url>http://www.ted.com/talks/a.html</url>",
                f"<keywords>talks, {lang}</keywords>",
                "<speaker>Al Gore</speaker>",
                "<talkid>1</talkid>",
                f"<title>Title {lang}</title>",
                f"<description>TED Talk {lang}</description>",
                *sentences[:2],
                "</doc>",
                '<reviewer href="http://example.org">R</reviewer>',
                '<translator href="http://example.org">T</translator>',
                *sentences[2:],
            ]
        )
        + "\n"
    )


def iwslt_xml(lang: str, setid: str, segments: list[str]) -> str:
    segs = "\n".join(f'<seg id="{i}"> {text} </seg>' for i, text in enumerate(segments, 1))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n'
        f'<refset setid="{setid}" srclang="german" trglang="{lang}">\n'
        '<doc docid="535" genre="lectures">\n<url>http://www.ted.com/talks/x.html</url>\n'
        f"<description>TED Talk</description>\n<talkid>535</talkid>\n<title>T</title>\n"
        f"{segs}\n</doc>\n</refset>\n</mteval>\n"
    )


GERMAN_TRAIN = ["Vielen Dank.", "Das ist <b>gut</b>\r ja.", "", "Dritter Satz.", "<3 Liebe"]
ENGLISH_TRAIN = ["Thank you.", "That is <b>good</b> yes.", "Orphan.", "Third sentence.", "<3 love"]


def make_iwslt_archive(path: Path) -> Path:
    return make_tgz(
        path,
        {
            "de-en/README": "readme\n",
            "de-en/train.tags.de-en.de": iwslt_train("de", GERMAN_TRAIN),
            "de-en/train.tags.de-en.en": iwslt_train("en", ENGLISH_TRAIN),
            "de-en/IWSLT17.TED.dev2010.de-en.de.xml": iwslt_xml(
                "de", "dev", ["Hallo Welt.", "A&amp;B&#10;C"]
            ),
            "de-en/IWSLT17.TED.dev2010.de-en.en.xml": iwslt_xml(
                "en", "dev", ["Hello world.", "A&amp;B"]
            ),
            "de-en/IWSLT17.TED.tst2011.de-en.de.xml": iwslt_xml("de", "t11", ["Elf."]),
            "de-en/IWSLT17.TED.tst2011.de-en.en.xml": iwslt_xml("en", "t11", ["Eleven."]),
            "de-en/IWSLT17.TED.tst2010.de-en.de.xml": iwslt_xml("de", "t10", ["Zehn.", "Zehn b."]),
            "de-en/IWSLT17.TED.tst2010.de-en.en.xml": iwslt_xml("en", "t10", ["Ten.", "Ten b."]),
        },
    )


def read_split(directory: Path, split: str, src: str, tgt: str) -> tuple[list[str], list[str]]:
    src_lines = (directory / f"{split}.{src}").read_text(encoding="utf-8").split("\n")
    tgt_lines = (directory / f"{split}.{tgt}").read_text(encoding="utf-8").split("\n")
    assert src_lines[-1] == "" and tgt_lines[-1] == ""  # newline-terminated
    assert len(src_lines) == len(tgt_lines)
    return src_lines[:-1], tgt_lines[:-1]


def test_iwslt17_converter_aligns_and_strips_markup(tmp_path):
    archive = make_iwslt_archive(tmp_path / sources.IWSLT17_ARCHIVE)
    out = tmp_path / "out"
    out.mkdir()
    counts = sources.IWSLT17.convert({sources.IWSLT17_ARCHIVE: archive}, tmp_path / "scratch", out)

    train_de, train_en = read_split(out, "train", "de", "en")
    # Tag lines are gone; the pair with an empty German side is dropped as a whole; a \r inside
    # a sentence does not split it; "<3" is a sentence, not a tag.
    assert train_de == ["Vielen Dank.", "Das ist <b>gut</b> ja.", "Dritter Satz.", "<3 Liebe"]
    assert train_en == ["Thank you.", "That is <b>good</b> yes.", "Third sentence.", "<3 love"]
    assert read_split(out, "valid", "de", "en") == (
        ["Hallo Welt.", "A&B C"],
        ["Hello world.", "A&B"],
    )
    # tst2010 before tst2011, whatever the order inside the archive.
    assert read_split(out, "test", "de", "en") == (
        ["Zehn.", "Zehn b.", "Elf."],
        ["Ten.", "Ten b.", "Eleven."],
    )
    assert counts == {"train": 4, "valid": 2, "test": 3}
    for path in out.iterdir():
        text = path.read_text(encoding="utf-8")
        assert "<seg" not in text and "<url>" not in text and "<title>" not in text


def test_iwslt17_misaligned_train_files_are_refused(tmp_path):
    archive = make_iwslt_archive(tmp_path / sources.IWSLT17_ARCHIVE)
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    members["de-en/train.tags.de-en.de"] += b"one extra line\n"
    make_tgz(archive, members)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ArchiveError, match="different line counts"):
        sources.IWSLT17.convert({sources.IWSLT17_ARCHIVE: archive}, tmp_path / "scratch", out)


# --------------------------------------------------------------------------- WMT14


def sgm(lang: str, segments: list[str]) -> str:
    segs = "\n".join(f'<seg id="{i}">{text}</seg>' for i, text in enumerate(segments, 1))
    return (
        f'<srcset setid="newstest2014" srclang="{lang}">\n'
        '<doc sysid="ref" docid="1" origlang="en">\n<p>\n'
        f"{segs}\n</p>\n</doc>\n</srcset>\n"
    )


def make_wmt14_archives(directory: Path) -> dict[str, Path]:
    return {
        "training-parallel-europarl-v7.tgz": make_tgz(
            directory / "training-parallel-europarl-v7.tgz",
            {
                "training/europarl-v7.de-en.en": "Resumption of the session\n\nI declare.\n",
                "training/europarl-v7.de-en.de": (
                    "Wiederaufnahme der Sitzungsperiode\nLeer.\nIch erkläre.\n"
                ),
                "training/europarl-v7.fr-en.fr": "Reprise de la session\n",
                "training/europarl-v7.fr-en.en": "Resumption of the session\n",
            },
        ),
        "training-parallel-commoncrawl.tgz": make_tgz(
            directory / "training-parallel-commoncrawl.tgz",
            {
                "commoncrawl.de-en.en": "Crawled\u2028line\n<P> kept as text\n",
                "commoncrawl.de-en.de": "Gecrawlte Zeile\n<P> als Text\n",
                "commoncrawl.fr-en.fr": "Rampé\n",
            },
        ),
        "training-parallel-nc-v9.tgz": make_tgz(
            directory / "training-parallel-nc-v9.tgz",
            {
                "training/news-commentary-v9.de-en.en": "News \tcommentary\n",
                "training/news-commentary-v9.de-en.de": "Nachrichten\n",
            },
        ),
        sources.WMT14_DEV_ARCHIVE: make_tgz(
            directory / sources.WMT14_DEV_ARCHIVE,
            {
                "dev/newstest2013.en": "Valid one\nValid two\n",
                "dev/newstest2013.de": "Gültig eins\nGültig zwei\n",
                "dev/newstest2012.en": "unused\n",
                "dev/newstest2014-deen-src.en.sgm": sgm("en", ["Gutach: Safety.", "A &amp; B"]),
                "dev/newstest2014-deen-ref.de.sgm": sgm("de", ["Gutach: Sicherheit.", "A &amp; B"]),
                "dev/newstest2014-deen-src.de.sgm": sgm("de", ["wrong direction"]),
            },
        ),
    }


def test_wmt14_converter_aligns_and_strips_markup(tmp_path):
    archives = make_wmt14_archives(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    counts = sources.WMT14.convert(archives, tmp_path / "scratch", out)

    train_en, train_de = read_split(out, "train", "en", "de")
    # Europarl, Common Crawl, News Commentary in that order; the empty-English pair dropped;
    # the U+2028 line separator and the tab folded into spaces; French files not used.
    assert train_en == [
        "Resumption of the session",
        "I declare.",
        "Crawled line",
        "<P> kept as text",
        "News commentary",
    ]
    assert train_de == [
        "Wiederaufnahme der Sitzungsperiode",
        "Ich erkläre.",
        "Gecrawlte Zeile",
        "<P> als Text",
        "Nachrichten",
    ]
    assert read_split(out, "valid", "en", "de") == (
        ["Valid one", "Valid two"],
        ["Gültig eins", "Gültig zwei"],
    )
    # sgm read as-is (like sacrebleu): markup gone, entities untouched.
    assert read_split(out, "test", "en", "de") == (
        ["Gutach: Safety.", "A &amp; B"],
        ["Gutach: Sicherheit.", "A &amp; B"],
    )
    assert counts == {"train": 5, "valid": 2, "test": 2}
    assert sorted(p.name for p in out.iterdir()) == [
        f"{split}.{lang}" for split in ("test", "train", "valid") for lang in ("de", "en")
    ]


# --------------------------------------------------------------------------- prepare_raw


def pin_to_local(monkeypatch, task: str, archives: dict[str, Path]) -> None:
    """Point a task's downloads at local archives (file:// URLs) with their true checksums."""
    source = sources.SOURCES[task]
    downloads = tuple(
        dataclasses.replace(
            download,
            url=archives[download.filename].as_uri(),
            mirrors=(),
            sha256=sha256_of(archives[download.filename]),
            size=archives[download.filename].stat().st_size,
        )
        for download in source.downloads
    )
    monkeypatch.setitem(sources.SOURCES, task, dataclasses.replace(source, downloads=downloads))


def test_prepare_raw_downloads_converts_and_then_reuses(tmp_path, monkeypatch):
    origin = tmp_path / "origin"
    origin.mkdir()
    archive = make_iwslt_archive(origin / "de-en.tgz")
    pin_to_local(monkeypatch, "iwslt17", {sources.IWSLT17_ARCHIVE: archive})
    cache = tmp_path / "cache"

    raw = sources.prepare_raw("iwslt17", cache)
    assert raw == cache / "raw" / "iwslt17"
    assert (cache / "downloads" / sources.IWSLT17_ARCHIVE).read_bytes() == archive.read_bytes()
    manifest = json.loads((raw / "manifest.json").read_text())
    assert manifest["lines"] == {"train": 4, "valid": 2, "test": 3}
    assert manifest["src_lang"] == "de" and manifest["tgt_lang"] == "en"
    assert listing(cache / "raw") == sorted(
        ["iwslt17", "iwslt17/manifest.json"]
        + [f"iwslt17/{s}.{lang}" for s in ("train", "valid", "test") for lang in ("de", "en")]
    )  # no scratch or temporary directory left

    monkeypatch.setattr(urllib.request, "urlopen", fail_network)
    assert sources.prepare_raw("iwslt17", cache) == raw
    # The archive alone is enough to rebuild offline: it is reused, verified, not fetched.
    shutil.rmtree(raw)
    assert sources.prepare_raw("iwslt17", cache) == raw


def test_prepare_raw_with_wrong_checksum_leaves_nothing(tmp_path, monkeypatch):
    archive = make_iwslt_archive(tmp_path / "de-en.tgz")
    pin_to_local(monkeypatch, "iwslt17", {sources.IWSLT17_ARCHIVE: archive})
    source = sources.SOURCES["iwslt17"]
    bad = dataclasses.replace(source.downloads[0], sha256="e" * 64)
    monkeypatch.setitem(sources.SOURCES, "iwslt17", dataclasses.replace(source, downloads=(bad,)))
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError) as caught:
        sources.prepare_raw("iwslt17", cache)
    assert archive.as_uri() in str(caught.value) and "e" * 64 in str(caught.value)
    assert listing(cache) == ["downloads"]


def test_prepare_raw_wmt14_end_to_end(tmp_path, monkeypatch):
    origin = tmp_path / "origin"
    origin.mkdir()
    pin_to_local(monkeypatch, "wmt14", make_wmt14_archives(origin))
    raw = sources.prepare_raw("wmt14", tmp_path / "cache")
    assert read_split(raw, "valid", "en", "de")[1] == ["Gültig eins", "Gültig zwei"]
    assert listing(tmp_path / "cache" / "raw") == sorted(
        ["wmt14", "wmt14/manifest.json"]
        + [f"wmt14/{s}.{lang}" for s in ("train", "valid", "test") for lang in ("de", "en")]
    )


def test_prepare_raw_refuses_a_foreign_directory_and_unknown_tasks(tmp_path):
    (tmp_path / "raw" / "iwslt17").mkdir(parents=True)
    with pytest.raises(DownloadError, match="not made by dsq"):
        sources.prepare_raw("iwslt17", tmp_path)
    with pytest.raises(ValueError, match="iwslt17, wmt14"):
        sources.prepare_raw("nope", tmp_path)


def test_every_registered_download_is_pinned():
    for source in sources.SOURCES.values():
        assert source.downloads
        for download in source.downloads:
            assert download.sha256 is not None and len(download.sha256) == 64
            int(download.sha256, 16)
            assert download.url.startswith("https://")
            assert download.checksum_from
