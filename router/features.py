"""Request features: what the routing policies know about one request.

Two kinds of prefix chain, one per request:
- KV blocks (`hash_tokens` > 0): where the model's replicas are kvgate engines that stream their KV
  block events, the gateway tokenizes the prompt with the engine's own tokenizer (`prompt_tokens`) and
  hashes it with the engine's chain (`kvgate.kv_blocks`), so a look-up in `block_index` is exact.
- TEXT chunks otherwise (foreign servers, or before the tokenizer arrived): the prompt is rendered into
  one canonical string, cut into fixed-size chunks of `chunk_chars` characters and hashed as a chain
  with xxh64, like the engine's block chain but over characters. These hashes only ever index the
  router's own guess of what each replica holds (`prefix_index`).

Chain property: chunk i's hash covers chunks 0..i and the adapter, so equal hashes at position i mean
equal text up to the end of chunk i under the same adapter. A later turn of a conversation renders to
the earlier turn's text plus more, so it shares every full chunk of the earlier turn.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvgate.kv_blocks import hash_blocks

# An estimate, not a tokenizer: English text under BPE tokenizers runs ~4 characters per token
# (code and non-Latin scripts run fewer). Used for sizes and capacities, never for correctness.
CHARS_PER_TOKEN = 4  # the starting guess; each model's estimate is then learnt (CharsPerToken)


class CharsPerToken:
    """A model's prompt characters per token, learnt from the `usage.prompt_tokens` responses report
    against the canonical prompt's length: an exponential average that starts at CHARS_PER_TOKEN.
    English text under a 32k-50k BPE vocabulary runs near 4; a small vocabulary (tiny-llama's) or code
    runs far lower, and the prefix index would otherwise believe a replica holds 2-3x the text it can.
    Each response moves the estimate `weight` of the way; ratios are clamped to [0.5, 16] so one odd
    response (an image part, a huge chat template) cannot throw it far. Worked: at 4.0 with weight 0.1,
    a response of 3,000 chars in 2,000 tokens (1.5) -> 4.0 + 0.1 x (1.5 - 4.0) = 3.75."""

    def __init__(self, initial: float = CHARS_PER_TOKEN, weight: float = 0.1) -> None:
        self.value = float(initial)
        self._weight = weight
        self.num_observed = 0

    def observe(self, prompt_chars: int, prompt_tokens: int) -> None:
        if prompt_chars <= 0 or prompt_tokens <= 0:
            return
        ratio = min(max(prompt_chars / prompt_tokens, 0.5), 16.0)
        self.value += self._weight * (ratio - self.value)
        self.num_observed += 1

# Separators from the ASCII control range, which chat text almost never contains, so a role name
# cannot run into its content: "\x1euser\x1fhi" differs from "\x1euserh\x1fi".
_RECORD = "\x1e"  # starts each message
_UNIT = "\x1f"  # ends the role / header of a message
_GROUP = "\x1d"  # separates named fields inside a message (name, tool calls)
_ROOT_TAG = b"kvgate-router-prefix-v1\x00"


@dataclass(frozen=True)
class RouteRequest:
    """The routing features of one request; built once by the handler, read by every policy."""

    model: str  # the base model's registry name (an adapter resolves to its base)
    adapter: str | None  # LoRA adapter name, None for the base model
    prefix_hashes: tuple[int, ...]  # the chain: KV block hashes (hash_tokens > 0), else text chunk hashes
    affinity_key: int  # rendezvous key: the first chunk's hash, or the whole short prompt's hash
    num_prompt_chars: int  # length of the canonical prompt, in characters
    estimated_prompt_tokens: int  # exact with KV blocks; else ceil(num_prompt_chars / chars_per_token)
    max_tokens: int | None  # completion budget the client asked for, None when it did not say
    stream: bool
    request_seq: int  # a counter the shell assigns per model; round robin cycles on it
    chunk_chars: int = 256  # the cut `prefix_hashes` were made at (the model's routing.prefix_chunk_chars)
    affinity_depth_chunks: int = 1  # how many chunks the affinity key reaches (routing.affinity_depth_chars)
    chars_per_token: float = CHARS_PER_TOKEN  # the gateway's calibrated estimate for this model
    hash_tokens: int = 0  # tokens per hash when prefix_hashes are the engine's KV blocks; 0: text chunks
    # With KV blocks, the text chunk chain as well: the gateway keeps its text index warm with it, for when
    # the model falls back to text (a foreign server joins the fleet). Empty when prefix_hashes are text.
    text_hashes: tuple[int, ...] = ()
    # Leading chunks that nearly every recent request of the model opens with (`openings.CommonOpenings`,
    # set by the shell): held by one replica or by all, they say nothing about where this request's cache is.
    common_opening_chunks: int = 0
    # The sequences it makes a replica decode: max(n, best_of, 1). It counts as that much load in flight there.
    num_sequences: int = 1

    def affinity_key_after(self, skip_chunks: int) -> int:
        """The affinity key of the text after its first `skip_chunks` chunks: the chain hash reaching
        `affinity_depth_chunks` past them (or the last chunk). With skip 0 it is `affinity_key`. A
        policy skips an opening every replica holds, so conversations that share a long system prompt
        still spread by their own first turns."""
        if skip_chunks <= 0 or not self.prefix_hashes:
            return self.affinity_key
        return self.prefix_hashes[min(len(self.prefix_hashes), skip_chunks + max(self.affinity_depth_chunks, 1)) - 1]

    def uncached_tokens(self, match_chunks: int) -> int:
        """Prompt tokens a replica holding `match_chunks` leading chunks (or KV blocks) must still
        prefill. With KV blocks, as the engine serves them: whole blocks, and never the last prompt
        token (block 16: a fully cached 32-token prompt still prefills 16)."""
        if self.hash_tokens:
            servable = max(self.estimated_prompt_tokens - 1, 0) // self.hash_tokens
            return self.estimated_prompt_tokens - min(match_chunks, servable) * self.hash_tokens
        cached_chars = min(match_chunks * self.chunk_chars, self.num_prompt_chars)
        return math.ceil((self.num_prompt_chars - cached_chars) / self.chars_per_token)

    def covers(self, match_chunks: int, skip_chunks: int, fraction: float) -> bool:
        """Whether `match_chunks` (held past the first `skip_chunks`) cover at least `fraction` of the
        prompt after those chunks, in characters (text chunks) or tokens (KV blocks)."""
        unit, total = ((self.hash_tokens, self.estimated_prompt_tokens) if self.hash_tokens
                       else (self.chunk_chars, self.num_prompt_chars))
        return match_chunks * unit >= fraction * max(total - skip_chunks * unit, 0)


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _render_content(content: object) -> str:
    """A message's content: a string as is; a list of parts concatenated in order (text parts by their
    text, any other part, e.g. an image, as canonical JSON); None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        rendered = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                rendered.append(part["text"])
            elif isinstance(part, str):
                rendered.append(part)
            else:
                rendered.append(_canonical_json(part))
        return "".join(rendered)
    return _canonical_json(content)


