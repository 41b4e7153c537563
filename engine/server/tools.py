"""Tools and structured output on the wire: what a chat request asks for, how a model family writes a tool
call, and reading calls back out of its text. No engine and no I/O (call ids are random, uuid4); refusals are
ApiErrors, rendered at the HTTP edge as protocol.py's are.

Request side: `tools`, `tool_choice` and `response_format` become typed values (ToolSpec, ToolChoice, a
Constraint). A model's chat template renders the tools itself (`tools=` in the template, as transformers
passes them); the template's own text says how its model writes a call (`detect_tool_format`):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   Qwen2/2.5, Hermes, SmolLM3
    llama3_json  {"name": "f", "parameters": {...}}                             Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}]                Mistral

`tool_choice` "required" or a named function is enforced with a grammar (`call_constraint`): the output is
exactly one call in the family's format, its name one of the tools and its arguments valid against that
tool's parameter schema. "auto" leaves the model free and parses whatever calls it wrote
(`ToolCallParser`, which also streams: text that may open a call is held back until it is clear).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.engine.sequence import Constraint, ConstraintKind
from kvgate.engine.structured import COMPACT_JSON
from kvgate.openai_wire import bad_request, json_type

MAX_TOOLS = 128
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolSpec:
    """One function a request offers: {"type": "function", "function": {...}}."""

    name: str
    description: str | None
    parameters: str  # the parameter schema as JSON text (hashable; compiled once per distinct schema)

    def to_template(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


class ChoiceMode(str, enum.Enum):
    NONE = "none"  # no calls: tools (if any) are context only
    AUTO = "auto"  # the model decides; whatever calls it writes are parsed
    REQUIRED = "required"  # exactly one call, to one of the tools, enforced by a grammar
    FUNCTION = "function"  # exactly one call, to the named function


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # mode FUNCTION: the one function to call

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ChoiceMode(self.mode))

    @property
    def forces_call(self) -> bool:
        return self.mode in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION)


@dataclass(frozen=True)
class ToolCall:
    """A call as OpenAI returns it: arguments are JSON text."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_template(self) -> dict[str, Any]:
        try:
            arguments: Any = json.loads(self.arguments)
        except (ValueError, RecursionError):  # not JSON (or nested past the parser's limit): the text as it is
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------- request parsing


def parse_tools(tools: Any, tool_choice: Any) -> tuple[tuple[ToolSpec, ...], ToolChoice]:
    """`tools` and `tool_choice` of a chat body. Raises ApiError 400 naming the field."""
    specs = _tool_specs(tools)
    if tool_choice is None:
        return specs, ToolChoice(ChoiceMode.AUTO if specs else ChoiceMode.NONE)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or a function; got {tool_choice!r}",
                              "tool_choice")
        if tool_choice != "none" and not specs:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return specs, ToolChoice(ChoiceMode(tool_choice))
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise bad_request("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice", code="invalid_type")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice.function.name must be a non-empty string", "tool_choice.function.name")
    if name not in {spec.name for spec in specs}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice.function.name")
    return specs, ToolChoice(ChoiceMode.FUNCTION, name)


def _tool_specs(tools: Any) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of functions; got {json_type(tools)}", "tools", code="invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools holds {len(tools)} functions; at most {MAX_TOOLS} are allowed", "tools")
    specs = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where,
                              code="invalid_type")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'; got {name!r}",
                              f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description",
                              code="invalid_type")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object; got {json_type(parameters)}",
                              f"{where}.function.parameters", code="invalid_type")
        specs.append(ToolSpec(name, description, json.dumps(parameters)))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    return tuple(specs)


def parse_message_tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (as this server returned them)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list; got {json_type(value)}", where, code="invalid_type")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise bad_request(f"{where}[{i}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\" (a string)}}}}", f"{where}[{i}]", code="invalid_type")
        call_id = call.get("id")
        calls.append(ToolCall(call_id if isinstance(call_id, str) else new_call_id(), name, arguments))
    return tuple(calls)


