"""Checks across documents: each document is schema-valid on its own, but do they fit together?

- names are unique per kind, over every document, valid or not (`duplicate_names`), and no adapter shares a
  name with a model (both go in `model`);
- an adapter's base model exists, has room for adapters, accepts the adapter's rank, and is the model a
  built-in adapter is made for;
- a model's placement names existing pools, and some allowed pool sells an offer it can run on;
- a tenant names models or adapters that exist, and no two tenants share an API key.

Each function is pure: documents in, problems out.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgate.registry.problems import KeyPath, Problem
from kvgate.registry.schema import BUILTIN_ADAPTERS, CapacityType, ModelDoc, Offer, PoolDoc, PoolSpec
from kvgate.registry.snapshot import LoadedDocument
from kvgate.registry.tenant import ALL_MODELS
from kvgate.registry.yamlsource import SourceDocument


def cross_check(documents: list[LoadedDocument],
                declared_elsewhere: frozenset[tuple[str, str]] = frozenset()) -> list[Problem]:
    """Every problem between `documents` but duplicate names (`duplicate_names` sees the invalid documents
    too; here the first of two documents of one name is checked). `declared_elsewhere` holds (kind, name)
    of documents that exist but failed validation: references to them are not dangling, what uses them
    is not checked against them, and they are not checked."""
    first: dict[tuple[str, str], LoadedDocument] = {}
    for loaded in documents:
        first.setdefault((loaded.kind, loaded.name), loaded)
    unique = list(first.values())
    problems: list[Problem] = []
    broken = {kind: {name for k, name in declared_elsewhere if k == kind} for kind in ("Model", "Adapter", "Pool")}
    models = {d.name: d for d in unique if d.kind == "Model"}
    adapters = {d.name: d for d in unique if d.kind == "Adapter"}
    pools = {d.name: d for d in unique if d.kind == "Pool"}
    tenants = [d for d in unique if d.kind == "Tenant"]

    for name, adapter in adapters.items():
        if name in models:
            problems.append(_at(adapter, ("metadata", "name"),
                                f"{name!r} is also a Model's name; requests name either in `model`, so "
                                f"adapter and model names must differ"))
        if adapter.document.spec.base_model not in broken["Model"]:
            problems += _check_adapter(adapter, models)
    pool_docs = {name: loaded.document for name, loaded in pools.items()}
    for model in models.values():
        # An invalid Pool might have been the one this model fits; its own problem is the one to fix. No
        # pools listed means every pool, the invalid ones too.
        allowed = model.document.spec.placement.pools or tuple(broken["Pool"])
        if not any(name in broken["Pool"] for name in allowed):
            problems += _check_placement(model, pool_docs)
    problems += _check_tenants(tenants, models, adapters, broken["Model"] | broken["Adapter"])
    return problems


def _at(loaded: LoadedDocument, path: KeyPath, message: str) -> Problem:
    return Problem(loaded.origin.file, loaded.origin.line_of(path), loaded.label, path, message)


def duplicate_names(declared: Iterable[tuple[str, str, SourceDocument]]) -> list[Problem]:
    """A problem at each document that repeats the (kind, name) of an earlier one. `declared`: the
    (kind, name, document) of every document in reading order, valid or not, so that a duplicate is
    reported even when one of the copies has problems of its own."""
    first: dict[tuple[str, str], SourceDocument] = {}
    problems = []
    for kind, name, source in declared:
        earlier = first.setdefault((kind, name), source)
        if earlier is not source:
            path = ("metadata", "name")
            problems.append(Problem(source.file, source.line_of(path), f"{kind}/{name}", path,
                                    f"duplicate {kind} name {name!r}; first defined at {earlier.file}:{earlier.line}"))
    return problems


def _check_adapter(adapter: LoadedDocument, models: dict[str, LoadedDocument]) -> list[Problem]:
    spec = adapter.document.spec
    base = models.get(spec.base_model)
    if base is None:
        known = ", ".join(sorted(models)) or "(none)"
        return [_at(adapter, ("spec", "base_model"), f"no Model named {spec.base_model!r}; models: {known}")]
    engine = base.document.spec.engine
    problems = []
    made_for = BUILTIN_ADAPTERS.get(spec.source.removeprefix("builtin:")) if spec.source.startswith("builtin:") else None
    if made_for is not None and base.document.spec.source != f"builtin:{made_for}":
        problems.append(_at(adapter, ("spec", "source"),
                            f"{spec.source} is made for builtin:{made_for}, but Model/{base.name} has source "
                            f"{base.document.spec.source!r}"))
    if spec.rank > engine.max_adapter_rank:
        problems.append(_at(adapter, ("spec", "rank"),
                            f"rank {spec.rank} exceeds Model/{base.name} spec.engine.max_adapter_rank "
                            f"({engine.max_adapter_rank}, its engines' --max-lora-rank); raise that or use a "
                            "smaller rank"))
    if engine.max_loaded_adapters == 0:
        problems.append(_at(adapter, ("spec", "base_model"),
                            f"Model/{base.name} has engine.max_loaded_adapters 0, so no adapter can be loaded"))
    return problems


def compatible(offer: Offer, model: ModelDoc) -> bool:
    """Can one node of `offer` run one replica of `model`? (GPU kind, count and memory.)"""
    needs = model.spec.resources
    if offer.gpu_kind not in needs.gpu_kinds or offer.gpu_count < needs.gpu_count:
        return False
    return needs.min_gpu_memory_gib is None or offer.gpu_memory_gib >= needs.min_gpu_memory_gib


def declared_offers(spec: PoolSpec) -> tuple[Offer, ...]:
    """What a pool is known to sell before anything runs: its offers; for a slurm pool, one offer per gres
    type it names, of up to 64 GPUs (sinfo tells the real count per node when the pool runs)."""
    if spec.slurm is None:
        return spec.offers
    return tuple(Offer(instance_type=f"{name}xN", gpu_kind=gpu.kind, gpu_count=64, gpu_memory_gib=gpu.memory_gib,
                       price_usd_per_hour=spec.slurm.gpu_hour_usd)
                 for name, gpu in spec.slurm.gpu_types.items())


def _check_placement(loaded: LoadedDocument, pools: dict[str, PoolDoc]) -> list[Problem]:
    model: ModelDoc = loaded.document
    if model.spec.routing.static_replicas:
        return []  # fronts servers someone else runs: nothing to place
    placement = model.spec.placement
    problems = []
    for index, name in enumerate(placement.pools):
        if name not in pools:
            known = ", ".join(sorted(pools)) or "(none)"
            problems.append(_at(loaded, ("spec", "placement", "pools", index), f"no Pool named {name!r}; pools: {known}"))
    allowed = [pools[n] for n in placement.pools if n in pools] if placement.pools else list(pools.values())
    if problems:
        return problems
    if not allowed:
        return [_at(loaded, ("spec", "placement"), "no Pool is declared, so this model cannot be placed; declare a "
                                                    "Pool or give routing.static_replicas")]
    offers = [offer for pool in allowed for offer in declared_offers(pool.spec)]
    if not any(compatible(offer, model) for offer in offers):
        needs = model.spec.resources
        memory = f" with >= {needs.min_gpu_memory_gib} GiB each" if needs.min_gpu_memory_gib else ""
        sold = sorted({f"{o.gpu_count}x {o.gpu_kind}" + (f" ({o.gpu_memory_gib:g} GiB)" if o.gpu_memory_gib else "")
                       for o in offers})
        return [_at(loaded, ("spec", "resources", "gpu_kinds"),
                    f"needs {needs.gpu_count}x {' or '.join(needs.gpu_kinds)}{memory}, but the allowed pools "
                    f"({', '.join(p.metadata.name for p in allowed)}) offer only: {', '.join(sold)}")]
    if not placement.allow_spot and not any(
        compatible(o, model) and o.capacity_type is CapacityType.ON_DEMAND for o in offers
    ):
        return [_at(loaded, ("spec", "placement", "allow_spot"),
                    "every compatible offer is spot, but allow_spot is false; allow spot or add on-demand offers")]
    return []


def _check_tenants(tenants: list[LoadedDocument], models: dict[str, LoadedDocument],
                   adapters: dict[str, LoadedDocument], broken: set[str]) -> list[Problem]:
    problems = []
    owner_of_key: dict[str, LoadedDocument] = {}
    servable = sorted([*models, *adapters])
    for tenant in tenants:
        spec = tenant.document.spec
        for index, name in enumerate(spec.models):
            if name != ALL_MODELS and name not in models and name not in adapters and name not in broken:
                problems.append(_at(tenant, ("spec", "models", index),
                                    f"no Model or Adapter named {name!r}; known: {', '.join(servable) or '(none)'}"
                                    f", or '*' for all"))
        other = owner_of_key.setdefault(spec.api_key_hmac, tenant)
        if other is not tenant:
            problems.append(_at(tenant, ("spec", "api_key_hmac"),
                                f"the same API key hash as Tenant/{other.name}; a key must identify one tenant"))
    return problems
