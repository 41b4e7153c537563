"""The typed records that gateways and the autoscaler exchange through the state store's durable records.

- `ObservationRecord`: collection "observations", id "<model>@<gateway_id>". Each gateway writes one per
  model about once a second (`router/observations.py`); the autoscaler sums them over gateways
  (`autoscaler/observe.py`).
- `AutoscalerStatus`: collection "autoscaler", id "status". The autoscaler rewrites it every tick
  (`autoscaler/loop.py`, built by `autoscaler/status.py`); the dashboard (`router/dashboard.py`), `kvgate up`'s
  progress log (`kvgate/stack.py`) and the next leader (to continue the event log and running cost) read it.

Writers and readers both go through `to_json` / `from_json`, so the shape is written down once, here.
Versions follow `schema`: unknown fields are ignored, missing optional ones take their defaults, and
`from_json` raises `NewerSchema` for a newer major, and one of `MALFORMED` for a record that does not
parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvgate.state.base import StateStore
from kvgate.state.schema import SCHEMA_KEY, NewerSchema, SkippedRecords, check_schema, count, non_negative

# What `from_json` raises for a record that does not parse (NewerSchema is a ValueError too: catch it first).
# ArithmeticError: JSON's 1e999 reads back as infinity, and int() of it raises OverflowError.
MALFORMED = (ArithmeticError, AttributeError, KeyError, TypeError, ValueError)

OBSERVATIONS_COLLECTION = "observations"
STATUS_COLLECTION = "autoscaler"
STATUS_ID = "status"


def observation_id(model: str, gateway_id: str) -> str:
    """The record id a gateway writes its observation of `model` under."""
    return f"{model}@{gateway_id}"


# ------------------------------------------------------------------------------------ observations


@dataclass(frozen=True, slots=True)
class ObservationRecord:
    """One model as one gateway sees it now."""

    SCHEMA_VERSION: ClassVar[int] = 1

    model: str
    gateway_id: str
    updated_at: float  # wall seconds: readers skip records a few intervals old (a gateway that died)
    queued: int = 0  # requests waiting at the gateway for a replica (none ready: scaling from zero)
    in_flight: int = 0  # proxied to a replica, not finished
    arrivals_per_s: float = 0.0  # over the gateway's window (10 s by default)
    ttft_p99_s: float | None = None  # time to first token over the same window; None without one
    # Added within schema 1 (a reader of an older gateway's record sees the defaults: no work, so the
    # autoscaler scales that model on concurrency alone; no completions, so it learns a request's time in
    # service from arrivals while nothing is queued):
    arrivals_var: float | None = None  # Var(arrivals in one interval) / interval over the window; None: too early
    prompt_tokens_per_s: float = 0.0  # prompt tokens routed requests must still prefill, per second
    prompt_tokens_sq_per_s: float = 0.0  # the same requests' uncached tokens squared, summed, per second
    completions_per_s: float | None = None  # requests a replica served, per second over the window; None: not counted

    def to_json(self) -> dict[str, Any]:
        return {SCHEMA_KEY: self.SCHEMA_VERSION, "model": self.model, "gateway_id": self.gateway_id,
                "queued": self.queued, "in_flight": self.in_flight, "arrivals_per_s": self.arrivals_per_s,
                "arrivals_var": self.arrivals_var, "prompt_tokens_per_s": self.prompt_tokens_per_s,
                "prompt_tokens_sq_per_s": self.prompt_tokens_sq_per_s, "completions_per_s": self.completions_per_s,
                "ttft_p99_s": self.ttft_p99_s, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ObservationRecord:
        """Counts and rates must be finite and >= 0, the model a non-empty string (else ValueError)."""
        check_schema(raw, "observation", cls.SCHEMA_VERSION)
        model = raw["model"]
        if not isinstance(model, str) or not model:
            raise ValueError(f"observation record: model must be a non-empty string, got {model!r}")
        ttft, var, done = raw.get("ttft_p99_s"), raw.get("arrivals_var"), raw.get("completions_per_s")
        return cls(model=model, gateway_id=str(raw.get("gateway_id", "")), updated_at=float(raw["updated_at"]),
                   queued=count(raw.get("queued", 0), "queued"), in_flight=count(raw.get("in_flight", 0), "in_flight"),
                   arrivals_per_s=non_negative(raw.get("arrivals_per_s", 0.0), "arrivals_per_s"),
                   ttft_p99_s=None if ttft is None else non_negative(ttft, "ttft_p99_s"),
                   arrivals_var=None if var is None else non_negative(var, "arrivals_var"),
                   prompt_tokens_per_s=non_negative(raw.get("prompt_tokens_per_s", 0.0), "prompt_tokens_per_s"),
                   prompt_tokens_sq_per_s=non_negative(raw.get("prompt_tokens_sq_per_s", 0.0), "prompt_tokens_sq_per_s"),
                   completions_per_s=None if done is None else non_negative(done, "completions_per_s"))


# ------------------------------------------------------------------------------------ autoscaler status


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """One entry of the autoscaler's event log."""

    t: float  # wall seconds
    model: str | None
    # An `EventKind` value (autoscaler/status.py). A str here, so that a reader keeps a kind that a newer
    # release added instead of dropping the log.
    kind: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "model": self.model, "kind": str(self.kind), "message": self.message}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StatusEvent:
        return cls(t=float(raw["t"]), model=raw.get("model"), kind=str(raw["kind"]),
                   message=str(raw.get("message", "")))


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model's replica decision, as the autoscaler made it this tick."""

    desired: int
    ready: int
    starting: int
    panic: bool = False
    forecast_rps: float | None = None
    arrivals_per_s: float = 0.0
    queued: int = 0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"desired": self.desired, "ready": self.ready, "starting": self.starting, "panic": self.panic,
                "forecast_rps": self.forecast_rps, "arrivals_per_s": self.arrivals_per_s,
                "queued": self.queued, "reason": self.reason}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ModelStatus:
        forecast = raw.get("forecast_rps")
        return cls(desired=int(raw["desired"]), ready=int(raw["ready"]), starting=int(raw["starting"]),
                   panic=bool(raw.get("panic", False)), forecast_rps=None if forecast is None else float(forecast),
                   arrivals_per_s=float(raw.get("arrivals_per_s", 0.0)), queued=int(raw.get("queued", 0)),
                   reason=str(raw.get("reason", "")))


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node the autoscaler runs, with what it costs and the replicas on it."""

    id: str
    pool: str
    instance_type: str
    capacity_type: str  # "spot" | "on_demand"
    price_usd_per_hour: float
    state: str
    launched_at: float | None = None  # wall seconds
    replicas: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "pool": self.pool, "instance_type": self.instance_type,
                "capacity_type": self.capacity_type, "price_usd_per_hour": self.price_usd_per_hour,
                "state": self.state, "launched_at": self.launched_at, "replicas": list(self.replicas)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NodeStatus:
        launched_at = raw.get("launched_at")
        return cls(id=str(raw["id"]), pool=str(raw["pool"]), instance_type=str(raw["instance_type"]),
                   capacity_type=str(raw["capacity_type"]), price_usd_per_hour=float(raw["price_usd_per_hour"]),
                   state=str(raw["state"]), launched_at=None if launched_at is None else float(launched_at),
                   replicas=tuple(str(r) for r in raw.get("replicas", ())))


@dataclass(frozen=True, slots=True)
class AutoscalerStatus:
    """The autoscaler's status record: its decisions, recent events and nodes, and what they cost."""

    SCHEMA_VERSION: ClassVar[int] = 1

    updated_at: float  # wall seconds
    holder: str = ""  # the autoscaler (lease holder) that wrote it
    models: Mapping[str, ModelStatus] = field(default_factory=dict)
    events: tuple[StatusEvent, ...] = ()  # the last MAX_EVENTS (autoscaler/status.py), oldest first
    nodes: tuple[NodeStatus, ...] = ()
    cost_usd_per_hour: float = 0.0
    cost_usd_total: float = 0.0  # accrued since the first leader; carried across leaders

    def to_json(self) -> dict[str, Any]:
        return {SCHEMA_KEY: self.SCHEMA_VERSION, "updated_at": self.updated_at, "holder": self.holder,
                "models": {name: self.models[name].to_json() for name in sorted(self.models)},
                "events": [event.to_json() for event in self.events],
                "nodes": [node.to_json() for node in self.nodes],
                "cost_usd_per_hour": self.cost_usd_per_hour, "cost_usd_total": self.cost_usd_total}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> AutoscalerStatus:
        check_schema(raw, "autoscaler status", cls.SCHEMA_VERSION)
        return cls(updated_at=float(raw["updated_at"]), holder=str(raw.get("holder", "")),
                   models={str(name): ModelStatus.from_json(m) for name, m in raw.get("models", {}).items()},
                   events=tuple(StatusEvent.from_json(e) for e in raw.get("events", ())),
                   nodes=tuple(NodeStatus.from_json(n) for n in raw.get("nodes", ())),
                   cost_usd_per_hour=float(raw.get("cost_usd_per_hour", 0.0)), cost_usd_total=float(raw.get("cost_usd_total", 0.0)))


async def read_status(store: StateStore, skipped: SkippedRecords) -> AutoscalerStatus | None:
    """The autoscaler's status record; None when there is none, or when a newer release wrote it (said once
    through `skipped`). Raises `MALFORMED` errors for a record that does not parse, and what the store
    raises (`StateStoreUnavailable`)."""
    record = await store.get_record(STATUS_COLLECTION, STATUS_ID)
    if record is None:
        return None
    try:
        return AutoscalerStatus.from_json(record.data)
    except NewerSchema as exc:
        skipped.newer(STATUS_COLLECTION, STATUS_ID, exc)
        return None
