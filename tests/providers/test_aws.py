"""AwsProvider against a real `moto` server process (boto3 over real HTTP, the `moto_endpoint_url`
session fixture), plus its pure parts (user data, state and error mapping) without a network.

moto models instances, tags, spot lifecycle, terminate and instance types, so those are asserted as
EC2 stores them. moto never produces capacity, quota or throttling errors, nor scheduled events, so
those are injected at the boto3 boundary with a botocore `before-send` hook (`ErrorInjector`) that
answers in EC2's own XML, which botocore then parses exactly as it would AWS's answer.
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import os
import shlex
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import yaml
from botocore.awsrequest import AWSResponse

from kvgate.clock import FakeClock
from kvgate.providers.aws import AwsProvider
from kvgate.providers.aws_ec2 import node_state
from kvgate.providers.aws_userdata import READY_TAG, render_user_data, user_data_payload
from kvgate.providers.base import (
    TAG_CLAIM, TAG_CLUSTER, TAG_MODEL, TAG_POOL, TAG_REPLICA, CapacityType, InsufficientCapacity, NodeClaim, NodeNotReady,
    NodeState, ProviderError, ProviderUnavailable, QuotaExceeded, ReplicaSpec, ReplicaState, engine_args,
)
from kvgate.registry.schema import KvgateInstall
from tests.providers.subject_aws import POOL, ErrorInjector, _Raw, claim, moto_session, pool_spec

SPEC = ReplicaSpec(model="tiny-llama", source="builtin:tiny-llama", max_model_len=512,
                   adapters=(("sql lora", "s3://bucket/sql"),))


class World:
    """One provider on the moto server, the raw EC2 client for checking what EC2 stored, the hook
    that injects errors, and the waits the provider asked its (injected) sleep for."""

    def __init__(self, endpoint_url: str, **spec_extra: object) -> None:
        self.session = moto_session()
        self.injector = ErrorInjector(self.session)
        self.spec = pool_spec(self.session, endpoint_url, **spec_extra)
        self.ec2 = self.session.client("ec2", endpoint_url=endpoint_url)
        self.clock = FakeClock()
        self.sleeps: list[float] = []
        self.cluster = f"t-{uuid.uuid4().hex[:8]}"
        self.provider = self.make_provider()

    def make_provider(self) -> AwsProvider:
        async def sleep(seconds: float) -> None:
            self.sleeps.append(seconds)
        return AwsProvider(POOL, self.spec, cluster=self.cluster, clock=self.clock, session=self.session, sleep=sleep)

    def instance(self, instance_id: str) -> dict:
        return self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


@pytest.fixture
async def world(moto_endpoint_url: str) -> AsyncIterator[World]:
    world = World(moto_endpoint_url)
    yield world
    for node in await world.provider.list():
        await world.provider.delete(node.id)
    await world.provider.close()


async def test_on_demand_and_spot_creates_are_tagged_and_placed(world: World) -> None:
    on_demand = await world.provider.create(claim(model="tiny-llama"))
    spot_claim = NodeClaim(id=f"claim-{uuid.uuid4().hex[:8]}", offering=claim(CapacityType.SPOT, "us-east-1b").offering,
                           model="tiny-llama", replica=SPEC, labels={"team": "search"})
    spot = await world.provider.create(spot_claim)

    stored_od, stored_spot = world.instance(on_demand.id), world.instance(spot.id)
    assert "InstanceLifecycle" not in stored_od and on_demand.capacity_type is CapacityType.ON_DEMAND
    assert stored_spot["InstanceLifecycle"] == "spot" and spot.capacity_type is CapacityType.SPOT
    assert stored_spot["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert stored_od["InstanceType"] == stored_spot["InstanceType"] == "g5.xlarge"
    tags = {t["Key"]: t["Value"] for t in stored_spot["Tags"]}
    assert tags == {TAG_CLUSTER: world.cluster, TAG_CLAIM: spot_claim.id, TAG_POOL: POOL, TAG_MODEL: "tiny-llama",
                    TAG_REPLICA: spot_claim.id, "team": "search"}
    assert stored_spot["ImageId"] == world.spec.aws.image_id
    # The boot replica's cloud-init travelled with the launch; the node without a replica got none.
    user_data = world.ec2.describe_instance_attribute(InstanceId=spot.id, Attribute="userData")["UserData"]["Value"]
    assert base64.b64decode(user_data).decode().startswith("#cloud-config\n")
    assert "Value" not in world.ec2.describe_instance_attribute(InstanceId=on_demand.id, Attribute="userData")["UserData"]


async def test_create_is_idempotent_across_a_restart(world: World) -> None:
    the_claim = claim()
    first = await world.provider.create(the_claim)
    again = await world.provider.create(the_claim)
    restarted = world.make_provider()  # a new kvgate process: nothing in memory, the tags remember
    after_restart = await restarted.create(the_claim)
    await restarted.close()
    assert first.id == again.id == after_restart.id
    mine = world.ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_CLAIM}", "Values": [the_claim.id]}])
    assert sum(len(r["Instances"]) for r in mine["Reservations"]) == 1
    assert world.injector.seen["RunInstances"] == 1


async def test_list_and_terminate(world: World) -> None:
    a, b = await world.provider.create(claim()), await world.provider.create(claim(CapacityType.SPOT, "us-east-1a"))
    listed = {n.id: n for n in await world.provider.list()}
    assert set(listed) == {a.id, b.id}
    assert all(n.state is NodeState.RUNNING and n.address for n in listed.values())  # moto runs them at once
    assert listed[b.id].price_usd_per_hour >= 0 and listed[a.id].price_usd_per_hour == 1.006
    await world.provider.delete(a.id)
    await world.provider.delete(a.id)
    await world.provider.delete("i-0123456789abcdef0")  # never existed
    assert world.instance(a.id)["State"]["Name"] == "terminated"
    states = {n.id: n.state for n in await world.provider.list()}
    assert states == {a.id: NodeState.TERMINATED, b.id: NodeState.RUNNING}


async def test_delete_leaves_another_clusters_instance_alone(world: World) -> None:
    other = AwsProvider(POOL, world.spec, cluster="someone-else", clock=world.clock, session=world.session)
    theirs = await other.create(claim())
    try:
        await world.provider.delete(theirs.id)
        assert world.instance(theirs.id)["State"]["Name"] == "running"
    finally:
        await other.delete(theirs.id)
        await other.close()


@pytest.mark.parametrize("code,expected", [
    ("InsufficientInstanceCapacity", InsufficientCapacity),
    ("SpotMaxPriceTooLow", InsufficientCapacity),
    ("MaxSpotInstanceCountExceeded", InsufficientCapacity),
    ("InstanceLimitExceeded", QuotaExceeded),
    ("VcpuLimitExceeded", QuotaExceeded),
    ("UnauthorizedOperation", ProviderError),
])
async def test_launch_errors_are_mapped(world: World, code: str, expected: type[ProviderError]) -> None:
    """Injected: moto never sells out. The hook answers RunInstances with EC2's error XML for `code`."""
    world.injector.rules["RunInstances"] = lambda fields: code
    the_claim = claim(CapacityType.SPOT, "us-east-1a")
    with pytest.raises(expected) as raised:
        await world.provider.create(the_claim)
    assert type(raised.value) is expected and code in str(raised.value)
    if expected is InsufficientCapacity:
        assert raised.value.offering == the_claim.offering
    assert world.injector.seen["RunInstances"] == 1, "only throttling is retried"
    assert await world.provider.list() == []


