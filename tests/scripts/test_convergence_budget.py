"""scripts/convergence.sh's ``budget_of``: the update at which a budget run's fp32 stalled, and,
for the language-model study's rule, the cap when it completed without a stall."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO

SCRIPT = REPO / "scripts" / "convergence.sh"


def budget_of(root, *mode):
    """``budget_of ROOT [cap]`` run from the script's own definition."""
    definition = f"source <(sed -n '/^budget_of() {{/,/^}}/p' {SCRIPT})"
    source = f"{definition}; budget_of {root} {' '.join(mode)}"
    return subprocess.run(["bash", "-c", source], capture_output=True, text=True,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})  # fmt: skip


@pytest.mark.parametrize(
    "record, plain, with_cap",
    [
        ({"status": "completed", "updates": 1120,
          "budget": {"stopped_early": {"update": 1120, "reason": "..."}}}, "1120", "1120"),
        ({"status": "completed", "updates": 5000, "budget": {"stopped_early": None}},
         None, "5000"),
        ({"status": "running", "updates": 300, "budget": {"stopped_early": None}}, None, None),
    ],
)  # fmt: skip
def test_the_budget_is_the_stall_or_with_cap_the_cap(tmp_path, record, plain, with_cap):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "result.json").write_text(json.dumps(record))
    for mode, want in (((), plain), (("cap",), with_cap)):
        done = budget_of(tmp_path, *mode)
        if want is None:
            assert done.returncode != 0 and "has not stopped at a stall" in done.stderr
        else:
            assert done.returncode == 0 and done.stdout.strip() == want, done.stderr
