"""OpenAI request bodies -> our request values, with errors a client can act on.

Pure functions over decoded JSON (no engine, no I/O), so every rule is a table-driven test. Refusals
are `ApiError`s (`kvgate.openai_wire`, the shape the gateway shares); the HTTP layer renders each
once, at the edge, as an OpenAI error object:

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": "invalid_type"}}

Unknown fields are ignored, as vLLM does: routers and SDKs add their own (`no_stop_trim`,
`skip_special_tokens`, `echo`, ...). An explicit `null` means "not given". Integers must be JSON
integers (`16`, not `16.0` or `"16"`), booleans must be `true`/`false`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvgate.engine.sequence import Constraint, SamplingParams
from kvgate.engine.server.tools import (ChoiceMode, ToolCall, ToolChoice, ToolSpec, parse_message_tool_calls,
                                        parse_response_format, parse_tools)
from kvgate.openai_wire import ApiError, BodyWording, bad_request, json_type, parse_json_body

MAX_LOGPROBS = 20  # the sampler returns at most this many alternatives per token
MAX_N = 128  # OpenAI's limit on choices; the server also keeps n within the engine's max_num_seqs
MAX_LOGIT_BIAS_ENTRIES = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default, which vLLM keeps
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# The engine's words for a body that is not a JSON object, as its clients have seen them.
_BODY_WORDING = BodyWording("The request body", "must be a JSON object; got {json_type}", "invalid_json")


def model_not_found(name: str, known: tuple[str, ...]) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist; this server serves: {', '.join(known)}",
                    type="NotFoundError", param="model", code="model_not_found")


def body_too_large(limit_bytes: int) -> ApiError:
    return ApiError(413, f"The request body is larger than this server accepts ({limit_bytes} bytes)",
                    type="RequestTooLargeError", code="body_too_large")


# ------------------------------------------------------------------------------------- values


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling fields both endpoints share; max_tokens stays None until the prompt's length is known."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens (vLLM's -1 is read as 0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's logprob and the top n
    n: int = 1  # choices, sampled from one prompt
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids are checked against the vocabulary later


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final chunk with usage
    user: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a "tool" turn: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention: a call's arguments as a mapping
        when they are a JSON object, which templates print with tojson)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    response_format: Constraint | None = None  # json_object / json_schema; None: text
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice(ChoiceMode.NONE)


# ------------------------------------------------------------------------------------- parsing


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object. Raises ApiError 400 for invalid JSON or another top-level type."""
    return parse_json_body(raw, _BODY_WORDING)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body. Raises ApiError 400 naming the field."""
    fields = _Fields(body)
    logprobs = fields.integer("logprobs", None, low=0, high=MAX_LOGPROBS)
    stream, include_usage = _stream_fields(fields)
    return CompletionRequest(
        model=fields.string("model", required=True),
        prompt=_prompt(fields),
        sampling=_sampling(fields, fields.integer("max_tokens", None, low=1), logprobs),
        stream=stream, include_usage=include_usage, user=fields.string("user"),
    )


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a /v1/chat/completions body. Raises ApiError 400 naming the field."""
    fields = _Fields(body)
    want_logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    # max_completion_tokens is the newer name; it wins when both are given, as in OpenAI's API.
    max_tokens = fields.integer("max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", None, low=1)
    stream, include_usage = _stream_fields(fields)
    tools, tool_choice = parse_tools(body.get("tools"), body.get("tool_choice"))
    response_format = parse_response_format(body.get("response_format"))
    if response_format is not None and tool_choice.forces_call:
        raise bad_request("response_format and a tool_choice that forces a call cannot be combined", "response_format")
    return ChatRequest(
        model=fields.string("model", required=True),
        messages=_messages(fields),
        sampling=_sampling(fields, max_tokens, (top_logprobs or 0) if want_logprobs else None),
        stream=stream, include_usage=include_usage, user=fields.string("user"),
        response_format=response_format, tools=tools, tool_choice=tool_choice,
    )


