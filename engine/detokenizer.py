"""Incremental detokenization of one sequence, with stop strings.

Two stages per new token:
1. Decode. A token's text can depend on its left neighbours (SentencePiece drops the space of a
   word-initial token at the start of a decode; a byte-level token may be half of a UTF-8 character),
   so each step decodes a short window: `ids[prefix:read]` (already emitted) and `ids[prefix:]`, and
   the new text is the difference. While the window ends in an incomplete UTF-8 character (the decode
   ends in U+FFFD) nothing is emitted and the window grows until the character completes. This is
   vLLM's `detokenize_incrementally`.
2. Stop strings. The output never contains a stop string nor any part of one: text that could still
   be the start of a stop string is held back until the next tokens prove it is not (it is then
   released) or complete the stop string (the text is cut before it and the sequence stops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Left context for the first decode: enough for SentencePiece's word-boundary handling and for a
# UTF-8 character split over up to 4 byte tokens.
_NUM_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs of kvgate.tokenizer.Tokenizer (fakes implement just this)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time. Not thread-safe; one per sequence.

    `text` is everything emitted so far: the concatenation of add()'s and flush()'s results.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)  # ids before this are already in the emitted text
        self._prefix_offset = 0  # left context for decoding ids[read_offset:]
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet emitted because it may start a stop string
        self._chunks: list[str] = []
        self._closed = False  # flushed, or stopped: no more text comes
        self.stopped = False  # a stop string ended the sequence

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed the next output token. Returns (text newly safe to emit, whether a stop string ended
        the sequence). After a stop or a flush, further tokens are ignored and return ("", stopped)."""
        if self._closed:
            return "", self.stopped
        self._ids.append(token_id)
        new_text = self._decode_new()
        if not new_text:
            return "", False
        emitted, self.stopped = self._filter_stop(self._held + new_text)
        self._closed = self.stopped
        self._chunks.append(emitted)
        return emitted, self.stopped

    def flush(self) -> str:
        """The sequence ended for another reason (EOS, length, abort): release the held-back text.

        Text held for a stop string is released. The bytes of a UTF-8 character that never
        completed are dropped, as vLLM does: the client never sees a U+FFFD for them.
        """
        if self._closed:
            return ""
        pending = self._decode_pending().rstrip(_REPLACEMENT)
        remainder, self._held = self._held + pending, ""
        cut = self._find_stop(remainder)
        if cut >= 0:  # the last complete characters finished a stop string after all
            remainder = remainder[:cut]
        self._closed = True
        self._chunks.append(remainder)
        return remainder

    def _decode_pending(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._decode(self._ids[self._prefix_offset:])[len(prefix_text):]

    def _decode_new(self) -> str:
        new_text = self._decode_pending()
        if not new_text or new_text.endswith(_REPLACEMENT):
            # Nothing yet (a special token that is skipped), or an incomplete UTF-8 character: wait.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Only ids[prefix_offset:] are decoded again: drop the rest so memory stays flat.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _find_stop(self, text: str) -> int:
        """Index of the earliest stop string in `text`, -1 if none."""
        return min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)

    def _filter_stop(self, text: str) -> tuple[str, bool]:
        """Split `text` (held + new) into what can be emitted now and what must wait.

        Worked example, stop ("</s>",): text "ab</" -> emit "ab", hold "</"; then "s>x" arrives:
        text "</s>x" holds the stop at 0 -> emit "" and stop.
        """
        if not self._stop:
            return text, False
        cut = self._find_stop(text)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        hold_from = len(text)
        longest = max(len(s) for s in self._stop)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(s.startswith(tail) for s in self._stop):
                hold_from = start
                break
        self._held = text[hold_from:]
        return text[:hold_from], False
