"""The gateway's live view of replicas: who exists, who is healthy, how loaded each one is.

    registry static_replicas ─┐                           ┌─ kvgate backend: gRPC WatchState stream (load_readers.py)
    store.list_members() ─────┼─> TrackedReplica records ─┼─ vllm / sglang / member w/o gRPC: GET /metrics
       (every poll_interval_s)│   (one per replica,       └─ every replica: GET /health every health_interval_s
    gateway attempts/reports ─┘    tracked_replica.py)     (probes.py)
                                        └──> view(model): frozen ReplicaStates for the policies

Replica ids: a static replica's is "<model>-static-<n>", a member's its membership record's replica_id; both
are public (response header, metrics, /admin/stats), the URL is not (`router.membership`). Log lines name a
replica by its id, or by its `public_url`.
Routable = a live member in state READY (static replicas always are), passing health checks, not
ejected, and not draining (by membership or by its own stream).

The tracker is the shell: it reads the registry, the store and the probes, and acts on pure decisions:
`router.membership` says which replicas exist and when a member that left the list is dropped,
`router.health` when a replica is ejected and readmitted. An unreachable store changes nothing: the last
known members and the static replicas stay, the poll goes on every `poll_interval_s`, and each failed poll
logs one WARNING line naming the store and the error (a gateway started before its Redis says so once a
second, not with a traceback); the first poll that works logs one INFO line.

All state is changed synchronously on the event loop; background tasks only await I/O and then call
the synchronous `_apply_*` methods, so no await ever happens half-way through a change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from kvgate.clock import Clock, sleep_or_wake
from kvgate.state.base import MemberRecord, StateStore, StateStoreError, raise_if_cancelled
from kvgate.state.base import ReplicaState as MemberState
from kvgate.state.outage import Outage
from kvgate.registry.schema import Backend
from kvgate.registry.snapshot import Snapshot
from kvgate.router.block_index import BlockIndex, BlockIndexes
from kvgate.router.engine_tokenizers import EngineTokenizers, KvChain
from kvgate.router.features import CharsPerToken, RouteRequest
from kvgate.router.outcomes import Answer, Learnt, text_chain
from kvgate.router.prefix_index import PrefixIndex, PrefixIndexes
from kvgate.router.health import (Ejection, after_check, after_request, newly_ejected, newly_unresponsive, readmitted,
                                  unresponsive)
from kvgate.router.capacity import RunCeiling, model_capacity, model_probes
from kvgate.router.load_readers import LoadReport, watch_stream
from kvgate.router.membership import (ModelKnobs, ReplicaSource, Unlisted, Upsert, drop_reason, judge_unlisted,
                                      member_sources, model_knobs, public_url, static_sources, upsert)
from kvgate.router.probes import HttpTarget, health_loop, scrape_loop
from kvgate.router.tracked_replica import REPLICA_STATES, AttemptLease, TrackedReplica
from kvgate.router.upstream import header_safe
from kvgate.router.view import InFlightChains, ReplicaView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerSettings:
    """The tracker's knobs."""

    poll_interval_s: float = 1.0  # membership polls and /metrics scrapes
    health_interval_s: float = 2.0  # GET /health of every replica
    eject_after_failures: int = 3  # requests failed in a row that eject a replica (router.health)
    eject_for_s: float = 10.0  # ... for this long, then until a health check passes
    # Health checks in a row without an answer (a frozen or dead process) that end the requests in flight
    # there (router.health): retried elsewhere before their first byte, an SSE error event after it. One such
    # check already takes the replica out of rotation; two spare the streams a single slow answer.
    interrupt_after_unanswered_checks: int = 2
    # ... but only the requests that heard nothing from the replica (no byte since the request went) for this
    # long, checked again at each unanswered check: a replica that still delivers is never cut off, however late
    # its /health answers (a busy event loop, a GC pause). Each check takes at most interval + probe_timeout_s,
    # and a frozen replica's requests are silent since the freeze, so they end within
    # max(2 x (2 s + 1 s), 5 s + 2 s + 1 s) = 8 s of it with the defaults (7 s with checks every 1 s), instead
    # of at the 120 s first-byte or 60 s idle timeout.
    interrupt_after_silent_s: float = 5.0
    prefix_chunk_chars: int = 256  # the prefix index's cut for a replica whose model the registry does not declare
    member_grace_s: float = 600.0  # how long a READY member that left the membership list is kept (router.membership)

    @property
    def ejection(self) -> Ejection:
        return Ejection(self.eject_after_failures, self.eject_for_s)

    @property
    def probe_timeout_s(self) -> float:
        """A probe or scrape never outlives its interval: a stalled replica is marked, not waited on."""
        return max(0.2, min(self.health_interval_s, self.poll_interval_s, 5.0))


