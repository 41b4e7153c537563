"""Routing policies: pure `choose(request, view, knobs)`; every behaviour on hand-built fleets."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvgate.registry.schema import Routing, RoutingPolicy
from kvgate.router.features import RouteRequest, build_route_request
from kvgate.router.policies import POLICIES, Reason, RoutingKnobs, choose, load_cap
from kvgate.router.prefix_index import PrefixIndexes
from kvgate.router.view import AdapterFit, CacheFill, InFlightChains, ReplicaState, ReplicaView

CHUNK = 64
HOT_SYSTEM = "You are the support bot of a large shop. Answer politely and briefly. " * 10  # 700 chars
ALL_POLICIES = list(RoutingPolicy)


def replica(replica_id: str, *, load: int = 0, model: str = "m", healthy: bool = True, draining: bool = False,
            adapters: tuple[str, ...] = (), max_adapters: int = 2) -> ReplicaState:
    return ReplicaState(replica_id=replica_id, url=f"http://{replica_id}", model=model, healthy=healthy,
                        draining=draining, in_flight=load, kv_blocks_total=1024, kv_blocks_free=1024,
                        adapters_loaded=frozenset(adapters), max_loaded_adapters=max_adapters)


def fleet(n: int) -> list[ReplicaState]:
    return [replica(f"r{i}") for i in range(n)]


def request(prompt: str, seq: int = 0, adapter: str | None = None) -> RouteRequest:
    return build_route_request({"prompt": prompt}, "m", adapter, CHUNK, seq)


def knobs(policy: RoutingPolicy, epsilon: float = 0.25, min_load_cap: int = 1) -> RoutingKnobs:
    """Epsilon 0.25 and no floor under the cap: the worked numbers below exercise the bound itself. A
    prefix is hot at 2 requests in flight sharing it (the default is 4), so the cases stay small, and a
    miss weighs 16 (the default is 24)."""
    return RoutingKnobs(policy=policy, load_epsilon=epsilon, min_load_cap=min_load_cap, hot_prefix_requests=2,
                        miss_cost_weight=16.0)


class Gateway:
    """A gateway's routing loop without I/O: route, record the chain, count the request (and its chain)
    in flight."""

    def __init__(self, replicas: list[ReplicaState], policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE) -> None:
        self.replicas = {r.replica_id: r for r in replicas}
        self.indexes = PrefixIndexes(CHUNK)
        self.in_flight_chains = InFlightChains()
        self.knobs = knobs(policy)

    def route(self, req: RouteRequest, *, stays_in_flight: bool) -> str:
        view = ReplicaView.of(self.replicas.values(), self.indexes, self.in_flight_chains)
        decision = choose(req, view, self.knobs)
        assert decision.replica_id is not None
        self.indexes.record(decision.replica_id, req.prefix_hashes)
        if stays_in_flight:
            chosen = self.replicas[decision.replica_id]
            self.replicas[decision.replica_id] = replace(chosen, in_flight=chosen.in_flight + 1)
            self.in_flight_chains.add(decision.replica_id, req.prefix_hashes)
        return decision.replica_id


def sharing_at(replica_id: str, req: RouteRequest, count: int) -> InFlightChains:
    """`count` requests in flight at `replica_id` whose chains are `req`'s: its prefix is hot there."""
    chains = InFlightChains()
    for _ in range(count):
        chains.add(replica_id, req.prefix_hashes)
    return chains


