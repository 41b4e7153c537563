"""Reading registry YAML into plain data while remembering where every key came from.

PyYAML's `safe_load` forgets line numbers, and errors without a line are hard to act on in a
directory of many files. So we compose the node graph ourselves and build plain Python values from
it, recording the line of every mapping key and sequence item under its key path. On the way we:
- report duplicate keys (PyYAML silently keeps the last one, which hides typos in reviews);
- expand `${ENV_VAR}` (and `${ENV_VAR:-default}`) in string values, so secrets stay out of git, and
  remember which paths were filled from the environment so `plan` can avoid printing them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kvgate.registry.problems import KeyPath, Problem

# `${NAME}` or `${NAME:-default}`; `$${...}` is a literal `${...}`.
_ENV_REF = re.compile(r"\$(\$?)\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SourceDocument:
    """One YAML document of a registry file, as plain data, with the line of every key path."""

    file: str
    data: Any  # what the document parsed to: normally a dict
    line: int  # the line the document starts on
    lines: Mapping[KeyPath, int] = field(default_factory=dict)
    from_env: frozenset[KeyPath] = frozenset()  # paths whose value came (partly) from ${...}
    problems: tuple[Problem, ...] = ()  # what the reader found inside it: duplicate keys, unset variables

    def line_of(self, path: KeyPath) -> int:
        """The line of `path`, or of its nearest ancestor that has one."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(tuple(path[:end]))
            if line is not None:
                return line
        return self.line


