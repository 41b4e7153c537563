"""Routing-benchmark workloads: deterministic request lists (arrival time, model, messages, max_tokens).

Two generators, both pure and seeded, so every router in `bench_routing.py` sees byte-identical requests:

- `mooncake(...)`: a replay of `../shared/traces/mooncake_fast25_conversation_trace.jsonl`. Every hash id
  becomes a fixed pseudo-random paragraph seeded by the id, so equal ids give equal text and a request's
  hash chain gives a shared text prefix. Scaling: one trace block of 512 tokens becomes
  `block_chars` characters (default 128 = 32 simulated tokens at 4 chars/token, i.e. sizes / 16); the last
  block is cut to the request's remainder (input_length - 512 x (blocks - 1), scaled the same way);
  output lengths are scaled by the same factor and capped (`max_output_tokens`). Arrival times are
  the trace's milliseconds divided by `speedup`, with uniform jitter inside the trace's ~3 s buckets.
- `hot_prefix(...)`: bursts of ~100 near-simultaneous requests; in each burst 55% share one long system
  prompt (then a unique question), 30% are the next turn of one of 30 multi-turn conversations (each with
  its own system prompt and a growing history), 15% name one of four LoRA adapters (each adapter with
  its own system prompt).

`infinite_cache_hit_rate(...)` replays the prompts in arrival order through an unbounded prefix cache
with the simulated replica's own block hashing: the best hit rate any routing can reach.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from loadtests.sim_replica_model import BLOCK_SIZE_TOKENS, block_hashes, num_prompt_tokens, render_chat

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
TRACE_BUCKET_S = 3.0
ADAPTERS = ("lora-sql", "lora-chat", "lora-code", "lora-math")
_WORDS = ("alpha", "bravo", "cache", "delta", "echo", "fox", "gamma", "hotel", "index", "jolt", "kilo",
          "lima", "metro", "nova", "oscar", "prefix", "quartz", "radix", "sierra", "tango", "umbra", "vector",
          "whisky", "xenon", "yield", "zulu", "router", "replica", "token", "block")


@dataclass(frozen=True)
class Request:
    at_s: float  # arrival, seconds from the start of the replay
    model: str  # base model or adapter name
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    kind: str  # "trace", "hot", "conversation", "lora"

    def body(self) -> dict[str, object]:
        return {"model": self.model, "messages": list(self.messages), "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}

    def prompt_text(self) -> str:
        return render_chat(self.messages)


def paragraph(seed: object, num_chars: int) -> str:
    """`num_chars` characters of words drawn from a generator seeded by `seed`: same seed, same text."""
    rng = random.Random(f"kvgate-bench:{seed}")
    out: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(_WORDS) + " "
        out.append(word)
        size += len(word)
    return "".join(out)[:num_chars]


def mooncake(model: str, num_requests: int, speedup: float, block_chars: int = 128, max_output_tokens: int = 64,
             seed: int = 0, trace: Path = TRACE, max_blocks: int | None = None) -> list[Request]:
    """`max_blocks`: keep only a request's first N hash blocks (real engines have a maximum length)."""
    rng = random.Random(seed)
    scale = block_chars / TRACE_BLOCK_TOKENS  # characters per trace token
    requests = []
    with trace.open() as f:
        for i, line in enumerate(f):
            if i >= num_requests:
                break
            row = json.loads(line)
            ids = row["hash_ids"]
            if max_blocks is not None and len(ids) > max_blocks:
                parts = [paragraph(h, block_chars) for h in ids[:max_blocks]]  # cut: the tail block is full
            else:
                parts = [paragraph(h, block_chars) for h in ids[:-1]]
                remainder = row["input_length"] - TRACE_BLOCK_TOKENS * (len(ids) - 1)
                parts.append(paragraph(ids[-1], block_chars)[:max(4, round(remainder * scale))])
            at = (row["timestamp"] / 1000.0 + rng.uniform(0.0, TRACE_BUCKET_S)) / speedup
            max_tokens = max(1, min(max_output_tokens, round(row["output_length"] * scale / 4)))
            requests.append(Request(at, model, ({"role": "user", "content": "".join(parts)},), max_tokens, "trace"))
    requests.sort(key=lambda r: r.at_s)
    return requests


