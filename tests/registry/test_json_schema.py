"""`kvgate registry schema` emits valid JSON Schema that accepts our documents and rejects bad ones."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from kvgate.registry.cli import registry_json_schema

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = registry_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)  # raises if the schema itself is invalid
    return jsonschema.Draft202012Validator(schema)


def example_documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and "${" not in str(document):  # ${VAR} strings are filled in before validation
                found.append((f"{path.name}:{document['metadata']['name']}", document))
    return found


@pytest.mark.parametrize("label,document", example_documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_example_documents_match_the_schema(validator, label: str, document: dict) -> None:
    assert list(validator.iter_errors(document)) == []


def test_schema_rejects_unknown_fields_and_kinds(validator) -> None:
    bad_field = {"apiVersion": "kvgate/v1", "kind": "Model", "metadata": {"name": "m"},
                 "spec": {"source": "/m", "colour": "blue"}}
    bad_kind = {"apiVersion": "kvgate/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    assert list(validator.iter_errors(bad_field))
    assert list(validator.iter_errors(bad_kind))


def test_schema_covers_every_kind() -> None:
    schema = registry_json_schema()
    assert set(schema["discriminator"]["mapping"]) == {"Model", "Adapter", "Pool", "Tenant"}
