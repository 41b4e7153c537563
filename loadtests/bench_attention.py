"""Attention alone, over the paged KV cache: the compiled kernel (engine/runner/csrc/paged_attention.cpp)
against gathering each sequence's blocks and running SDPA (the path it replaces for decodes), side by side.

SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64, blocks of 16 tokens) and a 30-layer cache, every
layer attended in turn, so that keys and values come from memory as in a real step rather than from a cache
that one layer's few megabytes would fit in. Cells: decodes of 1, 16 and 64 sequences, a long decode, and
two prompt chunks (which the runner keeps on the gather path: the last column says why; in bfloat16 that path
attends a chunk with grouped batched products, not SDPA: `_grouped_chunk_attention`). Each cell is the
median of --repeats passes over the 30 layers; per layer in ms. Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_attention.py
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

import torch  # noqa: E402

from kvgate.engine.runner.attention import _chunk_attention, _decode_attention, build_step_metadata  # noqa: E402
from kvgate.engine.runner.kernels import KernelLoader  # noqa: E402
from kvgate.engine.runner.kv_cache import PagedKVCache  # noqa: E402
from kvgate.engine.sequence import ModelInput, ScheduledSeq  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
# (sequences, cached tokens before the step, new tokens per sequence)
CELLS = [(1, 271, 1), (16, 271, 1), (64, 271, 1), (16, 1099, 1), (1, 912, 112), (1, 512, 512)]


def cell(kernel, dtype: torch.dtype, seqs: int, start: int, new: int, repeats: int) -> dict:
    blocks_per_seq = -(-(start + new) // BLOCK)
    total = seqs * blocks_per_seq + 1
    cache = PagedKVCache(num_layers=LAYERS, num_blocks=total, block_size=BLOCK, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, dtype=dtype, device=torch.device("cpu"), initial_workspace_blocks=64)
    cache.kv.normal_()
    tables = torch.randperm(total)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq).contiguous()
    batch = ModelInput(seqs=tuple(
        ScheduledSeq(seq_id=i, token_ids=(1,) * new, start_pos=start, block_table=tuple(tables[i].tolist()),
                     sample=True, params=None, output_token_ids=()) for i in range(seqs)))
    meta = build_step_metadata(batch, block_size=BLOCK, num_kv_blocks=total, max_positions=1 << 20,
                               max_gather_blocks=cache.max_gather_blocks, device=torch.device("cpu"))
    query = torch.randn(seqs * new, HEADS, HEAD_DIM)
    fresh = torch.randn(new, KV_HEADS, HEAD_DIM)
    if new == 1:
        def gather(layer: int) -> torch.Tensor:
            return _decode_attention(layer, query, meta.decode, cache)
    else:
        def gather(layer: int) -> torch.Tensor:
            return _chunk_attention(layer, query, fresh, fresh, meta.prefills[0], cache)
    out = torch.empty(query.shape)
    query_start = torch.arange(seqs + 1) * new
    start_pos = torch.full((seqs,), start)

    def compiled(layer: int) -> None:
        kernel(out, query, cache.kv[layer], tables, query_start, start_pos, HEAD_DIM ** -0.5, 1)

    expected = gather(0).float()
    compiled(0)
    error = (expected - out).abs().max().item()
    times = {}
    for name, fn in (("gather_sdpa", gather), ("kernel", compiled)):
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            for layer in range(LAYERS):
                fn(layer)
            runs.append((time.perf_counter() - started) / LAYERS * 1e3)
        times[name] = statistics.median(runs)
    return {"dtype": str(dtype).removeprefix("torch."), "seqs": seqs, "cached": start, "new": new,
            "gather_sdpa_ms": times["gather_sdpa"], "kernel_ms": times["kernel"],
            "speedup": times["gather_sdpa"] / times["kernel"], "max_abs_diff": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=str(REPO / "loadtests" / ".work" / "bench_attention.json"))
    args = parser.parse_args()
    loader = KernelLoader("wait", torch.device("cpu"))
    if loader.paged_attention is None:
        print(f"the kernel is {loader.status}", file=sys.stderr)
        return 1
    print(f"torch threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"ms per layer, median of {args.repeats} passes over {LAYERS} layers", flush=True)
    print(f"{'dtype':9} {'seqs':>4} {'cached':>6} {'new':>4} {'gather+SDPA':>12} {'kernel':>8} {'speed-up':>9}")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for seqs, start, new in CELLS:
            row = cell(loader.paged_attention, dtype, seqs, start, new, args.repeats)
            rows.append(row)
            print(f"{row['dtype']:9} {seqs:4} {start:6} {new:4} {row['gather_sdpa_ms']:12.3f} "
                  f"{row['kernel_ms']:8.3f} {row['speedup']:8.2f}x", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows},
                                          indent=2))
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
