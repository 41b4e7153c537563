"""A model's tokenizer and chat template, read from a Hugging Face model directory (or its files' contents).

A shared leaf: the engine tokenizes with it, and the gateway builds the same tokenizer from the files an
engine sends (`Replica.GetTokenizer`), so both compute the same KV block hashes for a prompt.

Plain Python over the `tokenizers` library and jinja2 (no torch, no transformers):
- tokenizer.json: the tokenizer itself (required);
- tokenizer_config.json: bos/eos tokens (strings or AddedToken dicts) and the chat template
  (a string, or a list of named templates of which "default" is used);
- chat_template.jinja: the chat template as newer transformers versions save it (wins over the config);
- generation_config.json: eos_token_id, an int or a list (all of them end generation).

As in transformers, the rendered chat prompt is encoded with add_special_tokens=False: a template that
wants a BOS writes `{{ bos_token }}` itself, so it is never doubled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

# A JSON escape of a UTF-16 surrogate, \ud800-\udfff: the first of a pair, or a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

# Used when the model ships no chat template: ChatML, as SmolLM2 and Qwen use.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The files of a model directory that make up its tokenizer (all optional but tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


class TokenizerError(ValueError):
    """The tokenizer files of a model directory are missing or invalid. The message names the file."""


class ChatTemplateError(ValueError):
    """The chat template failed to render these messages (raise_exception() in the template, or a
    template bug). The message is the template's own and is safe to return to a client as a 400."""


@dataclass(frozen=True)
class _SpecialTokens:
    bos: str | None
    eos: str | None
    pad: str | None
    unk: str | None


