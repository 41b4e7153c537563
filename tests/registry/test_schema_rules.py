"""Single-document rules: what a field accepts and what it rejects, with the message a user sees."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvgate.registry.schema import ModelSpec, Offer, PoolSpec, Scaling, StaticReplica, TenantSpec


def error_of(cls, data) -> str:
    with pytest.raises(ValidationError) as caught:
        cls.model_validate(data)
    return str(caught.value)


def test_scale_to_zero_must_say_how_long_requests_wait() -> None:
    assert "set max_queue_wait_s" in error_of(Scaling, {"min_replicas": 0, "max_replicas": 2})
    assert Scaling.model_validate({"min_replicas": 0, "max_replicas": 2, "max_queue_wait_s": 30}).min_replicas == 0


def test_panic_window_must_be_shorter_than_stable_window() -> None:
    assert "must be the shorter" in error_of(Scaling, {"stable_window_s": 10, "panic_window_s": 20})


@pytest.mark.parametrize("source", ["builtin:gpt-5", "ftp://host/x", "s3://", ""])
def test_bad_model_sources_are_rejected(source: str) -> None:
    error_of(ModelSpec, {"source": source})


@pytest.mark.parametrize("source", ["builtin:tiny-llama", "s3://bucket/prefix", "/models/llama", "./weights"])
def test_model_sources(source: str) -> None:
    assert ModelSpec.model_validate({"source": source}).source == source


def test_a_static_replicas_api_key_is_named_by_an_environment_variable_never_written() -> None:
    replica = StaticReplica.model_validate({"url": "http://10.0.0.5:8000", "api_key_env": "VLLM_API_KEY"})
    assert replica.api_key_env == "VLLM_API_KEY"
    assert "api_key_env" in error_of(StaticReplica, {"url": "http://h:1", "api_key_env": "sk-not-a-name"})
    assert "credentials once" in error_of(StaticReplica, {"url": "http://u:p@h:1", "api_key_env": "KEY"})
    assert StaticReplica.model_validate({"url": "http://h:1/v?to=a@b", "api_key_env": "KEY"})  # an @ in a query


def test_byte_sizes_accept_units() -> None:
    spec = ModelSpec.model_validate({"source": "/m", "engine": {"kv_cache_bytes": "512MiB"}})
    assert spec.engine.kv_cache_bytes == 512 * 1024 * 1024


@pytest.mark.parametrize("block", [0, 3, 24, 512])
def test_block_size_is_a_power_of_two_up_to_256(block: int) -> None:
    assert "power of two" in error_of(ModelSpec, {"source": "/m", "engine": {"block_size_tokens": block}})


def test_gpu_count_zero_means_cpu() -> None:
    assert "gpu_kinds [cpu]" in error_of(ModelSpec, {"source": "/m", "resources": {"gpu_kinds": ["H100"],
                                                                                   "gpu_count": 0}})
    assert "gpu_count 0" in error_of(Offer, {"instance_type": "x", "gpu_kind": "cpu", "gpu_count": 1,
                                             "price_usd_per_hour": 1})


def test_provider_blocks_must_match_the_provider() -> None:
    offer = {"instance_type": "x", "gpu_kind": "cpu", "gpu_count": 0, "price_usd_per_hour": 0}
    assert "only a 'local' block" in error_of(PoolSpec, {"provider": "local", "offers": [offer], "kubernetes": {}})
    assert "needs a region" in error_of(PoolSpec, {"provider": "aws", "offers": [offer]})


def test_a_source_with_a_line_break_or_control_character_is_refused() -> None:
    for source in ("/models/a\nbootcmd: [id]", "s3://m/a\u2028b", "/models/a\x00"):
        assert "no line break or control character" in error_of(ModelSpec, {"source": source})


def test_an_aws_pool_says_where_its_nodes_get_kvgate() -> None:
    offer = {"instance_type": "g5.xlarge", "gpu_kind": "A10G", "gpu_count": 1, "price_usd_per_hour": 1}
    aws = {"provider": "aws", "region": "us-east-1", "offers": [offer]}
    assert "needs aws.install" in error_of(PoolSpec, aws)
    assert "not on PyPI" in error_of(PoolSpec, {**aws, "aws": {"image_id": "ami-1"}})
    assert "exactly one of" in error_of(PoolSpec, {**aws, "aws": {"install": {}}})
    both = {"wheel_url": "https://a/k.whl", "index_url": "https://pypi.internal/simple"}
    assert "exactly one of" in error_of(PoolSpec, {**aws, "aws": {"install": both}})
    assert "goes with index_url" in error_of(PoolSpec, {**aws, "aws": {"install": {"wheel_url": "https://a/k.whl",
                                                                                   "version": "0.1.0"}}})
    assert "holds a space" in error_of(PoolSpec, {**aws, "aws": {"install": {"wheel_url": "https://a/k.whl; rm -rf /"}}})
    # A Unicode line separator is a line break to YAML: it would end the cloud-init value it sits in.
    assert "line break" in error_of(PoolSpec, {**aws, "aws": {"install": {"preinstalled": "/opt/k\u2028#"}}})
    for install in ({"preinstalled": "/opt/kvgate/bin/kvgate"}, {"wheel_url": "https://a/k.whl"},
                    {"index_url": "https://pypi.internal/simple", "version": "0.1.0"}):
        assert PoolSpec.model_validate({**aws, "aws": {"install": install}}).aws.install is not None


def test_tenant_key_hmac_is_64_hex_digits_and_normalised() -> None:
    assert "never the key" in error_of(TenantSpec, {"api_key_hmac": "sk-live-123", "models": ["*"]})
    spec = TenantSpec.model_validate({"api_key_hmac": "AB" * 32, "models": ["*"]})
    assert spec.api_key_hmac == "ab" * 32


def test_an_unsalted_sha256_key_hash_is_refused_with_how_to_migrate() -> None:
    message = error_of(TenantSpec, {"api_key_sha256": "ab" * 32, "models": ["*"]})
    assert "unsalted SHA-256 key hashes are no longer accepted" in message
    assert "kvgate keys hash --tenant NAME" in message and "KVGATE_KEY_SECRET" in message


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute"])
@pytest.mark.parametrize("value", [0.5, 0, -3])
def test_a_per_minute_limit_under_1_is_refused(field: str, value: float) -> None:
    message = error_of(TenantSpec, {"api_key_hmac": "ab" * 32, "models": ["*"], "rate_limits": {field: value}})
    assert f"is {value:g} per minute; use at least 1" in message
    spec = TenantSpec.model_validate({"api_key_hmac": "ab" * 32, "models": ["*"], "rate_limits": {field: 1}})
    assert getattr(spec.rate_limits, field) == 1


def test_a_tenant_may_use_only_the_names_it_lists() -> None:
    spec = TenantSpec.model_validate({"api_key_hmac": "ab" * 32, "models": ["tiny", "helper"]})
    assert spec.allows("tiny") and spec.allows("helper")
    assert not spec.allows("tiny-other") and not spec.allows("*")
    assert TenantSpec.model_validate({"api_key_hmac": "ab" * 32, "models": ["*"]}).allows("anything")


def test_snapshot_values_are_frozen() -> None:
    spec = ModelSpec.model_validate({"source": "/m"})
    with pytest.raises(ValidationError):
        spec.source = "/other"  # type: ignore[misc]
    assert isinstance(spec.routing.static_replicas, tuple)


STATIC = {"static_replicas": [{"url": "http://10.0.0.5:8000", "backend": "vllm"}]}


def test_request_caps_default_to_what_the_replicas_would_serve() -> None:
    """Unset, max_tokens is capped at the engine's length where kvgate starts the replicas, and at 2^20 where
    the model fronts servers whose length the registry does not know; n at 16; prompts by the body limit only."""
    started = ModelSpec.model_validate({"source": "/m", "engine": {"max_model_len_tokens": 4096}})
    fronted = ModelSpec.model_validate({"source": "/m", "routing": STATIC})
    assert (started.max_tokens_cap, fronted.max_tokens_cap) == (4096, 1 << 20)
    assert (started.limits.max_n, started.limits.max_prompt_chars) == (16, None)
    capped = ModelSpec.model_validate({"source": "/m", "limits": {"max_tokens": 512, "max_n": 2,
                                                                  "max_prompt_chars": 10_000}})
    assert (capped.max_tokens_cap, capped.limits.max_n, capped.limits.max_prompt_chars) == (512, 2, 10_000)


def test_a_max_tokens_cap_above_the_engines_length_is_refused_unless_the_model_fronts_other_servers() -> None:
    message = error_of(ModelSpec, {"source": "/m", "limits": {"max_tokens": 4096}})
    assert "limits.max_tokens (4096) exceeds engine.max_model_len_tokens (2048)" in message
    assert "leave it unset to cap at 2048" in message
    fronted = ModelSpec.model_validate({"source": "/m", "routing": STATIC, "limits": {"max_tokens": 200_000}})
    assert fronted.max_tokens_cap == 200_000


@pytest.mark.parametrize("limits, field", [({"max_tokens": 0}, "max_tokens"), ({"max_n": 0}, "max_n"),
                                           ({"max_n": 129}, "max_n"), ({"max_prompt_chars": 0}, "max_prompt_chars"),
                                           ({"max_prompt_tokens": 5}, "max_prompt_tokens")])
def test_request_caps_out_of_range_or_unknown_are_refused(limits: dict, field: str) -> None:
    assert f"limits.{field}" in error_of(ModelSpec, {"source": "/m", "limits": limits})
