"""The tokenizer: loading a Hugging Face directory's files in their several shapes, and chat templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgate.tokenizer import FALLBACK_CHAT_TEMPLATE, ChatTemplateError, Tokenizer, TokenizerError, lone_surrogate_in
from tests.engine.builtin_cache import tiny_llama_dir

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_llama_dir()


@pytest.fixture
def model_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of tiny-llama's tokenizer files, for tests that change them."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    return tmp_path


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_encode_adds_bos_only_with_special_tokens(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    plain = tok.encode("hello the world", add_special_tokens=False)
    assert tok.encode("hello the world") == [tok.bos_token_id, *plain]
    assert tok.decode(plain) == "hello the world"


def test_decode_skips_special_tokens_unless_asked(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_special_ids_and_vocab_size(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    # tokenizer_config's eos (<|im_end|>) first, then generation_config's list (<|endoftext|>, <|im_end|>)
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert tok.vocab_size == 256 + 30 + 4


def test_the_models_chat_template_renders_with_bos(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.has_own_chat_template
    assert tok.apply_chat_template(USER_HI) == (
        "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(USER_HI, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_a_chat_prompt_encoded_without_special_tokens_has_one_bos(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode(tok.apply_chat_template(USER_HI), add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_special_tokens_as_added_token_dicts(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json",
              bos_token={"content": "<|begin_of_text|>", "lstrip": False, "special": True},
              eos_token={"__type": "AddedToken", "content": "<|endoftext|>"})
    (model_dir / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(model_dir)
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token_ids == (tok.token_to_id("<|endoftext|>"),)


def test_generation_config_eos_as_a_single_int(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", eos_token=None)
    edit_json(model_dir / "generation_config.json", eos_token_id=7)
    assert Tokenizer.from_dir(model_dir).eos_token_ids == (7,)


def test_a_list_of_named_templates_uses_default(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"},
    ])
    assert Tokenizer.from_dir(model_dir).apply_chat_template(USER_HI) == "[user]hi"


def test_a_list_without_default_is_an_error_naming_the_file(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*'default'"):
        Tokenizer.from_dir(model_dir)


def test_chat_template_jinja_file_wins_over_the_config(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert Tokenizer.from_dir(model_dir).apply_chat_template(USER_HI) == "HI"


def test_without_a_template_the_chatml_fallback_is_used(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_dir(model_dir)
    assert not tok.has_own_chat_template and tok.chat_template == FALLBACK_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, *USER_HI]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_templates_render_like_transformers(model_dir: Path) -> None:
    # trim_blocks and lstrip_blocks drop the newlines and indentation around block tags; loop controls work;
    # tojson keeps non-ASCII.
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
        "{{ m['content'] | tojson }}\n"
        "{% endfor %}"
    )
    edit_json(model_dir / "tokenizer_config.json", chat_template=template)
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "café"}]
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == '"café"\n'


def test_raise_exception_becomes_a_chat_template_error(model_dir: Path) -> None:
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversations must start with user') }}{% endif %}")
    edit_json(model_dir / "tokenizer_config.json", chat_template=template)
    tok = Tokenizer.from_dir(model_dir)
    with pytest.raises(ChatTemplateError, match="Conversations must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_the_template_sandbox_blocks_python_internals(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(model_dir).apply_chat_template(USER_HI)


def test_the_template_cannot_mutate_the_messages(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(model_dir).apply_chat_template(USER_HI)


def test_a_template_that_does_not_compile_is_an_error(model_dir: Path) -> None:
    edit_json(model_dir / "tokenizer_config.json", chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        Tokenizer.from_dir(model_dir)


def test_a_missing_tokenizer_json_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=f"{tmp_path / 'tokenizer.json'}: missing"):
        Tokenizer.from_dir(tmp_path)


def test_an_invalid_tokenizer_json_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json: not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_invalid_json_in_the_config_names_the_file(model_dir: Path) -> None:
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(model_dir)


def test_a_bad_eos_token_id_names_the_file(model_dir: Path) -> None:
    edit_json(model_dir / "generation_config.json", eos_token_id="</s>")
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_dir(model_dir)


def test_the_tokenizer_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvgate.tokenizer, engine.detokenizer, engine.builtin; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("raw,lone", [
    (b'{"content": "plain text"}', False),
    (b'{"content": "\\ud83d\\ude00"}', False),  # a pair: one emoji
    (b'{"content": "\\ud83d"}', True),  # a high surrogate alone
    (b'{"content": "x\\uDC00y"}', True),  # a low one alone, upper-case hex
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', True),  # nested
    (b'{"\\ud800": 1}', True),  # in a key
    (b'{"content": "\\\\ud800"}', False),  # an escaped backslash then "ud800": text, no surrogate
])
def test_a_lone_surrogate_anywhere_in_a_body_is_found_and_a_pair_is_text(raw: bytes, lone: bool) -> None:
    value = json.loads(raw)
    assert lone_surrogate_in(raw, value) is lone
    if not lone:
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # what a tokenizer needs: it encodes

