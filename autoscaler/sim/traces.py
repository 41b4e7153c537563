"""Request traces for the simulator: the Azure LLM CSV, the Mooncake JSONL, and a bursty generator.

A `Trace` is an immutable list of `Request`s sorted by arrival time, starting at 0 s. Loaders raise
`TraceError` (file, line, what was wrong) for malformed input, never a bare traceback.

Two transforms change the load without changing the trace's shape:
- `compress_time(trace, factor)` divides every timestamp by `factor`: an hour plays in 60/factor
  minutes and the arrival rate goes up by `factor`.
- `scale_rate(trace, factor, seed)` keeps the timeline and multiplies the rate: each request is kept
  floor(factor) times plus once more with probability frac(factor) (thinning when factor < 1); copies
  are spread by a few milliseconds of seeded jitter so they are not simultaneous.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read: names the file, the line and what was wrong."""


@dataclass(frozen=True)
class Request:
    arrival_s: float  # seconds since the trace's first request
    input_tokens: int
    output_tokens: int
    # The prompt's blocks of `Trace.block_tokens` tokens as hash ids, in order (Mooncake's hash_ids): two prompts
    # sharing a first block share a prefix, the service model's prefix cache reuses it. () when the trace has none.
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]  # sorted by arrival_s, none before 0.0
    block_tokens: int = 0  # tokens a prompt block (`Request.blocks`) stands for; 0: no block hashes

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rps(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s > 0 else 0.0

    def slice(self, start_s: float, end_s: float) -> Trace:
        """The requests arriving in [start_s, end_s), shifted so the slice starts at 0."""
        kept = [r for r in self.requests if start_s <= r.arrival_s < end_s]
        return _from_unsorted(f"{self.name}[{start_s:g}:{end_s:g}]", kept, self.block_tokens)

    def next_block_id(self) -> int:
        """One past the largest block id: an offset that makes a copy's blocks its own."""
        return 1 + max((b for r in self.requests for b in r.blocks), default=-1)


def _from_unsorted(name: str, requests: list[Request], block_tokens: int = 0) -> Trace:
    requests.sort(key=lambda r: r.arrival_s)
    if not requests:
        return Trace(name, (), block_tokens)
    t0 = requests[0].arrival_s
    return Trace(name, tuple(replace(r, arrival_s=r.arrival_s - t0) for r in requests), block_tokens)


def least_prefill_tokens(trace: Trace) -> list[int]:
    """Each request's prompt tokens less the longest prefix of blocks any earlier request had: what it prefills at
    the least, with one cache of unlimited size shared by every replica. A trace without block hashes prefills
    its whole prompts. The lower bound and the oracle's need curve use it; a real replica's cache holds less."""
    if trace.block_tokens <= 0:
        return [r.input_tokens for r in trace.requests]
    seen: set[int] = set()
    tokens = []
    for request in trace.requests:
        held = 0
        for block in request.blocks:
            if block not in seen:
                break
            held += 1
        tokens.append(max(1, request.input_tokens - held * trace.block_tokens))
        seen.update(request.blocks)
    return tokens


def _offset_blocks(request: Request, offset: int) -> Request:
    return replace(request, blocks=tuple(b + offset for b in request.blocks)) if offset and request.blocks else request


def load_trace(path: str | Path) -> Trace:
    """Load by extension: `.csv` is the Azure format, `.jsonl` the Mooncake format."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.suffix == ".csv":
        return load_azure_csv(path)
    if path.suffix == ".jsonl":
        return load_mooncake_jsonl(path)
    raise TraceError(f"{path}: unknown trace format {path.suffix!r}; use an Azure .csv or a Mooncake .jsonl")


def load_azure_csv(path: str | Path) -> Trace:
    """Azure LLM inference trace 2023: columns TIMESTAMP (wall clock), ContextTokens, GeneratedTokens."""
    path = Path(path)
    requests: list[Request] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        needed = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not reader.fieldnames or not needed <= set(reader.fieldnames):
            raise TraceError(f"{path}:1: expected columns {sorted(needed)}, got {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            try:
                # Seven decimals (100 ns) is more than datetime parses; microseconds are plenty.
                stamp = row["TIMESTAMP"].strip()
                if "." in stamp:
                    head, frac = stamp.split(".", 1)
                    stamp = f"{head}.{frac[:6]}"
                arrival = datetime.fromisoformat(stamp).timestamp()
                requests.append(Request(arrival, _tokens(row["ContextTokens"]), _tokens(row["GeneratedTokens"])))
            except (ValueError, TypeError) as error:
                raise TraceError(f"{path}:{line}: {error}") from None
    return _from_unsorted(path.stem, requests)


MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake traces hash prompts in blocks of 512 tokens


def load_mooncake_jsonl(path: str | Path, *, seed: int = 0) -> Trace:
    """Mooncake FAST'25 trace: `timestamp` in ms, `input_length`, `output_length` and, where present, `hash_ids`
    (the prompt's 512-token blocks) per JSON line.

    Its timestamps are quantised to ~3 s buckets; requests sharing a timestamp are spread uniformly
    over the 3 s that follows (seeded), or they would all arrive in one instant.
    """
    path = Path(path)
    rng = random.Random(seed)
    requests: list[Request] = []
    with path.open() as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
                arrival = float(row["timestamp"]) / 1000.0 + rng.uniform(0.0, 3.0)
                blocks = tuple(int(b) for b in row.get("hash_ids", ()))
                requests.append(Request(arrival, _tokens(row["input_length"]), _tokens(row["output_length"]), blocks))
            except KeyError as error:
                raise TraceError(f"{path}:{line}: no field {error}; a Mooncake row has timestamp (ms), "
                                 "input_length and output_length") from None
            except (ValueError, TypeError) as error:
                raise TraceError(f"{path}:{line}: {type(error).__name__}: {error}") from None
    return _from_unsorted(path.stem, requests, MOONCAKE_BLOCK_TOKENS if any(r.blocks for r in requests) else 0)


def _tokens(value: object) -> int:
    count = int(value)  # type: ignore[call-overload]
    if count < 0:
        raise ValueError(f"negative token count {count}")
    return max(1, count)  # a request has at least one token each way; 0 would mean no work at all


def with_warmup(trace: Trace, warmup_s: float) -> Trace:
    """The trace preceded by its own first `warmup_s` seconds played backwards.

    A trace is a window cut out of continuous traffic, but a replay starts from an empty system: every
    window-based policy would first see no load and shed the fleet. The mirrored head gives the
    policies a history at the trace's own opening level and shape; the original starts at `warmup_s`
    (score from there: `simulate(..., score_from_s=warmup_s)`). The mirrored prompts' blocks are their own, so the
    warm-up leaves no cache the scored trace could not have built itself.
    """
    if warmup_s <= 0:
        return trace
    offset = trace.next_block_id()
    head = [_offset_blocks(replace(r, arrival_s=warmup_s - r.arrival_s), offset)
            for r in trace.requests if 0 < r.arrival_s < warmup_s]
    body = [replace(r, arrival_s=r.arrival_s + warmup_s) for r in trace.requests]
    return Trace(trace.name, tuple(sorted(head + body, key=lambda r: r.arrival_s)), trace.block_tokens)


def compress_time(trace: Trace, factor: float) -> Trace:
    """Play the trace `factor` times faster (factor 2: an hour in 30 minutes, twice the rate)."""
    if factor <= 0:
        raise TraceError(f"time compression must be > 0, got {factor}")
    return Trace(f"{trace.name}/t{factor:g}",
                 tuple(replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests), trace.block_tokens)


def scale_rate(trace: Trace, factor: float, *, seed: int = 0) -> Trace:
    """Multiply the arrival rate by `factor` on the same timeline (see the module docstring)."""
    if factor <= 0:
        raise TraceError(f"rate scale must be > 0, got {factor}")
    if factor == 1:
        return trace
    rng = random.Random(seed)
    whole, fraction = int(math.floor(factor)), factor - math.floor(factor)
    # The k-th copy of each request has the k-th copy of every block: copies share prefixes as the originals do
    # among themselves, not with each other (ten copies of one prompt would be nine free prefills).
    offset = trace.next_block_id()
    out: list[Request] = []
    for request in trace.requests:
        copies = whole + (1 if rng.random() < fraction else 0)
        for copy in range(copies):
            # Copies land within 50 ms of the original: same burst structure, no exact ties.
            jitter = 0.0 if copy == 0 else rng.uniform(0.0, 0.05)
            out.append(_offset_blocks(replace(request, arrival_s=request.arrival_s + jitter), copy * offset))
    return _from_unsorted(f"{trace.name}/x{factor:g}", out, trace.block_tokens)


@dataclass(frozen=True)
class BurstySpec:
    """A synthetic trace of long idle gaps and sudden spikes (the scale-to-zero and panic case).

    The trace alternates: quiet at `base_rps` (with probability `idle_fraction` a quiet phase is
    fully idle, 0 rps), then a spike at `spike_factor` x base_rps. Phase lengths are exponential
    with the given means. Sizes are drawn from lognormals with the given medians (Azure conv-like).
    """

    duration_s: float = 3600.0
    base_rps: float = 4.0
    spike_factor: float = 10.0
    mean_quiet_s: float = 600.0
    mean_spike_s: float = 300.0
    idle_fraction: float = 0.5
    median_input_tokens: int = 1020
    median_output_tokens: int = 129
    seed: int = 0


def bursty_trace(spec: BurstySpec = BurstySpec()) -> Trace:
    """Generate the bursty trace described by `spec` (deterministic for a given seed)."""
    rng = random.Random(spec.seed)
    requests: list[Request] = []
    t, spiking = 0.0, False
    while t < spec.duration_s:
        mean = spec.mean_spike_s if spiking else spec.mean_quiet_s
        end = min(spec.duration_s, t + rng.expovariate(1.0 / mean))
        if spiking:
            rate = spec.base_rps * spec.spike_factor
        else:
            rate = 0.0 if rng.random() < spec.idle_fraction else spec.base_rps
        if rate > 0:
            arrival = t + rng.expovariate(rate)
            while arrival < end:
                requests.append(Request(arrival, lognormal_tokens(rng, spec.median_input_tokens),
                                        lognormal_tokens(rng, spec.median_output_tokens)))
                arrival += rng.expovariate(rate)
        t, spiking = end, not spiking
    # Keep absolute times (no shift to 0): a trace that opens idle is part of the scenario.
    return Trace(f"bursty-seed{spec.seed}", tuple(requests))


def lognormal_tokens(rng: random.Random, median: int) -> int:
    # sigma 0.9 gives a p99/p50 of about 8, close to the Azure conversation trace (4,142 / 1,020 input).
    return max(1, int(rng.lognormvariate(math.log(median), 0.9)))
