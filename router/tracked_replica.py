"""One replica as the gateway tracks it (`TrackedReplica`), and what one attempt counts there until it ends
(`AttemptLease`). `router.replicas.ReplicaTracker` keeps the records; the view policies read is their
frozen `ReplicaState`. What decides membership and health is pure (`router.membership`, `router.health`):
a record hands it frozen values (`source`, `standing`, `health`) and takes back the result."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.state.base import ReplicaState as MemberState
from kvgate.registry.schema import Backend
from kvgate.router.block_index import BlockIndex
from kvgate.router.capacity import RunCeiling
from kvgate.router.health import Health
from kvgate.router.load_readers import LoadReport
from kvgate.router.membership import ReplicaSource, Standing
from kvgate.router.view import ChainHold, ReplicaState

REPLICA_STATES = ("ready", "unlisted", "starting", "draining", "unhealthy")  # TrackedReplica.routing_state


@dataclass
class TrackedReplica:
    """Mutable record of one replica; only `ReplicaTracker` changes it (and an attempt's `AttemptLease`)."""

    replica_id: str  # public: the response header, metric labels, /admin/stats (router.membership)
    model: str
    url: str = field(repr=False)  # where the proxy connects; may hold credentials, so never shown as it is
    backend: Backend
    grpc_target: str | None
    member_state: MemberState | None  # None: a static replica from the registry
    block_size_tokens: int
    max_loaded_adapters: int
    prefix_chunk_chars: int  # the model's routing.prefix_chunk_chars: the cut its prefix index counts in
    holds_places: bool = False  # the model's routing.fair_queueing: its state carries `places`
    places_per_replica: int | None = None  # the model's routing.max_in_flight_per_replica
    load: LoadReport = field(default_factory=LoadReport)
    ceiling: RunCeiling = field(default_factory=RunCeiling)  # what it has shown it runs at once (router.capacity)
    in_flight: int = 0
    pending_prefill_tokens: int = 0  # see ReplicaState.pending_prefill_tokens
    # Requests this gateway finished there since the last load report: that report still counts them
    # (an engine sends a snapshot at most every ~50 ms), so they come off its waiting + running until
    # the next one. Without it, sequential requests see a phantom load of 1 on the replica that just
    # served them and the load bound pushes a prefix hit elsewhere.
    num_ended_since_report: int = 0
    authorization: str | None = field(default=None, repr=False)  # the Authorization value the replica asks for
    health: Health = field(default_factory=Health)  # health checks and ejection (router.health)
    unlisted_since: float | None = None  # a READY member missing from the membership list since (clock)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    check_now: asyncio.Event = field(default_factory=asyncio.Event)  # set: its health loop checks at once
    # The attempts in flight there, told when it stops answering its health checks (`AttemptLease.unresponsive`).
    leases: set[AttemptLease] = field(default_factory=set, repr=False, compare=False)
    # The ReplicaState last built, until a field changes (__setattr__ drops it): every request's view
    # reads each replica of its model, and all but the one or two it touched are as they were. At 64
    # replicas, building them all anew took 230 us per request (loadtests/bench_routing_decision.py).
    _state: ReplicaState | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name != "_state":
            object.__setattr__(self, "_state", None)

    def source(self) -> ReplicaSource:
        """What it was tracked as, for `membership.upsert`."""
        return ReplicaSource(self.replica_id, self.model, self.url, self.backend, self.grpc_target, self.member_state)

    def standing(self) -> Standing:
        """What `membership.judge_unlisted` decides on."""
        return Standing(self.member_state, self.draining, self.health.failed_checks, self.unlisted_since)

    @property
    def healthy(self) -> bool:
        return self.health.in_rotation and self.member_state in (None, MemberState.READY, MemberState.DRAINING)

    @property
    def draining(self) -> bool:
        return self.load.draining or self.member_state is MemberState.DRAINING

    @property
    def accepts_requests(self) -> bool:
        """`state().accepts_requests` without building the state (asked per request by `kv_chain`)."""
        return self.healthy and not self.draining

    @property
    def routing_state(self) -> str:
        """One of REPLICA_STATES, for `kvgate_router_replicas`: "starting" (a member not yet READY), "draining",
        "unhealthy" (failing health checks, or ejected), "unlisted" (routable, though its membership record
        lapsed) or "ready"."""
        if self.member_state is MemberState.STARTING:
            return "starting"
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        return "ready" if self.unlisted_since is None else "unlisted"

    @property
    def places(self) -> float:
        """The requests this gateway keeps in flight here while the model is saturated (`ReplicaState.places`):
        the registry's max_in_flight_per_replica, else what it has shown it runs (`router.capacity`)."""
        if not self.holds_places:
            return math.inf
        return float(self.places_per_replica) if self.places_per_replica is not None else self.ceiling.capacity()

    def auth_headers(self) -> dict[str, str] | None:
        """The headers its health checks and scrapes send: its Authorization, if it asks for one."""
        return {"Authorization": self.authorization} if self.authorization else None

    def state(self) -> ReplicaState:
        if self._state is None:
            self._state = self._build_state()
        return self._state

    def _build_state(self) -> ReplicaState:
        healthy, draining = self.healthy, self.draining
        ended = self.num_ended_since_report
        num_running = max(self.load.num_running - ended, 0)  # what ended was running, or else waiting
        num_waiting = max(self.load.num_waiting - max(ended - self.load.num_running, 0), 0)
        return ReplicaState(
            replica_id=self.replica_id, url=self.url, model=self.model, healthy=healthy, draining=draining,
            in_flight=self.in_flight, num_waiting=num_waiting, num_running=num_running,
            pending_prefill_tokens=self.pending_prefill_tokens,
            kv_blocks_free=self.load.kv_blocks_free, kv_blocks_total=self.load.kv_blocks_total,
            block_size_tokens=self.load.block_size_tokens or self.block_size_tokens,
            adapters_loaded=self.load.adapters_loaded, max_loaded_adapters=self.max_loaded_adapters,
            places=self.places, probe=bool(self.holds_places and self.places_per_replica is None
                                           and self.ceiling.probe()))


class AttemptLease:
    """What one attempt counts at its replica (`ReplicaTracker.start_attempt`), taken off once each.

    It holds the replica's record and indexes as they were when the attempt started, not its id: when
    the replica is re-registered under the same id meanwhile (a member restarted on a new port, a
    static replica's backend changed), the new record starts from zero and this attempt's end takes
    nothing from the requests counted there since.

    Until it ends, the lease is in its record's `leases`, so the tracker can tell the attempt that the
    replica stopped answering its health checks (`when_unresponsive`)."""

    def __init__(self, tracked: TrackedReplica | None, chains: ChainHold | None, blocks: BlockIndex | None,
                 prefix_hashes: tuple[int, ...], prefill_tokens: int, num_sequences: int = 1) -> None:
        self._tracked, self._chains, self._blocks = tracked, chains, blocks
        self._num_sequences = num_sequences
        self._hashes, self._prefill_tokens = prefix_hashes, prefill_tokens
        self._prefilled = self._ended = False
        self._told: float | None = None  # the last `unresponsive(silent_for_s)` heard, if any
        self._on_unresponsive: Callable[[float], object] | None = None
        if tracked is not None:
            tracked.leases.add(self)

    def when_unresponsive(self, callback: Callable[[float], object]) -> None:
        """Call `callback(silent_for_s)` each time the tracker finds the replica not answering its health checks
        while the lease lasts (at once if it already has): the proxy then gives up on the attempt if it heard
        nothing from the replica for `silent_for_s` (`upstream.Interrupt.fire_if_silent`), instead of waiting
        out its first-byte or idle timeout on a frozen replica. One callback; a second replaces the first."""
        self._on_unresponsive = callback
        if self._told is not None:
            callback(self._told)

    def unresponsive(self, silent_for_s: float) -> None:
        """The replica is not answering its health checks (`router.health.unresponsive`); the tracker calls this
        for each lease in flight there at each such check. Nothing after `end`."""
        if self._ended:
            return
        self._told = silent_for_s
        if self._on_unresponsive is not None:
            self._on_unresponsive(silent_for_s)

    def prefilled(self) -> None:
        """The first token came (or the attempt ended without one): its prompt no longer waits."""
        if self._prefilled:
            return
        self._prefilled = True
        if self._tracked is not None:
            self._tracked.pending_prefill_tokens = max(0, self._tracked.pending_prefill_tokens - self._prefill_tokens)

    def end(self) -> None:
        """The attempt is over: no longer in flight, its chain no longer shared there, and its predicted
        blocks retire at the replica's second report from now (block_index)."""
        if self._ended:
            return
        self._ended = True
        self._on_unresponsive = None
        self.prefilled()
        if self._tracked is not None:
            self._tracked.leases.discard(self)
            self._tracked.in_flight = max(0, self._tracked.in_flight - self._num_sequences)
            self._tracked.num_ended_since_report += self._num_sequences
        if self._chains is not None:
            self._chains.release()
        if self._blocks is not None:
            self._blocks.retire(self._hashes)
