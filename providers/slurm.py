"""The `slurm` provider: replicas as Slurm batch jobs, nodes as claims recorded in Slurm itself.

How the Provider contract maps onto Slurm (records and pure rules in `slurm_jobs`):
- **Offerings** come from `sinfo --json`: per gres GPU type of the pool's partition (named in
  `slurm.gpu_types`) and claim size (1, 2, 4, ... GPUs up to a node's count), priced at `gpu_hour_usd` a GPU.
  With `slurm.sharing`, each size is offered twice: free GPUs, and `+training` GPUs held by preemptible
  training jobs at the sharing price, so the planner takes free GPUs, then training's, then a cloud's.
  A size no node can hold now (or past `ceiling_gpus`) is flagged unavailable, never dropped.
- **Nodes** are claims: `create` submits a held job that never runs and holds no GPU, tagged with the
  claim; it is idempotent on the claim id, RUNNING at once, and `delete` cancels it and every replica
  job of the claim. A claim whose replica job waits past `pending_timeout_s` is reported INTERRUPTED
  ("no capacity"): the planner deletes it and skips its offering for a while, i.e. looks elsewhere.
- **Replicas** are batch jobs in the partition with the model's GPUs (`--gres=gpu:TYPE:N`), no requeue.
  Their URL is the address of the node they landed on (sinfo) and the port their script chose (in the
  job comment); READY once `/health` answers. A job that ended without `stop_replica` is FAILED with
  Slurm's state and reason and the end of its log (when `log_dir` is readable here).
- **Stop**: the comment is marked `stopping`, the engine gets SIGTERM (`scancel --signal=TERM --full`) and
  drains; the job is cancelled once `drain_deadline_s` has passed.
- A restarted provider finds everything again through the comments; it touches only jobs tagged with
  its own cluster and pool.

Slurm's commands are the API (`sinfo`/`squeue --json`, `sbatch`, `scancel`, `scontrol`), run in worker
threads with `SLURM_CONF` from the pool. `slurmrestd` would answer the same JSON, but needs a JWT set-up
and a daemon most sites do not run for users; the commands are on every login node. With slurmctld down,
the commands fail (or answer JSON with an `errors` list): ProviderUnavailable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvgate.clock import Clock
from kvgate.providers.base import (
    InsufficientCapacity, Node, NodeClaim, NodeNotReady, NodeState, NotFound, Offering, OfferingKey, ProviderError,
    ProviderUnavailable, QuotaExceeded, ReplicaHandle, ReplicaSpec, ReplicaState, check_quota, engine_args, node_tags,
)
from kvgate.providers.local_proc import http_status, log_tail
from kvgate.providers.pool_provider import PoolProvider, Sleep
from kvgate.providers.slurm_jobs import (
    CLAIM, LIVE_STATES, MAX_COMMENT, REPLICA, SAFE_ID, Job, SlurmAnswerError, SlurmNode, Tags, capacity, claim_gpus,
    grace_mismatch, grace_times, job_name, lost_claims, offerings, parse_instance_type, parse_jobs, parse_nodes,
    replica_script, replica_state,
)
from kvgate.registry.schema import CapacityType, PoolSpec

log = logging.getLogger(__name__)

_COMMAND_TIMEOUT_S = 60.0
_POLL_S = 0.5  # how often a stop checks whether the job has ended
_UNREACHABLE = ("Unable to contact", "Connection refused", "Socket timed out", "Zero Bytes were transmitted")
_GONE = ("already finished", "already completing", "Invalid job id")  # the job ended under us


class SlurmProvider(PoolProvider):
    """One Slurm pool of one kvgate cluster (see the module docstring).

    `python` is the interpreter with kvgate on the compute nodes (default: the pool's `slurm.python`,
    else this process's); `env` is added to the Slurm commands' environment."""

    def __init__(self, pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, sleep: Sleep | None = None,
                 cache_dir: str | None = None, health_timeout_s: float = 1.0) -> None:
        super().__init__(pool_name, cluster=cluster, clock=clock, sleep=sleep)
        if spec.slurm is None:
            raise ProviderError(f"pool {pool_name!r}: provider 'slurm' needs a slurm block")
        self._spec = spec
        self._settings = spec.slurm
        self._python = self._settings.python or sys.executable
        self._log_dir = Path(self._settings.log_dir).resolve()
        self._cache_dir = cache_dir
        self._health_timeout_s = health_timeout_s
        self._env = {**os.environ, **({"SLURM_CONF": self._settings.conf} if self._settings.conf else {})}
        self._uid = os.getuid()  # only this user's jobs are ours, whatever their comments say
        self._ready: set[str] = set()  # job ids seen healthy: not probed again while they run
        # One submission at a time in this process: create and start_replica check, then submit (two callers
        # with one id would both submit); across processes the dedupe after each submission settles it.
        self._submitting = asyncio.Lock()
        self._grace_checked = self._settings.sharing is None
        # Ended jobs stopped here: Slurm keeps their records for MinJobAge and refuses to change them, so
        # this instance remembers not to list them (a restarted one lists them FAILED once more, and is
        # told to stop them again).
        self._dismissed: set[str] = set()

    # ------------------------------------------------------------------------------------ commands

    async def _command(self, *args: str, stdin: str | None = None) -> str:
        """One Slurm command's stdout; a failure is ProviderUnavailable (slurmctld down or slow) or
        ProviderError (Slurm refused the request), with Slurm's own words. Output is decoded leniently: any
        user's job name or comment may hold bytes that are not UTF-8, and must not stop kvgate."""
        try:
            done = await asyncio.to_thread(subprocess.run, list(args), env=self._env, capture_output=True,
                                           input=stdin.encode() if stdin is not None else None,
                                           timeout=_COMMAND_TIMEOUT_S)
        except FileNotFoundError:
            raise ProviderError(f"pool {self._pool!r}: {args[0]} not found; install Slurm's client commands "
                                "(Debian: slurm-client) where kvgate runs") from None
        except subprocess.TimeoutExpired:
            raise ProviderUnavailable(f"{args[0]} did not answer in {_COMMAND_TIMEOUT_S:.0f} s") from None
        out = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            text = (done.stderr.decode(errors="replace") or out).strip()[-500:]
            if any(s in text for s in _GONE):
                raise NotFound(f"{args[0]}: {text}")
            unreachable = any(s in text for s in _UNREACHABLE)
            kind = ProviderUnavailable if unreachable else ProviderError
            raise kind(f"{args[0]} exited {done.returncode}: {text}")
        return out

    async def _json(self, *args: str) -> dict[str, Any]:
        try:
            answer = json.loads(await self._command(*args))
        except ValueError:
            raise ProviderUnavailable(f"{args[0]} --json answered something that is not JSON") from None
        errors = [e for e in answer.get("errors") or () if e]
        if errors:  # slurmctld unreachable still exits 0 with JSON saying so
            first = errors[0]
            raise ProviderUnavailable(f"{args[0]}: {first.get('error') or first.get('description') or first}")
        return answer

    async def _jobs(self) -> list[Job]:
        try:
            return parse_jobs(await self._json("squeue", "--json", "--all"))
        except SlurmAnswerError as exc:
            raise ProviderError(str(exc)) from None

    async def _nodes(self) -> list[SlurmNode]:
        try:
            return parse_nodes(await self._json("sinfo", "--json"))
        except SlurmAnswerError as exc:
            raise ProviderError(str(exc)) from None

    def _claims(self, jobs: Sequence[Job]) -> list[Job]:
        return [j for j in jobs if j.live and j.mine(self._uid, self._cluster, self._pool, CLAIM)]

    def _replicas(self, jobs: Sequence[Job]) -> list[Job]:
        return [j for j in jobs if j.mine(self._uid, self._cluster, self._pool, REPLICA)]

    # ----------------------------------------------------------------------------------- offerings

    async def offerings(self) -> list[Offering]:
        nodes, jobs = await asyncio.gather(self._nodes(), self._jobs())
        if not self._grace_checked:
            await self._check_grace()
        return self._offerings(nodes, jobs)

    async def _check_grace(self) -> None:
        """Say once, in the log, when the pool's grace_time_s is not what Slurm's training partitions have:
        kvgate would then expect replicas that take training's GPUs sooner or later than they start."""
        self._grace_checked = True
        why = grace_mismatch(self._settings, grace_times(await self._command("scontrol", "show", "partition", "-o")))
        if why:
            log.warning("pool %s: %s; set grace_time_s to match", self._pool, why)

    def _offerings(self, nodes: Sequence[SlurmNode], jobs: Sequence[Job]) -> list[Offering]:
        claims = self._claims(jobs)
        running = {}
        for job in self._replicas(jobs):
            if job.state == "RUNNING" and job.tags is not None:
                running[job.tags.claim] = running.get(job.tags.claim, 0) + sum(job.gpus_by_node.values())
        claimed = sum(claim_gpus(c) for c in claims)
        unfilled = sum(max(0, claim_gpus(c) - running.get(c.tags.claim, 0)) for c in claims if c.tags)
        return offerings(self._pool, self._settings, capacity(self._settings, nodes, jobs), claimed=claimed,
                         unfilled=unfilled)

    # --------------------------------------------------------------------------------------- nodes

    def _lost(self, jobs: Sequence[Job]) -> dict[str, str]:
        """Claim id -> why Slurm will not serve it (its nodes are INTERRUPTED)."""
        return lost_claims(self._replicas(jobs), now=self._clock.wall(), pending_timeout_s=self._settings.pending_timeout_s)

    def _node(self, claim: Job, jobs: Sequence[Job], lost: Mapping[str, str] | None = None) -> Node:
        """The Node a claim job stands for; `lost` (from `_lost(jobs)`) saves listing it again per claim."""
        tags = claim.tags
        assert tags is not None
        why = (self._lost(jobs) if lost is None else lost).get(tags.claim)
        return Node(id=claim.id, claim_id=tags.claim, pool=self._pool, instance_type=tags.instance_type,
                    capacity_type=CapacityType.ON_DEMAND, zone="",
                    state=NodeState.INTERRUPTED if why else NodeState.RUNNING, address=None,
                    tags={**tags.labels, **node_tags(self._cluster, NodeClaim(
                        id=tags.claim, offering=OfferingKey(self._pool, tags.instance_type, CapacityType.ON_DEMAND),
                        model=tags.model or None))},
                    launched_at=tags.created_at, price_usd_per_hour=tags.usd_per_hour, reason=why or "")

    async def create(self, claim: NodeClaim) -> Node:
        """Record `claim` as a held job, or return the node already recorded for it. NotFound for an
        offering the pool does not sell, InsufficientCapacity when it is unavailable now, QuotaExceeded past
        the pool's max_nodes/max_gpus/budget or the sharing ceiling."""
        if not SAFE_ID.match(claim.id):
            raise ProviderError(f"claim id {claim.id!r}: use letters, digits, '.', '_', '-' (up to 63)")
        async with self._submitting:
            return await self._create(claim)

    async def _create(self, claim: NodeClaim) -> Node:
        nodes, jobs = await asyncio.gather(self._nodes(), self._jobs())
        claims = self._claims(jobs)
        for existing in claims:
            if existing.tags is not None and existing.tags.claim == claim.id:
                return self._node(existing, jobs)
        on_sale = self._offerings(nodes, jobs)
        offering = next((o for o in on_sale if o.key == claim.offering), None)
        if offering is None:
            sold = ", ".join(o.instance_type for o in on_sale) or "no GPUs"
            raise NotFound(f"pool {self._pool!r} does not sell {claim.offering} (sinfo shows partition "
                           f"{self._settings.partition!r} with: {sold})")
        held = [(claim_gpus(c), c.tags.usd_per_hour if c.tags else 0.0) for c in claims]
        check_quota(self._pool, offering, held, max_nodes=self._spec.max_nodes, max_gpus=self._spec.max_gpus,
                    budget_usd_per_hour=self._spec.budget_usd_per_hour)
        ceiling = self._settings.sharing.ceiling_gpus if self._settings.sharing else None
        if ceiling is not None and sum(g for g, _ in held) + offering.gpu_count > ceiling:
            raise QuotaExceeded(f"pool {self._pool!r}: ceiling_gpus is {ceiling}; inference holds "
                                f"{sum(g for g, _ in held)} and {offering.instance_type} needs {offering.gpu_count}")
        if not offering.available:
            raise InsufficientCapacity(claim.offering, f"partition {self._settings.partition!r} has no "
                                       f"{offering.instance_type} free now")
        tags = Tags(kind=CLAIM, cluster=self._cluster, pool=self._pool, claim=claim.id,
                    instance_type=offering.instance_type, model=claim.model or "", created_at=self._clock.wall(),
                    usd_per_hour=offering.price_usd_per_hour, labels=dict(claim.labels))
        # Held, and due in ten years: released by a site tool that frees held jobs, it still never runs.
        job_id = await self._sbatch(job_name(self._cluster, CLAIM, claim.id), tags.comment(),
                                    ["--hold", "--begin=now+3650days", "--output=/dev/null", "--wrap=true"])
        log.info("pool %s: claim %s recorded as held Slurm job %s (%s)", self._pool, claim.id, job_id,
                 offering.instance_type)
        jobs = await self._jobs()
        [survivor] = await self._one_of([c for c in self._claims(jobs) if c.tags and c.tags.claim == claim.id]
                                        or [Job(id=job_id, name="", state="PENDING", reason="JobHeldUser",
                                                partition=self._settings.partition, node="", submit_time=0.0,
                                                start_time=0.0, exit_code=0, gpus_by_node={}, tags=tags)])
        return self._node(survivor, jobs)

    async def _one_of(self, twins: Sequence[Job]) -> list[Job]:
        """The oldest of jobs submitted for one id (another kvgate process raced this one); the rest are
        cancelled, so an id never holds two claims or runs two replicas."""
        ordered = sorted(twins, key=lambda j: int(j.id) if j.id.isdigit() else 0)
        if len(ordered) > 1:
            log.warning("pool %s: jobs %s were submitted for one id; keeping %s", self._pool,
                        ", ".join(j.id for j in ordered), ordered[0].id)
            await self._cancel(*(j.id for j in ordered[1:]))
        return ordered[:1]

    async def _cancel(self, *job_ids: str) -> None:
        try:
            await self._command("scancel", *job_ids)
        except NotFound:
            pass  # ended meanwhile: cancelled is what was wanted

    async def _sbatch(self, name: str, comment: str, args: Sequence[str], script: str | None = None) -> str:
        if len(comment) > MAX_COMMENT:
            raise ProviderError(f"pool {self._pool!r}: the job comment would be {len(comment)} characters, over "
                                f"Slurm's {MAX_COMMENT}; shorten the claim's labels")
        command = ["sbatch", "--parsable", f"--partition={self._settings.partition}", f"--job-name={name}",
                   f"--comment={comment}", *self._settings.sbatch_args, *args]
        out = await self._command(*command, stdin=script)
        return out.strip().split(";")[0]

    async def delete(self, node_id: str) -> None:
        """Cancel the claim's record and every replica job of the claim; unknown ids succeed."""
        jobs = await self._jobs()
        claim = next((c for c in self._claims(jobs) if c.id == node_id), None)
        if claim is None or claim.tags is None:
            return
        doomed = [j.id for j in self._replicas(jobs) if j.live and j.tags and j.tags.claim == claim.tags.claim]
        await self._cancel(*doomed, claim.id)
        log.info("pool %s: claim %s released (job %s; replica jobs %s)", self._pool, claim.tags.claim, claim.id,
                 ", ".join(doomed) or "none")

    async def list(self) -> list[Node]:
        jobs = await self._jobs()
        lost = self._lost(jobs)
        return [self._node(c, jobs, lost) for c in self._claims(jobs)]

    # ------------------------------------------------------------------------------------ replicas

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle:
        """Submit the replica's batch job on claim `node_id`, or return the replica already running under
        `replica_id`. NotFound for an unknown claim, NodeNotReady for one Slurm will not serve now."""
        if replica_id is not None and not SAFE_ID.match(replica_id):
            raise ProviderError(f"replica id {replica_id!r}: use letters, digits, '.', '_', '-' (up to 63)")
        async with self._submitting:
            return await self._start_replica(node_id, spec, replica_id)

    async def _start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None) -> ReplicaHandle:
        jobs = await self._jobs()
        claim = next((c for c in self._claims(jobs) if c.id == node_id), None)
        if claim is None or claim.tags is None:
            raise NotFound(f"pool {self._pool!r} has no node {node_id!r}")
        node = self._node(claim, jobs)
        if node.state is not NodeState.RUNNING:
            raise NodeNotReady(f"node {node_id} is {node.state.value}: {node.reason}")
        if replica_id is not None:
            for job in self._replicas(jobs):
                if job.tags is not None and job.tags.replica == replica_id and not job.stopping:
                    return (await self._handles([job], jobs))[0]
        replica_id = replica_id or f"{claim.tags.claim}-{uuid.uuid4().hex[:8]}"
        parsed = parse_instance_type(claim.tags.instance_type)
        gres = [f"--gres=gpu:{parsed[0]}:{spec.gpu_count}"] if parsed and spec.gpu_count else []
        tags = Tags(kind=REPLICA, cluster=self._cluster, pool=self._pool, claim=claim.tags.claim, model=spec.model,
                    replica=replica_id, created_at=self._clock.wall())
        self._log_dir.mkdir(parents=True, exist_ok=True)
        script = replica_script(self._python, self._engine_args(spec, replica_id), tags.comment(), replica_id)
        job_id = await self._sbatch(job_name(self._cluster, REPLICA, replica_id), tags.comment(),
                                    [*gres, "--no-requeue", f"--output={self._log_dir / replica_id}.log"], script)
        log.info("pool %s: replica %s of %s submitted as Slurm job %s", self._pool, replica_id, spec.model, job_id)
        twins = [j for j in self._replicas(await self._jobs()) if j.live and not j.stopping and j.tags
                 and j.tags.replica == replica_id]
        await self._one_of(twins)
        return ReplicaHandle(id=replica_id, model=spec.model, node_id=node_id, url="", grpc_target=None,
                             state=ReplicaState.STARTING, started_at=tags.created_at)

    def _engine_args(self, spec: ReplicaSpec, replica_id: str) -> list[str]:
        args = engine_args(spec, host="0.0.0.0", port=0, replica_id=replica_id, cache_dir=self._cache_dir,
                           drain_timeout_s=self._settings.drain_timeout_s)
        args = _drop_option(args, "--port")  # the job script picks the port on the node it lands on
        if self._settings.device:
            args = [*_drop_option(args, "--device"), "--device", self._settings.device]
        return args

    async def list_replicas(self) -> list[ReplicaHandle]:
        jobs = await self._jobs()
        mine = [j for j in self._replicas(jobs) if not (j.stopping and not j.live) and j.id not in self._dismissed]
        self._dismissed &= {j.id for j in jobs}
        latest: dict[str, Job] = {}
        for job in sorted(mine, key=lambda j: int(j.id) if j.id.isdigit() else 0):
            latest[job.tags.replica if job.tags else job.id] = job
        return sorted(await self._handles(list(latest.values()), jobs), key=lambda h: h.id)

    async def _handles(self, replicas: Sequence[Job], jobs: Sequence[Job]) -> list[ReplicaHandle]:
        """Handles of `replicas`, on the node ids of their claims among `jobs`."""
        addresses = {n.name: n.address for n in await self._nodes()} if any(j.endpoint for j in replicas) else {}
        claims = {c.tags.claim: c.id for c in self._claims(jobs) if c.tags is not None}
        return list(await asyncio.gather(*(self._handle(j, addresses, claims) for j in replicas)))

    async def _handle(self, job: Job, addresses: dict[str, str], claims: dict[str, str]) -> ReplicaHandle:
        tags = job.tags
        assert tags is not None
        state, reason = replica_state(job, now=self._clock.wall(), pending_timeout_s=self._settings.pending_timeout_s)
        if job.live and tags.claim not in claims:
            # A replica never outlives its claim (someone cancelled or released the held job): reported failed,
            # so the planner stops it and places the model again, rather than losing track of a running job.
            state, reason = ReplicaState.FAILED, f"its claim {tags.claim} is gone from Slurm (cancelled outside kvgate)"
        url, grpc = "", None
        if job.endpoint is not None and job.node:
            host = addresses.get(job.node, job.node)
            url, grpc = f"http://{host}:{job.endpoint[0]}", f"{host}:{job.endpoint[1]}"
            if state is ReplicaState.STARTING and job.state == "RUNNING":
                if job.id in self._ready or await http_status(host, job.endpoint[0], "/health",
                                                              self._health_timeout_s) == 200:
                    self._ready.add(job.id)
                    state = ReplicaState.READY
        if state is ReplicaState.FAILED and not job.live:
            tail = log_tail(self._log_dir / f"{tags.replica}.log", lines=8, max_chars=1200)
            reason = f"{reason}; log: {tail}" if tail else reason
        return ReplicaHandle(id=tags.replica, model=tags.model, node_id=claims.get(tags.claim, ""), url=url,
                             grpc_target=grpc, state=state, started_at=tags.created_at, reason=reason)

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        """Mark the job stopping, SIGTERM the engine, cancel the job once `drain_deadline_s` has passed.
        Unknown or stopped ids succeed, and so does a job that ends under the stop."""
        jobs = [j for j in self._replicas(await self._jobs()) if j.tags and j.tags.replica == replica_id]
        self._dismissed.update(j.id for j in jobs if not j.live or j.state == "COMPLETING")
        for job in (j for j in jobs if j.live and j.state != "COMPLETING"):
            assert job.tags is not None
            comment = job.tags.comment() + (f" port={job.endpoint[0]} grpc={job.endpoint[1]}" if job.endpoint else "")
            try:
                await self._command("scontrol", "update", f"JobId={job.id}", f"Comment={comment} stopping")
                if job.state == "RUNNING":
                    await self._command("scancel", "--signal=TERM", "--full", job.id)
                    deadline = self._clock.now() + max(0.0, drain_deadline_s)
                    while self._clock.now() < deadline and await self._alive(job.id):
                        await self._sleep(_POLL_S)
                await self._command("scancel", job.id)
            except NotFound:
                self._dismissed.add(job.id)  # it ended under the stop: stopped is what was asked
            self._ready.discard(job.id)
            log.info("pool %s: replica %s (Slurm job %s) stopped", self._pool, replica_id, job.id)

    async def _alive(self, job_id: str) -> bool:
        """Whether the job still runs (squeue filters by -j in this format, unlike --json: one line, not
        every job of the cluster, twice a second)."""
        try:
            state = (await self._command("squeue", "-h", "-j", job_id, "-o", "%T")).strip()
        except NotFound:
            return False
        return state in LIVE_STATES and state != "COMPLETING"

    async def close(self) -> None:
        """Nothing to release: every record lives in Slurm; jobs keep running for the next autoscaler."""


def _drop_option(args: Sequence[str], flag: str) -> list[str]:
    """`args` without `flag` and its value."""
    result, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        else:
            result.append(arg)
    return result


def from_pool(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, **options: Any) -> SlurmProvider:
    """`build_provider`'s entry: options are SlurmProvider's keywords (sleep, cache_dir, health_timeout_s)."""
    return SlurmProvider(pool_name, spec, cluster=cluster, clock=clock, **options)