def read_file(path: Path, display_name: str, environ: Mapping[str, str]) -> tuple[list[SourceDocument], list[Problem]]:
    """Parse every document in one YAML file. Never raises for bad content.

    Returns the documents (each with the problems found inside it) and the problems of the file as a
    whole (unreadable, not YAML).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return [], [Problem(display_name, 0, "", (), f"is not UTF-8 text ({exc.reason} at byte {exc.start})")]
    except OSError as exc:
        return [], [Problem(display_name, 0, "", (), f"cannot be read: {exc.strerror}")]

    documents: list[SourceDocument] = []
    problems: list[Problem] = []
    loader = yaml.SafeLoader(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            builder = _Builder(loader, display_name, environ)
            data = builder.build(node, ())
            if data is None:
                continue  # an empty document, e.g. a trailing `---`
            documents.append(
                SourceDocument(
                    file=display_name,
                    data=data,
                    line=node.start_mark.line + 1,
                    lines=builder.lines,
                    from_env=frozenset(builder.from_env),
                    problems=tuple(builder.problems),
                )
            )
    except yaml.MarkedYAMLError as exc:
        line, column, message = describe_yaml_error(exc)
        problems.append(Problem(display_name, line, "", (), f"is not valid YAML: {message}", column))
    except yaml.YAMLError as exc:
        problems.append(Problem(display_name, 0, "", (), f"is not valid YAML: {exc}"))
    finally:
        loader.dispose()
    return documents, problems


# PyYAML's names for tokens, in the words of a person who writes YAML.
_TOKEN_WORDS = (("'<stream end>'", "the end of the file"), ("<block end>", "the end of the block"),
                ("'<block mapping start>'", "a key at a different indentation"),
                ("'<block sequence start>'", "a '- ' item at a different indentation"),
                ("'?'", "a key at a different indentation"), ("'-'", "a '- ' item at a different indentation"))
# Terse scanner problems with one usual cause: the fix to try first.
_HINTS = MappingProxyType({"mapping values are not allowed here": "check the indentation, or quote a value that holds ': '",
          "found character '\\t' that cannot start any token": "YAML indents with spaces, never tabs"})


def describe_yaml_error(exc: yaml.MarkedYAMLError) -> tuple[int, int, str]:
    """(line, column, one-line message) of a YAML syntax error; 1-based, 0 when unknown.

    The position is where PyYAML noticed the error. The construct it was inside (an unclosed `[` or
    quote) is named with its own position, since that is usually what needs the fix:
    "expected ',' or ']', got the end of the file (in the flow sequence that opens at line 3, column 7)".
    """
    mark = exc.problem_mark or exc.context_mark
    line, column = (mark.line + 1, mark.column + 1) if mark else (0, 0)
    expected, found_sep, found = " ".join((exc.problem or "").split()).partition(", but ")
    problem = _words(expected + (", " + found if found_sep else ""))
    problem += f" ({_HINTS[problem]})" if problem in _HINTS else ""
    context, at = " ".join((exc.context or "").split()), exc.context_mark
    if not context or at is None or at is mark or context == "while scanning for the next token":
        return line, column, problem or context or "syntax error"
    where = f"line {at.line + 1}, column {at.column + 1}"
    if context.startswith("while "):  # "while parsing a flow sequence": the construct left open
        construct = context.split(" ", 2)[-1].removeprefix("a ").removeprefix("an ")
        return line, column, f"{problem} (in the {construct} that opens at {where})"
    return line, column, f"{context} at {where}; {problem} here"  # "found duplicate anchor 'x'; first occurrence"


def _words(found: str) -> str:
    """"got '<stream end>'" -> "got the end of the file"."""
    for token, words in _TOKEN_WORDS:
        found = found.replace(token, words)
    return found


class _Builder:
    """Turns one composed YAML node graph into plain data, collecting lines and problems."""

    def __init__(self, loader: yaml.SafeLoader, file: str, environ: Mapping[str, str]) -> None:
        self._loader = loader
        self._file = file
        self._environ = environ
        self.lines: dict[KeyPath, int] = {}
        self.from_env: set[KeyPath] = set()
        self.problems: list[Problem] = []

    def build(self, node: yaml.Node, path: KeyPath) -> Any:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (index,)) for index, item in enumerate(node.value)]
        value = self._loader.construct_object(node, deep=True)
        if isinstance(value, str) and "$" in value:
            value = self._interpolate(value, node, path)
        return value

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[Any, Any]:
        # `<<: *anchor` merge keys: flatten_mapping puts the merged pairs first, so a key written out
        # in this mapping overrides a merged one (YAML's rule). Only a key written out twice is an error.
        explicit = {id(key) for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge"}
        self._loader.flatten_mapping(node)
        result: dict[Any, Any] = {}
        written: set[Any] = set()
        for key_node, value_node in node.value:
            key = self._loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                key = str(key)  # `1: x` or `true: x`; validation reports it as an unknown field
            child = path + (key,)
            line = key_node.start_mark.line + 1
            if id(key_node) in explicit:
                if key in written:
                    first = self.lines.get(child, line)
                    self.problems.append(
                        Problem(self._file, line, "", child, f"duplicate key {key!r} (first set on line {first})")
                    )
                    continue
                written.add(key)
            self.lines[child] = line
            result[key] = self.build(value_node, child)
        return result

    def _interpolate(self, text: str, node: yaml.Node, path: KeyPath) -> str:
        line = node.start_mark.line + 1

        def replace(match: re.Match[str]) -> str:
            if match.group(1):  # `$${X}` is the literal text `${X}`
                return "${" + match.group(2) + "}"
            name, has_default, default = match.group(2).partition(":-")
            if not _ENV_NAME.fullmatch(name):
                self.problems.append(
                    Problem(self._file, line, "", path, f"bad variable reference ${{{match.group(2)}}}: "
                            "write ${NAME} or ${NAME:-default}, NAME of letters, digits and _")
                )
                return match.group(0)
            self.from_env.add(path)
            if name in self._environ:
                return self._environ[name]
            if has_default:
                return default
            self.problems.append(
                Problem(self._file, line, "", path, f"environment variable {name} is not set "
                        f"(referenced as ${{{name}}}; set it, or write ${{{name}:-default}})")
            )
            return match.group(0)

        return _ENV_REF.sub(replace, text)


def environment() -> Mapping[str, str]:
    """The process environment, read once at the edge and passed down (the loader itself never reads it)."""
    return dict(os.environ)
