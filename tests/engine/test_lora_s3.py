"""Adapters from S3: a real moto server process plays S3 on a loopback port; the engine downloads the
adapter into its cache and serves it exactly as the same adapter from a local directory."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core import EngineConfig, EngineCore
from kvgate.engine.lora import AdapterLoadError
from kvgate.engine.lora.source import fetch_adapter
from tests.s3_objects import new_bucket, upload_dir
from tests.engine.lora_adapters import ALL_MODULES, AdapterSpec, tiny_hf_model, write_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 99, 3, 42, 250, 7, 8, 9, 120, 33]


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora-s3")
    hf = tiny_hf_model(root / "model", "mha_untied")
    write_adapter(root / "adapter", hf, AdapterSpec(rank=4, alpha=16, targets=ALL_MODULES, seed=7))
    return root / "model", root / "adapter"


@pytest.fixture
def bucket(moto_endpoint_url: str, moto_credentials: None) -> str:
    return new_bucket(moto_endpoint_url, "adapters")



def test_an_adapter_from_s3_serves_the_same_tokens_as_from_a_directory(
        model_and_adapter, moto_endpoint_url: str, bucket: str, tmp_path: Path, monkeypatch) -> None:
    model_dir, adapter_dir = model_and_adapter
    upload_dir(moto_endpoint_url, bucket, "team/sql-lora", adapter_dir)
    monkeypatch.setenv("KVGATE_S3_ENDPOINT_URL", moto_endpoint_url)  # as a deployment would set it
    llm = LLM(str(model_dir), kv_cache_bytes=2 << 20, cache_dir=tmp_path / "cache")
    llm.core.load_adapter("local", str(adapter_dir))

    llm.core.load_adapter("remote", f"s3://{bucket}/team/sql-lora/")

    assert llm.core.adapters().loaded == ("local", "remote")
    [local] = llm.generate([PROMPT], GREEDY, adapter="local")
    [remote] = llm.generate([PROMPT], GREEDY, adapter="remote")
    assert remote.token_ids == local.token_ids
    assert list((tmp_path / "cache" / "adapters").glob("*/*/adapter_model.safetensors"))


def test_fetching_an_unchanged_adapter_again_reuses_the_download(
        model_and_adapter, moto_endpoint_url: str, bucket: str, tmp_path: Path) -> None:
    _, adapter_dir = model_and_adapter
    upload_dir(moto_endpoint_url, bucket, "a", adapter_dir)

    first = fetch_adapter(f"s3://{bucket}/a", tmp_path, endpoint_url=moto_endpoint_url)
    again = fetch_adapter(f"s3://{bucket}/a", tmp_path, endpoint_url=moto_endpoint_url)
    boto3.client("s3", endpoint_url=moto_endpoint_url).put_object(
        Bucket=bucket, Key="a/adapter_config.json", Body=(adapter_dir / "adapter_config.json").read_bytes() + b" ")
    changed = fetch_adapter(f"s3://{bucket}/a", tmp_path, endpoint_url=moto_endpoint_url)

    assert first == again and changed != first
    assert sorted(p.name for p in first.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_missing_s3_prefix_fails_the_load_with_the_object_url(
        model_and_adapter, moto_endpoint_url: str, bucket: str, tmp_path: Path) -> None:
    model_dir, _ = model_and_adapter
    core = EngineCore(EngineConfig(model=str(model_dir), kv_cache_bytes=2 << 20, cache_dir=tmp_path,
                                   s3_endpoint_url=moto_endpoint_url))

    with pytest.raises(AdapterLoadError, match=rf"s3://{bucket}/nothing/here/adapter_config.json .*: not found"):
        core.load_adapter("ghost", f"s3://{bucket}/nothing/here")

    assert core.adapters().registered == ()
    core.add_request(PROMPT, GREEDY)
    while core.has_unfinished():
        core.step()
    assert core.stats().num_generated_tokens_total == 8
