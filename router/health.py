"""Whether a replica is in rotation, as its health checks and the gateway's own requests found it: pure.

Two signals, two rules (`ReplicaTracker` feeds them and acts on the result):
- Health checks (active): a failing check marks a replica unhealthy at once, a passing one marks it healthy.
  A replica that gives no answer at all to `after_checks` checks in a row (`unresponsive`: frozen, as a hung
  GPU driver or SIGSTOP leaves it) also loses, at each such check, the requests in flight there that have
  heard nothing from it for a while (the tracker's `interrupt_after_silent_s`): they are retried elsewhere or
  ended instead of at the proxy's timeouts. An answer of any status resets that count, so a draining replica's
  503 never ends the requests it is finishing, nor does a slow one that still answers; and a request that is
  still receiving bytes is never ended, however late the checks are answered.
- Requests (passive ejection): `eject_after_failures` failures reported in a row eject a replica for
  `eject_for_s`; after that it stays out until a health check passes (the probe), which readmits it with
  a fresh count. Ejected at t=100 for 10 s: a check that passes at t=105 changes nothing, one at t=111
  readmits it.

`Health` is a frozen value; every function returns a new one, with the time passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Ejection:
    """The passive-ejection knobs."""

    after_failures: int = 3  # requests failed in a row that eject a replica
    for_s: float = 10.0  # how long it stays out before a passing health check may readmit it


@dataclass(frozen=True)
class Health:
    """One replica's health record."""

    failed_checks: int = 0  # health checks failed in a row; 0 until the first, so a new replica is routable at once
    unanswered_checks: int = 0  # of those, the ones in a row that got no answer in time (a timeout, a refused
    # or reset connection): a frozen or dead process, not a server that says it is draining or broken
    consecutive_failures: int = 0  # requests failed there in a row, since the last success or readmission
    ejected_until: float | None = None  # set while ejected (clock seconds); cleared by a passing probe after it

    @property
    def check_ok(self) -> bool:
        """Its last health check passed (or none has run yet)."""
        return self.failed_checks == 0

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    @property
    def in_rotation(self) -> bool:
        """Neither failing its health checks nor ejected."""
        return self.check_ok and not self.ejected


def after_check(health: Health, ok: bool, now: float, answered: bool = True) -> Health:
    """A health check passed (`ok`) or failed at `now`, with an answer of some status or, not `answered`, none
    in time. A pass after the ejection ran out readmits the replica."""
    failed_checks = 0 if ok else health.failed_checks + 1
    unanswered_checks = 0 if answered else health.unanswered_checks + 1
    if ok and health.ejected_until is not None and now >= health.ejected_until:
        return Health(failed_checks=failed_checks)
    return replace(health, failed_checks=failed_checks, unanswered_checks=unanswered_checks)


def unresponsive(health: Health, after_checks: int) -> bool:
    """`after_checks` or more checks in a row went without an answer: the requests in flight there that hear
    nothing from it are given up on. Holds until the next answer."""
    return health.unanswered_checks >= after_checks


def newly_unresponsive(before: Health, after: Health, after_checks: int) -> bool:
    """The change from `before` to `after` is the `after_checks`-th check in a row without an answer: once per
    silence (for the log line), as the next answer starts a new count."""
    return not unresponsive(before, after_checks) and unresponsive(after, after_checks)


def after_request(health: Health, ok: bool, now: float, ejection: Ejection) -> Health:
    """A request there succeeded (`ok`), or failed before its first byte (connect error, 5xx), at `now`. The
    `ejection.after_failures`-th failure in a row ejects the replica until `now + ejection.for_s`; failures
    while ejected only count."""
    if ok:
        return replace(health, consecutive_failures=0)
    failures = health.consecutive_failures + 1
    if failures >= ejection.after_failures and health.ejected_until is None:
        return replace(health, consecutive_failures=failures, ejected_until=now + ejection.for_s)
    return replace(health, consecutive_failures=failures)


def readmitted(before: Health, after: Health) -> bool:
    """The change from `before` to `after` ended an ejection."""
    return before.ejected and not after.ejected


def newly_ejected(before: Health, after: Health) -> bool:
    return after.ejected and not before.ejected
