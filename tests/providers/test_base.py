"""The pure parts of providers/base.py: value types, errors, tags, the catalogue, and the engine
command line, which is checked against the real `kvgate engine` argument parser and EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.engine.server.main import build_parser, engine_config, served_name
from kvgate.providers.base import (TAG_CLAIM, TAG_CLUSTER, TAG_MODEL, TAG_POOL, CapacityType, InsufficientCapacity,
                            NodeClaim, NodeNotReady, NotFound, OfferingKey, Provider, ProviderError,
                            ProviderUnavailable, QuotaExceeded, ReplicaSpec, check_quota, engine_args, node_tags,
                            offerings_from_pool, replica_spec_for)
from kvgate.providers.fake import FakeProvider
from kvgate.providers.local import LocalProvider
from kvgate.registry.schema import AdapterDoc, ModelDoc
from tests.providers.subject_fake import POOL, SPEC

MODEL = ModelDoc.model_validate({
    "apiVersion": "kvgate/v1", "kind": "Model", "metadata": {"name": "chat"},
    "spec": {"source": "builtin:tiny-llama", "engine": {"kv_cache_bytes": "16MiB", "max_model_len_tokens": 512,
                                                        "max_loaded_adapters": 2, "max_adapter_rank": 8}},
})


def adapter(name: str, base: str = "chat") -> AdapterDoc:
    return AdapterDoc.model_validate({"apiVersion": "kvgate/v1", "kind": "Adapter", "metadata": {"name": name},
                                      "spec": {"base_model": base, "source": f"/adapters/{name}", "rank": 8}})


def test_replica_spec_for_takes_the_models_engine_settings() -> None:
    spec = replica_spec_for(MODEL, [adapter("sql"), adapter("fr")])
    assert spec == ReplicaSpec(model="chat", source="builtin:tiny-llama", gpu_count=0, kv_cache_bytes=16 * 2**20,
                               max_model_len=512, max_batch_tokens=2048, max_running_requests=64,
                               max_loaded_adapters=2, max_adapter_rank=8, dtype="auto",
                               adapters=(("fr", "/adapters/fr"), ("sql", "/adapters/sql")))
    with pytest.raises(ValueError, match="belongs to 'other'"):
        replica_spec_for(MODEL, [adapter("x", base="other")])


def test_engine_args_are_accepted_by_the_real_engine_parser() -> None:
    spec = replica_spec_for(MODEL, [adapter("sql")])
    args = engine_args(spec, host="127.0.0.1", port=8123, grpc_port=9123, replica_id="r-1", cache_dir="/tmp/c",
                       drain_timeout_s=7.5)
    parser = build_parser()
    parsed = parser.parse_args(args)
    assert (parsed.model, served_name(parsed), parsed.host, parsed.port, parsed.grpc_port, parsed.replica_id) == \
        ("builtin:tiny-llama", "chat", "127.0.0.1", 8123, 9123, "r-1")
    assert (parsed.kv_cache_bytes, parsed.max_model_len, parsed.max_loras, parsed.max_lora_rank) == (16 * 2**20, 512, 2, 8)
    assert (parsed.device, str(parsed.cache_dir), parsed.drain_timeout_s) == ("cpu", "/tmp/c", 7.5)
    config = engine_config(parsed, parser)  # the combination is valid, not only each flag
    assert config.max_model_len == 512 and config.kv_cache_bytes == 16 * 2**20
    minimal = parser.parse_args(engine_args(ReplicaSpec(model="m", source="/w", gpu_count=1), host="0.0.0.0", port=80))
    assert (minimal.device, minimal.grpc_port) == ("cuda", None)


def test_offerings_from_pool_lists_every_offer_and_zone() -> None:
    offerings = offerings_from_pool(POOL, SPEC)
    assert [(str(o.key), o.region, o.price_usd_per_hour, o.available) for o in offerings] == [
        ("fake-pool:g6.xlarge:on_demand", "us-test-1", 0.8, True),
        ("fake-pool:g6.xlarge:spot/us-test-1a", "us-test-1", 0.3, True),
        ("fake-pool:g6.xlarge:spot/us-test-1b", "us-test-1", 0.3, True),
    ]
    assert offerings[0].gpu_kind == "L4" and offerings[0].gpu_memory_gib == 24


def test_node_tags_and_claims() -> None:
    claim = NodeClaim(id="n-1", offering=OfferingKey(POOL, "g6.xlarge", CapacityType.SPOT),
                      model="chat", labels={"team": "ml", TAG_CLUSTER: "spoofed"})
    assert node_tags("prod", claim) == {"team": "ml", TAG_CLUSTER: "prod", TAG_CLAIM: "n-1", TAG_POOL: POOL,
                                        TAG_MODEL: "chat"}
    assert TAG_MODEL not in node_tags("prod", dataclasses.replace(claim, model=None))
    assert claim.pool == POOL
    with pytest.raises(TypeError):
        claim.labels["x"] = "y"  # type: ignore[index]  # frozen all the way down
    with pytest.raises(ValueError, match="non-empty id"):
        NodeClaim(id="", offering=claim.offering)


def test_errors_are_typed_and_say_whether_to_retry() -> None:
    key = OfferingKey(POOL, "g6.xlarge", CapacityType.ON_DEMAND)
    stockout = InsufficientCapacity(key)
    assert stockout.offering == key and "fake-pool:g6.xlarge:on_demand" in str(stockout)
    assert not stockout.retryable and not QuotaExceeded("q").retryable and not NotFound("n").retryable
    assert ProviderUnavailable("down").retryable and NodeNotReady("booting").retryable
    assert ProviderError("throttled", retryable=True).retryable
    assert all(issubclass(e, ProviderError) for e in (InsufficientCapacity, QuotaExceeded, NotFound,
                                                      ProviderUnavailable, NodeNotReady))


def test_implementations_satisfy_the_protocol(tmp_path) -> None:
    from kvgate.clock import FakeClock, RealClock
    from tests.providers.subject_local import pool_spec

    assert isinstance(FakeProvider(POOL, SPEC, cluster="c", clock=FakeClock()), Provider)
    assert isinstance(LocalProvider("l", pool_spec(tmp_path), cluster="c", clock=RealClock()), Provider)


# One 8-GPU node at $10/h is up; the candidate is another (8 GPUs, $10/h). Each row: the limits and the
# limit named in the error, or None when the node may be bought.
@pytest.mark.parametrize("limits,refused_by", [
    ({}, None),                                                   # no limits
    ({"max_nodes": 2}, None),                                     # 1 + 1 = 2 nodes: fits exactly
    ({"max_nodes": 1}, "max_nodes is 1 and 1 nodes are up"),
    ({"max_gpus": 16}, None),                                     # 8 + 8 = 16 GPUs: fits exactly
    ({"max_gpus": 15}, "max_gpus is 15; 8 GPUs in use"),
    ({"budget_usd_per_hour": 20.0}, None),                        # $10 + $10 = $20/h: fits exactly
    ({"budget_usd_per_hour": 19.99}, "budget is \\$19.99/h; \\$10.00/h spent"),
])
def test_check_quota_refuses_a_node_past_any_limit(limits: dict, refused_by: str | None) -> None:
    offering = dataclasses.replace(offerings_from_pool(POOL, SPEC)[0], gpu_count=8, price_usd_per_hour=10.0)
    bounds = {"max_nodes": None, "max_gpus": None, "budget_usd_per_hour": None, **limits}
    if refused_by is None:
        check_quota(POOL, offering, [(8, 10.0)], **bounds)
    else:
        with pytest.raises(QuotaExceeded, match=refused_by):
            check_quota(POOL, offering, [(8, 10.0)], **bounds)


def test_check_quota_tolerates_float_sums_at_the_budget() -> None:
    # 0.1 + 0.2 > 0.3 in floats: a budget met exactly must not be refused for rounding.
    offering = dataclasses.replace(offerings_from_pool(POOL, SPEC)[0], price_usd_per_hour=0.2)
    check_quota(POOL, offering, [(0, 0.1)], max_nodes=None, max_gpus=None, budget_usd_per_hour=0.3)