async def test_a_stockout_is_flagged_until_it_expires(world: World) -> None:
    """Injected stockout; the flag lives `stockout_ttl_s` (180 s) on the provider's (fake) clock."""
    world.injector.rules["RunInstances"] = lambda fields: "InsufficientInstanceCapacity"
    sold_out = claim(CapacityType.SPOT, "us-east-1a")
    with pytest.raises(InsufficientCapacity):
        await world.provider.create(sold_out)
    flags = {o.key: o.available for o in await world.provider.offerings()}
    assert len(flags) == 3 and flags[sold_out.offering] is False and sum(flags.values()) == 2
    with pytest.raises(InsufficientCapacity):  # not even tried again while flagged
        await world.provider.create(claim(CapacityType.SPOT, "us-east-1a"))
    assert world.injector.seen["RunInstances"] == 1
    world.injector.rules.clear()
    await world.clock.advance(181)
    assert all(o.available for o in await world.provider.offerings())
    assert (await world.provider.create(claim(CapacityType.SPOT, "us-east-1a"))).state is NodeState.PENDING


async def test_throttling_is_retried_with_backoff_then_unavailable(world: World) -> None:
    """Injected throttling: the first two RunInstances answer RequestLimitExceeded, the third reaches moto."""
    remaining = [2]

    def throttle_twice(fields: dict[str, str]) -> str | None:
        remaining[0] -= 1
        return "RequestLimitExceeded" if remaining[0] >= 0 else None

    world.injector.rules["RunInstances"] = throttle_twice
    node = await world.provider.create(claim())
    assert world.sleeps == [0.5, 1.0] and node.state is NodeState.PENDING

    world.sleeps.clear()
    world.injector.rules["DescribeInstances"] = lambda fields: "Throttling"
    with pytest.raises(ProviderUnavailable) as raised:
        await world.provider.list()
    assert raised.value.retryable and world.sleeps == [0.5, 1.0, 2.0, 4.0]  # five tries, four waits
    world.injector.rules.clear()


