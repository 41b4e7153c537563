"""The per-model wait at zero replicas: requests hold at the gateway while a replica starts.

Bounded twice: at most `max_queued` waiting per model (one more gets 503 at once), and each waits at
most `timeout_s` (then 503 with Retry-After). The depth is an observation for the autoscaler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvgate.router.errors import no_capacity

WaitForReplica = Callable[[str, float], Awaitable[bool]]


class WaitQueues:
    """Depth counters per model around the tracker's `wait_for_replica`. One event loop; no locks:
    the check and the increment happen with no await between them."""

    def __init__(self, wait_for_replica: WaitForReplica,
                 on_depth: Callable[[str, int], None] = lambda model, depth: None) -> None:
        self._wait_for_replica = wait_for_replica
        self._on_depth = on_depth
        self._depth: dict[str, int] = {}
        self._first_waiter_listeners: list[Callable[[str], None]] = []

    def on_first_waiter(self, listener: Callable[[str], None]) -> None:
        """Call `listener(model)` when a request starts waiting at a model where none waited: demand at zero
        ready replicas, which the observation publisher and an autoscaler in this process act on at once."""
        self._first_waiter_listeners.append(listener)

    def depth(self, model: str) -> int:
        """Requests of `model` waiting now: the autoscaler's queue observation."""
        return self._depth.get(model, 0)

    def depths(self) -> dict[str, int]:
        return {model: depth for model, depth in self._depth.items() if depth}

    async def wait(self, model: str, max_queued: int, timeout_s: float) -> None:
        """Return once a replica of `model` is ready. Raises ApiError 503 (with Retry-After) when
        the queue is full (at once) or no replica is ready within `timeout_s`."""
        depth = self.depth(model)
        if depth >= max_queued:
            raise no_capacity(f"model '{model}' has no ready replica and {depth} requests already wait for one",
                              retry_after_s=timeout_s)
        self._set(model, depth + 1)
        try:
            if depth == 0:
                for listener in self._first_waiter_listeners:
                    listener(model)
            ready = await self._wait_for_replica(model, timeout_s)
        finally:
            self._set(model, self.depth(model) - 1)
        if not ready:
            raise no_capacity(f"no replica of model '{model}' became ready within {timeout_s:g} s",
                              retry_after_s=timeout_s)

    def _set(self, model: str, depth: int) -> None:
        self._depth[model] = depth
        self._on_depth(model, depth)
