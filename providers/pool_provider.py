"""`PoolProvider`: the set-up that every provider's constructor shares, written once.

A provider serves one registry Pool for one kvgate cluster, on an injected clock (base.py's `Provider`).
Each implementation (`local`, `aws`, `kubernetes`, `fake`) subclasses `PoolProvider` and starts its
constructor with `super().__init__(pool_name, cluster=cluster, clock=clock, sleep=sleep)`; what stays
in the implementation is only what is its own (a cloud client, a catalogue, a work directory).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvgate.clock import Clock

# How a provider waits between retries and polls: `clock.sleep` unless a test passes one that returns at once.
Sleep = Callable[[float], Awaitable[None]]


class PoolProvider:
    """Which pool a provider serves, for which cluster, on which clock, and how it waits.

    Sets `_pool`, `_cluster`, `_clock` and `_sleep` (default: `clock.sleep`) for the implementation,
    and answers the `pool` and `cluster` properties of the `Provider` protocol."""

    def __init__(self, pool_name: str, *, cluster: str, clock: Clock, sleep: Sleep | None = None) -> None:
        self._pool = pool_name
        self._cluster = cluster
        self._clock = clock
        self._sleep: Sleep = sleep if sleep is not None else clock.sleep

    @property
    def pool(self) -> str:
        """The registry Pool this provider buys nodes from."""
        return self._pool

    @property
    def cluster(self) -> str:
        """The kvgate cluster whose nodes this provider tags and lists."""
        return self._cluster
