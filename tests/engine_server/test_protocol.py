"""OpenAI request bodies -> validated values: what is accepted, and the exact error for what is not."""

from __future__ import annotations

import pytest

from kvgate.engine.server.protocol import (
    ChatMessage,
    SamplingRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
    parse_load_adapter_request,
    sampling_params,
)
from kvgate.openai_wire import ApiError

COMPLETION = {"model": "m", "prompt": "hello"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_of(fn, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        fn(body)
    return caught.value


# ------------------------------------------------------------------------------------- accepted


def test_a_minimal_completion_takes_openai_defaults() -> None:
    request = parse_completion_request(COMPLETION)
    assert request.model == "m" and request.prompt == "hello"
    assert request.sampling == SamplingRequest()  # max_tokens: absent (16 once the prompt is known)
    assert not request.stream and not request.include_usage


@pytest.mark.parametrize("prompt,expected", [
    ("text", "text"),
    (["text"], "text"),  # a batch of one
    ([1, 2, 3], (1, 2, 3)),
    ([[1, 2, 3]], (1, 2, 3)),
    ([7], (7,)),
])
def test_a_prompt_is_text_or_token_ids_alone_or_in_a_batch_of_one(prompt, expected) -> None:
    assert parse_completion_request({**COMPLETION, "prompt": prompt}).prompt == expected


def test_every_sampling_field_is_read() -> None:
    body = {**COMPLETION, "max_tokens": 40, "min_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "seed": 7, "stop": ["x", "yz"], "stop_token_ids": [3], "presence_penalty": 0.1,
            "frequency_penalty": -0.2, "ignore_eos": True, "logprobs": 3, "user": "u1"}
    request = parse_completion_request(body)
    assert request.sampling == SamplingRequest(
        max_tokens=40, min_tokens=2, temperature=0.5, top_p=0.9, top_k=5, seed=7, stop=("x", "yz"),
        stop_token_ids=(3,), presence_penalty=0.1, frequency_penalty=-0.2, ignore_eos=True, logprobs=3)
    assert request.user == "u1"


def test_unknown_fields_and_explicit_nulls_are_ignored_as_vllm_does() -> None:
    body = {**COMPLETION, "echo": False, "no_stop_trim": True, "skip_special_tokens": True,
            "return_hidden_states": False, "temperature": None, "stop": None, "n": None}
    assert parse_completion_request(body).sampling == SamplingRequest()


def test_a_single_stop_string_becomes_a_tuple_and_top_k_minus_one_means_all() -> None:
    sampling = parse_completion_request({**COMPLETION, "stop": "\n", "top_k": -1}).sampling
    assert sampling.stop == ("\n",) and sampling.top_k == 0


def test_stream_options_include_usage() -> None:
    request = parse_completion_request({**COMPLETION, "stream": True, "stream_options": {"include_usage": True}})
    assert request.stream and request.include_usage


def test_chat_content_parts_are_joined_with_newlines_and_null_content_is_empty() -> None:
    body = {**CHAT, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "c", "name": "bob"}]}
    assert parse_chat_request(body).messages == (
        ChatMessage("system", "a\nb"), ChatMessage("assistant", ""), ChatMessage("user", "c"))


def test_chat_leaves_max_tokens_to_the_room_left_and_prefers_max_completion_tokens() -> None:
    assert parse_chat_request(CHAT).sampling.max_tokens is None
    assert parse_chat_request({**CHAT, "max_tokens": 5}).sampling.max_tokens == 5
    assert parse_chat_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 9}).sampling.max_tokens == 9


@pytest.mark.parametrize("fields,logprobs", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 4}, 4),
])
def test_chat_logprobs_is_a_flag_with_top_logprobs_alternatives(fields, logprobs) -> None:
    assert parse_chat_request({**CHAT, **fields}).sampling.logprobs == logprobs


def test_adapter_bodies_use_vllms_names() -> None:
    assert parse_load_adapter_request({"lora_name": "sql", "lora_path": "/a"}) == ("sql", "/a")


# ------------------------------------------------------------------------------------- refused

