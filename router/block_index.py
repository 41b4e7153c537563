"""What each kvgate engine replica holds in its prefix cache, exactly, from its own KV block events.

`prefix_index.PrefixIndex` guesses: it records what the gateway sent where and forgets by an LRU sized
to the replica's KV. A kvgate engine says instead. Its WatchState stream (proto/kvgate/v1/replica.proto)
carries `KvBlocksStored` / `KvBlocksRemoved` / `KvBlocksAllCleared` events keyed by the block hash chain
of `kvgate.kv_blocks`, and the gateway computes the same chain over a request's prompt tokens (with the
engine's own tokenizer, see `load_readers.fetch_tokenizer`), so a look-up here is the engine's own look-up,
up to the ~50 ms the stream coalesces. Every gateway reads the same streams, so gateways that share
nothing still agree on where a prefix lives: what the LRU guess could not give them.

What they do not say is which of those blocks requests came back for: the engine's LRU knows, the events
do not. A block a later request routed here matched while the replica held it joins the replica's working set
(`cache_fill`, as the text index counts it), so the working-set cost (`policies.evicted_working_set_tokens`)
applies to engines too; it leaves with the block's removal.

One gap the events cannot close: blocks are reported once computed, so a prompt routed a moment ago
is not yet held anywhere and a burst sharing a new system prompt would scatter. The gateway therefore
adds what it has just routed as *predicted* blocks of that replica, and takes them back at the second
state report after the request ends (`retire`): the first may have been built before the engine
committed the blocks and been read late, the second was built after the request's end was sent.

Mutable state owned by the gateway shell (ReplicaTracker); policies read it through `view.PrefixQuery`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgate.router.view import CacheFill, count_down


@dataclass(frozen=True)
class KvStored:
    """Full blocks newly cached, in chain order (the event as plain values; protobuf stops in load_readers)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvRemoved:
    """Blocks evicted: their hashes no longer hit."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvCleared:
    """The whole cache was dropped; also the start of every stream (a full resync follows)."""


KvEvent = KvStored | KvRemoved | KvCleared


@dataclass(frozen=True)
class BlockStats:
    """Predicted vs realised cached prompt tokens, as `prefix_index.PrefixStats` gives them."""

    num_entries: int  # blocks the replica reported cached
    capacity_chunks: int  # blocks the replica has in all (its KV pool)
    predicted_cached_tokens_total: int
    realised_cached_tokens_total: int
    num_corrections_total: int  # responses that realised fewer tokens than predicted


@dataclass
class BlockIndex:
    """One replica's cached block hashes (from its events) plus this gateway's predictions.

    `synced` is False until the stream's first resync (an `KvCleared`) and again after it drops: an
    index that is not synced says nothing about the replica, and the tracker then routes the model on
    the text index instead."""

    cached: set[int] = field(default_factory=set)
    predicted: Counter[int] = field(default_factory=Counter)
    reused: set[int] = field(default_factory=set)  # cached blocks a later request routed here matched
    retiring: list[tuple[int, ...]] = field(default_factory=list)  # ended; predictions go at the 2nd report
    retiring_next: list[tuple[int, ...]] = field(default_factory=list)  # ...and these at the next one
    synced: bool = False
    capacity_blocks: int = 0
    predicted_tokens: int = 0
    realised_tokens: int = 0
    num_corrections: int = 0

    def apply(self, events: Iterable[KvEvent]) -> None:
        """Apply a state report's events, oldest first; then drop the predictions of requests that ended
        before the previous report (this one was built after they ended, so their blocks are in `cached`
        now if the replica kept them)."""
        for event in events:
            if isinstance(event, KvStored):
                self.cached.update(event.block_hashes)
            elif isinstance(event, KvRemoved):
                self.cached.difference_update(event.block_hashes)
                self.reused.difference_update(event.block_hashes)
            else:
                self.cached.clear()
                self.reused.clear()
                self.synced = True
        for hashes in self.retiring_next:
            self._unpredict(hashes)
        self.retiring_next, self.retiring = self.retiring, []

    def disconnected(self) -> None:
        """The stream dropped: what the replica holds is unknown until the next resync."""
        self.cached.clear()
        self.reused.clear()
        self.synced = False

    def match_length(self, hashes: tuple[int, ...]) -> int:
        """Leading hashes held or predicted; stops at the first miss, as the engine's look-up does."""
        count = 0
        cached, predicted = self.cached, self.predicted
        for block_hash in hashes:
            if block_hash not in cached and block_hash not in predicted:
                break
            count += 1
        return count

    def predict(self, hashes: tuple[int, ...]) -> None:
        """A request with this chain was just routed here: count its blocks as held until it ends. The
        held blocks of its leading match join the working set: a request came back for them."""
        cached, predicted = self.cached, self.predicted
        for block_hash in hashes:
            if block_hash in cached:
                self.reused.add(block_hash)
            elif block_hash not in predicted:
                break
        predicted.update(hashes)

    def cache_fill(self) -> CacheFill | None:
        """The working set against the KV pool, in blocks; None until synced or while the size is unknown."""
        if not self.synced or self.capacity_blocks <= 0:
            return None
        return CacheFill(reused_chunks=len(self.reused), capacity_chunks=self.capacity_blocks)

    def retire(self, hashes: tuple[int, ...]) -> None:
        """The request `predict` counted has ended; its prediction goes at the second state report from
        now (at once while the stream is down: no report is coming to say what the replica kept)."""
        if self.synced:
            self.retiring.append(hashes)
        else:
            self._unpredict(hashes)

    def tally(self, predicted_tokens: int, realised_tokens: int) -> None:
        """A response's cached_tokens against what was predicted at routing time (metrics only: the
        events, not responses, keep this index right)."""
        self.predicted_tokens += predicted_tokens
        self.realised_tokens += realised_tokens
        self.num_corrections += realised_tokens < predicted_tokens

    def stats(self) -> BlockStats:
        return BlockStats(len(self.cached), self.capacity_blocks, self.predicted_tokens, self.realised_tokens,
                          self.num_corrections)

    def _unpredict(self, hashes: tuple[int, ...]) -> None:
        count_down(self.predicted, hashes)


