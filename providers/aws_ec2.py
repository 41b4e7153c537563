"""Pure EC2 logic of the aws provider: request bodies, error mapping, and instances read back as Nodes.

No boto3 and no I/O here: everything takes and returns plain dicts in the shapes of the EC2 API (as
boto3 returns them), so the mapping is table-tested without a network. `providers.aws` is the shell
that sends these requests.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvgate.providers.base import (
    TAG_CLAIM, TAG_CLUSTER, TAG_POOL, InsufficientCapacity, Node, NodeState, Offering, OfferingKey,
    ProviderError, ProviderUnavailable, QuotaExceeded,
)
from kvgate.registry.schema import AwsSettings, CapacityType


# EC2 error codes, from https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity", "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded", "Unsupported",
})
QUOTA_CODES = frozenset({"InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotFleetRequestCountExceeded"})
# Worth retrying with backoff: throttling and the API's own transient failures.
RETRYABLE_CODES = frozenset({
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "RequestThrottled",
    "ServiceUnavailable", "Unavailable", "InternalError", "InternalFailure",
})
# An instance id that does not exist (or was never valid): `delete` treats it as already gone.
MISSING_INSTANCE_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

# describe_instance_status event codes meaning "the cloud will take this instance away".
_TAKEAWAY_EVENTS = frozenset({"instance-stop", "instance-retirement", "instance-terminate"})
# StateReason codes of spot interruptions (the instance was stopped or terminated by EC2, not by us).
_SPOT_REASONS = frozenset({"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown"})


def map_error(code: str, message: str, offering: OfferingKey | None, operation: str) -> ProviderError:
    """Our typed error for an EC2 error `code`. Capacity errors need the offering that was sold out;
    without one (an error outside create) they become plain, non-retryable ProviderErrors."""
    text = f"EC2 {operation}: {code}: {message}"
    if code in CAPACITY_CODES and offering is not None:
        return InsufficientCapacity(offering, text)
    if code in QUOTA_CODES:
        return QuotaExceeded(text)
    if code in RETRYABLE_CODES:
        return ProviderUnavailable(text)
    return ProviderError(text)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry schedule for throttled calls: attempt n (0-based) waits min(cap, base * 2**n) seconds
    before the next try; after `max_attempts` tries the error is raised as ProviderUnavailable.
    Defaults: 0.5, 1, 2, 4 s between five tries, 7.5 s in all: EC2's token buckets refill in seconds."""

    max_attempts: int = 5
    base_s: float = 0.5
    cap_s: float = 8.0

    def delay_s(self, attempt: int) -> float:
        return min(self.cap_s, self.base_s * (2 ** attempt))


def cluster_filters(cluster: str, pool: str) -> list[dict[str, Any]]:
    """describe_instances filters for the nodes of this cluster and pool (every state)."""
    return [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}, {"Name": f"tag:{TAG_POOL}", "Values": [pool]}]


def run_instances_request(*, offering: Offering, claim_id: str, tags: Mapping[str, str], image_id: str,
                          settings: AwsSettings, user_data: str | bytes | None) -> dict[str, Any]:
    """The RunInstances parameters for one node. ClientToken = claim id makes EC2 itself return the same
    instance for a repeated call (idempotent for ~1 h; the shell also looks the claim up by tag first)."""
    tag_list = [{"Key": key, "Value": value} for key, value in sorted(tags.items())]
    request: dict[str, Any] = {
        "ImageId": image_id, "InstanceType": offering.instance_type, "MinCount": 1, "MaxCount": 1,
        "ClientToken": claim_id,
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                              {"ResourceType": "volume", "Tags": tag_list}],
        # Instance metadata v2 only: the register script in the user data uses a session token.
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
    }
    if offering.capacity_type is CapacityType.SPOT:
        # one-time + terminate: an interrupted node is gone; the planner buys a replacement.
        request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    if offering.zone:
        request["Placement"] = {"AvailabilityZone": offering.zone}
    if settings.subnet_ids:
        # Spread claims over the subnets deterministically, so a retried claim picks the same one.
        request["SubnetId"] = settings.subnet_ids[sum(claim_id.encode()) % len(settings.subnet_ids)]
    if settings.security_group_ids:
        request["SecurityGroupIds"] = list(settings.security_group_ids)
    if settings.key_name:
        request["KeyName"] = settings.key_name
    if settings.iam_instance_profile:
        key = "Arn" if settings.iam_instance_profile.startswith("arn:") else "Name"
        request["IamInstanceProfile"] = {key: settings.iam_instance_profile}
    if user_data is not None:
        request["UserData"] = user_data
    return request


def tags_of(instance: Mapping[str, Any]) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", ())}


def active_events(status: Mapping[str, Any] | None) -> list[str]:
    """Descriptions of scheduled events that take the instance away and are neither done nor cancelled."""
    found = []
    for event in (status or {}).get("Events", ()):
        description = event.get("Description", "")
        if event.get("Code") in _TAKEAWAY_EVENTS and not description.startswith(("[Completed]", "[Canceled]")):
            found.append(f"{event['Code']}: {description}".rstrip(": "))
    return found


