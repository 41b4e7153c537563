"""What the slurm provider reads from and writes to Slurm, as typed values and pure functions.

Slurm holds every record kvgate needs, so a restarted autoscaler finds its claims and replicas again:

- A **claim** (a kvgate node) is a held job that never runs (`sbatch --hold`, named
  `kvgate.<cluster>.claim.<claim id>`): a record of how many GPUs of which type the planner counts as
  bought, and at which notional price. It holds no GPU: Slurm allocates GPUs to replica jobs.
- A **replica** is a batch job (`kvgate.<cluster>.<replica id>`) asking for the model's GPUs
  (`--gres=gpu:TYPE:N`) in the pool's partition. Its script picks two free ports on the node it landed
  on, appends them to the job's comment, and `exec`s `python -m kvgate.engine`, so Slurm's signals reach
  the engine itself.
- Both carry their tags as JSON in the job comment (`kvgate/v1 {...}`); the replica's script appends
  ` port=P grpc=G`, and `stop_replica` appends ` stopping` before it signals, so a job that ends after
  a stop is not mistaken for a failure, even by the next autoscaler.

`squeue --json` lists every job whatever filter it is given (Slurm 22.05), so records are filtered here.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvgate.providers.base import CapacityType, Offering, ReplicaState
from kvgate.registry.slurm import SlurmSettings

COMMENT_PREFIX = "kvgate/v1 "
TRAINING_SUFFIX = "+training"
CLAIM, REPLICA = "claim", "replica"
# Job states in which a job may still hold or wait for resources (squeue's job_state).
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                         "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "COMPLETING"})
# Claim and replica ids kvgate writes into job names, log paths and scripts: nothing a shell or a path could read
# as more than a name (the planner's ids are `kvg-1a2b3c-r4`).
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Slurm keeps at most this many characters of a job comment; the replica's script appends its ports.
MAX_COMMENT = 1024 - len(" port=65535 grpc=65535 stopping")
_GRES = re.compile(r"^gpu:(?P<type>[^:(]+):(?P<count>\d+)")
_ENDPOINT = re.compile(r" port=(?P<port>\d+) grpc=(?P<grpc>\d+)")


class SlurmAnswerError(ValueError):
    """A Slurm command answered something this module cannot read (a changed JSON layout)."""


# --------------------------------------------------------------------------------------------- tags


@dataclass(frozen=True, slots=True)
class Tags:
    """What kvgate writes into a job's comment: whose job it is and what it stands for."""

    kind: str  # CLAIM or REPLICA
    cluster: str
    pool: str
    claim: str  # the claim id (a replica: the claim of the node it was started on)
    instance_type: str = ""  # a claim: the offering it was bought as
    model: str = ""
    replica: str = ""
    created_at: float = 0.0
    usd_per_hour: float = 0.0  # a claim: the notional price it was bought at
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    def comment(self) -> str:
        body = {"kind": self.kind, "cluster": self.cluster, "pool": self.pool, "claim": self.claim,
                "instance_type": self.instance_type, "model": self.model, "replica": self.replica,
                "created_at": self.created_at, "usd_per_hour": self.usd_per_hour, "labels": dict(self.labels)}
        return COMMENT_PREFIX + json.dumps(body, separators=(",", ":"), sort_keys=True)