def parse_response_format(value: Any) -> Constraint | None:
    """response_format: {"type": "text"} (None), {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}. Raises ApiError 400."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "object"}))
    if kind != "json_schema":
        raise bad_request("response_format.type must be \"text\", \"json_object\" or \"json_schema\"; "
                          f"got {kind!r}", "response_format.type")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format.json_schema.schema", code="invalid_type")
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


# ------------------------------------------------------------------------------------- model families


class ToolFamily(str, enum.Enum):
    HERMES = "hermes"  # <tool_call>{"name", "arguments"}</tool_call>: Qwen2/2.5, Hermes, SmolLM3
    LLAMA3_JSON = "llama3_json"  # {"name", "parameters"}: Llama 3.1-3.3
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name", "arguments"}]


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a tool call."""

    name: ToolFamily
    arguments_key: str  # "arguments", or Llama 3's "parameters"
    # The tokens that open and close a call when the vocabulary has them as single (added) tokens: a grammar
    # must name those by id (llguidance's <[id]>), as a grammar library never spells them out of pieces.
    opener_token: int | None = None
    closer_token: int | None = None
    # The opener is a special token, which decoding drops by default: the text must keep special tokens.
    tags_special: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", ToolFamily(self.name))


def detect_tool_format(chat_template: str, token_to_id: Callable[[str], int | None],
                       is_special: Callable[[int], bool] = lambda _: False) -> ToolFormat | None:
    """The call format a chat template teaches its model, from the template's text; None when the template
    does not render tools or uses a format kvgate cannot parse. `is_special(id)`: whether decoding drops it."""
    fmt = _template_format(chat_template, token_to_id)
    if fmt is not None and fmt.opener_token is not None and is_special(fmt.opener_token):
        return dataclasses.replace(fmt, tags_special=True)
    return fmt


def _template_format(chat_template: str, token_to_id: Callable[[str], int | None]) -> ToolFormat | None:
    if not re.search(r"\btools\b", chat_template):
        return None
    if "<tool_call>" in chat_template:
        return ToolFormat(ToolFamily.HERMES, "arguments", token_to_id(_HERMES_OPEN), token_to_id(_HERMES_CLOSE))
    if "[TOOL_CALLS]" in chat_template:
        return ToolFormat(ToolFamily.MISTRAL, "arguments", token_to_id("[TOOL_CALLS]"))
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return ToolFormat(ToolFamily.LLAMA3_JSON, "parameters")
    return None


def call_constraint(fmt: ToolFormat, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> Constraint:
    """The grammar of exactly one call in `fmt`, to one of `tools` (or the named one), arguments valid.
    Raises ApiError 400 for parameter schemas nested past what can be read."""
    offered = [t for t in tools if choice.mode is not ChoiceMode.FUNCTION or t.name == choice.name]
    definitions: dict[str, Any] = {}
    options = []
    try:
        for i, tool in enumerate(offered):
            name = f"tool{i}"
            parameters, own = _hoist_definitions(json.loads(tool.parameters), name)
            definitions.update(own)
            definitions[name] = parameters
            options.append({"type": "object", "additionalProperties": False, "required": ["name", fmt.arguments_key],
                            "properties": {"name": {"const": tool.name},
                                           fmt.arguments_key: {"$ref": f"#/$defs/{name}"}}})
    except RecursionError:
        raise bad_request("a tool's parameters are nested too deeply to enforce", "tools") from None
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "$defs": definitions, "x-guidance": dict(COMPACT_JSON)}  # as response_format JSON
    call = f"%json {json.dumps(schema)}"
    if fmt.name is ToolFamily.HERMES:
        body = f'{_literal(fmt.opener_token, _HERMES_OPEN)} "\\n" call "\\n" {_literal(fmt.closer_token, _HERMES_CLOSE)}'
    elif fmt.name is ToolFamily.MISTRAL:
        body = f'{_literal(fmt.opener_token, "[TOOL_CALLS]")} "[" call "]"'
    else:
        body = "call"
    return Constraint(ConstraintKind.LARK, f"start: {body}\ncall: {call}\n")


