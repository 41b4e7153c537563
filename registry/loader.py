"""Loading a registry directory into a validated `Snapshot`, or into a list of every problem.

The order of work: read every `*.yaml` / `*.yml` file under the directory (hidden ones skipped),
validate each document on its own (schema), then check the documents against each other
(`registry.checks`: duplicate names over every document, valid or not; the rest over the valid ones).
Problems from all three stages are collected, so one run reports everything; only a registry with no
problems becomes a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvgate.registry import checks
from kvgate.registry.problems import KeyPath, Problem, RegistryInvalid
from kvgate.registry.schema import DOCUMENT_CLASSES, KINDS, FieldProblem
from kvgate.registry.snapshot import LoadedDocument, Snapshot
from kvgate.registry.yamlsource import SourceDocument, environment, read_file

YAML_SUFFIXES = (".yaml", ".yml")


def load_registry(source: str | Path, environ: Mapping[str, str] | None = None) -> Snapshot:
    """Load and validate a registry directory (or one file).

    `environ` fills `${VAR}` references; it defaults to the process environment.
    Raises `RegistryInvalid` listing every problem when anything is wrong.
    """
    documents, problems, invalid = load_documents(source, environment() if environ is None else environ)
    # Documents that failed the schema still declare a name; references to them are not reported
    # again as dangling, so one mistake yields one message.
    problems += checks.cross_check(documents, declared_elsewhere=invalid)
    if problems:
        raise RegistryInvalid(str(source), problems)
    return Snapshot.build(str(source), documents)


def registry_files(root: Path) -> list[Path]:
    """The YAML files of a registry, in a stable order; hidden files and directories are skipped."""
    if root.is_file():
        return [root]
    files = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix in YAML_SUFFIXES and path.is_file():
            files.append(path)
    return sorted(files)


def load_documents(source: str | Path, environ: Mapping[str, str]
                   ) -> tuple[list[LoadedDocument], list[Problem], frozenset[tuple[str, str]]]:
    """Parse and schema-validate every document, and find duplicate names. Returns the good documents,
    every problem found, and the (kind, name) that invalid documents declare."""
    root = Path(source)
    if not root.exists():
        return [], [Problem(str(source), 0, "", (), "does not exist")], frozenset()
    files = registry_files(root)
    if not files:
        return [], [Problem(str(source), 0, "", (), "holds no registry files (*.yaml or *.yml)")], frozenset()

    loaded: list[LoadedDocument] = []
    problems: list[Problem] = []
    invalid: set[tuple[str, str]] = set()
    declared: list[tuple[str, str, SourceDocument]] = []
    for path in files:
        display = str(path) if root.is_file() else str(Path(source) / path.relative_to(root))
        sources, file_problems = read_file(path, display, environ)
        problems += file_problems
        for src in sources:
            document, doc_problems = _validate(src)
            problems += doc_problems
            kind_name = _declared(src.data)
            if kind_name is not None and kind_name[0] in DOCUMENT_CLASSES:
                declared.append((*kind_name, src))
            if document is not None:
                loaded.append(document)
            elif kind_name is not None:
                invalid.add(kind_name)
    return loaded, problems + checks.duplicate_names(declared), frozenset(invalid)


def _declared(data: Any) -> tuple[str, str] | None:
    """The (kind, name) a document claims, valid or not; None when it names neither as strings."""
    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
        return None
    kind, name = data.get("kind"), data["metadata"].get("name")
    return (kind, name) if isinstance(kind, str) and isinstance(name, str) else None


def _validate(src: SourceDocument) -> tuple[LoadedDocument | None, list[Problem]]:
    data = src.data
    if not isinstance(data, dict):
        got = type(data).__name__
        return None, [Problem(src.file, src.line, "", (), f"a document must be a mapping with apiVersion, kind, "
                                                          f"metadata and spec; got a {got}")]
    kind = data.get("kind")
    name = data.get("metadata", {}).get("name") if isinstance(data.get("metadata"), dict) else None
    label = f"{kind}/{name if isinstance(name, str) else '?'}"
    # Problems the YAML reader found (duplicate keys, unset variables) belong to this document.
    early = [Problem(p.file, p.line, label, p.path, p.message) for p in src.problems]

    if kind not in DOCUMENT_CLASSES:
        allowed = ", ".join(KINDS)
        message = "is missing; allowed kinds: " + allowed if kind is None else f"unknown kind {kind!r}; allowed: {allowed}"
        return None, early + [Problem(src.file, src.line_of(("kind",)), label, ("kind",), message)]

    cls = DOCUMENT_CLASSES[kind]
    try:
        document = cls.model_validate(data)
    except ValidationError as exc:
        found = [_problem_from_error(src, label, cls, error) for error in _causes(exc.errors())]
        # A value left as `${UNSET}` fails the schema too; the unset variable is the problem to show.
        reported = {p.path for p in early}
        return None, early + [p for p in found if p.path not in reported]
    if early:
        return None, early
    return LoadedDocument(document=document, origin=src), []


def _causes(errors: list[Any]) -> list[Any]:
    """Drop the errors that only follow from others: a list whose one item is invalid is also "too short
    after validation" (pydantic), which would send a person looking for a missing item."""
    def inner(error: Any) -> bool:
        loc = tuple(error["loc"])
        return any(len(other["loc"]) > len(loc) and tuple(other["loc"][:len(loc)]) == loc for other in errors)

    return [error for error in errors if not (error["type"] == "too_short" and inner(error))]


def _problem_from_error(src: SourceDocument, label: str, cls: type[BaseModel], error: Any) -> Problem:
    path = _data_path(src.data, error["loc"])
    error_type = error["type"]
    context = error.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, FieldProblem):
        path = path + cause.path
        message = str(cause)
    elif error_type == "extra_forbidden":
        allowed = _allowed_fields(cls, path[:-1])
        message = f"unknown field {path[-1]!r}" + (f"; allowed fields: {', '.join(allowed)}" if allowed else "")
    elif error_type == "missing":
        message = "is required but missing"
    else:
        message = error["msg"].removeprefix("Value error, ")
        if error_type != "value_error":
            message += f"; got {_show(error.get('input'))}"
    # A missing key has no line of its own: point at its parent mapping.
    return Problem(src.file, src.line_of(path), label, path, message)


def _data_path(data: Any, loc: Iterable[Any]) -> KeyPath:
    """Keep the parts of pydantic's error location that exist in the data (drops union tags etc.)."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(part, (str, int)) and not isinstance(node, (dict, list)):
            break  # a type tag under a scalar, e.g. ("source", "str")
        elif isinstance(node, dict) and isinstance(part, str) and not part.startswith(("function-", "json-")):
            path.append(part)  # a missing key: keep its name
            break
        else:
            break
    return tuple(path)


def _allowed_fields(cls: type[BaseModel], path: KeyPath) -> list[str]:
    """Field names of the model found at `path` inside `cls` (for 'unknown field' messages)."""
    model: Any = cls
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = _inner_model(field.annotation)
        if model is None:
            return []
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
