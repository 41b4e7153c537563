"""The replica service model and where replicas run: throughput, batch limit, price and cold start.

A replica of a model on one GPU kind (figures from the registry's `Model.spec.performance`):
- it holds at most `max_batch` requests at once (a slot per request, from admission to last token);
- it runs in engine steps (`batching.py`): each step decodes a token of every sequence past its prefill and
  prefills up to the model's `engine.max_batch_tokens` less those, first come first served (chunked prefill);
  a step takes max_batch / `decode_tokens_per_s` when anything decodes (decode is memory-bound: about the
  same at any batch size) plus its prefill tokens / `prefill_tokens_per_s`. So prefill and decode interfere:
  a burst of prompts queues for the prefill and lengthens every decoding sequence's steps meanwhile.

- with `kv_cache_tokens` set and a trace with block hashes (Mooncake), a replica keeps a prefix cache of that
  many tokens' blocks, least recently used out first (`PrefixCache`): a prompt prefills only the blocks after the
  longest prefix its replica holds, and the gateway sends a request to the replica that gives it its first token
  soonest (prefix held and prefill queue together).

It is the same for every policy, so the comparison between policies is fair; `loadtests/sim_calibrate.py` sets it
beside a real engine.

A `Placement` is one way to run a replica: a pool's offer (spot or on-demand), the replica's share of
the node price (gpu_count of the replica / gpu_count of the node: consolidation packs nodes), and the
cold start, the pool's node boot plus the model's load time (every start pays a fresh node: the
conservative case).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvgate.registry.schema import CapacityType, ModelDoc, Offer, PoolDoc
from kvgate.registry.snapshot import Snapshot


class SimConfigError(ValueError):
    """The registry lacks something the simulator needs; the message says what to add where."""


@dataclass(frozen=True)
class ServiceModel:
    gpu_kind: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # summed over a full batch
    max_batch: int
    kv_cache_tokens: int = 0  # the prefix cache's size; 0: none
    max_batch_tokens: int = 2048  # an engine step's token budget (chunked prefill: `batching.py`)

    def prefill_s(self, input_tokens: int) -> float:
        return input_tokens / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: int) -> float:
        # The first output token comes out of prefill; the rest are decoded at the per-sequence rate.
        return max(0, output_tokens - 1) * self.max_batch / self.decode_tokens_per_s


def service_model(model: ModelDoc, gpu_kind: str) -> ServiceModel:
    """The service model of `model` on `gpu_kind`; raises `SimConfigError` if the registry has no figures."""
    for entry in model.spec.performance.gpu_kinds:
        if entry.gpu_kind == gpu_kind:
            return ServiceModel(gpu_kind, entry.prefill_tokens_per_s, entry.decode_tokens_per_s,
                                entry.max_batch or model.spec.engine.max_running_requests, entry.kv_cache_tokens or 0,
                                model.spec.engine.max_batch_tokens)
    known = [entry.gpu_kind for entry in model.spec.performance.gpu_kinds]
    raise SimConfigError(f"Model/{model.metadata.name} has no spec.performance.gpu_kinds entry for {gpu_kind!r} "
                         f"(has {known or 'none'}); add prefill_tokens_per_s and decode_tokens_per_s for it")


class PrefixCache:
    """One replica's prefix cache: prompt blocks (hash ids) in least-recently-used order, at most `capacity` of them.
    Mutable, owned by one simulated replica. Worked: capacity 2, prompts [1, 2] then [1, 3]: the second matches 1
    block, and after it [2] is the one evicted (1 and 3 were used last)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks`, from the first, the cache holds."""
        held = 0
        for block in blocks:
            if block not in self._blocks:
                break
            held += 1
        return held

    def insert(self, blocks: tuple[int, ...]) -> None:
        """A prompt was prefilled: its blocks are the most recently used (a prompt longer than the cache keeps its
        last `capacity` blocks, which a later prompt cannot reuse without the first: harmless)."""
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass(frozen=True)
class Placement:
    """One way to run a replica of the model."""

    pool: str
    instance_type: str
    capacity_type: CapacityType
    price_usd_per_hour: float  # this replica's share of the node's price
    gpus: int  # GPUs this replica holds (for GPU-hours)
    cold_start_s: float  # node boot + model load
    service: ServiceModel

    @property
    def key(self) -> str:
        return f"{self.pool}/{self.instance_type}/{self.capacity_type.value}"


def placements(snapshot: Snapshot, model_name: str) -> tuple[Placement, ...]:
    """Every compatible placement of the model, cheapest first (ties: shorter cold start first).

    Compatible: a pool the model may use, the offer's GPU kind among the model's kinds with figures in
    `performance`, enough GPUs and GPU memory per node; spot offers only if the model allows spot.
    Raises `SimConfigError` when nothing fits, naming the model's needs.
    """
    model = snapshot.model(model_name)
    spec = model.spec
    pools = spec.placement.pools or tuple(snapshot.pools)
    found: list[Placement] = []
    for pool_name in pools:
        pool = snapshot.pool(pool_name)
        for offer in pool.spec.offers:
            if not _fits(model, offer):
                continue
            if offer.capacity_type is CapacityType.SPOT and not spec.placement.allow_spot:
                continue
            try:
                service = service_model(model, offer.gpu_kind)
            except SimConfigError:
                continue
            found.append(_placement(model, pool_name, pool, offer, service))
    if not found:
        raise SimConfigError(
            f"Model/{model_name} fits no offer: needs {spec.resources.gpu_count} x {list(spec.resources.gpu_kinds)} "
            f"in pools {list(pools)}, with spec.performance figures for the GPU kind")
    return tuple(sorted(found, key=lambda p: (p.price_usd_per_hour, p.cold_start_s, p.key)))


def _fits(model: ModelDoc, offer: Offer) -> bool:
    needs = model.spec.resources
    if offer.gpu_kind not in needs.gpu_kinds or offer.gpu_count < needs.gpu_count:
        return False
    return needs.min_gpu_memory_gib is None or offer.gpu_memory_gib >= needs.min_gpu_memory_gib


def _placement(model: ModelDoc, pool_name: str, pool: PoolDoc, offer: Offer, service: ServiceModel) -> Placement:
    gpus = model.spec.resources.gpu_count
    share = gpus / offer.gpu_count if offer.gpu_count else 1.0
    return Placement(pool=pool_name, instance_type=offer.instance_type, capacity_type=offer.capacity_type,
                     price_usd_per_hour=offer.price_usd_per_hour * share, gpus=gpus,
                     cold_start_s=pool.spec.node_boot_s + model.spec.performance.model_load_s, service=service)


def choose_placement(options: tuple[Placement, ...], *, spot: bool, unavailable: frozenset[str]) -> Placement | None:
    """The cheapest available placement of the wanted capacity type; on-demand if no spot is available.

    `spot` False asks for on-demand only (the on-demand base). None when nothing is available.
    """
    wanted = [p for p in options if p.key not in unavailable
              and (spot or p.capacity_type is CapacityType.ON_DEMAND)]
    return wanted[0] if wanted else None
