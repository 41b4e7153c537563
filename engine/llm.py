"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

    from kvgate.engine import LLM, SamplingParams
    llm = LLM("builtin:smollm2-135m")
    [out] = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=16, temperature=0))
    out.text, out.token_ids, out.num_cached_tokens, out.finish_reason

    llm = LLM("builtin:smollm2-135m", adapters=[("sql", "/adapters/sql-lora")])
    llm.generate(prompts, params, adapter="sql")          # or one adapter (or None) per prompt
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from kvgate.engine.core import DEFAULT_KV_CACHE_BYTES, EngineConfig, EngineCore, RequestOutput
from kvgate.engine.sequence import SamplingParams
from kvgate.tokenizer import Tokenizer

Prompt = str | Seq[int]


class LLM:
    """Runs batches of prompts to completion on one model, with continuous batching and prefix caching."""

    def __init__(self, model: str, *, dtype: str = "float32", kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, device: str | None = None,
                 cache_dir: str | Path | None = None, max_loras: int = 4, max_lora_rank: int = 16,
                 adapters: Seq[tuple[str, str]] = (), attention_kernel: str = "auto") -> None:
        self.core = EngineCore(EngineConfig(
            model=model, dtype=dtype, device=device, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, cache_dir=Path(cache_dir) if cache_dir else None,
            max_loras=max_loras, max_lora_rank=max_lora_rank, adapters=tuple(adapters),
            attention_kernel=attention_kernel,
        ))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 adapter: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids) and return results in prompt order.

        `params` is one SamplingParams for all prompts or one per prompt (default: SamplingParams());
        `adapter` one LoRA adapter name (None: the base model) for all prompts or one per prompt.
        Raises ValueError for an empty or too long prompt and UnknownAdapter for an adapter that is not
        registered, both before any work starts, and AdapterLoadError if an adapter's weights cannot be
        loaded (the other requests of the call are aborted).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(adapters)} adapters")
        outputs: dict[int, RequestOutput] = {}
        order = []
        try:
            for prompt, p, name in zip(prompts, params, adapters):
                seq_id = self.core.add_request(prompt, p, name)
                order.append(seq_id)
                outputs[seq_id] = RequestOutput(seq_id, list(self.core.scheduler.get(seq_id).prompt_token_ids))
        except Exception:
            for seq_id in order:
                self.core.abort(seq_id)
            raise
        while self.core.has_unfinished():
            deltas = self.core.step()
            errors = self.core.drain_request_errors()
            if errors:
                for seq_id in order:
                    self.core.abort(seq_id)
                raise errors[0][1]
            for delta in deltas:
                out = outputs[delta.seq_id]
                out.token_ids.append(delta.token_id)
                out.text += delta.text
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.sampled.logprob is not None:
                    out.logprobs.append(delta.sampled)
                if delta.finish_reason is not None:
                    out.finish_reason = delta.finish_reason
        return [outputs[seq_id] for seq_id in order]

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: render `messages` with the model's chat template and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], params)[0]
