"""`LocalProvider`: the embedded default. Nodes are slots on this machine; replicas are `kvgate engine`
child processes on free loopback ports.

- **Nodes**: the pool has `max_nodes` slots (default 1). `create` takes a free slot by creating its node
  file with O_EXCL (so two kvgate processes on one work_dir cannot take the same slot); a node is RUNNING
  at once. More claims than slots raise **QuotaExceeded** (the slot count is the pool's `max_nodes`
  quota; the offerings stay available=True, since nothing is sold out, the pool is full).
- **Replicas**: `python -m kvgate.engine ...` (`kvgate engine`) started in a new session, hence its own process
  group, so a stop takes its whole tree. Output goes to `<work_dir>/replicas/<id>.log`; a pid file
  `<id>.json` beside it records pid, start time (clock ticks, so a recycled pid is never mistaken for
  ours), ports, model, node and cluster. `list_replicas` probes GET /health of replicas still starting:
  200 means READY. A replica whose process is gone is FAILED, its reason the exit status and the last
  lines of its log, and any process left in its group is killed.
- **Stop**: SIGTERM to the group (the engine drains), SIGKILL once `drain_deadline_s` has passed.
- **Restart**: a new LocalProvider on the same work_dir finds the node and pid files: live replicas are
  adopted (listed, health-checked, stoppable), dead ones are reported FAILED with their log tail and
  their leftover processes killed, until `stop_replica` removes them. No process is orphaned.

Nodes and replicas are scoped to (cluster, pool) like cloud tags: another cluster on the same work_dir
sees none of them, but shares the slots, as it shares the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvgate.clock import Clock
from kvgate.providers.base import (Node, NodeClaim, NodeState, NotFound, Offering, ProviderError, QuotaExceeded,
                            ReplicaHandle, ReplicaSpec, ReplicaState, engine_args, node_tags, offerings_from_pool)
from kvgate.providers.pool_provider import PoolProvider
from kvgate.providers.local_proc import (describe_exit, free_port, http_status, is_alive, log_tail, our_group, proc_stat,
                                  reap, signal_group)
from kvgate.registry.schema import CapacityType, LocalSettings, PoolSpec

REGION = "local"
_POLL_S = 0.05  # how often a stop checks whether the process has exited
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KILL_WAIT_S = 5.0  # most time a SIGKILLed process takes to be gone


class LocalProvider(PoolProvider):
    """See the module docstring. `command` is what runs `kvgate engine` (default: this interpreter with
    `-m engine`); `cache_dir` is passed as --cache-dir (builtin model weights); `env` is added to the
    children's environment."""

    def __init__(self, pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock,
                 cache_dir: str | Path | None = None, command: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, delete_drain_s: float = 5.0,
                 health_timeout_s: float = 0.5) -> None:
        settings = spec.local or LocalSettings()
        super().__init__(pool_name, cluster=cluster, clock=clock)
        self._spec = spec
        self._host = settings.host
        self._slots = spec.max_nodes if spec.max_nodes is not None else 1
        self.work_dir = Path(settings.work_dir)
        self._nodes_dir = self.work_dir / "nodes"
        self._replicas_dir = self.work_dir / "replicas"
        self._cache_dir = str(cache_dir) if cache_dir is not None else None
        self._command = list(command) if command is not None else [sys.executable, "-m", "kvgate.engine"]
        self._env = dict(env or {})
        self._delete_drain_s = delete_drain_s
        self._health_timeout_s = health_timeout_s
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # replicas this instance started: reaped here
        self._ready: set[str] = set()  # replicas seen healthy once: not probed again while their process lives
        self._adopted = False

    # ------------------------------------------------------------------------------------------ nodes

    async def offerings(self) -> list[Offering]:
        return offerings_from_pool(self._pool, self._spec, default_region=REGION)

    async def create(self, claim: NodeClaim) -> Node:
        existing = self._find_claim(claim.id)
        if existing is not None:
            return existing
        if claim.pool != self._pool:
            raise NotFound(f"claim {claim.id} is for pool {claim.pool!r}; this provider serves {self._pool!r}")
        offering = self._offering(claim)
        self._nodes_dir.mkdir(parents=True, exist_ok=True)
        for slot in range(self._slots):
            node = Node(id=f"{self._pool}-slot-{slot}", claim_id=claim.id, pool=self._pool,
                        instance_type=offering.instance_type, capacity_type=offering.capacity_type,
                        zone=offering.zone or REGION, state=NodeState.RUNNING, address=self._host,
                        tags=node_tags(self._cluster, claim), launched_at=self._clock.wall(),
                        price_usd_per_hour=offering.price_usd_per_hour)
            try:
                fd = os.open(self._nodes_dir / f"{node.id}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(_node_json(node, self._cluster), handle)
            return node
        raise QuotaExceeded(f"local pool {self._pool!r} has {self._slots} slot(s) (max_nodes), all taken")

    async def delete(self, node_id: str) -> None:
        node = self._node(node_id)
        if node is None:
            return
        for record in self._records():
            if record["node_id"] == node_id:
                await self.stop_replica(record["id"], self._delete_drain_s)
        (self._nodes_dir / f"{node_id}.json").unlink(missing_ok=True)

    async def list(self) -> list[Node]:
        nodes = []
        for path in sorted(self._nodes_dir.glob("*.json")):
            node = self._node(path.stem)
            if node is not None:
                nodes.append(node)
        return nodes

    # --------------------------------------------------------------------------------------- replicas

    async def start_replica(self, node_id: str, spec: ReplicaSpec, replica_id: str | None = None) -> ReplicaHandle:
        self._adopt()
        if replica_id is not None:
            if not _SAFE_ID.fullmatch(replica_id):
                raise ValueError(f"replica id {replica_id!r}: use letters, digits, '.', '_' and '-' (it names files)")
            record = self._record(replica_id)
            if record is not None:
                return await self._handle(record)
        if self._node(node_id) is None:
            raise NotFound(f"no node {node_id!r} in local pool {self._pool!r} of cluster {self._cluster!r}")
        replica_id = replica_id or f"{node_id}-{uuid.uuid4().hex[:8]}"
        http_port = free_port(self._host)
        grpc_port = free_port(self._host)
        while grpc_port == http_port:
            grpc_port = free_port(self._host)
        command = [*self._command, *engine_args(spec, host=self._host, port=http_port, grpc_port=grpc_port,
                                                replica_id=replica_id, cache_dir=self._cache_dir)]
        self._replicas_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._replicas_dir / f"{replica_id}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._env}
        try:
            with open(log_path, "ab") as log:
                child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        except OSError as exc:
            raise ProviderError(f"cannot start the engine ({command[0]}): {exc}") from exc
        stat = proc_stat(child.pid)
        record = {
            "id": replica_id, "cluster": self._cluster, "pool": self._pool, "node_id": node_id, "model": spec.model,
            "pid": child.pid, "pgid": child.pid, "start_ticks": stat.start_ticks if stat else 0,
            "cmdline": command, "host": self._host, "http_port": http_port, "grpc_port": grpc_port,
            "started_at": self._clock.wall(), "log": str(log_path), "failed": None,
        }
        self._children[replica_id] = child
        self._write_record(record)
        return _handle_of(record, ReplicaState.STARTING)

    async def stop_replica(self, replica_id: str, drain_deadline_s: float = 30.0) -> None:
        record = self._record(replica_id)
        if record is None:
            return
        if self._alive(record):
            signal_group(record["pgid"], signal.SIGTERM, record["start_ticks"])
            deadline = self._clock.now() + max(0.0, drain_deadline_s)
            while self._alive(record) and self._clock.now() < deadline:
                await self._clock.sleep(_POLL_S)
        # SIGKILL whatever is left of the tree: the leader past its deadline, or helpers it left behind.
        signal_group(record["pgid"], signal.SIGKILL, record["start_ticks"])
        child = self._children.pop(replica_id, None)
        if child is not None:
            await asyncio.to_thread(child.wait)
        # SIGKILL is not instant: wait (bounded) until the whole group is gone, so that a stop that returned
        # means nothing of the replica runs, then reap the leader if an earlier instance here started it.
        deadline = self._clock.now() + _KILL_WAIT_S
        while our_group(record["pgid"], record["start_ticks"]) and self._clock.now() < deadline:
            await self._clock.sleep(_POLL_S)
        reap(record["pid"], record["start_ticks"])
        self._ready.discard(replica_id)
        (self._replicas_dir / f"{replica_id}.json").unlink(missing_ok=True)

    async def stop_all(self, drain_deadline_s: float = 30.0) -> None:
        """Stop every replica of this cluster and pool, concurrently (kvgate shutting down)."""
        await asyncio.gather(*(self.stop_replica(r["id"], drain_deadline_s) for r in self._records()))

    async def list_replicas(self) -> list[ReplicaHandle]:
        self._adopt()
        return list(await asyncio.gather(*(self._handle(r) for r in self._records())))

    async def wait_ready(self, replica_id: str, timeout_s: float, poll_s: float = 0.1) -> ReplicaHandle:
        """Poll until the replica is READY or FAILED, or `timeout_s` passes; returns its last handle.
        Raises NotFound for an unknown replica."""
        deadline = self._clock.now() + timeout_s
        while True:
            record = self._record(replica_id)
            if record is None:
                raise NotFound(f"no replica {replica_id!r}")
            handle = await self._handle(record)
            if handle.state is not ReplicaState.STARTING or self._clock.now() >= deadline:
                return handle
            await self._clock.sleep(poll_s)

    async def close(self) -> None:
        # Replicas keep running: a restarted kvgate adopts them through their pid files. The Popen objects
        # are dropped; Python reaps those children when they exit, the OS reparents them if we exit first.
        self._children.clear()

    # ---------------------------------------------------------------------------------------- helpers

    def _offering(self, claim: NodeClaim) -> Offering:
        for offering in offerings_from_pool(self._pool, self._spec, default_region=REGION):
            key = offering.key
            if (key.instance_type, key.capacity_type) == (claim.offering.instance_type, claim.offering.capacity_type) \
                    and claim.offering.zone in ("", key.zone):
                return offering
        raise NotFound(f"local pool {self._pool!r} does not sell {claim.offering}")

    def _node(self, node_id: str) -> Node | None:
        data = _read_json(self._nodes_dir / f"{node_id}.json")
        if data is None or data.get("cluster") != self._cluster or data.get("pool") != self._pool:
            return None
        return _node_from_json(data)

    def _find_claim(self, claim_id: str) -> Node | None:
        for path in sorted(self._nodes_dir.glob("*.json")):
            data = _read_json(path)
            if data and data.get("cluster") == self._cluster and data.get("claim_id") == claim_id:
                return _node_from_json(data)
        return None

    def _records(self) -> list[dict[str, Any]]:
        records = []
        for path in sorted(self._replicas_dir.glob("*.json")):
            data = _read_json(path)
            if data is not None and data.get("cluster") == self._cluster and data.get("pool") == self._pool:
                records.append(data)
        return records

    def _record(self, replica_id: str) -> dict[str, Any] | None:
        data = _read_json(self._replicas_dir / f"{replica_id}.json")
        if data is None or data.get("cluster") != self._cluster or data.get("pool") != self._pool:
            return None
        return data

    def _write_record(self, record: dict[str, Any]) -> None:
        path = self._replicas_dir / f"{record['id']}.json"
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, path)  # atomic: a reader sees the old or the new record, never half of one

    def _alive(self, record: dict[str, Any]) -> bool:
        child = self._children.get(record["id"])
        if child is not None:
            return child.poll() is None
        return is_alive(record["pid"], record["start_ticks"])

    def _adopt(self) -> None:
        """Once per instance: mark replicas that died while no provider watched them FAILED and end their
        leftovers; live ones need nothing (they are listed and health-checked like our own)."""
        if self._adopted:
            return
        self._adopted = True
        for record in self._records():
            if record.get("failed") is None and not self._alive(record):
                self._mark_failed(record, "exited while no kvgate was watching it")

    def _mark_failed(self, record: dict[str, Any], what: str) -> None:
        signal_group(record["pgid"], signal.SIGKILL, record["start_ticks"])
        reap(record["pid"], record["start_ticks"])
        tail = log_tail(Path(record["log"]))
        record["failed"] = f"the engine {what}" + (f"; last lines of {record['log']}:\n{tail}" if tail else "")
        self._ready.discard(record["id"])
        self._write_record(record)

    async def _handle(self, record: dict[str, Any]) -> ReplicaHandle:
        if record.get("failed") is None and not self._alive(record):
            child = self._children.pop(record["id"], None)
            self._mark_failed(record, describe_exit(child.wait() if child is not None else None))
        if record.get("failed") is not None:
            return _handle_of(record, ReplicaState.FAILED, record["failed"])
        if record["id"] in self._ready:
            return _handle_of(record, ReplicaState.READY)
        status = await http_status(record["host"], record["http_port"], "/health", self._health_timeout_s)
        if status == 200:
            self._ready.add(record["id"])
            return _handle_of(record, ReplicaState.READY)
        return _handle_of(record, ReplicaState.STARTING)