def describe_instance_status_answer(instance_id: str, code: str, description: str) -> AWSResponse:
    body = f"""<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstanceStatusResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>test-0001</requestId>
  <instanceStatusSet><item>
    <instanceId>{instance_id}</instanceId><availabilityZone>us-east-1a</availabilityZone>
    <eventsSet><item><code>{code}</code><description>{description}</description>
      <notBefore>2026-01-01T00:00:00.000Z</notBefore></item></eventsSet>
    <instanceState><code>16</code><name>running</name></instanceState>
  </item></instanceStatusSet>
</DescribeInstanceStatusResponse>""".encode()
    return AWSResponse("https://ec2.test/", 200, {"Content-Type": "text/xml"}, _Raw(body))


async def test_a_scheduled_stop_event_shows_as_interrupted(world: World) -> None:
    """Injected: moto reports no scheduled events, so the hook answers DescribeInstanceStatus with one."""
    node = await world.provider.create(NodeClaim(id=f"claim-{uuid.uuid4().hex[:8]}", offering=claim().offering,
                                                 model="tiny-llama", replica=SPEC))
    world.injector.rules["DescribeInstanceStatus"] = lambda fields: describe_instance_status_answer(
        node.id, "instance-stop", "The instance is scheduled to stop")
    provider = world.provider
    try:
        [listed] = await provider.list()
        assert listed.state is NodeState.INTERRUPTED and "instance-stop" in listed.reason
        [replica] = await provider.list_replicas()
        assert replica.state is ReplicaState.FAILED and "taken back" in replica.reason
    finally:
        world.injector.rules.clear()


async def test_boot_replica_is_adopted_registered_and_stopped(world: World) -> None:
    node = await world.provider.create(NodeClaim(id=f"claim-{uuid.uuid4().hex[:8]}", offering=claim().offering,
                                                 model="tiny-llama", replica=SPEC))
    [starting] = await world.provider.list_replicas()
    assert starting.state is ReplicaState.STARTING and starting.url == f"http://{world.instance(node.id)['PrivateIpAddress']}:8000"
    handle = await world.provider.start_replica(node.id, SPEC, replica_id="r-1")
    assert handle.id == "r-1" and (await world.provider.start_replica(node.id, SPEC, replica_id="r-1")).id == "r-1"
    with pytest.raises(ProviderError):
        await world.provider.start_replica(node.id, SPEC, replica_id="r-2")  # one replica per node
    with pytest.raises(ProviderError):
        await world.provider.start_replica(node.id, ReplicaSpec(model="other", source="builtin:smollm2-135m"))
    # What the node's kvgate-register script does once /health answers:
    world.ec2.create_tags(Resources=[node.id], Tags=[{"Key": READY_TAG, "Value": "ready"}])
    [ready] = await world.provider.list_replicas()
    assert (ready.id, ready.state, ready.model, ready.grpc_target) == (
        "r-1", ReplicaState.READY, "tiny-llama", f"{world.instance(node.id)['PrivateIpAddress']}:50051")
    await world.provider.stop_replica("r-1")
    assert world.instance(node.id)["State"]["Name"] == "terminated"
    assert await world.provider.list_replicas() == []


async def test_start_replica_on_a_node_without_one_or_not_running(world: World) -> None:
    bare = await world.provider.create(claim())
    with pytest.raises(ProviderError, match="NodeClaim.replica"):
        await world.provider.start_replica(bare.id, SPEC)
    world.ec2.stop_instances(InstanceIds=[bare.id])
    with pytest.raises(NodeNotReady):
        await world.provider.start_replica(bare.id, SPEC)


