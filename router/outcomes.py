"""What the gateway makes of a replica's answer, decided without I/O.

The proxy (`router.proxy`) gathers and performs; this module decides:
- what an answer's usage says (`cached_tokens_of`, `prompt_tokens_of`): a count, or None for a replica that
  does not say or says something that is not a count, which must never turn a counter back or poison an index;
- what the router learns from it (`Answer`, `Lesson`): the model's characters per token, whether the
  gateway's tokenizer counted the prompt as the replica did, and predicted against realised cached tokens,
  which `Tracker.learn` applies to the replica's prefix index;
- how a relayed stream ended (`stream_end`): its outcome label, and the error event the client gets;
- what operators read: the log line of a replica's caching judgement (`caching_judgement_log`) and the
  ring of recent routing decisions in /admin/stats (`DecisionRecord`, `DecisionRing`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Set
from dataclasses import asdict, dataclass
from typing import Any

from kvgate.router.features import RouteRequest
from kvgate.router.policies import RouteDecision
from kvgate.router.prefix_index import CachingJudgement

NUM_RECENT_DECISIONS = 100  # decisions /admin/stats lists

# A token holds at least one byte of text, and a character at most four (UTF-8).
_MAX_TOKENS_PER_CHAR = 4
# Tokens a chat template may add to a prompt's own: a reported count within this of the text's bound
# still teaches the model's characters per token.
_TEMPLATE_TOKENS = 4096
_MAX_COUNT = 1 << 31


def cached_tokens_of(payload: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a response or final chunk, None when absent or not a
    count (a replica's odd answer must not turn a counter back or poison the index)."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return _count_of(details.get("cached_tokens") if isinstance(details, dict) else None)


def prompt_tokens_of(payload: Any) -> int | None:
    """usage.prompt_tokens of a response or final chunk, None when absent or not a count."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return _count_of(usage.get("prompt_tokens") if isinstance(usage, dict) else None)


@dataclass(frozen=True)
class TokenUsage:
    """An answer's `usage`, as a tenant is billed for it (`router.usage`)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # of prompt_tokens; None when the replica does not say


def token_usage_of(payload: Any) -> TokenUsage | None:
    """The usage of a response or usage chunk, None unless its prompt and completion tokens are counts."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = _count_of(usage.get("prompt_tokens")), _count_of(usage.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    return TokenUsage(prompt, completion, cached_tokens_of(payload))


def tokens_used_of(payload: Any) -> int | None:
    """usage.prompt_tokens + usage.completion_tokens of a response or usage chunk (what a tenant's tokens per
    minute are settled with), None unless both are counts."""
    usage = token_usage_of(payload)
    return None if usage is None else usage.prompt_tokens + usage.completion_tokens


def _count_of(value: object) -> int | None:
    """A token count: an int from 0 to 2^31 (no prompt is longer), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT else None


def text_chain(route: RouteRequest) -> tuple[int, ...]:
    """The chain the text index records for a request sent to a replica: its text chunks, also when it is
    routed on KV blocks (`text_hashes`), so that the text index is warm should text take over."""
    return route.text_hashes if route.hash_tokens > 0 else route.prefix_hashes


@dataclass(frozen=True)
class Lesson:
    """Predicted against realised cached prompt tokens of one answer (the `kvgate_router_prefix_*` counts)."""

    predicted_chunks: int  # leading chunks (or KV blocks) the replica was believed to hold, at most the chain
    predicted_tokens: int  # ... as prompt tokens
    chars_per_token: float  # the model's ratio the estimate was made with
    cached_tokens: int | None  # what the replica reported cached, at most the prompt; None when it did not say
    prompt_tokens: int  # the prompt's tokens: the replica's count, else the gateway's estimate


@dataclass(frozen=True)
class Answer:
    """What a replica's successful answer says about the request it served, as the proxy gathered it."""

    route: RouteRequest
    predicted_match_chunks: int  # RouteDecision.predicted_match_chunks of the attempt that got the answer
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (`cached_tokens_of`)
    prompt_tokens: int | None  # usage.prompt_tokens (`prompt_tokens_of`)

    @property
    def teaches_prompt_size(self) -> bool:
        """Whether prompt_tokens may teach the model's characters per token: more tokens than the text's
        bytes allow (plus a chat template's own) are not the text's, an image part's say, and would drag
        the ratio down. 1,000 chars: up to 4 x 1,000 + 4,096 = 8,096 tokens teach."""
        return (self.prompt_tokens is not None
                and self.prompt_tokens <= _MAX_TOKENS_PER_CHAR * self.route.num_prompt_chars + _TEMPLATE_TOKENS)

    @property
    def tokens_disagree(self) -> bool:
        """Whether a request routed on KV blocks was counted otherwise by the replica: the gateway's
        tokenizer is not the engine's, so its block hashes cannot match the engine's either."""
        return (self.prompt_tokens is not None and self.route.hash_tokens > 0
                and self.prompt_tokens != self.route.estimated_prompt_tokens)

    def lesson(self, chars_per_token: float) -> Lesson:
        """Predicted against realised, at the model's `chars_per_token` (learnt from this answer first).
        Predicted tokens are exact on KV blocks; on text, the predicted chunks' characters (at most the
        prompt's) over chars_per_token: 3 chunks of 256 chars of a 700-char prompt at 3.5 -> 200 tokens."""
        route = self.route
        predicted = min(self.predicted_match_chunks, len(route.prefix_hashes))
        if route.hash_tokens:
            predicted_tokens = route.estimated_prompt_tokens - route.uncached_tokens(predicted)
        else:
            predicted_tokens = int(min(predicted * route.chunk_chars, route.num_prompt_chars) / chars_per_token)
        prompt_tokens = route.estimated_prompt_tokens if self.prompt_tokens is None else self.prompt_tokens
        # No more of a prompt is cached than the prompt.
        cached_tokens = None if self.cached_tokens is None else min(self.cached_tokens, prompt_tokens)
        return Lesson(predicted, predicted_tokens, chars_per_token, cached_tokens, prompt_tokens)


