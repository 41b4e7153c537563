"""The replica-state stream: the engine's side of `proto/kvgate/v1/replica.proto`.

    worker thread                          event loop                          one WatchState stream
    AsyncLLM.on_stats(stats)  --call_soon_threadsafe-->  every subscriber: changed.set()
    AsyncLLM.on_kv_events(ev) --call_soon_threadsafe-->  every subscriber: pending += ev --> next snapshot

The worker only hands values over, so a slow or stuck subscriber never delays an engine step. Each
stream is paced on its own (`next_send_at`):

* The first snapshot goes out at once.
* After a change (stats, KV events, `notify_changed()`), the next snapshot goes out `min_interval`
  after the previous one (default 50 ms); changes in between fold into it: gauges take their latest
  value, KV events accumulate. A wake-up whose snapshot would show nothing new (the engine's own
  counters moved, none of the fields on the wire did) sends nothing.
* With no change, a heartbeat goes out `max_interval` after the previous snapshot (default 250 ms).

KV events (a stream with include_kv_events, on an engine created with EngineConfig.enable_kv_events):
the first snapshot starts with `all_cleared`, then ONE `stored` event holding every cached block hash
(read on the worker between steps, see AsyncLLM.cached_block_hashes), then the events recorded since the
stream subscribed. That bulk `stored` event has no parent and an empty adapter: it is set membership
only (each hash already covers its parent chain and adapter), not a chain. Events that happened just
before the bulk read may repeat what it holds; subscribers apply events as set updates, in order.
Each stream buffers at most `max_pending_kv_hashes` hashes between two sends; a stream that falls
further behind (its client reads too slowly) drops its buffer and is resynced: its next snapshot starts
again with all_cleared + a fresh bulk snapshot. A resync is a full cache dump in one message: with ~10
bytes per hash, 400k cached blocks reach gRPC's default 4 MiB receive limit of the client.

An engine created without enable_kv_events records no events; a stream that asks for them then gets
snapshots without any (no all_cleared either), and the replica logs a warning saying so.

GetTokenizer answers the tokenizer files of the engine's model directory (kvgate.tokenizer.TOKENIZER_FILES
that are present) and its block size, so that a gateway hashes prompts into the same block chain. The
files are read once, when the service starts (right after the engine loaded its tokenizer from them), and
the same answer is sent for the life of the process: a later change on disk would not change what the
engine tokenizes with either. Without a tokenizer.json there (or with a file that cannot be read) the
service still serves the state stream; GetTokenizer then fails with FAILED_PRECONDITION.

`seq` counts the snapshots this service produces, GetState included, so run one service per process.
Pacing uses the event loop's monotonic clock (the only clock asyncio timeouts know); the wall-clock
fields on the wire come from the injected `now_ns`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvgate.engine.async_llm import AsyncLLM, EngineDead
from kvgate.engine.block_manager import BlockStored, KVEvent
from kvgate.engine.core import EngineStats
from kvgate.tokenizer import TOKENIZER_FILES
from kvgate.v1 import replica_pb2, replica_pb2_grpc

log = logging.getLogger("kvgate.engine.state")

DEFAULT_MIN_INTERVAL_MS = 50  # coalescing: at most 20 snapshots/s per stream
DEFAULT_MAX_INTERVAL_MS = 250  # heartbeat: a silent stream for 1 s is 4 missed heartbeats
# Per stream, KV hashes buffered between two sends before the stream is resynced instead: 65_536
# hashes are ~0.5 MiB, about 4k prompts of 256 tokens (16 blocks each) committed within one interval.
DEFAULT_MAX_PENDING_KV_HASHES = 65_536


# ------------------------------------------------------------------------------------ pure parts


@dataclass(frozen=True)
class StreamIntervals:
    """How one stream is paced, in seconds."""

    min_s: float  # coalescing: at most one snapshot per this long
    max_s: float  # heartbeat: at least one snapshot per this long


def stream_intervals(request: replica_pb2.WatchStateRequest) -> StreamIntervals:
    """The request's intervals, 0 meaning the defaults; a heartbeat below min_interval is raised to it
    (min 100 ms, max 0 -> 0.1 s and 0.25 s; min 500 ms, max 0 -> 0.5 s and 0.5 s)."""
    min_ms = request.min_interval_ms or DEFAULT_MIN_INTERVAL_MS
    max_ms = max(request.max_interval_ms or DEFAULT_MAX_INTERVAL_MS, min_ms)
    return StreamIntervals(min_ms / 1000, max_ms / 1000)


def next_send_at(last_sent_s: float, changed: bool, intervals: StreamIntervals) -> float:
    """When a stream sends its next snapshot: min_s after the last one if something changed since,
    else max_s after it (last sent at 10.0, min 0.05, max 0.25: changed -> 10.05, idle -> 10.25).
    `last_sent_s` is -inf before the first snapshot, which is due at once."""
    return last_sent_s + (intervals.min_s if changed else intervals.max_s)


def content_key(stats: EngineStats, draining: bool) -> tuple[object, ...]:
    """The fields of a snapshot that a subscriber sees; equal keys mean nothing new to send."""
    return (stats.num_waiting, stats.num_running, stats.num_kv_blocks_free, stats.num_kv_blocks_total,
            stats.block_size_tokens, stats.adapters_loaded, stats.prefix_queried_tokens_total,
            stats.prefix_hit_tokens_total, draining)


def kv_event_to_proto(event: KVEvent) -> replica_pb2.KvBlockEvent:
    if isinstance(event, BlockStored):
        return replica_pb2.KvBlockEvent(stored=replica_pb2.KvBlocksStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_hash,
            adapter=event.adapter or "", block_size_tokens=event.block_size))
    return replica_pb2.KvBlockEvent(removed=replica_pb2.KvBlocksRemoved(block_hashes=event.block_hashes))


def resync_events(cached_hashes: Sequence[int], block_size: int) -> list[replica_pb2.KvBlockEvent]:
    """all_cleared, then one parentless `stored` event with every cached hash (none if the cache is
    empty): what a subscriber rebuilds its copy of the cache from."""
    events = [replica_pb2.KvBlockEvent(all_cleared=replica_pb2.KvBlocksAllCleared())]
    if cached_hashes:
        events.append(replica_pb2.KvBlockEvent(stored=replica_pb2.KvBlocksStored(
            block_hashes=cached_hashes, block_size_tokens=block_size)))
    return events


class TokenizerFilesUnavailable(Exception):
    """The model directory's tokenizer files cannot be served; the message says which file and why."""


