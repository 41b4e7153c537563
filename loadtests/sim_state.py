"""The simulated replica's side of kvgate's replica-state protocol (proto/kvgate/v1/replica.proto).

A sim started with a tokenizer directory and a gRPC port (`SimReplicaConfig.tokenizer_dir` / `grpc_port`,
`sim_replica.py --tokenizer-dir DIR --grpc-port P`) speaks to a gateway as a `kvgate engine` does, so the
gateway can route it on its KV block events (registry: `backend: kvgate` with a `grpc_target`):

- prompts are counted and hashed as the engine does: `router.prompt_tokens.prompt_token_ids` on the
  request body with that directory's tokenizer, then `kvgate.kv_blocks.hash_blocks(ids, 16, adapter)`,
  the adapter being the request's model name when it names one of the sim's adapters (`SimTokens`);
- `Replica.WatchState` streams snapshots paced as the engine's (engine/state_service.py, whose pure
  helpers this reuses): the first at once, then at most one per min_interval (50 ms) after a change, a
  heartbeat after max_interval (250 ms) of none, nothing for a wake-up that changed nothing on the wire.
  With include_kv_events the first snapshot is a resync (all_cleared + one parentless `stored` with every
  cached hash), then the sim cache's own events (`sim_replica_model.PrefixCache`); a stream that falls
  behind by more than `max_pending_kv_hashes` is resynced instead;
- `Replica.GetState`: one snapshot; `Replica.GetTokenizer`: the directory's kvgate.tokenizer.TOKENIZER_FILES
  (read once, the same bytes the sim's own tokenizer was built from) and block size 16.

Snapshot fields: waiting / running from the scheduler; KV blocks total = the cache capacity, free = total
minus what the running sequences hold, a shared prompt block once (`Scheduler.num_kv_blocks_free`);
adapters_loaded = the adapters of the running batch (what the sim's /metrics reports as running LoRA
adapters: the sim models no adapter loading); the prefix counters; draining is always false.

Everything runs on the sim's event loop: the sim's engine calls `_ReplicaServicer._changed` after each
change with the KV events it drained, so a snapshot never races a cache change.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kvgate.engine.block_manager import KVEvent
from kvgate.engine.state_service import (DEFAULT_MAX_PENDING_KV_HASHES, Subscriber, kv_event_to_proto, paced_snapshots,
                                  read_tokenizer_files, resync_events, serve_replica_servicer, stream_intervals)
from kvgate.kv_blocks import hash_blocks
from kvgate.tokenizer import Tokenizer
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from loadtests.sim_replica_model import BLOCK_SIZE_TOKENS
from kvgate.router.prompt_tokens import PromptTokenizer, prompt_token_ids

if TYPE_CHECKING:
    from loadtests.sim_replica import SimEngine

log = logging.getLogger("kvgate.sim.state")


@dataclass(frozen=True)
class SimTokens:
    """A tokenizer directory's files and the tokenizer built from exactly those bytes. Load once per
    process and share between sims (`SimTokens.load`): a tokenizer is ~0.1 s and tens of MB."""

    files: Mapping[str, bytes]
    # The tokenizer, behind the gateway's piece cache (router.prompt_tokens): a real engine tokenizes
    # every prompt whole, but here that CPU would come out of the gateway's share of this box.
    pieces: PromptTokenizer

    @property
    def tokenizer(self) -> Tokenizer:
        return self.pieces.tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> SimTokens:
        """Raises engine.state_service.TokenizerFilesUnavailable (no tokenizer.json, unreadable file) or
        kvgate.tokenizer.TokenizerError (files that do not make a tokenizer)."""
        files = read_tokenizer_files(Path(model_dir))
        return cls(files, PromptTokenizer(Tokenizer.from_files(files, str(model_dir))))

    def prompt(self, body: Mapping[str, object], adapter: str | None) -> tuple[int, tuple[int, ...]] | None:
        """(prompt tokens, KV block chain) of a chat or completions body as a kvgate engine computes them;
        None for a body the engine would refuse (an image part, a batch of several prompts)."""
        ids = prompt_token_ids(body, self.pieces)
        if ids is None:
            return None
        return len(ids), tuple(hash_blocks(ids, BLOCK_SIZE_TOKENS, adapter))


@dataclass(frozen=True)
class _Identity:
    replica_id: str
    model: str
    adapters: frozenset[str]
    process_start_unix_ns: int


class _ReplicaServicer(replica_pb2_grpc.ReplicaServicer):
    def __init__(self, engine: SimEngine, tokens: SimTokens, identity: _Identity, now_ns: Callable[[], int],
                 max_pending_kv_hashes: int) -> None:
        self._engine = engine
        self._identity = identity
        self._now_ns = now_ns
        self._max_pending_kv_hashes = max_pending_kv_hashes
        self._seq = itertools.count(1)
        self._subscribers: set[Subscriber] = set()
        self._tokenizer = replica_pb2.TokenizerFiles(files=tokens.files, block_size_tokens=BLOCK_SIZE_TOKENS)
        engine.listeners.append(self._changed)

    def _changed(self, kv_events: Sequence[KVEvent]) -> None:
        """The sim's engine changed something (load, cache); `kv_events` are its cache's, oldest first."""
        for subscriber in self._subscribers:
            if kv_events:
                subscriber.add_kv_events(kv_events)
            subscriber.changed.set()

    def close(self) -> None:
        if self._changed in self._engine.listeners:
            self._engine.listeners.remove(self._changed)
        for subscriber in self._subscribers:
            subscriber.close()

    def _content(self) -> tuple[object, ...]:
        """The snapshot's fields a subscriber sees (equal tuples: nothing new to send)."""
        sched = self._engine.scheduler
        adapters = tuple(n for n in sched.running_names if n in self._identity.adapters)
        return (sched.num_waiting, sched.num_running, sched.num_kv_blocks_free(), sched.cache.capacity_blocks,
                adapters, sched.counters.num_prompt_tokens_queried, sched.counters.num_prompt_tokens_hit)

    def _snapshot(self, content: tuple[object, ...],
                  kv_events: Sequence[replica_pb2.KvBlockEvent] = ()) -> replica_pb2.ReplicaState:
        waiting, running, free, total, adapters, queried, hit = content
        return replica_pb2.ReplicaState(
            replica_id=self._identity.replica_id, model=self._identity.model, seq=next(self._seq),
            wall_time_unix_ns=self._now_ns(), process_start_unix_ns=self._identity.process_start_unix_ns,
            num_requests_waiting=waiting, num_requests_running=running, num_kv_blocks_free=free,
            num_kv_blocks_total=total, block_size_tokens=BLOCK_SIZE_TOKENS, adapters_loaded=adapters,
            prefix_cache_queried_tokens_total=queried, prefix_cache_hit_tokens_total=hit, draining=False,
            kv_events=kv_events)

    async def GetState(self, request: replica_pb2.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> replica_pb2.ReplicaState:
        return self._snapshot(self._content())

    async def GetTokenizer(self, request: replica_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> replica_pb2.TokenizerFiles:
        return self._tokenizer

    async def WatchState(self, request: replica_pb2.WatchStateRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[replica_pb2.ReplicaState]:
        intervals = stream_intervals(request)
        subscriber = Subscriber(request.include_kv_events, self._max_pending_kv_hashes)
        self._subscribers.add(subscriber)
        last_content: tuple[object, ...] | None = None

        async def build(is_heartbeat: bool) -> replica_pb2.ReplicaState | None:
            nonlocal last_content
            kv_events = self._take_kv_events(subscriber)
            content = self._content()
            if not (is_heartbeat or kv_events or content != last_content):
                return None  # e.g. a decode step: nothing on the wire moved
            last_content = content
            return self._snapshot(content, kv_events)

        try:
            async for snapshot in paced_snapshots(subscriber, intervals, context, build):
                yield snapshot
        finally:
            self._subscribers.discard(subscriber)

    def _take_kv_events(self, subscriber: Subscriber) -> list[replica_pb2.KvBlockEvent]:
        if not subscriber.include_kv_events:
            return []
        events: list[replica_pb2.KvBlockEvent] = []
        if subscriber.needs_resync:
            subscriber.needs_resync = False
            events = resync_events(self._engine.scheduler.cache.block_hashes(), BLOCK_SIZE_TOKENS)
        events.extend(kv_event_to_proto(event) for event in subscriber.take_kv_events())
        return events


class SimStateService:
    """A running `Replica` gRPC service of one sim. `port` is the bound port."""

    def __init__(self, server: grpc.aio.Server, servicer: _ReplicaServicer, port: int) -> None:
        self.server = server
        self.port = port
        self._servicer = servicer

    async def stop(self, grace: float | None = 0.5) -> None:
        """End every stream with UNAVAILABLE and stop the server. Idempotent; the sim keeps serving HTTP."""
        self._servicer.close()
        await self.server.stop(grace)


async def start_sim_state_service(engine: SimEngine, tokens: SimTokens, *, host: str, port: int, replica_id: str,
                                  model: str, adapters: Iterable[str] = (),
                                  now_ns: Callable[[], int] = time.time_ns,
                                  max_pending_kv_hashes: int = DEFAULT_MAX_PENDING_KV_HASHES) -> SimStateService:
    """Serve the `Replica` service for a running sim engine on host:port (plaintext gRPC; 0 picks a free
    port, see `.port`). The engine must have been made with record_kv_events for its streams to carry
    events. `now_ns` gives the wall clock; its value now is every snapshot's process_start_unix_ns.
    Raises OSError when the address cannot be bound."""
    servicer = _ReplicaServicer(engine, tokens, _Identity(replica_id, model, frozenset(adapters), now_ns()), now_ns,
                                max_pending_kv_hashes)
    server, bound_port, _ = await serve_replica_servicer(servicer, host, port, servicer.close)
    return SimStateService(server, servicer, bound_port)
