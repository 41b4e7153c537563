"""`LogLimiter`: one log line per distinct problem per interval, with a count, instead of one per event.

A gateway polls the state store every second, follows every replica's state stream and health, and answers
whatever arrives on its port; when one of those fails, it fails again at the next try. Logging each try
buries the one line that matters (the probe of issue 27 counted 430 tracebacks from a fuzz of malformed
requests). So each owner (a loop, a stream, a server's error log) keeps a `LogLimiter` and asks it, per
event, whether to log:

- `hit(key, now)` for each event of a problem (the key names the problem: an exception class, a store, a
  status code). The first event of a key is logged; later ones are counted and suppressed until
  `interval_s` has passed since the key's last line, when the next event is logged with the count suppressed
  in between. With an interval of 60 s and a poll every second, a store down for five minutes says so at
  t=0, 60, 120, 180 and 240: five lines, each after the first saying "59 more".
- `clear(key, now)` when the problem is over (the store answered): says how long it lasted and how many
  events it had, once, and the next event of that key is a first again. `clear_all` ends every key at once.

Pure: time is passed in (the caller's clock), nothing is logged here, and each owner holds its own
instance (no module state). The keys held are capped (`max_keys`, least recently hit dropped first), so
keys built from what a client sends cannot grow it without bound.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 60.0  # one line a minute per problem: a few hundred a day for one that never ends
DEFAULT_MAX_KEYS = 256


@dataclass(frozen=True)
class Verdict:
    """Log this event now."""

    first: bool  # the key's first event (ever, since `clear`, or since it was dropped for room)
    num_suppressed: int  # events of this key not logged since its previous line
    since_s: float  # seconds since the key's previous line; 0.0 for a first
    ongoing_s: float  # seconds since the key's first event; 0.0 for a first

    @property
    def note(self) -> str:
        """What to end the line with: "" when nothing was suppressed, else e.g. " (59 more in the last 60 s)"."""
        if not self.num_suppressed:
            return ""
        return f" ({self.num_suppressed} more in the last {self.since_s:.0f} s)"


@dataclass(frozen=True)
class Ended:
    """A problem that was going on is over."""

    duration_s: float  # from its first event to the `clear`
    num_events: int  # all of its events, logged or not


@dataclass
class _Problem:
    started_at: float  # clock time of its first event
    logged_at: float  # clock time of its last logged event
    num_events: int = 1
    num_suppressed: int = 0  # since `logged_at`


class LogLimiter:
    """Decides, per problem key, whether an event is logged now or counted for the next line. Not shared:
    each owner keeps its own (one asyncio task or one event loop's callbacks; not thread-safe)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError(f"interval_s must be >= 0 and max_keys >= 1, got {interval_s} and {max_keys}")
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._problems: dict[Hashable, _Problem] = {}  # least recently hit first

    def __len__(self) -> int:
        return len(self._problems)

    def ongoing(self, key: Hashable) -> bool:
        """`key` had an event since it was last cleared (and was not dropped for room)."""
        return key in self._problems

    def hit(self, key: Hashable, now: float) -> Verdict | None:
        """One event of `key` at `now`: a `Verdict` when it is to be logged, None when it is only counted."""
        problem = self._problems.pop(key, None)
        if problem is None:
            while len(self._problems) >= self._max_keys:
                del self._problems[next(iter(self._problems))]
            self._problems[key] = _Problem(started_at=now, logged_at=now)
            return Verdict(first=True, num_suppressed=0, since_s=0.0, ongoing_s=0.0)
        self._problems[key] = problem  # now the most recently hit
        problem.num_events += 1
        if now - problem.logged_at < self.interval_s:
            problem.num_suppressed += 1
            return None
        verdict = Verdict(first=False, num_suppressed=problem.num_suppressed, since_s=now - problem.logged_at,
                          ongoing_s=now - problem.started_at)
        problem.logged_at, problem.num_suppressed = now, 0
        return verdict

    def clear(self, key: Hashable, now: float) -> Ended | None:
        """`key`'s problem is over at `now`: an `Ended` to log once if it had events, else None."""
        problem = self._problems.pop(key, None)
        if problem is None:
            return None
        return Ended(duration_s=now - problem.started_at, num_events=problem.num_events)

    def clear_all(self, now: float) -> Ended | None:
        """Every problem is over at `now` (the thing that failed in several ways works again): one `Ended` from
        the earliest first event, counting every key's events; None if there were none."""
        if not self._problems:
            return None
        problems = list(self._problems.values())
        self._problems.clear()
        return Ended(duration_s=now - min(p.started_at for p in problems),
                     num_events=sum(p.num_events for p in problems))
