"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd as root in a fresh folder.

`slurm_cluster(work_dir)` writes slurm.conf and gres.conf for this host (the node name must equal
`hostname -s`), backs four fake H100s with character devices (Slurm refuses plain files), starts its own
munged on its own socket, then slurmctld and slurmd, and waits until the node is idle. Two partitions
share the node, as a cluster shared between inference and training is set up (README, "Sharing a Slurm
cluster with training"):

- `inference`: PriorityTier 10, never preempted;
- `training`: PriorityTier 1, `PreemptMode=REQUEUE` with `GraceTime` (10 s here), the default partition.

Every command a test runs needs `SLURM_CONF`; `SlurmCluster.env` holds it. On exit every job is cancelled
and each daemon is stopped by the pid in its pid file (slurmd takes ~10 s after `scontrol shutdown`).
Requires root and Debian's `slurm-wlm` (`make test` installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.services import free_loopback_port

GPUS = 4
GPU_TYPE = "h100"
GRACE_TIME_S = 10
INFERENCE = "inference"
TRAINING = "training"


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: its folder, node name, and the environment its commands need."""

    root: Path
    node: str

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> str:
        """One Slurm command's stdout, e.g. `run("scontrol", "show", "node")`."""
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, errors="replace", timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> list[dict]:
        """Every job slurmctld still holds (`squeue --json` lists all; callers filter)."""
        return json.loads(self.run("squeue", "--json", "--all"))["jobs"]

    def live_jobs(self, name_prefix: str = "") -> list[dict]:
        """Jobs that are not finished, whose name starts with `name_prefix`."""
        return [j for j in self.jobs() if j["name"].startswith(name_prefix)
                and j["job_state"] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")]

    def gpus_used(self) -> int:
        """GPUs allocated to jobs on the node now (sinfo's gres_used)."""
        [node] = json.loads(self.run("sinfo", "--json"))["nodes"]
        used = node.get("gres_used") or ""
        return int(used.split(":")[2].split("(")[0]) if used.startswith("gpu:") else 0

    def submit_training(self, *, gpus: int = GPUS, name: str = "train", script: str = "sleep 3600") -> str:
        """A training job holding `gpus` fake GPUs in the preemptible partition; returns its job id.
        Its output goes to <root>/<name>-<jobid>.out."""
        out = self.run("sbatch", "--parsable", f"--partition={TRAINING}", f"--gres=gpu:{GPU_TYPE}:{gpus}",
                       f"--job-name={name}", "--requeue", "--open-mode=append", f"--output={self.root}/{name}-%j.out",
                       f"--wrap={script}")
        return out.strip().split(";")[0]

    def cancel_all(self) -> None:
        """Cancel every user's jobs (tests also submit as `nobody`)."""
        ids = [str(j["job_id"]) for j in self.live_jobs()]
        if ids:
            self.run("scancel", *ids, check=False)

    def clean(self, timeout_s: float = 60.0) -> None:
        """Cancel every job and wait until none holds the node, so the next test starts on an idle cluster."""
        self.cancel_all()
        deadline = time.monotonic() + timeout_s
        while self.live_jobs() and time.monotonic() < deadline:
            time.sleep(0.3)
        if self.live_jobs():
            raise RuntimeError(f"jobs still alive {timeout_s:.0f} s after scancel: {self.live_jobs()}")

    def wait_state(self, job_id: str, state: str, timeout_s: float = 60.0) -> dict:
        """Wait until job `job_id` is in `state` (squeue's job_state); its record."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            seen = next((j for j in self.jobs() if str(j["job_id"]) == job_id), None)
            if seen is not None and seen["job_state"] == state:
                return seen
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} not {state} in {timeout_s:.0f} s: "
                             f"{seen and (seen['job_state'], seen['state_reason'])}")


def _write_config(root: Path, node: str) -> None:
    gpus = root / "gpus"
    gpus.mkdir()
    for index in range(GPUS):
        os.mknod(gpus / f"fakegpu{index}", 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
    (root / "state").mkdir()
    (root / "spool").mkdir()
    (root / "gres.conf").write_text(
        f"AutoDetect=off\nNodeName={node} Name=gpu Type={GPU_TYPE} File={gpus}/fakegpu[0-{GPUS - 1}]\n")
    lines = [
        "ClusterName=kvgate-test", f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_loopback_port()}", f"SlurmdPort={free_loopback_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        # cred_expire: a requeued job may start again only this long after it ended (default 120 s).
        f"AuthType=auth/munge", f"AuthInfo=socket={root}/munge.socket,cred_expire=10", "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "GresTypes=gpu", "ReturnToService=2", "SlurmdParameters=config_overrides",
        "MinJobAge=120", "MailProg=/bin/true", "MpiDefault=none", "KillWait=5", "SchedulerParameters=sched_min_interval=100000",
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        # 8 CPUs on any machine (config_overrides): room for replicas and training side by side.
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN",
        f"PartitionName={INFERENCE} Nodes={node} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
        f"PartitionName={TRAINING} Nodes={node} PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_TIME_S} "
        "Default=YES MaxTime=INFINITE State=UP",
    ]
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")


def _stop(pid_file: Path, timeout_s: float = 20.0) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _start(command: Sequence[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")


def _wait_idle(cluster: SlurmCluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=cluster.env, capture_output=True, text=True)
        last = done.stdout.strip() or done.stderr.strip()
        if done.returncode == 0 and last.split("\n")[0] == "idle":
            return
        time.sleep(0.3)
    log = (cluster.root / "slurmctld.log").read_text(errors="replace")[-2000:] if (cluster.root / "slurmctld.log").exists() else ""
    raise RuntimeError(f"the Slurm node did not become idle in {timeout_s:.0f} s (sinfo: {last!r})\n{log}")


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start a fresh single-node cluster in `root` (an empty folder) and stop it on exit."""
    node = socket.gethostname().split(".")[0]
    _write_config(root, node)
    cluster = SlurmCluster(root, node)
    env = cluster.env
    try:
        # munged as root (--force) on the cluster's own socket: no system munged, no clash with one.
        _start(["/usr/sbin/munged", "--force", f"--socket={root}/munge.socket", f"--pid-file={root}/munged.pid",
                f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"], env)
        _start(["slurmctld", "-i"], env)
        _start(["slurmd"], env)
        _wait_idle(cluster)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.cancel_all()
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        _stop(root / "munged.pid")
