"""A simulated OpenAI-compatible replica: an LRU prefix cache, a prefill/decode cost model, failure injection.

Stands in for a vLLM-like server where real engines cannot fit (routing benchmarks at 16 or 64 replicas)
and for a misbehaving backend in the router's tests. One aiohttp app:

- POST /v1/completions, /v1/chat/completions: streamed (SSE ending `data: [DONE]`, a usage chunk when
  `stream_options.include_usage`) or not; `usage.prompt_tokens_details.cached_tokens` reports the hit;
- GET /v1/models, /health, /metrics (vLLM's `vllm:*` names), /stats (JSON counters);
- POST /admin/fail {"mode": ..., "fail_after_n": N, ...} switches the failure mode at runtime.

In process: `build_app(config, clock)` for `aiohttp.test_utils` or an `AppRunner` (pass
`handler_cancellation=True` so a client that goes away on a non-streamed request aborts it), or
`await start_sim_replica(config)`. As a process:

    python loadtests/sim_replica.py --port 8001 --model sim-llama --adapter sql-lora \
        --kv-capacity-tokens 32768 --prefill-tokens-per-s 8000 --decode-tokens-per-s 50 --max-batch 16 \
        [--fail die_mid_stream --fail-after-n 10]

KV-events mode (`--tokenizer-dir DIR [--grpc-port P]`, `SimReplicaConfig.tokenizer_dir` / `grpc_port`): the
sim counts and hashes prompts with DIR's tokenizer exactly as a `kvgate engine` does, and on the gRPC port
serves kvgate's replica-state protocol (WatchState with KV block events, GetState, GetTokenizer), so a
gateway lists it as `backend: kvgate` with a `grpc_target` and routes it on its KV blocks. See
`sim_state.py`. Without a tokenizer directory (the default) it counts 4 characters per token, as always.

The cost model and the cache live in `sim_replica_model.py`; this file is the I/O shell.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from aiohttp import web

if __package__ in (None, ""):  # run as a script: make `kvgate` and `loadtests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvgate.engine.block_manager import KVEvent  # noqa: E402
from kvgate.clock import Clock, RealClock  # noqa: E402
from loadtests.sim_failures import (HEALTH_FAILS, FailMode, FailureSpec, FailureState,  # noqa: E402,F401
                                    drop_connection, stall)
from loadtests.sim_state import SimStateService, SimTokens, start_sim_state_service  # noqa: E402
from loadtests.sim_replica_model import (  # noqa: E402
    BLOCK_SIZE_TOKENS,
    Scheduler,
    SchedulerSpec,
    SimSequence,
    TokenEvent,
    block_hashes,
    filler_text,
    num_prompt_tokens,
    render_chat,
    render_completion,
)


@dataclass(frozen=True)
class SimReplicaConfig:
    model: str = "sim-model"
    adapters: tuple[str, ...] = ()
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    failure: FailureSpec = field(default_factory=FailureSpec)
    default_max_tokens: int = 16
    # A prompt plus max_tokens past this is refused with 400, as vLLM refuses one past max_model_len; without
    # it, a request asking for 10**30 tokens kept a batch slot for good.
    max_model_len_tokens: int = 131_072
    max_loras: int = 8  # only reported in vllm:lora_requests_info
    # KV-events mode (module docstring): count and hash prompts with this directory's tokenizer (a model
    # directory holding tokenizer.json) as a kvgate engine does...
    tokenizer_dir: str | None = None
    # ...and serve the replica-state protocol on this gRPC port (0: a free one). Needs tokenizer_dir.
    grpc_port: int | None = None
    # Export vllm:cache_config_info (the KV size). False: a server that reports none, as far as a
    # gateway's index sizing goes (bench_routing.py --sim-no-kv-size).
    report_kv_size: bool = True

    def __post_init__(self) -> None:
        if self.grpc_port is not None and self.tokenizer_dir is None:
            raise ValueError("grpc_port needs tokenizer_dir: the state protocol's KV events and GetTokenizer "
                             "describe prompts tokenized as an engine does")


class _OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _error_response(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
            503: "ServiceUnavailableError"}.get(status, "Error")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


class SimEngine:
    """The scheduler loop: plans a step, sleeps its duration on the clock, delivers its tokens.

    `listeners` are called on the loop after every change of the scheduler's state (a request added,
    admitted, stepped, ended) with the KV events its cache recorded since the last call (see
    `record_kv_events`; empty without it)."""

    def __init__(self, spec: SchedulerSpec, clock: Clock, record_kv_events: bool = False) -> None:
        self.scheduler = Scheduler(spec, record_kv_events)
        self.clock = clock
        self.num_served = 0
        self.listeners: list[Callable[[Sequence[KVEvent]], None]] = []
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[TokenEvent]] = {}
        self._wake = asyncio.Event()

    def submit(self, name: str, num_tokens: int, hashes: tuple[int, ...], max_tokens: int,
               adapter: str | None = None) -> tuple[SimSequence, asyncio.Queue[TokenEvent]]:
        """Queue a prompt of `num_tokens` whose full blocks hash to `hashes` (chain order)."""
        seq = SimSequence(next(self._ids), name, num_tokens, hashes, max_tokens, adapter=adapter)
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[seq.seq_id] = queue
        self.scheduler.add(seq)
        self._wake.set()
        self._changed()
        return seq, queue

    def release(self, seq: SimSequence) -> None:
        """The request is done with `seq`: abort it if it had not finished (idempotent)."""
        self._queues.pop(seq.seq_id, None)
        if self.scheduler.abort(seq.seq_id):
            self._changed()

    def _changed(self) -> None:
        if not self.listeners:
            return
        events = self.scheduler.cache.drain_events()
        for listener in list(self.listeners):
            listener(events)

    async def run(self) -> None:
        # Steps are paced against an absolute deadline so sleep overshoot does not slow the model down.
        deadline = self.clock.now()
        while True:
            plan = self.scheduler.schedule()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = self.clock.now()
                continue
            self._changed()  # admitted sequences moved from waiting to running
            deadline = max(deadline, self.clock.now() - 0.05) + plan.duration_s
            await self.clock.sleep(deadline - self.clock.now())
            for event in self.scheduler.complete(plan):
                queue = self._queues.get(event.seq_id)
                if queue is not None:
                    queue.put_nowait(event)
            self._changed()


ENGINE_KEY = web.AppKey("sim_engine", SimEngine)
TOKENS_KEY = web.AppKey("sim_tokens", SimTokens)  # set in KV-events mode only
CONFIG_KEY = web.AppKey("sim_config", SimReplicaConfig)
FAILURE_KEY = web.AppKey("sim_failure", FailureState)
CLOCK_KEY = web.AppKey("sim_clock", Clock)


@dataclass(frozen=True)
class _Completion:
    """A validated inference request."""

    chat: bool
    name: str
    text: str
    max_tokens: int
    stream: bool
    include_usage: bool


def _parse(body: object, config: SimReplicaConfig, chat: bool) -> _Completion:
    if not isinstance(body, dict):
        raise _OpenAIError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise _OpenAIError(400, "'model' must be a string", "model")
    if name != config.model and name not in config.adapters:
        raise _OpenAIError(404, f"The model `{name}` does not exist.", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _OpenAIError(400, "'messages' must be a non-empty list of objects", "messages")
        text = render_chat(messages)
    else:
        if "prompt" not in body:
            raise _OpenAIError(400, "'prompt' is required", "prompt")
        text = render_completion(body["prompt"])
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _OpenAIError(400, "'max_tokens' must be a positive integer", "max_tokens")
    options = body.get("stream_options") or {}
    return _Completion(chat, name, text, max_tokens, bool(body.get("stream")),
                       bool(isinstance(options, dict) and options.get("include_usage")))


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    config, engine, clock = request.app[CONFIG_KEY], request.app[ENGINE_KEY], request.app[CLOCK_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error_response(400, "the request body is not valid JSON")
    try:
        req = _parse(body, config, chat)
    except _OpenAIError as e:
        return _error_response(e.status, str(e), e.param)
    tokens = request.app.get(TOKENS_KEY)
    adapter = None
    if tokens is None:
        num_tokens, hashes = num_prompt_tokens(req.text), block_hashes(req.text, req.name)
    else:
        adapter = req.name if req.name in config.adapters else None
        prompt = tokens.prompt(body, adapter)
        if prompt is None:
            return _error_response(400, "a kvgate engine does not take this prompt (a non-text content part, "
                                        "or a batch of several prompts)")
        num_tokens, hashes = prompt
    if num_tokens + req.max_tokens > config.max_model_len_tokens:
        return _error_response(400, f"This model's maximum context length is {config.max_model_len_tokens} tokens. "
                                    f"However, you requested {num_tokens + req.max_tokens} tokens ({num_tokens} in "
                                    f"the messages, {req.max_tokens} in the completion).", "max_tokens")
    failure = request.app[FAILURE_KEY]
    fail = failure.take()
    if fail is FailMode.REFUSE:
        drop_connection(request)
        return web.Response(status=503)  # never reaches the client
    if fail is FailMode.UNAVAILABLE:
        response = _error_response(503, "injected failure: replica unavailable")
        response.headers["Retry-After"] = "1"
        return response
    if fail is FailMode.ERROR500:
        return _error_response(500, "injected failure: internal server error")
    if fail is FailMode.STALL:
        await stall()
    if fail is FailMode.SLOW_FIRST_BYTE:
        await clock.sleep(failure.spec.slow_first_byte_s)
    die_after = failure.spec.die_after_chunks if fail is FailMode.DIE_MID_STREAM else None

    seq, queue = engine.submit(req.name, num_tokens, hashes, req.max_tokens, adapter)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-sim{seq.seq_id}"
    created = int(clock.wall())
    try:
        if req.stream:
            return await _stream(request, req, seq, _tokens(queue), ident, created, die_after)
        text = "".join([filler_text(event.index) async for event in _tokens(queue)])
        engine.num_served += 1
        payload = _full_response(req, seq, text, ident, created)
        if die_after is not None:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(json.dumps(payload).encode()[:20])
            drop_connection(request)
            return response
        return web.json_response(payload)
    finally:
        engine.release(seq)


async def _tokens(queue: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
    while True:
        event = await queue.get()
        yield event
        if event.finished:
            return


def _usage(seq: SimSequence) -> dict[str, object]:
    return {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_generated,
            "total_tokens": seq.num_prompt_tokens + seq.num_generated,
            "prompt_tokens_details": {"cached_tokens": seq.num_cached_tokens}}


def _full_response(req: _Completion, seq: SimSequence, text: str, ident: str, created: int) -> dict[str, object]:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": "length"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return {"id": ident, "object": obj, "created": created, "model": req.name, "choices": [choice],
            "usage": _usage(seq)}


def _chunk(req: _Completion, ident: str, created: int, text: str | None, finish: str | None) -> dict[str, object]:
    if req.chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": ident, "object": obj, "created": created, "model": req.name, "choices": [choice]}


async def _stream(request: web.Request, req: _Completion, seq: SimSequence, events: AsyncIterator[TokenEvent],
                  ident: str, created: int, die_after: int | None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    num_sent = 0

    async def send(payload: object) -> bool:
        """Write one SSE event; False once the injected death has dropped the connection."""
        nonlocal num_sent
        if die_after is not None and num_sent >= die_after:
            drop_connection(request)
            return False
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())
        num_sent += 1
        return True

    async for event in events:
        # Like vLLM and kvgate's engine, the role chunk goes out with the first token, after prefill.
        if req.chat and event.index == 0 and not await send(_chunk(req, ident, created, None, None)):
            return response
        finish = "length" if event.finished else None
        if not await send(_chunk(req, ident, created, filler_text(event.index), finish)):
            return response
    request.app[ENGINE_KEY].num_served += 1
    if req.include_usage:
        usage_chunk = _chunk(req, ident, created, "", None) | {"choices": [], "usage": _usage(seq)}
        if not await send(usage_chunk):
            return response
    if await send("[DONE]"):
        await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    config, clock = request.app[CONFIG_KEY], request.app[CLOCK_KEY]
    created = int(clock.wall())
    data = [{"id": config.model, "object": "model", "created": created, "owned_by": "kvgate-sim", "root": config.model,
             "parent": None}]
    data += [{"id": a, "object": "model", "created": created, "owned_by": "kvgate-sim", "root": a,
              "parent": config.model} for a in config.adapters]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    failure = request.app[FAILURE_KEY]
    if failure.active() and failure.spec.mode in HEALTH_FAILS:
        if failure.spec.mode is FailMode.REFUSE:
            drop_connection(request)
        elif failure.spec.mode is FailMode.STALL:
            await stall()
        return _error_response(503 if failure.spec.mode is not FailMode.ERROR500 else 500, "injected failure")
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    config, engine = request.app[CONFIG_KEY], request.app[ENGINE_KEY]
    sched = engine.scheduler
    label = f'{{model_name="{config.model}"}}'
    adapters = set(config.adapters)
    lines = []

    def metric(name: str, kind: str, value: float, labels: str = label) -> None:
        lines.extend([f"# TYPE {name} {kind}", f"{name}{labels} {value}"])

    metric("vllm:num_requests_running", "gauge", sched.num_running)
    metric("vllm:num_requests_waiting", "gauge", sched.num_waiting)
    metric("vllm:gpu_cache_usage_perc", "gauge", sched.kv_usage())
    metric("vllm:kv_cache_usage_perc", "gauge", sched.kv_usage())
    if config.report_kv_size:  # as vLLM does: the KV size, from which a gateway sizes its index of what it caches
        metric("vllm:cache_config_info", "gauge", 1.0,
               f'{{block_size="{BLOCK_SIZE_TOKENS}",num_gpu_blocks="{sched.cache.capacity_blocks}",'
               f'enable_prefix_caching="{sched.spec.prefix_caching}"}}')
    metric("vllm:prefix_cache_queries_total", "counter", sched.counters.num_prompt_tokens_queried)
    metric("vllm:prefix_cache_hits_total", "counter", sched.counters.num_prompt_tokens_hit)
    metric("vllm:prompt_tokens_total", "counter", sched.counters.num_prompt_tokens_queried)
    metric("vllm:generation_tokens_total", "counter", sched.counters.num_generation_tokens)
    running = ",".join(n for n in sched.running_names if n in adapters)
    waiting = ",".join(n for n in sched.waiting_names if n in adapters)
    metric("vllm:lora_requests_info", "gauge", request.app[CLOCK_KEY].wall(),
           f'{{max_lora="{config.max_loras}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}}')
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


async def _stats(request: web.Request) -> web.Response:
    engine, failure = request.app[ENGINE_KEY], request.app[FAILURE_KEY]
    sched = engine.scheduler
    c = sched.counters
    return web.json_response({
        "num_prompt_tokens_queried": c.num_prompt_tokens_queried,
        "num_prompt_tokens_hit": c.num_prompt_tokens_hit,
        "hit_rate": c.num_prompt_tokens_hit / c.num_prompt_tokens_queried if c.num_prompt_tokens_queried else 0.0,
        "num_generation_tokens": c.num_generation_tokens,
        "num_requests": sum(c.requests_by_name.values()),
        "num_served": engine.num_served,
        "num_aborted": c.num_aborted,
        "requests_by_model": dict(c.requests_by_name),
        "num_waiting": sched.num_waiting,
        "num_running": sched.num_running,
        "num_cached_blocks": len(sched.cache),
        "kv_usage": sched.kv_usage(),
        "fail_mode": failure.spec.mode.value,
        "num_failures_injected": failure.num_injected,
    })


async def _admin_fail(request: web.Request) -> web.Response:
    """Set the failure spec: {"mode": "error500", "fail_after_n": 3, ...}; omitted fields keep their value."""
    failure = request.app[FAILURE_KEY]
    try:
        body = await request.json()
        updates = {k: body[k] for k in ("fail_after_n", "slow_first_byte_s", "die_after_chunks") if k in body}
        if "mode" in body:
            updates["mode"] = FailMode(body["mode"])
        failure.set(replace(failure.spec, **updates))
    except (ValueError, TypeError, AttributeError) as e:
        allowed = ", ".join(m.value for m in FailMode)
        return _error_response(400, f"bad failure spec ({e}); modes: {allowed}")
    return web.json_response(asdict(failure.spec) | {"mode": failure.spec.mode.value})


def build_app(config: SimReplicaConfig, clock: Clock | None = None, tokens: SimTokens | None = None) -> web.Application:
    """The replica app. Its scheduler loop starts and stops with the app (cleanup_ctx).

    In KV-events mode (config.tokenizer_dir) `tokens` is that directory's tokenizer, loaded here when not
    given (several sims in one process share one). The gRPC service is started by `start_sim_replica`."""
    app = web.Application()
    app[CONFIG_KEY] = config
    app[CLOCK_KEY] = clock or RealClock()
    app[FAILURE_KEY] = FailureState(config.failure)
    if config.tokenizer_dir is not None:
        app[TOKENS_KEY] = tokens or SimTokens.load(config.tokenizer_dir)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        app[ENGINE_KEY] = SimEngine(config.scheduler, app[CLOCK_KEY], record_kv_events=config.grpc_port is not None)
        task = asyncio.create_task(app[ENGINE_KEY].run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/stats", _stats)
    app.router.add_post("/admin/fail", _admin_fail)
    return app


@dataclass
class SimReplicaServer:
    runner: web.AppRunner
    url: str  # http://host:port, no trailing slash
    state: SimStateService | None = None  # KV-events mode with a grpc_port: the replica-state service
    grpc_target: str | None = None  # host:port of `state`

    @property
    def engine(self) -> SimEngine:
        return self.runner.app[ENGINE_KEY]

    async def close(self) -> None:
        if self.state is not None:
            await self.state.stop()
        await self.runner.cleanup()


async def start_sim_replica(config: SimReplicaConfig, host: str = "127.0.0.1", port: int = 0,
                            clock: Clock | None = None, tokens: SimTokens | None = None) -> SimReplicaServer:
    """Serve a replica on a real socket (port 0: a free one). Client disconnects cancel their handlers.
    With config.grpc_port (0: a free one) it also serves the replica-state protocol (`grpc_target`);
    `tokens`: see `build_app`."""
    runner = web.AppRunner(build_app(config, clock, tokens), handler_cancellation=True, shutdown_timeout=0.5,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    server = SimReplicaServer(runner, f"http://{bound_host}:{bound_port}")
    if config.grpc_port is not None:
        app = runner.app
        sim_clock = app[CLOCK_KEY]
        try:
            server.state = await start_sim_state_service(
                app[ENGINE_KEY], app[TOKENS_KEY], host=host, port=config.grpc_port, replica_id=f"sim-{bound_port}",
                model=config.model, adapters=config.adapters, now_ns=lambda: int(sim_clock.wall() * 1e9))
        except BaseException:
            await runner.cleanup()
            raise
        server.grpc_target = f"{host}:{server.state.port}"
    return server


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SimReplicaConfig]:
    d_sched, d_fail = SchedulerSpec(), FailureSpec()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", action="append", default=[], help="a LoRA adapter name served too (repeatable)")
    p.add_argument("--kv-capacity-tokens", type=int, default=d_sched.kv_capacity_tokens)
    p.add_argument("--prefill-tokens-per-s", type=float, default=d_sched.prefill_tokens_per_s)
    p.add_argument("--decode-tokens-per-s", type=float, default=d_sched.decode_tokens_per_s)
    p.add_argument("--max-batch", type=int, default=d_sched.max_batch)
    p.add_argument("--max-prefill-tokens-per-step", type=int, default=d_sched.max_prefill_tokens_per_step)
    p.add_argument("--no-prefix-caching", action="store_true", help="keep nothing computed (every prompt misses)")
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--max-model-len-tokens", type=int, default=SimReplicaConfig.max_model_len_tokens,
                   help="a prompt plus max_tokens past this gets 400, as from vLLM (default: %(default)s)")
    p.add_argument("--fail", choices=[m.value for m in FailMode], default="none")
    p.add_argument("--fail-after-n", type=int, default=d_fail.fail_after_n)
    p.add_argument("--slow-first-byte-s", type=float, default=d_fail.slow_first_byte_s)
    p.add_argument("--die-after-chunks", type=int, default=d_fail.die_after_chunks)
    p.add_argument("--tokenizer-dir", default=None,
                   help="KV-events mode: count and hash prompts with this model directory's tokenizer as a kvgate "
                        "engine does (e.g. builtin:smollm2-135m's directory)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="with --tokenizer-dir: serve kvgate's replica-state protocol (WatchState with KV block "
                        "events, GetTokenizer) on this port")
    a = p.parse_args(argv)
    if a.grpc_port is not None and a.tokenizer_dir is None:
        p.error("--grpc-port needs --tokenizer-dir")
    config = SimReplicaConfig(
        model=a.model, adapters=tuple(a.adapter), default_max_tokens=a.default_max_tokens,
        max_model_len_tokens=a.max_model_len_tokens,
        scheduler=SchedulerSpec(a.kv_capacity_tokens, a.prefill_tokens_per_s, a.decode_tokens_per_s, a.max_batch,
                                a.max_prefill_tokens_per_step, not a.no_prefix_caching),
        failure=FailureSpec(FailMode(a.fail), a.fail_after_n, a.slow_first_byte_s, a.die_after_chunks),
        tokenizer_dir=a.tokenizer_dir, grpc_port=a.grpc_port)
    return a, config


async def _serve_forever(host: str, port: int, config: SimReplicaConfig) -> None:
    server = await start_sim_replica(config, host, port)
    grpc_note = f" (replica-state gRPC on {server.grpc_target})" if server.grpc_target else ""
    print(f"sim_replica serving {config.model} on {server.url}{grpc_note}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> None:
    args, config = _parse_args(argv)
    try:
        import uvloop
        uvloop.run(_serve_forever(args.host, args.port, config))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