def read_tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The contents of each of TOKENIZER_FILES present in `model_dir`, by file name. Raises
    TokenizerFilesUnavailable when tokenizer.json is missing or a present file cannot be read: sending
    the rest would let a gateway build a different tokenizer (e.g. other EOS ids) without knowing it."""
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            files[name] = path.read_bytes()
        except OSError as exc:
            raise TokenizerFilesUnavailable(f"{path}: cannot be read: {exc}") from exc
    if "tokenizer.json" not in files:
        raise TokenizerFilesUnavailable(f"{model_dir / 'tokenizer.json'}: missing; this replica has no "
                                        "tokenizer to send, so a gateway cannot hash prompts for it")
    return files


# ----------------------------------------------------------------------------------- subscribers


class Subscriber:
    """The mailbox of one WatchState stream. Event-loop thread only. Public for stand-ins that speak this
    protocol (loadtests/sim_state.py)."""

    def __init__(self, include_kv_events: bool, max_pending_kv_hashes: int) -> None:
        self.include_kv_events = include_kv_events
        self.max_pending_kv_hashes = max_pending_kv_hashes
        self.changed = asyncio.Event()  # set by every change, cleared when a snapshot is built
        self.needs_resync = include_kv_events  # the first snapshot is a resync
        self.closed = False
        self._pending: list[KVEvent] = []
        self._num_pending_hashes = 0

    def add_kv_events(self, events: Iterable[KVEvent]) -> None:
        """Buffer events for the next snapshot; past the bound, drop them all and resync instead."""
        if not self.include_kv_events:
            return
        for event in events:
            self._pending.append(event)
            self._num_pending_hashes += len(event.block_hashes)
        if self._num_pending_hashes > self.max_pending_kv_hashes:
            log.warning("a state stream fell behind by %d KV block hashes (at most %d); resyncing it",
                        self._num_pending_hashes, self.max_pending_kv_hashes)
            self._pending.clear()
            self._num_pending_hashes = 0
            self.needs_resync = True
        self.changed.set()

    def take_kv_events(self) -> list[KVEvent]:
        events, self._pending, self._num_pending_hashes = self._pending, [], 0
        return events

    def close(self) -> None:
        self.closed = True
        self.changed.set()


# -------------------------------------------------------------------------------------- servicer


@dataclass(frozen=True)
class _Identity:
    replica_id: str
    model: str
    process_start_unix_ns: int


class _ReplicaServicer(replica_pb2_grpc.ReplicaServicer):
    def __init__(self, engine: AsyncLLM, identity: _Identity, is_draining: Callable[[], bool],
                 now_ns: Callable[[], int], max_pending_kv_hashes: int,
                 tokenizer_files: Mapping[str, bytes] | TokenizerFilesUnavailable) -> None:
        """`tokenizer_files`: what read_tokenizer_files returned for the engine's model directory, or
        the error it raised (then GetTokenizer fails with its message)."""
        self._engine = engine
        self._identity = identity
        self._is_draining = is_draining
        self._now_ns = now_ns
        self._max_pending_kv_hashes = max_pending_kv_hashes
        self._seq = itertools.count(1)
        self._subscribers: set[Subscriber] = set()
        self._loop = asyncio.get_running_loop()
        self._kv_events_enabled = engine.core.config.enable_kv_events  # frozen config: safe to read
        # Built once: every call serializes this same message (~9 MB for Llama 3); disk is not read again.
        self._tokenizer: replica_pb2.TokenizerFiles | TokenizerFilesUnavailable = (
            tokenizer_files if isinstance(tokenizer_files, TokenizerFilesUnavailable)
            else replica_pb2.TokenizerFiles(files=tokenizer_files,
                                            block_size_tokens=engine.core.config.block_size))
        self._unsubscribe = [engine.on_stats(self._stats_changed_threadsafe),
                             engine.on_kv_events(self._kv_events_threadsafe)]

    # --- called on the engine's worker thread: hand over, never block

    def _stats_changed_threadsafe(self, _stats: EngineStats) -> None:
        self._call_soon_threadsafe(self.notify_changed)

    def _kv_events_threadsafe(self, events: tuple[KVEvent, ...]) -> None:
        self._call_soon_threadsafe(self._fan_out_kv_events, events)

    def _call_soon_threadsafe(self, callback: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed before the service was stopped: nobody to tell
            pass

    # --- event loop

    def notify_changed(self) -> None:
        for subscriber in self._subscribers:
            subscriber.changed.set()

    def _fan_out_kv_events(self, events: tuple[KVEvent, ...]) -> None:
        for subscriber in self._subscribers:
            subscriber.add_kv_events(events)

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        for subscriber in self._subscribers:
            subscriber.close()

    def _snapshot(self, stats: EngineStats, draining: bool,
                  kv_events: Sequence[replica_pb2.KvBlockEvent] = ()) -> replica_pb2.ReplicaState:
        return replica_pb2.ReplicaState(
            replica_id=self._identity.replica_id, model=self._identity.model, seq=next(self._seq),
            wall_time_unix_ns=self._now_ns(), process_start_unix_ns=self._identity.process_start_unix_ns,
            num_requests_waiting=stats.num_waiting, num_requests_running=stats.num_running,
            num_kv_blocks_free=stats.num_kv_blocks_free, num_kv_blocks_total=stats.num_kv_blocks_total,
            block_size_tokens=stats.block_size_tokens, adapters_loaded=stats.adapters_loaded,
            prefix_cache_queried_tokens_total=stats.prefix_queried_tokens_total,
            prefix_cache_hit_tokens_total=stats.prefix_hit_tokens_total, draining=draining,
            kv_events=kv_events)

    async def GetState(self, request: replica_pb2.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> replica_pb2.ReplicaState:
        if not self._engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's engine has stopped")
        return self._snapshot(self._engine.stats, self._is_draining())

    async def GetTokenizer(self, request: replica_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> replica_pb2.TokenizerFiles:
        if isinstance(self._tokenizer, TokenizerFilesUnavailable):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(self._tokenizer))
        return self._tokenizer

    async def WatchState(self, request: replica_pb2.WatchStateRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[replica_pb2.ReplicaState]:
        intervals = stream_intervals(request)
        if request.include_kv_events and not self._kv_events_enabled:
            log.warning("a state stream asked for KV events, but the engine was created without "
                        "enable_kv_events; streaming snapshots without them")
        subscriber = Subscriber(request.include_kv_events and self._kv_events_enabled,
                                self._max_pending_kv_hashes)
        self._subscribers.add(subscriber)  # before the first cache read: no event falls in between
        last_key: tuple[object, ...] | None = None

        async def alive() -> None:
            if not self._engine.is_alive:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's engine has stopped")

        async def build(is_heartbeat: bool) -> replica_pb2.ReplicaState | None:
            nonlocal last_key
            kv_events = await self._take_kv_events(subscriber, context)
            stats, draining = self._engine.stats, self._is_draining()
            key = content_key(stats, draining)
            if not (is_heartbeat or kv_events or key != last_key):
                return None  # the engine's own counters moved; nothing on the wire did
            last_key = key
            return self._snapshot(stats, draining, kv_events)

        try:
            async for snapshot in paced_snapshots(subscriber, intervals, context, build, alive):
                yield snapshot
        finally:
            self._subscribers.discard(subscriber)

    async def _take_kv_events(self, subscriber: Subscriber,
                              context: grpc.aio.ServicerContext) -> list[replica_pb2.KvBlockEvent]:
        if not subscriber.include_kv_events:
            return []
        events: list[replica_pb2.KvBlockEvent] = []
        # The subscriber keeps buffering while the worker reads the cache; if it overflows meanwhile,
        # events after that read were lost and the read is repeated.
        while subscriber.needs_resync:
            subscriber.needs_resync = False
            try:
                cached = await self._engine.cached_block_hashes()
            except EngineDead:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's engine has stopped")
            events = resync_events(cached, self._engine.stats.block_size_tokens)
        events.extend(kv_event_to_proto(event) for event in subscriber.take_kv_events())
        return events


async def paced_snapshots(subscriber: Subscriber, intervals: StreamIntervals, context: grpc.aio.ServicerContext,
                          build: Callable[[bool], Awaitable[replica_pb2.ReplicaState | None]],
                          check: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[replica_pb2.ReplicaState]:
    """One WatchState stream's pacing: the first snapshot at once, then at most one per min interval after a
    change and a heartbeat after max interval of none (`next_send_at`). `build(is_heartbeat)` makes the
    snapshot, or None when nothing on the wire changed; `check` runs on every wake-up (it may abort).
    Aborts with UNAVAILABLE once the subscriber is closed. Shared with stand-ins (loadtests/sim_state.py)."""
    loop = asyncio.get_running_loop()
    last_sent_s = -math.inf
    while True:
        if subscriber.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica is shutting down")
        if check is not None:
            await check()
        now_s = loop.time()
        due_s = next_send_at(last_sent_s, subscriber.changed.is_set(), intervals)
        if now_s < due_s:
            await wait_for_change(subscriber, due_s - now_s)
            continue
        subscriber.changed.clear()
        snapshot = await build(now_s >= last_sent_s + intervals.max_s)
        if snapshot is not None:
            yield snapshot
            last_sent_s = now_s


async def wait_for_change(subscriber: Subscriber, timeout_s: float) -> None:
    """Sleep `timeout_s`, or less if the subscriber is idle and a change arrives first."""
    if subscriber.changed.is_set():  # already changed: wait out the coalescing interval
        await asyncio.sleep(timeout_s)
        return
    try:
        async with asyncio.timeout(timeout_s):
            await subscriber.changed.wait()
    except TimeoutError:
        pass


# ---------------------------------------------------------------------------------------- public


class StateService:
    """A running `Replica` gRPC service. `port` is the bound port (the OS's pick when asked for 0)."""

    def __init__(self, server: grpc.aio.Server, servicer: _ReplicaServicer, port: int) -> None:
        self.server = server
        self.port = port
        self._servicer = servicer

    def notify_changed(self) -> None:
        """Tell the streams that something outside the engine changed (e.g. draining started), so they
        send within min_interval instead of at the next heartbeat. Call on the event loop."""
        self._servicer.notify_changed()

    async def stop(self, grace: float | None = 1.0) -> None:
        """End every open stream with UNAVAILABLE (subscribers reconnect elsewhere), detach from the
        engine and stop the server; RPCs still running after `grace` seconds are cancelled.
        Idempotent. The engine itself is left running."""
        self._servicer.close()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_state_service(
    engine: AsyncLLM, *, host: str, port: int, replica_id: str, model: str,
    is_draining: Callable[[], bool] = lambda: False, now_ns: Callable[[], int] = time.time_ns,
    max_pending_kv_hashes: int = DEFAULT_MAX_PENDING_KV_HASHES,
) -> StateService:
    """Serve the `Replica` service for `engine` on host:port (plaintext gRPC); port 0 picks a free
    port, readable as `.port` of the result. Call on the event loop that will serve it.

    KV events reach streams only if the engine was created with EngineConfig(enable_kv_events=True).
    The tokenizer files GetTokenizer serves are read from the engine's model directory here, once; if
    they cannot be, a warning is logged and the service starts anyway (GetTokenizer then fails).
    `is_draining` is read for every snapshot; `now_ns` gives the wall clock (ns since the epoch), and
    its value now is the `process_start_unix_ns` of every snapshot. Raises OSError when the address
    cannot be bound.
    """
    if max_pending_kv_hashes < 1:
        raise ValueError(f"max_pending_kv_hashes must be an integer >= 1; got {max_pending_kv_hashes!r}")
    identity = _Identity(replica_id, model, process_start_unix_ns=now_ns())
    tokenizer_files: Mapping[str, bytes] | TokenizerFilesUnavailable
    try:  # a few MB at most: off the loop, which may already serve HTTP
        tokenizer_files = await asyncio.to_thread(read_tokenizer_files, Path(engine.core.model_dir))
    except TokenizerFilesUnavailable as exc:
        log.warning("GetTokenizer will fail with FAILED_PRECONDITION: %s", exc)
        tokenizer_files = exc
    servicer = _ReplicaServicer(engine, identity, is_draining, now_ns, max_pending_kv_hashes, tokenizer_files)
    server, bound_port, address = await serve_replica_servicer(servicer, host, port, servicer.close)
    log.info("replica state service for %s (%s) listening on %s", replica_id, model, address)
    return StateService(server, servicer, bound_port)


async def serve_replica_servicer(servicer: replica_pb2_grpc.ReplicaServicer, host: str, port: int,
                                 on_bind_error: Callable[[], None]) -> tuple[grpc.aio.Server, int, str]:
    """Serve `servicer` as the `Replica` service on host:port, plaintext (port 0: a free one); returns the
    started server, the bound port and "host:port". Calls `on_bind_error`, then raises OSError, when the
    address cannot be bound. Shared with stand-ins that speak this protocol (loadtests/sim_state.py)."""
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError for an address it cannot bind
        on_bind_error()
        raise OSError(f"cannot bind the state service to {address}: {exc}") from exc
    if bound_port == 0:
        on_bind_error()
        raise OSError(f"cannot bind the state service to {address}")
    await server.start()
    return server, bound_port, address.rsplit(":", 1)[0] + f":{bound_port}"
