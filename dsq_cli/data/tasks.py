"""Where each translation task's raw text comes from: one small registered class per task.

A task turns the config into three aligned splits (`ParallelSplit`) and a fingerprint of its
inputs, which keys the prepared cache. ``data.raw_dir`` always wins over a download.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dsq_cli.run_config import RunConfig

from .download import sha256_of
from .raw import SPLITS, DataError, ParallelSplit, find_file, read_parallel

if TYPE_CHECKING:
    from .download import DownloadError

TASKS: dict[str, type[TranslationTask]] = {}


def register_task(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        cls.name = name
        TASKS[name] = cls
        return cls

    return add


def get_task(name: str, cfg: RunConfig) -> TranslationTask:
    if name not in TASKS:
        raise DataError(f"unknown translation task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](cfg)


class TranslationTask:
    """A parallel corpus with train/valid/test splits and a source and target language."""

    name = "?"
    # split -> file stem in the raw directory (a task may use other names, e.g. val).
    split_stems = {split: split for split in SPLITS}

    def __init__(self, cfg: RunConfig):
        if cfg.task.src is None or cfg.task.tgt is None:
            raise DataError(
                f"task {self.name} needs task.src and task.tgt (the language suffixes), "
                f"got {cfg.task.src!r} and {cfg.task.tgt!r}"
            )
        self.cfg = cfg
        self.src: str = cfg.task.src
        self.tgt: str = cfg.task.tgt

    def raw_dir(self) -> Path:
        """The directory holding ``{stem}.{lang}[.gz]``: data.raw_dir, else the download."""
        if self.cfg.data.raw_dir is None:
            return self.download()
        path = Path(self.cfg.data.raw_dir).expanduser()
        if not path.is_dir():
            raise DataError(
                f"data.raw_dir={self.cfg.data.raw_dir} does not exist or is not a directory; "
                f"point it at the folder holding the {self.name} text files"
            )
        return path

    def download(self) -> Path:
        raise DataError(
            f"task {self.name} has no download; pass data.raw_dir=DIR with "
            f"{{train,valid,test}}.{{{self.src},{self.tgt}}}[.gz]"
        )

    def files(self) -> dict[str, tuple[Path, Path]]:
        directory = self.raw_dir()
        return {
            split: (
                find_file(directory, f"{self.split_stems[split]}.{self.src}"),
                find_file(directory, f"{self.split_stems[split]}.{self.tgt}"),
            )
            for split in SPLITS
        }

    def fingerprint(self) -> str:
        """A digest of everything the prepared data depends on, from this task's side."""
        digest = hashlib.sha256(f"{self.name}:{self.src}-{self.tgt}".encode())
        for split, pair in sorted(self.files().items()):
            for path in pair:
                digest.update(f"{split}:{path.name}:{sha256_of(path)}".encode())
        return digest.hexdigest()

    def load(self) -> dict[str, ParallelSplit]:
        return {
            split: read_parallel(src, tgt, drop_blank=(split == "train"))
            for split, (src, tgt) in self.files().items()
        }


@register_task("translation")
class PlainTranslation(TranslationTask):
    """Any parallel text in data.raw_dir."""


@register_task("demo")
class Demo(TranslationTask):
    """Generated in process (dsq_cli.data.demo): no files, nothing to download."""

    def fingerprint(self) -> str:
        sizes = dict(self.cfg.task.sizes)
        return hashlib.sha256(f"demo-v2:{sorted(sizes.items())}".encode()).hexdigest()

    def load(self) -> dict[str, ParallelSplit]:
        from . import demo

        sizes = self.cfg.task.sizes
        return {split: ParallelSplit(*demo.generate(split, sizes[split])) for split in SPLITS}


class Downloaded(TranslationTask):
    """A task whose official text is downloaded (docs/spec.md §7: pinned SHA-256) when no raw_dir is
    given."""

    def download_dir(self) -> Path:
        return Path(self.cfg.data.cache_dir).expanduser() / "downloads" / self.name

    def offline_hint(self) -> str:
        return (
            f"To work offline, run `dsq data {self.name} "
            f"data.cache_dir={self.cfg.data.cache_dir}` on a machine with network and copy that "
            "cache here, or pass "
            f"data.raw_dir=DIR with "
            + ", ".join(
                f"{stem}.{{{self.src},{self.tgt}}}[.gz]" for stem in self.split_stems.values()
            )
        )

    def download_failed(self, err: DownloadError) -> DataError:
        """The usage error for a failed download: what failed, then this task's ways around it
        (a verified file placed by hand is used as if downloaded)."""
        by_hand = ""
        if err.dest is not None and err.expected_sha256:
            by_hand = f", or place {err.dest.name} (sha256 {err.expected_sha256}) at {err.dest}"
        return DataError(f"{err} {self.offline_hint()}{by_hand}")


# Multi30k task 1 raw text, byte for byte as in github.com/multi30k/dataset (data/task1/raw).
MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{name}"
MULTI30K_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
}


@register_task("multi30k")
class Multi30k(Downloaded):
    split_stems = {"train": "train", "valid": "val", "test": "test_2016_flickr"}

    def download(self) -> Path:
        from .download import DownloadError, fetch

        directory = self.download_dir()
        for name, sha256 in MULTI30K_SHA256.items():
            try:
                fetch(MULTI30K_URL.format(name=name), sha256, directory / name)
            except DownloadError as err:
                raise self.download_failed(err) from None
        return directory


class _Official(Downloaded):
    """IWSLT17 and WMT14: the official archives, converted to plain text by .sources."""

    def download(self) -> Path:
        from .download import DownloadError
        from .sources import prepare_raw

        try:
            return Path(prepare_raw(self.name, Path(self.cfg.data.cache_dir).expanduser()))
        except DownloadError as err:
            raise self.download_failed(err) from None


@register_task("iwslt17")
class Iwslt17(_Official):
    pass


@register_task("wmt14")
class Wmt14(_Official):
    pass
