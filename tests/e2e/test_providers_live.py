"""Each provider end to end through the live loop: the real `kvgate autoscaler` process goes from demand
(min_replicas: 1) to a node bought, a replica started with the model's spec, a READY membership record,
and a chat request served through a real `kvgate router`, over a real redis-server.

- **local**: every part is real; the replica is the `kvgate engine` process the local provider starts.
- **kubernetes**: the API is `kmock`, an emulator over real HTTP with no controllers; the test plays the
  controllers and the kubelet (see its docstring), and nothing else.
- **aws**: EC2 is a real `moto` server, which boots nothing. So the test plays the node, and only the
  node: it reads the cloud-init user data the autoscaler sent with the launch, checks that it installs
  kvgate from the pool's `aws.install` and runs the model's engine, runs that engine command itself, and
  then tags the instance `kvgate:replica-state=ready`, as the user data's register script would once
  /health answers. The pool's subnet lies in 127.64.0.0/16, so the private address moto gives the
  instance is one this machine answers on; the engine listens there on the user data's own ports. Three
  things differ from a real node, and only these: the `kvgate` command is this environment's instead of
  /opt/kvgate/bin/kvgate, `--host` is that private address instead of 0.0.0.0, and `--cache-dir` is a
  temporary folder instead of /var/cache/kvgate.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import yaml

from kvgate.providers.aws_userdata import ENGINE_GRPC_PORT, ENGINE_PORT, READY_TAG
from kvgate.providers.base import engine_args, replica_spec_for
from kvgate.providers.k8s_manifests import CACHE_DIR, object_name
from kvgate.clock import RealClock
from kvgate.registry import load_registry
from kvgate.state import RedisStateStore
from tests.providers.subject_kubernetes import NAMESPACE as K8S_NAMESPACE, NODE_POOL, kube_world
from tests.eventually import eventually, eventually_sync
from tests.registry_docs import local_pool, tiny_llama
from tests.services import free_loopback_port, http_answers, kvgate_command, running, stop_process

WHEEL_URL = "https://artifacts.example/kvgate/kvgate-0.1.0-py3-none-any.whl"


def chat(base_url: str) -> tuple[int, str]:
    """(status, the replica that answered) of one short chat completion through the gateway."""
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status, answer.headers.get("x-kvgate-replica", "")
    except urllib.error.HTTPError as error:
        return error.code, ""


def stop(process: subprocess.Popen) -> None:
    stop_process(process, timeout_s=30.0)


def members(redis_url: str, prefix: str) -> list[dict[str, Any]]:
    """The membership records as the gateways read them, through kvgate's own Redis store."""
    async def read() -> list[dict[str, Any]]:
        store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
        try:
            return [{"id": m.replica_id, "url": m.url, "state": m.state.value, "node": m.node_id}
                    for m in await store.list_members()]
        finally:
            await store.close()
    return asyncio.run(read())


def status_updated_at(redis_url: str, prefix: str) -> float | None:
    """When the autoscaler last wrote its status record (once per tick as leader), or None before it did."""
    async def read() -> float | None:
        store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)
        try:
            record = await store.get_record("autoscaler", "status")
            return None if record is None else record.data["updated_at"]
        finally:
            await store.close()
    return asyncio.run(read())


