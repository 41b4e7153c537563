"""The simulated replica's model: prompt -> token blocks, an LRU prefix cache, and a step scheduler.

Plain Python, no I/O and no clock reads, so tests drive it in microseconds. `loadtests/sim_replica.py`
is the aiohttp shell around it: it sleeps each step's `duration_s` on an injected clock and hands the
tokens a step produced to the waiting requests.

Cost model (vLLM-like chunked prefill, continuous batching):
- a prompt has ceil(chars / 4) tokens; full blocks of 16 tokens (64 characters) are hashed as a chain
  seeded with the model (or adapter) name, so the same text under another adapter never hits;
- at most `max_batch` sequences run; the rest wait (FCFS) -> `num_waiting`;
- a sequence's cached tokens are looked up when it first gets prefill budget in a step (as vLLM's
  scheduler looks up computed blocks when it schedules a request), not when it joins the batch: the
  leading blocks found in the cache, never the whole prompt (the last token is always computed, as in
  vLLM);
- a prompt's full blocks join the cache when the step that computes them is planned, not when they are
  computed, as vLLM v1 does (`KVCacheManager.allocate_slots` caches the blocks of the tokens it schedules;
  a layer writes the whole batch's keys and values before its attention reads them). So a request
  scheduled behind another with the same prefix, in the same step or a later one, hits what that one
  scheduled ahead of it instead of computing it a second time. FCFS budget makes that the whole prefix:
  a request gets prefill budget only once those ahead of it have scheduled all of their prompts;
- each step spends up to `max_prefill_tokens_per_step` uncached prompt tokens, shared FCFS across the
  running batch, and gives one token to every running sequence that has finished its prefill;
  step time = prefill tokens / prefill_tokens_per_s + (1 / decode_tokens_per_s if anything decodes).
  Worked numbers with the defaults (8,000 prefill tok/s, 50 decode tok/s): a 2,000-token prompt with
  1,600 cached costs 400 / 8,000 = 50 ms to its first token on an idle replica, then 20 ms per token;
  cold, it costs 250 ms;
- the step that completes a prefill yields the first output token and touches the prompt's full blocks
  in the cache; joining or touched, blocks beyond `kv_capacity_tokens / 16` evict the least recently used.
  A chain is touched tail first, so its first block is the most recently used and eviction trims chains
  from their tails, as vLLM v1 and the kvgate engine free a finished request's blocks in reverse order.

KV-events mode (`sim_replica.py --tokenizer-dir`, see `sim_state.py`): the shell counts and hashes a
prompt as a kvgate engine does (its real token ids, `kvgate.kv_blocks.hash_blocks` with the adapter)
and passes them in; the cost model is the same. A cache made with `record_events` also records what a
kvgate engine's BlockManager reports for the same changes: a `BlockStored` per run of consecutive blocks
that joined the cache (chain order, naming the block before the run as parent), a `BlockRemoved` for the
blocks evicted. Where the sim differs from the engine (in both modes): it caches a prompt's blocks when it
plans their computation (the engine commits each block once computed, generated tokens too, and puts off a
request whose next block another is computing until then), and it may evict blocks a running sequence uses
(the engine never does). Events always describe the sim's own cache.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from kvgate.engine.block_manager import BlockRemoved, BlockStored, KVEvent

BLOCK_SIZE_TOKENS = 16
CHARS_PER_TOKEN = 4
_FILLER_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
                 "bright", "kites", "drift", "past", "quiet", "hills")


def render_chat(messages: Sequence[Mapping[str, object]]) -> str:
    """The canonical prompt of a conversation: every message as role and content, in order.

    Content given as a list of parts keeps only its text parts. The trailing assistant header stands for
    the generation prompt a chat template would add.
    """
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{message.get('role', 'user')}|>\n{content or ''}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def render_completion(prompt: object) -> str:
    """The canonical text of a /v1/completions prompt: a string, a list of strings (joined) or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "".join(p if isinstance(p, str) else f"{p} " for p in prompt)
    return str(prompt)


