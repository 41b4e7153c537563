"""Hot reload: a settled, valid change becomes a new snapshot; an invalid one keeps the last good."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvgate.clock import FakeClock, RealClock
from kvgate.registry import RegistryInvalid, RegistryWatcher
from tests.registry.samples import MODEL, POOL


def write(root: Path, text: str) -> None:
    (root / "all.yaml").write_text(text)


@pytest.fixture
async def watched(write_registry):
    root = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    watcher = await RegistryWatcher.open(root, FakeClock(), environ={})
    published = []
    watcher.subscribe(published.append)
    return root, watcher, published


async def test_a_valid_change_is_published_once_it_has_settled(watched) -> None:
    root, watcher, published = watched
    first = watcher.current
    write(root, POOL + "---\n" + MODEL + "  scaling: {max_replicas: 3}\n")
    assert await watcher.poll() is False  # changed: wait one poll in case the write is half done
    assert await watcher.poll() is True
    assert [s.version for s in published] == [watcher.current.version]
    assert watcher.current.version != first.version
    assert watcher.current.model("tiny").spec.scaling.max_replicas == 3
    assert await watcher.poll() is False  # nothing new


async def test_an_invalid_change_keeps_the_last_good_snapshot_and_says_why(watched) -> None:
    root, watcher, published = watched
    good = watcher.current
    write(root, POOL + "---\n" + MODEL + "  scaling: {min_replicas: 5, max_replicas: 2}\n")
    await watcher.poll()
    assert await watcher.poll() is False
    assert watcher.current is good
    assert published == []
    assert isinstance(watcher.last_error, RegistryInvalid)
    assert "min_replicas (5) is greater than max_replicas (2)" in str(watcher.last_error)
    # Fixed again: the error clears and the fix is published.
    write(root, POOL + "---\n" + MODEL + "  scaling: {max_replicas: 2}\n")
    await watcher.poll()
    assert await watcher.poll() is True
    assert watcher.last_error is None


async def test_a_change_of_layout_only_publishes_nothing(watched) -> None:
    root, watcher, published = watched
    write(root, "# a comment\n" + POOL + "---\n" + MODEL)
    await watcher.poll()
    await watcher.poll()
    assert published == []


async def test_a_failing_subscriber_does_not_stop_the_others(watched) -> None:
    root, watcher, published = watched

    def broken(_snapshot) -> None:
        raise RuntimeError("subscriber bug")

    watcher.subscribe(broken)
    later = []
    watcher.subscribe(later.append)
    write(root, POOL + "---\n" + MODEL + "  scaling: {max_replicas: 3}\n")
    await watcher.poll()
    assert await watcher.poll() is True
    assert len(published) == 1 and len(later) == 1


async def test_unsubscribe(watched) -> None:
    root, watcher, published = watched
    other = []
    unsubscribe = watcher.subscribe(other.append)
    unsubscribe()
    write(root, POOL + "---\n" + MODEL + "  scaling: {max_replicas: 3}\n")
    await watcher.poll()
    await watcher.poll()
    assert other == [] and len(published) == 1


async def test_opening_an_invalid_registry_fails_with_every_problem(write_registry) -> None:
    adapter = "apiVersion: kvgate/v1\nkind: Adapter\nmetadata: {name: a}\nspec: {base_model: ghost, source: /a, rank: 8}\n"
    root = write_registry({"all.yaml": POOL + "---\n" + MODEL + "  colour: blue\n---\n" + adapter})
    with pytest.raises(RegistryInvalid) as caught:
        await RegistryWatcher.open(root, FakeClock(), environ={})
    assert [p.path[-1] for p in caught.value.problems] == ["colour", "base_model"]


async def test_the_watch_loop_picks_up_an_edit_on_its_own(write_registry) -> None:
    root = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    watcher = await RegistryWatcher.open(root, RealClock(), interval_s=0.02, environ={})
    seen = asyncio.Event()
    watcher.subscribe(lambda _snapshot: seen.set())
    task = asyncio.create_task(watcher.watch())
    try:
        write(root, POOL + "---\n" + MODEL + "  scaling: {max_replicas: 3}\n")
        await asyncio.wait_for(seen.wait(), timeout=10)
    finally:
        task.cancel()
    assert watcher.current.model("tiny").spec.scaling.max_replicas == 3
