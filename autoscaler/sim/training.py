"""A Slurm cluster that inference replicas share with a training backlog (SUNK-style), for `kvgate sim --shared-slurm`:
the backlog, and the ledger of who holds the cluster's GPUs.

One cluster of `ClusterSpec.gpus` GPUs. Inference replicas run in a high-priority partition, training jobs in a
preemptible one (PreemptMode=REQUEUE, GraceTime `grace_s`). GPUs are a count, not nodes: a job of k GPUs fits
wherever k are free (no node boundaries, so no fragmentation across nodes). The rules:

- **The backlog** (`BacklogSpec`): jobs of k GPUs (k drawn from `gpus_per_job`) and a runtime, seeded per job, so
  every arrangement sees the same jobs. `queue_depth` jobs wait at every moment (one is submitted whenever one
  starts): training always has work queued, so every GPU it may use can be used.
- **Scheduling**: whenever GPUs free up, queued jobs start first-fit in submission order; a requeued job keeps its
  place (Slurm keeps its priority), so it runs before any job submitted after it. A job too big for the free GPUs
  lets smaller ones behind it start (backfill without reservations).
- **Inference takes GPUs** (`acquire`): free GPUs first; when short, GPUs that training jobs already stopping will
  leave and no other replica waits for; when still short, it preempts running jobs, the most recently started first
  (PreemptParameters=youngest_first). A victim gets SIGTERM and leaves its GPUs when it exits: when its checkpoint is
  written (`checkpoint_s`) if the grace allows one (`grace_s >= checkpoint_s`), else killed at the grace time; a
  victim whose run ends before that completes instead. The replica gets its GPUs when the last victim it waits
  for has left (the delay `acquire` returns; its cold start begins then). GPUs it already has, and GPUs freed
  meanwhile, sit idle for it: Slurm starts no training on GPUs a pending higher-priority job needs.
- **Checkpoints**: a job checkpoints every `checkpoint_every_s` seconds of progress since it (re)started, and at
  SIGTERM when the grace lets it write one. Requeued, it resumes from its last checkpoint: the progress since is lost
  and run again. Checkpoints cost no time otherwise (asynchronous checkpointing).
- **The ceiling**: inference holds at most `inference_ceiling_gpus` GPUs, held or waited for; a start past it is
  refused.
- **The reserve** (`inference_reserve_gpus`: GPUs inference gets without a grace): while inference holds fewer, the
  difference stays free; training never starts on it. The live Slurm pool's floor is a price rule instead (GPUs
  inference takes from training at the base price, never counted as borrowing), which GPU-hours do not see; the
  reserve is the simulator's reading of GPUs kept for inference. Default 0.
- **Giving GPUs back** (`release`): to replicas waiting for GPUs first, then to the training queue.

Accounting, in GPU-seconds from `score_from_s` (the warm-up before it is not counted): every GPU at every moment is
held by inference (from the moment its replica has it), held by training (running, or stopping in its grace), or
idle (free, or waiting for a replica), so inference + training + idle = GPUs x time. Useful training is training
less the stopping time and the progress lost to requeues (`ClusterUse`). "Lent to training": GPU-time training
runs beyond `own_training_gpus` GPUs at once, the cluster training has of its own in the separate split.

Pure: the functions take and return frozen states (`ClusterState`) and read no clock; `_Ledger` is a working copy
private to one call.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class BacklogSpec:
    """The training backlog: its jobs' sizes and runtimes, how they checkpoint, how many wait."""

    gpus_per_job: tuple[int, ...] = (1, 2, 4, 8)  # each job's GPUs, drawn uniformly from these
    mean_runtime_s: float = 3600.0  # a job's runtime at its GPUs: lognormal with this mean
    runtime_sigma: float = 0.75  # the lognormal's sigma (0: every job runs exactly the mean)
    checkpoint_every_s: float = 1800.0  # seconds of progress between checkpoints
    checkpoint_s: float = 120.0  # seconds one checkpoint takes to write (a checkpoint at SIGTERM needs grace >= it)
    queue_depth: int = 32  # jobs waiting at every moment
    seed: int = 0


