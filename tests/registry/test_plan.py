"""`plan`: a readable diff of meaning between two registries."""

from __future__ import annotations

from kvgate.registry import load_registry
from kvgate.registry.plan import Action, plan, render, to_json
from kvgate.registry.snapshot import Snapshot
from tests.registry.samples import MODEL, POOL

TENANT = """
apiVersion: kvgate/v1
kind: Tenant
metadata: {name: acme}
spec: {api_key_hmac: "${ACME_KEY}", models: [tiny]}
"""


def test_no_changes_when_only_layout_differs(write_registry) -> None:
    old = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    new = load_registry(write_registry({"p.yaml": "# moved\n" + POOL, "m.yaml": MODEL}), {})
    result = plan(old, new)
    assert not result.has_changes
    assert "No changes" in render(result)


def test_added_changed_and_removed_documents(write_registry) -> None:
    old = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    second = MODEL.replace("name: tiny", "name: small").replace("tiny-llama", "smollm2-135m")
    changed = MODEL + "  scaling: {max_replicas: 4}\n"
    new = load_registry(write_registry({"a.yaml": changed + "---\n" + second + "---\n" + POOL}), {})
    result = plan(old, new)
    assert [(c.action, c.kind, c.name) for c in result.changes] == [
        (Action.ADD, "Model", "small"), (Action.CHANGE, "Model", "tiny")]
    text = render(result)
    assert "  + Model/small" in text
    assert '      + spec.source = "builtin:smollm2-135m"' in text
    assert "      ~ spec.scaling.max_replicas: 1 -> 4" in text
    assert text.endswith("Plan: 1 to add, 1 to change, 0 to remove.")


def test_first_plan_from_empty_adds_everything(write_registry) -> None:
    new = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    result = plan(Snapshot.empty(), new)
    assert [(c.action, c.name) for c in result.changes] == [(Action.ADD, "tiny"), (Action.ADD, "local")]


def test_removed_documents(write_registry) -> None:
    old = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    model = MODEL + "  routing:\n    static_replicas: [{url: 'http://h:1'}]\n"
    new = load_registry(write_registry({"a.yaml": model}), {})
    assert "  - Pool/local" in render(plan(old, new))


def test_values_from_the_environment_are_never_printed(write_registry) -> None:
    files = {"a.yaml": "---\n".join([POOL, MODEL, TENANT])}
    old = load_registry(write_registry(files), {"ACME_KEY": "1" * 64})
    new = load_registry(write_registry(files), {"ACME_KEY": "2" * 64})
    result = plan(old, new)
    text = render(result) + str(to_json(result))
    assert "spec.api_key_hmac: (sensitive) changed" in text
    assert "1" * 64 not in text and "2" * 64 not in text
    first = render(plan(Snapshot.empty(), new))
    assert "+ spec.api_key_hmac = (sensitive)" in first and "2" * 64 not in first


def test_json_plan_summary(write_registry) -> None:
    new = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    data = to_json(plan(Snapshot.empty(), new))
    assert data["summary"] == {"add": 2, "change": 0, "remove": 0}
    assert data["changes"][0]["fields"][0]["path"] == "metadata.name"


def test_color_only_when_asked(write_registry) -> None:
    new = load_registry(write_registry({"a.yaml": POOL + "---\n" + MODEL}), {})
    assert "\033[32m" in render(plan(Snapshot.empty(), new), color=True)
    assert "\033[" not in render(plan(Snapshot.empty(), new))
