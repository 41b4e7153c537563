"""The engine on a GPU: exactness against Hugging Face and tokens/s, in one short run (< 10 min on one GPU).

    python loadtests/gpu_check.py                      # CUDA when present: every built-in model, fp32 and bf16
    python loadtests/gpu_check.py --device cpu --smoke # the same checks, small: what CI runs (tests/engine)

For each built-in model (`builtin:tiny-llama`, random weights; `builtin:smollm2-135m`, the trained one):
1. **Exactness**: prompts of 7, 33, 100 and 300 seeded token ids, 16 tokens greedy with EOS ignored, through
   kvgate's `LLM` and through `transformers`' `generate` on the same device and dtype. Reported: tokens that
   match before the first divergence, and the largest difference of the chosen tokens' log-probabilities over
   the matching steps. fp32 must match exactly in tokens and within --fp32-tolerance in log-probabilities; bf16
   is reported (rounding differs between kernels, so a divergence late in a sequence is expected).
2. **Throughput**: batch 1, 16 and 64 (smoke: 1 and 4), prompts of 256 new token ids (smoke: 32), 128 tokens
   generated (smoke: 8), with the prefix cache on and off; every run sends prompts no run sent before, so
   "on" measures the cost of caching, not reuse. Median of --repeats after one warm-up.

Prints a table, writes JSON (--json), exits 1 when an fp32 check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import make_prompts  # noqa: E402

PROMPT_LENGTHS = (7, 33, 100, 300)
CHECK_TOKENS = 16


def device_of(requested: str | None) -> str:
    import torch
    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("gpu_check: --device cuda, but torch sees no CUDA device")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    import platform
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads (torch {torch.__version__})"


def hf_reference(model_dir: Path, dtype: str, device: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens and the chosen tokens' log-probabilities, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    result = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_TOKENS,
                                 min_new_tokens=CHECK_TOKENS, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            # The raw logits: `scores` have min_new_tokens' EOS mask applied, which changes the normalisation.
            logprobs = [torch.log_softmax(logits[0].float(), dim=-1)[token].item()
                        for logits, token in zip(out.logits, tokens)]
            result.append((tokens, logprobs))
    del model
    return result


def check_model(model_dir: Path, dtype: str, device: str, vocab: int, tolerance: float) -> dict:
    from kvgate.engine import LLM, SamplingParams

    prompts = [make_prompts(vocab, 1, n, seed=n)[0] for n in PROMPT_LENGTHS]
    llm = LLM(str(model_dir), dtype=dtype, device=device, kv_cache_bytes=256 << 20, enable_prefix_caching=False)
    ours = llm.generate(prompts, SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True,
                                                logprobs=0))
    del llm
    reference = hf_reference(model_dir, dtype, device, prompts)
    matched, worst = [], 0.0
    for out, (tokens, logprobs) in zip(ours, reference):
        same = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), len(tokens))
        matched.append(same)
        for step in range(same):
            worst = max(worst, abs(out.logprobs[step].logprob - logprobs[step]))
    exact = all(m == CHECK_TOKENS for m in matched)
    ok = exact and worst <= tolerance if dtype == "float32" else True
    return {"dtype": dtype, "tokens_matched": matched, "of": CHECK_TOKENS, "max_logprob_diff": worst,
            "exact_tokens": exact, "ok": ok}


def throughput(model_dir: Path, dtype: str, device: str, vocab: int, batch: int, caching: bool, prompt_tokens: int,
               new_tokens: int, repeats: int) -> float:
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, device=device, kv_cache_bytes=1 << 30, max_num_seqs=max(16, batch),
              enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for run in range(-1, repeats):  # -1 warms up
        prompts = make_prompts(vocab, batch, prompt_tokens, seed=100_000 * batch + run + 1 + (7 if caching else 0))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        if run >= 0:
            times.append(time.perf_counter() - start)
        assert all(len(o.token_ids) == new_tokens for o in outs)
    del llm
    return batch * new_tokens / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when torch sees one)")
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2-135m"], help="built-in model names")
    parser.add_argument("--dtypes", nargs="+", help="default: float32 and bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--smoke", action="store_true", help="small batches and prompts: a CPU smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp32-tolerance", type=float, default=1e-3, help="largest log-probability difference")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)

    from kvgate.engine.builtin import resolve_model_source
    from kvgate.engine.config import load_model_config

    device = device_of(args.device)
    dtypes = args.dtypes or (["float32", "bfloat16"] if device.startswith("cuda") else ["float32"])
    batches, prompt_tokens, new_tokens = ((1, 4), 32, 8) if args.smoke else ((1, 16, 64), 256, 128)
    repeats = 1 if args.smoke else args.repeats
    started = time.perf_counter()
    print(f"device: {device_name(device)}", flush=True)
    report = {"device": device, "device_name": device_name(device), "date": time.strftime("%Y-%m-%d"),
              "checks": [], "throughput": []}
    for name in args.models:
        model_dir = resolve_model_source(f"builtin:{name}")
        vocab = load_model_config(model_dir).vocab_size
        for dtype in dtypes:
            check = {"model": name, **check_model(model_dir, dtype, device, vocab, args.fp32_tolerance)}
            report["checks"].append(check)
            print(f"{name:14} {dtype:9} vs HF: tokens matched {check['tokens_matched']} of {CHECK_TOKENS}, "
                  f"max |logprob diff| {check['max_logprob_diff']:.2e}  {'ok' if check['ok'] else 'FAILED'}",
                  flush=True)
            for batch in batches:
                for caching in (False, True):
                    rate = throughput(model_dir, dtype, device, vocab, batch, caching, prompt_tokens, new_tokens,
                                      repeats)
                    report["throughput"].append({"model": name, "dtype": dtype, "batch": batch,
                                                 "prefix_caching": caching, "tokens_per_s": rate})
                    print(f"{name:14} {dtype:9} batch {batch:3} prefix cache {'on ' if caching else 'off'}: "
                          f"{rate:9.1f} tok/s", flush=True)
    report["seconds"] = time.perf_counter() - started
    print(f"done in {report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print("wrote", args.json)
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
