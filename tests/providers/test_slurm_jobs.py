"""The slurm provider's pure rules (providers/slurm_jobs.py): comments, gres, offerings and their prices,
job states as replica states, the replica's batch script."""

from __future__ import annotations

from kvgate.providers.base import ReplicaState
from kvgate.providers.slurm_jobs import (
    CLAIM, Capacity, Job, SlurmNode, Tags, capacity, gres_gpus, lost_claims, offerings, parse_comment, parse_instance_type,
    parse_jobs, replica_script, replica_state, sizes,
)
from kvgate.registry.slurm import SlurmSettings

SETTINGS = SlurmSettings.model_validate({
    "partition": "inference", "gpu_hour_usd": 1.0, "gpu_types": {"h100": {"kind": "H100", "memory_gib": 80}},
    "sharing": {"partitions": ["training"], "gpu_hour_usd": 3.0, "floor_gpus": 2, "ceiling_gpus": 6}})


def job(state: str = "RUNNING", *, partition: str = "training", gpus: int = 0, node: str = "n1", submit: float = 0,
        comment: str = "", reason: str = "None", requeue: bool = True, exit_code: int = 0) -> Job:
    return parse_jobs({"jobs": [{
        "job_id": 7, "name": "x", "job_state": state, "state_reason": reason, "partition": partition,
        "requeue": requeue, "user_id": 0, "exit_code": exit_code,
        "batch_host": node, "submit_time": submit, "comment": comment,
        "gres_detail": [f"gpu:h100:{gpus}(IDX:0-{gpus - 1})"] if gpus else [],
        "job_resources": {"allocated_nodes": [{"nodename": node}]} if gpus else {}}]})[0]


def test_a_comment_carries_the_tags_the_endpoint_and_the_stop_mark() -> None:
    tags = Tags(kind=CLAIM, cluster="c", pool="p", claim="k1", instance_type="h100x2", labels={"a": "b'c"})
    assert parse_comment(tags.comment()) == (tags, None, False)
    assert parse_comment(tags.comment() + " port=8001 grpc=8002") == (tags, (8001, 8002), False)
    assert parse_comment(tags.comment() + " port=8001 grpc=8002 stopping") == (tags, (8001, 8002), True)
    assert parse_comment("someone else's words") == (None, None, False)
    assert parse_comment("kvgate/v1 {broken") == (None, None, False)
    forged = Tags(kind="replica", cluster="c", pool="p", claim="k1", replica="/var/log/dpkg").comment()
    assert parse_comment(forged) == (None, None, False), "an id that could be a path is not kvgate's"


def test_gres_strings_and_instance_types() -> None:
    assert gres_gpus("gpu:h100:3(IDX:0-2)") == ("h100", 3)
    assert gres_gpus("craynetwork:1,gpu:a100:8(S:0-1)") == ("a100", 8)
    assert gres_gpus("(null)") is None
    assert sizes(8) == [1, 2, 4, 8] and sizes(6) == [1, 2, 4, 6] and sizes(1) == [1] and sizes(0) == []
    assert parse_instance_type("h100x2+training") == ("h100", 2, True)
    assert parse_instance_type("h100x2") == ("h100", 2, False)
    assert parse_instance_type("p5.48xlarge") is None and parse_instance_type("h100x0") is None


def test_capacity_counts_free_gpus_and_those_preemptible_training_holds() -> None:
    nodes = [SlurmNode("n1", "10.0.0.1", ("inference", "training"), "mixed", "h100", 4, 3),
             SlurmNode("n2", "10.0.0.2", ("inference",), "idle drain", "h100", 4, 0),
             SlurmNode("n3", "10.0.0.3", ("other",), "idle", "h100", 8, 0)]
    jobs = [job(gpus=2, node="n1"), job(gpus=1, node="n1", partition="inference"), job("PENDING", gpus=0),
            job(gpus=1, node="n1", requeue=False)]  # --no-requeue: preempting it would kill it, so not takeable
    assert capacity(SETTINGS, nodes, jobs) == {"h100": Capacity(per_node=4, free=1, takeable=3, free_total=1,
                                                                takeable_total=3)}


def test_offerings_price_free_gpus_then_trainings_within_the_floor_and_ceiling() -> None:
    have = {"h100": Capacity(per_node=4, free=1, takeable=4, free_total=1, takeable_total=4)}
    offers = {o.instance_type: o for o in offerings("p", SETTINGS, have, claimed=1, unfilled=0)}
    assert sorted(offers) == ["h100x1", "h100x1+training", "h100x2", "h100x2+training", "h100x4",
                              "h100x4+training"], "every size, sold out or not"
    assert offers["h100x1"].available and offers["h100x1"].price_usd_per_hour == 1.0
    assert not offers["h100x2"].available, "one GPU is free"
    assert offers["h100x1+training"].price_usd_per_hour == 1.0, "1 + 1 <= floor 2: the free price"
    assert offers["h100x2+training"].price_usd_per_hour == 6.0 and offers["h100x2+training"].available
    assert offers["h100x4+training"].available, "1 + 4 <= ceiling 6"
    assert offers["h100x4"].gpu_kind == "H100" and offers["h100x4"].gpu_memory_gib == 80
    promised = {o.instance_type: o for o in offerings("p", SETTINGS, have, claimed=1, unfilled=1)}
    assert not promised["h100x1"].available, "the free GPU is promised to a claim without its replica yet"
    assert not promised["h100x4+training"].available, "4 takeable, 1 of them promised"
    full = {o.instance_type: o for o in offerings("p", SETTINGS, have, claimed=5, unfilled=0)}
    assert full["h100x1+training"].available and not full["h100x2+training"].available, "ceiling 6"


