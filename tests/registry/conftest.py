from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

WriteRegistry = Callable[..., Path]


@pytest.fixture
def write_registry(tmp_path: Path) -> WriteRegistry:
    """Write {relative name: YAML text} into a fresh directory and return it."""
    counter = iter(range(1000))

    def write(files: dict[str, str], name: str | None = None) -> Path:
        root = tmp_path / (name or f"registry{next(counter)}")
        root.mkdir(parents=True, exist_ok=True)
        for relative, text in files.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip("\n"))
        return root

    return write
