"""The gateway's endpoints: validate at the edge, then hand inference requests to the proxy.

Every refusal leaves as an OpenAI error object (`router.errors`), rendered once by `error_middleware`;
bad input is never a 500.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_urldispatcher import _default_expect_handler  # the 100 Continue itself; stable since aiohttp 2

from kvgate.openai_wire import ApiError, BodyWording, bad_request, error_response, parse_json_body
from kvgate.registry.schema import RoutingPolicy, TenantDoc
from kvgate.registry.snapshot import Snapshot, UnknownName
from kvgate.router.errors import model_not_found, no_capacity
from kvgate.router.fair_queue import Flow
from kvgate.router.flow_control import fair_queue_stats
from kvgate.router.features import build_route_request
from kvgate.router.membership import public_url
from kvgate.router.memory import install_memory_routes
from kvgate.router.dashboard import dashboard_page
from kvgate.router.app_keys import (CLOCK_KEY, DASHBOARD_KEY, DRAIN_KEY, GATES_KEY, METRICS_KEY, OPENINGS_KEY, PROXY_KEY, QUEUES_KEY,
                         FINISHED_KEY, REGISTRY_KEY, REQUEST_ID_KEY, SEQUENCE_KEY, SETTINGS_KEY, TENANTS_KEY,
                         TRACKER_KEY, ADMITTED_KEY, ANSWERED_KEY, LIMITER_KEY, METER_KEY)
from kvgate.router.policies import RoutingKnobs
from kvgate.router.prompt_tokens import PromptTokenizer, prompt_token_ids
from kvgate.router.metrics import TOKEN_KINDS, RouterMetrics
from kvgate.router.proxy import (REPLICA_HEADER, REQUEST_ID_HEADER, STREAM_OUTCOME_KEY, TOKENS_USED_KEY, USAGE_KEY,
                                ProxyRequest)
from kvgate.router.refusals import NO_MODEL, NO_TENANT, REFUSAL_MODEL_KEY, REFUSAL_TENANT_KEY, refusal_labels
from kvgate.router.request_caps import check_prompt_size, check_sampling_caps, completion_budget
from kvgate.router.tenants import PRIORITY_HEADER, flow_of, visible_names
from kvgate.router.upstream import header_safe
from kvgate.router.usage import answer_code, tenant_label

log = logging.getLogger("kvgate.router")
# Prompts longer than this (characters) are tokenized on a worker thread: 4,096 characters of new text take
# ~1-2 ms to encode, and the tokenizer releases the GIL meanwhile (kvgate.tokenizer), so the loop serves on.
TOKENIZE_INLINE_MAX_CHARS = 4_096
# Bodies larger than this are parsed, validated and cut into features on a worker thread: 8 MB of token ids
# take ~0.5 s of CPU. The thread holds the GIL too: json's C parser for all of its ~0.1 s, the Python that
# validates and hashes only a few milliseconds at a time, so the loop serves on through most of it.
OFF_LOOP_MIN_BYTES = 1 << 20
# The gateway's words for a body that is not a JSON object, as its clients have seen them.
_BODY_WORDING = BodyWording("the request body", "must be a JSON object, not {python_type}", "invalid_type")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return refuse(request, exc)
    except web.HTTPException as exc:  # unknown path, wrong method: still an OpenAI error object
        if exc.status < 400:
            raise
        return refuse(request, ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                                        type="NotFoundError" if exc.status == 404 else "BadRequestError"))
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return refuse(request, ApiError(500, "internal gateway error; see the gateway's log",
                                        type="InternalServerError", code="internal_error"))


def refuse(request: web.Request, error: ApiError) -> web.Response:
    """The gateway's own error answer, counted in `kvgate_router_refused_requests_total` (`router.refusals`)."""
    labels = refusal_labels(error, request.get(REFUSAL_MODEL_KEY, NO_MODEL), request.get(REFUSAL_TENANT_KEY, NO_TENANT))
    request.app[METRICS_KEY].refused_requests.labels(*labels).inc()
    return error_response(error)


