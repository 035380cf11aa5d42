"""Machines joining and nodes' certificate identity: join.hello, join.request, cert.renew, the
admins' join tokens, the identity rule at node.register and the revocation check at handshakes.

A machine joins over two connections without a client certificate (the listener takes certless
peers when ``join.ca_key`` is set): join.hello gets the CA, which the joiner checks against the
hash it was given; then, verifying the control-plane with that CA, join.request sends a token
and a certificate request made for a key that never leaves the machine, and gets a node
certificate (CN its name, OU node) back. A certless connection may send those two only:
anything else is refused PERMISSION_DENIED and the connection closed. Failed attempts are
bounded per source address; every attempt is audited, counted and (rate-limited) logged.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping

import structlog

from iop_control_plane.identity import IdentityStore, Token, parse_token
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.settings import IdentitySettings, JoinSettings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Connection, EventSink, Handler, Inbound, IopError, MessageHandler, PeerIdentity, Role
from iop_wire.certs import Authority, RequestError, ca_hash, requested_name
from iop_wire.errors import Reason
from iop_wire.logs import RateLimitedLog
from iop_wire.messages import error_envelope
from iop_wire.metrics import LIMIT_HITS

__all__ = ["SHARED_NODE_NAME", "Joining", "failure_source", "valid_node_name"]

_log = structlog.get_logger("iop.control_plane")
SHARED_NODE_NAME = "node"
"""The CN of the shared development node certificate (``iop certs init``)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_RESERVED = frozenset(str(role) for role in Role)
_JOIN_MESSAGES = ("join_hello", "join_request")
_DEFAULT_TTL = 3600.0
_OFF = "this control-plane issues no certificates (set join.ca_key)"
_CERTLESS_ONLY = "a connection without a certificate may send join.hello and join.request only, not {kind}"


def valid_node_name(name: str) -> bool:
    """Whether ``name`` may be a joined node's name (and so its certificate's CN)."""
    return _NAME.fullmatch(name) is not None and name not in _RESERVED


def _denied(message: str, reason: Reason) -> IopError:
    return IopError(pb.ERROR_CODE_PERMISSION_DENIED, message, reason=reason)


class _Refusal(Exception):
    """A join.request refused: the outcome audited and counted, and the error answered."""

    def __init__(self, outcome: str, error: IopError) -> None:
        super().__init__(error.message)
        self.outcome, self.error = outcome, error


def failure_source(address: str) -> str:
    """What failed join attempts are counted by: an IPv4 address, or an IPv6 address's /64 (one
    host's share: counted by address, one machine would have 2**64 to guess from)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else ip)


class _FailureBound:
    """Failed join attempts per source within a sliding window, for at most ``sources`` sources: a
    new one beyond them forgets the source that failed first (counted and logged), so peers with
    many addresses cannot grow the table."""

    def __init__(self, limit: int, window: float, sources: int, logs: RateLimitedLog) -> None:
        self.limit, self.window, self.sources, self._logs = limit, window, sources, logs
        self._failures: defaultdict[str, deque[float]] = defaultdict(deque)

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again; None when it may now."""
        failures = self._failures.get(address)
        if failures is None:
            return None
        now = time.monotonic()
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures[0] + self.window - now if len(failures) >= self.limit else None

    def failed(self, address: str) -> None:
        if address not in self._failures and len(self._failures) >= self.sources:
            forgotten = next(iter(self._failures))  # the one that first failed: dicts keep insertion order
            del self._failures[forgotten]
            LIMIT_HITS.labels("join_failure_sources").inc()
            self._logs.warning(
                "join failure sources", _log, "join failures forgotten", reason="too many sources", limit=self.sources
            )
        self._failures[address].append(time.monotonic())


class _JoinOnly(Mapping[str, MessageHandler]):
    """A certless connection's handler table: join.hello and join.request; every other message type
    maps to ``deny`` (the wire answers what it finds here, so nothing falls through)."""

    def __init__(self, served: dict[str, MessageHandler], deny: MessageHandler) -> None:
        self._served, self._deny = served, deny

    def __getitem__(self, kind: str) -> MessageHandler:
        return self._served.get(kind, self._deny)

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str)

    def __iter__(self) -> Iterator[str]:
        return iter(self._served)

    def __len__(self) -> int:
        return len(self._served)