def test_every_registry_policy_has_a_function() -> None:
    assert set(POLICIES) == set(RoutingPolicy)
    assert RoutingKnobs.from_routing(Routing(policy="least_load", load_epsilon=0.5)) == RoutingKnobs(
        policy=RoutingPolicy.LEAST_LOAD, load_epsilon=0.5, min_load_cap=8)  # the registry's defaults are the knobs'
    tuned = RoutingKnobs.from_routing(Routing(hot_prefix_requests=5, over_bound_cost_tokens=123.0,
                                              working_set_share=0.5))
    assert (tuned.hot_prefix_requests, tuned.over_bound_cost_tokens, tuned.working_set_share) == (5, 123.0, 0.5)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_no_candidate_means_no_replica(policy: RoutingPolicy) -> None:
    view = ReplicaView.of([replica("a", healthy=False), replica("b", draining=True), replica("c", model="other")])
    decision = choose(request("x" * 200), view, knobs(policy))
    assert decision.replica_id is None and decision.reason is Reason.NO_REPLICA


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_draining_and_unhealthy_replicas_are_never_chosen(policy: RoutingPolicy) -> None:
    # the sick ones are idle and hold the prefix; the healthy one is busy: still the healthy one
    replicas = [replica("a", healthy=False), replica("b", draining=True), replica("c", load=50)]
    indexes = PrefixIndexes(CHUNK)
    req = request(HOT_SYSTEM)
    for rid in ("a", "b"):
        indexes.record(rid, req.prefix_hashes)
    for seq in range(20):
        decision = choose(replace(req, request_seq=seq), ReplicaView.of(replicas, indexes), knobs(policy))
        assert decision.replica_id == "c"


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_while_fair_queuing_holds_places_a_request_goes_where_one_is_free(policy: RoutingPolicy) -> None:
    # a holds the prompt and is within the load bound (16 and 15 of 16 each), but every place there is taken
    replicas = [replace(replica("a", load=16), places=16.0), replace(replica("b", load=15), places=16.0)]
    indexes = PrefixIndexes(CHUNK)
    req = request(HOT_SYSTEM)
    indexes.record("a", req.prefix_hashes)
    for seq in range(8):
        decision = choose(replace(req, request_seq=seq), ReplicaView.of(replicas, indexes), knobs(policy))
        assert decision.replica_id == "b"
    # every place taken (more gateways, or stale counts): the policy chooses among all of them as before
    full = [replace(r, in_flight=16) for r in replicas]
    assert choose(req, ReplicaView.of(full, indexes), knobs(RoutingPolicy.CACHE_AWARE)).replica_id == "a"


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_place_in_a_shown_batch_goes_before_a_probe_place(policy: RoutingPolicy) -> None:
    # a has 16 in flight and a probe place (17); b has 15 of its 16: b's place is in a batch it has shown
    replicas = [replace(replica("a", load=16), places=17.0, probe=True), replace(replica("b", load=15), places=16.0)]
    indexes = PrefixIndexes(CHUNK)
    req = request(HOT_SYSTEM)
    indexes.record("a", req.prefix_hashes)
    for seq in range(8):
        assert choose(replace(req, request_seq=seq), ReplicaView.of(replicas, indexes), knobs(policy)).replica_id == "b"
    # b full too: the probe place is the one place left
    full = [replicas[0], replace(replicas[1], in_flight=16)]
    assert all(choose(replace(req, request_seq=seq), ReplicaView.of(full, indexes), knobs(policy)).replica_id == "a"
               for seq in range(8))


def test_round_robin_cycles_in_replica_id_order() -> None:
    view = ReplicaView.of([replica("r2"), replica("r0"), replica("r1", load=9)])
    chosen = [choose(request("same", seq), view, knobs(RoutingPolicy.ROUND_ROBIN)).replica_id for seq in range(6)]
    assert chosen == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_load_picks_the_minimum() -> None:
    view = ReplicaView.of([replica("a", load=3), replica("b", load=1), replica("c", load=2)])
    decision = choose(request("p"), view, knobs(RoutingPolicy.LEAST_LOAD))
    assert (decision.replica_id, decision.reason, decision.load) == ("b", Reason.LEAST_LOAD, 1)


def test_load_takes_the_larger_of_own_in_flight_and_engine_queue() -> None:
    # 3 in flight here; the engine says 2 waiting + 4 running (other gateways' too) -> 6
    state = replace(replica("a", load=3), num_waiting=2, num_running=4)
    assert state.load == 6


@pytest.mark.parametrize("policy", [RoutingPolicy.CACHE_AWARE, RoutingPolicy.LEAST_LOAD, RoutingPolicy.CONSISTENT_HASH])
def test_distinct_sequential_prompts_on_idle_replicas_spread(policy: RoutingPolicy) -> None:
    # sglang-router: 12 of 12 on worker 0. Sequential: each finishes before the next, replicas stay idle.
    gateway = Gateway(fleet(4), policy)
    placed = Counter(gateway.route(request(f"prompt number {i}: " + "z" * 100, i), stays_in_flight=False)
                     for i in range(12))
    assert len(placed) >= 3 and max(placed.values()) <= 6


@pytest.mark.parametrize("holder_load,holds_it", [
    # others at 2 each. holder 2: mean_after (2 + 6 + 1) / 4 = 2.25, cap max(floor(2.81), 3) = 3, 2 + 1 <= 3
    (2, True),
    # holder 3: mean_after 2.5, cap max(floor(3.125), 3) = 3, 3 + 1 > 3: over the bound
    (3, False),
    # holder 4: mean_after 2.75, cap max(floor(3.44), 3) = 3
    (4, False),
])
def test_a_hot_prefix_goes_to_the_replica_holding_it_within_the_bound(holder_load: int, holds_it: bool) -> None:
    # two of the holder's requests in flight share the prompt: it is hot there, and the bound holds
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    loads = {rid: holder_load if rid == holder else 2 for rid in gateway.replicas}
    view = ReplicaView.of([replace(r, in_flight=loads[rid]) for rid, r in gateway.replicas.items()], gateway.indexes,
                          sharing_at(holder, request(HOT_SYSTEM + "question 0"), 2))
    decision = choose(request(HOT_SYSTEM + "question 1"), view, knobs(RoutingPolicy.CACHE_AWARE))
    if holds_it:
        # 710 chars -> 11 chunks; the 11th (chars 640..703) ends in "ques", common to both questions
        assert (decision.replica_id, decision.reason, decision.predicted_match_chunks) == (holder, Reason.PREFIX_HIT, 11)
    else:
        assert decision.replica_id != holder and decision.reason is Reason.LOAD_FALLBACK
        assert decision.load_cap == 3


