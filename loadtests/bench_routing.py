"""Routing benchmark: kvgate's policies vs sglang-router and vllm-router, same simulated replicas for all.

For each workload (`loadtests/workloads.py`: a scaled Mooncake conversation-trace replay, and a hot-prefix
burst workload with multi-turn conversations and a LoRA mix) and each replica count, every router is put
in front of N fresh simulated replicas (`loadtests/sim_replica.py`: LRU prefix cache + prefill/decode cost
model; restarted before every run so every router starts from cold caches) and the same requests are
replayed at their arrival times by an aiohttp client streaming chat completions. Per router: prompt-token
hit rate from the replicas' counters (/stats: hit / queried tokens), that rate over the infinite-cache
single-replica replay of the same prompts (the best any routing can do), mean / p50 / p99 time to first
token (first non-empty content chunk), throughput, max/mean requests per replica, failed requests.

Replica sizing, per workload and N (stated in the JSON): KV capacity per replica = `--kv-factor` x the
workload's unique prompt tokens / N (at the default 1.0 the cluster holds the working set once, a
replica 1/N of it: eviction matters unless the router partitions prefixes); prefill speed per replica = offered prompt tokens/s
(cold, no cache) / (N x `--load`), so at --load 1.0 the cluster is exactly busy without any cache hit
and a router's hit rate decides whether queues form; decode 50 tokens/s per sequence, batch 16.
Replicas run in min(N, 4) processes (N/4 replicas per process at N >= 16, on one event loop each),
because this box has 2 cores.

    .venv/bin/python loadtests/bench_routing.py --quick            # smoke run, < 2 minutes
    .venv/bin/python loadtests/bench_routing.py                    # both workloads, 4 and 16 replicas
    .venv/bin/python loadtests/bench_routing.py --replicas 4 16 64 --workloads hot_prefix
    .venv/bin/python loadtests/bench_routing.py --sim-kv-events --routers kvgate:cache_aware

--sim-kv-events puts the same sims in KV-events mode (`sim_state.py`): they tokenize with SmolLM2-135M's
tokenizer (~4.1 characters per token here, the sims' scale of 4) and speak kvgate's replica-state protocol,
so kvgate routes them on their KV block events, as it routes real engines (the run waits until it does and
records `routes_on`). Replicas are sized as without the flag (from the 4-characters-per-token summary); the
best hit rate is then the tokenized replay's (`token_replay` in the JSON). Peers see the same sims over HTTP.

Peers live in their own venvs under loadtests/.work/ (never in the project's dependencies):
    python3 -m venv loadtests/.work/sglang-router-venv && loadtests/.work/sglang-router-venv/bin/pip install sglang-router==0.3.2
    python3 -m venv loadtests/.work/vllm-router-venv && loadtests/.work/vllm-router-venv/bin/pip install vllm-router==0.1.17
A peer whose venv is missing is skipped (and said so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WORK = REPO / "loadtests" / ".work"
MODEL = "sim-llama"
# Real engines (--engines): tiny-llama's tokenizer makes ~1.2 characters per token (measured by the run and
# written to the JSON), and its maximum length is 1,024 tokens, so the workloads' texts are scaled down.
ENGINE_HOT_TEXT_SCALE = 1 / 8  # hot_prefix: 6,000-char system prompt -> 750 chars (~640 tokens)
ENGINE_BLOCK_CHARS = 16  # mooncake: one 512-token trace block -> 16 chars (~14 tokens), i.e. ~1/38
ENGINE_MAX_BLOCKS = 56  # mooncake: at most 56 trace blocks (896 chars) per prompt, under 1,024 tokens

from loadtests import workloads  # noqa: E402
from loadtests.common import percentile  # noqa: E402
from loadtests.routing_fleet import (  # noqa: E402,F401  (re-exported: callers of the old module keep working)
    ROUTERS,
    Fleet,
    free_ports,
    replica_counters,
    router_available,
    serve_sims,
    start_engine_fleet,
    start_fleet,
    start_router,
    stop_router,
    write_registry,
)

# -------------------------------------------------------------------------------------------- client


async def wait_ready(session, url: str, proc: subprocess.Popen, timeout_s: float = 60.0,
                     engines: bool = False) -> None:
    """Until one tiny chat request goes through the router (its few tokens are subtracted from the stats),
    and with `engines`, until a kvgate gateway routes on the engines' KV blocks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status == 200:
                    await r.read()
                    if not engines or await routes_on(session, url) != "text":  # tokenizer fetched, streams synced
                        return
        except Exception:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError("router not ready")


