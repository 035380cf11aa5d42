"""Requests to the worker (files and batches), each answered by one envelope or an HTTP error.

The worker pool (:func:`iop_edge.upstream.worker_pool`) carries them; what can go wrong on the
way becomes an :class:`ApiError` here: no worker configured (503 naming ``worker.address``), none
connected (503, Retry-After), the connection lost (503), no answer within ``REQUEST_TIMEOUT``
(504), an error answer (:func:`iop_wire.openai.errors.from_worker`: an unknown id is a 404).
"""

from __future__ import annotations

from iop_edge.upstream import Pool
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import ConnectionClosed, IopError
from iop_wire.connection import Connection
from iop_wire.openai.errors import ApiError, from_iop, from_worker

__all__ = ["REQUEST_TIMEOUT", "STORE_TIMEOUT", "Worker"]

REQUEST_TIMEOUT = 30.0
"""Seconds the worker has to answer one request (an upload's chunks each get this long)."""
STORE_TIMEOUT = 300.0
"""Seconds the worker has to answer an upload's last chunk: it answers once the whole file is stored."""


class Worker:
    """The edge's side of the worker's protocol."""

    def __init__(self, pool: Pool | None) -> None:
        self.pool = pool

    def connection(self) -> Connection:
        """A connection to the worker that is up; 503 when none is (or none is configured)."""
        try:
            if self.pool is None:
                raise IopError(pb.ERROR_CODE_UNAVAILABLE, "no worker is configured: set worker.address")
            return self.pool.connection()
        except IopError as exc:
            raise from_iop(exc) from None

    async def ask(
        self,
        request: pb.Envelope,
        answer: str,
        *,
        caller: str,
        about: str = "",
        param: str = "id",
        connection: Connection | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> pb.Envelope:
        """Send ``request`` for ``caller`` (on ``connection``, else any that is up) and return its ``answer`` envelope.

        The worker shows ``caller`` only its own files and batches.

        ``about`` is the file or batch id the request names, for the 404 of an unknown one
        (``param`` names the request field it came from).
        """
        connection = connection or self.connection()
        request.caller = caller
        try:
            reply = await connection.request(request, timeout)
        except ConnectionClosed:
            message = f"the connection to the worker at {connection.address} closed; retry"
            raise ApiError(503, message, code="service_unavailable", retry_after=1.0) from None
        except IopError as exc:
            raise from_worker(exc, about, param=param) from None
        except TimeoutError:
            message = f"the worker at {connection.address} did not answer within {timeout:g} s"
            raise ApiError(504, message, code="timeout") from None
        kind = reply.WhichOneof("body")
        if kind != answer:
            message = f"the worker answered {request.WhichOneof('body')} with {kind}, not {answer}"
            raise ApiError(502, message, code="backend_error")
        return reply
