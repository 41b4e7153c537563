"""Cross-checks: documents that are fine alone but do not fit together."""

from __future__ import annotations

import pytest

from kvgate.registry import RegistryInvalid, load_registry
from tests.registry.samples import MODEL, POOL

GPU_POOL = """
apiVersion: kvgate/v1
kind: Pool
metadata: {name: gpus}
spec:
  provider: aws
  region: us-east-1
  aws: {install: {wheel_url: https://artifacts.example/kvgate-0.1.0-py3-none-any.whl}}
  offers:
    - {instance_type: g6e.xlarge, gpu_kind: L40S, gpu_count: 1, gpu_memory_gib: 48, price_usd_per_hour: 1.86,
       capacity_type: spot}
"""

GPU_MODEL = """
apiVersion: kvgate/v1
kind: Model
metadata: {name: big}
spec:
  source: s3://models/big
  resources: {gpu_kinds: [H100], gpu_count: 1}
"""

ADAPTER = """
apiVersion: kvgate/v1
kind: Adapter
metadata: {name: helper}
spec: {base_model: tiny, source: /adapters/helper, rank: 8}
"""

TENANT = """
apiVersion: kvgate/v1
kind: Tenant
metadata: {name: acme}
spec:
  api_key_hmac: "%s"
  models: [tiny]
"""
KEY_A = "a" * 64


def messages(write_registry, *documents: str) -> list[str]:
    root = write_registry({"all.yaml": "---\n".join(documents)})
    with pytest.raises(RegistryInvalid) as caught:
        load_registry(root, {})
    return [p.message for p in caught.value.problems]


def test_names_are_unique_per_kind(write_registry) -> None:
    (message,) = messages(write_registry, POOL, MODEL, MODEL)
    assert message.startswith("duplicate Model name 'tiny'; first defined at ")


def test_a_duplicate_name_is_reported_even_when_one_copy_is_invalid(write_registry) -> None:
    invalid = MODEL + "  scaling: {max_replicas: 0}\n"
    for first, second in ((invalid, MODEL), (MODEL, invalid)):
        found = messages(write_registry, POOL, first, second)
        assert len(found) == 2 and sum(m.startswith("duplicate Model name 'tiny'; first defined at ") for m in found) == 1


def test_an_invalid_pool_is_reported_once_not_again_as_missing_on_its_models(write_registry) -> None:
    bad_pool = POOL.replace("price_usd_per_hour: 0", "price_usd_per_hour: -1")
    named = MODEL + "  placement: {pools: [local]}\n"
    for model in (MODEL, named):  # every pool allowed, or this one named
        (message,) = messages(write_registry, bad_pool, model)  # not also "too short", nor "no Pool is declared"
        assert message == "Input should be greater than or equal to 0; got -1"


def test_the_same_name_may_be_used_by_different_kinds(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL.replace("name: tiny", "name: local")})
    assert load_registry(root, {}).model("local")


def test_adapter_and_model_names_must_differ(write_registry) -> None:
    clash = ADAPTER.replace("name: helper", "name: tiny")
    (message,) = messages(write_registry, POOL, MODEL, clash)
    assert "'tiny' is also a Model's name" in message


def test_adapter_rank_must_fit_the_base_model(write_registry) -> None:
    (message,) = messages(write_registry, POOL, MODEL, ADAPTER.replace("rank: 8", "rank: 64"))
    assert message == ("rank 64 exceeds Model/tiny spec.engine.max_adapter_rank (16, its engines' --max-lora-rank); "
                       "raise that or use a smaller rank")


def test_a_builtin_adapter_must_sit_on_the_builtin_model_it_was_made_for(write_registry) -> None:
    demo = ADAPTER.replace("source: /adapters/helper", "source: builtin:smollm2-demo-a")
    (message,) = messages(write_registry, POOL, MODEL, demo)
    assert message == "builtin:smollm2-demo-a is made for builtin:smollm2-135m, but Model/tiny has source 'builtin:tiny-llama'"
    smollm2 = MODEL.replace("builtin:tiny-llama", "builtin:smollm2-135m")
    assert load_registry(write_registry({"a.yaml": "---\n".join([POOL, smollm2, demo])}), {}).adapter("helper")