def _render_message(message: object) -> str:
    """One chat message, rendered so that it depends on this message alone (never on later ones), which
    is what makes a conversation's text grow only at its end from turn to turn."""
    if not isinstance(message, Mapping):
        raise ValueError(f"a chat message must be an object; got {type(message).__name__}")
    text = _RECORD + str(message.get("role", "")) + _UNIT + _render_content(message.get("content"))
    for key in ("name", "tool_call_id", "tool_calls", "function_call"):
        if message.get(key) is not None:
            value = message[key]
            text += _GROUP + key + _UNIT + (value if isinstance(value, str) else _canonical_json(value))
    return text


def _render_prompt(prompt: object) -> str:
    """A completions prompt: a string as is; token ids as "id," each (prefix-stable: [1, 2] renders to
    a prefix of [1, 2, 3]); a batch (list of prompts) as each rendered after a record separator."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "".join(f"{t}," for t in prompt)
    if isinstance(prompt, Sequence):
        return "".join(_RECORD + _render_prompt(p) for p in prompt)
    raise ValueError(f"prompt must be a string, token ids or a list of them; got {type(prompt).__name__}")


def canonical_prompt(body: Mapping[str, object], chat: bool | None = None) -> str:
    """The canonical text of a chat or completions request body, deterministic for equal bodies. `chat`
    says which endpoint it came to (True: `messages`, False: `prompt`, whatever else the body holds, as
    the replica reads it); None: `messages` when present, else `prompt`.

    Chat (`messages`): the tool definitions, if any, as canonical JSON first (chat templates put them in
    the system prompt), then every message as "\\x1e" + role + "\\x1f" + content, with name, tool_call_id
    and tool calls appended as canonical JSON. Completions (`prompt`): see `_render_prompt`.
    Raises ValueError when the body has neither, or they have the wrong shape (the handler validates
    first, so this is a programming error there).
    """
    if "messages" in body and chat is not False:
        messages = body["messages"]
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of message objects")
        head = _RECORD + "tools" + _UNIT + _canonical_json(body["tools"]) if body.get("tools") else ""
        return head + "".join(_render_message(m) for m in messages)
    if "prompt" in body and chat is not True:
        return _render_prompt(body["prompt"])
    if chat is None:
        raise ValueError("the body has neither 'messages' (chat) nor 'prompt' (completions)")
    raise ValueError(f"the body has no {'messages' if chat else 'prompt'!r}")


def chain_root(adapter: str | None) -> int:
    """The chain's root: the adapter is folded in here, so every hash of the chain depends on it."""
    return xxhash.xxh64_intdigest(_ROOT_TAG + (adapter or "").encode())


