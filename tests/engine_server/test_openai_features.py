"""Structured output, tools, n > 1 and logit_bias through a real `kvgate engine` process and the official SDK.

tiny-llama and tiny-tools have random weights, so whatever they write unconstrained is noise: every schema
and every forced tool call below must still parse and validate, because the grammar allows nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from kvgate.engine.builtin import resolve_model_source
from tests.engine.builtin_cache import shared_cache_dir
from tests.engine_server.test_process import Replica, start_replica

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "mood", "stops"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 30},
                         "mood": {"enum": ["calm", "busy"]},
                         "stops": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                                   "maxItems": 4}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
BOOK = {"type": "function", "function": {
    "name": "book_table",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["people"],
                   "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12}}}}}
TOOLS = [WEATHER, BOOK]
ASK = [{"role": "user", "content": "What is the weather in Lisbon?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[Replica]:
    replica = start_replica(tmp_path_factory.mktemp("tiny"))
    yield replica
    replica.process.terminate()
    replica.process.wait(30)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> Iterator[Replica]:
    replica = start_replica(tmp_path_factory.mktemp("tools"), model="builtin:tiny-tools")
    yield replica
    replica.process.terminate()
    replica.process.wait(30)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema, "strict": True}}


def streamed_chat(client: openai.OpenAI, **kwargs) -> dict[int, dict]:
    """A streamed chat folded back into choices: content, tool calls (name, arguments) and finish reason."""
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            mine = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            mine["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = mine["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            mine["finish"] = choice.finish_reason or mine["finish"]
    return choices


def test_every_json_schema_answer_parses_and_validates(tiny: Replica) -> None:
    client = tiny.openai()
    for seed in range(6):
        answer = client.chat.completions.create(model="tiny-llama", messages=ASK, seed=seed, max_tokens=300,
                                                temperature=1.0, response_format=schema_format(SCHEMA))
        choice = answer.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
        streamed = streamed_chat(client, model="tiny-llama", messages=ASK, seed=seed, max_tokens=300,
                                 temperature=1.0, response_format=schema_format(SCHEMA))
        assert streamed[0]["content"] == choice.message.content and streamed[0]["finish"] == "stop"


def test_json_mode_gives_an_object(tiny: Replica) -> None:
    answer = tiny.openai().chat.completions.create(model="tiny-llama", messages=ASK, seed=1, max_tokens=400,
                                                   response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:
        assert answer.choices[0].message.content.startswith("{")


def test_a_schema_that_cannot_be_enforced_and_tools_without_a_template_are_400s(tiny: Replica) -> None:
    client = tiny.openai(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no-such-format") as caught:
        client.chat.completions.create(model="tiny-llama", messages=ASK, response_format=schema_format(
            {"type": "string", "format": "no-such-format"}))
    assert caught.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="no chat template with tool support") as caught:
        client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS)
    assert caught.value.body["param"] == "tools"


def test_tool_choice_required_always_yields_a_valid_call(tools_model: Replica) -> None:
    client = tools_model.openai()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(6):
        answer = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                                seed=seed, temperature=1.0, max_tokens=200)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed = streamed_chat(client, model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                 seed=seed, temperature=1.0, max_tokens=200)[0]
        assert streamed["finish"] == "tool_calls"
        assert streamed["calls"] == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_a_named_tool_choice_calls_that_function(tools_model: Replica) -> None:
    answer = tools_model.openai().chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, seed=4, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "book_table"}})
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "book_table"
    jsonschema.validate(json.loads(call.function.arguments), BOOK["function"]["parameters"])


def test_tools_are_rendered_and_a_tool_turn_goes_back_to_the_model(tools_model: Replica) -> None:
    client = tools_model.openai()
    bare = client.chat.completions.create(model="tiny-tools", messages=ASK, max_tokens=1)
    offered = client.chat.completions.create(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=1)
    rendered = json.dumps(WEATHER) + json.dumps(BOOK)
    assert offered.usage.prompt_tokens - bare.usage.prompt_tokens > len(rendered) // 8  # the signatures went in
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Lisbon", "unit": "celsius"})}}
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    answer = client.chat.completions.create(model="tiny-tools", messages=follow_up, tools=TOOLS, max_tokens=4)
    assert answer.usage.prompt_tokens > offered.usage.prompt_tokens


def test_n_samples_share_the_prompt_and_count_it_once(tiny: Replica) -> None:
    client = tiny.openai()
    prompt = list(range(100, 260))  # 160 tokens: 10 full blocks of 16
    answer = client.completions.create(model="tiny-llama", prompt=prompt, n=4, max_tokens=20, seed=9,
                                       temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == 160 and answer.usage.completion_tokens == 80
    assert len({c.text for c in answer.choices}) > 1
    texts = {i: "" for i in range(4)}
    for chunk in client.completions.create(model="tiny-llama", prompt=prompt, n=4, max_tokens=20, seed=9,
                                           temperature=1.0, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in answer.choices]

    # While four long samples of a fresh 160-token prompt stream, the prompt's 10 blocks are held once.
    long_prompt = [(7 * i) % 280 + 3 for i in range(160)]
    total = tiny.metric("kvgate_engine_kv_blocks_total")
    stream = client.completions.create(model="tiny-llama", prompt=long_prompt, n=4, max_tokens=1500,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    used = []
    for count, _ in enumerate(stream):
        if count in (8, 40):
            used.append(total - tiny.metric("kvgate_engine_kv_blocks_free"))
        if count > 40:
            break
    stream.close()
    # 10 shared + each sample's own blocks (a few, as it generates); 40+ if each held its own prompt copy
    assert all(u <= 10 + 4 * 3 for u in used), used


def test_logit_bias_reaches_the_sampler(tiny: Replica) -> None:
    answer = tiny.openai().completions.create(model="tiny-llama", prompt="hello", max_tokens=5, temperature=0,
                                              logit_bias={"97": 100}, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == "aaaaa"  # token 97 is the byte "a"


NESTED_TOOL = {"type": "function", "function": {  # as pydantic writes a model with a nested one
    "name": "ship", "parameters": {
        "$defs": {"Address": {"type": "object", "additionalProperties": False, "required": ["city"],
                              "properties": {"city": {"type": "string", "maxLength": 10}}}},
        "type": "object", "additionalProperties": False, "required": ["to"],
        "properties": {"to": {"$ref": "#/$defs/Address"}}}}}


def test_a_forced_call_to_a_tool_whose_schema_refers_to_its_own_defs(tools_model: Replica) -> None:
    answer = tools_model.openai().chat.completions.create(
        model="tiny-tools", messages=ASK, tools=[NESTED_TOOL, WEATHER], tool_choice="required", seed=2,
        temperature=1.0, max_tokens=200)
    [call] = answer.choices[0].message.tool_calls
    schema = next(t for t in (NESTED_TOOL, WEATHER) if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


def test_a_call_cut_by_max_tokens_says_length(tools_model: Replica) -> None:
    answer = tools_model.openai().chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="required", seed=1, max_tokens=6)
    assert answer.choices[0].finish_reason == "length"


def test_odd_inputs_are_400s_or_served_never_500s(tiny: Replica, tools_model: Replica) -> None:
    client = tiny.openai(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="allows no output"):
        client.chat.completions.create(model="tiny-llama", messages=ASK, response_format=schema_format({"$ref": "#"}))
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="tiny-llama", prompt="x", logit_bias={"9" * 5000: 1})
    # Arguments nested past json's recursion limit are rendered as the text they are: here into a prompt longer
    # than the model takes, which is the 400 that says so, not a 500.
    deep = "[" * 990 + "]" * 990
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    with pytest.raises(openai.BadRequestError, match="your prompt has 2"):
        tools_model.openai(max_retries=0).chat.completions.create(
            model="tiny-tools", max_tokens=2, tools=TOOLS,
            messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c", "content": "ok"}])


def test_logprobs_of_constrained_output_are_the_models_and_finite(tiny: Replica) -> None:
    response = tiny.openai().chat.completions.with_raw_response.create(
        model="tiny-llama", messages=ASK, max_tokens=20, logprobs=True, top_logprobs=5,
        response_format=schema_format({"const": "hello world"}))
    assert "Infinity" not in response.text  # strict JSON parsers refuse it
    content = response.parse().choices[0].logprobs.content
    assert len(content) > 1 and all(len(entry.top_logprobs) == 5 for entry in content)


def test_call_tags_that_are_special_tokens_are_kept_for_the_parser(tmp_path: Path) -> None:
    # Some Hermes-style models mark <tool_call> special, which decoding drops unless told to keep it.
    model_dir = tmp_path / "special-tags"
    model_dir.mkdir()
    for item in resolve_model_source("builtin:tiny-tools", shared_cache_dir()).iterdir():  # built once, here
        (model_dir / item.name).write_bytes(item.read_bytes())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in ("<tool_call>", "</tool_call>"):
            token["special"] = True
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    replica = start_replica(tmp_path, "--served-model-name", "special", model=str(model_dir))
    try:
        answer = replica.openai().chat.completions.create(model="special", messages=ASK, tools=TOOLS,
                                                          tool_choice="required", seed=3, max_tokens=200)
        assert answer.choices[0].finish_reason == "tool_calls" and len(answer.choices[0].message.tool_calls) == 1
    finally:
        replica.process.terminate()
        replica.process.wait(30)


def test_a_tool_schema_that_cannot_be_read_is_a_400_in_auto_mode_too(tools_model: Replica) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        tools_model.openai(max_retries=0).chat.completions.create(model="tiny-tools", messages=ASK, tools=[bad])
    assert caught.value.body["param"] == "tools"
