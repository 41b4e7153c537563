"""Where a replica's load comes from: the engine's gRPC WatchState stream, or a foreign server's /metrics.

Both readers turn what the backend says into one `LoadReport`, a frozen value the tracker folds into
its replica record. The Prometheus parsing is a pure function (`parse_metrics`), so the names that
vLLM and SGLang export are pinned by table tests, not by live servers.

KV figures. vLLM exports only a usage fraction (`vllm:gpu_cache_usage_perc`, renamed
`vllm:kv_cache_usage_perc` in v1), plus, when it has it, `vllm:cache_config_info` whose labels carry
`num_gpu_blocks` and `block_size`. SGLang exports its pool in tokens (`sglang:max_total_num_tokens`, in
pages of `sglang:page_size`, default 1) and `sglang:token_usage`. Either way free blocks = total x (1 -
usage): 1,000 blocks at 0.25 usage -> 750 free (both count cached blocks no request holds as free). Without
block counts the report says 0 total ("unknown"), and
`PrefixIndexes.ensure()` then sizes that replica's index to `prefix_index.DEFAULT_CAPACITY_CHUNKS`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import asyncio

import grpc

from kvgate.clock import Clock
from kvgate.log_limit import LogLimiter
from kvgate.tokenizer import Tokenizer, TokenizerError
from kvgate.v1 import replica_pb2, replica_pb2_grpc
from kvgate.router.block_index import KvCleared, KvEvent, KvRemoved, KvStored

log = logging.getLogger(__name__)

# gRPC reconnect backoff: 0.1 s doubling to 5 s, so a restarting engine is seen again within ~5 s and
# a dead one costs one connect attempt per 5 s.
STREAM_BACKOFF_MIN_S = 0.1
STREAM_BACKOFF_MAX_S = 5.0
# A stream silent this long is dropped and reconnected: eight of the engine's default 250 ms heartbeats.
STREAM_SILENCE_S = 2.0
# GetTokenizer carries the model's tokenizer.json, which runs to ~9 MB for Llama 3, and a stream's resync every
# cached block hash (gRPC's default cap is 4 MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LoadReport:
    """One reading of a replica's load, from either source."""

    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0  # 0: the backend gave no block counts
    block_size_tokens: int | None = None  # None: not reported; the registry's figure stands
    adapters_loaded: frozenset[str] = frozenset()
    draining: bool = False
    prefix_caching: bool | None = None  # vLLM's enable_prefix_caching label; None: not reported
    # Stream only: identify the engine process and order snapshots (see replica.proto).
    process_start_unix_ns: int = 0
    seq: int = 0
    kv_events: tuple[KvEvent, ...] = ()  # prefix-cache changes since the previous snapshot, oldest first


# name{labels} value [timestamp]; names may hold colons (vllm:num_requests_waiting).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


def replica_url(base_url: str, path: str) -> str:
    """`path` under a replica's base URL, before the URL's query string, which every request keeps:
    ("http://h/api?v=1", "/metrics") -> "http://h/api/metrics?v=1"."""
    base, mark, query = base_url.partition("?")
    return f"{base.rstrip('/')}{path}{mark}{query}"


# What a foreign server's /metrics may make the gateway believe, at most: far above any real server
# (an H200 holds ~2M blocks of a small model's KV) and far below what would let an index grow unchecked.
MAX_REQUESTS = 1_000_000
MAX_KV_BLOCKS = 1 << 26
MAX_BLOCK_SIZE_TOKENS = 4096


