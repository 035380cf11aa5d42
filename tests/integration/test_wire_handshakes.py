"""Handshakes cannot be starved (issue 18, item 4): real mTLS listener on 127.0.0.1 port 0.

70 TCP connections that never send a TLS hello, all from 127.0.0.2 (all of 127/8 is loopback),
take at most ``max_handshakes_per_address`` handshake slots and are closed after
``first_byte_timeout``; a legitimate dialer from 127.0.0.1 connects and reconnects meanwhile,
and the listener logs about it once a second, not once per socket.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import warnings

import structlog
from conftest import EchoHandler, Pki

from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.metrics import REGISTRY
from iop_wire.tls import Role, TlsConfig

_ATTACKERS = 70
_CONFIG_FIRST_BYTE = 1.0  # seconds; the default is 3


def _limit_hits(limit: str) -> float:
    return REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": limit}) or 0.0


async def _silent_socket(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection from 127.0.0.2 that will never say anything."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))


async def _closed_by_listener(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except ConnectionError:  # reset at accept
        return True


async def test_silent_sockets_from_one_address_do_not_starve_other_dialers(
    pki: Pki, handler: EchoHandler, edge_tls: TlsConfig
) -> None:
    config = ListenerConfig(tls=pki.config("test-node", Role.NODE), first_byte_timeout=_CONFIG_FIRST_BYTE)
    per_address = config.max_handshakes_per_address
    assert per_address * 2 < config.max_handshakes < _ATTACKERS  # the attack would fill the listener without it
    refused, silent = _limit_hits("handshakes_per_address"), _limit_hits("first_byte_timeout")
    async with Listener(config, handler.wire()) as listener:
        with structlog.testing.capture_logs() as logs:
            started = time.monotonic()
            attack = [await _silent_socket(listener.port) for _ in range(_ATTACKERS)]
            # A legitimate peer connects, runs, goes away and reconnects while the attack holds.
            for attempt in range(3):
                async with asyncio.timeout(5):
                    connection = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost")
                assert (await connection.capabilities()).node_id == "test-node", attempt
                await connection.close()
            dialed_within = time.monotonic() - started
            closed = await asyncio.wait_for(
                asyncio.gather(*(_closed_by_listener(reader) for reader, _ in attack)), _CONFIG_FIRST_BYTE + 5
            )
            held_for = time.monotonic() - started
        for _, writer in attack:
            writer.close()
    assert dialed_within < _CONFIG_FIRST_BYTE, dialed_within  # not after the silent ones were timed out
    assert all(closed)
    assert held_for < _CONFIG_FIRST_BYTE + 3, held_for
    assert _limit_hits("handshakes_per_address") - refused == _ATTACKERS - per_address
    assert _limit_hits("first_byte_timeout") - silent == per_address
    lines = [entry for entry in logs if entry["event"] in ("connection refused", "handshake failed")]
    assert 2 <= len(lines) <= 6, lines  # once a second per kind, not 70 lines
    refusal = next(entry for entry in lines if entry["event"] == "connection refused")
    assert refusal["reason"] == "handshakes per address limit reached" and refusal["limit"] == per_address
    assert sum(entry["not_logged_since_last"] for entry in lines) + len(lines) <= _ATTACKERS


async def test_a_socket_that_sends_nothing_is_closed_after_the_first_byte_timeout(
    pki: Pki, handler: EchoHandler
) -> None:
    config = ListenerConfig(tls=pki.config("test-node", Role.NODE), first_byte_timeout=0.3, handshake_timeout=30)
    async with Listener(config, handler.wire()) as listener:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        assert await asyncio.wait_for(_closed_by_listener(reader), 10)
        assert time.monotonic() - started < 3.0  # long before the 30 s handshake timeout
        writer.close()


async def test_a_listener_closed_while_connections_arrive_leaves_no_socket_open(pki: Pki, handler: EchoHandler) -> None:
    # Closed a loop step or a few after the connections: each accepted socket is in its accept, in a task not
    # yet run, or waiting for its first byte. Each must be closed by the listener, not left to the collector.
    config = ListenerConfig(tls=pki.config("test-node", Role.NODE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for steps in range(12):
            listener = await Listener(config, handler.wire()).start()
            port = listener.port
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
            for _ in range(steps):
                await asyncio.sleep(0)
            await listener.close()
            for client in clients:
                client.close()
            gc.collect()
    leaks = [str(warning.message) for warning in caught if issubclass(warning.category, ResourceWarning)]
    assert leaks == []
