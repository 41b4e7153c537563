"""The cheapest node plan (`autoscaler/sim/nodeplan.py`), with worked numbers.

Registry: examples/sim. chat-70b takes 4 H100s a replica, so an 8-GPU node holds 2; its on-demand base is 2.
H100 nodes: p5.48xlarge spot $31.50/h and on-demand $55.04/h (aws-us-east-1, boots in 240 s, at most 256
GPUs), h100-80gb-x8 on-demand $49.24/h (gpucloud, boots in 90 s, at most 64 GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.autoscaler.sim.nodeplan import cheapest_node_plan
from kvgate.autoscaler.sim.nodes import node_planning
from kvgate.autoscaler.sim.records import Stockout
from kvgate.registry import load_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"
SPOT, GPUCLOUD = 31.50, 49.24


@pytest.fixture(scope="module")
def setting():
    snapshot = load_registry(EXAMPLES)
    pools = {name: pool.spec for name, pool in snapshot.pools.items()}
    return snapshot.model("chat-70b"), node_planning(snapshot, "chat-70b").offerings, pools


def plan(setting, demand, end_s, **options):
    model, offerings, pools = setting
    return cheapest_node_plan(demand, end_s, model, offerings, pools, **options)


def test_the_base_goes_on_the_cheapest_on_demand_node_and_the_rest_on_spot(setting) -> None:
    # 2 replicas for an hour: the base, one gpucloud node ($49.24). 4 replicas: that plus one p5 spot node.
    assert plan(setting, [(0.0, 2)], 3600.0).usd == pytest.approx(GPUCLOUD)
    four = plan(setting, [(0.0, 4)], 3600.0)
    assert four.usd == pytest.approx(GPUCLOUD + SPOT) and four.gpu_hours == pytest.approx(16.0)
    base_free = setting[0].model_copy(update={"spec": setting[0].spec.model_copy(update={
        "placement": setting[0].spec.placement.model_copy(update={"on_demand_base_replicas": 0})})})
    assert cheapest_node_plan([(0.0, 2)], 3600.0, base_free, setting[1], setting[2]).usd == pytest.approx(SPOT)


def test_a_node_added_pays_its_boot_and_is_kept_through_a_dip_shorter_than_a_boot(setting) -> None:
    # 2 -> 4 replicas for 600 s from t=600: the spot node is bought 240 s early: (600 + 240) s at $31.50.
    rise = plan(setting, [(0.0, 2), (600.0, 4), (1200.0, 2)], 1800.0)
    assert rise.usd == pytest.approx(GPUCLOUD / 2 + (600 + 240) * SPOT / 3600)
    # 4 replicas with a 100 s dip to 2: keeping the spot node through it (100 s) beats a new boot (240 s).
    dip = plan(setting, [(0.0, 4), (600.0, 2), (700.0, 4)], 1000.0)
    assert dip.usd == pytest.approx((GPUCLOUD + SPOT) * 1000 / 3600)
    # A 300 s dip is longer than a boot: released, and bought back paying 240 s.
    long_dip = plan(setting, [(0.0, 4), (600.0, 2), (900.0, 4)], 1200.0)
    assert long_dip.usd == pytest.approx(GPUCLOUD * 1200 / 3600 + SPOT * (600 + 240 + 300) / 3600)
    # Needed 100 s after scoring starts: the other 140 s of its boot fall in the warm-up, which no run pays for.
    early = plan(setting, [(0.0, 2), (100.0, 4)], 700.0)
    assert early.usd == pytest.approx(GPUCLOUD * 700 / 3600 + SPOT * (600 + 100) / 3600)


def test_a_stockout_stops_purchases_but_not_the_nodes_held(setting) -> None:
    # p5 spot sells nothing from 300 s. The spot node held from the start keeps running; the rise to 6 at 600 s
    # buys a second gpucloud node ($49.24, boot 90 s) instead of spot.
    out = (Stockout("aws-us-east-1/p5.48xlarge/spot", 300.0, 1e9),)
    stocked_out = plan(setting, [(0.0, 4), (600.0, 6)], 1200.0, outages=out)
    assert stocked_out.usd == pytest.approx((GPUCLOUD + SPOT) * 1200 / 3600 + GPUCLOUD * (600 + 90) / 3600)


def test_a_stocked_out_spot_node_lasts_as_long_as_it_is_expected_to_survive(setting) -> None:
    # 4 replicas: the gpucloud base node and one p5 spot node. p5 spot sells nothing from 600 s, and spot nodes
    # are interrupted once an hour: the one held is expected to survive while e^(-t / 1 h) rounds to 1, ln 2 hours
    # (2,495 s) into the stockout, checked every minute: gone at 600 + 2,520 = 3,120 s, replaced by a second
    # gpucloud node (boot 90 s) for the last 480 s. Spot pays $33.60 an hour for its expected re-boots.
    out = (Stockout("aws-us-east-1/p5.48xlarge/spot", 600.0, 1e9),)
    thinned = plan(setting, [(0.0, 4)], 3600.0, outages=out, spot_interruptions_per_hour=1.0)
    spot = SPOT * (1 + 240 / 3600)
    assert thinned.usd == pytest.approx(GPUCLOUD + spot * 3120 / 3600 + GPUCLOUD * (480 + 90) / 3600)
    # Without interruptions the node held runs through the stockout.
    assert plan(setting, [(0.0, 4)], 3600.0, outages=out).usd == pytest.approx(GPUCLOUD + SPOT)


def test_frequent_interruptions_make_on_demand_the_cheaper_spare(setting) -> None:
    # Each interruption pays a spot node's 240 s boot again: at 10 an hour, $31.50 x (1 + 10 x 240 / 3600) = $52.50,
    # dearer than gpucloud's $49.24; at 1 an hour, $33.60, still spot.
    assert plan(setting, [(0.0, 4)], 3600.0, spot_interruptions_per_hour=10.0).usd == pytest.approx(2 * GPUCLOUD)
    assert plan(setting, [(0.0, 4)], 3600.0, spot_interruptions_per_hour=1.0).usd == pytest.approx(
        GPUCLOUD + SPOT * (1 + 240 / 3600))


def test_demand_past_every_quota_is_held_as_far_as_it_fits_and_reported_short(setting) -> None:
    # 256 + 64 GPUs hold 80 replicas; 90 asked for 600 s: 80 are held, and the 600 s are reported short.
    result = plan(setting, [(0.0, 90)], 600.0)
    assert result.short_s == pytest.approx(600.0) and result.gpu_hours == pytest.approx(320 * 600 / 3600)
