"""The gateway's live view of replicas: who exists, who is healthy, how loaded each one is.

    registry static_replicas ─┐                           ┌─ kvgate backend: gRPC WatchState stream (load_readers.py)
    store.list_members() ─────┼─> TrackedReplica records ─┼─ vllm / sglang / member w/o gRPC: GET /metrics
       (every poll_interval_s)│   (one per replica,       └─ every replica: GET /health every health_interval_s
    gateway attempts/reports ─┘    tracked_replica.py)
                                        └──> view(model): frozen ReplicaStates for the policies

Replica ids: a static replica's id is its URL; a member's id is its membership record's replica_id.
Routable = a live member in state READY (static replicas always are), passing health checks, not
ejected, and not draining (by membership or by its own stream).

Membership is eventually consistent, and the data path must outlive the control path. A member that
leaves the list while READY (its heartbeat lapsed: the autoscaler crashed, restarts, fails over to a standby
after the lease TTL, or Redis restarted empty) stays tracked, and routable whenever it is, for up to
`member_grace_s` or until it is listed again; Envoy treats hosts that leave service discovery the same way.
A failed health check or an ejection takes it out of rotation as it would a listed replica; it is dropped
after UNLISTED_DROP_AFTER_CHECKS failed checks in a row (a replica that is gone). A member that leaves while
STARTING or DRAINING is dropped at once: the autoscaler marks a replica DRAINING before it stops it on
scale-down, and publishes one it takes out for good without a drain (a replica that failed, a preempted or
deleted node, one its provider no longer lists) DRAINING once more and lets that record lapse. An unreachable
store changes nothing: the last known members and the static replicas stay, the poll goes on every
`poll_interval_s`, and each failed poll logs one WARNING line naming the store and the error (a gateway started
before its Redis says so once a second, not with a traceback); the first poll that works logs one INFO line.

Ejection (passive): `eject_after_failures` failures reported in a row eject a replica for
`eject_for_s`; after that it stays out until a health check passes (the probe), then takes traffic
again. A failing health check marks a replica unhealthy at once; a passing one marks it healthy.

All state is changed synchronously on the event loop; background tasks only await I/O and then call
the synchronous `_apply_*` methods, so no await ever happens half-way through a change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping

import aiohttp

from kvgate.clock import Clock
from kvgate.state.base import MemberRecord, StateStore, StateStoreError
from kvgate.state.outage import Outage
from kvgate.state.base import ReplicaState as MemberState
from kvgate.registry.schema import Backend
from kvgate.registry.snapshot import Snapshot
from kvgate.router.block_index import BlockIndexes
from kvgate.router.engine_tokenizers import EngineTokenizers, KvChain
from kvgate.router.features import CharsPerToken
from kvgate.router.prefix_index import PrefixIndexes
from kvgate.router.load_readers import LoadReport, parse_metrics, replica_url, watch_stream
from kvgate.router.tracked_replica import REPLICA_STATES, AttemptLease, TrackedReplica
from kvgate.router.upstream import header_safe
from kvgate.router.view import InFlightChains, ReplicaView

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE_TOKENS = 16
# A member kept after its membership record lapsed is dropped after this many failed health checks in a row
# (~6 s at the default 2 s interval): one slow check, under load, must not drop a replica nothing re-adds.
UNLISTED_DROP_AFTER_CHECKS = 3


def bearer_from_env(variable: str, url: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """`Bearer <key>` from the environment variable a static replica names, or None with a warning when it is
    unset, empty or not a printable ASCII token (a line break in it would split the request's head)."""
    key = environ.get(variable, "").strip()
    if not key or not header_safe(key):
        log.warning("replica %s: environment variable %s %s; sending it no API key", url, variable,
                    "is not set" if not key else "does not hold a printable ASCII key")
        return None
    return f"Bearer {key}"


class ReplicaTracker:
    """Tracks static and member replicas of every registry model; see the module docstring.

    Each replica's prefix index counts in its model's `routing.prefix_chunk_chars` (the size requests
    are cut at), so capacities and `correct()` rounding match the hashes; `prefix_chunk_chars` is only
    the fallback for a replica whose model the registry does not (or no longer) declare."""

    def __init__(self, *, clock: Clock, store: StateStore | None = None, http: aiohttp.ClientSession | None = None,
                 poll_interval_s: float = 1.0, health_interval_s: float = 2.0, eject_after_failures: int = 3,
                 eject_for_s: float = 10.0, prefix_chunk_chars: int = 256, member_grace_s: float = 600.0) -> None:
        self._clock = clock
        self._store = store
        self._http = http
        self._owns_http = http is None
        self._poll_interval_s = poll_interval_s
        self._health_interval_s = health_interval_s
        self._eject_after_failures = eject_after_failures
        self._eject_for_s = eject_for_s
        self._member_grace_s = member_grace_s
        self._default_chunk_chars = prefix_chunk_chars
        self.prefixes = PrefixIndexes(prefix_chunk_chars)
        self.blocks = BlockIndexes()  # exact, from kvgate engines' KV block events
        self.in_flight_chains = InFlightChains()  # the prefix chains of requests in flight, per replica
        self.tokenizers = EngineTokenizers(clock, self._engines_of, self._source_of)  # per model: its KvChain
        self._chars_per_token: dict[str, CharsPerToken] = {}  # per model, learnt from responses
        self._replicas: dict[str, TrackedReplica] = {}
        self._sorted_by_model: dict[str, tuple[TrackedReplica, ...]] = {}  # cleared when a replica comes or goes
        self._snapshot: Snapshot | None = None
        self._started = False
        self._closed = False
        self._member_task: asyncio.Task[None] | None = None
        self._store_outage = Outage()  # failed membership polls in a row
        self._changed = asyncio.Event()

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
        wanted: dict[str, tuple[str, Backend, str | None, str | None]] = {}
        for name, doc in snapshot.models.items():
            for static in doc.spec.routing.static_replicas:
                wanted[static.url] = (name, static.backend, static.grpc_target, static.api_key_env)
        for replica_id, tracked in list(self._replicas.items()):
            if tracked.member_state is None and replica_id not in wanted:
                self._drop(replica_id)
        for url, (model, backend, grpc_target, api_key_env) in wanted.items():
            self._upsert(url, model, url, backend, grpc_target, None)
            self._replicas[url].authorization = bearer_from_env(api_key_env, url) if api_key_env else None
        for tracked in self._replicas.values():
            tracked.block_size_tokens, tracked.max_loaded_adapters, tracked.prefix_chunk_chars = (
                self._model_knobs(tracked.model))
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
                      predict_blocks: bool = False) -> AttemptLease:
        """Count one attempt at the replica until the lease's `end`: one more in flight, `prefill_tokens`
        (its uncached prompt) pending until `prefilled`, its prefix chain in flight (what makes a prefix
        hot), and with `predict_blocks` its chain as the replica's predicted KV blocks. An unknown id (a
        replica that just left) counts nothing."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return AttemptLease(None, None, None, prefix_hashes, 0)
        tracked.in_flight += 1
        tracked.pending_prefill_tokens += prefill_tokens
        chains = self.in_flight_chains.add(replica_id, prefix_hashes)
        blocks = self.blocks.predict(replica_id, prefix_hashes) if predict_blocks else None
        return AttemptLease(tracked, chains, blocks, prefix_hashes, prefill_tokens)

    def chars_per_token_of(self, model: str) -> float:
        """The model's learnt prompt characters per token (features.CharsPerToken)."""
        estimate = self._chars_per_token.get(model)
        return estimate.value if estimate is not None else CharsPerToken().value

    def learn_prompt_size(self, model: str, prompt_chars: int, prompt_tokens: int) -> None:
        """A response reported `prompt_tokens` for a canonical prompt of `prompt_chars`; the model's
        replicas' index capacities follow the new estimate at their next load report."""
        self._chars_per_token.setdefault(model, CharsPerToken()).observe(prompt_chars, prompt_tokens)

    def report_success(self, replica_id: str) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is not None:
            tracked.consecutive_failures = 0

    def report_failure(self, replica_id: str) -> None:
        """A request failed there (connect error, 5xx before the first byte). The Nth in a row ejects."""
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        tracked.consecutive_failures += 1
        if tracked.consecutive_failures >= self._eject_after_failures and tracked.ejected_until is None:
            tracked.ejected_until = self._clock.now() + self._eject_for_s
            log.warning("replica %s ejected for %.1f s after %d failures in a row", replica_id,
                        self._eject_for_s, tracked.consecutive_failures)
            self._notify()

    # ------------------------------------------------------------------------------ bookkeeping

    def _model_knobs(self, model: str) -> tuple[int, int, int]:
        """(block_size_tokens, max_loaded_adapters, prefix_chunk_chars) of a model."""
        doc = self._snapshot.models.get(model) if self._snapshot is not None else None
        if doc is None:
            return DEFAULT_BLOCK_SIZE_TOKENS, 0, self._default_chunk_chars
        return (doc.spec.engine.block_size_tokens, doc.spec.engine.max_loaded_adapters,
                doc.spec.routing.prefix_chunk_chars)

    def _ensure_index(self, tracked: TrackedReplica) -> None:
        """Create or resize the replica's prefix index to its KV capacity in its model's chunks (none for a
        server that says it keeps no prefix cache)."""
        self.prefixes.ensure(tracked.replica_id, tracked.load.kv_blocks_total,
                             tracked.load.block_size_tokens or tracked.block_size_tokens, tracked.prefix_chunk_chars,
                             self.chars_per_token_of(tracked.model), caches=tracked.load.prefix_caching is not False)

    def _notify(self) -> None:
        """Wake every wait_for_replica; they re-check and wait on a fresh event."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _upsert(self, replica_id: str, model: str, url: str, backend: Backend, grpc_target: str | None,
                member_state: MemberState | None) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is not None and tracked.source_key == (url, backend, grpc_target) and tracked.model == model:
            if tracked.member_state != member_state:
                tracked.member_state = member_state
                self._notify()
            return
        if tracked is not None:
            self._drop(replica_id)
        block_size, max_adapters, chunk_chars = self._model_knobs(model)
        tracked = TrackedReplica(replica_id, model, url.rstrip("/"), backend, grpc_target, member_state,
                           block_size, max_adapters, chunk_chars)
        self._replicas[replica_id] = tracked
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
        rid = tracked.replica_id
        if tracked.grpc_target:
            tracked.tasks.append(asyncio.create_task(watch_stream(
                tracked.grpc_target, self._clock, lambda report: self._apply_stream(rid, report),
                lambda: self.blocks.disconnected(rid), include_kv_events=True), name=f"kvgate-stream-{rid}"))
            self.tokenizers.want(tracked.model)
        elif tracked.backend is not Backend.OPENAI:
            # vllm, sglang, and members without a gRPC target (foreign backends) publish /metrics.
            tracked.tasks.append(asyncio.create_task(self._scrape_loop(tracked), name=f"kvgate-scrape-{rid}"))
        tracked.tasks.append(asyncio.create_task(self._health_loop(tracked), name=f"kvgate-health-{rid}"))

    # ------------------------------------------------------------------------------ membership

    async def _member_loop(self) -> None:
        while True:
            await self._clock.sleep(self._poll_interval_s)
            await self._poll_members()

    async def _poll_members(self) -> None:
        assert self._store is not None
        try:
            records = await self._store.list_members()
        except Exception as exc:  # keep the last known membership; the grace of unlisted members still runs
            self._store_outage.failed(self._clock.now())
            num_static = sum(1 for r in self._replicas.values() if r.member_state is None)
            what = (f"routing to {num_static} static and {len(self._replicas) - num_static} last known member "
                    f"replica(s), next try in {self._poll_interval_s:g} s")
            if isinstance(exc, StateStoreError):  # expected (Redis down, starting, restarting): one line, no trace
                log.warning("membership poll failed: %s; %s", exc, what)
            else:  # a bug: its traceback is what fixes it
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
        for record in records:
            seen.add(record.replica_id)
            backend = Backend.KVGATE if record.grpc_target else Backend.VLLM
            self._upsert(record.replica_id, record.model, record.url, backend, record.grpc_target, record.state)
            tracked = self._replicas[record.replica_id]
            if tracked.unlisted_since is not None:
                log.info("replica %s is listed again after %.1f s", record.replica_id,
                         self._clock.now() - tracked.unlisted_since)
                tracked.unlisted_since = None
        for replica_id, tracked in list(self._replicas.items()):
            if tracked.member_state is not None and replica_id not in seen:
                self._unlisted(tracked)

    def _unlisted(self, tracked: TrackedReplica) -> None:
        """A member missing from the membership list: kept while it was READY, is not draining, has not failed
        UNLISTED_DROP_AFTER_CHECKS health checks in a row and `member_grace_s` has not run out since it went
        missing; dropped otherwise (module docstring)."""
        now = self._clock.now()
        keep = (tracked.member_state is MemberState.READY and not tracked.draining
                and tracked.failed_checks < UNLISTED_DROP_AFTER_CHECKS)
        since = tracked.unlisted_since
        if since is None and keep and self._member_grace_s > 0:
            tracked.unlisted_since = now
            log.warning("replica %s left the membership list while serving; routing to it while its health "
                        "checks pass, for up to %.0f s", tracked.replica_id, self._member_grace_s)
            return
        if since is not None and keep and now - since < self._member_grace_s:
            return
        if since is not None:
            why = "grace over" if keep else "draining" if tracked.draining else (
                f"{tracked.failed_checks} failed health checks in a row")
            log.warning("replica %s dropped %.1f s after it left the membership list (%s)", tracked.replica_id,
                        now - since, why)
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
        was_routable = tracked.accepts_requests
        tracked.load = report
        tracked.num_ended_since_report = 0
        self._ensure_index(tracked)
        if tracked.accepts_requests != was_routable:
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

    def tokens_disagree(self, model: str, replica_id: str) -> None:
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

    async def _scrape_loop(self, tracked: TrackedReplica) -> None:
        while True:
            try:
                url = replica_url(tracked.url, "/metrics")
                async with self._http_session().get(url, timeout=self._timeout(),
                                                     headers=tracked.auth_headers()) as response:
                    text = await response.text() if response.status == 200 else None
                if text is not None:
                    self._apply_load(tracked.replica_id, parse_metrics(text))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the health check decides health; a failed scrape keeps the last load
                log.debug("scrape %s/metrics failed: %r", tracked.url, exc)
            await self._clock.sleep(self._poll_interval_s)

    async def _health_loop(self, tracked: TrackedReplica) -> None:
        while True:
            try:
                url = replica_url(tracked.url, "/health")
                async with self._http_session().get(url, timeout=self._timeout(),
                                                     headers=tracked.auth_headers()) as response:
                    ok = response.status == 200
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("health check %s failed: %r", tracked.url, exc)
                ok = False
            self._apply_health(tracked.replica_id, ok)
            await self._clock.sleep(self._health_interval_s)

    def _apply_health(self, replica_id: str, ok: bool) -> None:
        tracked = self._replicas.get(replica_id)
        if tracked is None:
            return
        before = tracked.accepts_requests
        tracked.failed_checks = 0 if ok else tracked.failed_checks + 1
        if ok and tracked.ejected_until is not None and self._clock.now() >= tracked.ejected_until:
            log.info("replica %s passed its probe after ejection", replica_id)
            tracked.ejected_until = None
            tracked.consecutive_failures = 0
        if tracked.unlisted_since is not None and tracked.failed_checks >= UNLISTED_DROP_AFTER_CHECKS:
            self._unlisted(tracked)  # nothing lists it and it stopped answering: gone
        elif tracked.accepts_requests != before:
            self._notify()

    def _http_session(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("ReplicaTracker used before start()")
        return self._http

    def _timeout(self) -> aiohttp.ClientTimeout:
        # A probe or scrape never outlives its interval: a stalled replica is marked, not waited on.
        return aiohttp.ClientTimeout(total=max(0.2, min(self._health_interval_s, self._poll_interval_s, 5.0)))
