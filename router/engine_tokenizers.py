"""Per model, the tokenizer and KV block size of its kvgate engines (`KvChain`), which the gateway needs to
route the model's requests on the engines' own KV blocks (`ReplicaTracker.kv_chain`).

Fetched over gRPC (`Replica.GetTokenizer`) from one of the model's engines, one task per model at a time,
retried with back-off while none can answer. Dropped, and fetched again, when the model's weights change in
the registry or when an engine counts a prompt differently (`disagree`): a stale tokenizer must never route.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvgate.clock import Clock
from kvgate.router.prompt_tokens import PromptTokenizer
from kvgate.router.load_readers import fetch_tokenizer

log = logging.getLogger(__name__)

# A model's engines that did not answer GetTokenizer (starting up, unreachable) are asked again after this
# long, doubling to TOKENIZER_RETRY_MAX_S while none can say (an engine without the RPC mid-upgrade, say).
TOKENIZER_RETRY_S = 2.0
TOKENIZER_RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class KvChain:
    """How a model's prompts map onto its engines' KV blocks: the engines' tokenizer and block size."""

    tokenizer: PromptTokenizer
    block_size_tokens: int


class EngineTokenizers:
    """The models' KV chains. `engines_of(model)` gives the gRPC targets of the model's engines now;
    `source_of(model)` its registry weights source ("" when the registry no longer declares it)."""

    def __init__(self, clock: Clock, engines_of: Callable[[str], list[str]], source_of: Callable[[str], str]) -> None:
        self._clock = clock
        self._engines_of = engines_of
        self._source_of = source_of
        self._chains: dict[str, KvChain] = {}  # per model, once one of its engines sent its tokenizer
        self._sources: dict[str, str] = {}  # the model's registry source when its chain was fetched
        self._refetch_after: dict[str, float] = {}  # per model: no refetch on disagreement before this (clock)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def get(self, model: str) -> KvChain | None:
        return self._chains.get(model)

    def put(self, model: str, chain: KvChain) -> None:
        """Use `chain` for `model` (what a fetch does; tests put a wrong one)."""
        self._chains[model] = chain
        self._sources[model] = self._source_of(model)

    def want(self, model: str, prefer: str | None = None, wait_s: float = 0.0) -> None:
        """Fetch the model's engine tokenizer (from `prefer` first, else whichever engine answers), until
        one arrives; at most one fetch task per model."""
        task = self._tasks.get(model)
        if model in self._chains or (task is not None and not task.done()):
            return
        self._tasks[model] = asyncio.create_task(self._fetch(model, prefer, wait_s), name=f"kvgate-tokenizer-{model}")

    def after_reload(self) -> None:
        """A model whose weights changed (or that left the registry) may tokenize differently: drop its
        chain and ask its engines again."""
        for model in list(self._chains):
            if self._sources.get(model) != self._source_of(model) or not self._source_of(model):
                del self._chains[model]
                self._sources.pop(model, None)
                engines = self._engines_of(model)
                if engines:
                    self.want(model, prefer=engines[0])

    def disagree(self, model: str, prefer: str | None) -> bool:
        """A response's usage.prompt_tokens differed from the gateway's count for a prompt it routed on KV
        blocks: the tokenizer it holds is not the engines' (weights changed under a replica, a stale fetch
        during a rolling change). Drop it, so the model routes on text, and fetch again (from `prefer`
        first), at most once a minute: an engine that counts differently for good then stays on text between
        tries. False when the model had no chain."""
        if self._chains.pop(model, None) is None:
            return False
        now = self._clock.now()
        wait_s = max(self._refetch_after.get(model, now) - now, 0.0)
        self._refetch_after[model] = now + wait_s + TOKENIZER_RETRY_MAX_S
        self.want(model, prefer=prefer, wait_s=wait_s)
        return True

    def tasks(self) -> list[asyncio.Task[None]]:
        """The fetch tasks, for the tracker's close() to cancel."""
        return list(self._tasks.values())

    async def _fetch(self, model: str, prefer: str | None, wait_s: float) -> None:
        delay_s = TOKENIZER_RETRY_S
        if wait_s > 0:
            await self._clock.sleep(wait_s)
        while model not in self._chains:
            targets = sorted(set(self._engines_of(model)), key=lambda t: t != prefer)
            if not targets:
                return  # no engine left to ask; the next one to join asks again
            for target in targets:
                try:
                    fetched = await fetch_tokenizer(target)
                    chain = KvChain(PromptTokenizer(fetched[0]), fetched[1]) if fetched is not None else None
                except grpc.aio.AioRpcError as exc:
                    log.debug("GetTokenizer %s: %s", target, exc.code().name)
                    continue
                except Exception:  # a tokenizer that fails its own checks: this task must not die of it
                    log.warning("GetTokenizer %s: unusable answer", target, exc_info=True)
                    continue
                if chain is None:
                    continue  # this engine cannot say; another may
                self.put(model, chain)
                log.info("model %s: routing on its engines' KV blocks (block size %d)", model, chain.block_size_tokens)
                return
            await self._clock.sleep(delay_s)
            delay_s = min(delay_s * 2, TOKENIZER_RETRY_MAX_S)
