"""Pure helpers of the live loop: turning what the providers list into what the deciders and the
routers read. No I/O and no clock reads; `now` is an argument.

- `model_observation`: gateway totals + replica list -> the scaler's `ModelObservation`.
- `cold_start_s`: node boot plus model load, for the scaler's forecast horizon.
- `member_record`: a provider's `ReplicaHandle` -> the `MemberRecord` routers watch.
- `node_statuses`: nodes + replicas -> the dashboard's node rows.
- `booting_by_model`: replicas of claims and nodes still booting, per model (on their way, not listed).
- `Backoff`: exponential back-off of replica starts for a model whose replicas keep failing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvgate.autoscaler.claims import ClaimRecord
from kvgate.autoscaler.observe import GatewayTotals
from kvgate.autoscaler.planner import planned_replicas
from kvgate.autoscaler.demand import ModelObservation
from kvgate.autoscaler.status import NodeStatus
from kvgate.state import MemberRecord
from kvgate.state import ReplicaState as MemberState
from kvgate.providers.base import Node, NodeState, ReplicaHandle, ReplicaState
from kvgate.registry.schema import ModelDoc
from kvgate.registry.snapshot import Snapshot


def model_observation(model: str, totals: GatewayTotals | None, replicas: Iterable[ReplicaHandle],
                      draining: frozenset[str], starting_claims: int = 0) -> ModelObservation:
    """One model's observation for the scaler.

    Gateways count what they proxied and is not finished (`in_flight`): that is waiting plus running
    at the replicas, which the gateways cannot tell apart, so it is all reported as running (the
    scaler only adds them up). Draining replicas count neither as ready nor starting: they are
    leaving. `starting_claims` are nodes being bought for the model (their replicas are not started
    yet but are on the way, so the scaler does not ask again).
    """
    ready = starting = 0
    for replica in replicas:
        if replica.model != model or replica.id in draining:
            continue
        if replica.state is ReplicaState.READY:
            ready += 1
        elif replica.state is ReplicaState.STARTING:
            starting += 1
    return ModelObservation(
        model=model,
        queued_at_gateways=totals.queued if totals else 0,
        waiting=0,
        running=totals.in_flight if totals else 0,
        arrivals_per_s=totals.arrivals_per_s if totals else 0.0,
        ttft_p99_s=totals.ttft_p99_s if totals else None,
        ready_replicas=ready,
        starting_replicas=starting + starting_claims,
        prompt_tokens_per_s=totals.prompt_tokens_per_s if totals else 0.0,
        prompt_tokens_sq_per_s=totals.prompt_tokens_sq_per_s if totals else 0.0,
        arrivals_var=totals.arrivals_var if totals else None,
        completions_per_s=totals.completions_per_s if totals else None,
    )


def cold_start_s(snapshot: Snapshot, model: ModelDoc) -> float:
    """Node boot plus model load on the fastest pool the model may use (0 when no pool fits), the
    horizon a forecast must look ahead. Worked: pools booting in 240 s and 90 s, model_load_s 60 ->
    150 s."""
    allowed = model.spec.placement.pools or tuple(snapshot.pools)
    boots = [snapshot.pools[name].spec.node_boot_s for name in allowed if name in snapshot.pools]
    if not boots:
        return 0.0
    return min(boots) + model.spec.performance.model_load_s


def autoscaled_models(snapshot: Snapshot) -> list[str]:
    """Models whose replicas the autoscaler runs: every model without static replicas."""
    return sorted(name for name, doc in snapshot.models.items() if not doc.spec.routing.static_replicas)


def member_record(replica: ReplicaHandle, pool: str | None, draining: bool) -> MemberRecord | None:
    """The membership record routers see for `replica`; None for one that must not be listed (failed
    or stopped: routers drop it when the record goes)."""
    if replica.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
        return None
    if draining:
        state = MemberState.DRAINING
    elif replica.state is ReplicaState.READY:
        state = MemberState.READY
    else:
        state = MemberState.STARTING
    return MemberRecord(replica_id=replica.id, model=replica.model, url=replica.url,
                        grpc_target=replica.grpc_target, state=state, node_id=replica.node_id, pool=pool)


def retired_record(replica: ReplicaHandle, pool: str | None) -> MemberRecord:
    """The record that takes `replica` out of routing for good (it failed, or its node is going): DRAINING,
    whatever the provider says of it. Gateways stop sending to a DRAINING member at their next poll and
    drop it as soon as its record goes; a READY record that merely vanished they keep while its health
    checks pass (`router.membership`: an autoscaler that lapses must not empty them)."""
    return MemberRecord(replica_id=replica.id, model=replica.model, url=replica.url,
                        grpc_target=replica.grpc_target, state=MemberState.DRAINING, node_id=replica.node_id,
                        pool=pool)


def node_statuses(nodes: Iterable[Node], replicas: Iterable[ReplicaHandle]) -> list[NodeStatus]:
    """The dashboard's node rows: each node with the ids of the replicas on it."""
    on_node: dict[str, list[str]] = {}
    for replica in replicas:
        on_node.setdefault(replica.node_id, []).append(replica.id)
    return [NodeStatus(id=node.id, pool=node.pool, instance_type=node.instance_type,
                       capacity_type=node.capacity_type.value, price_usd_per_hour=node.price_usd_per_hour,
                       state=node.state.value, launched_at=node.launched_at,
                       replicas=tuple(sorted(on_node.get(node.id, ()))))
            for node in sorted(nodes, key=lambda n: n.id)]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Replica-start back-off of one model. Worked (base 5 s, cap 300 s): failures at t=0, 5, 15
    allow the next start at 5, 15 (5 + 10), 35 (15 + 20); the 7th failure in a row waits the
    cap, 300 s. One replica becoming ready resets it."""

    failures: int = 0
    retry_at: float = float("-inf")  # monotonic seconds

    def may_start(self, now: float) -> bool:
        return now >= self.retry_at

    def after_failure(self, now: float, base_s: float, max_s: float) -> Backoff:
        delay_s = min(max_s, base_s * 2 ** self.failures)
        return Backoff(self.failures + 1, now + delay_s)


def pools_of(nodes: Iterable[Node]) -> Mapping[str, str]:
    """node id -> pool."""
    return {node.id: node.pool for node in nodes}


def booting_by_model(nodes: Iterable[Node], claims: Iterable[ClaimRecord],
                     replicas: Iterable[ReplicaHandle]) -> dict[str, int]:
    """Replicas on their way that no provider lists yet, per model: the planned replicas of each claim whose
    node is not listed (bought or being bought), and of each listed PENDING node less those already on it.
    The scaler counts them as starting, so it does not ask again while a node boots. Worked: a claim for 2
    replicas of m, unlisted, and a pending node planned for 3 of m with 1 listed on it -> {"m": 4}."""
    listed = {node.id for node in nodes}
    on_node: dict[str, int] = {}
    for replica in replicas:
        on_node[replica.node_id] = on_node.get(replica.node_id, 0) + 1
    booting: dict[str, int] = {}
    for record in claims:
        if record.node_id not in listed and record.claim.model:
            model = record.claim.model
            booting[model] = booting.get(model, 0) + planned_replicas(record.claim.labels)
    for node in nodes:
        if node.state is NodeState.PENDING and node.model:
            missing = max(0, planned_replicas(node.tags) - on_node.get(node.id, 0))
            booting[node.model] = booting.get(node.model, 0) + missing
    return {model: n for model, n in booting.items() if n}
