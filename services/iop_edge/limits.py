"""Per-key limits on one edge: rpm, tpm and max_concurrent over sliding 60-second windows.

:class:`Limiter` is the local arithmetic: with keys in a file of one edge it is the whole story;
with a store shared by several edges (``shared.SharedLimits``) it is what an edge falls back to,
with its share of each limit, while the store cannot be reached.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from iop_edge.key_storage import ApiKey

__all__ = ["Lease", "LimitExceeded", "Limiter"]


class LimitExceeded(Exception):
    """A key is at one of its limits: answer 429 with ``Retry-After``."""

    def __init__(self, message: str, *, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.message = message
        """One line for the client, naming the key and the limit."""
        self.retry_after = retry_after
        """Seconds (> 0) until the request would be let through, all else unchanged."""
        self.limit = limit
        """Which limit: ``rpm``, ``tpm`` or ``max_concurrent``."""


_WINDOW = 60.0  # seconds: rpm and tpm are per minute
_BUCKET = 0.1  # events this close together share one entry: a window holds at most 600 entries
_BUSY_RETRY = 1.0  # seconds to suggest when max_concurrent is reached: a request's end is unknown


@dataclasses.dataclass(slots=True)
class _Entry:
    first: float
    last: float
    count: int


class _Window:
    """Counts over the last 60 s, as at most 600 entries however many events come.

    An entry leaves the window 60 s after its *last* event, so merged events are counted a little
    longer (up to 0.1 s), never shorter: the limit is never exceeded.
    """

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: collections.deque[_Entry] = collections.deque()
        self.total = 0

    def add(self, now: float, count: int) -> None:
        if self.entries:
            entry = self.entries[-1]
            now = max(now, entry.last)  # entries stay in time order whatever clock the caller passed
            if now - entry.first < _BUCKET:
                entry.last, entry.count = now, entry.count + count
                self.total += count
                return
        self.entries.append(_Entry(now, now, count))
        self.total += count

    def prune(self, now: float) -> None:
        while self.entries and self.entries[0].last <= now - _WINDOW:
            self.total -= self.entries.popleft().count

    def wait(self, now: float, limit: int) -> float:
        """Seconds until the total is below ``limit`` (after :meth:`prune`)."""
        remaining = self.total
        for entry in self.entries:
            remaining -= entry.count
            if remaining < limit:
                return entry.last + _WINDOW - now
        return 0.0  # unreachable while total >= limit >= 1


@dataclasses.dataclass(slots=True)
class _KeyState:
    touched: float
    in_progress: int = 0
    requests: _Window = dataclasses.field(default_factory=_Window)
    tokens: _Window = dataclasses.field(default_factory=_Window)

    def idle(self) -> bool:
        return self.in_progress == 0 and not self.requests.entries and not self.tokens.entries


class Lease:
    """One admitted request; :meth:`release` it when the request ends, however it ends."""

    __slots__ = ("_limiter", "_name", "_state")

    def __init__(self, limiter: Limiter | None, name: str, state: _KeyState | None) -> None:
        self._limiter = limiter
        self._name = name
        self._state = state

    def release(self, tokens: int = 0, *, now: float | None = None) -> None:
        """Free the request's slot and count ``tokens`` (prompt + completion) against tpm; idempotent."""
        state, self._state = self._state, None
        if state is not None and self._limiter is not None:
            self._limiter._release(self._name, state, max(tokens, 0), time.monotonic() if now is None else now)


_FREE = Lease(None, "", None)  # the lease of a key without limits: nothing to release


class Limiter:
    """Per-key rpm, tpm and max_concurrent over sliding 60-second windows, for one event loop.

    tpm counts the tokens of finished requests: a request is admitted while the last minute's
    tokens are below tpm, so one long request may overshoot it. A key's state is dropped once it
    is idle (nothing in progress, nothing in the last minute): memory follows the active keys.
    Keys without limits cost nothing.
    """

    def __init__(self) -> None:
        # Least recently touched first, so the idle states are swept from the front.
        self._states: collections.OrderedDict[str, _KeyState] = collections.OrderedDict()

    def acquire(self, key: ApiKey, now: float | None = None, *, counted_only: bool = False) -> Lease:
        """Admit one request of ``key`` or raise :class:`LimitExceeded` (the longest wait of the limits hit).

        ``counted_only``: admitted by someone else (the shared limits), only counted here.
        """
        if not key.limited:
            return _FREE
        now = time.monotonic() if now is None else now
        self._sweep(now)
        state = self._states.get(key.name) or _KeyState(now)
        state.requests.prune(now)
        state.tokens.prune(now)
        refusals = [] if counted_only else _refusals(key, state, now)
        if refusals:
            raise max(refusals, key=lambda refusal: refusal.retry_after)
        state.in_progress += 1
        if key.rpm is not None:
            state.requests.add(now, 1)
        self._touch(key.name, state, now)
        return Lease(self, key.name, state)

    def in_progress(self, key_name: str) -> int:
        """Requests of the key in progress (0 for keys without limits: they are not tracked)."""
        state = self._states.get(key_name)
        return 0 if state is None else state.in_progress

    def __len__(self) -> int:
        """Keys with state kept."""
        return len(self._states)

    def _release(self, name: str, state: _KeyState, tokens: int, now: float) -> None:
        state.in_progress -= 1
        if tokens:
            state.tokens.add(now, tokens)
        state.requests.prune(now)
        state.tokens.prune(now)
        if self._states.get(name) is not state:
            return
        if state.idle():
            del self._states[name]
        else:
            self._touch(name, state, now)

    def _touch(self, name: str, state: _KeyState, now: float) -> None:
        state.touched = max(state.touched, now)
        self._states[name] = state
        self._states.move_to_end(name)

    def _sweep(self, now: float) -> None:
        """Drop the states untouched for a window; those still in progress go to the back."""
        for _ in range(len(self._states)):
            name, state = next(iter(self._states.items()))
            if state.touched > now - _WINDOW - _BUCKET:
                return
            del self._states[name]
            state.requests.prune(now)
            state.tokens.prune(now)
            if not state.idle():
                self._touch(name, state, now)


def _refusals(key: ApiKey, state: _KeyState, now: float) -> list[LimitExceeded]:
    found: list[LimitExceeded] = []
    if key.max_concurrent is not None and state.in_progress >= key.max_concurrent:
        found.append(
            LimitExceeded(
                f"key {key.name!r} has {state.in_progress} requests in progress, its limit (max_concurrent)",
                retry_after=_BUSY_RETRY,
                limit="max_concurrent",
            )
        )
    if key.rpm is not None and state.requests.total >= key.rpm:
        found.append(
            LimitExceeded(
                f"key {key.name!r} is at its limit of {key.rpm} requests per minute (rpm)",
                retry_after=state.requests.wait(now, key.rpm),
                limit="rpm",
            )
        )
    if key.tpm is not None and state.tokens.total >= key.tpm:
        found.append(
            LimitExceeded(
                f"key {key.name!r} is at its limit of {key.tpm} tokens per minute (tpm)",
                retry_after=state.tokens.wait(now, key.tpm),
                limit="tpm",
            )
        )
    return found
