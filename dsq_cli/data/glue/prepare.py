"""Preparing a GLUE task's download: ``prepare_glue`` fetches the task's pinned files
(SHA-256 verified) into ``cache_dir/glue/downloads`` and assembles ``cache_dir/glue/<FOLDER>``
in one rename, ``dsq_glue.json`` inside marking it complete."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..download import DownloadError, built_in_place, fetch
from ..raw import DataError
from .tasks import GlueTask, get_glue_task

log = logging.getLogger("dsq.data")

PREPARED = "dsq_glue.json"  # written last into a prepared download: the folder is complete


def prepare_glue(task: GlueTask | str, cache_dir: Path, *, timeout: float = 60) -> Path:
    """The folder ``cache_dir/glue/<FOLDER>`` holding the task's train and dev files,
    downloaded (pinned SHA-256) and unpacked first unless it is already there.

    The folder is assembled under a temporary name next to it and renamed into place with
    ``dsq_glue.json`` inside, so an interrupted preparation leaves no half-written folder;
    the downloaded files themselves are kept in ``cache_dir/glue/downloads``."""
    task = get_glue_task(task) if isinstance(task, str) else task
    glue_root = Path(cache_dir).expanduser() / "glue"
    out_dir = glue_root / task.folder
    if (out_dir / PREPARED).is_file():
        return out_dir
    if out_dir.exists():
        raise DataError(
            f"{out_dir} exists but was not prepared by dsq (no {PREPARED}); remove it, or pass "
            f"data.raw_dir={out_dir} if it holds {task.describe_files()}"
        )
    if not task.downloads:
        raise DataError(
            f"GLUE task {task.name} has no pinned download. {task.offline_hint(cache_dir)}"
        )

    archives: dict[str, Path] = {}
    for download in task.downloads:
        dest = glue_root / "downloads" / download.filename
        try:
            archives[download.filename] = fetch(
                download.url, download.sha256, dest, timeout=timeout, size=download.size
            )
        except DownloadError as err:
            raise DataError(
                f"{err} {task.offline_hint(cache_dir)}, or place {download.filename} "
                f"(sha256 {download.sha256}) at {dest}."
            ) from None

    with built_in_place(out_dir, PREPARED) as (ready, scratch):
        try:
            task.assemble(archives, scratch, ready)
        except DownloadError as err:  # an unsafe or unreadable archive (ArchiveError)
            raise DataError(str(err)) from None
        record = {
            "task": task.name,
            "folder": task.folder,
            "files": [task.train_file, task.dev_file],
            "downloads": [
                {"url": d.url, "sha256": d.sha256, "checksum_from": d.checksum_from}
                for d in task.downloads
            ],
        }
        (ready / PREPARED).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log.info("GLUE %s ready in %s", task.folder, out_dir)
    return out_dir
