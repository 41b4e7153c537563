"""LoRA slot bookkeeping in plain Python: the adapter manager (LRU eviction of idle adapters, pins, deferred
unloads, failed loads) and the scheduler's use of it (a sequence runs only when its adapter has a slot;
LoRA sequences are served in arrival order; base ones pass a LoRA sequence that waits).

A fake SlotLoader records what the runner would be asked to do. Adapters are zero-filled PEFT directories
for the tiny config of peft_files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.lora import AdapterInfo, AdapterLoadError, AdapterManager, UnknownAdapter
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.sequence import ModelOutput, SampledToken, SamplingParams, Sequence, SequenceStatus
from tests.engine.peft_files import TINY, write_peft_dir


class FakeSlots:
    def __init__(self) -> None:
        self.held: dict[int, str] = {}
        self.ops: list[tuple] = []
        self.failing: set[str] = set()

    def load(self, slot: int, name: str, adapter) -> None:
        if name in self.failing:
            raise AdapterLoadError(f"{adapter.weights_path}: cannot read the adapter's tensors")
        self.held[slot] = name
        self.ops.append(("load", slot, name))

    def clear(self, slot: int) -> None:
        self.held.pop(slot, None)
        self.ops.append(("clear", slot))


@pytest.fixture
def adapter_dirs(tmp_path) -> dict[str, Path]:
    return {name: write_peft_dir(tmp_path / name) for name in ("a", "b", "c")}


def make_manager(adapter_dirs, max_loras: int, names=("a", "b", "c")) -> tuple[AdapterManager, FakeSlots]:
    slots = FakeSlots()
    manager = AdapterManager(TINY, slots, max_loras=max_loras, max_lora_rank=16)
    for name in names:
        manager.register(name, f"/src/{name}", adapter_dirs[name])
    return manager, slots


def run_one_request(manager: AdapterManager, name: str) -> None:
    manager.on_add(name)
    manager.on_run(name)
    manager.sync()
    manager.on_stop(name)
    manager.on_finish(name)


# ------------------------------------------------------------------------------------------- manager


def test_registered_adapters_load_lazily_into_the_lowest_free_slot_at_sync(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=2)
    assert manager.info() == AdapterInfo(registered=("a", "b", "c"), loaded=())

    assert manager.load_now("b") and manager.load_now("a")
    assert slots.ops == []  # decided, not yet done
    manager.sync()

    assert slots.held == {0: "b", 1: "a"}
    assert manager.info().loaded == ("a", "b") and manager.num_loads_total == 2


def test_a_full_table_evicts_the_least_recently_used_idle_adapter(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=2)
    run_one_request(manager, "a")  # slot 0
    run_one_request(manager, "b")  # slot 1
    run_one_request(manager, "a")  # a is now the most recently used

    run_one_request(manager, "c")

    assert slots.held == {0: "a", 1: "c"}  # b, least recently used, gave its slot to c
    assert manager.num_evictions_total == 1 and manager.num_loads_total == 3


def test_an_adapter_with_a_running_sequence_is_never_evicted(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=1)
    manager.on_add("a")
    manager.on_run("a")
    manager.sync()

    assert not manager.can_run("b")
    assert manager.load_now("b") is False  # registered; loads when a slot frees
    manager.on_stop("a")
    assert manager.can_run("b")
    assert manager.load_now("b")
    manager.sync()
    assert slots.held == {0: "b"} and manager.num_evictions_total == 1


def test_unloading_an_idle_adapter_frees_its_slot_at_once(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=2)
    run_one_request(manager, "a")

    assert manager.unload("a") is True
    manager.sync()

    assert slots.held == {} and manager.info() == AdapterInfo(registered=("b", "c"), loaded=())
    with pytest.raises(UnknownAdapter, match="unknown adapter 'a'; registered adapters: b, c"):
        manager.on_add("a")


def test_unloading_an_adapter_in_use_refuses_new_requests_and_drops_it_after_the_last(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=2)
    manager.on_add("a")
    manager.on_run("a")
    manager.on_add("a")  # a second request, still waiting
    manager.sync()

    assert manager.unload("a") is False
    with pytest.raises(UnknownAdapter):
        manager.on_add("a")
    assert manager.info() == AdapterInfo(registered=("b", "c"), loaded=())  # no longer offered

    manager.on_stop("a")
    manager.on_finish("a")
    assert slots.held == {0: "a"}  # the waiting request still needs it
    manager.on_finish("a")
    manager.sync()
    assert slots.held == {}


def test_registering_again_is_idempotent_and_cancels_a_pending_unload(adapter_dirs) -> None:
    manager, _ = make_manager(adapter_dirs, max_loras=2)
    manager.on_add("a")
    manager.unload("a")

    manager.register("a", "/src/a", adapter_dirs["a"])

    assert manager.is_registered("a")
    with pytest.raises(AdapterLoadError, match="adapter 'a' is in use by 1 request"):
        manager.register("a", "/src/other", adapter_dirs["b"])


def test_a_failed_load_frees_the_slot_keeps_the_registration_and_reports_why(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=1)
    slots.failing.add("a")
    manager.on_add("a")
    manager.on_run("a")

    failures = manager.sync()

    assert list(failures) == ["a"] and "cannot read" in str(failures["a"])
    assert manager.info() == AdapterInfo(registered=("a", "b", "c"), loaded=()) and manager.num_loads_total == 0
    manager.on_stop("a")
    manager.on_finish("a")
    run_one_request(manager, "b")  # the slot is usable
    assert slots.held == {0: "b"}


def test_max_loras_zero_turns_lora_off(adapter_dirs) -> None:
    manager = AdapterManager(TINY, None, max_loras=0, max_lora_rank=16)
    with pytest.raises(AdapterLoadError, match="multi-LoRA is off"):
        manager.register("a", "/src/a", adapter_dirs["a"])


# ----------------------------------------------------------------------------------------- scheduler


def make_scheduler(manager: AdapterManager, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, BlockManager(64, 4), adapters=manager)


def add(scheduler: Scheduler, seq_id: int, adapter: str | None) -> Sequence:
    seq = Sequence(seq_id, prompt_token_ids=(1, 2, 3), params=SamplingParams(max_tokens=2), adapter=adapter)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, manager: AdapterManager) -> list[int]:
    """One engine step with a runner that always samples token 7; returns the scheduled seq ids."""
    batch = scheduler.schedule()
    assert manager.sync() == {}
    sampled = tuple(SampledToken(w.seq_id, 7) for w in batch.seqs if w.sample)
    scheduler.update(batch, ModelOutput(sampled))
    return [w.seq_id for w in batch.seqs]


def test_an_unknown_adapter_is_refused_when_the_request_is_added(adapter_dirs) -> None:
    manager, _ = make_manager(adapter_dirs, max_loras=1)
    scheduler = make_scheduler(manager)
    with pytest.raises(UnknownAdapter):
        add(scheduler, 0, "nope")
    assert not scheduler.has_unfinished()


def test_a_sequence_waits_while_its_adapter_has_no_slot_and_base_sequences_pass_it(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=1)
    scheduler = make_scheduler(manager)
    for seq_id, adapter in enumerate(["a", "b", None, "a"]):
        add(scheduler, seq_id, adapter)

    # a takes the only slot; b must wait; the base request passes it; the second a request waits behind b
    # (arrival order among LoRA requests), though a's slot could serve it.
    assert step(scheduler, manager) == [0, 2]
    assert step(scheduler, manager) == [0, 2]  # decodes; both finish (max_tokens 2)
    assert slots.held == {0: "a"}

    assert step(scheduler, manager) == [1]  # a is idle now: evicted for b
    assert slots.held == {0: "b"} and manager.num_evictions_total == 1
    step(scheduler, manager)
    assert step(scheduler, manager) == [3]
    assert slots.held == {0: "a"} and manager.num_loads_total == 3


def test_sequences_of_a_loaded_adapter_share_its_slot(adapter_dirs) -> None:
    manager, slots = make_manager(adapter_dirs, max_loras=1)
    scheduler = make_scheduler(manager)
    for seq_id in range(3):
        add(scheduler, seq_id, "a")
    assert step(scheduler, manager) == [0, 1, 2]
    assert manager.num_loads_total == 1


def test_preemption_unpins_and_a_finished_request_releases_its_adapter(adapter_dirs) -> None:
    manager, _ = make_manager(adapter_dirs, max_loras=1)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    scheduler = Scheduler(config, BlockManager(2, 4), adapters=manager)  # two blocks of 4 tokens in all
    older = Sequence(0, prompt_token_ids=(1, 2, 3), params=SamplingParams(max_tokens=5))
    newer = Sequence(1, prompt_token_ids=(4, 5, 6), params=SamplingParams(max_tokens=5), adapter="a")
    scheduler.add(older)
    scheduler.add(newer)
    step(scheduler, manager)  # both prefill, one block each
    step(scheduler, manager)  # both reach 4 tokens: their blocks are full
    assert newer.status is SequenceStatus.RUNNING and not manager.can_run("b")

    step(scheduler, manager)  # the older needs a second block: the newer is preempted

    assert newer.status is SequenceStatus.WAITING and manager.can_run("b")
    scheduler.abort(1)
    assert manager.unload("a") is True  # no request names it any more
