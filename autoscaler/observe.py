"""Reading what the gateways observed: the "observe" step of the live loop.

Each router gateway writes one record per model it serves, about once a second, into the state
store's collection "observations" with id "<model>@<gateway_id>":

    {"model": str, "gateway_id": str,
     "queued": int,            # requests waiting at that gateway for a replica
     "in_flight": int,         # proxied to a replica, not finished
     "arrivals_per_s": float,  # over the last 10 s
     "ttft_p99_s": float|null,
     "updated_at": wall seconds}

`totals_by_model` (pure) sums them across gateways, skipping records older than `max_age_s` (a
gateway that died stops counting after 10 s instead of holding its last load forever) and records
that do not parse (one bad writer must not stop the autoscaler: they are counted, not raised).
`read_gateway_totals` is the thin async shell over the store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.state import StateStore, StoredRecord

OBSERVATIONS = "observations"
# Gateways write every ~1 s; ten missed writes mean the gateway is gone, not slow.
DEFAULT_MAX_AGE_S = 10.0


@dataclass(frozen=True, slots=True)
class GatewayTotals:
    """One model's load summed over every live gateway."""

    model: str
    queued: int  # requests held at gateways waiting for a replica (scale-from-zero demand)
    in_flight: int  # requests proxied to replicas and not finished: waiting + running at replicas
    arrivals_per_s: float
    ttft_p99_s: float | None  # the worst gateway's p99: a max, since p99s do not add
    num_gateways: int


@dataclass(frozen=True, slots=True)
class ObservationRead:
    """The result of one read: totals per model, and how many records were skipped and why."""

    totals: Mapping[str, GatewayTotals]
    num_stale: int
    num_malformed: int


def observation_id(model: str, gateway_id: str) -> str:
    """The record id a gateway writes its observation of `model` under."""
    return f"{model}@{gateway_id}"


def _number(raw: Any, *, integer: bool) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
        raise ValueError(f"not a count: {raw!r}")
    return int(raw) if integer else float(raw)


def totals_by_model(records: Iterable[StoredRecord], now_wall_s: float,
                    max_age_s: float = DEFAULT_MAX_AGE_S) -> ObservationRead:
    """Sum observation records per model across gateways (pure).

    A record counts when `now_wall_s - updated_at < max_age_s` (a record from slightly in the future,
    clock skew between hosts, counts). Worked example: gateways g1 {queued 2, in_flight 5, 3.0/s,
    p99 0.4} and g2 {queued 1, in_flight 4, 1.5/s, p99 0.9}, both fresh -> queued 3, in_flight 9,
    4.5/s, p99 0.9, 2 gateways. A g3 record 12 s old is skipped and counted in `num_stale`.
    """
    sums: dict[str, list[Any]] = {}
    num_stale = num_malformed = 0
    for record in records:
        data = record.data
        try:
            model = data["model"]
            if not isinstance(model, str) or not model:
                raise ValueError("model")
            updated_at = float(data["updated_at"])
            queued = int(_number(data.get("queued", 0), integer=True))
            in_flight = int(_number(data.get("in_flight", 0), integer=True))
            arrivals = _number(data.get("arrivals_per_s", 0.0), integer=False)
            raw_ttft = data.get("ttft_p99_s")
            ttft = None if raw_ttft is None else _number(raw_ttft, integer=False)
        except (KeyError, TypeError, ValueError):
            num_malformed += 1
            continue
        if now_wall_s - updated_at >= max_age_s:
            num_stale += 1
            continue
        entry = sums.setdefault(model, [0, 0, 0.0, None, 0])
        entry[0] += queued
        entry[1] += in_flight
        entry[2] += arrivals
        if ttft is not None:
            entry[3] = ttft if entry[3] is None else max(entry[3], ttft)
        entry[4] += 1
    totals = {
        model: GatewayTotals(model, queued=q, in_flight=f, arrivals_per_s=a, ttft_p99_s=t, num_gateways=n)
        for model, (q, f, a, t, n) in sorted(sums.items())
    }
    return ObservationRead(totals, num_stale, num_malformed)


async def read_gateway_totals(store: StateStore, now_wall_s: float,
                              max_age_s: float = DEFAULT_MAX_AGE_S) -> ObservationRead:
    """Read every observation record and sum it per model. Raises `StateStoreUnavailable`."""
    return totals_by_model(await store.list_records(OBSERVATIONS), now_wall_s, max_age_s)
