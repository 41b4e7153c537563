"""Offerings as data with small pure filters: compatible, slots, quota headroom, cheapest.

The planner's building blocks (Karpenter keeps the same split: instance types and offerings are data,
filters are small functions). Nothing here remembers anything between calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvgate.providers.base import CapacityType, Offering, OfferingKey
from kvgate.registry.schema import CPU_KIND, ModelDoc, PoolSpec


def units_per_replica(model: ModelDoc) -> int:
    """Room one replica takes on a node: its GPUs, or 1 slot for a CPU-only model."""
    return max(1, model.spec.resources.gpu_count)


def node_units(offering: Offering, cpu_replicas_per_node: int) -> int:
    """Room a node of `offering` has: its GPUs, or `cpu_replicas_per_node` slots on a CPU node."""
    return offering.gpu_count if offering.gpu_kind != CPU_KIND else cpu_replicas_per_node


def compatible(model: ModelDoc, offering: Offering, *, on_demand_only: bool = False) -> bool:
    """Can a replica of `model` run on a node of `offering` under the model's placement rules?

    Pool allowed (empty placement.pools: every pool), GPU kind listed, enough GPUs, enough memory per
    GPU, and spot only where placement.allow_spot (and not when `on_demand_only`).
    """
    spec = model.spec
    if spec.placement.pools and offering.pool not in spec.placement.pools:
        return False
    if offering.capacity_type is CapacityType.SPOT and (on_demand_only or not spec.placement.allow_spot):
        return False
    res = spec.resources
    if offering.gpu_kind not in res.gpu_kinds:
        return False
    if res.gpu_count > offering.gpu_count:
        return False
    return res.min_gpu_memory_gib is None or offering.gpu_memory_gib >= res.min_gpu_memory_gib


@dataclass(slots=True)
class PoolUsage:
    """Nodes, GPUs and dollars per hour a pool uses (listed nodes + pending claims + this tick's buys).

    Mutable on purpose: one planning call adds its own buys as it goes; it never outlives the call.
    """

    num_nodes: int = 0
    num_gpus: int = 0
    usd_per_hour: float = 0.0

    def add(self, offering: Offering) -> None:
        self.num_nodes += 1
        self.num_gpus += offering.gpu_count
        self.usd_per_hour += offering.price_usd_per_hour

    def remove(self, offering: Offering) -> None:
        self.num_nodes -= 1
        self.num_gpus -= offering.gpu_count
        self.usd_per_hour -= offering.price_usd_per_hour


def quota_problem(pool: PoolSpec | None, usage: PoolUsage, offering: Offering) -> str | None:
    """Why buying one more node of `offering` would break the pool's quota or budget, or None if it fits.

    Worked numbers: budget 10 $/h, using 8.20 $/h, offering 2.50 $/h -> "budget: 8.20 + 2.50 > 10.00 $/h".
    """
    if pool is None:
        return f"pool {offering.pool!r} is not in the registry"
    if pool.max_nodes is not None and usage.num_nodes + 1 > pool.max_nodes:
        return f"max_nodes: {usage.num_nodes} + 1 > {pool.max_nodes}"
    if pool.max_gpus is not None and usage.num_gpus + offering.gpu_count > pool.max_gpus:
        return f"max_gpus: {usage.num_gpus} + {offering.gpu_count} > {pool.max_gpus}"
    budget = pool.budget_usd_per_hour
    if budget is not None and usage.usd_per_hour + offering.price_usd_per_hour > budget + 1e-9:
        return f"budget: {usage.usd_per_hour:.2f} + {offering.price_usd_per_hour:.2f} > {budget:.2f} $/h"
    return None


@dataclass(frozen=True, slots=True)
class Choice:
    """The offering to buy for `replicas` replicas, or why none could be chosen."""

    offering: Offering | None
    replicas: int
    why_not: str = ""


def cheapest(model: ModelDoc, num_replicas: int, offerings: Iterable[Offering], *,
             unavailable: Mapping[OfferingKey, float], now: float, usage: Mapping[str, PoolUsage],
             pools: Mapping[str, PoolSpec], on_demand_only: bool, cpu_replicas_per_node: int) -> Choice:
    """The offering with the lowest price per replica it would hold, for up to `num_replicas` replicas.

    A node of G units holds floor(G / units_per_replica) replicas; for n replicas still to place it
    holds min(n, that). Worked numbers, 3 replicas of a 1-GPU model: a 1-GPU node at $2/h costs $2 per
    replica; an 8-GPU node at $12/h holds 3 -> $4 per replica; the 1-GPU node wins. Ties go to the
    lower node price, then to the offering key (deterministic). A `replica_at_boot` node holds one
    replica whatever its size (an 8-GPU EC2 node for a 1-GPU model costs its whole price per replica). Skipped: unavailable (sold out), in
    the ICE cache (`unavailable[key] > now`), incompatible, or over quota/budget.
    """
    per_replica = units_per_replica(model)
    best: tuple[float, float, str] | None = None
    chosen: Offering | None = None
    chosen_n = 0
    reasons: set[str] = set()
    for offering in offerings:
        if not compatible(model, offering, on_demand_only=on_demand_only):
            continue
        fits = node_units(offering, cpu_replicas_per_node) // per_replica
        if fits < 1:
            continue
        if offering.replica_at_boot:
            fits = 1  # the node boots into its claim's one replica and runs nothing else
        if not offering.available:
            reasons.add(f"{offering.key} sold out")
            continue
        if unavailable.get(offering.key, 0.0) > now:
            reasons.add(f"{offering.key} skipped after insufficient capacity")
            continue
        problem = quota_problem(pools.get(offering.pool), usage.get(offering.pool, PoolUsage()), offering)
        if problem:
            reasons.add(f"{offering.pool} {problem}")
            continue
        n = min(num_replicas, fits)
        rank = (offering.price_usd_per_hour / n, offering.price_usd_per_hour, str(offering.key))
        if best is None or rank < best:
            best, chosen, chosen_n = rank, offering, n
    if chosen is None:
        kind = "on-demand " if on_demand_only else ""
        why = "; ".join(sorted(reasons)) or f"no {kind}offering of the allowed pools fits its GPU needs"
        return Choice(None, 0, why)
    return Choice(chosen, chosen_n)
