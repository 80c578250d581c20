"""The package a user imports: its version (the distribution's, one source) and what completes
after ``dsq.`` (every export, loaded on first use)."""

from __future__ import annotations

import importlib.metadata

import dsq


def test_the_version_is_the_distributions():
    assert dsq.__version__ == importlib.metadata.version("dsq")


def test_dir_lists_every_export_and_each_resolves():
    listed = dir(dsq)
    assert set(dsq.__all__) | {"__version__"} == set(listed)
    for name in dsq.__all__:
        assert getattr(dsq, name) is not None, name
