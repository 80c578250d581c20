"""The GLUE data layer (dsq_cli/data/glue/): real SST-2/RTE/CoLA files from ../shared/data,
synthetic files in the real formats of the other five tasks, malformed rows named by
file:line, downloads without network (file:// URLs and a failing fetch), and the metrics
against hand-computed values and against scikit-learn and SciPy (test-only references)."""

from __future__ import annotations

import hashlib
import math
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import SHARED_DATA
from omegaconf import OmegaConf

from dsq_cli.data.download import DownloadError
from dsq_cli.data.glue import (
    GLUE_TASKS,
    GlueExample,
    GlueTask,
    get_glue_task,
    load_glue,
    register_glue_task,
)
from dsq_cli.data.glue import prepare as glue_prepare
from dsq_cli.data.glue import tasks as glue_tasks
from dsq_cli.data.raw import DataError
from dsq_cli.data.sources import Download
from dsq_cli.run_result import FRACTION_METRICS, METRICS
from dsq_cli.train.glue_metrics import METRIC_FUNCTIONS, average_ranks, compute_metrics

GLUE_DATA = SHARED_DATA / "glue"
needs_glue = pytest.mark.skipif(
    not GLUE_DATA.is_dir(), reason=f"real GLUE data not found at {GLUE_DATA}"
)


def make_cfg(task: str, raw_dir: Path | None, *, subset=None, cache_dir: Path | None = None):
    return OmegaConf.create(
        {
            "task": {"name": task},
            "data": {
                "raw_dir": None if raw_dir is None else str(raw_dir),
                "subset": subset,
                "cache_dir": None if cache_dir is None else str(cache_dir),
            },
        }
    )


def write_tsv(path: Path, rows: list[str], *, newline: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(row + newline for row in rows).encode("utf-8"))
    return path


