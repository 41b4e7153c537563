"""The replica's aiohttp application: routes, the error and admission middleware, readiness and drain.

    build_app(engine, settings) -> web.Application

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (serving.py), POST
/v1/load_lora_adapter, POST /v1/unload_lora_adapter (admin endpoints: token, loopback and source roots in
adapter_access.py), GET /health, GET /metrics.

Every error leaves as an OpenAI error object with its status (DESIGN.md "Conventions"): `ApiError`
from the protocol and serving layers, aiohttp's own HTTP errors (unknown route, wrong method), and
anything unexpected as a 500 that is logged. Admission is decided here too: while draining, every
request but /health and /metrics gets a 503 with Retry-After, and the requests already admitted are
tracked so the process can wait for them (see `Lifecycle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.sequence import SamplingParams
from kvgate.engine.server import serving
from kvgate.engine.server.adapter_access import allowed_source, check_caller
from kvgate.engine.server.context import CONTEXT, Lifecycle, ServerContext, ServerSettings
from kvgate.engine.server.metrics import CONTENT_TYPE, ServerMetrics
from kvgate.engine.server.protocol import parse_load_adapter_request, parse_unload_adapter_request
from kvgate.openai_wire import ApiError, bad_request, error_response

log = logging.getLogger("kvgate.engine.server")

_UNTRACKED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: answered while draining, not waited for


def build_app(engine: AsyncLLM, settings: ServerSettings) -> web.Application:
    """The replica's application over a running engine. The caller owns the engine (and closes it);
    the app owns its metrics registry and warms the engine up on startup."""
    app = web.Application(middlewares=[_errors_and_admission], client_max_size=settings.max_body_bytes)
    lifecycle = Lifecycle()
    metrics = ServerMetrics(lambda: engine.stats, lambda: lifecycle.draining)
    app[CONTEXT] = ServerContext(engine=engine, settings=settings, metrics=metrics, lifecycle=lifecycle)
    app.cleanup_ctx.append(_warm_up)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat_completions)
    app.router.add_post("/v1/load_lora_adapter", _load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", _unload_adapter)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


@web.middleware
async def _errors_and_admission(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
    lifecycle = request.app[CONTEXT].lifecycle
    try:
        if request.path in _UNTRACKED_PATHS:
            return await handler(request)
        if lifecycle.draining:
            return error_response(_draining_error(request.app[CONTEXT].settings))
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs every handler in a task
        lifecycle.admit(task)
        try:
            return await handler(request)
        finally:
            lifecycle.release(task)
    except ApiError as exc:
        return error_response(exc)
    except ConnectionResetError:  # the client left while its body was read: nobody to answer
        return web.Response(status=499, reason="Client Closed Request")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
        return error_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                                       type=kind.get(exc.status, "BadRequestError")))
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error; see the replica's log",
                                       type="InternalServerError", code="internal_error"))


def _draining_error(settings: ServerSettings) -> ApiError:
    return ApiError(503, "This replica is draining and accepts no new requests; retry on another replica",
                    type="ServiceUnavailableError", code="draining",
                    headers={"Retry-After": str(settings.retry_after_s)},
                    close=True)  # a client that keeps this connection would only get 503s here


async def _warm_up(app: web.Application) -> AsyncIterator[None]:
    """One tiny generation before the server reports ready: first-call allocations and kernel
    selection happen here rather than in a client's first request."""
    context = app[CONTEXT]
    if context.settings.warmup:
        prompt = context.encode_text("Hello") or [0]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in context.engine.generate(prompt, params):
            pass
    context.lifecycle.ready = True
    yield
    context.lifecycle.ready = False


# ------------------------------------------------------------------------------------ handlers


async def _models(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    created = int(context.settings.wall())
    base = {"id": context.model_name, "object": "model", "created": created, "owned_by": "kvgate",
            "root": context.model_root, "parent": None, "max_model_len": context.max_model_len}
    adapters = [{"id": name, "object": "model", "created": created, "owned_by": "kvgate", "root": name,
                 "parent": context.model_name} for name in context.adapter_names()]
    return web.json_response({"object": "list", "data": [base, *adapters]})


async def _health(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    if not context.engine.is_alive:
        return web.json_response({"status": "engine_stopped"}, status=503)
    if context.lifecycle.draining:
        return web.json_response({"status": "draining"}, status=503,
                                 headers={"Retry-After": str(context.settings.retry_after_s)})
    if not context.lifecycle.ready:
        return web.json_response({"status": "starting"}, status=503)
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _load_adapter(request: web.Request) -> web.Response:
    """401/403 before anything else (adapter_access.py), then 403 for a source under no root. A source that
    is allowed but cannot be loaded gets one 400 whatever the reason, naming the adapter and not the path
    (so it tells nobody what exists on the replica); the replica's log says why."""
    context = request.app[CONTEXT]
    access = context.settings.adapter_access
    check_caller(access, request.headers.get("Authorization"))
    load = getattr(context.engine, "load_adapter", None)
    if load is None:
        raise _lora_unsupported()
    name, source = parse_load_adapter_request(await serving.read_json(request))
    if name == context.model_name:
        raise bad_request(f"lora_name '{name}' is the base model's name; pick another", "lora_name")
    allowed = allowed_source(access, source)
    try:
        await load(name, allowed)
    except (ValueError, OSError) as exc:  # AdapterLoadError, a refusal of the name, a path the OS refuses
        log.warning("adapter %r could not be loaded from %r: %s", name, allowed, exc)
        raise bad_request(f"The lora adapter '{name}' could not be loaded: lora_path holds no adapter this replica "
                          f"can serve, or the name is in use with another source; the replica's log says why",
                          "lora_path", code="adapter_load_failed") from exc
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_adapter(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    check_caller(context.settings.adapter_access, request.headers.get("Authorization"))
    unload = getattr(context.engine, "unload_adapter", None)
    if unload is None:
        raise _lora_unsupported()
    name = parse_unload_adapter_request(await serving.read_json(request))
    if not await unload(name):
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError",
                       param="lora_name", code="adapter_not_found")
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _lora_unsupported() -> ApiError:
    return ApiError(501, "This engine build has no multi-LoRA support; adapters cannot be loaded or unloaded",
                    type="NotImplementedError", code="not_implemented")
