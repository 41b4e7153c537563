"""The autoscaler's status record, read by the dashboard (and reusable by the simulator).

State store collection "autoscaler", record id "status", rewritten every loop tick. The record and its
parts (`AutoscalerStatus`, `ModelStatus`, `NodeStatus`, `StatusEvent`) are typed in kvgate/state/records.py,
where its readers outside the autoscaler find them too; `Event` here is `StatusEvent`.

Everything here is pure: the event kinds, a bounded event log (the last 50, oldest first), the cost
arithmetic, and `build_status` that assembles the record.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from kvgate.state.records import STATUS_COLLECTION, STATUS_ID, AutoscalerStatus, ModelStatus, NodeStatus
from kvgate.state.records import StatusEvent as Event

__all__ = ["MAX_EVENTS", "STATUS_COLLECTION", "STATUS_ID", "AutoscalerStatus", "Event", "EventKind", "ModelStatus",
           "NodeStatus", "accrue_cost", "append_events", "build_status", "cost_per_hour"]

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


def append_events(events: tuple[Event, ...], new: Iterable[Event], limit: int = MAX_EVENTS) -> tuple[Event, ...]:
    """The log with `new` appended, keeping the last `limit` (oldest dropped first)."""
    combined = events + tuple(new)
    return combined[-limit:] if len(combined) > limit else combined


def cost_per_hour(nodes: Iterable[NodeStatus]) -> float:
    """What the nodes cost right now, in USD per hour."""
    return sum(node.price_usd_per_hour for node in nodes)


def accrue_cost(total_usd: float, usd_per_hour: float, elapsed_s: float) -> float:
    """The running total after `elapsed_s` at `usd_per_hour`. Worked: $0 + $3.60/h for 10 s -> $0.01."""
    return total_usd + usd_per_hour * max(0.0, elapsed_s) / 3600.0


def build_status(*, updated_at: float, holder: str, models: Mapping[str, ModelStatus],
                 events: Iterable[Event], nodes: Iterable[NodeStatus], cost_usd_total: float) -> AutoscalerStatus:
    """The status record, models and nodes in a stable order (the writer stores its `to_json()`)."""
    node_list = tuple(sorted(nodes, key=lambda n: n.id))
    return AutoscalerStatus(updated_at=updated_at, holder=holder, models={name: models[name] for name in sorted(models)},
                            events=tuple(events), nodes=node_list, cost_usd_per_hour=cost_per_hour(node_list),
                            cost_usd_total=cost_usd_total)