def tree(directory: Path) -> list[str]:
    """Everything under ``directory``, hidden temporary names included."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def error_of(task: str, path: Path) -> str:
    with pytest.raises(DataError) as caught:
        get_glue_task(task).read(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- registry


def test_registry_holds_the_eight_tasks_with_their_folders_and_metrics():
    expected = {
        "sst2": ("SST-2", "dev.tsv", 2, "accuracy"),
        "rte": ("RTE", "dev.tsv", 2, "accuracy"),
        "cola": ("CoLA", "dev.tsv", 2, "mcc"),
        "mrpc": ("MRPC", "dev.tsv", 2, "f1"),
        "qnli": ("QNLI", "dev.tsv", 2, "accuracy"),
        "mnli": ("MNLI", "dev_matched.tsv", 3, "accuracy"),
        "qqp": ("QQP", "dev.tsv", 2, "f1"),
        "stsb": ("STS-B", "dev.tsv", 1, "pearson"),
    }
    assert set(GLUE_TASKS) == set(expected)
    for name, (folder, dev_file, num_classes, metric) in expected.items():
        task = get_glue_task(name)
        assert (task.name, task.folder, task.train_file) == (name, folder, "train.tsv")
        assert (task.dev_file, task.num_classes, task.metric) == (dev_file, num_classes, metric)
        assert set(task.metrics) <= set(METRICS)
    assert get_glue_task("mrpc").metrics == get_glue_task("qqp").metrics == ("f1", "accuracy")
    assert get_glue_task("stsb").metrics == ("pearson", "spearman")
    assert get_glue_task("stsb").labels is None and get_glue_task("stsb").is_regression
    assert get_glue_task("mnli").labels == ("contradiction", "entailment", "neutral")
    assert get_glue_task("rte").labels == get_glue_task("qnli").labels


def test_every_download_is_pinned_and_says_where_the_checksum_came_from():
    pinned = {}
    for task in GLUE_TASKS.values():
        assert task.downloads, task.name
        for download in task.downloads:
            assert download.url.startswith("https://dl.fbaipublicfiles.com/")
            assert download.url.rsplit("/", 1)[1] == download.filename
            # a SHA-256 as sha256_of writes it: 64 lower-case hex digits, nothing else (no 0x,
            # no underscores or spaces, no truncated or longer digest)
            assert re.fullmatch(r"[0-9a-f]{64}", download.sha256), (task.name, download.sha256)
            assert isinstance(download.size, int) and download.size > 0
            assert "huggingface/datasets" in download.checksum_from
            pinned[download.url] = download.sha256
    # one checksum per file: a pasted duplicate pins some file to another's bytes
    assert len(set(pinned.values())) == len(pinned) == 9


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(DataError, match="unknown GLUE task 'sst3'; choose one of cola, mnli"):
        get_glue_task("sst3")


def test_registration_refuses_duplicates_and_bad_definitions():
    with pytest.raises(ValueError, match="registered twice"):
        register_glue_task("sst2")(type("Again", (GlueTask,), {}))
    assert "Again" not in {type(t).__name__ for t in GLUE_TASKS.values()}

    class BadMetric(GlueTask):
        metrics = ("bleu2",)

    class F1OnThreeClasses(GlueTask):
        labels = ("a", "b", "c")
        metrics = ("f1",)

    class RegressionScoredByAccuracy(GlueTask):
        labels = None

    class NoHeaderWithoutFieldNames(GlueTask):
        has_header = False

    for cls in (BadMetric, F1OnThreeClasses, RegressionScoredByAccuracy, NoHeaderWithoutFieldNames):
        with pytest.raises(ValueError):
            cls().check_definition()


# --------------------------------------------------------------------------- real files

REAL = [
    # task, train size, dev size, train label counts
    ("sst2", 67349, 872, [29780, 37569]),
    ("rte", 2490, 277, [1249, 1241]),
    ("cola", 8551, 1043, [2528, 6023]),
]


@needs_glue
@pytest.mark.parametrize("name, n_train, n_dev, train_counts", REAL)
@pytest.mark.slow  # reads every line of the real GLUE files
def test_real_files_have_the_documented_sizes(name, n_train, n_dev, train_counts):
    task = get_glue_task(name)
    directory = GLUE_DATA / task.folder
    data = load_glue(make_cfg(name, directory))
    assert data.task is task and data.source == str(directory)
    assert (len(data.train), len(data.dev)) == (n_train, n_dev)
    assert np.bincount([e.label for e in data.train], minlength=2).tolist() == train_counts
    for example in data.train + data.dev:
        assert example.label in (0, 1)
        assert example.text_a and example.text_a == example.text_a.strip()
        assert (example.text_b is None) == (name != "rte")
    manifest = data.manifest
    assert manifest["task"] == name and manifest["dir"] == str(directory)
    assert manifest["sizes"] == {"train": n_train, "dev": n_dev}
    assert manifest["subset"] is None and manifest["dropped_empty"] == {"train": 0}
    for file_name in ("train.tsv", "dev.tsv"):
        digest = hashlib.sha256((directory / file_name).read_bytes()).hexdigest()
        assert manifest["sha256"][file_name] == digest


@pytest.mark.slow
@needs_glue
def test_real_files_spot_checks():
    sst2 = load_glue(make_cfg("sst2", GLUE_DATA / "SST-2"))
    assert sst2.train[0] == GlueExample("hide new secretions from the parental units", None, 0)
    assert sst2.train[99] == GlueExample(
        "acted and directed , it 's clear that washington most certainly has a new career "
        "ahead of him",
        None,
        1,
    )
    # A stray quote at the end of a sentence stays text (csv.QUOTE_NONE).
    assert sst2.dev[-1].text_a.endswith("could not be improved upon . '")
    assert sst2.dev[-1].label == 1

    rte = load_glue(make_cfg("rte", GLUE_DATA / "RTE"))
    assert rte.dev[0].text_a.startswith("Dana Reeve, the widow of the actor Christopher Reeve")
    assert rte.dev[0].text_b == "Christopher Reeve had an accident."
    assert rte.task.labels[rte.dev[0].label] == "not_entailment"
    assert rte.task.labels[rte.dev[1].label] == "entailment"

    cola = load_glue(make_cfg("cola", GLUE_DATA / "CoLA"))
    assert cola.dev[0] == GlueExample("The sailors rode the breeze clear of the rocks.", None, 1)
    assert cola.train[-1] == GlueExample("What all did you get for Christmas?", None, 1)


@needs_glue
@pytest.mark.slow  # reads every line of the real GLUE files
def test_subset_keeps_the_first_training_examples_in_file_order():
    directory = GLUE_DATA / "SST-2"
    full = get_glue_task("sst2").read(directory / "train.tsv")
    data = load_glue(make_cfg("sst2", directory, subset=100))
    assert data.train == full[:100]
    assert len(data.dev) == 872  # the dev set is never cut
    assert data.manifest["sizes"] == {"train": 100, "dev": 872}
    assert data.manifest["subset"] == 100 and data.manifest["train_in_file"] == 67349


# --------------------------------------------------------------------------- other formats

MRPC_HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"  # with the sources' BOM
QNLI_HEADER = "index\tquestion\tsentence\tlabel"
MNLI_TRAIN_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label"
)
MNLI_DEV_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\t"
    "label5\tgold_label"
)
QQP_HEADER = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"
STSB_HEADER = (
    "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
)


def mnli_row(index: int, s1: str, s2: str, label: str, *, dev: bool) -> str:
    parses = ["( ( a ) b )", "( c )", "(ROOT (S a))", "(ROOT (S c))"]
    annotators = [label] * (5 if dev else 1)
    return "\t".join(
        [str(index), "31193", f"{index}n", "fiction", *parses, s1, s2, *annotators, label]
    )


def test_mrpc_format(tmp_path):
    directory = tmp_path / "MRPC"
    write_tsv(
        directory / "train.tsv",
        [
            MRPC_HEADER,
            '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " .\t'
            'Referring to him as only " the witness " , Amrozi accused his brother .',
            "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought it in 1995 .",
        ],
        newline="\r\n",  # Microsoft's line ends
    )
    write_tsv(directory / "dev.tsv", [MRPC_HEADER, "1\t1\t2\tA cat sat .\tA cat was sitting ."])
    data = load_glue(make_cfg("mrpc", directory))
    assert data.train[0] == GlueExample(
        'Amrozi accused his brother , whom he called " the witness " .',
        'Referring to him as only " the witness " , Amrozi accused his brother .',
        1,
    )
    assert data.train[1].label == 0 and data.train[1].text_b.endswith("in 1995 .")
    assert data.dev == [GlueExample("A cat sat .", "A cat was sitting .", 1)]


def test_qnli_format(tmp_path):
    directory = tmp_path / "QNLI"
    write_tsv(
        directory / "train.tsv",
        [
            QNLI_HEADER,
            "0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it, "
            "the series was darker.\tnot_entailment",
            "1\tWhich missile batteries were used?\tThe Patriot batteries were used.\tentailment",
        ],
    )
    write_tsv(directory / "dev.tsv", [QNLI_HEADER, "0\tWho?\tHe did.\tentailment"])
    data = load_glue(make_cfg("qnli", directory))
    assert [e.label for e in data.train] == [1, 0]
    assert data.train[0].text_a == "When did the third Digimon series begin?"
    assert data.dev == [GlueExample("Who?", "He did.", 0)]


def test_mnli_format_reads_the_matched_dev_file(tmp_path):
    directory = tmp_path / "MNLI"
    write_tsv(
        directory / "train.tsv",
        [
            MNLI_TRAIN_HEADER,
            mnli_row(
                0,
                "Conceptually cream skimming has two dimensions.",
                "It is simple.",
                "neutral",
                dev=False,
            ),
            mnli_row(
                1, "you know during the season", "You lose the things.", "entailment", dev=False
            ),
            mnli_row(
                2,
                "One of our number will carry out",
                "A member will ignore",
                "contradiction",
                dev=False,
            ),
        ],
    )
    write_tsv(
        directory / "dev_matched.tsv", [MNLI_DEV_HEADER, mnli_row(0, "A", "B", "neutral", dev=True)]
    )
    write_tsv(
        directory / "dev_mismatched.tsv",
        [MNLI_DEV_HEADER, mnli_row(0, "X", "Y", "entailment", dev=True)],
    )
    data = load_glue(make_cfg("mnli", directory))
    assert [data.task.labels[e.label] for e in data.train] == [
        "neutral",
        "entailment",
        "contradiction",
    ]
    assert data.train[0].text_a == "Conceptually cream skimming has two dimensions."
    assert data.train[0].text_b == "It is simple."
    assert data.dev == [GlueExample("A", "B", 2)]
    assert data.manifest["files"] == {"train": "train.tsv", "dev": "dev_matched.tsv"}


def test_qqp_format_drops_empty_training_questions_but_not_in_dev(tmp_path):
    directory = tmp_path / "QQP"
    write_tsv(
        directory / "train.tsv",
        [
            QQP_HEADER,
            "133273\t213221\t213222\tHow is the life of a math student?\tWhich level of math?\t0",
            "201841\t303951\t174364\tHow can I create an Android app?\t\t0",  # as in QQP-clean
            "402555\t536040\t536041\tHow do I control my emotions?\tHow do you control it?\t1",
        ],
    )
    write_tsv(directory / "dev.tsv", [QQP_HEADER, "1\t2\t3\tWhy?\tWhy not?\t1"])
    data = load_glue(make_cfg("qqp", directory))
    assert [e.label for e in data.train] == [0, 1]
    assert data.train[1].text_a == "How do I control my emotions?"
    assert data.manifest["dropped_empty"] == {"train": 1}
    assert data.manifest["sizes"] == {"train": 2, "dev": 1}

    write_tsv(directory / "dev.tsv", [QQP_HEADER, "1\t2\t3\tWhy?\t\t1"])
    with pytest.raises(DataError, match=rf"{directory / 'dev.tsv'}:2: empty question2"):
        load_glue(make_cfg("qqp", directory))


def test_stsb_format_reads_float_scores(tmp_path):
    directory = tmp_path / "STS-B"
    write_tsv(
        directory / "train.tsv",
        [
            STSB_HEADER,
            "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\t"
            "An air plane is taking off.\t5.000",
            "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a flute.\t"
            "A man is playing a bamboo flute.\t3.800",
            "2\tmain-news\theadlines\t2015\t0010\tnone\tnone\tA.\tB.\t0.000",
        ],
    )
    write_tsv(
        directory / "dev.tsv", [STSB_HEADER, "0\tg\tf\ty\t1\tnone\tnone\tA man.\tA woman.\t1.25"]
    )
    data = load_glue(make_cfg("stsb", directory))
    assert [e.label for e in data.train] == [5.0, 3.8, 0.0]
    assert all(isinstance(e.label, float) for e in data.train)
    assert data.train[0].text_b == "An air plane is taking off."
    assert data.dev == [GlueExample("A man.", "A woman.", 1.25)]


def test_stray_carriage_returns_and_quotes_stay_inside_their_line(tmp_path):
    path = write_tsv(
        tmp_path / "train.tsv",
        ["sentence\tlabel", 'a "quoted\rbit \t1', '"unbalanced \t0', "plain\t1"],
        newline="\r\n",
    )
    examples = get_glue_task("sst2").read(path)
    assert examples == [
        GlueExample('a "quoted bit', None, 1),
        GlueExample('"unbalanced', None, 0),
        GlueExample("plain", None, 1),
    ]


def test_trailing_blank_lines_are_ignored(tmp_path):
    path = write_tsv(tmp_path / "dev.tsv", ["sentence\tlabel", "good\t1", "", "  "])
    assert get_glue_task("sst2").read(path) == [GlueExample("good", None, 1)]


# --------------------------------------------------------------------------- malformed rows

MALFORMED = [
    # task, lines, line number in the message, what the message says
    (
        "sst2",
        ["sentence\tlabel", "fine\t1", "no tab here"],
        3,
        "1 tab-separated field(s), expected at least 2",
    ),
    (
        "rte",
        ["index\tsentence1\tsentence2\tlabel", "0\tA.\tB.\tcontradiction"],
        2,
        "unknown label 'contradiction'; RTE labels are entailment, not_entailment",
    ),
    (
        "sst2",
        ["sentence\tlabel", "fine\t1", "fine\t2"],
        3,
        "unknown label '2'; SST-2 labels are 0, 1",
    ),
    (
        "stsb",
        [STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\t4.0", "1\tg\tf\ty\t1\tn\tn\tA.\tB.\tn/a"],
        3,
        "score 'n/a' is not a number; STS-B scores are numbers from 0 to 5",
    ),
    ("stsb", [STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\t5.5"], 2, "outside 0..5"),
    ("stsb", [STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\tnan"], 2, "is not a number"),
    ("rte", ["index\tsentence1\tsentence2\tlabel", "0\tA.\t \tentailment"], 2, "empty sentence2"),
    ("sst2", ["hide new secretions\t0", "fine\t1"], 1, "no header column(s) sentence, label"),
    (
        "qnli",
        ["index\tquery\tsentence\tlabel", "0\tQ?\tS.\tentailment"],
        1,
        "a header without column(s) question",
    ),
    (
        "cola",
        ["gj04\t1\t\tGood.", "gj04\t1\tBad."],
        2,
        "3 tab-separated field(s), expected 4 (source, label, original mark, sentence)",
    ),
    ("cola", ["index\tsentence", "0\tA test sentence."], 1, "expected 4"),  # CoLA's test.tsv
    ("cola", ["gj04\t1\t\tGood.", "gj04\t1\t*\tBad.\textra"], 2, "5 tab-separated field(s)"),
    ("cola", ["gj04\t1\t\tGood.", "", "gj04\t0\t*\tBad."], 2, "blank line between examples"),
]


@pytest.mark.parametrize("task, lines, line, says", MALFORMED)
def test_malformed_rows_name_file_and_line(tmp_path, task, lines, line, says):
    path = write_tsv(tmp_path / "train.tsv", lines)
    message = error_of(task, path)
    assert message.startswith(f"{path}:{line}: ")
    assert says in message


def test_not_utf8_names_file_line_and_byte_offset(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_bytes(b"sentence\tlabel\ngood\t1\ncaf\xe9 bad\t0\n")
    message = error_of("sst2", path)
    # "sentence\tlabel\n" is 15 bytes, "good\t1\n" 7, "caf" 3: the bad byte is at offset 25.
    assert message.startswith(f"{path}:3: not UTF-8 text at byte offset 25")
    assert "save the file as UTF-8" in message


def test_a_missing_file_names_the_expected_folder(tmp_path):
    message = error_of("mnli", tmp_path / "dev_matched.tsv")
    assert message == (
        f"missing GLUE file {tmp_path / 'dev_matched.tsv'}; "
        "expected the GLUE MNLI folder (train.tsv, dev_matched.tsv)"
    )


def test_empty_files_and_header_only_files(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    assert error_of("sst2", empty).startswith(f"{empty} is empty")
    blank = write_tsv(tmp_path / "blank.tsv", ["", ""])
    assert error_of("cola", blank).startswith(f"{blank} is empty")
    header_only = write_tsv(tmp_path / "header.tsv", ["sentence\tlabel"])
    assert error_of("sst2", header_only).startswith(f"{header_only} holds no examples")


def test_a_training_file_with_only_empty_sentences_is_an_error(tmp_path):
    path = write_tsv(tmp_path / "train.tsv", ["sentence\tlabel", " \t1"])
    with pytest.raises(DataError, match=r"holds no examples \(1 dropped for an empty sentence\)"):
        get_glue_task("sst2").read(path, drop_empty=True)


# --------------------------------------------------------------------------- configuration


def sst2_folder(root: Path) -> Path:
    write_tsv(root / "train.tsv", ["sentence\tlabel", "good\t1", "bad\t0", "fine\t1"])
    write_tsv(root / "dev.tsv", ["sentence\tlabel", "great\t1"])
    return root


def test_raw_dir_that_is_missing_or_incomplete(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(
        DataError, match="does not exist or is not a directory; point it at the GLUE SST-2"
    ):
        load_glue(make_cfg("sst2", missing))
    folder = tmp_path / "SST-2"
    write_tsv(folder / "train.tsv", ["sentence\tlabel", "good\t1"])
    with pytest.raises(DataError) as caught:
        load_glue(make_cfg("sst2", folder))
    assert str(caught.value) == (
        f"data.raw_dir={folder} has no dev.tsv (it holds: train.tsv); "
        "point it at the GLUE SST-2 folder (train.tsv, dev.tsv)"
    )
    mnli = tmp_path / "MNLI"
    write_tsv(mnli / "train.tsv", [MNLI_TRAIN_HEADER])
    write_tsv(mnli / "dev.tsv", [MNLI_DEV_HEADER])
    with pytest.raises(DataError, match="has no dev_matched.tsv"):
        load_glue(make_cfg("mnli", mnli))


@pytest.mark.parametrize("subset", [0, -5, True, "100", 2.5])
def test_subset_must_be_a_positive_count(tmp_path, subset):
    with pytest.raises(DataError, match="data.subset=.*expected a positive number"):
        load_glue(make_cfg("sst2", sst2_folder(tmp_path), subset=subset))


def test_subset_larger_than_the_data_keeps_everything(tmp_path):
    data = load_glue(make_cfg("sst2", sst2_folder(tmp_path), subset=1000))
    assert len(data.train) == 3 and data.manifest["subset"] == 1000


# --------------------------------------------------------------------------- downloads


def make_zip(path: Path, members: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return path


def pin_local(monkeypatch, task_class: type, files: dict[str, Path]) -> None:
    """Point a task's downloads at local files (file:// URLs, their real checksums)."""
    downloads = tuple(
        Download(
            filename=name,
            url=path.as_uri(),
            sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
            size=path.stat().st_size,
        )
        for name, path in files.items()
    )
    monkeypatch.setattr(task_class, "downloads", downloads)


