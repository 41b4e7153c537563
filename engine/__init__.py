"""The bundled paged-attention engine: paged KV cache, automatic prefix caching, continuous batching
with chunked prefill, sampling. Only `engine.runner` imports torch.

    from kvgate.engine import LLM, SamplingParams

`LLM` and `AsyncLLM` are imported lazily so that importing `engine.scheduler` or
`engine.block_manager` never loads torch or tokenizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.engine.sequence import FinishReason, SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.async_llm import AsyncLLM
    from kvgate.engine.llm import LLM

__all__ = ["LLM", "AsyncLLM", "FinishReason", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from kvgate.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from kvgate.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
