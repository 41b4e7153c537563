"""Fair sharing of a saturated model: requests past what its replicas run at once wait at the gateway, in queues
per tenant and priority (`router.fair_queue` decides the order), and the lowest priority is shed first, before
its first byte, when its wait would break the model's TTFT SLO.

A model's capacity is what its ready replicas run at once (`ReplicaTracker.capacity`: the registry's
`max_in_flight_per_replica`, or what each has shown it runs): below it a request goes straight on, as without
fair sharing; at it, requests wait and each one that ends lets the next go. Sending more would not run more: the
replicas would queue them first come, first served, and one tenant offering five times the fleet would sit in
front of everyone else. Capacity is unknown (infinite) until every replica's is known, and while a model has no
ready replica (`queueing.WaitQueues` holds those requests).

Pacing. Places free in groups (requests that started together end together), and a tenant with a backlog would
take a whole group at once; the replicas would then prefill its requests together, in the steps a lighter tenant's
next request also waits for. So a tenant past its reservation (`router.fair_share`) starts a request only while
fewer than a steady stream's number are before their first token (capacity / mean hold x mean time to the first
token, Little's law) plus one; a tenant within its reservation is never paced. What it does for a light tenant's
tail: docs/benchmarks.md, Fair sharing.

Shedding. A waiting request is predicted to wait (requests ahead of it + 1) x the mean time a request holds its
place / capacity; one predicted past its budget is refused at once with 503 `model_overloaded` and Retry-After,
and one still waiting when its budget runs out is refused then. The budget is the model's `slo.ttft_ms` (else its
queue wait) less the mean time from a place granted to the first token, so that what waits and is served still
meets the SLO: a queue kept full to the whole SLO would serve every request just past it.
A higher priority goes ahead of everything lower, so the lowest priority's wait passes the budget first, and when
the queue is full an arrival takes the place of the last request of a lower priority. Each gateway holds its own
queues against the capacity it sees; N gateways share a model's replicas, so each keeps the load signal honest
only for what it sent (the replicas' reported queues still tell every gateway when they are saturated).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.clock import Clock
from kvgate.openai_wire import ApiError
from kvgate.router.errors import no_capacity
from kvgate.router.fair_queue import FairQueue, Flow, Ticket
from kvgate.router.fair_share import FairShares

HOLD_EWMA_ALPHA = 0.1  # weight of the newest hold time in the mean the wait prediction uses


@dataclass(frozen=True, eq=False)
class Permit:
    """A request's place among those the model runs; `FlowGate.leave` gives it back."""

    flow: Flow
    granted_at: float


def overloaded(model: str, wait_s: float, budget_s: float) -> ApiError:
    return no_capacity(f"model '{model}' is saturated: a request of this priority would wait about {wait_s:.1f} s "
                       f"for a replica, past the {budget_s:g} s it may; retry later", max(1.0, wait_s),
                       code="model_overloaded")