def bearer_from_env(variable: str, replica: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """`Bearer <key>` from the environment variable a static replica names, or None with a warning (naming
    the replica as `replica` says) when it is unset, empty or not a printable ASCII token (a line break in it
    would split the request's head)."""
    key = environ.get(variable, "").strip()
    if not key or not header_safe(key):
        log.warning("replica %s: environment variable %s %s; sending it no API key", replica, variable,
                    "is not set" if not key else "does not hold a printable ASCII key")
        return None
    return f"Bearer {key}"


class ReplicaTracker:
    """Tracks static and member replicas of every registry model; see the module docstring.

    Each replica's prefix index counts in its model's `routing.prefix_chunk_chars` (the size requests
    are cut at), so capacities and `correct()` rounding match the hashes; `settings.prefix_chunk_chars` is
    only the fallback for a replica whose model the registry does not (or no longer) declare."""

    def __init__(self, *, clock: Clock, store: StateStore | None = None, http: aiohttp.ClientSession | None = None,
                 settings: TrackerSettings = TrackerSettings()) -> None:
        self._clock = clock
        self._store = store
        self._http = http
        self._owns_http = http is None
        self._settings = settings
        self.prefixes = PrefixIndexes(settings.prefix_chunk_chars)
        self.blocks = BlockIndexes()  # exact, from kvgate engines' KV block events
        self.in_flight_chains = InFlightChains()  # the prefix chains of requests in flight, per replica
        self.tokenizers = EngineTokenizers(clock, self._engines_of, self._source_of)  # per model: its KvChain
        self._chars_per_token: dict[str, CharsPerToken] = {}  # per model, learnt from responses
        self._replicas: dict[str, TrackedReplica] = {}
        self._sorted_by_model: dict[str, tuple[TrackedReplica, ...]] = {}  # cleared when a replica comes or goes
        self._snapshot: Snapshot | None = None
        self._listeners: list[Callable[[], None]] = []
        self._started = False
        self._closed = False
        self._member_task: asyncio.Task[None] | None = None
        self._store_outage = Outage()  # failed membership polls in a row
        self._changed = asyncio.Event()
        self._poll_soon = asyncio.Event()  # set by poll_members_soon: the member loop polls without waiting

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self, snapshot: Snapshot) -> None:
        """Track the snapshot's static replicas and, with a store, its members (first poll done before
        returning, so members are in the view at once). Call once."""
        if self._started:
            raise RuntimeError("ReplicaTracker.start called twice")
        self._started = True
        if self._http is None:
            self._http = aiohttp.ClientSession()
        self.update_registry(snapshot)
        if self._store is not None:
            await self._poll_members()
            self._member_task = asyncio.create_task(self._member_loop(), name="kvgate-members")

    def update_registry(self, snapshot: Snapshot) -> None:
        """Hot reload: add and remove static replicas, refresh per-model knobs. Idempotent."""
        self._snapshot = snapshot
        wanted = static_sources(snapshot)
        for replica_id, tracked in list(self._replicas.items()):
            if tracked.member_state is None and replica_id not in wanted:
                self._drop(replica_id)
        for replica_id, source in wanted.items():
            self._upsert(source)
            self._replicas[replica_id].authorization = (
                bearer_from_env(source.api_key_env, f"{replica_id} ({public_url(source.url)})")
                if source.api_key_env else None)
        for tracked in self._replicas.values():
            knobs = self._model_knobs(tracked.model)
            tracked.block_size_tokens, tracked.max_loaded_adapters, tracked.prefix_chunk_chars = (
                knobs.block_size_tokens, knobs.max_loaded_adapters, knobs.prefix_chunk_chars)
            tracked.holds_places, tracked.places_per_replica = knobs.holds_places, knobs.places_per_replica
            self._ensure_index(tracked)
        self.tokenizers.after_reload()
        self._notify()

    async def close(self) -> None:
        """Cancel every background task and close the HTTP session if the tracker made it. Idempotent."""
        self._closed = True
        tasks = [t for r in self._replicas.values() for t in r.tasks] + self.tokenizers.tasks()
        if self._member_task is not None:
            tasks.append(self._member_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for tracked in self._replicas.values():
            tracked.tasks.clear()
        if self._owns_http and self._http is not None:
            await self._http.close()
            self._http = None

    # ------------------------------------------------------------------------------------ the view

    def view(self, model: str, blocks: bool = False) -> ReplicaView:
        """Every known replica of `model` (routable or not), with `self.prefixes` as prefix query, or
        `self.blocks` when `blocks` (a request whose chain is KV blocks, see `kv_chain`)."""
        return ReplicaView(tuple(r.state() for r in self._of_model(model)), self.blocks if blocks else self.prefixes,
                           self.in_flight_chains)

    def _of_model(self, model: str) -> tuple[TrackedReplica, ...]:
        """The records of `model`'s replicas, sorted by id as ReplicaView wants them."""
        records = self._sorted_by_model.get(model)
        if records is None:
            records = tuple(sorted((r for r in self._replicas.values() if r.model == model),
                                   key=lambda r: r.replica_id))
            self._sorted_by_model[model] = records
        return records

    def kv_chain(self, model: str) -> KvChain | None:
        """The KV chain to route `model`'s requests on, or None to route them on text: one of its engines
        sent its tokenizer, at least one routable replica streams its KV block events (synced), and every
        routable replica is a kvgate engine (a gRPC stream) in the engines' block size. An engine whose
        stream is down meanwhile counts as holding nothing (it is likely dying: its health check or a
        failed request takes it out), rather than sending the whole model back to a text index that was
        not kept while it routed on blocks. A fleet that mixes in a foreign server is routed on text."""
        chain = self.tokenizers.get(model)
        if chain is None:
            return None
        synced = False
        for tracked in self._replicas.values():
            if tracked.model != model or not tracked.accepts_requests:
                continue
            if not tracked.grpc_target:
                return None
            if self.blocks.is_synced(tracked.replica_id):
                if tracked.load.block_size_tokens != chain.block_size_tokens:
                    return None
                synced = True
        return chain if synced else None

    def replica_ids(self) -> frozenset[str]:
        """Every replica tracked now, of every model, routable or not."""
        return frozenset(self._replicas)

    def num_ready(self, model: str) -> int:
        """Replicas of `model` that take requests now."""
        return sum(1 for r in self._replicas.values() if r.model == model and r.accepts_requests)

    def capacity(self, model: str) -> float:
        """Requests `model`'s ready replicas run at once (`router.capacity`); math.inf while unknown."""
        return model_capacity(self._ready_ceilings(model), self._per_replica(model))

    def probes(self, model: str) -> int:
        """How many of `capacity`'s places are probes (`router.capacity`)."""
        return model_probes(self._ready_ceilings(model), self._per_replica(model))

    def _ready_ceilings(self, model: str) -> list[RunCeiling]:
        return [r.ceiling for r in self._of_model(model) if r.accepts_requests]

    def _per_replica(self, model: str) -> int | None:
        knobs = self._snapshot.models.get(model) if self._snapshot is not None else None
        return knobs.spec.routing.max_in_flight_per_replica if knobs is not None else None

    def url(self, replica_id: str) -> str:
        """Base URL of a tracked replica; raises KeyError for an unknown one."""
        return self._replicas[replica_id].url

    def authorization(self, replica_id: str) -> str | None:
        """The Authorization header value to send the replica (its `api_key_env`), or None."""
        tracked = self._replicas.get(replica_id)
        return tracked.authorization if tracked is not None else None

    def prefix_caching(self, replica_id: str) -> str:
        """Whether the replica keeps what it computes, for operators (/admin/stats): "off" where it says
        so (vLLM's enable_prefix_caching="False"), "not_observed" where its responses have stopped
        realising predicted hits (`PrefixIndex.caches`: a server that caches nothing but does not say),
        else "on". "unknown" for a replica not tracked."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return "unknown"
        if tracked.load.prefix_caching is False:
            return "off"
        index = self.prefixes.get(replica_id)
        return "not_observed" if index is not None and not index.caches() else "on"

    def cache_index(self, replica_id: str) -> tuple[BlockIndex | PrefixIndex | None, bool]:
        """(what the gateway knows of the replica's cache, whether it is exact): its KV-block index once that is
        synced with the engine's events, else the text index of what it was sent; (None, False) if neither."""
        blocks = self.blocks.get(replica_id)
        if blocks is not None and blocks.synced:
            return blocks, True
        return self.prefixes.get(replica_id), False

    async def wait_for_replica(self, model: str, timeout_s: float) -> bool:
        """True as soon as `model` has a routable replica; False after `timeout_s` (on the clock)."""
        deadline = self._clock.now() + timeout_s
        while not self.num_ready(model):
            remaining = deadline - self._clock.now()
            if remaining <= 0 or self._closed:
                return False
            changed = asyncio.ensure_future(self._changed.wait())
            timer = asyncio.ensure_future(self._clock.sleep(remaining))
            try:
                await asyncio.wait((changed, timer), return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                timer.cancel()
        return True

    # ------------------------------------------------------------------ the gateway's own signals

    def start_attempt(self, replica_id: str, prefix_hashes: tuple[int, ...], prefill_tokens: int = 0,
                      predict_blocks: bool = False, num_sequences: int = 1) -> AttemptLease:
        """Count one attempt at the replica until the lease's `end`: `num_sequences` more in flight (a request
        with n = 4 decodes four sequences there), `prefill_tokens`
        (its uncached prompt) pending until `prefilled`, its prefix chain in flight (what makes a prefix
        hot), and with `predict_blocks` its chain as the replica's predicted KV blocks. An unknown id (a
        replica that just left) counts nothing."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return AttemptLease(None, None, None, prefix_hashes, 0)
        tracked.in_flight += num_sequences
        tracked.pending_prefill_tokens += prefill_tokens
        chains = self.in_flight_chains.add(replica_id, prefix_hashes)
        blocks = self.blocks.predict(replica_id, prefix_hashes) if predict_blocks else None
        return AttemptLease(tracked, chains, blocks, prefix_hashes, prefill_tokens, num_sequences)

    def chars_per_token_of(self, model: str) -> float:
        """The model's learnt prompt characters per token (features.CharsPerToken)."""
        estimate = self._chars_per_token.get(model)
        return estimate.value if estimate is not None else CharsPerToken().value

    def _learn_prompt_size(self, model: str, prompt_chars: int, prompt_tokens: int) -> None:
        """A response reported `prompt_tokens` for a canonical prompt of `prompt_chars`; the model's
        replicas' index capacities follow the new estimate at their next load report."""
        self._chars_per_token.setdefault(model, CharsPerToken()).observe(prompt_chars, prompt_tokens)

    def record_sent(self, replica_id: str, route: RouteRequest) -> None:
        """`route`'s request goes to the replica: its text index records the chain (`outcomes.text_chain`)."""
        self.prefixes.record(replica_id, text_chain(route))

    def learn(self, replica_id: str, answer: Answer) -> Learnt:
        """Learn from the replica's answer (`router.outcomes`): the model's characters per token first, a
        tokenizer that counts otherwise, then predicted vs realised cached tokens into the replica's index
        (on KV blocks only tallied: the replica's events keep that index right)."""
        model = answer.route.model
        if answer.teaches_prompt_size and answer.prompt_tokens is not None:
            self._learn_prompt_size(model, answer.route.num_prompt_chars, answer.prompt_tokens)
        if answer.tokens_disagree:
            self._tokens_disagree(model, replica_id)
        lesson = answer.lesson(self.chars_per_token_of(model))
        if lesson.cached_tokens is None:
            return Learnt(lesson)
        if answer.route.hash_tokens:
            self.blocks.tally(replica_id, lesson.predicted_tokens, lesson.cached_tokens)
            return Learnt(lesson)
        return Learnt(lesson, self.prefixes.learn(replica_id, answer.route.prefix_hashes, lesson.predicted_chunks,
                                                  lesson.cached_tokens, lesson.chars_per_token))

    def report_success(self, replica_id: str) -> None:
        """A request there got its first byte: its run of failures ends."""
        self._apply_request(replica_id, True)

    def report_failure(self, replica_id: str) -> None:
        """A request failed there (connect error, 5xx before the first byte). The Nth in a row ejects."""
        self._apply_request(replica_id, False)

    def _apply_request(self, replica_id: str, ok: bool) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        before = tracked.health
        tracked.health = after_request(before, ok, self._clock.now(), self._settings.ejection)
        if newly_ejected(before, tracked.health):
            log.warning("replica %s ejected for %.1f s after %d failures in a row", replica_id,
                        self._settings.eject_for_s, tracked.health.consecutive_failures)
            self._notify()

    # ------------------------------------------------------------------------------ bookkeeping

    def _model_knobs(self, model: str) -> ModelKnobs:
        return model_knobs(self._snapshot, model, self._settings.prefix_chunk_chars)

    def _ensure_index(self, tracked: TrackedReplica) -> None:
        """Create or resize the replica's prefix index to its KV capacity in its model's chunks (none for a
        server that says it keeps no prefix cache)."""
        self.prefixes.ensure(tracked.replica_id, tracked.load.kv_blocks_total,
                             tracked.load.block_size_tokens or tracked.block_size_tokens, tracked.prefix_chunk_chars,
                             self.chars_per_token_of(tracked.model), caches=tracked.load.prefix_caching is not False)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever a replica becomes routable or not, or shows it runs more (its capacity)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        """Wake every wait_for_replica; they re-check and wait on a fresh event. Tell the listeners."""
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self._listeners:
            listener()

    def _upsert(self, source: ReplicaSource) -> None:
        """Track `source` as `membership.upsert` says: as it is, with a new state, or as a new record."""
        tracked = self._replicas.get(source.replica_id)
        change = upsert(tracked.source() if tracked is not None else None, source)
        if change is Upsert.KEEP:
            return
        if tracked is not None and change is Upsert.STATE:
            was_starting = tracked.member_state is MemberState.STARTING
            tracked.member_state = source.member_state
            if was_starting and source.member_state is MemberState.READY:
                # Its health checks failed while it loaded (nothing listened yet); the autoscaler has just seen
                # /health pass, so check again now rather than keep it out of rotation until the next check.
                tracked.check_now.set()
            self._notify()
            return
        if tracked is not None:
            self._drop(source.replica_id)
        knobs = self._model_knobs(source.model)
        tracked = TrackedReplica(source.replica_id, source.model, source.url, source.backend,
                                 source.grpc_target, source.member_state, knobs.block_size_tokens,
                                 knobs.max_loaded_adapters, knobs.prefix_chunk_chars, knobs.holds_places,
                                 knobs.places_per_replica)
        self._replicas[source.replica_id] = tracked
        self._sorted_by_model.clear()
        self._ensure_index(tracked)
        self._start_readers(tracked)
        self._notify()

    def _drop(self, replica_id: str) -> None:
        tracked = self._replicas.pop(replica_id, None)
        if tracked is None:
            return
        self._sorted_by_model.clear()
        for task in tracked.tasks:
            task.cancel()
        self.prefixes.forget_replica(replica_id)
        self.blocks.forget_replica(replica_id)
        self.in_flight_chains.forget_replica(replica_id)
        self._notify()

    def _start_readers(self, tracked: TrackedReplica) -> None:
        """Its load reader (gRPC stream, /metrics scrape, or none for an openai server) and health checks."""
        rid = tracked.replica_id
        target = HttpTarget(tracked.url, self._http_session, tracked.auth_headers, self._settings.probe_timeout_s,
                            name=rid)
        if tracked.grpc_target:
            tracked.tasks.append(asyncio.create_task(watch_stream(
                tracked.grpc_target, self._clock, lambda report: self._apply_stream(rid, report),
                lambda: self.blocks.disconnected(rid), include_kv_events=True), name=f"kvgate-stream-{rid}"))
            self.tokenizers.want(tracked.model)
        elif tracked.backend is not Backend.OPENAI:
            # vllm, sglang, and members without a gRPC target (foreign backends) publish /metrics.
            tracked.tasks.append(asyncio.create_task(scrape_loop(
                target, self._clock, self._settings.poll_interval_s, lambda report: self._apply_load(rid, report)),
                name=f"kvgate-scrape-{rid}"))
        tracked.tasks.append(asyncio.create_task(health_loop(
            target, self._clock, self._settings.health_interval_s, lambda ok: self._apply_health(rid, ok),
            lambda: self._apply_health(rid, False, answered=False), check_now=tracked.check_now),
            name=f"kvgate-health-{rid}"))

    # ------------------------------------------------------------------------------ membership

    def poll_members_soon(self) -> None:
        """Read membership now rather than at the next poll: the store said a member changed (`kvgate up`'s
        in-memory store does; Redis gateways poll)."""
        self._poll_soon.set()

    async def _member_loop(self) -> None:
        while True:
            await sleep_or_wake(self._clock, self._settings.poll_interval_s, self._poll_soon)
            self._poll_soon.clear()
            await self._poll_members()
            raise_if_cancelled()

    async def _poll_members(self) -> None:
        assert self._store is not None
        try:
            records = await self._store.list_members()
        except Exception as exc:  # keep the last known membership; the grace of unlisted members still runs
            note = self._store_outage.failed(self._clock.now())  # None: said less than a minute ago
            num_static = sum(1 for r in self._replicas.values() if r.member_state is None)
            what = (f"routing to {num_static} static and {len(self._replicas) - num_static} last known member "
                    f"replica(s), next try in {self._settings.poll_interval_s:g} s{note}")
            if note is not None and isinstance(exc, StateStoreError):  # expected (Redis down, restarting): no trace
                log.warning("membership poll failed: %s; %s", exc, what)
            elif note is not None:  # a bug: its traceback is what fixes it
                log.exception("membership poll failed unexpectedly; %s", what)
            for tracked in [r for r in self._replicas.values() if r.unlisted_since is not None]:
                self._unlisted(tracked)
            return
        recovered = self._store_outage.recovered(self._clock.now())
        if recovered is not None:
            log.info("membership poll works again %s; %d member(s) listed", recovered, len(records))
        self._apply_members(records)

    def _apply_members(self, records: list[MemberRecord]) -> None:
        seen = set()
        for source in member_sources(records):
            seen.add(source.replica_id)
            self._upsert(source)
            tracked = self._replicas[source.replica_id]
            if tracked.unlisted_since is not None:
                log.info("replica %s is listed again after %.1f s", source.replica_id,
                         self._clock.now() - tracked.unlisted_since)
                tracked.unlisted_since = None
        for replica_id, tracked in list(self._replicas.items()):
            if tracked.member_state is not None and replica_id not in seen:
                self._unlisted(tracked)

    def _unlisted(self, tracked: TrackedReplica) -> None:
        """A member missing from the membership list: kept or dropped as `membership.judge_unlisted` says."""
        now, grace_s, standing = self._clock.now(), self._settings.member_grace_s, tracked.standing()
        verdict = judge_unlisted(standing, now, grace_s)
        if verdict is Unlisted.KEEP:
            return
        if verdict is Unlisted.START_GRACE:
            tracked.unlisted_since = now
            log.warning("replica %s left the membership list while serving; routing to it while its health "
                        "checks pass, for up to %.0f s", tracked.replica_id, grace_s)
            return
        if standing.unlisted_since is not None:
            log.warning("replica %s dropped %.1f s after it left the membership list (%s)", tracked.replica_id,
                        now - standing.unlisted_since, drop_reason(standing))
        self._drop(tracked.replica_id)

    def replica_counts(self) -> dict[tuple[str, str], int]:
        """(model, state) -> replicas, for `kvgate_router_replicas`, one state each (`routing_state`). Every
        registry model has every state, 0 included, so that an alert on ready == 0 finds a series when it
        matters."""
        models = set(self._snapshot.models) if self._snapshot is not None else set()
        counts = {(model, state): 0 for model in models for state in REPLICA_STATES}
        for tracked in self._replicas.values():
            key = (tracked.model, tracked.routing_state)
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def store_reachable(self) -> bool:
        """False while membership polls fail to reach the state store (True without a store)."""
        return not self._store_outage.ongoing

    def unlisted_for_s(self, replica_id: str) -> float | None:
        """How long a member has been kept since it left the membership list; None when it is listed (or
        static, or unknown)."""
        tracked = self._replicas.get(replica_id)
        if tracked is None or tracked.unlisted_since is None:
            return None
        return self._clock.now() - tracked.unlisted_since

    # ------------------------------------------------------------------------------ state readers

    def _apply_load(self, replica_id: str, report: LoadReport) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        was_routable, capacity = tracked.accepts_requests, tracked.ceiling.capacity()
        tracked.load = report
        tracked.ceiling = tracked.ceiling.seen(report, self._clock.now())
        tracked.num_ended_since_report = 0
        self._ensure_index(tracked)
        if tracked.accepts_requests != was_routable or tracked.ceiling.capacity() != capacity:
            self._notify()

    def _apply_stream(self, replica_id: str, report: LoadReport) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        previous = tracked.load
        if previous.process_start_unix_ns and report.process_start_unix_ns != previous.process_start_unix_ns:
            self.prefixes.forget_replica(replica_id)  # restarted: its KV cache is empty
        elif report.process_start_unix_ns == previous.process_start_unix_ns and report.seq <= previous.seq:
            return  # an older snapshot than one already applied
        self.blocks.apply(replica_id, report.kv_events, report.kv_blocks_total)
        self._apply_load(replica_id, report)

    # ------------------------------------------------------------------------------ tokenizers

    def _tokens_disagree(self, model: str, replica_id: str) -> None:
        """A response's usage.prompt_tokens differed from the gateway's count for a prompt routed on KV
        blocks: the model routes on text until its tokenizer is fetched again (`EngineTokenizers.disagree`)."""
        tracked = self._replicas.get(replica_id)
        if self.tokenizers.disagree(model, prefer=tracked.grpc_target if tracked else None):
            log.warning("model %s: replica %s counted a prompt differently from this gateway's tokenizer; "
                        "routing on text until its tokenizer is fetched again", model, replica_id)

    def _engines_of(self, model: str) -> list[str]:
        """The gRPC targets of the model's kvgate engines, in the order they were tracked."""
        return [r.grpc_target for r in self._replicas.values() if r.model == model and r.grpc_target]

    def _source_of(self, model: str) -> str:
        doc = self._snapshot.models.get(model) if self._snapshot is not None else None
        return doc.spec.source if doc is not None else ""

    def _apply_health(self, replica_id: str, ok: bool, answered: bool = True) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        before, was_routable = tracked.health, tracked.accepts_requests
        tracked.health = after_check(before, ok, self._clock.now(), answered)
        if readmitted(before, tracked.health):
            log.info("replica %s passed its probe after ejection", replica_id)
        if unresponsive(tracked.health, self._settings.interrupt_after_unanswered_checks):
            self._interrupt_attempts(tracked, newly_unresponsive(
                before, tracked.health, self._settings.interrupt_after_unanswered_checks))
        if tracked.standing().gone:
            self._unlisted(tracked)  # nothing lists it and it stopped answering: gone
        elif tracked.accepts_requests != was_routable:
            self._notify()

    def _interrupt_attempts(self, tracked: TrackedReplica, first: bool) -> None:
        """Tell every attempt in flight at a replica that is not answering its health checks, at each such check:
        the proxy gives up on those that heard nothing from it for `interrupt_after_silent_s` (retried elsewhere
        or their stream ended), so one that stalls later is caught at a later check. One line per silence
        (`first`), only when there were some."""
        leases = list(tracked.leases)
        silent_for_s = self._settings.interrupt_after_silent_s
        if leases and first:
            log.warning("replica %s answered none of its last %d health checks: giving up on those of the %d "
                        "request(s) in flight there that heard nothing from it for %g s", tracked.replica_id,
                        tracked.health.unanswered_checks, len(leases), silent_for_s)
        for lease in leases:
            lease.unresponsive(silent_for_s)

    def _http_session(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("ReplicaTracker used before start()")
        return self._http
