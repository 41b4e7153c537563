"""The node level, judged: the cheapest node plan that holds the replicas a run asked for, to measure the
planner's dollars against.

A run's timeline says how many replicas its nodes held at each tick (started on running nodes, not draining).
`cheapest_node_plan` knows that whole curve and the scenario's stockouts in advance, and:
1. for each stretch of constant demand and availability, finds the cheapest mix of whole nodes that holds
   the replicas: an integer program over the offerings (HiGHS, through scipy), each node holding
   floor(its GPUs / the model's GPUs) replicas (one for a node that boots into its replica), the model's
   on-demand base on on-demand nodes, within each pool's max_nodes, max_gpus and budget, spot only where
   the model allows it; an offering stocked out sells no more nodes then, but those held keep running (spot
   ones as many as the interruptions expected meanwhile leave: a stockout cannot replace what is taken);
2. per offering, keeps a node through a dip shorter than the node's boot (releasing and buying it back
   would pay the boot again: the offline rule for renting with a set-up cost), and pays the pool's
   `node_boot_s` for every node it adds (bought that long before it is needed);
3. pays a spot node's boot once more per interruption it expects (the scenario's rate per node-hour), so
   frequent interruptions may make on-demand the cheaper plan.
It never holds an empty node, a draining replica's node or a node it gave up while booting, nor buys the wrong
node: that is what the live planner's cost is measured against (`Summary.node_plan_usd`). It is the cheapest plan of this construction, not a
proven optimum over every schedule; replica counts themselves are judged by the oracle and the bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from kvgate.autoscaler.offers import compatible, node_units, units_per_replica
from kvgate.autoscaler.sim.records import Stockout
from kvgate.providers.base import CapacityType, Offering
from kvgate.registry.schema import ModelDoc, PoolSpec


# How often a stocked-out spot offering's nodes are thinned by the interruptions expected (`_Mixer.survivors`).
_THIN_STEP_S = 60.0


@dataclass(frozen=True)
class NodePlan:
    usd: float
    gpu_hours: float
    short_s: float  # seconds in which no mix held the replicas asked for (the plan held the most it could)


def cheapest_node_plan(demand: Sequence[tuple[float, int]], end_s: float, model: ModelDoc, offerings: Sequence[Offering],
                       pools: Mapping[str, PoolSpec], *, outages: Sequence[Stockout] = (),
                       spot_interruptions_per_hour: float = 0.0, cpu_replicas_per_node: int = 4) -> NodePlan:
    """The plan's cost for `demand`, (t, replicas) points in time order each held until the next (the last until
    `end_s`); `outages` in the same time (0: the start of scoring). Worked: 2 replicas of a 4-GPU model for an hour on 8-GPU nodes at $31.50 (spot) and $49.24
    (on-demand), on-demand base 2: one on-demand node, $49.24; with base 0, one spot node, $31.50."""
    mixer = _Mixer(model, tuple(offerings), dict(pools), spot_interruptions_per_hour, cpu_replicas_per_node)
    points = [(t, n) for t, n in demand if t < end_s]
    counts: list[tuple[float, float, tuple[int, ...]]] = []  # (start, end, nodes per offering)
    short_s = 0.0
    held = tuple(0 for _ in mixer.offerings)
    stocked_out: dict[int, tuple[float, int]] = {}  # offering index -> (outage start, nodes held then)
    # Stretches are split where an outage begins or ends inside them, and every minute of an outage while spot is
    # interrupted (the nodes it holds thin out: `_Mixer.survivors`).
    bounds = sorted({float(b) for o in outages for b in (o.start_s, o.end_s)})
    if spot_interruptions_per_hour > 0:
        bounds = sorted({*bounds, *(float(b) for o in outages for b in np.arange(o.start_s, o.end_s, _THIN_STEP_S))})
    for i, (t, replicas) in enumerate(points):
        t_next = points[i + 1][0] if i + 1 < len(points) else end_s
        cuts = sorted({t, t_next, *(b for b in bounds if t < b < t_next)})
        for start, stop in zip(cuts, cuts[1:]):
            out = {j for j, key in enumerate(mixer.keys)
                   if any(o.start_s <= start < o.end_s and key.startswith(o.key_prefix) for o in outages)}
            stocked_out = {j: stocked_out.get(j, (start, held[j])) for j in out}
            caps = tuple(mixer.survivors(j, *stocked_out[j], start, n) if j in out else None
                         for j, n in enumerate(held))  # out of stock: no more than it holds, less what is lost
            mix, placed = mixer.mix(replicas, caps)
            if placed < replicas:
                short_s += stop - start
            counts.append((start, stop, mix))
            held = mix
    usd = gpu_s = 0.0
    for j, offering in enumerate(mixer.offerings):
        usd_j, held_s = _offering_cost([(a, b, mix[j]) for a, b, mix in counts],
                                       mixer.boot_s(offering), mixer.effective_price(offering))
        usd += usd_j
        gpu_s += held_s * offering.gpu_count
    return NodePlan(usd, gpu_s / 3600.0, short_s)


def _offering_cost(series: list[tuple[float, float, int]], boot_s: float, usd_per_hour: float) -> tuple[float, float]:
    """(dollars, node-seconds) of one offering's node-count curve, each node kept through dips shorter than
    `boot_s` and paying `boot_s` for every node added after the start, or as much of it as falls after the start
    (a boot before it is in the warm-up, which no run is charged for)."""
    if not series:
        return 0.0, 0.0
    node_s = 0.0
    boot_paid_s = 0.0
    top = max(n for _, _, n in series)
    for level in range(1, top + 1):  # the k-th node of this offering: held where the count reaches k
        held: list[tuple[float, float]] = []
        for start, stop, n in series:
            if n < level:
                continue
            if held and start - held[-1][1] < boot_s:  # a dip shorter than a boot: keep the node through it
                held[-1] = (held[-1][0], stop)
            else:
                held.append((start, stop))
        node_s += sum(b - a for a, b in held)
        boot_paid_s += sum(min(boot_s, a - series[0][0]) for a, _ in held)  # the opening fleet is warm
    return (node_s + boot_paid_s) * usd_per_hour / 3600.0, node_s + boot_paid_s


class _Mixer:
    """The cheapest mix of nodes for a replica count and a set of offerings out of stock, memoized."""

    def __init__(self, model: ModelDoc, offerings: tuple[Offering, ...], pools: dict[str, PoolSpec],
                 spot_rate: float, cpu_replicas_per_node: int) -> None:
        self.model, self.pools, self.spot_rate = model, pools, spot_rate
        need = units_per_replica(model)
        usable = []
        for o in offerings:
            fits = 1 if o.replica_at_boot else node_units(o, cpu_replicas_per_node) // need
            if compatible(model, o) and o.available and fits >= 1:
                usable.append((o, fits))
        usable.sort(key=lambda of: str(of[0].key))
        self.offerings = tuple(o for o, _ in usable)
        self.fits = np.array([f for _, f in usable], dtype=float)
        self.keys = tuple(f"{o.pool}/{o.instance_type}/{o.capacity_type.value}" for o in self.offerings)
        self.mix = lru_cache(maxsize=None)(self._mix)

    def boot_s(self, offering: Offering) -> float:
        pool = self.pools.get(offering.pool)
        return pool.node_boot_s if pool is not None else 0.0

    def survivors(self, j: int, since: float, held_then: int, now: float, held_now: int) -> int:
        """How many of offering j's nodes the plan may still hold at `now` when it sells nothing since `since`: no
        more than it holds, and for spot, the nodes it held then thinned by the interruptions expected meanwhile
        (rounded), since a stocked-out offering cannot replace what is taken. Held whole, a plan kept 9 spot nodes
        through a 20-minute stockout at 1 interruption a node-hour, where about 2.5 of them would have gone and
        only on-demand nodes could replace them. Worked: 9 held, 1 an hour, 20 minutes on -> 9 x e^(-1/3) = 6.4 -> 6."""
        if self.offerings[j].capacity_type is not CapacityType.SPOT or self.spot_rate <= 0:
            return held_now
        return min(held_now, int(round(held_then * np.exp(-self.spot_rate * (now - since) / 3600.0))))

    def effective_price(self, offering: Offering) -> float:
        """Spot pays its boot again per interruption expected."""
        price = offering.price_usd_per_hour
        if offering.capacity_type is CapacityType.SPOT:
            price *= 1.0 + self.spot_rate * self.boot_s(offering) / 3600.0
        return price

    def _mix(self, replicas: int, caps: tuple[int | None, ...]) -> tuple[tuple[int, ...], int]:
        """(nodes per offering, replicas held): the cheapest mix for `replicas`, or for the most that fit, with at
        most `caps[i]` nodes of offering i where it is not None."""
        base = min(self.model.spec.placement.on_demand_base_replicas, replicas)
        for want in range(replicas, -1, -1):
            mix = self._solve(want, min(base, want), caps)
            if mix is not None:
                return mix, want
        return tuple(0 for _ in self.offerings), 0

    def _solve(self, replicas: int, on_demand: int, caps: tuple[int | None, ...]) -> tuple[int, ...] | None:
        n = len(self.offerings)
        if replicas == 0:
            return tuple(0 for _ in range(n))
        if n == 0:
            return None
        # Cheapest first; among equal prices fewer nodes, then the offering order (deterministic).
        cost = np.array([self.effective_price(o) for o in self.offerings]) + 1e-6 * (1 + np.arange(n))
        upper = np.array([np.inf if cap is None else float(cap) for cap in caps])
        rows, low, high = [self.fits], [replicas], [np.inf]
        if on_demand:
            rows.append(self.fits * np.array([o.capacity_type is CapacityType.ON_DEMAND for o in self.offerings]))
            low.append(on_demand)
            high.append(np.inf)
        for name, spec in self.pools.items():
            in_pool = np.array([o.pool == name for o in self.offerings], dtype=float)
            if not in_pool.any():
                continue
            for limit, per_node in ((spec.max_nodes, in_pool), (spec.max_gpus, in_pool * [o.gpu_count for o in self.offerings]),
                                    (spec.budget_usd_per_hour, in_pool * [o.price_usd_per_hour for o in self.offerings])):
                if limit is not None:
                    rows.append(np.asarray(per_node, dtype=float))
                    low.append(-np.inf)
                    high.append(float(limit))
        result = milp(cost, constraints=LinearConstraint(np.vstack(rows), low, high), integrality=np.ones(n),
                      bounds=Bounds(np.zeros(n), upper))
        if not result.success:
            return None
        return tuple(int(round(x)) for x in result.x)
