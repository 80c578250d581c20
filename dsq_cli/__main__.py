"""The `dsq` command (``python -m dsq_cli`` too): the suite's CLI, or one line on how to install
the suite where only the library is installed (``pip install dsq``)."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from dsq_cli.cli import app
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] in ("dsq", "dsq_cli"):
            raise  # a broken install of dsq itself, not a missing framework
        sys.exit(
            f"dsq: error: the dsq command is the experiment suite, and it needs {err.name!r}: "
            "pip install '.[suite]' in this checkout (the library alone: import dsq)"
        )
    app()


if __name__ == "__main__":
    run()
