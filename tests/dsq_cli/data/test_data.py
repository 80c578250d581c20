"""Data reading and preparation for every translation task: the demo corpus, plain parallel text,
multi30k (real data from ../shared/data), IWSLT17/WMT14 from a raw_dir or a (failing) download,
malformed input named by file and line, and the atomic cache."""

from __future__ import annotations

import gzip
import json

import pytest
from helpers.paths import SHARED_DATA
from typer.testing import CliRunner

from dsq_cli.cli import app
from dsq_cli.config import compose
from dsq_cli.data import demo
from dsq_cli.data.prepare import prepare
from dsq_cli.data.raw import DataError, read_parallel
from dsq_cli.data.tasks import MULTI30K_SHA256, TASKS, get_task

MULTI30K = SHARED_DATA / "multi30k"


def write(path, lines, gz=False):
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def parallel_dir(tmp_path, src="de", tgt="en", n=(40, 8, 8), gz=False, stems=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    stems = stems or {"train": "train", "valid": "valid", "test": "test"}
    for (split, stem), count in zip(stems.items(), n):
        suffix = ".gz" if gz else ""
        write(
            tmp_path / f"{stem}.{src}{suffix}",
            [f"{split} quelle {i} satz" for i in range(count)],
            gz,
        )
        write(
            tmp_path / f"{stem}.{tgt}{suffix}",
            [f"{split} source {i} sentence" for i in range(count)],
            gz,
        )
    return tmp_path


def cfg_for(task, cache, *extra):
    return compose([f"task={task}", f"data.cache_dir={cache}", "data.vocab_size=60", *extra])


def test_every_task_config_has_a_reader():
    from dsq_cli.config import group_choices
    from dsq_cli.data.glue import GLUE_TASKS
    from dsq_cli.data.lm import LM_TASKS

    assert set(group_choices("task")) == set(TASKS) | set(GLUE_TASKS) | set(LM_TASKS)
    assert len(TASKS) + len(GLUE_TASKS) + len(LM_TASKS) == len(group_choices("task"))


def test_demo_corpus_is_deterministic_and_not_copyable():
    src, tgt = demo.generate("train", 200)
    assert (src, tgt) == demo.generate("train", 200)
    assert demo.generate("valid", 50) != demo.generate("test", 50)
    src_words = {w for line in src for w in line.split()}
    tgt_words = {w for line in tgt for w in line.split()}
    assert len(src_words & tgt_words) <= 2  # disjoint vocabularies (a '.'-word may coincide)
    assert all(len(s.split()) >= 4 for s in src)


def test_demo_copy_baseline_scores_about_zero():
    import sacrebleu

    src, tgt = demo.generate("test", 300)
    assert sacrebleu.corpus_bleu(src, [tgt]).score < 1.0


def test_translation_task_reads_plain_and_gzipped_text(tmp_path):
    for gz in (False, True):
        raw = (
            parallel_dir(tmp_path / f"gz{gz}", gz=gz)
            if (tmp_path / f"gz{gz}").mkdir() is None
            else None
        )
        cfg = cfg_for(
            "translation", tmp_path / "cache", f"data.raw_dir={raw}", "data.src=de", "data.tgt=en"
        )
        splits = get_task("translation", cfg).load()
        assert [len(splits[s]) for s in ("train", "valid", "test")] == [40, 8, 8]
        assert splits["test"].src[3] == "test quelle 3 satz"
        assert splits["test"].tgt[3] == "test source 3 sentence"


def test_prepare_builds_a_fairseq_directory_and_reuses_it(tmp_path):
    raw = parallel_dir(tmp_path / "raw")
    cfg = cfg_for(
        "translation", tmp_path / "cache", f"data.raw_dir={raw}", "data.src=de", "data.tgt=en"
    )
    first = prepare(cfg)
    files = ["dict.de.txt", "dict.en.txt", "spm.model", "train.de-en.de.bin", "test.raw.en"]
    for name in [*files, "test.de-en.en.idx", "manifest.json"]:
        assert (first.path / name).is_file(), name
    assert first.manifest["sizes"] == {"train": 40, "valid": 8, "test": 8}
    assert (first.path / "test.raw.en").read_text().splitlines()[0] == "test source 0 sentence"
    again = prepare(cfg)
    assert again.path == first.path  # a cache hit
    # A changed input is a different key, never the stale cache.
    write(raw / "train.en", [f"changed {i}" for i in range(40)])
    assert prepare(cfg).path != first.path
    subset = prepare(compose([*_args(cfg), "data.subset=10"]))
    assert subset.manifest["sizes"]["train"] == 10


def _args(cfg):
    data = cfg.data
    return [
        f"task={cfg.task.name}",
        f"data.cache_dir={data.cache_dir}",
        "data.vocab_size=60",
        f"data.raw_dir={data.raw_dir}",
        f"data.src={data.src}",
        f"data.tgt={data.tgt}",
    ]


def test_interrupted_preparation_leaves_nothing(tmp_path, monkeypatch):
    import dsq_cli.data.prepare as prep

    raw = parallel_dir(tmp_path / "raw")
    cfg = cfg_for(
        "translation", tmp_path / "cache", f"data.raw_dir={raw}", "data.src=de", "data.tgt=en"
    )

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_binarize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    assert list((tmp_path / "cache" / "prepared").iterdir()) == []  # no final, no temp dir
    monkeypatch.undo()
    assert prepare(cfg).manifest["sizes"]["train"] == 40


def _truncate_gzip(d):
    (d / "train.de").unlink()
    (d / "train.de.gz").write_bytes(gzip.compress(b"x\n" * 40)[:20])


DAMAGE = {
    "unaligned": (
        lambda d: write(d / "train.en", ["only one line"]),
        r"train.de:2: line has no partner: .*train.en ends after line 1",
    ),
    "empty": (lambda d: (d / "valid.de").write_bytes(b""), r"valid.de is empty"),
    "not utf-8": (
        lambda d: (d / "test.en").write_bytes(b"fine\n\xff\xfe broken\n" + b"x\n" * 6),
        r"test.en:2: not UTF-8",
    ),
    "blank": (lambda d: write(d / "test.de", ["a"] * 3 + ["   "] + ["b"] * 4), r"test.de:4: blank"),
    "missing": (lambda d: (d / "valid.en").unlink(), r"has no valid.en or valid.en.gz"),
    "truncated gzip": (_truncate_gzip, r"train.de.gz: cannot read"),
}


@pytest.mark.parametrize("damage, message", DAMAGE.values(), ids=DAMAGE.keys())
def test_malformed_data_is_named_by_file_and_line(tmp_path, damage, message):
    raw = parallel_dir(tmp_path / "raw")
    damage(raw)
    cfg = cfg_for(
        "translation", tmp_path / "cache", f"data.raw_dir={raw}", "data.src=de", "data.tgt=en"
    )
    with pytest.raises(DataError, match=message):
        prepare(cfg)
    assert not (tmp_path / "cache" / "prepared").exists() or not any(
        (tmp_path / "cache" / "prepared").iterdir()
    )


def test_blank_training_pairs_are_dropped_and_counted(tmp_path):
    write(tmp_path / "a.de", ["eins", "", "drei"])
    write(tmp_path / "a.en", ["one", "two", "three"])
    split = read_parallel(tmp_path / "a.de", tmp_path / "a.en", drop_blank=True)
    assert split.src == ["eins", "drei"] and split.dropped_blank == 1


def test_a_carriage_return_inside_a_line_keeps_sides_aligned(tmp_path):
    (tmp_path / "a.de").write_bytes(b"eins\rzwei\ndrei\n")
    write(tmp_path / "a.en", ["one two", "three"])
    split = read_parallel(tmp_path / "a.de", tmp_path / "a.en", drop_blank=False)
    assert split.src == ["eins zwei", "drei"]


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"real data not found at {MULTI30K}")
def test_multi30k_reads_the_real_files(tmp_path):
    cfg = cfg_for("multi30k", tmp_path / "cache", f"data.raw_dir={MULTI30K}")
    splits = get_task("multi30k", cfg).load()
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [29000, 1014, 1000]
    assert splits["train"].src[0].startswith("Zwei junge weiße Männer")  # German source
    assert splits["train"].tgt[0].startswith("Two young")


