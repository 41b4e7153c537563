"""The gateway's prompt tokenizer: the engine's tokens, encoded piece by piece between special tokens."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kvgate.tokenizer import Tokenizer
from loadtests import workloads
from kvgate.router.prompt_tokens import PromptTokenizer, prompt_token_ids
from tests.engine.builtin_cache import smollm2_dir, tiny_llama_dir


class CountingTokenizer:
    """A kvgate Tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chars_encoded = 0

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars_encoded += len(text)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("model_dir", [tiny_llama_dir, smollm2_dir], ids=["tiny-llama", "smollm2"])
def test_pieces_give_the_engines_tokens_and_encode_a_repeated_system_prompt_once(model_dir) -> None:
    tokenizer = Tokenizer.from_dir(model_dir())
    counted = CountingTokenizer(tokenizer)
    pieces = PromptTokenizer(counted, check_every=1)  # also compares every chat with its whole encoding
    assert pieces.pieces_on
    reqs = workloads.hot_prefix("m", 1, 2.0) + workloads.mooncake("m", 50, 8.0)
    for r in reqs:
        body = r.body()
        assert prompt_token_ids(body, pieces) == prompt_token_ids(body, tokenizer)
    assert pieces.pieces_on  # no chat disagreed
    # Encoded characters: each chat whole (the check), plus its pieces not seen before: the hot system
    # prompt (55 of 100 requests) and the conversations' earlier turns only once.
    whole = sum(len(tokenizer.apply_chat_template(list(r.messages))) for r in reqs)
    assert counted.chars_encoded - whole < 0.6 * whole
    checked = PromptTokenizer(CountingTokenizer(tokenizer), check_every=10**9)
    for r in reqs[:100]:
        prompt_token_ids(r.body(), checked)
    hot = sum(len(tokenizer.apply_chat_template(list(r.messages))) for r in reqs[:100])
    assert checked.tokenizer.chars_encoded < 0.35 * hot  # the first chat is checked whole, then pieces only
    completion = {"prompt": "Hello there"}  # with special tokens (a BOS): whole, as the engine does
    assert prompt_token_ids(completion, pieces) == tokenizer.encode("Hello there", add_special_tokens=True)


def test_a_tokenizer_whose_pieces_do_not_add_up_encodes_whole_prompts() -> None:
    """A pre-tokenizer that marks the start of its input (Metaspace prepending to the first piece only)
    tokenizes a piece cut out of the middle differently: the check at build time turns the pieces off."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for word in ("▁", "a", "b", "▁a", "▁b", "user", "▁user", "system", "▁system", "\n", "▁\n"):
        vocab.setdefault(word, len(vocab))
    hf = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Metaspace()
    hf.add_special_tokens(["<s>", "</s>"])
    template = "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    tokenizer = Tokenizer(hf, bos_token="<s>", eos_token="</s>", chat_template=template)
    pieces = PromptTokenizer(tokenizer)
    assert not pieces.pieces_on
    body = {"messages": [{"role": "user", "content": "a b"}]}
    assert prompt_token_ids(body, pieces) == prompt_token_ids(body, tokenizer)


@pytest.mark.parametrize("model_dir", [tiny_llama_dir, smollm2_dir], ids=["tiny-llama", "smollm2"])
def test_a_long_message_that_grows_is_encoded_once_up_to_its_last_word_cut(model_dir) -> None:
    """A conversation kept in one user turn (the Mooncake trace's shape) or a shared document: the text
    is also cut at word starts every ~1,024 characters, so the next request encodes only what follows the
    last cut it shares, and the tokens still equal the whole prompt's."""
    tokenizer = Tokenizer.from_dir(model_dir())
    counted = CountingTokenizer(tokenizer)
    pieces = PromptTokenizer(counted, check_every=10**9)
    history = " ".join(f"Turn {i}: the user asked about caches, and the model said {i * 7} things." for i in range(80))
    for extra in ("", " And one more question?"):
        body = {"messages": [{"role": "user", "content": history + extra}]}
        before = counted.chars_encoded
        assert prompt_token_ids(body, pieces) == prompt_token_ids(body, tokenizer)
        encoded = counted.chars_encoded - before
    assert len(history) > 5_000 and encoded < 1_200  # the second request: its last part only


def test_a_live_mismatch_turns_the_pieces_off_and_answers_with_the_whole_prompts_tokens() -> None:
    """The build-time check passed, then pieces stop adding up (here: a tokenizer that, once armed, adds a
    token to any text without a special token): the next checked chat says so, and from then on prompts
    are encoded whole."""
    tokenizer = Tokenizer.from_dir(smollm2_dir())

    class Drifting(CountingTokenizer):
        armed = False

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = super().encode(text, add_special_tokens)
            return ids + [0] if self.armed and "<|im_start|>" not in text else ids

    drifting = Drifting(tokenizer)
    pieces = PromptTokenizer(drifting, check_every=2)
    assert pieces.pieces_on
    drifting.armed = True
    body = {"messages": [{"role": "user", "content": "Hello there"}]}
    assert prompt_token_ids(body, pieces) == prompt_token_ids(body, tokenizer)  # the first chat is checked
    assert not pieces.pieces_on and not pieces.word_cuts_on
    assert prompt_token_ids(body, pieces) == prompt_token_ids(body, tokenizer)


def test_each_endpoint_reads_only_its_own_prompt_field() -> None:
    tokenizer = Tokenizer.from_dir(smollm2_dir())
    both = {"prompt": "plain text", "messages": [{"role": "user", "content": "a chat"}]}
    assert prompt_token_ids(both, tokenizer, chat=False) == tokenizer.encode("plain text", add_special_tokens=True)
    assert prompt_token_ids({"prompt": "x", "messages": 5}, tokenizer, chat=False) is not None
    assert prompt_token_ids({"messages": 5}, tokenizer, chat=True) is None
