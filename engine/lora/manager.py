"""Which LoRA adapters a replica serves, and which of them hold one of its `max_loras` weight slots.

Plain Python: the manager decides, the runner acts. Decisions change the bookkeeping at once and queue
slot operations (load adapter X into slot 2, clear slot 1); `sync()` performs them through the runner's
`SlotLoader`, once per engine step between scheduling and the forward pass, so the scheduler never does
I/O and the runner never sees a slot change in the middle of a step.

Lifecycle of one adapter:
  register   validated (adapter_config.json and tensor shapes against the base model); accepts requests
  loaded     its weights hold a slot; requests of several loaded adapters share one forward pass
  evicted    a slot was needed and this was the least recently used IDLE adapter (no running sequence);
             still registered, reloaded from its directory on its next use
  unloading  unload() was called while requests still named it: new requests are refused at once, the
             accepted ones finish, then it is dropped

The scheduler drives the counts through the gate methods (on_add, can_run, on_run, on_stop, on_finish):
a sequence pins its adapter's slot from admission until it is preempted or finishes, and a sequence
whose adapter can get no slot this step is not admitted (engine/scheduler.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvgate.engine.config import ModelConfig
from kvgate.engine.lora.errors import AdapterLoadError, UnknownAdapter
from kvgate.engine.lora.peft import PeftAdapter, read_peft_adapter


@dataclass(frozen=True)
class AdapterInfo:
    registered: tuple[str, ...]  # names new requests may use, sorted
    loaded: tuple[str, ...]  # of those, the ones whose weights hold a slot now, sorted


class SlotLoader(Protocol):
    """Puts adapter weights into the runner's slots (engine/runner/lora.py; a fake in tests)."""

    def load(self, slot: int, name: str, adapter: PeftAdapter) -> None:
        """Replace whatever `slot` held with `adapter`'s weights. Raises AdapterLoadError."""

    def clear(self, slot: int) -> None:
        """Forget what `slot` held. Idempotent."""


@dataclass
class _Entry:
    source: str
    adapter: PeftAdapter
    slot: int | None = None
    num_requests: int = 0  # unfinished requests naming it, waiting or running
    num_running: int = 0  # of those, RUNNING: they pin the slot
    unloading: bool = False


@dataclass(frozen=True)
class _Load:
    slot: int
    name: str


@dataclass(frozen=True)
class _Clear:
    slot: int


