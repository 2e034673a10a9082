"""capture_logs sees a module logger's events whatever an earlier test configured.

capture_logs swaps the processors inside the configured list; a logger that cached an earlier
config's list (configure_logging again makes a new one) keeps logging past it.

configure_logging caches each logger's processors on first use in production; under the tests it
must not (tests/conftest.py), or a module logger used by one test is invisible to a later test's
capture_logs: whole modules failed that way in full runs and passed alone.
"""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from kvrelay.logging import configure_logging, get_logger


def test_a_logger_used_under_another_config_is_still_captured() -> None:
    log = get_logger("kvrelay.tests.capture")
    configure_logging("INFO", process="test", json=True)
    log.info("before_capture")  # first use: would cache this config's processor list
    configure_logging("INFO", process="test", json=False)  # a later test's config: a new list
    try:
        with capture_logs() as events:
            log.info("inside_capture", n=1)
        assert [e["event"] for e in events] == ["inside_capture"]
    finally:
        structlog.contextvars.clear_contextvars()
