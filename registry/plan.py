"""`plan`: what changes between two registries, document by document and field by field.

Reviewers of a registry pull request want to see meaning, not YAML: a default written out, a key
moved to another file or a comment changed is no change at all, while a default that the new file
overrides is. So the diff compares effective values (defaults filled in) of documents matched by
kind and name. Values filled from `${ENV_VAR}` are secrets and are shown only as "(sensitive)".
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from kvgate.registry.problems import KeyPath, format_path
from kvgate.registry.snapshot import Snapshot

SENSITIVE = "(sensitive)"


class Action(str, enum.Enum):
    ADD = "add"
    CHANGE = "change"
    REMOVE = "remove"


@dataclass(frozen=True)
class FieldChange:
    path: KeyPath  # inside the document, e.g. ("spec", "scaling", "max_replicas")
    old: Any  # JSON value; None with `added`
    new: Any  # JSON value; None with `removed`
    added: bool = False  # the path exists only in the new document
    removed: bool = False  # the path exists only in the old document
    sensitive: bool = False  # filled from ${ENV_VAR}: never print the values


@dataclass(frozen=True)
class DocumentChange:
    action: Action
    kind: str
    name: str
    fields: tuple[FieldChange, ...]  # for ADD: the fields the author set; for REMOVE: empty


@dataclass(frozen=True)
class Plan:
    old_source: str
    new_source: str
    old_version: str
    new_version: str
    changes: tuple[DocumentChange, ...]

    def count(self, action: Action) -> int:
        return sum(1 for change in self.changes if change.action is action)

    @property
    def has_changes(self) -> bool:
        return bool(self.changes)


def plan(old: Snapshot, new: Snapshot) -> Plan:
    """The changes that take `old` to `new`, ordered by kind (Model, Adapter, Pool, Tenant) and name."""
    old_docs = {(d.kind, d.metadata.name): d for d in old.documents()}
    new_docs = {(d.kind, d.metadata.name): d for d in new.documents()}
    order = {"Model": 0, "Adapter": 1, "Pool": 2, "Tenant": 3}
    changes = []
    for key in sorted(old_docs.keys() | new_docs.keys(), key=lambda k: (order[k[0]], k[1])):
        kind, name = key
        before, after = old_docs.get(key), new_docs.get(key)
        if before is None:
            secret = {p for k, n, p in new.sensitive if (k, n) == key}
            set_fields = _flatten(after.model_dump(mode="json", exclude_unset=True))
            fields = tuple(FieldChange(p, None, v, added=True, sensitive=_under(p, secret))
                           for p, v in set_fields.items() if p[:1] not in (("apiVersion",), ("kind",)))
            changes.append(DocumentChange(Action.ADD, kind, name, fields))
        elif after is None:
            changes.append(DocumentChange(Action.REMOVE, kind, name, ()))
        else:
            secret = {p for k, n, p in old.sensitive | new.sensitive if (k, n) == key}
            fields = _diff(before.model_dump(mode="json"), after.model_dump(mode="json"), secret)
            if fields:
                changes.append(DocumentChange(Action.CHANGE, kind, name, fields))
    return Plan(old.source, new.source, old.version, new.version, tuple(changes))


def _flatten(value: Any, path: KeyPath = ()) -> dict[KeyPath, Any]:
    """Nested dicts and lists of dicts become leaf paths; lists of scalars stay whole values."""
    if isinstance(value, dict) and value:
        out: dict[KeyPath, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, path + (key,)))
        return out
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, path + (index,)))
        return out
    return {path: value}


def _under(path: KeyPath, prefixes: set[KeyPath]) -> bool:
    return any(path[: len(prefix)] == prefix for prefix in prefixes)


def _diff(old: dict[str, Any], new: dict[str, Any], secret: set[KeyPath]) -> tuple[FieldChange, ...]:
    before, after = _flatten(old), _flatten(new)
    changes = []
    for path in sorted(before.keys() | after.keys(), key=lambda p: [str(part) for part in p]):
        sensitive = _under(path, secret)
        if path not in after:
            changes.append(FieldChange(path, before[path], None, removed=True, sensitive=sensitive))
        elif path not in before:
            changes.append(FieldChange(path, None, after[path], added=True, sensitive=sensitive))
        elif before[path] != after[path]:
            changes.append(FieldChange(path, before[path], after[path], sensitive=sensitive))
    return tuple(changes)


# ----------------------------------------------------------------------------------------- rendering

_COLORS = {"+": "\033[32m", "-": "\033[31m", "~": "\033[33m"}
_RESET = "\033[0m"
_SIGN = {Action.ADD: "+", Action.CHANGE: "~", Action.REMOVE: "-"}


def _value(value: Any, sensitive: bool) -> str:
    return SENSITIVE if sensitive else json.dumps(value)


def render(result: Plan, color: bool = False) -> str:
    """A terraform-style text plan for people."""

    def paint(sign: str, text: str) -> str:
        return f"{_COLORS[sign]}{text}{_RESET}" if color else text

    lines = [f"Registry plan: {result.old_source} ({result.old_version}) -> {result.new_source} ({result.new_version})",
             ""]
    if not result.has_changes:
        lines.append("No changes: both registries mean the same thing.")
        return "\n".join(lines)
    for change in result.changes:
        sign = _SIGN[change.action]
        lines.append(paint(sign, f"  {sign} {change.kind}/{change.name}"))
        for field in change.fields:
            where = format_path(field.path)
            if field.added:
                lines.append(paint("+", f"      + {where} = {_value(field.new, field.sensitive)}"))
            elif field.removed:
                lines.append(paint("-", f"      - {where} (was {_value(field.old, field.sensitive)})"))
            elif field.sensitive:
                lines.append(paint("~", f"      ~ {where}: {SENSITIVE} changed"))
            else:
                lines.append(paint("~", f"      ~ {where}: {json.dumps(field.old)} -> {json.dumps(field.new)}"))
    lines += ["", f"Plan: {result.count(Action.ADD)} to add, {result.count(Action.CHANGE)} to change, "
                  f"{result.count(Action.REMOVE)} to remove."]
    return "\n".join(lines)


def to_json(result: Plan) -> dict[str, Any]:
    """The plan as JSON-able data for CI bots; sensitive values are replaced by "(sensitive)"."""

    def shown(value: Any, sensitive: bool) -> Any:
        return SENSITIVE if sensitive and value is not None else value

    return {
        "old": {"source": result.old_source, "version": result.old_version},
        "new": {"source": result.new_source, "version": result.new_version},
        "summary": {action.value: result.count(action) for action in Action},
        "changes": [
            {
                "action": change.action.value,
                "kind": change.kind,
                "name": change.name,
                "fields": [
                    {"path": format_path(f.path), "old": shown(f.old, f.sensitive), "new": shown(f.new, f.sensitive),
                     "added": f.added, "removed": f.removed, "sensitive": f.sensitive}
                    for f in change.fields
                ],
            }
            for change in result.changes
        ],
    }