def sst2_zip(path: Path) -> Path:
    return make_zip(
        path,
        {
            "SST-2/train.tsv": "sentence\tlabel\ngood \t1\nbad \t0\n",
            "SST-2/dev.tsv": "sentence\tlabel\nfine \t1\n",
            "SST-2/test.tsv": "index\tsentence\n0\tunknown\n",
            "SST-2/original/README.txt": "not needed\n",
        },
    )


def test_download_is_verified_unpacked_and_reused(tmp_path, monkeypatch):
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": sst2_zip(tmp_path / "SST-2.zip")})
    cache = tmp_path / "cache"
    data = load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert data.source == str(cache / "glue" / "SST-2")
    assert data.train == [GlueExample("good", None, 1), GlueExample("bad", None, 0)]
    assert data.manifest["downloaded"] is True
    assert tree(cache / "glue") == [
        "SST-2",
        "SST-2/dev.tsv",
        "SST-2/dsq_glue.json",
        "SST-2/train.tsv",
        "downloads",
        "downloads/SST-2.zip",
    ]

    def no_network(*args, **kwargs):
        raise AssertionError("a prepared task must not be downloaded again")

    monkeypatch.setattr(glue_prepare, "fetch", no_network)
    assert load_glue(make_cfg("sst2", None, cache_dir=cache)).train == data.train