def test_a_hot_prefix_under_100_concurrent_requests_stays_within_the_bound() -> None:
    # sglang-router split this 76/12/12. Nothing finishes: every request stays in flight.
    gateway = Gateway(fleet(4))
    placed = Counter(gateway.route(request(HOT_SYSTEM + f"user {i}", i), stays_in_flight=True) for i in range(100))
    mean = 100 / 4
    # final cap: mean_after 25, max(floor(31.25), 25) = 31 -> max/mean <= 1.24
    assert max(placed.values()) / mean <= 1.25
    assert len(placed) == 4


@pytest.mark.parametrize("loads,epsilon,cap", [
    ((0, 0, 0, 0), 0.25, 1),  # mean_after 0.25: floor(0.31) = 0, ceil = 1 -> idle replicas have room
    ((1, 1, 1, 1), 0.25, 2),  # mean_after 1.25: floor(1.56) = 1, ceil = 2
    ((25, 25, 25, 24), 0.25, 31),  # mean_after 25: floor(31.25) = 31
    ((10, 0), 0.0, 6),  # mean_after 5.5: epsilon 0 -> ceil(5.5) = 6
])
def test_load_cap(loads: tuple[int, ...], epsilon: float, cap: int) -> None:
    assert load_cap(tuple(replica(f"r{i}", load=x) for i, x in enumerate(loads)), epsilon) == cap


def test_under_the_floor_a_holder_keeps_its_own_cache_but_not_a_hot_prefix() -> None:
    # 4 replicas, the holder has 3 in flight, the others 1: mean_after 1.75, epsilon 0.25 -> cap
    # max(floor(2.19), 2) = 2. The next turn's prompt is 178 tokens, 2 of them not at the holder.
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    loads = [replace(r, in_flight=3 if rid == holder else 1) for rid, r in gateway.replicas.items()]
    req = request(HOT_SYSTEM + "question 1")
    # Its load is other traffic: 3 + 1 - 2 = 2 over the bound, 16 x 2 + 2 x 2,000 against a miss
    # elsewhere of 16 x 178 = 2,848: it spills.
    view = ReplicaView.of(loads, gateway.indexes)
    spilled = choose(req, view, knobs(RoutingPolicy.CACHE_AWARE))
    assert spilled.replica_id != holder and spilled.reason is Reason.LOAD_FALLBACK
    # With min_load_cap 4, a replica holding a request's own cache is not over the bound for it below
    # 4 in flight (an engine batches 4 at once: spilling would only cost a prefill elsewhere).
    kept = choose(req, view, knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=4))
    assert (kept.replica_id, kept.reason, kept.load_cap) == (holder, Reason.PREFIX_HIT, 4)
    # The floor is not for a hot prefix: with its 3 requests in flight all on this prompt, it spreads.
    hot = ReplicaView.of(loads, gateway.indexes, sharing_at(holder, request(HOT_SYSTEM + "question 0"), 3))
    moved = choose(req, hot, knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=4))
    assert moved.replica_id != holder and moved.reason is Reason.LOAD_FALLBACK and moved.load_cap == 2


@pytest.mark.parametrize("holder_load,stays", [
    # others at 2. The next turn's prompt is 178 tokens (710 chars / 4), of which the holder lacks 2:
    # its cost 16 x 2 + 2,000 x (requests over the bound), anywhere else 16 x 178 = 2,848.
    (3, True),  # cap 3 (worked above), 3 + 1 - 3 = 1 over: 32 + 2,000 < 2,848
    (4, False),  # cap 3, 2 over: 32 + 4,000 > 2,848: the queue outweighs the miss
])
def test_a_conversation_stays_with_its_cache_over_the_bound_until_the_queue_outweighs_the_miss(
        holder_load: int, stays: bool) -> None:
    # the holder's load is other traffic: no request in flight there shares this conversation's prefix
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    view = ReplicaView.of([replace(r, in_flight=holder_load if rid == holder else 2)
                           for rid, r in gateway.replicas.items()], gateway.indexes)
    decision = choose(request(HOT_SYSTEM + "question 1"), view, knobs(RoutingPolicy.CACHE_AWARE))
    assert holder_load + 1 > decision.load_cap  # the holder is over the bound in every case
    if stays:
        assert (decision.replica_id, decision.reason) == (holder, Reason.PREFIX_HIT)
    else:
        assert decision.replica_id != holder and decision.reason is Reason.LOAD_FALLBACK
    hard = replace(knobs(RoutingPolicy.CACHE_AWARE), over_bound_cost_tokens=1e9)
    assert choose(request(HOT_SYSTEM + "question 1"), view, hard).replica_id != holder


