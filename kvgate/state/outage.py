"""`Outage`: one caller's record of the state store failing, so that its log says so when the outage starts, at
most once a minute while it lasts (with the count of failed tries in between), and once when it is over,
rather than a line (or a traceback) per try.

The gateway polls membership every second and the autoscaler ticks every second; either may start before
Redis does (a Kubernetes pod scheduled ahead of the Redis StatefulSet) or lose it for a while. The caller
asks `failed(now)` at each failed try and logs one WARNING line, naming the store and the error (the store's
message already does), only when it answers a note; the first success after failures is one INFO line with
how long it lasted (`recovered`). A store down for 5 minutes under a 1 s poll: lines at t=0, 60, 120, 180,
240 and one on recovery, not 300. The decisions are `kvgate.log_limit.LogLimiter`'s; time comes from the
caller's clock.
"""

from __future__ import annotations

from kvgate.log_limit import DEFAULT_INTERVAL_S, LogLimiter

_STORE = "store"  # the one problem an Outage follows


class Outage:
    """Failures since the store last answered. Not shared: each loop keeps its own."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._limiter = LogLimiter(interval_s, max_keys=1)

    @property
    def ongoing(self) -> bool:
        return self._limiter.ongoing(_STORE)

    def failed(self, now: float) -> str | None:
        """Count one failed try at `now`. Returns what to end this try's log line with when it is to be logged:
        "" for the first, e.g. " (failing for 60 s; 59 more failed tries since the last line)" when the
        interval has passed since the last line; None when the try is only counted."""
        verdict = self._limiter.hit(_STORE, now)
        if verdict is None:
            return None
        if verdict.first:
            return ""
        return (f" (failing for {verdict.ongoing_s:.0f} s; {verdict.num_suppressed} more failed "
                f"{_tries(verdict.num_suppressed)} since the last line)")

    def recovered(self, now: float) -> str | None:
        """The store answered at `now`: None if it had not failed, else what to log once, e.g.
        "after 12.3 s and 11 failed tries" (failures from t=100.0 on, answered at 112.3)."""
        ended = self._limiter.clear(_STORE, now)
        if ended is None:
            return None
        return f"after {ended.duration_s:.1f} s and {ended.num_events} failed {_tries(ended.num_events)}"


def _tries(count: int) -> str:
    return "try" if count == 1 else "tries"