def test_mrpc_download_is_split_into_train_and_dev_by_the_dev_ids(tmp_path, monkeypatch):
    source = tmp_path / "msr_paraphrase_train.txt"
    source.write_bytes(
        (
            MRPC_HEADER + "\r\n"
            "1\t702876\t702977\tAmrozi accused his brother .\tReferring to him , Amrozi .\r\n"
            "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought it .\r\n"
            "1\t1330381\t1330521\tThey had published .\tOn June 10 , it was published .\r\n"
        ).encode("utf-8")
    )
    dev_ids = tmp_path / "mrpc_dev_ids.tsv"
    dev_ids.write_text("2108705\t2108831\n", encoding="utf-8")
    pin_local(
        monkeypatch,
        glue_tasks.Mrpc,
        {"msr_paraphrase_train.txt": source, "mrpc_dev_ids.tsv": dev_ids},
    )
    data = load_glue(make_cfg("mrpc", None, cache_dir=tmp_path / "cache"))
    assert [e.text_a for e in data.train] == [
        "Amrozi accused his brother .",
        "They had published .",
    ]
    assert data.dev == [GlueExample("Yucaipa owned Dominick 's .", "Yucaipa bought it .", 0)]
    written = (tmp_path / "cache" / "glue" / "MRPC" / "train.tsv").read_text(encoding="utf-8")
    assert written.startswith("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t")