def parse_comment(comment: str) -> tuple[Tags | None, tuple[int, int] | None, bool]:
    """(tags, (port, grpc port) once the replica chose them, stopping) from a job comment; tags None when
    the job is not kvgate's (or its comment was rewritten by someone)."""
    if not comment.startswith(COMMENT_PREFIX):
        return None, None, False
    text = comment[len(COMMENT_PREFIX):]
    try:
        body, end = json.JSONDecoder().raw_decode(text)
        tags = Tags(kind=str(body["kind"]), cluster=str(body["cluster"]), pool=str(body["pool"]),
                    claim=str(body["claim"]), instance_type=str(body.get("instance_type", "")),
                    model=str(body.get("model", "")), replica=str(body.get("replica", "")),
                    created_at=float(body.get("created_at", 0.0)), usd_per_hour=float(body.get("usd_per_hour", 0.0)),
                    labels={str(k): str(v) for k, v in dict(body.get("labels") or {}).items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None, False
    if not SAFE_ID.match(tags.claim) or (tags.replica and not SAFE_ID.match(tags.replica)):
        return None, None, False  # not written by kvgate: these ids end up in paths
    rest = text[end:]
    found = _ENDPOINT.search(rest)
    return tags, (int(found["port"]), int(found["grpc"])) if found else None, rest.endswith(" stopping")


# --------------------------------------------------------------------------------------------- jobs


@dataclass(frozen=True, slots=True)
class Job:
    """One job from `squeue --json`, with its kvgate tags when it has them."""

    id: str
    name: str
    state: str  # squeue's job_state: PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ...
    reason: str  # squeue's state_reason: Resources, Priority, JobHeldUser, None, ...
    partition: str
    node: str  # the batch host ("" while pending)
    submit_time: float
    start_time: float
    exit_code: int  # the job's exit status (Slurm's wait status >> 8); `signal` the signal that ended it, or 0
    gpus_by_node: Mapping[str, int]
    user_id: int = -1
    requeue: bool = False  # may be requeued (so preempting it loses no job, only work since a checkpoint)
    signal: int = 0
    tags: Tags | None = None
    endpoint: tuple[int, int] | None = None
    stopping: bool = False

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def mine(self, uid: int, cluster: str, pool: str, kind: str) -> bool:
        """Submitted by user `uid` and tagged for (cluster, pool) as `kind`. The user matters: anyone on the
        cluster can write a comment, and `squeue --json` lists every user's jobs."""
        return (self.user_id == uid and self.tags is not None
                and (self.tags.cluster, self.tags.pool, self.tags.kind) == (cluster, pool, kind))


def gres_gpus(text: str) -> tuple[str, int] | None:
    """`gpu:h100:3(IDX:0-2)` -> ("h100", 3); None for no GPU. Several gres are comma-separated."""
    for part in re.split(r",(?=[a-z])", text or ""):
        found = _GRES.match(part.strip())
        if found:
            return found["type"], int(found["count"])
    return None


def _gpus_by_node(raw: Mapping[str, Any]) -> dict[str, int]:
    details = list(raw.get("gres_detail") or ())
    hosts = [n.get("nodename", "") for n in ((raw.get("job_resources") or {}).get("allocated_nodes") or ())]
    result: dict[str, int] = {}
    for host, detail in zip(hosts, details):
        gpus = gres_gpus(detail)
        if host and gpus:
            result[host] = result.get(host, 0) + gpus[1]
    return result


def parse_jobs(answer: Mapping[str, Any]) -> list[Job]:
    """Every job in a `squeue --json` answer. Raises SlurmAnswerError when the layout is not Slurm's."""
    try:
        jobs = []
        for raw in answer["jobs"]:
            tags, endpoint, stopping = parse_comment(str(raw.get("comment") or ""))
            jobs.append(Job(
                id=str(raw["job_id"]), name=str(raw.get("name", "")), state=str(raw["job_state"]),
                reason=str(raw.get("state_reason") or "None"), partition=str(raw.get("partition", "")),
                node=str(raw.get("batch_host") or ""), submit_time=float(raw.get("submit_time") or 0),
                start_time=float(raw.get("start_time") or 0), exit_code=(int(raw.get("exit_code") or 0) >> 8) & 0xFF,
                signal=int(raw.get("exit_code") or 0) & 0x7F, gpus_by_node=_gpus_by_node(raw),
                user_id=int(raw.get("user_id", -1)), requeue=bool(raw.get("requeue")), tags=tags, endpoint=endpoint,
                stopping=stopping))
        return jobs
    except (KeyError, TypeError, ValueError) as exc:
        raise SlurmAnswerError(f"squeue --json: unexpected layout ({exc!r})") from None


# -------------------------------------------------------------------------------------------- nodes

_UNUSABLE = ("down", "drain", "fail", "maint", "reserved", "not_responding", "unknown", "future", "power")


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One node from `sinfo --json`: its address, partitions and GPUs (one gres GPU type per node)."""

    name: str
    address: str
    partitions: tuple[str, ...]
    state: str
    gpu_type: str
    gpus: int
    gpus_used: int

    @property
    def usable(self) -> bool:
        return not any(word in self.state.lower() for word in _UNUSABLE)


def parse_nodes(answer: Mapping[str, Any]) -> list[SlurmNode]:
    """Every node in a `sinfo --json` answer. Raises SlurmAnswerError when the layout is not Slurm's."""
    try:
        nodes = []
        for raw in answer["nodes"]:
            total = gres_gpus(str(raw.get("gres") or "")) or ("", 0)
            used = gres_gpus(str(raw.get("gres_used") or "")) or ("", 0)
            state = raw.get("state", "")
            flags = raw.get("state_flags") or ()
            nodes.append(SlurmNode(name=str(raw["name"]), address=str(raw.get("address") or raw["name"]),
                                   partitions=tuple(raw.get("partitions") or ()),
                                   state=" ".join([str(state), *map(str, flags)]),
                                   gpu_type=total[0], gpus=total[1], gpus_used=used[1]))
        return nodes
    except (KeyError, TypeError, ValueError) as exc:
        raise SlurmAnswerError(f"sinfo --json: unexpected layout ({exc!r})") from None


# ---------------------------------------------------------------------------------------- offerings


def instance_type(gpu_type: str, gpus: int, from_training: bool = False) -> str:
    """`h100x2`, or `h100x2+training` for GPUs taken from preemptible training."""
    return f"{gpu_type}x{gpus}" + (TRAINING_SUFFIX if from_training else "")


def parse_instance_type(name: str) -> tuple[str, int, bool] | None:
    """(gpu type, GPUs, from training) of an instance type `instance_type` wrote; None otherwise."""
    base = name.removesuffix(TRAINING_SUFFIX)
    gpu_type, sep, count = base.rpartition("x")
    if not sep or not gpu_type or not count.isdigit() or int(count) < 1:
        return None
    return gpu_type, int(count), base != name


def sizes(per_node: int) -> list[int]:
    """Claim sizes offered for nodes of `per_node` GPUs: powers of two up to it, and it: 8 -> 1, 2, 4, 8."""
    result, size = [], 1
    while size < per_node:
        result.append(size)
        size *= 2
    return [*result, per_node] if per_node else []


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the partition has now, per gres type, as the provider reads it from sinfo and squeue.

    `free`/`takeable` are the most GPUs of the type free (or free plus held by requeueable training) on
    any one node, `free_total`/`takeable_total` the sums over nodes."""

    per_node: int
    free: int
    takeable: int
    free_total: int
    takeable_total: int = 0


def capacity(settings: SlurmSettings, nodes: Iterable[SlurmNode], jobs: Iterable[Job]) -> dict[str, Capacity]:
    """Per gres type named in `settings.gpu_types`, the partition's GPUs as `Capacity`."""
    preemptible = settings.sharing.partitions if settings.sharing else ()
    held: dict[str, int] = {}
    for job in jobs:
        if job.state == "RUNNING" and job.partition in preemptible and job.requeue:  # else preemption kills it
            for host, gpus in job.gpus_by_node.items():
                held[host] = held.get(host, 0) + gpus
    result: dict[str, Capacity] = {}
    for node in nodes:
        if settings.partition not in node.partitions or node.gpu_type not in settings.gpu_types:
            continue
        free = max(0, node.gpus - node.gpus_used) if node.usable else 0
        takeable = min(node.gpus, free + held.get(node.name, 0)) if node.usable else 0
        seen = result.get(node.gpu_type, Capacity(0, 0, 0, 0))
        result[node.gpu_type] = Capacity(per_node=max(seen.per_node, node.gpus), free=max(seen.free, free),
                                         takeable=max(seen.takeable, takeable), free_total=seen.free_total + free,
                                         takeable_total=seen.takeable_total + takeable)
    return result


def offerings(pool: str, settings: SlurmSettings, partition: Mapping[str, Capacity], *, claimed: int,
              unfilled: int) -> list[Offering]:
    """The pool's offerings: per gres type and claim size, free GPUs at `gpu_hour_usd` each, and (with
    `sharing`) GPUs taken from training at the sharing price, or at the free price while the claims stay
    within `floor_gpus`. Nothing is dropped: a size that does not fit now, or would pass `ceiling_gpus`,
    is flagged unavailable. `claimed`: GPUs the pool's live claims hold; `unfilled`: the part of them not
    yet used by a running replica (free GPUs the planner has already promised)."""
    sharing = settings.sharing
    ceiling = sharing.ceiling_gpus if sharing else None
    result = []
    for gpu_type, have in sorted(partition.items()):
        kind = settings.gpu_types[gpu_type]
        for gpus in sizes(have.per_node):
            within_ceiling = ceiling is None or claimed + gpus <= ceiling
            free = have.free >= gpus and have.free_total - unfilled >= gpus
            choices = [(False, settings.gpu_hour_usd, free)]
            if sharing is not None:
                price = settings.gpu_hour_usd if claimed + gpus <= sharing.floor_gpus else sharing.gpu_hour_usd
                choices.append((True, price, have.takeable >= gpus and have.takeable_total - unfilled >= gpus))
            for from_training, gpu_hour, fits in choices:
                result.append(Offering(
                    pool=pool, instance_type=instance_type(gpu_type, gpus, from_training), gpu_kind=kind.kind,
                    gpu_count=gpus, gpu_memory_gib=kind.memory_gib, cpus=None, memory_gib=None,
                    capacity_type=CapacityType.ON_DEMAND, region=settings.partition, zone="",
                    price_usd_per_hour=round(gpus * gpu_hour, 6), available=fits and within_ceiling))
    return result


def grace_times(show_partition: str) -> dict[str, float]:
    """Partition -> GraceTime seconds, from `scontrol show partition -o` (one partition a line)."""
    result = {}
    for line in show_partition.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "PartitionName" in fields and fields.get("GraceTime", "").isdigit():
            result[fields["PartitionName"]] = float(fields["GraceTime"])
    return result


def grace_mismatch(settings: SlurmSettings, graces: Mapping[str, float]) -> str:
    """Why the pool's grace_time_s disagrees with its training partitions' GraceTime, or ""."""
    if settings.sharing is None:
        return ""
    wrong = {name: graces[name] for name in settings.sharing.partitions
             if name in graces and graces[name] != settings.sharing.grace_time_s}
    missing = [name for name in settings.sharing.partitions if name not in graces]
    parts = [f"partition {name!r} has GraceTime={value:g}" for name, value in sorted(wrong.items())]
    parts += [f"Slurm has no partition {name!r}" for name in missing]
    if not parts:
        return ""
    return f"sharing.grace_time_s is {settings.sharing.grace_time_s:g} s but " + "; ".join(parts)


# ------------------------------------------------------------------------------------------ replicas


def replica_state(job: Job, *, now: float, pending_timeout_s: float) -> tuple[ReplicaState, str]:
    """The replica state a job stands for, and why when it failed. A running job whose endpoint is known is
    STARTING here: the caller asks its /health to tell READY. A job that ended after `stop_replica` marked it
    is STOPPED."""
    if job.stopping and not job.live:
        return ReplicaState.STOPPED, ""
    if job.state == "PENDING":
        waited = now - job.submit_time
        if waited > pending_timeout_s:
            return ReplicaState.FAILED, (f"Slurm job {job.id} pending for {waited:.0f} s in partition "
                                         f"{job.partition} (Slurm's reason: {job.reason}): no capacity")
        return ReplicaState.STARTING, ""
    if job.live:
        return ReplicaState.STARTING, ""
    how = {"CANCELLED": "was cancelled outside kvgate", "PREEMPTED": "was preempted"}.get(job.state, "ended")
    ended = f"signal {job.signal}" if job.signal else f"exit code {job.exit_code}"
    return ReplicaState.FAILED, f"Slurm job {job.id} {how}: {job.state} (Slurm's reason: {job.reason}, {ended})"


def lost_claims(jobs: Sequence[Job], *, now: float, pending_timeout_s: float) -> dict[str, str]:
    """Claim id -> why, for claims Slurm will not serve: a replica job on it pending past the timeout
    (insufficient capacity), or preempted (a higher partition took its GPUs). Their nodes are INTERRUPTED."""
    result: dict[str, str] = {}
    for job in jobs:
        if job.tags is None or job.stopping:
            continue
        if job.state == "PENDING" and now - job.submit_time > pending_timeout_s:
            result.setdefault(job.tags.claim, replica_state(job, now=now, pending_timeout_s=pending_timeout_s)[1])
        elif job.state == "PREEMPTED":
            result.setdefault(job.tags.claim, f"Slurm job {job.id} was preempted (Slurm's reason: {job.reason})")
    return result


def claim_gpus(claim: Job) -> int:
    parsed = parse_instance_type(claim.tags.instance_type) if claim.tags else None
    return parsed[1] if parsed else 0



# --------------------------------------------------------------------------------------- job scripts


def job_name(cluster: str, kind: str, ident: str) -> str:
    return f"kvgate.{cluster}.{ident}" if kind == REPLICA else f"kvgate.{cluster}.claim.{ident}"


def replica_script(python: str, engine_args: Sequence[str], comment: str, replica_id: str) -> str:
    """The batch script of one replica: pick two free ports, publish them in the comment, exec the engine."""
    q = shlex.quote
    pick = ("import socket\n"
            "s = [socket.socket() for _ in range(2)]\n"
            "[x.bind(('', 0)) for x in s]\n"
            "print(*[x.getsockname()[1] for x in s])")
    return "\n".join([
        "#!/bin/bash",
        f"# kvgate replica {replica_id}, written by kvgate's slurm provider: the engine gets Slurm's signals.",
        "set -u",
        f"PY={q(python)}",
        f"read -r PORT GRPC_PORT < <(\"$PY\" -c {q(pick)}) || exit 1",
        f"scontrol update JobId=\"$SLURM_JOB_ID\" Comment={q(comment)}\" port=$PORT grpc=$GRPC_PORT\" || exit 1",
        "echo \"kvgate: replica on $(hostname -s) port $PORT (gRPC $GRPC_PORT)\"",
        f"exec \"$PY\" -m kvgate.engine {' '.join(q(a) for a in engine_args)} --port \"$PORT\" "
        "--grpc-port \"$GRPC_PORT\"",
        "",
    ])
