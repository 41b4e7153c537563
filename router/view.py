"""What the policies see of the fleet: frozen replica states plus read-only prefix queries.

The shell builds a `ReplicaView` per decision from the latest replica snapshots (engine state stream
or scraped /metrics) and its own in-flight counts; policies never see anything mutable but the
`PrefixQuery` and `SharingQuery`, which they only read.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class AdapterFit(enum.IntEnum):
    """How well a replica suits a request's adapter; higher is better."""

    MUST_EVICT = 0  # every adapter slot is taken: loading it evicts another adapter (and stalls)
    FREE_SLOT = 1  # not loaded, but a slot is free: one load, nobody evicted
    LOADED = 2  # already in memory, or the request names no adapter


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router sees it at decision time."""

    replica_id: str
    url: str
    model: str  # base model it serves
    healthy: bool  # passes health checks and is not ejected
    draining: bool  # finishing its work before it stops: takes nothing new
    in_flight: int  # requests this gateway sent and that have not finished (fresh, counted at routing)
    num_waiting: int = 0  # engine-reported queue (all gateways; as old as the last snapshot)
    num_running: int = 0  # engine-reported running sequences (all gateways)
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0  # 0 when unknown (a foreign backend that reports no KV figures)
    block_size_tokens: int = 16
    adapters_loaded: frozenset[str] = frozenset()
    max_loaded_adapters: int = 0
    # This gateway's estimate of prompt tokens routed here and not yet prefilled (no first token yet),
    # after the replica's predicted cache hit: the prefill queued ahead of a new request.
    pending_prefill_tokens: int = 0
    # The requests this gateway keeps in flight here while the model is saturated (fair queuing: what the
    # replica runs at once, configured or learned, `router.capacity`); math.inf where unknown or not held.
    places: float = math.inf
    # One of those places is a probe (`router.capacity`): a request sent into it waits behind a full batch
    # unless the replica runs more than it has shown.
    probe: bool = False
    # Requests queued or running here: max(in_flight, num_waiting + num_running), set from those fields.
    # A max, not a sum: the gateway's own in-flight requests are also in the engine's counts once it has
    # seen them, so a sum counts them twice. `in_flight` is fresh (it rises the moment we route, so a
    # burst of 100 spreads), the engine's counts include other gateways' requests; the max takes the
    # larger, more complete of the two. 3 in flight here, engine says 2 waiting + 4 running -> 6.
    # A field, not a property: cache_aware reads it several times per replica per request.
    load: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "load", max(self.in_flight, self.num_waiting + self.num_running))

    def adapter_fit(self, adapter: str | None) -> AdapterFit:
        if adapter is None or adapter in self.adapters_loaded:
            return AdapterFit.LOADED
        if len(self.adapters_loaded) < self.max_loaded_adapters:
            return AdapterFit.FREE_SLOT
        return AdapterFit.MUST_EVICT

    @property
    def accepts_requests(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class CacheFill:
    """How full a replica's prefix cache is with what requests come back for, in the index's chunks: the
    chunks held that a later request sent there again (a system prompt, a conversation's history), out of
    all the chunks its KV cache holds."""

    reused_chunks: int
    capacity_chunks: int


class PrefixQuery(Protocol):
    """Read-only access to the prefix index: how many leading hashes of a chain `replica_id` holds, and
    how full its cache is with reused prefixes (None where the index cannot tell)."""

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int: ...

    def cache_fill(self, replica_id: str) -> CacheFill | None: ...


class NoPrefixes:
    """A PrefixQuery (and SharingQuery) that knows nothing: for policies that ignore prefixes, and for
    tests."""

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int:
        return 0

    def cache_fill(self, replica_id: str) -> CacheFill | None:
        return None

    def sharing(self, replica_id: str, chain_hash: int) -> int:
        return 0


class SharingQuery(Protocol):
    """Read-only: how many of the gateway's requests in flight at `replica_id` have `chain_hash` in
    their prefix chain."""

    def sharing(self, replica_id: str, chain_hash: int) -> int: ...


def count_down(counts: Counter[int], hashes: Iterable[int]) -> None:
    """Take one off each hash's count, dropping a hash whose count reaches 0 (so `len` stays the
    number of hashes still counted)."""
    for chain_hash in hashes:
        left = counts[chain_hash] - 1
        if left > 0:
            counts[chain_hash] = left
        else:
            counts.pop(chain_hash, None)


@dataclass(eq=False)
class ChainHold:
    """One request's chain counted at one replica by `InFlightChains.add`; `release` takes it off once.
    It holds the counts it was added to, not the replica id: after `forget_replica` (the replica left, or
    re-registered under the same id) a release touches only the forgotten counts, never those of requests
    sent to the new one."""

    counts: Counter[int]
    hashes: tuple[int, ...]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            count_down(self.counts, self.hashes)


class InFlightChains:
    """The prefix chains of the gateway's requests in flight, counted per replica and hash: how many
    requests in flight at a replica share a prefix (`sharing`), which tells a hot prompt (a burst of
    requests on one system prompt) from a conversation's own history. The shell adds a chain when it
    sends a request and releases the hold when the attempt ends."""

    def __init__(self) -> None:
        self._by_replica: dict[str, Counter[int]] = {}

    def add(self, replica_id: str, hashes: tuple[int, ...]) -> ChainHold:
        counts = self._by_replica.setdefault(replica_id, Counter())
        counts.update(hashes)
        return ChainHold(counts, hashes)

    def sharing(self, replica_id: str, chain_hash: int) -> int:
        counts = self._by_replica.get(replica_id)
        return counts.get(chain_hash, 0) if counts is not None else 0

    def num_hashes(self, replica_id: str) -> int:
        """Distinct hashes counted at `replica_id`: 0 once every request sent there has ended."""
        counts = self._by_replica.get(replica_id)
        return len(counts) if counts is not None else 0

    def forget_replica(self, replica_id: str) -> None:
        self._by_replica.pop(replica_id, None)


@dataclass(frozen=True)
class ReplicaView:
    """All replicas known to the gateway (every model), sorted by id, plus the prefix queries."""

    replicas: tuple[ReplicaState, ...]
    prefixes: PrefixQuery
    in_flight_chains: SharingQuery = NoPrefixes()

    @classmethod
    def of(cls, replicas: Iterable[ReplicaState], prefixes: PrefixQuery | None = None,
           in_flight_chains: SharingQuery | None = None) -> ReplicaView:
        """Sorts by replica id, so every decision is independent of the order states arrived in."""
        ordered = tuple(sorted(replicas, key=lambda r: r.replica_id))
        return cls(replicas=ordered, prefixes=prefixes if prefixes is not None else NoPrefixes(),
                   in_flight_chains=in_flight_chains if in_flight_chains is not None else NoPrefixes())

    def candidates(self, model: str) -> tuple[ReplicaState, ...]:
        """Replicas of `model` that take new requests (healthy and not draining, sorted by id), and of those,
        when any has a place free (`places`: fair queuing holds the model to what its replicas run), only
        those, and those with a place in the batch they have shown before those with only the probe place
        free. A request the fair queue let go was granted a place; sent where every place is taken, it would
        wait inside that replica behind whoever came first while another replica has room (the load bound
        alone allows it: 16 and 15 in flight of 16 each is within 1.25 x the mean)."""
        ready = tuple(r for r in self.replicas if r.model == model and r.accepts_requests)
        free = (tuple(r for r in ready if r.in_flight < r.places - r.probe)
                or tuple(r for r in ready if r.in_flight < r.places))
        return free if free and len(free) < len(ready) else ready

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int:
        return self.prefixes.match_length(replica_id, hashes)

    def sharing(self, replica_id: str, chain_hash: int) -> int:
        return self.in_flight_chains.sharing(replica_id, chain_hash)

    def cache_fill(self, replica_id: str) -> CacheFill | None:
        return self.prefixes.cache_fill(replica_id)
