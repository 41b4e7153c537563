"""`AsyncLLM`: the engine for servers. Engine steps run on a worker thread, off the event loop;
each request streams its tokens to an asyncio consumer.

The `EngineCore` is single-threaded: only the worker touches it. Callers hand it commands (add,
abort) through a thread-safe queue that the worker applies between steps, and the worker hands each
request's deltas back with `loop.call_soon_threadsafe`. torch releases the GIL inside its kernels,
so the event loop keeps serving HTTP while a step runs.

A consumer that stops reading (client gone, task cancelled) aborts its request, which frees its KV
blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, TypeVar

from kvgate.engine.block_manager import KVEvent
from kvgate.engine.core import EngineConfig, EngineCore, EngineStats, TokenDelta
from kvgate.engine.lora import AdapterInfo
from kvgate.engine.sequence import SamplingParams

log = logging.getLogger("kvgate.engine")
T = TypeVar("T")


@dataclass(frozen=True)
class _Add:
    prompt: str | Seq[int]
    params: SamplingParams
    adapter: str | None
    on_delta: Callable[[TokenDelta | BaseException], None]
    result: concurrent.futures.Future[list[int]]


@dataclass(frozen=True)
class _Abort:
    seq_id: int


@dataclass(frozen=True)
class _Call:
    """Run `fn(core)` on the worker between steps; for reads that must not race a step."""

    fn: Callable[[EngineCore], Any]
    result: concurrent.futures.Future[Any]


class EngineDead(RuntimeError):
    """The engine's worker thread stopped (a bug or a device error); every open request gets this."""


