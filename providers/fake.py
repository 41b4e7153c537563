"""`FakeProvider`: an in-memory provider for autoscaler tests and the trace simulator.

Deterministic and driven by the injected clock: nothing runs in the background, every method does its
work synchronously when called, and states are derived from `clock.now()` at the time of the call
(a node is PENDING until `launch_latency_s` has passed since it was bought, a replica STARTING until
`replica_start_latency_s` has passed). Drive time with `FakeClock.advance`.

Several providers (clusters, pools) may share one `FakeCloud`, the "world" that holds every node, so a
test can check that a provider lists only its own cluster's nodes.

Fault injection, all synchronous and applied from the next call on:
- `set_stockout(instance_type, capacity_type=None, zone=None)`: those offerings are flagged
  available=False and `create` raises InsufficientCapacity; `clear_stockout` undoes it.
- quota: the pool's `max_nodes`, `max_gpus` and `budget_usd_per_hour`, or `set_quota(...)`: QuotaExceeded.
- `preempt(node_id, reason)`: the node turns INTERRUPTED (a spot interruption); its replicas FAILED.
- `fail_next(n, methods=None)`: the next n calls (of those methods, or any) raise ProviderUnavailable.
- `fail_next_replicas(n, reason)`: the next n replicas started become FAILED once their start latency passes.
- `launch_latency_s`, `replica_start_latency_s`, `terminate_latency_s` are plain settable attributes.

Every call is recorded in `calls` as (method, args), failed calls included, for assertions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.clock import Clock
from kvgate.providers.base import (CapacityType, InsufficientCapacity, Node, NodeClaim, NodeNotReady, NodeState, NotFound,
                            Offering, OfferingKey, ProviderUnavailable, ReplicaHandle, ReplicaSpec,
                            ReplicaState, check_quota, node_tags, offerings_from_pool)
from kvgate.providers.pool_provider import PoolProvider
from kvgate.registry.schema import PoolSpec


@dataclass
class _NodeRecord:
    node: Node  # state as stored: PENDING/RUNNING become a function of time in `_current`
    cluster: str
    bought_at: float  # clock.now() when created
    gpus: int
    ready_at: float
    gone_at: float | None = None  # clock.now() when a TERMINATING node disappears


@dataclass
class _ReplicaRecord:
    handle: ReplicaHandle
    cluster: str
    pool: str
    ready_at: float
    fail_reason: str | None = None  # injected: FAILED instead of READY once ready_at passes


@dataclass
class FakeCloud:
    """The shared world of every FakeProvider built on it: nodes and replicas of all clusters and pools."""

    nodes: dict[str, _NodeRecord] = field(default_factory=dict)
    claims: dict[tuple[str, str], str] = field(default_factory=dict)  # (cluster, claim id) -> node id
    replicas: dict[str, _ReplicaRecord] = field(default_factory=dict)
    _ids: Iterable[int] = field(default_factory=lambda: itertools.count(1))

    def next_id(self) -> int:
        return next(self._ids)  # type: ignore[call-overload]


class FakeProvider(PoolProvider):
    """See the module docstring. `offerings` default to the pool spec's catalogue (region `region`)."""

    def __init__(self, pool_name: str, spec: PoolSpec | None = None, *, cluster: str, clock: Clock,
                 cloud: FakeCloud | None = None, offerings: list[Offering] | None = None, region: str = "fake-1",
                 launch_latency_s: float | None = None, replica_start_latency_s: float = 0.0,
                 terminate_latency_s: float = 0.0) -> None:
        if spec is None and offerings is None:
            raise ValueError("FakeProvider needs a pool spec or a list of offerings")
        super().__init__(pool_name, cluster=cluster, clock=clock)
        self.cloud = cloud if cloud is not None else FakeCloud()
        catalogue = offerings if offerings is not None else offerings_from_pool(pool_name, spec, default_region=region)  # type: ignore[arg-type]
        self._catalogue: list[Offering] = list(catalogue)
        self.launch_latency_s = launch_latency_s if launch_latency_s is not None else (spec.node_boot_s if spec else 0.0)
        self.replica_start_latency_s = replica_start_latency_s
        self.terminate_latency_s = terminate_latency_s
        self.max_nodes: int | None = spec.max_nodes if spec else None
        self.max_gpus: int | None = spec.max_gpus if spec else None
        self.budget_usd_per_hour: float | None = spec.budget_usd_per_hour if spec else None
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._stockouts: set[OfferingKey] = set()
        self._failures_left = 0
        self._failing_methods: frozenset[str] | None = None
        self._replica_failures: list[str] = []
        self._ports = itertools.count(8000)

    # -------------------------------------------------------------------------------- fault injection

    def set_stockout(self, instance_type: str, capacity_type: CapacityType | None = None, zone: str | None = None,
                     sold_out: bool = True) -> None:
        """Flag every matching offering sold out (or, with sold_out=False, back in stock)."""
        for offering in self._catalogue:
            if offering.instance_type == instance_type and capacity_type in (None, offering.capacity_type) \
                    and zone in (None, offering.zone):
                (self._stockouts.add if sold_out else self._stockouts.discard)(offering.key)

    def clear_stockout(self, instance_type: str, capacity_type: CapacityType | None = None,
                       zone: str | None = None) -> None:
        self.set_stockout(instance_type, capacity_type, zone, sold_out=False)

    def set_quota(self, *, max_nodes: int | None = None, max_gpus: int | None = None,
                  budget_usd_per_hour: float | None = None) -> None:
        """Replace the pool's limits (None: no limit)."""
        self.max_nodes, self.max_gpus, self.budget_usd_per_hour = max_nodes, max_gpus, budget_usd_per_hour

    def set_price(self, instance_type: str, capacity_type: CapacityType, price_usd_per_hour: float) -> None:
        """Change the price of matching offerings (spot prices move)."""
        self._catalogue = [replace(o, price_usd_per_hour=price_usd_per_hour)
                           if (o.instance_type, o.capacity_type) == (instance_type, capacity_type) else o
                           for o in self._catalogue]

    def fail_next(self, count: int = 1, methods: Iterable[str] | None = None) -> None:
        """The next `count` calls (to `methods` only, when given) raise ProviderUnavailable."""
        self._failures_left = count
        self._failing_methods = frozenset(methods) if methods is not None else None

    def fail_next_replicas(self, count: int = 1, reason: str = "injected failure: the engine exited") -> None:
        """The next `count` replicas started end FAILED with `reason` instead of READY."""
        self._replica_failures.extend([reason] * count)

    def preempt(self, node_id: str, reason: str = "spot interruption: the cloud is reclaiming the node") -> None:
        """A spot interruption: the node turns INTERRUPTED and every replica on it FAILED."""
        record = self.cloud.nodes.get(node_id)
        if record is None:
            raise NotFound(f"no node {node_id!r}")
        record.node = replace(record.node, state=NodeState.INTERRUPTED, reason=reason)
        for replica in self.cloud.replicas.values():
            if replica.handle.node_id == node_id and replica.handle.state is not ReplicaState.STOPPED:
                replica.handle = replace(replica.handle, state=ReplicaState.FAILED, reason=f"node {node_id} {reason}")
                replica.fail_reason = replica.handle.reason

    # --------------------------------------------------------------------------------------- Provider

    async def offerings(self) -> list[Offering]:
        self._enter("offerings")
        return [replace(o, available=o.key not in self._stockouts) for o in self._catalogue]

    async def create(self, claim: NodeClaim) -> Node:
        self._enter("create", claim)
        existing = self.cloud.claims.get((self._cluster, claim.id))
        if existing is not None and existing in self.cloud.nodes:
            return self._current(self.cloud.nodes[existing])
        if claim.pool != self._pool:
            raise NotFound(f"claim {claim.id} is for pool {claim.pool!r}, this provider serves {self._pool!r}")
        offering = self._match(claim.offering)
        if offering.key in self._stockouts:
            raise InsufficientCapacity(claim.offering, f"{offering.key} is sold out (injected stockout)")
        self._check_quota(offering)
        number = self.cloud.next_id()
        now = self._clock.now()
        node = Node(id=f"fake-{number}", claim_id=claim.id, pool=self._pool, instance_type=offering.instance_type,
                    capacity_type=offering.capacity_type, zone=offering.zone or f"{offering.region}a",
                    state=NodeState.PENDING, address=f"10.0.{number // 256}.{number % 256}",
                    tags=node_tags(self._cluster, claim), launched_at=self._clock.wall(),
                    price_usd_per_hour=offering.price_usd_per_hour)
        self.cloud.nodes[node.id] = _NodeRecord(node, self._cluster, now, offering.gpu_count,
                                                ready_at=now + self.launch_latency_s)
        self.cloud.claims[(self._cluster, claim.id)] = node.id
        return self._current(self.cloud.nodes[node.id])

    async def delete(self, node_id: str) -> None:
        self._enter("delete", node_id)
        record = self._own_node(node_id)
        if record is None:
            return
        for replica_id, replica in list(self.cloud.replicas.items()):
            if replica.handle.node_id == node_id:
                del self.cloud.replicas[replica_id]
        if self.terminate_latency_s <= 0:
            self._forget(node_id)
        elif record.gone_at is None:
            record.node = replace(record.node, state=NodeState.TERMINATING)
            record.gone_at = self._clock.now() + self.terminate_latency_s

    async def list(self) -> list[Node]:
        self._enter("list")
        return [self._current(r) for r in list(self.cloud.nodes.values())
                if r.cluster == self._cluster and r.node.pool == self._pool and self._present(r)]

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle:
        self._enter("start_replica", node_id, spec, replica_id)
        if replica_id is not None and replica_id in self.cloud.replicas:
            return self._replica_now(self.cloud.replicas[replica_id])
        record = self._own_node(node_id)
        if record is None:
            raise NotFound(f"no node {node_id!r} in pool {self._pool!r} of cluster {self._cluster!r}")
        node = self._current(record)
        if node.state is not NodeState.RUNNING:
            raise NodeNotReady(f"node {node_id} is {node.state.value}, not running")
        replica_id = replica_id or f"{node_id}-r{self.cloud.next_id()}"
        port = next(self._ports)
        handle = ReplicaHandle(id=replica_id, model=spec.model, node_id=node_id, url=f"http://{node.address}:{port}",
                               grpc_target=f"{node.address}:{port + 1000}", state=ReplicaState.STARTING,
                               started_at=self._clock.wall())
        fail_reason = self._replica_failures.pop(0) if self._replica_failures else None
        record_ = _ReplicaRecord(handle, self._cluster, self._pool, self._clock.now() + self.replica_start_latency_s,
                                 fail_reason)
        self.cloud.replicas[replica_id] = record_
        return self._replica_now(record_)

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        self._enter("stop_replica", replica_id, drain_deadline_s)
        record = self.cloud.replicas.get(replica_id)
        if record is not None and record.cluster == self._cluster and record.pool == self._pool:
            del self.cloud.replicas[replica_id]

    async def list_replicas(self) -> list[ReplicaHandle]:
        self._enter("list_replicas")
        return [self._replica_now(r) for r in self.cloud.replicas.values()
                if r.cluster == self._cluster and r.pool == self._pool]

    async def close(self) -> None:
        self.calls.append(("close", ()))

    # ---------------------------------------------------------------------------------------- helpers

    def _enter(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))
        if self._failures_left > 0 and (self._failing_methods is None or method in self._failing_methods):
            self._failures_left -= 1
            raise ProviderUnavailable(f"{method}: injected API error")

    def _match(self, key: OfferingKey) -> Offering:
        for offering in self._catalogue:
            if offering.key == key:
                return offering
        if not key.zone:  # any zone: the first one in stock, else the first one
            candidates = [o for o in self._catalogue if (o.pool, o.instance_type, o.capacity_type)
                          == (key.pool, key.instance_type, key.capacity_type)]
            in_stock = [o for o in candidates if o.key not in self._stockouts]
            if candidates:
                return (in_stock or candidates)[0]
        raise NotFound(f"pool {self._pool!r} does not sell {key}")

    def _check_quota(self, offering: Offering) -> None:
        mine = [self._current(r) for r in self.cloud.nodes.values()
                if r.cluster == self._cluster and r.node.pool == self._pool and self._present(r)]
        in_use = [(self.cloud.nodes[n.id].gpus, n.price_usd_per_hour)
                  for n in mine if n.state not in (NodeState.TERMINATING, NodeState.TERMINATED)]
        check_quota(self._pool, offering, in_use, max_nodes=self.max_nodes, max_gpus=self.max_gpus,
                    budget_usd_per_hour=self.budget_usd_per_hour)

    def _present(self, record: _NodeRecord) -> bool:
        if record.gone_at is not None and self._clock.now() >= record.gone_at:
            self._forget(record.node.id)
            return False
        return True

    def _forget(self, node_id: str) -> None:
        record = self.cloud.nodes.pop(node_id, None)
        if record is not None:
            self.cloud.claims.pop((record.cluster, record.node.claim_id), None)

    def _own_node(self, node_id: str) -> _NodeRecord | None:
        record = self.cloud.nodes.get(node_id)
        if record is None or record.cluster != self._cluster or record.node.pool != self._pool:
            return None
        return record if self._present(record) else None

    def _current(self, record: _NodeRecord) -> Node:
        node = record.node
        if node.state is NodeState.PENDING and self._clock.now() >= record.ready_at:
            record.node = node = replace(node, state=NodeState.RUNNING)
        return node

    def _replica_now(self, record: _ReplicaRecord) -> ReplicaHandle:
        handle = record.handle
        if handle.state is ReplicaState.STARTING and self._clock.now() >= record.ready_at:
            if record.fail_reason is not None:
                record.handle = handle = replace(handle, state=ReplicaState.FAILED, reason=record.fail_reason)
            else:
                record.handle = handle = replace(handle, state=ReplicaState.READY)
        return handle


def from_pool(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, **options: Any) -> FakeProvider:
    """`build_provider`'s entry: options are FakeProvider's keyword arguments (cloud, latencies, ...)."""
    return FakeProvider(pool_name, spec, cluster=cluster, clock=clock, **options)
