"""`kvgate engine` / `python -m kvgate.engine`: one replica server process.

    kvgate engine --model builtin:smollm2-135m --port 8000 [--grpc-port 9000] [--adapter NAME=SOURCE ...]
                  [--adapter-root DIR|s3://bucket/prefix ...] [--insecure-open-adapters]
                  (the adapter endpoints' token: $KVGATE_ENGINE_ADMIN_TOKEN; see server/adapter_access.py)

Process wiring, the composition root of a replica: parse arguments into an EngineConfig and
ServerSettings, load the model, serve HTTP (aiohttp on uvloop, AppRunner for a controlled shutdown)
and, with --grpc-port, the replica-state stream. The real clock is chosen here and nowhere else.

Exit codes: 0 after a clean drain, 1 when the model cannot be loaded or the port cannot be bound, 2 for
bad arguments (argparse's convention). Neither prints a traceback: the message says what is wrong.

Drain: the first SIGTERM or SIGINT stops admitting requests (503 with Retry-After, /health 503) while
the listener stays open, waits up to --drain-timeout-s for the requests in flight to finish, aborts
what is left, then closes the listener and the engine. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import inspect
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from kvgate.engine.core import EngineConfig, start_runner_import
from kvgate.engine.server.adapter_access import AdapterAccess, access_for, adapter_root, startup_notice
from kvgate.server_log import MalformedRequestLog

log = logging.getLogger("kvgate.engine.server")

DTYPES = ("float32", "bfloat16", "float16", "auto")
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_STOP_GRACE_S = 5.0  # after the drain: how long aiohttp may take to flush the last responses



def served_name(args: argparse.Namespace) -> str:
    """The name clients put in `model` for the base model: --served-model-name, else the registry's name
    for a built-in (`builtin:smollm2-135m` -> `smollm2-135m`), else --model as given (vLLM's default)."""
    if args.served_model_name:
        return args.served_model_name
    return args.model.removeprefix("builtin:")


def model_aliases(args: argparse.Namespace) -> tuple[str, ...]:
    """Other names the base model answers to: --model as given, when it is not the served name."""
    return () if args.model == served_name(args) else (args.model,)


def parse_bytes(text: str) -> int:
    """'256MiB' -> 268435456; units B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 268435456, 256MiB or 1GiB; got {text!r}")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size; got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 (any free port) to 65535; got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0; got {text!r}")
    return value


def _adapter(text: str) -> tuple[str, str]:
    name, sep, source = text.partition("=")
    if not sep or not name or not source:
        raise argparse.ArgumentTypeError(f"expected NAME=SOURCE (e.g. sql=/adapters/sql-lora); got {text!r}")
    return name, source


def _adapter_root(text: str) -> str:
    try:
        return adapter_root(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    parser = argparse.ArgumentParser(
        prog="kvgate engine", description="Serve one model (and its LoRA adapters) over the OpenAI API.")
    parser.add_argument("--model", required=True, help="builtin:tiny-llama, builtin:smollm2-135m, a local "
                        "Hugging Face directory, or s3://BUCKET/PREFIX (fetched once with parallel ranged reads "
                        "into --cache-dir, keyed by the objects' ETags)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="HTTP port; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--grpc-port", type=_port, help="also serve the replica-state gRPC stream on this port")
    parser.add_argument("--served-model-name", help="the model name clients send (default: --model, without a builtin: prefix)")
    parser.add_argument("--replica-id", help="this replica's id in the state stream (default: HOST:PORT)")
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=defaults["kv_cache_bytes"],
                        help="KV-cache memory, e.g. 256MiB or 4GiB (default: 256MiB)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults["dtype"], help="(default: %(default)s)")
    parser.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    parser.add_argument("--max-model-len", type=_positive_int, help="longest prompt + completion, in tokens "
                        "(default: what the model and the KV cache allow)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=defaults["max_num_seqs"],
                        help="requests batched at once (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=defaults["max_num_batched_tokens"],
                        help="token budget of one engine step (default: %(default)s)")
    parser.add_argument("--max-loras", type=_non_negative_int,
                        help="LoRA adapters resident at once; 0 turns multi-LoRA off (default: 4)")
    parser.add_argument("--max-lora-rank", type=_positive_int, help="largest adapter rank (default: 16)")
    parser.add_argument("--adapter", type=_adapter, action="append", default=[], metavar="NAME=SOURCE",
                        help="register a LoRA adapter; repeat for more")
    parser.add_argument("--adapter-root", type=_adapter_root, action="append", default=[],
                        metavar="DIR|s3://BUCKET/PREFIX", help="where /v1/load_lora_adapter may load from; repeat "
                        "for more (default: only builtin: adapters and the --adapter sources)")
    parser.add_argument("--insecure-open-adapters", action="store_true",
                        help="open the adapter endpoints without a token on a non-loopback --host (default: they "
                        "need $KVGATE_ENGINE_ADMIN_TOKEN there, and are refused without it)")
    parser.add_argument("--s3-endpoint-url", help="S3 endpoint for s3:// models and adapters (default: "
                        "$KVGATE_S3_ENDPOINT_URL, $AWS_ENDPOINT_URL, else AWS's)")
    parser.add_argument("--attention-kernel", choices=("auto", "wait", "off"), default=defaults["attention_kernel"],
                        help="CPU decode attention through the compiled kernel: auto uses a cached build, or builds "
                        "one in the background (about 20 s, once per machine) and gathers KV blocks meanwhile; "
                        "wait builds before serving; off always gathers (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, help="where builtin models are built (default: "
                        "$KVGATE_CACHE_DIR or ~/.cache/kvgate)")
    parser.add_argument("--drain-timeout-s", type=_seconds, default=30.0,
                        help="on SIGTERM, how long in-flight requests may finish (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=parse_bytes, default=8 * 2**20,
                        help="largest request body (default: 8MiB)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="(default: %(default)s; debug adds an access log)")
    return parser


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The EngineConfig the arguments ask for; an invalid combination is a usage error (exit 2)."""
    values: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "device": args.device, "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "cache_dir": args.cache_dir, "attention_kernel": args.attention_kernel,
        # The router's prefix index follows the KV events of the state stream.
        "enable_kv_events": args.grpc_port is not None,
    }
    lora = {"max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "adapters": tuple(args.adapter) or None, "s3_endpoint_url": args.s3_endpoint_url}
    values.update({name: value for name, value in lora.items() if value is not None})
    try:
        return EngineConfig(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = engine_config(args, parser)
    if importlib.util.find_spec("torch") is None:  # a gateway-only install: say what to add, not a traceback
        print("kvgate engine: torch is not installed, and the engine needs it: pip install 'kvgate[engine]' "
              "(on a machine without CUDA, install torch's CPU build first)", file=sys.stderr)
        return 2
    start_runner_import()  # torch, on a thread, while the server and the model's files are set up
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return uvloop.run(serve(args, config))
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 130


async def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Load the model, serve until a signal, drain, and return the exit code."""
    phases = {"process": process_age_s()}  # interpreter start and kvgate's own imports, up to here
    from kvgate.engine.async_llm import AsyncLLM  # torch comes with the model runner: only once the arguments are good

    signals = _Signals(asyncio.get_running_loop())
    log.info("loading model %s", config.model)
    try:
        engine = await AsyncLLM.create(config)
        phases.update(engine.core.load_seconds)
    except Exception as exc:  # any load failure is the operator's to fix; the message says what
        log.debug("model load failed", exc_info=True)
        print(f"kvgate engine: cannot load model {config.model!r}: {exc}", file=sys.stderr)
        return 1
    try:
        if signals.stop.is_set():
            return 0
        return await _serve_engine(engine, args, signals, phases)
    finally:
        await engine.close()


async def _serve_engine(engine: Any, args: argparse.Namespace, signals: _Signals,
                        phases: dict[str, float | None]) -> int:
    """`phases`: the start-up so far (process, loading), for the start-up line once serving."""
    from kvgate.engine.server.app import build_app
    from kvgate.engine.server.context import CONTEXT, ServerSettings

    settings = ServerSettings(served_model_name=served_name(args), model_aliases=model_aliases(args),
                              max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout_s,
                              adapter_access=_adapter_access(args), now=time.monotonic, wall=time.time)
    app = build_app(engine, settings)
    lifecycle = app[CONTEXT].lifecycle
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, shutdown_timeout=_STOP_GRACE_S,
                           access_log=logging.getLogger("aiohttp.access") if args.log_level == "debug" else None,
                           logger=MalformedRequestLog(logging.getLogger("aiohttp.server"), settings.now))
    try:
        warm_started = time.perf_counter()
        await runner.setup()  # warms the engine up
        warm_up_s = time.perf_counter() - warm_started
    except Exception as exc:
        log.debug("warm-up failed", exc_info=True)
        print(f"kvgate engine: the warm-up generation failed: {exc!r}", file=sys.stderr)
        return 1
    lifecycle.ready = False  # /health says ready only once every port it was asked for is served
    state_service = None
    try:
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as exc:
            print(f"kvgate engine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        port = runner.addresses[0][1]
        if args.grpc_port is not None:
            try:
                state_service = await _start_state_service(engine, args, port, lambda: lifecycle.draining)
            except OSError as exc:
                print(f"kvgate engine: cannot serve the state stream on port {args.grpc_port}: {exc}",
                      file=sys.stderr)
                return 1
        lifecycle.ready = True
        log.info("kvgate engine ready: model %s on http://%s:%d", settings.served_model_name, args.host, port)
        phases = {**phases, "warm_up": warm_up_s}
        age = process_age_s()
        if age is not None:  # the rest: the HTTP app, its listener, the state stream, the event loop's turns
            phases["other"] = max(0.0, age - sum(s for s in phases.values() if s is not None))
        log.info("start-up: %s", startup_summary(phases, weight_bytes(engine.core.model_dir)))
        await signals.stop.wait()
        lifecycle.begin_drain()
        if state_service is not None and hasattr(state_service, "notify_changed"):
            state_service.notify_changed()
        log.info("draining: %d requests in flight, waiting up to %gs", lifecycle.num_in_flight,
                 settings.drain_timeout_s)
        idle = asyncio.ensure_future(lifecycle.wait_idle(settings.drain_timeout_s))
        forced = asyncio.ensure_future(signals.force.wait())
        await asyncio.wait({idle, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not (idle.done() and idle.result()):
            idle.cancel()
            log.warning("drain cut short: aborted %d requests in flight", await lifecycle.cancel_in_flight())
        return 0
    finally:
        if state_service is not None:
            await state_service.stop(1.0)
        await runner.cleanup()
        log.info("kvgate engine stopped")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def weight_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))


def startup_summary(phases: dict[str, float | None], weights: int) -> str:
    """One line: the phases' sum (with "other", the time since the process started), each phase in seconds,
    and the weights' read rate, e.g. `2.78 s: process 0.43, torch_import 0.00, source 0.00, tokenizer 0.41,
    build 0.01, weights 0.95 (538 MB, 0.57 GB/s), prepare 0.20, kv_cache 0.05, warm_up 0.06, other 0.67`."""
    known = {name: seconds for name, seconds in phases.items() if seconds is not None}
    parts = []
    for name, seconds in known.items():
        rate = f" ({weights / 1e6:.0f} MB, {weights / seconds / 1e9:.2f} GB/s)" if name == "weights" and seconds else ""
        parts.append(f"{name} {seconds:.2f}{rate}")
    return f"{sum(known.values()):.2f} s: " + ", ".join(parts)


def _adapter_access(args: argparse.Namespace) -> AdapterAccess:
    """The adapter endpoints' policy from the arguments and the environment (the token), said in the log."""
    access = access_for(host=args.host, environ=os.environ, insecure_open=args.insecure_open_adapters,
                        roots=tuple(args.adapter_root), startup_sources=tuple(source for _, source in args.adapter))
    notice = startup_notice(access, host=args.host, insecure_open=args.insecure_open_adapters)
    if notice is not None:
        log.log(*notice)
    return access


async def _start_state_service(engine: Any, args: argparse.Namespace, http_port: int, is_draining: Any) -> Any:
    if importlib.util.find_spec("kvgate.engine.state_service") is None:
        log.warning("--grpc-port: this engine build has no state service; not serving gRPC")
        return None
    from kvgate.engine.state_service import start_state_service

    replica_id = args.replica_id or f"{socket.gethostname()}:{http_port}"
    extra = {"is_draining": is_draining} if "is_draining" in inspect.signature(start_state_service).parameters else {}
    return await start_state_service(engine, host=args.host, port=args.grpc_port, replica_id=replica_id,
                                     model=served_name(args), **extra)


class _Signals:
    """SIGTERM/SIGINT: the first sets `stop` (drain), the second `force` (skip the drain wait)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            log.warning("%s again: stopping without waiting for requests in flight", sig.name)
            self.force.set()
        else:
            log.info("%s: draining", sig.name)
            self.stop.set()