def test_offline_download_failure_says_to_pass_raw_dir(tmp_path, monkeypatch):
    def offline(url, sha256, dest, **kwargs):
        raise DownloadError(
            f"Download of {url} failed after 0 bytes: [Errno -3] Temporary failure in name "
            "resolution (nothing was kept).",
            url=url,
            dest=dest,
            expected_sha256=sha256,
            received_bytes=0,
        )

    monkeypatch.setattr(glue_prepare, "fetch", offline)
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as caught:
        load_glue(make_cfg("rte", None, cache_dir=cache))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("Download of https://dl.fbaipublicfiles.com/glue/data/RTE.zip failed")
    assert "pass data.raw_dir=DIR holding the GLUE RTE folder (train.tsv, dev.tsv)" in message
    assert f"place RTE.zip (sha256 {glue_tasks.Rte.downloads[0].sha256})" in message
    assert "parallel text" not in message  # no translation advice
    assert not (cache / "glue" / "RTE").exists()


def test_a_missing_source_fails_the_real_fetch_and_leaves_nothing(tmp_path, monkeypatch):
    missing = tmp_path / "gone" / "SST-2.zip"
    monkeypatch.setattr(
        glue_tasks.Sst2, "downloads", (Download("SST-2.zip", missing.as_uri(), "0" * 64, 10),)
    )
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="failed.*pass data.raw_dir=DIR holding the GLUE SST-2"):
        load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert tree(cache / "glue") == ["downloads"]


