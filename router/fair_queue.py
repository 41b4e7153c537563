"""Who goes next while a model is saturated: strict priority bands, and weighted fair queuing between the tenants
of a band. No I/O and no clock: `router.flow_control` is the shell that waits on it.

Within a band each request gets a virtual finish tag when it arrives, `max(band's virtual time, its tenant's last
tag) + 1 / weight`, and the smallest tag goes next (self-clocked fair queuing: the band's virtual time is the tag
of the request last sent on). A tenant that sends a burst gets tags far ahead, so a tenant that sends one request
now and then finds its tag at the band's virtual time and goes before the burst's rest: each tenant gets the
share its weight says of what the band is served, however much more it offers. A higher band always goes first
(llm-d's flow control and the Gateway API Inference Extension use the same bands); an empty band forgets its
tags, so a tenant idle for a while starts even again.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Flow:
    """Whose a request is: its tenant, the priority it was given and the tenant's weight."""

    tenant: str
    priority: int = 0
    weight: float = 1.0


@dataclass(eq=False)
class Ticket:
    """One waiting request. Compared by identity; `tag` then `seq` order it within its band."""

    flow: Flow
    seq: int
    tag: float = 0.0
    live: bool = field(default=True, repr=False)


@dataclass
class _Band:
    virtual: float = 0.0
    last_tag: dict[str, float] = field(default_factory=dict)
    # Each tenant's waiting requests: their tags only grow, so each queue is in the order it is served.
    queues: dict[str, collections.deque[Ticket]] = field(default_factory=dict)
    live: int = 0


class FairQueue:
    """The waiting requests of one model."""

    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()
        self._depth: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(band.live for band in self._bands.values())

    def push(self, flow: Flow) -> Ticket:
        band = self._bands.setdefault(flow.priority, _Band())
        start = max(band.virtual, band.last_tag.get(flow.tenant, 0.0))
        ticket = Ticket(flow, next(self._seq), start + 1.0 / flow.weight)
        band.last_tag[flow.tenant] = ticket.tag
        band.queues.setdefault(flow.tenant, collections.deque()).append(ticket)
        band.live += 1
        self._depth[flow.tenant] = self._depth.get(flow.tenant, 0) + 1
        return ticket

    def pop(self, eligible: Callable[[Flow], bool] = lambda flow: True) -> Ticket | None:
        """The next request to send on (highest band, smallest tag) among those whose flow is `eligible`, or
        None when none such waits. A band whose tenants are all ineligible lets a lower band's go."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            heads = [queue[0] for queue in map(self._live_queue, band.queues.values()) if queue]
            chosen = min((t for t in heads if eligible(t.flow)), key=lambda t: (t.tag, t.seq), default=None)
            if chosen is not None:
                band.virtual = chosen.tag
                band.queues[chosen.flow.tenant].popleft()
                self._forget(chosen, band, priority)
                return chosen
        return None

    def remove(self, ticket: Ticket) -> bool:
        """Take a waiting request out (its client went, or it was shed); False if it was not waiting."""
        band = self._bands.get(ticket.flow.priority)
        if not ticket.live or band is None:
            return False
        self._forget(ticket, band, ticket.flow.priority)  # left in its queue, skipped when it reaches the head
        return True

    def ahead_of(self, ticket: Ticket) -> int:
        """Requests that go before `ticket` as things stand: all of the higher bands, the smaller tags of its own."""
        ahead = 0
        for priority, band in self._bands.items():
            if priority > ticket.flow.priority:
                ahead += band.live
            elif priority == ticket.flow.priority:
                ahead += sum(1 for queue in band.queues.values() for other in queue
                             if other.live and (other.tag, other.seq) < (ticket.tag, ticket.seq))
        return ahead

    def last_of_lowest(self) -> Ticket | None:
        """The request that would go last: the largest tag of the lowest band (shed first to make room)."""
        for priority in sorted(self._bands):
            tails = [next((t for t in reversed(queue) if t.live), None)
                     for queue in self._bands[priority].queues.values()]
            live = [t for t in tails if t is not None]
            if live:
                return max(live, key=lambda t: (t.tag, t.seq))
        return None

    def depth_by_tenant(self) -> dict[str, int]:
        return dict(self._depth)

    @staticmethod
    def _live_queue(queue: collections.deque[Ticket]) -> collections.deque[Ticket]:
        """`queue` with the removed requests at its head dropped."""
        while queue and not queue[0].live:
            queue.popleft()
        return queue

    def _forget(self, ticket: Ticket, band: _Band, priority: int) -> None:
        ticket.live = False
        band.live -= 1
        left = self._depth[ticket.flow.tenant] - 1
        if left:
            self._depth[ticket.flow.tenant] = left
        else:
            del self._depth[ticket.flow.tenant]
            band.queues.pop(ticket.flow.tenant, None)  # none of its requests waits: nothing left to keep
        if band.live == 0:  # empty: its tags and its virtual time start again
            del self._bands[priority]
