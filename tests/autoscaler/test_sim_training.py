"""A Slurm cluster shared by inference and a training backlog (`autoscaler/sim/training.py`), and `kvgate sim
--shared-slurm` against two separate clusters (`autoscaler/sim/sharing.py`).

The ledger's rules on hand-made clusters first, worked numbers in comments (jobs of a fixed runtime: a backlog with
`runtime_sigma` 0), then the comparison on a short slice of the real Azure trace, then the CLI as a user runs it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.autoscaler.sim.baselines import StaticPolicy
from kvgate.autoscaler.sim.engine import simulate
from kvgate.autoscaler.sim.records import FleetSetup
from kvgate.autoscaler.sim.service import Placement, ServiceModel
from kvgate.autoscaler.sim.sharing import SharingSpec, compare_sharing, sharing_table
from kvgate.autoscaler.sim.traces import Request, Trace, load_trace, scale_rate
from kvgate.autoscaler.sim.training import (BacklogSpec, ClusterSpec, ClusterState, acquire, advance, backlog_job,
                                            finish, open_cluster, release, training_only)
from kvgate.registry import load_registry
from kvgate.registry.schema import CapacityType

REPO = Path(__file__).resolve().parents[2]
AZURE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
EXAMPLES = REPO / "examples" / "sim"


def _backlog(gpus: int = 4, runtime_s: float = 10_000.0, checkpoint_s: float = 120.0) -> BacklogSpec:
    """Jobs of `gpus` GPUs running exactly `runtime_s`, a checkpoint every 1,000 s of progress."""
    return BacklogSpec(gpus_per_job=(gpus,), mean_runtime_s=runtime_s, runtime_sigma=0.0, checkpoint_every_s=1000.0,
                       checkpoint_s=checkpoint_s, queue_depth=4)


def _cluster(gpus: int = 8, ceiling: int = 4, grace_s: float = 60.0, **backlog: float) -> ClusterSpec:
    return ClusterSpec(gpus, ceiling, _backlog(**backlog), grace_s)  # type: ignore[arg-type]


def _jobs(state: ClusterState) -> list[tuple[int, float, float]]:
    """(index, started at, seconds done when it started) of each job running."""
    return sorted((r.job.index, r.started_at, r.done_at_start_s) for r in state.running)


# ----------------------------------------------------------------------------------------------- the ledger


def test_training_fills_every_gpu_inference_does_not_hold() -> None:
    spec = _cluster(gpus=12, ceiling=4)
    state = open_cluster(spec, {0: 4})
    assert (state.inference_gpus, state.training_gpus, state.free) == (4, 8, 0)
    assert _jobs(state) == [(0, 0.0, 0.0), (1, 0.0, 0.0)]
    assert len(state.queue) == 4  # the backlog keeps its depth: one submitted for each started


def test_a_requeue_loses_only_the_progress_since_the_last_checkpoint() -> None:
    # 60 s grace < 120 s to write a checkpoint: no checkpoint at SIGTERM. Job 1 (the youngest: both started at 0,
    # the later submitted) is 2,500 s in, its last checkpoint at 2,000: it loses 500 s x 4 GPUs.
    spec = _cluster()
    state, wait_s = acquire(spec, open_cluster(spec, {}), 2500.0, key=7, gpus=4)
    assert wait_s == 60.0  # the replica starts its cold start when the grace is over
    state = advance(spec, state, 2600.0)
    assert state.inference_gpus == 4 and _jobs(state) == [(0, 0.0, 0.0)]
    assert state.queue[0][0].index == 1 and state.queue[0][1] == 2000.0  # first in line, from its checkpoint
    assert state.tally.jobs_requeued == 1 and state.tally.lost_gpu_s == 500.0 * 4
    assert state.tally.stopping_gpu_s == 60.0 * 4  # the grace: held by training, no progress kept


def test_a_grace_long_enough_for_a_checkpoint_loses_nothing_and_frees_the_gpus_when_written() -> None:
    spec = _cluster(grace_s=180.0)  # >= the 120 s a checkpoint takes: written at SIGTERM, then the job exits
    state, wait_s = acquire(spec, open_cluster(spec, {}), 2500.0, key=7, gpus=4)
    assert wait_s == 120.0
    state = advance(spec, state, 2700.0)
    assert state.tally.lost_gpu_s == 0.0 and state.queue[0][1] == 2500.0


def test_training_resumes_on_the_gpus_inference_gives_back() -> None:
    spec = _cluster()
    state, _ = acquire(spec, open_cluster(spec, {}), 2500.0, key=7, gpus=4)
    state = release(spec, state, 3000.0, key=7)
    # The requeued job 1 is first in line: it resumes from its checkpoint at 2,000 s on the GPUs given back.
    assert (state.inference_gpus, state.training_gpus, state.free) == (0, 8, 0)
    assert _jobs(state) == [(0, 0.0, 0.0), (1, 3000.0, 2000.0)]
    state = advance(spec, state, 11_000.0)  # it needs 8,000 s more: done at 11,000, as job 0 was at 10,000
    assert state.tally.jobs_completed == 2


def test_a_victim_that_would_end_within_the_grace_completes_instead() -> None:
    spec = _cluster(runtime_s=1000.0)
    state, wait_s = acquire(spec, open_cluster(spec, {}), 970.0, key=7, gpus=4)
    assert wait_s == 30.0  # job 1 ends at 1,000 s on its own
    state = advance(spec, state, 1000.0)
    assert state.tally.jobs_requeued == 0 and state.tally.jobs_completed == 2 and state.inference_gpus == 4


def test_a_second_start_takes_the_spare_gpus_of_a_job_already_stopping() -> None:
    # One 8-GPU job holds the cluster. The first replica preempts it; the second, 20 s later, waits for the same
    # job's other 4 GPUs (40 s left of its grace) and preempts nothing more.
    spec = ClusterSpec(8, 8, _backlog(gpus=8), 60.0)
    state, first = acquire(spec, open_cluster(spec, {}), 100.0, key=1, gpus=4)
    state, second = acquire(spec, state, 120.0, key=2, gpus=4)
    assert (first, second) == (60.0, 40.0)
    state = advance(spec, state, 200.0)
    assert state.tally.jobs_requeued == 1 and state.inference_gpus == 8 and state.training_gpus == 0


def test_inference_never_holds_more_than_the_ceiling() -> None:
    spec = _cluster(gpus=16, ceiling=8)
    state = open_cluster(spec, {})
    state, a = acquire(spec, state, 10.0, key=1, gpus=4)
    state, b = acquire(spec, state, 11.0, key=2, gpus=4)  # waiting for its grace still counts against the ceiling
    state, refused = acquire(spec, state, 12.0, key=3, gpus=4)
    assert a is not None and b is not None and refused is None and state.tally.refused_starts == 1
    state = release(spec, state, 13.0, key=1)
    state, c = acquire(spec, state, 14.0, key=3, gpus=4)
    assert c is not None and state.tally.peak_inference_gpus == 8


def test_the_reserve_keeps_gpus_free_for_a_start_that_waits_for_no_grace() -> None:
    spec = ClusterSpec(8, 8, _backlog(), 60.0, inference_reserve_gpus=4)
    state = open_cluster(spec, {})
    assert state.training_gpus == 4 and state.free == 4
    state, wait_s = acquire(spec, state, 50.0, key=1, gpus=4)
    assert wait_s == 0.0 and state.tally.jobs_requeued == 0


def test_a_replica_cancelled_while_it_waits_gives_its_gpus_to_training() -> None:
    spec = _cluster()
    state, _ = acquire(spec, open_cluster(spec, {}), 2500.0, key=7, gpus=4)
    state = release(spec, state, 2530.0, key=7)
    state = advance(spec, state, 2600.0)  # the victim still leaves at 2,560 (it had its SIGTERM); it runs again
    assert state.inference_gpus == 0 and state.training_gpus == 8 and state.reserved == 0


def test_gpu_hours_add_up_whatever_inference_does() -> None:
    # Random starts and stops on a 32-GPU cluster: every GPU is always inference's, training's or idle, and over the
    # whole run inference + training + idle = GPUs x hours.
    spec = ClusterSpec(32, 24, BacklogSpec(queue_depth=8, mean_runtime_s=900.0), 60.0, own_training_gpus=16,
                       score_from_s=300.0)
    rng = random.Random(3)
    state, held, t = open_cluster(spec, {}), set(), 0.0
    for key in range(400):
        t += rng.expovariate(1 / 20.0)
        if held and rng.random() < 0.5:
            state = release(spec, state, t, held.pop())
        else:
            state, wait_s = acquire(spec, state, t, key, 4)
            held |= {key} if wait_s is not None else set()
        waiting = sum(h.gpus for h in state.waiting)
        assert state.free + state.reserved + state.inference_gpus + state.training_gpus == 32
        assert min(state.free, state.reserved) >= 0 and state.inference_gpus + waiting <= 24
    use = finish(spec, state, t + 100.0)
    assert use.inference_gpu_h + use.training_gpu_h + use.idle_gpu_h == pytest.approx(32 * use.hours)
    assert use.jobs_requeued > 0 and 0 < use.useful_training_gpu_h < use.training_gpu_h
    assert 0 < use.lent_gpu_h < use.training_gpu_h


def test_the_backlog_is_the_same_jobs_in_every_run_and_never_runs_dry() -> None:
    spec = BacklogSpec(seed=5)
    assert [backlog_job(spec, i) for i in range(20)] == [backlog_job(spec, i) for i in range(20)]
    assert backlog_job(spec, 3) != backlog_job(BacklogSpec(seed=6), 3)
    assert {backlog_job(spec, i).gpus for i in range(100)} == {1, 2, 4, 8}
    use = training_only(ClusterSpec(64, 0, spec, own_training_gpus=64), 6 * 3600.0)
    assert use.training_gpu_h > 0.99 * 64 * 6 and use.jobs_completed > 0 and use.lent_gpu_h == 0.0


# ------------------------------------------------------------------------------------------- in the engine


def _engine_fleet(cluster: ClusterSpec | None, initial: int = 0) -> FleetSetup:
    # Replicas of 4 GPUs, a 10 s cold start, 1,000 prefill tokens/s, one request at a time.
    placement = Placement("slurm", "slurm", CapacityType.ON_DEMAND, 0.0, 4, 10.0, ServiceModel("X", 1_000.0, 10.0, 1))
    return FleetSetup("m", (placement,), min_replicas=0, max_replicas=10, on_demand_base=0, ttft_slo_s=1.0,
                      initial_replicas=initial, tail_s=100.0, cluster=cluster)


def test_a_replica_that_preempts_training_starts_its_cold_start_after_the_grace() -> None:
    trace = Trace("one", (Request(0.0, 100, 1),))
    alone = simulate(trace, _engine_fleet(None), StaticPolicy(1, tick_s=1.0))
    assert alone.ttft_s[0] == pytest.approx(10.1)  # started at the first tick: 10 s cold start + 0.1 s prefill
    shared = simulate(trace, _engine_fleet(ClusterSpec(4, 4, _backlog(), 60.0)), StaticPolicy(1, tick_s=1.0))
    assert shared.ttft_s[0] == pytest.approx(70.1)  # the training job's 60 s grace first
    use = shared.cluster_use
    assert use is not None and use.jobs_requeued == 1 and use.delayed_starts == 1
    # The replica holds the 4 GPUs from 60 s to the end (0 + 100 s tail); training held them through its grace.
    assert use.inference_gpu_h * 3600 == pytest.approx(4 * 40.0) and use.training_gpu_h * 3600 == pytest.approx(4 * 60)


def test_the_engine_starts_no_replica_past_the_ceiling() -> None:
    trace = Trace("one", (Request(0.0, 100, 1),))
    fleet = _engine_fleet(ClusterSpec(16, 8, _backlog(), 60.0), initial=1)
    result = simulate(trace, fleet, StaticPolicy(3, tick_s=1.0))
    assert result.max_replicas == 2  # 8 GPUs of inference: two replicas of 4, whatever the policy asks
    assert result.cluster_use is not None and result.cluster_use.peak_inference_gpus == 8
    assert result.cluster_use.refused_starts > 0


# ------------------------------------------------------------------------------------------- the comparison


@pytest.fixture(scope="module")
def azure_sharing():
    # 10 minutes of Azure at 10x (about 530 requests a minute), 2 minutes of warm-up, on 128 GPUs.
    trace = scale_rate(load_trace(AZURE).slice(0, 600), 10.0)
    return compare_sharing(trace, load_registry(EXAMPLES), "chat-70b", SharingSpec(128), warmup_s=120)


def test_the_separate_arrangement_never_preempts(azure_sharing) -> None:
    separate, shared = azure_sharing.arrangements
    assert separate.name == "separate" and shared.name == "shared"
    assert separate.use.jobs_requeued == separate.use.delayed_starts == 0 and separate.use.lent_gpu_h == 0.0
    assert separate.use.useful_training_gpu_h == separate.use.training_gpu_h


def test_sharing_lends_training_the_gpus_inference_leaves_idle(azure_sharing) -> None:
    separate, shared = azure_sharing.arrangements
    total = azure_sharing.spec.cluster_gpus
    for row in (separate, shared):
        use = row.use
        assert use.gpus == total
        assert use.inference_gpu_h + use.training_gpu_h + use.idle_gpu_h == pytest.approx(total * use.hours)
        assert use.peak_inference_gpus <= azure_sharing.inference_gpus
    # The inference cluster's GPUs its fleet does not hold (0.46 GPU-h of 18.4 here: kvgate holds its peak of 23
    # replicas most of these 12 minutes), and training borrowing them when it shares (0.72 GPU-h).
    assert separate.use.idle_gpu_h > 0.25
    assert shared.use.lent_gpu_h > 0.25 and shared.use.utilisation > separate.use.utilisation
    assert shared.use.training_gpu_h == pytest.approx(separate.use.training_gpu_h + shared.use.lent_gpu_h, abs=0.5)
    text = sharing_table(azure_sharing)
    assert f"separate: {azure_sharing.inference_gpus} inference (kvgate's peak on a dedicated cluster)" in text


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.autoscaler.sim", "--registry", str(EXAMPLES), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_prints_the_shared_and_separate_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sharing.json"
    result = _sim("--trace", str(AZURE), "--model", "chat-70b", "--duration-s", "240", "--rate-scale", "5",
                  "--warmup-s", "60", "--shared-slurm", "64", "--inference-gpus", "32", "--slurm-grace-s", "90",
                  "--training-gpus-per-job", "2,4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "| separate" in result.stdout and "| shared" in result.stdout
    assert "separate: 32 inference (--inference-gpus) + 32 training" in result.stdout
    data = json.loads(out.read_text())
    assert data["grace_s"] == 90.0 and data["backlog"]["gpus_per_job"] == [2, 4]
    assert [a["name"] for a in data["arrangements"]] == ["separate", "shared"]
    assert all(0 < a["utilisation"] <= 1 for a in data["arrangements"])


@pytest.mark.parametrize("args,message", [
    (["--training-queue-depth", "8"], "--training-queue-depth needs --shared-slurm GPUS"),
    (["--shared-slurm", "64", "--sweep"], "--sweep does not go with --shared-slurm"),
    (["--shared-slurm", "64", "--policy", "kpa"], "--policy does not go with --shared-slurm"),
    (["--shared-slurm", "0"], "--shared-slurm: '0': a whole number of GPUs > 0"),
    (["--shared-slurm", "64", "--training-gpus-per-job", "1,x"], "comma-separated whole numbers"),
    (["--shared-slurm", "6", "--inference-gpus", "4"], "the backlog's 8-GPU jobs do not fit the 6-GPU cluster"),
    (["--shared-slurm", "64", "--inference-gpus", "60"], "the separate training cluster (64 - 60 = 4 GPUs) cannot"),
])
def test_cli_sharing_mistakes_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = _sim("--trace", str(AZURE), "--model", "chat-70b", "--duration-s", "60", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
