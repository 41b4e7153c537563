"""Who may start on a saturated model (`router.fair_share`): reservations up to each tenant's fair share and
recent peak, the rest first come, and nothing kept for a tenant gone idle."""

from __future__ import annotations

import math

from kvgate.router.fair_share import ACTIVE_HALF_LIFE_S, IDLE_HALF_LIFE_S, FairShares


def start(shares: FairShares, tenant: str, now: float = 0.0, weight: float = 1.0) -> bool:
    """Arrive and start if allowed; True when it started (else it stays waiting)."""
    shares.arrived(tenant, weight, now)
    if shares.may_start(tenant, 16, now):
        shares.started(tenant, now)
        return True
    return False


def test_a_tenant_alone_may_use_the_whole_capacity() -> None:
    shares = FairShares()
    assert all(start(shares, "heavy") for _ in range(16))
    assert not start(shares, "heavy")


def test_a_light_tenants_peak_plus_one_is_held_back_from_a_heavy_one() -> None:
    shares = FairShares()
    for _ in range(3):
        start(shares, "light")  # peak 3: reservation 4
    for _ in range(3):
        shares.ended("light", 0.0)
    started = sum(start(shares, "heavy") for _ in range(20))
    assert started == 12  # 16 - the light tenant's 4, none of which it uses right now
    assert all(start(shares, "light") for _ in range(4))  # its next four start at once


def test_a_probe_place_goes_only_to_a_tenant_past_its_reservation() -> None:
    # 16 places, one of them a probe (a request there waits behind a full batch unless the replica runs more)
    shares = FairShares()
    start(shares, "light")
    shares.ended("light", 0.0)  # peak 1: reservation 2, nothing running
    for _ in range(20):
        shares.arrived("heavy", 1.0, 0.0)
        if shares.may_start("heavy", 16, 0.0, probes=1):
            shares.started("heavy", 0.0)
    # the 15 shown, less the light tenant's 2: the probe stays empty while places of the batch are held back (a
    # request sent on would run in one of those, and the light tenant's next would wait for the batch to free)
    assert shares.tenants()["heavy"][0] == 13
    for _ in range(2):
        shares.arrived("light", 1.0, 0.0)
        assert shares.may_start("light", 16, 0.0, probes=1)
        shares.started("light", 0.0)
    # 15 run, the batch shown: the light tenant's next place is held back still (peak 2 + 1), so no probe yet,
    # and the light tenant does not take the probe either (its request would wait behind the full batch)
    shares.arrived("light", 1.0, 0.0)
    assert not shares.may_start("heavy", 16, 0.0, probes=1)
    assert not shares.may_start("light", 16, 0.0, probes=1)
    alone = FairShares()
    for _ in range(20):
        alone.arrived("heavy", 1.0, 0.0)
        if alone.may_start("heavy", 16, 0.0, probes=1):
            alone.started("heavy", 0.0)
    assert alone.running == 16  # nothing held back: the shown 15 and the probe
    assert shares.reservations(15, 0.0)["light"] == 4.0  # its peak of 3, plus 1


def test_a_reservation_is_never_more_than_the_fair_share() -> None:
    shares = FairShares()
    for _ in range(30):
        start(shares, "a")
        start(shares, "b")
    assert shares.reservations(16, 0.0) == {"a": 8.0, "b": 8.0}
    assert shares.tenants()["a"][0] + shares.tenants()["b"][0] == 16


def test_weights_set_the_fair_shares() -> None:
    shares = FairShares()
    start(shares, "gold", weight=3.0)
    start(shares, "bronze", weight=1.0)
    reserved = shares.reservations(16, 0.0)
    assert reserved["gold"] == 2.0 and reserved["bronze"] == 2.0  # each held to its peak of 1, plus 1
    for _ in range(40):
        shares.arrived("gold", 3.0, 0.0)
        shares.arrived("bronze", 1.0, 0.0)
    assert shares.reservations(16, 0.0) == {"gold": 12.0, "bronze": 4.0}


def test_a_peak_decays_slowly_while_its_tenant_is_active() -> None:
    shares = FairShares()
    for _ in range(7):
        start(shares, "light")
    for _ in range(6):
        shares.ended("light", 0.0)  # one still runs
    assert shares.reservations(16, ACTIVE_HALF_LIFE_S)["light"] == 4.5  # a peak of 3.5, plus 1


def test_an_idle_tenants_peak_decays_fast_and_it_is_forgotten() -> None:
    shares = FairShares()
    for _ in range(7):
        start(shares, "light")
    for _ in range(7):
        shares.ended("light", 0.0)
    assert shares.reservations(16, 0.0)["light"] == 8.0
    assert shares.reservations(16, IDLE_HALF_LIFE_S)["light"] == 4.5  # a peak of 3.5, plus 1
    assert "light" not in shares.reservations(16, 5 * IDLE_HALF_LIFE_S)  # 7 / 32 < 0.5: forgotten


def test_an_unknown_capacity_lets_everyone_start() -> None:
    shares = FairShares()
    shares.arrived("a", 1.0, 0.0)
    assert shares.may_start("a", math.inf, 0.0)


def test_a_higher_priority_never_waits_for_what_is_held_back_for_a_lower_one() -> None:
    shares = FairShares()
    for _ in range(7):
        shares.arrived("batch", 1.0, 0.0, priority=-1)  # peak 7: 8 held back from equals, not from above
    shares.arrived("urgent", 1.0, 0.0, priority=1)
    assert shares.reservations(16, 0.0)["urgent"] == 2.0  # its own peak of 1 + 1, of a share of all 16
    for _ in range(15):
        shares.arrived("urgent", 1.0, 0.0, priority=1)
    assert sum(shares.may_start("urgent", 16, 0.0) and (shares.started("urgent", 0.0) or True)
               for _ in range(16)) == 16
