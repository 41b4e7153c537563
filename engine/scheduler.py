"""Continuous batching with chunked prefill, prefix-cache lookup and preemption by recompute.

One engine step (see engine/sequence.py): `schedule()` picks which tokens of which sequences to
compute under a per-step token budget, the runner computes them, `update()` advances the sequences,
appends sampled tokens and finishes sequences that hit a token-level stop.

Policy of one `schedule()` (modelled on vLLM v1, with decodes first as in Sarathi-Serve):
1. RUNNING sequences, decoding ones first (1 token each: a long prefill must not stall every decode),
   then ones still prefilling (their next chunk), each in admission order, while budget lasts.
   When the pool cannot hold a sequence's next tokens, the NEWEST running sequence is preempted by
   recompute (blocks freed, num_computed_tokens = 0, front of the waiting queue) and the check
   retried; if the newest is the sequence itself, it is the one preempted.
2. WAITING sequences in FIFO order (preempted ones at the front), only if step 1 preempted nobody
   (admitting while evicting would thrash), while there are budget, seats (max_num_seqs) and blocks.
   Admission attaches the cached prefix, then prefills a chunk of min(remaining, budget) tokens.
   A sequence whose LoRA adapter can get no slot this step (every slot pinned by running sequences of
   other adapters) is passed over, and so is every later LoRA sequence, so that adapters are served in
   arrival order and none starves; base-model sequences behind it are still admitted.
   A sequence whose next uncached block another running sequence has yet to compute (a burst of
   requests that share a system prompt) is passed over too, and keeps its place: a step later it hits
   the blocks the other one computed instead of computing the same prefix a second time.
   Why a step later and not in the same step, as vLLM v1 admits them: on a CPU a step costs what its
   tokens cost, so merging saves nothing and delays the first request's first token (16 prompts sharing a
   512-token system prompt plus 32 tokens each of their own: mean TTFT 1,624-1,855 ms waiting, 1,823-2,019 ms
   merged). On a GPU it may pay; unmeasured.

LoRA slots: with an `AdapterGate` (engine/lora/manager.py), a sequence pins its adapter's slot from
admission until it is preempted or finishes, and the gate counts every request per adapter.

Samples (n > 1): the first sample is queued as usual and its forks wait (FORKING) for it to compute the
prompt. Its admission reserves a seat for each of them. When it samples, `update` forks them: they share its
full blocks and each gets a copy of its partly filled last one (ModelInput.block_copies, applied before the
next forward pass), and each takes its own first token from the same logits. A fork that finds no block, or
whose first sample ended before its prefill, computes the prompt itself instead, from the front of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.sequence import (FinishReason, ModelInput, ModelOutput, SampledToken, ScheduledSeq,
                             Sequence, SequenceStatus)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # seats: sequences RUNNING at once
    max_num_batched_tokens: int  # per-step token budget, prefill chunks and decodes together
    max_model_len: int  # prompt + generated tokens of one sequence, at most
    eos_token_ids: tuple[int, ...] = ()
    # Cap on one sequence's prefill chunk per step, so several prompts share a step instead of the
    # oldest taking the whole budget (vLLM's long_prefill_token_threshold). None: no cap.
    long_prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {getattr(self, name)!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2; got {self.max_model_len!r}")
        if self.long_prefill_chunk is not None and self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk must be None or an integer >= 1; "
                             f"got {self.long_prefill_chunk!r}")


class AdapterGate(Protocol):
    """The scheduler's view of LoRA slots (implemented by engine.lora.AdapterManager)."""

    def on_add(self, adapter: str) -> None:
        """A request for `adapter` was accepted; raises UnknownAdapter to refuse it."""

    def can_run(self, adapter: str) -> bool:
        """Whether a sequence of `adapter` can start running this step (it holds or can get a slot)."""

    def on_run(self, adapter: str) -> None:
        """A sequence of `adapter` started running: pin its slot."""

    def on_stop(self, adapter: str) -> None:
        """A running sequence of `adapter` was preempted or finished: unpin."""

    def on_finish(self, adapter: str) -> None:
        """A request for `adapter` ended, running or waiting."""


@dataclass(frozen=True)
class StepResult:
    """One sampled token, already appended to `seq`; finish_reason is set when it ended the sequence."""

    seq: Sequence
    new_token_id: int
    sampled: SampledToken
    finish_reason: FinishReason | None