@pytest.mark.parametrize("sharing,stays", [(0, True), (1, True), (2, False), (5, False)])
def test_a_prefix_is_hot_at_two_requests_in_flight_sharing_it_and_then_the_bound_holds(sharing: int, stays: bool) -> None:
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    view = ReplicaView.of([replace(r, in_flight=3 if rid == holder else 2) for rid, r in gateway.replicas.items()],
                          gateway.indexes, sharing_at(holder, request(HOT_SYSTEM + "question 0"), sharing))
    decision = choose(request(HOT_SYSTEM + "question 1"), view, knobs(RoutingPolicy.CACHE_AWARE))
    assert (decision.replica_id == holder) is stays


@pytest.mark.parametrize("sharing,stays", [(3, True), (4, False)])
def test_by_default_a_prefix_is_hot_at_four_requests_in_flight_sharing_it(sharing: int, stays: bool) -> None:
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    view = ReplicaView.of([replace(r, in_flight=4 if rid == holder else 2) for rid, r in gateway.replicas.items()],
                          gateway.indexes, sharing_at(holder, request(HOT_SYSTEM + "question 0"), sharing))
    # 4 + 6 + 1 = 11 after this one, cap max(floor(1.25 x 2.75), 3) = 3: the holder is over it; below the
    # floor of 8 it keeps the request while the prefix is not hot there
    decision = choose(request(HOT_SYSTEM + "question 1"), view, RoutingKnobs.from_routing(Routing()))
    assert (decision.replica_id == holder) is stays


def test_a_hot_prefix_counts_as_hot_when_the_held_tail_reaches_into_rarer_text() -> None:
    # The holder holds 11 chunks of "question 1"'s chain (its 11th reaches "ques", from an earlier
    # "question 0"); the 5 requests in flight there are other questions on the same system prompt,
    # sharing its first 10 chunks but not the 11th. Hot all the same: they share most of what it holds.
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    in_flight = InFlightChains()
    for i in range(5):
        other = request(HOT_SYSTEM + f"another thing {i}")
        assert other.prefix_hashes[9] == request(HOT_SYSTEM + "question 1").prefix_hashes[9]
        assert other.prefix_hashes[10] != request(HOT_SYSTEM + "question 1").prefix_hashes[10]
        in_flight.add(holder, other.prefix_hashes)
    view = ReplicaView.of([replace(r, in_flight=5 if rid == holder else 2) for rid, r in gateway.replicas.items()],
                          gateway.indexes, in_flight)
    decision = choose(request(HOT_SYSTEM + "question 1"), view, knobs(RoutingPolicy.CACHE_AWARE))
    assert decision.replica_id != holder and decision.reason is Reason.LOAD_FALLBACK


def test_a_system_prompt_every_replica_holds_does_not_make_a_conversation_hot() -> None:
    # Every replica holds a long system prompt; a holds this conversation's history past it. Two other
    # conversations in flight at a share only the system prompt: the conversation is not hot there and
    # keeps the floor (8) for its own cache instead of spilling at the bound (cap 4 at loads 4/3/3/3).
    system = "You are a helpful assistant with a long policy. " * 30  # 23 chunks
    history = "user: my conversation history about topic X. " * 8
    indexes = PrefixIndexes(CHUNK)
    for rid in "abcd":
        indexes.record(rid, request(system + "other").prefix_hashes)
    indexes.record("a", request(system + history).prefix_hashes)
    in_flight = InFlightChains()
    for k in range(2):
        in_flight.add("a", request(system + f"unrelated conversation {k} " * 5).prefix_hashes)
    replicas = [replica("a", load=4)] + [replica(rid, load=3) for rid in "bcd"]
    decision = choose(request(system + history + "next turn"), ReplicaView.of(replicas, indexes, in_flight),
                      knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=8))
    assert (decision.replica_id, decision.reason, decision.load_cap) == ("a", Reason.PREFIX_HIT, 8)
    # ...while two in flight that share its history make it hot: the bound itself then holds
    hot = InFlightChains()
    for _ in range(2):
        hot.add("a", request(system + history + "another turn").prefix_hashes)
    decision = choose(request(system + history + "next turn"), ReplicaView.of(replicas, indexes, hot),
                      knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=8))
    assert decision.replica_id != "a" and decision.reason is Reason.LOAD_FALLBACK and decision.load_cap == 4


def test_new_text_never_goes_over_the_bound() -> None:
    # nothing of this prompt is held anywhere: the over-bound replica is idle in tokens, the others are
    # not, but the bound rules it out (only a held cache earns the exception)
    replicas = [replace(replica("a", load=6)), replace(replica("b", load=1), pending_prefill_tokens=5000),
                replace(replica("c", load=1), pending_prefill_tokens=5000)]
    for floor in (1, 8):  # the floor is for a request's own cache, not for new text
        decision = choose(request("brand new text " * 20), ReplicaView.of(replicas),
                          knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=floor))
        assert decision.replica_id in ("b", "c") and decision.load_cap == 3


