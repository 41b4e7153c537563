"""Routing policies: pure functions `(RouteRequest, ReplicaView, RoutingKnobs) -> RouteDecision`.

`choose` runs the model's `routing.policy`: `round_robin`, `least_load`, `consistent_hash` (the rendezvous
home of the prompt's opening, within the load bound) or `cache_aware`, the default, which sends a request
where its prompt prefix is cached without piling load on one replica.

Why pure: no I/O, no clock, no mutation, so the same request and view give the same decision in every
gateway, and gateways that share nothing agree. Rendezvous hashing is keyed on request content, and ties
are never broken by list position (a router that does sends distinct sequential prompts all to its first
replica). Views differ between gateways only in their own in-flight counts: load, pending prefill and the
in-flight chains that make a prefix hot (with G gateways a burst counts as hot at a replica once about
G x hot_prefix_requests of its requests are in flight there).

The load bound (consistent hashing with bounded loads, Mirrokni et al. 2016), used by `consistent_hash`
and `cache_aware`: with n candidates whose loads sum to `total`, a replica has room for this request when
load + 1 <= cap, where

    mean_after = (total + 1) / n                        # the mean once this request is placed
    cap = max(floor((1 + epsilon) x mean_after), ceil(mean_after))

This is the registry's "(1 + epsilon) x mean load + 1" made exact: the ceil(mean) term is the "+1" slack
that always leaves the least-loaded replica room (its load is at most floor(total / n), so
load + 1 <= ceil(mean_after)); the floor keeps the maximum within (1 + epsilon) x mean once loads are
large. Worked: 4 replicas, 99 in flight, epsilon 0.25 -> mean_after 25, cap max(floor(31.25), 25) = 31,
so max/mean <= 31 / 25 = 1.24.

`cache_aware` holds the bound as stated for what it exists to spread: new text, and a hot prefix (one that
`hot_prefix_requests` of this gateway's requests in flight at the replica share, e.g. a burst on one system
prompt: other replicas then take and cache it too). For a request whose own cache a replica holds (a
conversation's history, shared by nothing else in flight there) the cap has the floor
`min_load_cap_requests` (an engine batches that many at once, and moving the request costs its history's
prefill), and past it the replica stays a candidate at `over_bound_cost_tokens` per request over, which the
token cost below weighs against that prefill. Why soft: with the bound hard for every request, a replay of
the Mooncake trace (`loadtests/routing_replay.py`) kept 0.920 / 0.837 of the best hit rate at 4 / 16
replicas, against 0.979 / 0.957 soft, at about the same p99.

Requests are a coarse unit (one needs 2,000 prompt tokens prefilled, the next turn of a cached
conversation 40), so within the bound `cache_aware` chooses by a cost in tokens, as what delays a first
token is the prefill queued ahead of it plus its own:

    cost = pending_prefill_tokens + miss_cost_weight x uncached

`pending_prefill_tokens` are the prompt tokens this gateway routed to the replica whose first token has
not come back, counted after its cache; `uncached` is what of this prompt the replica does not hold. With
a weight of 1 this is the replica's time to first token, a greedy choice that gives the cache away at the
first queue; a higher weight also charges a miss for the prefill it costs again later and the
conversation's next turns that find their cache elsewhere (in the Mooncake replay at 4 / 16 replicas,
weight 1 kept 0.75 / 0.54 of the best hit rate, 16 kept 0.93 / 0.87 with a lower p99; the default is 24).
Worked, weight 16: a 1,600-token prompt; replica A holds 1,500 of it and has 2,800 tokens pending (cost
2,800 + 1,600 = 4,400), B holds nothing and has 0 pending (cost 25,600): A. With 24,000 pending on A (cost
25,600) they tie and the score below decides. New text (held nowhere) costs the same everywhere but for
the queues: it goes to the least pending prefill, and on ties (idle replicas) to the rendezvous home of
its opening. It does not also weigh a replica's waiting requests: the gateway sees `num_waiting` up to a
scrape (1 s) late, and in the replay such a weight moved p99 by no more than the seeds' spread. A replica
that reports its KV blocks and has fewer free tokens than the request's uncached part would have to evict
or preempt to start it, so it has no room while another one does.

A replica's cache fills with prefixes worth keeping: those requests came back for (a system prompt,
conversations' histories; the text index counts a chunk recorded again while held as its working set, the
KV-event index a held block that a later request matched, `view.CacheFill`). Uncached tokens that would not
fit beside that working set in `working_set_share` of the replica's KV cache push part of it out, and each
token pushed out is a miss later, so the cost adds `miss_cost_weight x` those tokens
(`evicted_working_set_tokens`). Without it, conversations that new text placed together on idle replicas
stay together as their histories grow, until the engine's LRU trims each one's tail to make room for
another's next turn.

How `cache_aware` compares with sglang-router and vllm-router: docs/benchmarks.md, Routing.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import xxhash

from kvgate.registry.schema import Routing, RoutingPolicy
from kvgate.router.features import RouteRequest
from kvgate.router.view import AdapterFit, CacheFill, ReplicaState, ReplicaView


class Reason(enum.Enum):
    """Why a replica was chosen; one `kvgate_router_decisions_total` label each."""

    PREFIX_HIT = "prefix_hit"  # it holds the longest prefix, within the load bound (or over it, for its own cache)
    ADAPTER_AFFINITY = "adapter_affinity"  # no prefix anywhere; it has the adapter loaded (or a free slot)
    RENDEZVOUS = "rendezvous"  # no prefix, no adapter preference: placed by rendezvous hash
    NEW_TEXT = "new_text"  # held somewhere, too little to count: placed as new text
    LOAD_FALLBACK = "load_fallback"  # the holder of a counted prefix was over the bound or its queue too long
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CONSISTENT_HASH = "consistent_hash"
    NO_REPLICA = "no_replica"  # no healthy, non-draining replica of the model


@dataclass(frozen=True)
class RoutingKnobs:
    """A model's routing settings, from its registry `Routing`."""

    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    load_epsilon: float = 0.25  # the registry's defaults
    min_load_cap: int = 8
    min_match_fraction: float = 0.0
    miss_cost_weight: float = 24.0
    hot_prefix_requests: int = 4
    over_bound_cost_tokens: float = 2000.0
    working_set_share: float = 0.85

    @classmethod
    def from_routing(cls, routing: Routing) -> RoutingKnobs:
        return cls(policy=routing.policy, load_epsilon=routing.load_epsilon,
                   min_load_cap=routing.min_load_cap_requests, min_match_fraction=routing.min_match_fraction,
                   miss_cost_weight=routing.miss_cost_weight, hot_prefix_requests=routing.hot_prefix_requests,
                   over_bound_cost_tokens=routing.over_bound_cost_tokens,
                   working_set_share=routing.working_set_share)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica and why, with the figures behind it (for metrics and /admin/stats)."""

    replica_id: str | None  # None only with Reason.NO_REPLICA
    reason: Reason
    predicted_match_chunks: int = 0  # leading prefix chunks the chosen replica is believed to hold
    adapter_fit: AdapterFit | None = None  # of the chosen replica, for the request's adapter
    load: int = 0  # the chosen replica's load before this request
    load_cap: int = 0  # the load bound's cap (0 where the policy has none)
    num_candidates: int = 0


# The reason calls a request whose replicas all hold the same opening a prefix hit when that opening is
# at least this share of its prompt (a fleet of one; a hot prompt cached everywhere), not for a common
# first block.
HELD_EVERYWHERE_HIT_SHARE = 0.5

PolicyFn = Callable[[RouteRequest, ReplicaView, RoutingKnobs], RouteDecision]


def rendezvous_weight(key: int, replica_id: str) -> int:
    """Highest-random-weight hashing: each replica's weight for a key; the highest wins. xxh64, not
    Python's salted hash(), so every process computes the same weights."""
    return xxhash.xxh64_intdigest(struct.pack("<Q", key) + replica_id.encode())


