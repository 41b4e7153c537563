"""Loading: every problem in a directory is reported at once, each with file:line and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.registry import RegistryInvalid, load_registry
from tests.registry.samples import MODEL, POOL

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def problems_of(source: Path, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(RegistryInvalid) as caught:
        load_registry(source, environ or {})
    return [str(p) for p in caught.value.problems]


@pytest.mark.parametrize("example", ["registry", "fleet"])
def test_examples_validate(example: str) -> None:
    snapshot = load_registry(EXAMPLES / example, {})
    assert snapshot.models


def test_one_run_lists_every_mistake_with_file_and_line(write_registry) -> None:
    root = write_registry({
        "pools.yaml": POOL,
        "models.yaml": """
            apiVersion: kvgate/v1
            kind: Model
            metadata: {name: m1}
            spec:
              source: builtin:tiny-llama
              engine:
                block_size_tokens: sixteen
              scaling:
                min_replicas: 5
                max_replicas: 2
              colour: blue
            """,
        "adapters/a.yaml": """
            apiVersion: kvgate/v1
            kind: Adapter
            metadata: {name: a1}
            spec:
              base_model: missing-model
              source: /adapters/a1
              rank: 8
            """,
    })
    found = problems_of(root)
    models, adapters = f"{root}/models.yaml", f"{root}/adapters/a.yaml"
    assert found == [
        f"{adapters}:5: Adapter/a1: spec.base_model: no Model named 'missing-model'; models: (none)",
        f"{models}:7: Model/m1: spec.engine.block_size_tokens: Input should be a valid integer, unable to parse "
        "string as an integer; got 'sixteen'",
        f"{models}:9: Model/m1: spec.scaling.min_replicas: min_replicas (5) is greater than max_replicas (2)",
        f"{models}:11: Model/m1: spec.colour: unknown field 'colour'; allowed fields: source, description, "
        "resources, engine, routing, scaling, placement, slo, performance, limits",
    ]


def test_an_invalid_model_does_not_make_its_adapters_dangling(write_registry) -> None:
    root = write_registry({"all.yaml": POOL + "---" + MODEL + "  scaling: {max_replicas: 0}\n---" + """