async def tag_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every answer to an inference request, streamed, passed through or an error,
    carries its request id."""
    if REQUEST_ID_KEY in request:
        response.headers.setdefault(REQUEST_ID_HEADER, request[REQUEST_ID_KEY])
    if ADMITTED_KEY in request:  # a tenant's answer: what is left of its limits, as OpenAI's answers say
        for name, value in request[ADMITTED_KEY].headers.items():
            response.headers.setdefault(name, value)


def install_routes(app: web.Application) -> None:
    app.on_response_prepare.append(tag_request_id)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_within_limit)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_within_limit)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/stats", admin_stats)
    app.router.add_get("/admin/history", admin_history)
    install_memory_routes(app, app[CLOCK_KEY])  # /admin/memory: RSS and tracemalloc's sites (`router.memory`)
    app.router.add_get("/dashboard", dashboard)


def _snapshot(request: web.Request) -> Snapshot:
    return request.app[REGISTRY_KEY].current  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- inference


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=False)


async def expect_within_limit(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: a body its Content-Length puts over the limit is refused (413) before the client
    sends it, instead of a 100 Continue; anything else as aiohttp answers it."""
    refused = _declared_too_large(request)
    if refused is not None:  # an inference request answered before its handler runs: counted as one here
        request.app[METRICS_KEY].answers.labels(NO_MODEL, answer_code(None, refused)).inc()
        return refuse(request, refused)
    return await _default_expect_handler(request)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the gateway's limit of {limit} bytes",
                        type="RequestTooLargeError", code="request_too_large", close=True)


def _declared_too_large(request: web.Request) -> ApiError | None:
    """The 413 for a body whose Content-Length is over the limit, to answer before reading it; else None."""
    limit = request.app[SETTINGS_KEY].max_body_bytes
    return _too_large(limit) if request.content_length is not None and request.content_length > limit else None


async def _read_json(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    settings = request.app[SETTINGS_KEY]
    refused = _declared_too_large(request)
    if refused is not None:
        raise refused
    try:
        if request.content.is_eof():  # it came with the headers, as most do: no timer needed
            raw = await request.read()
        else:
            async with asyncio.timeout(settings.body_timeout_s or None):  # 0: no limit
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(settings.max_body_bytes) from exc
    except TimeoutError as exc:  # a stalled client, or a chunked body that broke after its first chunk
        raise ApiError(408, f"the request body did not arrive within {settings.body_timeout_s:g} s",
                           type="RequestTimeoutError", code="body_timeout", close=True) from exc
    except (BadHttpMessage, web.RequestPayloadError) as exc:  # a Content-Encoding that does not decode
        detail = str(exc).splitlines()[-1].strip()  # aiohttp's text: "400, message:\n  Can not decode ..."
        request.content.feed_eof()  # nothing more to read: else aiohttp reads on, meets it again and logs an ERROR
        raise ApiError(400, f"the request body could not be read: {detail}", type="BadRequestError",
                           code="invalid_body", close=True) from exc
    return raw, await _off_loop(len(raw), parse_json_body, raw, _BODY_WORDING)


async def _off_loop(body_bytes: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, on a worker thread for a body of OFF_LOOP_MIN_BYTES or more."""
    if body_bytes >= OFF_LOOP_MIN_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def validate_inference_body(body: dict[str, Any], chat: bool) -> str:
    """Check what routing needs (the engine checks the rest); returns the `model` field.
    Raises ApiError 400 naming the field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model",
                          "missing" if model is None else "invalid_type")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("'messages' is required and must be a non-empty list of message objects", "messages",
                              "missing" if messages is None else "invalid_type")
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise bad_request(f"messages[{i}] needs a 'role' string", f"messages[{i}].role",
                                  "missing" if "role" not in message else "invalid_type")
    elif "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt", "missing")
    elif not _is_prompt(body["prompt"]):
        raise bad_request("'prompt' must be a string, a list of strings, token ids, or a list of token-id lists",
                          "prompt", "invalid_type")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be true or false", "stream", "invalid_type")
    return model


def _is_prompt(prompt: object) -> bool:
    def token_ids(value: object) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if isinstance(prompt, str) or token_ids(prompt):
        return True
    return isinstance(prompt, list) and all(isinstance(p, str) or token_ids(p) for p in prompt)


