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
from kvgate.engine.server.tools import ToolCallParser, ToolFormat

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


def _call_reason(calls: list, reason: FinishReason | None) -> str | None:
    """"tool_calls" when the output held calls, unless max_tokens cut it ("length", as OpenAI says then)."""
    return "tool_calls" if calls and reason is not FinishReason.LENGTH else _reason(reason)


def by_choice(deltas: Sequence[TokenDelta], n: int) -> list[list[TokenDelta]]:
    """Each choice's deltas, in order (a request with n > 1 interleaves them)."""
    choices: list[list[TokenDelta]] = [[] for _ in range(n)]
    for delta in deltas:
        choices[delta.index].append(delta)
    return choices


class _Renderer:
    def __init__(self, *, request_id: str, created: int, model: str, token_text: TokenText,
                 logprobs: bool, include_usage: bool = False, n: int = 1) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs  # the client asked for logprobs
        self.include_usage = include_usage  # streamed: every chunk says "usage": null, the last one has it
        self.n = n  # choices

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk_envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._envelope(object_name, choices)
        if self.include_usage:
            chunk["usage"] = None
        return chunk


class CompletionRenderer(_Renderer):
    """/v1/completions: "text_completion" objects, streamed or not."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._text_offset = [0] * self.n  # characters of token text streamed so far per choice, for text_offset

    def response(self, deltas: Sequence[TokenDelta], usage: Usage) -> dict[str, Any]:
        choices = []
        for index, mine in enumerate(by_choice(deltas, self.n)):
            choices.append({"index": index, "text": "".join(d.text for d in mine),
                            "logprobs": self._logprobs(mine, index) if self.logprobs else None,
                            "finish_reason": _reason(mine[-1].finish_reason), "stop_reason": None})
        return {**self._envelope("text_completion", choices), "usage": usage.to_json()}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, delta: TokenDelta) -> list[dict[str, Any]]:
        """The stream chunks one delta makes: none while text is held back (a partial character or a possible
        stop string), unless it ends its choice or carries logprobs the client asked for."""
        if not (delta.text or delta.finish_reason is not None or self.logprobs):
            return []
        choice = {"index": delta.index, "text": delta.text,
                  "logprobs": self._logprobs([delta], delta.index) if self.logprobs else None,
                  "finish_reason": _reason(delta.finish_reason), "stop_reason": None}
        return [self._chunk_envelope("text_completion", [choice])]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope("text_completion", []), "usage": usage.to_json()}

    def _logprobs(self, deltas: Sequence[TokenDelta], index: int) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for delta in deltas:
            token = self.token_text(delta.token_id)
            top = {self.token_text(t): lp for t, lp in delta.sampled.top_logprobs}
            top.setdefault(token, delta.sampled.logprob)
            tokens.append(token)
            token_logprobs.append(delta.sampled.logprob)
            top_logprobs.append(top)
            text_offset.append(self._text_offset[index])
            self._text_offset[index] += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class ChatRenderer(_Renderer):
    """/v1/chat/completions: a "chat.completion", or "chat.completion.chunk"s of which the first of each
    choice carries the assistant role and the last carries the finish reason. With a `tool_format`, each
    choice's text goes through a ToolCallParser: calls come back as `tool_calls` (finish reason
    "tool_calls"); streamed, each call is a chunk with its id and name, then one with its arguments."""

    def __init__(self, *, tool_format: ToolFormat | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool_format = tool_format
        self._parsers = [ToolCallParser(tool_format) for _ in range(self.n)] if tool_format is not None else None

    def response(self, deltas: Sequence[TokenDelta], usage: Usage) -> dict[str, Any]:
        choices = []
        for index, mine in enumerate(by_choice(deltas, self.n)):
            content, calls = "".join(d.text for d in mine), []
            if self.tool_format is not None:
                parser = ToolCallParser(self.tool_format)
                sent = parser.feed(content)
                rest, calls = parser.finish()
                content = sent + rest
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = [call.to_json() for call in calls]
            choices.append({"index": index, "message": message,
                            "logprobs": self._logprobs(mine) if self.logprobs else None,
                            "finish_reason": _call_reason(calls, mine[-1].finish_reason)})
        return {**self._envelope("chat.completion", choices), "usage": usage.to_json()}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk_envelope("chat.completion.chunk", [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for index in range(self.n)]

    def chunks(self, delta: TokenDelta) -> list[dict[str, Any]]:
        """The stream chunks one delta makes (see CompletionRenderer.chunks); with tools, held text and the
        calls come out when the choice ends."""
        text, calls = delta.text, []
        if self._parsers is not None:
            parser = self._parsers[delta.index]
            text = parser.feed(text)
            if delta.finish_reason is not None:
                rest, calls = parser.finish()
                text += rest
        logprobs = self._logprobs([delta]) if self.logprobs else None
        if not calls:  # content, the last of it with the finish reason (as before tools existed)
            if not (text or delta.finish_reason is not None or self.logprobs):
                return []
            return [self._choice_chunk(delta.index, {"content": text}, logprobs, _reason(delta.finish_reason))]
        out = []
        if text or logprobs is not None:
            out.append(self._choice_chunk(delta.index, {"content": text}, logprobs, None))
        for k, call in enumerate(calls):
            opening = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append(self._choice_chunk(delta.index, {"tool_calls": [opening]}, None, None))
            arguments = {"index": k, "function": {"arguments": call.arguments}}
            out.append(self._choice_chunk(delta.index, {"tool_calls": [arguments]}, None, None))
        out.append(self._choice_chunk(delta.index, {}, None, _call_reason(calls, delta.finish_reason)))
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage.to_json()}

    def _choice_chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
        return self._chunk_envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

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
