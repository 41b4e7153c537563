"""The best offline schedule the simulator finds: the yardstick every policy's GPU-hours are read against.

It knows the whole trace, and is searched in two stages, every candidate run on the same simulator and nodes as
the policies it judges:

1. **A family of need curves.** `baselines.oracle_need` turns the trace's concurrency on unlimited replicas (the
   per-second peak, or its mean over 30 or 60 s) and its prefill work into replicas at a utilization u of a
   replica; for each curve a bisection finds the largest u (100%, 98%, ... 50%) whose run still meets the goal.
   Not past 100%: the curve's decode slowdown grows as its replicas fall (a replica's prefill share rises), so a
   curve at 150% needed more replicas than at 100% (Azure x10, 15 minutes: 36 at the peak against 27).
2. **Refinement, block by block.** The cheapest passing curve is then cut where its run has misses to spare: the
   scored trace is split into blocks of `REFINE_BLOCK_S`, and each block in turn tries one replica fewer, kept
   while the run still meets the goal for less (`refine`). So the goal's 1% of misses is spent where it saves
   replicas, not spread evenly as one utilization spreads it.

The result is the cheapest schedule found, not a proven optimum: the lower bound (`bound.py`) is the floor no
schedule can go under, and a test holds this search to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.autoscaler.sim.baselines import OraclePolicy, oracle_need
from kvgate.autoscaler.sim.records import RunResult

if TYPE_CHECKING:
    from kvgate.autoscaler.sim.compare import Bench

ATTAINMENT_GOAL = 0.99
WINDOWS_S = (0, 30, 60)  # concurrency smoothing the search tries (0: the per-second peak)
UTILIZATIONS = tuple(round(1.0 - 0.02 * step, 2) for step in range(26))  # 100%, 98%, ... 50%
REFINE_BLOCK_S = 300.0  # a block's length: several cold starts, so a cut's queue stays mostly inside it
REFINE_MAX_RUNS = 12  # a bound on the refinement's simulations: one pass over an hour's blocks (on Azure x10 its
# gains came in the first 7 of 24 runs: 69.1 -> 67.6 GPU-h)


@dataclass(frozen=True)
class OracleTry:
    """One run of the search: a need curve, how it was made, and how it scored."""

    result: RunResult
    need: tuple[int, ...]  # replicas needed in each second of the (warmed-up) trace
    rule: str
    attainment: float  # the run's TTFT-SLO attainment


@dataclass(frozen=True)
class OracleSearch:
    """What the search kept: the cheapest run meeting the goal (or the best-attaining one, when none does) and its
    need curve, which also sets every policy's warm start and the static peak."""

    result: RunResult
    need: tuple[int, ...]
    rule: str


def search_oracle(bench: Bench, goal: float = ATTAINMENT_GOAL) -> OracleSearch:
    """The cheapest oracle run that meets `goal` (module docstring)."""
    best: OracleTry | None = None
    fallback: OracleTry | None = None  # the best attainment seen
    for window_s in WINDOWS_S:
        passing, failing = bisect_utilization(bench, window_s, goal)
        if failing is not None and (fallback is None or failing.attainment > fallback.attainment):
            fallback = failing
        if passing is not None and (best is None or passing.result.gpu_seconds < best.result.gpu_seconds):
            best = passing
    if best is not None:
        refined = refine(bench, best, goal)
        return OracleSearch(refined.result, refined.need, refined.rule)
    # Some requests cannot meet the SLO on any fleet (a prompt whose prefill alone is longer than the
    # SLO): keep the oracle's best try, and say so in its rule rather than refusing to compare.
    assert fallback is not None
    return OracleSearch(fallback.result, fallback.need,
                        f"{fallback.rule}; NOT meeting {goal:.0%} (best {fallback.attainment:.2%}: the SLO is out of "
                        "reach of the service model for some requests)")


def try_need(bench: Bench, need: tuple[int, ...], rule: str, *, look_ahead_s: float | None = None) -> OracleTry:
    """One oracle run on `need` (held to the fleet's limits), ordering each second's replicas one cold start ahead,
    or `look_ahead_s` ahead (0: a policy that knows the present exactly and not the future)."""
    need = tuple(min(bench.scaling.max_replicas, n) for n in need)
    ahead_s = bench.cold_start_s if look_ahead_s is None else look_ahead_s
    result = bench.run(bench.fleet_for(need), OraclePolicy(need, ahead_s, bench.scaling.min_replicas))
    return OracleTry(result, need, rule, result.attainment(bench.base.ttft_slo_s))


