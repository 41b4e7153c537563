"""The whole path on a real Slurm cluster: `kvgate autoscaler` buys a claim in a Slurm pool and starts the
model's replica as a batch job, `kvgate router` serves a request from it, and a restarted autoscaler adopts
the jobs instead of starting new ones (checked with squeue). Real redis-server, real slurmctld/slurmd
(tests/slurm_cluster.py: fake H100s, so the engine runs on the CPU), official openai SDK.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from kvgate.clock import RealClock
from kvgate.state import RedisStateStore
from tests.eventually import eventually_sync
from tests.services import free_loopback_port, http_answers, kvgate_command, running
from tests.slurm_cluster import SlurmCluster

REGISTRY = """\
apiVersion: kvgate/v1
kind: Model
metadata: {{name: tiny-llama}}
spec:
  source: builtin:tiny-llama
  resources: {{gpu_kinds: [H100], gpu_count: 1}}
  engine: {{max_model_len_tokens: 256, kv_cache_bytes: 16MiB}}
  scaling: {{min_replicas: 1, max_replicas: 1, max_queue_wait_s: 60}}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {{name: campus}}
spec:
  provider: slurm
  node_boot_s: 0
  slurm:
    partition: inference
    gpu_hour_usd: 1.5
    gpu_types: {{h100: {{kind: H100, memory_gib: 80}}}}
    conf: "{conf}"
    log_dir: "{logs}"
    device: cpu
    sharing: {{partitions: [training], gpu_hour_usd: 2.5, ceiling_gpus: 2, grace_time_s: 10}}
"""


SCALE_TO_ZERO = "min_replicas: 0, scale_to_zero_grace_s: 0, scale_down_delay_s: 0, forecast_enabled: false,"


def ready_urls(redis_url: str, prefix: str) -> list[str]:
    async def read() -> list[str]:
        store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
        try:
            return [m.url for m in await store.list_members() if m.state.value == "ready"]
        finally:
            await store.close()
    return asyncio.run(read())


def kvgate_jobs(cluster: SlurmCluster) -> list[tuple[str, str, str]]:
    """(job id, name, state) of every live kvgate job, from squeue."""
    return sorted((str(j["job_id"]), j["name"], j["job_state"]) for j in cluster.live_jobs("kvgate."))


@contextmanager
def autoscaler(common: list[str], log: Path) -> Iterator[None]:
    port = free_loopback_port()
    with running([*kvgate_command(), "autoscaler", *common, "--interval-s", "0.5", "--metrics-port", str(port)],
                 name="kvgate autoscaler", timeout_s=60, ready=lambda: http_answers(f"http://127.0.0.1:{port}/health"),
                 log_path=log):
        yield


def test_a_slurm_replica_serves_through_the_gateway_and_a_new_autoscaler_adopts_it(
        slurm_cluster: SlurmCluster, redis_url: str, tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "fleet.yaml").write_text(REGISTRY.format(conf=slurm_cluster.conf, logs=tmp_path / "logs"))
    prefix = f"slurm-{uuid.uuid4().hex[:8]}:"
    common = ["--registry", str(registry), "--state", redis_url, "--key-prefix", prefix]
    gateway_port = free_loopback_port()
    try:
        with running([*kvgate_command(), "router", *common, "--port", str(gateway_port)], name="kvgate router",
                     timeout_s=60, ready=lambda: http_answers(f"http://127.0.0.1:{gateway_port}/health"),
                     log_path=tmp_path / "router.log"):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused", timeout=60)
            with autoscaler(common, tmp_path / "autoscaler-1.log"):
                [url] = eventually_sync(lambda: ready_urls(redis_url, prefix), "the Slurm replica is ready", 180,
                                        poll_s=0.5)
                answer = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
                assert answer.choices and answer.usage.completion_tokens >= 1
                before = kvgate_jobs(slurm_cluster)
                names = [name for _, name, _ in before]
                assert len(before) == 2 and sum(".claim." in n for n in names) == 1, before  # one claim, one replica
                assert [state for _, name, state in before if ".claim." not in name] == ["RUNNING"]
            # SIGTERM left the fleet for the next autoscaler (by design): the jobs run on.
            assert kvgate_jobs(slurm_cluster) == before
            with autoscaler(common, tmp_path / "autoscaler-2.log"):
                time.sleep(5)  # ten ticks: time to start (or leak) something if it were going to
                assert kvgate_jobs(slurm_cluster) == before, "adopted: the same jobs, nothing new"
                assert ready_urls(redis_url, prefix) == [url]
                answer = client.completions.create(model="tiny-llama", prompt="again", max_tokens=4)
                assert answer.choices
                # Scaled to zero (a registry reload): the replica job ends and its GPU goes back to Slurm; the
                # claim, a held job that holds no GPU, is released after the planner's empty-node grace.
                (registry / "fleet.yaml").write_text(REGISTRY.format(conf=slurm_cluster.conf, logs=tmp_path / "logs")
                                                     .replace("min_replicas: 1,", SCALE_TO_ZERO))
                eventually_sync(lambda: [n for _, n, _ in kvgate_jobs(slurm_cluster)] == [
                    n for _, n, _ in before if ".claim." in n], "only the claim is left", 60, poll_s=0.5)
                assert slurm_cluster.gpus_used() == 0
    finally:
        slurm_cluster.clean()