def parse_load_adapter_request(body: dict[str, Any]) -> tuple[str, str]:
    """vLLM's /v1/load_lora_adapter body -> (lora_name, lora_path)."""
    fields = _Fields(body)
    return fields.string("lora_name", required=True), fields.string("lora_path", required=True)


def parse_unload_adapter_request(body: dict[str, Any]) -> str:
    """vLLM's /v1/unload_lora_adapter body -> lora_name."""
    return _Fields(body).string("lora_name", required=True)


def sampling_params(request: SamplingRequest, *, num_prompt_tokens: int, max_model_len: int,
                    prompt_param: str, default_max_tokens: int | None = None,
                    constraint: Constraint | None = None, skip_special_tokens: bool = True) -> SamplingParams:
    """The engine's SamplingParams once the prompt is tokenized.

    A prompt and its completion share the model's context: with max_model_len 2048, a 2000-token
    prompt leaves room for 48 tokens. Asking for more than the room is a 400 that states both numbers.
    An absent max_tokens is `default_max_tokens` (16 for completions, as OpenAI and vLLM) capped by the
    room, or all of the room when there is no default (chat, as vLLM).
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
            prompt_param, code="context_length_exceeded")
    if request.max_tokens is not None:
        max_tokens = request.max_tokens
    else:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens", code="context_length_exceeded")
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({request.min_tokens}) must be at most max_tokens ({max_tokens})",
                          "min_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=request.min_tokens, temperature=request.temperature,
            top_p=request.top_p, top_k=request.top_k, seed=request.seed, stop=request.stop,
            stop_token_ids=request.stop_token_ids, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, ignore_eos=request.ignore_eos, logprobs=request.logprobs,
            logit_bias=request.logit_bias, n=request.n, constraint=constraint,
            skip_special_tokens=skip_special_tokens,
        )
    except ValueError as exc:  # every field was checked above; this is a backstop, still the client's fault
        raise bad_request(str(exc)) from exc


# ------------------------------------------------------------------------------------- helpers


def _sampling(fields: _Fields, max_tokens: int | None, logprobs: int | None) -> SamplingRequest:
    top_k = fields.integer("top_k", 0, low=-1)
    return SamplingRequest(
        max_tokens=max_tokens,
        min_tokens=fields.integer("min_tokens", 0, low=0),
        temperature=fields.number("temperature", 1.0, low=0.0, high=100.0),
        top_p=fields.number("top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=max(top_k, 0),
        seed=fields.integer("seed", None, low=_SEED_RANGE[0], high=_SEED_RANGE[1]),
        stop=_stop(fields),
        stop_token_ids=tuple(fields.integer_list("stop_token_ids", low=0)),
        presence_penalty=fields.number("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
        ignore_eos=fields.boolean("ignore_eos", False),
        logprobs=logprobs,
        n=fields.integer("n", 1, low=1, high=MAX_N),
        logit_bias=_logit_bias(fields),
    )


def _logit_bias(fields: _Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias from -100 to 100}."""
    value = fields.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object of token ids to numbers; got {json_type(value)}",
                          "logit_bias", code="invalid_type")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                          "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers); got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number from -100 to 100; got {bias!r}", "logit_bias")
        out.append((int(key), float(bias)))
    ids = [token for token, _ in out]
    if len(set(ids)) != len(ids):  # "5" and "05" name one token; their biases would add up
        raise bad_request("logit_bias names a token id twice", "logit_bias")
    return tuple(out)


def _stream_fields(fields: _Fields) -> tuple[bool, bool]:
    stream = fields.boolean("stream", False)
    options = fields.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object; got {json_type(options)}", "stream_options",
                          code="invalid_type")
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = _Fields(options, prefix="stream_options.").boolean("include_usage", False)
    return stream, include_usage