async def _engine_token_ids(body: dict[str, Any], tokenizer: PromptTokenizer, chat: bool,
                            body_bytes: int) -> list[int] | None:
    """The prompt's tokens as its engines compute them (`prompt_tokens`); a long prompt (judged by the body's
    size, which bounds it) on a thread, so that the event loop, serving every stream, does not wait for the
    tokenizer."""
    try:
        if body_bytes > TOKENIZE_INLINE_MAX_CHARS:
            return await asyncio.to_thread(prompt_token_ids, body, tokenizer, chat)
        return prompt_token_ids(body, tokenizer, chat)
    except Exception:  # a template that trips on odd input: route on text; the engine answers the request itself
        log.debug("could not tokenize a prompt for KV-block routing; routing it on text", exc_info=True)
        return None


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    drain = request.app[DRAIN_KEY]
    error: BaseException | None = None
    try:
        if drain.draining:
            raise no_capacity("this gateway is shutting down; retry on another", retry_after_s=1, code="draining")
        drain.in_flight += 1
        try:
            return await _serve_inference(request, chat)
        finally:
            drain.in_flight -= 1
    except BaseException as exc:
        error = exc
        raise
    finally:
        # Every answer comes through `_forward`, which notes it as soon as it is whole: a client that left while its
        # limits were settled still had its answer.
        answered = request.get(ANSWERED_KEY)
        code = answer_code(answered, None if answered is not None else error)
        request.app[METRICS_KEY].answers.labels(request.get(REFUSAL_MODEL_KEY, NO_MODEL), code).inc()


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a usable one (1-128 printable ASCII characters), else a new one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(given) <= 128 and header_safe(given):
        return given
    return uuid.uuid4().hex