def _chain_step(parent: int, chunk: str) -> int:
    return xxhash.xxh64_intdigest(struct.pack("<Q", parent) + chunk.encode("utf-8", "surrogatepass"))


def prefix_hashes(text: str, chunk_chars: int, adapter: str | None) -> tuple[int, ...]:
    """The chain of hashes of every FULL chunk of `text`: chunk_chars 4, "abcdefghij" -> 2 hashes
    ("abcd", "efgh"). The tail ("ij") gets no hash: a partial chunk is the part most likely to differ
    between requests (the new user turn) and the engine never caches a partial block either, so hashing
    it would only predict hits that cannot happen. It still counts in `num_prompt_chars`.

    Raises ValueError for chunk_chars < 1."""
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1; got {chunk_chars!r}")
    hashes = []
    parent = chain_root(adapter)
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = _chain_step(parent, text[start:start + chunk_chars])
        hashes.append(parent)
    return tuple(hashes)


def affinity_key(text: str, hashes: tuple[int, ...], adapter: str | None, depth_chunks: int = 1) -> int:
    """Where a request lives when nothing else decides: the chain hash of its first `depth_chunks`
    chunks (fewer when the prompt is shorter), so every prompt that opens with the same text that long
    agrees, and conversations that share only a short system prompt spread; for a prompt shorter than
    one chunk, the hash of all of it (so distinct short prompts spread and a repeated one agrees with
    itself)."""
    if not hashes:
        return _chain_step(chain_root(adapter), text)
    return hashes[min(len(hashes), max(depth_chunks, 1)) - 1]


def _num_sequences(body: Mapping[str, object]) -> int:
    """n (or best_of) of a body that passed the gateway's caps; 1 when neither is given."""
    values = [v for key in ("n", "best_of") if isinstance(v := body.get(key), int) and not isinstance(v, bool)]
    return max([1, *values])


def _max_tokens(body: Mapping[str, object]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def build_route_request(body: Mapping[str, object], model: str, adapter: str | None,
                        chunk_chars: int, request_seq: int,
                        chars_per_token: float = CHARS_PER_TOKEN, affinity_depth_chars: int = 0,
                        token_ids: Sequence[int] | None = None, block_size_tokens: int = 0,
                        chat: bool | None = None) -> RouteRequest:
    """The RouteRequest of a validated chat or completions body. Raises ValueError as
    `canonical_prompt` and `prefix_hashes` do. `affinity_depth_chars` (the registry's
    routing.affinity_depth_chars) sets the affinity key's depth; 0 or less than a chunk: the first chunk.

    With `token_ids` (the prompt as the engine tokenizes it, `prompt_tokens.prompt_token_ids`) and the
    engine's `block_size_tokens`, the chain is the engine's KV block chain and the token count exact;
    the affinity depth is then `affinity_depth_chars` at the model's characters per token, in blocks.
    `chat`: as for `canonical_prompt`."""
    text = canonical_prompt(body, chat)
    if token_ids is not None and block_size_tokens > 0:
        blocks = tuple(hash_blocks(token_ids, block_size_tokens, adapter))
        depth = max(round(affinity_depth_chars / chars_per_token / block_size_tokens), 1)
        return RouteRequest(
            model=model, adapter=adapter, prefix_hashes=blocks,
            affinity_key=affinity_key(text, blocks, adapter, depth), num_prompt_chars=len(text),
            estimated_prompt_tokens=len(token_ids), max_tokens=_max_tokens(body),
            stream=bool(body.get("stream", False)), request_seq=request_seq, chunk_chars=chunk_chars,
            affinity_depth_chunks=depth, chars_per_token=chars_per_token, hash_tokens=block_size_tokens,
            text_hashes=prefix_hashes(text, chunk_chars, adapter), num_sequences=_num_sequences(body))
    hashes = prefix_hashes(text, chunk_chars, adapter)
    return RouteRequest(
        model=model,
        adapter=adapter,
        prefix_hashes=hashes,
        affinity_key=affinity_key(text, hashes, adapter, affinity_depth_chars // chunk_chars),
        num_prompt_chars=len(text),
        estimated_prompt_tokens=math.ceil(len(text) / chars_per_token),
        max_tokens=_max_tokens(body),
        stream=bool(body.get("stream", False)),
        request_seq=request_seq,
        chunk_chars=chunk_chars,
        chars_per_token=chars_per_token,
        affinity_depth_chunks=max(affinity_depth_chars // chunk_chars, 1),
        num_sequences=_num_sequences(body),
    )
