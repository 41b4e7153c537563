"""HTTP server overhead: the same load through `kvgate engine` (OpenAI API over HTTP) and through the
in-process asyncio API (`AsyncLLM`), on the same engine settings.

Load: --requests requests, --concurrency at a time (default 16), each a fixed prompt of
--prompt-tokens token ids (deterministic, seeded, all different so the prefix cache does not help),
--max-tokens generated greedily with EOS ignored, each asking for the chosen token's logprob
(logprobs=0): then every token is one SSE event, as with a real model's text, whereas tiny-llama's
random bytes often hold a stream's text back to its end (an incomplete UTF-8 character), which would
make its time to first token meaningless. Three modes:

  async-api    AsyncLLM.generate in this process, one asyncio task per request
  http-stream  a `kvgate engine` child process, POST /v1/completions with stream=true (SSE), aiohttp client
  http-plain   the same process, stream=false

For each: output tokens/s over the wall time, request latency p50/p99 and time to first token p50/p99
(the client's view; for http-plain the first token arrives with the last). One warm-up round runs first.
Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_server.py                                  # builtin:tiny-llama
    .venv/bin/python loadtests/bench_server.py --model builtin:smollm2-135m --requests 64

The client shares the machine with the server: on a small CPU box, the HTTP modes also pay for the
client's own JSON and SSE parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import make_prompts, read_completion_stream, start_engine
WORK = REPO / "loadtests" / ".work"


@dataclass(frozen=True)
class Sample:
    latency_s: float
    ttft_s: float
    num_tokens: int


async def drive(one: Callable[[list[int]], Awaitable[Sample]], prompts: list[list[int]], concurrency: int
                ) -> tuple[float, list[Sample]]:
    """Run every prompt with at most `concurrency` in flight; returns (wall seconds, samples)."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(prompt: list[int]) -> Sample:
        async with gate:
            return await one(prompt)

    start = time.perf_counter()
    samples = await asyncio.gather(*(bounded(p) for p in prompts))
    return time.perf_counter() - start, list(samples)


def summarize(mode: str, wall_s: float, samples: list[Sample]) -> dict:
    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    latencies = [s.latency_s for s in samples]
    ttfts = [s.ttft_s for s in samples]
    tokens = sum(s.num_tokens for s in samples)
    return {"mode": mode, "requests": len(samples), "output_tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s, "latency_p50_s": pct(latencies, 50), "latency_p99_s": pct(latencies, 99),
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99)}


# ------------------------------------------------------------------------------------ in-process


async def bench_async_api(args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]) -> dict:
    from kvgate.engine import SamplingParams
    from kvgate.engine.async_llm import AsyncLLM
    from kvgate.engine.core import EngineConfig

    llm = await AsyncLLM.create(EngineConfig(model=args.model, kv_cache_bytes=args.kv_cache_bytes,
                                             max_num_seqs=args.max_num_seqs, cache_dir=args.cache_dir))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)

    async def one(prompt: list[int]) -> Sample:
        start = time.perf_counter()
        first = None
        count = 0
        async for _ in llm.generate(prompt, params):
            if first is None:
                first = time.perf_counter()
            count += 1
        return Sample(time.perf_counter() - start, first - start, count)

    try:
        await drive(one, warmup, args.concurrency)
        wall, samples = await drive(one, prompts, args.concurrency)
    finally:
        await llm.close()
    return summarize("async-api", wall, samples)


# ------------------------------------------------------------------------------------------ HTTP


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    options = ["--model", args.model, "--kv-cache-bytes", str(args.kv_cache_bytes), "--max-num-seqs",
               str(args.max_num_seqs), "--served-model-name", "bench", "--log-level", "warning"]
    if args.cache_dir:
        options += ["--cache-dir", str(args.cache_dir)]
    return start_engine(options, WORK / "bench_server-engine.log", REPO)


async def bench_http(args: argparse.Namespace, url: str, prompts: list[list[int]], warmup: list[list[int]],
                     stream: bool) -> dict:
    import aiohttp

    async def one(prompt: list[int]) -> Sample:
        body = {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        first = None
        async with session.post(url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            if not stream:
                data = await response.json()
                end = time.perf_counter()
                return Sample(end - start, end - start, data["usage"]["completion_tokens"])
            first, count = await read_completion_stream(response, time.perf_counter)
        return Sample(time.perf_counter() - start, first - start, count)

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await drive(one, warmup, args.concurrency)
        wall, samples = await drive(one, prompts, args.concurrency)
    return summarize("http-stream" if stream else "http-plain", wall, samples)


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    import uvloop

    from kvgate.engine.builtin import resolve_model_source
    from kvgate.engine.config import load_model_config
    from kvgate.engine.server.main import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("KVGATE_CACHE_DIR", REPO / ".kvgate-cache")))
    parser.add_argument("--json", type=Path, default=WORK / "bench_server.json")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    vocab = load_model_config(resolve_model_source(args.model, args.cache_dir)).vocab_size
    prompts = make_prompts(vocab, args.requests, args.prompt_tokens, seed=1)
    warmup = make_prompts(vocab, args.concurrency, args.prompt_tokens, seed=2)
    print(f"model {args.model}: {args.requests} requests, {args.concurrency} concurrent, prompts of "
          f"{args.prompt_tokens} tokens, {args.max_tokens} new tokens each, greedy", flush=True)

    rows = [uvloop.run(bench_async_api(args, prompts, warmup))]
    process, url = start_server(args)
    try:
        rows.append(uvloop.run(bench_http(args, url, prompts, warmup, stream=True)))
        rows.append(uvloop.run(bench_http(args, url, prompts, warmup, stream=False)))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

    base = rows[0]["tokens_per_s"]
    print(f"{'mode':12} {'tokens/s':>9} {'vs API':>7} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>9} {'ttft p99':>9}")
    for row in rows:
        print(f"{row['mode']:12} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / base:6.0%} "
              f"{row['latency_p50_s'] * 1000:6.0f}ms {row['latency_p99_s'] * 1000:6.0f}ms "
              f"{row['ttft_p50_s'] * 1000:7.0f}ms {row['ttft_p99_s'] * 1000:7.0f}ms")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": settings, "cpu_count": os.cpu_count(), "rows": rows}, indent=2))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
