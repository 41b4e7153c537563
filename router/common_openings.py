"""The opening nearly every request of a model shares, measured over its recent requests.

Every prompt of a fleet often opens the same way: one application's system prompt, a chat template's
default one, a trace whose first block is in every request. Such an opening says nothing about where a
request's own cache lives. `cache_aware` already skips what every replica holds, but a replica that has not
yet served the model (new, or idle while queues are short) holds none of it, and then each request costs
`miss_cost_weight` x the opening more there than anywhere else. So while no queue forms it never gets a
request: on the engines' trace with two gateways, two of four engines stayed idle and the other two overflowed
their caches (requests per engine [274, 0, 0, 326], 0.849 of the best hit rate; counting the common opening,
[189, 185, 123, 103] and 0.992).

`CommonOpenings` counts, per model, the leading chain hashes of its last `window` requests, and says how many
leading chunks of a request at least `share` of them opened with (`observe`). The policy treats those chunks
as held everywhere. A hot prompt that half the requests share is not common: it is what routing follows.
Worked, window 256, share 0.9: after 256 requests all opening with the same 3 chunks and 10% of them also
sharing a 4th, a request with that opening has 3 common chunks.

Mutable state owned by the gateway shell, fed each routed request's chain; no clock, no I/O. A model whose
chunking changes (a registry reload) starts over by itself: its new chains' hashes are counted from zero, and the
old ones leave the window within `window` requests.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace

from kvgate.registry.schema import RoutingPolicy
from kvgate.router.features import RouteRequest

WINDOW_REQUESTS = 256  # recent requests per model that the share is taken over
COMMON_SHARE = 0.9  # the share of them that must open with a chunk for it to count as common
MIN_REQUESTS = 64  # fewer seen so far: nothing is common yet (the first burst says little about the rest)
MAX_CHUNKS = 64  # leading chunks counted per request


@dataclass
class _ModelOpenings:
    chains: deque[tuple[int, ...]] = field(default_factory=deque)
    counts: Counter[int] = field(default_factory=Counter)


class CommonOpenings:
    """Per model, the leading chunks nearly every recent request shares (module docstring)."""

    def __init__(self, window: int = WINDOW_REQUESTS, share: float = COMMON_SHARE, min_requests: int = MIN_REQUESTS,
                 max_chunks: int = MAX_CHUNKS) -> None:
        if window < 1 or not 0 < share <= 1 or min_requests < 1 or max_chunks < 1:
            raise ValueError(f"need window, min_requests, max_chunks >= 1 and 0 < share <= 1; got {window}, "
                             f"{min_requests}, {max_chunks}, {share}")
        self._window, self._share, self._min, self._max_chunks = window, share, min_requests, max_chunks
        self._by_model: dict[str, _ModelOpenings] = {}

    def observe(self, model: str, hashes: tuple[int, ...]) -> int:
        """Count this request's chain, then return how many of its leading chunks at least `share` of the
        model's last `window` requests (this one included) opened with; 0 until `min_requests` were seen.
        Chain hashes fold in everything before them, so counts only fall along a chain."""
        seen = self._by_model.setdefault(model, _ModelOpenings())
        chain = hashes[:self._max_chunks]
        seen.chains.append(chain)
        seen.counts.update(chain)
        if len(seen.chains) > self._window:
            old = seen.chains.popleft()
            seen.counts.subtract(old)
            for chunk_hash in old:
                if seen.counts[chunk_hash] <= 0:
                    del seen.counts[chunk_hash]
        if len(seen.chains) < self._min:
            return 0
        need = self._share * len(seen.chains)
        common = 0
        for chunk_hash in chain:
            if seen.counts[chunk_hash] < need:
                break
            common += 1
        return common

    def stamp(self, route: RouteRequest, policy: RoutingPolicy) -> RouteRequest:
        """`route` with its `common_opening_chunks` counted (`observe`) when `policy` uses them (cache_aware),
        as the gateway's handler and the routing replay both route."""
        if policy is not RoutingPolicy.CACHE_AWARE:
            return route
        return replace(route, common_opening_chunks=self.observe(route.model, route.prefix_hashes))
