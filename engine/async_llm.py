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

from engine.core import EngineConfig, EngineCore, EngineStats, TokenDelta
from engine.sequence import SamplingParams

log = logging.getLogger("kvgate.engine")


@dataclass(frozen=True)
class _Add:
    prompt: str | Seq[int]
    params: SamplingParams
    adapter: str | None
    on_delta: Callable[[TokenDelta | BaseException], None]
    result: concurrent.futures.Future[int]


@dataclass(frozen=True)
class _Abort:
    seq_id: int


class EngineDead(RuntimeError):
    """The engine's worker thread stopped (a bug or a device error); every open request gets this."""


class AsyncLLM:
    """Serve many concurrent requests from one `EngineCore` driven by a worker thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[int, Callable[[TokenDelta | BaseException], None]] = {}
        self._failure: BaseException | None = None
        # The worker publishes a fresh snapshot after every step and command; readers on other threads
        # see an immutable value and never touch the core. Listeners are called on the worker thread.
        self._stats = core.stats()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
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
        """Stream the deltas of one request, the last one carrying its finish reason.

        Raises ValueError (bad prompt) before the first delta. Closing the iterator early, or
        cancelling the task that reads it, aborts the request.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()

        def on_delta(item: TokenDelta | BaseException) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        seq_id = await self._submit(prompt, params, adapter, on_delta)
        finished = False
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
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

    def on_stats(self, listener: Callable[[EngineStats], None]) -> Callable[[], None]:
        """Call `listener(stats)` whenever a step or command changed the snapshot. It runs on the worker
        thread, so it must only hand the value over (e.g. loop.call_soon_threadsafe). Returns an
        unsubscribe function."""
        self._stats_listeners.append(listener)
        return lambda: self._stats_listeners.remove(listener) if listener in self._stats_listeners else None

    def _publish_stats(self) -> None:
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
                      on_delta: Callable[[TokenDelta | BaseException], None]) -> int:
        if self._failure is not None or not self._thread.is_alive():
            raise EngineDead(f"the engine stopped: {self._failure!r}")
        result: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._commands.put(_Add(prompt, params, adapter, on_delta, result))
        return await asyncio.wrap_future(result)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._sinks.pop(command.seq_id, None)
            self.core.abort(command.seq_id)
            return
        try:
            seq_id = self.core.add_request(command.prompt, command.params, command.adapter)
        except Exception as exc:  # bad input: the caller gets it, the engine carries on
            command.result.set_exception(exc)
            return
        self._sinks[seq_id] = command.on_delta
        command.result.set_result(seq_id)

    def _run(self) -> None:
        try:
            while True:
                # Block for a command only when there is nothing to compute.
                block = not self.core.has_unfinished()
                try:
                    command = self._commands.get(block=block)
                    while True:
                        if command is None:
                            return
                        self._apply(command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                self._publish_stats()
                deltas = self.core.step()
                self._publish_stats()  # before the deltas: a consumer that saw its last token sees it counted
                for delta in deltas:
                    sink = self._sinks.get(delta.seq_id)
                    if sink is not None:
                        sink(delta)
                        if delta.finish_reason is not None:
                            del self._sinks[delta.seq_id]
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
            if isinstance(command, _Add) and not command.result.done():
                command.result.set_exception(EngineDead("the engine was closed"))
