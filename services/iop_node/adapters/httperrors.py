"""The HTTP client's one exception tree (httpx's shape: by phase, then by cause).

    HttpError                   any failure of a request; nothing below is an OSError or a TimeoutError
    ├── ClientClosed            the client was closed (``aclose``) before the request went out
    ├── NotSent                 the request's ``only_if`` condition was false at send time: nothing was sent
    ├── TimeoutException
    │   ├── PoolTimeout         no free connection slot within the pool timeout (nothing was sent)
    │   ├── ConnectTimeout      no connection within the connect timeout (nothing was sent)
    │   └── ReadTimeout         no response head within the first-byte timeout, no bytes for the
    │                           idle timeout while waiting, or the response ran past its total timeout
    ├── NetworkError
    │   ├── ConnectError        the connection could not be opened: refused, unresolvable, TLS failed
    │   └── ConnectionLost      the connection closed or failed before the response was complete
    │       └── ServerDisconnected  a reused keep-alive connection closed without a byte of answer;
    │                               the server may have read the request, so it is not sent again
    └── ProtocolError           the server's bytes are not HTTP/1.x as this client reads it, or
                                over a limit (head size, header count, line length, body size)

``adapters/http.py`` maps this tree to IOP error codes in one table.
"""

from __future__ import annotations

__all__ = [
    "ClientClosed",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLost",
    "HttpError",
    "NetworkError",
    "NotSent",
    "PoolTimeout",
    "ProtocolError",
    "ReadTimeout",
    "ServerDisconnected",
    "TimeoutException",
]


class HttpError(Exception):
    """A request failed; the message says how, in words fit for a run's error message."""


class ClientClosed(HttpError):
    """The client was closed before the request went out."""


class NotSent(HttpError):
    """The caller's ``only_if`` condition was false when the request was about to go out."""


class TimeoutException(HttpError):
    """A phase of the request took longer than its timeout."""


class PoolTimeout(TimeoutException):
    """Every connection slot stayed busy for the pool timeout."""


class ConnectTimeout(TimeoutException):
    """Opening the connection took longer than the connect timeout."""


class ReadTimeout(TimeoutException):
    """The response's head, or its next bytes, or its end did not come in time."""


class NetworkError(HttpError):
    """The connection failed."""


class ConnectError(NetworkError):
    """The connection could not be opened (refused, unresolvable, TLS handshake or verification)."""


class ConnectionLost(NetworkError):
    """The connection closed or failed before the response was complete."""


class ServerDisconnected(ConnectionLost):
    """A reused connection closed without answering: a keep-alive race, or a server that died."""


class ProtocolError(HttpError):
    """The server's bytes are not HTTP/1.x as this client reads it, or over one of its limits."""
