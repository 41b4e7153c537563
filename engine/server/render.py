"""Engine token deltas -> OpenAI response objects and stream chunks, shaped exactly as OpenAI's.

Pure (no aiohttp, no I/O): a renderer is built per request with its id, creation time and model
name, and turns `TokenDelta`s into the JSON-ready dicts of /v1/completions ("text_completion") or
/v1/chat/completions ("chat.completion" / "chat.completion.chunk").

Logprobs use each endpoint's own format:
- completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
  as in vLLM, each top_logprobs dict also holds the chosen token;
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A token's string is its own decode (special tokens kept), so a byte-level token that is half of a
UTF-8 character reads as U+FFFD, and `bytes` carries the UTF-8 of that string, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.engine.core import TokenDelta
from kvgate.engine.sequence import FinishReason

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class _Renderer:
    def __init__(self, *, request_id: str, created: int, model: str, token_text: TokenText,
                 logprobs: bool, include_usage: bool = False) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs  # the client asked for logprobs
        self.include_usage = include_usage  # streamed: every chunk says "usage": null, the last one has it

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk_envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._envelope(object_name, choices)
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def must_send(self, delta: TokenDelta) -> bool:
        """Whether a streamed delta makes a chunk: text held back (a partial character or a possible stop
        string) makes none unless it ends the request or carries logprobs the client asked for."""
        return bool(delta.text) or delta.finish_reason is not None or self.logprobs


class CompletionRenderer(_Renderer):
    """/v1/completions: "text_completion" objects, streamed or not."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._text_offset = 0  # characters of token text streamed so far, for text_offset

    def response(self, deltas: Sequence[TokenDelta], usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(d.text for d in deltas),
                  "logprobs": self._logprobs(deltas) if self.logprobs else None,
                  "finish_reason": _reason(deltas[-1].finish_reason), "stop_reason": None}
        return {**self._envelope("text_completion", [choice]), "usage": usage.to_json()}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: TokenDelta) -> dict[str, Any]:
        choice = {"index": 0, "text": delta.text,
                  "logprobs": self._logprobs([delta]) if self.logprobs else None,
                  "finish_reason": _reason(delta.finish_reason), "stop_reason": None}
        return self._chunk_envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope("text_completion", []), "usage": usage.to_json()}

    def _logprobs(self, deltas: Sequence[TokenDelta]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for delta in deltas:
            token = self.token_text(delta.token_id)
            top = {self.token_text(t): lp for t, lp in delta.sampled.top_logprobs}
            top.setdefault(token, delta.sampled.logprob)
            tokens.append(token)
            token_logprobs.append(delta.sampled.logprob)
            top_logprobs.append(top)
            text_offset.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class ChatRenderer(_Renderer):
    """/v1/chat/completions: a "chat.completion", or "chat.completion.chunk"s of which the first
    carries the assistant role and the last content chunk carries the finish reason."""

    def response(self, deltas: Sequence[TokenDelta], usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                  "logprobs": self._logprobs(deltas) if self.logprobs else None,
                  "finish_reason": _reason(deltas[-1].finish_reason)}
        return {**self._envelope("chat.completion", [choice]), "usage": usage.to_json()}

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._chunk_envelope("chat.completion.chunk", [choice])]

    def chunk(self, delta: TokenDelta) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": delta.text},
                  "logprobs": self._logprobs([delta]) if self.logprobs else None,
                  "finish_reason": _reason(delta.finish_reason)}
        return self._chunk_envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage.to_json()}

    def _logprobs(self, deltas: Sequence[TokenDelta]) -> dict[str, Any]:
        return {"content": [self._entry(d.token_id, d.sampled.logprob,
                                        [self._entry(t, lp) for t, lp in d.sampled.top_logprobs])
                            for d in deltas]}

    def _entry(self, token_id: int, logprob: float | None, top: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
        token = self.token_text(token_id)
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = top
        return entry


Renderer = CompletionRenderer | ChatRenderer
