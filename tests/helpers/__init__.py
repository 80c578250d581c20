"""Plain functions and constants the test modules share (fixtures stay in tests/conftest.py).

pytest puts tests/ on sys.path (pyproject.toml, ``pythonpath``), so a test imports them as
``from helpers.paths import REPO``.
"""
