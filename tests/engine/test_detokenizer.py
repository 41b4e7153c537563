"""Incremental detokenization: multi-byte characters, left context, stop strings, flush."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.tokenizer import Tokenizer
from tests.engine.builtin_cache import tiny_llama_dir


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """tiny-llama's byte-level BPE: 256 byte tokens and a few merges, so 'é' is 2 tokens and '🙂' is 4."""
    return Tokenizer.from_dir(tiny_llama_dir())


def stream(tok: Tokenizer, text: str, stop: tuple[str, ...] = (),
           prompt: str = "Q:") -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `text`'s tokens one by one; the chunk emitted for each, and the detokenizer."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    chunks = []
    for token_id in tok.encode(text, add_special_tokens=False):
        chunk, stopped = detok.add(token_id)
        chunks.append(chunk)
        if stopped:
            break
    return chunks, detok


def test_streamed_text_equals_the_full_decode(tok: Tokenizer) -> None:
    text = "Hello the world, it is raining in Paris. 42!"
    chunks, detok = stream(tok, text)
    assert "".join(chunks) == text == detok.text
    assert detok.flush() == ""


def test_multibyte_characters_never_produce_a_replacement_char(tok: Tokenizer) -> None:
    text = "café 🙂 naïve 日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # really split across tokens
    chunks, detok = stream(tok, text)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    # '🙂' is four byte tokens: three empty chunks, then the whole character at once.
    emoji = tok.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    assert [detok.add(t) for t in emoji] == [("", False)] * 3 + [("🙂", False)]


def test_flush_drops_an_unfinished_character(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    for token_id in tok.encode("ok 🙂", add_special_tokens=False)[:-2]:  # ends two bytes into the emoji
        detok.add(token_id)
    assert detok.text == "ok "
    assert detok.flush() == ""
    assert detok.text == "ok "


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"))
    assert detok.add(tok.token_to_id("<|im_end|>")) == ("", False)
    assert detok.add(tok.encode("a", add_special_tokens=False)[0]) == ("a", False)


def test_left_context_keeps_a_word_initial_space() -> None:
    # A SentencePiece-style decoder drops the space of the first token of a decode: decoding
    # "▁world" alone gives "world". With the prompt as left context the output is " world".
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = Tokenizer(raw)
    assert tok.decode([2]) == "world"
    detok = IncrementalDetokenizer(tok, [1])
    assert detok.add(2) == (" world", False)
    assert detok.add(2) == (" world", False)


def test_a_stop_string_spanning_tokens_is_never_emitted(tok: Tokenizer) -> None:
    chunks, detok = stream(tok, "The answer. STOP and more", stop=("STOP",))
    assert detok.stopped
    assert detok.text == "The answer. "
    assert all(c in "The answer. " for c in chunks)
    assert not any(part in "".join(chunks) for part in ("S", "ST", "STO"))
    assert detok.flush() == ""
    assert detok.add(tok.encode("x", add_special_tokens=False)[0]) == ("", True)  # ignored after a stop


def test_a_partial_match_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), stop=("</end>",))
    emitted = []
    for token_id in tok.encode("a </e", add_special_tokens=False):
        emitted.append(detok.add(token_id)[0])
    assert "".join(emitted) == "a "  # "</e" could still become "</end>"
    text, stopped = detok.add(tok.encode("x", add_special_tokens=False)[0])
    assert (text, stopped) == ("</ex", False)  # proven a false alarm: released at once
    assert detok.text == "a </ex"


def test_flush_releases_held_text(tok: Tokenizer) -> None:
    chunks, detok = stream(tok, "tail </en", stop=("</end>",))
    assert "".join(chunks) == "tail "
    assert detok.flush() == "</en"
    assert detok.text == "tail </en"
    assert not detok.stopped


def test_the_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    _, detok = stream(tok, "one two three", stop=("three", "two"))
    assert detok.stopped and detok.text == "one "


def test_a_stop_at_the_very_start_emits_nothing(tok: Tokenizer) -> None:
    chunks, detok = stream(tok, "STOP", stop=("STOP",))
    assert detok.stopped and detok.text == "" and chunks[-1] == ""


def test_a_stop_string_ending_in_a_multibyte_character(tok: Tokenizer) -> None:
    chunks, detok = stream(tok, "ok 🙂 done", stop=("ok 🙂",))
    assert detok.stopped and detok.text == ""
    assert all("\ufffd" not in c for c in chunks)


def test_text_inside_a_token_before_the_stop_is_kept(tok: Tokenizer) -> None:
    # " the" is one token (merges Ġt + he); the stop "he" ends inside it: " t" is kept.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    _, detok = stream(tok, "in the end", stop=("he",))
    assert detok.text == "in t"
