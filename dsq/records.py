"""What a run's result.json says of its headline metric, shared by the library (the Hugging Face
callback writes result.json) and the suite (``dsq table`` reads it): the metrics a record may
name and which way each is better. The standard library only."""

from __future__ import annotations

# GLUE's metrics, fractions from 0 (or -1) to 1; BLEU is 0 to 100, perplexity 1 and up
FRACTION_METRICS = ("accuracy", "mcc", "f1", "pearson", "spearman")
METRICS = ("bleu", *FRACTION_METRICS, "perplexity")
# the metrics where lower is better (a language model's perplexity); the others: higher
LOWER_IS_BETTER = frozenset({"perplexity"})


def check_metric(metric: str) -> None:
    """Refuse a metric ``dsq table`` does not read (a loss: it reads losses from their own
    fields), naming the ones it reads."""
    if metric not in METRICS:
        raise ValueError(
            f"metric={metric!r}: a result's metric is one dsq table reads, {', '.join(METRICS)} "
            "(a validation loss goes in valid_loss, which dsq table reads as a loss)"
        )