def load_cap(candidates: tuple[ReplicaState, ...], epsilon: float, floor: int = 1) -> int:
    """The most load a replica may reach by taking this request (see the module docstring), never
    below `floor` (the registry's min_load_cap_requests)."""
    mean_after = (sum(r.load for r in candidates) + 1) / len(candidates)
    return max(math.floor((1 + epsilon) * mean_after), math.ceil(mean_after), floor)


def _decision(request: RouteRequest, view: ReplicaView, chosen: ReplicaState, reason: Reason,
              num_candidates: int, cap: int = 0, match: int | None = None) -> RouteDecision:
    if match is None:
        match = view.match_length(chosen.replica_id, request.prefix_hashes)
    return RouteDecision(replica_id=chosen.replica_id, reason=reason, predicted_match_chunks=match,
                         adapter_fit=chosen.adapter_fit(request.adapter), load=chosen.load,
                         load_cap=cap, num_candidates=num_candidates)


def _no_replica() -> RouteDecision:
    return RouteDecision(replica_id=None, reason=Reason.NO_REPLICA)


def round_robin(request: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
    """Candidate number request_seq mod n, in replica-id order."""
    candidates = view.candidates(request.model)
    if not candidates:
        return _no_replica()
    chosen = candidates[request.request_seq % len(candidates)]
    return _decision(request, view, chosen, Reason.ROUND_ROBIN, len(candidates))


def least_load(request: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
    """The least-loaded candidate; ties go to the highest rendezvous weight of the request's
    affinity key, so idle replicas share distinct prompts instead of the first taking them all."""
    candidates = view.candidates(request.model)
    if not candidates:
        return _no_replica()
    chosen = max(candidates, key=lambda r: (-r.load, rendezvous_weight(request.affinity_key, r.replica_id)))
    return _decision(request, view, chosen, Reason.LEAST_LOAD, len(candidates))


def consistent_hash(request: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
    """Rendezvous hashing of the affinity key (the first chunk), bounded: the highest-weight replica
    with room under the load cap."""
    candidates = view.candidates(request.model)
    if not candidates:
        return _no_replica()
    cap = load_cap(candidates, knobs.load_epsilon, knobs.min_load_cap)
    ranked = sorted(candidates, key=lambda r: rendezvous_weight(request.affinity_key, r.replica_id), reverse=True)
    chosen = next(r for r in ranked if r.load + 1 <= cap)  # the least-loaded always has room
    reason = Reason.CONSISTENT_HASH if chosen is ranked[0] else Reason.LOAD_FALLBACK
    return _decision(request, view, chosen, reason, len(candidates), cap)


def cache_aware_score(request: RouteRequest, replica: ReplicaState, match_chunks: int,
                      key: int | None = None) -> tuple[int, int, int]:
    """cache_aware's preference apart from load, compared lexicographically, higher is better:

    1. match_chunks: the longest counted prefix held wins;
    2. adapter fit: loaded (or no adapter) > free slot > must evict;
    3. rendezvous weight of `key` (default the affinity key; cache_aware passes the key of the text
       after an opening every replica holds): where new text lives, the same in every gateway.
    """
    return (match_chunks, int(replica.adapter_fit(request.adapter)),
            rendezvous_weight(request.affinity_key if key is None else key, replica.replica_id))


def prefill_cost(replica: ReplicaState, uncached_tokens: int, miss_cost_weight: float) -> float:
    """The prefill queued at `replica` plus this request's uncached part, weighted (module docstring)."""
    return replica.pending_prefill_tokens + miss_cost_weight * uncached_tokens


def evicted_working_set_tokens(request: RouteRequest, replica: ReplicaState, fill: CacheFill | None,
                               uncached_tokens: int, share: float) -> int:
    """Tokens of the replica's working set (the prefixes requests came back for there, `CacheFill`) that
    prefilling `uncached_tokens` would push out of its KV cache: what does not fit in `share` of the cache
    beside the working set. 0 where the index cannot tell (fill None) or the replica reports no KV size
    (its index size is a guess). Worked, 121 chunks of 32 tokens, share 0.85: 102 - 95 reused = 7 chunks
    (224 tokens) of room, so an 800-token prompt would push out 576 tokens that requests come back for."""
    if fill is None or replica.kv_blocks_total == 0:
        return 0
    room_chunks = max(0, math.floor(share * fill.capacity_chunks) - fill.reused_chunks)
    tokens_per_chunk = request.hash_tokens or request.chunk_chars / request.chars_per_token
    return max(0, math.ceil(uncached_tokens - room_chunks * tokens_per_chunk))


def _counted_match(request: RouteRequest, match_chunks: int, skip_chunks: int, min_fraction: float) -> int:
    """`match_chunks` (held past the first `skip_chunks`) when they cover at least `min_fraction` of
    the prompt after those chunks, else 0. Worked: a 6,000-char system prompt every replica holds, then
    500 chars of conversation of which one replica holds 450: 450 >= 0.25 x 500, it counts."""
    return match_chunks if request.covers(match_chunks, skip_chunks, min_fraction) else 0


def _kv_fits(replica: ReplicaState, uncached: int) -> bool:
    """Whether the replica's free KV holds the uncached prompt; True when it does not report KV."""
    return replica.kv_blocks_total == 0 or replica.kv_blocks_free * replica.block_size_tokens >= uncached


def is_hot_at(request: RouteRequest, view: ReplicaView, replica_id: str, skip_chunks: int, match_chunks: int,
              min_requests: int) -> bool:
    """Whether the part of this prompt that `replica_id` alone holds (`match_chunks` past the first
    `skip_chunks`, which every candidate holds) is hot there: at least `min_requests` of the gateway's
    requests in flight there share most of it (its first half, rounded up: the last held chunk may
    reach into text only a few share, as a question's first word). A burst on one system prompt is hot
    at its holder; a conversation's history is shared by its own turns only, even behind a long system
    prompt that every replica holds and other conversations in flight share."""
    if match_chunks <= 0:
        return False
    return view.sharing(replica_id, request.prefix_hashes[skip_chunks + (match_chunks + 1) // 2 - 1]) >= min_requests


@dataclass(frozen=True)
class _Holdings:
    """What each candidate holds of one request, as cache_aware weighs it; maps are by replica id."""

    request: RouteRequest
    held: Mapping[str, int]  # leading chunks each holds, counted or not: the KV test and the prediction use it
    held_everywhere: int  # the least of `held`: what every candidate holds
    common: int  # leading chunks that set no replica apart (`_holdings`)
    matches: Mapping[str, int]  # chunks held past `common`, where they count (`_counted_match`), else 0
    key: int  # the affinity key of the text after `common`: where new text goes
    uncached: Mapping[str, int]  # prompt tokens each would prefill
    counted_uncached: Mapping[str, int]  # ... counting as held only `common` and a counted match

    def score(self, replica: ReplicaState) -> tuple[int, int, int]:
        return cache_aware_score(self.request, replica, self.matches[replica.replica_id], self.key)


def _holdings(request: RouteRequest, view: ReplicaView, candidates: tuple[ReplicaState, ...],
              min_match_fraction: float) -> _Holdings:
    held = {r.replica_id: view.match_length(r.replica_id, request.prefix_hashes) for r in candidates}
    held_everywhere = min(held.values())
    # What sets no replica apart: the opening every candidate holds, or nearly every request shares.
    common = max(held_everywhere, min(request.common_opening_chunks, len(request.prefix_hashes)))
    matches = {rid: _counted_match(request, max(0, n - common), common, min_match_fraction)
               for rid, n in held.items()}
    uncached = {rid: request.uncached_tokens(n) for rid, n in held.items()}  # what it would prefill
    # What the cost counts as held: the common opening plus a counted match. A short match that does not
    # count would otherwise still pull new conversations onto whoever holds a common opening
    # (min_match_fraction), one weighted block at a time; and a replica that lacks the opening every
    # request shares would never be chosen while queues are short.
    counted_uncached = {rid: request.uncached_tokens(common + matches[rid]) for rid in held}
    return _Holdings(request, held, held_everywhere, common, matches, request.affinity_key_after(common),
                     uncached, counted_uncached)


def _cache_aware_reason(h: _Holdings, candidates: tuple[ReplicaState, ...], with_room: list[ReplicaState],
                        chosen: ReplicaState) -> Reason:
    """Why cache_aware chose `chosen` among `with_room` (the Reason rules of its docstring)."""
    matches, adapter = h.matches, h.request.adapter
    # The best-scoring candidate overall: it matters only when one holds a counted match, and then only
    # among those holding the longest.
    longest = max(matches.values())
    preferred = max((r for r in candidates if matches[r.replica_id] == longest), key=h.score) if longest else chosen
    if matches[preferred.replica_id] > 0 and chosen is not preferred:
        return Reason.LOAD_FALLBACK
    if matches[chosen.replica_id] > 0 or _counted_match(h.request, h.held_everywhere, 0, HELD_EVERYWHERE_HIT_SHARE):
        return Reason.PREFIX_HIT  # it holds a counted prefix, or every replica does (one replica, say)
    if chosen.adapter_fit(adapter) > min(r.adapter_fit(adapter) for r in with_room):
        return Reason.ADAPTER_AFFINITY
    return Reason.NEW_TEXT if any(h.held.values()) else Reason.RENDEZVOUS


def cache_aware(request: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
    """kvgate's policy: among candidates under the load bound (or over it, at a cost per request over,
    for a request whose cached prefix they hold unless it is hot there: module docstring) with free
    KV for their uncached part (a KV test that no candidate under the bound passes is dropped; the
    bound always leaves one), the lowest `prefill_cost`; ties go to the best `cache_aware_score`.

    A match counts only for the part that sets a replica apart (an opening every candidate holds, or that
    nearly every recent request opens with, `RouteRequest.common_opening_chunks`, says nothing about where
    the rest lives), and only when it covers `min_match_fraction` of the prompt past that opening (0 by
    default: all of it counts). The KV test uses what each replica holds; the
    cost, the tie-break and the reason use the counted match; the cost also weighs the working set a
    replica's uncached part would push out (`evicted_working_set_tokens`). Ties are common at low load
    (nothing pending anywhere): new text then goes by rendezvous of its own opening
    (`affinity_depth_chars` past what every replica holds), the same choice in every gateway.

    Reason: LOAD_FALLBACK when the best-scoring candidate holds a counted prefix and was not chosen
    (over the bound, short of KV, or its queue outweighed the miss); else PREFIX_HIT when the chosen
    one holds a counted prefix, or what every candidate holds is at least HELD_EVERYWHERE_HIT_SHARE of
    the prompt (a fleet of one, or a hot prompt cached everywhere); else ADAPTER_AFFINITY when its
    adapter fit beat another candidate's; else NEW_TEXT when some candidate holds part of the prompt,
    RENDEZVOUS when none does.
    Where it stands against sglang-router and vllm-router: docs/benchmarks.md, Routing."""
    candidates = view.candidates(request.model)
    if not candidates:
        return _no_replica()
    cap = load_cap(candidates, knobs.load_epsilon)
    h = _holdings(request, view, candidates, knobs.min_match_fraction)
    matches, uncached = h.matches, h.uncached
    # The bound holds as stated for new text and for a prefix hot at the replica (the burst spreads,
    # and more replicas cache the prefix). For a request whose own cache a replica holds (a counted
    # match, not hot there) it holds from the floor up, and over it that replica stays a candidate at
    # a cost per request over: moving the request costs its prefill, which the cost weighs.
    own_cap = load_cap(candidates, knobs.load_epsilon, knobs.min_load_cap)
    own = {r.replica_id for r in candidates if matches[r.replica_id] > 0 and not is_hot_at(
        request, view, r.replica_id, h.common, matches[r.replica_id], knobs.hot_prefix_requests)}
    under_cap = [r for r in candidates if r.load + 1 <= (own_cap if r.replica_id in own else cap)]
    eligible = [r for r in candidates if r.replica_id in own or r.load + 1 <= cap]
    # The KV-fit test prefers replicas with free KV for the uncached part, but never sends a request
    # over the bound for it: with no fitting replica under the bound, the cost decides among all.
    fits = {r.replica_id for r in eligible if _kv_fits(r, uncached[r.replica_id])}
    if not any(r.replica_id in fits for r in under_cap):
        fits.update(r.replica_id for r in under_cap)
    with_room = [r for r in eligible if r.replica_id in fits]
    # A token of a replica's working set that this prefill would push out is a miss later: it weighs as one.
    costs = {r.replica_id: prefill_cost(r, h.counted_uncached[r.replica_id], knobs.miss_cost_weight)
             + knobs.miss_cost_weight * evicted_working_set_tokens(
                 request, r, view.cache_fill(r.replica_id), uncached[r.replica_id], knobs.working_set_share)
             + knobs.over_bound_cost_tokens * max(0, r.load + 1 - own_cap) for r in with_room}
    least = min(costs.values())
    cheapest = [r for r in with_room if costs[r.replica_id] == least]
    chosen = cheapest[0] if len(cheapest) == 1 else max(cheapest, key=h.score)  # scores (hashes) only for ties
    reason = _cache_aware_reason(h, candidates, with_room, chosen)
    # predicted_match_chunks is what it holds, counted or not: the prefill estimate and the
    # predicted-vs-realised check need the truth.
    chosen_cap = own_cap if chosen.replica_id in own else cap
    return _decision(request, view, chosen, reason, len(candidates), chosen_cap, h.held[chosen.replica_id])


POLICIES: Mapping[RoutingPolicy, PolicyFn] = MappingProxyType({
    RoutingPolicy.ROUND_ROBIN: round_robin,
    RoutingPolicy.LEAST_LOAD: least_load,
    RoutingPolicy.CONSISTENT_HASH: consistent_hash,
    RoutingPolicy.CACHE_AWARE: cache_aware,
})


def choose(request: RouteRequest, view: ReplicaView, knobs: RoutingKnobs) -> RouteDecision:
    """The decision of the model's policy (`knobs.policy`). Pure; never raises for an empty fleet
    (that is Reason.NO_REPLICA, which the shell turns into queue-then-503)."""
    return POLICIES[knobs.policy](request, view, knobs)