async def routes_on(session, url: str) -> str | None:
    """What a kvgate gateway routes MODEL on: "kv_blocks" (its engines' KV block events) or "text" (its own
    index); None for a peer router (no /admin/stats). A gateway in front of simulated replicas is on text."""
    try:
        async with session.get(url + "/admin/stats") as r:
            if r.status != 200:
                return None
            return (await r.json())["models"][MODEL].get("routes_on")
    except Exception:
        return None


async def one_request(session, url: str, req: workloads.Request, t0: float, timeout_s: float,
                      extra_body: dict | None = None) -> dict:
    """Send `req` at t0 + req.at_s and read its stream to the end. Never raises: failures are recorded.

    Besides TTFT and tokens: `streamed` (a 200 came back and at least one SSE event was read: a failure
    after that is "broken mid-stream", before it "failed before any streamed byte"), `error_event` (the
    stream carried an `error` object, as kvgate sends when an upstream breaks) and `replica` (the gateway's
    x-kvgate-replica header, None for peers)."""
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
    sent = time.perf_counter()
    ttft = None
    tokens = 0
    done = False
    error = None
    streamed = error_event = False
    replica = None
    usage = None
    body = req.body() if not extra_body else req.body() | extra_body
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            replica = r.headers.get("x-kvgate-replica")
            if r.status != 200:
                error = f"status {r.status}"
            else:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    streamed = True
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage") or usage
                    if "error" in chunk:
                        error_event = True
                        error = f"SSE error event: {str(chunk['error'])[:60]}"
                        continue
                    for choice in chunk.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            if ttft is None:
                                ttft = time.perf_counter() - sent
                            tokens += 1
                if not done:
                    error = "stream ended without [DONE]"
    except Exception as e:  # timeouts and dropped connections are failures, not crashes
        error = f"{type(e).__name__}: {e}"
    usage = usage or {}
    return {"ttft": ttft, "tokens": tokens, "ok": done and error is None, "error": error,
            "end": time.perf_counter(), "kind": req.kind, "sent": sent - t0, "streamed": streamed,
            "error_event": error_event, "replica": replica, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def router_decisions(session, url: str) -> dict[str, float]:
    """kvgate's `kvgate_router_decisions_total` by reason (empty for peers, or when unreadable)."""
    out: dict[str, float] = {}
    try:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    except Exception:
        return out
    for line in text.splitlines():
        if line.startswith("kvgate_router_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else labels
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def kv_events_off(fields: list[str]) -> bool:
    """Whether --set turns the registry's routing.kv_events off ("kv_events: false")."""
    return any(f.replace(" ", "").lower() == "kv_events:false" for f in fields)


async def replay(url: str, proc: subprocess.Popen, fleet: Fleet | list[str], reqs: list[workloads.Request],
                 timeout_s: float, extra_body: dict | None = None, kv_blocks: bool | None = None) -> dict:
    """`kv_blocks`: wait until kvgate routes on the replicas' KV blocks; default: when they stream them
    (engines, sims with KV events)."""
    import aiohttp

    if isinstance(fleet, list):
        fleet = Fleet([], fleet)
    if kv_blocks is None:
        kv_blocks = bool(fleet.grpc_targets)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await wait_ready(session, url, proc, engines=kv_blocks)
        before = await replica_counters(session, fleet)
        t0 = time.perf_counter() + 0.2
        results = await asyncio.gather(*(one_request(session, url, r, t0, timeout_s, extra_body) for r in reqs))
        after = await replica_counters(session, fleet)
        decisions = await router_decisions(session, url)
        on = await routes_on(session, url)
    return {**summarize(results, before, after, decisions, t0, len(reqs)), "routes_on": on}


def summarize(results: list[dict], before: list[dict | None], after: list[dict | None], decisions: dict,
              t0: float, num_requests: int) -> dict:
    """Per-run figures from the client's results and the replicas' counters before and after (a replica
    that no longer answers, i.e. was killed, counts nothing)."""
    pairs = [(a, b) for a, b in zip(after, before) if a is not None and b is not None]
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    queried = sum(a["num_prompt_tokens_queried"] - b["num_prompt_tokens_queried"] for a, b in pairs)
    hit = sum(a["num_prompt_tokens_hit"] - b["num_prompt_tokens_hit"] for a, b in pairs)
    loads = [a["num_requests"] - b["num_requests"] for a, b in pairs]
    end = max((r["end"] for r in results), default=t0)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = (r["error"] or "?")[:80]
            errors[key] = errors.get(key, 0) + 1

    mean_load = statistics.fmean(loads) if loads else 0.0
    by_kind: dict[str, dict[str, int]] = {}  # kind -> replica -> requests (kvgate names its replica)
    for r in results:
        if r["replica"] is not None:
            kind = by_kind.setdefault(r["kind"], {})
            kind[r["replica"]] = kind.get(r["replica"], 0) + 1
    usage_by_kind: dict[str, dict[str, float]] = {}  # from each response's usage, where it reports cached_tokens
    for r in results:
        if r.get("prompt_tokens") is not None and r.get("cached_tokens") is not None:
            kind = usage_by_kind.setdefault(r["kind"], {"prompt_tokens": 0, "cached_tokens": 0})
            kind["prompt_tokens"] += r["prompt_tokens"]
            kind["cached_tokens"] += r["cached_tokens"]
    for kind in usage_by_kind.values():
        kind["hit_rate"] = kind["cached_tokens"] / kind["prompt_tokens"] if kind["prompt_tokens"] else 0.0
    return {"num_requests": num_requests, "num_ok": len(ok), "num_failed": num_requests - len(ok), "errors": errors,
            "hit_rate": hit / queried if queried else 0.0, "prompt_tokens_queried": queried,
            "prompt_tokens_hit": hit,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "duration_s": end - t0,
            "throughput_rps": len(ok) / (end - t0), "output_tokens_per_s": sum(r["tokens"] for r in ok) / (end - t0),
            "router_decisions": decisions, "replica_loads": loads,
            "max_over_mean_load": max(loads) / mean_load if mean_load else None,
            "replica_requests_by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "usage_hit_rate_by_kind": dict(sorted(usage_by_kind.items()))}


# ------------------------------------------------------------------------------------------ the runs


def make_workload(name: str, quick: bool, args: argparse.Namespace) -> list[workloads.Request]:
    engines = getattr(args, "engines", False)
    if name == "mooncake":
        n = 300 if quick else args.mooncake_requests
        if engines:
            return workloads.mooncake(MODEL, n, args.speedup, block_chars=ENGINE_BLOCK_CHARS,
                                      max_blocks=ENGINE_MAX_BLOCKS)
        return workloads.mooncake(MODEL, n, args.speedup)
    bursts = 3 if quick else args.bursts
    return workloads.hot_prefix(MODEL, bursts, args.burst_gap_s, text_scale=ENGINE_HOT_TEXT_SCALE if engines else 1.0)


def engine_sizes(reqs: list[workloads.Request], n: int, kv_factor: float) -> dict:
    """For real engines: the tokenized replay (best hit rate, unique tokens, chars per token) and the KV size
    per replica, kv_factor x unique prompt tokens / n (as the sim mode), at least 2,048 tokens."""
    from kvgate.engine.builtin import resolve_model_source
    from kvgate.engine.config import load_model_config
    from kvgate.tokenizer import Tokenizer
    from loadtests.routing_fleet import CACHE_DIR, ENGINE_MODEL

    model_dir = resolve_model_source(ENGINE_MODEL, CACHE_DIR)
    tok = Tokenizer.from_dir(model_dir)
    cfg = load_model_config(model_dir)

    def encode(r: workloads.Request) -> list[int]:  # what the engine does with a chat request
        return tok.encode(tok.apply_chat_template(list(r.messages), add_generation_prompt=True),
                          add_special_tokens=False)

    replay_info = workloads.token_replay(reqs, encode, 16)
    kv_tokens = max(2048, int(kv_factor * replay_info["unique_tokens"] / n))
    kv_tokens = -(-kv_tokens // 16) * 16
    # float32 K and V for every layer and KV head
    bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    return replay_info | {"kv_tokens": kv_tokens, "kv_cache_bytes": kv_tokens * bytes_per_token,
                          "kv_bytes_per_token": bytes_per_token}


def sim_token_replay(reqs: list[workloads.Request]) -> dict[str, float]:
    """The best-possible replay of `reqs` on sims in KV-events mode: their tokenizer, their prompt tokens."""
    from kvgate.tokenizer import Tokenizer
    from loadtests.routing_fleet import sim_tokenizer_dir
    from kvgate.router.prompt_tokens import prompt_token_ids

    tokenizer = Tokenizer.from_dir(sim_tokenizer_dir())
    return workloads.token_replay(reqs, lambda r: prompt_token_ids(r.body(), tokenizer), 16)


def run_cell(workload: str, reqs: list[workloads.Request], n: int, routers: list[str],
             args: argparse.Namespace) -> dict:
    info = workloads.summary(reqs)
    engines = getattr(args, "engines", False)
    extra_body = None
    chunk_chars = 128
    if engines:  # real tokens, real KV bytes; the sim's chars/4 figures do not apply
        sizes = engine_sizes(reqs, n, args.kv_factor)
        best, kv_tokens = sizes["best_hit_rate"], sizes["kv_tokens"]
        info |= {"prompt_tokens": sizes["prompt_tokens"], "unique_tokens": sizes["unique_tokens"],
                 "prompt_tokens_max": sizes["prompt_tokens_max"], "chars_per_token": sizes["chars_per_token"]}
        # Random weights emit EOS at random: ignore it so every request streams its max_tokens.
        extra_body = {"ignore_eos": True, "temperature": 0}
        chunk_chars = 32  # ~27 tiny-llama tokens, under two engine KV blocks
        cell = {"workload": workload, "replicas": n, "mode": "engines", "workload_summary": info,
                "infinite_cache_hit_rate": best, "best_hit_rate_by_kind": sizes["best_hit_rate_by_kind"],
                "replica_kv_capacity_tokens": kv_tokens,
                "replica_kv_cache_bytes": sizes["kv_cache_bytes"], "prefix_chunk_chars": chunk_chars,
                "results": {}, "skipped": {}}
        print(f"\n== {workload}, {n} kvgate engines: {info['num_requests']} requests over {info['span_s']:.1f} s, "
              f"{info['prompt_tokens']} prompt tokens ({info['chars_per_token']:.2f} chars/token, longest "
              f"{info['prompt_tokens_max']}), {info['unique_tokens']} unique; infinite-cache hit rate {best:.3f}; "
              f"replica KV {kv_tokens} tokens ({sizes['kv_cache_bytes']} bytes)", flush=True)
    else:
        kv_events = getattr(args, "sim_kv_events", False)
        best = workloads.infinite_cache_hit_rate(reqs)
        kv_tokens = max(2048, int(args.kv_factor * info["unique_tokens"] / n))
        offered_tps = info["prompt_tokens"] / max(1.0, info["span_s"])
        prefill_tps = offered_tps / (n * args.load)
        cell = {"workload": workload, "replicas": n, "workload_summary": info, "infinite_cache_hit_rate": best,
                "replica_kv_capacity_tokens": kv_tokens, "replica_prefill_tokens_per_s": prefill_tps,
                "replica_decode_tokens_per_s": 50.0, "load": args.load, "results": {}, "skipped": {}}
        if kv_events:  # the sims count real tokens: the best is the tokenized replay's
            replay_info = sim_token_replay(reqs)
            best = replay_info["best_hit_rate"]
            cell |= {"mode": "sim-kv-events", "infinite_cache_hit_rate": best, "token_replay": replay_info,
                     "infinite_cache_hit_rate_chars": workloads.infinite_cache_hit_rate(reqs)}
        if getattr(args, "sim_no_kv_size", False):
            cell["mode"] = "sim-no-kv-size"
        print(f"\n== {workload}, {n} replicas{' (KV events)' if kv_events else ''}: {info['num_requests']} requests "
              f"over {info['span_s']:.1f} s, {info['prompt_tokens']} prompt tokens, {info['unique_tokens']} unique; "
              f"infinite-cache hit rate {best:.3f}; replica KV {kv_tokens} tokens, prefill {prefill_tps:.0f} tok/s",
              flush=True)
    for name in routers:
        why = router_available(name)
        if why:
            cell["skipped"][name] = why
            print(f"  {name}: skipped, {why}", flush=True)
            continue
        fleet = (start_engine_fleet(n, sizes["kv_cache_bytes"]) if engines else
                 start_fleet(n, kv_tokens, prefill_tps, kv_events=getattr(args, "sim_kv_events", False),
                             kv_size=not getattr(args, "sim_no_kv_size", False)))
        with tempfile.TemporaryDirectory() as tmp:
            log = WORK / f"bench_routing-{name.replace(':', '-')}.log"
            proc, url = start_router(name, fleet, Path(tmp), log, chunk_chars, ", ".join(args.set))
            try:
                res = asyncio.run(replay(url, proc, fleet, reqs, args.timeout_s, extra_body,
                                         kv_blocks=bool(fleet.grpc_targets) and not kv_events_off(args.set)))
            except Exception as e:
                res = None
                cell["skipped"][name] = f"run failed: {e} (log {log.relative_to(REPO)})"
                print(f"  {name}: run failed: {e}", flush=True)
            finally:
                stop_router(proc)
                fleet.stop()
        if res is not None:
            res["hit_rate_over_best"] = res["hit_rate"] / best if best else None
            cell["results"][name] = res
            print(f"  {name}: hit {res['hit_rate']:.3f}, p99 TTFT {res['ttft_p99_s']}, failed {res['num_failed']}"
                  f"{', decisions ' + str(res['router_decisions']) if res['router_decisions'] else ''}", flush=True)
            best_by_kind = cell.get("best_hit_rate_by_kind", {})
            if res["usage_hit_rate_by_kind"]:
                print("    hit by kind (responses' cached_tokens; best): " + ", ".join(
                    f"{kind} {v['hit_rate']:.3f}" + (f" ({best_by_kind[kind]:.3f})" if kind in best_by_kind else "")
                    for kind, v in res["usage_hit_rate_by_kind"].items()), flush=True)
    return cell


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(cell: dict) -> None:
    what = {"engines": "kvgate engines (tiny-llama)", "sim-kv-events": "simulated replicas with KV events",
            "sim-no-kv-size": "simulated replicas that report no KV size"}.get(
        cell.get("mode"), "simulated replicas")
    print(f"\n### {cell['workload']}, {cell['replicas']} {what} "
          f"(infinite-cache hit rate {cell['infinite_cache_hit_rate']:.3f})")
    print("| router:policy | hit rate | hit / best | TTFT mean ms | p50 ms | p99 ms | req/s | out tok/s "
          "| max/mean load | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in cell["results"].items():
        ms = lambda v: fmt(None if v is None else v * 1000, ".0f")  # noqa: E731
        print(f"| {name} | {r['hit_rate']:.3f} | {fmt(r['hit_rate_over_best'], '.3f')} | {ms(r['ttft_mean_s'])} "
              f"| {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {r['throughput_rps']:.1f} "
              f"| {r['output_tokens_per_s']:.0f} | {fmt(r['max_over_mean_load'], '.2f')} | {r['num_failed']} |")
    for name, why in cell["skipped"].items():
        print(f"| {name} | skipped: {why} |")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_sims"]:
        serve_sims(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 replicas, small workloads, 3 routers")
    p.add_argument("--workloads", nargs="+", default=["hot_prefix", "mooncake"], choices=["hot_prefix", "mooncake"])
    p.add_argument("--replicas", nargs="+", type=int, default=[4, 16])
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument("--mooncake-requests", type=int, default=1200, help="first N trace rows")
    p.add_argument("--speedup", type=float, default=8.0, help="trace time compression factor")
    p.add_argument("--bursts", type=int, default=8)
    p.add_argument("--burst-gap-s", type=float, default=2.0)
    p.add_argument("--kv-factor", type=float, default=1.0)
    p.add_argument("--load", type=float, default=1.0, help="offered cold prompt tokens / cluster prefill capacity")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per request; past it a request counts as failed")
    p.add_argument("--set", action="append", default=[], metavar="FIELD: VALUE",
                   help="a registry routing field for kvgate's routers, e.g. --set 'miss_cost_weight: 32' (repeatable)")
    p.add_argument("--engines", action="store_true",
                   help="real `kvgate engine` replicas on builtin:tiny-llama instead of simulated ones (texts scaled "
                        "down to its 1,024-token length; defaults: 4 replicas, 3 bursts, 800 trace rows at --speedup 16)")
    p.add_argument("--sim-kv-events", action="store_true",
                   help="simulated replicas in KV-events mode: they tokenize as a kvgate engine (SmolLM2-135M's "
                        "tokenizer) and stream their KV block events, so kvgate routes on them (see above)")
    p.add_argument("--sim-no-kv-size", action="store_true",
                   help="simulated replicas that do not export their KV size (vllm:cache_config_info), as a server "
                        "that reports none: kvgate's text index then has its default size")
    p.add_argument("--out", type=Path, default=WORK / "bench_routing.json")
    args = p.parse_args(argv)
    if args.sim_no_kv_size and (args.engines or args.sim_kv_events):
        p.error("--sim-no-kv-size is for simulated replicas on the text index (not --engines or --sim-kv-events)")
    if args.sim_kv_events and args.engines:
        p.error("--sim-kv-events is for simulated replicas; real engines (--engines) always stream KV events")
    if args.sim_kv_events and args.out == WORK / "bench_routing.json":
        args.out = WORK / ("bench_routing-sim-kv-quick.json" if args.quick else "bench_routing-sim-kv.json")
    if args.engines:
        given = set(argv)
        if "--replicas" not in given:
            args.replicas = [4]
        if "--bursts" not in given:
            args.bursts = 3
        if "--mooncake-requests" not in given:
            args.mooncake_requests = 800  # the trace's reuse builds up: its first 300 rows repeat little
        if "--speedup" not in given:
            args.speedup = 16.0
        if args.out == WORK / "bench_routing.json":
            args.out = WORK / "bench_routing-engines.json"
    if args.quick:
        args.replicas = [4]
        args.routers = ["kvgate:round_robin", "kvgate:cache_aware", "sglang:cache_aware"]
        if args.out in (WORK / "bench_routing.json", WORK / "bench_routing-engines.json"):
            args.out = WORK / ("bench_routing-engines-quick.json" if args.engines else "bench_routing-quick.json")
    WORK.mkdir(parents=True, exist_ok=True)
    cells = []
    for workload in args.workloads:
        reqs = make_workload(workload, args.quick, args)
        for n in args.replicas:
            cells.append(run_cell(workload, reqs, n, args.routers, args))
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": cells},
                                           indent=2))
    for cell in cells:
        print_table(cell)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
