"""What a gateway tells the autoscaler: per model, the requests it holds, how fast they arrive, and their work.

Each gateway writes one `ObservationRecord` (kvgate/state/records.py: its fields and versioning) per
model to the state store, collection `observations`, id `<model>@<gateway_id>`, about once a second:
requests waiting for a replica (none ready: scaling from zero), requests in flight, arrivals over the
last `window_s` and how bursty they were (the variance of each interval's count), the requests that finished
over the same window (with those in flight, Little's law gives a request's time in service), the prompt tokens the
routed requests must still prefill (after the prefix their replica is predicted to hold) and their
squares (the autoscaler's queueing model needs their spread), and the time to first token over the same
window. Readers (the autoscaler) sum over
gateways and ignore records older than a few intervals, so a gateway that dies simply stops counting.
The gateway deletes its records when it stops.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvgate.clock import Clock, sleep_or_wake
from kvgate.state.base import StateStore, StateStoreError, raise_if_cancelled
from kvgate.state.outage import Outage
from kvgate.state.records import OBSERVATIONS_COLLECTION, ObservationRecord, observation_id

log = logging.getLogger(__name__)


class ArrivalRate:
    """Arrivals per second over a sliding window, from a cumulative count sampled now and then.

    Keeps (now, count) samples no older than the window (plus the one just before it, to measure
    from); the rate is the growth between the oldest kept sample and the newest over their distance.
    Worked: counts 0 at t=0, 30 at t=10 with a 10 s window -> 3.0/s."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, count: int) -> float:
        """Record the count at `now`; return the rate over the window (0.0 until two samples)."""
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()
        first_t, first_count = self._samples[0]
        if now <= first_t:
            return 0.0
        return max(count - first_count, 0) / (now - first_t)


class ArrivalSpread:
    """The variance of arrivals counted in each publishing interval, over a window, per second of interval:
    Var(N_tau) / tau, which is the rate itself for Poisson arrivals and k times it for batches of k.

    Worked: counts 2, 0, 4, 2 in four 1 s intervals -> mean 2, variance 2.0 (population) -> 2.0 per second."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._last: tuple[float, int] | None = None
        self._counts: collections.deque[tuple[float, float, int]] = collections.deque()  # (end, length, count)

    def add(self, now: float, count: int) -> float | None:
        """Record the cumulative count at `now`; the variance per second, None until two intervals."""
        if self._last is not None and now > self._last[0]:
            self._counts.append((now, now - self._last[0], max(0, count - self._last[1])))
        self._last = (now, count)
        while self._counts and now - self._counts[0][0] >= self._window_s:
            self._counts.popleft()
        if len(self._counts) < 2:
            return None
        tau = sum(length for _, length, _ in self._counts) / len(self._counts)
        mean = sum(n for _, _, n in self._counts) / len(self._counts)
        return sum((n - mean) ** 2 for _, _, n in self._counts) / len(self._counts) / tau


class PromptWork:
    """Per model, the prompt tokens routed requests must still prefill, summed, and their squares: counted
    once a request, at its first attempt (a retry is the same work moved), by the proxy."""

    def __init__(self) -> None:
        self._sums: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def note(self, model: str, uncached_tokens: int) -> None:
        entry = self._sums[model]
        entry[0] += uncached_tokens
        entry[1] += uncached_tokens * uncached_tokens

    def totals(self, model: str) -> tuple[int, int]:
        """(tokens, squares) so far for `model`; (0, 0) before its first request."""
        entry = self._sums.get(model)
        return (entry[0], entry[1]) if entry else (0, 0)


@dataclass
class _ModelWindows:
    """One model's sliding windows at this gateway: arrivals, their spread, prompt tokens and their squares."""

    arrivals: ArrivalRate
    spread: ArrivalSpread
    tokens: ArrivalRate
    squares: ArrivalRate
    finished: ArrivalRate

    @classmethod
    def of(cls, window_s: float) -> _ModelWindows:
        return cls(ArrivalRate(window_s), ArrivalSpread(window_s), ArrivalRate(window_s), ArrivalRate(window_s),
                   ArrivalRate(window_s))