@dataclass(frozen=True)
class TrainingJob:
    index: int  # submission order: its priority
    gpus: int
    runtime_s: float  # seconds it runs at its GPUs, uninterrupted


def backlog_job(spec: BacklogSpec, index: int) -> TrainingJob:
    """The backlog's job number `index`: drawn from (seed, index) alone, the same in every run."""
    rng = random.Random(f"kvgate-backlog:{spec.seed}:{index}")
    gpus = spec.gpus_per_job[rng.randrange(len(spec.gpus_per_job))]
    sigma = spec.runtime_sigma
    return TrainingJob(index, gpus, spec.mean_runtime_s * rng.lognormvariate(-sigma * sigma / 2, sigma))


@dataclass(frozen=True)
class ClusterSpec:
    """One Slurm cluster and its pool policy. `backlog` None: no training (a dedicated inference cluster)."""

    gpus: int
    inference_ceiling_gpus: int  # inference holds at most this many, held or waited for
    backlog: BacklogSpec | None = None
    grace_s: float = 60.0  # GraceTime of the preemptible partition
    inference_reserve_gpus: int = 0  # kept free for inference while it holds fewer (module docstring)
    own_training_gpus: int = 0  # training running beyond this many GPUs at once is lent to it
    score_from_s: float = 0.0  # GPU-time, requeues and completions before this are warm-up: not counted

    def __post_init__(self) -> None:
        if not 0 <= self.inference_ceiling_gpus <= self.gpus:
            raise ValueError(f"inference ceiling {self.inference_ceiling_gpus} outside 0..{self.gpus} GPUs")
        if self.backlog is not None and max(self.backlog.gpus_per_job, default=0) > self.gpus:
            raise ValueError(f"training jobs of {max(self.backlog.gpus_per_job)} GPUs cannot run on {self.gpus}")


@dataclass(frozen=True)
class Tally:
    """Sums from `score_from_s` on (seconds are GPU-seconds)."""

    inference_gpu_s: float = 0.0
    training_gpu_s: float = 0.0  # held by training jobs, running or stopping
    stopping_gpu_s: float = 0.0  # of which in a grace before a requeue (no progress kept)
    lost_gpu_s: float = 0.0  # progress thrown away by requeues (made after score_from_s)
    lent_gpu_s: float = 0.0  # training beyond own_training_gpus
    idle_gpu_s: float = 0.0  # free, or held idle for a replica waiting for the rest of its GPUs
    jobs_requeued: int = 0
    jobs_completed: int = 0
    delayed_starts: int = 0  # replica starts that waited for training to leave
    start_delay_s: float = 0.0  # their waits, summed
    refused_starts: int = 0  # starts asked past the ceiling (the engine asks again on its next tick)
    peak_inference_gpus: int = 0  # held or waited for, over the whole run (warm-up included)


@dataclass(frozen=True)
class _Running:
    job: TrainingJob
    started_at: float
    done_at_start_s: float  # seconds of its runtime done when it (re)started: its last checkpoint
    stop_at: float | None = None  # SIGTERM'd: it leaves its GPUs then
    saved_s: float = 0.0  # the progress its requeue keeps (set at SIGTERM)

    @property
    def end_at(self) -> float:
        return self.started_at + self.job.runtime_s - self.done_at_start_s

    @property
    def event_at(self) -> float:
        return self.end_at if self.stop_at is None else self.stop_at

    @property
    def requeues(self) -> bool:
        return self.stop_at is not None and self.stop_at < self.end_at


@dataclass(frozen=True)
class _Holding:
    key: int  # the replica's id
    gpus: int
    from_s: float  # when it has all its GPUs


