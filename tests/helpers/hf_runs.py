"""A ``DSQCallback`` as a short Trainer run leaves it, without a Trainer: shared by
tests/dsq/integrations/test_hf_result.py in its own process and in a fresh one (imports the
library only)."""

from __future__ import annotations

import torch

from dsq.engine import QuantConfig, dsq_linear
from dsq.integrations.hf import DSQCallback


def recorded(preset: str = "dsq") -> DSQCallback:
    """A callback of ``preset``'s config that recorded one update's GEMMs (one linear layer) and
    counted three updates, the last two after a stall moved the stash up a level."""
    torch.manual_seed(0)
    cfg = QuantConfig.from_preset(preset)
    callback = DSQCallback(cfg)
    x = torch.randn(2, 16, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)
    with callback.history.first_update():
        dsq_linear(x, w, None, cfg).sum().backward()
    callback.history.count_update(cfg.current())
    for update, loss in ((1, 1.0), (2, 2.0)):  # the second is no better: the stash rises
        callback.history.book(cfg.step(loss, update), update)
    for _ in range(2):
        callback.history.count_update(cfg.current())
    return callback