def test_the_kv_test_never_sends_a_request_over_the_bound() -> None:
    # under the bound, b and c lack free KV for the prompt; a holds the prefix but is over the bound
    # with the prefix hot there: the KV test is dropped rather than breaking the bound
    req = request(HOT_SYSTEM + "question 1")
    indexes = PrefixIndexes(CHUNK)
    indexes.record("a", request(HOT_SYSTEM + "question 0").prefix_hashes)
    full = dict(kv_blocks_total=1024, kv_blocks_free=0)
    replicas = [replica("a", load=6), replace(replica("b", load=1), **full), replace(replica("c", load=1), **full)]
    view = ReplicaView.of(replicas, indexes, sharing_at("a", req, 2))
    assert choose(req, view, knobs(RoutingPolicy.CACHE_AWARE)).replica_id in ("b", "c")
    # not hot at a, which is 7 over its bound (loads 12, 1, 1: cap 6): it could take the request, but
    # its cost (16 x 2 + 2,000 x 7) is above a miss elsewhere (16 x 178): the KV test alone must not pick it
    far_over = ReplicaView.of([replica("a", load=12), *replicas[1:]], indexes)
    assert choose(req, far_over, knobs(RoutingPolicy.CACHE_AWARE)).replica_id in ("b", "c")


def test_in_flight_chains_count_requests_per_replica_and_hash() -> None:
    chains = InFlightChains()
    first = chains.add("a", (1, 2, 3))
    second = chains.add("a", (1, 2, 9))
    chains.add("b", (1,))
    assert [chains.sharing("a", h) for h in (1, 2, 3, 9, 7)] == [2, 2, 1, 1, 0]
    first.release()
    first.release()  # once only
    assert [chains.sharing("a", h) for h in (1, 2, 3)] == [1, 1, 0] and chains.sharing("b", 1) == 1
    chains.forget_replica("a")  # it left and came back under the same id
    third = chains.add("a", (1, 2))
    second.release()  # sent to the old one: takes nothing from the new one's counts
    assert [chains.sharing("a", h) for h in (1, 2, 9)] == [1, 1, 0]
    third.release()
    chains.forget_replica("b")
    assert chains.sharing("a", 1) == chains.sharing("b", 1) == chains.num_hashes("a") == 0


def test_two_gateways_sharing_nothing_agree_on_repeated_prefixes_below_the_load_bound() -> None:
    # each gateway has its own index and its own in-flight counts; 40 system prompts, each sent 5 times
    # to both, interleaved with unrelated traffic that differs per gateway
    one, two = Gateway(fleet(4)), Gateway(fleet(4))
    agree = total = 0
    for round_ in range(5):
        for p in range(40):
            system = f"system prompt {p}: " + "s" * 150
            one.route(request(f"noise {round_} {p} " + "n" * 100), stays_in_flight=False)
            a = one.route(request(system + f"turn {round_}"), stays_in_flight=False)
            b = two.route(request(system + f"turn {round_} other user"), stays_in_flight=False)
            agree += a == b
            total += 1
    assert agree / total >= 0.95


def test_consistent_hash_keeps_a_prefix_on_one_replica_and_falls_back_over_the_cap() -> None:
    replicas = fleet(4)
    req = request(HOT_SYSTEM)
    home = choose(req, ReplicaView.of(replicas), knobs(RoutingPolicy.CONSISTENT_HASH))
    assert home.reason is Reason.CONSISTENT_HASH
    assert choose(request(HOT_SYSTEM + "other tail"), ReplicaView.of(replicas),
                  knobs(RoutingPolicy.CONSISTENT_HASH)).replica_id == home.replica_id
    busy = [replace(r, in_flight=5) if r.replica_id == home.replica_id else r for r in replicas]
    # loads 5, 0, 0, 0: mean_after 1.5, cap max(floor(1.875), 2) = 2 -> home has no room
    fallback = choose(req, ReplicaView.of(busy), knobs(RoutingPolicy.CONSISTENT_HASH))
    assert fallback.replica_id != home.replica_id and fallback.reason is Reason.LOAD_FALLBACK


@pytest.mark.parametrize("states,expected,reason", [
    # adapter loaded > free slot > must evict
    ((("a", ("x", "y")), ("b", ("sql",)), ("c", ())), "b", Reason.ADAPTER_AFFINITY),
    ((("a", ("x", "y")), ("c", ("x",))), "c", Reason.ADAPTER_AFFINITY),  # c has a free slot, a must evict
])
def test_adapter_affinity_ordering(states: tuple, expected: str, reason: Reason) -> None:
    view = ReplicaView.of([replica(rid, adapters=loaded) for rid, loaded in states])
    for i in range(10):  # whatever the rendezvous order of the prompt
        decision = choose(request(f"prompt {i} " + "q" * 80, i, adapter="sql"), view, knobs(RoutingPolicy.CACHE_AWARE))
        assert (decision.replica_id, decision.reason) == (expected, reason)


