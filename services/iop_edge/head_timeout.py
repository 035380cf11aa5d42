"""uvicorn's httptools protocol with a bound on the time a request's headers may take.

uvicorn closes an idle keep-alive connection, but has no timer on a request's head: a client
that connects and sends nothing, or sends its headers a byte at a time, holds its connection
(one of ``http.max_connections``) for as long as it likes. Here the head of every request must
be complete within ``http.header_timeout`` seconds of the connection's opening (first request)
or of the request's first byte (later ones); past it the connection is closed, counted in
``iop_edge_refused_total{limit="header_timeout"}`` and logged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from iop_edge.metrics import EdgeMetrics

__all__ = ["header_timeout_protocol"]

_log = structlog.get_logger("iop.edge")


def header_timeout_protocol(timeout: float, metrics: EdgeMetrics) -> type[asyncio.Protocol]:
    """An httptools protocol class whose connections close when a request's head takes over ``timeout`` s."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            metrics.refused.labels("header_timeout").inc()
            _log.warning("request head too slow: connection closed", client=_client(self.client), timeout=timeout)
            self.transport.close()

    return HeaderTimeoutProtocol


def _client(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if address else "unknown"
