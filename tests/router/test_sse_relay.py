"""How the proxy reads a replica's SSE stream as it relays it (`router.proxy.SseRelay`): whole events only,
the first token, [DONE], and the usage chunk's token counts."""

from __future__ import annotations

import json

import pytest

from kvgate.router import proxy
from kvgate.router.proxy import SseRelay, carries_output
from kvgate.router.upstream import UpstreamError


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chat_chunk(delta: dict | None = None, finish_reason: str | None = None, **extra: object) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta or {},
                                                            "finish_reason": finish_reason}], **extra}


@pytest.mark.parametrize("payload, expected", [
    (chat_chunk({"role": "assistant", "content": ""}), False),  # vLLM's and SGLang's opening chunk
    (chat_chunk({"role": "assistant", "content": None}), False),
    (chat_chunk({"content": "Hello"}), True),
    (chat_chunk({"content": "\n"}), True),
    (chat_chunk({"content": '"quoted"'}), True),
    (chat_chunk({"reasoning_content": "Let me think"}), True),
    (chat_chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}), True),
    (chat_chunk({"tool_calls": []}), False),
    (chat_chunk({}, finish_reason="length"), True),
    (chat_chunk({"role": "assistant", "content": ""}, usage=None), False),
    (chat_chunk({"role": "assistant", "content": ""}, usage={}), False),
    ({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 0}}, True),
    ({"object": "text_completion", "choices": [{"index": 0, "text": " world", "finish_reason": None}]}, True),
    ({"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": None}]}, False),
    # a key inside a string value is escaped, so it is not one
    (chat_chunk({"role": "assistant", "content": ""}, note='{"content": "x"}'), False),
])
def test_carries_output(payload: object, expected: bool) -> None:
    data = json.dumps(payload).encode()
    assert carries_output(data) is expected
    assert carries_output(data.replace(b": ", b":").replace(b", ", b",")) is expected  # compact JSON too


def test_the_relay_passes_only_whole_events_and_keeps_the_rest_for_the_next_read() -> None:
    relay = SseRelay()
    role, token = event(chat_chunk({"role": "assistant", "content": ""})), event(chat_chunk({"content": "Hi"}))
    stream = role + token + b"data: [DONE]\n\n"
    cut_1, cut_2 = len(role) + 10, len(role) + len(token) + 3
    assert relay.feed(stream[:cut_1]) == role
    assert not relay.first_token  # the opening chunk holds no token
    assert relay.feed(stream[cut_1:cut_2]) == token
    assert relay.first_token and not relay.done
    assert relay.feed(stream[cut_2:]) == b"data: [DONE]\n\n"
    assert relay.done


def test_the_relay_reads_the_usage_chunks_prompt_and_cached_tokens() -> None:
    relay = SseRelay()
    usage = {"prompt_tokens": 120, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 96}}
    out = relay.feed(event(chat_chunk({"content": "Hi"})) + event({"choices": [], "usage": usage})
                     + b"data: [DONE]\r\n\r\n")
    assert out.endswith(b"data: [DONE]\n\n")  # CRLF line ends are normalised
    assert (relay.prompt_tokens, relay.cached_tokens, relay.done) == (120, 96, True)


def test_an_event_that_never_ends_is_a_broken_stream_not_a_growing_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "MAX_EVENT_BYTES", 1000)
    relay = SseRelay()
    assert relay.feed(event(chat_chunk({"content": "x" * 500}))) != b""  # whole events of any size under it pass
    assert relay.feed(b"data: " + b"y" * 600) == b""
    with pytest.raises(UpstreamError, match="over 1000 bytes"):
        relay.feed(b"y" * 600)  # no event boundary in 1,206 bytes



def test_the_relay_keeps_the_last_usage_chunks_tokens_used() -> None:
    # vLLM's continuous usage stats put a cumulative usage in every chunk: the last one is the answer's.
    relay = SseRelay()
    relay.feed(event(chat_chunk({"content": "a"}, usage={"prompt_tokens": 7, "completion_tokens": 1})))
    relay.feed(event(chat_chunk({"content": "b"}, usage={"prompt_tokens": 7, "completion_tokens": 2})))
    relay.feed(b"data: [DONE]\n\n")
    assert relay.tokens_used == 9 and relay.prompt_tokens == 7


def test_a_stream_without_usage_leaves_tokens_used_unknown() -> None:
    relay = SseRelay()
    relay.feed(event(chat_chunk({"content": "a"}, finish_reason="stop")) + b"data: [DONE]\n\n")
    assert relay.tokens_used is None
