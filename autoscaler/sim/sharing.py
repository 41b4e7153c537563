"""`kvgate sim --shared-slurm GPUS`: one Slurm cluster shared by inference and a training backlog, against two
separate clusters of the same total size.

Both arrangements run kvgate's replica step (`KvgatePolicy`: the live scaler's `decide_replicas`, the registry's
knobs) on the same trace; only where a replica's GPUs come from differs (`training.py` has the rules):
- **separate**: an inference cluster of G_inf GPUs (replicas capped at G_inf / GPUs per replica; GPUs it does not use
  stay idle) and a training cluster of the other GPUs running the backlog alone, never preempted;
- **shared**: one cluster of all the GPUs; training runs on every GPU inference does not hold, and a replica that
  needs GPUs training holds waits for the preempted jobs' grace before its cold start. Inference holds at most the
  ceiling (default G_inf: the same inference capacity as the separate split, so the comparison is where GPUs come
  from, not how many inference may have).

G_inf, unless given, is the most GPUs kvgate's own fleet holds on a dedicated cluster of all the GPUs (warm-up
included): what a separate inference cluster needs for kvgate to run unconstrained. That run is replayed on a
cluster of exactly G_inf GPUs as the separate arrangement's inference (the cap never binds, so the decisions are the
same). A replica is a Slurm job on nodes that already run: its cold start is the model load (`performance.model_load_s`)
without a node boot, and the scaler plans with it in both arrangements (its forecast horizon and backlog drain time:
the same decision inputs, so a start delayed by a grace is a cost of sharing, not a different policy). The
opening fleet (ready at t=0, before the warm-up) is what the trace's first model load needs at 80% of the batch
slots (the oracle's need curve, `baselines.oracle_need`). The replica's service figures are the model's
for its first GPU kind with figures. Spot, stockouts and failed starts do not apply: the cluster is owned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvgate.autoscaler.demand import ScalerSpec
from kvgate.autoscaler.sim.baselines import KvgatePolicy, oracle_need
from kvgate.autoscaler.sim.compare import summarize, with_overrides
from kvgate.autoscaler.sim.engine import simulate
from kvgate.autoscaler.sim.records import FleetSetup, RunResult
from kvgate.autoscaler.sim.service import Placement, ServiceModel, SimConfigError, service_model
from kvgate.autoscaler.sim.training import BacklogSpec, ClusterSpec, ClusterUse, training_only
from kvgate.autoscaler.sim.traces import Trace, with_warmup
from kvgate.autoscaler.work import ReplicaCapacity
from kvgate.registry.schema import CapacityType, ModelDoc
from kvgate.registry.snapshot import Snapshot


@dataclass(frozen=True)
class SharingSpec:
    """The cluster and its pool policy, as `kvgate sim --shared-slurm` options set them."""

    cluster_gpus: int
    backlog: BacklogSpec = BacklogSpec()
    grace_s: float = 60.0
    inference_gpus: int | None = None  # G_inf of the separate split; None: kvgate's peak on a dedicated cluster
    ceiling_gpus: int | None = None  # the shared cluster's inference ceiling; None: G_inf
    reserve_gpus: int = 0  # the shared cluster's reserve for inference (training.py)


@dataclass(frozen=True)
class Arrangement:
    """One row of the table: how the GPUs were arranged, what inference got, and the cluster's GPU-hours."""

    name: str  # "separate" | "shared"
    layout: str  # e.g. "48 + 80" (inference + training clusters) or "128 shared"
    slo_attainment: float
    ttft_p99_s: float
    peak_replicas: int
    cold_starts: int
    use: ClusterUse


@dataclass(frozen=True)
class SharingComparison:
    trace: str
    model: str
    num_requests: int
    gpu_kind: str
    gpus_per_replica: int
    model_load_s: float
    spec: SharingSpec
    inference_gpus: int  # G_inf, as used
    split_rule: str  # how G_inf was chosen
    ceiling_gpus: int  # the shared cluster's inference ceiling, as used
    arrangements: tuple[Arrangement, ...]


