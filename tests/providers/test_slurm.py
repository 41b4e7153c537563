"""SlurmProvider on a real single-node Slurm cluster (tests/slurm_cluster.py: four fake H100s, partitions
`inference` and preemptible `training` with GraceTime 10 s): replica jobs that serve, training requeued for a
replica and resumed after it, a job cancelled from outside, a replica pending past its deadline, adoption
by a restarted provider, and slurmctld unreachable. Engines run `builtin:tiny-llama` on the CPU (the GPUs are
character devices), each in a batch job that Slurm starts.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvgate.clock import RealClock
from kvgate.providers.base import (InsufficientCapacity, NodeState, ProviderError, ProviderUnavailable, QuotaExceeded, ReplicaSpec,
                                   ReplicaState)
from kvgate.providers.slurm import SlurmProvider
from tests.eventually import eventually
from tests.providers.subject_slurm import POOL, claim, pool_spec, sharing_spec
from tests.slurm_cluster import GRACE_TIME_S, SlurmCluster

SPEC = ReplicaSpec(model="tiny-llama", source="builtin:tiny-llama", gpu_count=1, max_model_len=256,
                   kv_cache_bytes=16 * 2 ** 20)
START_S = 120.0  # a replica job: Slurm's scheduling pass, then the engine's start on a loaded 2-core box


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster):
    yield slurm_cluster
    slurm_cluster.clean()


def provider_for(cluster: SlurmCluster, tmp_path: Path, name: str = "", *, sharing: bool = False, **slurm) -> SlurmProvider:
    spec = (sharing_spec if sharing else pool_spec)(cluster, tmp_path / "logs", **slurm)
    return SlurmProvider(POOL, spec, cluster=name or f"t-{uuid.uuid4().hex[:6]}", clock=RealClock())


async def ready_replica(provider: SlurmProvider, replica_id: str):
    async def ready():
        found = [h for h in await provider.list_replicas() if h.id == replica_id]
        assert not found or found[0].state is not ReplicaState.FAILED, found[0].reason
        return found[0] if found and found[0].state is ReplicaState.READY else None
    return await eventually(ready, f"replica {replica_id} is ready", timeout_s=START_S, poll_s=0.5)


def complete(url: str) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def job_of(cluster: SlurmCluster, replica_id: str) -> dict:
    [job] = [j for j in cluster.live_jobs("kvgate.") if j["name"].endswith("." + replica_id)]
    return job


async def test_a_replica_job_serves_on_its_node_and_stops_by_draining(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = provider_for(cluster, tmp_path)
    node = await provider.create(claim())
    assert node.state is NodeState.RUNNING and node.address is None  # a claim: the job's node gives the URL
    await provider.start_replica(node.id, SPEC, replica_id="r1")
    again = await provider.start_replica(node.id, SPEC, replica_id="r1")
    assert again.id == "r1" and len(cluster.live_jobs(f"kvgate.{provider.cluster}.r1")) == 1, "idempotent"
    handle = await ready_replica(provider, "r1")
    assert handle.node_id == node.id and handle.url.startswith("http://127.0.0.1:")
    assert complete(handle.url)["choices"][0]["text"] is not None
    job = job_of(cluster, "r1")
    assert job["partition"] == "inference" and job["tres_per_node"] == "gres:gpu:h100:1"
    assert job["gres_detail"] == ["gpu:h100:1(IDX:0)"]
    started = time.monotonic()
    await provider.stop_replica("r1", drain_deadline_s=20)
    assert time.monotonic() - started < 20, "the engine drained on SIGTERM and exited before the deadline"
    assert await provider.list_replicas() == []
    assert cluster.live_jobs(f"kvgate.{provider.cluster}.r1") == []
    log = (tmp_path / "logs" / "r1.log").read_text()
    assert "kvgate: replica on" in log


async def test_training_is_requeued_for_a_replica_and_runs_again_after_it(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = provider_for(cluster, tmp_path, sharing=True)
    training = cluster.submit_training(gpus=4, script="echo start $(date +%s); exec sleep 3600")
    cluster.wait_state(training, "RUNNING")
    offers = {o.instance_type: o for o in await provider.offerings()}
    assert not offers["h100x1"].available, "every GPU is training's"
    assert offers["h100x1+training"].available and offers["h100x1+training"].price_usd_per_hour == 2.5
    with pytest.raises(InsufficientCapacity):
        await provider.create(claim("h100x1"))
    node = await provider.create(claim("h100x1+training"))
    submitted = time.monotonic()
    await provider.start_replica(node.id, SPEC, replica_id="r1")
    requeued = await eventually(lambda: next((j for j in cluster.jobs() if str(j["job_id"]) == training
                                              and j["job_state"] == "PENDING"), None),
                                "the training job is requeued", timeout_s=START_S, poll_s=0.3)
    waited = time.monotonic() - submitted
    # Slurm checks GraceTime on a timer of about 30 s, so the requeue comes within grace + one timer period.
    assert waited < GRACE_TIME_S + 40, f"requeued after {waited:.0f} s"
    assert requeued["restart_cnt"] == 1
    handle = await ready_replica(provider, "r1")
    assert complete(handle.url)["choices"]
    await provider.stop_replica("r1", drain_deadline_s=20)
    await provider.delete(node.id)
    cluster.wait_state(training, "RUNNING", timeout_s=90)  # the GPUs went back to the queue
    out = cluster.root / f"train-{training}.out"
    await eventually(lambda: out.read_text().count("start ") == 2, "it ran, was requeued, and ran again",
                     poll_s=0.3)


async def test_a_job_cancelled_from_outside_is_failed_with_slurms_reason(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = provider_for(cluster, tmp_path)
    node = await provider.create(claim())
    await provider.start_replica(node.id, SPEC, replica_id="r1")
    job = job_of(cluster, "r1")
    cluster.wait_state(str(job["job_id"]), "RUNNING")
    cluster.run("scancel", str(job["job_id"]))

    async def failed():
        found = [h for h in await provider.list_replicas() if h.id == "r1"]
        return found[0] if found and found[0].state is ReplicaState.FAILED else None
    handle = await eventually(failed, "the replica is reported failed", timeout_s=60, poll_s=0.3)
    assert f"Slurm job {job['job_id']} was cancelled outside kvgate: CANCELLED" in handle.reason
    assert "Slurm's reason" in handle.reason
    await provider.stop_replica("r1")
    assert await provider.list_replicas() == []


async def test_a_replica_whose_claim_was_cancelled_from_outside_is_failed(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = provider_for(cluster, tmp_path)
    node = await provider.create(claim())
    await provider.start_replica(node.id, SPEC, replica_id="r1")
    cluster.run("scancel", node.id)  # the held job that records the claim
    [replica] = await eventually(lambda: provider.list_replicas(), "the replica is listed", poll_s=0.3)
    assert replica.state is ReplicaState.FAILED and "is gone from Slurm" in replica.reason
    await provider.stop_replica("r1", drain_deadline_s=5)
    await eventually(lambda: cluster.live_jobs("kvgate.") == [], "nothing of kvgate runs", poll_s=0.3)


async def test_a_replica_pending_past_its_deadline_gives_its_claim_up(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = provider_for(cluster, tmp_path, pending_timeout_s=3)
    node = await provider.create(claim())  # free now ...
    training = cluster.submit_training(gpus=4)  # ... then training takes every GPU; this pool may not preempt
    cluster.wait_state(training, "RUNNING")
    await provider.start_replica(node.id, SPEC, replica_id="r1")

    async def interrupted():
        return [n for n in await provider.list() if n.state is NodeState.INTERRUPTED]
    [lost] = await eventually(interrupted, "the claim is given up", timeout_s=30, poll_s=0.3)
    assert lost.id == node.id and "no capacity" in lost.reason and "Slurm's reason" in lost.reason
    [replica] = await provider.list_replicas()
    assert replica.state is ReplicaState.FAILED and "pending for" in replica.reason
    await provider.delete(node.id)
    assert await provider.list() == []
    await eventually(lambda: cluster.live_jobs("kvgate.") == [], "no kvgate job is left", poll_s=0.3)


async def test_a_restarted_provider_adopts_its_jobs_and_touches_no_one_elses(cluster: SlurmCluster, tmp_path: Path) -> None:
    first = provider_for(cluster, tmp_path, "adopt")
    stranger = provider_for(cluster, tmp_path, "stranger")
    node = await first.create(claim())
    theirs = await stranger.create(claim())
    await first.start_replica(node.id, SPEC, replica_id="r1")
    await first.close()
    second = provider_for(cluster, tmp_path, "adopt")
    assert [n.id for n in await second.list()] == [node.id]
    handle = await ready_replica(second, "r1")
    assert handle.node_id == node.id
    await second.delete(node.id)
    assert [n.id for n in await stranger.list()] == [theirs.id]
    await eventually(lambda: [j["name"] for j in cluster.live_jobs("kvgate.")] == [
        f"kvgate.stranger.claim.{theirs.claim_id}"], "only the stranger's claim is left", poll_s=0.3)


async def test_the_ceiling_and_floor_price_what_inference_takes(cluster: SlurmCluster, tmp_path: Path) -> None:
    provider = SlurmProvider(POOL, sharing_spec(cluster, tmp_path / "logs", floor_gpus=1, ceiling_gpus=2),
                             cluster="ceiling", clock=RealClock())
    offers = {o.instance_type: o for o in await provider.offerings()}
    assert offers["h100x1+training"].price_usd_per_hour == 1.5, "within the floor: the free price"
    assert offers["h100x2+training"].price_usd_per_hour == 5.0
    assert not offers["h100x4"].available, "past the ceiling"
    await provider.create(claim("h100x2"))
    with pytest.raises(QuotaExceeded, match="ceiling_gpus is 2"):
        await provider.create(claim("h100x1"))


async def test_an_unreachable_slurmctld_is_provider_unavailable(cluster: SlurmCluster, tmp_path: Path) -> None:
    conf = tmp_path / "elsewhere.conf"
    conf.write_text("\n".join(f"SlurmctldPort=1" if line.startswith("SlurmctldPort=") else line
                              for line in cluster.conf.read_text().splitlines()) + "\n")
    provider = provider_for(cluster, tmp_path, conf=str(conf))
    for call in (provider.offerings, provider.list):  # sinfo and squeue; each retries for ~9 s first
        with pytest.raises(ProviderUnavailable):
            await call()


PLANNER_REGISTRY = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: chat}}
spec:
  source: builtin:tiny-llama
  resources: {{gpu_kinds: [H100], gpu_count: 1}}
  scaling: {{min_replicas: 0, max_replicas: 4, max_queue_wait_s: 60}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: {pool}}}
spec:
  provider: slurm
  slurm:
    partition: inference
    gpu_hour_usd: 1.5
    gpu_types: {{h100: {{kind: H100, memory_gib: 80}}}}
    conf: "{conf}"
    sharing: {{partitions: [training], gpu_hour_usd: 2.5, ceiling_gpus: {ceiling}, grace_time_s: 10}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: cloud}}
spec:
  provider: fake
  offers: [{{instance_type: h100-1, gpu_kind: H100, gpu_count: 1, gpu_memory_gib: 80, price_usd_per_hour: 4.0}}]
"""