def node_state(instance: Mapping[str, Any], status: Mapping[str, Any] | None) -> tuple[NodeState, str]:
    """(state, reason) of an instance, from its state, its StateReason and its status events.

    EC2 name -> ours: pending -> PENDING; running -> RUNNING, or INTERRUPTED when a stop/retirement event
    is scheduled; shutting-down -> TERMINATING, or INTERRUPTED when EC2 reclaims a spot node
    (StateReason Server.SpotInstanceTermination); stopping/stopped -> INTERRUPTED (kvgate never stops
    nodes, so someone or something else did); terminated -> TERMINATED."""
    name = instance.get("State", {}).get("Name", "pending")
    reason_code = instance.get("StateReason", {}).get("Code", "")
    reason_text = instance.get("StateReason", {}).get("Message", "") or reason_code
    if name == "pending":
        return NodeState.PENDING, ""
    if name == "running":
        events = active_events(status)
        return (NodeState.INTERRUPTED, "; ".join(events)) if events else (NodeState.RUNNING, "")
    if name == "shutting-down":
        if reason_code in _SPOT_REASONS:
            return NodeState.INTERRUPTED, f"spot interruption: {reason_text}"
        return NodeState.TERMINATING, reason_text
    if name in ("stopping", "stopped"):
        return NodeState.INTERRUPTED, f"instance {name}: {reason_text}".rstrip(": ")
    return NodeState.TERMINATED, reason_text


def node_from_instance(instance: Mapping[str, Any], status: Mapping[str, Any] | None, *, pool: str,
                       price_usd_per_hour: float) -> Node:
    """One describe_instances instance (and its describe_instance_status entry, when any) as a Node."""
    tags = tags_of(instance)
    state, reason = node_state(instance, status)
    launch = instance.get("LaunchTime")
    launched_at = launch.timestamp() if isinstance(launch, dt.datetime) else 0.0
    spot = instance.get("InstanceLifecycle") == "spot"
    return Node(
        id=instance["InstanceId"], claim_id=tags.get(TAG_CLAIM, ""), pool=pool,
        instance_type=instance.get("InstanceType", ""),
        capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
        zone=instance.get("Placement", {}).get("AvailabilityZone", ""), state=state,
        address=instance.get("PrivateIpAddress") or instance.get("PublicIpAddress") or None,
        tags=tags, launched_at=launched_at, price_usd_per_hour=price_usd_per_hour, reason=reason)


def instances_of(pages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The instances of describe_instances pages, flattened out of their reservations."""
    return [dict(instance) for page in pages for reservation in page.get("Reservations", ())
            for instance in reservation.get("Instances", ())]


def enrich_from_instance_types(offerings: Sequence[Offering], types: Sequence[Mapping[str, Any]]) -> list[Offering]:
    """Fill what the catalogue left unset (cpus, memory_gib, gpu_memory_gib 0) from describe_instance_types.
    The catalogue wins where it says something: it is what the operator reviewed."""
    by_name = {t["InstanceType"]: t for t in types}
    result = []
    for offering in offerings:
        info = by_name.get(offering.instance_type)
        if info is None:
            result.append(offering)
            continue
        cpus = offering.cpus or info.get("VCpuInfo", {}).get("DefaultVCpus")
        memory_gib = offering.memory_gib or (info.get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024 or None)
        gpu_memory_gib = offering.gpu_memory_gib
        gpus = info.get("GpuInfo", {}).get("Gpus", ())
        if not gpu_memory_gib and gpus:
            gpu_memory_gib = gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024
        result.append(replace(offering, cpus=cpus, memory_gib=memory_gib, gpu_memory_gib=gpu_memory_gib))
    return result


def enrich_spot_prices(offerings: Sequence[Offering], history: Sequence[Mapping[str, Any]]) -> list[Offering]:
    """Spot offerings priced from describe_spot_price_history: the newest price per (type, zone); an
    offering without a zone takes the cheapest zone (EC2 places it where we ask, so that is the price
    we can get). On-demand offerings and types without history keep the catalogue price."""
    newest: dict[tuple[str, str], tuple[dt.datetime, float]] = {}
    for entry in history:
        key = (entry["InstanceType"], entry.get("AvailabilityZone", ""))
        stamp = entry.get("Timestamp") or dt.datetime.min.replace(tzinfo=dt.timezone.utc)
        if key not in newest or stamp > newest[key][0]:
            newest[key] = (stamp, float(entry["SpotPrice"]))
    result = []
    for offering in offerings:
        if offering.capacity_type is not CapacityType.SPOT:
            result.append(offering)
            continue
        prices = [price for (itype, zone), (_, price) in newest.items()
                  if itype == offering.instance_type and (not offering.zone or zone == offering.zone)]
        result.append(replace(offering, price_usd_per_hour=min(prices)) if prices else offering)
    return result