def hot_prefix(model: str, num_bursts: int, burst_gap_s: float, burst_size: int = 100, system_chars: int = 6000,
               num_conversations: int = 30, max_tokens: int = 16, seed: int = 0,
               text_scale: float = 1.0) -> list[Request]:
    """`text_scale` multiplies every text size (system prompts, questions, turns) for short-context engines."""
    rng = random.Random(seed)
    size = lambda chars: max(8, round(chars * text_scale))  # noqa: E731
    system = paragraph("hot-system", size(system_chars))
    conv_systems = [paragraph(f"conv-system-{c}", size(1200)) for c in range(num_conversations)]
    lora_systems = {a: paragraph(f"lora-system-{a}", size(3000)) for a in ADAPTERS}
    num_hot = round(burst_size * 0.55)
    num_conv = min(num_conversations, round(burst_size * 0.30))
    num_lora = burst_size - num_hot - num_conv
    requests = []
    for b in range(num_bursts):
        start = b * burst_gap_s
        jitter = lambda: start + rng.uniform(0.0, 0.05)  # noqa: E731 - ~100 requests within 50 ms
        for i in range(num_hot):
            question = paragraph(f"hot-q-{b}-{i}", size(200))
            msgs = ({"role": "system", "content": system}, {"role": "user", "content": question})
            requests.append(Request(jitter(), model, msgs, max_tokens, "hot"))
        for c in range(num_conv):
            msgs: list[dict[str, str]] = [{"role": "system", "content": conv_systems[c]}]
            for turn in range(b + 1):
                msgs.append({"role": "user", "content": paragraph(f"conv-{c}-user-{turn}", size(200))})
                if turn < b:
                    msgs.append({"role": "assistant", "content": paragraph(f"conv-{c}-reply-{turn}", size(160))})
            requests.append(Request(jitter(), model, tuple(msgs), max_tokens, "conversation"))
        for i in range(num_lora):
            adapter = ADAPTERS[i % len(ADAPTERS)]
            msgs = ({"role": "system", "content": lora_systems[adapter]},
                    {"role": "user", "content": paragraph(f"lora-q-{b}-{i}", size(200))})
            requests.append(Request(jitter(), adapter, msgs, max_tokens, "lora"))
    requests.sort(key=lambda r: r.at_s)
    return requests


def infinite_cache_hits(requests: list[Request]) -> list[tuple[int, int]]:
    """(prompt tokens, tokens hit) of each request, in arrival order, on one replica with an unbounded cache.

    Mirrors the simulated replica: 64-character blocks chained from the model (adapter) name, leading
    blocks only, never the prompt's last token.
    """
    seen: set[int] = set()
    out = []
    for r in requests:
        text = r.prompt_text()
        hashes = block_hashes(text, r.model)
        tokens = num_prompt_tokens(text)
        matchable = (tokens - 1) // BLOCK_SIZE_TOKENS
        n = 0
        for h in hashes[:matchable]:
            if h not in seen:
                break
            n += 1
        out.append((tokens, n * BLOCK_SIZE_TOKENS))
        seen.update(hashes)
    return out


def infinite_cache_hit_rate(requests: list[Request]) -> float:
    """Prompt-token hit rate of the requests on one replica with an unbounded cache: the best any
    routing can do (`infinite_cache_hits`)."""
    hits = infinite_cache_hits(requests)
    queried = sum(t for t, _ in hits)
    return sum(h for _, h in hits) / queried if queried else 0.0


def token_block_hashes(ids: list[int], name: str, block_tokens: int = 16) -> list[int]:
    """Chain hashes of the full `block_tokens` blocks of a token-id prompt, seeded by the model (adapter) name."""
    parent = xxhash.xxh3_64_intdigest(name.encode())
    hashes = []
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + repr(ids[start:start + block_tokens]).encode())
        hashes.append(parent)
    return hashes


def token_replay(requests: list[Request], encode: Callable[[Request], list[int]],
                 block_tokens: int = 16) -> dict[str, float]:
    """The best-possible replay for a real engine, and the sizes it needs.

    `encode` gives a request's prompt token ids (chat template applied). Like a paged prefix cache, only
    leading full blocks hit, never the prompt's last token. Returns the infinite-cache single-replica hit
    rate (`best_hit_rate`), `prompt_tokens`, `unique_tokens` (distinct blocks x block size),
    `prompt_tokens_max`, `chars_per_token` (prompt characters / prompt tokens) and `best_hit_rate_by_kind`.
    """
    seen: set[int] = set()
    queried = hit = chars = longest = 0
    by_kind: dict[str, list[int]] = {}  # kind -> [queried, hit]
    for r in requests:
        ids = encode(r)
        hashes = token_block_hashes(ids, r.model, block_tokens)
        n = 0
        for h in hashes[:(len(ids) - 1) // block_tokens]:
            if h not in seen:
                break
            n += 1
        queried += len(ids)
        hit += n * block_tokens
        kind = by_kind.setdefault(r.kind, [0, 0])
        kind[0] += len(ids)
        kind[1] += n * block_tokens
        chars += len(r.prompt_text())
        longest = max(longest, len(ids))
        seen.update(hashes)
    return {"best_hit_rate": hit / queried if queried else 0.0, "prompt_tokens": queried,
            "unique_tokens": len(seen) * block_tokens, "prompt_tokens_max": longest,
            "chars_per_token": chars / queried if queried else 0.0,
            "best_hit_rate_by_kind": {k: h / q if q else 0.0 for k, (q, h) in sorted(by_kind.items())}}


def summary(requests: list[Request]) -> dict[str, float]:
    """Sizes of a request list: prompt tokens (simulated, chars/4), unique cache blocks, span."""
    tokens = [num_prompt_tokens(r.prompt_text()) for r in requests]
    unique = set()
    for r in requests:
        unique.update(block_hashes(r.prompt_text(), r.model))
    span = max(r.at_s for r in requests) if requests else 0.0
    return {"num_requests": len(requests), "prompt_tokens": sum(tokens),
            "prompt_tokens_p50": sorted(tokens)[len(tokens) // 2] if tokens else 0,
            "prompt_tokens_max": max(tokens, default=0), "unique_blocks": len(unique),
            "unique_tokens": len(unique) * BLOCK_SIZE_TOKENS, "span_s": span,
            "output_tokens": sum(r.max_tokens for r in requests)}
