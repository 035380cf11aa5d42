"""Recent traffic for overview.show: runs that ended on this control-plane, per second, for the last hour.

A ring of :data:`WINDOW_MAX` one-second slots; a run's end adds to its second's slot in O(1)
(per model: runs, failed, prompt and completion tokens; and a TTFT sample). Memory is bounded
whatever the rate: a slot keeps at most :data:`MODELS_PER_SECOND` models (later ones in the
same second are summed under :data:`OTHER`, counted in
``iop_control_plane_overview_folded_total`` and logged once a second) and at most
:data:`SAMPLES_PER_SECOND` TTFT samples (reservoir sampling: every run of the second has the
same chance of being among them, so the percentiles stay unbiased at any rate). An answer reads
at most 3,600 slots, whatever the number of nodes.

A run refused for its model (no node serves it, or its name is over the limit) is counted under
``(unknown)``, as in the usage rollup: names a client makes up never fill the ring's slots.

``failed`` counts runs that ended failed, not cancelled ones (a client that goes away is not a
fault of the platform); ``requests`` counts both.
"""

from __future__ import annotations

import datetime
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from prometheus_client import Counter

from iop_control_plane.ledger import LedgerEntry
from iop_control_plane.usage import usage_model
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.logs import RateLimitedLog

if TYPE_CHECKING:
    from google.protobuf.duration_pb2 import Duration

__all__ = ["MODELS_PER_SECOND", "OTHER", "SAMPLES_PER_SECOND", "WINDOW_DEFAULT", "WINDOW_MAX", "Traffic"]

_log = structlog.get_logger("iop.control_plane")
WINDOW_DEFAULT = 60
"""Seconds an overview sums when the request names none."""
WINDOW_MAX = 3600
"""Most seconds an overview may sum (the ring's length)."""
MODELS_PER_SECOND = 256
"""Models one second's slot keeps apart; more are summed under :data:`OTHER`."""
SAMPLES_PER_SECOND = 256
"""TTFT samples one second's slot keeps."""
OTHER = "(other)"
"""The model name of runs summed past :data:`MODELS_PER_SECOND` in one second."""


@dataclass(slots=True)
class _Tally:
    """One model's runs that ended in one second."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class _Second:
    """The runs that ended in one second."""

    at: int
    """The second (since the epoch) it holds."""
    models: dict[str, _Tally] = field(default_factory=dict)
    samples: list[tuple[str, float]] = field(default_factory=list)
    """(model, TTFT seconds) of at most SAMPLES_PER_SECOND runs that had an output."""
    timed: int = 0
    """Runs with a TTFT that ended in the second (the reservoir's count)."""


@dataclass(slots=True)
class _Sum:
    """A model's (or every model's) share of a window."""

    tally: _Tally = field(default_factory=_Tally)
    ttfts: list[float] = field(default_factory=list)


class Traffic:
    """Runs that ended on this control-plane in the last :data:`WINDOW_MAX` seconds."""

    def __init__(self, folded: Counter | None = None) -> None:
        self._ring: list[_Second | None] = [None] * WINDOW_MAX
        self._folded = folded
        self._fold_log = RateLimitedLog(every=1.0)

    def ended(self, entry: LedgerEntry, now: float | None = None) -> None:
        """Count a run that ended (its status, usage and first output are set), under ``(unknown)`` when it
        was refused for its model (:func:`~iop_control_plane.usage.usage_model`)."""
        usage = entry.usage
        ttft = None if entry.first_output is None else entry.first_output - entry.received
        node_id = entry.attempts[-1].node_id if entry.attempts else ""
        self.add(
            usage_model(entry.model, entry.error_code, node_id),
            failed=entry.status == "failed",
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            ttft=ttft,
            now=now,
        )

    def add(
        self,
        model: str,
        *,
        failed: bool,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        now: float | None = None,
    ) -> None:
        """Count one run that ended ``now`` (default: the time)."""
        second = self._slot(int(now if now is not None else time.time()))
        tally = second.models.get(model)
        if tally is None:
            if len(second.models) >= MODELS_PER_SECOND:
                model = self._fold(model)
            tally = second.models.setdefault(model, _Tally())
        tally.requests += 1
        tally.failed += failed
        tally.prompt_tokens += prompt_tokens
        tally.completion_tokens += completion_tokens
        if ttft is not None:
            second.timed += 1
            if len(second.samples) < SAMPLES_PER_SECOND:
                second.samples.append((model, ttft))
            elif (slot := random.randrange(second.timed)) < SAMPLES_PER_SECOND:  # noqa: S311 - sampling, not secrets
                second.samples[slot] = (model, ttft)

    def shown(
        self, window: int, *, queued: dict[str, int], running: dict[str, int], now: float | None = None
    ) -> pb.OverviewShown:
        """The overview of the last ``window`` seconds (0: :data:`WINDOW_DEFAULT`; at most :data:`WINDOW_MAX`),
        with the runs ``queued`` and ``running`` now per model."""
        window = min(window or WINDOW_DEFAULT, WINDOW_MAX)
        total, models = self._sums(window, int(now if now is not None else time.time()))
        answer = pb.OverviewShown(
            window_seconds=window,
            requests=total.tally.requests,
            failed=total.tally.failed,
            prompt_tokens=total.tally.prompt_tokens,
            completion_tokens=total.tally.completion_tokens,
            queued=sum(queued.values()),
            running=sum(running.values()),
        )
        _percentile(answer.ttft_p50, total.ttfts, 0.50)
        _percentile(answer.ttft_p95, total.ttfts, 0.95)
        for model in sorted(models.keys() | queued.keys() | running.keys()):
            share = models.get(model, _Sum())
            traffic = answer.models.add(
                model=model,
                requests=share.tally.requests,
                failed=share.tally.failed,
                completion_tokens=share.tally.completion_tokens,
                queued=queued.get(model, 0),
                running=running.get(model, 0),
            )
            _percentile(traffic.ttft_p50, share.ttfts, 0.50)
        return answer

    def _slot(self, at: int) -> _Second:
        index = at % WINDOW_MAX
        second = self._ring[index]
        if second is None or second.at != at:
            second = self._ring[index] = _Second(at)
        return second

    def _fold(self, model: str) -> str:
        if self._folded is not None:
            self._folded.inc()
        self._fold_log.warning("overview", _log, "overview: too many models in one second", model=model[:64],
                               bound=MODELS_PER_SECOND)  # fmt: skip
        return OTHER

    def _sums(self, window: int, now: int) -> tuple[_Sum, dict[str, _Sum]]:
        total, models = _Sum(), dict[str, _Sum]()
        for at in range(now - window + 1, now + 1):
            second = self._ring[at % WINDOW_MAX]
            if second is None or second.at != at:
                continue
            for model, tally in second.models.items():
                share = models.setdefault(model, _Sum())
                for into in (share.tally, total.tally):
                    into.requests += tally.requests
                    into.failed += tally.failed
                    into.prompt_tokens += tally.prompt_tokens
                    into.completion_tokens += tally.completion_tokens
            for model, ttft in second.samples:
                models.setdefault(model, _Sum()).ttfts.append(ttft)
                total.ttfts.append(ttft)
        return total, models


def _percentile(into: Duration, values: list[float], q: float) -> None:
    """Set the Duration ``into`` to the ``q`` quantile of ``values`` (nearest rank); unset when there are none."""
    if not values:
        return
    values.sort()
    rank = min(len(values) - 1, max(0, int(q * len(values) + 0.999999) - 1))
    into.FromTimedelta(datetime.timedelta(seconds=values[rank]))