class BlockIndexes:
    """One BlockIndex per replica id; implements `view.PrefixQuery` over KV block chains."""

    def __init__(self) -> None:
        self._by_replica: dict[str, BlockIndex] = {}

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int:
        """0 for a replica without a synced index."""
        index = self._by_replica.get(replica_id)
        return index.match_length(hashes) if index is not None and index.synced else 0

    def get(self, replica_id: str) -> BlockIndex | None:
        return self._by_replica.get(replica_id)

    def cache_fill(self, replica_id: str) -> CacheFill | None:
        """The replica's working set against its KV pool (`BlockIndex.cache_fill`); None when unknown."""
        index = self._by_replica.get(replica_id)
        return index.cache_fill() if index is not None else None

    def is_synced(self, replica_id: str) -> bool:
        index = self._by_replica.get(replica_id)
        return index is not None and index.synced

    def apply(self, replica_id: str, events: Iterable[KvEvent], capacity_blocks: int) -> None:
        index = self._by_replica.setdefault(replica_id, BlockIndex())
        index.capacity_blocks = capacity_blocks
        index.apply(events)

    def disconnected(self, replica_id: str) -> None:
        index = self._by_replica.get(replica_id)
        if index is not None:
            index.disconnected()

    def predict(self, replica_id: str, hashes: tuple[int, ...]) -> BlockIndex:
        """Predict the chain at the replica; returns the index to `retire` it from when the request ends,
        so a replica re-registered under the same id meanwhile (a new index) keeps its own predictions."""
        index = self._by_replica.setdefault(replica_id, BlockIndex())
        index.predict(hashes)
        return index

    def tally(self, replica_id: str, predicted_tokens: int, realised_tokens: int) -> None:
        index = self._by_replica.get(replica_id)
        if index is not None:
            index.tally(predicted_tokens, realised_tokens)

    def forget_replica(self, replica_id: str) -> None:
        self._by_replica.pop(replica_id, None)