def num_prompt_tokens(text: str) -> int:
    """ceil(chars / 4), at least 1: 'hello' -> 2."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def block_hashes(text: str, name: str) -> tuple[int, ...]:
    """Chain hashes of the full 64-character blocks of `text`; `name` (model or adapter) seeds the chain."""
    block_chars = BLOCK_SIZE_TOKENS * CHARS_PER_TOKEN
    parent = xxhash.xxh3_64_intdigest(name.encode())
    hashes = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + text[start:start + block_chars].encode())
        hashes.append(parent)
    return tuple(hashes)


def filler_text(index: int) -> str:
    """Output token `index` of every response: deterministic filler words, one word per token."""
    return " " + _FILLER_WORDS[index % len(_FILLER_WORDS)]


class PrefixCache:
    """An LRU set of block hashes holding at most `capacity_blocks`.

    With `record_events`, every change is also recorded as kvgate engine KV events (see the module
    docstring) until `drain_events`; applied in order to an empty set, they give `block_hashes()`."""

    def __init__(self, capacity_blocks: int, record_events: bool = False) -> None:
        self.capacity_blocks = capacity_blocks
        self.record_events = record_events
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self) -> list[int]:
        """Every cached hash, least recently used first: what a fresh KV-event subscriber starts from."""
        return list(self._blocks)

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last drain, oldest first (none without `record_events`)."""
        events, self._events = self._events, []
        return events

    def peek(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached, without touching them."""
        num = 0
        for h in hashes:
            if h not in self._blocks:
                break
            num += 1
        return num

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached; touches them, tail first, so the first block
        is the most recently used (see `insert`)."""
        num = self.peek(hashes)
        for h in reversed(hashes[:num]):
            self._blocks.move_to_end(h)
        return num

    def insert(self, hashes: Sequence[int], adapter: str | None = None) -> None:
        """Add or touch every block of a prompt's chain, tail first, then evict the least recently used
        beyond capacity. Touching the tail first leaves the chain's first block the most recently used, so
        eviction trims a chain from its tail, as vLLM v1 (which frees a request's blocks in reverse order)
        and the kvgate engine do: a conversation squeezed by others loses its last blocks, not its first
        one and with it every block behind it. `adapter` only labels the recorded `BlockStored` events
        (the hashes already cover it)."""
        new = [index for index, h in enumerate(hashes) if h not in self._blocks]  # chain indices joining
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        evicted = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        if self.record_events:
            self._events.extend(stored_events(hashes, new, adapter))
            if evicted:
                self._events.append(BlockRemoved(tuple(evicted)))


def stored_events(chain: Sequence[int], new: Sequence[int], adapter: str | None) -> list[BlockStored]:
    """One BlockStored per run of consecutive indices in `new` (ascending chain indices of blocks that
    joined the cache), each naming the chain's block before the run as parent (None for a first block),
    as the engine's BlockManager reports them: chain [a, b, c, d], new [0, 2, 3] -> ([a], None), ([c, d], b)."""
    events = []
    start = 0
    for i in range(1, len(new) + 1):
        if i < len(new) and new[i] == new[i - 1] + 1:
            continue
        first, last = new[start], new[i - 1]
        events.append(BlockStored(tuple(chain[first:last + 1]), chain[first - 1] if first > 0 else None, adapter,
                                  BLOCK_SIZE_TOKENS))
        start = i
    return events


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class SimSequence:
    """One request inside the scheduler."""

    seq_id: int
    name: str  # the model or adapter it asked for; seeds its block hashes
    num_prompt_tokens: int
    hashes: tuple[int, ...]
    max_tokens: int
    adapter: str | None = None  # labels its KV events (KV-events mode); the hashes already cover it
    state: SeqState = SeqState.WAITING
    num_cached_tokens: int = 0  # known once it first gets prefill budget (`looked_up`)
    looked_up: bool = False
    num_computed_tokens: int = 0  # prompt tokens cached or prefilled so far
    num_generated: int = 0


@dataclass(frozen=True)
class SchedulerSpec:
    """The cost model's knobs; see the module docstring for what each costs."""

    kv_capacity_tokens: int = 32_768
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 50.0  # per running sequence: batching is free up to max_batch
    max_batch: int = 16
    max_prefill_tokens_per_step: int = 2_048  # the prefill chunk shared across the batch in one step
    prefix_caching: bool = True  # False: keeps nothing it computed, as vLLM --no-enable-prefix-caching


@dataclass(frozen=True)
class StepPlan:
    """What one step computes; the shell sleeps `duration_s` and then calls `complete(plan)`."""

    duration_s: float
    prefill: tuple[tuple[int, int], ...]  # (seq_id, prompt tokens computed this step)
    decode: tuple[int, ...]  # seq_ids that get one more token


@dataclass(frozen=True)
class TokenEvent:
    """Output token `index` (0-based) of sequence `seq_id`; `finished` when it was the last."""

    seq_id: int
    index: int
    finished: bool


@dataclass
class SimCounters:
    """Cumulative counts since start, for /metrics and /stats."""

    num_prompt_tokens_queried: int = 0
    num_prompt_tokens_hit: int = 0
    num_generation_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    requests_by_name: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Continuous batching over a prefix cache. Not thread-safe; the shell calls it from one loop."""

    def __init__(self, spec: SchedulerSpec, record_kv_events: bool = False) -> None:
        self.spec = spec
        self.cache = PrefixCache(spec.kv_capacity_tokens // BLOCK_SIZE_TOKENS, record_kv_events)
        self.counters = SimCounters()
        self._waiting: list[SimSequence] = []
        self._running: list[SimSequence] = []
        self._by_id: dict[int, SimSequence] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running_names(self) -> tuple[str, ...]:
        return tuple(sorted({s.name for s in self._running}))

    @property
    def waiting_names(self) -> tuple[str, ...]:
        return tuple(sorted({s.name for s in self._waiting}))

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens queued or in prefill (a sequence not yet looked up counts whole)."""
        return sum(s.num_prompt_tokens - s.num_computed_tokens for s in self._waiting + self._running)

    def cached_tokens_now(self, num_prompt_tokens: int, hashes: Sequence[int]) -> int:
        """The cached tokens a prompt's look-up would find now; touches nothing."""
        return self.cache.peek(hashes[:_matchable_blocks(num_prompt_tokens)]) * BLOCK_SIZE_TOKENS

    def num_cached_tokens(self, seq_id: int) -> int | None:
        """A live sequence's cached tokens (0 until looked up); None once it has ended."""
        seq = self._by_id.get(seq_id)
        return seq.num_cached_tokens if seq is not None else None

    def kv_usage(self) -> float:
        """Fraction of the KV capacity in use, as vLLM's `vllm:kv_cache_usage_perc` counts it: 1 - free
        blocks / capacity, with `num_kv_blocks_free` below (a block several running sequences share is
        used once; cached blocks no running sequence holds are free)."""
        return 1.0 - self.num_kv_blocks_free() / max(1, self.cache.capacity_blocks)

    def num_kv_blocks_free(self) -> int:
        """KV blocks no running sequence holds, as vLLM's block pool and a kvgate engine count them:
        cached prefixes are free (evictable), a full prompt block that several running sequences share
        (same hash) is held once, and each holds private blocks for the rest of its prompt and its output.
        Capacity 64 blocks, two running sequences with the same 40-token prompt (2 full blocks) and 2
        tokens out each -> 64 - 2 - 2 x 1 = 60."""
        shared: set[int] = set()
        private = 0
        for s in self._running:
            shared.update(s.hashes)
            private += math.ceil((s.num_prompt_tokens + s.num_generated) / BLOCK_SIZE_TOKENS) - len(s.hashes)
        return max(0, self.cache.capacity_blocks - len(shared) - private)

    def add(self, seq: SimSequence) -> None:
        self._waiting.append(seq)
        self._by_id[seq.seq_id] = seq
        self.counters.requests_by_name[seq.name] = self.counters.requests_by_name.get(seq.name, 0) + 1

    def abort(self, seq_id: int) -> bool:
        """Drop an unfinished sequence. Idempotent: False when it is unknown or already ended."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return False
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        seq.state = SeqState.ABORTED
        self.counters.num_aborted += 1
        return True

    def schedule(self) -> StepPlan | None:
        """Admit waiting sequences up to `max_batch` and plan one step; None when there is nothing to do."""
        while self._waiting and len(self._running) < self.spec.max_batch:
            self._admit(self._waiting.pop(0))
        budget = self.spec.max_prefill_tokens_per_step
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for seq in self._running:
            if not seq.looked_up and budget > 0:
                self._look_up(seq)
            remaining = seq.num_prompt_tokens - seq.num_computed_tokens
            if remaining == 0:
                decode.append(seq.seq_id)
            elif budget > 0:
                num = min(remaining, budget)
                prefill.append((seq.seq_id, num))
                budget -= num
                if self.spec.prefix_caching:  # cached when scheduled, as vLLM v1 does (module docstring)
                    self.cache.insert(seq.hashes[:(seq.num_computed_tokens + num) // BLOCK_SIZE_TOKENS], seq.adapter)
        if not prefill and not decode:
            return None
        duration_s = sum(n for _, n in prefill) / self.spec.prefill_tokens_per_s
        if decode:
            duration_s += 1.0 / self.spec.decode_tokens_per_s
        return StepPlan(duration_s, tuple(prefill), tuple(decode))

    def complete(self, plan: StepPlan) -> list[TokenEvent]:
        """Apply a planned step; sequences aborted since `schedule` are skipped."""
        events = []
        for seq_id, num in plan.prefill:
            seq = self._by_id.get(seq_id)
            if seq is None:
                continue
            seq.num_computed_tokens += num
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                if self.spec.prefix_caching:
                    self.cache.insert(seq.hashes, seq.adapter)
                events.append(self._emit(seq))
        for seq_id in plan.decode:
            seq = self._by_id.get(seq_id)
            if seq is not None:
                events.append(self._emit(seq))
        return events

    def _admit(self, seq: SimSequence) -> None:
        seq.state = SeqState.RUNNING
        self._running.append(seq)

    def _look_up(self, seq: SimSequence) -> None:
        num_blocks = self.cache.match(seq.hashes[:_matchable_blocks(seq.num_prompt_tokens)])
        seq.looked_up = True
        seq.num_cached_tokens = num_blocks * BLOCK_SIZE_TOKENS
        seq.num_computed_tokens = seq.num_cached_tokens
        self.counters.num_prompt_tokens_queried += seq.num_prompt_tokens
        self.counters.num_prompt_tokens_hit += seq.num_cached_tokens

    def _emit(self, seq: SimSequence) -> TokenEvent:
        index = seq.num_generated
        seq.num_generated += 1
        self.counters.num_generation_tokens += 1
        finished = seq.num_generated >= seq.max_tokens
        if finished:
            seq.state = SeqState.FINISHED
            self._running.remove(seq)
            del self._by_id[seq.seq_id]
            self.counters.num_finished += 1
        return TokenEvent(seq.seq_id, index, finished)


def _matchable_blocks(num_prompt_tokens: int) -> int:
    """Leading blocks a prompt may find cached: never the whole prompt, as the last token is computed to
    produce the first output token."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE_TOKENS