def test_adapter_fit_of_a_replica() -> None:
    state = replica("a", adapters=("x",), max_adapters=2)
    assert state.adapter_fit(None) is AdapterFit.LOADED
    assert state.adapter_fit("x") is AdapterFit.LOADED
    assert state.adapter_fit("y") is AdapterFit.FREE_SLOT
    assert replace(state, max_loaded_adapters=1).adapter_fit("y") is AdapterFit.MUST_EVICT


def test_a_prefix_match_outranks_adapter_fit_and_rendezvous() -> None:
    indexes = PrefixIndexes(CHUNK)
    req = request(HOT_SYSTEM, adapter="sql")
    view_replicas = [replica("a", adapters=("sql",)), replica("b", adapters=("sql",))]
    rendezvous_home = choose(req, ReplicaView.of(view_replicas), knobs(RoutingPolicy.CACHE_AWARE)).replica_id
    other = "b" if rendezvous_home == "a" else "a"
    indexes.record(other, req.prefix_hashes[:6])  # 6 x 64 = 384 of 700 chars: over half, it counts
    decision = choose(req, ReplicaView.of(view_replicas, indexes), knobs(RoutingPolicy.CACHE_AWARE))
    assert (decision.replica_id, decision.reason, decision.predicted_match_chunks) == (other, Reason.PREFIX_HIT, 6)


def test_new_text_goes_to_the_least_pending_prefill_and_on_ties_to_its_rendezvous_home() -> None:
    # Every conversation opens with one shared chunk (as every Mooncake request opens with block 0).
    # All replicas hold it, so it sets none apart: a new conversation is new text. It costs the same
    # everywhere but for the queues, so it goes where the least prefill waits; on idle replicas, to the
    # rendezvous home of its own opening, the same in every gateway.
    shared = "s" * CHUNK
    req = request(shared + "n" * 4 * CHUNK)  # 5 chunks, 4 of them new
    indexes = PrefixIndexes(CHUNK)
    for rid in "abc":
        indexes.record(rid, request(shared).prefix_hashes)
    idle = ReplicaView.of([replica(rid, load=3) for rid in "abc"], indexes)
    home = choose(req, idle, knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=8))
    assert home.reason is Reason.NEW_TEXT and home.predicted_match_chunks == 1
    assert choose(request(shared + "n" * 4 * CHUNK + "longer"), idle,
                  knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=8)).replica_id == home.replica_id
    # The home has 900 tokens of prefill waiting, another 100 and the third 300: the 100 takes it,
    # whatever the request counts under the cap (the one at 100 has the most requests in flight; the
    # cap, mean_after 20 / 3, is floor(8.33) = 8, and new text sees no floor).
    pending = dict(zip(sorted("abc", key=lambda r: r != home.replica_id), (900, 100, 300)))
    loads = dict(zip(sorted("abc", key=lambda r: r != home.replica_id), (6, 7, 6)))
    busy = ReplicaView.of([replace(replica(rid, load=loads[rid]), pending_prefill_tokens=pending[rid])
                           for rid in "abc"], indexes)
    decision = choose(req, busy, knobs(RoutingPolicy.CACHE_AWARE, min_load_cap=8))
    assert decision.reason is Reason.NEW_TEXT and pending[decision.replica_id] == 100


def test_new_text_goes_where_it_would_not_push_out_a_working_set() -> None:
    # Two idle replicas with 16 KV blocks each: 16 x 16 tokens x 4 chars / 64 = 16 chunks of index, of
    # which 0.85 (13 chunks) may hold the working set before new text counts as pushing it out. New text
    # (4 chunks, 64 tokens) goes to its rendezvous home while nothing is reused there; once a conversation
    # of 14 chunks has come back to the home, those 64 tokens would push out as many working-set tokens
    # (weighing 16 x 64 more), so it goes to the other replica, where they fit.
    text = "n" * 4 * CHUNK
    small = [replace(replica(rid), kv_blocks_total=16, kv_blocks_free=16) for rid in ("a", "b")]
    indexes = PrefixIndexes(CHUNK)
    for r in small:
        indexes.ensure(r.replica_id, r.kv_blocks_total, r.block_size_tokens)
    home = choose(request(text), ReplicaView.of(small, indexes), knobs(RoutingPolicy.CACHE_AWARE)).replica_id
    conversation = request("c" * 14 * CHUNK).prefix_hashes
    for _ in range(2):
        indexes.record(home, conversation)
    assert indexes.cache_fill(home) == CacheFill(reused_chunks=14, capacity_chunks=16)
    decision = choose(request(text), ReplicaView.of(small, indexes), knobs(RoutingPolicy.CACHE_AWARE))
    assert decision.replica_id != home and decision.reason is Reason.RENDEZVOUS
    # A replica that reports no KV size has an index of a guessed size: nothing is charged there.
    unsized = [replace(r, kv_blocks_total=0, kv_blocks_free=0) for r in small]
    assert choose(request(text), ReplicaView.of(unsized, indexes), knobs(RoutingPolicy.CACHE_AWARE)).replica_id == home