def test_official_tasks_read_plain_text_from_raw_dir(tmp_path):
    for task, (src, tgt) in {"iwslt17": ("de", "en"), "wmt14": ("en", "de")}.items():
        raw = parallel_dir(tmp_path / task, src, tgt)
        splits = get_task(task, cfg_for(task, tmp_path / "cache", f"data.raw_dir={raw}")).load()
        assert len(splits["train"]) == 40


def test_offline_download_names_the_command_to_run(tmp_path, monkeypatch):
    import dsq_cli.data.download as download

    def no_network(*args, **kwargs):
        raise download.DownloadError("cannot reach https://example.org/x (offline)")

    monkeypatch.setattr(download, "fetch", no_network)
    import dsq_cli.data.sources as sources

    monkeypatch.setattr(sources, "fetch", no_network, raising=False)
    for task in ("multi30k", "iwslt17"):
        cfg = cfg_for(task, tmp_path / "cache")
        with pytest.raises(DataError, match=rf"run `dsq data {task} data.cache_dir="):
            get_task(task, cfg).load()


def test_a_failed_download_says_where_a_file_placed_by_hand_goes(tmp_path, monkeypatch):
    import urllib.request

    def offline(request, timeout):
        raise OSError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    cfg = cfg_for("multi30k", tmp_path / "cache")
    with pytest.raises(DataError) as caught:
        get_task("multi30k", cfg).load()
    message = str(caught.value)
    dest = tmp_path / "cache" / "downloads" / "multi30k" / "train.de.gz"
    assert message.startswith("Download of https://github.com/multi30k/")
    assert "no route to host" in message and "run `dsq data multi30k" in message
    sha256 = MULTI30K_SHA256["train.de.gz"]
    assert message.endswith(f", or place train.de.gz (sha256 {sha256}) at {dest}")
    assert "\n" not in message


def test_dsq_data_prepares_and_reports(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "data",
            "demo",
            f"data.cache_dir={tmp_path}",
            "task.sizes.train=200",
            "data.vocab_size=120",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "demo:" in result.output and "train 200" in result.output
    (prepared,) = (tmp_path / "prepared").iterdir()
    assert json.loads((prepared / "manifest.json").read_text())["task"] == "demo"


def test_dsq_data_missing_raw_dir_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["data", "multi30k", f"data.raw_dir={tmp_path / 'nope'}"])
    assert result.exit_code == 2
    assert f"data.raw_dir={tmp_path / 'nope'} does not exist" in result.output
