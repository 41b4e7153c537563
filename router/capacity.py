"""What a model's replicas run at once, as the gateway's fair queuing needs it (`router.flow_control`): the
registry's `routing.max_in_flight_per_replica` when set, else learned from each replica's load reports.

A replica has shown its batch once it reports requests waiting: it was given more than it runs. From then on
its capacity is the most it has reported running, plus one. The one more lets it show a larger batch if it has
one (a gateway that held it to exactly what it had seen would never see more), and keeps at most one request
waiting inside it, where the order is first come, first served. A replica that has never had requests waiting
has no known capacity, and nor has its model: its requests go straight on, as without fair queuing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.router.load_readers import LoadReport


@dataclass(frozen=True)
class RunCeiling:
    """What one replica has shown it runs at once."""

    most_running: int = 0
    has_queued: bool = False  # it has reported requests waiting

    def seen(self, report: LoadReport) -> RunCeiling:
        """This ceiling after `report`: running 12 of a ceiling of 10 -> 12; waiting 3 -> it has queued."""
        most = max(self.most_running, report.num_running)
        queued = self.has_queued or report.num_waiting > 0
        return self if (most, queued) == (self.most_running, self.has_queued) else RunCeiling(most, queued)

    def capacity(self) -> float:
        """Requests to keep in flight there: the most it ran + 1 once it has queued; math.inf until then."""
        return self.most_running + 1 if self.has_queued and self.most_running else math.inf


def model_capacity(ceilings: Iterable[RunCeiling], per_replica: int | None) -> float:
    """The requests a model's ready replicas run at once: `per_replica` each when the registry sets it, else the
    sum of what each has shown; math.inf while any has shown nothing, or there is none."""
    ceilings = list(ceilings)
    if not ceilings:
        return math.inf
    if per_replica is not None:
        return float(per_replica * len(ceilings))
    return sum(ceiling.capacity() for ceiling in ceilings)
