"""Forwarding: route, send the original body to the chosen replica, pass the answer back.

Retry rule: an attempt may be retried only while the client has received nothing. Before that point a
connect error, a dropped connection, a 5xx, a first-byte timeout or a body that breaks while we buffer
it all count as a failed attempt: the replica gets `report_failure`, joins this request's excluded set
(never tried again for it) and the request is routed afresh among the rest, at most
`routing.max_retries` times. Once a byte has gone to the client (a streamed response's first event),
nothing is retried; a stream that breaks or idles past `stream_idle_timeout_s` ends with an SSE error
event and `data: [DONE]`.

A replica that stops answering its health checks (frozen: a hung driver, SIGSTOP) is not waited out: the
tracker tells each attempt there through its lease (`AttemptLease.when_unresponsive`), which fires the
attempt's `upstream.Interrupt` if the attempt heard nothing from the replica for a while
(`TrackerSettings.interrupt_after_silent_s`), and the wait it is in raises at once. Before the first byte that is a
failed attempt like any other (outcome `replica_unhealthy`, retried elsewhere); after it, the stream's SSE error
event (code `replica_unhealthy`). A replica that is slow but answers its health checks is never cut off, nor is an
attempt that is still receiving bytes, however late the health checks are answered.

"First byte" for a stream is its first body bytes, not its headers: an engine sends headers at once
and may then stall in prefill, and while we hold the headers back the request can still move.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from aiohttp import HttpVersion11, web

from kvgate.clock import Clock
from kvgate.registry.schema import Routing
from kvgate.openai_wire import ApiError
from kvgate.router.errors import bad_gateway, no_capacity, sse_error_event, upstream_timeout
from kvgate.router.features import RouteRequest
from kvgate.router.metrics import RouterMetrics
from kvgate.router.observations import PromptWork
from kvgate.router.outcomes import (Answer, DecisionRecord, DecisionRing, Learnt, caching_judgement_log,
                                    TokenUsage, cached_tokens_of, prompt_tokens_of, stream_end, token_usage_of,
                                    tokens_used_of)
from kvgate.router.policies import Reason, RouteDecision, RoutingKnobs, choose
from kvgate.router.queueing import WaitQueues
from kvgate.router.upstream import Interrupt, ReplicaUnresponsive, UpstreamError, UpstreamPool, UpstreamResponse
from kvgate.router.view import ReplicaView

if TYPE_CHECKING:
    from kvgate.router.tracked_replica import AttemptLease

log = logging.getLogger(__name__)

_DRAIN_AFTER_DONE_S = 1.0
# Which replica answered, for operators, tests and benchmarks: its public id ("m-static-0", "kvg-..."), never
# its URL, which may hold credentials and names an internal address (router.membership).
REPLICA_HEADER = "x-kvgate-replica"
# One id per request, the client's or the gateway's, sent to the replica (vLLM takes it as its request id
# with --enable-request-id-headers) and back to the client, and kept with the decision in /admin/stats.
REQUEST_ID_HEADER = "X-Request-Id"
# Prompt plus completion tokens, as the replica's usage said, on the response of an answer that said: what the
# handler settles a tenant's tokens per minute with (router.admission).
TOKENS_USED_KEY = web.ResponseKey("kvgate_tokens_used", int)
# The replica's usage, on the response of an answer that reported one, and how a relayed stream ended (its
# `kvgate_router_requests_total` outcome): what a tenant's usage is counted with (router.usage).
USAGE_KEY = web.ResponseKey("kvgate_usage", TokenUsage)
STREAM_OUTCOME_KEY = web.ResponseKey("kvgate_stream_outcome", str)


class Tracker(Protocol):
    """What the proxy needs of `router.replicas.ReplicaTracker`."""

    def view(self, model: str, blocks: bool = False) -> ReplicaView: ...
    def record_sent(self, replica_id: str, route: RouteRequest) -> None: ...
    def start_attempt(self, replica_id: str, prefix_hashes: tuple[int, ...], prefill_tokens: int = 0,
                      predict_blocks: bool = False, num_sequences: int = 1) -> AttemptLease: ...
    def learn(self, replica_id: str, answer: Answer) -> Learnt: ...
    def report_success(self, replica_id: str) -> None: ...
    def report_failure(self, replica_id: str) -> None: ...
    def url(self, replica_id: str) -> str: ...
    def authorization(self, replica_id: str) -> str | None: ...
    async def wait_for_replica(self, model: str, timeout_s: float) -> bool: ...
    def num_ready(self, model: str) -> int: ...
    def replica_ids(self) -> frozenset[str]: ...


@dataclass(frozen=True)
class ProxyRequest:
    """A validated inference request, ready to route."""

    path: str  # "/v1/chat/completions" or "/v1/completions", the same upstream
    body: bytes  # the client's bytes, forwarded unchanged
    route: RouteRequest
    knobs: RoutingKnobs
    routing: Routing  # retries, timeouts, queue bound
    queue_wait_s: float  # the model's scaling.max_queue_wait_s, or the gateway default
    arrived_at: float  # clock.now() when the request arrived, for TTFT
    request_id: str = ""  # REQUEST_ID_HEADER: the client's, or one the gateway made up
    # Told clock.now() when the first token reaches the client (the fair queue learns its wait budget from it).
    on_first_token: Callable[[float], None] | None = None

    def first_token(self, model: str, metrics: RouterMetrics, now: float, *, streamed: bool,
                    observe: bool = True) -> None:
        """The first token reached the client at `now` (`observe`: count it in kvgate_router_ttft_seconds)."""
        if observe:
            metrics.ttft_seconds.labels(model, "true" if streamed else "false").observe(now - self.arrived_at)
        if self.on_first_token is not None:
            self.on_first_token(now)


class AttemptFailed(Exception):
    """One retryable failure before the client got a byte. `status`/`body` when the replica answered."""

    def __init__(self, outcome: str, message: str, *, status: int | None = None, body: bytes = b"",
                 content_type: str = "application/json") -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status = status
        self.body = body
        self.content_type = content_type


class Proxy:
    """Routes and forwards requests; owns the recent-decision ring and per-replica outcome counts."""

    def __init__(self, tracker: Tracker, upstream: UpstreamPool, metrics: RouterMetrics,
                 clock: Clock, queues: WaitQueues, prompt_work: PromptWork | None = None) -> None:
        self.tracker = tracker
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.queues = queues
        self.recent_decisions = DecisionRing()
        self.outcomes_by_replica: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.prompt_work = prompt_work or PromptWork()  # what the autoscaler's work model reads (router.observations)
        self._drains: set[asyncio.Task[None]] = set()  # streams' ends read after [DONE] (`_drain_after_done`)

    async def forward(self, request: web.Request, preq: ProxyRequest) -> web.StreamResponse:
        """Serve `preq`; raises ApiError (503 no capacity, 502/504) when no replica could answer."""
        model = preq.route.model
        excluded: set[str] = set()
        last: AttemptFailed | None = None
        num_attempts, waited = 0, False
        while num_attempts <= preq.routing.max_retries:
            decision = self._decide(preq, excluded, num_attempts)
            if decision.replica_id is None:
                if excluded or waited:
                    break  # every replica failed this request, or one was ready and is gone again
                waited = True
                try:
                    await self.queues.wait(model, preq.routing.max_queued_requests, preq.queue_wait_s)
                except ApiError:
                    self._count(model, "", "no_capacity")
                    raise
                continue
            num_attempts += 1
            replica_id = decision.replica_id
            self.tracker.record_sent(replica_id, preq.route)
            uncached = preq.route.uncached_tokens(decision.predicted_match_chunks)
            if num_attempts == 1:
                self.prompt_work.note(model, uncached)
            # On KV blocks the chain is held as predicted until the replica's events say.
            lease = self.tracker.start_attempt(replica_id, preq.route.prefix_hashes, uncached,
                                               predict_blocks=preq.route.hash_tokens > 0,
                                               num_sequences=preq.route.num_sequences)
            try:
                return await self._attempt(request, preq, replica_id, decision, lease)
            except asyncio.CancelledError:  # the client went away (handler cancellation), at any point of the attempt
                self._count(model, replica_id, "client_gone")
                raise
            except AttemptFailed as failure:
                self.tracker.report_failure(replica_id)
                self._count(model, replica_id, failure.outcome)
                excluded.add(replica_id)
                last = failure
            finally:
                lease.end()
        return self._give_up(model, last)

    def _give_up(self, model: str, last: AttemptFailed | None) -> web.StreamResponse:
        if last is None:
            self._count(model, "", "no_capacity")
            raise no_capacity(f"no replica of model '{model}' is ready", retry_after_s=1)
        if last.status is not None:  # the replica answered: its status and body pass through
            return web.Response(status=last.status, body=last.body, headers={"Content-Type": last.content_type})
        if last.outcome == "timeout":
            raise upstream_timeout(f"no replica of model '{model}' answered in time: {last}")
        raise bad_gateway(f"no replica of model '{model}' could be reached: {last}")

    def _decide(self, preq: ProxyRequest, excluded: set[str], attempt: int) -> RouteDecision:
        started = self.clock.now()
        view = self.tracker.view(preq.route.model, blocks=preq.route.hash_tokens > 0)
        if excluded:
            view = replace(view, replicas=tuple(r for r in view.replicas if r.replica_id not in excluded))
        decision = choose(preq.route, view, preq.knobs)
        self.metrics.decision_seconds.labels(preq.route.model).observe(self.clock.now() - started)
        self.metrics.decisions.labels(preq.route.model, decision.reason.value).inc()
        if decision.reason is not Reason.NO_REPLICA:
            self.recent_decisions.append(DecisionRecord.of(decision, preq.route, request_id=preq.request_id,
                                                           attempt=attempt, excluded=excluded,
                                                           wall=self.clock.wall()))
        return decision

    def forget_replicas(self, replica_ids: Iterable[str]) -> None:
        """Drop the outcome counts of replicas that are gone for good (`RouterMetrics.retire_replicas`)."""
        for replica_id in replica_ids:
            self.outcomes_by_replica.pop(replica_id, None)

    def _count(self, model: str, replica_id: str, outcome: str) -> None:
        self.metrics.requests.labels(model, replica_id, outcome).inc()
        if replica_id:
            self.outcomes_by_replica[replica_id][outcome] += 1

    async def _attempt(self, request: web.Request, preq: ProxyRequest, replica_id: str,
                       decision: RouteDecision, lease: AttemptLease) -> web.StreamResponse:
        routing = preq.routing
        started = self.clock.now()
        interrupt = Interrupt()
        lease.when_unresponsive(interrupt.fire_if_silent)
        try:
            upstream = await self.upstream.post(
                self.tracker.url(replica_id), preq.path, preq.body, accept=request.headers.get("Accept", "*/*"),
                authorization=self.tracker.authorization(replica_id), request_id=preq.request_id,
                connect_timeout_s=routing.connect_timeout_s, timeout_s=routing.first_byte_timeout_s,
                interrupt=interrupt)
        except TimeoutError as exc:
            raise AttemptFailed("timeout", f"replica {replica_id}: no answer in time ({type(exc).__name__})") from exc
        except ReplicaUnresponsive as exc:
            raise _unresponsive(replica_id) from exc
        except UpstreamError as exc:  # its text names the replica's address: for the log, not the client
            log.debug("replica %s: %s", replica_id, exc)
            raise AttemptFailed("connect_error", f"replica {replica_id} could not be reached") from exc
        finished = False
        try:
            if upstream.status >= 500:
                body = await self._read_body(upstream, routing.stream_idle_timeout_s, replica_id, swallow=True)
                raise AttemptFailed("upstream_5xx", f"replica {replica_id} answered {upstream.status}",
                                    status=upstream.status, body=body,
                                    content_type=upstream.headers.get("content-type", "application/json"))
            if upstream.content_type == "text/event-stream" and upstream.status < 300:
                remaining_s = routing.first_byte_timeout_s - (self.clock.now() - started)
                response = await self._stream(request, preq, upstream, replica_id, decision, remaining_s, lease)
            else:
                response = await self._buffered(preq, upstream, replica_id, decision)
            finished = True
            return response
        finally:
            if finished and upstream.at_eof:
                upstream.release()  # a clean end: the connection goes back to the pool
            elif finished and response.get(STREAM_OUTCOME_KEY) == "success":
                self._drain_after_done(upstream)
            else:
                upstream.close()  # cancelled, broken or abandoned: drop it, which aborts the upstream request

    async def _read_body(self, upstream: UpstreamResponse, idle_s: float, replica_id: str,
                         swallow: bool = False) -> bytes:
        parts, size = [], 0
        try:
            while chunk := await upstream.read(idle_s):
                parts.append(chunk)
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise UpstreamError(f"the answer is over {MAX_ANSWER_BYTES} bytes")
        except (TimeoutError, UpstreamError) as exc:
            if swallow:
                return b"".join(parts)
            if isinstance(exc, ReplicaUnresponsive):
                raise _unresponsive(replica_id) from exc
            outcome = "timeout" if isinstance(exc, TimeoutError) else "broken_body"
            raise AttemptFailed(outcome, f"replica {replica_id}: body broke: {exc or type(exc).__name__}") from exc
        return b"".join(parts)

    async def _buffered(self, preq: ProxyRequest, upstream: UpstreamResponse, replica_id: str,
                        decision: RouteDecision) -> web.Response:
        """A non-streamed answer (or a 4xx): read it all (still retryable), then pass it through."""
        body = await self._read_body(upstream, preq.routing.stream_idle_timeout_s, replica_id)
        self.tracker.report_success(replica_id)
        model = preq.route.model
        used: int | None = None
        usage: TokenUsage | None = None
        if upstream.status < 300:
            self._count(model, replica_id, "success")
            try:
                payload = json.loads(body)
            except (ValueError, RecursionError):
                payload = None  # not JSON: nothing to learn; the client gets the bytes as they are
            self._learn(preq, replica_id, decision, cached_tokens_of(payload), prompt_tokens_of(payload))
            used, usage = tokens_used_of(payload), token_usage_of(payload)
        else:
            self._count(model, replica_id, f"upstream_{upstream.status // 100}xx")
        preq.first_token(model, self.metrics, self.clock.now(), streamed=False, observe=upstream.status < 300)
        response = web.Response(status=upstream.status, body=body, headers={
            "Content-Type": upstream.headers.get("content-type", "application/json"), REPLICA_HEADER: replica_id})
        if used is not None:
            response[TOKENS_USED_KEY] = used
        if usage is not None:
            response[USAGE_KEY] = usage
        return response

    async def _stream(self, request: web.Request, preq: ProxyRequest, upstream: UpstreamResponse,
                      replica_id: str, decision: RouteDecision, first_byte_s: float,
                      lease: AttemptLease) -> web.StreamResponse:
        """Pass SSE through event by event, awaiting each write (backpressure: a slow client slows the
        upstream read, never a growing buffer)."""
        try:
            first = await upstream.read(first_byte_s)
        except TimeoutError as exc:
            raise AttemptFailed("timeout", f"replica {replica_id}: no first event in time") from exc
        except ReplicaUnresponsive as exc:
            raise _unresponsive(replica_id) from exc
        except UpstreamError as exc:
            raise AttemptFailed("broken_body", f"replica {replica_id}: stream broke before its first event") from exc
        if not first:
            raise AttemptFailed("broken_body", f"replica {replica_id}: stream ended before its first event")
        model = preq.route.model
        response = _EventStream(status=upstream.status, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", REPLICA_HEADER: replica_id})
        if request.version < HttpVersion11:
            response.force_close()  # no chunked framing before HTTP/1.1: the stream ends with the connection
        relay = SseRelay()
        error: TimeoutError | UpstreamError | None = None
        try:
            await response.prepare(request)
            await self._relay(response, upstream, first, relay, preq, lease)
        except ConnectionResetError:  # the client went away: the caller's close() aborts the upstream
            self._count(model, replica_id, "client_gone")  # (seen as handler cancellation: counted in forward)
            response[STREAM_OUTCOME_KEY] = "client_gone"
            return response
        except (TimeoutError, UpstreamError) as exc:
            error = exc
        end = stream_end(relay.done, error, preq.routing.stream_idle_timeout_s,
                         unresponsive=isinstance(error, ReplicaUnresponsive))
        self._count(model, replica_id, end.outcome)
        response[STREAM_OUTCOME_KEY] = end.outcome
        if end.error_code is not None:
            self.tracker.report_failure(replica_id)
            await self._end_with_error(response, end.message, end.error_code)
            return response
        self.tracker.report_success(replica_id)
        self._learn(preq, replica_id, decision, relay.cached_tokens, relay.prompt_tokens)
        if relay.tokens_used is not None:
            response[TOKENS_USED_KEY] = relay.tokens_used
        if relay.usage is not None:
            response[USAGE_KEY] = relay.usage
        return response

    def _drain_after_done(self, upstream: UpstreamResponse) -> None:
        """What follows a stream's [DONE] is only the chunked terminator; reading it lets the connection return to
        the pool instead of being dropped. Read in a task of its own, bounded, off the request's path: the client
        has its whole answer, and a client that closes its connection at [DONE] (many do) would otherwise cancel
        the handler here and have its complete answer counted as `client_gone`, its usage lost."""
        async def drain() -> None:
            try:
                with contextlib.suppress(TimeoutError, UpstreamError):
                    await upstream.read_all(_DRAIN_AFTER_DONE_S)
            finally:
                if upstream.at_eof:
                    upstream.release()
                else:
                    upstream.close()

        task = asyncio.create_task(drain(), name="kvgate-drain-after-done")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _relay(self, response: web.StreamResponse, upstream: UpstreamResponse, chunk: bytes,
                     relay: SseRelay, preq: ProxyRequest, lease: AttemptLease) -> None:
        """Pass the replica's bytes through `relay` to the client, from `chunk` on, until `[DONE]` or the end
        of its body. Raises what the reads and writes raise."""
        ttft_observed = False
        itl = InterTokenClock(self.metrics.itl_seconds.labels(preq.route.model))
        while True:
            out = relay.feed(chunk)
            itl.tokens_at(relay.token_events, self.clock.now())
            if relay.done:
                await response.write_eof(out)  # the last events and the chunked terminator in one write
            elif out:
                await response.write(out)
            if relay.first_token and not ttft_observed:
                # The prompt's prefill is over at the first token, not at the first event: a server
                # may open the stream with a role-only chunk before it has prefilled.
                ttft_observed = True
                lease.prefilled()
                preq.first_token(preq.route.model, self.metrics, self.clock.now(), streamed=True)
            if relay.done:
                return
            chunk = await upstream.read(preq.routing.stream_idle_timeout_s)
            if not chunk:
                return

    @staticmethod
    async def _end_with_error(response: web.StreamResponse, message: str, code: str) -> None:
        try:
            await response.write_eof(sse_error_event(message, code))
        except ConnectionResetError:
            pass  # the client left as well

    def _learn(self, preq: ProxyRequest, replica_id: str, decision: RouteDecision, cached_tokens: int | None,
               prompt_tokens: int | None = None) -> None:
        """Hand the answer's usage to the tracker to learn from (`router.outcomes`), then count predicted
        against realised cached tokens and log a replica's caching judgement when it flips."""
        model = preq.route.model
        learnt = self.tracker.learn(replica_id, Answer(preq.route, decision.predicted_match_chunks,
                                                       cached_tokens, prompt_tokens))
        lesson = learnt.lesson
        self.metrics.prefix_predicted_tokens.labels(model).inc(lesson.predicted_tokens)
        self.metrics.prefix_estimated_prompt_tokens.labels(model).inc(preq.route.estimated_prompt_tokens)
        if lesson.cached_tokens is not None:  # None: a replica that does not say (vLLM without
            # --enable-prompt-tokens-details), so the realised rate is over the prompts that did
            self.metrics.prefix_realised_tokens.labels(model).inc(lesson.cached_tokens)
            self.metrics.prefix_reported_prompt_tokens.labels(model).inc(lesson.prompt_tokens)
        if learnt.judgement is not None:
            log.log(*caching_judgement_log(replica_id, learnt.judgement))


