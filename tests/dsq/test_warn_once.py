import logging

from dsq.warn_once import warn_once


def test_a_warning_is_said_once_a_logger_however_often_asked(caplog):
    warn_once.cache_clear()
    first, second = logging.getLogger("dsq.test.first"), logging.getLogger("dsq.test.second")
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
