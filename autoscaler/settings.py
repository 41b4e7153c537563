"""How an `Autoscaler` is configured and wired: its settings, where it reads the registry, and how it
builds a provider per pool. Kept apart from the loop so the composition roots (`kvgate autoscaler`,
`kvgate up`) read one short module to embed it.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.autoscaler.observe import DEFAULT_MAX_AGE_S
from kvgate.autoscaler.planner import PlannerSettings
from kvgate.clock import Clock
from kvgate.providers.base import Provider
from kvgate.registry.schema import PoolDoc
from kvgate.registry.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class AutoscalerSettings:
    """Knobs of the live loop. Times in seconds."""

    interval_s: float = 1.0  # one tick per second: gateways write observations about as often
    lease_ttl_s: float = 10.0  # a dead leader is replaced this long after its last renewal
    member_ttl_s: float = 10.0  # membership heartbeats: a dead autoscaler's records expire after this
    drain_notice_s: float = 2.0  # routers see DRAINING this long before the replica is told to stop
    drain_timeout_s: float = 30.0  # how long stop_replica lets in-flight requests finish
    observation_max_age_s: float = DEFAULT_MAX_AGE_S
    backoff_base_s: float = 5.0  # first retry after a failed replica start; doubles per failure
    backoff_max_s: float = 300.0
    offerings_refresh_s: float = 60.0  # prices and availability are re-read this often per pool
    stop_wait_s: float = 5.0  # on stop(), how long to wait for replica stops already under way
    # How long a started replica is watched for readiness between ticks, where its provider can (WatchesReadiness):
    # the tick that publishes it READY runs when it is, not up to interval_s later.
    ready_watch_s: float = 120.0
    planner: PlannerSettings = field(default_factory=PlannerSettings)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.lease_ttl_s < 2 * self.interval_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must be at least two ticks "
                             f"(2 x interval_s = {2 * self.interval_s}) or the lease lapses between renewals")


class SnapshotSource(Protocol):
    """Anything with a `current` registry snapshot: a `RegistryWatcher` (hot reload, read every
    tick) or a `FixedSnapshot`."""

    @property
    def current(self) -> Snapshot: ...


@dataclass
class FixedSnapshot:
    """A snapshot source that never changes (tests, and callers that reload by assigning `current`)."""

    current: Snapshot


ProviderFactory = Callable[[str, PoolDoc], Provider]


def provider_factory_for(cluster: str, clock: Clock, **options: object) -> ProviderFactory:
    """A factory that builds each pool's provider with `providers.build.build_provider`."""
    from kvgate.providers.build import build_provider

    def build(pool_name: str, pool: PoolDoc) -> Provider:
        return build_provider(pool_name, pool.spec, cluster=cluster, clock=clock, **options)
    return build


def default_holder() -> str:
    """host-pid-random: unique per process, readable on the dashboard."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