async def test_pool_quota_is_enforced_before_buying(moto_endpoint_url: str) -> None:
    world = World(moto_endpoint_url, max_nodes=1)
    try:
        await world.provider.create(claim())
        with pytest.raises(QuotaExceeded, match="max_nodes"):
            await world.provider.create(claim())
        assert world.injector.seen["RunInstances"] == 1
    finally:
        for node in await world.provider.list():
            await world.provider.delete(node.id)
        await world.provider.close()


async def test_offerings_are_enriched_where_ec2_answers(world: World) -> None:
    offerings = await world.provider.offerings()
    assert len(offerings) == 3  # one on-demand, spot in two zones
    # The catalogue left cpus/memory/GPU memory unset; moto's instance-type data fills them.
    assert all(o.cpus == 4 and o.memory_gib == 16.0 and o.gpu_memory_gib > 20 for o in offerings)
    world.injector.rules["DescribeInstanceTypes"] = lambda fields: "InternalError"
    world.injector.rules["DescribeSpotPriceHistory"] = lambda fields: "UnauthorizedOperation"
    plain = await world.provider.offerings()
    assert [(o.cpus, o.price_usd_per_hour) for o in plain] == [(None, 1.006), (None, 0.45), (None, 0.45)]
    assert world.sleeps == [], "enrichment is tried once, never retried"


# ------------------------------------------------------------------------------------ pure parts


WHEEL = KvgateInstall(wheel_url="https://artifacts.example/kvgate-0.1.0-py3-none-any.whl")


def test_user_data_renders_valid_cloud_config_and_shell() -> None:
    text = render_user_data(SPEC, claim_id="claim-1", pool="gpu", cluster="prod", install=WHEEL, version="0.1.0",
                            drain_timeout_s=20)
    assert text.startswith("#cloud-config\n")
    document = yaml.safe_load(text)
    files = {f["path"]: f for f in document["write_files"]}
    assert set(files) == {"/usr/local/bin/kvgate-engine", "/etc/systemd/system/kvgate-engine.service",
                          "/usr/local/bin/kvgate-install", "/usr/local/bin/kvgate-register"}
    for path in ("/usr/local/bin/kvgate-engine", "/usr/local/bin/kvgate-install", "/usr/local/bin/kvgate-register"):
        checked = subprocess.run(["bash", "-n"], input=files[path]["content"], text=True, capture_output=True)
        assert checked.returncode == 0, f"{path}: {checked.stderr}"
    # The engine script runs exactly base.engine_args, quoting intact (an adapter name with a space).
    exec_line = files["/usr/local/bin/kvgate-engine"]["content"].split("exec ", 1)[1]
    argv = shlex.split(exec_line.replace("\\\n", " "))
    assert argv[:2] == ["/opt/kvgate/bin/kvgate", "engine"]
    assert argv[2:] == engine_args(SPEC, host="0.0.0.0", port=8000, grpc_port=50051, replica_id="claim-1",
                                   cache_dir="/var/cache/kvgate", drain_timeout_s=20)
    unit = files["/etc/systemd/system/kvgate-engine.service"]["content"]
    assert "ExecStart=/usr/local/bin/kvgate-engine" in unit and "TimeoutStopSec=25" in unit
    assert ["bash", "/usr/local/bin/kvgate-install"] in document["runcmd"]
    assert any("enable" in step and "kvgate-engine.service" in step for step in document["runcmd"])
    # A failed install is reported at once, not after the 30 min wait for /health.
    assert "trap 'touch /run/kvgate-install-failed' ERR" in files["/usr/local/bin/kvgate-install"]["content"]
    assert "if [ -e /run/kvgate-install-failed ]; then break; fi" in files["/usr/local/bin/kvgate-register"]["content"]
    with pytest.raises(ValueError, match="quote"):
        render_user_data(SPEC, claim_id="c", pool="gpu'; rm -rf /", cluster="prod", install=WHEEL, version="0.1.0")


def install_commands(text: str) -> list[list[str]]:
    """The argv of every pip install in the node's install script."""
    files = {f["path"]: f["content"] for f in yaml.safe_load(text)["write_files"]}
    return [shlex.split(line) for line in files["/usr/local/bin/kvgate-install"].splitlines()
            if line.split(" ", 1)[0].endswith("/pip")]


