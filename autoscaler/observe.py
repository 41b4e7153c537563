"""Reading what the gateways observed: the "observe" step of the live loop.

Each router gateway writes one `ObservationRecord` (kvgate/state/records.py) per model it serves, about
once a second, into the state store's collection "observations" with id "<model>@<gateway_id>".

`totals_by_model` (pure) sums them across gateways, skipping records older than `max_age_s` (a
gateway that died stops counting after 10 s instead of holding its last load forever), records
that do not parse (one bad writer must not stop the autoscaler: they are counted, not raised) and
records of a newer schema major (a gateway of a newer release, mid-upgrade: returned, for the shell to
say once). `read_gateway_totals` is the thin async shell over the store.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvgate.state import StateStore, StoredRecord
from kvgate.state.records import MALFORMED, OBSERVATIONS_COLLECTION, ObservationRecord
from kvgate.state.schema import NewerSchema, SkippedRecords

log = logging.getLogger(__name__)

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
    prompt_tokens_per_s: float = 0.0  # uncached prompt tokens routed per second (sums)
    prompt_tokens_sq_per_s: float = 0.0  # their squares (sums)
    arrivals_var: float | None = None  # variances add across gateways that split traffic independently; None: none said
    completions_per_s: float | None = None  # requests replicas served per second (sums); None: some gateway did not say


@dataclass(frozen=True, slots=True)
class ObservationRead:
    """The result of one read: totals per model, and how many records were skipped and why."""

    totals: Mapping[str, GatewayTotals]
    num_stale: int
    num_malformed: int
    newer: Mapping[str, NewerSchema] = field(default_factory=dict)  # record id -> why it was skipped


def totals_by_model(records: Iterable[StoredRecord], now_wall_s: float,
                    max_age_s: float = DEFAULT_MAX_AGE_S) -> ObservationRead:
    """Sum observation records per model across gateways (pure).

    A record counts when `now_wall_s - updated_at < max_age_s` (a record from slightly in the future,
    clock skew between hosts, counts). Worked example: gateways g1 {queued 2, in_flight 5, 3.0/s,
    p99 0.4} and g2 {queued 1, in_flight 4, 1.5/s, p99 0.9}, both fresh -> queued 3, in_flight 9,
    4.5/s, p99 0.9, 2 gateways. A g3 record 12 s old is skipped and counted in `num_stale`. Prompt tokens,
    their squares and the arrival variances add up the same way (a gateway that reports no variance adds none).
    """
    totals: dict[str, GatewayTotals] = {}
    num_stale = num_malformed = 0
    newer: dict[str, NewerSchema] = {}
    for record in records:
        try:
            obs = ObservationRecord.from_json(record.data)
        except NewerSchema as exc:
            newer[record.id] = exc
            continue
        except MALFORMED:
            num_malformed += 1
            continue
        if now_wall_s - obs.updated_at >= max_age_s:
            num_stale += 1
            continue
        totals[obs.model] = _add(totals.get(obs.model), obs)
    totals = dict(sorted(totals.items()))
    return ObservationRead(totals, num_stale, num_malformed, newer)


def _add(totals: GatewayTotals | None, obs: ObservationRecord) -> GatewayTotals:
    """`totals` with one more gateway's record in it: counts, rates and variances add, the p99 is the worst."""
    if totals is None:
        return GatewayTotals(obs.model, obs.queued, obs.in_flight, obs.arrivals_per_s, obs.ttft_p99_s, 1,
                             obs.prompt_tokens_per_s, obs.prompt_tokens_sq_per_s, obs.arrivals_var,
                             obs.completions_per_s)
    p99s = [t for t in (totals.ttft_p99_s, obs.ttft_p99_s) if t is not None]
    variances = [v for v in (totals.arrivals_var, obs.arrivals_var) if v is not None]
    # Completions pair with in_flight, which every gateway reports: summed only when every gateway counts them.
    done = (None if totals.completions_per_s is None or obs.completions_per_s is None
            else totals.completions_per_s + obs.completions_per_s)
    return GatewayTotals(totals.model, totals.queued + obs.queued, totals.in_flight + obs.in_flight,
                         totals.arrivals_per_s + obs.arrivals_per_s, max(p99s) if p99s else None,
                         totals.num_gateways + 1, totals.prompt_tokens_per_s + obs.prompt_tokens_per_s,
                         totals.prompt_tokens_sq_per_s + obs.prompt_tokens_sq_per_s,
                         sum(variances) if variances else None, done)


async def read_gateway_totals(store: StateStore, now_wall_s: float, max_age_s: float = DEFAULT_MAX_AGE_S,
                              skipped: SkippedRecords | None = None) -> ObservationRead:
    """Read every observation record and sum it per model; a record of a newer release is logged through
    `skipped` (once per record and version; without one, on every read). Raises `StateStoreUnavailable`."""
    read = totals_by_model(await store.list_records(OBSERVATIONS_COLLECTION), now_wall_s, max_age_s)
    skipped = skipped or SkippedRecords(log)
    for record_id, exc in sorted(read.newer.items()):
        skipped.newer(OBSERVATIONS_COLLECTION, record_id, exc)
    return read