def test_an_unknown_builtin_adapter_lists_the_builtin_ones(write_registry) -> None:
    (message,) = messages(write_registry, POOL, MODEL, ADAPTER.replace("/adapters/helper", "builtin:sql"))
    assert message == "unknown built-in adapter 'builtin:sql'; built-ins are builtin:smollm2-demo-a, builtin:smollm2-demo-b"


def test_adapter_needs_a_base_model_that_can_load_adapters(write_registry) -> None:
    model = MODEL + "  engine: {max_loaded_adapters: 0}\n"
    (message,) = messages(write_registry, POOL, model, ADAPTER)
    assert "max_loaded_adapters 0" in message


def test_placement_must_name_existing_pools(write_registry) -> None:
    model = MODEL + "  placement: {pools: [local, nowhere]}\n"
    assert messages(write_registry, POOL, model) == ["no Pool named 'nowhere'; pools: local"]


def test_a_model_needs_a_gpu_kind_that_some_allowed_pool_offers(write_registry) -> None:
    assert messages(write_registry, POOL, GPU_POOL, GPU_MODEL) == [
        "needs 1x H100, but the allowed pools (local, gpus) offer only: 0x cpu, 1x L40S (48 GiB)"
    ]


def test_gpu_memory_counts(write_registry) -> None:
    model = GPU_MODEL.replace("[H100]", "[L40S]").replace("gpu_count: 1}", "gpu_count: 1, min_gpu_memory_gib: 80}")
    (message,) = messages(write_registry, GPU_POOL, model)
    assert message.startswith("needs 1x L40S with >= 80.0 GiB each")


def test_spot_only_offers_need_allow_spot(write_registry) -> None:
    model = GPU_MODEL.replace("[H100]", "[L40S]")
    assert messages(write_registry, GPU_POOL, model) == [
        "every compatible offer is spot, but allow_spot is false; allow spot or add on-demand offers"
    ]
    allowed = model + "  placement: {allow_spot: true}\n"
    assert load_registry(write_registry({"a.yaml": GPU_POOL + "---\n" + allowed}), {}).model("big")


def test_a_model_without_pools_cannot_be_placed(write_registry) -> None:
    assert messages(write_registry, MODEL) == [
        "no Pool is declared, so this model cannot be placed; declare a Pool or give routing.static_replicas"
    ]


def test_a_model_fronting_static_replicas_needs_no_pool(write_registry) -> None:
    model = MODEL + "  routing:\n    static_replicas: [{url: 'http://10.0.0.5:8000/', backend: vllm}]\n"
    snapshot = load_registry(write_registry({"a.yaml": model}), {})
    assert snapshot.model("tiny").spec.routing.static_replicas[0].url == "http://10.0.0.5:8000"


def test_tenants_must_name_existing_models_or_adapters(write_registry) -> None:
    tenant = (TENANT % KEY_A).replace("models: [tiny]", "models: [tiny, helper, ghost]")
    assert messages(write_registry, POOL, MODEL, ADAPTER, tenant) == [
        "no Model or Adapter named 'ghost'; known: helper, tiny, or '*' for all"
    ]


def test_two_tenants_cannot_share_a_key(write_registry) -> None:
    second = (TENANT % KEY_A.upper()).replace("name: acme", "name: globex")
    (message,) = messages(write_registry, POOL, MODEL, TENANT % KEY_A, second)
    assert message == "the same API key hash as Tenant/acme; a key must identify one tenant"


def test_every_cross_check_problem_is_reported_together(write_registry) -> None:
    found = messages(write_registry, POOL, MODEL, MODEL, ADAPTER.replace("base_model: tiny", "base_model: x"),
                     (TENANT % KEY_A).replace("[tiny]", "[ghost]"))
    assert len(found) == 3
