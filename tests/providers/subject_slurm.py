"""The contract subject for SlurmProvider: two clusters on one real single-node Slurm cluster (the session's
`slurm_cluster`: four fake H100s in partition `inference`, tests/slurm_cluster.py).

Claims are held jobs, so created nodes are RUNNING at once and hold no GPU. `exhaust()` plays training
taking every GPU: a job holding all four runs in the `training` partition, so the free `h100x1` offering
is sold out (this pool has no `sharing` block, so it may not take them) and `create` must raise
InsufficientCapacity. Every job is cancelled when the test ends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgate.clock import RealClock
from kvgate.providers.base import CapacityType, InsufficientCapacity, NodeClaim, OfferingKey, ProviderError
from kvgate.providers.slurm import SlurmProvider
from kvgate.registry.schema import PoolSpec
from tests.providers.contract import ContractSubject
from tests.slurm_cluster import INFERENCE, TRAINING, SlurmCluster

POOL = "slurm-pool"


def pool_spec(cluster: SlurmCluster, log_dir: Path, **slurm: Any) -> PoolSpec:
    return PoolSpec.model_validate({
        "provider": "slurm", "max_nodes": 8,
        "slurm": {"partition": INFERENCE, "gpu_hour_usd": 1.5, "conf": str(cluster.conf), "device": "cpu",
                  "log_dir": str(log_dir), "gpu_types": {"h100": {"kind": "H100", "memory_gib": 80}}, **slurm}})


def sharing_spec(cluster: SlurmCluster, log_dir: Path, **sharing: Any) -> PoolSpec:
    """A pool that may take training's GPUs (grace as the test cluster's partition has it)."""
    from tests.slurm_cluster import GRACE_TIME_S
    return pool_spec(cluster, log_dir, pending_timeout_s=120,
                     sharing={"partitions": [TRAINING], "gpu_hour_usd": 2.5, "grace_time_s": GRACE_TIME_S, **sharing})


def claim(instance_type: str = "h100x1", model: str = "tiny-llama") -> NodeClaim:
    return NodeClaim(id=f"claim-{uuid.uuid4().hex[:10]}", model=model,
                     offering=OfferingKey(POOL, instance_type, CapacityType.ON_DEMAND))


@asynccontextmanager
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[ContractSubject]:
    cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
    spec = pool_spec(cluster, request.getfixturevalue("tmp_path") / "logs")
    clock = RealClock()
    provider = SlurmProvider(POOL, spec, cluster=f"a-{uuid.uuid4().hex[:6]}", clock=clock)
    other = SlurmProvider(POOL, spec, cluster=f"b-{uuid.uuid4().hex[:6]}", clock=clock)

    async def exhaust() -> tuple[NodeClaim, type[ProviderError]]:
        job = cluster.submit_training(gpus=4)
        cluster.wait_state(job, "RUNNING")
        return claim(), InsufficientCapacity

    try:
        yield ContractSubject(provider=provider, other_cluster=other, new_claim=claim, exhaust=exhaust)
    finally:
        cluster.clean()