def _hoist_definitions(schema: Any, name: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameter schema made to live at #/$defs/<name> of a larger schema: its own $defs (or
    definitions) move beside it as <name>__<def>, and every local $ref is rewritten to match ("#" is the
    schema itself, "#/$defs/Loc" its Loc, "#/properties/a" a part of it). pydantic writes nested models so."""
    own: dict[str, Any] = {}
    if isinstance(schema, dict):
        schema = dict(schema)
        for key in ("$defs", "definitions"):
            moved = schema.pop(key, None)
            if isinstance(moved, dict):
                own.update({f"{name}__{k}": v for k, v in moved.items()})

    def rewrite(ref: str) -> str:
        for key in ("#/$defs/", "#/definitions/"):
            if ref.startswith(key):
                return f"#/$defs/{name}__{ref[len(key):]}"
        if ref == "#" or ref.startswith("#/"):
            return f"#/$defs/{name}{ref[1:]}"
        return ref  # not local: llguidance refuses it, naming it

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: rewrite(v) if k == "$ref" and isinstance(v, str) else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema), {k: walk(v) for k, v in own.items()}


def _literal(token_id: int | None, text: str) -> str:
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


# ------------------------------------------------------------------------------------- reading calls


class ToolCallParser:
    """Splits one choice's output into content and tool calls, as it streams.

    `feed(text)` returns the content that can be sent now; text that may be (the start of) a call is held.
    `finish()` returns the held text that turned out to be content, and the calls. A call that does not
    parse stays content: the client sees what the model wrote."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""
        self._in_calls = False  # a call has begun: everything from here is held until the end
        self._sent_content = False

    def feed(self, text: str) -> str:
        if self._in_calls:
            self._held += text
            return ""
        pending = self._held + text
        if self.fmt.name is ToolFamily.HERMES:
            start = pending.find(_HERMES_OPEN)
            if start >= 0:
                self._in_calls = True
                self._held = pending[start:]
                return self._send(pending[:start])
            keep = _partial_suffix(pending, _HERMES_OPEN)
            self._held = pending[len(pending) - keep:] if keep else ""
            return self._send(pending[:len(pending) - keep])
        # llama3_json, mistral: a call is the whole output, opening with { or [
        stripped = pending.lstrip()
        if not self._sent_content and (not stripped or stripped[0] in "{["):
            self._in_calls = bool(stripped)
            self._held = pending
            return ""
        self._held = ""
        return self._send(pending)

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        calls = (_hermes_calls(held) if self.fmt.name is ToolFamily.HERMES
                 else _json_calls(held, self.fmt.arguments_key))
        if calls is None:
            return held, []
        content, found = calls
        return content, found

    def _send(self, text: str) -> str:
        if text:
            self._sent_content = True
        return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (so may become it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _hermes_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    calls: list[ToolCall] = []
    content: list[str] = []
    position = 0
    while True:
        start = text.find(_HERMES_OPEN, position)
        if start < 0:
            content.append(text[position:])
            break
        content.append(text[position:start])
        end = text.find(_HERMES_CLOSE, start)
        body = text[start + len(_HERMES_OPEN):end if end >= 0 else len(text)]
        call = _one_call(body.strip(), "arguments")
        if call is None:
            return None
        calls.append(call)
        if end < 0:
            break
        position = end + len(_HERMES_CLOSE)
    return "".join(content).strip(), calls


def _json_calls(text: str, arguments_key: str) -> tuple[str, list[ToolCall]] | None:
    text = text.strip()
    if text.startswith("[TOOL_CALLS]"):
        text = text[len("[TOOL_CALLS]"):].lstrip()
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        # Llama 3 may separate several calls with semicolons
        parts = [p for p in text.split(";") if p.strip()]
        try:
            value = [json.loads(p) for p in parts]
        except (ValueError, RecursionError):
            return None
    objects = value if isinstance(value, list) else [value]
    calls = [_call_from(obj, arguments_key) for obj in objects]
    if not calls or any(c is None for c in calls):
        return None
    return "", [c for c in calls if c is not None]


def _one_call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        return _call_from(json.loads(text), arguments_key)
    except (ValueError, RecursionError):  # what the model wrote is not a call: it stays content
        return None


def _call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], text)
