"""The `aws` provider: a registry Pool of EC2 instances, bought and ended through boto3.

The only module (with its pure helpers `aws_ec2`, `aws_userdata`) that touches boto3. Every blocking
boto3 call runs in a worker thread (`asyncio.to_thread`); botocore's own retries are off, so throttling
is retried here, with backoff through the injected `sleep` (the clock's by default), then raised as
`ProviderUnavailable`.

How the Provider contract maps onto EC2:
- `offerings()`: the pool's catalogue (registry offers), enriched where the API answers:
  `describe_instance_types` fills CPUs, memory and GPU memory the catalogue left unset, and
  `describe_spot_price_history` prices spot offerings. Enrichment failures are logged, never fatal.
  An offering whose launch failed with a capacity error is flagged `available=False` for
  `stockout_ttl_s` (3 min by default; by the injected clock).
- `create(claim)`: looks the claim up by its `kvgate:claim` tag first (a restarted kvgate finds what it
  bought), then `run_instances` with `ClientToken` = claim id (EC2 itself dedupes racing retries),
  tagged kvgate:cluster/claim/pool/model on the instance and its volumes, spot through
  `InstanceMarketOptions`, and, when the claim carries a `ReplicaSpec`, cloud-init user data that starts
  that engine at boot and tags the instance once it is healthy (`aws_userdata`). Pool quota
  (`max_nodes`, `max_gpus`, `budget_usd_per_hour`) is checked against `list()` before buying.
- `delete(node_id)`: `terminate_instances`; an unknown id, or an instance of another cluster, is left
  alone and the call succeeds.
- `list()`: `describe_instances` filtered by the cluster and pool tags, plus `describe_instance_status`
  for scheduled stop/retirement events. Spot interruptions show as `NodeState.INTERRUPTED`: through the
  instance state (StateReason `Server.SpotInstanceTermination`, or stopped) and through status events.
- Replicas: an EC2 node runs exactly one replica, chosen at launch (the claim's `replica`).
  `start_replica` adopts that boot replica (under the caller's `replica_id`, kept in the `kvgate:replica`
  tag) and refuses another model; `list_replicas` reports it READY once the instance carries
  `kvgate:replica-state=ready` (set by the node itself); `stop_replica` terminates the node, whose
  systemd unit gives the engine its drain timeout before SIGKILL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.metadata
import logging
from dataclasses import replace
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from kvgate.clock import Clock
from kvgate.providers.aws_ec2 import (
    MISSING_INSTANCE_CODES, Backoff, cluster_filters, enrich_from_instance_types,
    enrich_spot_prices, instances_of, map_error, node_from_instance, run_instances_request, tags_of,
)
from kvgate.providers.aws_userdata import (ENGINE_GRPC_PORT, ENGINE_PORT, READY_TAG, render_user_data,
                                          user_data_payload)
from kvgate.providers.base import (
    TAG_CLAIM, TAG_CLUSTER, TAG_MODEL, TAG_REPLICA, InsufficientCapacity, Node, NodeClaim, NodeNotReady, NodeState,
    NotFound, Offering, OfferingKey, ProviderError, ProviderUnavailable, ReplicaHandle,
    ReplicaSpec, ReplicaState, check_quota, node_tags, offerings_from_pool,
)
from kvgate.providers.pool_provider import PoolProvider, Sleep
from kvgate.registry.schema import AwsSettings, CapacityType, KvgateInstall, PoolSpec

log = logging.getLogger(__name__)

# A public SSM parameter naming the newest AWS Deep Learning Base AMI (NVIDIA driver, Ubuntu 22.04):
# the default image when the pool sets no aws.image_id.
DEFAULT_AMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
_GONE = (NodeState.TERMINATING, NodeState.TERMINATED)


def installed_version() -> str:
    """The version of the kvgate distribution this process runs: what an index install on a node pins."""
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        raise ProviderError("kvgate is not installed as a distribution (pip install -e . at least), so its "
                            "version for new nodes is unknown; pass kvgate_version") from None


class AwsProvider(PoolProvider):
    """One EC2 pool of one kvgate cluster (see the module docstring for how each call maps to EC2).

    `session` is a boto3 Session (credentials, profile; tests register botocore event hooks on it);
    default: a new Session from the environment. `sleep` waits between throttled retries (default:
    `clock.sleep`). Nodes get kvgate where the pool's `aws.install` says; an index install pins
    `kvgate_version` (default: this installation's version) unless the pool names one."""

    def __init__(self, pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock,
                 session: Any | None = None, sleep: Sleep | None = None, backoff: Backoff = Backoff(),
                 kvgate_version: str | None = None, stockout_ttl_s: float = 180.0,
                 drain_timeout_s: float = 30.0) -> None:
        if not spec.region:
            raise ProviderError(f"pool {pool_name!r}: provider 'aws' needs a region")
        super().__init__(pool_name, cluster=cluster, clock=clock, sleep=sleep)
        self._spec = spec
        self._settings = spec.aws or AwsSettings()
        self._backoff = backoff
        self._pinned_version = kvgate_version
        self._stockout_ttl_s = stockout_ttl_s
        self._drain_timeout_s = drain_timeout_s
        # An EC2 node runs the one replica its claim's user data starts at boot (see start_replica).
        self._catalogue = [replace(o, replica_at_boot=True) for o in offerings_from_pool(pool_name, spec)]
        self._sold_out_until: dict[OfferingKey, float] = {}  # offering -> clock.now() when it may sell again
        self._image_id: str | None = self._settings.image_id
        # Last known price per (type, capacity type), for Nodes; refreshed by offerings().
        self._prices = {(o.instance_type, o.capacity_type): o.price_usd_per_hour for o in self._catalogue}
        session = session or boto3.session.Session()
        # total_max_attempts=1: botocore would retry throttling with real sleeps inside the worker thread;
        # this class retries instead, through the injected sleep.
        config = botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"},
                                        connect_timeout=5, read_timeout=30)
        try:
            self._ec2 = session.client("ec2", region_name=spec.region, endpoint_url=self._settings.endpoint_url,
                                       config=config)
            self._ssm = session.client("ssm", region_name=spec.region, endpoint_url=self._settings.endpoint_url,
                                       config=config)
        except botocore.exceptions.BotoCoreError as exc:
            raise ProviderError(f"pool {pool_name!r}: cannot build an EC2 client: {exc}") from None

    def _kvgate_version(self, install: KvgateInstall) -> str | None:
        """The version an index install pins when the pool names none: the one given, else this installation's.
        Read only when needed, so a pool that installs from a wheel or an image works from a plain checkout."""
        if not install.index_url or install.version:
            return None
        return self._pinned_version or installed_version()

    # ------------------------------------------------------------------------------------- the calls

    async def _call(self, operation: str, *, client: Any = None, offering: OfferingKey | None = None,
                    missing_ok: bool = False, attempts: int | None = None, **params: Any) -> dict[str, Any] | None:
        """One EC2 API call in a thread, with retries of retryable errors; our typed errors out.
        With `missing_ok`, an unknown instance id returns None instead of raising."""
        method = getattr(client or self._ec2, operation)
        max_attempts = attempts or self._backoff.max_attempts
        for attempt in range(max_attempts):
            try:
                return await asyncio.to_thread(method, **params)
            except botocore.exceptions.ClientError as exc:
                error = exc.response.get("Error", {})
                code, message = error.get("Code", "Unknown"), error.get("Message", "")
                if missing_ok and code in MISSING_INSTANCE_CODES:
                    return None
                mapped = map_error(code, message, offering, operation)
            except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                    botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError) as exc:
                mapped = ProviderUnavailable(f"EC2 {operation}: {exc}")
            except botocore.exceptions.NoCredentialsError:
                raise ProviderError(f"EC2 {operation}: no AWS credentials; set AWS_PROFILE or "
                                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or attach an instance role") from None
            except botocore.exceptions.BotoCoreError as exc:
                raise ProviderError(f"EC2 {operation}: {exc}") from None
            if not isinstance(mapped, ProviderUnavailable) or attempt == max_attempts - 1:
                raise mapped
            delay_s = self._backoff.delay_s(attempt)
            log.info("EC2 %s: %s; retry %d/%d in %.1f s", operation, mapped, attempt + 1, max_attempts - 1, delay_s)
            await self._sleep(delay_s)
        raise AssertionError("unreachable: the loop returns or raises")

    async def _instances(self, filters: list[dict[str, Any]] | None = None,
                         instance_ids: list[str] | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {}
        if filters:
            params["Filters"] = filters
        if instance_ids:
            params["InstanceIds"] = instance_ids
        pages = []
        while True:
            page = await self._call("describe_instances", missing_ok=bool(instance_ids), **params)
            if page is None:
                return []
            pages.append(page)
            if not page.get("NextToken"):
                return instances_of(pages)
            params["NextToken"] = page["NextToken"]

    # ---------------------------------------------------------------------------------- offerings

    async def offerings(self) -> list[Offering]:
        """Every catalogue offering, enriched where EC2 answers, sold-out ones flagged (never dropped)."""
        result = list(self._catalogue)
        types = sorted({o.instance_type for o in result})
        try:
            answer = await self._call("describe_instance_types", attempts=1, InstanceTypes=types)
            result = enrich_from_instance_types(result, (answer or {}).get("InstanceTypes", []))
        except ProviderError as exc:
            log.warning("pool %s: describe_instance_types failed, using the catalogue as is: %s", self._pool, exc)
        spot_types = sorted({o.instance_type for o in result if o.capacity_type is CapacityType.SPOT})
        if spot_types:
            try:
                answer = await self._call(
                    "describe_spot_price_history", attempts=1, InstanceTypes=spot_types,
                    ProductDescriptions=["Linux/UNIX"], StartTime=dt.datetime.fromtimestamp(self._clock.wall(), dt.timezone.utc))
                result = enrich_spot_prices(result, (answer or {}).get("SpotPriceHistory", []))
            except ProviderError as exc:
                log.warning("pool %s: describe_spot_price_history failed, using catalogue prices: %s", self._pool, exc)
        now = self._clock.now()
        self._prices = {(o.instance_type, o.capacity_type): o.price_usd_per_hour for o in result}
        return [replace(o, available=self._sold_out_until.get(o.key, 0.0) <= now) for o in result]

    def _offering_for(self, key: OfferingKey) -> Offering:
        for offering in self._catalogue:
            if offering.key == key:
                return offering
        raise NotFound(f"pool {self._pool!r} does not sell {key}; its offers are "
                       f"{', '.join(str(o.key) for o in self._catalogue)}")

    def _price_of(self, instance_type: str, capacity_type: CapacityType) -> float:
        return self._prices.get((instance_type, capacity_type), 0.0)

    # -------------------------------------------------------------------------------------- nodes

    async def create(self, claim: NodeClaim) -> Node:
        """Buy one instance for `claim`, or return the one already bought for it (see the module docstring).
        Raises NotFound (offering not in the catalogue), InsufficientCapacity, QuotaExceeded,
        ProviderUnavailable (throttled past the retries), ProviderError (anything else EC2 refused)."""
        offering = self._offering_for(claim.offering)
        existing = await self._node_of_claim(claim.id)
        if existing is not None:
            return existing
        now = self._clock.now()
        if self._sold_out_until.get(offering.key, 0.0) > now:
            raise InsufficientCapacity(offering.key, f"{offering.key} failed with a capacity error less than "
                                       f"{self._stockout_ttl_s:.0f} s ago; not trying again yet")
        await self._check_quota(offering)
        tags = node_tags(self._cluster, claim)
        user_data = None
        if claim.replica is not None:
            tags.setdefault(TAG_MODEL, claim.replica.model)
            tags[TAG_REPLICA] = claim.id  # the boot replica's id until a caller adopts it
            if self._settings.install is None:  # the registry refuses such a pool; a hand-built PoolSpec may not
                raise ProviderError(f"pool {self._pool!r} has no aws.install: new nodes would have no kvgate",
                                    retryable=False)
            try:
                user_data = user_data_payload(render_user_data(
                    claim.replica, claim_id=claim.id, pool=self._pool, cluster=self._cluster,
                    install=self._settings.install, version=self._kvgate_version(self._settings.install),
                    drain_timeout_s=self._drain_timeout_s))
            except ValueError as exc:  # a registry value no node could boot with: no launch will take it
                raise ProviderError(f"pool {self._pool!r}, claim {claim.id}: {exc}", retryable=False) from None
        request = run_instances_request(offering=offering, claim_id=claim.id, tags=tags,
                                        image_id=await self._image(), settings=self._settings, user_data=user_data)
        try:
            answer = await self._call("run_instances", offering=offering.key, **request)
        except InsufficientCapacity:
            self._sold_out_until[offering.key] = now + self._stockout_ttl_s
            raise
        assert answer is not None  # missing_ok is off, so a failure raised
        instance = answer["Instances"][0]
        log.info("pool %s: bought %s (%s) for claim %s", self._pool, instance["InstanceId"], offering.key, claim.id)
        return self._node(instance, None)

    async def _node_of_claim(self, claim_id: str) -> Node | None:
        filters = cluster_filters(self._cluster, self._pool) + [{"Name": f"tag:{TAG_CLAIM}", "Values": [claim_id]}]
        nodes = [self._node(i, None) for i in await self._instances(filters)]
        # A live instance wins over a terminated one still listed (EC2 lists those for about an hour).
        nodes.sort(key=lambda n: (n.state is NodeState.TERMINATED, -n.launched_at))
        return nodes[0] if nodes else None

    async def _check_quota(self, offering: Offering) -> None:
        spec = self._spec
        if spec.max_nodes is None and spec.max_gpus is None and spec.budget_usd_per_hour is None:
            return  # no limits: skip the DescribeInstances call
        gpus = {o.instance_type: o.gpu_count for o in self._catalogue}
        in_use = [(gpus.get(n.instance_type, 0), n.price_usd_per_hour)
                  for n in await self.list() if n.state not in _GONE]
        check_quota(self._pool, offering, in_use, max_nodes=spec.max_nodes, max_gpus=spec.max_gpus,
                    budget_usd_per_hour=spec.budget_usd_per_hour)

    async def _image(self) -> str:
        if self._image_id is None:
            try:
                answer = await self._call("get_parameter", client=self._ssm, Name=DEFAULT_AMI_PARAMETER)
            except ProviderError as exc:
                raise ProviderError(f"pool {self._pool!r}: set aws.image_id; the default AMI (SSM parameter "
                                    f"{DEFAULT_AMI_PARAMETER}) could not be read: {exc}") from None
            assert answer is not None
            self._image_id = answer["Parameter"]["Value"]
        return self._image_id

    async def delete(self, node_id: str) -> None:
        """Terminate the instance. Succeeds when it is gone already, never existed, or is not this
        cluster's (kvgate never ends what it did not buy)."""
        instances = await self._instances(instance_ids=[node_id])
        if not instances or tags_of(instances[0]).get(TAG_CLUSTER) != self._cluster:
            return
        if instances[0].get("State", {}).get("Name") == "terminated":
            return
        await self._call("terminate_instances", missing_ok=True, InstanceIds=[node_id])
        log.info("pool %s: terminated %s", self._pool, node_id)

    async def list(self) -> list[Node]:
        """This cluster's instances in this pool, every state, sorted by id; interruptions flagged."""
        instances = await self._instances(cluster_filters(self._cluster, self._pool))
        running = [i["InstanceId"] for i in instances if i.get("State", {}).get("Name") == "running"]
        statuses: dict[str, dict[str, Any]] = {}
        if running:
            try:
                answer = await self._call("describe_instance_status", InstanceIds=running, IncludeAllInstances=True)
                statuses = {s["InstanceId"]: s for s in (answer or {}).get("InstanceStatuses", [])}
            except ProviderError as exc:
                # Not fatal: interruptions also show in the instance state; the next poll sees the events.
                log.warning("pool %s: describe_instance_status failed: %s", self._pool, exc)
        return sorted((self._node(i, statuses.get(i["InstanceId"])) for i in instances), key=lambda n: n.id)

    def _node(self, instance: dict[str, Any], status: dict[str, Any] | None) -> Node:
        capacity = CapacityType.SPOT if instance.get("InstanceLifecycle") == "spot" else CapacityType.ON_DEMAND
        return node_from_instance(instance, status, pool=self._pool,
                                  price_usd_per_hour=self._price_of(instance.get("InstanceType", ""), capacity))

    # ----------------------------------------------------------------------------------- replicas

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle:
        """Adopt the replica the node started at boot. NotFound: no such node of this cluster;
        NodeNotReady: not running (yet); ProviderError: the node booted without a replica, or with
        another model, or its replica is already adopted under another id (one replica per node)."""
        node = next((n for n in await self.list() if n.id == node_id), None)
        if node is None:
            raise NotFound(f"pool {self._pool!r} has no node {node_id!r}")
        if node.state is not NodeState.RUNNING:
            raise NodeNotReady(f"node {node_id} is {node.state.value}, not running")
        current = node.tags.get(TAG_REPLICA)
        if current is None or node.model != spec.model:
            raise ProviderError(f"node {node_id} runs {node.model or 'no replica'}; an EC2 node runs the one replica "
                                f"its claim named at launch: buy a node with NodeClaim.replica for {spec.model!r}",
                                retryable=False)
        wanted = replica_id or current
        if wanted != current:
            if current != node.claim_id:
                raise ProviderError(f"node {node_id} already runs replica {current!r}; it has room for one")
            await self._call("create_tags", Resources=[node_id], Tags=[{"Key": TAG_REPLICA, "Value": wanted}])
            node = replace(node, tags={**node.tags, TAG_REPLICA: wanted})
        return self._replica_of(node)

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        """End the replica by terminating its node (one replica per node): EC2 shuts the instance down
        and systemd gives the engine its drain timeout. Unknown or stopped replicas: success."""
        for node in await self.list():
            if node.tags.get(TAG_REPLICA) == replica_id and node.state not in _GONE:
                await self.delete(node.id)

    async def list_replicas(self) -> list[ReplicaHandle]:
        """The boot replica of every node that is not terminated, by the node's state and ready tag."""
        return [self._replica_of(n) for n in await self.list()
                if TAG_REPLICA in n.tags and n.state is not NodeState.TERMINATED]

    def _replica_of(self, node: Node) -> ReplicaHandle:
        registered = node.tags.get(READY_TAG, "")
        if node.state is NodeState.INTERRUPTED:
            state, reason = ReplicaState.FAILED, f"its node is being taken back: {node.reason}"
        elif node.state is NodeState.TERMINATING:
            state, reason = ReplicaState.STOPPED, ""
        elif node.state is NodeState.RUNNING and registered == "ready":
            state, reason = ReplicaState.READY, ""
        elif registered == "failed":
            state, reason = ReplicaState.FAILED, ("the engine did not answer /health before the boot deadline; "
                                                  "see journalctl -u kvgate-engine and /var/log/kvgate-register.log "
                                                  f"on {node.id}")
        else:
            state, reason = ReplicaState.STARTING, ""
        address = node.address or ""
        return ReplicaHandle(
            id=node.tags[TAG_REPLICA], model=node.model or "", node_id=node.id,
            url=f"http://{address}:{ENGINE_PORT}" if address else "",
            grpc_target=f"{address}:{ENGINE_GRPC_PORT}" if address else None,
            state=state, started_at=node.launched_at, reason=reason)

    async def close(self) -> None:
        """Close the HTTP pools of the clients; nodes keep running."""
        for client in (self._ec2, self._ssm):
            await asyncio.to_thread(client.close)


def from_pool(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, **options: Any) -> AwsProvider:
    """`build_provider`'s entry: options are AwsProvider's keywords (session, sleep, backoff, kvgate_version,
    stockout_ttl_s, drain_timeout_s)."""
    return AwsProvider(pool_name, spec, cluster=cluster, clock=clock, **options)