class Joining:
    """The join, renew and token handlers, the register identity rule and the handshake screen."""

    def __init__(
        self,
        join: JoinSettings,
        identity: IdentitySettings,
        *,
        store: IdentityStore,
        sessions: NodeSessions,
        metrics: ControlPlaneMetrics,
        authority: Authority | None,
    ) -> None:
        self.settings, self.identity, self.store = join, identity, store
        self.sessions, self.metrics, self.authority = sessions, metrics, authority
        self.connections: Callable[[], Iterable[Connection]] = tuple
        """The listener's open connections (set once it listens): a certless run.request closes its own."""
        self._logs = RateLimitedLog()
        self._failures = _FailureBound(join.max_failures, join.failure_window, join.max_failure_sources, self._logs)
        self._joining = asyncio.Lock()  # one join at a time: a token's uses and a name's holder stay exact
        self._lifetime = datetime.timedelta(seconds=join.certificate_lifetime)
        self._closing: set[asyncio.Task[None]] = set()

    # -- who may connect and register -------------------------------------------------------

    def screen(self, peer: PeerIdentity) -> IopError | None:
        """The listener's check after TLS: a revoked certificate is refused at the preface."""
        if peer.serial not in self.store.revoked:
            return None
        self.metrics.connections_refused.labels("certificate_revoked").inc()
        self._logs.warning(
            f"revoked {peer.name}", _log, "connection refused", reason="certificate revoked", peer=peer.name
        )
        return _revoked(peer)

    def vet_registration(self, node_id: str, peer: PeerIdentity) -> bool:
        """The identity rule at node.register (TLS on): the node_id must be the certificate's CN,
        except for the shared development certificate where allowed. True when ``peer`` is that
        shared certificate; IopError (PERMISSION_DENIED) when the registration is refused."""
        if peer.serial in self.store.revoked:
            self._refuse_registration("certificate_revoked", node_id, peer)
            raise _revoked(peer)
        if peer.name == SHARED_NODE_NAME and self.identity.shared_node_certificate:
            return True
        if peer.name != node_id:
            self._refuse_registration("identity_mismatch", node_id, peer)
            why = (
                "the shared development certificate may not register here (identity.shared_node_certificate is false)"
                if peer.name == SHARED_NODE_NAME
                else f"a node registers under its certificate's name: this one is {peer.name!r}, not {node_id!r}"
            )
            raise _denied(why, pb.ERROR_REASON_IDENTITY_MISMATCH)
        return False

    def _refuse_registration(self, reason: str, node_id: str, peer: PeerIdentity) -> None:
        self.metrics.registrations_refused.labels(reason).inc()
        self._logs.warning(
            f"register {reason} {peer.name}",
            _log,
            "registration refused",
            reason=reason,
            node_id=node_id,
            peer=peer.name,
        )

    # -- handler tables ---------------------------------------------------------------------

    def certless_handler(self) -> Handler:
        """What a peer without a certificate may do: join.hello and join.request, nothing else."""
        served: dict[str, MessageHandler] = {"join_hello": self.join_hello, "join_request": self.join_request}
        return Handler(run=self._certless_run, messages=_JoinOnly(served, self._certless_other))

    def node_handlers(self) -> dict[str, MessageHandler]:
        """A node certificate's: cert.renew."""
        return {"cert_renew": self.cert_renew}

    def admin_handlers(self) -> dict[str, MessageHandler]:
        """An admin certificate's: join tokens."""
        return {
            "join_token_create": self.join_token_create,
            "join_tokens_list": self.join_tokens_list,
            "join_token_revoke": self.join_token_revoke,
        }

    def off_handlers(self) -> dict[str, MessageHandler]:
        """Join messages from anyone when joining is off: UNAVAILABLE."""
        if self.authority is not None:
            return {}
        return dict.fromkeys(
            (*_JOIN_MESSAGES, "cert_renew", "join_token_create", "join_tokens_list", "join_token_revoke"), _off
        )

    # -- joining ----------------------------------------------------------------------------

    async def join_hello(self, inbound: Inbound) -> None:
        """The CA, for the joiner to check against its pinned hash."""
        ca_pem = self._authority().cert_pem.decode()
        await inbound.reply(pb.Envelope(join_welcome=pb.JoinWelcome(ca_pem=ca_pem)))

    async def join_request(self, inbound: Inbound) -> None:
        """A token and a certificate request in, a node certificate out (or one clear error)."""
        authority = self._authority()
        message = inbound.envelope.join_request
        address = inbound.connection.address.rpartition(":")[0] or "?"
        source = failure_source(address)
        parsed = parse_token(message.token)
        token_id = parsed[0] if parsed else ""
        name = ""
        try:
            if (wait := self._failures.retry_after(source)) is not None:
                error = IopError(
                    pb.ERROR_CODE_RESOURCE_EXHAUSTED,
                    f"too many failed join attempts from {source}: try again in {wait:.0f} s",
                    reason=pb.ERROR_REASON_TOO_MANY_ATTEMPTS,
                    retry_after=datetime.timedelta(seconds=wait),
                    retryable=True,
                )
                raise _Refusal("too_many_attempts", error)
            async with self._joining:
                token = await self._open_token(parsed)
                name = self._name(message.csr_pem, token)
                accepted = await self._accept(authority, token, name, message.csr_pem)
        except _Refusal as refusal:
            if refusal.outcome != "too_many_attempts":
                self._failures.failed(source)
            await self._attempt(token_id, address, name, refusal.outcome)
            raise refusal.error from None
        await self._attempt(token_id, address, name, "accepted")
        await inbound.reply(pb.Envelope(join_accepted=accepted))

    async def _open_token(self, parsed: tuple[str, str] | None) -> Token:
        token = await self.store.token(parsed[0]) if parsed else None
        if parsed is None or token is None or not token.opens_with(parsed[1]):
            error = _denied("the join token is not valid", pb.ERROR_REASON_TOKEN_INVALID)
            raise _Refusal("token_invalid", error)
        if token.revoked_at is not None:
            error = _denied(f"join token {token.id} was revoked", pb.ERROR_REASON_TOKEN_REVOKED)
            raise _Refusal("token_revoked", error)
        if token.expires_at <= time.time():
            error = _denied(
                f"join token {token.id} expired at {_when(token.expires_at)}", pb.ERROR_REASON_TOKEN_EXPIRED
            )
            raise _Refusal("token_expired", error)
        if token.used >= token.uses:
            error = _denied(
                f"join token {token.id} was used {token.used} of {token.uses} times", pb.ERROR_REASON_TOKEN_USED_UP
            )
            raise _Refusal("token_used_up", error)
        return token

    def _name(self, csr_pem: str, token: Token) -> str:
        """The node name the request asks for, checked."""
        try:
            name = requested_name(csr_pem.encode(), Role.NODE)
        except (RequestError, UnicodeError) as exc:
            raise _Refusal("bad_request", IopError(pb.ERROR_CODE_INVALID_ARGUMENT, str(exc))) from None
        if not valid_node_name(name):
            why = (
                f"the name {name[:80]!r} is not a node name: 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit, and not a role name"
            )
            raise _Refusal("bad_request", IopError(pb.ERROR_CODE_INVALID_ARGUMENT, why))
        if not name.startswith(token.name_prefix):
            why = f"join token {token.id} admits names starting with {token.name_prefix!r}, not {name!r}"
            raise _Refusal("bad_request", IopError(pb.ERROR_CODE_INVALID_ARGUMENT, why))
        if self.sessions.connection(name) is not None:
            why = f"the name {name!r} is held by a live node: choose another (iop join --name)"
            raise _Refusal("name_taken", _denied(why, pb.ERROR_REASON_NAME_TAKEN))
        return name

    async def _accept(self, authority: Authority, token: Token, name: str, csr_pem: str) -> pb.JoinAccepted:
        if not await self.store.use_token(token.id):
            error = _denied(f"join token {token.id} is used up", pb.ERROR_REASON_TOKEN_USED_UP)
            raise _Refusal("token_used_up", error)
        pem, facts = authority.sign_request(csr_pem.encode(), role=Role.NODE, lifetime=self._lifetime)
        replaced = await self.store.issued(name, facts.serial, facts.not_after.timestamp(), replaces=True)
        self.metrics.certificates_issued.labels("join").inc()
        _log.info("node joined", node_id=name, token=token.id, serial=facts.serial, revoked_earlier=replaced)
        accepted = pb.JoinAccepted(node_id=name, certificate_pem=pem.decode())
        accepted.not_after.FromDatetime(facts.not_after)
        return accepted

    async def _attempt(self, token_id: str, address: str, name: str, outcome: str) -> None:
        self.metrics.join_attempts.labels(outcome).inc()
        await self.store.audit(token_id, address, name, outcome)
        if outcome != "accepted":
            self._logs.warning(outcome, _log, "join refused", outcome=outcome, address=address, token=token_id)

    async def _certless_other(self, inbound: Inbound) -> None:
        kind = inbound.envelope.WhichOneof("body") or "(none)"
        await _deny_certless(inbound.connection, kind, in_reply_to=inbound.envelope.id, limiter=self._logs)

    async def _certless_run(self, request: pb.RunRequest, sink: EventSink) -> None:
        connection = next((c for c in self.connections() if c.id == sink.connection_id), None)
        if connection is not None:  # closed from a task of its own: closing cancels this run's task
            task = asyncio.create_task(_deny_certless(connection, "run.request", in_reply_to="", limiter=self._logs))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, _CERTLESS_ONLY.format(kind="run.request"))

    # -- renewal ----------------------------------------------------------------------------

    async def cert_renew(self, inbound: Inbound) -> None:
        """A new certificate for the node's new key, over its own mTLS connection."""
        authority, peer = self._authority(), inbound.peer
        if peer.serial in self.store.revoked:
            raise _revoked(peer)
        if peer.name == SHARED_NODE_NAME:
            raise IopError(
                pb.ERROR_CODE_PERMISSION_DENIED,
                "the shared development certificate is not renewed: join this machine to get its own",
            )
        try:
            name = requested_name(inbound.envelope.cert_renew.csr_pem.encode(), Role.NODE)
        except (RequestError, UnicodeError) as exc:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, str(exc)) from None
        if name != peer.name:
            self._refuse_registration("identity_mismatch", name, peer)
            why = f"a renewal keeps the certificate's name: this one is {peer.name!r}, the request asks for {name!r}"
            raise _denied(why, pb.ERROR_REASON_IDENTITY_MISMATCH)
        pem, facts = authority.sign_request(
            inbound.envelope.cert_renew.csr_pem.encode(), role=Role.NODE, lifetime=self._lifetime
        )
        await self.store.issued(name, facts.serial, facts.not_after.timestamp(), replaces=False)
        self.metrics.certificates_issued.labels("renew").inc()
        _log.info("certificate renewed", node_id=name, serial=facts.serial, previous=peer.serial)
        renewed = pb.CertRenewed(certificate_pem=pem.decode())
        renewed.not_after.FromDatetime(facts.not_after)
        await inbound.reply(pb.Envelope(cert_renewed=renewed))

    # -- tokens -----------------------------------------------------------------------------

    async def join_token_create(self, inbound: Inbound) -> None:
        """A token for machines to join with; its secret is shown this once."""
        authority, message = self._authority(), inbound.envelope.join_token_create
        ttl = message.ttl.ToTimedelta().total_seconds() if message.HasField("ttl") else _DEFAULT_TTL
        if ttl <= 0:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"a token's ttl must be positive, not {ttl:g} s")
        prefix = message.name_prefix
        if prefix and not re.fullmatch(r"[A-Za-z0-9._-]{1,62}", prefix):
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"name prefix {prefix[:80]!r} has characters no name may")
        text, token = await self.store.create_token(
            ttl=ttl, uses=message.uses or 1, name_prefix=prefix, created_by=inbound.peer.name
        )
        _log.info("join token created", token=token.id, uses=token.uses, ttl=ttl, by=inbound.peer.name)
        created = pb.JoinTokenCreated(token=text, info=_info(token), ca_hash=ca_hash(authority.cert_pem))
        await inbound.reply(pb.Envelope(join_token_created=created))

    async def join_tokens_list(self, inbound: Inbound) -> None:
        """Every token, newest first, without secrets."""
        tokens = [_info(token) for token in await self.store.tokens()]
        await inbound.reply(pb.Envelope(join_tokens_listed=pb.JoinTokensListed(tokens=tokens)))

    async def join_token_revoke(self, inbound: Inbound) -> None:
        """No machine may join with the token any more."""
        token_id = inbound.envelope.join_token_revoke.id
        if not await self.store.revoke_token(token_id):
            raise IopError(pb.ERROR_CODE_NOT_FOUND, f"no join token {token_id[:80]!r}")
        _log.info("join token revoked", token=token_id, by=inbound.peer.name)
        await inbound.reply(pb.Envelope(operation_done=pb.OperationDone(message=f"join token {token_id} revoked")))

    def _authority(self) -> Authority:
        if self.authority is None:
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, _OFF, retryable=False)
        return self.authority