def parse_samples(text: str) -> list[Sample]:
    """Every sample line of a Prometheus text exposition; comments and unparsable lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        raw_labels = _LABEL.findall(match.group(3) or "")
        labels = tuple((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in raw_labels)
        samples.append(Sample(match.group(1), labels, value))
    return samples


def _sum(samples: list[Sample], *names: str) -> float | None:
    """The sum over all label sets of the first name present (vLLM labels per model_name/engine)."""
    for name in names:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        if values:
            return sum(values)
    return None


def _mean(samples: list[Sample], *names: str) -> float | None:
    for name in names:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        if values:
            return sum(values) / len(values)
    return None


def _latest_lora_adapters(samples: list[Sample]) -> frozenset[str]:
    # vllm:lora_requests_info is a gauge whose value is a timestamp; the newest sample is current.
    infos = [s for s in samples if s.name == "vllm:lora_requests_info"]
    if not infos:
        return frozenset()
    newest = max(infos, key=lambda s: s.value)
    running = newest.label("running_lora_adapters") or ""
    return frozenset(name for name in running.split(",") if name)


def _label(samples: list[Sample], name: str, key: str) -> str | None:
    """Label `key` of the first sample named `name` (an info gauge such as vllm:cache_config_info)."""
    return next((s.label(key) for s in samples if s.name == name), None)


def _int_label(samples: list[Sample], name: str, key: str) -> int:
    try:
        return int(float(_label(samples, name, key) or 0))
    except (ValueError, OverflowError):  # not a number, or inf
        return 0


def _bounded(value: float, high: int) -> int:
    """A count a server reported, as an int in [0, high]: a negative, infinite or absurd figure from a
    misbehaving exporter must not turn into a negative queue or an index that never evicts."""
    return int(min(max(value, 0.0), high)) if math.isfinite(value) else 0


def parse_metrics(text: str) -> LoadReport:
    """The load of a vLLM or SGLang server from its /metrics text. Missing names read as 0 / unknown."""
    samples = parse_samples(text)
    waiting = _bounded(_sum(samples, "vllm:num_requests_waiting", "sglang:num_queue_reqs") or 0.0, MAX_REQUESTS)
    running = _bounded(_sum(samples, "vllm:num_requests_running", "sglang:num_running_reqs") or 0.0, MAX_REQUESTS)
    usage = _mean(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
    total = _bounded(_int_label(samples, "vllm:cache_config_info", "num_gpu_blocks"), MAX_KV_BLOCKS)
    block_size = _int_label(samples, "vllm:cache_config_info", "block_size")
    if total <= 0:  # SGLang: the KV pool in tokens, in pages of page_size tokens
        pool_tokens = _sum(samples, "sglang:max_total_num_tokens") or 0.0
        page = _bounded(_mean(samples, "sglang:page_size") or 1.0, MAX_BLOCK_SIZE_TOKENS) or 1  # the same on every rank
        total, block_size = (_bounded(pool_tokens, MAX_KV_BLOCKS) // page, page) if pool_tokens >= 1 else (0, 0)
    if not 0 < block_size <= MAX_BLOCK_SIZE_TOKENS:
        block_size = 0
    free = 0
    if total > 0:
        free = round(total * (1.0 - min(max(usage or 0.0, 0.0), 1.0)))
    caching = _label(samples, "vllm:cache_config_info", "enable_prefix_caching")
    return LoadReport(num_waiting=waiting, num_running=running, kv_blocks_free=free,
                      kv_blocks_total=total, block_size_tokens=block_size or None,
                      adapters_loaded=_latest_lora_adapters(samples),
                      prefix_caching={"True": True, "False": False}.get(caching or ""))


def _kv_event(event: replica_pb2.KvBlockEvent) -> KvEvent | None:
    kind = event.WhichOneof("event")
    if kind == "stored":
        return KvStored(tuple(event.stored.block_hashes))
    if kind == "removed":
        return KvRemoved(tuple(event.removed.block_hashes))
    if kind == "all_cleared":
        return KvCleared()
    return None  # a kind added after this gateway was built: ignored


def report_from_state(state: replica_pb2.ReplicaState) -> LoadReport:
    """The protobuf snapshot as a plain value; protobuf types stop here."""
    events = tuple(e for e in map(_kv_event, state.kv_events) if e is not None)
    return LoadReport(num_waiting=state.num_requests_waiting, num_running=state.num_requests_running,
                      kv_blocks_free=state.num_kv_blocks_free, kv_blocks_total=state.num_kv_blocks_total,
                      block_size_tokens=state.block_size_tokens or None,
                      adapters_loaded=frozenset(state.adapters_loaded), draining=state.draining,
                      process_start_unix_ns=state.process_start_unix_ns, seq=state.seq, kv_events=events)


async def _stream_once(target: str, include_kv_events: bool) -> AsyncIterator[LoadReport]:
    # A resync carries every cached block hash: past ~400,000 blocks it outgrows gRPC's default 4 MB.
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = replica_pb2_grpc.ReplicaStub(channel).WatchState(
            replica_pb2.WatchStateRequest(include_kv_events=include_kv_events))
        async for state in call:
            yield report_from_state(state)


async def fetch_tokenizer(target: str, timeout_s: float = 30.0) -> tuple[Tokenizer, int] | None:
    """The engine's tokenizer and KV block size, from its `GetTokenizer` RPC: one call per replica
    connection, never per request. None when the replica cannot say (an engine without the RPC, or
    without a tokenizer.json); the caller then routes on text. Raises grpc.aio.AioRpcError when the
    replica is unreachable, so the caller can try again later."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        try:
            reply = await replica_pb2_grpc.ReplicaStub(channel).GetTokenizer(
                replica_pb2.GetTokenizerRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                log.info("replica %s has no tokenizer to share (%s): routing its model on text", target,
                         exc.details())
                return None
            raise
    files = dict(reply.files)
    try:  # parsing a large tokenizer.json takes a while: off the event loop
        tokenizer = await asyncio.to_thread(Tokenizer.from_files, files, f"replica {target}")
    except TokenizerError as exc:
        log.warning("replica %s sent a tokenizer that does not load (%s): routing its model on text", target, exc)
        return None
    return tokenizer, reply.block_size_tokens


async def watch_stream(target: str, clock: Clock, on_report: Callable[[LoadReport], None],
                       on_disconnect: Callable[[], None], include_kv_events: bool = False,
                       silence_s: float = STREAM_SILENCE_S) -> None:
    """Follow a replica's WatchState stream until cancelled, reconnecting with backoff.

    `on_report` gets every snapshot (with KV block events when `include_kv_events`; each connection
    starts with a full resync); `on_disconnect` is called each time the stream ends, fails to connect, or
    says nothing for `silence_s` (the engine heartbeats every 250 ms, so a silent stream is a stuck replica
    or a half-open connection, whose KV events can no longer be trusted). Never raises but CancelledError:
    every error is retried, and logged once per kind per minute (a dead replica is retried every 5 s for as
    long as it is tracked), with one line when the stream delivers again."""
    backoff_s = STREAM_BACKOFF_MIN_S
    # Silences are limited apart from failures, and never "end": a stream that connects and then stalls again
    # would otherwise log its recovery and its silence at every reconnect.
    failures, silences = LogLimiter(), LogLimiter()
    while True:
        stream = _stream_once(target, include_kv_events)
        try:
            while True:
                async with asyncio.timeout(silence_s):
                    report = await anext(stream)
                backoff_s = STREAM_BACKOFF_MIN_S
                if (ended := failures.clear_all(clock.now())) is not None:
                    log.info("state stream %s delivers again after %.1f s and %d failed connection(s)", target,
                             ended.duration_s, ended.num_events)
                on_report(report)
        except StopAsyncIteration:
            pass
        except Exception as exc:  # a backend must never crash the tracker
            _log_stream_failure(target, exc, silence_s, silences if isinstance(exc, TimeoutError) else failures,
                                clock.now())
        finally:
            await stream.aclose()
        on_disconnect()
        await clock.sleep(backoff_s)
        backoff_s = min(backoff_s * 2, STREAM_BACKOFF_MAX_S)


def _log_stream_failure(target: str, exc: Exception, silence_s: float, limiter: LogLimiter, now: float) -> None:
    """One line per kind of failure per `limiter` interval: a silent stream (WARNING), a gRPC status (INFO: a
    replica starting or stopping says UNAVAILABLE), anything else (ERROR, with its traceback the first time)."""
    if isinstance(exc, TimeoutError):
        if (verdict := limiter.hit("silent", now)) is not None:
            log.warning("state stream %s said nothing for %.1f s; reconnecting%s", target, silence_s, verdict.note)
    elif isinstance(exc, grpc.aio.AioRpcError):
        if (verdict := limiter.hit(exc.code(), now)) is not None:
            log.info("state stream %s: %s %s%s", target, exc.code().name, exc.details(), verdict.note)
    elif (verdict := limiter.hit(type(exc), now)) is not None:
        log.error("state stream %s failed: %r%s", target, exc, verdict.note, exc_info=exc if verdict.first else None)