@pytest.mark.parametrize("training, ceiling, bought", [
    (False, 4, f"{POOL}:h100x1:on_demand"),  # free GPUs first
    (True, 4, f"{POOL}:h100x1+training:on_demand"),  # then training's, before the cloud's
    (True, 0, "cloud:h100-1:on_demand"),  # inference may take none here: the cloud
])
async def test_the_planner_takes_free_gpus_then_trainings_then_a_clouds(
        cluster: SlurmCluster, tmp_path: Path, training: bool, ceiling: int, bought: str) -> None:
    from kvgate.autoscaler.planner import CreateNode, PlannerInputs, PlannerState, plan_nodes
    from kvgate.providers.base import offerings_from_pool
    from kvgate.registry import load_registry

    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "fleet.yaml").write_text(PLANNER_REGISTRY.format(pool=POOL, conf=cluster.conf,
                                                                             ceiling=ceiling))
    snapshot = load_registry(tmp_path / "registry")
    provider = SlurmProvider(POOL, snapshot.pools[POOL].spec, cluster="planner", clock=RealClock())
    if training:
        cluster.wait_state(cluster.submit_training(gpus=4), "RUNNING")
    offers = (*await provider.offerings(), *offerings_from_pool("cloud", snapshot.pools["cloud"].spec))
    inputs = PlannerInputs(snapshot, {"chat": 1}, (), (), tuple(offers), id_prefix="t")
    _, actions = plan_nodes(inputs, PlannerState(), now=time.time())
    assert [str(a.claim.offering) for a in actions if isinstance(a, CreateNode)] == [bought]


