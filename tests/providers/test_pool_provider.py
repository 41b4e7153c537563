"""providers/pool_provider.py: the set-up every provider shares."""

from __future__ import annotations

from kvgate.clock import FakeClock
from kvgate.providers.aws import AwsProvider
from kvgate.providers.fake import FakeProvider
from kvgate.providers.kubernetes import KubernetesProvider
from kvgate.providers.local import LocalProvider
from kvgate.providers.pool_provider import PoolProvider


async def _no_wait(seconds: float) -> None:
    return None


def test_it_names_the_pool_and_the_cluster() -> None:
    provider = PoolProvider("gpus", cluster="prod", clock=FakeClock())
    assert (provider.pool, provider.cluster) == ("gpus", "prod")


def test_it_waits_on_the_clock_unless_given_another_sleep() -> None:
    clock = FakeClock()
    assert PoolProvider("gpus", cluster="prod", clock=clock)._sleep == clock.sleep
    assert PoolProvider("gpus", cluster="prod", clock=clock, sleep=_no_wait)._sleep is _no_wait


def test_every_provider_is_set_up_by_it() -> None:
    for implementation in (AwsProvider, FakeProvider, KubernetesProvider, LocalProvider):
        assert issubclass(implementation, PoolProvider)
