"""The `slurm` block of a Pool: which partition replicas run in, what its GPUs notionally cost, and how
inference shares the cluster with preemptible training (README, "Sharing a Slurm cluster with training").

A Slurm pool lists no `offers`: the provider reads them from `sinfo` (each GPU type and count per node of
the partition), priced at `gpu_hour_usd` per GPU, so Slurm capacity and cloud offers compete on one scale.
"""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from kvgate.registry.strict import FieldProblem, Strict

# Partition and gres type names as Slurm accepts them; anything else would reach sbatch's command line.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def _check_name(field: str, value: str) -> None:
    if not _SLURM_NAME.match(value):
        raise FieldProblem(field, f"{value!r} is not a Slurm name (letters, digits, '_', '.', '-')")


class SlurmGpuType(Strict):
    """What a gres GPU type of the partition is, in kvgate's words (Slurm knows only the type's name)."""

    kind: str = Field(description="The GPU kind models name in resources.gpu_kinds, e.g. H100.")
    memory_gib: float = Field(default=0.0, ge=0, description="Memory per GPU, for resources.min_gpu_memory_gib.")


class SlurmSharing(Strict):
    """Taking GPUs from preemptible training jobs, SUNK-style.

    Training runs in `partitions` with `PreemptMode=REQUEUE` and a `GraceTime`; the pool's partition has a
    higher `PriorityTier`, so Slurm requeues training when a replica needs its GPUs. The provider then also
    offers GPUs held by training, at `gpu_hour_usd` each (above the free GPUs' price and below a cloud's, so
    the planner takes free GPUs first, then training's, then buys cloud nodes)."""

    partitions: tuple[str, ...] = Field(min_length=1, description="Partitions whose jobs inference may preempt.")
    gpu_hour_usd: float = Field(ge=0, description="Notional price of one GPU taken from training for an hour.")
    floor_gpus: int = Field(default=0, ge=0, description="GPUs inference always takes at the free price, "
                            "preempting training if it must: training never holds these against inference.")
    ceiling_gpus: int | None = Field(default=None, ge=0, description="Most GPUs inference holds in this pool at "
                                     "once, free or taken; training keeps the rest. Unset: no ceiling.")
    grace_time_s: float = Field(default=60.0, ge=0, description="The training partitions' GraceTime: how long a "
                                "preempted job has to checkpoint before Slurm requeues it and a replica starts.")

    @model_validator(mode="after")
    def _names_and_bounds(self) -> SlurmSharing:
        for index, name in enumerate(self.partitions):
            _check_name(f"partitions[{index}]", name)
        if self.ceiling_gpus is not None and self.floor_gpus > self.ceiling_gpus:
            raise FieldProblem("floor_gpus", f"{self.floor_gpus} is above ceiling_gpus {self.ceiling_gpus}")
        return self


class SlurmSettings(Strict):
    partition: str = Field(description="The partition replica jobs run in (a high PriorityTier where it shares "
                           "nodes with training).")
    gpu_hour_usd: float = Field(ge=0, description="Notional price of one free GPU of the partition for an hour.")
    gpu_types: dict[str, SlurmGpuType] = Field(
        min_length=1, description="The partition's gres GPU types (the TYPE of gpu:TYPE:N), e.g. "
                                  "{h100: {kind: H100, memory_gib: 80}}; other types are not offered.")
    conf: str | None = Field(default=None, description="slurm.conf for the Slurm commands (SLURM_CONF); unset: "
                             "the commands' default.")
    python: str | None = Field(default=None, description="The Python with kvgate on the compute nodes; unset: "
                               "the autoscaler's own (a venv on a shared file system).")
    log_dir: str = Field(default=".kvgate/slurm", description="Where replica jobs write their logs; on a "
                         "multi-node cluster, a shared file system path, so failures can quote the log.")
    sbatch_args: tuple[str, ...] = Field(default=(), description="Extra sbatch options for every job kvgate "
                                         "submits, e.g. [--account=inference, --qos=serving].")
    device: str | None = Field(default=None, description="The engine's --device; unset: cuda for GPU models. "
                               "cpu runs on a test cluster whose GPUs are fake.")
    pending_timeout_s: float = Field(default=300.0, gt=0, description="A replica job still pending after this "
                                     "is insufficient capacity: its claim is given up and the planner looks "
                                     "elsewhere.")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="The engine's drain on SIGTERM.")
    sharing: SlurmSharing | None = Field(default=None, description="Take GPUs from preemptible training.")

    @model_validator(mode="after")
    def _consistent(self) -> SlurmSettings:
        _check_name("partition", self.partition)
        for name in self.gpu_types:
            _check_name(f"gpu_types.{name}", name)
        for index, arg in enumerate(self.sbatch_args):
            if not arg.startswith("--") or "\n" in arg:
                raise FieldProblem(f"sbatch_args[{index}]", f"{arg!r}: write long options, e.g. --account=NAME")
        if self.sharing is not None:
            if self.partition in self.sharing.partitions:
                raise FieldProblem("sharing.partitions", f"{self.partition!r} is the pool's own partition; "
                                   "name the training partitions")
            if self.pending_timeout_s <= self.sharing.grace_time_s:
                raise FieldProblem("pending_timeout_s", f"{self.pending_timeout_s:g} s is not above the grace time "
                                   f"{self.sharing.grace_time_s:g} s: every preemption would count as no capacity")
        return self
