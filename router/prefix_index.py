"""The router's guess of which prompt prefixes each replica holds in its KV cache.

One `PrefixIndex` per replica: an LRU set of chunk hashes (see `router.features`), sized to what the
replica's KV cache can really hold, so the index forgets roughly when the engine evicts. It is mutable
state owned by the gateway shell; policies read it only through `view.PrefixQuery`.

Capacity in chunks = kv_blocks_total x block_size_tokens x chars_per_token // chunk_chars (the
model's learnt ratio, see features.CharsPerToken): 1,000 blocks x 16 tokens x 4 chars/token =
64,000 chars = 250 chunks of 256 chars.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvgate.router.features import CHARS_PER_TOKEN
from kvgate.router.view import CacheFill

# A replica that reports no KV figures (a foreign backend) gets an index this big, in chunks: 16,384 x 256
# chars is ~4M characters (~1M tokens), more than most single replicas' KV (an H100 serving an 8B model in
# bf16 holds ~0.5M tokens), and ~2.4 MB of hashes when full. Too big costs little: what the replica
# evicted and the index still believes costs one miss, which puts it back in the replica. Too small scatters
# conversations the replica still holds. `routing_replay.py --no-kv-size`, the trace at 4 replicas (the
# right size there is 6,299 chunks of 128 chars), six seeds: hit/best 0.532 at 1,024 chunks, 0.929 at 4,096,
# 0.979 at 16,384, as sized right; at 16 replicas (1,574 right) 0.953 at 4,096 and at 16,384.
DEFAULT_CAPACITY_CHUNKS = 16384
# The most chunks one replica's index keeps: ~256M characters at the default cut, some 64M tokens, twice the
# KV of an H200 serving a 135M-parameter model (2M blocks of 16 tokens). A server that reports more gets this,
# so that an absurd figure cannot make an index that never evicts (~150 bytes a chunk: ~150 MB full).
MAX_CAPACITY_CHUNKS = 1 << 20

# A replica is taken not to cache (prefix caching off) when none of its last CACHE_EVIDENCE_WINDOW
# responses that were predicted a hit realised a cached token, and there were at least CACHE_EVIDENCE_MIN
# of them; see `PrefixIndex.correct`.
CACHE_EVIDENCE_WINDOW = 16
CACHE_EVIDENCE_MIN = 4


def capacity_chunks(kv_blocks_total: int, block_size_tokens: int, chunk_chars: int,
                    chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Chunks a replica's KV cache holds; DEFAULT_CAPACITY_CHUNKS when it reports no KV figures, and at
    most MAX_CAPACITY_CHUNKS whatever it reports."""
    if kv_blocks_total <= 0 or block_size_tokens <= 0:
        return DEFAULT_CAPACITY_CHUNKS
    return min(int(kv_blocks_total * block_size_tokens * chars_per_token // chunk_chars), MAX_CAPACITY_CHUNKS)


@dataclass(frozen=True)
class PrefixStats:
    """Predicted vs realised cached prompt tokens, for `kvgate_router_prefix_*` metrics."""

    num_entries: int
    capacity_chunks: int
    predicted_cached_tokens_total: int
    realised_cached_tokens_total: int
    num_corrections_total: int  # responses that realised fewer chunks than predicted


@dataclass(frozen=True)
class CachingJudgement:
    """Whether a replica keeps what it computes (`PrefixIndex.caches`), with the evidence it was judged on."""

    caches: bool
    num_recent_predicted_hits: int  # responses predicted a hit in the evidence window


class PrefixIndex:
    """An LRU of chunk hashes for one replica. Not thread-safe; the shell calls it from one event loop."""

    def __init__(self, capacity_chunks: int, chunk_chars: int) -> None:
        if capacity_chunks < 0 or chunk_chars < 1:
            raise ValueError(f"need capacity_chunks >= 0 and chunk_chars >= 1; got {capacity_chunks}, {chunk_chars}")
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._reused: set[int] = set()  # held chunks a later chain recorded again: the working set
        self._capacity = capacity_chunks
        self._chunk_chars = chunk_chars
        self._predicted_tokens = 0
        self._realised_tokens = 0
        self._num_corrections = 0
        self._recent_hits: deque[bool] = deque(maxlen=CACHE_EVIDENCE_WINDOW)  # predicted a hit: realised any?

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, chunk_hash: int) -> bool:
        return chunk_hash in self._lru

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def chunk_chars(self) -> int:
        return self._chunk_chars

    def match_length(self, hashes: tuple[int, ...]) -> int:
        """Leading hashes present, stopping at the first miss (a chain hash past a miss cannot be a hit
        in the engine either). A read: it does not refresh recency."""
        count = 0
        for chunk_hash in hashes:
            if chunk_hash not in self._lru:
                break
            count += 1
        return count

    def record(self, hashes: tuple[int, ...]) -> None:
        """Note that the replica is about to hold this chain. Inserted deepest first, so the chain's root
        is the most recently used and eviction trims chains from their tail, as the engine does. A chunk
        already held joins the working set (`cache_fill`): a request came back for it."""
        for chunk_hash in reversed(hashes):
            if chunk_hash in self._lru:
                self._lru.move_to_end(chunk_hash)
                self._reused.add(chunk_hash)
            else:
                self._lru[chunk_hash] = None
        self._evict_to(self._capacity)

    def correct(self, hashes: tuple[int, ...], predicted_chunks: int, realised_cached_tokens: int,
                chars_per_token: float = CHARS_PER_TOKEN) -> int:
        """Learn from a response's `cached_tokens` against the chunks predicted at routing time.

        A shortfall from a replica that caches (some of its recent predicted hits realised cached
        tokens) keeps the chain: the engine had evicted it, or another request was still computing it,
        and this request has just computed it again, so the replica now holds it as most recently used.
        Dropping it would send the next identical prompt elsewhere, to miss there too. A replica that
        realises nothing (prefix caching off, a backend that reports 0) does not hold what it computes,
        so the chain is dropped: a later identical prompt scores as the new text it is there. Realised
        chunks round up (ceil(tokens x 4 / chunk_chars)), because engines cache whole blocks only and the
        token/char ratio is an estimate: 300 tokens at 4 chars per token, 256-char chunks -> ceil(1200 /
        256) = 5 chunks, no shortfall against 5 predicted. Returns the number of hashes dropped.

        Replayed against dropping the chain on every shortfall (`loadtests/routing_replay.py`, six seeds):
        hot_prefix at 16 replicas 0.912 -> 0.935 of the best hit rate (a burst on a new prompt realises 0
        on the requests prefilled together, and dropping their chain scattered the next burst), 0.905 ->
        0.925 where replicas report no KV size; the other cells within 0.003."""
        predicted_chunks = min(predicted_chunks, len(hashes))
        self._predicted_tokens += int(predicted_chunks * self._chunk_chars / chars_per_token)
        self._realised_tokens += realised_cached_tokens
        if predicted_chunks > 0:
            self._recent_hits.append(realised_cached_tokens > 0)
        realised_chunks = math.ceil(realised_cached_tokens * chars_per_token / self._chunk_chars)
        if realised_chunks >= predicted_chunks:
            return 0
        self._num_corrections += 1
        if self.caches():
            return 0
        dropped = [chunk_hash for chunk_hash in hashes if chunk_hash in self._lru]
        for chunk_hash in dropped:
            del self._lru[chunk_hash]
        self._reused.difference_update(dropped)
        return len(dropped)

    def caches(self) -> bool:
        """Whether the replica keeps what it computes: any of its last CACHE_EVIDENCE_WINDOW responses
        that were predicted a hit realised cached tokens. Assumed until at least CACHE_EVIDENCE_MIN such
        responses have come back, all with nothing."""
        return len(self._recent_hits) < CACHE_EVIDENCE_MIN or any(self._recent_hits)

    @property
    def num_recent_predicted_hits(self) -> int:
        """Responses in the evidence window `caches` judges by (those that were predicted a hit)."""
        return len(self._recent_hits)

    def resize(self, capacity_chunks: int) -> None:
        """New capacity (the replica reported a different KV size); shrinking evicts the oldest."""
        if capacity_chunks < 0:
            raise ValueError(f"capacity_chunks must be >= 0; got {capacity_chunks}")
        self._capacity = capacity_chunks
        self._evict_to(capacity_chunks)

    def cache_fill(self) -> CacheFill:
        return CacheFill(reused_chunks=len(self._reused), capacity_chunks=self._capacity)

    def stats(self) -> PrefixStats:
        return PrefixStats(len(self._lru), self._capacity, self._predicted_tokens,
                           self._realised_tokens, self._num_corrections)

    def _evict_to(self, capacity: int) -> None:
        while len(self._lru) > capacity:
            self._reused.discard(self._lru.popitem(last=False)[0])


class PrefixIndexes:
    """One PrefixIndex per replica id; implements `view.PrefixQuery` for the policies.

    Each index has its own chunk size: a replica's is its model's `routing.prefix_chunk_chars` (the
    size the request's hash chain was cut at), given to `ensure`. `chunk_chars` here is only the default
    for a replica that `record` meets before any `ensure`."""

    def __init__(self, chunk_chars: int) -> None:
        self._chunk_chars = chunk_chars
        self._by_replica: dict[str, PrefixIndex] = {}

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int:
        """0 for a replica never seen."""
        index = self._by_replica.get(replica_id)
        return index.match_length(hashes) if index is not None else 0

    def ensure(self, replica_id: str, kv_blocks_total: int, block_size_tokens: int,
               chunk_chars: int | None = None, chars_per_token: float = CHARS_PER_TOKEN,
               caches: bool = True) -> PrefixIndex:
        """The replica's index, created or resized to its reported KV capacity, in chunks of
        `chunk_chars` (default: the constructor's); capacity 0 where the replica says it `caches` nothing
        (vLLM's enable_prefix_caching="False"), so it never predicts a hit there. Idempotent. A new chunk
        size (the model's prefix_chunk_chars changed on reload) starts an empty index: hashes of other cuts
        never match."""
        chunk_chars = chunk_chars or self._chunk_chars
        capacity = capacity_chunks(kv_blocks_total, block_size_tokens, chunk_chars, chars_per_token) if caches else 0
        index = self._by_replica.get(replica_id)
        if index is None or index.chunk_chars != chunk_chars:
            index = self._by_replica[replica_id] = PrefixIndex(capacity, chunk_chars)
        elif index.capacity != capacity:
            index.resize(capacity)
        return index

    def get(self, replica_id: str) -> PrefixIndex | None:
        return self._by_replica.get(replica_id)

    def record(self, replica_id: str, hashes: tuple[int, ...]) -> None:
        """Record a routed chain; a replica without an index gets one of the default size."""
        index = self._by_replica.get(replica_id)
        if index is None:
            index = self._by_replica[replica_id] = PrefixIndex(DEFAULT_CAPACITY_CHUNKS, self._chunk_chars)
        index.record(hashes)

    def correct(self, replica_id: str, hashes: tuple[int, ...], predicted_chunks: int,
                realised_cached_tokens: int, chars_per_token: float = CHARS_PER_TOKEN) -> int:
        """As PrefixIndex.correct; 0 for a replica already forgotten."""
        index = self._by_replica.get(replica_id)
        if index is None:
            return 0
        return index.correct(hashes, predicted_chunks, realised_cached_tokens, chars_per_token)

    def learn(self, replica_id: str, hashes: tuple[int, ...], predicted_chunks: int, realised_cached_tokens: int,
              chars_per_token: float = CHARS_PER_TOKEN) -> CachingJudgement | None:
        """As `correct`; the replica's caching judgement when this answer changed it, else None (also for a
        replica already forgotten)."""
        index = self._by_replica.get(replica_id)
        if index is None:
            return None
        cached_before = index.caches()
        index.correct(hashes, predicted_chunks, realised_cached_tokens, chars_per_token)
        if index.caches() == cached_before:
            return None
        return CachingJudgement(index.caches(), index.num_recent_predicted_hits)

    def cache_fill(self, replica_id: str) -> CacheFill | None:
        """The replica's working set against its capacity; None for a replica never seen."""
        index = self._by_replica.get(replica_id)
        return index.cache_fill() if index is not None else None

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica's index (it left, or restarted with an empty cache). Succeeds if unknown."""
        self._by_replica.pop(replica_id, None)

    def replica_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_replica))
