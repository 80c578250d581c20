"""Benchmarks behind ``dsq bench``: results go to docs/benchmarks.md, never into timed tests."""
