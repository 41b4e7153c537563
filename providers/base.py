"""The `Provider` interface: what the autoscaler may ask of any place that sells nodes and runs replicas.

Modelled on Karpenter's CloudProvider. A provider serves one registry `Pool` for one kvgate cluster:

- **offerings** are what the pool sells (instance type x capacity type x zone), each with a price and an
  `available` flag. Sold-out offerings are flagged, never dropped, so the planner can tell "sold out now"
  from "not sold here".
- **nodes** are bought with a `NodeClaim`. `create` is idempotent on the claim id, so a planner that
  crashed between "record the claim" and "see the node" can safely ask again.
- **replicas** are `kvgate engine` servers placed on nodes; a `ReplicaHandle` says where one answers
  and whether it is ready, and, when it failed, why in words a person can act on.

Spot interruptions: a provider reports them as nodes in state `NodeState.INTERRUPTED` in `list()`
(with `Node.reason` saying what the cloud said). An interrupted node stays listed, as interrupted,
until the caller `delete`s it or the cloud has terminated it (then it is `TERMINATED` or gone). There
is no separate event stream: the reconciler polls `list()` anyway, and a poll cannot lose an event.

All methods are `async`; none may block the event loop for long. Errors are the typed `ProviderError`
subclasses below; a provider never lets a cloud SDK's own exception escape.

This module is pure: value types, errors, the protocol and pure helpers. It imports nothing but the
registry's types.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from kvgate.registry.schema import AdapterDoc, CapacityType, ModelDoc, PoolSpec

__all__ = [
    "CapacityType", "OfferingKey", "Offering", "NodeClaim", "NodeState", "Node", "ReplicaState",
    "ReplicaSpec", "ReplicaHandle", "ProviderError", "InsufficientCapacity", "QuotaExceeded", "NotFound",
    "ProviderUnavailable", "NodeNotReady", "Provider", "TAG_CLUSTER", "TAG_CLAIM", "TAG_POOL", "TAG_MODEL",
    "TAG_REPLICA",
    "node_tags", "offerings_from_pool", "check_quota", "replica_spec_for", "engine_args",
]

# Tags kvgate puts on every node it buys; `list()` finds nodes by TAG_CLUSTER (and TAG_POOL).
# Kubernetes label keys cannot hold ':', so that provider maps them to its own keys; the meaning is the same.
TAG_CLUSTER = "kvgate:cluster"
TAG_CLAIM = "kvgate:claim"
TAG_POOL = "kvgate:pool"
TAG_MODEL = "kvgate:model"
# On a node that boots into its replica (Offering.replica_at_boot): that replica's id, the claim id until
# `start_replica` adopts it under the caller's id. A node whose boot replica was handed out has no room left.
TAG_REPLICA = "kvgate:replica"


def _frozen_mapping(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(value or {}))


# ------------------------------------------------------------------------------------------ offerings


@dataclass(frozen=True, slots=True)
class OfferingKey:
    """What identifies an offering within a cluster: the planner remembers sold-out offerings by this key.

    `zone` is "" when the offering is sold in any zone of the region (the provider picks one)."""

    pool: str
    instance_type: str
    capacity_type: CapacityType
    zone: str = ""

    def __str__(self) -> str:
        where = f"/{self.zone}" if self.zone else ""
        return f"{self.pool}:{self.instance_type}:{self.capacity_type.value}{where}"


@dataclass(frozen=True, slots=True)
class Offering:
    """One thing a pool sells, with its price now and whether it can be bought now.

    `available=False` means sold out (a stockout, or the provider's own quota says no more of this kind);
    `create` with such an offering is expected to raise `InsufficientCapacity`."""

    pool: str
    instance_type: str
    gpu_kind: str  # e.g. "H100"; registry.schema.CPU_KIND ("cpu") for nodes without GPUs
    gpu_count: int
    gpu_memory_gib: float  # per GPU
    cpus: int | None
    memory_gib: float | None
    capacity_type: CapacityType
    region: str
    zone: str  # "" = any zone of the region
    price_usd_per_hour: float
    available: bool = True
    # True where a node boots straight into the one replica its claim names (`NodeClaim.replica`, AWS
    # cloud-init) and can run nothing else: the planner buys one such node per replica, and never
    # places a replica of another model, or a second one, on it.
    replica_at_boot: bool = False

    @property
    def key(self) -> OfferingKey:
        return OfferingKey(self.pool, self.instance_type, self.capacity_type, self.zone)


# ----------------------------------------------------------------------------------------------- nodes


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What is needed to start `kvgate engine` for one registry Model: built by `replica_spec_for`.

    `model` is the name clients send (the Model's registry name, passed as --served-model-name);
    `source` is the weights (builtin:NAME, a local directory or s3://...). `adapters` are (name, source)
    pairs, registered with --adapter NAME=SOURCE."""

    model: str
    source: str
    gpu_count: int = 0
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    max_batch_tokens: int | None = None
    max_running_requests: int | None = None
    max_loaded_adapters: int | None = None
    max_adapter_rank: int | None = None
    dtype: str | None = None
    adapters: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class NodeClaim:
    """A request to buy one node of one offering. `id` is chosen by the caller and is the idempotency
    key: `create` with an id it has seen returns that node again and buys nothing.

    `model` is a hint (tagged as kvgate:model, shown on dashboards). `replica`, when set, asks providers
    whose nodes boot straight into a replica (AWS cloud-init) to start that engine at boot; providers
    that start replicas separately ignore it. `labels` are extra tags the caller wants on the node."""

    id: str
    offering: OfferingKey
    model: str | None = None
    replica: ReplicaSpec | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("a NodeClaim needs a non-empty id (the idempotency key)")
        object.__setattr__(self, "labels", _frozen_mapping(self.labels))

    @property
    def pool(self) -> str:
        return self.offering.pool


class NodeState(str, enum.Enum):
    PENDING = "pending"  # bought, not yet usable (booting)
    RUNNING = "running"  # usable: replicas may be started on it
    INTERRUPTED = "interrupted"  # the cloud is taking it back (spot interruption); replicas will die
    TERMINATING = "terminating"  # delete was asked; going away
    TERMINATED = "terminated"  # gone; may still be listed for a while (EC2 keeps them ~1 h)


@dataclass(frozen=True, slots=True)
class Node:
    """A node kvgate bought. `launched_at` is wall-clock seconds (Unix epoch): it outlives processes.

    `tags` hold at least TAG_CLUSTER, TAG_CLAIM, TAG_POOL (and TAG_MODEL when the claim had a model).
    `address` is where replicas on it are reached (an IP or host name), None until known.
    `reason` says why a node is INTERRUPTED/TERMINATED when the provider knows (e.g. the spot notice)."""

    id: str
    claim_id: str
    pool: str
    instance_type: str
    capacity_type: CapacityType
    zone: str
    state: NodeState
    address: str | None
    tags: Mapping[str, str]
    launched_at: float
    price_usd_per_hour: float
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", _frozen_mapping(self.tags))

    @property
    def model(self) -> str | None:
        return self.tags.get(TAG_MODEL)


# -------------------------------------------------------------------------------------------- replicas


class ReplicaState(str, enum.Enum):
    STARTING = "starting"  # launched, /health not yet answering
    READY = "ready"  # /health answers: may take traffic
    FAILED = "failed"  # exited or never became healthy; `reason` says why
    STOPPED = "stopped"  # stopped on request


@dataclass(frozen=True, slots=True)
class ReplicaHandle:
    """One engine replica. `url` is its OpenAI-compatible base URL (http://host:port); `grpc_target`
    is host:port of its ReplicaState stream, None when it serves none. `reason` is a one-paragraph
    human explanation when FAILED (e.g. the end of the engine's log), "" otherwise.
    `started_at` is wall-clock seconds."""

    id: str
    model: str
    node_id: str
    url: str
    grpc_target: str | None
    state: ReplicaState
    started_at: float
    reason: str = ""


# ---------------------------------------------------------------------------------------------- errors


class ProviderError(Exception):
    """Base of every error a provider raises. `retryable` says whether the same call may succeed later
    without the caller changing anything (throttling, an API outage, a node still booting)."""

    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class InsufficientCapacity(ProviderError):
    """The offering is sold out now (stockout, spot price too low, no free slot). The planner should
    skip `offering` for a while and try the next cheapest."""

    def __init__(self, offering: OfferingKey, message: str = "") -> None:
        super().__init__(message or f"no capacity for {offering}")
        self.offering = offering


class QuotaExceeded(ProviderError):
    """An account or pool limit (instance count, vCPUs, GPUs, budget) forbids buying more in this pool."""


class NotFound(ProviderError):
    """The named node or replica does not exist (for calls where absence is an error, e.g. start_replica
    on an unknown node). `delete` and `stop_replica` never raise it: absence is their goal."""


class ProviderUnavailable(ProviderError):
    """The provider's API failed or timed out; the call may be retried (with backoff)."""

    retryable = True


class NodeNotReady(ProviderError):
    """start_replica on a node that is not RUNNING yet (or no longer); retry once it is."""

    retryable = True


# -------------------------------------------------------------------------------------------- protocol


@runtime_checkable
class Provider(Protocol):
    """One pool of one cluster. Construct through `providers.build.build_provider`.

    Contracts every implementation keeps (tests/providers/ checks them for each one):
    - `offerings()` lists every offering of the pool; sold-out ones have available=False, never dropped.
    - `create(claim)` is idempotent on `claim.id`: a second call returns the same node (same id) and buys
      nothing. A sold-out offering raises `InsufficientCapacity(claim.offering)`; a pool/account limit
      raises `QuotaExceeded`; an offering this pool does not sell raises `NotFound`. The node is tagged
      TAG_CLUSTER=cluster, TAG_CLAIM=claim.id, TAG_POOL=pool and TAG_MODEL=claim.model (when set).
    - `delete(node_id)` ends the node and every replica on it; deleting a node that is gone (or never
      existed) succeeds silently.
    - `list()` returns exactly the nodes tagged for this cluster and this pool, in any state (spot
      interruptions show as INTERRUPTED, see the module docstring), never nodes of another cluster.
    - `start_replica(node_id, spec, replica_id=None)` starts one engine on a RUNNING node and returns at
      once, usually in state STARTING; `list_replicas()` later shows it READY or FAILED (with a reason).
      Unknown node: `NotFound`; node not running: `NodeNotReady`. With `replica_id` given, a second call
      with the same id returns the existing replica (idempotent); without, the provider picks an id.
    - `stop_replica(replica_id, drain_deadline_s)` asks the replica to drain (SIGTERM or equivalent) and
      ends it for sure once the deadline passes; stopping an unknown or stopped replica succeeds.
    - `list_replicas()` returns this provider's replicas, failed ones included (until stopped).
    - `close()` releases clients and background tasks; it does not delete nodes or stop replicas
      (a restarted kvgate adopts them).
    """

    @property
    def pool(self) -> str: ...

    @property
    def cluster(self) -> str: ...

    async def offerings(self) -> list[Offering]: ...

    async def create(self, claim: NodeClaim) -> Node: ...

    async def delete(self, node_id: str) -> None: ...

    async def list(self) -> list[Node]: ...

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle: ...

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None: ...

    async def list_replicas(self) -> list[ReplicaHandle]: ...

    async def close(self) -> None: ...


@runtime_checkable
class WatchesReadiness(Protocol):
    """A provider that can watch one starting replica cheaply until it is READY or FAILED (the local provider
    polls its /health every `poll_s`). The autoscaler uses it to act on a replica the moment it is ready, rather
    than at its next tick: what a request waiting at zero replicas sees. Raises NotFound for an unknown replica."""

    async def wait_ready(self, replica_id: str, timeout_s: float, poll_s: float = 0.1) -> ReplicaHandle: ...


# ------------------------------------------------------------------------------------------ pure helpers


def node_tags(cluster: str, claim: NodeClaim) -> dict[str, str]:
    """The tags a provider puts on the node it buys for `claim` (caller labels first, ours win)."""
    tags = dict(claim.labels)
    tags.update({TAG_CLUSTER: cluster, TAG_CLAIM: claim.id, TAG_POOL: claim.pool})
    if claim.model:
        tags[TAG_MODEL] = claim.model
    return tags


def offerings_from_pool(pool_name: str, spec: PoolSpec, *, default_region: str = "") -> list[Offering]:
    """The pool's catalogue as offerings, all available: one per offer and zone (one with zone "" when
    the offer names no zones). Providers then flag what is sold out and may refresh prices."""
    region = spec.region or default_region
    result: list[Offering] = []
    for offer in spec.offers:
        for zone in offer.zones or ("",):
            result.append(Offering(
                pool=pool_name, instance_type=offer.instance_type, gpu_kind=offer.gpu_kind,
                gpu_count=offer.gpu_count, gpu_memory_gib=offer.gpu_memory_gib, cpus=offer.cpus,
                memory_gib=offer.memory_gib, capacity_type=offer.capacity_type, region=region, zone=zone,
                price_usd_per_hour=offer.price_usd_per_hour, available=True))
    return result


def check_quota(pool_name: str, offering: Offering, in_use: Sequence[tuple[int, float]], *,
                max_nodes: int | None, max_gpus: int | None, budget_usd_per_hour: float | None) -> None:
    """Raise `QuotaExceeded` when one more node of `offering`, on top of the live nodes `in_use` (one
    `(gpu_count, usd_per_hour)` pair each), would pass one of the pool's limits; None means no limit.

    The one rule every provider applies before it buys (the planner applies the same limits first; this
    is the provider's own guard). The message names the limit (`max_nodes`, `max_gpus`, `budget`) and
    the numbers, so a person can see which one to raise."""
    if max_nodes is not None and len(in_use) + 1 > max_nodes:
        raise QuotaExceeded(f"pool {pool_name!r}: max_nodes is {max_nodes} and {len(in_use)} nodes are up")
    gpus = sum(g for g, _ in in_use)
    if max_gpus is not None and gpus + offering.gpu_count > max_gpus:
        raise QuotaExceeded(f"pool {pool_name!r}: max_gpus is {max_gpus}; {gpus} GPUs in use and "
                            f"{offering.instance_type} has {offering.gpu_count}")
    spend = sum(p for _, p in in_use)
    # The epsilon: prices are summed floats, and a budget met exactly must still allow the node.
    if budget_usd_per_hour is not None and spend + offering.price_usd_per_hour > budget_usd_per_hour + 1e-9:
        raise QuotaExceeded(f"pool {pool_name!r}: budget is ${budget_usd_per_hour:.2f}/h; ${spend:.2f}/h spent "
                            f"and {offering.key} costs ${offering.price_usd_per_hour:.2f}/h")


def replica_spec_for(model: ModelDoc, adapters: Sequence[AdapterDoc] = ()) -> ReplicaSpec:
    """The engine settings of a registry Model (and the adapters on it) as a `ReplicaSpec`.

    Raises ValueError when an adapter belongs to another base model (a caller bug)."""
    name = model.metadata.name
    engine = model.spec.engine
    pairs: list[tuple[str, str]] = []
    for adapter in adapters:
        if adapter.spec.base_model != name:
            raise ValueError(f"adapter {adapter.metadata.name!r} belongs to {adapter.spec.base_model!r}, not {name!r}")
        pairs.append((adapter.metadata.name, adapter.spec.source))
    return ReplicaSpec(
        model=name, source=model.spec.source, gpu_count=model.spec.resources.gpu_count,
        kv_cache_bytes=int(engine.kv_cache_bytes) if engine.kv_cache_bytes is not None else None,
        max_model_len=engine.max_model_len_tokens, max_batch_tokens=engine.max_batch_tokens,
        max_running_requests=engine.max_running_requests, max_loaded_adapters=engine.max_loaded_adapters,
        max_adapter_rank=engine.max_adapter_rank, dtype=engine.dtype, adapters=tuple(sorted(pairs)))


def engine_args(spec: ReplicaSpec, *, host: str, port: int, grpc_port: int | None = None,
                replica_id: str | None = None, cache_dir: str | None = None,
                drain_timeout_s: float | None = None) -> list[str]:
    """The arguments after `kvgate engine` that start `spec` (a pure function, shared by every provider:
    local child processes, cloud-init scripts, Kubernetes container args)."""
    args = ["--model", spec.source, "--served-model-name", spec.model, "--host", host, "--port", str(port)]
    if grpc_port is not None:
        args += ["--grpc-port", str(grpc_port)]
    if replica_id:
        args += ["--replica-id", replica_id]
    args += ["--device", "cpu" if spec.gpu_count == 0 else "cuda"]
    optional = (("--kv-cache-bytes", spec.kv_cache_bytes), ("--max-model-len", spec.max_model_len),
                ("--max-num-batched-tokens", spec.max_batch_tokens), ("--max-num-seqs", spec.max_running_requests),
                ("--max-loras", spec.max_loaded_adapters), ("--max-lora-rank", spec.max_adapter_rank),
                ("--dtype", spec.dtype), ("--cache-dir", cache_dir),
                ("--drain-timeout-s", drain_timeout_s))
    for flag, value in optional:
        if value is not None:
            args += [flag, str(value)]
    for name, source in spec.adapters:
        args += ["--adapter", f"{name}={source}"]
    return args