async def _serve_inference(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    request_id = request[REQUEST_ID_KEY] = _request_id(request)
    clock = app[CLOCK_KEY]
    arrived_at = clock.now()
    snapshot = _snapshot(request)
    tenant = _authenticate(request, snapshot)  # before reading the body: a stranger costs no parsing
    request[REFUSAL_TENANT_KEY] = tenant_label(tenant)
    flow = flow_of(tenant, request.headers.get(PRIORITY_HEADER))
    raw, body = await _read_json(request)
    name = await _off_loop(len(raw), validate_inference_body, body, chat)
    try:
        if tenant is not None and not tenant.spec.allows(name):  # answered as if it did not exist
            raise UnknownName("model or adapter", name, [])
        resolved = snapshot.resolve(name)
    except UnknownName:
        raise model_not_found(name, visible_names(snapshot, tenant)) from None
    model_doc, adapter = resolved.model, resolved.adapter
    model = model_doc.metadata.name
    request[REFUSAL_MODEL_KEY] = model
    check_sampling_caps(body, model, model_doc.spec)  # before any tokenizing: a refusal costs the least
    routing = model_doc.spec.routing
    sequence = app[SEQUENCE_KEY]
    sequence[model] += 1
    tracker = app[TRACKER_KEY]
    chain = tracker.kv_chain(model) if routing.policy is RoutingPolicy.CACHE_AWARE and routing.kv_events else None
    token_ids = await _engine_token_ids(body, chain.tokenizer, chat, len(raw)) if chain is not None else None
    try:
        route = await _off_loop(len(raw), build_route_request, body, model,
                                adapter.metadata.name if adapter else None, routing.prefix_chunk_chars,
                                sequence[model], chars_per_token=tracker.chars_per_token_of(model),
                                affinity_depth_chars=routing.affinity_depth_chars, token_ids=token_ids,
                                block_size_tokens=chain.block_size_tokens if chain is not None else 0,
                                chat=chat)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except RecursionError as exc:  # parsed, but too deep to render (the parser's reach is a little deeper)
        raise bad_request("the request body is nested too deeply", code="invalid_json") from exc
    check_prompt_size(route.num_prompt_chars, model, model_doc.spec, chat)
    if tenant is not None:  # last of the checks: a request refused for anything else takes nothing
        completion_tokens = completion_budget(body, model_doc.spec.max_tokens_cap)
        request[ADMITTED_KEY] = await app[LIMITER_KEY].admit(tenant, route.estimated_prompt_tokens,
                                                             completion_tokens)
    route = app[OPENINGS_KEY].stamp(route, routing.policy)
    app[DASHBOARD_KEY].note_request(model, route.estimated_prompt_tokens)
    queue_wait_s = model_doc.spec.scaling.max_queue_wait_s or app[SETTINGS_KEY].default_queue_wait_s
    # kvgate engines serve the base under its registry name and each adapter under its own, as do vLLM
    # and SGLang with --lora-modules, so the body goes upstream byte for byte.
    preq = ProxyRequest(path=request.path, body=raw, route=route, knobs=RoutingKnobs.from_routing(routing),
                        routing=routing, queue_wait_s=queue_wait_s, arrived_at=arrived_at, request_id=request_id)
    slo_ttft_ms = model_doc.spec.slo.ttft_ms
    fair = FairTerms(flow, slo_ttft_ms / 1000 if slo_ttft_ms else queue_wait_s) if routing.fair_queueing else None
    return await _forward(request, preq, tenant, name, fair)


@dataclass(frozen=True)
class FairTerms:
    """How a request waits while its model is saturated (`router.flow_control`)."""

    flow: Flow
    budget_s: float  # the most it may wait there: the model's TTFT SLO, else its queue wait


async def _forward(request: web.Request, preq: ProxyRequest, tenant: TenantDoc | None, name: str,
                   fair: FairTerms | None) -> web.StreamResponse:
    """Wait for a place while the model is saturated (`fair`), forward, and account for the answer: its usage,
    its tenant's limits settled, its place given to the next."""
    app, model = request.app, preq.route.model
    in_flight = app[METRICS_KEY].in_flight.labels(model)
    in_flight.inc()
    gate, permit, response = app[GATES_KEY].gate(model), None, None
    try:
        if fair is not None:
            permit = await gate.enter(fair.flow, fair.budget_s, preq.routing.max_queued_requests)
            app[METRICS_KEY].fair_dispatched.labels(model, fair.flow.tenant).inc()
            preq = replace(preq, on_first_token=functools.partial(gate.first_token, permit))
        with app[METER_KEY].metering(tenant, name, preq.request_id) as metered:  # its usage, however it ends
            response = metered.response = request[ANSWERED_KEY] = await app[PROXY_KEY].forward(request, preq)
        _count_answer(app[METRICS_KEY], preq, response, app[CLOCK_KEY].now())
        return response
    finally:
        if permit is not None:
            gate.leave(permit)
        in_flight.dec()
        if response is not None and REPLICA_HEADER in response.headers:  # a replica served it: with in_flight less
            app[FINISHED_KEY][model] += 1  # queued, Little's law's time in service for the autoscaler
        if ADMITTED_KEY in request:  # settled with the answer's usage, where it reported one; shielded, so that a
            used = response.get(TOKENS_USED_KEY) if response is not None else None  # client leaving now leaks no place
            await asyncio.shield(app[LIMITER_KEY].release(request[ADMITTED_KEY], used))


def _count_answer(metrics: RouterMetrics, preq: ProxyRequest, response: web.StreamResponse, now: float) -> None:
    """A replica's answer, relayed whole: its time end to end, and its tokens by model and adapter."""
    if response.status >= 300 or response.get(STREAM_OUTCOME_KEY, "success") != "success":
        return
    model, adapter = preq.route.model, preq.route.adapter or ""
    metrics.e2e_seconds.labels(model).observe(now - preq.arrived_at)
    usage = response.get(USAGE_KEY)
    if usage is not None:
        counts = (usage.prompt_tokens, usage.cached_tokens or 0, usage.completion_tokens)
        for kind, count in zip(TOKEN_KINDS, counts, strict=True):
            metrics.tokens.labels(model, adapter, kind).inc(count)


# ------------------------------------------------------------------------------------ the rest


def _authenticate(request: web.Request, snapshot: Snapshot) -> TenantDoc | None:
    """The request's tenant (`router.tenants`); None on an open gateway. Raises ApiError 401."""
    return request.app[TENANTS_KEY].authenticate(snapshot, request.headers.get("Authorization", ""))


async def list_models(request: web.Request) -> web.Response:
    """Every name the caller may use, OpenAI's list shape; an adapter's `parent` is its base model."""
    snapshot = _snapshot(request)
    tenant = _authenticate(request, snapshot)
    created = int(request.app[CLOCK_KEY].wall())
    shown = set(visible_names(snapshot, tenant))
    data = [{"id": name, "object": "model", "created": created, "owned_by": "kvgate", "root": name, "parent": None}
            for name in sorted(snapshot.models) if name in shown]
    # An adapter's base model is named only to a caller who may see it: listing an adapter must not reveal it.
    data += [{"id": name, "object": "model", "created": created, "owned_by": "kvgate", "root": name,
              "parent": doc.spec.base_model if doc.spec.base_model in shown else None}
             for name, doc in sorted(snapshot.adapters.items()) if name in shown]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Open to all (load balancers, probes). Ready replicas per model on an open gateway; once tenants are
    declared only their total, since a model's name is for the tenants that may use it."""
    snapshot = _snapshot(request)
    tracker = request.app[TRACKER_KEY]
    ready = {name: tracker.num_ready(name) for name in sorted(snapshot.models)}
    draining = request.app[DRAIN_KEY].draining
    body: dict[str, object] = {"status": "draining" if draining else "ok", "registry_version": snapshot.version}
    if snapshot.tenants:
        body["num_ready_total"] = sum(ready.values())
    else:
        body["num_ready"] = ready
    return web.json_response(body, status=503 if draining else 200)


async def metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    tracker = request.app[TRACKER_KEY]
    metrics.set_replica_counts(tracker.replica_counts())
    metrics.state_store_up.set(1 if tracker.store_reachable else 0)
    text, content_type = metrics.render()
    return web.Response(body=text, headers={"Content-Type": content_type})


async def admin_stats(request: web.Request) -> web.Response:
    """JSON for the dashboard: per model and per replica load, prefix figures, adapters, outcomes,
    and the last ~100 routing decisions. Behind the admin token when one is set (`router.operator_access`)."""
    app = request.app
    snapshot, tracker, proxy, queues = _snapshot(request), app[TRACKER_KEY], app[PROXY_KEY], app[QUEUES_KEY]
    models = {}
    for name, doc in sorted(snapshot.models.items()):
        replicas = []
        for state in tracker.view(name).replicas:
            if state.model != name:
                continue
            index, exact = tracker.cache_index(state.replica_id)
            prefix = index.stats() if index is not None else None
            fill = index.cache_fill() if index is not None else None  # the working set the cost weighs
            replicas.append({
                # Its URL without user part or query (either may hold credentials): which server an id is, for
                # operators; behind the admin token when one is set, yet never worth a secret.
                "replica_id": state.replica_id, "url": public_url(state.url), "healthy": state.healthy,
                "draining": state.draining, "in_flight": state.in_flight, "load": state.load,
                "unlisted_s": tracker.unlisted_for_s(state.replica_id),  # kept though its membership lapsed
                "num_waiting": state.num_waiting, "num_running": state.num_running,
                "kv_blocks_free": state.kv_blocks_free, "kv_blocks_total": state.kv_blocks_total,
                "adapters_loaded": sorted(state.adapters_loaded),
                "prefix_source": "kv_events" if exact else "text",  # entries: KV blocks, else text chunks
                "prefix_caching": "on" if exact else tracker.prefix_caching(state.replica_id),
                "prefix_index_entries": prefix.num_entries if prefix else 0,
                "prefix_capacity_chunks": prefix.capacity_chunks if prefix else 0,
                "prefix_predicted_tokens_total": prefix.predicted_cached_tokens_total if prefix else 0,
                "prefix_realised_tokens_total": prefix.realised_cached_tokens_total if prefix else 0,
                "prefix_corrections_total": prefix.num_corrections_total if prefix else 0,
                "prefix_working_set_chunks": fill.reused_chunks if fill else None,  # None: unknown
                "outcomes": dict(proxy.outcomes_by_replica.get(state.replica_id, {})),
            })
        models[name] = {
            "policy": doc.spec.routing.policy.value,
            "routes_on": "kv_blocks" if doc.spec.routing.kv_events and tracker.kv_chain(name) is not None else "text",
            "adapters": [a.metadata.name for a in snapshot.adapters_of(name)],
            "num_ready": tracker.num_ready(name),
            "queue_depth": queues.depth(name),
            "in_flight": sum(r["in_flight"] for r in replicas),
            "fair_queue": fair_queue_stats(app[GATES_KEY].gate(name), tracker.capacity(name), app[CLOCK_KEY].now()),
            "replicas": replicas,
        }
    payload = {"registry_version": snapshot.version, "models": models,
               "recent_decisions": proxy.recent_decisions.as_json(),
               "usage": app[METER_KEY].totals()}  # per tenant and model since this gateway started
    return web.json_response(await app[DASHBOARD_KEY].extend_stats(payload))


async def admin_history(request: web.Request) -> web.Response:
    """The dashboard's time series (`router.stats_history.StatsHistory.series`), every range or the one
    `?range_s=` names (400 for one not offered); guarded as /admin/stats is."""
    history = request.app[DASHBOARD_KEY].history
    given = request.query.get("range_s")
    if given is None:
        return web.json_response(history.series())
    try:
        return web.json_response(history.series(range_s=float(given)))
    except ValueError:
        offered = ", ".join(f"{span:g}" for span in history.ranges_s)
        raise bad_request(f"range_s must be one of the history's ranges in seconds ({offered}), not {given!r}",
                          param="range_s") from None


async def dashboard(request: web.Request) -> web.Response:
    """The operator dashboard: one self-contained page that polls /admin/stats and /admin/history.
    Open to all (it holds no data); it asks for the admin token, or takes ?token=, when one is set."""
    return web.Response(text=dashboard_page(), content_type="text/html", headers={"Cache-Control": "no-cache"})
