"""`Outage`: one caller's record of the state store failing, so that its log says so once per try and
once when it is over, rather than a traceback per try.

The gateway polls membership every second and the autoscaler ticks every second; either may start before
Redis does (a Kubernetes pod scheduled ahead of the Redis StatefulSet) or lose it for a while. Each failed
try is one WARNING line that names the store and the error (the store's message already does); the first
success after failures is one INFO line with how long it lasted. Time comes from the caller's clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outage:
    """Failures since the store last answered. Not shared: each loop keeps its own."""

    since: float | None = None  # clock time of the first failed try, None while the store answers
    num_failures: int = 0

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, now: float) -> None:
        """Count one failed try at `now`."""
        if self.since is None:
            self.since = now
        self.num_failures += 1

    def recovered(self, now: float) -> str | None:
        """The store answered at `now`: None if it had not failed, else what to log once, e.g.
        "after 12.3 s and 11 failed tries" (failures from t=100.0 on, answered at 112.3)."""
        if self.since is None:
            return None
        tries = "try" if self.num_failures == 1 else "tries"
        text = f"after {now - self.since:.1f} s and {self.num_failures} failed {tries}"
        self.since, self.num_failures = None, 0
        return text
