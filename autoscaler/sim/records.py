"""The simulator's records: what a run is given (the fleet, the scenario, the policy) and what it returns.

A `Policy` decides a replica count from the same `ModelObservation` the live loop builds; `PolicyStep` plugs
one into the live decision (`autoscaler.decide`) as its replica step. `Scenario` is what the world does
(spot interruptions, stockouts, failed starts), seeded; `FleetSetup` is the model's fleet from the registry;
`RunResult` is everything one run produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.autoscaler.demand import ModelObservation
from kvgate.autoscaler.scaler import ReplicaDecision
from kvgate.autoscaler.sim.nodes import NodePlanning
from kvgate.autoscaler.sim.service import Placement
from kvgate.autoscaler.sim.training import ClusterSpec, ClusterUse
from kvgate.registry.snapshot import Snapshot


@dataclass(frozen=True)
class SimDecision:
    desired: int
    panic: bool = False
    forecast_rps: float | None = None
    reason: str = ""


class Policy(Protocol):
    """A replica-count policy: `decide` is pure over (state, observation, now); the engine keeps the state."""

    name: str
    tick_s: float

    def initial_state(self) -> Any: ...

    def decide(self, state: Any, obs: ModelObservation, now: float) -> tuple[Any, SimDecision]: ...


@dataclass(frozen=True)
class PolicyStep:
    """A sim `Policy` as the live decision's replica step (`decide.ReplicaStep`), its count held to the fleet's
    limits."""

    policy: Policy
    min_replicas: int
    max_replicas: int

    def __call__(self, snapshot: Snapshot, model: str, state: Any, obs: ModelObservation,
                 now: float) -> tuple[Any, ReplicaDecision]:
        state, decision = self.policy.decide(self.policy.initial_state() if state is None else state, obs, now)
        desired = min(self.max_replicas, max(self.min_replicas, decision.desired))
        return state, ReplicaDecision(desired, decision.panic, decision.forecast_rps, decision.reason)


@dataclass(frozen=True)
class Stockout:
    """Placements whose key starts with `key_prefix` (pool/instance_type/capacity) sell nothing in [start_s, end_s)."""

    key_prefix: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Scenario:
    """What the world does to the fleet: spot interruptions, stockouts, failed starts. Seeded, so runs repeat."""

    spot_interruptions_per_hour: float = 0.0  # per spot replica, or per spot node where nodes are planned (kvgate)
    stockouts: tuple[Stockout, ...] = ()
    start_failure_rate: float = 0.0  # the share of replica starts that fail at the end of the model load (nodes only)
    seed: int = 0

@dataclass(frozen=True)
class FleetSetup:
    """The model's fleet: where replicas may run, its limits and its SLO."""

    model: str
    placements: tuple[Placement, ...]  # cheapest first (service.placements)
    min_replicas: int
    max_replicas: int
    on_demand_base: int  # replicas kept on on-demand; spot beyond it (placements hold spot only if allowed)
    ttft_slo_s: float
    initial_replicas: int = 0  # ready at t=0 on the cheapest on-demand-first placements (warm start)
    tail_s: float = 120.0
    nodes: NodePlanning | None = None  # set: the live node planner places replicas on simulated nodes
    cluster: ClusterSpec | None = None  # set (no nodes): replicas take GPUs from this Slurm cluster (training.py)


@dataclass(frozen=True)
class TimelinePoint:
    t: float
    arrivals_per_s: float
    ongoing: int  # queued + in flight: the demand
    ready: int
    active: int  # ready + starting (what the policy has asked for and not released)
    desired: int
    panic: bool
    placed: int = 0  # replicas started on running nodes and not draining, after the tick's actions: what nodes held


@dataclass(frozen=True)
class RunResult:
    """Everything one policy's run produced. TTFTs are in request order; NaN = never got a first token."""

    policy: str
    ttft_s: tuple[float, ...]
    gpu_seconds: float
    cost_usd: float
    cold_starts: int
    scaling_actions: int  # ticks at which the desired count changed
    preemptions: int
    duration_s: float
    timeline: tuple[TimelinePoint, ...]
    max_replicas: int
    cluster_use: ClusterUse | None = None  # with `FleetSetup.cluster`: its GPU-hours, inference's and training's

    def attainment(self, slo_s: float) -> float:
        """The share of scored requests with a first token within `slo_s` (never served counts as a miss)."""
        n = len(self.ttft_s)
        return sum(1 for t in self.ttft_s if t <= slo_s) / n if n else 1.0  # NaN compares False