@dataclass(frozen=True)
class ClusterState:
    """Who holds the GPUs at `t`. free + reserved + inference + training = the cluster's GPUs."""

    t: float
    active: tuple[_Holding, ...]  # replicas holding their GPUs
    waiting: tuple[_Holding, ...]  # replicas waiting for training to leave, in the order they asked
    running: tuple[_Running, ...]  # training jobs, running or stopping
    queue: tuple[tuple[TrainingJob, float], ...]  # (job, seconds of it done), in submission order
    next_job: int  # the index of the next job the backlog submits
    free: int
    reserved: int  # idle GPUs held for waiting replicas
    tally: Tally

    @property
    def inference_gpus(self) -> int:
        return sum(h.gpus for h in self.active)

    @property
    def training_gpus(self) -> int:
        return sum(r.job.gpus for r in self.running)


def open_cluster(spec: ClusterSpec, holdings: Mapping[int, int]) -> ClusterState:
    """The cluster at t=0: the opening replicas (replica id -> GPUs) hold their GPUs, training fills what it may.
    Raises ValueError when they hold more than the ceiling."""
    gpus = sum(holdings.values())
    if gpus > spec.inference_ceiling_gpus:
        raise ValueError(f"the opening fleet holds {gpus} GPUs, over the inference ceiling "
                         f"{spec.inference_ceiling_gpus}")
    state = ClusterState(0.0, tuple(_Holding(k, g, 0.0) for k, g in sorted(holdings.items())), (), (), (), 0,
                         spec.gpus - gpus, 0, Tally(peak_inference_gpus=gpus))
    ledger = _Ledger(spec, state)
    ledger.backfill()
    return ledger.freeze()


def advance(spec: ClusterSpec, state: ClusterState, until: float) -> ClusterState:
    """The cluster at `until`: jobs that ended or stopped, replicas that got their GPUs, training started since."""
    ledger = _Ledger(spec, state)
    ledger.advance(until)
    return ledger.freeze()


def acquire(spec: ClusterSpec, state: ClusterState, now: float, key: int,
            gpus: int) -> tuple[ClusterState, float | None]:
    """Replica `key` asks for `gpus` at `now`: the new state and the seconds until it has them (0: at once), or
    None when that would pass the inference ceiling (then nothing changes but the count of refused starts)."""
    ledger = _Ledger(spec, state)
    ledger.advance(now)
    delay_s = ledger.acquire(key, gpus)
    return ledger.freeze(), delay_s


def release(spec: ClusterSpec, state: ClusterState, now: float, key: int) -> ClusterState:
    """Replica `key` is gone at `now` (held, or still waiting): its GPUs go to waiting replicas, then to training.
    Releasing an unknown key changes nothing (idempotent)."""
    ledger = _Ledger(spec, state)
    ledger.advance(now)
    ledger.release(key)
    return ledger.freeze()


@dataclass(frozen=True)
class ClusterUse:
    """One cluster's (or two clusters') GPU-hours over the scored time, and what happened to training."""

    gpus: int
    hours: float
    inference_gpu_h: float
    training_gpu_h: float
    useful_training_gpu_h: float  # training less stopping graces and progress lost to requeues
    lent_gpu_h: float
    idle_gpu_h: float
    jobs_requeued: int
    jobs_completed: int
    delayed_starts: int
    start_delay_s: float  # summed over the delayed starts
    refused_starts: int
    peak_inference_gpus: int

    @property
    def utilisation(self) -> float:
        """Busy GPU-hours over GPUs x hours."""
        total = self.gpus * self.hours
        return (self.inference_gpu_h + self.training_gpu_h) / total if total else 0.0

    def plus(self, other: ClusterUse) -> ClusterUse:
        """Two clusters side by side over the same hours (the separate arrangement): sums, the larger peak."""
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return replace(self, **{**sums, "hours": self.hours,
                                "peak_inference_gpus": max(self.peak_inference_gpus, other.peak_inference_gpus)})


def finish(spec: ClusterSpec, state: ClusterState, end: float) -> ClusterUse:
    """The cluster's use from `score_from_s` to `end` (release every replica first to count their GPUs back)."""
    tally = advance(spec, state, end).tally
    hour = 3600.0
    return ClusterUse(
        spec.gpus, max(0.0, end - spec.score_from_s) / hour, tally.inference_gpu_s / hour, tally.training_gpu_s / hour,
        (tally.training_gpu_s - tally.stopping_gpu_s - tally.lost_gpu_s) / hour, tally.lent_gpu_s / hour,
        tally.idle_gpu_s / hour, tally.jobs_requeued, tally.jobs_completed, tally.delayed_starts, tally.start_delay_s,
        tally.refused_starts, tally.peak_inference_gpus)