class FlowGate:
    """The fair queue of one model, on one event loop (no locks: no await between a check and its change)."""

    def __init__(self, model: str, clock: Clock, capacity: Callable[[], float],
                 on_change: Callable[[FlowGate], None] = lambda gate: None,
                 probes: Callable[[], int] = lambda: 0) -> None:
        self.model = model
        self._clock = clock
        self._capacity = capacity
        self._probes = probes  # how many of the capacity's places are probes (`router.capacity`)
        self._on_change = on_change
        self._queue = FairQueue()
        self.shares = FairShares()  # who runs and waits, and who may start next (router.fair_share)
        self._waiters: dict[Ticket, asyncio.Future[Permit]] = {}
        self.mean_hold_s: float | None = None
        self.mean_first_token_s: float | None = None  # from a place granted to the first token sent
        self.dispatched: dict[str, int] = {}  # per tenant, since start: each tenant's share of what was served
        self._before_first_token: set[Permit] = set()  # granted, no first token yet: prefilling (or queued) upstream

    @property
    def active(self) -> int:
        """Permits out: requests sent on and not yet ended."""
        return self.shares.running

    @property
    def depth(self) -> int:
        return len(self._queue)

    def depth_by_tenant(self) -> dict[str, int]:
        return self._queue.depth_by_tenant()

    async def enter(self, flow: Flow, budget_s: float, max_queued: int) -> Permit:
        """A place among the requests the model runs, at once or after a fair wait; raises ApiError 503
        (`model_overloaded`) when the wait would pass `budget_s` or the queue holds `max_queued` of this
        priority or higher."""
        arrived = self._clock.now()
        budget_s = max(0.0, budget_s - (self.mean_first_token_s or 0.0))  # what is left of it for waiting
        if len(self._queue) >= max_queued:
            self._make_room(flow, budget_s)
        ticket = self._queue.push(flow)
        self.shares.arrived(flow.tenant, flow.weight, arrived, flow.priority)
        waiter: asyncio.Future[Permit] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = waiter
        self.dispatch()
        if waiter.done():
            self._waiters.pop(ticket, None)
            return waiter.result()
        predicted = self._predicted_wait_s(self._queue.ahead_of(ticket))
        if predicted > budget_s:
            self._abandon(ticket, waiter)
            raise overloaded(self.model, predicted, budget_s)
        self._on_change(self)
        timer = asyncio.ensure_future(self._clock.sleep(budget_s))
        try:
            await asyncio.wait((waiter, timer), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went
            self._abandon(ticket, waiter)
            raise
        finally:
            timer.cancel()
            self._waiters.pop(ticket, None)
        if waiter.done():
            return waiter.result()  # granted, or shed to make room for a higher priority (raises)
        self._abandon(ticket, waiter)
        raise overloaded(self.model, self._clock.now() - arrived, budget_s)

    def first_token(self, permit: Permit, now: float) -> None:
        """The request sent its first token: how long that took once it had its place."""
        took_s = max(0.0, now - permit.granted_at)
        self.mean_first_token_s = took_s if self.mean_first_token_s is None else (
            (1 - HOLD_EWMA_ALPHA) * self.mean_first_token_s + HOLD_EWMA_ALPHA * took_s)
        if permit in self._before_first_token:
            self._before_first_token.discard(permit)
            self.dispatch()

    def leave(self, permit: Permit) -> None:
        """The request ended: its place goes to the next one waiting."""
        now = self._clock.now()
        self._before_first_token.discard(permit)
        self.shares.ended(permit.flow.tenant, now)
        held_s = max(0.0, now - permit.granted_at)
        self.mean_hold_s = held_s if self.mean_hold_s is None else (
            (1 - HOLD_EWMA_ALPHA) * self.mean_hold_s + HOLD_EWMA_ALPHA * held_s)
        self.dispatch()

    def dispatch(self) -> None:
        """Start as many waiting requests as may start (`FairShares.may_start`), in the fair queue's order:
        after a request arrives or ends, or when the capacity grew (a replica became ready, or showed it runs
        more)."""
        capacity, probes, now, changed = self._capacity(), self._probes(), self._clock.now(), False
        burst = self._start_burst(capacity)
        while len(self._queue):
            past = len(self._before_first_token) < burst  # may a tenant past its reservation start one now
            ticket = self._queue.pop(lambda flow: self.shares.may_start(flow.tenant, capacity, now, past, probes))
            if ticket is None:
                break
            self.shares.started(ticket.flow.tenant, now)
            self.dispatched[ticket.flow.tenant] = self.dispatched.get(ticket.flow.tenant, 0) + 1
            waiter = self._waiters.get(ticket)
            if waiter is None or waiter.done():  # nobody waits for it any more: the place goes back
                self.shares.ended(ticket.flow.tenant, now)
                continue
            permit = Permit(ticket.flow, now)
            self._before_first_token.add(permit)
            waiter.set_result(permit)
            changed = True
        if changed:
            self._on_change(self)

    def _start_burst(self, capacity: float) -> float:
        """How many requests may be before their first token at once, for those past their tenant's reservation:
        what a steady stream has there (Little: capacity / mean hold x mean time to the first token), plus one.
        Places free in groups (requests that started together end together), and one tenant's waiting
        requests would take a group at once and prefill together in the replicas, in the same steps as a lighter
        tenant's next request; started one or two at a time they fill the places as fast as they free on average.
        math.inf until both means are known."""
        if not math.isfinite(capacity) or not self.mean_hold_s or self.mean_first_token_s is None:
            return math.inf
        return math.ceil(capacity * self.mean_first_token_s / self.mean_hold_s) + 1

    def _abandon(self, ticket: Ticket, waiter: asyncio.Future[Permit]) -> None:
        """The request stopped waiting (its budget ran out, or its client went): out of the queue, or, if it
        was granted a place in the same instant, that place given back."""
        if self._queue.remove(ticket):
            self.shares.gave_up(ticket.flow.tenant, self._clock.now())
        elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self.leave(waiter.result())
        self._waiters.pop(ticket, None)
        self._on_change(self)

    def _make_room(self, flow: Flow, budget_s: float) -> None:
        """The queue is full: the last request of a lower priority is shed for `flow`, or `flow` is."""
        last = self._queue.last_of_lowest()
        if last is None or last.flow.priority >= flow.priority:
            raise overloaded(self.model, self._predicted_wait_s(len(self._queue)), budget_s)
        self._queue.remove(last)
        self.shares.gave_up(last.flow.tenant, self._clock.now())
        waiter = self._waiters.get(last)
        if waiter is not None and not waiter.done():
            waiter.set_exception(overloaded(self.model, self._predicted_wait_s(len(self._queue)), budget_s))

    def _predicted_wait_s(self, ahead: int) -> float:
        """(ahead + 1) x mean hold / capacity; 0 until a request has ended (nothing to predict from)."""
        capacity = self._capacity()
        if self.mean_hold_s is None or not math.isfinite(capacity) or capacity <= 0:
            return 0.0
        return (ahead + 1) * self.mean_hold_s / capacity


class FlowGates:
    """One `FlowGate` per model, made on first use."""

    def __init__(self, clock: Clock, capacity: Callable[[str], float],
                 on_change: Callable[[FlowGate], None] = lambda gate: None,
                 probes: Callable[[str], int] = lambda model: 0) -> None:
        self._clock = clock
        self._capacity = capacity
        self._probes = probes
        self._on_change = on_change
        self._gates: dict[str, FlowGate] = {}

    def gate(self, model: str) -> FlowGate:
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = FlowGate(model, self._clock, lambda: self._capacity(model), self._on_change,
                                                 lambda: self._probes(model))
        return gate

    def depth(self, model: str) -> int:
        gate = self._gates.get(model)
        return gate.depth if gate is not None else 0

    def dispatch_all(self) -> None:
        """A replica's capacity changed: every gate sends on what now fits."""
        for gate in self._gates.values():
            gate.dispatch()

    def gates(self) -> dict[str, FlowGate]:
        return dict(self._gates)


def fair_queue_stats(gate: FlowGate, capacity: float, now: float) -> dict[str, object]:
    """A gate as /admin/stats shows it: the capacity it holds to (None: unknown, nothing waits), what runs and
    waits and the places reserved per tenant, and each tenant's share of the requests sent on since start."""
    reserved = gate.shares.reservations(capacity, now) if math.isfinite(capacity) else {}
    total = sum(gate.dispatched.values()) or 1
    return {"capacity": capacity if math.isfinite(capacity) else None, "running": gate.active,
            "waiting": gate.depth, "mean_hold_s": gate.mean_hold_s,
            "tenants": {tenant: {"running": running, "waiting": waiting, "reserved": reserved.get(tenant)}
                        for tenant, (running, waiting) in sorted(gate.shares.tenants().items())},
            "dispatched_share": {tenant: n / total for tenant, n in sorted(gate.dispatched.items())}}
