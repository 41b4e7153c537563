"""Request features: canonical prompt text and the chained chunk hashes the prefix index keys on."""

from __future__ import annotations

import pytest

from kvgate.router.features import (
    CHARS_PER_TOKEN,
    build_route_request,
    canonical_prompt,
    chain_root,
    prefix_hashes,
)

SYSTEM = "You are a careful assistant. " * 20  # 580 chars: 2 full chunks of 256


def chat(*messages: tuple[str, str]) -> dict:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in messages]}


@pytest.mark.parametrize("body,expected", [
    (chat(("system", "be brief"), ("user", "hi")), "\x1esystem\x1fbe brief\x1euser\x1fhi"),
    # content parts concatenate in order; a non-text part is canonical JSON (sorted keys)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "image_url", "image_url": {"url": "u"}},
                                                 {"type": "text", "text": "b"}]}]},
     '\x1euser\x1fa{"image_url":{"url":"u"},"type":"image_url"}b'),
    # tool calls and names are part of the text, deterministically
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]},
     '\x1eassistant\x1f\x1dtool_calls\x1f[{"id":"c1","type":"function"}]'),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "\x1etool\x1f42\x1dtool_call_id\x1fc1"),
    ({"prompt": "Once upon a time"}, "Once upon a time"),
    ({"prompt": [1, 2, 3]}, "1,2,3,"),  # token ids: "id," each, so [1, 2] is a prefix of [1, 2, 3]
])
def test_canonical_prompt_renders_roles_and_content_deterministically(body: dict, expected: str) -> None:
    assert canonical_prompt(body) == expected
    assert canonical_prompt(dict(body)) == canonical_prompt(body)


def test_key_order_of_tool_calls_does_not_change_the_text() -> None:
    a = {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}
    b = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}", "name": "f"}, "id": "c"}]}]}
    assert canonical_prompt(a) == canonical_prompt(b)


def test_role_is_part_of_the_text() -> None:
    assert canonical_prompt(chat(("user", "hi"))) != canonical_prompt(chat(("assistant", "hi")))


@pytest.mark.parametrize("body", [{}, {"messages": "hi"}, {"messages": [3]}, {"prompt": 3.5}])
def test_malformed_bodies_raise_value_error(body: dict) -> None:
    with pytest.raises(ValueError):
        canonical_prompt(body)


@pytest.mark.parametrize("length,chunk_chars,num_hashes", [
    (0, 4, 0),
    (3, 4, 0),  # shorter than a chunk: no hash, the tail is never hashed
    (4, 4, 1),
    (10, 4, 2),  # "abcd" "efgh", tail "ij" unhashed
    (580, 256, 2),
])
def test_only_full_chunks_are_hashed(length: int, chunk_chars: int, num_hashes: int) -> None:
    assert len(prefix_hashes("x" * length, chunk_chars, None)) == num_hashes


def test_hashes_are_chained_so_a_later_chunk_depends_on_earlier_ones() -> None:
    a = prefix_hashes("AAAABBBB", 4, None)
    b = prefix_hashes("CCCCBBBB", 4, None)
    assert a[1] != b[1]  # the same second chunk under different first chunks


def test_same_text_under_two_adapters_shares_no_hash() -> None:
    text = SYSTEM + "question"
    base, lora_a, lora_b = (set(prefix_hashes(text, 64, adapter)) for adapter in (None, "a", "b"))
    assert not base & lora_a and not lora_a & lora_b and not base & lora_b
    assert chain_root("a") != chain_root(None)


def test_a_later_turn_shares_every_full_chunk_of_the_earlier_turn() -> None:
    turn1 = chat(("system", SYSTEM), ("user", "What is a KV cache?"))
    turn2 = chat(("system", SYSTEM), ("user", "What is a KV cache?"),
                 ("assistant", "It stores attention keys and values. " * 5), ("user", "And paging?"))
    h1 = build_route_request(turn1, "m", None, 64, 0).prefix_hashes
    h2 = build_route_request(turn2, "m", None, 64, 1).prefix_hashes
    assert len(h2) > len(h1) > 0
    assert h2[:len(h1)] == h1


