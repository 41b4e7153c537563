"""A request's prompt tokens exactly as a kvgate engine computes them.

With the engine's own tokenizer (fetched once from a replica, `sources.fetch_tokenizer`) the gateway
computes the block hashes the engine will look up in its prefix cache, and matches them against what
each replica reports holding (`block_index`). This mirrors the engine's request handling
(engine/server/protocol.py and context.py); tests/router/test_prompt_tokens.py checks the two agree on
real engines:

- chat: each message as {role, content}; content a string, null (""), or text parts joined by "\\n";
  rendered with the model's chat template and the generation prompt, encoded without special tokens
  (the template writes its own BOS); tools and other fields do not reach the engine's template;
- completions: a string (or a batch of one string) encoded with special tokens; token ids (or a batch
  of one list of ids) as given.

What the engine would reject (an image part, a batch of several prompts) gives None: the request is
then routed on the text index, and the engine answers the 400 itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.tokenizer import ChatTemplateError, Tokenizer


def _chat_messages(messages: object) -> list[dict[str, str]] | None:
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, Mapping) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                return None
            content = "\n".join(texts)
        elif not isinstance(content, str):
            return None
        out.append({"role": message["role"], "content": content})
    return out


def _is_token_ids(value: object) -> bool:
    """Token ids the block hash can take (u32); the engine refuses ids outside its vocabulary itself."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)


def prompt_token_ids(body: Mapping[str, object], tokenizer: Tokenizer) -> list[int] | None:
    """The prompt token ids the engine will compute for this chat or completions body, or None where
    the engine would refuse it (see the module docstring)."""
    if "messages" in body:
        messages = _chat_messages(body["messages"])
        if messages is None:
            return None
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError:
            return None
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=True)
    if _is_token_ids(prompt):
        return list(prompt)  # type: ignore[arg-type]
    return None