def bisect_utilization(bench: Bench, window_s: int, goal: float = ATTAINMENT_GOAL, *,
                       look_ahead_s: float | None = None) -> tuple[OracleTry | None, OracleTry | None]:
    """Bisect over utilization (attainment falls as utilization rises): the try at the highest that meets
    the goal, and the best-attaining try that did not (None where there is none). `look_ahead_s` as `try_need`'s."""
    curve = f"mean concurrency over {window_s} s" if window_s else "peak concurrency each second"
    low, high = 0, len(UTILIZATIONS) - 1
    passing: OracleTry | None = None
    failing: OracleTry | None = None
    while low <= high:
        middle = (low + high) // 2
        u = UTILIZATIONS[middle]
        need = oracle_need(bench.trace, bench.base.placements[0].service, u, window_s=window_s,
                           tail_s=bench.base.tail_s)
        tried = try_need(bench, need, f"{curve} / {u:.0%} of a replica", look_ahead_s=look_ahead_s)
        if tried.attainment >= goal:
            passing, high = tried, middle - 1
        else:
            low = middle + 1
            if failing is None or tried.attainment > failing.attainment:
                failing = tried
    return passing, failing


def refine(bench: Bench, start: OracleTry, goal: float = ATTAINMENT_GOAL) -> OracleTry:
    """`start` (meeting `goal`) cut block by block while the run still meets it (module docstring, stage 2).

    Coordinate descent: in each pass every block, those with the fewest misses first, tries one replica fewer
    in each of its seconds (never below one where the curve has any); a cut is kept when the run still meets the
    goal and costs less. Blocks interact (a cut's queue and late replicas spill into the next block: Azure x10,
    cutting one block by 10% added 1,127 misses to the block after it), so each cut is judged by a whole run,
    not by the misses of its own block.
    """
    blocks = _blocks(bench)
    if not blocks or start.attainment < goal:
        return start
    misses = blocks.misses(start.result, bench.base.ttft_slo_s)
    order = sorted(range(blocks.count), key=lambda b: misses[b])
    cuts = [0] * blocks.count
    best, runs, cut = start, 0, True
    while cut and runs < REFINE_MAX_RUNS:
        cut = False
        for block in order:
            trial = [c + (b == block) for b, c in enumerate(cuts)]
            need = blocks.cut(start.need, trial)
            if need == best.need or runs >= REFINE_MAX_RUNS:
                continue
            tried = try_need(bench, need, "")
            runs += 1
            if tried.attainment >= goal and tried.result.gpu_seconds < best.result.gpu_seconds:
                best, cuts, cut = tried, trial, True
    if best is start:
        return start
    return OracleTry(best.result, best.need, f"{start.rule}, then {sum(c > 0 for c in cuts)} of {blocks.count} "
                     f"blocks of {REFINE_BLOCK_S:g} s cut by {max(cuts)} replica(s) at most", best.attainment)


@dataclass(frozen=True)
class _Blocks:
    """The scored trace cut into blocks: which block each scored request and each second of the need curve is in."""

    count: int
    of_request: tuple[int, ...]  # per scored request, in the order of `RunResult.ttft_s`
    start_s: float  # where the scored part begins (the warm-up's end)

    def misses(self, result: RunResult, slo_s: float) -> list[int]:
        counts = [0] * self.count
        for block, ttft in zip(self.of_request, result.ttft_s):
            if not ttft <= slo_s:  # NaN (never served) is a miss
                counts[block] += 1
        return counts

    def cut(self, need: tuple[int, ...], cuts: Sequence[int]) -> tuple[int, ...]:
        """`need` with each scored second's replicas less its block's cut, never below one where it had any; the
        warm-up as it is."""
        out = list(need)
        for second in range(int(self.start_s), len(out)):
            block = min(self.count - 1, int((second - self.start_s) // REFINE_BLOCK_S))
            out[second] = max(min(1, need[second]), need[second] - cuts[block])
        return tuple(out)


def _blocks(bench: Bench) -> _Blocks | None:
    scored = [r.arrival_s for r in bench.trace.requests if r.arrival_s >= bench.warmup_s]
    if not scored:
        return None
    count = max(1, math.ceil((scored[-1] - bench.warmup_s + 1e-9) / REFINE_BLOCK_S))
    return _Blocks(count, tuple(min(count - 1, int((a - bench.warmup_s) // REFINE_BLOCK_S)) for a in scored),
                   bench.warmup_s)