def test_the_same_text_under_another_adapter_does_not_match() -> None:
    indexes = PrefixIndexes(CHUNK)
    indexes.record("a", request(HOT_SYSTEM, adapter="sql").prefix_hashes)
    view = ReplicaView.of([replica("a"), replica("b")], indexes)
    assert choose(request(HOT_SYSTEM, adapter="chat"), view, knobs(RoutingPolicy.CACHE_AWARE)).predicted_match_chunks == 0


def test_view_is_sorted_so_arrival_order_does_not_matter() -> None:
    states = fleet(5)
    req = request("some prompt " + "w" * 100)
    forward = choose(req, ReplicaView.of(states), knobs(RoutingPolicy.CACHE_AWARE))
    backward = choose(req, ReplicaView.of(reversed(states)), knobs(RoutingPolicy.CACHE_AWARE))
    assert forward == backward


def _with_pending(states: list[ReplicaState], pending: dict[str, int]) -> list[ReplicaState]:
    return [replace(r, pending_prefill_tokens=pending.get(r.replica_id, 0)) for r in states]


def test_uncached_tokens_counts_what_the_replica_does_not_hold() -> None:
    req = request("x" * 6400)  # 6,400 chars at 4 chars per token: 1,600 tokens, 100 chunks of 64
    assert req.estimated_prompt_tokens == 1600
    assert req.uncached_tokens(0) == 1600
    assert req.uncached_tokens(94) == 96  # 94 x 64 = 6,016 chars held, 384 left = 96 tokens
    assert req.uncached_tokens(100) == 0


@pytest.mark.parametrize("holder_pending,holder_is_chosen", [
    # The module docstring's example at weight 16: a 1,600-token prompt of which the holder holds 94 of
    # 100 chunks (96 tokens uncached, cost 2,800 + 16 x 96 = 4,336); the others hold nothing and have
    # 0, 300 and 900 pending (cost 25,600 at best). The holder keeps it.
    (2800, True),
    # With 25,000 pending the holder's cost is 26,536 > 25,600: its queue outweighs the miss.
    (25_000, False),
])
def test_a_holder_keeps_its_prefix_until_its_queue_outweighs_the_weighted_miss(holder_pending: int,
                                                                                holder_is_chosen: bool) -> None:
    req = request("y" * 6400)
    gateway = Gateway(fleet(4))
    holder = "r2"
    gateway.indexes.record(holder, req.prefix_hashes[:94])
    others = iter((0, 300, 900))
    pending = {rid: holder_pending if rid == holder else next(others) for rid in gateway.replicas}
    states = _with_pending([replace(r, in_flight=1) for r in gateway.replicas.values()], pending)
    decision = choose(req, ReplicaView.of(states, gateway.indexes), knobs(RoutingPolicy.CACHE_AWARE))
    if holder_is_chosen:
        assert (decision.replica_id, decision.reason, decision.predicted_match_chunks) == (holder, Reason.PREFIX_HIT, 94)
    else:
        assert decision.replica_id != holder and decision.reason is Reason.LOAD_FALLBACK
        assert pending[decision.replica_id] == 0  # the least pending of the rest


def test_a_later_turn_stays_with_its_conversation_although_the_holder_has_more_requests() -> None:
    # Every replica has 2 requests in flight: request cap max(floor(1.25 x 2.25), ceil(2.25)) = 3, room
    # everywhere. The holder also has the most pending prefill (120 tokens of other short turns), but
    # the turn adds only its uncached tail (5 tokens: cost 120 + 16 x 5 = 200) where elsewhere it
    # costs 16 x 500. Pending tokens do not push a cheap hit away.
    history = "turn one of a long conversation. " * 60  # 1,980 chars
    req = request(history + "and now a follow-up")
    gateway = Gateway(fleet(4))
    holder = gateway.route(request(history), stays_in_flight=False)
    states = [replace(r, in_flight=2, pending_prefill_tokens=120 if r.replica_id == holder else 0)
              for r in gateway.replicas.values()]
    decision = choose(req, ReplicaView.of(states, gateway.indexes), knobs(RoutingPolicy.CACHE_AWARE))
    assert (decision.replica_id, decision.reason) == (holder, Reason.PREFIX_HIT)