@dataclass(frozen=True)
class _Setup:
    """What every run of one comparison shares."""

    trace: Trace  # with its warm-up
    model: ModelDoc
    service: ServiceModel
    scaler: ScalerSpec
    warmup_s: float
    opening: int  # replicas ready at t=0 (within the cluster's cap)

    @property
    def gpus(self) -> int:
        return self.model.spec.resources.gpu_count

    @property
    def end_s(self) -> float:
        return self.trace.duration_s + FleetSetup.tail_s  # where the engine ends a run

    def run(self, cluster: ClusterSpec) -> RunResult:
        """kvgate's fleet on `cluster`, from the opening fleet."""
        model = self.model
        load_s = model.spec.performance.model_load_s
        placement = Placement("slurm", "slurm", CapacityType.ON_DEMAND, 0.0, self.gpus, load_s, self.service)
        scaling = model.spec.scaling
        top = min(scaling.max_replicas, cluster.inference_ceiling_gpus // self.gpus)
        if top < max(1, scaling.min_replicas):
            raise SimConfigError(f"{cluster.inference_ceiling_gpus} GPUs for inference hold no replica of "
                                 f"{self.gpus} GPUs (Model/{model.metadata.name} min_replicas {scaling.min_replicas})")
        fleet = FleetSetup(model.metadata.name, (placement,), scaling.min_replicas, top, 0,
                           (model.spec.slo.ttft_ms or 0) / 1000.0, initial_replicas=min(top, self.opening),
                           cluster=cluster)
        return simulate(self.trace, fleet, KvgatePolicy(self.scaler), score_from_s=self.warmup_s)


def compare_sharing(trace: Trace, snapshot: Snapshot, model_name: str, spec: SharingSpec, *, warmup_s: float = 600.0,
                    kvgate_scaling: Mapping[str, Any] | None = None) -> SharingComparison:
    """The separate and shared arrangements of `spec.cluster_gpus` GPUs on `trace` (module docstring).

    Raises `SimConfigError` for a model the simulator cannot score, or a cluster that cannot hold the split: too few
    GPUs for one replica, G_inf or the ceiling over the cluster, or a training cluster smaller than a backlog job.
    """
    total = spec.cluster_gpus
    if max(spec.backlog.gpus_per_job) > total:
        raise SimConfigError(f"the backlog's {max(spec.backlog.gpus_per_job)}-GPU jobs do not fit the {total}-GPU "
                             f"cluster")
    setup = _setup(trace, snapshot, model_name, warmup_s, kvgate_scaling)
    if spec.inference_gpus is None:
        sized = setup.run(ClusterSpec(total, total, score_from_s=warmup_s))
        assert sized.cluster_use is not None
        inference_gpus = sized.cluster_use.peak_inference_gpus
        rule = "kvgate's peak on a dedicated cluster"
    else:
        inference_gpus, rule = spec.inference_gpus, "--inference-gpus"
    ceiling = inference_gpus if spec.ceiling_gpus is None else spec.ceiling_gpus
    _check_split(spec, setup, inference_gpus, ceiling)
    training_gpus = total - inference_gpus
    separate = setup.run(ClusterSpec(inference_gpus, inference_gpus, score_from_s=warmup_s))
    assert separate.cluster_use is not None
    if training_gpus:
        alone = ClusterSpec(training_gpus, 0, spec.backlog, spec.grace_s, own_training_gpus=training_gpus,
                            score_from_s=warmup_s)
        separate_use = separate.cluster_use.plus(training_only(alone, setup.end_s))
    else:
        separate_use = separate.cluster_use
    shared = setup.run(ClusterSpec(total, ceiling, spec.backlog, spec.grace_s, spec.reserve_gpus, training_gpus,
                                   score_from_s=warmup_s))
    assert shared.cluster_use is not None
    slo_s = (setup.model.spec.slo.ttft_ms or 0) / 1000.0
    rows = (_row("separate", f"{inference_gpus} + {training_gpus}", separate, separate_use, slo_s),
            _row("shared", f"{total} shared", shared, shared.cluster_use, slo_s))
    return SharingComparison(setup.trace.name, model_name, len(separate.ttft_s), setup.service.gpu_kind,
                             setup.gpus, setup.model.spec.performance.model_load_s, spec, inference_gpus, rule, ceiling,
                             rows)


def _setup(trace: Trace, snapshot: Snapshot, model_name: str, warmup_s: float,
           kvgate_scaling: Mapping[str, Any] | None) -> _Setup:
    model = snapshot.model(model_name)
    if model.spec.slo.ttft_ms is None:
        raise SimConfigError(f"Model/{model_name} has no spec.slo.ttft_ms: the simulator scores TTFT against it")
    kinds = [k for k in model.spec.resources.gpu_kinds
             if any(entry.gpu_kind == k for entry in model.spec.performance.gpu_kinds)]
    if not kinds:
        raise SimConfigError(f"Model/{model_name} has no spec.performance.gpu_kinds entry for its GPU kinds "
                             f"{list(model.spec.resources.gpu_kinds)}")
    scaler = ScalerSpec(with_overrides(model.spec.scaling, kvgate_scaling or {}), model.spec.performance.model_load_s,
                        capacity=ReplicaCapacity.of(model))
    warm, service = with_warmup(trace, warmup_s), service_model(model, kinds[0])
    # The opening fleet: what the first model load's seconds need at 80% of the batch slots (the oracle's need curve),
    # so the warm-up starts near the trace's level rather than panicking up from one replica (that overshoot would
    # set G_inf).
    need = oracle_need(warm, service, 0.8, window_s=60)
    first = max(need[:int(model.spec.performance.model_load_s) + 1], default=0)
    opening = max(1, model.spec.scaling.min_replicas, min(model.spec.scaling.max_replicas, first))
    return _Setup(warm, model, service, scaler, warmup_s, opening)


def _check_split(spec: SharingSpec, setup: _Setup, inference_gpus: int, ceiling: int) -> None:
    total = spec.cluster_gpus
    if not setup.gpus <= inference_gpus <= total:
        raise SimConfigError(f"--inference-gpus {inference_gpus}: between one replica's {setup.gpus} GPUs and the "
                             f"cluster's {total}")
    if not setup.gpus <= ceiling <= total:
        raise SimConfigError(f"--inference-ceiling-gpus {ceiling}: between one replica's {setup.gpus} GPUs and the "
                             f"cluster's {total}")
    biggest = max(spec.backlog.gpus_per_job)
    if total - inference_gpus and total - inference_gpus < biggest:
        raise SimConfigError(f"the separate training cluster ({total} - {inference_gpus} = {total - inference_gpus} "
                             f"GPUs) cannot run the backlog's {biggest}-GPU jobs: a larger --shared-slurm or smaller "
                             f"--training-gpus-per-job")


def _row(name: str, layout: str, result: RunResult, use: ClusterUse, slo_s: float) -> Arrangement:
    summary = summarize(result, slo_s)
    return Arrangement(name, layout, summary.slo_attainment, summary.ttft_p99_s, result.max_replicas,
                       result.cold_starts, use)


# ------------------------------------------------------------------------------------------------ report

COLUMNS = ("arrangement", "GPUs", "TTFT-SLO", "p99 TTFT", "inference GPU-h", "training GPU-h", "useful", "lent",
           "requeued", "completed", "utilisation", "delayed starts", "peak replicas")


def _seconds(value: float) -> str:
    return "never" if value == float("inf") else f"{value:.2f}s"


def _delays(use: ClusterUse) -> str:
    """Starts that waited for training (their mean wait), and starts refused at the ceiling if any."""
    text = f"{use.delayed_starts} ({use.start_delay_s / use.delayed_starts:.0f}s)" if use.delayed_starts else "0"
    return f"{text}, {use.refused_starts} refused" if use.refused_starts else text


def sharing_rows(comparison: SharingComparison) -> list[tuple[str, ...]]:
    return [(a.name, a.layout, f"{a.slo_attainment * 100:.2f}%", _seconds(a.ttft_p99_s), f"{a.use.inference_gpu_h:.1f}",
             f"{a.use.training_gpu_h:.1f}", f"{a.use.useful_training_gpu_h:.1f}", f"{a.use.lent_gpu_h:.1f}",
             str(a.use.jobs_requeued), str(a.use.jobs_completed), f"{a.use.utilisation * 100:.1f}%", _delays(a.use),
             str(a.peak_replicas))
            for a in comparison.arrangements]


def sharing_head(comparison: SharingComparison) -> list[str]:
    """What was run, in three lines: the trace and model, the split, the backlog."""
    c, spec, backlog = comparison, comparison.spec, comparison.spec.backlog
    hours = c.arrangements[0].use.hours if c.arrangements else 0.0
    writes = (f"written within the {spec.grace_s:g}s grace" if spec.grace_s >= backlog.checkpoint_s
              else f"none at SIGTERM: grace {spec.grace_s:g}s < {backlog.checkpoint_s:g}s")
    return [
        f"trace {c.trace}, model {c.model} ({c.gpus_per_replica} x {c.gpu_kind} a replica, cold start "
        f"{c.model_load_s:g}s model load), {c.num_requests} requests, {hours * 60:.1f} min scored",
        f"cluster {spec.cluster_gpus} GPUs; separate: {c.inference_gpus} inference ({c.split_rule}) + "
        f"{spec.cluster_gpus - c.inference_gpus} training; shared: inference ceiling {c.ceiling_gpus}, reserve "
        f"{spec.reserve_gpus}, grace {spec.grace_s:g}s",
        f"backlog: jobs of {'/'.join(map(str, backlog.gpus_per_job))} GPUs, mean runtime "
        f"{backlog.mean_runtime_s / 3600:.2g} h, a checkpoint every {backlog.checkpoint_every_s:g}s of progress taking "
        f"{backlog.checkpoint_s:g}s ({writes}), {backlog.queue_depth} queued, seed {backlog.seed}",
    ]


def sharing_table(comparison: SharingComparison) -> str:
    """A Markdown table headed by what was run; GPU-hours are over the scored time."""
    body = [COLUMNS, *sharing_rows(comparison)]
    widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([*sharing_head(comparison), "", line(COLUMNS), rule, *(line(r) for r in body[1:])])


def sharing_json(comparison: SharingComparison) -> dict[str, Any]:
    """The comparison as JSON: what was run and, per arrangement, inference's scores and the cluster's GPU-hours."""
    c = comparison
    return {
        "trace": c.trace, "model": c.model, "num_requests": c.num_requests, "gpu_kind": c.gpu_kind,
        "gpus_per_replica": c.gpus_per_replica, "model_load_s": c.model_load_s,
        "cluster_gpus": c.spec.cluster_gpus, "inference_gpus": c.inference_gpus, "split_rule": c.split_rule,
        "ceiling_gpus": c.ceiling_gpus, "reserve_gpus": c.spec.reserve_gpus, "grace_s": c.spec.grace_s,
        "backlog": asdict(c.spec.backlog),
        "arrangements": [{"name": a.name, "layout": a.layout, "slo_attainment": a.slo_attainment,
                          "ttft_p99_s": a.ttft_p99_s if a.ttft_p99_s != float("inf") else None,
                          "peak_replicas": a.peak_replicas, "cold_starts": a.cold_starts,
                          **asdict(a.use), "utilisation": a.use.utilisation}
                         for a in c.arrangements],
    }
