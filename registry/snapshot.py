"""The validated registry as one immutable, versioned value.

Everything downstream (router, autoscaler, engine launcher) reads a `Snapshot`, never YAML. A snapshot
never changes; a reload produces a new one. Its `version` is a content hash over the canonical JSON of
every document (defaults filled in), so two directories that mean the same thing have the same
version whatever their file layout, comments or key order, and any change in meaning changes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvgate.registry.problems import KeyPath
from kvgate.registry.schema import KINDS, AdapterDoc, ModelDoc, PoolDoc, TenantDoc
from kvgate.registry.yamlsource import SourceDocument

AnyDoc = ModelDoc | AdapterDoc | PoolDoc | TenantDoc


@dataclass(frozen=True)
class LoadedDocument:
    """A schema-valid document and where it came from (for cross-check errors with lines)."""

    document: AnyDoc
    origin: SourceDocument

    @property
    def kind(self) -> str:
        return self.document.kind

    @property
    def name(self) -> str:
        return self.document.metadata.name

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.name}"


class UnknownName(KeyError):
    """A lookup named something the registry does not declare. The message lists what exists."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = known
        shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
        super().__init__(f"no {kind} named {name!r}; known: {shown or '(none)'}")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Resolved:
    """What a request's `model` field means: a base model, and the adapter on it if one was named."""

    model: ModelDoc
    adapter: AdapterDoc | None = None

    @property
    def served_name(self) -> str:
        return (self.adapter or self.model).metadata.name


@dataclass(frozen=True)
class Snapshot:
    """An immutable, validated registry. Build it with `registry.load_registry`."""

    source: str
    version: str  # first 16 hex digits of the SHA-256 of the canonical content
    models: Mapping[str, ModelDoc]
    adapters: Mapping[str, AdapterDoc]
    pools: Mapping[str, PoolDoc]
    tenants: Mapping[str, TenantDoc]
    # (kind, name) -> (file, line) where each document starts, for messages and the dashboard.
    origins: Mapping[tuple[str, str], tuple[str, int]] = field(repr=False)
    # (kind, name, key path) of values filled from ${ENV_VAR}: secrets that `plan` must not print.
    sensitive: frozenset[tuple[str, str, KeyPath]] = field(repr=False)
    _adapters_by_model: Mapping[str, tuple[AdapterDoc, ...]] = field(repr=False)
    _tenants_by_key: Mapping[str, TenantDoc] = field(repr=False)

    @classmethod
    def build(cls, source: str, documents: list[LoadedDocument]) -> Snapshot:
        """Assemble a snapshot from documents that already passed every check."""
        by_kind: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
        origins: dict[tuple[str, str], tuple[str, int]] = {}
        sensitive: set[tuple[str, str, KeyPath]] = set()
        for loaded in sorted(documents, key=lambda d: (d.kind, d.name)):
            by_kind[loaded.kind][loaded.name] = loaded.document
            origins[(loaded.kind, loaded.name)] = (loaded.origin.file, loaded.origin.line)
            sensitive.update((loaded.kind, loaded.name, path) for path in loaded.origin.from_env)
        adapters_by_model: dict[str, list[AdapterDoc]] = {}
        for adapter in by_kind["Adapter"].values():
            adapters_by_model.setdefault(adapter.spec.base_model, []).append(adapter)
        return cls(
            source=source,
            version=content_hash(by_kind),
            models=MappingProxyType(by_kind["Model"]),
            adapters=MappingProxyType(by_kind["Adapter"]),
            pools=MappingProxyType(by_kind["Pool"]),
            tenants=MappingProxyType(by_kind["Tenant"]),
            origins=MappingProxyType(origins),
            sensitive=frozenset(sensitive),
            _adapters_by_model=MappingProxyType({k: tuple(v) for k, v in adapters_by_model.items()}),
            _tenants_by_key=MappingProxyType({t.spec.api_key_hmac: t for t in by_kind["Tenant"].values()}),
        )

    @classmethod
    def empty(cls, source: str = "(empty)") -> Snapshot:
        """A registry with no documents: the starting point of a first `plan`."""
        return cls.build(source, [])

    # -------------------------------------------------------------------------------------- lookups

    def model(self, name: str) -> ModelDoc:
        """The base model called `name`; raises `UnknownName`."""
        try:
            return self.models[name]
        except KeyError:
            raise UnknownName("model", name, sorted(self.models)) from None

    def adapter(self, name: str) -> AdapterDoc:
        """The adapter called `name`; raises `UnknownName`."""
        try:
            return self.adapters[name]
        except KeyError:
            raise UnknownName("adapter", name, sorted(self.adapters)) from None

    def pool(self, name: str) -> PoolDoc:
        """The pool called `name`; raises `UnknownName`."""
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownName("pool", name, sorted(self.pools)) from None

    def resolve(self, served_name: str) -> Resolved:
        """What a request's `model` field names: a base model, or an adapter plus its base.

        Model and adapter names never collide (a cross-check), so this is unambiguous.
        Raises `UnknownName` listing every servable name.
        """
        if served_name in self.models:
            return Resolved(self.models[served_name])
        if served_name in self.adapters:
            adapter = self.adapters[served_name]
            return Resolved(self.models[adapter.spec.base_model], adapter)
        raise UnknownName("model or adapter", served_name, self.served_names())

    def served_names(self) -> list[str]:
        """Every name a request may put in `model`: base models and adapters, sorted."""
        return sorted([*self.models, *self.adapters])

    def adapters_of(self, model_name: str) -> tuple[AdapterDoc, ...]:
        """The adapters whose base is `model_name`, sorted by name (empty if none)."""
        return self._adapters_by_model.get(model_name, ())

    def tenant_for_key_hmac(self, api_key_hmac: str) -> TenantDoc | None:
        """The tenant whose API key's HMAC (`registry.tenant.key_hmac`, lower-case hex) is `api_key_hmac`, or
        None. A dict lookup, built once per snapshot."""
        return self._tenants_by_key.get(api_key_hmac)

    def documents(self) -> Iterator[AnyDoc]:
        """Every document, by kind (Model, Adapter, Pool, Tenant) then name."""
        for table in (self.models, self.adapters, self.pools, self.tenants):
            yield from table.values()

    def counts(self) -> dict[str, int]:
        return {"Model": len(self.models), "Adapter": len(self.adapters),
                "Pool": len(self.pools), "Tenant": len(self.tenants)}


def content_hash(by_kind: Mapping[str, Mapping[str, Any]]) -> str:
    canonical = {
        kind: {name: doc.model_dump(mode="json") for name, doc in sorted(docs.items())}
        for kind, docs in sorted(by_kind.items())
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