@dataclass(frozen=True)
class Learnt:
    """What `Tracker.learn` made of an answer, for the proxy's metrics and log."""

    lesson: Lesson
    judgement: CachingJudgement | None = None  # the replica's caching judgement, when this answer changed it


def caching_judgement_log(replica_id: str, judgement: CachingJudgement) -> tuple[int, str]:
    """The log level and line for a replica whose caching judgement (`PrefixIndex.caches`) just flipped:
    operators see it in /admin/stats too, but a replica that stops caching is worth a WARNING."""
    if judgement.caches:
        return logging.INFO, f"replica {replica_id} realises cached tokens again: routing on its prefix cache"
    return logging.WARNING, (
        f"replica {replica_id} realised no cached tokens on its last {judgement.num_recent_predicted_hits} "
        "predicted prefix hits: routing as if it keeps no prefix cache (is prefix caching on there?)")


@dataclass(frozen=True)
class StreamEnd:
    """How a relayed stream ended, once the client had its first event (nothing is retried then)."""

    outcome: str  # the `kvgate_router_requests_total` outcome label
    error_code: str | None = None  # the code of the SSE error event that ends the client's stream; None: clean
    message: str = ""  # ... and its message


def stream_end(done: bool, error: Exception | None, idle_timeout_s: float, unresponsive: bool = False) -> StreamEnd:
    """A stream that sent `[DONE]` ended well; one that idled past `idle_timeout_s` (`error` a
    TimeoutError), broke (`error` another), was given up on as its replica stopped answering its health checks
    (`unresponsive`) or ended without `[DONE]` ends with an error event."""
    if unresponsive:
        return StreamEnd("replica_unhealthy", "replica_unhealthy",
                         "the replica stopped answering its health checks; the stream cannot go on")
    if isinstance(error, TimeoutError):
        return StreamEnd("stream_idle_timeout", "stream_idle_timeout",
                         f"the replica sent nothing for {idle_timeout_s:g} s")
    if error is not None:
        return StreamEnd("broken_stream", "stream_broken", f"the replica's stream broke: {error}")
    if not done:
        return StreamEnd("broken_stream", "stream_broken", "the replica's stream ended before [DONE]")
    return StreamEnd("success")


@dataclass(frozen=True)
class DecisionRecord:
    """One routing decision as /admin/stats lists it under `recent_decisions`."""

    wall: float  # unix seconds when it was made
    model: str
    adapter: str | None
    request_id: str  # the request's X-Request-Id
    replica: str
    reason: str  # a policies.Reason value
    attempt: int  # 0 for the request's first try, n for its nth retry
    predicted_match_chunks: int
    load: int  # the chosen replica's load before this request
    load_cap: int
    num_candidates: int
    excluded: tuple[str, ...]  # replicas that already failed this request, sorted

    @classmethod
    def of(cls, decision: RouteDecision, route: RouteRequest, *, request_id: str, attempt: int,
           excluded: Set[str], wall: float) -> DecisionRecord:
        """The record of `decision` (one that names a replica) for the request `route` describes."""
        return cls(wall=wall, model=route.model, adapter=route.adapter, request_id=request_id,
                   replica=decision.replica_id or "", reason=decision.reason.value, attempt=attempt,
                   predicted_match_chunks=decision.predicted_match_chunks, load=decision.load,
                   load_cap=decision.load_cap, num_candidates=decision.num_candidates,
                   excluded=tuple(sorted(excluded)))

    def as_json(self) -> dict[str, Any]:
        """The record as /admin/stats serves it (the dashboard reads these keys)."""
        return {**asdict(self), "excluded": list(self.excluded)}


class DecisionRing:
    """The last `size` decision records, oldest first: the older fall off as new ones come."""

    def __init__(self, size: int = NUM_RECENT_DECISIONS) -> None:
        self._records: collections.deque[DecisionRecord] = collections.deque(maxlen=size)

    def append(self, record: DecisionRecord) -> None:
        self._records.append(record)

    def __iter__(self) -> Iterator[DecisionRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def as_json(self) -> list[dict[str, Any]]:
        return [record.as_json() for record in self._records]