def test_an_interrupted_preparation_leaves_no_folder(tmp_path, monkeypatch):
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": sst2_zip(tmp_path / "SST-2.zip")})

    real_extract = glue_tasks.extract

    def interrupted(*args, **kwargs):
        real_extract(*args, **kwargs)  # the files are unpacked, then Ctrl-C arrives
        raise KeyboardInterrupt

    monkeypatch.setattr(glue_tasks, "extract", interrupted)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert tree(cache / "glue") == ["downloads", "downloads/SST-2.zip"]  # verified, kept
    monkeypatch.undo()
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": tmp_path / "SST-2.zip"})
    assert len(load_glue(make_cfg("sst2", None, cache_dir=cache)).train) == 2


def test_a_zip_without_the_task_folder_is_refused(tmp_path, monkeypatch):
    wrong = make_zip(tmp_path / "SST-2.zip", {"RTE/train.tsv": "x\n", "RTE/other.tsv": "y\n"})
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": wrong})
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="holds no SST-2/train.tsv with dev.tsv; delete it"):
        load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert tree(cache / "glue") == ["downloads", "downloads/SST-2.zip"]


def test_a_cache_folder_not_made_by_dsq_is_not_trusted(tmp_path):
    cache = tmp_path / "cache"
    sst2_folder(cache / "glue" / "SST-2")
    with pytest.raises(DataError, match="not prepared by dsq .* pass data.raw_dir="):
        load_glue(make_cfg("sst2", None, cache_dir=cache))


# --------------------------------------------------------------------------- metrics


