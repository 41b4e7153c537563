"""DESIGN.md's folder boundaries, checked on the source: who may import whom.

| folder | may import (of ours) |
| registry/ | nothing |
| engine/ | registry, kvgate.v1, kvgate.clock, kvgate.tokenizer, kvgate.kv_blocks, kvgate.openai_wire, kvgate.log_limit, kvgate.server_log, kvgate.exposition |
| router/ | registry, kvgate.v1, kvgate.state, kvgate.clock, kvgate.tokenizer, kvgate.kv_blocks, kvgate.openai_wire, kvgate.log_limit, kvgate.server_log, kvgate.exposition |
| autoscaler/ | registry, providers, kvgate.state, kvgate.clock, kvgate.log_limit, kvgate.exposition, kvgate.openai_wire |
| providers/ | registry |
| kvgate/ leaves (everything but cli.py and stack.py) | registry |
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Every part installs under the one import name `kvgate` (pyproject.toml's package-dir); a folder's
# subpackage is `kvgate.<folder>`.
SUBSYSTEMS = ("registry", "engine", "router", "autoscaler", "providers")
LEAVES = ("kvgate.clock", "kvgate.state", "kvgate.v1", "kvgate.tokenizer", "kvgate.kv_blocks", "kvgate.openai_wire",
          "kvgate.log_limit", "kvgate.server_log", "kvgate.exposition")
# The engine and the gateway must tokenize and hash prompts identically (KV block events), so both
# import the one tokenizer and block chain; both speak the one OpenAI wire shape (errors, JSON bodies); and both
# limit their log lines alike (one per problem per interval), and both write /metrics alike (no `_created` series).
SHARED_WITH_ENGINE = ("kvgate.tokenizer", "kvgate.kv_blocks", "kvgate.openai_wire", "kvgate.log_limit",
                      "kvgate.server_log", "kvgate.exposition")
ALLOWED = {
    "registry": {"kvgate.registry"},
    "engine": {"kvgate.engine", "kvgate.registry", "kvgate.v1", "kvgate.clock", *SHARED_WITH_ENGINE},
    "router": {"kvgate.router", "kvgate.registry", "kvgate.v1", "kvgate.state", "kvgate.clock", *SHARED_WITH_ENGINE},
    "autoscaler": {"kvgate.autoscaler", "kvgate.registry", "kvgate.providers", "kvgate.state", "kvgate.clock",
                   "kvgate.log_limit", "kvgate.exposition", "kvgate.openai_wire"},
    "providers": {"kvgate.providers", "kvgate.registry", "kvgate.clock"},
    "kvgate-leaf": {"kvgate.registry", *LEAVES},
}


def package_of(path: Path) -> list[str]:
    """The installed package a source file belongs to: router/proxy.py -> ["kvgate", "router"]."""
    parts = list(path.relative_to(REPO).parts[:-1])
    return parts if parts[:1] == ["kvgate"] else ["kvgate", *parts]


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), package_of(path), str(path))


def imports_in(source: str, package: list[str], filename: str = "<source>") -> set[str]:
    """Every module of ours that `source` (a file of `package`) imports, by its full name. Relative imports are
    resolved against the package (`from ..autoscaler import planner` in router/ is kvgate.autoscaler); a bare
    top-level subsystem name (the layout before one import name) counts as ours too, so it is refused rather
    than missed."""
    found = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            found.update([base] if node.module else [f"{base}.{alias.name}" for alias in node.names])
    return {name for name in found if name.split(".")[0] in ("kvgate", *SUBSYSTEMS)}


def test_relative_imports_are_judged_by_where_they_lead() -> None:
    package = package_of(REPO / "router" / "proxy.py")
    assert package == ["kvgate", "router"]
    source = "from ..autoscaler import planner\nfrom . import policies\nfrom .view import ReplicaView\n"
    assert imports_in(source, package) == {"kvgate.autoscaler", "kvgate.router.policies", "kvgate.router.view"}
    assert not allowed("kvgate.autoscaler", ALLOWED["router"])


def allowed(name: str, rules: set[str]) -> bool:
    return any(name == rule or name.startswith(rule + ".") for rule in rules)


def source_files() -> list[tuple[str, Path]]:
    files = []
    for folder in SUBSYSTEMS:
        files += [(folder, p) for p in sorted((REPO / folder).rglob("*.py"))]
    for path in sorted((REPO / "kvgate").rglob("*.py")):
        relative = path.relative_to(REPO / "kvgate")
        if relative.parts[0] not in ("cli.py", "stack.py", "protogen.py"):
            files.append(("kvgate-leaf", path))
    return files


@pytest.mark.parametrize("folder,path", source_files(), ids=lambda v: str(v.relative_to(REPO)) if isinstance(v, Path) else v)
def test_imports_respect_the_folder_boundaries(folder: str, path: Path) -> None:
    bad = sorted(name for name in imports_of(path) if not allowed(name, ALLOWED[folder]))
    assert bad == [], f"{path.relative_to(REPO)} ({folder}) may not import {bad}; see DESIGN.md 'Folders'"


def test_kvgate_package_init_imports_nothing() -> None:
    tree = ast.parse((REPO / "kvgate" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