def test_build_route_request_fills_every_field() -> None:
    body = {**chat(("user", "x" * 100)), "max_tokens": 32, "stream": True}
    request = build_route_request(body, "tiny", "sql", 16, 7)
    text_len = len("\x1euser\x1f") + 100  # 107 chars
    assert request.model == "tiny" and request.adapter == "sql"
    assert request.num_prompt_chars == text_len
    assert request.estimated_prompt_tokens == -(-text_len // CHARS_PER_TOKEN) == 27  # ceil(107 / 4)
    assert len(request.prefix_hashes) == 6  # 107 // 16
    assert request.affinity_key == request.prefix_hashes[0]
    assert request.max_tokens == 32 and request.stream and request.request_seq == 7
    assert request.num_sequences == 1
    assert build_route_request({**body, "n": 3}, "tiny", None, 16, 0).num_sequences == 3
    assert build_route_request({**body, "n": 2, "best_of": 5}, "tiny", None, 16, 0).num_sequences == 5


def test_short_prompts_get_distinct_affinity_keys() -> None:
    a = build_route_request({"prompt": "hi"}, "m", None, 256, 0)
    b = build_route_request({"prompt": "yo"}, "m", None, 256, 1)
    assert a.prefix_hashes == b.prefix_hashes == ()
    assert a.affinity_key != b.affinity_key
    assert a.affinity_key == build_route_request({"prompt": "hi"}, "m", None, 256, 9).affinity_key


def test_the_affinity_key_reaches_as_deep_as_asked() -> None:
    shared = "s" * 128  # one 128-char chunk of shared opening, then text of each conversation
    a = build_route_request({"prompt": shared + "a" * 1000}, "m", None, 128, 0, affinity_depth_chars=1024)
    b = build_route_request({"prompt": shared + "b" * 1000}, "m", None, 128, 1, affinity_depth_chars=1024)
    assert a.affinity_key == a.prefix_hashes[7] and a.affinity_key != b.affinity_key  # 1,024 // 128 = 8 chunks
    # Depth 0 (or under a chunk): the first chunk, shared by both.
    a1 = build_route_request({"prompt": shared + "a" * 1000}, "m", None, 128, 0)
    b1 = build_route_request({"prompt": shared + "b" * 1000}, "m", None, 128, 1)
    assert a1.affinity_key == b1.affinity_key == a1.prefix_hashes[0]
    # A prompt shorter than the depth: its last full chunk.
    short = build_route_request({"prompt": shared + "c" * 200}, "m", None, 128, 2, affinity_depth_chars=1024)
    assert short.affinity_key == short.prefix_hashes[-1]


def test_chars_per_token_learns_from_reported_prompt_tokens() -> None:
    from kvgate.router.features import CharsPerToken

    estimate = CharsPerToken(weight=0.1)
    assert estimate.value == 4.0
    estimate.observe(3000, 2000)  # 1.5 chars per token: 4.0 + 0.1 x (1.5 - 4.0) = 3.75
    assert estimate.value == pytest.approx(3.75)
    for _ in range(100):
        estimate.observe(3000, 2000)
    assert estimate.value == pytest.approx(1.5, abs=0.01)
    estimate.observe(10, 0)  # no tokens reported: ignored
    estimate.observe(100_000, 1)  # absurd ratio: clamped to 16, moves it 0.1 x (16 - 1.5) at most
    assert estimate.value == pytest.approx(1.5 + 0.1 * 14.5, abs=0.01)
    assert estimate.num_observed == 102


def test_the_endpoint_says_which_field_is_the_prompt() -> None:
    """A completions body that also carries `messages` is routed on its prompt, as the replica reads it (and
    a chat body on its messages)."""
    body = {"prompt": "the prompt", "messages": [{"role": "user", "content": "other"}]}
    assert canonical_prompt(body, chat=False) == canonical_prompt({"prompt": "the prompt"})
    assert canonical_prompt(body, chat=True) == canonical_prompt({"messages": body["messages"]})
    assert canonical_prompt({"prompt": "p", "messages": 5}, chat=False) == canonical_prompt({"prompt": "p"})
