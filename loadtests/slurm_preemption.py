"""How long inference waits for training's GPUs on a shared Slurm cluster, and how soon training gets them back.

    python loadtests/slurm_preemption.py [--cycles 3] [--json out.json]

Starts its own single-node Slurm as root (tests/slurm_cluster.py: four fake H100s, partitions `inference`
and `training` with PreemptMode=REQUEUE, GraceTime 10 s), then per cycle: a training job takes all four
GPUs; kvgate's slurm provider claims one GPU from training and starts a `builtin:tiny-llama` replica (on the
CPU); the replica is stopped and the claim released. Prints per cycle, and the median: replica submitted ->
training requeued, -> replica ready, and replica stopped -> training running again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.clock import RealClock  # noqa: E402
from kvgate.providers.base import CapacityType, NodeClaim, OfferingKey, ReplicaSpec, ReplicaState  # noqa: E402
from kvgate.providers.slurm import SlurmProvider  # noqa: E402
from kvgate.registry.schema import PoolSpec  # noqa: E402
from tests.slurm_cluster import GRACE_TIME_S, INFERENCE, TRAINING, SlurmCluster, slurm_cluster  # noqa: E402

SPEC = ReplicaSpec(model="tiny-llama", source="builtin:tiny-llama", gpu_count=1, max_model_len=256,
                   kv_cache_bytes=16 * 2 ** 20)


def state_of(cluster: SlurmCluster, job_id: str) -> str:
    return next((j["job_state"] for j in cluster.jobs() if str(j["job_id"]) == job_id), "GONE")


async def until(condition, timeout_s: float = 300.0) -> float:
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("gave up waiting")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def cycle(cluster: SlurmCluster, provider: SlurmProvider, index: int) -> dict[str, float]:
    training = cluster.submit_training(gpus=4, name=f"train{index}")
    cluster.wait_state(training, "RUNNING")
    node = await provider.create(NodeClaim(id=f"bench-{index}", model="tiny-llama",
                                           offering=OfferingKey(provider.pool, "h100x1+training", CapacityType.ON_DEMAND)))
    submitted = time.monotonic()
    await provider.start_replica(node.id, SPEC, replica_id=f"r{index}")

    async def requeued() -> bool:
        return state_of(cluster, training) == "PENDING"

    async def ready() -> bool:
        return any(h.id == f"r{index}" and h.state is ReplicaState.READY for h in await provider.list_replicas())

    to_requeue = await until(requeued)
    await until(ready)
    to_ready = time.monotonic() - submitted
    stopped = time.monotonic()
    await provider.stop_replica(f"r{index}", drain_deadline_s=20)
    await provider.delete(node.id)

    async def training_back() -> bool:
        return state_of(cluster, training) == "RUNNING"

    await until(training_back)
    back = time.monotonic() - stopped
    cluster.clean()
    return {"to_training_requeued_s": round(to_requeue, 1), "to_replica_ready_s": round(to_ready, 1),
            "stop_to_training_running_s": round(back, 1)}


async def main(cycles: int, out: str | None) -> None:
    with tempfile.TemporaryDirectory() as root, slurm_cluster(Path(root)) as cluster:
        spec = PoolSpec.model_validate({"provider": "slurm", "slurm": {
            "partition": INFERENCE, "gpu_hour_usd": 1.5, "conf": str(cluster.conf), "device": "cpu",
            "log_dir": f"{root}/logs", "gpu_types": {"h100": {"kind": "H100"}},
            "sharing": {"partitions": [TRAINING], "gpu_hour_usd": 2.5, "grace_time_s": GRACE_TIME_S}}})
        provider = SlurmProvider("bench", spec, cluster="bench", clock=RealClock())
        rows = []
        print(f"GraceTime {GRACE_TIME_S} s; {cycles} cycles", flush=True)
        print(f"{'cycle':>5} {'-> requeued s':>14} {'-> ready s':>11} {'stop -> training back s':>24}")
        for index in range(cycles):
            row = await cycle(cluster, provider, index)
            rows.append(row)
            print(f"{index:>5} {row['to_training_requeued_s']:>14} {row['to_replica_ready_s']:>11} "
                  f"{row['stop_to_training_running_s']:>24}", flush=True)
        medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{'median':>5} {medians['to_training_requeued_s']:>14} {medians['to_replica_ready_s']:>11} "
              f"{medians['stop_to_training_running_s']:>24}")
        if out:
            Path(out).write_text(json.dumps({"grace_time_s": GRACE_TIME_S, "cycles": rows, "median": medians}, indent=1))
            print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    asyncio.run(main(args.cycles, args.json))