def flags(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of an argument list (every engine flag takes a value)."""
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


@contextmanager
def control_plane(tmp_path: Path, redis_url: str, registry: str, env: dict[str, str] | None = None
                  ) -> Iterator[tuple[str, str]]:
    """`kvgate autoscaler` and `kvgate router` on `registry` over one Redis key prefix; yields
    (gateway URL, key prefix). Both stop (SIGTERM) when the block ends."""
    (tmp_path / "registry").mkdir()
    (tmp_path / "registry" / "r.yaml").write_text(registry)
    prefix = f"live-{uuid.uuid4().hex[:8]}:"
    state = ["--state", redis_url, "--key-prefix", prefix]
    port = free_loopback_port()
    gateway = f"http://127.0.0.1:{port}"
    with open(tmp_path / "autoscaler.log", "wb") as log:
        autoscaler = subprocess.Popen(
            [*kvgate_command(), "autoscaler", "--registry", str(tmp_path / "registry"), *state,
             "--cluster", prefix.rstrip(":"), "--interval-s", "0.5"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        with running([*kvgate_command(), "router", "--registry", str(tmp_path / "registry"), "--port", str(port),
                      *state], name="kvgate router", ready=lambda: http_answers(gateway + "/health"), timeout_s=60,
                     log_path=tmp_path / "router.log"):
            yield gateway, prefix
            assert autoscaler.poll() is None, (tmp_path / "autoscaler.log").read_text()[-3000:]
    finally:
        stop(autoscaler)


def test_local_pool_from_demand_to_a_served_request(tmp_path: Path, redis_url: str) -> None:
    work_dir = tmp_path / "work"
    registry = tiny_llama() + local_pool(work_dir)
    try:
        with control_plane(tmp_path, redis_url, registry) as (gateway, prefix):
            [member] = eventually_sync(lambda: [m for m in members(redis_url, prefix) if m["state"] == "ready"],
                                       "a READY member", timeout_s=120, poll_s=0.2)  # ~6 s to load tiny-llama
            assert [p.name for p in (work_dir / "nodes").iterdir()], "no node (local slot) was taken"
            [record] = [json.loads(p.read_text()) for p in (work_dir / "replicas").glob("*.json")]
            assert record["id"] == member["id"] and member["node"] == record["node_id"]
            spec = replica_spec_for(load_registry(tmp_path / "registry").models["tiny-llama"])
            model_flags = ("--model", "--served-model-name", "--device", "--kv-cache-bytes", "--max-model-len")
            started, expected = flags(record["cmdline"]), flags(engine_args(spec, host="h", port=1))
            assert {f: started[f] for f in model_flags} == {f: expected[f] for f in model_flags}
            status, replica = eventually_sync(lambda: (lambda s, r: (s, r) if s == 200 else None)(*chat(gateway)),
                                              "a request served through the gateway", timeout_s=60, poll_s=0.2)
            assert replica == member["id"]
    finally:
        stop_local_replicas(work_dir)


def stop_local_replicas(work_dir: Path) -> None:
    """The autoscaler leaves replicas running on purpose when it stops; the test ends them."""
    for path in (work_dir / "replicas").glob("*.json") if (work_dir / "replicas").exists() else ():
        try:
            os.killpg(json.loads(path.read_text())["pgid"], 9)
        except (ProcessLookupError, KeyError, ValueError):
            pass


# ------------------------------------------------------------------------------------------------ aws


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


def aws_pool(ec2: Any, endpoint_url: str) -> str:
    """An EC2 pool on the moto server whose subnet is a fresh 127.64.N.0/24 (see the module docstring)."""
    image_id = ec2.register_image(Name=f"kvgate-{uuid.uuid4().hex[:6]}", RootDeviceName="/dev/sda1")["ImageId"]
    block = int(uuid.uuid4().int % 250) + 1
    vpc = ec2.create_vpc(CidrBlock=f"127.64.{block}.0/24")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"127.64.{block}.0/24")["Subnet"]["SubnetId"]
    return f"""apiVersion: kvgate/v1
kind: Pool
metadata: {{name: ec2}}
spec:
  provider: aws
  region: us-east-1
  max_nodes: 2
  node_boot_s: 0
  aws: {{endpoint_url: "{endpoint_url}", image_id: {image_id}, subnet_ids: [{subnet}],
         install: {{wheel_url: "{WHEEL_URL}"}}}}
  offers: [{{instance_type: m5.xlarge, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0.192}}]
"""


def instances_of(ec2: Any, cluster: str) -> list[dict[str, Any]]:
    answer = ec2.describe_instances(Filters=[{"Name": "tag:kvgate:cluster", "Values": [cluster]}])
    return [i for r in answer["Reservations"] for i in r["Instances"] if i["State"]["Name"] != "terminated"]


def node_script(user_data: str) -> tuple[list[str], list[str]]:
    """(the engine's argv, the pip install commands) that the node's cloud-init would run."""
    document = yaml.safe_load(user_data)
    files = {f["path"]: f["content"] for f in document["write_files"]}
    engine = shlex.split(files["/usr/local/bin/kvgate-engine"].split("exec ", 1)[1].replace("\\\n", " "))
    installs = [line for line in files["/usr/local/bin/kvgate-install"].splitlines() if "/bin/pip install" in line]
    return engine, installs


def test_aws_pool_from_demand_to_a_served_request(tmp_path: Path, redis_url: str, moto_endpoint_url: str) -> None:
    session = boto3.Session(region_name="us-east-1", **{k.lower(): v for k, v in AWS_ENV.items()
                                                        if k != "AWS_DEFAULT_REGION"})
    ec2 = session.client("ec2", endpoint_url=moto_endpoint_url)
    registry = tiny_llama() + aws_pool(ec2, moto_endpoint_url)
    node: subprocess.Popen | None = None
    cluster = ""
    try:
        with control_plane(tmp_path, redis_url, registry, env=AWS_ENV) as (gateway, prefix):
            cluster = prefix.rstrip(":")
            [instance] = eventually_sync(lambda: instances_of(ec2, cluster), "the autoscaler to buy a node",
                                         timeout_s=60, poll_s=0.2)
            raw = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"], Attribute="userData")
            argv, installs = node_script(base64.b64decode(raw["UserData"]["Value"]).decode())

            # The node installs kvgate from the pool's wheel, and runs the model's engine exactly.
            assert installs == [f"/opt/kvgate/bin/pip install --quiet 'kvgate[engine] @ {WHEEL_URL}'"]
            tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
            spec = replica_spec_for(load_registry(tmp_path / "registry").models["tiny-llama"])
            assert argv == ["/opt/kvgate/bin/kvgate", "engine", *engine_args(
                spec, host="0.0.0.0", port=ENGINE_PORT, grpc_port=ENGINE_GRPC_PORT, replica_id=tags["kvgate:claim"],
                cache_dir="/var/cache/kvgate", drain_timeout_s=30.0)]

            # Play the node: its engine on its private address, then the register script's tag.
            address = instance["PrivateIpAddress"]
            assert address.startswith("127.64."), address
            played = [*kvgate_command(), *argv[1:]]
            played[played.index("--host") + 1] = address
            played[played.index("--cache-dir") + 1] = str(tmp_path / "node-cache")
            with open(tmp_path / "node.log", "wb") as log:
                node = subprocess.Popen(played, stdout=log, stderr=subprocess.STDOUT)
            eventually_sync(lambda: http_answers(f"http://{address}:{ENGINE_PORT}/health") or node.poll() is not None,
                            "the node's engine to answer /health", timeout_s=120, poll_s=0.2)
            assert node.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
            ec2.create_tags(Resources=[instance["InstanceId"]], Tags=[{"Key": READY_TAG, "Value": "ready"}])

            [member] = eventually_sync(lambda: [m for m in members(redis_url, prefix) if m["state"] == "ready"],
                                       "the replica's READY membership", timeout_s=60, poll_s=0.2)
            assert member["url"] == f"http://{address}:{ENGINE_PORT}" and member["node"] == instance["InstanceId"]
            status, replica = eventually_sync(lambda: (lambda s, r: (s, r) if s == 200 else None)(*chat(gateway)),
                                              "a request served through the gateway", timeout_s=60, poll_s=0.2)
            assert replica == member["id"]
            ticks: set[float | None] = set()  # the one replica's node is enough: four more ticks buy nothing else

            def four_more_ticks() -> bool:
                ticks.add(status_updated_at(redis_url, prefix))
                return len(ticks - {None}) >= 5
            eventually_sync(four_more_ticks, "four more autoscaler ticks", poll_s=0.1)
            assert [i["InstanceId"] for i in instances_of(ec2, cluster)] == [instance["InstanceId"]]
    finally:
        if node is not None and node.poll() is None:
            stop(node)
        if cluster:
            ids = [i["InstanceId"] for i in instances_of(ec2, cluster)]
            if ids:
                ec2.terminate_instances(InstanceIds=ids)


# ----------------------------------------------------------------------------------------- kubernetes


def k8s_pool(kubeconfig: Path) -> str:
    """A Kubernetes pool on kmock that grows the Cluster API MachineDeployment `gpu-workers` (CPU nodes:
    tiny-llama needs no GPU)."""
    return f"""apiVersion: kvgate/v1
kind: Pool
metadata: {{name: k8s}}
spec:
  provider: kubernetes
  max_nodes: 2
  node_boot_s: 0
  kubernetes: {{namespace: {K8S_NAMESPACE}, kubeconfig: "{kubeconfig}", context: kmock, node_pool: {NODE_POOL},
               image: "localhost/kvgate:0.1.0-cpu"}}
  offers: [{{instance_type: cpu-8, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0.4}}]
"""


def stored(world: Any, resource: str, name: str) -> dict[str, Any] | None:
    """The object as kmock holds it (a plain copy), or None while there is none."""
    try:
        return json.loads(json.dumps(world.emulator.objects[resource, K8S_NAMESPACE, name].raw))
    except KeyError:
        return None


def started(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


async def test_kubernetes_pool_from_demand_to_a_served_request(tmp_path: Path, redis_url: str) -> None:
    """kmock stores objects and runs no controller, so the test plays three, each only where the autoscaler
    waits on it: the Cluster API controller (the MachineDeployment kvgate grew reports its machine ready),
    the ReplicaSet controller with the scheduler (a pod of the engine Deployment, labelled from its template,
    with a pod IP in 127.65.0.0/16 so this machine answers on it), and the kubelet (it runs the container's
    `command` and `args`, with the downward API's $(POD_NAME) filled in, and marks the pod Ready once /health
    answers, as the readiness probe would). The kubelet differs from a real one in three things only: the
    `kvgate` command is this environment's instead of the image's, `--host` is the pod IP instead of
    0.0.0.0, and `--cache-dir` is a temporary folder."""
    engine: subprocess.Popen | None = None
    processes: list[subprocess.Popen] = []
    store: RedisStateStore | None = None
    async with kube_world(tmp_path) as world:
        try:
            (tmp_path / "registry").mkdir()
            (tmp_path / "registry" / "r.yaml").write_text(tiny_llama() + k8s_pool(world.kubeconfig))
            prefix = f"live-{uuid.uuid4().hex[:8]}:"
            cluster = prefix.rstrip(":")
            state = ["--state", redis_url, "--key-prefix", prefix]
            port = free_loopback_port()
            gateway = f"http://127.0.0.1:{port}"
            registry = str(tmp_path / "registry")
            processes.append(started([*kvgate_command(), "autoscaler", "--registry", registry, *state,
                                      "--cluster", cluster, "--interval-s", "0.5"], tmp_path / "autoscaler.log"))
            processes.append(started([*kvgate_command(), "router", "--registry", registry, "--port", str(port),
                                      *state], tmp_path / "router.log"))
            store = RedisStateStore.from_url(redis_url, RealClock(), prefix=prefix)

            # The Cluster API controller: kvgate grew the node pool by one for its claim; the machine joins.
            await eventually(lambda: world.node_pool()["spec"]["replicas"] == 1, "the autoscaler to grow the node pool",
                             timeout_s=60, poll_s=0.2)
            assert list(json.loads(world.node_pool()["metadata"]["annotations"]["kvgate.io/claims"])) == [cluster]
            world.set_node_pool(status={"readyReplicas": 1})

            # The ReplicaSet controller and the scheduler: one pod of the engine Deployment kvgate made.
            name = object_name("kvgate", cluster, "tiny-llama", "k8s")
            deployment = await eventually(lambda: stored(world, "apps/v1/deployments", name), "the engine Deployment",
                                          timeout_s=60, poll_s=0.2)
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            spec = replica_spec_for(load_registry(tmp_path / "registry").models["tiny-llama"])
            assert container["image"] == "localhost/kvgate:0.1.0-cpu"
            assert [*container["command"], *container["args"]] == ["kvgate", "engine", *engine_args(
                spec, host="0.0.0.0", port=ENGINE_PORT, grpc_port=ENGINE_GRPC_PORT, replica_id="$(POD_NAME)",
                cache_dir=CACHE_DIR, drain_timeout_s=30.0)]
            pod_name, pod_ip = f"{name[:50]}-x7k2p", f"127.65.{uuid.uuid4().int % 250 + 1}.{uuid.uuid4().int % 250 + 1}"
            world.emulator.objects["v1/pods", K8S_NAMESPACE, pod_name] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": K8S_NAMESPACE, "creationTimestamp": "2026-11-27T00:00:00Z",
                             "labels": dict(deployment["spec"]["template"]["metadata"]["labels"])},
                "spec": {**deployment["spec"]["template"]["spec"], "nodeName": "cpu-worker-0"},
                "status": {"phase": "Running", "podIP": pod_ip, "conditions": [{"type": "Ready", "status": "False"}]}}

            # The kubelet: the container's command, then Ready once /health answers.
            argv = [*kvgate_command(), *container["command"][1:],
                    *(a.replace("$(POD_NAME)", pod_name) for a in container["args"])]
            argv[argv.index("--host") + 1] = pod_ip
            argv[argv.index("--cache-dir") + 1] = str(tmp_path / "pod-cache")
            engine = started(argv, tmp_path / "pod.log")
            await eventually(lambda: http_answers(f"http://{pod_ip}:{ENGINE_PORT}/health") or engine.poll() is not None,
                             "the pod's engine to answer /health", timeout_s=120, poll_s=0.2)
            assert engine.poll() is None, (tmp_path / "pod.log").read_text()[-3000:]
            world.emulator.objects["v1/pods", K8S_NAMESPACE, pod_name].patch(
                {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})

            async def ready_members() -> list[Any]:
                assert processes[0].poll() is None, (tmp_path / "autoscaler.log").read_text()[-3000:]
                return [m for m in await store.list_members() if m.state.value == "ready"]
            [member] = await eventually(ready_members, "a READY member", timeout_s=120, poll_s=0.2)
            assert member.url == f"http://{pod_ip}:{ENGINE_PORT}"
            bound = world.emulator.objects["v1/pods", K8S_NAMESPACE, pod_name].raw["metadata"]["labels"]
            assert bound["kvgate.io/replica"] == member.replica_id  # the provider bound the pod to the replica
            async def served() -> tuple[int, str] | None:
                answer = await asyncio.to_thread(chat, gateway)
                return answer if answer[0] == 200 else None
            answer = await eventually(served, "a request served through the gateway", timeout_s=60, poll_s=0.2)
            assert answer[1] == member.replica_id
        finally:
            if store is not None:
                await store.close()
            for process in [*processes, *([engine] if engine else [])]:
                if process.poll() is None:
                    await asyncio.to_thread(stop, process)
