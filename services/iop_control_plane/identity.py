"""Join tokens, the audit of join attempts, and the node certificates issued and revoked, kept in
the control-plane's state store (:mod:`iop_control_plane.state`: SQLite or shared PostgreSQL).

A token is ``iopjt-<id>.<secret>``: the id is public (listed, revoked by it), the secret is kept
only as its SHA-256 and compared in constant time. Token and certificate operations are rare:
each is one short transaction. The revoked serials are also held in memory, where every TLS
handshake looks them up; revocations made by a replica join them when the store is polled
(:mod:`iop_control_plane.replicas`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
import time
from dataclasses import dataclass

from iop_control_plane.state import StateStore

__all__ = ["IdentityStore", "Token", "parse_token"]

_TOKEN = re.compile(r"iopjt-([a-z0-9]{6})\.([0-9a-f]{32})")
_ID_CHARS = string.ascii_lowercase + string.digits


def parse_token(text: str) -> tuple[str, str] | None:
    """(id, secret) of a token as ``iop join-token create`` prints it; None when it is not shaped so."""
    match = _TOKEN.fullmatch(text.strip())
    return (match[1], match[2]) if match else None


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Token:
    """One join token as stored (its secret only hashed)."""

    id: str
    secret_sha256: str
    created_at: float
    expires_at: float
    uses: int
    """Machines that may join with it."""
    used: int
    """Machines that did."""
    name_prefix: str
    created_by: str
    """The admin certificate's name that created it."""
    revoked_at: float | None

    def opens_with(self, secret: str) -> bool:
        """Whether ``secret`` is this token's (compared in constant time)."""
        return hmac.compare_digest(self.secret_sha256, _digest(secret))


class IdentityStore:
    """Tokens, join attempts and node certificates in the state store; revoked serials also in :attr:`revoked`."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.revoked: set[str] = set()
        """Serials (lower hex) of every revoked certificate (here, or by a replica once it is polled)."""

    async def open(self) -> None:
        """Load the revoked serials (the state store is open)."""
        self.revoked = await self.store.revoked()

    async def create_token(self, *, ttl: float, uses: int, name_prefix: str, created_by: str) -> tuple[str, Token]:
        """A new token: its text (shown once) and what is stored of it."""
        token_id = "".join(secrets.choice(_ID_CHARS) for _ in range(6))
        secret = secrets.token_hex(16)
        now = time.time()
        token = Token(token_id, _digest(secret), now, now + ttl, uses, 0, name_prefix, created_by, None)
        await self.store.add_token(
            (token.id, token.secret_sha256, now, token.expires_at, uses, 0, name_prefix, created_by, None)
        )
        return f"iopjt-{token_id}.{secret}", token

    async def tokens(self) -> list[Token]:
        """Every token, newest first."""
        return [Token(*row) for row in await self.store.tokens()]

    async def token(self, token_id: str) -> Token | None:
        """The token with this id, if there is one."""
        rows = await self.store.tokens(token_id)
        return Token(*rows[0]) if rows else None

    async def revoke_token(self, token_id: str) -> bool:
        """No machine may join with it any more; False when there is no such token."""
        return await self.store.revoke_token(token_id, time.time())

    async def use_token(self, token_id: str) -> bool:
        """Count one use of the token; False when it was used up meanwhile (by any replica)."""
        return await self.store.use_token(token_id)

    async def audit(self, token_id: str, address: str, name: str, outcome: str) -> None:
        """Record one join attempt."""
        await self.store.add_attempt(time.time(), token_id, address, name, outcome)

    async def attempts(self) -> list[tuple[str, str, str, str]]:
        """Every join attempt, oldest first: (token id, address, name, outcome)."""
        return [(str(a), str(b), str(c), str(d)) for a, b, c, d in await self.store.attempts()]

    async def issued(self, node_id: str, serial: str, not_after: float, *, replaces: bool) -> list[str]:
        """Record a certificate issued to ``node_id``; with ``replaces`` its earlier ones are revoked
        (returned), so only the newest of a name that joined again is valid."""
        earlier = await self.revoke_node(node_id, "joined again") if replaces else []
        await self.store.issue(node_id, serial, not_after, time.time())
        return earlier

    async def revoke_node(
        self, node_id: str, reason: str, *, also: tuple[str, float | None] | None = None
    ) -> list[str]:
        """Revoke every certificate of ``node_id`` not revoked yet, and ``also`` (a serial it presented
        that was not issued here, with its expiry); the serials revoked."""
        now = time.time()
        presented = None if also is None else (also[0], also[1] or now)
        serials = await self.store.revoke_node(node_id, reason, now, presented)
        self.revoked.update(serials)
        return serials

    def follow(self, revoked: set[str]) -> set[str]:
        """Take the store's revoked serials (polled); those not known here before."""
        new = revoked - self.revoked
        self.revoked |= revoked
        return new
