"""Multi-LoRA throughput: one engine serving 16 concurrent sequences of the base model, of one adapter, and of
four adapters mixed in every batch, on the same prompts, greedy, EOS ignored.

The adapters are random PEFT adapters of rank 16 on all seven projections (q, k, v, o, gate, up, down) with
small weights, written once under loadtests/.work/lora-adapters/. All four fit the engine's slots
(max_loras 4), so the runs measure the forward pass, not loading. Modes: the base model, one adapter for
all streams, four adapters mixed evenly (4 streams each), and four mixed unevenly (7/4/3/2). Prefix
caching is off so every run computes everything. Each cell is the median of --repeats runs after a
warm-up; the modes are interleaved within each repeat so that a busy host slows them alike. A second table
times prefill alone (max_tokens 1). Target: four mixed adapters at most 1.3x the base model's time.
Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_lora.py                  # builtin:smollm2-135m, float32
    .venv/bin/python loadtests/bench_lora.py --quick          # fewer tokens, 1 repeat: a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORK = REPO / "loadtests" / ".work"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NUM_ADAPTERS = 4


def write_adapters(model_dir: Path, out: Path, rank: int) -> list[tuple[str, str]]:
    """NUM_ADAPTERS random PEFT adapters for the model in `model_dir` (idempotent); (name, directory) each."""
    import torch
    from safetensors.torch import save_file

    from kvgate.engine.config import load_model_config
    from kvgate.engine.lora.peft import projection_shape

    config = load_model_config(model_dir)
    adapters = []
    for index in range(NUM_ADAPTERS):
        directory = out / f"{model_dir.name}-r{rank}-{index}"
        adapters.append((f"lora{index}", str(directory)))
        if (directory / "adapter_model.safetensors").is_file():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, parent in MODULES.items():
                in_features, out_features = projection_shape(config, module)
                key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                # Small weights: the deltas nudge the output; what is measured is the compute.
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
        save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
            "bias": "none", "use_rslora": False}))
    return adapters


def uneven_mix(names: list[str], streams: int) -> list[str]:
    """The streams split 7:4:3:2 over four adapters, so decode steps have unequal rows per adapter (the
    runner's gathered layout) where the even mix has equal ones (its view layout)."""
    bounds = (7, 11, 14, 16)  # cumulative sixteenths
    return [names[next(k for k, b in enumerate(bounds) if i * 16 < b * streams)] for i in range(streams)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m", help="builtin:NAME or an HF directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, default=16, help="concurrent sequences")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 32 new tokens")
    parser.add_argument("--json", default=str(WORK / "bench_lora.json"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, 32

    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.builtin import resolve_model_source

    model_dir = resolve_model_source(args.model)
    adapters = write_adapters(model_dir, WORK / "lora-adapters", args.rank)
    llm = LLM(str(model_dir), dtype=args.dtype, kv_cache_bytes=1 << 30, max_num_seqs=max(16, args.streams),
              enable_prefix_caching=False, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, adapters=adapters)
    vocab = llm.core.runner.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    names = [name for name, _ in adapters]
    modes = {
        "base": [None] * args.streams,
        "1 adapter": [names[0]] * args.streams,
        f"{NUM_ADAPTERS} adapters mixed": [names[i % NUM_ADAPTERS] for i in range(args.streams)],
        f"{NUM_ADAPTERS} adapters uneven": uneven_mix(names, args.streams),
    }
    print(f"model {args.model} ({args.dtype}); {args.streams} streams; prompts {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new, greedy; adapters rank {args.rank} on {', '.join(MODULES)}", flush=True)

    tables = {}
    for phase, new_tokens in (("generate", args.new_tokens), ("prefill", 1)):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for mode_adapters in modes.values():  # warm-up
            llm.generate(prompts, params, adapter=mode_adapters)
        for _ in range(args.repeats):
            for mode, mode_adapters in modes.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, adapter=mode_adapters)
                times[mode].append(time.perf_counter() - start)
                assert all(len(o.token_ids) == new_tokens for o in outs)
        base = statistics.median(times["base"])
        tokens = args.streams * (new_tokens if phase == "generate" else args.prompt_tokens)
        tables[phase] = [{"mode": mode, "seconds": statistics.median(runs), "runs": runs,
                          "tokens_per_s": tokens / statistics.median(runs),
                          "slowdown": statistics.median(runs) / base} for mode, runs in times.items()]
        unit = "output tok/s" if phase == "generate" else "prompt tok/s"
        print(f"\n{phase} ({'all ' + str(new_tokens) + ' tokens' if phase == 'generate' else 'max_tokens 1'})")
        print(f"{'mode':22} {'seconds':>8} {unit:>13} {'vs base':>8}")
        for row in tables[phase]:
            print(f"{row['mode']:22} {row['seconds']:8.2f} {row['tokens_per_s']:13.1f} {row['slowdown']:7.2f}x")

    mixed = next(row["slowdown"] for row in tables["generate"] if row["mode"] == f"{NUM_ADAPTERS} adapters mixed")
    print(f"\n{NUM_ADAPTERS} adapters mixed vs base: {mixed:.2f}x (target <= 1.3x) -> "
          f"{'met' if mixed <= 1.3 else 'NOT met'}")
    stats = llm.core.stats()
    assert stats.num_adapter_evictions_total == 0, "all adapters should stay resident"
    WORK.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "tables": tables, "target_slowdown": 1.3,
                                           "met": mixed <= 1.3}, indent=2))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
