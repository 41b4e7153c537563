"""Models from S3 (engine/s3_models.py): a real moto server process plays S3 on a loopback port. The fetched
copy is byte for byte the uploaded directory, whatever the part size; an unchanged model is found in the cache
without a download, a changed one gets a new folder; bad sources are clear errors; and an engine serves a
model from s3:// with the tokens it gives from the local directory."""

from __future__ import annotations

import filecmp
import logging
from pathlib import Path

import boto3
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.builtin import ModelSourceError, resolve_model_source
from kvgate.engine.s3_models import fetch_s3_model, part_ranges
from tests.s3_objects import new_bucket, upload_dir
from tests.engine.builtin_cache import tiny_llama_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def bucket(moto_endpoint_url: str, moto_credentials: None) -> str:
    return new_bucket(moto_endpoint_url, "models")



def same_files(left: Path, right: Path) -> bool:
    names = sorted(p.name for p in left.iterdir() if p.is_file())
    if names != sorted(p.name for p in right.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(left, right, names, shallow=False)
    return not mismatch and not errors


def test_part_ranges_cover_every_byte_once() -> None:
    assert part_ranges(0, 4) == []
    assert part_ranges(10, 4) == [(0, 3), (4, 7), (8, 9)]
    assert part_ranges(8, 4) == [(0, 3), (4, 7)]


@pytest.mark.parametrize("part_bytes", [1 << 20, 64 << 20])  # many parts per file; one part per file
def test_the_fetched_copy_is_the_uploaded_directory(moto_endpoint_url: str, bucket: str, tmp_path: Path,
                                                    part_bytes: int) -> None:
    model = tiny_llama_dir()
    upload_dir(moto_endpoint_url, bucket, "llama/tiny", model)

    stats = fetch_s3_model(f"s3://{bucket}/llama/tiny", tmp_path, moto_endpoint_url, workers=4,
                           part_bytes=part_bytes)

    assert not stats.cached and stats.downloaded_bytes == sum(p.stat().st_size for p in model.iterdir()
                                                              if p.is_file())
    assert same_files(model, stats.path)
    assert not [p for p in stats.path.parent.iterdir() if p.name.startswith(".fetch-")]


def test_an_unchanged_model_is_found_in_the_cache_and_a_changed_one_is_fetched_anew(
        moto_endpoint_url: str, bucket: str, tmp_path: Path) -> None:
    upload_dir(moto_endpoint_url, bucket, "m", tiny_llama_dir())
    url = f"s3://{bucket}/m/"
    first = fetch_s3_model(url, tmp_path, moto_endpoint_url)

    again = fetch_s3_model(url, tmp_path, moto_endpoint_url)
    assert again.cached and again.downloaded_bytes == 0 and again.path == first.path

    boto3.client("s3", endpoint_url=moto_endpoint_url).put_object(Bucket=bucket, Key="m/README.md", Body=b"v2")
    changed = fetch_s3_model(url, tmp_path, moto_endpoint_url)
    assert not changed.cached and changed.path != first.path
    assert (changed.path / "README.md").read_bytes() == b"v2"
    assert first.path.is_dir()  # a replica still reading the old version keeps its files


def test_bad_sources_are_errors_that_name_the_url(moto_endpoint_url: str, bucket: str, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=rf"s3://{bucket}/nothing: no objects under this prefix"):
        fetch_s3_model(f"s3://{bucket}/nothing", tmp_path, moto_endpoint_url)
    boto3.client("s3", endpoint_url=moto_endpoint_url).put_object(Bucket=bucket, Key="x/weights.bin", Body=b"0")
    with pytest.raises(ModelSourceError, match="not a Hugging Face model"):
        fetch_s3_model(f"s3://{bucket}/x", tmp_path, moto_endpoint_url)
    with pytest.raises(ModelSourceError, match="not found"):
        fetch_s3_model("s3://no-such-bucket-kvgate/m", tmp_path, moto_endpoint_url)
    with pytest.raises(ModelSourceError, match="expected s3://bucket/prefix"):
        fetch_s3_model("s3:///m", tmp_path, moto_endpoint_url)


def test_an_unreachable_endpoint_is_an_error_not_a_hang(moto_credentials: None, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"s3://b/m \(endpoint http://127.0.0.1:9\)"):
        fetch_s3_model("s3://b/m", tmp_path, "http://127.0.0.1:9")


def test_an_engine_serves_an_s3_model_as_it_serves_the_directory(moto_endpoint_url: str, bucket: str,
                                                                 tmp_path: Path, monkeypatch, caplog) -> None:
    model = tiny_llama_dir()
    upload_dir(moto_endpoint_url, bucket, "team/tiny", model)
    monkeypatch.setenv("KVGATE_S3_ENDPOINT_URL", moto_endpoint_url)  # as a deployment would set it
    prompt = [5, 17, 99, 3, 42, 250, 7]

    with caplog.at_level(logging.INFO, logger="kvgate.engine.s3"):
        remote = LLM(f"s3://{bucket}/team/tiny", kv_cache_bytes=2 << 20, cache_dir=tmp_path)
    local = LLM(str(model), kv_cache_bytes=2 << 20)

    assert remote.generate([prompt], GREEDY)[0].token_ids == local.generate([prompt], GREEDY)[0].token_ids
    assert resolve_model_source(f"s3://{bucket}/team/tiny", tmp_path) == remote.core.model_dir
    assert "parallel ranged reads" in caplog.text and "fetched s3://" in caplog.text
