"""The autoscaler's Prometheus series, `kvgate_autoscaler_*`, read from the loop at each scrape.

    kvgate_autoscaler_leader                         1 on the copy that holds the lease, 0 on a standby
    kvgate_autoscaler_state_store_up                 1 while the last tick reached the state store
    kvgate_autoscaler_last_tick_timestamp_seconds    wall time of the last tick that reached the store
    kvgate_autoscaler_replicas_desired{model}        the last decision
    kvgate_autoscaler_replicas{model, state}         ready | starting, as the last decision saw them
    kvgate_autoscaler_nodes{pool, capacity_type, state}
    kvgate_autoscaler_node_cost_usd_per_hour{pool}   what the nodes cost now, every pool of the registry (0 for none)
    kvgate_autoscaler_cost_usd_total                 accrued since the first leader (carried across leaders)
    kvgate_autoscaler_provisioning_oldest_seconds{pool}  how long the oldest node still booting, or claim not yet a
                                                     node, has been at it (0 when none): alert on a stuck one

Only the leader exports the fleet's series (a standby's view is stale); every copy exports the first three, so
"no copy leads" is `max(kvgate_autoscaler_leader) < 1`. The series are built by `families`, a pure function of a
`Reading` and the wall clock; `AutoscalerCollector` is the thin shell prometheus_client calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate.autoscaler.claims import ClaimPhase
from kvgate.autoscaler.reconciler import Fleet
from kvgate.providers.base import NodeState
from kvgate.state.records import AutoscalerStatus


@dataclass(frozen=True, slots=True)
class Provisioning:
    """A node still booting, or a claim the provider has not yet turned into a node."""

    pool: str
    since: float  # wall seconds


@dataclass(frozen=True, slots=True)
class Reading:
    """What the metrics read of one autoscaler copy at a scrape."""

    leader: bool
    store_up: bool
    last_tick_at: float | None = None  # wall seconds of the last tick that reached the store
    pools: tuple[str, ...] = ()  # the registry's pools
    status: AutoscalerStatus | None = None  # the last status record this copy wrote as leader
    provisioning: tuple[Provisioning, ...] = ()


def provisioning(fleet: Fleet) -> tuple[Provisioning, ...]:
    """The fleet's nodes still booting (since their launch) and claims with no node yet (since written)."""
    booting = [Provisioning(node.pool, node.launched_at) for node in fleet.nodes
               if node.state is NodeState.PENDING and node.launched_at is not None]
    claimed = [Provisioning(record.claim.offering.pool, record.created_at) for record in fleet.claims.values()
               if record.phase is ClaimPhase.PENDING and record.node_id is None]
    return tuple(booting + claimed)


def families(reading: Reading, now: float) -> list[Metric]:
    """The metric families of `reading` at wall time `now`."""
    leader = GaugeMetricFamily("kvgate_autoscaler_leader", "1 on the autoscaler copy that holds the lease, else 0.",
                               value=1 if reading.leader else 0)
    store = GaugeMetricFamily("kvgate_autoscaler_state_store_up",
                              "1 while the autoscaler's last tick reached the state store, else 0.",
                              value=1 if reading.store_up else 0)
    out: list[Metric] = [leader, store]
    if reading.last_tick_at is not None:
        out.append(GaugeMetricFamily("kvgate_autoscaler_last_tick_timestamp_seconds",
                                     "Wall time of the last tick that reached the state store.",
                                     value=reading.last_tick_at))
    if reading.leader and reading.status is not None:
        out.extend(_fleet(reading.status, reading.pools))
        out.append(_provisioning(reading.provisioning, reading.pools, now))
    return out


def _fleet(status: AutoscalerStatus, pools: Iterable[str]) -> Iterator[Metric]:
    desired = GaugeMetricFamily("kvgate_autoscaler_replicas_desired", "Replicas the last decision wants, by model.",
                                labels=["model"])
    replicas = GaugeMetricFamily("kvgate_autoscaler_replicas", "Replicas by model and state (ready, starting), as "
                                 "the last decision saw them.", labels=["model", "state"])
    for name, model in status.models.items():
        desired.add_metric([name], model.desired)
        replicas.add_metric([name, "ready"], model.ready)
        replicas.add_metric([name, "starting"], model.starting)
    nodes = GaugeMetricFamily("kvgate_autoscaler_nodes", "Nodes by pool, capacity type and state.",
                              labels=["pool", "capacity_type", "state"])
    counts: dict[tuple[str, str, str], int] = {}
    cost = dict.fromkeys(pools, 0.0)
    for node in status.nodes:
        key = (node.pool, node.capacity_type, node.state)
        counts[key] = counts.get(key, 0) + 1
        cost[node.pool] = cost.get(node.pool, 0.0) + node.price_usd_per_hour
    for key in sorted(counts):
        nodes.add_metric(list(key), counts[key])
    per_hour = GaugeMetricFamily("kvgate_autoscaler_node_cost_usd_per_hour", "What the nodes cost now, by pool.",
                                 labels=["pool"])
    for pool in sorted(cost):
        per_hour.add_metric([pool], cost[pool])
    total = CounterMetricFamily("kvgate_autoscaler_cost_usd", "Node cost accrued since the first leader, in USD.",
                                value=status.cost_usd_total)
    yield from (desired, replicas, nodes, per_hour, total)


def _provisioning(waiting: Iterable[Provisioning], pools: Iterable[str], now: float) -> Metric:
    oldest = dict.fromkeys(pools, 0.0)
    for item in waiting:
        oldest[item.pool] = max(oldest.get(item.pool, 0.0), now - item.since)
    family = GaugeMetricFamily("kvgate_autoscaler_provisioning_oldest_seconds",
                               "Age of the oldest node still booting or claim not yet a node, by pool (0: none).",
                               labels=["pool"])
    for pool in sorted(oldest):
        family.add_metric([pool], round(max(0.0, oldest[pool]), 3))
    return family


class AutoscalerCollector:
    """Calls `read` at each scrape and yields its families (`wall` is the clock's wall time)."""

    def __init__(self, read: Callable[[], Reading], wall: Callable[[], float]) -> None:
        self._read = read
        self._wall = wall

    def collect(self) -> Iterator[Metric]:
        yield from families(self._read(), self._wall())


def autoscaler_registry(read: Callable[[], Reading], wall: Callable[[], float]) -> CollectorRegistry:
    """A registry of its own holding the autoscaler's series (rendered with `render`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AutoscalerCollector(read, wall))  # type: ignore[arg-type]  # a Collector by shape
    return registry

