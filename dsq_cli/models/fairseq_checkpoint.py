"""Loading a checkpoint in fairseq's own format (e.g. the released RoBERTa) under torch 2.6+.

fairseq's checkpoints pickle ``argparse.Namespace`` and other objects that torch's default
``weights_only=True`` refuses: `load_fairseq_checkpoint` allows exactly those types, for a file
the user named, instead of turning safety off.
"""

from __future__ import annotations

from pathlib import Path


def load_fairseq_checkpoint(path: str | Path) -> dict:
    """A checkpoint in fairseq's own format (e.g. a released RoBERTa), from a path the user gave.

    torch's safe loader is kept on; only the plain container types fairseq pickles are allowed.
    """
    import argparse
    import collections

    import torch

    allowed = [argparse.Namespace, collections.OrderedDict, collections.defaultdict, dict, list]
    with torch.serialization.safe_globals(allowed):
        return torch.load(Path(path), map_location="cpu", weights_only=True)