BAD_COMPLETIONS = [
    # (body change, param, code, words in the message)
    ({"model": None}, "model", "missing_required_parameter", "model is required"),
    ({"model": 3}, "model", "invalid_type", "model must be a string; got a number"),
    ({"prompt": None}, "prompt", "missing_required_parameter", "prompt is required"),
    ({"prompt": ""}, "prompt", "invalid_value", "must not be empty"),
    ({"prompt": []}, "prompt", "invalid_value", "must not be empty"),
    ({"prompt": ["a", "b"]}, "prompt", "invalid_value", "holds 2 prompts"),
    ({"prompt": [[1], [2]]}, "prompt", "invalid_value", "holds 2 prompts"),
    ({"prompt": [1, "a"]}, "prompt", "invalid_type", "a string or a list of token ids"),
    ({"prompt": [1.5]}, "prompt", "invalid_type", "a string or a list of token ids"),
    ({"prompt": [-1]}, "prompt", "invalid_value", ">= 0"),
    ({"prompt": {"text": "x"}}, "prompt", "invalid_type", "a string or a list of token ids"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value", "an integer >= 1; got 0"),
    ({"max_tokens": 16.0}, "max_tokens", "invalid_type", "an integer; got a number"),
    ({"max_tokens": "16"}, "max_tokens", "invalid_type", "an integer; got a string"),
    ({"max_tokens": True}, "max_tokens", "invalid_type", "an integer; got a boolean"),
    ({"min_tokens": -1}, "min_tokens", "invalid_value", ">= 0"),
    ({"temperature": -0.1}, "temperature", "invalid_value", "from 0 to 100"),
    ({"temperature": "hot"}, "temperature", "invalid_type", "a number; got a string"),
    ({"top_p": 0}, "top_p", "invalid_value", "in (0, 1]"),
    ({"top_p": 1.5}, "top_p", "invalid_value", "in (0, 1]"),
    ({"top_k": -2}, "top_k", "invalid_value", ">= -1"),
    ({"seed": 2**64}, "seed", "invalid_value", "seed must be an integer from"),
    ({"stop": 3}, "stop", "invalid_type", "a string or a list of strings"),
    ({"stop": ["ok", ""]}, "stop", "invalid_value", "must not be empty"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "invalid_type", "a list of integers"),
    ({"stop_token_ids": [-3]}, "stop_token_ids", "invalid_value", ">= 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value", "from -2 to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "invalid_value", "from -2 to 2"),
    ({"logprobs": 21}, "logprobs", "invalid_value", "from 0 to 20"),
    ({"logprobs": True}, "logprobs", "invalid_type", "an integer; got a boolean"),
    ({"n": 0}, "n", "invalid_value", "n must be an integer from 1 to 128"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_value", "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value", "from -100 to 100"),
    ({"logit_bias": [5]}, "logit_bias", "invalid_type", "must be an object"),
    ({"logit_bias": {"5": 1, "05": 1}}, "logit_bias", "invalid_value", "names a token id twice"),
    ({"stream": "yes"}, "stream", "invalid_type", "true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value", "only allowed when stream"),
    ({"stream": True, "stream_options": []}, "stream_options", "invalid_type", "must be an object"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type",
     "true or false"),
    ({"ignore_eos": "no"}, "ignore_eos", "invalid_type", "true or false"),
    ({"user": 5}, "user", "invalid_type", "a string"),
]


@pytest.mark.parametrize("change,param,code,words", BAD_COMPLETIONS, ids=[str(c[0]) for c in BAD_COMPLETIONS])
def test_a_bad_completion_field_is_a_400_naming_it(change, param, code, words) -> None:
    error = error_of(parse_completion_request, {**COMPLETION, **change})
    assert (error.status, error.param, error.code, error.type) == (400, param, code, "BadRequestError")
    assert words in error.message


BAD_CHATS = [
    ({"messages": None}, "messages", "missing_required_parameter", "messages is required"),
    ({"messages": []}, "messages", "invalid_type", "non-empty list"),
    ({"messages": "hi"}, "messages", "invalid_type", "non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type", "an object with role and content"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter", "role is required"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role", "invalid_type", "a string"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type", "text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "invalid_value", "'image_url' (this server takes text only)"),
    ({"logprobs": 1}, "logprobs", "invalid_type", "true or false"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value", "requires logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "invalid_value", "from 0 to 20"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value", ">= 1"),
    ({"n": 129}, "n", "invalid_value", "n must be an integer from 1 to 128"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value", "must be \"text\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "invalid_type", "must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name",
     "invalid_value", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice.function.name", "invalid_value", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value", "needs tools"),
]


@pytest.mark.parametrize("change,param,code,words", BAD_CHATS, ids=[str(c[0]) for c in BAD_CHATS])
def test_a_bad_chat_field_is_a_400_naming_it(change, param, code, words) -> None:
    error = error_of(parse_chat_request, {**CHAT, **change})
    assert (error.status, error.param, error.code) == (400, param, code)
    assert words in error.message


@pytest.mark.parametrize("raw,words", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object; got an array"),
    (b"null", "must be a JSON object; got null"),
])
def test_a_body_that_is_not_a_json_object_is_a_400(raw, words) -> None:
    error = error_of(parse_json_object, raw)
    assert (error.status, error.code) == (400, "invalid_json") and words in error.message


def test_the_error_body_is_an_openai_error_object() -> None:
    error = error_of(parse_completion_request, {**COMPLETION, "n": 0})
    assert error.body() == {"error": {"message": "n must be an integer from 1 to 128; got 0", "type": "BadRequestError",
                                      "param": "n", "code": "invalid_value"}}


# ----------------------------------------------------------------------- context length, max_tokens


def test_an_absent_max_tokens_takes_the_room_left() -> None:
    # max_model_len 100, a 30-token prompt: 70 tokens of room.
    params = sampling_params(SamplingRequest(), num_prompt_tokens=30, max_model_len=100, prompt_param="messages")
    assert params.max_tokens == 70


@pytest.mark.parametrize("num_prompt_tokens,expected", [(30, 16), (90, 10)])
def test_the_completions_default_of_16_tokens_is_capped_by_the_room_left(num_prompt_tokens, expected) -> None:
    # max_model_len 100: a 30-token prompt gets the default 16; a 90-token prompt the 10 that are left.
    params = sampling_params(SamplingRequest(), num_prompt_tokens=num_prompt_tokens, max_model_len=100,
                             prompt_param="prompt", default_max_tokens=16)
    assert params.max_tokens == expected


def test_prompt_plus_max_tokens_over_the_context_is_a_400_stating_both_numbers() -> None:
    with pytest.raises(ApiError) as caught:
        sampling_params(SamplingRequest(max_tokens=80), num_prompt_tokens=30, max_model_len=100,
                        prompt_param="prompt")
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert "maximum context length is 100 tokens" in error.message
    assert "110 tokens (30 in the prompt, 80 in the completion)" in error.message


def test_a_prompt_that_fills_the_context_is_a_400_on_the_prompt() -> None:
    with pytest.raises(ApiError) as caught:
        sampling_params(SamplingRequest(), num_prompt_tokens=100, max_model_len=100, prompt_param="messages")
    assert (caught.value.param, caught.value.code) == ("messages", "context_length_exceeded")
    assert "your prompt has 100 tokens" in caught.value.message


def test_min_tokens_over_the_resolved_max_tokens_is_a_400() -> None:
    with pytest.raises(ApiError) as caught:
        sampling_params(SamplingRequest(max_tokens=4, min_tokens=5), num_prompt_tokens=1, max_model_len=100,
                        prompt_param="prompt")
    assert caught.value.param == "min_tokens"
    assert "min_tokens (5) must be at most max_tokens (4)" in caught.value.message


def test_the_resolved_request_becomes_engine_sampling_params() -> None:
    request = SamplingRequest(max_tokens=8, temperature=0.0, stop=("x",), logprobs=2, seed=3)
    params = sampling_params(request, num_prompt_tokens=5, max_model_len=100, prompt_param="prompt")
    assert (params.max_tokens, params.greedy, params.stop, params.logprobs, params.seed) == (8, True, ("x",), 2, 3)
