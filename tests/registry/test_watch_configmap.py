"""Hot reload of a registry mounted from a Kubernetes ConfigMap (the Helm chart's layout).

The kubelet swaps a `..data` symlink to a new timestamped directory rather than rewriting files in place.
`KubeletVolume` (tests/registry/kubelet_volume.py, which draws the layout) reproduces those steps, in the
order of the kubelet's AtomicWriter, on disk, so the watcher is tested against the real layout and swap, not against files
edited in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.clock import FakeClock
from kvgate.registry import RegistryWatcher
from kvgate.registry.loader import load_registry
from tests.registry.kubelet_volume import KubeletVolume
from tests.registry.samples import MODEL, POOL


@pytest.fixture
def volume(tmp_path: Path) -> KubeletVolume:
    volume = KubeletVolume(tmp_path / "registry")
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL})
    return volume


async def test_the_kubelet_layout_loads_only_the_visible_files_once(volume: KubeletVolume) -> None:
    snapshot = load_registry(volume.root, environ={})
    # The same documents reach the loader through the symlinks and the hidden directory; only the
    # symlinks count, so no document is reported twice as a duplicate.
    assert (snapshot.counts()["Model"], snapshot.counts()["Pool"]) == (1, 1)


async def test_a_swapped_configmap_is_reloaded(volume: KubeletVolume) -> None:
    watcher = await RegistryWatcher.open(volume.root, FakeClock(), environ={})
    published = []
    watcher.subscribe(published.append)
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL + "  scaling: {max_replicas: 3}\n"})
    assert await watcher.poll() is False  # changed: waits one poll to see it settle
    assert await watcher.poll() is True
    assert [s.version for s in published] == [watcher.current.version]
    assert watcher.current.model("tiny").spec.scaling.max_replicas == 3


async def test_a_key_added_to_the_configmap_is_loaded(volume: KubeletVolume) -> None:
    watcher = await RegistryWatcher.open(volume.root, FakeClock(), environ={})
    second = MODEL.replace("name: tiny", "name: tiny-two")
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL, "more-models.yaml": second})
    await watcher.poll()
    assert await watcher.poll() is True
    assert watcher.current.counts()["Model"] == 2


async def test_a_key_removed_from_the_configmap_is_unloaded(volume: KubeletVolume) -> None:
    second = MODEL.replace("name: tiny", "name: tiny-two")
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL, "more-models.yaml": second})
    watcher = await RegistryWatcher.open(volume.root, FakeClock(), environ={})
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL})
    await watcher.poll()
    assert await watcher.poll() is True
    assert watcher.current.counts()["Model"] == 1
    assert not (volume.root / "more-models.yaml").exists()


async def test_a_broken_configmap_keeps_the_last_good_registry(volume: KubeletVolume) -> None:
    watcher = await RegistryWatcher.open(volume.root, FakeClock(), environ={})
    good = watcher.current
    volume.publish({"pools.yaml": POOL, "models.yaml": MODEL + "  scaling: {min_replicas: 5, max_replicas: 2}\n"})
    await watcher.poll()
    assert await watcher.poll() is False
    assert watcher.current is good
    assert "min_replicas (5) is greater than max_replicas (2)" in str(watcher.last_error)
