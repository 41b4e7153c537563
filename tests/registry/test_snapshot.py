"""The snapshot: immutable, versioned by meaning, with lookups."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.registry import UnknownName, load_registry
from tests.registry.samples import MODEL, POOL

ADAPTER = """
apiVersion: kvgate/v1
kind: Adapter
metadata: {name: helper}
spec: {base_model: tiny, source: /adapters/helper, rank: 8}
"""


def test_version_ignores_layout_comments_key_order_and_written_defaults(write_registry) -> None:
    one = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    reordered = MODEL.replace("kind: Model\n", "").replace("apiVersion: kvgate/v1\n", "kind: Model\napiVersion: kvgate/v1\n")
    two = write_registry({"pools/p.yaml": "# the pool\n" + POOL,
                          "m.yaml": reordered + "  routing: {policy: cache_aware}  # the default, written out\n"})
    assert load_registry(one, {}).version == load_registry(two, {}).version


def test_version_changes_with_meaning(write_registry) -> None:
    one = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    two = write_registry({"all.yaml": POOL + "---\n" + MODEL + "  routing: {policy: round_robin}\n"})
    assert load_registry(one, {}).version != load_registry(two, {}).version


def test_snapshot_cannot_be_changed(write_registry) -> None:
    snapshot = load_registry(write_registry({"all.yaml": POOL + "---\n" + MODEL}), {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.version = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        snapshot.models["other"] = snapshot.model("tiny")  # type: ignore[index]


def test_resolve_names_a_model_or_an_adapter_on_its_base(write_registry) -> None:
    snapshot = load_registry(write_registry({"all.yaml": "---\n".join([POOL, MODEL, ADAPTER])}), {})
    base = snapshot.resolve("tiny")
    assert base.model.metadata.name == "tiny" and base.adapter is None
    lora = snapshot.resolve("helper")
    assert lora.model.metadata.name == "tiny" and lora.adapter.metadata.name == "helper"
    assert lora.served_name == "helper"
    assert [a.metadata.name for a in snapshot.adapters_of("tiny")] == ["helper"]
    assert snapshot.served_names() == ["helper", "tiny"]


def test_unknown_names_raise_listing_what_exists(write_registry) -> None:
    snapshot = load_registry(write_registry({"all.yaml": "---\n".join([POOL, MODEL, ADAPTER])}), {})
    with pytest.raises(UnknownName, match=r"no model or adapter named 'gpt-4'; known: helper, tiny"):
        snapshot.resolve("gpt-4")
    with pytest.raises(UnknownName, match="known: local"):
        snapshot.pool("gpus")


def test_tenant_lookup_by_key_hmac(write_registry) -> None:
    tenant = f"""
apiVersion: kvgate/v1
kind: Tenant
metadata: {{name: acme}}
spec: {{api_key_hmac: "{'c' * 64}", models: ['*']}}
"""
    snapshot = load_registry(write_registry({"all.yaml": "---\n".join([POOL, MODEL, tenant])}), {})
    assert snapshot.tenant_for_key_hmac("c" * 64).metadata.name == "acme"
    assert snapshot.tenant_for_key_hmac("d" * 64) is None


def test_origins_point_at_each_document(write_registry) -> None:
    root = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    snapshot = load_registry(root, {})
    assert snapshot.origins[("Model", "tiny")] == (f"{root}/all.yaml", 9)
