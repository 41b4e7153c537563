"""A request's prompt tokens exactly as a kvgate engine computes them.

With the engine's own tokenizer (fetched once from a replica, `load_readers.fetch_tokenizer`) the gateway
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

Tokenizing is the gateway's largest cost on this path (~0.4 us a token, and the engine's `tokenizers`
call holds the GIL), so `PromptTokenizer` encodes a rendered chat in pieces: a tokenizer cuts its input at
special tokens first and encodes the text between them on its own, so a system prompt or an earlier turn,
which recur in every request of a conversation or a hot prompt, is encoded once and then looked up.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping

from kvgate.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)

# Encoded pieces kept: a piece is a message's text between special tokens (a system prompt, a turn), cut at
# word starts past WORD_CUT_CHARS; text without word starts (CJK, base64) stays whole, so the characters held
# are bounded too.
MAX_CACHED_PIECES = 4096
MAX_CACHED_CHARS = 8 * 1024 * 1024
# One chat in this many is also encoded whole and compared: a tokenizer whose pieces do not add up to
# the whole (a pre-tokenizer that treats each piece's start as the text's start) turns the cache off.
CHECK_EVERY = 64


class PromptTokenizer:
    """An engine's tokenizer for the gateway: `apply_chat_template` and `encode` as kvgate.tokenizer's,
    but a chat prompt (encoded without special tokens) is encoded piece by piece between its special
    tokens, each piece through an LRU cache. Exact by construction where the tokenizer cuts at special
    tokens first (checked on a sample chat when built, then on one chat in CHECK_EVERY): else whole.
    Safe to call from the event loop and a worker thread at once."""

    def __init__(self, tokenizer: Tokenizer, max_pieces: int = MAX_CACHED_PIECES, check_every: int = CHECK_EVERY) -> None:
        self.tokenizer = tokenizer
        specials = tokenizer.plain_special_tokens()
        self._specials = specials or {}
        self._cut = (re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
                     if specials else None)
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._max_pieces = max_pieces
        self._cached_chars = 0
        self._check_every = check_every
        self._num_encoded = 0
        self._lock = threading.Lock()
        self.word_cuts_on = False
        self.pieces_on = self._cut is not None and self._self_check()
        self.word_cuts_on = self.pieces_on and self._self_check(word_cuts=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or not self.pieces_on:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = self._encode_pieces(text)
        with self._lock:
            check = self._num_encoded % self._check_every == 0  # the first chat, then one in check_every
            self._num_encoded += 1
        if check:
            whole = self.tokenizer.encode(text, add_special_tokens=False)
            if whole != ids:
                log.warning("this tokenizer's pieces do not add up to the whole prompt; encoding whole prompts")
                self.pieces_on = self.word_cuts_on = False
                return whole
        return ids

    def _encode_pieces(self, text: str) -> list[int]:
        assert self._cut is not None
        ids: list[int] = []
        for piece in self._cut.split(text):
            if not piece:
                continue
            special = self._specials.get(piece)
            if special is not None:
                ids.append(special)
                continue
            for part in _word_cuts(piece) if self.word_cuts_on else (piece,):
                ids.extend(self._encode_cached(part))
        return ids

    def _encode_cached(self, piece: str) -> list[int]:
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
        if cached is None:
            cached = self.tokenizer.encode(piece, add_special_tokens=False)
            if len(piece) > MAX_CACHED_CHARS // 16:
                return cached  # too big to keep: encoded, not cached
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = cached
                    self._cached_chars += len(piece)
                while len(self._pieces) > self._max_pieces or self._cached_chars > MAX_CACHED_CHARS:
                    evicted, _ = self._pieces.popitem(last=False)
                    self._cached_chars -= len(evicted)
        return cached

    def _self_check(self, word_cuts: bool = False) -> bool:
        """Whether a sample chat (with a long turn to cut at words when `word_cuts`) encodes in pieces
        exactly as whole. Leaves word_cuts_on at `word_cuts`: the constructor sets its final value."""
        self.word_cuts_on = word_cuts
        long_turn = " ".join(f"Line {i}: the quick brown fox, 12 jumps;  over\tthe lazy dog's den." for i in range(60))
        sample = [{"role": "system", "content": "You are terse.\n  Answer in one line."},
                  {"role": "user", "content": " Hello there,  how are you?"},
                  {"role": "assistant", "content": "Fine.\n"}, {"role": "user", "content": "Ünïcode and tabs\t!"},
                  {"role": "user", "content": long_turn}]
        try:
            text = self.apply_chat_template(sample)
        except ChatTemplateError:
            return False
        try:
            return self._encode_pieces(text) == self.tokenizer.encode(text, add_special_tokens=False)
        finally:
            self._pieces.clear()
            self._cached_chars = 0


# Text between special tokens longer than this is also cut at word starts, about this many characters apart,
# so a long message that grows from request to request (a conversation kept in one user turn, a shared
# document) is encoded once up to its last cut.
WORD_CUT_CHARS = 1024
# A word start: a space after a non-space, before a letter. Byte-level BPE pre-tokenizers (GPT-2's, Llama 3's,
# SmolLM2's, tiny-llama's) start a pre-token there (" word"), and BPE never merges across pre-tokens, so the
# two sides encode apart exactly as within the whole; other tokenizers fail the checks and stay whole.
_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")


def _word_cuts(text: str) -> list[str]:
    """`text` cut at the first word start at or after every WORD_CUT_CHARS characters from the last cut:
    where the cuts fall depends only on the text before them, so two texts that share a long opening
    share their leading parts."""
    parts, start = [], 0
    while len(text) - start > WORD_CUT_CHARS:
        found = _WORD_START.search(text, start + WORD_CUT_CHARS)
        if found is None:
            break
        parts.append(text[start:found.start()])
        start = found.start()
    parts.append(text[start:])
    return parts


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


def prompt_token_ids(body: Mapping[str, object], tokenizer: Tokenizer | PromptTokenizer,
                     chat: bool | None = None) -> list[int] | None:
    """The prompt token ids the engine will compute for this chat (`chat`: /v1/chat/completions) or
    completions body, or None where the engine would refuse it (see the module docstring). Each endpoint
    reads only its own field, as the engine does; `chat` None: a chat when the body has `messages`."""
    if chat is None:
        chat = "messages" in body
    if chat:
        messages = _chat_messages(body.get("messages"))
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
