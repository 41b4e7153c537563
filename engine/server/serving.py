"""POST /v1/completions and /v1/chat/completions: parse, tokenize, generate, answer or stream.

One request's path:
    body -> protocol.parse_*  -> context: model/adapter, prompt token ids -> protocol.sampling_params
         -> engine.generate (an async iterator of TokenDelta) -> render.* -> JSON, or SSE chunks

The first delta is awaited before any byte is sent, so an input the engine refuses still gets a
proper status (and a router may retry elsewhere before the first byte). Streams are written one
chunk per delta with `await response.write(...)`, which waits while the socket's buffer is full:
a slow reader slows its own request down instead of growing memory.

A client that goes away aborts its request: aiohttp cancels the handler (handler_cancellation) or
the next write raises ConnectionResetError; either way the `aclosing` block closes the engine's
iterator, and AsyncLLM aborts the request, freeing its KV blocks at the next step.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvgate.engine.async_llm import EngineDead
from kvgate.engine.core import TokenDelta
from kvgate.engine.lora import UnknownAdapter
from kvgate.engine.sequence import SamplingParams
from kvgate.engine.server.context import CONTEXT, ServerContext
from kvgate.engine.server.tools import ChoiceMode, ToolFormat, call_constraint
from kvgate.engine.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatRequest,
    body_too_large,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
    sampling_params,
)
from kvgate.engine.server.render import ChatRenderer, CompletionRenderer, Renderer, Usage
from kvgate.openai_wire import ApiError, bad_request

# What engine.generate raises for one request: before its first token (a refusal), or after.
_ENGINE_REFUSALS = (ValueError, UnknownAdapter)
_ENGINE_ERRORS = (EngineDead, *_ENGINE_REFUSALS)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Job:
    """One validated request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    stream: bool
    include_usage: bool
    arrival_s: float  # the server clock when the request arrived, for time to first token


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object. Raises ApiError 413 over the size limit, 400 for bad JSON."""
    limit = request.app[CONTEXT].settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:  # chunked bodies: aiohttp counts as it reads
        raise body_too_large(limit) from exc
    return parse_json_object(raw)


async def completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    arrival_s = context.now()
    parsed = parse_completion_request(await read_json(request))
    adapter = context.resolve_model(parsed.model)
    prompt_ids = await context.completion_prompt_ids(parsed.prompt)
    params = sampling_params(parsed.sampling, num_prompt_tokens=len(prompt_ids), max_model_len=context.max_model_len,
                             prompt_param="prompt", default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
    context.check_sampling(params)
    renderer = CompletionRenderer(request_id=f"cmpl-{uuid.uuid4().hex}", created=int(context.settings.wall()),
                                  model=parsed.model, token_text=context.token_text,
                                  logprobs=params.logprobs is not None, include_usage=parsed.include_usage,
                                  n=params.n)
    job = Job(prompt_ids, params, adapter, parsed.stream, parsed.include_usage, arrival_s)
    return await _generate(request, context, job, renderer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    arrival_s = context.now()
    parsed = parse_chat_request(await read_json(request))
    adapter = context.resolve_model(parsed.model)
    tool_format = context.tool_format_for(parsed.tools, parsed.tool_choice)
    prompt_ids = await context.chat_prompt_ids(parsed.messages, parsed.tools if tool_format is not None else ())
    constraint, param = parsed.response_format, "response_format"
    if tool_format is not None and parsed.tool_choice.mode is not ChoiceMode.NONE:
        calls = call_constraint(tool_format, parsed.tools, parsed.tool_choice)
        if parsed.tool_choice.forces_call:
            constraint, param = calls, "tools"
        else:  # "auto" leaves the model free, but a parameter schema that cannot be read is the client's error now
            await context.check_constraint(calls, "tools")
    if constraint is not None:
        await context.check_constraint(constraint, param)
    params = sampling_params(parsed.sampling, num_prompt_tokens=len(prompt_ids),
                             max_model_len=context.max_model_len, prompt_param="messages", constraint=constraint,
                             skip_special_tokens=not (tool_format is not None and tool_format.tags_special))
    context.check_sampling(params)
    renderer = ChatRenderer(request_id=f"chatcmpl-{uuid.uuid4().hex}", created=int(context.settings.wall()),
                            model=parsed.model, token_text=context.token_text,
                            logprobs=params.logprobs is not None, include_usage=parsed.include_usage,
                            n=params.n, tool_format=_parsed_calls(tool_format, parsed))
    job = Job(prompt_ids, params, adapter, parsed.stream, parsed.include_usage, arrival_s)
    return await _generate(request, context, job, renderer)


def _parsed_calls(tool_format: ToolFormat | None, parsed: ChatRequest) -> ToolFormat | None:
    """The format to read calls out of the output with: none when tools are off, or when the output is held to
    a response_format (a JSON answer with a "name" field is an answer, not a Llama 3 call)."""
    if parsed.tool_choice.mode is ChoiceMode.NONE or parsed.response_format is not None:
        return None
    return tool_format


class _Record:
    """What the metrics need to know about one request, filled in as its tokens arrive."""

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_tokens = 0  # every choice's (usage counts them all)
        self.choice_tokens: dict[int, int] = {}  # per choice: time per output token is per sequence
        self.cached_tokens = 0
        self.finish_reason = "abort"  # until a delta says otherwise: the client left, or a drain timed out
        self.accepted = True  # False when the engine refused the input: not a request that ran

    def token(self, delta: TokenDelta, now_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.last_token_s = now_s
        self.num_tokens += 1
        self.choice_tokens[delta.index] = self.choice_tokens.get(delta.index, 0) + 1
        self.cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.value


async def _generate(request: web.Request, context: ServerContext, job: Job, renderer: Renderer
                    ) -> web.StreamResponse:
    record = _Record(job.arrival_s)
    try:
        async with contextlib.aclosing(context.engine.generate(job.prompt_ids, job.params, job.adapter)) as deltas:
            try:
                first = await anext(deltas)
            except _ENGINE_REFUSALS:
                record.accepted = False  # refused before it ran: not a request for the latency metrics
                raise
            record.token(first, context.now())
            if job.stream:
                return await _stream(request, context, job, renderer, first, deltas, record)
            collected = [first]
            async for delta in deltas:  # until every choice has finished
                record.token(delta, context.now())
                collected.append(delta)
            usage = Usage(len(job.prompt_ids), record.num_tokens, record.cached_tokens)
            return web.json_response(renderer.response(collected, usage), dumps=_dumps)
    except _ENGINE_ERRORS as exc:
        record.finish_reason = "error"
        raise engine_error(exc) from exc
    finally:
        if record.accepted:
            context.metrics.observe_request(
                arrival_s=record.arrival_s, first_token_s=record.first_token_s, last_token_s=record.last_token_s,
                num_output_tokens=max(record.choice_tokens.values(), default=0), finish_reason=record.finish_reason)


def engine_error(exc: Exception) -> ApiError:
    """The client's view of an error the engine raised for one request (typed errors, mapped once here)."""
    if isinstance(exc, EngineDead):
        return ApiError(503, f"The engine of this replica stopped: {exc}", type="ServiceUnavailableError",
                        code="engine_unavailable")
    if isinstance(exc, UnknownAdapter):  # unloaded between our check and the engine's
        return ApiError(404, f"The model adapter is not available: {exc}", type="NotFoundError", param="model",
                        code="model_not_found")
    # ValueError: the engine's own input checks behind ours, or an adapter that failed to load for it
    return bad_request(str(exc))


async def _stream(request: web.Request, context: ServerContext, job: Job, renderer: Renderer,
                  first: TokenDelta, deltas: AsyncIterator[TokenDelta], record: _Record) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        for chunk in renderer.opening_chunks():
            await _send(response, chunk)
        delta: TokenDelta | None = first
        while delta is not None:  # until every choice has finished
            for chunk in renderer.chunks(delta):
                await _send(response, chunk)
            delta = await anext(deltas, None)
            if delta is not None:
                record.token(delta, context.now())
        if job.include_usage:
            await _send(response, renderer.usage_chunk(Usage(len(job.prompt_ids), record.num_tokens,
                                                             record.cached_tokens)))
        await response.write(_DONE)
    except ConnectionResetError:
        pass  # the client went away; leaving the aclosing block aborts the request
    except _ENGINE_ERRORS as exc:  # the status is sent already: say it in the stream, as vLLM does
        record.finish_reason = "error"
        with contextlib.suppress(ConnectionResetError):
            await _send(response, engine_error(exc).body())
            await response.write(_DONE)
    return response


async def _send(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    await response.write(b"data: " + _dumps(obj).encode() + b"\n\n")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