class AsyncLLM:
    """Serve many concurrent requests from one `EngineCore` driven by a worker thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[int, Callable[[TokenDelta | BaseException], None]] = {}
        self._failure: BaseException | None = None
        # The worker publishes a fresh snapshot after every step and command; readers on other threads
        # see an immutable value and never touch the core. Listeners are called on the worker thread.
        self._stats = core.stats()
        self._adapters = core.adapters()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._kv_event_listeners: list[Callable[[tuple[KVEvent, ...]], None]] = []
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncLLM:
        """Load the model on a thread (seconds to minutes) without blocking the event loop."""
        core = await asyncio.to_thread(EngineCore, config)
        return cls(core)

    # --------------------------------------------------------------------------------- public API

    async def generate(self, prompt: str | Seq[int], params: SamplingParams,
                       adapter: str | None = None) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request, the last one carrying its finish reason. With params.n > 1,
        the deltas of its n samples interleave (TokenDelta.index says whose), and the stream ends when all
        n have finished.

        Raises ValueError (bad prompt, a constraint that does not compile) or UnknownAdapter before the
        first delta, and AdapterLoadError if the adapter's weights cannot be loaded when the request is
        scheduled. Closing the iterator early, or cancelling the task that reads it, aborts the request.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()

        def on_delta(item: TokenDelta | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        open_ids = set(await self._submit(prompt, params, adapter, on_delta))
        try:
            while open_ids:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    open_ids.discard(item.seq_id)
                yield item
        finally:
            for seq_id in open_ids:
                self._commands.put(_Abort(seq_id))

    async def close(self) -> None:
        """Stop the worker after its current step; open requests are aborted."""
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot the worker published (after its last step or command)."""
        return self._stats

    async def load_adapter(self, name: str, source: str) -> None:
        """Register a LoRA adapter and load it now (EngineCore.load_adapter). An s3:// source downloads on
        a thread first; validation and the load run on the worker between steps. Raises AdapterLoadError;
        the engine keeps serving."""
        directory = await asyncio.to_thread(self.core.fetch_adapter, source)
        load = self._published(lambda core: core.load_adapter(name, source, directory=directory))
        await self._call_on_worker(load)

    async def unload_adapter(self, name: str) -> bool:
        """Stop serving an adapter (EngineCore.unload_adapter): new requests for it raise UnknownAdapter,
        accepted ones finish. True if it was registered, False if not."""
        return await self._call_on_worker(self._published(lambda core: core.unload_adapter(name)))

    def adapters(self) -> AdapterInfo:
        """The registered and loaded adapters, as of the worker's last step or command (load_adapter and
        unload_adapter publish before they return)."""
        return self._adapters

    def on_stats(self, listener: Callable[[EngineStats], None]) -> Callable[[], None]:
        """Call `listener(stats)` whenever a step or command changed the snapshot. It runs on the worker
        thread, so it must only hand the value over (e.g. loop.call_soon_threadsafe). Returns an
        unsubscribe function."""
        self._stats_listeners.append(listener)
        return lambda: self._stats_listeners.remove(listener) if listener in self._stats_listeners else None

    def on_kv_events(self, listener: Callable[[tuple[KVEvent, ...]], None]) -> Callable[[], None]:
        """Call `listener(events)` with the prefix-cache events (BlockStored/BlockRemoved, oldest first)
        that each step or command recorded. Only an engine created with EngineConfig.enable_kv_events
        records any. Like on_stats, it runs on the worker thread. Returns an unsubscribe function."""
        self._kv_event_listeners.append(listener)
        return lambda: (self._kv_event_listeners.remove(listener)
                        if listener in self._kv_event_listeners else None)

    async def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache, read on the worker between steps. Events recorded
        after this read reach on_kv_events listeners after the result is set, so a listener that was
        subscribed before the call and applies its events to the result as set updates keeps an exact
        copy (events from just before the read may repeat what the result holds)."""
        return await self._call_on_worker(lambda core: core.block_manager.cached_block_hashes())

    def _publish_kv_events(self) -> None:
        if not self.core.block_manager.enable_kv_events:
            return
        events = tuple(self.core.block_manager.drain_kv_events())  # drained even with no listener
        if not events:
            return
        for listener in list(self._kv_event_listeners):
            try:
                listener(events)
            except Exception:
                log.exception("kv event listener failed")

    def _published(self, fn: Callable[[EngineCore], T]) -> Callable[[EngineCore], T]:
        """`fn`, then a fresh snapshot, so the caller sees its change as soon as it returns."""
        def run(core: EngineCore) -> T:
            try:
                return fn(core)
            finally:
                self._publish_stats()
        return run

    def _publish_stats(self) -> None:
        self._adapters = self.core.adapters()
        stats = self.core.stats()
        if stats == self._stats:
            return
        self._stats = stats
        for listener in list(self._stats_listeners):
            try:
                listener(stats)
            except Exception:
                log.exception("stats listener failed")

    # ---------------------------------------------------------------------------------- internals

    async def _submit(self, prompt: str | Seq[int], params: SamplingParams, adapter: str | None,
                      on_delta: Callable[[TokenDelta | BaseException], None]) -> list[int]:
        if self._failure is not None or not self._thread.is_alive():
            raise EngineDead(f"the engine stopped: {self._failure!r}")
        result: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        self._commands.put(_Add(prompt, params, adapter, on_delta, result))
        try:
            return await asyncio.wrap_future(result)
        except asyncio.CancelledError:
            # The caller left (client gone) before learning the id. A future the worker has not taken
            # yet is cancelled with us and never added; one it is adding is aborted once it has an id.
            result.add_done_callback(self._abort_if_added)
            raise

    def _abort_if_added(self, result: concurrent.futures.Future[list[int]]) -> None:
        if not result.cancelled() and result.exception() is None:
            for seq_id in result.result():
                self._commands.put(_Abort(seq_id))

    async def _call_on_worker(self, fn: Callable[[EngineCore], T]) -> T:
        if self._failure is not None or not self._thread.is_alive():
            raise EngineDead(f"the engine stopped: {self._failure!r}")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(fn, result))
        return await asyncio.wrap_future(result)

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        # A caller cancelled while its command waited here cancelled the command's future: skip it. Past
        # this check the future cannot be cancelled, so setting its result below cannot raise.
        if not isinstance(command, _Abort) and not command.result.set_running_or_notify_cancel():
            return
        if isinstance(command, _Call):
            try:
                command.result.set_result(command.fn(self.core))
            except Exception as exc:
                command.result.set_exception(exc)
            return
        if isinstance(command, _Abort):
            self._sinks.pop(command.seq_id, None)
            self.core.abort(command.seq_id)
            return
        try:
            seq_ids = self.core.add_requests(command.prompt, command.params, command.adapter)
        except Exception as exc:  # bad input: the caller gets it, the engine carries on
            command.result.set_exception(exc)
            return
        for seq_id in seq_ids:
            self._sinks[seq_id] = command.on_delta
        command.result.set_result(seq_ids)

    def _run(self) -> None:
        try:
            while True:
                # Block for a command only when there is nothing to compute.
                block = not self.core.has_unfinished()
                applied = False
                try:
                    command = self._commands.get(block=block)
                    while True:
                        if command is None:
                            return
                        self._apply(command)
                        applied = True
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if applied:  # otherwise nothing changed since the previous step's publish
                    self._publish_stats()
                    self._publish_kv_events()
                deltas = self.core.step()
                self._publish_stats()  # before the deltas: a consumer that saw its last token sees it counted
                self._publish_kv_events()  # likewise its blocks: they were committed in this step
                for delta in deltas:
                    sink = self._sinks.get(delta.seq_id)
                    if sink is not None:
                        sink(delta)
                        if delta.finish_reason is not None:
                            del self._sinks[delta.seq_id]
                for seq_id, error in self.core.drain_request_errors():  # e.g. its adapter failed to load
                    sink = self._sinks.pop(seq_id, None)
                    if sink is not None:
                        sink(error)
        except BaseException as exc:  # a bug or device failure: fail every open request loudly
            log.exception("engine worker died")
            self._failure = exc
            for sink in self._sinks.values():
                sink(EngineDead(f"the engine stopped: {exc!r}"))
            self._sinks.clear()
        finally:
            for sink in self._sinks.values():
                sink(EngineDead("the engine was closed"))
            self._sinks.clear()
            self._drain_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)) and not command.result.done():
                command.result.set_exception(EngineDead("the engine was closed"))
