"""The autoscaler's status record, read by the dashboard (and reusable by the simulator).

State store collection "autoscaler", record id "status", rewritten every loop tick:

    {"updated_at": wall s, "holder": str,
     "models": {name: {"desired", "ready", "starting", "panic", "forecast_rps", "arrivals_per_s",
                       "queued", "reason"}},
     "events": [{"t", "model", "kind", "message"}],   # the last 50, oldest first
     "nodes": [{"id", "pool", "instance_type", "capacity_type", "price_usd_per_hour", "state",
                "launched_at", "replicas": [ids]}],
     "cost_usd_per_hour": float, "cost_usd_total": float}

Everything here is pure: value types, a bounded event log, and `build_status` that turns them into
the record's JSON.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

STATUS_COLLECTION = "autoscaler"
STATUS_ID = "status"
MAX_EVENTS = 50  # enough for the dashboard's "recent events" list; older ones live in the log


class EventKind(enum.StrEnum):
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    NODE_CREATE = "node_create"
    NODE_DELETE = "node_delete"
    NODE_ADOPTED = "node_adopted"
    ORPHAN_RELEASED = "orphan_released"
    REPLICA_START = "replica_start"
    REPLICA_READY = "replica_ready"
    REPLICA_DRAIN = "replica_drain"
    REPLICA_STOP = "replica_stop"
    REPLICA_FAILED = "replica_failed"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    PREEMPTED = "preempted"
    PROVIDER_ERROR = "provider_error"
    LEASE_ACQUIRED = "lease_acquired"
    LEASE_LOST = "lease_lost"


@dataclass(frozen=True, slots=True)
class Event:
    t: float  # wall seconds
    model: str | None
    kind: EventKind
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "model": self.model, "kind": self.kind.value, "message": self.message}


def append_events(events: tuple[Event, ...], new: Iterable[Event], limit: int = MAX_EVENTS) -> tuple[Event, ...]:
    """The log with `new` appended, keeping the last `limit` (oldest dropped first)."""
    combined = events + tuple(new)
    return combined[-limit:] if len(combined) > limit else combined


@dataclass(frozen=True, slots=True)
class ModelStatus:
    desired: int
    ready: int
    starting: int
    panic: bool
    forecast_rps: float | None
    arrivals_per_s: float
    queued: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"desired": self.desired, "ready": self.ready, "starting": self.starting, "panic": self.panic,
                "forecast_rps": self.forecast_rps, "arrivals_per_s": self.arrivals_per_s,
                "queued": self.queued, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class NodeStatus:
    id: str
    pool: str
    instance_type: str
    capacity_type: str  # "spot" | "on_demand"
    price_usd_per_hour: float
    state: str
    launched_at: float | None  # wall seconds
    replicas: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "pool": self.pool, "instance_type": self.instance_type,
                "capacity_type": self.capacity_type, "price_usd_per_hour": self.price_usd_per_hour,
                "state": self.state, "launched_at": self.launched_at, "replicas": list(self.replicas)}


def cost_per_hour(nodes: Iterable[NodeStatus]) -> float:
    """What the nodes cost right now, in USD per hour."""
    return sum(node.price_usd_per_hour for node in nodes)


def accrue_cost(total_usd: float, usd_per_hour: float, elapsed_s: float) -> float:
    """The running total after `elapsed_s` at `usd_per_hour`. Worked: $0 + $3.60/h for 10 s -> $0.01."""
    return total_usd + usd_per_hour * max(0.0, elapsed_s) / 3600.0


def build_status(*, updated_at: float, holder: str, models: Mapping[str, ModelStatus],
                 events: Iterable[Event], nodes: Iterable[NodeStatus], cost_usd_total: float) -> dict[str, Any]:
    """The status record's data (see the module docstring), models and nodes in a stable order."""
    node_list = sorted(nodes, key=lambda n: n.id)
    return {
        "updated_at": updated_at,
        "holder": holder,
        "models": {name: models[name].to_json() for name in sorted(models)},
        "events": [event.to_json() for event in events],
        "nodes": [node.to_json() for node in node_list],
        "cost_usd_per_hour": cost_per_hour(node_list),
        "cost_usd_total": cost_usd_total,
    }
