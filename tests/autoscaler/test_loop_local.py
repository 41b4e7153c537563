"""The embedded set-up that `kvgate up` uses: the loop with the real `local` provider, real `kvgate
engine` child processes (builtin tiny-llama) and the memory store, on the real clock.

An autoscaler brings the model's one replica up, stops (as on SIGTERM: replicas left running), and a
new autoscaler with a new provider on the same work directory and store adopts the running replica
instead of starting another. `release_fleet` (what `kvgate up` does on Ctrl-C) then stops every replica
process and frees the slot.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.autoscaler.claims import ClaimStore
from kvgate.autoscaler.loop import Autoscaler, AutoscalerSettings, FixedSnapshot, provider_factory_for
from kvgate.clock import RealClock
from kvgate.state import MemoryStateStore
from kvgate.registry import load_registry
from tests.eventually import eventually
from tests.registry_docs import local_pool, tiny_llama


async def ready_members(store: MemoryStateStore, timeout_s: float) -> list:
    async def all_ready() -> list:
        members = await store.list_members()
        return members if members and all(m.state.value == "ready" for m in members) else []
    return await eventually(all_ready, "every replica ready", timeout_s, poll_s=0.1)


async def test_a_restarted_autoscaler_adopts_the_running_local_replica(tmp_path: Path) -> None:
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "r.yaml").write_text(tiny_llama() + local_pool(tmp_path / "work"))
    snapshot = FixedSnapshot(load_registry(tmp_path / "registry"))
    clock = RealClock()
    store = MemoryStateStore(clock)
    settings = AutoscalerSettings(interval_s=0.2, lease_ttl_s=2.0)
    first = Autoscaler(snapshot, store, clock, provider_factory=provider_factory_for("t", clock),
                       settings=settings, holder="first")
    second = None
    try:
        await first.start()
        [member] = await ready_members(store, 60)  # ~5.5 s on a 2-core box (tiny-llama load)
        await first.stop()
        for provider in first.providers.values():
            await provider.close()

        second = Autoscaler(snapshot, store, clock, provider_factory=provider_factory_for("t", clock),
                            settings=settings, holder="second")
        await second.start()
        leading_ticks: set[float] = set()  # the status record's updated_at, written once per tick as leader

        async def ticked_as_leader() -> bool:
            record = await store.get_record("autoscaler", "status")
            if record is not None and record.data["holder"] == "second":
                leading_ticks.add(record.data["updated_at"])
            return len(leading_ticks) >= 3
        await eventually(ticked_as_leader, "three ticks of the second autoscaler as leader", poll_s=0.02)
        [adopted] = await ready_members(store, 10)

        assert second.is_leader
        assert adopted.replica_id == member.replica_id and adopted.url == member.url
        [local] = second.providers.values()
        assert [r.id for r in await local.list_replicas()] == [member.replica_id]

        await second.stop()
        await second.release_fleet()  # what `kvgate up` does on Ctrl-C: nothing left behind
        assert await local.list_replicas() == [] and await local.list() == []
        assert await store.list_members() == [] and await ClaimStore(store, "reader").list() == []
    finally:
        for autoscaler in (first, second):
            if autoscaler is None:
                continue
            await autoscaler.stop()
            for provider in autoscaler.providers.values():
                for replica in await provider.list_replicas():
                    await provider.stop_replica(replica.id, 5.0)
                for node in await provider.list():
                    await provider.delete(node.id)
                await provider.close()