@pytest.mark.parametrize("install,expected_pip,expected_kvgate", [
    # A wheel: pip installs that file with the engine extra; its dependencies come from PyPI.
    (WHEEL, [["/opt/kvgate/bin/pip", "install", "--quiet",
              "kvgate[engine] @ https://artifacts.example/kvgate-0.1.0-py3-none-any.whl"]], "/opt/kvgate/bin/kvgate"),
    # An index: the only index pip uses, pinned to the version of the autoscaler that bought the node.
    (KvgateInstall(index_url="https://pypi.internal/simple"),
     [["/opt/kvgate/bin/pip", "install", "--quiet", "--index-url", "https://pypi.internal/simple",
       "kvgate[engine]==0.3.1"]], "/opt/kvgate/bin/kvgate"),
    (KvgateInstall(index_url="https://pypi.internal/simple", version="0.3.0"),
     [["/opt/kvgate/bin/pip", "install", "--quiet", "--index-url", "https://pypi.internal/simple",
       "kvgate[engine]==0.3.0"]], "/opt/kvgate/bin/kvgate"),
    # On the image already: nothing is installed at boot (the script checks it is there), the engine runs it.
    (KvgateInstall(preinstalled="/usr/local/bin/kvgate"), [], "/usr/local/bin/kvgate"),
])
def test_nodes_get_kvgate_from_where_the_pool_says_never_from_pypi_by_name(
        install: KvgateInstall, expected_pip: list[list[str]], expected_kvgate: str) -> None:
    text = render_user_data(SPEC, claim_id="claim-1", pool="gpu", cluster="prod", install=install, version="0.3.1")
    assert install_commands(text) == expected_pip
    engine = {f["path"]: f for f in yaml.safe_load(text)["write_files"]}["/usr/local/bin/kvgate-engine"]["content"]
    assert shlex.split(engine.split("exec ", 1)[1].replace("\\\n", " "))[:2] == [expected_kvgate, "engine"]


def test_the_install_script_finds_or_installs_a_python_of_at_least_3_11() -> None:
    # Ubuntu 22.04 (the default Deep Learning AMI) has python3 3.10, which kvgate does not run on.
    text = render_user_data(SPEC, claim_id="claim-1", pool="gpu", cluster="prod", install=WHEEL, version=None)
    script = {f["path"]: f["content"] for f in yaml.safe_load(text)["write_files"]}["/usr/local/bin/kvgate-install"]
    assert "sys.version_info < (3, 11)" in script and "apt-get install -y -q python3.11 python3.11-venv" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_an_install_that_fails_leaves_the_marker_the_register_script_reports(tmp_path) -> None:
    # Run the node's install script for an image that lacks the kvgate it should have; the marker goes to
    # a temporary path instead of /run.
    text = render_user_data(SPEC, claim_id="claim-1", pool="gpu", cluster="prod", version=None,
                            install=KvgateInstall(preinstalled=str(tmp_path / "no-such-kvgate")))
    script = {f["path"]: f["content"] for f in yaml.safe_load(text)["write_files"]}["/usr/local/bin/kvgate-install"]
    marker = tmp_path / "install-failed"
    ran = subprocess.run(["bash", "-c", script.replace("/run/kvgate-install-failed", str(marker))])
    assert ran.returncode != 0 and marker.exists()
    (tmp_path / "no-such-kvgate").write_text("#!/bin/sh\n")
    (tmp_path / "no-such-kvgate").chmod(0o755)
    marker.unlink()
    ran = subprocess.run(["bash", "-c", script.replace("/run/kvgate-install-failed", str(marker))])
    assert ran.returncode == 0 and not marker.exists()


@pytest.mark.parametrize("source", [
    "/models/a\nbootcmd: [[sh, -c, id]]\nx: |1 #",  # a newline would add a cloud-init key run as root
    "/models/a\u2028b", "/models/a\x85b", "/models/a\u200bb",  # line breaks to YAML; a format character
])
def test_a_value_that_could_reshape_the_user_data_is_refused(source: str) -> None:
    spec = ReplicaSpec(model="m", source=source)
    with pytest.raises(ValueError, match="line break or control character"):
        render_user_data(spec, claim_id="c", pool="gpu", cluster="prod", install=WHEEL, version="0.1.0")
    with pytest.raises(ValueError, match="line break or control character"):
        render_user_data(SPEC, claim_id="c", pool="gpu", cluster="prod", version="0.1.0",
                         install=KvgateInstall.model_construct(wheel_url=f"https://a/{source[-2:]}k.whl"))