class Tokenizer:
    """Encode, decode and render chat prompts for one model. Immutable after construction."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._special = _SpecialTokens(bos=bos_token, eos=eos_token, pad=pad_token, unk=unk_token)
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_ids = [tokenizer.token_to_id(eos_token)] if eos_token else []
        eos_ids += list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template: str = chat_template or FALLBACK_CHAT_TEMPLATE
        self.has_own_chat_template: bool = chat_template is not None
        self._template = _compile_template(self.chat_template)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory. Raises TokenizerError naming the bad file."""
        model_dir = Path(model_dir)
        files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
        return cls.from_files(files, str(model_dir))

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], where: str = "") -> Tokenizer:
        """Load from the contents of a model directory's tokenizer files, by file name (any of
        TOKENIZER_FILES; tokenizer.json is required): what `from_dir` reads, or what an engine sent
        over its state protocol so that a gateway tokenizes exactly as it does. `where` names the
        source in errors. Raises TokenizerError naming the bad file."""
        def path(name: str) -> str:
            return f"{where}/{name}" if where else name

        if "tokenizer.json" not in files:
            raise TokenizerError(f"{path('tokenizer.json')}: missing; the model directory needs a tokenizer.json")
        try:
            tokenizer = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise TokenizerError(f"{path('tokenizer.json')}: not a valid tokenizer.json: {exc}") from exc
        config = _read_json(files.get("tokenizer_config.json"), path("tokenizer_config.json"))
        generation = _read_json(files.get("generation_config.json"), path("generation_config.json"))
        if "chat_template.jinja" in files:
            try:
                chat_template = files["chat_template.jinja"].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TokenizerError(f"{path('chat_template.jinja')}: not UTF-8: {exc}") from exc
        else:
            chat_template = _pick_chat_template(config.get("chat_template"), path("tokenizer_config.json"))
        try:
            return cls(
                tokenizer,
                bos_token=_token_content(config.get("bos_token")),
                eos_token=_token_content(config.get("eos_token")),
                pad_token=_token_content(config.get("pad_token")),
                unk_token=_token_content(config.get("unk_token")),
                extra_eos_token_ids=_eos_ids(generation.get("eos_token_id"), path("generation_config.json")),
                chat_template=chat_template,
            )
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"{where or 'tokenizer'}: the chat template does not compile: {exc}") from exc

    @property
    def bos_token(self) -> str | None:
        return self._special.bos

    @property
    def eos_token(self) -> str | None:
        return self._special.eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds (a BOS).
        Through `encode_batch`, which gives the same ids but releases the GIL while it works (`encode`
        holds it), so a caller that tokenizes a long prompt on a worker thread leaves the event loop free."""
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def plain_special_tokens(self) -> dict[str, int] | None:
        """The special added tokens (content -> id), or None when any added token matches other than
        literally (lstrip / rstrip / single_word / normalized, or a non-special added token): then text
        cannot be cut at added tokens by a plain string search the way the tokenizer cuts it."""
        out = {}
        for token_id, token in self._tokenizer.get_added_tokens_decoder().items():
            if token.lstrip or token.rstrip or token.single_word or token.normalized or not token.special:
                return None
            out[token.content] = token_id
        return out

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar library builds its vocabulary from)."""
        return self._tokenizer.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt text; `tools` (OpenAI's
        [{"type": "function", "function": {...}}]) go to the template as transformers passes them.

        Encode the result with add_special_tokens=False. Raises ChatTemplateError when the template
        rejects the messages (for example a role order it does not support).
        """
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special.bos or "",
                eos_token=self._special.eos or "",
                pad_token=self._special.pad or "",
                unk_token=self._special.unk or "",
                **({"tools": [dict(t) for t in tools]} if tools else {}),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc


class NotJsonText(ValueError):
    """A request body that is not JSON text; str() completes "the request body is ..."."""


def loads_json_text(raw: bytes) -> Any:
    """A request body parsed as JSON text: strictly UTF-8 (RFC 8259), so neither a UTF-16 body nor a surrogate
    in the bytes gets through, without NaN, Infinity or a number past a float's range, and nested within the
    parser's reach. The gateway and the engine both read bodies with it. Raises NotJsonText; a lone surrogate
    *escape* is `lone_surrogate_in`'s to find."""
    try:
        return _STRICT_JSON.decode(raw.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, Infinity or 1e999
        raise NotJsonText(f"not valid JSON: {exc}") from exc
    except RecursionError as exc:  # arrays or objects nested past the interpreter's recursion limit
        raise NotJsonText("nested too deeply to parse") from exc


def _not_json_constant(name: str) -> Any:
    """`json.loads` takes NaN, Infinity and -Infinity, which JSON does not have (RFC 8259): a server behind the
    gateway may parse them, choke on them, or sample with a NaN temperature."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one that overflows (1e999) is no more a number than Infinity is."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


# One decoder for every body: json.loads with a keyword builds a new one per call (~1 us). It keeps no state.
_STRICT_JSON = json.JSONDecoder(parse_constant=_not_json_constant, parse_float=_finite_float)


def lone_surrogate_in(raw: bytes, value: Any) -> bool:
    """Whether a JSON request body (`raw`, strictly UTF-8, parsed into `value`) holds a lone UTF-16 surrogate.
    `"\\ud800"` is valid JSON but no text: no tokenizer can encode it, so servers answer it with a 400 before it
    reaches one. (A surrogate encoded in the bytes themselves, or a UTF-16 body, fails the strict UTF-8 decode
    that comes first; only the escape gets this far.)
    A pair (an emoji written as two escapes) parses to one character and passes. Walks `value` only when
    `raw` holds a surrogate escape at all: a 6 KB chat body costs 3.7 us, 11 us with an escaped emoji."""
    if not _SURROGATE_ESCAPE.search(raw):
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)  # keys
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim_blocks/lstrip_blocks, loop controls, raise_exception
    and a tojson that keeps non-ASCII. transformers' strftime_now is left out on purpose: it reads the
    real clock, and the templates that use it (Llama 3.x) check `is defined` and fall back to a date."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _read_json(data: bytes | None, path: str) -> dict[str, Any]:
    """An optional JSON object file's contents: {} when absent, TokenizerError when present but invalid."""
    if data is None:
        return {}
    try:
        data = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: must hold a JSON object; got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _pick_chat_template(value: Any, path: str) -> str | None:
    """A string, or a list of {"name", "template"} of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named and isinstance(named["default"], str):
            return named["default"]
        raise TokenizerError(f"{path}: chat_template lists {sorted(map(str, named))} but no 'default'")
    raise TokenizerError(f"{path}: chat_template must be a string or a list of named templates")


def _eos_ids(value: Any, path: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints; got {value!r}")
    return tuple(values)
