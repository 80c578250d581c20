"""What a fresh interpreter has imported after some code: the checks that the library, and what
is built on it alone, load nothing of the suite (test_architecture.py, test_hf_result.py)."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers.paths import REPO

SUITE_PACKAGES = ("fairseq", "hydra", "wandb", "submitit", "dsq_cli", "transformers", "omegaconf")


def loaded_after(code: str, watched: tuple[str, ...] = SUITE_PACKAGES) -> list[str]:
    """The top-level packages of the suite and its frameworks (``watched``) a fresh interpreter,
    started in the repository, has loaded after running ``code`` (statements, one a line or
    separated by semicolons)."""
    report = (
        f"import sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {set(watched)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\n{report}"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])  # a printed list of strings