def test_user_data_over_ec2s_limit_is_gzipped_and_refused_past_it() -> None:
    # 150 adapters of realistic names: ~17 KB of text, over EC2's 16,384 bytes; gzipped it fits.
    adapters = tuple((f"customer-{i:03d}-support-lora", f"s3://acme-adapters/customers/{i:03d}/support-lora-v3")
                     for i in range(150))
    text = render_user_data(replace(SPEC, adapters=adapters), claim_id="claim-1", pool="gpu", cluster="prod",
                            install=WHEEL, version=None)
    assert len(text.encode()) > 16_384
    payload = user_data_payload(text)
    assert isinstance(payload, bytes) and len(payload) <= 16_384 and gzip.decompress(payload).decode() == text
    assert user_data_payload("#cloud-config\n") == "#cloud-config\n"  # small ones stay readable text
    with pytest.raises(ValueError, match="over EC2's 16,384"):
        user_data_payload("#cloud-config\n" + os.urandom(30_000).hex())  # random hex: gzip halves it at best


@pytest.mark.parametrize("state,reason,events,expected", [
    ("pending", "", [], NodeState.PENDING),
    ("running", "", [], NodeState.RUNNING),
    ("running", "", [{"Code": "instance-retirement", "Description": "hardware failure"}], NodeState.INTERRUPTED),
    ("running", "", [{"Code": "instance-stop", "Description": "[Completed] done"}], NodeState.RUNNING),
    ("running", "", [{"Code": "system-reboot", "Description": "reboot"}], NodeState.RUNNING),
    ("shutting-down", "Server.SpotInstanceTermination", [], NodeState.INTERRUPTED),
    ("shutting-down", "Client.UserInitiatedShutdown", [], NodeState.TERMINATING),
    ("stopped", "Server.SpotInstanceShutdown", [], NodeState.INTERRUPTED),
    ("terminated", "Server.SpotInstanceTermination", [], NodeState.TERMINATED),
])
def test_instance_states_map_to_node_states(state: str, reason: str, events: list, expected: NodeState) -> None:
    instance = {"State": {"Name": state}, "StateReason": {"Code": reason, "Message": reason}}
    got, why = node_state(instance, {"Events": events})
    assert got is expected
    if expected is NodeState.INTERRUPTED:
        assert why, "an interruption says why"


def test_launch_times_are_wall_clock_seconds() -> None:
    from kvgate.providers.aws_ec2 import node_from_instance
    launched = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    node = node_from_instance({"InstanceId": "i-1", "State": {"Name": "running"}, "LaunchTime": launched,
                               "Tags": [{"Key": TAG_CLAIM, "Value": "c"}]}, None, pool="p", price_usd_per_hour=1.0)
    assert node.launched_at == launched.timestamp() and node.claim_id == "c" and node.address is None


async def test_without_an_image_id_the_default_ami_lookup_fails_clearly(moto_endpoint_url: str) -> None:
    """moto's SSM holds no Deep Learning AMI parameter, so the default lookup fails: the error says
    what to set instead of leaking botocore's ParameterNotFound."""
    session = moto_session()
    spec = pool_spec(session, moto_endpoint_url)
    spec = spec.model_copy(update={"aws": spec.aws.model_copy(update={"image_id": None})})
    provider = AwsProvider(POOL, spec, cluster=f"t-{uuid.uuid4().hex[:8]}", clock=FakeClock(), session=session)
    try:
        with pytest.raises(ProviderError, match="set aws.image_id"):
            await provider.create(claim())
        assert await provider.list() == []
    finally:
        await provider.close()


async def test_build_provider_makes_an_aws_provider(moto_endpoint_url: str) -> None:
    from kvgate.providers.build import build_provider
    session = moto_session()
    provider = build_provider(POOL, pool_spec(session, moto_endpoint_url), cluster="c", clock=FakeClock(),
                              session=session)
    try:
        assert isinstance(provider, AwsProvider) and (provider.pool, provider.cluster) == (POOL, "c")
        assert len(await provider.offerings()) == 3
    finally:
        await provider.close()