def test_a_replica_without_free_kv_for_the_uncached_prompt_is_passed_over() -> None:
    req = request("z" * 6400)  # 1,600 tokens
    gateway = Gateway(fleet(4))
    holder = gateway.route(request("z" * 3200), stays_in_flight=False)  # holds half: 800 uncached
    full = [replace(r, kv_blocks_free=10) if r.replica_id == holder else r for r in gateway.replicas.values()]
    # 10 free blocks x 16 tokens = 160 < 800 uncached: it would have to evict; others have 16,384 free.
    decision = choose(req, ReplicaView.of(full, gateway.indexes), knobs(RoutingPolicy.CACHE_AWARE))
    assert decision.replica_id != holder and decision.reason is Reason.LOAD_FALLBACK
    # When no replica has the room, KV does not decide: the holder keeps it.
    all_full = [replace(r, kv_blocks_free=10) for r in gateway.replicas.values()]
    decision = choose(req, ReplicaView.of(all_full, gateway.indexes), knobs(RoutingPolicy.CACHE_AWARE))
    assert (decision.replica_id, decision.reason) == (holder, Reason.PREFIX_HIT)


def test_a_short_opening_held_by_one_replica_does_not_attract_new_conversations() -> None:
    # Early in a trace only one replica holds the shared opening (1 chunk of 64 chars). A new
    # conversation of 10 chunks matches 64 of 640 chars there: 10%; with min_match_fraction 0.25 that
    # does not count, so it is new text placed by its own rendezvous key, not piled onto that holder.
    shared = "s" * CHUNK
    strict = RoutingKnobs(policy=RoutingPolicy.CACHE_AWARE, load_epsilon=0.25, min_load_cap=1, min_match_fraction=0.25)
    indexes = PrefixIndexes(CHUNK)
    for rid in ("a", "b", "c", "d"):
        indexes.ensure(rid, 1024, 16, CHUNK)
    indexes.record("a", request(shared).prefix_hashes)
    view = ReplicaView.of([replica(rid) for rid in "abcd"], indexes)
    homes = Counter()
    for i in range(40):
        req = build_route_request({"prompt": shared + f"conversation {i:03d} " * 40}, "m", None, CHUNK, i,
                                  affinity_depth_chars=1024)  # the registry's default depth
        decision = choose(req, view, strict)
        assert decision.reason in (Reason.NEW_TEXT, Reason.RENDEZVOUS)
        homes[decision.replica_id] += 1
    assert len(homes) == 4 and max(homes.values()) <= 20  # spread by rendezvous, not all on "a"
    # With the fraction at 0 (the default) the 1-chunk match counts: on idle replicas it goes to the holder.
    lenient = RoutingKnobs(policy=RoutingPolicy.CACHE_AWARE, load_epsilon=0.25, min_load_cap=1, min_match_fraction=0.0)
    decision = choose(request(shared + "conversation 999 " * 40), view, lenient)
    assert (decision.replica_id, decision.reason) == ("a", Reason.PREFIX_HIT)


def test_a_fleet_of_one_reports_its_prefix_hits_as_hits() -> None:
    # The only replica holds 11 of 11 chunks: held everywhere, so nothing sets it apart, but the
    # request is a cache hit wherever it goes and the reason says so (the dashboard counts reasons).
    gateway = Gateway(fleet(1))
    gateway.route(request(HOT_SYSTEM + "question 0"), stays_in_flight=False)
    decision = choose(request(HOT_SYSTEM + "question 1"), ReplicaView.of(gateway.replicas.values(), gateway.indexes),
                      knobs(RoutingPolicy.CACHE_AWARE))
    assert (decision.reason, decision.predicted_match_chunks) == (Reason.PREFIX_HIT, 11)


def test_an_opening_every_request_shares_does_not_keep_a_replica_that_lacks_it_idle() -> None:
    # Sequential distinct prompts (nothing in flight) that all open with the same two chunks. r0 served
    # one before and holds the opening; r1 and r2 hold nothing, so each prompt costs 16 x 32 tokens more
    # there, and with no queue anywhere r0 takes every one. Once the shell says the opening is common to
    # nearly every request (`openings.CommonOpenings`), it sets no replica apart and the prompts spread.
    opening = "Shared preamble of every request in this fleet, exactly two chunks long. " * 2
    prompts = [opening[:2 * CHUNK] + f"question {i}: " + "w" * 80 for i in range(30)]
    for common in (0, 2):
        gw = Gateway(fleet(3))
        gw.indexes.record("r0", request(prompts[0]).prefix_hashes)
        chosen = {gw.route(replace(request(p, seq=i), common_opening_chunks=common), stays_in_flight=False)
                  for i, p in enumerate(prompts)}
        assert chosen == ({"r0"} if common == 0 else {"r0", "r1", "r2"})
    # A request that holds its own cache past the opening still goes to it.
    gw = Gateway(fleet(3))
    history = opening[:2 * CHUNK] + "a long conversation held only by r2 " * 8
    gw.indexes.record("r2", request(history).prefix_hashes)
    follow_up = replace(request(history + "next turn"), common_opening_chunks=2)
    assert gw.route(follow_up, stays_in_flight=False) == "r2"
