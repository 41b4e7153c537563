"""A lower bound on the GPU-hours any schedule of replicas needs to meet a TTFT-SLO attainment on a trace.

The oracle (`oracle.py`) is the cheapest perfect-foresight run the simulator finds: a good yardstick, but not a
bound, as a schedule it did not try may cost less. This module gives the bound: no policy, however it scales, spends fewer GPU-hours on the service model and meets the goal.

It is a linear programme over time buckets of `bucket_s` (HiGHS through scipy), a relaxation of every schedule:
replicas are fractional and may be anything when scoring starts, and each request's work is charged at the
cheapest placement. What it keeps of the fleet and the service model (`service.py`):
- at least `min_replicas` and at most `max_replicas` replicas at any time;
- a replica pays `start_cost_s` (its model load; node boot is left out, as a node may be up already) before it
  serves: each rise of the GPUs held from one bucket to the next costs that much more (averaging over buckets
  only hides starts, so this charges no more than a real schedule pays);
- a request meets the SLO only if its prefill ends within the SLO of its arrival, and a replica prefills one
  request at a time: over any window of buckets i..j, the prefill of the requests arriving in it that meet
  the SLO fits in the GPU-seconds of buckets i..j + ceil(SLO / bucket_s);
- a request holds one of its replica's `max_batch` slots from admission (at or after its arrival) for its
  prefill and decode: over a window i..j, the slot-time of those requests within `slot_horizon_s` of the SLO
  fits in the slot-capacity of buckets i..j + ceil((SLO + slot_horizon_s) / bucket_s); over the whole run,
  all of it up to the run's end fits in the run's slot-capacity;
- a request whose prefill alone takes longer than the SLO on the fastest placement never meets it;
- with block hashes (Mooncake), a prompt prefills at least what no earlier prompt shared of it
  (`traces.least_prefill_tokens`: one unlimited cache for all replicas), so the bound holds under any cache.
Which requests meet the SLO is the LP's choice, bucket by bucket: serving y of a bucket's n requests costs at
least the y cheapest (a convex curve the LP sees through tangent lines, each below it).

Worked: 1 GPU per replica prefilling 1,000 tokens/s, one request a second of 1,000 prompt tokens for 100 s, an
SLO of 2 s: every window of w seconds needs w s of prefill, so about 100 GPU-seconds (0.028 GPU-h) however
the schedule is shaped.

Windows longer than `max_window_s` are left out: fewer constraints, a lower (still valid) bound, a smaller LP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from kvgate.autoscaler.sim.service import Placement
from kvgate.autoscaler.sim.traces import Trace, least_prefill_tokens

TANGENTS_PER_BUCKET = 8  # tangent lines under each bucket's cost curve: more is tighter and larger


@dataclass(frozen=True)
class Bound:
    """The least GPU-hours (and the least USD, at the cheapest GPU-hour) of any schedule meeting `goal`; the
    GPU-hours count the replicas' model loads too, as the simulator charges them.

    `feasible` False: no schedule within the fleet's limits meets it; `reason` says why, and the numbers are
    NaN (there is nothing to compare a policy's cost with)."""

    goal: float
    gpu_hours: float
    cost_usd: float
    feasible: bool
    reason: str = ""


@dataclass(frozen=True)
class _Costs:
    """Each request's cheapest GPU-seconds: of prefill, of slot-time within the horizon, of slot-time to the
    run's end; and whether it can meet the SLO at all."""

    prefill: np.ndarray
    slot_window: np.ndarray
    slot_total: np.ndarray
    can_meet: np.ndarray


def _costs(trace: Trace, placements: Sequence[Placement], slo_s: float, slot_horizon_s: float,
           end_s: float) -> _Costs:
    arrival = np.array([r.arrival_s for r in trace.requests])
    tokens_in = np.array(least_prefill_tokens(trace), dtype=float)  # a prefix cache can only save prefill
    decode_tokens = np.array([max(0, r.output_tokens - 1) for r in trace.requests], dtype=float)
    inf = np.full(len(arrival), np.inf)
    prefill, slot_window, slot_total, fastest_prefill_s = inf.copy(), inf.copy(), inf.copy(), inf.copy()
    for p in placements:
        service = p.service
        prefill_s = tokens_in / service.prefill_tokens_per_s
        slot_s = prefill_s + decode_tokens * service.max_batch / service.decode_tokens_per_s
        per_slot = p.gpus / service.max_batch  # GPU-seconds a slot-second
        fastest_prefill_s = np.minimum(fastest_prefill_s, prefill_s)
        prefill = np.minimum(prefill, p.gpus * prefill_s)
        slot_window = np.minimum(slot_window, per_slot * np.minimum(slot_s, slot_horizon_s))
        slot_total = np.minimum(slot_total, per_slot * np.minimum(slot_s, np.maximum(end_s - arrival, 0.0)))
    return _Costs(prefill, slot_window, slot_total, fastest_prefill_s <= slo_s)


@dataclass
class _Rows:
    """Sparse rows of one kind (<= or ==): their coefficients as (row, column, value) triples, and right sides."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    rhs: list[float] = field(default_factory=list)

    def add(self, terms: Sequence[tuple[int, float]], rhs: float) -> None:
        row = len(self.rhs)
        for col, val in terms:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.rhs.append(rhs)

    def matrix(self, num_cols: int):  # -> scipy.sparse.csr_matrix
        return coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.rhs), num_cols)).tocsr()


class _Programme:
    """The LP's columns and rows, built row by row. Columns, a block of one per bucket each: G_k (GPUs held in
    bucket k), its rise from the bucket before, y_k (requests meeting the SLO), one cost per family (prefill, slot
    in window, slot in total), then the running sums of G and of each cost (windows read them as differences)."""

    def __init__(self, num_buckets: int) -> None:
        self.k = num_buckets
        self.num_cols = 0
        self.gpus = self._block()
        self.rise = self._block()  # how much G rose from the bucket before (0 for the first: free)
        self.met = self._block()
        self.cost = [self._block() for _ in range(3)]
        self.gpus_sum = self._block()
        self.cost_sum = [self._block() for _ in range(3)]
        self.upper = _Rows()  # <= rows
        self.equal_rows = _Rows()  # == rows

    def _block(self) -> int:
        start = self.num_cols
        self.num_cols += self.k
        return start

    def running_sum(self, sums: int, of: int) -> None:
        """sums_j = sums_{j-1} + of_j."""
        for j in range(self.k):
            terms = [(sums + j, 1.0), (of + j, -1.0)] + ([(sums + j - 1, -1.0)] if j else [])
            self.equal_rows.add(terms, 0.0)

    def window(self, sums: int, i: int, j: int) -> list[tuple[int, float]]:
        """sum over buckets i..j of the column summed in `sums` (clamped to the last bucket)."""
        j = min(j, self.k - 1)
        return [(sums + j, 1.0)] + ([(sums + i - 1, -1.0)] if i else [])


def _tangents(sorted_costs: np.ndarray) -> list[tuple[float, float, float]]:
    """Lines (slope, at_count, cost_there) under the convex cost of serving the y cheapest: at up to
    TANGENTS_PER_BUCKET evenly spaced counts m, cost(y) >= cost(m) + (y - m) x the (m+1)th cheapest."""
    n = len(sorted_costs)
    cumulative = np.concatenate(([0.0], np.cumsum(sorted_costs)))
    counts = sorted({int(round(x)) for x in np.linspace(0, n - 1, min(n, TANGENTS_PER_BUCKET))})
    return [(float(sorted_costs[m]), float(m), float(cumulative[m])) for m in counts]


def gpu_hours_lower_bound(trace: Trace, placements: Sequence[Placement], *, slo_s: float, goal: float,
                          max_replicas: int, tail_s: float, min_replicas: int = 0, start_cost_s: float = 0.0,
                          bucket_s: float = 10.0, max_window_s: float = 600.0, slot_horizon_s: float = 60.0) -> Bound:
    """The bound for `trace` (scored from its start; the fleet may be anything then) on `placements`."""
    if not trace.requests:
        return Bound(goal, 0.0, 0.0, True)
    end_s = trace.duration_s + tail_s
    k = max(1, math.ceil(end_s / bucket_s))
    costs = _costs(trace, placements, slo_s, slot_horizon_s, end_s)
    n_total = len(trace.requests)
    needed = math.ceil(goal * n_total - 1e-9)
    if int(costs.can_meet.sum()) < needed:
        return _infeasible(goal, f"{n_total - int(costs.can_meet.sum())} of {n_total} requests need longer than "
                                 f"the {slo_s:g} s SLO to prefill on the fastest placement")
    bucket = np.minimum((np.array([r.arrival_s for r in trace.requests]) // bucket_s).astype(int), k - 1)
    lp = _Programme(k)
    counts = np.zeros(k)
    for b in range(k):  # each bucket's cost curves, for the requests in it that can meet the SLO
        members = np.flatnonzero((bucket == b) & costs.can_meet)
        counts[b] = len(members)
        for family, per_request in enumerate((costs.prefill, costs.slot_window, costs.slot_total)):
            if not len(members):
                continue
            for slope, at, there in _tangents(np.sort(per_request[members])):
                # cost_b >= there + slope x (y_b - at)
                lp.upper.add([(lp.met + b, slope), (lp.cost[family] + b, -1.0)], slope * at - there)
    lp.running_sum(lp.gpus_sum, lp.gpus)
    for family in range(3):
        lp.running_sum(lp.cost_sum[family], lp.cost[family])
    slo_lag = math.ceil(slo_s / bucket_s)
    slot_lag = math.ceil((slo_s + slot_horizon_s) / bucket_s)
    longest = max(1, int(max_window_s // bucket_s))
    for i in range(k):
        for j in range(i, min(k, i + longest)):
            for family, lag in ((0, slo_lag), (1, slot_lag)):
                # the work of bucket i..j's met requests fits in the GPU-seconds of i..j + lag
                lp.upper.add(lp.window(lp.cost_sum[family], i, j)
                           + [(c, -bucket_s * v) for c, v in lp.window(lp.gpus_sum, i, j + lag)], 0.0)
    lp.upper.add(lp.window(lp.cost_sum[2], 0, k - 1)
               + [(c, -bucket_s * v) for c, v in lp.window(lp.gpus_sum, 0, k - 1)], 0.0)
    lp.upper.add([(lp.met + b, -1.0) for b in range(k)], -float(needed))
    for b in range(1, k):  # rise_b >= G_b - G_(b-1)
        lp.upper.add([(lp.gpus + b, 1.0), (lp.gpus + b - 1, -1.0), (lp.rise + b, -1.0)], 0.0)
    return _solve(lp, counts, placements, goal, (min_replicas, max_replicas), bucket_s, start_cost_s)


def _solve(lp: _Programme, counts: np.ndarray, placements: Sequence[Placement], goal: float,
           replicas: tuple[int, int], bucket_s: float, start_cost_s: float) -> Bound:
    objective = np.zeros(lp.num_cols)
    objective[lp.gpus:lp.gpus + lp.k] = bucket_s
    objective[lp.rise + 1:lp.rise + lp.k] = start_cost_s
    gpus = min(p.gpus for p in placements)  # a replica's GPUs (the model's: the same on every placement)
    bounds = [(0.0, None)] * lp.num_cols
    for b in range(lp.k):
        bounds[lp.gpus + b] = (float(replicas[0] * gpus), float(replicas[1] * max(p.gpus for p in placements)))
        bounds[lp.met + b] = (0.0, float(counts[b]))
    result = linprog(objective, A_ub=lp.upper.matrix(lp.num_cols), b_ub=lp.upper.rhs,
                     A_eq=lp.equal_rows.matrix(lp.num_cols), b_eq=lp.equal_rows.rhs, bounds=bounds, method="highs")
    if result.status == 2:
        return _infeasible(goal, f"no schedule of at most {replicas[1]} replicas (max_replicas) meets it")
    if result.status != 0:
        raise RuntimeError(f"the lower-bound LP did not solve: {result.message}")
    gpu_hours = result.fun / 3600.0
    cheapest = min(p.price_usd_per_hour / p.gpus for p in placements)
    return Bound(goal, gpu_hours, gpu_hours * cheapest, True)


def _infeasible(goal: float, reason: str) -> Bound:
    return Bound(goal, math.nan, math.nan, False, f"no schedule meets {goal:.2%}: {reason}")