def _unresponsive(replica_id: str) -> AttemptFailed:
    """An attempt given up on before the client's first byte, as its replica stopped answering health checks."""
    return AttemptFailed("replica_unhealthy", f"replica {replica_id} stopped answering its health checks")


class _EventStream(web.StreamResponse):
    """A streamed response whose headers wait for its first events, so that both leave in one write (the
    flag is aiohttp's, read since 3.11; an older aiohttp sends the headers at prepare, as before)."""

    _send_headers_immediately = False


# The largest SSE event and the largest non-streamed answer the gateway holds for a replica: far above a real
# one (an answer with logprobs for 4,096 tokens is ~2 MB), far below what would exhaust the gateway's memory.
MAX_EVENT_BYTES = 16 << 20
MAX_ANSWER_BYTES = 64 << 20


class SseRelay:
    """Cuts an SSE byte stream at event boundaries ("\\n\\n"), so only whole events reach the client
    (an error event after a break then parses), and notes the first token, `[DONE]` and the usage
    chunk's prompt and cached tokens."""

    def __init__(self) -> None:
        self._pending = b""
        self.first_token = False  # an event carried output (text, a tool call, a finish reason, usage)
        self.done = False
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.tokens_used: int | None = None  # the last usage chunk's (vLLM's continuous usage is cumulative)
        self.usage: TokenUsage | None = None  # ... all of it
        self.token_events = 0  # events that carried a token (text or a tool call's), for the inter-token latency

    def feed(self, data: bytes) -> bytes:
        """The whole events completed by `data`; keeps any partial one for the next call. Raises
        UpstreamError when a partial event grows past MAX_EVENT_BYTES (a replica that never ends one)."""
        self._pending += data.replace(b"\r\n", b"\n")
        cut = self._pending.rfind(b"\n\n")
        complete = b""
        if cut >= 0:
            complete, self._pending = self._pending[:cut + 2], self._pending[cut + 2:]
        if len(self._pending) > MAX_EVENT_BYTES:
            raise UpstreamError(f"the replica sent an event of over {MAX_EVENT_BYTES} bytes")
        if not complete:
            return b""
        for event in complete.split(b"\n\n"):
            self._inspect(event)
        return complete

    def _inspect(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = self.first_token = True
            elif not self.first_token:
                self.first_token = carries_output(data)
            if _TOKEN_FIELD.search(data) is not None:
                self.token_events += 1
            if b'"usage"' in data and b"prompt_tokens" in data:  # only a usage chunk: skip parsing the rest
                try:
                    payload = json.loads(data)
                except (ValueError, RecursionError):
                    continue
                self.cached_tokens = cached_tokens_of(payload) if self.cached_tokens is None else self.cached_tokens
                self.prompt_tokens = prompt_tokens_of(payload) if self.prompt_tokens is None else self.prompt_tokens
                self.tokens_used = tokens_used_of(payload) or self.tokens_used
                self.usage = token_usage_of(payload) or self.usage


# A field that holds output, with a value that is not empty: text ("content", "text", "reasoning_content"), a
# finish reason, a tool call, a usage object. Inside a JSON string quotes are escaped, so a key can only match
# where it is one. The role-only opening chunk ('"delta": {"role": "assistant", "content": ""}') does not.
_OUTPUT_FIELD = re.compile(rb'"(?:content|text|reasoning_content|finish_reason)"\s*:\s*"[^"]'
                           rb'|"tool_calls"\s*:\s*\[\s*\{|"usage"\s*:\s*\{\s*"')


# An event that carried generated text or a tool call's (not a finish reason or usage alone): one engine step's
# token, as vLLM, SGLang and kvgate's engine stream them.
_TOKEN_FIELD = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*\{')


class Observer(Protocol):
    """A histogram's child: what `InterTokenClock` records gaps into."""

    def observe(self, value: float) -> None: ...


class InterTokenClock:
    """Observes `kvgate_router_itl_seconds` for one relayed stream: the time from one token event to the next. Events
    that arrive in one read share the time since the last read's evenly (the gateway cannot see them apart);
    those of the first read that held tokens give no gap (nothing before them to measure from)."""

    def __init__(self, histogram: Observer) -> None:
        self._histogram = histogram
        self._seen = 0
        self._last_at: float | None = None

    def tokens_at(self, token_events: int, now: float) -> None:
        """The stream's token events so far were `token_events` at `now`."""
        new, self._seen = token_events - self._seen, token_events
        if new <= 0:
            return
        if self._last_at is not None:
            gap = (now - self._last_at) / new
            for _ in range(new):
                self._histogram.observe(gap)
        self._last_at = now


def carries_output(data: bytes) -> bool:
    """Whether one SSE event's data holds output: a choice with text, a tool call or a finish reason, or a
    usage chunk. Read by pattern, not parsed: it runs on every event until the stream's first token."""
    return _OUTPUT_FIELD.search(data) is not None
