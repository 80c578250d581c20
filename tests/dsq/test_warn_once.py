import logging

from dsq.warn_once import warn_once


def test_a_warning_is_said_once_a_logger_however_often_asked(caplog):
    warn_once.cache_clear()
    first, second = "dsq.test.first", "dsq.test.second"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            warn_once(first, "slower, not different")
            warn_once(second, "slower, not different")
        warn_once(first, "another cause")
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said == [
        ("dsq.test.first", "slower, not different"),
        ("dsq.test.second", "slower, not different"),
        ("dsq.test.first", "another cause"),
    ]
    warn_once.cache_clear()  # forgotten: said again
    with caplog.at_level(logging.WARNING):
        warn_once(first, "another cause")
    assert len(caplog.records) == 4


def test_a_warning_said_once_costs_a_compiled_graph_nothing():
    """A quantizer whose backend lacks a kernel warns at every call; once said, the warning must
    not break the graph of a compiled model at each of them (its key holds strings only)."""
    import torch

    def quantize_like(x):
        warn_once("dsq.test", "the reference runs it")
        return x * 2

    warn_once.cache_clear()
    quantize_like(torch.ones(2))  # said eagerly
    explained = torch._dynamo.explain(quantize_like)(torch.ones(2))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