def test_metrics_against_hand_computed_values():
    # tp = 2 (items 0, 4), fp = 1 (item 1), fn = 1 (item 3), tn = 2 (items 2, 5)
    predictions, labels = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]
    mrpc = compute_metrics(get_glue_task("mrpc"), predictions, labels)
    assert mrpc["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert mrpc["accuracy"] == pytest.approx(4 / 6)
    assert mrpc["glue_score"] == pytest.approx((2 / 3 + 4 / 6) / 2)
    assert mrpc["value"] == mrpc["f1"]
    assert set(mrpc) == {"f1", "accuracy", "glue_score", "value"}

    cola = compute_metrics(get_glue_task("cola"), predictions, labels)
    assert cola["mcc"] == pytest.approx((2 * 2 - 1 * 1) / math.sqrt(3 * 3 * 3 * 3))
    assert set(cola) == {"mcc", "glue_score", "value"} and cola["value"] == cola["glue_score"]

    mnli = compute_metrics(get_glue_task("mnli"), [0, 1, 2, 2], [0, 1, 1, 2])
    assert mnli == {"accuracy": 0.75, "glue_score": 0.75, "value": 0.75}

    # x centred: (-1, 0, 1); y = (1, 2, 4) centred: (-4/3, -1/3, 5/3); r = 3 / (√2 · √42 / 3)
    stsb = compute_metrics(get_glue_task("stsb"), [1.0, 2.0, 3.0], [1.0, 2.0, 4.0])
    assert stsb["pearson"] == pytest.approx(9 / math.sqrt(84))
    assert stsb["spearman"] == pytest.approx(1.0)  # the same order
    assert stsb["glue_score"] == pytest.approx((9 / math.sqrt(84) + 1) / 2)


def test_every_glue_metric_is_a_fraction_to_the_result_type():
    """result.json readers (dsq table, the plots) show fractions to three decimals: a metric
    added to the GLUE registry is one of them."""
    assert set(METRIC_FUNCTIONS) == set(FRACTION_METRICS)


def test_average_ranks_share_ties():
    ranks = average_ranks(np.array([3.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
    assert ranks.tolist() == [5.0, 1.0, 2.5, 2.5, 5.0, 5.0]


def test_metric_invariants():
    rng = np.random.default_rng(0)
    for name, task in GLUE_TASKS.items():
        if task.is_regression:
            labels = rng.uniform(0, 5, size=50)
        else:
            labels = np.arange(50) % task.num_classes  # every class present
        perfect = compute_metrics(task, labels, labels)
        assert all(value == pytest.approx(1.0) for value in perfect.values()), name
    cola, stsb = get_glue_task("cola"), get_glue_task("stsb")
    labels = [0, 1, 1, 0, 1]
    for constant in (0, 1):  # a constant predictor carries no information
        assert compute_metrics(cola, [constant] * 5, labels)["mcc"] == 0.0
    assert compute_metrics(stsb, [2.5] * 5, [0.0, 1.0, 2.0, 3.0, 4.0])["pearson"] == 0.0
    assert compute_metrics(cola, [1, 0, 0, 1, 0], labels)["mcc"] == pytest.approx(-1.0)
    assert compute_metrics(get_glue_task("qqp"), [0] * 5, [0] * 5)["f1"] == 0.0  # no positive
    diverged = compute_metrics(stsb, [math.nan, 1.0, 2.0], [0.0, 1.0, 2.0])
    assert math.isnan(diverged["pearson"]) and math.isnan(diverged["value"])


def test_metrics_agree_with_scikit_learn_and_scipy():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1234)
    for size in (7, 64, 1000):
        labels = rng.integers(0, 2, size=size)
        predictions = np.where(rng.random(size) < 0.7, labels, 1 - labels)
        mrpc = compute_metrics(get_glue_task("mrpc"), predictions.tolist(), labels.tolist())
        assert mrpc["f1"] == pytest.approx(sklearn_metrics.f1_score(labels, predictions), abs=1e-12)
        assert mrpc["accuracy"] == pytest.approx(
            sklearn_metrics.accuracy_score(labels, predictions), abs=1e-12
        )
        cola = compute_metrics(get_glue_task("cola"), predictions, labels)
        assert cola["mcc"] == pytest.approx(
            sklearn_metrics.matthews_corrcoef(labels, predictions), abs=1e-12
        )
        three = rng.integers(0, 3, size=size)
        guesses = np.where(rng.random(size) < 0.5, three, rng.integers(0, 3, size=size))
        assert compute_metrics(get_glue_task("mnli"), guesses, three)["accuracy"] == pytest.approx(
            sklearn_metrics.accuracy_score(three, guesses), abs=1e-12
        )
        # Scores on a 0.2 grid and rounded predictions: many ties on both sides.
        scores = np.round(rng.uniform(0, 5, size=size) * 5) / 5
        guessed = np.round(scores + rng.normal(0, 1.0, size=size), 1)
        stsb = compute_metrics(get_glue_task("stsb"), guessed.tolist(), scores.tolist())
        assert stsb["pearson"] == pytest.approx(stats.pearsonr(guessed, scores)[0], abs=1e-12)
        assert stsb["spearman"] == pytest.approx(stats.spearmanr(guessed, scores)[0], abs=1e-12)
        assert average_ranks(guessed).tolist() == stats.rankdata(guessed).tolist()


def test_metric_inputs_are_checked():
    sst2, stsb = get_glue_task("sst2"), get_glue_task("stsb")
    with pytest.raises(ValueError, match="same length"):
        compute_metrics(sst2, [0, 1], [0])
    with pytest.raises(ValueError, match="argmax"):
        compute_metrics(sst2, [[0.1, 0.9]], [1])
    with pytest.raises(ValueError, match="non-empty"):
        compute_metrics(sst2, [], [])
    with pytest.raises(ValueError, match="predictions must lie in 0..1"):
        compute_metrics(sst2, [2], [1])
    with pytest.raises(ValueError, match="class indices"):
        compute_metrics(sst2, [0.5], [1])
    with pytest.raises(ValueError, match="finite"):
        compute_metrics(stsb, [1.0], [math.inf])
    assert compute_metrics(sst2, np.array([1.0, 0.0]), [1, 0])["accuracy"] == 1.0


def test_a_task_without_download_or_cache_dir_says_what_to_pass(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="task sst2 needs data.raw_dir or data.cache_dir"):
        load_glue(make_cfg("sst2", None))
    monkeypatch.setattr(glue_tasks.Sst2, "downloads", ())
    with pytest.raises(DataError, match="sst2 has no pinned download. Instead, pass data.raw_dir="):
        load_glue(make_cfg("sst2", None, cache_dir=tmp_path / "cache"))


def test_an_unsafe_archive_is_a_data_error_and_leaves_nothing(tmp_path, monkeypatch):
    evil = make_zip(tmp_path / "SST-2.zip", {"../SST-2/train.tsv": "x\n", "SST-2/dev.tsv": "y\n"})
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": evil})
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="leaves the target directory"):
        load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert tree(cache / "glue") == ["downloads", "downloads/SST-2.zip"]
    assert tree(tmp_path / "cache") == ["glue", "glue/downloads", "glue/downloads/SST-2.zip"]


def test_a_preparation_finished_first_by_another_process_is_used(tmp_path, monkeypatch):
    pin_local(monkeypatch, glue_tasks.Sst2, {"SST-2.zip": sst2_zip(tmp_path / "SST-2.zip")})
    cache = tmp_path / "cache"
    other = cache / "glue" / "SST-2"
    real_assemble = glue_tasks.Sst2.assemble

    def racing(self, archives, scratch, out_dir):
        real_assemble(self, archives, scratch, out_dir)
        sst2_folder(other)  # the other process renames its complete folder into place first
        (other / glue_prepare.PREPARED).write_text("{}\n", encoding="utf-8")

    monkeypatch.setattr(glue_tasks.Sst2, "assemble", racing)
    data = load_glue(make_cfg("sst2", None, cache_dir=cache))
    assert data.source == str(other) and len(data.train) == 3  # the other process's files
    assert not [name for name in tree(cache / "glue") if ".part" in name]


MRPC_SOURCE_ROWS = [MRPC_HEADER, "1\t1\t2\tA .\tB .", "0\t3\t4\tC .\tD ."]
MRPC_BROKEN = [
    # dev id lines, source lines, the file and line named, what is said
    (["3\t4\t5"], MRPC_SOURCE_ROWS, "ids:2", "expected two tab-separated ids"),
    (["3\t4"], ["Quality\tID\tString", *MRPC_SOURCE_ROWS[1:]], "source:1", "expected the header"),
    (["3\t4"], [*MRPC_SOURCE_ROWS, "1\t5\t6\tE ."], "source:4", "expected 5 fields"),
    (["7\t8"], MRPC_SOURCE_ROWS, "ids and ", "give an empty split"),
]


@pytest.mark.parametrize("id_lines, source_lines, where, says", MRPC_BROKEN)
def test_broken_mrpc_sources_are_named(tmp_path, id_lines, source_lines, where, says):
    files = {
        glue_tasks.MRPC_DEV_IDS: write_tsv(
            tmp_path / "ids", ["", *id_lines]
        ),  # a blank line is fine
        glue_tasks.MRPC_TRAIN_TXT: write_tsv(tmp_path / "source", [*source_lines, ""]),
    }
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=says) as caught:
        get_glue_task("mrpc").assemble(files, tmp_path / "scratch", out)
    assert str(caught.value).startswith(str(tmp_path / where))
    assert tree(out) == []
