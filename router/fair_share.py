"""Which tenant may start a request on a saturated model: max-min fair shares of its capacity, reserved for each
tenant up to what it has recently needed. Pure: time comes in as arguments (`router.flow_control` is the shell).

Ordering alone (`router.fair_queue`) is not enough to keep a light tenant's time to first token as it is on an
idle fleet: when a heavy tenant fills every place, the light one's next request waits for one to free up, however
fair the order. So each active tenant has a reservation: the smaller of its fair share of the capacity
(capacity x its weight / the weights of the active tenants at its priority or above) and its recent peak demand
plus one (the room for its next request). A request may start when its tenant is under its reservation, or when
the places nobody of its priority or above has reserved (capacity - what those other tenants' reservations hold
back - what runs) have room: a higher priority never waits for what is held back for a lower one. A tenant alone has the whole
capacity; a heavy tenant beside a light one gets everything the light one's peak leaves, which is the price of
the light one never waiting: places held back for a peak stand idle between peaks.

Demand is requests running plus waiting. Its peak decays slowly while the tenant is active (half every
ACTIVE_HALF_LIFE_S: a reservation that shrank between a light tenant's bursts would let a heavy one take the places
the next burst needs, and, places being held until their requests end, the burst would wait for them) and fast
once it has nothing running or waiting (half every IDLE_HALF_LIFE_S), and a tenant whose peak has decayed below
half a request, with nothing running or waiting, is forgotten (so the records stay bounded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVE_HALF_LIFE_S = 300.0
IDLE_HALF_LIFE_S = 10.0
FORGET_BELOW = 0.5


@dataclass
class _Tenant:
    weight: float
    priority: int = 0  # of its latest request
    running: int = 0
    waiting: int = 0
    peak: float = 0.0
    peak_at: float = 0.0


class FairShares:
    """The running and waiting requests of each tenant of one model, and who may start next."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self.running = 0

    def arrived(self, tenant: str, weight: float, now: float, priority: int = 0) -> None:
        record = self._tenants.setdefault(tenant, _Tenant(weight))
        record.weight, record.priority = weight, priority
        record.waiting += 1
        self._note(record, now)

    def gave_up(self, tenant: str, now: float) -> None:
        """A waiting request left without starting (shed, or its client went)."""
        record = self._tenants[tenant]
        record.waiting -= 1
        self._note(record, now)

    def started(self, tenant: str, now: float) -> None:
        record = self._tenants[tenant]
        record.waiting -= 1
        record.running += 1
        self.running += 1
        self._note(record, now)

    def ended(self, tenant: str, now: float) -> None:
        record = self._tenants[tenant]
        record.running -= 1
        self.running -= 1
        self._note(record, now)

    def may_start(self, tenant: str, capacity: float, now: float, past_reservation: bool = True,
                  probes: int = 0) -> bool:
        """Whether a request of `tenant` (arrived) may start now within `capacity` (math.inf: always); with
        `past_reservation` False, only into a place reserved for it (the gate is pacing those past theirs).
        `probes` of the capacity are places offered to learn whether a replica runs more (`router.capacity`):
        only a tenant past its reservation takes one, and reservations are shares of the rest. A request in a
        probe place waits behind a full batch unless the replica does run more; given to a light tenant's
        request, that wait was its tail (`loadtests/bench_fair_share.py`, chat: quiet p99 1.40x alone)."""
        if self.running >= capacity:
            return False
        if not math.isfinite(capacity):
            return True
        shown = capacity - probes
        reserved = self.reservations(shown, now)
        own = self._tenants[tenant]
        if own.running < reserved[tenant]:
            return self.running < shown
        if not past_reservation:
            return False
        held_back = sum(max(0.0, reserved[name] - record.running) for name, record in self._tenants.items()
                        if name != tenant and record.priority >= own.priority)
        # Places held back are places of the shown batch: while any is, the probes stay empty (a request sent on
        # would run in a held-back place, the view preferring those, and the tenant it was held for would wait).
        return self.running + held_back < (shown if held_back > 0 else capacity)

    def reservations(self, capacity: float, now: float) -> dict[str, float]:
        """Each active tenant's reservation: min(its fair share, peak demand + 1), its fair share being
        capacity x its weight / the weights of the active tenants at its priority or above."""
        self._forget_idle(now)
        records = self._tenants.values()
        return {name: min(capacity * record.weight / sum(other.weight for other in records
                                                           if other.priority >= record.priority),
                          self._peak(record, now) + 1)
                for name, record in self._tenants.items()}

    def tenants(self) -> dict[str, tuple[int, int]]:
        """(running, waiting) of each tenant known now."""
        return {name: (record.running, record.waiting) for name, record in self._tenants.items()}

    def _note(self, record: _Tenant, now: float) -> None:
        record.peak = max(record.running + record.waiting, self._peak(record, now))
        record.peak_at = now

    @staticmethod
    def _peak(record: _Tenant, now: float) -> float:
        half_life = ACTIVE_HALF_LIFE_S if record.running or record.waiting else IDLE_HALF_LIFE_S
        return record.peak * 0.5 ** (max(0.0, now - record.peak_at) / half_life)

    def _forget_idle(self, now: float) -> None:
        idle = [name for name, record in self._tenants.items()
                if not record.running and not record.waiting and self._peak(record, now) < FORGET_BELOW]
        for name in idle:
            del self._tenants[name]
