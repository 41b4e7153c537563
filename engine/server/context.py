"""What every handler of one replica shares: settings, the engine, what the model accepts, the
metrics and the lifecycle. One `ServerContext` per app, stored under the typed key `CONTEXT`.

The model's fixed facts (tokenizer, max_model_len, vocabulary) are read once from the engine core
at construction; they never change, so handlers read them on the event loop without touching the
engine's worker thread, which owns everything else in the core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.server.adapter_access import AdapterAccess
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.sequence import Constraint, SamplingParams
from kvgate.engine.server.protocol import ChatMessage, model_not_found
from kvgate.engine.server.tools import ChoiceMode, ToolChoice, ToolFormat, ToolSpec, detect_tool_format
from kvgate.engine.structured import GrammarError
from kvgate.openai_wire import bad_request
from kvgate.tokenizer import ChatTemplateError

# Text longer than this (characters) is tokenized on a thread: about a millisecond of tokenizer work,
# which the event loop, serving every other stream, should not wait for.
_TOKENIZE_INLINE_MAX_CHARS = 16_384


@dataclass(frozen=True)
class ServerSettings:
    """What shapes the HTTP side of one replica. Time is injected: main.py passes the real clocks
    explicitly, tests pass fakes (the defaults are the real clocks, for scripts)."""

    served_model_name: str  # the `model` clients send for the base model, the one /v1/models lists
    # Other names clients may send for the base model: `kvgate engine --model builtin:smollm2-135m` serves
    # `smollm2-135m` and answers to `builtin:smollm2-135m` too, the name its user just typed.
    model_aliases: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies get a 413
    drain_timeout_s: float = 30.0  # after SIGTERM: how long in-flight requests may take before they are aborted
    retry_after_s: int = 5  # the Retry-After of a 503 while draining: about how long a replacement takes
    warmup: bool = True  # one tiny generation before /health says ready
    # Who may load and unload adapters, and from where (adapter_access.py); the default refuses every call.
    adapter_access: AdapterAccess = AdapterAccess()
    now: Callable[[], float] = time.monotonic  # seconds on a monotonic timeline, for latency metrics
    wall: Callable[[], float] = time.time  # seconds since the epoch, for `created` fields


class Lifecycle:
    """Readiness and drain of one server.

    starting -> ready (after warm-up) -> draining (SIGTERM: new requests get 503, /health 503) -> the
    process waits until the requests admitted before the drain finished, or the drain timeout passed
    and the rest are cancelled (which aborts them in the engine and frees their KV blocks).
    """

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def admit(self, task: asyncio.Task[Any]) -> None:
        self._in_flight.add(task)
        self._idle.clear()

    def release(self, task: asyncio.Task[Any]) -> None:
        self._in_flight.discard(task)
        if not self._in_flight:
            self._idle.set()

    def begin_drain(self) -> None:
        """Stop admitting requests. Idempotent."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no admitted request is left; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def cancel_in_flight(self) -> int:
        """Cancel every admitted request and wait for them to unwind; returns how many there were."""
        tasks = list(self._in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)


class ServerContext:
    """Shared by every handler of one app."""

    def __init__(self, *, engine: AsyncLLM, settings: ServerSettings, metrics: ServerMetrics,
                 lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.lifecycle = lifecycle
        core = engine.core  # fixed facts only, read once (see the module docstring)
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.model_root: str = core.config.model
        self.model_name = settings.served_model_name
        self._encode_prompt = core.encode_prompt  # text or token ids -> ids; ValueError for ids out of range
        self._token_texts: dict[int, str] = {}
        self.vocab_size: int = core.vocab_size
        self.max_num_seqs: int = core.config.max_num_seqs
        self._grammars = core.grammars  # compile() is safe off the engine's thread
        # How this model writes tool calls, from its own chat template; None: no tools (the fallback template has none).
        template = self.tokenizer.chat_template if self.tokenizer.has_own_chat_template else ""
        self.tool_format: ToolFormat | None = detect_tool_format(
            template, self.tokenizer.token_to_id, lambda t: self.tokenizer.decode([t], skip_special_tokens=True) == "")

    @property
    def now(self) -> Callable[[], float]:
        return self.settings.now

    def adapter_names(self) -> tuple[str, ...]:
        """Adapters clients may name: registered or loaded (() before the engine has multi-LoRA)."""
        adapters = getattr(self.engine, "adapters", None)
        if adapters is None:
            return ()
        info = adapters()
        return tuple(dict.fromkeys((*info.registered, *info.loaded)))

    def resolve_model(self, name: str) -> str | None:
        """The adapter a request's `model` names: None for the base model (its served name or an alias; an
        adapter of an alias's name wins). Raises ApiError 404 naming what is served."""
        if name == self.model_name:
            return None
        adapters = self.adapter_names()
        if name in adapters:
            return name
        if name in self.settings.model_aliases:
            return None
        raise model_not_found(name, (self.model_name, *adapters))

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    async def completion_prompt_ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        """Token ids of a /v1/completions prompt. Raises ApiError 400 for ids outside the vocabulary."""
        try:
            return await _maybe_off_loop(self._encode_prompt, prompt, len(prompt) if isinstance(prompt, str) else 0)
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from exc

    async def chat_prompt_ids(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """Token ids of a chat rendered with the model's template (which writes its own BOS), with `tools`
        offered through the template. Raises ApiError 400 when the template rejects the messages."""
        dicts = [m.to_template() for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(dicts, add_generation_prompt=True,
                                                      tools=[t.to_template() for t in tools] or None)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        return await _maybe_off_loop(lambda t: self.tokenizer.encode(t, add_special_tokens=False), text, len(text))

    def tool_format_for(self, tools: Sequence[ToolSpec], choice: ToolChoice) -> ToolFormat | None:
        """The call format to render and parse `tools` with; None when there are none. Raises ApiError 400
        when tools are asked for and the model's chat template has no tool support kvgate can parse."""
        if not tools:
            return None
        if self.tool_format is None and choice.mode is not ChoiceMode.NONE:
            raise bad_request(f"model '{self.model_name}' has no chat template with tool support that this server can "
                              "parse (formats: hermes <tool_call>, llama3 JSON, mistral [TOOL_CALLS]); send the "
                              "request without tools", "tools")
        return self.tool_format

    async def check_constraint(self, constraint: Constraint, param: str) -> None:
        """Compile `constraint` now (cached), so a schema the grammar library cannot take is a 400 naming the
        part at fault rather than a failure inside the engine. Compiling runs on a thread."""
        try:
            await asyncio.to_thread(self._grammars.compile, constraint)
        except GrammarError as exc:
            raise bad_request(f"{param}: the schema cannot be enforced: {exc}", param) from exc

    def check_sampling(self, params: SamplingParams) -> None:
        """What only this server knows: n within its sequences, logit_bias ids within its vocabulary."""
        if params.n > self.max_num_seqs:
            raise bad_request(f"n is {params.n}; this server runs at most {self.max_num_seqs} sequences at once "
                              "(max_num_seqs)", "n")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise bad_request(f"logit_bias names token ids outside the vocabulary (0 .. {self.vocab_size - 1}): "
                              f"{bad[:5]}", "logit_bias")

    def token_text(self, token_id: int) -> str:
        """One token's own string (special tokens kept), for logprobs. Memoized: the vocabulary is finite."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


async def _maybe_off_loop(fn: Callable[[Any], list[int]], arg: Any, size_chars: int) -> list[int]:
    if size_chars > _TOKENIZE_INLINE_MAX_CHARS:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


CONTEXT = web.AppKey("kvgate_engine_context", ServerContext)