async def test_other_users_jobs_and_bytes_are_not_taken_for_kvgates(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Anyone on the cluster can write a comment kvgate would write; squeue --json lists every user's jobs."""
    import asyncio
    import subprocess

    from kvgate.providers.slurm_jobs import CLAIM, Tags

    provider = provider_for(cluster, tmp_path, "victim")
    forged = Tags(kind=CLAIM, cluster="victim", pool=POOL, claim="forged", instance_type="h100x4", usd_per_hour=-1000)
    for comment in (forged.comment(), "caf\xe9 not utf-8"):
        argv = ["runuser", "-u", "nobody", "--", "sbatch", "--hold", "--output=/dev/null", "--wrap=true",
                f"--job-name=kvgate.victim.claim.forged", f"--partition=inference"]
        done = subprocess.run([*argv, b"--comment=" + comment.encode("latin-1")], env=cluster.env,
                              capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert await provider.list() == []
    assert {o.instance_type for o in await provider.offerings() if o.available} >= {"h100x4"}
    # Two creates and two starts for one id, at once: one held job, one replica job.
    mine = claim()
    first, second = await asyncio.gather(provider.create(mine), provider.create(mine))
    assert first.id == second.id and [n.id for n in await provider.list()] == [first.id]
    await asyncio.gather(*(provider.start_replica(first.id, SPEC, replica_id="r1") for _ in range(2)))
    assert len(cluster.live_jobs("kvgate.victim.r1")) == 1
    await provider.stop_replica("r1", drain_deadline_s=5)
    await provider.stop_replica("r1", drain_deadline_s=5)  # stopped already: succeeds
    with pytest.raises(ProviderError, match="replica id"):
        await provider.start_replica(first.id, SPEC, replica_id="r1\ntouch /tmp/pwned")


async def test_a_grace_time_slurm_does_not_have_is_said_once(cluster: SlurmCluster, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    matching = provider_for(cluster, tmp_path, sharing=True)
    await matching.offerings()
    assert "grace_time_s" not in caplog.text
    wrong = SlurmProvider(POOL, sharing_spec(cluster, tmp_path / "logs", grace_time_s=60), cluster="g",
                          clock=RealClock())
    await wrong.offerings()
    await wrong.offerings()
    assert caplog.text.count("sharing.grace_time_s is 60 s but partition 'training' has GraceTime=10") == 1