apiVersion: kvgate/v1
kind: Adapter
metadata: {name: a1}
spec: {base_model: tiny, source: /a, rank: 8}
"""})
    found = problems_of(root)
    assert len(found) == 1 and "max_replicas" in found[0]


def test_several_documents_per_file_and_files_in_subdirectories(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL, "more/b.yml": MODEL.replace("tiny}", "tiny2}")})
    snapshot = load_registry(root, {})
    assert sorted(snapshot.models) == ["tiny", "tiny2"]


def test_hidden_files_and_directories_are_ignored(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL, ".git/x.yaml": "not: [valid", ".draft.yaml": ":"})
    assert load_registry(root, {}).models


def test_empty_documents_are_skipped(write_registry) -> None:
    root = write_registry({"a.yaml": "---\n" + POOL + "---\n---\n" + MODEL + "---\n"})
    assert len(load_registry(root, {}).models) == 1


def test_env_variables_fill_values(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL.replace("builtin:tiny-llama", "${WEIGHTS}")})
    snapshot = load_registry(root, {"WEIGHTS": "s3://bucket/llama"})
    assert snapshot.model("tiny").spec.source == "s3://bucket/llama"


def test_env_default_is_used_when_unset_and_dollar_dollar_is_literal(write_registry) -> None:
    model = MODEL.replace("builtin:tiny-llama", "${WEIGHTS:-/models/llama}") + "  description: costs $${PRICE}\n"
    snapshot = load_registry(write_registry({"a.yaml": POOL + "---\n" + model}), {})
    assert snapshot.model("tiny").spec.source == "/models/llama"
    assert snapshot.model("tiny").spec.description == "costs ${PRICE}"


def test_unset_env_variable_is_one_clear_error(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL.replace("builtin:tiny-llama", "${NOT_SET_ANYWHERE}")})
    assert problems_of(root) == [
        f"{root}/a.yaml:13: Model/tiny: spec.source: environment variable NOT_SET_ANYWHERE is not set "
        "(referenced as ${NOT_SET_ANYWHERE}; set it, or write ${NOT_SET_ANYWHERE:-default})"
    ]


def test_duplicate_keys_are_errors(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL + "  source: builtin:smollm2-135m\n"})
    assert problems_of(root) == [
        f"{root}/a.yaml:14: Model/tiny: spec.source: duplicate key 'source' (first set on line 13)"
    ]


def test_merge_keys_may_be_overridden(write_registry) -> None:
    pool = POOL.replace(
        "  offers: [{instance_type: slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}]",
        "  offers:\n    - &slot {instance_type: slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}\n"
        "    - <<: *slot\n      capacity_type: spot\n      price_usd_per_hour: 0.5\n",
    )
    snapshot = load_registry(write_registry({"a.yaml": pool}), {})
    offers = snapshot.pool("local").spec.offers
    assert [(o.capacity_type.value, o.price_usd_per_hour) for o in offers] == [("on_demand", 0.0), ("spot", 0.5)]


def test_yaml_syntax_error_names_line_and_column_and_where_the_open_bracket_is(write_registry) -> None:
    root = write_registry({"a.yaml": POOL, "b.yaml": "apiVersion: kvgate/v1\nkind: Model\nspec: [unclosed\n"})
    assert problems_of(root) == [f"{root}/b.yaml:4:1: is not valid YAML: expected ',' or ']', got the end of the "
                                 "file (in the flow sequence that opens at line 3, column 7)"]


@pytest.mark.parametrize("text, expected", [
    ("a: b\n  c: d\n", "2:4: is not valid YAML: mapping values are not allowed here (check the indentation, or "
                       "quote a value that holds ': ')"),
    ("a:\n\t- b\n", "2:1: is not valid YAML: found character '\\t' that cannot start any token (YAML indents with "
                   "spaces, never tabs)"),
    ("a:\n  - b\n c: d\n", "3:2: is not valid YAML: expected the end of the block, found a key at a different "
                          "indentation (in the block mapping that opens at line 1, column 1)"),
    ("a: &x 1\nb: &x 2\n", "2:4: is not valid YAML: found duplicate anchor 'x'; first occurrence at line 1, column 4; "
                         "second occurrence here"),
])
def test_yaml_syntax_errors_are_one_line_in_words(write_registry, text: str, expected: str) -> None:
    root = write_registry({"a.yaml": text})
    (found,) = problems_of(root)
    assert found == f"{root}/a.yaml:{expected}" and "\n" not in found


def test_unknown_kind_and_non_mapping_documents(write_registry) -> None:
    root = write_registry({"a.yaml": "apiVersion: kvgate/v1\nkind: Widget\nmetadata: {name: w}\n---\n- a\n- b\n"})
    assert problems_of(root) == [
        f"{root}/a.yaml:2: Widget/w: kind: unknown kind 'Widget'; allowed: Model, Adapter, Pool, Tenant",
        f"{root}/a.yaml:5: a document must be a mapping with apiVersion, kind, metadata and spec; got a list",
    ]


def test_wrong_api_version_lists_the_allowed_one(write_registry) -> None:
    root = write_registry({"a.yaml": POOL.replace("kvgate/v1", "kvgate/v2")})
    (found,) = problems_of(root)
    assert "apiVersion" in found and "'kvgate/v1'" in found and "got 'kvgate/v2'" in found


def test_missing_required_field_points_at_its_parent(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL.replace("  source: builtin:tiny-llama\n", "  description: x\n")})
    assert problems_of(root) == [f"{root}/a.yaml:12: Model/tiny: spec.source: is required but missing"]


def test_missing_and_empty_directories_are_reported(tmp_path: Path) -> None:
    assert problems_of(tmp_path / "nope") == [f"{tmp_path / 'nope'}: does not exist"]
    assert problems_of(tmp_path) == [f"{tmp_path}: holds no registry files (*.yaml or *.yml)"]


def test_a_single_file_is_a_registry_too(write_registry) -> None:
    root = write_registry({"all.yaml": POOL + "---\n" + MODEL})
    assert load_registry(root / "all.yaml", {}).model("tiny")


def test_a_request_cap_the_replicas_cannot_serve_points_at_its_line(write_registry) -> None:
    root = write_registry({"a.yaml": POOL + "---\n" + MODEL + "  limits:\n    max_tokens: 100000\n"})
    assert problems_of(root) == [
        f"{root}/a.yaml:15: Model/tiny: spec.limits.max_tokens: limits.max_tokens (100000) exceeds "
        "engine.max_model_len_tokens (2048), the longest prompt plus completion this model's replicas serve; "
        "lower it, or leave it unset to cap at 2048"]
