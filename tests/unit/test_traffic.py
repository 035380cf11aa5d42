"""The overview's rolling window (no I/O): per-second slots, the window summed, TTFT percentiles, and
the bounds on what one second keeps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from iop_control_plane.traffic import MODELS_PER_SECOND, OTHER, SAMPLES_PER_SECOND, Traffic

NOW = 1_764_669_600.0


def _ms(duration: object) -> float:
    return round(duration.ToNanoseconds() / 1e6, 3)  # type: ignore[attr-defined]


def test_the_window_sums_runs_that_ended_in_it_per_model() -> None:
    traffic = Traffic()
    for n in range(10):  # one run a second for 10 s: 10, 20, ... 100 ms to first output
        traffic.add("m1", failed=n == 9, prompt_tokens=5, completion_tokens=7, ttft=(n + 1) / 100, now=NOW - 9 + n)
    traffic.add("m2", failed=False, prompt_tokens=1, completion_tokens=2, ttft=None, now=NOW)  # no output
    traffic.add("m1", failed=False, prompt_tokens=100, completion_tokens=100, ttft=1.0, now=NOW - 61)  # too old
    shown = traffic.shown(0, queued={"m3": 2}, running={"m1": 3}, now=NOW)
    assert (shown.window_seconds, shown.requests, shown.failed) == (60, 11, 1)
    assert (shown.prompt_tokens, shown.completion_tokens, shown.queued, shown.running) == (51, 72, 2, 3)
    assert (_ms(shown.ttft_p50), _ms(shown.ttft_p95)) == (50.0, 100.0)
    m1, m2, m3 = shown.models
    assert (m1.model, m1.requests, m1.failed, m1.completion_tokens, m1.running, _ms(m1.ttft_p50)) == (
        "m1", 10, 1, 70, 3, 50.0
    )  # fmt: skip
    assert (m2.model, m2.requests, m2.HasField("ttft_p50")) == ("m2", 1, False)
    assert (m3.model, m3.requests, m3.queued) == ("m3", 0, 2)
    assert traffic.shown(5, queued={}, running={}, now=NOW).requests == 6
    assert traffic.shown(3600, queued={}, running={}, now=NOW).requests == 12


def test_a_second_reused_an_hour_later_starts_empty() -> None:
    traffic = Traffic()
    traffic.add("m1", failed=False, prompt_tokens=1, completion_tokens=1, ttft=0.1, now=NOW)
    traffic.add("m1", failed=False, prompt_tokens=1, completion_tokens=1, ttft=0.1, now=NOW + 3600)
    assert traffic.shown(3600, queued={}, running={}, now=NOW + 3600).requests == 1
    assert traffic.shown(60, queued={}, running={}, now=NOW + 7200).requests == 0


def test_one_second_keeps_bounded_models_and_samples() -> None:
    registry = CollectorRegistry()
    traffic = Traffic(Counter("folded", "runs summed under (other)", registry=registry))
    for n in range(MODELS_PER_SECOND + 10):
        traffic.add(f"model-{n}", failed=False, prompt_tokens=1, completion_tokens=1, ttft=0.01, now=NOW)
    for _ in range(10 * SAMPLES_PER_SECOND):
        traffic.add("model-0", failed=False, prompt_tokens=1, completion_tokens=1, ttft=0.02, now=NOW)
    shown = traffic.shown(1, queued={}, running={}, now=NOW)
    assert len(shown.models) == MODELS_PER_SECOND + 1 and shown.models[0].model == OTHER
    assert (shown.models[0].requests, registry.get_sample_value("folded_total")) == (10, 10)
    assert shown.requests == MODELS_PER_SECOND + 10 + 10 * SAMPLES_PER_SECOND  # every run counted
    assert _ms(shown.ttft_p50) == 20.0  # sampled: most runs of the second took 20 ms