class ObservationPublisher:
    """Writes this gateway's observations every `interval_s`; owned by the app when it has a store.

    The readers are callables into the gateway (arrival counts, wait-queue depths, in-flight gauges,
    every model's TTFT p99 over the window), so this class holds no request path state of its own."""

    def __init__(self, *, store: StateStore, gateway_id: str, clock: Clock,
                 model_names: Callable[[], Iterable[str]], arrivals: Mapping[str, int],
                 queued: Callable[[str], int], in_flight: Callable[[], Mapping[str, float]],
                 ttft_p99_s: Callable[[], Mapping[str, float | None]], prompt_work: PromptWork | None = None,
                 finished: Mapping[str, int] | None = None, interval_s: float = 1.0, window_s: float = 10.0) -> None:
        self._store = store
        self.gateway_id = gateway_id
        self._clock = clock
        self._model_names = model_names
        self._arrivals = arrivals
        self._finished = finished
        self._queued = queued
        self._in_flight = in_flight
        self._ttft_p99_s = ttft_p99_s
        self._interval_s = interval_s
        self._window_s = window_s
        self._prompt_work = prompt_work or PromptWork()
        self._windows: dict[str, _ModelWindows] = {}
        self._written: set[str] = set()
        self._soon = asyncio.Event()
        self._urgent_listeners: list[Callable[[], None]] = []

    def publish_soon(self) -> None:
        """Publish now, not at the end of the interval: a request waits at a model with no ready replica, and the
        autoscaler starts one only once it reads that. (The early reading makes one interval of the windows short:
        rates are per second of window and stay right; the spread's variance counts one short interval.)"""
        self._soon.set()

    def on_urgent_publish(self, listener: Callable[[], None]) -> None:
        """Call `listener` after each publish that `publish_soon` asked for: an autoscaler in this process ticks
        then (`kvgate up`), rather than at its next interval."""
        self._urgent_listeners.append(listener)

    def observe(self) -> list[ObservationRecord]:
        """Every registry model's observation now (synchronous: one consistent reading)."""
        now, wall = self._clock.now(), self._clock.wall()
        in_flight = self._in_flight()
        ttft_p99_s = self._ttft_p99_s()  # every model's, from one reading of the window
        out = []
        for model in self._model_names():
            windows = self._windows.get(model) or self._windows.setdefault(model, _ModelWindows.of(self._window_s))
            arrived = self._arrivals[model]
            prompt_tokens, prompt_squares = self._prompt_work.totals(model)
            var = windows.spread.add(now, arrived)
            # The gauge counts a request from its arrival; those still waiting at this gateway are `queued`, and
            # in_flight is the rest: at replicas (Little's law pairs it with the requests that finished there).
            queued = self._queued(model)
            out.append(ObservationRecord(
                model=model, gateway_id=self.gateway_id, queued=queued,
                in_flight=max(0, int(in_flight.get(model, 0)) - queued),
                arrivals_per_s=round(windows.arrivals.add(now, arrived), 4),
                arrivals_var=None if var is None else round(var, 4),
                prompt_tokens_per_s=round(windows.tokens.add(now, prompt_tokens), 2),
                prompt_tokens_sq_per_s=round(windows.squares.add(now, prompt_squares), 1),
                completions_per_s=(None if self._finished is None
                                   else round(windows.finished.add(now, self._finished[model]), 4)),
                ttft_p99_s=ttft_p99_s.get(model), updated_at=wall))
        return out

    async def publish_once(self) -> None:
        observations = self.observe()
        for obs in observations:
            record_id = observation_id(obs.model, self.gateway_id)
            await self._store.put_record(OBSERVATIONS_COLLECTION, record_id, obs.to_json())
            self._written.add(record_id)

    async def run(self) -> None:
        """Publish until cancelled; a store that is down is retried, and logged when the outage starts, once a
        minute while it lasts and once when it ends (`Outage`)."""
        outage = Outage()
        while True:
            urgent = self._soon.is_set()
            self._soon.clear()
            try:
                await self.publish_once()
                recovered = outage.recovered(self._clock.now())
                if recovered is not None:
                    log.info("publishing observations to the state store again %s", recovered)
                if urgent:
                    for listener in self._urgent_listeners:
                        listener()
            except StateStoreError as exc:
                note = outage.failed(self._clock.now())
                if note is not None:
                    log.warning("cannot publish observations to the state store (the autoscaler does not see this "
                                "gateway's load meanwhile): %s%s", exc, note)
            raise_if_cancelled()
            await sleep_or_wake(self._clock, self._interval_s, self._soon)

    async def withdraw(self) -> None:
        """Delete the records this gateway wrote (on shutdown); a store that is down is ignored."""
        for record_id in sorted(self._written):
            with contextlib.suppress(StateStoreError):
                await self._store.delete_record(OBSERVATIONS_COLLECTION, record_id)
        self._written.clear()