def _handle_of(record: Mapping[str, Any], state: ReplicaState, reason: str = "") -> ReplicaHandle:
    return ReplicaHandle(id=record["id"], model=record["model"], node_id=record["node_id"],
                         url=f"http://{record['host']}:{record['http_port']}",
                         grpc_target=f"{record['host']}:{record['grpc_port']}", state=state,
                         started_at=record["started_at"], reason=reason)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # gone, or being replaced: os.replace makes a torn read impossible, deletion is not
    return data if isinstance(data, dict) else None


def _node_json(node: Node, cluster: str) -> dict[str, Any]:
    return {"id": node.id, "claim_id": node.claim_id, "cluster": cluster, "pool": node.pool,
            "instance_type": node.instance_type, "capacity_type": node.capacity_type.value, "zone": node.zone,
            "address": node.address, "tags": dict(node.tags), "launched_at": node.launched_at,
            "price_usd_per_hour": node.price_usd_per_hour}


def _node_from_json(data: Mapping[str, Any]) -> Node:
    return Node(id=data["id"], claim_id=data["claim_id"], pool=data["pool"], instance_type=data["instance_type"],
                capacity_type=CapacityType(data["capacity_type"]), zone=data["zone"], state=NodeState.RUNNING,
                address=data["address"], tags=data["tags"], launched_at=data["launched_at"],
                price_usd_per_hour=data["price_usd_per_hour"])


def from_pool(pool_name: str, spec: PoolSpec, *, cluster: str, clock: Clock, **options: Any) -> LocalProvider:
    """`build_provider`'s entry: options are LocalProvider's keyword arguments (cache_dir, command, env, ...)."""
    return LocalProvider(pool_name, spec, cluster=cluster, clock=clock, **options)