class AdapterManager:
    """The registry (name -> source) and the slot table of one replica. Not thread-safe: the engine's
    worker thread owns it."""

    def __init__(self, model: ModelConfig, loader: SlotLoader | None, *, max_loras: int, max_lora_rank: int) -> None:
        for key, value, low in (("max_loras", max_loras, 0), ("max_lora_rank", max_lora_rank, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}; got {value!r}")
        if max_loras and loader is None:
            raise ValueError("a SlotLoader is needed when max_loras > 0")
        self.model = model
        self.loader = loader
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._entries: dict[str, _Entry] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._lru: OrderedDict[str, None] = OrderedDict()  # adapters holding a slot, least recently used first
        self._pending: list[_Load | _Clear] = []
        self.num_loads_total = 0  # weights loaded into a slot (first loads and reloads after eviction)
        self.num_evictions_total = 0  # idle adapters that gave their slot to another

    # ------------------------------------------------------------------------------------ registry

    def register(self, name: str, source: str, directory: Path) -> None:
        """Validate the adapter in `directory` and accept requests for `name`. Idempotent for the same
        source and directory (it also cancels a pending unload). A new source or directory (a changed S3
        object) replaces the old weights if no request uses them. Raises AdapterLoadError: invalid files,
        multi-LoRA off (max_loras=0), or a replacement while requests still use the name."""
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"an adapter name must be a non-empty string; got {name!r}")
        if self.max_loras == 0:
            raise AdapterLoadError(f"cannot load adapter {name!r}: multi-LoRA is off (max_loras is 0)")
        entry = self._entries.get(name)
        if entry is not None and entry.source == source and entry.adapter.directory == Path(directory):
            entry.unloading = False
            return
        if entry is not None and entry.num_requests:
            raise AdapterLoadError(f"adapter {name!r} is in use by {entry.num_requests} request(s) with source "
                                   f"{entry.source!r}; unload it and load the new source when they finish")
        adapter = read_peft_adapter(directory, self.model, self.max_lora_rank)
        if entry is not None:
            self._drop(name)
        self._entries[name] = _Entry(source, adapter)

    def load_now(self, name: str) -> bool:
        """Give a registered adapter a slot now (a free one, else the least recently used idle adapter's);
        call sync() after. False when every slot is pinned by running requests: it loads on first use.
        Raises UnknownAdapter."""
        entry = self._entry(name)
        if entry.slot is None:
            if not self._can_get_slot():
                return False
            self._assign(name, entry)
        self._touch(name)
        return True

    def unload(self, name: str) -> bool:
        """Stop serving `name`: new requests for it raise UnknownAdapter from now on. True if it was
        dropped now (no request used it); False if accepted requests still use it: they finish with its
        weights, and it is dropped after the last one. Raises UnknownAdapter for a name not registered."""
        entry = self._entry(name)
        if entry.num_requests:
            entry.unloading = True
            return False
        self._drop(name)
        return True

    def is_registered(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and not entry.unloading

    def info(self) -> AdapterInfo:
        registered = tuple(sorted(n for n, e in self._entries.items() if not e.unloading))
        return AdapterInfo(registered=registered, loaded=self.loaded())

    def loaded(self) -> tuple[str, ...]:
        """Registered adapters whose weights hold a slot (not ones being unloaded: they take no new requests)."""
        return tuple(sorted(name for name in self._slots if name is not None and not self._entries[name].unloading))

    def slot_of(self, name: str) -> int | None:
        entry = self._entries.get(name)
        return entry.slot if entry is not None else None

    # -------------------------------------------------------------------------- the scheduler's gate

    def on_add(self, name: str) -> None:
        """A request for `name` was accepted. Raises UnknownAdapter if it is not registered."""
        self._entry(name).num_requests += 1

    def can_run(self, name: str) -> bool:
        """Whether a sequence of `name` can start running this step: its adapter holds a slot, or a slot
        is free, or an idle adapter can be evicted."""
        return self._entries[name].slot is not None or self._can_get_slot()

    def on_run(self, name: str) -> None:
        """A sequence of `name` started running (call only after can_run): pins the slot, assigning one
        (and evicting) if needed."""
        entry = self._entries[name]
        entry.num_running += 1
        if entry.slot is None:
            self._assign(name, entry)
        self._touch(name)

    def on_stop(self, name: str) -> None:
        """A running sequence of `name` was preempted or finished."""
        self._entries[name].num_running -= 1
        self._touch(name)

    def on_finish(self, name: str) -> None:
        """A request for `name` ended (finished, aborted or failed), running or not."""
        entry = self._entries[name]
        entry.num_requests -= 1
        if entry.unloading and entry.num_requests == 0:
            self._drop(name)

    # ------------------------------------------------------------------------------------- runner

    def sync(self) -> dict[str, AdapterLoadError]:
        """Perform the queued slot operations. Returns the adapters whose load failed, with why; each lost
        its slot (and stays registered: the next request retries). The caller fails their sequences."""
        pending, self._pending = self._pending, []
        failures: dict[str, AdapterLoadError] = {}
        for op in pending:
            assert self.loader is not None, "no slot operations without slots"
            if isinstance(op, _Clear):
                self.loader.clear(op.slot)
                continue
            entry = self._entries.get(op.name)
            if entry is None or entry.slot != op.slot:
                continue  # dropped or moved before the load happened
            try:
                self.loader.load(op.slot, op.name, entry.adapter)
            except AdapterLoadError as exc:
                failures[op.name] = exc
                self._release(op.name, entry)
                self.loader.clear(op.slot)
            else:
                self.num_loads_total += 1
        return failures

    # ---------------------------------------------------------------------------------- internals

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.unloading:
            raise UnknownAdapter(name, self.info().registered)
        return entry

    def _can_get_slot(self) -> bool:
        return None in self._slots or self._victim() is not None

    def _victim(self) -> str | None:
        return next((name for name in self._lru if self._entries[name].num_running == 0), None)

    def _assign(self, name: str, entry: _Entry) -> None:
        if None in self._slots:
            slot = self._slots.index(None)  # the lowest free slot
        else:
            victim = self._victim()
            if victim is None:
                raise RuntimeError(f"no slot for adapter {name!r}: every slot is pinned (check can_run first)")
            slot = self._entries[victim].slot
            self._release(victim, self._entries[victim])
            self.num_evictions_total += 1
        self._slots[slot] = name
        entry.slot = slot
        self._lru[name] = None
        self._pending.append(_Load(slot, name))

    def _release(self, name: str, entry: _Entry) -> None:
        self._slots[entry.slot] = None
        entry.slot = None
        self._lru.pop(name, None)

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name)
        if entry.slot is not None:
            slot = entry.slot
            self._release(name, entry)
            self._pending.append(_Clear(slot))

    def _touch(self, name: str) -> None:
        if name in self._lru:
            self._lru.move_to_end(name)