def _prompt(fields: _Fields) -> str | tuple[int, ...]:
    value = fields.get("prompt")
    if value is None:
        raise bad_request("prompt is required", "prompt", code="missing_required_parameter")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise bad_request(f"prompt holds {len(value)} prompts; this server takes one prompt per request",
                              "prompt")
        value = value[0]  # a batch of one: ["text"] or [[1, 2, 3]]
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        return value
    if isinstance(value, list) and not value:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(value, list) and all(_is_int(t) for t in value):
        if any(t < 0 for t in value):
            raise bad_request("prompt token ids must be >= 0", "prompt")
        return tuple(value)
    raise bad_request("prompt must be a string or a list of token ids", "prompt", code="invalid_type")


def _messages(fields: _Fields) -> tuple[ChatMessage, ...]:
    value = fields.get("messages")
    if value is None:
        raise bad_request("messages is required", "messages", code="missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages",
                          code="invalid_type")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(value: Any, where: str) -> ChatMessage:
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object with role and content", where, code="invalid_type")
    fields = _Fields(value, prefix=f"{where}.")
    role = fields.string("role", required=True)
    tool_calls = parse_message_tool_calls(value.get("tool_calls"), f"{where}.tool_calls")
    tool_call_id = fields.string("tool_call_id")
    content = value.get("content")
    if content is None:  # an assistant turn that only called tools
        return ChatMessage(role, "", tool_calls, tool_call_id)
    if isinstance(content, str):
        return ChatMessage(role, content, tool_calls, tool_call_id)
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                          code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise bad_request(f"{param} must be a text part {{\"type\": \"text\", \"text\": ...}}; got {kind!r} "
                              f"(this server takes text only)", param)
        texts.append(part["text"])
    return ChatMessage(role, "\n".join(texts), tool_calls, tool_call_id)  # vLLM joins text parts with newlines


def _stop(fields: _Fields) -> tuple[str, ...]:
    value = fields.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise bad_request("stop must be a string or a list of strings", "stop", code="invalid_type")
    if not all(values):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Typed reads of a JSON object's keys; errors name the key (with `prefix` for nested objects)."""

    def __init__(self, raw: dict[str, Any], prefix: str = "") -> None:
        self.raw = raw
        self.prefix = prefix

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    def _wrong_type(self, key: str, value: Any, wanted: str) -> ApiError:
        return bad_request(f"{self.prefix}{key} must be {wanted}; got {json_type(value)}", self.prefix + key,
                           code="invalid_type")

    def _out_of_range(self, key: str, value: Any, allowed: str) -> ApiError:
        return bad_request(f"{self.prefix}{key} must be {allowed}; got {value!r}", self.prefix + key)

    def string(self, key: str, *, required: bool = False) -> Any:
        value = self.raw.get(key)
        if value is None:
            if required:
                raise bad_request(f"{self.prefix}{key} is required", self.prefix + key,
                                  code="missing_required_parameter")
            return None
        if not isinstance(value, str):
            raise self._wrong_type(key, value, "a string")
        if required and not value:
            raise self._out_of_range(key, value, "a non-empty string")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._wrong_type(key, value, "true or false")
        return value

    def integer(self, key: str, default: Any, *, low: int | None = None, high: int | None = None) -> Any:
        value = self.raw.get(key)
        if value is None:
            return default
        if not _is_int(value):
            raise self._wrong_type(key, value, "an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            raise self._out_of_range(key, value, _range_text(low, high))
        return value

    def number(self, key: str, default: float, *, low: float, high: float, low_open: bool = False) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._wrong_type(key, value, "a number")
        if value < low or value > high or (low_open and value == low):
            interval = f"in ({low:g}, {high:g}]" if low_open else f"from {low:g} to {high:g}"
            raise self._out_of_range(key, value, f"a number {interval}")
        return float(value)

    def integer_list(self, key: str, *, low: int) -> list[int]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise self._wrong_type(key, value, "a list of integers")
        if any(v < low for v in value):
            raise self._out_of_range(key, value, f"a list of integers >= {low}")
        return value


def _range_text(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer from {low} to {high}"
    if low is not None:
        return f"an integer >= {low}"
    return f"an integer <= {high}"
