"""A block of comparisons fixed before its runs (docs/results.md, "Protocol"), Holm-adjusted over
the whole block, with each comparison's verdict: the answer tables of docs/results.md.

`dsq table --adjust holm` adjusts within one table (one column's comparisons in one measure, or
the post-move pairs). A protocol's block spans several tables: rising rows against their static
controls by two endpoints, and against amp_bf16. This reads each comparison from `dsq table
--format json`, in a fresh process of this checkout, and adjusts the raw p-values over the block.

Verdicts (the protocol's rule): *better* or *worse* where the Holm-adjusted p of the paired t
test is below 5% (a lower loss is better); else *equivalent* where the Holm-adjusted p of the
two one-sided tests against +-0.02 nats is below 5%; else *not resolved*. A block whose runs are
not all in is refused: no comparison is made before all seeds of its pairs are.

Usage: python scripts/study_blocks.py BLOCK     (from the repository root; BLOCK: clean-control
or lm). tests/scripts/test_study_blocks.py checks that docs/results.md shows what this prints.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from dsq_cli.table.intervals import holm

MARGIN = 0.02  # nats, every block's (the protocol's)
LEVEL = 0.90
ALPHA = 0.05
RESULTS = Path("results")
HEADING = "| {title} | interval, 90% | p | Holm p | TOST p (±0.02) | Holm TOST p | verdict |"
ENDPOINTS = {"last-loss": "last-model loss", "post-move": "post-move loss"}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """``row`` minus ``against``, seed by seed, by ``endpoint``; ``pairs`` holds each seed's two
    run folders (the row's, the comparator's)."""

    setting: str  # what the label says before the endpoint ("de->en"; "" for one setting)
    row: str
    against: str
    endpoint: str  # last-loss | post-move
    pairs: tuple[tuple[Path, Path], ...]

    @property
    def name(self) -> str:
        return f"{self.row} - {self.against}, {self.endpoint}"

    def label(self, n: int) -> str:
        """The comparison's name with ``n``, the pairs it was computed on."""
        before = f"{self.setting}, " if self.setting else ""
        return f"{before}{ENDPOINTS[self.endpoint]} (n={n})"


@dataclasses.dataclass(frozen=True)
class Block:
    title: str  # the first column's heading
    comparisons: tuple[Comparison, ...]


def _pairs(rising_root: str, control_root: str, row: str, against: str, seeds) -> tuple:
    return tuple(
        (RESULTS / rising_root / f"seed{s}" / f"quant-{row}",
         RESULTS / control_root / f"seed{s}" / f"quant-{against}")
        for s in seeds
    )  # fmt: skip


def clean_control() -> Block:
    """dsq against dsq_stash_bfp2 on Multi30k: dsq trained again at the control's commit."""
    settings = (
        ("de->en", "convergence-dsq-rerun", "convergence", (1, 2, 3, 4, 5)),
        ("en->de", "convergence-en-de-dsq-rerun", "convergence-en-de", (1, 2, 3)),
    )
    return Block("dsq - dsq_stash_bfp2", tuple(
        Comparison(setting, "dsq", "dsq_stash_bfp2", endpoint,
                   _pairs(rising, control, "dsq", "dsq_stash_bfp2", seeds))
        for setting, rising, control, seeds in settings
        for endpoint in ENDPOINTS
    ))  # fmt: skip


LM_RISING = {"dsq": "dsq_stash_bfp2", "bfp6_rising_stash": "bfp6_stash_bfp3",
             "nvfp4_dsq": "nvfp4_dsq_stash_nvfp4"}  # fmt: skip


def lm() -> Block:
    """The language-model study's nine: each rising row minus its static control by both
    endpoints, and each rising row minus amp_bf16 by last-model loss."""
    seeds = (1, 2, 3, 4, 5)
    comparisons = [
        Comparison(f"{row} - {control}", row, control, endpoint,
                   _pairs("lm", "lm", row, control, seeds))
        for row, control in LM_RISING.items()
        for endpoint in ENDPOINTS
    ]  # fmt: skip
    comparisons += [
        Comparison(f"{row} - amp_bf16", row, "amp_bf16", "last-loss",
                   _pairs("lm", "lm", row, "amp_bf16", seeds))
        for row in LM_RISING
    ]  # fmt: skip
    return Block("comparison", tuple(comparisons))


BLOCKS = {"clean-control": clean_control, "lm": lm}


def _table_json(comparison: Comparison) -> dict:
    runs = [str(path) for pair in comparison.pairs for path in pair]
    command = [sys.executable, "-m", "dsq_cli.cli", "table", *runs, "--format", "json",
               "--rows", comparison.row, "--against", comparison.against, "--level", str(LEVEL),
               "--margin", f"0.5,{MARGIN}", "--endpoint", comparison.endpoint]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"study_blocks: `dsq table` failed for {comparison.name}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def measured(comparison: Comparison) -> dict:
    """The comparison's interval, n, p and TOST p, as `dsq table` computes them."""
    found = _table_json(comparison)
    if comparison.endpoint == "post-move":
        (record,) = [r for r in found["post_move"] if r["control"] == comparison.against]
    else:
        (cell,) = found["cells"][comparison.row].values()
        record = cell["measures"]["last_valid_loss"]["difference"]
    return {key: record[key] for key in ("mean", "low", "high", "n", "p", "equivalence_p")}


def verdict(mean: float, p_held: float, tost_held: float) -> str:
    if p_held < ALPHA:
        return "better" if mean < 0 else "worse"
    return "equivalent" if tost_held < ALPHA else "not resolved"


def rows(block: Block) -> list[dict]:
    """Each comparison's numbers, Holm-adjusted over the block, and its verdict; none before
    every run of the block has its record."""
    missing = sorted({str(run) for c in block.comparisons for pair in c.pairs for run in pair
                      if not (run / "result.json").is_file()})  # fmt: skip
    if missing:
        raise FileNotFoundError(f"no record in {', '.join(missing)}; a block is compared only "
                                "once all its runs are in")  # fmt: skip
    found = [measured(c) for c in block.comparisons]
    for comparison, record in zip(block.comparisons, found):
        if record["p"] is None:  # a block fixed in advance is adjusted over all its comparisons
            raise ValueError(f"{comparison.name}: {record['n']} pairs, too few for a paired "
                             "test")  # fmt: skip
    for record, p_held, tost_held in zip(found, holm([r["p"] for r in found]),
                                         holm([r["equivalence_p"] for r in found])):  # fmt: skip
        record.update(p_held=p_held, tost_held=tost_held,
                      verdict=verdict(record["mean"], p_held, tost_held))  # fmt: skip
    for comparison, record in zip(block.comparisons, found):
        if record["n"] != len(comparison.pairs):
            left = len(comparison.pairs) - record["n"]
            record["verdict"] += f" ({left} seeds without a post-move pair)"
    return found


def markdown(block: Block) -> str:
    lines = [HEADING.format(title=block.title), "|---|---:|---:|---:|---:|---:|---|"]
    for comparison, r in zip(block.comparisons, rows(block)):
        interval = f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"
        p = f"{r['p']:.3f} | {r['p_held']:.3f}"
        tost = f"{r['equivalence_p']:.4f} | {r['tost_held']:.4f}"
        lines.append(f"| {comparison.label(r['n'])} | {interval} | {p} | {tost} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in BLOCKS:
        print(f"usage: python scripts/study_blocks.py BLOCK (one of {', '.join(BLOCKS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        sys.stdout.write(markdown(BLOCKS[argv[0]]()))
    except (FileNotFoundError, ValueError) as err:
        print(f"study_blocks: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