def test_job_states_as_replica_states() -> None:
    assert replica_state(job("PENDING", submit=100, reason="Resources"), now=150, pending_timeout_s=60) == (
        ReplicaState.STARTING, "")
    state, why = replica_state(job("PENDING", submit=100, reason="Resources"), now=200, pending_timeout_s=60)
    assert state is ReplicaState.FAILED and "pending for 100 s" in why and "Resources" in why
    assert replica_state(job("RUNNING"), now=0, pending_timeout_s=60)[0] is ReplicaState.STARTING
    state, why = replica_state(job("CANCELLED"), now=0, pending_timeout_s=60)
    assert state is ReplicaState.FAILED and "cancelled outside kvgate" in why
    state, why = replica_state(job("FAILED", exit_code=3 << 8), now=0, pending_timeout_s=60)
    assert state is ReplicaState.FAILED and "ended: FAILED" in why and "exit code 3)" in why
    assert "signal 9)" in replica_state(job("FAILED", exit_code=9), now=0, pending_timeout_s=60)[1]
    state, why = replica_state(job("PREEMPTED"), now=0, pending_timeout_s=60)
    assert state is ReplicaState.FAILED and "was preempted" in why
    stopped = job("CANCELLED", comment=Tags(kind="replica", cluster="c", pool="p", claim="k").comment() + " stopping")
    assert replica_state(stopped, now=0, pending_timeout_s=60) == (ReplicaState.STOPPED, "")


def test_claims_slurm_will_not_serve_are_lost() -> None:
    tags = Tags(kind="replica", cluster="c", pool="p", claim="k1").comment()
    pending = job("PENDING", submit=0, comment=tags, reason="Resources")
    assert lost_claims([pending], now=30, pending_timeout_s=60) == {}
    assert "no capacity" in lost_claims([pending], now=90, pending_timeout_s=60)["k1"]
    assert "was preempted" in lost_claims([job("PREEMPTED", comment=tags)], now=0, pending_timeout_s=60)["k1"]
    assert lost_claims([job("PREEMPTED", comment=tags + " stopping")], now=0, pending_timeout_s=60) == {}


def test_the_replica_script_execs_the_engine_on_the_ports_it_publishes() -> None:
    comment = Tags(kind="replica", cluster="c", pool="p", claim="k", labels={"x": "it's"}).comment()
    script = replica_script("/opt/kvgate/bin/python", ["--model", "builtin:tiny-llama"], comment, "r1")
    assert script.startswith("#!/bin/bash\n")
    assert "exec \"$PY\" -m kvgate.engine --model builtin:tiny-llama --port \"$PORT\"" in script
    assert "Comment='kvgate/v1 " in script and "\" port=$PORT grpc=$GRPC_PORT\"" in script


def test_the_readmes_slurm_pool_loads(tmp_path) -> None:
    import re
    from pathlib import Path

    from kvgate.registry import load_registry

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Sharing a Slurm cluster with training"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)[1]
    (tmp_path / "pool.yaml").write_text(block)
    pool = load_registry(tmp_path).pools["campus"].spec
    assert pool.slurm.sharing.ceiling_gpus == 32 and pool.slurm.gpu_types["h100"].kind == "H100"


def test_slurm_pools_are_checked_where_they_are_written() -> None:
    import pytest
    from pydantic import ValidationError

    from kvgate.registry.schema import PoolSpec

    base = {"partition": "inference", "gpu_hour_usd": 1.0, "gpu_types": {"h100": {"kind": "H100"}}}
    cases = [
        ({"provider": "slurm"}, "needs a slurm block"),
        ({"provider": "slurm", "slurm": base, "offers": [{"instance_type": "x", "gpu_kind": "H100", "gpu_count": 1,
                                                          "price_usd_per_hour": 1}]}, "lists no offers"),
        ({"provider": "local"}, "at least one offer"),
        ({"provider": "slurm", "slurm": {**base, "partition": "a b"}}, "not a Slurm name"),
        ({"provider": "slurm", "slurm": {**base, "sbatch_args": ["-A x"]}}, "long options"),
        ({"provider": "slurm", "slurm": {**base, "sharing": {"partitions": ["t"], "gpu_hour_usd": 2, "floor_gpus": 4,
                                                             "ceiling_gpus": 2}}}, "above ceiling_gpus"),
        ({"provider": "slurm", "slurm": {**base, "pending_timeout_s": 30, "sharing": {
            "partitions": ["t"], "gpu_hour_usd": 2, "grace_time_s": 60}}}, "not above the grace time"),
        ({"provider": "slurm", "slurm": {**base, "sharing": {"partitions": ["inference"], "gpu_hour_usd": 2}}},
         "the pool's own partition"),
    ]
    for document, words in cases:
        with pytest.raises(ValidationError, match=words):
            PoolSpec.model_validate(document)


def test_the_pools_grace_is_checked_against_slurms() -> None:
    from kvgate.providers.slurm_jobs import grace_mismatch, grace_times

    shown = ("PartitionName=inference AllowGroups=ALL GraceTime=0 PreemptMode=OFF\n"
             "PartitionName=training AllowGroups=ALL GraceTime=120 PreemptMode=REQUEUE\n")
    assert grace_times(shown) == {"inference": 0.0, "training": 120.0}
    assert grace_mismatch(SETTINGS, {"training": 60.0}) == ""
    assert grace_mismatch(SETTINGS, {"training": 120.0}) == (
        "sharing.grace_time_s is 60 s but partition 'training' has GraceTime=120")
    assert "no partition 'training'" in grace_mismatch(SETTINGS, {})
