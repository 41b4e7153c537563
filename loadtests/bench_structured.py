"""What constrained decoding costs the engine: batch-16 decode with half the sequences held to a JSON schema,
against none constrained, in the same run, on the same prompts.

Each round runs 16 prompts of --prompt-tokens random token ids to --new-tokens new tokens (EOS ignored; the
schema asks for at least 200 array items, so no constrained sequence can end early) three ways: none
constrained, 8 of 16 constrained, all 16 constrained. Decode time per step is the time of a --new-tokens run
less the time of a 1-token run of the same prompts (the prefill), over --new-tokens - 1 steps; tokens/s counts
every sequence's tokens. Median of --repeats, every run on prompts no run sent before. Prints a table and
writes JSON.

    .venv/bin/python loadtests/bench_structured.py                    # SmolLM2-135M, fp32 and bf16
    .venv/bin/python loadtests/bench_structured.py --quick            # 1 repeat, 32 new tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.common import make_prompts  # noqa: E402

WORK = REPO / "loadtests" / ".work"
BATCH = 16
# A long array of small records: every constrained sequence stays inside it for the whole run.
SCHEMA = {"type": "object", "required": ["rows"], "additionalProperties": False, "properties": {
    "rows": {"type": "array", "minItems": 200, "items": {
        "type": "object", "required": ["id", "ok"], "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"}}}}}}
SHARES = (("none", 0), ("half", BATCH // 2), ("all", BATCH))


def run_once(llm, prompts: list[list[int]], params, constrained: int) -> float:
    """Seconds to generate for `prompts`, the first `constrained` of them under the schema."""
    from kvgate.engine.sequence import Constraint

    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    per_prompt = [dataclasses.replace(params, constraint=constraint) if i < constrained else params
                  for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, per_prompt)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == params.max_tokens for o in outs), "a sequence ended early"
    opening = '{"rows": ['
    for out in outs[:constrained]:  # held to the schema (a 1-token run has only begun it)
        assert out.text.startswith(opening) or opening.startswith(out.text), out.text[:40]
    return elapsed


def bench_dtype(model_dir: Path, dtype: str, vocab: int, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    from kvgate.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_cache_bytes=1 << 30, max_num_seqs=BATCH, enable_prefix_caching=False,
              attention_kernel="wait")
    full = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prefill = dataclasses.replace(full, max_tokens=1)
    seed = iter(range(1, 10_000))
    run_once(llm, make_prompts(vocab, BATCH, prompt_tokens, seed=next(seed)), full, BATCH)  # warm-up, compiles
    cells = {}
    for name, constrained in SHARES:
        decode_ms, total_s = [], []
        for _ in range(repeats):
            prompts = make_prompts(vocab, BATCH, prompt_tokens, seed=next(seed))
            whole = run_once(llm, prompts, full, constrained)
            first = run_once(llm, make_prompts(vocab, BATCH, prompt_tokens, seed=next(seed)), prefill, constrained)
            decode_ms.append((whole - first) / (new_tokens - 1) * 1000)
            total_s.append(whole)
        step = statistics.median(decode_ms)
        cells[name] = {"constrained": constrained, "decode_step_ms": step, "decode_tok_s": BATCH * 1000 / step,
                       "run_s": statistics.median(total_s), "runs_decode_step_ms": decode_ms}
    for cell in cells.values():
        cell["vs_none"] = cells["none"]["decode_step_ms"] / cell["decode_step_ms"]
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:NAME or an HF directory")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 32 new tokens")
    parser.add_argument("--json", default=str(WORK / "bench_structured.json"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, 32

    from kvgate.engine.builtin import resolve_model_source
    from kvgate.engine.config import load_model_config

    model_dir = resolve_model_source(args.model)
    vocab = load_model_config(model_dir).vocab_size
    print(f"model {args.model}; batch {BATCH}, prompts {args.prompt_tokens} tokens, {args.new_tokens} new, greedy; "
          f"median of {args.repeats}", flush=True)
    print("| dtype | constrained | decode step ms | decode tok/s | vs none |\n|---|---:|---:|---:|---:|")
    results = {}
    for dtype in args.dtypes:
        results[dtype] = cells = bench_dtype(model_dir, dtype, vocab, args.prompt_tokens, args.new_tokens,
                                             args.repeats)
        for name, cell in cells.items():
            print(f"| {dtype} | {cell['constrained']} of {BATCH} | {cell['decode_step_ms']:.1f} | "
                  f"{cell['decode_tok_s']:.0f} | {cell['vs_none']:.2f}x |", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d"),
                                           "schema": SCHEMA, "results": results}, indent=2))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