class Scheduler:
    """Owns and mutates every Sequence of one replica. Synchronous, no clock reads, no I/O."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 adapters: AdapterGate | None = None) -> None:
        capacity_tokens = block_manager.num_total_blocks * block_manager.block_size
        if capacity_tokens < config.max_model_len:
            # Otherwise a lone sequence could outgrow the pool and preempt itself forever.
            raise ValueError(f"the KV pool holds {capacity_tokens} tokens "
                             f"({block_manager.num_total_blocks} blocks of {block_manager.block_size}); "
                             f"max_model_len {config.max_model_len} needs at least that many")
        self.config = config
        self.block_manager = block_manager
        self.adapters = adapters  # None: no LoRA slot limits (sequences may still name adapters)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order: the newest is last
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._released: list[int] = []  # finished since the last schedule()
        # Further samples (n > 1) of a sequence whose prompt is not computed yet, by that sequence's id.
        self._forks: dict[int, list[Sequence]] = {}
        self._block_copies: list[tuple[int, int, int]] = []  # (forked seq_id, source, destination), for the next step
        self.num_preemptions_total = 0  # a counter for metrics: preemptions mean the KV pool is too small
        self.num_prefix_waits_total = 0  # admissions put off a step for a prefix another sequence computes

    # ----- requests in and out

    def add(self, seq: Sequence, forks: tuple[Sequence, ...] = ()) -> None:
        """Queue a new sequence, with `forks`: further samples of the same prompt (n > 1), which wait until
        `seq` has computed the prompt and then share its KV blocks (`update` forks them), each sampling its
        own first token from the same logits. Raises ValueError for an empty prompt, a prompt that leaves no
        room to generate (len(prompt) >= max_model_len), a seq_id in use, or a sequence already started,
        and the gate's UnknownAdapter for an adapter it does not serve."""
        if 1 + len(forks) > self.config.max_num_seqs:  # the samples run together, so they must fit in one batch
            raise ValueError(f"{1 + len(forks)} samples; this engine runs at most {self.config.max_num_seqs} "
                             "sequences at once")
        for fork in forks:
            if fork.prompt_token_ids != seq.prompt_token_ids or fork.adapter != seq.adapter:
                raise ValueError(f"fork {fork.seq_id} must have the prompt and adapter of sequence {seq.seq_id}")
            if fork.seq_id in self._seqs or fork.seq_id == seq.seq_id:
                raise ValueError(f"seq_id {fork.seq_id} is already in use")
        num_prompt = seq.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt is empty; a request needs at least one prompt token")
        if num_prompt >= self.config.max_model_len:
            raise ValueError(f"the prompt has {num_prompt} tokens; this model's maximum length is "
                             f"{self.config.max_model_len} tokens, prompt and output together")
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} has already been scheduled")
        if seq.adapter is not None and self.adapters is not None:
            for _ in (seq, *forks):
                self.adapters.on_add(seq.adapter)
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        if forks:
            self._forks[seq.seq_id] = list(forks)
            for fork in forks:
                fork.status = SequenceStatus.FORKING
                self._seqs[fork.seq_id] = fork

    def abort(self, seq_id: int) -> bool:
        """Cancel a sequence: free its blocks at once, finish it with ABORT. False if it is unknown or
        already finished. Safe between schedule() and update(): update() skips it."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: int, reason: FinishReason) -> bool:
        """Finish a sequence for a reason found outside the scheduler (a stop string). Same contract
        as abort()."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        """Queued sequences, the forks waiting for their first sample's prefill included."""
        return len(self._waiting) + self._num_pending_forks(running_parents_only=False)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ----- one step

    def schedule(self) -> ModelInput:
        """Choose this step's work. The result lists each sequence at most once; its block_table
        covers every position up to the end of its chunk."""
        scheduled: dict[int, ScheduledSeq] = {}
        budget, preempted = self._schedule_running(scheduled)
        if not preempted:
            self._admit_waiting(scheduled, budget)
        released, self._released = tuple(self._released), []
        copies = tuple((source, dest) for seq_id, source, dest in self._block_copies if self._holds(seq_id, dest))
        self._block_copies.clear()
        return ModelInput(seqs=tuple(scheduled.values()), released_seq_ids=released, block_copies=copies)

    def update(self, batch: ModelInput, output: ModelOutput) -> list[StepResult]:
        """Apply the runner's answer to `batch`: advance each scheduled sequence by its chunk, cache
        its newly full blocks, start the forks of sequences that computed their prompt, append each sampled
        token and apply token-level stops. Sequences finished or aborted since schedule() are skipped. Raises
        ValueError if `output` does not hold exactly one token per sampling sequence of `batch` and one per
        fork it names, in order (each sequence, then its forks)."""
        sampled = _pair_samples(batch, output)
        results = []
        for work in batch.seqs:
            seq = self._seqs.get(work.seq_id)
            if (seq is None or seq.status is not SequenceStatus.RUNNING
                    or seq.num_computed_tokens != work.start_pos):
                continue  # finished, aborted or preempted since this batch was scheduled
            seq.num_computed_tokens += len(work.token_ids)
            self.block_manager.commit_full_blocks(seq)
            if not work.sample:
                continue
            # Forked before the token is appended (they share the prompt's blocks only), reported after it.
            forked = self._fork(seq, work, sampled) if work.forks else []
            results.append(self._append(seq, sampled[work.seq_id]))
            results.extend(forked)
        return results

    # ----- internals

    def _schedule_running(self, scheduled: dict[int, ScheduledSeq]) -> tuple[int, bool]:
        """Step 1 of the policy. Returns the budget left and whether anything was preempted."""
        budget = self.config.max_num_batched_tokens
        preempted = False
        decoding = [s for s in self._running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self._running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk_len(seq, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self._running[-1]
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.allocate(seq, num_new)
                scheduled[seq.seq_id] = self._work(seq, num_new)
                budget -= num_new
        return budget, preempted

    def _admit_waiting(self, scheduled: dict[int, ScheduledSeq], budget: int) -> None:
        """Step 2 of the policy: FIFO, stopping at the first sequence that does not fit; LoRA sequences
        without a slot this step, and sequences whose prefix another is computing, are passed over (and
        keep their place)."""
        passed_over: list[Sequence] = []
        try:
            self._admit_in_order(scheduled, budget, passed_over)
        finally:
            self._waiting.extendleft(reversed(passed_over))

    def _admit_in_order(self, scheduled: dict[int, ScheduledSeq], budget: int, passed_over: list[Sequence]) -> None:
        blocks = self.block_manager
        lora_held = False
        while self._waiting and budget > 0:
            seq = self._waiting[0]
            # Once one LoRA sequence waits for a slot, later ones wait too (arrival order across adapters).
            if seq.adapter is not None and self.adapters is not None and (
                    lora_held or not self.adapters.can_run(seq.adapter)):
                lora_held = True
                passed_over.append(self._waiting.popleft())
                continue
            if blocks.prefix_computing_elsewhere(seq):
                self.num_prefix_waits_total += 1
                passed_over.append(self._waiting.popleft())
                continue
            # A sequence with forks pending takes their seats too: they join the batch when it samples.
            if self._seats_taken() + 1 + len(self._forks.get(seq.seq_id, ())) > self.config.max_num_seqs:
                return
            num_cached = blocks.allocate_prefix(seq)
            seq.num_computed_tokens = num_cached
            num_new = self._chunk_len(seq, budget)
            if not blocks.can_allocate(seq, num_new):
                blocks.free(seq)  # give the prefix back; retried next step
                seq.num_computed_tokens = 0
                return
            blocks.allocate(seq, num_new)
            self._waiting.popleft()
            self._running.append(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.adapter is not None and self.adapters is not None:
                self.adapters.on_run(seq.adapter)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                blocks.record_prefix_query(seq.num_prompt_tokens, num_cached)
            scheduled[seq.seq_id] = self._work(seq, num_new)
            budget -= num_new

    def _holds(self, seq_id: int, block: int) -> bool:
        """Whether sequence `seq_id` is running with `block` in its table (a fork preempted or finished before
        its copy ran has freed it)."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.status is SequenceStatus.RUNNING and block in seq.block_table

    def _seats_taken(self) -> int:
        """Running sequences, and the seats their pending forks will take."""
        return len(self._running) + self._num_pending_forks(running_parents_only=True)

    def _num_pending_forks(self, running_parents_only: bool) -> int:
        return sum(1 for parent_id, forks in self._forks.items()
                   if not running_parents_only or self._seqs[parent_id].status is SequenceStatus.RUNNING
                   for fork in forks if fork.status is SequenceStatus.FORKING)

    def _fork(self, parent: Sequence, work: ScheduledSeq, sampled: dict[int, SampledToken]) -> list[StepResult]:
        """Start the forks of `parent`, whose prompt is now computed, each with its own sampled token. A fork
        that finds no free block for its copy on write (or no seat, which admission reserved) computes the
        prompt itself instead, later: its drawn token is dropped, and so is its sampling state (released), so
        that its seeded draws start over as a lone request's would."""
        results = []
        for fork in self._forks.pop(parent.seq_id, []):
            if fork.status is not SequenceStatus.FORKING:
                continue  # finished (aborted) while it waited
            if not self.block_manager.can_fork(parent) or len(self._running) >= self.config.max_num_seqs:
                fork.status = SequenceStatus.WAITING
                self._waiting.appendleft(fork)
                self._released.append(fork.seq_id)
                continue
            copy = self.block_manager.fork(parent, fork)
            if copy is not None:
                self._block_copies.append((fork.seq_id, *copy))
            fork.num_computed_tokens = parent.num_computed_tokens
            fork.num_cached_tokens = parent.num_cached_tokens
            fork.status = SequenceStatus.RUNNING
            self._running.append(fork)
            if fork.adapter is not None and self.adapters is not None:
                self.adapters.on_run(fork.adapter)
            results.append(self._append(fork, sampled[fork.seq_id]))
        return results

    def _append(self, seq: Sequence, token: SampledToken) -> StepResult:
        """Append a sampled token to a running sequence and apply the token-level stops."""
        seq.output_token_ids.append(token.token_id)
        reason = self._stop_reason(seq, token.token_id)
        if reason is not None:
            self._finish(seq, reason)
        return StepResult(seq, token.token_id, token, reason)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.config.long_prefill_chunk is not None:
            num_new = min(num_new, self.config.long_prefill_chunk)
        return num_new

    def _work(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new
        prompt = seq.prompt_token_ids
        if end <= len(prompt):
            token_ids = prompt[start:end]
        else:  # the chunk reaches into generated tokens: a decode, or recomputing after preemption
            outputs = seq.output_token_ids[max(0, start - len(prompt)):end - len(prompt)]
            token_ids = (*prompt[start:], *outputs)
        sample = end == seq.num_tokens
        forks = self._forks.get(seq.seq_id, ()) if sample and not seq.output_token_ids else ()
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=tuple(token_ids), start_pos=start,
                            block_table=tuple(seq.block_table), sample=sample,
                            params=seq.params, output_token_ids=tuple(seq.output_token_ids),
                            adapter=seq.adapter,
                            forks=tuple((f.seq_id, f.params) for f in forks if f.status is SequenceStatus.FORKING))

    def _preempt(self, seq: Sequence, scheduled: dict[int, ScheduledSeq]) -> int:
        """Preempt by recompute; returns the budget it gave back if it was already scheduled."""
        self._running.remove(seq)
        self._unpin(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.appendleft(seq)
        work = scheduled.pop(seq.seq_id, None)
        return len(work.token_ids) if work is not None else 0

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Token-level stops. A stop token wins over a length limit reached by the same token: the
        sequence ended naturally. The stop token stays in output_token_ids (the detokenizer hides it)."""
        params = seq.params
        is_eos = not params.ignore_eos and token_id in self.config.eos_token_ids
        # min_tokens: a stop among the first min_tokens generated tokens is ignored (the token was appended).
        early = len(seq.output_token_ids) <= params.min_tokens
        if not early and (is_eos or token_id in params.stop_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._unpin(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        # A sequence that ends before its forks could share its prompt leaves them to compute it themselves, at
        # the front of the queue, with fresh sampling state (a fork's row may have been sampled already).
        for fork in reversed(self._forks.pop(seq.seq_id, [])):
            if fork.status is SequenceStatus.FORKING:
                fork.status = SequenceStatus.WAITING
                self._waiting.appendleft(fork)
                self._released.append(fork.seq_id)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._released.append(seq.seq_id)
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.on_finish(seq.adapter)

    def _unpin(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.on_stop(seq.adapter)


def _pair_samples(batch: ModelInput, output: ModelOutput) -> dict[int, SampledToken]:
    expected = []  # each sampling sequence, then its forks (which sample from its logits)
    for work in batch.seqs:
        if work.sample:
            expected += [work.seq_id, *(fork_id for fork_id, _ in work.forks)]
    got = [token.seq_id for token in output.sampled]
    if got != expected:
        raise ValueError(f"the runner sampled for sequences {got}; the batch asked for {expected}")
    return {token.seq_id: token for token in output.sampled}
