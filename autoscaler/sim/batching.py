"""One replica's continuous batching as the simulator runs it: engine steps, chunked prefill under a token budget,
decode shared by the batch. Mutable, owned by one simulated replica; time comes in as arguments.

A step decodes one token of every sequence past its prefill and prefills up to `max_batch_tokens` less those
tokens of the prompts waiting, first come first served (a long prompt spans steps: chunked prefill, as vLLM V1 and
SGLang schedule by default). A step takes `decode_step_s` (max_batch / decode_tokens_per_s: decode is
memory-bound, so a step costs about the same at any batch size) when anything decodes, plus its prefill tokens /
prefill_tokens_per_s. A prompt's first token comes at the end of the step that prefills its last token, and each
later token one step after the one before. So prefill and decode interfere as they do in an engine: while prompts
wait, every decoding sequence's steps are longer, and requests hold their batch slot longer.

Worked (decode_step_s 0.02, 10,000 prefill tokens/s, budget 2,048): a 3,000-token prompt arriving with 8
sequences decoding takes two steps, 0.02 + 2,040 / 10,000 = 0.224 s and 0.02 + 960 / 10,000 = 0.116 s: its first
token at 0.340 s (0.300 s alone), and the 8 decoded two tokens in 0.340 s instead of 0.04 s.

Between prefills the step never changes, so decode-only stretches are not stepped one by one: the decode clock
(`steps`, fractional) runs at 1 / decode_step_s and the next event is the next sequence to end. While prompts
wait, the replica is stepped one step at a time, a few steps a second at the usual budgets. A prompt that arrives
while the replica only decodes starts a step at once (at most one decode step early); one that arrives during a
prefill step joins the next.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from kvgate.autoscaler.sim.service import ServiceModel
from kvgate.autoscaler.work import step_budget

_EPS = 1e-6  # of a decode step: the fractional clock's rounding (a step is 0.01-0.1 s, runs last hours)


@dataclass
class _Prompt:
    index: int
    remaining: int  # prompt tokens not yet prefilled
    output_tokens: int


@dataclass(frozen=True)
class Advance:
    """What a replica's event came to: requests whose first token came now, requests that ended now, and when its
    next event is due (None: idle)."""

    first_tokens: tuple[int, ...]
    ended: tuple[int, ...]
    next_at: float | None


class ReplicaBatch:
    """The requests one replica runs: prompts being prefilled, in order, and sequences decoding."""

    def __init__(self, service: ServiceModel) -> None:
        self.decode_step_s = service.max_batch / service.decode_tokens_per_s
        self.prefill_s_per_token = 1 / service.prefill_tokens_per_s
        self.budget = step_budget(service.max_batch_tokens, service.max_batch)
        self.prefilling: deque[_Prompt] = deque()
        self.pending_tokens = 0  # prompt tokens waiting to be prefilled, all prompts
        self.decoding: list[tuple[float, int]] = []  # heap of (the decode step of its last token, request)
        self.steps = 0.0  # decode steps done (the decode clock)
        self.clock_at = 0.0  # when `steps` was last brought up to date
        self.step_ends: float | None = None  # the end of the step under way, while prompts wait
        self.step_chunk = 0  # prompt tokens that step prefills
        self.version = 0  # bumped whenever the next event moves: an event of an older version is stale

    def __len__(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def admit(self, now: float, index: int, prompt_tokens: int, output_tokens: int) -> float | None:
        """A request joins. Returns when the replica's next event is now due if that moved (schedule it under
        `version`), None if the step under way takes it in at its end."""
        tokens = max(1, prompt_tokens)
        self.prefilling.append(_Prompt(index, tokens, max(1, output_tokens)))
        self.pending_tokens += tokens
        if self.step_ends is not None:
            return None
        self._sync(now)
        return self._begin_step(now)

    def first_token_estimate(self, now: float, prompt_tokens: int) -> float:
        """When a prompt of `prompt_tokens` sent now would get its first token, if nothing else arrived: the
        prompts ahead and its own, at the prefill rate a step leaves beside its decodes (the dispatch's guess;
        called for every ready replica on every dispatch, so kept lean)."""
        if self.step_ends is None:
            start, tokens = now, self.pending_tokens + prompt_tokens
        else:
            start, tokens = self.step_ends, self.pending_tokens - self.step_chunk + prompt_tokens
        if self.decoding:  # each step of the budget (less the decodes) pays a decode step too
            steps = -(-tokens // max(1, self.budget - len(self.decoding)))
            return start + steps * self.decode_step_s + tokens * self.prefill_s_per_token
        return start + tokens * self.prefill_s_per_token

    def advance(self, now: float) -> Advance:
        """The replica's event at `now` (the end of a step, or a sequence's last token)."""
        first: list[int] = []
        if self.step_ends is not None and now >= self.step_ends - _EPS:
            if self.decoding:
                self.steps += 1
            self.clock_at = now
            first = self._prefill(self.step_chunk)
            self.step_ends, self.step_chunk = None, 0
        elif self.step_ends is None:
            self._sync(now)
        ended: list[int] = []
        while self.decoding and self.decoding[0][0] <= self.steps + _EPS:
            ended.append(heapq.heappop(self.decoding)[1])
        if self.step_ends is not None:  # a step still under way (an event from before it began): keep its end
            return Advance(tuple(first), tuple(ended), None)
        if self.prefilling:
            next_at: float | None = self._begin_step(now)
        elif self.decoding:
            self.version += 1
            next_at = now + (self.decoding[0][0] - self.steps) * self.decode_step_s
        else:
            next_at = None
        return Advance(tuple(first), tuple(ended), next_at)

    def clear(self) -> list[int]:
        """The replica is gone: every request it held (prompts first, in order), and nothing left to step."""
        held = [prompt.index for prompt in self.prefilling] + [index for _, index in self.decoding]
        self.prefilling.clear()
        self.decoding.clear()
        self.pending_tokens, self.step_ends, self.step_chunk = 0, None, 0
        self.version += 1
        return held

    def _sync(self, now: float) -> None:
        """Bring the decode clock to `now` (decode only: one step every decode_step_s while anything decodes)."""
        if self.decoding:
            self.steps += (now - self.clock_at) / self.decode_step_s
        self.clock_at = now

    def _begin_step(self, now: float) -> float:
        self.step_chunk = min(self.pending_tokens, max(1, self.budget - len(self.decoding)))
        took = (self.decode_step_s if self.decoding else 0.0) + self.step_chunk * self.prefill_s_per_token
        self.step_ends = now + took
        self.version += 1
        return self.step_ends

    def _prefill(self, chunk: int) -> list[int]:
        """`chunk` prompt tokens prefilled, first come first served; the requests whose prompt that completes
        start decoding (their first token is this step's)."""
        done: list[int] = []
        while chunk > 0 and self.prefilling:
            head = self.prefilling[0]
            take = min(chunk, head.remaining)
            head.remaining -= take
            chunk -= take
            self.pending_tokens -= take
            if head.remaining == 0:
                self.prefilling.popleft()
                done.append(head.index)
                heapq.heappush(self.decoding, (self.steps + head.output_tokens - 1, head.index))
        return done
