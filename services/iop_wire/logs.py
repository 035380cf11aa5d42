"""Logging: libraries log through the standard library, applications decide where it goes.

The wire is a library: its loggers (:func:`library_logger`) hand events to ``logging`` loggers
under ``iop.wire``. Until an application configures logging, Python prints only warnings and
errors, to stderr, and a client's stdout stays its own. IOP's processes call :func:`configure`:
every event, theirs and the libraries', becomes one JSON object per line on stderr.
"""

from __future__ import annotations

import logging
import sys
import time

import structlog
from structlog.typing import FilteringBoundLogger, Processor

__all__ = ["RateLimitedLog", "configure", "library_logger"]


class RateLimitedLog:
    """Lines a peer (or a bad input) can trigger in a loop: each key logged at most once per ``every``
    seconds, with ``not_logged_since_last``, the count of those held back since the last line."""

    def __init__(self, every: float = 1.0) -> None:
        self._every = every
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, logger: FilteringBoundLogger, event: str, **fields: object) -> None:
        """Log ``event`` as a warning unless ``key`` was logged less than ``every`` seconds ago (then count it)."""
        if (unlogged := self._due(key)) is not None:
            logger.warning(event, not_logged_since_last=unlogged, **fields)

    def error(self, key: str, logger: FilteringBoundLogger, event: str, **fields: object) -> None:
        """As :meth:`warning`, at error level."""
        if (unlogged := self._due(key)) is not None:
            logger.error(event, not_logged_since_last=unlogged, **fields)

    def _due(self, key: str) -> int | None:
        """The count held back since ``key``'s last line if a line is due now, else None (and one more held)."""
        now = time.monotonic()
        last, unlogged = self._last.get(key, (-self._every, 0))
        if now - last < self._every:
            self._last[key] = (last, unlogged + 1)
            return None
        self._last[key] = (now, 0)
        return unlogged


def library_logger(name: str) -> FilteringBoundLogger:
    """A structlog logger over ``logging.getLogger(name)``: silent below WARNING until logging is configured."""
    logger: FilteringBoundLogger = structlog.wrap_logger(logging.getLogger(name))
    return logger


def configure(level: str = "info") -> None:
    """Send IOP's log events at ``level`` and up, and other libraries' warnings, to stderr as JSON lines."""
    threshold = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,  # records of other libraries (asyncio, ...) become JSON lines too
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    # Other libraries' debug and info lines (asyncio's, aiosqlite's every statement) are not ours to show.
    root.setLevel(max(threshold, logging.WARNING))
    logging.getLogger("iop").setLevel(threshold)
