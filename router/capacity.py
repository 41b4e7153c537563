"""What a model's replicas run at once, as the gateway's fair queuing needs it (`router.flow_control`): the
registry's `routing.max_in_flight_per_replica` when set, else learned from each replica's load reports.

A replica has shown its batch when it reports requests waiting while it runs the most it has been seen running,
in reports at least QUEUED_FOR_S apart with requests waiting throughout: it was given more than it runs, and runs
no more. Its capacity is then that many. One report is not enough: a request that arrived since the replica's
last step shows as waiting until the next one admits it (~50 ms later), and a light tenant's burst caught so held
a 16-request replica to 7 (`loadtests/bench_fair_share.py --lockstep`, quiet tenant alone: p99 1.0 s, not 0.2). Until it shows that (it has
queued only below its most, as when its KV cache was short, or it just ran more than ever before), and again for
one report every PROBE_EVERY_S, its capacity is one more: a gateway that held it to what it had seen would never
see a larger batch (a KV cache that frees up, a restart with a larger max_num_seqs), and one more keeps at most
one request waiting inside it. Why not always one more, as this once did: that one waits behind a full batch,
first come first served, and it was as often a light tenant's request as a heavy one's (in
`loadtests/bench_fair_share.py` the learned capacity's quiet-tenant p99 was 1.7x the configured one's on the long
shape). The probe place costs a light tenant nothing now: only a tenant past its reservation takes it, and only
while no place of the shown batches is held back for another (`FairShares.may_start`), and a request goes to a
place in a shown batch before a probe place (`ReplicaView.candidates`); given to anyone, the probe windows were
the light tenant's slowest answers (chat: quiet p99 1.40x alone; 1.28x since). A replica that has never had
requests waiting has no known capacity, and nor has its model: its requests go straight on, as without fair
queuing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.router.load_readers import LoadReport

PROBE_EVERY_S = 30.0  # how often a replica held to its batch is offered one more, to show a larger one
QUEUED_FOR_S = 0.5  # requests waiting in reports this far apart, and in every one between: a queue, not a step's arrivals


@dataclass(frozen=True)
class RunCeiling:
    """What one replica has shown it runs at once."""

    most_running: int = 0
    has_queued: bool = False  # it has reported requests waiting for QUEUED_FOR_S
    full_at: float | None = None  # when it last showed a queue while running most_running: its batch
    probing: bool = True  # offered one more than most_running (until it shows its batch, and every PROBE_EVERY_S)
    waiting_since: float | None = None  # the first of the reports in a row with requests waiting
    waiting_at_most: bool = False  # and each of those ran most_running

    def seen(self, report: LoadReport, now: float) -> RunCeiling:
        """This ceiling after `report` at `now`: running 12 of a ceiling of 10 -> 12 (probing 13); waiting while
        running 12, its most, in reports QUEUED_FOR_S apart -> its batch is 12."""
        most = max(self.most_running, report.num_running)
        grew = most > self.most_running
        full_at = None if grew else self.full_at  # it ran more: that is not its batch yet
        since, at_most = None, False
        if report.num_waiting > 0:
            since = now if self.waiting_since is None else self.waiting_since
            at_most = report.num_running >= most and (self.waiting_at_most or self.waiting_since is None)
        queued = since is not None and now - since >= QUEUED_FOR_S
        if queued and at_most:
            full_at = now
        probing = full_at is None or now - full_at >= PROBE_EVERY_S
        ceiling = RunCeiling(most, self.has_queued or queued, full_at, probing, since, at_most)
        return self if ceiling == self else ceiling

    def capacity(self) -> float:
        """Requests to keep in flight there: its batch once shown (one more while probing); math.inf until it has
        queued."""
        if not self.has_queued or not self.most_running:
            return math.inf
        return self.most_running + self.probe()

    def probe(self) -> int:
        """1 while one of its places is the probe: a request sent there waits behind a full batch unless the
        replica runs more than it has shown, so only a tenant past its reservation is given it
        (`FairShares.may_start`, `ReplicaView.candidates`)."""
        return int(self.probing and self.has_queued and self.most_running > 0)


def model_probes(ceilings: Iterable[RunCeiling], per_replica: int | None) -> int:
    """How many of `model_capacity`'s places are probes (none when the registry sets the batch)."""
    return 0 if per_replica is not None else sum(ceiling.probe() for ceiling in ceilings)


def model_capacity(ceilings: Iterable[RunCeiling], per_replica: int | None) -> float:
    """The requests a model's ready replicas run at once: `per_replica` each when the registry sets it, else the
    sum of what each has shown; math.inf while any has shown nothing, or there is none."""
    ceilings = list(ceilings)
    if not ceilings:
        return math.inf
    if per_replica is not None:
        return float(per_replica * len(ceilings))
    return sum(ceiling.capacity() for ceiling in ceilings)