async def _off(inbound: Inbound) -> None:
    raise IopError(pb.ERROR_CODE_UNAVAILABLE, _OFF, retryable=False)


async def _deny_certless(connection: Connection, kind: str, *, in_reply_to: str, limiter: RateLimitedLog) -> None:
    """Refuse what a certless peer may not send, and close its connection."""
    address = connection.address.rpartition(":")[0]
    limiter.warning("certless", _log, "request refused", reason="no certificate", kind=kind, address=address)
    why = _CERTLESS_ONLY.format(kind=kind)
    error = IopError(pb.ERROR_CODE_PERMISSION_DENIED, why)
    await connection.send(error_envelope(error, in_reply_to=in_reply_to))
    await connection.close(why, code=pb.ERROR_CODE_PERMISSION_DENIED)


def _revoked(peer: PeerIdentity) -> IopError:
    return _denied(
        f"the certificate of {peer.name!r} (serial {peer.serial}) was revoked: join again with a new token",
        pb.ERROR_REASON_CERTIFICATE_REVOKED,
    )


def _when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="seconds")


def _info(token: Token) -> pb.JoinTokenInfo:
    info = pb.JoinTokenInfo(
        id=token.id,
        uses=token.uses,
        used=token.used,
        name_prefix=token.name_prefix,
        created_by=token.created_by,
        revoked=token.revoked_at is not None,
    )
    info.created_at.FromNanoseconds(int(token.created_at * 1e9))
    info.expires_at.FromNanoseconds(int(token.expires_at * 1e9))
    return info
