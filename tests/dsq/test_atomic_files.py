"""dsq/atomic_files.py: the destination holds the old file or the whole new one, and a
failed write leaves no temporary file behind."""

from __future__ import annotations

import os

import pytest

from dsq.atomic_files import atomic_path, write_atomic


def test_write_atomic_replaces_text_and_bytes_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "result.json"
    write_atomic(path, "first ü\n")
    assert path.read_bytes() == "first ü\n".encode()
    write_atomic(path, b"\x00second")
    assert path.read_bytes() == b"\x00second"
    assert os.listdir(tmp_path) == ["result.json"]


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_text("half of the new")
        raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_the_new_file_gets_the_permissions_of_a_plain_write(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a", "x")
        (tmp_path / "b").write_text("x")
    finally:
        os.umask(umask)
    assert (tmp_path / "a").stat().st_mode == (tmp_path / "b").stat().st_mode
