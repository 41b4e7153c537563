"""providers/pool_provider.py: the set-up every provider shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
from kubernetes import client as k8s

from kvgate.clock import FakeClock
from kvgate.providers.aws import AwsProvider
from kvgate.providers.fake import FakeProvider
from kvgate.providers.kubernetes import KubernetesProvider
from kvgate.providers.local import LocalProvider
from kvgate.providers.pool_provider import PoolProvider
from kvgate.registry.schema import PoolSpec


async def _no_wait(seconds: float) -> None:
    return None


def test_it_names_the_pool_and_the_cluster() -> None:
    provider = PoolProvider("gpus", cluster="prod", clock=FakeClock())
    assert (provider.pool, provider.cluster) == ("gpus", "prod")


def test_it_waits_on_the_clock_unless_given_another_sleep() -> None:
    clock = FakeClock()
    assert PoolProvider("gpus", cluster="prod", clock=clock)._sleep == clock.sleep
    assert PoolProvider("gpus", cluster="prod", clock=clock, sleep=_no_wait)._sleep is _no_wait


def _spec(provider: str, **settings: Any) -> PoolSpec:
    return PoolSpec.model_validate({
        "provider": provider, "offers": [{"instance_type": "box", "gpu_kind": "L4", "gpu_count": 1,
                                          "price_usd_per_hour": 1.0}], **settings})


async def test_every_provider_is_set_up_by_it(tmp_path: Path) -> None:
    """Each implementation's constructor passes its pool, cluster, clock and sleep on to PoolProvider:
    one that skipped `super().__init__` would fail here, not only when a method first read `_pool`.
    None of these constructors does I/O: boto3 and the Kubernetes client connect on the first call."""
    clock = FakeClock()
    boto = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
    aws_settings = {"endpoint_url": "http://127.0.0.1:9", "install": {"preinstalled": "/opt/kvgate/bin/kvgate"}}
    aws = AwsProvider("gpus", _spec("aws", region="us-east-1", aws=aws_settings),
                      cluster="prod", clock=clock, session=boto, sleep=_no_wait)
    kubernetes = KubernetesProvider("gpus", _spec("kubernetes"), cluster="prod", clock=clock,
                                    api_client=k8s.ApiClient(), sleep=_no_wait)
    fake = FakeProvider("gpus", _spec("fake"), cluster="prod", clock=clock)
    local = LocalProvider("gpus", _spec("local", local={"work_dir": str(tmp_path)}), cluster="prod", clock=clock)
    # Fake and local take no sleep of their own, so they wait on the clock.
    for provider, sleep in ((aws, _no_wait), (kubernetes, _no_wait), (fake, clock.sleep), (local, clock.sleep)):
        assert isinstance(provider, PoolProvider), type(provider).__name__
        assert (provider.pool, provider.cluster) == ("gpus", "prod"), type(provider).__name__
        assert provider._clock is clock and provider._sleep == sleep, type(provider).__name__
    for provider in (aws, kubernetes, fake, local):
        await provider.close()
