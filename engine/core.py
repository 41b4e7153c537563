"""The engine core: one model, its KV cache, a scheduler, and the step that ties them together.

    step():  batch = scheduler.schedule()          which tokens of which sequences, under the budget
             logits = runner.compute_logits(batch)  one forward pass over the paged KV cache (torch)
             sampled = sampler(logits, ...)         one token per sequence that reached its end
             results = scheduler.update(...)        append tokens, token-level stops, free blocks
             detokenize, stop strings               text deltas; a stop string finishes the sequence

`EngineCore` is synchronous and single-threaded; `engine.llm.LLM` drives it for offline batches and
`engine.async_llm.AsyncLLM` drives it from a worker thread for servers.

Multi-LoRA: adapters are registered (EngineConfig.adapters at start, load_adapter later) and hold one of
max_loras weight slots while in use (engine/lora/manager.py); between scheduling and the forward pass,
step() loads the adapters that the step's admissions need (evicting least recently used idle ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.builtin import default_cache_dir, resolve_model_source
from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.engine.lora import AdapterInfo, AdapterManager, UnknownAdapter
from kvgate.engine.lora.source import fetch_adapter
from kvgate.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from kvgate.engine.sequence import (FinishReason, ModelInput, ModelOutput, SampledToken, SamplingParams,
                                   ScheduledSeq, Sequence)
from kvgate.engine.structured import GrammarBook, GrammarStep
from kvgate.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported on a thread at start (start_runner_import), never at import time
    import torch

log = logging.getLogger("kvgate.engine")

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Sizes are per replica."""

    model: str  # builtin:NAME or a local HF directory
    dtype: str = "float32"  # float32, bfloat16, float16 or auto (the checkpoint's)
    device: str | None = None  # None: cuda when available, else cpu
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_model_len: int | None = None  # None: what the model supports
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    cache_dir: Path | None = None  # where built-in models are created; None: $KVGATE_CACHE_DIR or ~/.cache/kvgate
    max_loras: int = 4  # LoRA adapters whose weights are resident at once; 0 turns multi-LoRA off
    max_lora_rank: int = 16  # the largest adapter rank accepted; every slot is sized for it
    # (name, source) adapters registered at start; source is a local PEFT directory or s3://bucket/prefix.
    # Each is downloaded and validated at start (a bad one fails the start); the first max_loras are loaded.
    adapters: tuple[tuple[str, str], ...] = ()
    s3_endpoint_url: str | None = None  # s3:// models and adapters; None: $KVGATE_S3_ENDPOINT_URL, $AWS_ENDPOINT_URL, AWS
    # CPU decode attention through the compiled kernel (runner/kernels.py): "auto" (cached build at once, else
    # built in the background), "wait" (build before serving) or "off" (always gather the KV blocks).
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple((name, source) for name, source in self.adapters))
        for key, value, low in (("max_loras", self.max_loras, 0), ("max_lora_rank", self.max_lora_rank, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}; got {value!r}")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: each name must appear once; got {names}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's load and cache, for /metrics and the replica-state stream."""

    num_waiting: int
    num_running: int
    num_kv_blocks_free: int  # free blocks, counting cached-but-unused ones (reclaimable on demand)
    num_kv_blocks_total: int
    block_size_tokens: int
    prefix_queried_tokens_total: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens_total: int  # of those, found in the cache
    num_preemptions_total: int
    num_generated_tokens_total: int
    num_prompt_tokens_total: int
    num_requests_finished_total: int
    num_requests_aborted_total: int
    adapters_loaded: tuple[str, ...] = ()  # registered adapters whose weights hold a slot now, sorted
    num_adapter_loads_total: int = 0  # adapter weights loaded into a slot (first loads and reloads)
    num_adapter_evictions_total: int = 0  # idle adapters evicted (least recently used) for another
    num_prefix_waits_total: int = 0  # admissions put off a step: another request was computing their prefix


@dataclass
class TokenDelta:
    """What one step added to one request: a token, the text it completed, and whether it ended."""

    seq_id: int
    token_id: int
    text: str  # new text; may be "" while a multi-byte character or possible stop string is held back
    sampled: SampledToken
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens this request found in the prefix cache
    index: int = 0  # which sample of its request (n > 1) this sequence is: 0 .. n - 1


@dataclass
class RequestOutput:
    """The finished (or so-far) result of one request."""

    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    logprobs: list[SampledToken] = field(default_factory=list)  # when requested: one per token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


RUNNER_MODULE = "kvgate.engine.runner.runner"  # imports torch
READ_AHEAD_CHUNK = 8 << 20


def start_runner_import() -> None:
    """Import the model runner (and torch) on a daemon thread, once; a later `import` of it waits for that thread
    rather than starting over. An import error is left to that later import to raise, where it is reported."""
    if RUNNER_MODULE in sys.modules:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module(RUNNER_MODULE)

    threading.Thread(target=run, name="kvgate-import-torch", daemon=True).start()


def read_ahead(model_dir: Path) -> None:
    """Read the weight files once on a daemon thread, into the page cache, while torch imports: loading them later
    reads memory rather than the disk. Plain reads into one reused buffer (the GIL is released while each one
    waits): POSIX_FADV_WILLNEED was tried first, and this VM's kernel read only the first 8 MiB of the file for it
    (fincore)."""
    paths = sorted(Path(model_dir).glob("*.safetensors"))
    available = _available_memory_bytes()
    if available is not None and sum(p.stat().st_size for p in paths) > available // 2:
        return  # it would evict what the load itself reads (a model near the machine's memory): let the load read

    def run() -> None:
        buffer = bytearray(READ_AHEAD_CHUNK)
        for path in paths:
            with contextlib.suppress(OSError), open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass

    threading.Thread(target=run, name="kvgate-read-ahead", daemon=True).start()


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class EngineCore:
    """Owns the model runner, KV blocks, scheduler, sampler and per-request detokenizers."""

    def __init__(self, config: EngineConfig) -> None:
        # torch is imported inside the runner package, never at engine import time, and on a thread of its own
        # (start_runner_import), so that its ~0.8 s overlaps finding the model, reading its weights into the page
        # cache and loading the tokenizer: together those were 0.2-0.4 s of a start from a cold page cache.
        started = time.perf_counter()
        start_runner_import()
        self.config = config
        model_dir = resolve_model_source(config.model, config.cache_dir, config.s3_endpoint_url)
        resolved = time.perf_counter()
        read_ahead(model_dir)
        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_dir(model_dir)
        tokenized = time.perf_counter()
        from kvgate.engine.runner.runner import ModelRunner  # waits for the import thread where it still runs
        from kvgate.engine.runner.sampler import Sampler

        imported = time.perf_counter()
        self.runner = ModelRunner(
            model_dir, dtype=config.dtype, device=config.device, kv_cache_bytes=config.kv_cache_bytes,
            block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            attention_kernel=config.attention_kernel,
        )
        model_config = self.runner.config
        # Seconds per part of loading: the source (a download, a builtin's first conversion), then the runner's.
        # On the critical path only: torch_import is what was left of the import once the rest was done.
        self.load_seconds = {"source": resolved - started, "tokenizer": tokenized - resolved,
                             "torch_import": imported - tokenized, **self.runner.load_seconds}
        # A sequence must fit in the KV pool on its own, or it would preempt itself forever.
        max_model_len = min(config.max_model_len or model_config.max_model_len,
                            model_config.max_model_len,  # positions, or Mistral's sliding window
                            self.runner.num_kv_blocks * config.block_size)
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          enable_kv_events=config.enable_kv_events)
        self.adapter_manager = AdapterManager(model_config, self.runner.lora, max_loras=config.max_loras,
                                              max_lora_rank=config.max_lora_rank)
        eos = set(self.tokenizer.eos_token_ids)
        if model_config.eos_token_ids:
            eos.update(model_config.eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len, eos_token_ids=tuple(sorted(eos))),
            self.block_manager, adapters=self.adapter_manager,
        )
        self.sampler = Sampler()
        self.vocab_size = model_config.vocab_size  # rows of logits; logit_bias ids must be below it
        self.grammars = GrammarBook(self.tokenizer.to_json, tuple(sorted(eos)), model_config.vocab_size)
        self._ids = itertools.count()
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._sample_index: dict[int, int] = {}  # seq_id -> its sample's index, for samples after the first
        # Requests of n > 1 samples: each sample's request (its first sample's id), and the samples still open,
        # so that the request counters count requests, not samples.
        self._request_of: dict[int, int] = {}
        self._open_samples: dict[int, int] = {}
        self._num_generated_tokens_total = 0
        self._num_prompt_tokens_total = 0
        self._num_requests_finished_total = 0
        self._num_requests_aborted_total = 0
        self._request_errors: list[tuple[int, Exception]] = []  # requests that failed inside a step
        for name, source in config.adapters:
            self._register_adapter(name, source, self.fetch_adapter(source),
                                   load=len(self.adapter_manager.loaded()) < config.max_loras)

    # ------------------------------------------------------------------------------------ requests

    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids for a prompt given as text (BOS added as the tokenizer's config says) or as ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(t) for t in prompt]
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams, adapter: str | None = None) -> int:
        """Queue a request of one sample; returns its id. Raises ValueError for an empty or too long prompt,
        n > 1 (see add_requests), a constraint that does not compile (GrammarError), and UnknownAdapter for an
        adapter that is not registered."""
        if params.n != 1:
            raise ValueError(f"add_request takes n = 1; got n = {params.n} (use add_requests)")
        return self.add_requests(prompt, params, adapter)[0]

    def add_requests(self, prompt: str | Seq[int], params: SamplingParams, adapter: str | None = None) -> list[int]:
        """Queue the params.n samples of one prompt; returns their ids, sample 0 first. The samples after the
        first fork from it once it has computed the prompt, sharing its KV blocks; sample i draws from its own
        seed stream (seed + i when a seed is given). Raises as add_request."""
        token_ids = self.encode_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this model takes at most "
                             f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        samples = [Sequence(seq_id=next(self._ids), prompt_token_ids=tuple(token_ids),
                            params=_sample_params(params, i), adapter=adapter) for i in range(params.n)]
        try:
            if params.constraint is not None:
                for seq in samples:  # GrammarError (a ValueError) refuses the request
                    self.grammars.start(seq.seq_id, params.constraint)
            self.scheduler.add(samples[0], tuple(samples[1:]))
        except Exception:
            for seq in samples:
                self.grammars.release(seq.seq_id)
            raise
        for index, seq in enumerate(samples):
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                                    params.skip_special_tokens)
            if index:
                self._sample_index[seq.seq_id] = index
            if len(samples) > 1:
                self._request_of[seq.seq_id] = samples[0].seq_id
        if len(samples) > 1:
            self._open_samples[samples[0].seq_id] = len(samples)
        self._num_prompt_tokens_total += len(token_ids)
        return [seq.seq_id for seq in samples]

    def abort(self, seq_id: int) -> bool:
        """Cancel a request; its KV blocks are freed at once. False if it was unknown or finished."""
        request_ended = self._forget(seq_id)
        aborted = self.scheduler.abort(seq_id)
        self._num_requests_aborted_total += aborted and request_ended
        return aborted

    def stats(self) -> EngineStats:
        """Load and cache counters now. Call from the thread that steps the engine."""
        blocks = self.block_manager
        return EngineStats(
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running,
            num_kv_blocks_free=blocks.num_free_blocks, num_kv_blocks_total=blocks.num_total_blocks,
            block_size_tokens=blocks.block_size, prefix_queried_tokens_total=blocks.queried_tokens_total,
            prefix_hit_tokens_total=blocks.hit_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_prefix_waits_total=self.scheduler.num_prefix_waits_total,
            num_generated_tokens_total=self._num_generated_tokens_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_requests_finished_total=self._num_requests_finished_total,
            num_requests_aborted_total=self._num_requests_aborted_total,
            adapters_loaded=self.adapter_manager.loaded(),
            num_adapter_loads_total=self.adapter_manager.num_loads_total,
            num_adapter_evictions_total=self.adapter_manager.num_evictions_total,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def drain_request_errors(self) -> list[tuple[int, Exception]]:
        """(seq_id, error) of requests that failed inside step() since the last drain: their adapter's
        weights could not be loaded (AdapterLoadError). They are finished, with no further deltas."""
        errors, self._request_errors = self._request_errors, []
        return errors

    # ------------------------------------------------------------------------------------ adapters

    def fetch_adapter(self, source: str) -> Path:
        """The local directory of an adapter source, downloading s3:// sources into the cache (blocking).
        Touches no engine state, so it may run on any thread. Raises AdapterLoadError."""
        return fetch_adapter(source, self.config.cache_dir or default_cache_dir(), self.config.s3_endpoint_url)

    def load_adapter(self, name: str, source: str, *, directory: Path | None = None) -> None:
        """Register `name` -> `source` and load its weights into a slot now: a free slot, else the one of
        the least recently used idle adapter. When every slot is pinned by running requests it is only
        registered, and loads on first use. Idempotent for the same source; a new source replaces the
        weights if no request uses them. `directory`: the source already fetched (fetch_adapter), so that
        a download need not block the engine. Raises AdapterLoadError (nothing is registered then)."""
        self._register_adapter(name, source, directory or self.fetch_adapter(source), load=True)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving `name`: new requests for it raise UnknownAdapter from now on. An idle adapter's
        slot is freed at once; one that accepted requests still use keeps its weights until the last of
        them finishes. True if the adapter was registered, False if not."""
        try:
            self.adapter_manager.unload(name)
        except UnknownAdapter:
            return False
        self.adapter_manager.sync()
        return True

    def adapters(self) -> AdapterInfo:
        """Registered adapters and those of them whose weights are loaded."""
        return self.adapter_manager.info()

    def _register_adapter(self, name: str, source: str, directory: Path, *, load: bool) -> None:
        manager = self.adapter_manager
        was_registered = manager.is_registered(name)
        manager.register(name, source, directory)
        if load and manager.load_now(name):
            failure = manager.sync().get(name)
            if failure is not None:
                if not was_registered:
                    manager.unload(name)
                raise failure

    # ---------------------------------------------------------------------------------------- step

    def step(self) -> list[TokenDelta]:
        """Run one engine step; returns a delta for every token sampled in it."""
        batch = self.scheduler.schedule()
        self.sampler.release(batch.released_seq_ids)
        batch = self._load_adapters(batch)
        if not batch.seqs:
            self.runner.copy_blocks(batch.block_copies)  # a fork's copy must not wait for a step that runs
            return []
        logits = self.runner.compute_logits(batch)
        sampled = self._sample(logits, [s for s in batch.seqs if s.sample])
        deltas = []
        for result in self.scheduler.update(batch, ModelOutput(tuple(sampled))):
            delta = self._delta(result)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSeq]) -> list[SampledToken]:
        """One token per sampling sequence and per fork it names, each fork from its sequence's logits."""
        if not sampling:
            return []
        if any(s.forks for s in sampling):
            logits, sampling = _with_fork_rows(logits, sampling)
        raw = logits  # logprobs report the model's distribution, not the grammar's cut of it
        if self.grammars.num_matchers:
            logits = self.grammars.mask(logits, [s.seq_id for s in sampling])
        return self.sampler(logits, sampling, raw)

    def _delta(self, result: StepResult) -> TokenDelta | None:
        """The text one sampled token adds, with the sequence's end: a stop token, a stop string, its grammar
        complete (which wins over a length limit reached by the same token), or the length limit. None for a
        sequence aborted between schedule and update."""
        seq_id = result.seq.seq_id
        detokenizer = self._detokenizers.get(seq_id)
        if detokenizer is None:
            return None
        reason = result.finish_reason
        grammar = self.grammars.advance(seq_id, result.new_token_id)
        if grammar is GrammarStep.REJECTED:  # the mask allowed it, so this is a bug: say so, and end cleanly
            log.warning("sequence %d: its grammar rejected token %d; stopping it", seq_id, result.new_token_id)
        if reason is FinishReason.STOP:
            # EOS or a stop token id: like vLLM, its text is not part of the output.
            text = detokenizer.flush()
        else:
            text, stopped = detokenizer.add(result.new_token_id)
            if stopped or grammar is not GrammarStep.CONTINUE:
                if reason is None:
                    self.scheduler.finish(seq_id, FinishReason.STOP)
                reason = FinishReason.STOP
            if reason is not None:
                text += detokenizer.flush()  # "" after a stop string (the detokenizer cut the text before it)
        index = self._sample_index.get(seq_id, 0)
        if reason is not None and self._forget(seq_id):
            self._num_requests_finished_total += 1
        self._num_generated_tokens_total += 1
        return TokenDelta(seq_id, result.new_token_id, text, result.sampled, reason, result.seq.num_cached_tokens,
                          index)

    def _forget(self, seq_id: int) -> bool:
        """Drop what the core keeps per sequence once it has ended (the scheduler frees its blocks). Returns
        whether that ended its request: always for one sample, for the last open one of n."""
        self._detokenizers.pop(seq_id, None)
        self.grammars.release(seq_id)
        self._sample_index.pop(seq_id, None)
        request = self._request_of.pop(seq_id, None)
        if request is None:
            return True
        self._open_samples[request] -= 1
        if self._open_samples[request]:
            return False
        del self._open_samples[request]
        return True

    def _load_adapters(self, batch: ModelInput) -> ModelInput:
        """Load the adapters that this step's admissions need. A failed load fails the sequences that
        need it (their callers get the error from drain_request_errors); the rest of the batch runs."""
        failures = self.adapter_manager.sync()
        if not failures:
            return batch
        kept = []
        for work in batch.seqs:
            error = failures.get(work.adapter) if work.adapter is not None else None
            if error is None:
                kept.append(work)
                continue
            self.scheduler.finish(work.seq_id, FinishReason.ABORT)
            self._num_requests_aborted_total += self._forget(work.seq_id)
            self._request_errors.append((work.seq_id, error))
        return dataclasses.replace(batch, seqs=tuple(kept))


_SEED_MODULUS = 2 ** 64  # torch.Generator.manual_seed takes -2**63 .. 2**64 - 1


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of a request: n = 1, and seed + index when a seed is given."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index) % _SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)


def _with_fork_rows(logits: torch.Tensor, sampling: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
    """The step's logits and sampling rows with a row per fork: a fork samples from the logits of the
    sequence it forks from, under its own params (seed)."""
    import torch

    rows: list[int] = []
    expanded: list[ScheduledSeq] = []
    for row, work in enumerate(sampling):
        rows.append(row)
        expanded.append(work)
        for seq_id, params in work.forks:
            rows.append(row)
            expanded.append(dataclasses.replace(work, seq_id=seq_id, params=params, forks=()))
    return logits.index_select(0, torch.tensor(rows, device=logits.device)), expanded