def training_only(spec: ClusterSpec, end: float) -> ClusterUse:
    """A cluster of training alone (the separate arrangement's training cluster) from 0 to `end`."""
    return finish(spec, open_cluster(spec, {}), end)


class _Ledger:
    """A working copy of one `ClusterState` for one operation (`freeze` gives the new state back)."""

    def __init__(self, spec: ClusterSpec, state: ClusterState) -> None:
        self.spec, self.t = spec, state.t
        self.active, self.waiting = list(state.active), list(state.waiting)
        self.running, self.queue = list(state.running), list(state.queue)
        self.next_job, self.free, self.reserved, self.tally = state.next_job, state.free, state.reserved, state.tally

    def freeze(self) -> ClusterState:
        return ClusterState(self.t, tuple(self.active), tuple(self.waiting), tuple(self.running), tuple(self.queue),
                            self.next_job, self.free, self.reserved, self.tally)

    def count(self, **added: float) -> None:
        self.tally = replace(self.tally, **{k: getattr(self.tally, k) + v for k, v in added.items()})

    def scored(self) -> bool:
        return self.t >= self.spec.score_from_s

    # ------------------------------------------------------------------------------------------ time

    def advance(self, until: float) -> None:
        """Play the cluster's own events (jobs ending or leaving, replicas getting their GPUs) up to `until`."""
        if until < self.t:
            raise ValueError(f"the cluster is at {self.t}s; it cannot go back to {until}s")
        while True:
            due = min([r.event_at for r in self.running] + [h.from_s for h in self.waiting], default=math.inf)
            if due > until:
                break
            self.accrue(due)
            self.settle()
        self.accrue(until)

    def accrue(self, t: float) -> None:
        """Count the GPUs as they are held from `self.t` to `t` (the part after score_from_s)."""
        span = t - max(self.t, self.spec.score_from_s)
        self.t = t
        if span <= 0:
            return
        training = sum(r.job.gpus for r in self.running)
        stopping = sum(r.job.gpus for r in self.running if r.requeues)
        self.count(inference_gpu_s=sum(h.gpus for h in self.active) * span, training_gpu_s=training * span,
                   stopping_gpu_s=stopping * span, idle_gpu_s=(self.free + self.reserved) * span,
                   lent_gpu_s=max(0, training - self.spec.own_training_gpus) * span)

    def settle(self) -> None:
        """At `self.t`: jobs that end or leave go (requeued, or completed), replicas whose GPUs are all free get
        them, and training starts on what is left."""
        freed = 0
        for r in [r for r in self.running if r.event_at <= self.t]:
            self.running.remove(r)
            freed += r.job.gpus
            if r.requeues:
                position = bisect.bisect([j.index for j, _ in self.queue], r.job.index)
                self.queue.insert(position, (r.job, r.saved_s))
            elif self.scored():
                self.count(jobs_completed=1)
        self.give_back(freed)
        for h in [h for h in self.waiting if h.from_s <= self.t]:
            self.waiting.remove(h)
            self.reserved -= h.gpus
            if self.reserved < 0:
                raise RuntimeError(f"ledger: replica {h.key} got GPUs nobody freed at {self.t}s")
            self.active.append(h)
        self.backfill()

    # ------------------------------------------------------------------------------------- training

    def give_back(self, gpus: int) -> None:
        """Freed GPUs: to replicas waiting for theirs first (held idle for them), the rest free."""
        to_waiting = min(gpus, sum(h.gpus for h in self.waiting) - self.reserved)
        self.reserved += to_waiting
        self.free += gpus - to_waiting

    def backfill(self) -> None:
        """Start queued jobs first-fit in submission order on the free GPUs training may use."""
        if self.spec.backlog is None:
            return
        inference = sum(h.gpus for h in self.active) + sum(h.gpus for h in self.waiting)
        usable = self.free - max(0, self.spec.inference_reserve_gpus - inference)
        self.submit()
        i = 0
        while i < len(self.queue) and usable > 0:
            job, done_s = self.queue[i]
            if job.gpus > usable:
                i += 1
                continue
            del self.queue[i]
            self.running.append(_Running(job, self.t, done_s))
            self.free -= job.gpus
            usable -= job.gpus
            self.submit()

    def submit(self) -> None:
        """Top the queue up to the backlog's depth with the next jobs."""
        assert self.spec.backlog is not None
        while len(self.queue) < self.spec.backlog.queue_depth:
            self.queue.append((backlog_job(self.spec.backlog, self.next_job), 0.0))
            self.next_job += 1

    def preempt(self, r: _Running) -> _Running:
        """SIGTERM to `r` now: when it leaves its GPUs and what progress its requeue keeps (module docstring)."""
        backlog = self.spec.backlog
        assert backlog is not None
        progress_s = r.done_at_start_s + (self.t - r.started_at)
        writes = self.spec.grace_s >= backlog.checkpoint_s  # a checkpoint at SIGTERM, then it exits
        stop_at = min(r.end_at, self.t + (backlog.checkpoint_s if writes else self.spec.grace_s))
        since_s = progress_s - r.done_at_start_s
        saved_s = progress_s if writes else r.done_at_start_s + math.floor(since_s / backlog.checkpoint_every_s) * \
            backlog.checkpoint_every_s
        stopped = replace(r, stop_at=stop_at, saved_s=saved_s)
        if stopped.requeues and self.scored():
            # The progress lost was made in the last (progress - saved) seconds: count what of it was scored.
            lost_s = min(progress_s - saved_s, self.t - self.spec.score_from_s)
            self.count(jobs_requeued=1, lost_gpu_s=max(0.0, lost_s) * r.job.gpus)
        return stopped

    # ------------------------------------------------------------------------------------ inference

    def acquire(self, key: int, gpus: int) -> float | None:
        asked = sum(h.gpus for h in self.active) + sum(h.gpus for h in self.waiting) + gpus
        if asked > self.spec.inference_ceiling_gpus:
            if self.scored():
                self.count(refused_starts=1)
            return None
        self.tally = replace(self.tally, peak_inference_gpus=max(self.tally.peak_inference_gpus, asked))
        take = min(self.free, gpus)
        self.free -= take
        if take == gpus:
            self.active.append(_Holding(key, gpus, self.t))
            return 0.0
        # Short: GPUs that stopping jobs will leave beyond what earlier waiting replicas count on, then victims.
        leaving = sum(r.job.gpus for r in self.running if r.stop_at is not None)
        spare = leaving - (sum(h.gpus for h in self.waiting) - self.reserved)
        short = gpus - take
        victims = sorted((r for r in self.running if r.stop_at is None),
                         key=lambda r: (-r.started_at, -r.job.index))  # youngest first
        for victim in victims:
            if spare >= short:
                break
            self.running[self.running.index(victim)] = self.preempt(victim)
            spare += victim.job.gpus
        if spare < short:  # the ceiling is at most the cluster, so training always holds enough: a broken invariant
            raise RuntimeError(f"ledger: {gpus} GPUs asked at {self.t}s and training holds too few to give")
        self.reserved += take
        from_s = max(r.stop_at for r in self.running if r.stop_at is not None)
        self.waiting.append(_Holding(key, gpus, from_s))
        if self.scored():
            self.count(delayed_starts=1, start_delay_s=from_s - self.t)
        return from_s - self.t

    def release(self, key: int) -> None:
        for h in self.active:
            if h.key == key:
                self.active.remove(h)
                self.give_back(h.gpus)
                break
        else:
            for h in self.waiting:
                if h.key == key:
                    self.waiting.remove(h)
                    excess = max(0, self.reserved - sum(w.gpus for w in self.waiting))
                    self.reserved -= excess
                    self.free += excess
                    break
            else:
                return
        self.backfill()
